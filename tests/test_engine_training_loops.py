"""The engine in real training loops: mixed precision, torch.compile, checkpointing, odd inputs.

References are plain autograd / torch.func in float64 (float32 for mixed precision).
"""

import warnings

import pytest
import torch
from problems import reference_per_sample_grads
from second_order_reference import Curvature
from torch import nn
from torch.utils.checkpoint import checkpoint

from backpack import backpack, extend
from backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchDotGrad,
    BatchGrad,
    BatchJacobian,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)

DTYPE = torch.float64
ALL = [
    BatchGrad,
    BatchL2Grad,
    SumGradSquared,
    Variance,
    BatchDotGrad,
    DiagGGNExact,
    DiagGGNMC,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
    BatchJacobian,
    KFAC,
    KFLR,
    KFRA,
    DiagHessian,
    BatchDiagHessian,
    GGNMP,
    HMP,
    PCHMP,
]


def mlp(dtype=DTYPE):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def close(actual, expected, msg="", rtol=1e-7, atol=1e-10):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)


def _flat(value, param):
    """A quantity as one flat tensor (lists of factors concatenated, products applied)."""
    if callable(value):
        gen = torch.Generator().manual_seed(3)
        value = value(torch.randn(2, *param.shape, generator=gen, device="cpu").to(param))
    if isinstance(value, list):
        return torch.cat([v.flatten() for v in value])
    return value.flatten()


# --- mixed precision -------------------------------------------------------------------------
def _amp_models():
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    )
    mlp_ = nn.Sequential(nn.Linear(6, 8), nn.Sigmoid(), nn.Linear(8, 3))
    return {"mlp": (mlp_, torch.randn(16, 6)), "cnn": (cnn, torch.randn(16, 2, 6, 6))}


@pytest.mark.parametrize("extension", ALL, ids=lambda e: e.__name__)
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_autocast_bfloat16_every_extension_runs_in_float32(extension, model_name):
    model, x = _amp_models()[model_name]
    model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
    y = torch.randint(0, 3, (x.shape[0],))
    results = {}
    for amp in (False, True):
        torch.manual_seed(1)
        model.zero_grad()
        with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16, enabled=amp):
            loss = lossfunc(model(x), y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no spurious coverage warnings either
            with backpack(extension()):
                loss.backward()
        results[amp] = {
            n: _flat(getattr(p, extension().savefield), p) for n, p in model.named_parameters()
        }
    for name, value in results[True].items():
        assert value.dtype == torch.float32, name
        expected = results[False][name]
        if extension in (DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC):
            assert value.shape == expected.shape and torch.isfinite(value).all()
            continue
        # bfloat16 keeps 8 bits: the model itself differs at that level
        error = (value - expected).norm() / expected.norm().clamp_min(1e-12)
        assert error < 0.1, (name, float(error))


# --- torch.compile ---------------------------------------------------------------------------
def test_compiled_model_gives_the_eager_numbers():
    model, lossfunc = extend(mlp()), extend(nn.CrossEntropyLoss())
    compiled = torch.compile(model)
    x, y = torch.randn(6, 4, dtype=DTYPE), torch.randint(0, 3, (6,))
    exts = [BatchGrad, Variance, BatchL2Grad, DiagGGNExact, BatchDiagGGNExact, KFLR, GGNMP]
    for run in (model, compiled):
        with backpack(*[e() for e in exts]):
            lossfunc(run(x), y).backward()
        values = {(n, e): _flat(getattr(p, e().savefield), p) for n, p in model.named_parameters()
                  for e in exts}
        if run is model:
            eager = values
    for key, value in values.items():
        close(value, eager[key], str(key), rtol=1e-9, atol=1e-12)


# --- checkpointing ---------------------------------------------------------------------------
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint(reentrant):
    model, lossfunc = extend(mlp()), extend(nn.CrossEntropyLoss())
    x = torch.randn(5, 4, dtype=DTYPE, requires_grad=True)
    y = torch.randint(0, 3, (5,))

    def step(use_checkpoint, *exts):
        model.zero_grad()
        out = checkpoint(model, x, use_reentrant=reentrant) if use_checkpoint else model(x)
        with backpack(*exts):
            lossfunc(out, y).backward()
        return {n: [p.grad_batch.clone()] + [getattr(p, e.savefield).clone() for e in exts[1:]]
                for n, p in model.named_parameters()}

    first = [BatchGrad(), Variance(), BatchL2Grad()]
    plain, checked = step(False, *first), step(True, *first)
    for name in plain:
        for a, b in zip(checked[name], plain[name]):
            close(a, b, name)
    if reentrant:
        with pytest.raises(NotImplementedError, match="use_reentrant=True.*use_reentrant=False"):
            step(True, BatchGrad(), DiagGGNExact())
    else:
        second = [BatchGrad(), DiagGGNExact(), DiagHessian()]
        plain, checked = step(False, *second), step(True, *second)
        for name in plain:
            for a, b in zip(checked[name], plain[name]):
                close(a, b, name)


# --- odd inputs ------------------------------------------------------------------------------
@pytest.mark.parametrize("extension", [e for e in ALL if e not in (KFAC, KFLR, KFRA)],
                         ids=lambda e: e.__name__)
def test_empty_batch(extension):
    model, lossfunc = extend(mlp()), extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(torch.randn(0, 4, dtype=DTYPE)), torch.zeros(0, dtype=torch.long))
    with backpack(extension()):
        loss.backward()
    for p in model.parameters():
        value = getattr(p, extension().savefield)
        if callable(value):
            value = value(torch.ones(1, *p.shape, dtype=DTYPE))
            assert value.abs().max() == 0
            continue
        if extension in (BatchGrad, BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian):
            assert value.shape == (0, *p.shape)
        elif extension is BatchL2Grad:
            assert value.shape == (0,)
        elif extension is BatchDotGrad:
            assert value.shape == (0, 0)
        elif extension in (SqrtGGNExact, SqrtGGNMC):
            assert value.shape[1:] == (0, *p.shape)
        elif extension is BatchJacobian:
            assert value.shape == (0, 3, *p.shape)
        else:
            assert value.shape == p.shape and value.abs().max() == 0


