"""`backpack.curvature.accumulate` against brute-force quantities of the data-set loss."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import PROBLEMS, Reference
from torch import nn

from backpack import backpack, extend
from backpack.curvature import accumulate
from backpack.extensions import (
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDiagHessian,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)

SIZES = [4, 4, 3]  # an incomplete last batch
REDUCTIONS = ["mean", "sum"]
ALL = ["mlp_ce", "mlp_mse", "cnn_ce", "token_ce"]


def close(a, b, atol=1e-12):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-9)


def first_order():
    return [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()]


def second_order():
    return [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), DiagHessian(), BatchDiagHessian()]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ALL)
def test_first_order_quantities(name, reduction):
    problem = PROBLEMS[name]
    model = problem.model()
    result = accumulate(model, problem.make_loss(reduction), problem.batches(SIZES), first_order())
    ref = Reference(problem, model, reduction)
    G = ref.per_sample_grads()  # [N, P]
    grads = ref.split(G)
    gradient = ref.split(ref.gradient())
    for pname, p in model.named_parameters():
        g = grads[pname]
        close(p.grad_batch, g)
        close(p.batch_l2, g.flatten(1).square().sum(1))
        close(p.sum_grad_squared, g.square().sum(0))
        close(p.variance, g.var(0, unbiased=False))
        close(p.grad, gradient[pname])
        close(result["grad_batch"][pname], g)
    assert result.num_samples == problem.N and result.num_batches == len(SIZES)
    assert result.normaliser == problem.normaliser(reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ALL)
def test_second_order_quantities(name, reduction):
    problem = PROBLEMS[name]
    model = problem.model()
    accumulate(model, problem.make_loss(reduction), problem.batches(SIZES), second_order())
    ref = Reference(problem, model, reduction)
    ggns = ref.split(torch.diagonal(ref.per_sample_ggns(), dim1=1, dim2=2))
    hess = ref.split(torch.diagonal(ref.per_sample_hessians(), dim1=1, dim2=2))
    for pname, p in model.named_parameters():
        close(p.diag_ggn_exact_batch, ggns[pname])
        close(p.diag_ggn_exact, ggns[pname].sum(0))
        close(p.sqrt_ggn_exact.square().sum(0), ggns[pname])
        close(p.diag_h_batch, hess[pname])
        close(p.diag_h, hess[pname].sum(0))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_sqrt_ggn_gives_the_ggn_block(reduction):
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    accumulate(model, problem.make_loss(reduction), problem.batches(SIZES), SqrtGGNExact())
    ref = Reference(problem, model, reduction)
    ggn = ref.ggn()
    weight = model[0].weight
    sqrt = weight.sqrt_ggn_exact.flatten(2).flatten(0, 1)  # [V·N, P_w]
    close(sqrt.T @ sqrt, ggn[: weight.numel(), : weight.numel()])


def one_batch(model, lossfunc, X, y, extensions):
    """The quantities of one backward on (X, y): the definition on a concatenated data set."""
    extend(model)
    extend(lossfunc)
    model.zero_grad()
    with backpack(*extensions):
        lossfunc(model(X), y).backward()
    return {
        name: {e.savefield: getattr(p, e.savefield) for e in extensions}
        for name, p in model.named_parameters()
    }


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ["mlp_ce", "cnn_ce", "token_ce"])
def test_kflr_equals_the_concatenated_data_set(name, reduction, approx):
    """A averages all inputs, G sums with the data-set loss's factor: one backward on all data."""
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss(reduction)
    result = accumulate(model, lossfunc, problem.batches(SIZES), KFLR(kfac_approx=approx))
    X, y = problem.batches([problem.N])[0]
    expected = one_batch(model, lossfunc, X, y, [KFLR(kfac_approx=approx)])
    for pname, factors in result["kflr"].items():
        assert len(factors) == len(expected[pname]["kflr"])
        for ours, theirs in zip(factors, expected[pname]["kflr"]):
            close(ours, theirs)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kflr_brute_force_factors(reduction):
    """Last layer: G = Σ_n Hessian of sample n's term w.r.t. the logits; first: A = E[x xᵀ]."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    result = accumulate(model, problem.make_loss(reduction), problem.batches(SIZES), KFLR())
    ref = Reference(problem, model, reduction)
    logits = model(problem.X).detach()
    loss = problem.make_loss("sum")
    H = 0
    for i in range(problem.N):
        term = lambda o, i=i: loss(o, problem.Y[i : i + 1]) / ref.nu  # noqa: E731
        H = H + torch.func.hessian(term)(logits[i : i + 1])[0, :, 0]
    close(result["kflr"]["2.weight"][0], H)
    close(result["kflr"]["2.bias"][0], H)
    close(result["kflr"]["0.weight"][1], problem.X.T @ problem.X / problem.N)


@pytest.mark.parametrize("name", ["mlp_ce", "cnn_ce", "token_ce"])
def test_one_batch_loader_is_bit_exact(name):
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    exts = [BatchGrad(), Variance(), SumGradSquared(), DiagGGNExact(), KFLR(), SqrtGGNExact()]
    result = accumulate(model, lossfunc, problem.batches([problem.N]), exts)
    X, y = problem.batches([problem.N])[0]
    torch.manual_seed(0)
    expected = one_batch(model, lossfunc, X, y, exts)
    for pname in result.names:
        for e in exts:
            ours, theirs = result[e.savefield][pname], expected[pname][e.savefield]
            for a, b in zip(ours, theirs) if isinstance(ours, list) else [(ours, theirs)]:
                assert torch.equal(a, b), (pname, e.savefield)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kfac_mc_combines_batches_by_definition(reduction):
    """Replaying the same draws batch by batch: G = Σ_b s_b G_b / ν, A = Σ_b N_b A_b / N."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss(reduction)
    batches = problem.batches(SIZES)
    torch.manual_seed(3)
    result = accumulate(model, lossfunc, batches, [KFAC(mc_samples=2), DiagGGNMC(mc_samples=2)])
    torch.manual_seed(3)
    nu = problem.normaliser(reduction)
    expected = {}
    for X, y in batches:
        got = one_batch(model, lossfunc, X, y, [KFAC(mc_samples=2), DiagGGNMC(mc_samples=2)])
        s = float((y != -100).sum()) if reduction == "mean" else 1.0
        for pname, q in got.items():
            weighted = [q["kfac"][0] * s / nu] + [a * X.shape[0] / problem.N for a in q["kfac"][1:]]
            diag = q["diag_ggn_mc"] * s / nu
            if pname not in expected:
                expected[pname] = (weighted, diag)
            else:
                w0, d0 = expected[pname]
                expected[pname] = ([x + y for x, y in zip(w0, weighted)], d0 + diag)
    for pname in result.names:
        for ours, theirs in zip(result["kfac"][pname], expected[pname][0]):
            close(ours, theirs)
        close(result["diag_ggn_mc"][pname], expected[pname][1])


