"""Second-order extensions fail loudly and cleanly on what they cannot compute.

Every error must name the problem, leave no active engine behind, and a following correct backward
(on the same model where it can be fixed) must give the right numbers.
"""

import copy

import pytest
import torch
from second_order_reference import Curvature
from torch import nn

import backpack.passes.curvature as engine_module
from backpack import backpack, extend
from backpack import secondorder as secondorder_module
from backpack.context import CTX
from backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)

DT = torch.float64


@pytest.fixture(autouse=True)
def _no_engine_left():
    assert CTX.engines == []
    yield
    assert CTX.engines == []


def data(n=5, d_in=4, classes=3):
    x = torch.randn(n, d_in, dtype=DT)
    y = torch.randint(0, classes, (n,))
    return x, y


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9, msg=msg)


def recovers(model, x, y, ext=None, hessian=False):
    """A correct backward on `model` (built un-extended, then extended) matches brute force."""
    ext = ext or (DiagHessian() if hessian else DiagGGNExact())
    lossfunc = nn.CrossEntropyLoss()
    reference = Curvature(copy.deepcopy(model), x, lossfunc, y, hessian=hessian, per_sample=False)
    extend(model)
    loss = extend(lossfunc)(model(x), y)
    with backpack(ext):
        loss.backward()
    assert CTX.engines == []
    for name, p in model.named_parameters():
        expected = reference.diag(reference.hessian if hessian else reference.ggn, name)
        close(getattr(p, ext.savefield), expected, name)


def mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


# --- the loss --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ext",
    [
        DiagGGNExact(), SqrtGGNExact(), SqrtGGNMC(), KFAC(), KFLR(), KFRA(), DiagHessian(), HMP(),
        GGNMP(),
    ],
    ids=repr,
)
def test_loss_not_extended_is_recognised_from_the_graph(ext):
    """A plain nn.CrossEntropyLoss (or F.cross_entropy) gives the extended loss's numbers."""
    x, y = data()
    results = []
    for extended in (True, False):
        torch.manual_seed(0)
        model = extend(mlp())
        lossfunc = extend(nn.CrossEntropyLoss()) if extended else nn.CrossEntropyLoss()
        loss = lossfunc(model(x), y)
        torch.manual_seed(1)
        with backpack(ext):
            loss.backward()
        values = []
        for p in model.parameters():
            value = getattr(p, ext.savefield)
            if callable(value):
                value = value(torch.ones(2, *p.shape, dtype=DT))
            values.extend(value if isinstance(value, list) else [value])
        results.append(values)
    assert CTX.engines == []
    for a, b in zip(*results):
        close(a, b)


@pytest.mark.parametrize(
    "make_loss",
    [
        lambda out, y: nn.CrossEntropyLoss(label_smoothing=0.1)(out, y),
        lambda out, y: (out - out.detach().mean()).abs().sum(),
    ],
    ids=["label-smoothing", "custom"],
)
def test_unknown_loss_says_how_to_switch(make_loss):
    x, y = data()
    model = extend(mlp())
    with pytest.raises(RuntimeError, match="extend.*F.cross_entropy"):
        with backpack(DiagGGNExact()):
            make_loss(model(x), y).backward()
    assert CTX.engines == []
    recovers(mlp(), x, y)


def test_loss_computed_functionally():
    x, y = data()
    model = mlp()
    reference = Curvature(copy.deepcopy(model), x, nn.CrossEntropyLoss(), y, hessian=False)
    extend(model)
    with backpack(DiagGGNExact()):
        nn.functional.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        close(p.diag_ggn_exact, reference.diag(reference.ggn, name), name)


@pytest.mark.parametrize(
    "make_loss,target",
    [
        (nn.NLLLoss, lambda out: torch.randint(0, out.shape[1], (out.shape[0],))),
        (nn.L1Loss, torch.randn_like),
        (nn.SmoothL1Loss, torch.randn_like),
    ],
    ids=["NLLLoss", "L1Loss", "SmoothL1Loss"],
)
def test_extended_but_unsupported_loss(make_loss, target):
    x, y = data()
    model = extend(mlp())
    out = model(x)
    loss = extend(make_loss())(out, target(out.detach()))
    name = make_loss.__name__
    with pytest.raises(NotImplementedError, match=name):
        with backpack(DiagGGNExact()):
            loss.backward()
    recovers(mlp(), x, y)