@pytest.mark.parametrize("extension", [KFAC, KFLR])
def test_empty_batch_kronecker_factors_refused_clearly(extension):
    model, lossfunc = extend(mlp()), extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(torch.randn(0, 4, dtype=DTYPE)), torch.zeros(0, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="without samples.*Skip empty batches"):
        with backpack(extension()):
            loss.backward()


def test_token_loss_with_every_target_ignored_has_zero_curvature():
    model, lossfunc = extend(mlp()), extend(nn.CrossEntropyLoss(ignore_index=-1))
    loss = lossfunc(model(torch.randn(5, 4, dtype=DTYPE)), torch.full((5,), -1))
    exts = [BatchGrad(), DiagGGNExact(), BatchDiagGGNExact(), KFLR(), SqrtGGNExact(), DiagGGNMC()]
    with backpack(*exts):
        loss.backward()
    for p in model.parameters():
        assert torch.equal(p.grad, torch.zeros_like(p))  # what autograd says
        for ext in exts:
            value = getattr(p, ext.savefield)
            value = value[0] if isinstance(value, list) else value  # KFLR: G (A is the input's)
            assert value.abs().max() == 0


def test_nan_in_one_sample_keeps_the_other_rows_exact_and_warns_nothing():
    model, lossfunc = extend(mlp()), extend(nn.CrossEntropyLoss(reduction="sum"))
    x, y = torch.randn(5, 4, dtype=DTYPE), torch.randint(0, 3, (5,))
    x[2, 1] = float("nan")
    # one forward per sample (a batched backward would spread the NaN: 0 * NaN = NaN)
    summed = nn.CrossEntropyLoss(reduction="sum")
    rows = [reference_per_sample_grads(mlp(), x[n : n + 1], summed, y[n : n + 1]) for n in range(5)]
    reference = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = lossfunc(model(x), y)
        with backpack(BatchGrad(), BatchL2Grad(), Variance()):
            loss.backward()
    keep = [0, 1, 3, 4]
    for name, p in model.named_parameters():
        close(p.grad_batch[keep], reference[name][keep], name)
        assert torch.isnan(p.grad_batch[2]).all()
        close(p.batch_l2[keep], reference[name][keep].flatten(1).square().sum(1), name)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_create_graph_keeps_per_sample_quantities_differentiable():
    model, lossfunc = extend(mlp()), extend(nn.CrossEntropyLoss())
    x = torch.randn(5, 4, dtype=DTYPE, requires_grad=True)
    y = torch.randint(0, 3, (5,))
    with backpack(BatchGrad(), BatchL2Grad()):
        lossfunc(model(x), y).backward(create_graph=True)
    weight = model[0].weight
    (ours,) = torch.autograd.grad(weight.grad_batch.square().sum(), x, retain_graph=True)
    (ours_l2,) = torch.autograd.grad(weight.batch_l2.sum(), x)
    close(ours, ours_l2)

    def psg_norm(inp):
        grads = reference_per_sample_grads(model, inp, lossfunc, y, create_graph=True)
        return grads["0.weight"].square().sum()

    (expected,) = torch.autograd.grad(psg_norm(x), x)
    close(ours, expected)
    for p in model.parameters():
        p.grad = None  # break autograd's parameter/gradient cycle