def test_merge_equals_one_sweep():
    problem = PROBLEMS["token_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    exts = [BatchGrad(), Variance(), SumGradSquared(), DiagGGNExact(), KFLR(), BatchL2Grad()]
    batches = problem.batches([2, 3, 4, 2])
    whole = accumulate(model, lossfunc, batches, exts)
    first = accumulate(model, lossfunc, batches[:2], exts)
    second = accumulate(model, lossfunc, batches[2:], exts)
    merged = first.merge(second)
    assert merged.total == whole.total and merged.num_samples == whole.num_samples
    for e in exts:
        for pname in whole.names:
            a, b = merged[e.savefield][pname], whole[e.savefield][pname]
            for x, y in zip(a, b) if isinstance(a, list) else [(a, b)]:
                close(x, y)
    for pname in whole.names:
        close(merged.gradient()[pname], whole.gradient()[pname])
    merged.write(model)
    close(model.lin.weight.variance, whole["variance"]["lin.weight"])


def test_merge_refuses_a_changed_model():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    batches = problem.batches(SIZES)
    first = accumulate(model, lossfunc, batches[:1], DiagGGNExact())
    with torch.no_grad():
        model[0].weight.add_(1e-3)
    second = accumulate(model, lossfunc, batches[1:], DiagGGNExact())
    with pytest.raises(ValueError, match="parameters changed"):
        first.merge(second)
    other = accumulate(model, lossfunc, batches[1:], SumGradSquared())
    with pytest.raises(ValueError, match="different extensions"):
        second.merge(other)


@pytest.mark.parametrize("give_total", [True, False])
def test_callback_streams_rows(give_total):
    problem = PROBLEMS["token_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    batches = problem.batches(SIZES)
    streamed = {}

    def callback(index, name, value):
        streamed.setdefault(name, []).append((index, value))

    total = problem.normaliser("mean") if give_total else None
    result = accumulate(
        model, lossfunc, batches, [BatchGrad(), BatchL2Grad()], callback=callback, total=total
    )
    assert result["grad_batch"]["lin.weight"] is None
    ref = Reference(problem, model, "mean").split(
        Reference(problem, model, "mean").per_sample_grads()
    )
    assert [i for i, _ in streamed["lin.weight"]] == [0, 0, 1, 1, 2, 2]
    rows = torch.cat([v for _, v in streamed["lin.weight"] if v.dim() == 3])
    close(rows, ref["lin.weight"])
    with pytest.raises(ValueError, match="streamed"):
        accumulate(model, lossfunc, batches, BatchGrad(), callback=callback, total=3.0)
    first = accumulate(model, lossfunc, batches[:1], BatchGrad(), callback=callback)
    second = accumulate(model, lossfunc, batches[1:], BatchGrad(), callback=callback)
    with pytest.raises(ValueError, match="streamed"):
        first.merge(second)


def test_a_batch_without_loss_terms():
    """All targets of a batch ignored: no loss term, zero rows, samples still counted."""
    problem = PROBLEMS["token_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    batches = problem.batches(SIZES)
    X, y = batches[1]
    batches[1] = (X, torch.full_like(y, -100))
    result = accumulate(model, lossfunc, batches, [BatchGrad(), Variance(), DiagGGNExact()])
    Y = problem.Y.clone()
    Y[4:8] = -100
    from curvature_problems import Problem

    masked = Problem("masked", problem.make_model, problem.make_loss, problem.X, Y, True)
    ref = Reference(masked, model, "mean")
    G = ref.split(ref.per_sample_grads())
    ggn = ref.split(torch.diagonal(ref.ggn()))
    for pname in result.names:
        close(result["grad_batch"][pname], G[pname])
        close(result["variance"][pname], G[pname].var(0, unbiased=False))
        close(result["diag_ggn_exact"][pname], ggn[pname])
    with pytest.raises(ValueError, match="no loss term"):
        accumulate(model, lossfunc, batches, KFLR())


def test_errors():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    batches = problem.batches(SIZES)
    with pytest.raises(ValueError, match="no batch"):
        accumulate(model, lossfunc, [], DiagGGNExact())
    bad = batches + [(torch.randn(2, 5, dtype=torch.float64), torch.tensor([0, 1]))]
    with pytest.raises(ValueError, match="Batch 3 has non-batch shapes"):
        accumulate(model, lossfunc, bad, DiagGGNExact())
    with pytest.raises(NotImplementedError, match="N_total"):
        accumulate(model, lossfunc, batches, BatchDotGrad())
    with pytest.raises(NotImplementedError, match="KFRA"):
        accumulate(model, lossfunc, batches, KFRA())
    with pytest.raises(ValueError, match="subsampling"):
        accumulate(model, lossfunc, batches, BatchGrad(subsampling=[0]))
    with pytest.raises(ValueError, match="instances"):
        accumulate(model, lossfunc, batches, [DiagGGNExact])
    with pytest.raises(ValueError, match="reduction"):
        accumulate(model, nn.CrossEntropyLoss(reduction="none"), batches, DiagGGNExact())


def test_progress_bar_and_generators():
    pytest.importorskip("tqdm")
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("sum")
    batches = problem.batches(SIZES)
    a = accumulate(model, lossfunc, batches, DiagGGNExact(), progress=True)
    b = accumulate(model, lossfunc, iter(batches), DiagGGNExact())
    for pname in a.names:
        close(a["diag_ggn_exact"][pname], b["diag_ggn_exact"][pname])


def test_write_false_keeps_the_gradients():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    accumulate(
        model, problem.make_loss("mean"), problem.batches(SIZES), DiagGGNExact(), write=False
    )
    for p in model.parameters():
        assert torch.equal(p.grad, torch.ones_like(p))
        assert not hasattr(p, "diag_ggn_exact")
