"""Second-order extensions on every problem of the table, against brute-force torch.func."""

import functools

import pytest
import torch
from problems import problems_with
from second_order_reference import Curvature
from torch import nn

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
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)

#: expected warnings: problems of the table whose layers have no rule use the torch.func
#: fallback (it warns once per layer class), and torch's vmap notices missing batching rules
pytestmark = [
    pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:There is a performance drop because we have not yet implemented the batching "
        "rule:UserWarning"
    ),
]

SECOND = problems_with("second")
HESSIAN = problems_with("hessian")
KRON = problems_with("kron")
ids = lambda problems: [p.id for p in problems]  # noqa: E731


@functools.cache
def reference(problem_id, hessian):
    problem = next(p for p in SECOND + HESSIAN if p.id == problem_id)
    model, x, lossfunc, y = problem.build()
    return Curvature(model, x, lossfunc, y, hessian=hessian)


def run(problem, *exts):
    model, x, lossfunc, y = problem.build()
    extend(model)
    extend(lossfunc)
    loss = lossfunc(model(x), y)
    with backpack(*exts):
        loss.backward()
    return model


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9, msg=msg)


@pytest.mark.parametrize("problem", SECOND, ids=ids(SECOND))
def test_ggn_family(problem):
    ref = reference(problem.id, False)
    model = run(problem, DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), GGNMP())
    for name, p in model.named_parameters():
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)
        sqrt = p.sqrt_ggn_exact.flatten(2)
        assert p.sqrt_ggn_exact.shape[2:] == p.shape
        close(torch.einsum("vnp,vnq->pq", sqrt, sqrt), ref.block(ref.ggn, name), name)
        mat = torch.randn(3, *p.shape, dtype=p.dtype, device=p.device)
        expected = (ref.block(ref.ggn, name) @ mat.flatten(1).T).T.reshape(mat.shape)
        close(p.ggnmp(mat), expected, name)


@pytest.mark.parametrize("problem", SECOND, ids=ids(SECOND))
def test_sqrt_ggn_subsampling(problem):
    subsampling = [1, 0, 1]
    model = run(problem, SqrtGGNExact(subsampling=subsampling), SqrtGGNMC(2, subsampling))
    ref = reference(problem.id, False)
    for name, p in model.named_parameters():
        sqrt = p.sqrt_ggn_exact
        assert sqrt.shape[1] == 3 and p.sqrt_ggn_mc.shape[:2] == (2, 3)
        for pos, n in enumerate(subsampling):
            flat = sqrt[:, pos].flatten(1)
            close(flat.T @ flat, ref.block(ref.ggn_per_sample[n], name), name)


@pytest.mark.parametrize("problem", HESSIAN, ids=ids(HESSIAN))
def test_hessian_family(problem):
    ref = reference(problem.id, True)
    model = run(
        problem,
        DiagHessian(),
        BatchDiagHessian(),
        HMP(),
        PCHMP(modify="clip"),
    )
    for name, p in model.named_parameters():
        close(p.diag_h, ref.diag(ref.hessian, name), name)
        close(p.diag_h_batch, ref.diag(ref.hessian_per_sample, name), name)
        mat = torch.randn(2, *p.shape, dtype=p.dtype, device=p.device)
        expected = (ref.block(ref.hessian, name) @ mat.flatten(1).T).T.reshape(mat.shape)
        close(p.hmp(mat), expected, name)
        # the positive-curvature block lies between the GGN and GGN + |residual|
        pch = p.pchmp(mat).flatten(1)
        quad = (pch * mat.flatten(1)).sum(1)
        ggn_quad = ((ref.block(ref.ggn, name) @ mat.flatten(1).T).T * mat.flatten(1)).sum(1)
        assert (quad >= ggn_quad - 1e-9).all()


@pytest.mark.parametrize("problem", KRON, ids=ids(KRON))
def test_kflr_kfac_kfra_definitions(problem):
    model = run(problem, KFLR(), KFAC(mc_samples=4))
    ref = reference(problem.id, False)
    for name, p in model.named_parameters():
        factors = p.kflr
        assert len(p.kfac) == len(factors)
        for kflr, kfac in zip(factors, p.kfac):
            assert kflr.shape == kfac.shape
        if name.endswith("bias") and problem.options.get("bias_block_is_G", True):
            # for Linear/Conv with 2-D outputs per sample, G is the bias block of the GGN
            close(factors[0], ref.block(ref.ggn, name), name)


