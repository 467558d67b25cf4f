"""Exact curvature of convolutional graphs reduced column by column, and the rank C−1 factor.

`backpack.secondorder._reduce_columns` backpropagates each column of the loss-Hessian factor and
sums its squares into the parameter diagonals where it arrives (in chunks of columns), instead of
storing `[V, N, *out]` factors. The cross-entropy factor has C − 1 columns there. Both are checked
against brute-force GGNs and Hessians in float64, for every chunk layout, with a negative loss
weight and two losses, and next to extensions that still need the stored factors.
"""

import pytest
import torch
from second_order_reference import Curvature
from thread_checks import assert_threads_reproduce
from torch import nn

from backpack import backpack, extend, secondorder
from backpack.extensions import (
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
)
from backpack.recording import Record
from backpack.rules.losses import CrossEntropyLossRule

DTYPE = torch.float64


def cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 2, stride=2),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(4, 5),
        nn.Tanh(),
        nn.Linear(5, 4),
    )


def build(loss="ce", reduction="mean"):
    torch.manual_seed(0)
    model = cnn().to(DTYPE)
    x = torch.randn(5, 2, 4, 4, dtype=DTYPE)
    if loss == "ce":
        lossfunc = nn.CrossEntropyLoss(reduction=reduction)
        y = torch.randint(0, 4, (5,))
    else:
        lossfunc = nn.MSELoss(reduction=reduction)
        y = torch.randn(5, 4, dtype=DTYPE)
    return model, x, lossfunc, y


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-10, msg=msg)


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of `_reduce_columns` (the path under test must actually run)."""
    calls = []
    original = secondorder._reduce_columns

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(secondorder, "_reduce_columns", counting)
    return calls


@pytest.mark.parametrize("chunk", [1, 40, None], ids=["one-column", "partial-chunks", "default"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_diagonals_match_brute_force(chunk, loss, reduction, monkeypatch, spy):
    if chunk is not None:
        # 40 elements: one column of the first conv's output ([5, 3, 4, 4]) exceeds it (chunks
        # of 1), the second conv's ([5, 4, 1, 1]) takes 2 columns per chunk, leaving a partial one
        monkeypatch.setattr(secondorder, "REDUCE_CHUNK_ELEMENTS", chunk)
    model, x, lossfunc, y = build(loss, reduction)
    ref = Curvature(model, x, lossfunc, y, hessian=True, per_sample=False)
    extend(model)
    extend(lossfunc)
    with backpack(DiagGGNExact(), BatchDiagGGNExact(), DiagHessian()):
        lossfunc(model(x), y).backward()
    assert spy, "the column-reduction path did not run"
    for name, p in model.named_parameters():
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)
        close(p.diag_h, ref.diag(ref.hessian, name), name)


def test_per_sample_hessian_diagonal(spy):
    model, x, lossfunc, y = build()
    ref = Curvature(model, x, lossfunc, y, hessian=True, per_sample=True)
    extend(model)
    extend(lossfunc)
    with backpack(BatchDiagHessian()):
        lossfunc(model(x), y).backward()
    assert spy
    for name, p in model.named_parameters():
        close(p.diag_h_batch, ref.diag(ref.hessian_per_sample, name), name)


def test_negative_weight_and_two_losses(spy):
    """-0.5 · L(f(x1)) + L(f(x2)): each loss's term keeps its sign; the rows stack."""
    model, x, lossfunc, y = build()
    torch.manual_seed(3)
    x2, y2 = torch.randn_like(x), torch.randint(0, 4, (5,))
    ref1 = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    ref2 = Curvature(model, x2, lossfunc, y2, hessian=False, per_sample=False)
    extend(model)
    extend(lossfunc)
    with backpack(DiagGGNExact(), BatchDiagGGNExact()):
        (-0.5 * lossfunc(model(x), y) + lossfunc(model(x2), y2)).backward()
    assert len(spy) == 2
    for name, p in model.named_parameters():
        expected = -0.5 * ref1.diag(ref1.ggn, name) + ref2.diag(ref2.ggn, name)
        close(p.diag_ggn_exact, expected, name)
        rows = torch.cat(
            [-0.5 * ref1.diag(ref1.ggn_per_sample, name), ref2.diag(ref2.ggn_per_sample, name)]
        )
        close(p.diag_ggn_exact_batch, rows, name)