@pytest.mark.parametrize("make_loss", [nn.MSELoss, nn.CrossEntropyLoss, nn.BCEWithLogitsLoss])
def test_loss_without_reduction(make_loss):
    x, y = data()
    model = extend(mlp())
    out = model(x)
    if make_loss is nn.CrossEntropyLoss:
        target = y
    elif make_loss is nn.BCEWithLogitsLoss:
        target = torch.randint(0, 2, out.shape).to(DT)
    else:
        target = torch.randn_like(out)
    loss = extend(make_loss(reduction="none"))(out, target).sum()
    with pytest.raises(NotImplementedError, match="reduction"):
        with backpack(DiagGGNExact()):
            loss.backward()
    recovers(mlp(), x, y)


# --- constructors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: DiagGGNMC(mc_samples=0),
        lambda: DiagGGNMC(mc_samples=-1),
        lambda: DiagGGNMC(mc_samples=1.5),
        lambda: DiagGGNMC(mc_samples=True),
        lambda: KFAC(mc_samples=0),
        lambda: SqrtGGNMC(mc_samples=0),
    ],
    ids=["diag0", "diag-1", "diag1.5", "diagTrue", "kfac0", "sqrt0"],
)
def test_invalid_mc_samples(make):
    with pytest.raises(ValueError, match="mc_samples"):
        make()


def test_invalid_pchmp_modify():
    with pytest.raises(ValueError, match="modify"):
        PCHMP(modify="foo")
    PCHMP(modify="abs")  # the valid choices construct


# --- batch normalisation -------------------------------------------------------------------------


def bn_model():
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def test_batchnorm_train_mode():
    x, y = data()
    torch.manual_seed(2)
    model = extend(bn_model())
    lossfunc = extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(x), y)
    with pytest.raises(NotImplementedError, match="eval"):
        with backpack(DiagGGNExact()):
            loss.backward()
    # the same model in eval mode works
    torch.manual_seed(2)
    fresh = bn_model()
    fresh.load_state_dict(model.state_dict())
    recovers(fresh.eval(), x, y)


@pytest.mark.parametrize("ext", [KFAC(), KFLR()], ids=repr)
def test_kronecker_factors_on_batchnorm_in_eval_mode_are_its_dense_block(ext):
    """No Kronecker rule: the parameter's whole curvature block `[B]` (exact for KFLR)."""
    x, y = data()
    model = bn_model().eval()
    reference = Curvature(copy.deepcopy(model), x, nn.CrossEntropyLoss(), y, hessian=False)
    extend(model)
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with backpack(ext):
        loss.backward()
    for name, p in model.named_parameters():
        factors = getattr(p, ext.savefield)
        if name.startswith("1."):  # the BatchNorm layer
            assert len(factors) == 1 and factors[0].shape == (p.numel(), p.numel())
            if isinstance(ext, KFLR):
                close(factors[0], reference.block(reference.ggn, name), name)
    recovers(bn_model().eval(), x, y)


def test_dense_blocks_above_the_limit_are_refused_by_name(monkeypatch):
    x, y = data()
    model = extend(bn_model().eval())
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    monkeypatch.setattr(engine_module, "DENSE_BLOCK_MAX_NUMEL", 4)
    with pytest.raises(NotImplementedError, match=r"weight of '1' \(BatchNorm1d\).*\[5, 5\]"):
        with backpack(KFLR()):
            loss.backward()
    recovers(bn_model().eval(), x, y)


# --- residual curvature needs modules -----------------------------------------------------------


class FunctionalTanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 5)
        self.l2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


@pytest.mark.parametrize(
    "ext", [DiagHessian(), BatchDiagHessian(), HMP(), PCHMP(), PCHMP(modify="abs")], ids=repr
)
def test_hessian_with_functional_nonlinearity(ext):
    x, y = data()
    model = extend(FunctionalTanh().to(DT))
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with pytest.raises(NotImplementedError, match="Tanh") as info:
        with backpack(ext):
            loss.backward()
    message = str(info.value)
    assert "nn.Tanh" in message and "use_converter" in message
    # the GGN does not need the residual terms: the same model works
    torch.manual_seed(3)
    recovers(FunctionalTanh().to(DT), x, y)