def test_kfac_converges_to_kflr():
    problem = next(p for p in KRON if p.id == "linear-mlp-ce-mean")
    torch.manual_seed(1)
    model = run(problem, KFLR(), KFAC(mc_samples=20000))
    for p in model.parameters():
        torch.testing.assert_close(p.kfac[0], p.kflr[0], rtol=0.05, atol=2e-3)


@pytest.mark.parametrize(
    "mc_ext,exact_ext", [(DiagGGNMC, DiagGGNExact), (BatchDiagGGNMC, BatchDiagGGNExact)]
)
@pytest.mark.parametrize("problem_id", ["linear-mlp-ce-mean", "linear-mlp-mse-sum"])
def test_mc_converges_and_is_reproducible(problem_id, mc_ext, exact_ext):
    problem = next(p for p in SECOND if p.id == problem_id)
    torch.manual_seed(3)
    model = run(problem, mc_ext(mc_samples=20000), exact_ext())
    exact_field, mc_field = exact_ext().savefield, mc_ext().savefield
    first = {}
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            getattr(p, mc_field), getattr(p, exact_field), rtol=0.1, atol=1e-3
        )
        first[name] = getattr(p, mc_field).clone()
    torch.manual_seed(7)
    model = run(problem, mc_ext(mc_samples=3))
    torch.manual_seed(7)
    again = run(problem, mc_ext(mc_samples=3))
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        close(getattr(p, mc_field), getattr(q, mc_field), name)


def test_kfra_matches_recursion_and_single_layer_kflr():
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    single = extend(torch.nn.Sequential(torch.nn.Linear(4, 3)).double())
    with backpack(KFRA(), KFLR()):
        lossfunc(single(x), y).backward()
    for p in single.parameters():
        for a, b in zip(p.kfra, p.kflr):
            close(a, b)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(4, 5), torch.nn.Sigmoid(), torch.nn.Linear(5, 3)
        ).double()
    )
    with backpack(KFRA()):
        lossfunc(model(x), y).backward()
    out = model(x).detach()
    prob = out.softmax(1)
    gbar = sum(torch.diag(prob[n]) - torch.outer(prob[n], prob[n]) for n in range(6)) / 6
    w2 = model[2].weight.detach()
    s = torch.sigmoid(model[0](x)).detach()
    d = s * (1 - s)
    g1 = w2.T @ gbar @ w2
    g0 = sum(torch.diag(d[n]) @ g1 @ torch.diag(d[n]) for n in range(6)) / 6
    close(model[2].weight.kfra[0], gbar)
    close(model[0].weight.kfra[0], g0)
    close(model[0].weight.kfra[1], x.T @ x / 6)
    close(model[0].bias.kfra[0], g0)


