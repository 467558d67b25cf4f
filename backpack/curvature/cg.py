"""Batched (preconditioned) conjugate gradients for symmetric positive definite systems.

`conjugate_gradients(apply, B)` solves `S X = B` for the K columns of `B` at once. Each column has
its own step sizes; every iteration makes one call of `apply` on the columns still running, so
for the data-set operators one sweep over the data per iteration serves all K right-hand sides.
The operators' `inverse(damping)` (`CGInverse` in `backpack.curvature.operators`) builds on it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CGInfo", "NotPositiveDefiniteError", "conjugate_gradients"]


@dataclass
class CGInfo:
    """What a solve did.

    Attributes:
        iterations: Calls of the system's product (sweeps over the data) it took.
        residuals: Final relative residual `‖b − S x‖ / ‖b‖` of each column (from the
            recurrence), shape `[K]`.
        converged: Whether every column reached the tolerance.
    """

    iterations: int
    residuals: Tensor
    converged: bool


class NotPositiveDefiniteError(ValueError):
    """Conjugate gradients met a direction of non-positive curvature."""


def conjugate_gradients(
    apply: Callable[[Tensor], Tensor],
    B: Tensor,
    tol: float = 1e-6,
    max_iter: int = 1000,
    preconditioner: Callable[[Tensor], Tensor] | None = None,
    name: str = "the system",
    total: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, CGInfo]:
    """Solve `S X = B` column by column by (preconditioned) conjugate gradients, batched.

    From `x_0 = 0`, with residual `r = b − S x`, preconditioned residual `z = M r` and search
    direction `p` (initially `z`), each iteration and column steps `x += α p`, `r −= α S p` with
    `α = rᵀz / pᵀSp`, then `p = z_new + β p` with `β = r_newᵀz_new / rᵀz`. A column stops once
    `‖r‖ ≤ tol · ‖b‖`.

    Args:
        apply: `V ↦ S V` on `[P, k]` matrices (S symmetric positive definite).
        B: Right-hand sides `[P, K]`.
        tol: Relative residual at which a column stops.
        max_iter: Most iterations (a warning if some column has not converged by then).
        preconditioner: `R ↦ M R` with M symmetric positive definite, M ≈ S⁻¹; None for plain CG.
        name: How to call S in messages.
        total: Sums per-column partial inner products over the parts of the vectors held
            elsewhere (the ranks of an FSDP2 model, whose rows each rank holds); None when
            the columns are whole.

    Returns:
        The solutions `[P, K]` and a `CGInfo`.

    Raises:
        NotPositiveDefiniteError: When `pᵀ S p ≤ 0` for a search direction (S is not positive
            definite) or `rᵀ M r < 0` (the preconditioner is not).
    """

    def colsum(t: Tensor) -> Tensor:
        return t.sum(0) if total is None else total(t.sum(0))

    def colnorm(t: Tensor) -> Tensor:
        return t.norm(dim=0) if total is None else total(t.square().sum(0)).sqrt()

    X = torch.zeros_like(B)
    norms = colnorm(B)
    tiny = torch.finfo(B.dtype).tiny
    target = tol * norms
    R = B.clone()

    def precondition(residual: Tensor) -> Tensor:
        if preconditioner is None:
            return residual
        Z = preconditioner(residual).to(residual)
        if bool((colsum(residual * Z) < 0).any()):
            raise NotPositiveDefiniteError(
                f"rᵀMr < 0 in conjugate gradients on {name}: the preconditioner is not "
                "positive definite."
            )
        return Z

    Z = precondition(R)
    Pdir = Z.clone()
    rz = colsum(R * Z)
    active = colnorm(R) > target
    iterations = 0
    while bool(active.any()) and iterations < max_iter:
        idx = active.nonzero().flatten()
        Pa = Pdir[:, idx]
        SPa = apply(Pa)
        iterations += 1
        curvature = colsum(Pa * SPa)
        if bool((curvature <= 0).any()):
            raise NotPositiveDefiniteError(
                f"pᵀSp = {float(curvature.min()):.3g} ≤ 0 met by conjugate gradients on {name}: "
                "the system is not positive definite."
            )
        alpha = rz[idx] / curvature
        X[:, idx] += alpha * Pa
        R[:, idx] -= alpha * SPa
        Za = precondition(R[:, idx])
        rz_new = colsum(R[:, idx] * Za)
        Pdir[:, idx] = Za + rz_new / rz[idx].clamp(min=tiny) * Pa
        rz[idx] = rz_new
        active[idx] = colnorm(R[:, idx]) > target[idx]
    residuals = colnorm(R) / norms.clamp(min=tiny)
    info = CGInfo(iterations, residuals, not bool(active.any()))
    if not info.converged:
        warnings.warn(
            f"Conjugate gradients on {name} did not reach tol={tol:g} in {max_iter} iterations "
            f"(largest relative residual {float(residuals.max()):.3g}); raise max_iter or the "
            "damping, or pass a preconditioner.",
            stacklevel=3,
        )
    return X, info