# --- messages and graph walks ----------------------------------------------------------------
def test_errors_name_the_module_by_its_path():
    model = extend(nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.ReLU(), nn.BatchNorm1d(3))))
    lossfunc = extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(torch.randn(6, 4)), torch.randint(0, 3, (6,)))
    with pytest.raises(NotImplementedError, match=r"DiagGGNExact is undefined for '1\.1'"):
        with backpack(DiagGGNExact()):
            loss.backward()


def test_functional_nonlinearity_named_as_torch_function():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 2)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    model, lossfunc = extend(Net()), extend(nn.CrossEntropyLoss())
    loss = lossfunc(model(torch.randn(3, 4)), torch.randint(0, 2, (3,)))
    with pytest.raises(NotImplementedError, match=r"DiagHessian needs .* torch\.tanh"):
        with backpack(DiagHessian()):
            loss.backward()


@pytest.mark.parametrize("identity", [nn.Dropout(0.5), nn.Identity()], ids=["dropout", "identity"])
def test_modules_returning_their_input_are_part_of_the_chain(identity):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), identity, nn.ReLU(), nn.Linear(5, 3)).to(DTYPE).eval()
    plain = nn.Sequential(model[0], model[2], model[3])
    x, y = torch.randn(6, 4, dtype=DTYPE), torch.randint(0, 3, (6,))
    results = []
    for net in (model, plain):
        extend(net)
        lossfunc = extend(nn.CrossEntropyLoss())
        with backpack(KFRA(), DiagHessian()):
            lossfunc(net(x), y).backward()
        results.append([(p.kfra, p.diag_h.clone()) for p in net.parameters()])
    for (kfra, diag), (kfra_ref, diag_ref) in zip(*results):
        close(diag, diag_ref)
        for a, b in zip(kfra, kfra_ref):
            close(a, b)
    ref = Curvature(plain, x, nn.CrossEntropyLoss(), y)
    for name, p in plain.named_parameters():
        close(p.diag_h, ref.diag(ref.hessian, name))


def _nothing_computed_warnings(record):
    return [w for w in record if "computed nothing" in str(w.message)]


def test_every_model_without_extended_modules_warns():
    """A second non-extended model in the same process warns too (it used to fail silently)."""
    for width in (2, 5):  # two different models, one after the other
        model = nn.Linear(3, width)
        loss = nn.functional.cross_entropy(model(torch.randn(4, 3)), torch.zeros(4).long())
        with pytest.warns(UserWarning, match=r"computed nothing.*extend\(model\)"):
            with backpack(DiagGGNExact()):
                loss.backward()
        assert not hasattr(model.weight, "diag_ggn_exact")


def test_the_warning_names_what_the_backward_reached():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.warns(UserWarning) as record:
        with backpack(BatchGrad()):
            model(torch.randn(5, 3)).sum().backward()
    (warning,) = _nothing_computed_warnings(record)
    text = str(warning.message)
    assert "backpack(BatchGrad())" in text
    assert "4 parameter(s) of shape(s)" in text and "[4, 3]" in text and "[2, 4]" in text
    assert warning.filename == __file__  # points at the user's backward call