def test_hessian_with_tanh_module_is_fine():
    x, y = data()
    recovers(mlp(), x, y, hessian=True)


def test_inplace_relu_before_sigmoid_hessian_is_correct():
    x, y = data()
    model = nn.Sequential(
        nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 5), nn.Sigmoid(), nn.Linear(5, 3)
    ).to(DT)
    recovers(model, x, y, hessian=True)


def elu_inplace():
    return nn.Sequential(nn.Linear(4, 5), nn.ELU(inplace=True), nn.Linear(5, 3)).to(DT)


@pytest.mark.parametrize("ext", [DiagHessian(), BatchDiagHessian(), HMP(), PCHMP()], ids=repr)
def test_inplace_elu_hessian_raises(ext):
    """The residual term needs ELU's input, which the in-place op overwrote: a clear error."""
    x, y = data()
    model = extend(elu_inplace())
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with pytest.raises(NotImplementedError, match="inplace=False"):
        with backpack(ext):
            loss.backward()
    recovers(nn.Sequential(nn.Linear(4, 5), nn.ELU(), nn.Linear(5, 3)).to(DT), x, y, hessian=True)


def test_inplace_elu_ggn_is_correct():
    x, y = data()
    recovers(elu_inplace(), x, y)


def test_inplace_relu_after_elu_hessian_is_correct():
    x, y = data()
    model = nn.Sequential(nn.Linear(4, 5), nn.ELU(), nn.ReLU(inplace=True), nn.Linear(5, 3))
    recovers(model.to(DT), x, y, hessian=True)


# --- KFRA ----------------------------------------------------------------------------------------


