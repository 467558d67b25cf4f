"""Low-rank query gradients (`scores(..., query_rank=r)`) against explicit truncated SVDs.

Reference (float64): per-sample gradients from `torch.func`, the query's preconditioned gradient
of every matrix parameter truncated to rank r with `torch.linalg.svd`, one-axis parameters kept,
then the plain dot products.
"""

from __future__ import annotations

import pytest
import torch
from influence_problems import PROBLEMS, Reference

from backpack.influence import fit


def _truncated(rows: dict[str, torch.Tensor], shapes: dict, rank: int) -> dict[str, torch.Tensor]:
    """Each `[Q, numel]` row of a matrix parameter at its best rank `rank`."""
    out = {}
    for name, value in rows.items():
        shape = shapes[name]
        if len(shape) < 2:
            out[name] = value
            continue
        M = value.reshape(value.shape[0], shape[0], -1)
        U, S, Vh = torch.linalg.svd(M, full_matrices=False)
        r = min(rank, S.shape[-1])
        out[name] = ((U[..., :r] * S[:, None, :r]) @ Vh[:, :r]).reshape(value.shape[0], -1)
    return out


def _reference(problem, strategy: str, rank: int | None, per_token: bool = False):
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    train = problem.train(4)
    influence = fit(model, lossfunc, train, strategy, damping=0.1, fisher="type-2")
    ref = Reference(problem, model)
    shapes = dict(zip(ref.names, ref.shapes))
    rows = ref.query_rows()
    M = influence.precondition(rows)
    if rank is not None:
        M = _truncated(M, shapes, rank)
    M = torch.cat([M[n] for n in ref.names], dim=1)
    if per_token:
        terms = ref.terms(problem.X, problem.Y)  # [N, T, P]
        expected = torch.einsum("qp,ntp->qnt", M, terms)
    else:
        expected = M @ ref.train_grads().T
    return influence, train, expected