def test_a_loop_without_extended_modules_warns_once_per_call_site():
    """Python's default filter shows the warning once for a loop, not on every step."""
    model = nn.Linear(3, 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        for _ in range(4):
            with backpack(BatchGrad()):
                model(torch.randn(4, 3)).sum().backward()
    assert len(_nothing_computed_warnings(record)) == 1


def test_backward_after_the_context_warns_at_its_end():
    model = extend(nn.Linear(3, 2))
    loss = model(torch.randn(4, 3)).sum()
    with pytest.warns(UserWarning, match=r"with-block computes \.grad only"):
        with backpack(BatchGrad()):
            pass
    loss.backward()
    assert not hasattr(model.weight, "grad_batch")


def test_no_warning_where_extended_modules_take_part():
    """Backward passes through extended modules, reentrant checkpoints of plain functions."""
    first, second = extend(nn.Linear(3, 4)), extend(nn.Linear(4, 2))
    x = torch.randn(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with backpack(BatchGrad()):  # the inner backward of the checkpoint meets no layer
            hidden = checkpoint(torch.tanh, first(x), use_reentrant=True)
            nn.functional.cross_entropy(second(hidden), torch.zeros(5).long()).backward()
        with backpack(DiagGGNExact()):
            nn.functional.cross_entropy(second(first(x)), torch.zeros(5).long()).backward()
        with backpack():  # no extensions asked: nothing to warn about
            nn.Linear(3, 2)(x).sum().backward()
    assert first.weight.grad_batch.shape == (5, 4, 3)


@pytest.mark.parametrize("loss", ["module", "function", "extended module"])
@pytest.mark.parametrize("extension", [BatchGrad, DiagGGNExact])
def test_backward_through_an_unextended_model_warns(loss, extension):
    """Forgetting `extend(model)`: the loss is recognised, but no layer takes part."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    lossfunc = {
        "module": nn.CrossEntropyLoss(),
        "function": nn.functional.cross_entropy,
        "extended module": extend(nn.CrossEntropyLoss()),
    }[loss]
    out = model(torch.randn(5, 3))
    with pytest.warns(UserWarning, match=r"computed nothing.*extend\(model\)"):
        with backpack(extension()):
            lossfunc(out, torch.randint(0, 2, (5,))).backward()
    assert not hasattr(model[0].weight, extension().savefield)


# --- calls that disagree on the samples ------------------------------------------------------
class _Positions(nn.Module):
    """Token + position embedding (positions broadcast over the batch), optionally added twice."""

    def __init__(self, twice=False, vocab=7, t=4, d=6):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.mix, self.head = nn.Linear(d, d), nn.Linear(d, vocab)
        self.twice, self.t = twice, t

    def forward(self, idx):
        p = self.pos(torch.arange(self.t))
        x = self.tok(idx) + p
        x = self.mix(x) + p if self.twice else self.mix(x)
        return self.head(torch.tanh(x)).transpose(1, 2)


@pytest.mark.parametrize("n", [3, 4], ids=["N!=T", "N==T"])
def test_position_embedding_added_twice_sums_both_uses_per_sample(n):
    """Both additions broadcast the positions: each sample's gradient adds their shares."""
    torch.manual_seed(0)
    model = _Positions(twice=True).to(DTYPE)
    idx = torch.randint(0, 7, (n, 4))
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    expected = reference_per_sample_grads(model, idx, lossfunc, idx)
    extend(model)
    with backpack(BatchGrad()):
        extend(lossfunc)(model(idx), idx).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[name], rtol=1e-10, atol=1e-12)


def test_nan_in_a_broadcast_position_embedding_keeps_nan_gradients():
    model = extend(_Positions().to(DTYPE))
    with torch.no_grad():
        model.pos.weight[0, 0] = float("nan")
    idx = torch.randint(0, 7, (3, 4))
    with backpack(BatchGrad()):
        nn.functional.cross_entropy(model(idx), idx).backward()
    assert model.pos.weight.grad_batch.shape == (3, 4, 6)
    assert torch.isnan(model.pos.weight.grad).any()


@pytest.mark.parametrize("extension", [BatchGrad, DiagGGNExact], ids=lambda e: e.__name__)
def test_layer_on_sequence_first_tensors_is_refused(extension):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(6, 2, 8, dropout=0.0)  # sequence-first
    model = extend(nn.Sequential(layer, nn.Linear(6, 5)).to(DTYPE))
    x, y = torch.randn(4, 3, 6, dtype=DTYPE), torch.randint(0, 5, (12,))
    with pytest.raises(RuntimeError, match="processes .* samples along its batch axis"):
        with backpack(extension()):
            nn.functional.cross_entropy(model(x).reshape(-1, 5), y).backward()
