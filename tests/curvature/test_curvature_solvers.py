"""CG inverses, XTrace/XDiag and stochastic Lanczos quadrature against dense float64 references."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import PROBLEMS, Reference
from test_curvature_estimators import psd

from backpack.curvature import (
    GGN,
    KFAC,
    EmpiricalFisher,
    Hessian,
    conjugate_gradients,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    lanczos_quadrature,
    slq_logdet,
    spectral_density,
    xdiag,
    xtrace,
)
from backpack.curvature.estimators import _random

SIZES = [4, 4, 3]
OPERATORS = {
    "ggn": (GGN, Reference.ggn),
    "hessian": (Hessian, Reference.hessian),
    "ef": (EmpiricalFisher, Reference.empirical_fisher),
}


def low_rank(size=30, rank=4, seed=3):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(size, rank, generator=g, dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0] * rank, dtype=torch.float64)[:rank]
    return U @ torch.diag(signs) @ U.T  # symmetric, indefinite, rank 4


# --- conjugate gradients -------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["mlp_ce", "cnn_ce", "mlp_mse"])
@pytest.mark.parametrize("kind", OPERATORS)
def test_cg_inverse_matches_a_dense_solve(kind, name, reduction):
    problem = PROBLEMS[name]
    model = problem.model()
    cls, reference = OPERATORS[kind]
    op = cls(model, problem.make_loss(reduction), problem.batches(SIZES))
    dense = reference(Reference(problem, model, reduction))
    P = dense.shape[0]
    # a damping above −λ_min keeps the Hessian's system definite
    damping = max(float(-torch.linalg.eigvalsh(dense)[0]), 0.0) + 0.1
    system = dense + damping * torch.eye(P, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    V = torch.randn(P, 3, generator=g, dtype=torch.float64)
    inverse = op.inverse(damping, tol=1e-12, max_iter=4 * P)
    X = inverse @ V
    torch.testing.assert_close(X, torch.linalg.solve(system, V), atol=1e-9, rtol=1e-9)
    assert inverse.info.converged and inverse.info.residuals.shape == (3,)
    assert inverse.info.iterations <= 4 * P
    x = inverse @ V[:, 0]
    assert x.shape == (P,)
    torch.testing.assert_close(x, X[:, 0], atol=1e-9, rtol=1e-9)


def test_cg_batches_columns_into_one_sweep_per_iteration():
    """Each iteration is one product with all running columns: as many sweeps as iterations."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    op = GGN(model, problem.make_loss("mean"), problem.batches(SIZES))
    calls = []
    original = op._matmat

    def counting(V):
        calls.append(V.shape[1])
        return original(V)

    op._matmat = counting
    V = torch.randn(op.shape[0], 4, dtype=torch.float64)
    V[:, 3] = 0  # a zero right-hand side is solved at once, without products
    inverse = op.inverse(1.0, tol=1e-10)
    X = inverse @ V
    assert len(calls) == inverse.info.iterations
    assert calls[0] == 3 and all(k <= 3 for k in calls)
    assert torch.equal(X[:, 3], torch.zeros_like(X[:, 3]))


def test_cg_with_a_kfac_preconditioner_and_a_dense_one():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    data = problem.batches(SIZES)
    op = GGN(model, lossfunc, data)
    dense = Reference(problem, model, "mean").ggn()
    P = dense.shape[0]
    damping = 1e-2
    system = dense + damping * torch.eye(P, dtype=torch.float64)
    v = torch.randn(P, dtype=torch.float64)
    expected = torch.linalg.solve(system, v)
    plain = op.inverse(damping, tol=1e-10, max_iter=10 * P)
    torch.testing.assert_close(plain @ v, expected, atol=1e-8, rtol=1e-8)
    preconditioner = KFAC(model, lossfunc, data).inverse(damping)
    kfac = op.inverse(damping, tol=1e-10, max_iter=10 * P, preconditioner=preconditioner)
    torch.testing.assert_close(kfac @ v, expected, atol=1e-8, rtol=1e-8)
    exact = op.inverse(damping, tol=1e-10, preconditioner=torch.linalg.inv(system))
    torch.testing.assert_close(exact @ v, expected, atol=1e-8, rtol=1e-8)
    assert exact.info.iterations <= 2 < plain.info.iterations


