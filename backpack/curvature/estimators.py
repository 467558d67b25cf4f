"""Randomised and Krylov estimators on any symmetric operator (`op @ V` and `op.shape`).

`op` is a curvature operator of `backpack.curvature` or a dense symmetric tensor. Costs are
counted in matrix-vector products with `op`; for the data-set operators, a product with a
`[P, K]` matrix is one sweep over the data, so the number of sweeps is given too.

On an operator of a model sharded with FSDP2 (`op.sharded`), vectors are this rank's local
shards: every rank draws the same random vectors as one process with the same seed and keeps
its rows, inner products are summed over the ranks, and results that are vectors (diagonals,
eigenvectors) are this rank's rows. Every rank must call the estimator (it is a collective).
Estimators that orthogonalise blocks of vectors (`hutchpp_trace`, `xtrace`, `xdiag`) take their
thin QR over the ranks (`_qr`, TSQR: one exchange of small `R` factors), so that every rank
holds its rows of `Q` and the whole `R`, as one process would.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "eigvalsh",
    "hutchinson_trace",
    "hutchinson_diagonal",
    "hutchpp_trace",
    "xtrace",
    "xdiag",
]


def _info(op: Any) -> tuple[int, torch.dtype, torch.device]:
    if isinstance(op, Tensor):
        if op.dim() != 2 or op.shape[0] != op.shape[1]:
            raise ValueError(f"Need a square matrix, got shape {tuple(op.shape)}.")
        return op.shape[0], op.dtype, op.device
    return op.shape[0], op.dtype, op.device


def _reusing(op: Any) -> AbstractContextManager:
    """The operator's `cached()` block (products inside it reuse work, e.g. Hessian graphs)."""
    cached = None if isinstance(op, Tensor) else getattr(op, "cached", None)
    return cached() if callable(cached) else nullcontext()


def _random(size: int, columns: int, seed: int, distribution: str, dtype, device) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    if distribution == "rademacher":
        v = torch.randint(0, 2, (size, columns), generator=generator).to(torch.float64) * 2 - 1
    elif distribution == "normal":
        v = torch.randn(size, columns, generator=generator, dtype=torch.float64)
    else:
        raise ValueError(f"distribution must be 'rademacher' or 'normal', got {distribution!r}.")
    return v.to(dtype=dtype, device=device)


def _sharded(op: Any) -> bool:
    """Whether `op`'s vectors are this rank's shards of an FSDP2 model (see `CurvatureOperator`)."""
    return not isinstance(op, Tensor) and bool(getattr(op, "sharded", False))


def _size(op: Any) -> int:
    """P: the length of the (global) vectors `op` multiplies."""
    return int(op.global_size) if _sharded(op) else _info(op)[0]


def _draw(op: Any, columns: int, seed: int, distribution: str) -> Tensor:
    """The seeded random `[P, columns]` matrix, or this rank's rows of it on a sharded `op`.

    On a sharded operator every rank draws the whole matrix (on the host) and keeps its rows,
    so the vectors are those of one process with the same seed.
    """
    size, dtype, device = _info(op)
    if not _sharded(op):
        return _random(size, columns, seed, distribution, dtype, device)
    full = _random(op.global_size, columns, seed, distribution, dtype, torch.device("cpu"))
    return op.local_rows(full).to(device=device).contiguous()


def _total(op: Any, t: Tensor) -> Tensor:
    """A partial sum over this rank's rows, summed over the ranks on a sharded `op`."""
    return op.sum_over_ranks(t) if _sharded(op) else t


def _norm(op: Any, v: Tensor, dim: int | None = None) -> Tensor:
    """The (column) norm of a vector of `op`, over all ranks' rows on a sharded `op`."""
    if not _sharded(op):
        return v.norm() if dim is None else v.norm(dim=dim)
    squares = v.square().sum() if dim is None else v.square().sum(dim)
    return op.sum_over_ranks(squares).sqrt()


