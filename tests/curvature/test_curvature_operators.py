"""GGN, Hessian and EmpiricalFisher operators against brute-force matrices of the data-set loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from curvature_problems import PROBLEMS, Reference
from torch import nn

from backpack.curvature import GGN, EmpiricalFisher, Hessian

SIZES = [4, 4, 3]
REDUCTIONS = ["mean", "sum"]
OPERATORS = {
    "ggn": (GGN, Reference.ggn),
    "hessian": (Hessian, Reference.hessian),
    "ef": (EmpiricalFisher, Reference.empirical_fisher),
}


def close(a, b, atol=1e-12):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-9)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ["mlp_ce", "mlp_mse", "cnn_ce", "token_ce"])
@pytest.mark.parametrize("kind", OPERATORS)
def test_operator_matches_brute_force(kind, name, reduction):
    problem = PROBLEMS[name]
    model = problem.model()
    cls, reference = OPERATORS[kind]
    op = cls(model, problem.make_loss(reduction), problem.batches(SIZES), column_chunk=32)
    expected = reference(Reference(problem, model, reduction))
    P = expected.shape[0]
    assert op.shape == (P, P)
    close(op.to_dense(), expected)
    v = torch.randn(P, dtype=torch.float64)
    V = torch.randn(P, 3, dtype=torch.float64)
    close(op @ v, expected @ v)
    close(op @ V, expected @ V)
    close(op.diagonal(), expected.diagonal())
    close(op.trace(), expected.trace())


def test_to_scipy():
    pytest.importorskip("scipy")
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    op = GGN(model, problem.make_loss("mean"), problem.batches(SIZES))
    expected = Reference(problem, model, "mean").ggn().numpy()
    linop = op.to_scipy()
    assert linop.shape == expected.shape and linop.dtype == np.float64
    x = np.random.default_rng(0).standard_normal((expected.shape[0], 2))
    np.testing.assert_allclose(linop @ x[:, 0], expected @ x[:, 0], atol=1e-12)
    np.testing.assert_allclose(linop @ x, expected @ x, atol=1e-12)
    np.testing.assert_allclose(linop.rmatvec(x[:, 1]), expected @ x[:, 1], atol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_monte_carlo_ggn(reduction):
    """A fixed matrix (same draws every sweep) whose own diagonal matches, unbiased for the GGN."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss(reduction)
    data = problem.batches(SIZES)
    op = GGN(model, lossfunc, data, mc_samples=3, seed=2)
    dense = op.to_dense()
    close(op.to_dense(), dense)
    close(op.diagonal(), dense.diagonal())
    exact = Reference(problem, model, reduction).ggn()
    many = GGN(model, lossfunc, data, mc_samples=2000, seed=0).diagonal()
    error = (many - exact.diagonal()).abs().max() / exact.diagonal().abs().max()
    assert error < 0.1
    state = torch.random.get_rng_state()
    GGN(model, lossfunc, data, mc_samples=1) @ torch.ones(op.shape[0], dtype=torch.float64)
    assert torch.equal(state, torch.random.get_rng_state())


def test_hessian_diagonal_falls_back_to_products():
    """A layer without DiagHessian support: the diagonal from Hessian-vector products."""

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

        def forward(self, x):
            return x * self.weight

    problem = PROBLEMS["mlp_ce"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(Scale(), torch.nn.Linear(4, 3).double())
    op = Hessian(model, problem.make_loss("mean"), problem.batches(SIZES))
    expected = Reference(problem, model, "mean").hessian()
    with pytest.warns(UserWarning):
        diagonal = op.diagonal()
    close(diagonal, expected.diagonal())


def test_operator_errors():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    with pytest.raises(TypeError, match="re-iterable"):
        GGN(model, lossfunc, iter(problem.batches(SIZES)))
    op = GGN(model, lossfunc, problem.batches(SIZES))
    with pytest.raises(ValueError, match="P = 43"):
        op @ torch.ones(5, dtype=torch.float64)
    with torch.no_grad():
        model[0].weight.add_(1e-3)
    with pytest.raises(ValueError, match="changed since"):
        op @ torch.ones(43, dtype=torch.float64)
    with pytest.raises(ValueError, match="mc_samples"):
        GGN(model, lossfunc, problem.batches(SIZES), mc_samples=0)


def test_frozen_parameters_are_left_out():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    model[0].weight.requires_grad_(False)
    op = GGN(model, problem.make_loss("mean"), problem.batches(SIZES))
    expected = Reference(problem, model, "mean").ggn()
    assert op.shape == (43 - 20, 43 - 20)
    close(op.to_dense(), expected)
    close(op.diagonal(), expected.diagonal())


@pytest.mark.parametrize("kind", ["empirical", "mc", "exact", "hessian"])
def test_products_leave_a_users_grad_untouched(kind):
    """Products run backwards with extensions: a `.grad` the user holds keeps its values."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc, data = problem.make_loss("mean"), problem.batches(SIZES)
    grads = {n: torch.full_like(p, 0.25) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    op = {
        "empirical": lambda: EmpiricalFisher(model, lossfunc, data),
        "mc": lambda: GGN(model, lossfunc, data, mc_samples=2),
        "exact": lambda: GGN(model, lossfunc, data),
        "hessian": lambda: Hessian(model, lossfunc, data),
    }[kind]()
    op @ torch.ones(op.shape[0], 2, dtype=torch.float64)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


class _WithUnused(nn.Module):
    """A Linear layer and a trainable parameter the loss does not use."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.lin(x)


def test_hessian_with_unused_parameter():
    """Hessian products: zero rows and columns for a parameter outside the loss's graph."""
    torch.manual_seed(0)
    model = _WithUnused().double()
    X = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64)
    lossfunc = nn.MSELoss()
    data = [(X[:2], y[:2]), (X[2:], y[2:])]
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])

    def loss_of(flat):
        pieces = dict(
            zip(
                names,
                (t.reshape(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes)),
            )
        )
        return lossfunc(torch.func.functional_call(model, pieces, (X,)), y)

    expected = torch.autograd.functional.hessian(loss_of, theta)
    close(Hessian(model, lossfunc, data).to_dense(), expected)
    assert expected[:2].abs().max() == 0  # `unused` comes first (own parameters first)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ["mlp_ce", "mlp_mse", "cnn_ce", "token_ce"])
