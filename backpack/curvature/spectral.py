"""Spectral density of a symmetric operator by stochastic Lanczos quadrature.

The spectral density of a symmetric `[P, P]` matrix A is `φ(t) = (1/P) Σ_i δ(t − λ_i)`. For a
random unit vector v with `E[v vᵀ] = I/P`, `E[vᵀ f(A) v] = (1/P) Σ_i f(λ_i) = ∫ f φ`. Lanczos
from v, after m steps, gives a tridiagonal `T_m` with eigenpairs `(θ_k, s_k)`; the Gauss
quadrature `Σ_k τ_k f(θ_k)` with `τ_k = (e_1ᵀ s_k)²` equals `vᵀ f(A) v` for every polynomial f of
degree below `2m`. Averaging over L probes gives nodes θ and weights `τ/L` (summing to 1), and
the density is that discrete measure broadened by Gaussians of width σ.

Here the L probes run together: each Lanczos step is one product of A with an `[P, L]` matrix,
so one sweep over the data per step for all probes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from backpack.curvature.estimators import _draw, _info, _norm, _reusing, _size, _total

__all__ = ["lanczos_quadrature", "spectral_density", "slq_logdet"]


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def lanczos_quadrature(
    op: Any,
    num_probes: int,
    num_steps: int,
    seed: int = 0,
    distribution: str = "rademacher",
) -> tuple[Tensor, Tensor]:
    """Nodes and weights of stochastic Lanczos quadrature, `[L, m]` each.

    Probe l is column l of the seeded random `[P, L]` matrix (Rademacher or Gaussian), normalised.
    Lanczos runs `m = min(num_steps, P)` steps from each probe, with full reorthogonalisation (in
    the operator's dtype). A probe whose Krylov space becomes invariant stops early (its Gauss
    quadrature is then exact for every f); its remaining entries have weight 0.

    For probe l, `Σ_k weights[l, k] · nodes[l, k]^j = vᵀ A^j v / (L ‖v‖²)` for `j < 2m`; so
    `Σ weights = 1` and `Σ weights · nodes` is an unbiased estimate of `tr(A) / P`. With m = P the
    nodes of each probe are A's distinct eigenvalues.

    Args:
        op: A symmetric operator or dense matrix `[P, P]`.
        num_probes: L, the number of random start vectors.
        num_steps: m, Lanczos steps per probe.
        seed: Seed of the probes (a private generator; the global RNG is untouched).
        distribution: "rademacher" or "normal".

    Returns:
        `nodes` and `weights`, both `[L, m]`; the weights of all probes sum to 1.

    Cost: m products with `[P, L']` matrices, `L' ≤ L` the probes still running (m sweeps over
    the data); memory `m · P · L` for the Lanczos bases.
    """
    _check_positive("num_probes", num_probes)
    _check_positive("num_steps", num_steps)
    local, dtype, device = _info(op)
    size = _size(op)
    steps = min(num_steps, size)
    V = _draw(op, num_probes, seed, distribution)
    basis = torch.zeros(steps + 1, local, num_probes, dtype=dtype, device=device)
    basis[0] = V / _norm(op, V, dim=0)
    alphas = torch.zeros(steps, num_probes, dtype=dtype, device=device)
    betas = torch.zeros(steps, num_probes, dtype=dtype, device=device)
    lengths = torch.full((num_probes,), steps, dtype=torch.long)
    active = torch.ones(num_probes, dtype=torch.bool)
    eps = torch.finfo(dtype).eps
    with _reusing(op):
        for j in range(steps):
            idx = active.nonzero().flatten()
            if idx.numel() == 0:
                break
            W = op @ basis[j][:, idx]
            alphas[j, idx] = _total(op, (basis[j][:, idx] * W).sum(0))
            previous = basis[: j + 1][:, :, idx]
            for _ in range(2):  # full reorthogonalisation, twice is enough
                coefficients = _total(op, torch.einsum("kpl,pl->kl", previous, W))
                W = W - torch.einsum("kpl,kl->pl", previous, coefficients)
            beta = _norm(op, W, dim=0)
            betas[j, idx] = beta
            if j + 1 == steps:
                break
            scale = torch.cat([alphas[: j + 1, idx].abs(), betas[: j + 1, idx]]).amax(0)
            done = beta <= eps * size * scale.clamp(min=torch.finfo(dtype).tiny)
            for local, column in enumerate(idx.tolist()):
                if bool(done[local]):
                    active[column] = False
                    lengths[column] = j + 1
                else:
                    basis[j + 1][:, column] = W[:, local] / beta[local]
    nodes = torch.zeros(num_probes, steps, dtype=dtype, device=device)
    weights = torch.zeros(num_probes, steps, dtype=dtype, device=device)
    for column in range(num_probes):
        n = int(lengths[column])
        T = torch.diag(alphas[:n, column])
        if n > 1:
            off = betas[: n - 1, column]
            T = T + torch.diag(off, 1) + torch.diag(off, -1)
        theta, vectors = torch.linalg.eigh(T)
        nodes[column, :n] = theta
        weights[column, :n] = vectors[0].square() / num_probes
    return nodes, weights


def spectral_density(
    op: Any,
    num_probes: int,
    num_steps: int,
    grid: Tensor | int | None = None,
    sigma: float | None = None,
    seed: int = 0,
    distribution: str = "rademacher",
) -> tuple[Tensor, Tensor]:
    """A Gaussian-broadened estimate of the spectral density of A, by stochastic Lanczos quadrature.

    `density(t) = Σ_{l,k} w_lk · exp(−(t − θ_lk)² / (2σ²)) / (σ √(2π))` with the nodes θ and
    weights w of `lanczos_quadrature` (the weights sum to 1, so the density integrates to 1 over
    the real line; over the default grid up to `1e-6`). Its mean is an unbiased estimate of
    `tr(A)/P`; its moments of order j < 2m match A's (`tr(A^j)/P`) in expectation over the
    probes. The density of eigenvalues, not their count: multiply by P for the number of
    eigenvalues per unit.

    Args:
        op: A symmetric operator or dense matrix `[P, P]`.
        num_probes: L, random start vectors (the variance of the estimate falls like 1/L).
        num_steps: m, Lanczos steps per probe (the resolution of the spectrum: about m nodes
            per probe, the extreme eigenvalues found first).
        grid: The points t `[G]`; or their number (default 1000) on the default range: the
            nodes' range widened by `5σ` on both sides.
        sigma: Width of the Gaussians (default: 1% of the nodes' range, or `0.01·max(|θ|, 1)` when
            all nodes coincide). Widths below the node spacing show the nodes as spikes.
        seed: Seed of the probes.
        distribution: "rademacher" or "normal" probes.

    Returns:
        `(grid, density)`, both `[G]` in the operator's dtype.

    Cost: as `lanczos_quadrature`: m sweeps over the data, each a product with `[P, L]`.
    """
    nodes, weights = lanczos_quadrature(op, num_probes, num_steps, seed, distribution)
    used = nodes[weights > 0]
    if used.numel() == 0:  # only for a zero probe weight everywhere (not reachable in practice)
        used = nodes.flatten()
    low, high = float(used.min()), float(used.max())
    if sigma is None:
        spread = high - low
        sigma = 0.01 * spread if spread > 0 else 0.01 * max(abs(low), abs(high), 1.0)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
        raise ValueError(f"sigma must be a positive number, got {sigma!r}.")
    if grid is None or isinstance(grid, int):
        points = 1000 if grid is None else grid
        _check_positive("grid", points)
        grid = torch.linspace(
            low - 5 * sigma, high + 5 * sigma, points, dtype=nodes.dtype, device=nodes.device
        )
    else:
        grid = torch.as_tensor(grid, dtype=nodes.dtype, device=nodes.device).flatten()
    flat_nodes, flat_weights = nodes.flatten(), weights.flatten()
    density = torch.zeros_like(grid)
    chunk = max(1, 2**22 // max(flat_nodes.numel(), 1))
    norm = 1.0 / (sigma * math.sqrt(2 * math.pi))
    for start in range(0, grid.numel(), chunk):
        t = grid[start : start + chunk, None]
        gauss = torch.exp(-0.5 * ((t - flat_nodes) / sigma) ** 2)
        density[start : start + chunk] = norm * (gauss @ flat_weights)
    return grid, density


def slq_logdet(
    op: Any,
    damping: float = 0.0,
    num_probes: int = 30,
    num_steps: int = 30,
    seed: int = 0,
    distribution: str = "rademacher",
) -> Tensor:
    """An estimate of `log det(A + λI)` for a symmetric positive semi-definite operator A.

    `log det(A + λI) = tr log(A + λI) = P · ∫ log(t + λ) φ(t) dt`, with the nodes θ and weights w
    of `lanczos_quadrature`: `P · Σ_{l,k} w_lk log(θ_lk + λ)`. Unbiased over the probes up to the
    quadrature error, which falls quickly with m for a well-conditioned `A + λI` (the log is
    smooth on its spectrum). For the exact operators (`GGN`, `EmpiricalFisher`), where no
    closed form exists: the Laplace approximation's evidence needs `log det(GGN + prior)`. The
    structured operators (`KFAC`, `EKFAC`) have the exact `op.logdet(damping)` instead.

    Args:
        op: A symmetric positive semi-definite operator or dense matrix `[P, P]`.
        damping: λ ≥ 0 added to the diagonal (the prior precision of a Laplace approximation).
        num_probes: L, random start vectors (the estimate's variance falls like 1/L).
        num_steps: m, Lanczos steps per probe.
        seed: Seed of the probes.
        distribution: "rademacher" or "normal" probes.

    Returns:
        A scalar tensor in the operator's dtype.

    Raises:
        ValueError: If a node θ + λ is not positive (A + λI is not positive definite: raise
            `damping`).

    Cost: as `lanczos_quadrature`: m sweeps over the data, each a product with `[P, L]`.
    """
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or damping < 0:
        raise ValueError(f"damping must be a number >= 0, got {damping!r}.")
    size = _size(op)
    nodes, weights = lanczos_quadrature(op, num_probes, num_steps, seed, distribution)
    shifted = nodes + damping
    used = weights > 0
    smallest = float(shifted[used].min()) if bool(used.any()) else 1.0
    scale = float(nodes[used].abs().max()) if bool(used.any()) else 1.0
    if smallest <= torch.finfo(nodes.dtype).eps * max(scale, 1.0):
        raise ValueError(
            f"slq_logdet: A + {damping}·I has a Ritz value {smallest:.3g} <= 0, so it is not "
            "positive definite (log det undefined). Pass a larger damping."
        )
    logs = torch.where(used, shifted.clamp_min(torch.finfo(nodes.dtype).tiny).log(), 0.0)
    return size * (weights * logs).sum()
