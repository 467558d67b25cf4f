"""Seeded estimators on small dense operators and on a data-set operator."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import PROBLEMS, Reference

from backpack.curvature import (
    GGN,
    eigvalsh,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
)


def psd(size=30, decay=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=torch.float64))
    values = decay ** torch.arange(size, dtype=torch.float64) * 10
    return Q @ torch.diag(values) @ Q.T


def test_hutchinson_trace_within_its_standard_deviation():
    A = psd()
    m = 400
    estimate = hutchinson_trace(A, m, seed=1)
    std = (2 * (A.square().sum() - A.diagonal().square().sum()) / m).sqrt()
    assert (estimate - A.trace()).abs() < 4 * std
    assert torch.equal(estimate, hutchinson_trace(A, m, seed=1))
    normal = hutchinson_trace(A, m, seed=1, distribution="normal")
    assert (normal - A.trace()).abs() < 4 * (2 * A.square().sum() / m).sqrt()


def test_hutchinson_diagonal_within_its_standard_deviation():
    A = psd()
    m = 400
    estimate = hutchinson_diagonal(A, m, seed=2)
    std = ((A.square().sum(1) - A.diagonal().square()) / m).sqrt()
    assert ((estimate - A.diagonal()).abs() < 4 * std + 1e-12).all()


def test_hutchinson_diagonal_of_a_diagonal_matrix_is_exact():
    A = torch.diag(torch.arange(1.0, 6.0, dtype=torch.float64))
    torch.testing.assert_close(hutchinson_diagonal(A, 1), A.diagonal())


def test_hutchpp_is_exact_once_the_sketch_spans_the_space():
    A = psd(size=20, decay=0.9)
    torch.testing.assert_close(hutchpp_trace(A, 60), A.trace(), atol=1e-10, rtol=1e-12)
    low_rank = psd(size=20)[:, :4] @ psd(size=20)[:4, :]
    low_rank = low_rank + low_rank.T
    torch.testing.assert_close(hutchpp_trace(low_rank, 30), low_rank.trace(), atol=1e-10, rtol=0)


def test_hutchpp_beats_hutchinson_on_a_decaying_spectrum():
    A = psd(size=60, decay=0.6)
    errors = [
        [(f(A, 30, seed=s) - A.trace()).abs() for s in range(10)]
        for f in (hutchinson_trace, hutchpp_trace)
    ]
    assert max(errors[1]) < 2e-2 * A.trace()
    assert sum(errors[1]) < sum(errors[0]) / 5


def test_eigvalsh_top_k_and_vectors():
    A = psd(size=40, decay=0.8)
    expected = torch.linalg.eigvalsh(A).flip(0)
    values, vectors = eigvalsh(A, k=3, return_eigenvectors=True, seed=0)
    torch.testing.assert_close(values, expected[:3], atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(A @ vectors, vectors * values, atol=1e-6, rtol=0)
    indefinite = A - 3 * torch.eye(40, dtype=torch.float64)
    torch.testing.assert_close(eigvalsh(indefinite, k=2), expected[:2] - 3, atol=1e-8, rtol=0)


def test_eigvalsh_is_exact_after_P_steps_and_on_low_rank():
    g = torch.Generator().manual_seed(0)
    B = torch.randn(12, 12, generator=g, dtype=torch.float64)
    A = B + B.T
    torch.testing.assert_close(
        eigvalsh(A, k=12, max_iter=12, tol=0), torch.linalg.eigvalsh(A).flip(0), atol=1e-10, rtol=0
    )
    u = torch.randn(12, 2, generator=g, dtype=torch.float64)
    low = u @ u.T  # rank 2: the Krylov space is invariant after 2 steps
    torch.testing.assert_close(
        eigvalsh(low, k=3), torch.linalg.eigvalsh(low).flip(0)[:3], atol=1e-10, rtol=0
    )


def test_estimators_on_a_data_set_operator():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    op = GGN(model, problem.make_loss("mean"), problem.batches([4, 4, 3]))
    dense = Reference(problem, model, "mean").ggn()
    torch.testing.assert_close(
        eigvalsh(op, k=2), torch.linalg.eigvalsh(dense).flip(0)[:2], atol=1e-9, rtol=1e-7
    )
    torch.testing.assert_close(hutchpp_trace(op, 3 * 43), dense.trace(), atol=1e-10, rtol=1e-10)


def test_estimator_errors():
    A = psd(size=5)
    with pytest.raises(ValueError, match="num_matvecs"):
        hutchinson_trace(A, 0)
    with pytest.raises(ValueError, match="num_matvecs"):
        hutchpp_trace(A, 2)
    with pytest.raises(ValueError, match="k must be"):
        eigvalsh(A, k=6)
    with pytest.raises(ValueError, match="distribution"):
        hutchinson_trace(A, 3, distribution="uniform")
