"""Randomised and Krylov estimators on any symmetric operator (`op @ V` and `op.shape`).

`op` is a curvature operator of `backpack.curvature` or a dense symmetric tensor. Costs are
counted in matrix-vector products with `op`; for the data-set operators, a product with a
`[P, K]` matrix is one sweep over the data, so the number of sweeps is given too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["eigvalsh", "hutchinson_trace", "hutchinson_diagonal", "hutchpp_trace"]


def _info(op: Any) -> tuple[int, torch.dtype, torch.device]:
    if isinstance(op, Tensor):
        if op.dim() != 2 or op.shape[0] != op.shape[1]:
            raise ValueError(f"Need a square matrix, got shape {tuple(op.shape)}.")
        return op.shape[0], op.dtype, op.device
    return op.shape[0], op.dtype, op.device


def _random(size: int, columns: int, seed: int, distribution: str, dtype, device) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    if distribution == "rademacher":
        v = torch.randint(0, 2, (size, columns), generator=generator).to(torch.float64) * 2 - 1
    elif distribution == "normal":
        v = torch.randn(size, columns, generator=generator, dtype=torch.float64)
    else:
        raise ValueError(f"distribution must be 'rademacher' or 'normal', got {distribution!r}.")
    return v.to(dtype=dtype, device=device)


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
    size, dtype, device = _info(op)
    V = _random(size, num_matvecs, seed, distribution, dtype, device)
    return (V * (op @ V)).sum() / num_matvecs


def hutchinson_diagonal(
    op: Any, num_matvecs: int, seed: int = 0, distribution: str = "rademacher"
) -> Tensor:
    """Hutchinson's estimate `(1/m) Σ_i v_i ⊙ A v_i` of `diag(A)`.

    Unbiased; with Rademacher vectors entry j has variance `(Σ_k A_jk² − A_jj²) / m`.

    Args: as `hutchinson_trace`.

    Cost: m matrix-vector products, in one product with a `[P, m]` matrix (one sweep).
    """
    _check_count(num_matvecs)
    size, dtype, device = _info(op)
    V = _random(size, num_matvecs, seed, distribution, dtype, device)
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
    size, dtype, device = _info(op)
    s = num_matvecs // 3
    r = num_matvecs - 2 * s
    S = _random(size, s, seed, distribution, dtype, device)
    G = _random(size, r, seed + 1, distribution, dtype, device)
    Q, _ = torch.linalg.qr(op @ S)
    G = G - Q @ (Q.T @ G)
    both = op @ torch.cat([Q, G], dim=1)
    AQ, AG = both[:, : Q.shape[1]], both[:, Q.shape[1] :]
    return (Q * AQ).sum() + (G * AG).sum() / r


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
    size, dtype, device = _info(op)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= size:
        raise ValueError(f"k must be an integer in [1, {size}], got {k!r}.")
    steps = max_iter if max_iter is not None else min(size, max(20 * k, 100))
    steps = max(min(steps, size), k)
    basis = torch.empty(size, steps + 1, dtype=dtype, device=device)
    alphas: list[Tensor] = []
    betas: list[Tensor] = []
    v = _random(size, 1, seed, "normal", dtype, device)[:, 0]
    basis[:, 0] = v / v.norm()
    values = vectors = None
    for j in range(steps):
        w = op @ basis[:, j]
        alpha = basis[:, j] @ w
        # full reorthogonalisation (twice is enough)
        for _ in range(2):
            w = w - basis[:, : j + 1] @ (basis[:, : j + 1].T @ w)
        beta = w.norm()
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
            w = _random(size, 1, seed + j + 1, "normal", dtype, device)[:, 0]
            for _ in range(2):
                w = w - basis[:, : j + 1] @ (basis[:, : j + 1].T @ w)
            beta = torch.zeros((), dtype=dtype, device=device)
            basis[:, j + 1] = w / w.norm()
            betas.append(beta)
            continue
        betas.append(beta)
        basis[:, j + 1] = w / beta
    m = len(alphas)
    eigenvalues = values.flip(0)[:k]
    if not return_eigenvectors:
        return eigenvalues
    ritz = basis[:, :m] @ vectors.flip(1)[:, :k]
    return eigenvalues, ritz