def test_cg_refuses_an_indefinite_hessian():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    op = Hessian(model, problem.make_loss("mean"), problem.batches(SIZES))
    dense = Reference(problem, model, "mean").hessian()
    values, vectors = torch.linalg.eigh(dense)
    assert values[0] < 0  # the Hessian of this problem is indefinite
    with pytest.raises(ValueError, match="not positive definite.*Hessian is indefinite"):
        op.inverse(0.0) @ vectors[:, 0]


def test_cg_argument_errors_and_non_convergence():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    op = GGN(model, problem.make_loss("mean"), problem.batches(SIZES))
    with pytest.raises(ValueError, match="damping"):
        op.inverse(-1.0)
    with pytest.raises(ValueError, match="tol"):
        op.inverse(1.0, tol=0)
    with pytest.raises(ValueError, match="max_iter"):
        op.inverse(1.0, max_iter=0)
    inverse = op.inverse(1e-6, tol=1e-14, max_iter=2)
    with pytest.warns(UserWarning, match="did not reach"):
        inverse @ torch.ones(op.shape[0], dtype=torch.float64)
    assert not inverse.info.converged and inverse.info.iterations == 2
    with torch.no_grad():
        model[0].weight.add_(1e-3)
    with pytest.raises(ValueError, match="changed since"):
        op.inverse(1.0) @ torch.ones(op.shape[0], dtype=torch.float64)


def test_conjugate_gradients_on_a_dense_matrix():
    A = psd(size=20, decay=0.8) + 1e-3 * torch.eye(20, dtype=torch.float64)
    B = torch.randn(20, 2, dtype=torch.float64)
    X, info = conjugate_gradients(lambda V: A @ V, B, tol=1e-12, max_iter=200)
    torch.testing.assert_close(X, torch.linalg.solve(A, B), atol=1e-8, rtol=1e-8)
    assert info.converged and (info.residuals <= 1e-12).all()
    with pytest.raises(ValueError, match="preconditioner is not positive definite"):
        conjugate_gradients(lambda V: A @ V, B, preconditioner=lambda R: -R)


# --- XTrace and XDiag ----------------------------------------------------------------------


def test_xtrace_and_xdiag_are_exact_below_their_budget():
    A = low_rank()
    for seed in range(3):
        # s = 5 test vectors: every leave-one-out sketch spans the rank-4 range
        torch.testing.assert_close(xtrace(A, 10, seed=seed), A.trace(), atol=1e-10, rtol=0)
        torch.testing.assert_close(xdiag(A, 10, seed=seed), A.diagonal(), atol=1e-10, rtol=0)
    # and not above it: 3 test vectors leave a rank-2 sketch
    assert (xtrace(A, 6) - A.trace()).abs() > 1e-6


@pytest.mark.parametrize("estimator", ["xtrace", "xdiag"])
def test_exchangeable_estimators_are_unbiased(estimator):
    """Mean over seeds within 4 standard errors of the truth, on a full-rank indefinite matrix."""
    g = torch.Generator().manual_seed(5)
    B = torch.randn(8, 8, generator=g, dtype=torch.float64)
    A = B + B.T
    runs = 1000
    if estimator == "xtrace":
        values = torch.stack([xtrace(A, 6, seed=s) for s in range(runs)])
        truth = A.trace()
    else:
        values = torch.stack([xdiag(A, 6, seed=s) for s in range(runs)])
        truth = A.diagonal()
    error = (values.mean(0) - truth).abs()
    assert (error < 4 * values.std(0) / runs**0.5).all()


def test_xtrace_beats_hutchpp_and_reports_its_error():
    A = psd(size=60, decay=0.8)
    budget = 24
    errors = {
        f.__name__: torch.stack([(f(A, budget, seed=s) - A.trace()).abs() for s in range(10)])
        for f in (hutchinson_trace, hutchpp_trace, xtrace)
    }
    assert errors["xtrace"].mean() < errors["hutchpp_trace"].mean()
    assert errors["hutchpp_trace"].mean() < errors["hutchinson_trace"].mean()
    estimate, std = xtrace(A, budget, seed=0, return_std=True)
    assert std > 0 and (estimate - A.trace()).abs() < 5 * std
    assert torch.equal(estimate, xtrace(A, budget, seed=0))