def _qr(op: Any, Y: Tensor) -> tuple[Tensor, Tensor]:
    """Thin QR `Y = Q R`; on a sharded `op`, of this rank's rows of Y: its rows of Q, R whole.

    TSQR: each rank factors its rows, `Y_r = Q_r R_r`; the ranks' `R_r` stacked in rank order
    are factored once more, `[R_0; R_1; …] = Q̃ R`, and rank r's rows of Q are `Q_r Q̃_r` (`Q̃_r`
    its rows of Q̃). Q's columns are orthonormal, since those of the block diagonal `diag(Q_r)`
    and of Q̃ are, and every rank computes the same R from the same stacked matrix.
    """
    if not _sharded(op):
        return torch.linalg.qr(Y)
    local_q, local_r = torch.linalg.qr(Y)
    stacked, start = op.stack_over_ranks(local_r)
    outer_q, R = torch.linalg.qr(stacked)
    return local_q @ outer_q[start : start + local_r.shape[0]], R


def _dot(op: Any, A: Tensor, B: Tensor) -> Tensor:
    """`Aᵀ B` of two matrices of `op`'s vectors (summed over the ranks on a sharded `op`)."""
    return _total(op, A.T @ B)


def _check_count(num_matvecs: int, minimum: int = 1) -> None:
    if isinstance(num_matvecs, bool) or not isinstance(num_matvecs, int) or num_matvecs < minimum:
        raise ValueError(f"num_matvecs must be an integer >= {minimum}, got {num_matvecs!r}.")


def hutchinson_trace(
    op: Any, num_matvecs: int, seed: int = 0, distribution: str = "rademacher"
) -> Tensor:
    """Hutchinson's estimate `(1/m) Σ_i v_iᵀ A v_i` of `tr(A)`, with random `v_i`.

    Unbiased; with Rademacher vectors its variance is `2 (‖A‖_F² − Σ_i A_ii²) / m`.

    Args:
        op: A symmetric operator or dense matrix `[P, P]`.
        num_matvecs: m, the number of random vectors.
        seed: Seed of the vectors (a private generator; the global RNG is untouched).
        distribution: "rademacher" (±1) or "normal".

    Cost: m matrix-vector products, in one product with a `[P, m]` matrix (one sweep).
    """
    _check_count(num_matvecs)
    V = _draw(op, num_matvecs, seed, distribution)
    return _total(op, (V * (op @ V)).sum()) / num_matvecs


def hutchinson_diagonal(
    op: Any, num_matvecs: int, seed: int = 0, distribution: str = "rademacher"
) -> Tensor:
    """Hutchinson's estimate `(1/m) Σ_i v_i ⊙ A v_i` of `diag(A)`.

    Unbiased; with Rademacher vectors entry j has variance `(Σ_k A_jk² − A_jj²) / m`.

    Args: as `hutchinson_trace`.

    Cost: m matrix-vector products, in one product with a `[P, m]` matrix (one sweep).
    """
    _check_count(num_matvecs)
    V = _draw(op, num_matvecs, seed, distribution)
    return (V * (op @ V)).sum(1) / num_matvecs


def hutchpp_trace(
    op: Any, num_matvecs: int, seed: int = 0, distribution: str = "rademacher"
) -> Tensor:
    """Hutch++ (Meyer, Musco, Musco and Woodruff, 2021) estimate of `tr(A)`.

    With `s = num_matvecs // 3`: `Q` an orthonormal basis of `A S` for a random `[P, s]` S;
    estimate `tr(Qᵀ A Q) + tr(Gᵀ (I − QQᵀ) A (I − QQᵀ) G) / r` for a random `[P, r]` G,
    `r = num_matvecs − 2s`. The low-rank part is exact, so the estimate is exact once
    `s ≥ rank(A)` (in particular for `s ≥ P`); for PSD matrices its relative error decays like
    `1/m` rather than Hutchinson's `1/√m`.

    Args: as `hutchinson_trace` (num_matvecs >= 3).

    Cost: num_matvecs matrix-vector products in two products (two sweeps): `A S` (s columns),
    then `A [Q, (I − QQᵀ) G]` (`min(s, P) + r` columns).
    """
    _check_count(num_matvecs, minimum=3)
    s = num_matvecs // 3
    r = num_matvecs - 2 * s
    S = _draw(op, s, seed, distribution)
    G = _draw(op, r, seed + 1, distribution)
    with _reusing(op):
        Q, _ = _qr(op, op @ S)
        G = G - Q @ _dot(op, Q, G)
        both = op @ torch.cat([Q, G], dim=1)
    AQ, AG = both[:, : Q.shape[1]], both[:, Q.shape[1] :]
    return _total(op, (Q * AQ).sum() + (G * AG).sum() / r)