def test_stored_factors_when_other_extensions_need_them(spy):
    """With a square root or Kronecker factors in the same pass, factors are stored as before."""
    model, x, lossfunc, y = build()
    ref = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    extend(model)
    extend(lossfunc)
    with backpack(DiagGGNExact(), SqrtGGNExact(), KFLR()):
        lossfunc(model(x), y).backward()
    assert not spy
    for name, p in model.named_parameters():
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        assert p.sqrt_ggn_exact.shape == (4, 5, *p.shape)  # one column per class
        flat = p.sqrt_ggn_exact.flatten(2)
        close(torch.einsum("vnp,vnq->pq", flat, flat), ref.block(ref.ggn, name), name)


def test_monte_carlo_diagonal_is_reduced(spy):
    model, x, lossfunc, y = build()
    extend(model)
    extend(lossfunc)
    torch.manual_seed(7)
    with backpack(DiagGGNMC(mc_samples=3)):
        lossfunc(model(x), y).backward()
    assert spy
    reduced = {k: p.diag_ggn_mc.clone() for k, p in model.named_parameters()}
    # the same draws through stored factors (the path taken next to a square root)
    model.zero_grad()
    torch.manual_seed(7)
    with backpack(DiagGGNMC(mc_samples=3), KFLR()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        close(p.diag_ggn_mc, reduced[name], name)


class _Call:
    """The slots of a loss record that `CrossEntropyLossRule.sqrt_hessian` reads."""

    def __init__(self, module, out, target):
        self.module, self.args = module, (out, target)


@pytest.mark.parametrize(
    "shape, loss",
    [
        ((6, 5), nn.CrossEntropyLoss()),
        ((6, 5), nn.CrossEntropyLoss(reduction="sum", weight=torch.rand(5, dtype=DTYPE) + 0.5)),
        ((3, 4, 2, 3), nn.CrossEntropyLoss(ignore_index=1)),
        ((4, 2), nn.CrossEntropyLoss(label_smoothing=0.2)),
    ],
    ids=["plain", "class-weights-sum", "spatial-ignore-index", "two-classes"],
)
def test_cross_entropy_factor_of_rank_c_minus_1(shape, loss):
    torch.manual_seed(0)
    out = torch.randn(*shape, dtype=DTYPE) * 3
    target = torch.randint(0, shape[1], (shape[0], *shape[2:]))
    call: Record = _Call(loss, out, target)  # type: ignore[assignment]
    rule = CrossEntropyLossRule()
    full, reduced = rule.sqrt_hessian(call), rule.sqrt_hessian(call, reduced=True)
    c, positions = shape[1], max(1, out[0, 0].numel())
    assert full.shape[0] == c * positions
    assert reduced.shape[0] == (c - 1) * positions
    assert reduced.shape[1:] == full.shape[1:]

    def gram(s):
        flat = s.reshape(s.shape[0], s.shape[1], -1)
        return torch.einsum("vnd,vne->nde", flat, flat)

    close(gram(reduced), gram(full))
    # and the Hessian itself (samples do not interact: its diagonal blocks), by autograd
    hess = torch.autograd.functional.hessian(lambda o: loss(o, target), out)
    d = out[0].numel()
    hess = hess.reshape(shape[0], d, shape[0], d)
    blocks = torch.stack([hess[i, :, i, :] for i in range(shape[0])])
    close(gram(reduced), blocks)


class SharedConv(nn.Module):
    """One convolution applied twice to the same samples (its GGN has cross terms)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.act = nn.Tanh()
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.conv(self.act(self.conv(x))).flatten(1))


def check_ggn_diagonals(model, x, y):
    """DiagGGNExact and BatchDiagGGNExact of `model` (float64, CE) against brute force."""
    lossfunc = nn.CrossEntropyLoss()
    ref = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    extend(model)
    extend(lossfunc)
    with backpack(DiagGGNExact(), BatchDiagGGNExact()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)


def test_parameter_used_twice_on_the_same_samples_keeps_factors(spy):
    torch.manual_seed(0)
    model = SharedConv().to(DTYPE)
    check_ggn_diagonals(model, torch.randn(3, 2, 4, 4, dtype=DTYPE), torch.randint(0, 3, (3,)))
    assert not spy


def test_too_large_exact_factor_is_refused_clearly(monkeypatch):
    """Token losses on [N, V, T] logits need V·T columns: refused before allocating."""
    monkeypatch.setattr(secondorder, "EXACT_FACTOR_MAX_ELEMENTS", 1000)
    model = extend(nn.Conv1d(3, 6, 1).to(DTYPE))  # [N, 6 classes, 8 positions]
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(4, 3, 8, dtype=DTYPE), torch.randint(0, 6, (4, 8))
    loss = lossfunc(model(x), y)  # 48 columns x 192 entries > 1000
    with pytest.raises(NotImplementedError, match=r"DiagGGNExact needs the exact Hessian.*48"):
        with backpack(DiagGGNExact()):
            loss.backward()
    # the Monte-Carlo version runs
    model.zero_grad()
    with backpack(DiagGGNMC()):
        lossfunc(model(x), y).backward()
    assert model.weight.diag_ggn_mc.shape == model.weight.shape


def _kron_run(ext_factory, two_losses=False):
    torch.manual_seed(0)
    model, x, lossfunc, y = build()
    extend(model)
    extend(lossfunc)
    x2, y2 = torch.randn_like(x), torch.randint(0, 4, (5,))
    ext = ext_factory()
    torch.manual_seed(5)
    with backpack(ext):
        loss = lossfunc(model(x), y)
        if two_losses:
            loss = loss - 0.3 * lossfunc(model(x2), y2)
        loss.backward()
    return {k: [t.clone() for t in getattr(p, ext.savefield)] for k, p in model.named_parameters()}


@pytest.mark.parametrize("two_losses", [False, True])
@pytest.mark.parametrize(
    "ext_factory",
    [KFLR, lambda: KFLR(kfac_approx="reduce"), lambda: KFAC(mc_samples=3)],
    ids=["kflr", "kflr-reduce", "kfac-3"],
)
def test_kronecker_factors_reduced_as_when_stored(ext_factory, two_losses, spy, monkeypatch):
    """G summed column by column equals G from stored factors (same draws for KFAC)."""
    reduced = _kron_run(ext_factory, two_losses)
    assert len(spy) == (2 if two_losses else 1), "the column-reduction path did not run"
    monkeypatch.setattr(secondorder, "_reducible_now", lambda *args: False)
    stored = _kron_run(ext_factory, two_losses)
    assert len(spy) == (2 if two_losses else 1)
    for name in reduced:
        assert len(reduced[name]) == len(stored[name])
        for a, b in zip(reduced[name], stored[name], strict=True):
            close(a, b, name)


# --- set-ups around the reduced path: a module without a rule, torch.compile, threads ----------
class Scale(nn.Module):
    """A parametrized module without a rule (the generic torch.func rule handles it)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return x * self.weight.reshape(1, 3, 1, 1)


def cnn_with_generic_layer():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        Scale(),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(12, 4),
    )