def test_xdiag_beats_hutchinson_on_a_decaying_spectrum():
    A = psd(size=60, decay=0.8)
    errors = [
        torch.stack([(f(A, 24, seed=s) - A.diagonal()).norm() for s in range(10)]).mean()
        for f in (hutchinson_diagonal, xdiag)
    ]
    assert errors[1] < errors[0] / 2


def test_exchangeable_estimators_on_a_data_set_operator():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    op = EmpiricalFisher(model, problem.make_loss("mean"), problem.batches(SIZES))
    dense = Reference(problem, model, "mean").empirical_fisher()
    # rank ≤ 11 samples: 12 test vectors make both exact
    torch.testing.assert_close(xtrace(op, 24), dense.trace(), atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(xdiag(op, 24), dense.diagonal(), atol=1e-12, rtol=1e-9)
    with pytest.raises(ValueError, match="num_matvecs"):
        xtrace(op, 1)


# --- stochastic Lanczos quadrature ---------------------------------------------------------


def spectrum_matrix(size=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=torch.float64))
    values = torch.linspace(-2, 5, size, dtype=torch.float64) ** 3 / 10
    return Q @ torch.diag(values) @ Q.T, values


def test_quadrature_reproduces_the_probes_moments():
    """Gauss quadrature with m steps is exact for polynomials of degree < 2m, probe by probe."""
    A, values = spectrum_matrix()
    L, m = 4, 5
    nodes, weights = lanczos_quadrature(A, L, m, seed=7)
    assert nodes.shape == weights.shape == (L, m)
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0, dtype=torch.float64))
    V = _random(30, L, 7, "rademacher", torch.float64, "cpu")
    V = V / V.norm(dim=0)
    power = torch.eye(30, dtype=torch.float64)
    for j in range(2 * m):
        quadrature = (weights * nodes**j).sum(1) * L
        exact = (V * (power @ V)).sum(0)
        scale = values.abs().max() ** j
        torch.testing.assert_close(quadrature / scale, exact / scale, atol=1e-12, rtol=0)
        power = power @ A


def test_full_lanczos_finds_every_eigenvalue_and_the_mean_estimates_the_trace():
    A, values = spectrum_matrix()
    nodes, weights = lanczos_quadrature(A, 3, 30, seed=1)
    for row in nodes:
        torch.testing.assert_close(row, values, atol=1e-10, rtol=0)
    # Σ w θ = mean over probes of vᵀAv/‖v‖², Hutchinson's estimate of tr(A)/P
    estimate = (weights * nodes).sum()
    many_nodes, many_weights = lanczos_quadrature(A, 400, 3, seed=2)
    many = (many_weights * many_nodes).sum()
    std = (2 * (A.square().sum() - A.diagonal().square().sum()) / 400).sqrt() / 30
    assert (many - A.trace() / 30).abs() < 4 * std
    assert estimate.isfinite()


def test_spectral_density_integrates_to_one_and_has_the_right_mean():
    A, values = spectrum_matrix()
    grid, density = spectral_density(A, num_probes=8, num_steps=30, seed=0)
    assert grid.shape == density.shape == (1000,) and (density >= 0).all()
    torch.testing.assert_close(
        torch.trapezoid(density, grid), torch.tensor(1.0, dtype=torch.float64), atol=1e-6, rtol=0
    )
    nodes, weights = lanczos_quadrature(A, 8, 30, seed=0)
    mean = torch.trapezoid(grid * density, grid)
    torch.testing.assert_close(mean, (weights * nodes).sum(), atol=1e-6, rtol=0)
    # a narrow width on a given grid puts the mass at the eigenvalues
    custom = torch.linspace(-1.5, 13.0, 4000, dtype=torch.float64)
    _, sharp = spectral_density(A, 8, 30, grid=custom, sigma=0.01)
    peak = custom[sharp.argmax()]
    assert (values - peak).abs().min() < 0.01
    with pytest.raises(ValueError, match="sigma"):
        spectral_density(A, 2, 3, sigma=0.0)
    with pytest.raises(ValueError, match="num_steps"):
        lanczos_quadrature(A, 2, 0)