def _leave_one_out(op: Any, num_matvecs: int, seed: int, distribution: str):
    """The shared sketch of `xtrace` and `xdiag`, with a basis of every leave-one-out range.

    With `s = num_matvecs // 2` random test vectors `Ω = [ω_1 … ω_s]`: `Y = A Ω = Q R` (thin QR),
    `Z = A Q`. For each i, `Q_(i) = Q B_i` is an orthonormal basis of the range of `Y` without
    its column i: `Y_{−i} = Q R_{−i}`, so `B_i` holds the left singular vectors of `R_{−i}`
    (these are `Y_{−i}`'s, rotated by `Qᵀ`) whose singular values exceed `eps^(3/4)` times the
    largest. `Q_(i)` depends on the other test vectors only, never on `ω_i`.

    Returns:
        `Ω`, `Y`, `Q`, `Z`, `R` and the list of the `B_i`.
    """
    _check_count(num_matvecs, minimum=2)
    s = num_matvecs // 2
    Omega = _draw(op, s, seed, distribution)
    with _reusing(op):
        Y = op @ Omega
        Q, R = _qr(op, Y)
        Z = op @ Q
    threshold = torch.finfo(Omega.dtype).eps ** 0.75
    bases = []
    for i in range(s):
        rest = torch.cat([R[:, :i], R[:, i + 1 :]], dim=1)
        if rest.shape[1] == 0:
            bases.append(R.new_zeros(R.shape[0], 0))
            continue
        U, sigma, _ = torch.linalg.svd(rest, full_matrices=False)
        rank = int((sigma > threshold * sigma[0]).sum()) if bool(sigma[0] > 0) else 0
        bases.append(U[:, :rank])
    return Omega, Y, Q, Z, R, bases


def xtrace(op: Any, num_matvecs: int, seed: int = 0, return_std: bool = False) -> Any:
    """XTrace (Epperly, Tropp and Webber, 2024): an exchangeable estimate of `tr(A)`.

    Every test vector serves both as a sketch of A's range and as a Hutchinson probe, in turn.
    With `s = num_matvecs // 2` Gaussian test vectors `ω_1, …, ω_s`, let `Q_(i)` be an
    orthonormal basis of the range of the products `A ω_j` with `j ≠ i` (all but the i-th),
    `Π_i = I − Q_(i) Q_(i)ᵀ` the projection onto its complement, of rank `d_i = P − rank(Q_(i))`,
    and `x_i = √d_i · Π_i ω_i / ‖Π_i ω_i‖`. The estimate is the mean over i of
    `t_i = tr(Q_(i)ᵀ A Q_(i)) + x_iᵀ A x_i`.

    Since `ω_i` is independent of `Q_(i)` and `x_i` is uniform on the sphere of radius `√d_i` in
    `Π_i`'s range (`E[x_i x_iᵀ] = Π_i`), each `t_i` is unbiased: `E[x_iᵀ A x_i] =
    tr(Π_i A Π_i) = tr(A) − tr(Q_(i)ᵀ A Q_(i))`. It is exact (up to rounding) once A's rank is at
    most `s − 1` (then `Π_i A = 0`), and for a decaying spectrum the error falls like Hutch++'s,
    with a smaller constant (every vector feeds the low-rank part).

    Args:
        op: A symmetric operator or dense matrix `[P, P]`.
        num_matvecs: m >= 2: the budget of matrix-vector products (an odd m uses m − 1).
        seed: Seed of the test vectors (a private generator; the global RNG is untouched).
        return_std: Also return the standard error `std(t_i) / √s` of the mean, an estimate of
            the error from the same products.

    Returns:
        The estimate (and its standard error).

    Cost: `2s` matrix-vector products in two products with `[P, s]` matrices (two sweeps over
    the data): `A Ω`, then `A Q`. Besides: a QR of `[P, s]`, `s` SVDs of `[s, s − 1]` and
    `O(P s²)` arithmetic.
    """
    Omega, Y, Q, Z, R, bases = _leave_one_out(op, num_matvecs, seed, "normal")
    size = _size(op)
    T = _dot(op, Q, Z)
    T = (T + T.T) / 2
    G = _dot(op, Q, Omega)
    low = torch.stack([(B * (T @ B)).sum() for B in bases])
    C = torch.stack([B @ (B.T @ G[:, i]) for i, B in enumerate(bases)], dim=1)
    W = Omega - Q @ C  # Π_i ω_i, column by column
    AW = Y - Z @ C  # A Π_i ω_i
    dims = torch.tensor([size - B.shape[1] for B in bases], dtype=Omega.dtype, device=Y.device)
    norms = _total(op, W.square().sum(0))
    tiny = torch.finfo(Omega.dtype).tiny
    residual = torch.where(
        (dims > 0) & (norms > tiny), _total(op, (W * AW).sum(0)) * dims / norms.clamp(min=tiny), 0.0
    )
    estimates = low + residual
    estimate = estimates.mean()
    if not return_std:
        return estimate
    s = estimates.numel()
    std = estimates.std() / s**0.5 if s > 1 else torch.full_like(estimate, float("inf"))
    return estimate, std