def test_module_without_rule_is_reduced_correctly(spy):
    torch.manual_seed(0)
    model = cnn_with_generic_layer().to(DTYPE)
    check_ggn_diagonals(model, torch.randn(5, 2, 4, 4, dtype=DTYPE), torch.randint(0, 4, (5,)))
    assert spy


def _quantities(model):
    return {
        (name, field): torch.cat([t.flatten() for t in value]) if isinstance(value, list)
        else value.clone()
        for name, p in model.named_parameters()
        for field in ("diag_ggn_exact", "diag_ggn_exact_batch", "kflr", "grad")
        if (value := getattr(p, field, None)) is not None
    }


def test_compiled_convolutional_model_gives_the_eager_numbers(spy):
    model, x, lossfunc, y = build()
    extend(model)
    extend(lossfunc)
    results = []
    for run in (model, torch.compile(model)):
        model.zero_grad()
        with backpack(DiagGGNExact(), BatchDiagGGNExact(), KFLR()):
            lossfunc(run(x), y).backward()
        results.append(_quantities(model))
    assert spy
    assert results[0].keys() == results[1].keys()
    for key, value in results[0].items():
        close(results[1][key], value, str(key))


def test_threads_match_single_threaded_results():
    setups = []
    for seed in range(3):
        torch.manual_seed(seed)
        model, x, lossfunc, y = build()
        setups.append((extend(model), x, extend(lossfunc), y))

    def step(i):
        model, x, lossfunc, y = setups[i]
        model.zero_grad()
        with backpack(DiagGGNExact(), BatchDiagGGNExact(), KFLR()):
            lossfunc(model(x), y).backward()
        return _quantities(model)

    assert_threads_reproduce(step, 3, 10)
