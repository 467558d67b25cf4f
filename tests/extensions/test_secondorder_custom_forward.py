"""Beyond the original: the GGN family on custom forwards, without any conversion.

Second-order factors are propagated by autograd, so residual additions written in `forward`,
functional nonlinearities, torchvision's in-place ReLUs (one module applied twice per block) and
tied weights need no `use_converter=True`. Everything is checked in float64 against brute-force
GGN blocks (`tests/second_order_reference.Curvature`) or `autograd_diag_ggn_exact`.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from second_order_reference import Curvature
from torch import nn

from backpack import backpack, extend
from backpack.extensions import (
    GGNMP,
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
)
from backpack.utils.examples import autograd_diag_ggn_exact

DT = torch.float64


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9, msg=msg)


def run(model, x, lossfunc, y, *exts):
    extend(model)
    loss = extend(lossfunc)(model(x), y)
    with backpack(*exts):
        loss.backward()
    return model


def check_ggn_family(model, x, lossfunc, y, reference):
    """Diagonal, per-sample diagonal, square root and matrix products vs the GGN blocks."""
    run(model, x, lossfunc, y, DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), GGNMP())
    n = x.shape[0]
    for name, p in model.named_parameters():
        block = reference.block(reference.ggn, name)
        close(p.diag_ggn_exact, reference.diag(reference.ggn, name), name)
        assert p.diag_ggn_exact_batch.shape == (n, *p.shape)
        close(p.diag_ggn_exact_batch, reference.diag(reference.ggn_per_sample, name), name)
        sqrt = p.sqrt_ggn_exact
        assert sqrt.shape[1:] == (n, *p.shape)
        flat = sqrt.flatten(2)
        close(torch.einsum("vnp,vnq->pq", flat, flat), block, name)
        mat = torch.randn(2, *p.shape, dtype=DT)
        close(p.ggnmp(mat), (block @ mat.flatten(1).T).T.reshape(mat.shape), name)


# --- (a) seed 004's MyFirstResNet: torch.add residual and functional relu in forward ----------


class MyFirstResNet(nn.Module):
    """The custom ResNet of the original's residual-network example (seed 004)."""

    def __init__(self, C_in=1, C_hid=5, input_dim=(28, 28), output_dim=10):  # noqa: N803
        super().__init__()
        self.conv1 = nn.Conv2d(C_in, C_hid, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv2d(C_hid, C_hid, kernel_size=3, stride=1, padding=1)
        self.linear1 = nn.Linear(input_dim[0] * input_dim[1] * C_hid, output_dim)
        if C_in == C_hid:
            self.shortcut = nn.Identity()
        else:
            self.shortcut = nn.Conv2d(C_in, C_hid, kernel_size=1, stride=1)

    def forward(self, x):
        residual = self.shortcut(x)
        x = self.conv2(F.relu(self.conv1(x)))
        x = x + residual
        x = x.flatten(start_dim=1)
        return self.linear1(x)


def resnet_problem():
    torch.manual_seed(0)
    model = MyFirstResNet(C_in=1, C_hid=3, input_dim=(6, 6), output_dim=4).to(DT)
    x = torch.randn(3, 1, 6, 6, dtype=DT)
    y = torch.randint(0, 4, (3,))
    return model, x, nn.CrossEntropyLoss(), y


@functools.cache
def resnet_reference():
    model, x, lossfunc, y = resnet_problem()
    return Curvature(model, x, lossfunc, y, hessian=False)


def test_my_first_resnet_ggn_family():
    model, x, lossfunc, y = resnet_problem()
    check_ggn_family(model, x, lossfunc, y, resnet_reference())


def test_my_first_resnet_mc_shapes():
    model, x, lossfunc, y = resnet_problem()
    exts = DiagGGNMC(mc_samples=2), BatchDiagGGNMC(mc_samples=2), SqrtGGNMC(mc_samples=2)
    run(model, x, lossfunc, y, *exts)
    for p in model.parameters():
        assert p.diag_ggn_mc.shape == p.shape and (p.diag_ggn_mc >= 0).all()
        assert p.diag_ggn_mc_batch.shape == (3, *p.shape)
        assert p.sqrt_ggn_mc.shape == (2, 3, *p.shape)
        # one sampled factor serves all three (same mc_samples)
        close(p.diag_ggn_mc_batch.sum(0), p.diag_ggn_mc)
        close(p.sqrt_ggn_mc.square().sum(0), p.diag_ggn_mc_batch)


def test_my_first_resnet_kflr_kfac():
    model, x, lossfunc, y = resnet_problem()
    reference = resnet_reference()
    run(model, x, lossfunc, y, KFLR(), KFAC(mc_samples=2))
    for name, p in model.named_parameters():
        for factors in (p.kflr, p.kfac):
            if name.endswith("bias"):
                assert [f.shape for f in factors] == [(p.shape[0], p.shape[0])]
            else:
                fan_in = p[0].numel()
                assert [f.shape for f in factors] == [(p.shape[0],) * 2, (fan_in, fan_in)]
    close(model.linear1.bias.kflr[0], reference.block(reference.ggn, "linear1.bias"))


class ResidualMLP(nn.Module):
    """Linear layers only, with a residual addition and functional nonlinearities."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.hidden = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + F.softplus(self.hidden(h))
        return self.out(h)


@pytest.mark.parametrize("lossfunc", [nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum")])
def test_residual_mlp_kflr_bias_factors_are_ggn_blocks(lossfunc):
    torch.manual_seed(1)
    model = ResidualMLP().to(DT)
    x = torch.randn(6, 4, dtype=DT)
    y = torch.randint(0, 3, (6,)) if isinstance(lossfunc, nn.CrossEntropyLoss) else None
    if y is None:
        y = torch.randn(6, 3, dtype=DT)
    reference = Curvature(copy.deepcopy(model), x, lossfunc, y, hessian=False)
    run(model, x, lossfunc, y, KFLR(), KFAC(mc_samples=2))
    for name, p in model.named_parameters():
        assert len(p.kflr) == len(p.kfac) == (1 if name.endswith("bias") else 2)
        for a, b in zip(p.kflr, p.kfac):
            assert a.shape == b.shape
        if name.endswith("bias"):
            # bias gradient = output gradient, so G is exactly the bias' GGN block
            close(p.kflr[0], reference.block(reference.ggn, name), name)
    with torch.no_grad():
        h = torch.tanh(model.inp(x))
        inputs = {"inp": x, "hidden": h, "out": h + F.softplus(model.hidden(h))}
    for name, module in model.named_children():
        close(module.weight.kflr[1], inputs[name].T @ inputs[name] / x.shape[0], name)
        close(module.weight.kfac[1], module.weight.kflr[1], name)
    fresh = ResidualMLP().to(DT)
    fresh.load_state_dict(model.state_dict())
    check_ggn_family(fresh, x, lossfunc, y, reference)


# --- (b) torchvision ResNets: in-place ReLUs applied twice per block, BN in eval mode -----------


def tiny_torchvision_resnet():
    from torchvision.models.resnet import BasicBlock

    downsample = nn.Sequential(nn.Conv2d(4, 6, 1, stride=2, bias=False), nn.BatchNorm2d(6))
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        BasicBlock(4, 4),
        BasicBlock(4, 6, stride=2, downsample=downsample),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 3),
    ).to(DT)
    # non-trivial running statistics and affine parameters
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model.eval()


@pytest.mark.parametrize("lossfunc", [nn.MSELoss(), nn.CrossEntropyLoss(reduction="sum")])
def test_torchvision_basic_blocks_ggn_family(lossfunc):
    pytest.importorskip("torchvision")
    torch.manual_seed(2)
    model = tiny_torchvision_resnet()
    x = torch.randn(2, 3, 6, 6, dtype=DT)
    with torch.no_grad():
        out = model(x)
    if isinstance(lossfunc, nn.CrossEntropyLoss):
        y = torch.randint(0, 3, (2,))
    else:
        y = torch.randn_like(out)
    reference = Curvature(copy.deepcopy(model), x, lossfunc, y, hessian=False)
    check_ggn_family(model, x, lossfunc, y, reference)


@pytest.mark.slow
def test_torchvision_resnet18_diag_ggn_exact():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).to(DT).eval()
    x = torch.randn(2, 3, 16, 16, dtype=DT)
    lossfunc = nn.MSELoss()
    with torch.no_grad():
        y = torch.rand_like(model(x))
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    # evenly spaced entries plus the first entry of a few parameter tensors
    starts = torch.tensor([0, *[p.numel() for p in params]]).cumsum(0)[:-1]
    idx = torch.cat([torch.linspace(0, num_params - 1, 6).long(), starts[[0, 1, 4, 30, -2, -1]]])
    expected = autograd_diag_ggn_exact(x, y, model, lossfunc, idx=idx)
    assert (expected != 0).sum() >= 5
    run(model, x, lossfunc, y, DiagGGNExact())
    diag = torch.cat([p.diag_ggn_exact.flatten() for p in params])
    close(diag[idx], expected)


# --- (c) tied weights: the GGN block of a shared parameter includes cross terms ----------------


class TiedEmbedding(nn.Module):
    """Embedding whose matrix is also the output layer's weight (two modules, one parameter)."""

    def __init__(self, vocab=6, dim=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        h = torch.tanh(self.mid(self.emb(idx).sum(1)))
        return self.out(h)


class LinearTwice(nn.Module):
    """One Linear layer applied twice in a row."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class LinearTwiceUntied(nn.Module):
    """LinearTwice with a separate (initially equal) layer for each use."""

    def __init__(self, tied: LinearTwice):
        super().__init__()
        self.first = copy.deepcopy(tied.shared)
        self.second = copy.deepcopy(tied.shared)
        self.head = copy.deepcopy(tied.head)

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


def untie_embedding(tied: TiedEmbedding) -> TiedEmbedding:
    untied = copy.deepcopy(tied)
    untied.out.weight = nn.Parameter(tied.emb.weight.detach().clone())
    return untied


def tied_problems():
    torch.manual_seed(3)
    tied = TiedEmbedding().to(DT)
    yield (
        "tied-embedding", tied, untie_embedding(tied), torch.randint(0, 6, (5, 3)), 6,
        "emb.weight", ("emb.weight", "out.weight"),
    )  # fmt: skip
    tied = LinearTwice().to(DT)
    yield (
        "linear-twice", tied, LinearTwiceUntied(tied), torch.randn(5, 3, dtype=DT), 2,
        "shared.weight", ("first.weight", "second.weight"),
    )  # fmt: skip


def full_block(reference, name_a, name_b):
    start_a, stop_a, _ = reference._offsets[name_a]
    start_b, stop_b, _ = reference._offsets[name_b]
    return reference.ggn[start_a:stop_a, start_b:stop_b]


@pytest.mark.parametrize("problem", list(tied_problems()), ids=lambda p: p[0])
def test_tied_weights_full_ggn_blocks(problem):
    _, model, untied, x, classes, shared, uses = problem
    y = torch.randint(0, classes, (x.shape[0],))
    lossfunc = nn.CrossEntropyLoss()
    reference = Curvature(copy.deepcopy(model), x, lossfunc, y, hessian=False)
    check_ggn_family(model, x, lossfunc, y, reference)
    # the tied block is the sum of all four blocks of the untied uses, and the cross blocks
    # between the two uses do not vanish
    split = Curvature(untied, x, lossfunc, y, hessian=False, per_sample=False)
    a, b = uses
    cross = full_block(split, a, b)
    assert cross.abs().max() > 1e-3
    summed = full_block(split, a, a) + full_block(split, b, b) + cross + cross.T
    close(reference.block(reference.ggn, shared), summed)


def test_tied_weight_used_functionally_warns():
    """A parameter also used by a functional op: quantities cover module uses, with a warning."""

    class FunctionalTie(TiedEmbedding):
        def forward(self, idx):
            h = torch.tanh(self.mid(self.emb(idx).sum(1)))
            return F.linear(h, self.emb.weight)

    torch.manual_seed(3)
    model = FunctionalTie().to(DT)
    del model.out
    x, y = torch.randint(0, 6, (5, 3)), torch.randint(0, 6, (5,))
    lossfunc = nn.CrossEntropyLoss()
    with pytest.warns(UserWarning, match="outside extended modules"):
        run(model, x, lossfunc, y, DiagGGNExact(), BatchGrad())
    # the module parameters used only inside modules are exact and raise no warning
    reference = Curvature(copy.deepcopy(model), x, lossfunc, y, hessian=False)
    close(model.mid.weight.diag_ggn_exact, reference.diag(reference.ggn, "mid.weight"))