def xdiag(op: Any, num_matvecs: int, seed: int = 0, distribution: str = "rademacher") -> Tensor:
    """An exchangeable estimate of `diag(A)`, in the spirit of XDiag (Epperly, Tropp, Webber).

    As `xtrace`, each of the `s = num_matvecs // 2` test vectors is used in turn as the probe
    while the others sketch A's range. With `Q_(i)` the orthonormal basis of the range of the
    products `A ω_j` with `j ≠ i`, the estimate is the mean over i of
    `d_i = diag(Q_(i) Q_(i)ᵀ A) + ω_i ⊙ (I − Q_(i) Q_(i)ᵀ) A ω_i`.

    The first term is computed exactly; the second is Hutchinson's diagonal estimator of
    `(I − Q_(i)Q_(i)ᵀ) A`, unbiased because `ω_i` is independent of `Q_(i)`. So the estimate is
    unbiased, exact (up to rounding) once A's rank is at most `s − 1`, and for a decaying
    spectrum far more accurate than `hutchinson_diagonal` with as many products.

    Args:
        op: A symmetric operator or dense matrix `[P, P]`.
        num_matvecs: m >= 2, the budget of matrix-vector products (an odd m uses m − 1).
        seed: Seed of the test vectors.
        distribution: "rademacher" (±1) or "normal".

    Cost: `2s` matrix-vector products in two products with `[P, s]` matrices (two sweeps): `A Ω`,
    then `A Q`; besides a QR of `[P, s]`, `s` SVDs of `[s, s − 1]` and `O(P s²)` arithmetic.
    """
    Omega, Y, Q, Z, R, bases = _leave_one_out(op, num_matvecs, seed, distribution)
    s = Omega.shape[1]
    # mean_i diag(Q B_i B_iᵀ Qᵀ A) = diag(Q M Zᵀ) with M the mean of the B_i B_iᵀ (A symmetric)
    M = sum(B @ B.T for B in bases) / s
    low = ((Q @ M) * Z).sum(1)
    # (I − Q_(i)Q_(i)ᵀ) A ω_i = y_i − Q B_i B_iᵀ r_i, since Qᵀ y_i = r_i
    C = torch.stack([B @ (B.T @ R[:, i]) for i, B in enumerate(bases)], dim=1)
    residual = (Omega * (Y - Q @ C)).mean(1)
    return low + residual