def small_3c3d():
    """3c3d's layout (3 conv + 3 linear layers, CIFAR-sized input) with few channels."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 5), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(8, 8, 3), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(),
        nn.Linear(12, 10),
    ).to(DT)  # fmt: skip


def test_kfra_on_cnn_raises():
    torch.manual_seed(4)
    model = extend(small_3c3d())
    x, y = torch.randn(2, 3, 32, 32, dtype=DT), torch.randint(0, 10, (2,))
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with pytest.raises(NotImplementedError, match="KFRA"):
        with backpack(KFRA()):
            loss.backward()
    assert not any(hasattr(p, "kfra") for p in model.parameters())
    x2, y2 = data()
    recovers(mlp(), x2, y2, ext=DiagGGNExact())


def test_kfra_on_cnn_refuses_up_front_because_of_dimension(monkeypatch):
    calls = []
    propagate = secondorder_module.propagate

    def counting(*args, **kwargs):
        calls.append(1)
        return propagate(*args, **kwargs)

    monkeypatch.setattr(secondorder_module, "propagate", counting)
    torch.manual_seed(4)
    model = extend(small_3c3d())
    x, y = torch.randn(2, 3, 32, 32, dtype=DT), torch.randint(0, 10, (2,))
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with pytest.raises(NotImplementedError, match="too large") as info:
        with backpack(KFRA()):
            loss.backward()
    assert "6272" in str(info.value)  # 8 channels x 28 x 28 after the first convolution
    assert calls == [], "KFRA backpropagated curvature before refusing"


def test_kfra_wide_hidden_layer_dimension_error():
    model = extend(nn.Sequential(nn.Linear(3, 5000), nn.ReLU(), nn.Linear(5000, 2)).to(DT))
    x, y = torch.randn(2, 3, dtype=DT), torch.randint(0, 2, (2,))
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with pytest.raises(NotImplementedError, match="too large") as info:
        with backpack(KFRA()):
            loss.backward()
    assert "5000" in str(info.value) and "KFLR" in str(info.value)
    x2, y2 = data()
    recovers(mlp(), x2, y2)


class SkipOverLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l3 = nn.Linear(4, 3)

    def forward(self, x):
        h = self.l1(x)
        return self.l3(torch.relu(self.l2(h)) + h)


def test_kfra_on_branching_model():
    x, y = data()
    model = extend(SkipOverLayer().to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(x), y)
    with pytest.raises(NotImplementedError, match="chain"):
        with backpack(KFRA()):
            loss.backward()
    # KFLR handles the branch: its output factor of a bias is that bias' GGN block
    reference = Curvature(copy.deepcopy(model), x, nn.CrossEntropyLoss(), y, hessian=False)
    loss = lossfunc(model(x), y)
    with backpack(KFLR()):
        loss.backward()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            close(p.kflr[0], reference.block(reference.ggn, name), name)


def test_kfra_skip_from_input_is_still_a_chain():
    """A skip connection from the (constant) input adds no branch between parameters."""

    class InputSkip(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(4, 4)
            self.l2 = nn.Linear(4, 3)

        def forward(self, x):
            return self.l2(torch.relu(self.l1(x)) + x)

    x, y = data()
    model = extend(InputSkip().to(DT))
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with backpack(KFRA(), KFLR()):
        loss.backward()
    # last layer: KFRA's output factor is the batch-summed loss Hessian, as KFLR's
    close(model.l2.weight.kfra[0], model.l2.weight.kflr[0])
    close(model.l2.weight.kfra[1], model.l2.weight.kflr[1])
    # first layer: batch average of D_n W2ᵀ Ḡ W2 D_n (D_n: ReLU's derivative), the skip adds 0
    gbar = model.l2.weight.kfra[0]
    w2 = model.l2.weight.detach()
    d = (model.l1(x) > 0).to(DT).detach()
    inner = w2.T @ gbar @ w2
    expected = torch.einsum("ni,ij,nj->ij", d, inner, d) / x.shape[0]
    close(model.l1.weight.kfra[0], expected)
    close(model.l1.bias.kfra[0], expected)
    close(model.l1.weight.kfra[1], x.T @ x / x.shape[0])


def _token_model():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5)).double())
    return model, torch.randn(4, 6, 3, dtype=torch.float64)


def test_token_rows_mixing_samples_are_refused():
    """Loss rows built across the sample axis (each row holds every sample's logits) have no
    sample: the factor columns cannot be placed, so the extension refuses."""
    model, x = _token_model()
    lossfunc = extend(nn.CrossEntropyLoss())
    out = model(x)  # [N=4, T=6, C=5]
    rows = out.permute(2, 1, 0).reshape(-1, 4)  # row (c, t) holds the 4 samples' logits
    y = torch.randint(0, 4, (rows.shape[0],))
    with pytest.raises(NotImplementedError, match="cannot tell which sample"):
        with backpack(DiagGGNExact()):
            lossfunc(rows, y).backward()
    assert CTX.engine is None


def test_token_rows_owners_in_chunks_of_samples_give_the_same_curvature(monkeypatch):
    """The (row, sample) presence table filled one sample at a time gives the same result."""
    model, x = _token_model()
    lossfunc = extend(nn.CrossEntropyLoss())
    y = torch.randint(0, 5, (24,))
    results = []
    for chunk in (secondorder_module._PRESENCE_CHUNK, 1):
        monkeypatch.setattr(secondorder_module, "_PRESENCE_CHUNK", chunk)
        model.zero_grad()
        with backpack(DiagGGNExact()):
            lossfunc(model(x).flatten(0, 1), y).backward()
        results.append([p.diag_ggn_exact.clone() for p in model.parameters()])
    # brute force: diag(Jᵀ H J) with J the Jacobian of the [N·T, C] logits
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach() for n, p in model.named_parameters()}
    logits = lambda p: torch.func.functional_call(model, p, (x,)).flatten(0, 1)  # noqa: E731
    out = logits(params)
    jac = torch.func.jacrev(logits)(params)
    hess = torch.func.hessian(lambda o: nn.functional.cross_entropy(o, y))(out)
    for i, name in enumerate(names):
        j = jac[name].reshape(out.numel(), -1)
        expected = torch.einsum("ap,ab,bp->p", j, hess.reshape(out.numel(), -1), j)
        torch.testing.assert_close(results[1][i], results[0][i], rtol=0, atol=0)
        torch.testing.assert_close(
            results[0][i].flatten(), expected, rtol=1e-10, atol=1e-12, msg=name
        )