class _NoRule(torch.nn.Module):
    """A parametrized module without a dedicated rule: handled by the torch.func fallback."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return torch.sin(x) @ self.w.T


def test_ggn_family_on_module_without_rule():
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(_NoRule(), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    lossfunc = torch.nn.CrossEntropyLoss()
    ref = Curvature(model, x, lossfunc, y, hessian=False)
    extend(model)
    extend(lossfunc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with backpack(DiagGGNExact(), BatchDiagGGNExact(), GGNMP()):
            lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)


def test_kfra_refuses_shared_parameters():
    lin = torch.nn.Linear(3, 3)
    model = extend(torch.nn.Sequential(lin, torch.nn.Tanh(), lin, torch.nn.Linear(3, 2)))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    with pytest.raises(NotImplementedError, match="several times"), backpack(KFRA()):
        lossfunc(model(torch.randn(4, 3)), torch.randint(0, 2, (4,))).backward()


#: containers whose own parameters meet the samples only where they are broadcast over them
#: (called once: a container called twice takes the fallback, checked by the table's tests)
SITES = [
    p
    for p in SECOND
    if p.id.startswith("container") and "own-matrix" not in p.id and "reuse" not in p.tags
]


@pytest.mark.parametrize("problem", SITES, ids=ids(SITES))
def test_site_parameters_without_fallback(problem, monkeypatch):
    """A class token, a position embedding and a LayerScale take their curvature at their
    sites: no torch.func re-run of the whole container, first-order quantities unchanged."""
    from problems import reference_per_sample_grads

    from backpack.extensions import BatchGrad
    from backpack.rules.generic import FuncRule

    def refuse(*args, **kwargs):
        raise AssertionError("the torch.func fallback ran")

    monkeypatch.setattr(FuncRule, "samples_independent", refuse)
    monkeypatch.setattr(FuncRule, "per_sample_grads", refuse)
    ref = reference(problem.id, False)
    exts = [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), KFLR(), BatchGrad()]
    model = run(problem, *exts)
    own = {name for name, _ in model.named_parameters(recurse=False)}
    model2, x, lossfunc, y = problem.build()
    grads = reference_per_sample_grads(model2, x, lossfunc, y)
    assert own
    for name, p in model.named_parameters():
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)
        sqrt = p.sqrt_ggn_exact.flatten(2)
        close(torch.einsum("vnp,vnq->pq", sqrt, sqrt), ref.block(ref.ggn, name), name)
        close(p.grad_batch, grads[name], name)
        if name in own:  # no Kronecker rule: the parameter's dense GGN block
            (block,) = p.kflr
            close(block, ref.block(ref.ggn, name), name)


@pytest.mark.parametrize("per_sample", [False, True])
def test_one_monte_carlo_column_on_tokens_gives_the_squared_roots(per_sample):
    """A Linear layer over positions with one Monte-Carlo column squares each sample's product
    in place (`linear._one_column_diag`); the numbers are those of the square root's squares,
    with and without coefficients per sample."""
    from backpack.rules.linear import _one_column_diag

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    x = torch.randn(4, 7, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 7))
    with backpack(DiagGGNMC(mc_samples=1), BatchDiagGGNMC(mc_samples=1), SqrtGGNMC(mc_samples=1)):
        lossfunc(model(x).transpose(1, 2), y).backward()
    for name, p in model.named_parameters():
        squares = p.sqrt_ggn_mc.square().sum(0)
        close(p.diag_ggn_mc_batch, squares, name)
        close(p.diag_ggn_mc, squares.sum(0), name)
    f, xs, coef = torch.randn(3, 7, 6), torch.randn(3, 7, 5), torch.rand(3)
    got = _one_column_diag(xs, f, ["weight", "bias"], coef, per_sample)
    weight = coef[:, None, None] * torch.einsum("nto,nti->noi", f, xs).square()
    bias = coef[:, None] * f.sum(1).square()
    close(got["weight"], weight if per_sample else weight.sum(0))
    close(got["bias"], bias if per_sample else bias.sum(0))


class TwoOutputs(nn.Module):
    """A container whose second output (not in the loss) holds one of its own parameters."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.pos = nn.Parameter(torch.randn(1, 4))
        self.aux = nn.Parameter(torch.randn(1, 4))

    def forward(self, x):
        h = self.lin(x)
        return self.head(torch.tanh(h + self.pos)), self.aux.expand(x.shape[0], -1) * x[:, :1]


def test_site_parameter_the_loss_does_not_reach_gets_zero_curvature():
    """The factor columns do not reach `aux`'s site: zeros, while `pos` (a bias after `lin`)
    gets `lin.bias`'s curvature."""
    torch.manual_seed(0)
    model = extend(TwoOutputs().double())
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    with backpack(DiagGGNExact(), BatchDiagGGNExact()):
        out, _ = model(x)
        lossfunc(out, y).backward()
    assert model.aux.grad is None
    close(model.aux.diag_ggn_exact, torch.zeros_like(model.aux))
    close(model.pos.diag_ggn_exact[0], model.lin.bias.diag_ggn_exact)
    close(model.pos.diag_ggn_exact_batch[:, 0], model.lin.bias.diag_ggn_exact_batch)