def eigvalsh(
    op: Any,
    k: int = 1,
    return_eigenvectors: bool = False,
    seed: int = 0,
    max_iter: int | None = None,
    tol: float = 1e-8,
) -> Tensor | tuple[Tensor, Tensor]:
    """The k largest (algebraic) eigenvalues of a symmetric operator, by Lanczos.

    Lanczos with full reorthogonalisation (in the operator's dtype; use float64 for accuracy)
    from a seeded random start. After each step the Ritz pairs of the tridiagonal matrix are
    checked: it stops when the residuals `‖A y − θ y‖ = β_m |e_mᵀ s|` of the top k are all below
    `tol · max|θ|`, or after `max_iter` steps (default `min(P, max(20·k, 100))`), or when the
    Krylov space is invariant (then the top k are exact up to rounding). After P steps the
    results are exact whatever the start.

    Args:
        op: A symmetric operator or dense matrix `[P, P]`.
        k: How many eigenvalues.
        return_eigenvectors: Also return the eigenvectors `[P, k]`.
        seed: Seed of the start vector.
        max_iter: Most Lanczos steps.
        tol: Relative residual tolerance.

    Returns:
        The eigenvalues `[k]`, largest first (and the eigenvectors `[P, k]`, column i for
        eigenvalue i).

    Cost: one matrix-vector product (one sweep) per step; at most `max_iter` steps, typically a
    few times k for well-separated top eigenvalues.
    """
    local, dtype, device = _info(op)
    size = _size(op)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= size:
        raise ValueError(f"k must be an integer in [1, {size}], got {k!r}.")
    steps = max_iter if max_iter is not None else min(size, max(20 * k, 100))
    steps = max(min(steps, size), k)
    basis = torch.empty(local, steps + 1, dtype=dtype, device=device)
    v = _draw(op, 1, seed, "normal")[:, 0]
    basis[:, 0] = v / _norm(op, v)
    with _reusing(op):
        values, vectors, m = _lanczos_top(op, basis, k, tol, seed)
    eigenvalues = values.flip(0)[:k]
    if not return_eigenvectors:
        return eigenvalues
    ritz = basis[:, :m] @ vectors.flip(1)[:, :k]
    return eigenvalues, ritz


def _lanczos_top(op: Any, basis: Tensor, k: int, tol: float, seed: int) -> tuple:
    """Lanczos steps into `basis` (column 0 the start) until the top k Ritz pairs converge.

    Returns `(θ, S, m)`: the eigenpairs of the `m x m` tridiagonal `T_m`.
    """
    size, dtype, device = _size(op), basis.dtype, basis.device
    steps = basis.shape[1] - 1
    alphas: list[Tensor] = []
    betas: list[Tensor] = []
    values = vectors = None
    for j in range(steps):
        w = op @ basis[:, j]
        alpha = _total(op, basis[:, j] @ w)
        # full reorthogonalisation (twice is enough)
        for _ in range(2):
            w = w - basis[:, : j + 1] @ _total(op, basis[:, : j + 1].T @ w)
        beta = _norm(op, w)
        alphas.append(alpha)
        T = torch.diag(torch.stack(alphas))
        if betas:
            off = torch.stack(betas)
            T = T + torch.diag(off, 1) + torch.diag(off, -1)
        values, vectors = torch.linalg.eigh(T)
        top = min(k, j + 1)
        residual = (beta * vectors[-1, -top:]).abs()
        scale = values.abs().max().clamp(min=torch.finfo(dtype).tiny)
        invariant = beta <= torch.finfo(dtype).eps * scale * size
        if j + 1 >= k and (invariant or bool((residual <= tol * scale).all())):
            break
        if invariant:  # restart in the orthogonal complement (fewer than k found so far)
            w = _draw(op, 1, seed + j + 1, "normal")[:, 0]
            for _ in range(2):
                w = w - basis[:, : j + 1] @ _total(op, basis[:, : j + 1].T @ w)
            beta = torch.zeros((), dtype=dtype, device=device)
            basis[:, j + 1] = w / _norm(op, w)
            betas.append(beta)
            continue
        betas.append(beta)
        basis[:, j + 1] = w / beta
    return values, vectors, len(alphas)