def test_hessian_cached_products(name, reduction):
    """Products through kept graphs equal the brute-force Hessian's; each forward runs once."""
    problem = PROBLEMS[name]
    model = problem.model()
    expected = Reference(problem, model, reduction).hessian()
    op = Hessian(model, problem.make_loss(reduction), problem.batches(SIZES))
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    V = torch.randn(expected.shape[0], 3, dtype=torch.float64)
    with op.cached():
        close(op @ V, expected @ V)
        assert len(calls) == len(SIZES)
        close(op @ V[:, 1], expected @ V[:, 1])
        with op.cached():  # nested: the outer block's graphs
            close(op @ V[:, :2], expected @ V[:, :2])
        assert len(calls) == len(SIZES)
    close(op @ V, expected @ V)
    assert len(calls) == 2 * len(SIZES)  # the block freed its graphs
    handle.remove()


def test_hessian_cache_budget_and_changes():
    """Over budget every product sweeps; a changed model raises; a failed sweep keeps nothing."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    expected = Reference(problem, model, "mean").hessian()
    v = torch.randn(expected.shape[0], dtype=torch.float64)
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    op = Hessian(model, lossfunc, problem.batches(SIZES))
    with op.cached(max_bytes=100):
        close(op @ v, expected @ v)
        close(op @ v, expected @ v)
        assert len(calls) == 2 * len(SIZES)
    with op.cached():
        close(op @ v, expected @ v)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        with pytest.raises(ValueError, match="parameters changed"):
            op @ v
        with torch.no_grad():
            next(model.parameters()).sub_(1.0)

    class Failing(list):
        fail = True

        def __iter__(self):
            for i, batch in enumerate(super().__iter__()):
                if i == 1 and Failing.fail:
                    Failing.fail = False
                    raise RuntimeError("bad batch")
                yield batch

    op = Hessian(model, lossfunc, Failing(problem.batches(SIZES)))
    with op.cached():
        with pytest.raises(RuntimeError, match="bad batch"):
            op @ v
        close(op @ v, expected @ v)  # the half sweep's graph was not kept twice
        close(op @ v, expected @ v)


def test_estimators_keep_hessian_graphs():
    """eigvalsh, CG and SLQ sweep the data once; their results are the dense matrix's."""
    from backpack.curvature import eigvalsh, slq_logdet

    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("sum")
    expected = Reference(problem, model, "sum").hessian()
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    op = Hessian(model, lossfunc, problem.batches(SIZES))
    top = eigvalsh(op, k=2, tol=1e-10)
    close(top, torch.linalg.eigvalsh(expected).flip(0)[:2], atol=1e-8)
    assert len(calls) == len(SIZES)
    calls.clear()
    damping = 1.0 - float(torch.linalg.eigvalsh(expected)[0])
    b = torch.randn(expected.shape[0], dtype=torch.float64)
    x = op.inverse(damping, tol=1e-12) @ b
    close(x, torch.linalg.solve(expected + damping * torch.eye(len(b), dtype=b.dtype), b), 1e-8)
    assert len(calls) == len(SIZES)
    calls.clear()
    slq_logdet(op, damping=damping, num_probes=2, num_steps=expected.shape[0])
    assert len(calls) == len(SIZES)


def test_hessian_of_a_compiled_model():
    """A torch.compile'd model: products through the original module; compiled inner code names
    the fix (compiled code has no double backward)."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    expected = Reference(problem, model, "mean").hessian()
    v = torch.randn(expected.shape[0], dtype=torch.float64)
    close(Hessian(torch.compile(model), lossfunc, problem.batches(SIZES)) @ v, expected @ v)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.compile(nn.Linear(3, 2).double())

        def forward(self, x):
            return self.inner(x)

    data = [(torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0]))]
    with pytest.raises(RuntimeError, match="_orig_mod"):
        Hessian(Outer(), nn.CrossEntropyLoss(), data) @ torch.ones(8, dtype=torch.float64)
