"""Unit tests of backpack's custom modules: forward, repr, argument checks, KFRA through them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jacrev, vmap

from backpack import backpack, extend
from backpack.custom_module.branching import (
    ActiveIdentity,
    CatModule,
    MultiplyModule,
    Parallel,
    SumModule,
)
from backpack.custom_module.pad import Pad
from backpack.custom_module.permute import Permute
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing
from backpack.extensions import KFRA, DiagGGNExact

DT = torch.float64


def randn(*shape):
    return torch.randn(*shape, dtype=DT)


# --- forward passes vs their functional equivalents ------------------------------------------
def test_sum_multiply_cat_merges():
    a, b, c = randn(3, 4), randn(3, 4), randn(3, 1)
    torch.testing.assert_close(SumModule()(a, b, c), a + b + c, rtol=0, atol=0)
    torch.testing.assert_close(SumModule()(a), a, rtol=0, atol=0)
    torch.testing.assert_close(MultiplyModule()(a, b, c), a * b * c, rtol=0, atol=0)
    torch.testing.assert_close(CatModule(1)(a, b), torch.cat([a, b], 1), rtol=0, atol=0)
    torch.testing.assert_close(CatModule(-1)(a, c), torch.cat([a, c], -1), rtol=0, atol=0)
    assert CatModule().dim == 1


def test_parallel_default_merge_is_sum():
    torch.manual_seed(0)
    branch = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(DT)
    block = Parallel(nn.Identity(), branch)
    assert isinstance(block.merge, SumModule)
    x = randn(3, 4)
    torch.testing.assert_close(block(x), x + torch.tanh(branch[0](x)), rtol=0, atol=0)
    # parameter names follow `branch.<k>` like the original's ResNet example
    assert [k for k, _ in block.named_parameters()] == ["branch.1.0.weight", "branch.1.0.bias"]


def test_parallel_nested_and_custom_merge():
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(4, 3).to(DT), nn.Linear(4, 2).to(DT)
    inner = Parallel(nn.Identity(), nn.Sigmoid())
    block = Parallel(lin1, nn.Sequential(lin2, inner), merge_module=CatModule(dim=1))
    x = randn(5, 4)
    h = lin2(x)
    expected = torch.cat([lin1(x), h + torch.sigmoid(h)], dim=1)
    torch.testing.assert_close(block(x), expected, rtol=0, atol=0)
    gate = Parallel(nn.Identity(), nn.Sigmoid(), merge_module=MultiplyModule())
    torch.testing.assert_close(gate(x), x * torch.sigmoid(x), rtol=0, atol=0)


def test_active_identity_creates_new_tensor():
    x = randn(3, 4).requires_grad_()
    y = ActiveIdentity()(x)
    assert y is not x and y.grad_fn is not None
    torch.testing.assert_close(y, x, rtol=0, atol=0)
    (y * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert nn.Identity()(x) is x  # the contrast: nn.Identity returns its input itself


def test_scale_module():
    x = randn(3, 4)
    torch.testing.assert_close(ScaleModule(0.5)(x), 0.5 * x, rtol=0, atol=0)
    torch.testing.assert_close(ScaleModule()(x), x, rtol=0, atol=0)
    assert ScaleModule(2).weight == 2.0 and isinstance(ScaleModule(2).weight, float)


def test_permute():
    x = randn(2, 3, 4, 5)
    torch.testing.assert_close(Permute(0, 2, 3, 1)(x), x.permute(0, 2, 3, 1), rtol=0, atol=0)
    torch.testing.assert_close(Permute(0, -1, 1, 2)(x), x.permute(0, 3, 1, 2), rtol=0, atol=0)
    trans = Permute(1, 3, init_transpose=True)(x)
    torch.testing.assert_close(trans, x.transpose(1, 3), rtol=0, atol=0)


def test_slicing():
    x = randn(3, 6, 5)
    info = (slice(None), slice(1, 4), slice(None, None, 2))
    torch.testing.assert_close(Slicing(info)(x), x[:, 1:4, ::2], rtol=0, atol=0)
    torch.testing.assert_close(Slicing((slice(None), 2))(x), x[:, 2], rtol=0, atol=0)
    torch.testing.assert_close(Slicing(slice(None))(x), x, rtol=0, atol=0)
    torch.testing.assert_close(Slicing([slice(None), ..., 0])(x), x[..., 0], rtol=0, atol=0)


@pytest.mark.parametrize(
    "pad,mode,value",
    [
        ((1, 2), "constant", 0.3),
        ((2, 0, 1, 1), "constant", 0.0),
        ((-1, 2), "constant", 1.5),
        ((2, 1), "reflect", 0.0),
        ((1, 2), "replicate", 0.0),
        ((2, 2), "circular", 0.0),
    ],
)
def test_pad(pad, mode, value):
    x = randn(2, 3, 5)
    expected = F.pad(x, pad, mode=mode, value=value) if mode == "constant" else F.pad(x, pad, mode)
    torch.testing.assert_close(Pad(pad, mode, value)(x), expected, rtol=0, atol=0)


def test_pad_default_is_zero_constant():
    x = randn(2, 3, 4, 4)
    torch.testing.assert_close(Pad((1, 1, 2, 0))(x), F.pad(x, (1, 1, 2, 0)), rtol=0, atol=0)


def test_reduce_tuple_after_lstm():
    torch.manual_seed(0)
    lstm = nn.LSTM(3, 4, batch_first=True).to(DT)
    x = randn(2, 5, 3)
    out, (h, c) = lstm(x)
    torch.testing.assert_close(ReduceTuple()(lstm(x)), out, rtol=0, atol=0)
    torch.testing.assert_close(ReduceTuple(index=1)(lstm(x))[0], h, rtol=0, atol=0)
    model = nn.Sequential(lstm, ReduceTuple(0), nn.Flatten())
    torch.testing.assert_close(model(x), out.flatten(1), rtol=0, atol=0)


# --- repr --------------------------------------------------------------------------------------
def test_reprs():
    assert repr(ScaleModule(0.5)) == "ScaleModule(weight=0.5)"
    assert repr(Permute(0, 2, 1)) == "Permute(dims=(0, 2, 1), init_transpose=False)"
    assert repr(Permute(1, 2, init_transpose=True)) == "Permute(dims=(1, 2), init_transpose=True)"
    assert repr(Pad((1, 2), value=0.3)) == "Pad(pad=(1, 2), mode='constant', value=0.3)"
    assert repr(Pad((1, 2), mode="reflect")) == "Pad(pad=(1, 2), mode='reflect', value=0.0)"
    assert repr(ReduceTuple()) == "ReduceTuple(index=0)"
    assert repr(CatModule(2)) == "CatModule(dim=2)"
    assert repr(SumModule()) == "SumModule()"
    assert repr(MultiplyModule()) == "MultiplyModule()"
    assert repr(ActiveIdentity()) == "ActiveIdentity()"
    text = repr(Slicing((slice(None), slice(1, 4))))
    assert text == "Slicing(slice_info=(slice(None, None, None), slice(1, 4, None)))"
    par = repr(Parallel(nn.Identity(), nn.Tanh()))
    assert "(branch): ModuleList" in par and "(merge): SumModule()" in par
    assert "(1): Tanh()" in par


# --- invalid arguments -------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [(1, 0, 2), (2, 1, 0), (-3, 1, 2)])
def test_permute_must_keep_batch_axis(dims):
    with pytest.raises(ValueError, match="batch axis"):
        Permute(*dims)


def test_permute_other_errors():
    with pytest.raises(ValueError, match="batch axis"):
        Permute()
    with pytest.raises(ValueError, match="permutation"):
        Permute(0, 1, 1)
    with pytest.raises(ValueError, match="permutation"):
        Permute(0, 3, 1)
    with pytest.raises(ValueError, match="int"):
        Permute(0, 1.0, 2)
    with pytest.raises(ValueError, match="two axes to swap, neither the batch axis"):
        Permute(0, 2, init_transpose=True)
    with pytest.raises(ValueError, match="two axes to swap"):
        Permute(1, 2, 3, init_transpose=True)


@pytest.mark.parametrize(
    "info", [(slice(1, None),), (slice(None, 2), slice(None)), (0, slice(None)), (..., 0), ()]
)
def test_slicing_must_keep_batch_axis(info):
    with pytest.raises(ValueError, match="batch axis"):
        Slicing(info)


@pytest.mark.parametrize("weight", [torch.tensor(2.0), torch.ones(3), "2", None])
def test_scale_module_rejects_non_numbers(weight):
    with pytest.raises(ValueError, match="ScaleModule's weight must be a float"):
        ScaleModule(weight)


def test_pad_errors():
    with pytest.raises(ValueError, match="mode"):
        Pad((1, 1), mode="mirror")
    with pytest.raises(ValueError, match="even number"):
        Pad((1, 2, 3))
    with pytest.raises(ValueError, match="only applies to mode 'constant'"):
        Pad((1, 1), mode="reflect", value=2.0)


def test_merge_and_container_errors():
    with pytest.raises(ValueError, match="at least one input"):
        SumModule()()
    with pytest.raises(ValueError, match="at least one input"):
        MultiplyModule()()
    with pytest.raises(ValueError, match="at least one input"):
        CatModule()()
    with pytest.raises(ValueError, match="dim must be an int"):
        CatModule(dim=1.0)
    with pytest.raises(ValueError, match="at least one branch"):
        Parallel()
    with pytest.raises(TypeError, match="merge_module must be a module"):
        Parallel(nn.Identity(), merge_module="sum")
    with pytest.raises(TypeError, match="branches must be modules"):
        Parallel(nn.Identity(), torch.add)


# --- KFRA through a chain with ScaleModule, Permute, Pad -------------------------------------
def _chain():
    return nn.Sequential(
        nn.Linear(4, 6),
        ScaleModule(0.5),
        nn.Tanh(),
        nn.Unflatten(1, (2, 3)),  # [N, 2, 3]
        Permute(0, 2, 1),  # [N, 3, 2]
        Pad((1, 0), value=0.2),  # [N, 3, 3]
        nn.Sigmoid(),
        Permute(1, 2, init_transpose=True),
        nn.Flatten(),  # [N, 9]
        nn.Linear(9, 5),
        ScaleModule(-2.0),
        nn.Softplus(),
        nn.Linear(5, 3),
    ).to(DT)


def _kfra_reference(model, x, lossfunc, y):
    """Ḡ ← (1/N) Σ_n J_nᵀ Ḡ J_n module by module, from the batch-summed loss Hessian."""
    inputs, h = [], x
    for module in model:
        inputs.append(h)
        h = module(h)
    n = x.shape[0]
    hess = jacrev(jacrev(lambda o: lossfunc(o, y)))(h.detach())  # [N, C, N, C]
    gbar = sum(hess[i, :, i, :] for i in range(n))
    factors = {}
    for module, inp in reversed(list(zip(model, inputs))):
        inp = inp.detach()
        if isinstance(module, nn.Linear):
            factors[module] = (gbar, inp.T @ inp / n)
        jac = vmap(jacrev(lambda xi, m=module: m(xi.unsqueeze(0)).squeeze(0)))(inp)
        jac = jac.reshape(n, gbar.shape[0], -1)
        gbar = torch.einsum("noi,op,npj->ij", jac, gbar, jac) / n
    return factors


@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum")])
def test_kfra_through_scale_permute_pad(loss):
    torch.manual_seed(0)
    model = _chain()
    x = randn(6, 4)
    y = torch.randint(0, 3, (6,)) if isinstance(loss, nn.CrossEntropyLoss) else randn(6, 3)
    expected = _kfra_reference(model, x, loss, y)
    extend(model)
    lossfunc = extend(loss)
    with backpack(KFRA()):
        lossfunc(model(x), y).backward()
    for module, (g, a) in expected.items():
        torch.testing.assert_close(module.weight.kfra[0], g, rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(module.weight.kfra[1], a, rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(module.bias.kfra[0], g, rtol=1e-7, atol=1e-10)


def test_kfra_rejects_parallel_branches():
    torch.manual_seed(0)
    model = extend(
        nn.Sequential(
            nn.Linear(4, 4), Parallel(nn.Identity(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
        ).to(DT)
    )
    lossfunc = extend(nn.MSELoss())
    x = randn(3, 4)
    with pytest.raises(NotImplementedError, match="KFRA"):
        with backpack(KFRA()):
            lossfunc(model(x), randn(3, 4)).backward()
    # the GGN family handles the same branching model
    with backpack(DiagGGNExact()):
        lossfunc(model(x), randn(3, 4)).backward()
    assert model[0].weight.diag_ggn_exact.shape == (4, 4)