@pytest.mark.parametrize("strategy", ["identity", "diagonal", "kfac", "ekfac"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
@pytest.mark.parametrize("rank", [1, 2])
def test_low_rank_scores_equal_truncated_svd(name, strategy, rank):
    problem = PROBLEMS[name]
    influence, train, expected = _reference(problem, strategy, rank)
    got = influence.scores(problem.query(2), train, query_rank=rank, query_rank_norm="frobenius")
    scale = expected.abs().max()
    assert torch.allclose(got, expected, atol=1e-10 * scale, rtol=0)
    # the dense products (factored=False) give the same numbers
    dense = influence.scores(
        problem.query(2), train, query_rank=rank, factored=False, query_rank_norm="frobenius"
    )
    assert torch.allclose(dense, expected, atol=1e-10 * scale, rtol=0)


@pytest.mark.parametrize("strategy", ["identity", "ekfac"])
@pytest.mark.parametrize("rank", [1, 2])
def test_low_rank_per_token(strategy, rank):
    problem = PROBLEMS["gpt"]
    influence, train, expected = _reference(problem, strategy, rank, per_token=True)
    got = influence.scores(
        problem.query(2), train, query_rank=rank, per_token=True, query_rank_norm="frobenius"
    )
    assert torch.allclose(got, expected, atol=1e-10 * expected.abs().max(), rtol=0)


def test_full_rank_is_exact_and_error_diagnostic():
    problem = PROBLEMS["gpt"]
    influence, train, exact = _reference(problem, "ekfac", None)
    query = problem.query(2)
    # rank ≥ every matrix's smaller side: nothing is truncated
    assert torch.allclose(influence.scores(query, train, query_rank=7), exact, atol=1e-12, rtol=0)
    errors = influence.query_rank_error(query, train, [1, 2, 3, 4])
    for r, error in errors.items():
        low = influence.scores(query, train, query_rank=r)  # query_rank_norm="fisher"
        assert error == pytest.approx(float((low - exact).norm() / exact.norm()), rel=1e-8)
    assert errors[4] < 1e-12 and errors[1] > 0
    with pytest.raises(ValueError, match="query_rank"):
        influence.scores(query, train, query_rank=0)
    with pytest.raises(ValueError, match="query_rank_norm"):
        influence.scores(query, train, query_rank=1, query_rank_norm="spectral")


def test_beats_joint_truncation_of_weight_and_bias():
    """kronfluence truncates a module's `[W | b]` jointly; here W at rank r and b exact.

    A rank-r truncation of `[W | b]` restricted to W has rank ≤ r, so W's best rank-r error is
    never larger, and the bias is exact: the query gradient's error is at most kronfluence's
    (exact SVD; its default randomized SVD is no better than the exact one).
    """
    problem = PROBLEMS["mlp"]
    model = problem.model()
    influence = fit(
        model, problem.make_loss("mean"), problem.train(4), "ekfac", separate_weight_and_bias=False
    )
    ref = Reference(problem, model)
    rows = ref.query_rows()
    M = influence.precondition(rows)
    for layer in ("0", "2"):
        W, b = M[f"{layer}.weight"], M[f"{layer}.bias"]
        out = b.shape[1]
        joint = torch.cat([W.reshape(-1, out, W.shape[1] // out), b[..., None]], dim=2)
        for rank in (1, 2):
            ours = _truncated({"w": W}, {"w": (out, W.shape[1] // out)}, rank)["w"]
            ours_error = (ours - W).reshape(W.shape[0], -1).norm(dim=1)  # the bias: exact
            theirs = _truncated({"j": joint.flatten(1)}, {"j": joint.shape[1:]}, rank)["j"]
            theirs_error = (theirs - joint.flatten(1)).norm(dim=1)
            assert torch.all(ours_error <= theirs_error + 1e-12)


def _weighted_reference(influence, M: dict, shapes: dict, rank: int) -> dict:
    """The best rank-r rows in the norm `‖G^{1/2} Δ A^{1/2}‖_F`, by Cholesky factors.

    `G ⊗ A`: the block's eigenvalues fitted by one outer product `u vᵀ` in its basis (a
    diagonal block: the identity basis), eigenvalues floored at 1e-6 of the largest; the
    optimum does not depend on the square root, so `C_Gᵀ Δ C_A` with Cholesky factors.
    """
    out = dict(M)
    for b in influence.blocks:
        shape = shapes[b.name]
        if len(shape) < 2:
            continue
        m, k = shape[0], M[b.name].shape[1] // shape[0]
        if min(m, k) <= rank:
            continue
        lam = b.values.reshape(b.rows, -1)
        U, S, Vh = torch.linalg.svd(lam)
        u, v = U[:, 0].abs() * S[0].sqrt(), Vh[0].abs() * S[0].sqrt()
        if len(b.vectors) == 2:
            G = b.vectors[0] @ torch.diag(u) @ b.vectors[0].T
            A = b.vectors[1] @ torch.diag(v) @ b.vectors[1].T
        else:
            G, A = torch.diag(u), torch.diag(v)
        if b.bias is not None:
            A = A[:-1, :-1]
        if b.transposed:
            G, A = A, G

        def floored(X):
            e, Q = torch.linalg.eigh(X)
            return Q @ torch.diag(e.clamp_min(e.max() * 1e-6)) @ Q.T

        CG, CA = torch.linalg.cholesky(floored(G)), torch.linalg.cholesky(floored(A))
        X = CG.T @ M[b.name].reshape(-1, m, k) @ CA
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
        Xr = (U[..., :rank] * S[:, None, :rank]) @ Vh[:, :rank]
        out[b.name] = (torch.linalg.inv(CG.T) @ Xr @ torch.linalg.inv(CA)).flatten(1)
    return out


@pytest.mark.parametrize("strategy", ["diagonal", "kfac", "ekfac"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
@pytest.mark.parametrize("folded", [False, True])
def test_fisher_norm_truncation(name, strategy, folded):
    problem = PROBLEMS[name]
    model = problem.model()
    train = problem.train(4)
    influence = fit(
        model,
        problem.make_loss("mean"),
        train,
        strategy,
        damping=0.1,
        fisher="type-2",
        separate_weight_and_bias=not folded,
    )
    ref = Reference(problem, model)
    shapes = dict(zip(ref.names, ref.shapes))
    rows = ref.query_rows()
    M = _weighted_reference(influence, influence.precondition(rows), shapes, 1)
    expected = torch.cat([M[n] for n in ref.names], dim=1) @ ref.train_grads().T
    got = influence.scores(problem.query(2), train, query_rank=1)
    assert torch.allclose(got, expected, atol=1e-9 * expected.abs().max(), rtol=0)


def test_fisher_norm_is_frobenius_for_identity():
    problem = PROBLEMS["gpt"]
    train = problem.train(4)
    influence = fit(problem.model(), problem.make_loss("mean"), train, "identity")
    query = problem.query(2)
    a = influence.scores(query, train, query_rank=1)
    b = influence.scores(query, train, query_rank=1, query_rank_norm="frobenius")
    assert torch.equal(a, b)