def test_spectral_density_of_a_data_set_operator_matches_the_dense_matrix():
    """A rank-deficient GGN: Lanczos stops early per probe (invariant space), same result."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    op = GGN(model, problem.make_loss("mean"), problem.batches(SIZES))
    dense = Reference(problem, model, "mean").ggn()
    nodes, weights = lanczos_quadrature(op, 2, 43, seed=3)
    dense_nodes, dense_weights = lanczos_quadrature(dense, 2, 43, seed=3)
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close((weights * nodes).sum(), (dense_weights * dense_nodes).sum())
    assert (weights == 0).any()  # the probes stopped before 43 steps
    largest = torch.linalg.eigvalsh(dense)[-1]
    torch.testing.assert_close(nodes[weights > 0].max(), largest, atol=1e-10, rtol=1e-8)
    grid, density = spectral_density(op, 2, 43, seed=3)
    dense_grid, dense_density = spectral_density(dense, 2, 43, seed=3)
    torch.testing.assert_close(grid, dense_grid, atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(density, dense_density, atol=1e-6, rtol=1e-6)


# --- sweeps: progress bars and errors through the new entry points -------------------------


def test_progress_and_data_errors_reach_the_solvers():
    pytest.importorskip("tqdm")
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    op = GGN(model, lossfunc, problem.batches(SIZES), progress=True)
    dense = Reference(problem, model, "mean").ggn()
    v = torch.randn(op.shape[0], dtype=torch.float64)
    expected = torch.linalg.solve(dense + torch.eye(op.shape[0], dtype=torch.float64), v)
    torch.testing.assert_close(op.inverse(1.0, tol=1e-12) @ v, expected, atol=1e-9, rtol=1e-9)
    with pytest.raises(ValueError, match="no batch"):
        xtrace(GGN(model, lossfunc, []), 4)
    batches = problem.batches(SIZES)
    batches[1] = (batches[1][0][:, :3], batches[1][1])
    with pytest.raises(ValueError, match="Batch 1 has non-batch shapes"):
        spectral_density(GGN(model, lossfunc, batches), 2, 3)


def test_slq_logdet_is_probe_wise_exact_with_full_lanczos():
    """With m = P each probe's quadrature is vᵀ log(A + λI) v / ‖v‖² exactly."""
    A, values = spectrum_matrix()
    A, values = A @ A, values.square()  # positive semi-definite
    damping, L = 0.3, 5
    estimate = slq_logdet(A, damping, num_probes=L, num_steps=30, seed=3)
    V = _random(30, L, 3, "rademacher", torch.float64, "cpu")
    V = V / V.norm(dim=0)
    evals, evecs = torch.linalg.eigh(A + damping * torch.eye(30, dtype=torch.float64))
    log_matrix = evecs @ torch.diag(evals.log()) @ evecs.T
    expected = 30 * (V * (log_matrix @ V)).sum(0).mean()
    torch.testing.assert_close(estimate, expected, atol=1e-10, rtol=0)


def test_slq_logdet_is_exact_for_a_diagonal_matrix_and_rademacher_probes():
    values = torch.linspace(0.1, 4.0, 12, dtype=torch.float64)
    estimate = slq_logdet(torch.diag(values), 0.5, num_probes=2, num_steps=12)
    torch.testing.assert_close(estimate, (values + 0.5).log().sum(), atol=1e-10, rtol=0)


def test_slq_logdet_of_a_ggn_operator_estimates_the_dense_logdet():
    problem = PROBLEMS["mlp_ce"]
    ggn = GGN(problem.model(), problem.make_loss("mean"), problem.batches(SIZES))
    dense = ggn.to_dense()
    size = dense.shape[0]
    exact = torch.linalg.slogdet(dense + 0.1 * torch.eye(size, dtype=dense.dtype))[1]
    estimate = slq_logdet(ggn, 0.1, num_probes=64, num_steps=20, seed=0)
    assert estimate.dtype == dense.dtype and estimate.shape == ()
    assert (estimate - exact).abs() < 0.05 * exact.abs()


def test_slq_logdet_refuses_an_indefinite_matrix_and_bad_damping():
    A, _ = spectrum_matrix()  # has negative eigenvalues
    with pytest.raises(ValueError, match="not positive definite"):
        slq_logdet(A, 0.0, num_probes=2, num_steps=30)
    with pytest.raises(ValueError, match="damping"):
        slq_logdet(A @ A, -1.0)
