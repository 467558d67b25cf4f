"""Preconditioned query gradients kept at low rank, and their products with training gradients.

A query's preconditioned gradient of a matrix parameter (`m × k`: a Linear weight, a
convolution's `C_out × C_in·prod(kernel)`) is replaced by its best rank-r approximation in the
Frobenius norm (truncated SVD, Eckart-Young): `M ≈ U_r S_r V_rᵀ`, stored as `left = U_r`
`[Q, m, r]` and `right = V_r S_r` `[Q, k, r]`. Parameters of one axis (biases, norm layers) and
matrices of rank ≤ r stay exact.

Against a training gradient in factored form `G = Σ_t L_t R_tᵀ` (an "outer" site) the product
needs neither `M` nor `G`:

    ⟨U Wᵀ, Σ_t L_t R_tᵀ⟩ = Σ_t Σ_j (U_jᵀ L_t)(W_jᵀ R_t),

`Q N T r (m + k)` multiply-adds per batch instead of `Q N T m k`. Where forming `M` again (a few
queries at a time) is cheaper, or the training side has no factors, `M` is rebuilt chunk by
chunk and the ordinary products are taken.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from backpack.influence._sites import CHUNK_ENTRIES, Site, dense

__all__ = ["LowRank", "compress", "concat", "fisher_weights"]


class LowRank:
    """The rank-r factors of Q preconditioned query gradients of one matrix parameter.

    `M_q = left_q right_qᵀ` reshaped to `shape`; `left` `[Q, m, r]`, `right` `[Q, k, r]`.
    """

    def __init__(self, shape: tuple, left: Tensor, right: Tensor) -> None:
        self.shape = tuple(shape)
        self.left = left
        self.right = right

    @property
    def num_queries(self) -> int:
        """The number of queries Q."""
        return self.left.shape[0]

    @property
    def rank(self) -> int:
        """The rank r."""
        return self.left.shape[-1]

    def matrices(self, start: int = 0, stop: int | None = None) -> Tensor:
        """`[stop - start, *shape]`: the rank-r matrices of queries `start:stop`."""
        left, right = self.left[start:stop], self.right[start:stop]
        return (left @ right.transpose(1, 2)).reshape(left.shape[0], *self.shape)

    def _chunks(self) -> list[tuple[int, int]]:
        q = self.num_queries
        step = max(1, CHUNK_ENTRIES // max(math.prod(self.shape), 1))
        return [(s, min(s + step, q)) for s in range(0, q, step)]

    def _factored_cost(self, site: Site) -> tuple[int, int]:
        """Multiply-adds of the factored form and of rebuilding `M` (then the cheaper product)."""
        n, t = site.left.shape[:2]
        m, k = self.left.shape[1], self.right.shape[1]
        q, r = self.num_queries, self.rank
        rebuild = q * m * k * r + min(n * t * m * k + q * n * m * k, q * n * t * m * k)
        return q * n * t * r * (m + k), rebuild

    def _factored(self, site: Site) -> Tensor:
        """`[Q, N, T]`: `Σ_j (U_jᵀ L_t)(W_jᵀ R_t)` per query, sample and position."""
        n, t = site.left.shape[:2]
        L, R = site.left.flatten(0, 1), site.right.flatten(0, 1)  # [NT, m], [NT, k]
        per = n * t * self.rank
        out = []
        for a, b in zip(
            self.left.split(max(1, CHUNK_ENTRIES // max(per, 1))),
            self.right.split(max(1, CHUNK_ENTRIES // max(per, 1))),
        ):
            x = torch.matmul(L, a)  # [Q_c, NT, r]
            x.mul_(torch.matmul(R, b))
            out.append(x.sum(-1).view(a.shape[0], n, t))
        return torch.cat(out)

    def products(self, sites: list[Site], per_token: bool) -> Tensor:
        """`[Q, N]` (or `[Q, N, T]` for `per_token`): `⟨M_q, G_n⟩` with a parameter's sites."""
        total: Tensor | None = None
        rest = []
        for site in sites:
            if site.kind == "outer" and _fits(site, self.shape):
                factored, rebuild = self._factored_cost(site)
                if factored <= rebuild:
                    value = self._factored(site)
                    value = value if per_token else value.sum(-1)
                    total = value if total is None else total + value
                    continue
            rest.append(site)
        if rest:
            if per_token:
                parts = []
                for start, stop in self._chunks():
                    M = self.matrices(start, stop)
                    parts.append(sum(s.token_products(M) for s in rest))
                value = torch.cat(parts)
            else:
                g = dense(rest).flatten(1)
                value = torch.cat([self.matrices(s, e).flatten(1) @ g.T for s, e in self._chunks()])
            total = value if total is None else total + value
        return total

    def to(self, dtype: torch.dtype) -> LowRank:
        """The factors in `dtype`."""
        return LowRank(self.shape, self.left.to(dtype), self.right.to(dtype))


def _fits(site: Site, shape: tuple) -> bool:
    """Whether an "outer" site's factors match the matrix `(shape[0], prod(shape[1:]))`."""
    return (
        site.left.shape[-1] == shape[0]
        and site.right.shape[-1] == math.prod(shape[1:])
        and tuple(site.shape) == tuple(shape)
    )


#: the smallest eigenvalue of a weighting factor, relative to its largest
WEIGHT_FLOOR = 1e-6


def compress(
    value: Tensor, shape: tuple, rank: int, weights: Weights | None = None
) -> Tensor | LowRank:
    """Truncate the rows `[Q, numel]` of a parameter of `shape` to rank `rank` (or keep them).

    Without `weights`, the best rank-r matrix in the Frobenius norm (truncated SVD). With
    `weights` `(L, L⁻¹, R, R⁻¹)` (symmetric positive definite, `m × m` and `k × k`), the best
    in the weighted norm `‖L (M − M_r) R‖_F`: `M_r = L⁻¹ [L M R]_r R⁻¹`.

    One-axis parameters and matrices whose smaller side is at most `rank` are returned as they
    are (exact). The SVD runs in float32 for half-precision inputs; the factors come back in the
    input's dtype.
    """
    if len(shape) < 2:
        return value
    m, k = shape[0], math.prod(shape[1:])
    if min(m, k) <= rank:
        return value
    q = value.shape[0]
    work = value.reshape(q, m, k)
    if work.dtype in (torch.float16, torch.bfloat16):
        work = work.float()
    if weights is not None:
        L, L_inv, R, R_inv = (w.to(work) for w in weights)
        work = L @ work @ R
    U, S, Vh = torch.linalg.svd(work, full_matrices=False)
    left = U[..., :rank]
    right = Vh[:, :rank, :].transpose(1, 2) * S[:, None, :rank]
    if weights is not None:
        left, right = L_inv @ left, R_inv @ right
    return LowRank(shape, left.contiguous().to(value.dtype), right.contiguous().to(value.dtype))


Weights = tuple[Tensor, Tensor, Tensor, Tensor]


def _roots(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """`X^{1/2}`, `X^{-1/2}` of a symmetric PSD matrix, eigenvalues floored at `WEIGHT_FLOOR`."""
    values, vectors = torch.linalg.eigh(matrix)
    return _roots_of(vectors, values)


def _roots_of(vectors: Tensor | None, values: Tensor) -> tuple[Tensor, Tensor]:
    """`X^{1/2}`, `X^{-1/2}` of `X = V diag(values) Vᵀ` (V orthonormal; None: the identity)."""
    if vectors is None:
        vectors = torch.eye(values.shape[0], dtype=values.dtype, device=values.device)
    top = values.max().clamp_min(torch.finfo(values.dtype).tiny)
    values = values.clamp_min(top * WEIGHT_FLOOR)
    return (vectors * values.sqrt()) @ vectors.T, (vectors / values.sqrt()) @ vectors.T


def fisher_weights(block: Any, shape: tuple) -> Weights | None:
    """`(G^{1/2}, G^{-1/2}, A^{1/2}, A^{-1/2})` of a weight's block in its `(m, k)` orientation.

    The training gradients' second moment `F` of the block is approximated by one Kronecker
    product `G ⊗ A` (for the rows of `(m, k)` and the columns): its eigenvalues `Λ` in the
    block's basis (`Q_0 ⊗ Q_1`, or the identity of a diagonal block) by their best rank-one
    fit `u vᵀ` (the top singular pair of `Λ ≥ 0`), so `G = Q_0 diag(u) Q_0ᵀ`,
    `A = Q_1 diag(v) Q_1ᵀ` (a folded bias's column left out). Since the squared error of the
    scores over training examples is `Σ_n ⟨Δ, g_n⟩² = N vec(Δ)ᵀ F vec(Δ)`, truncating in the
    norm `‖G^{1/2} Δ A^{1/2}‖_F` is the best rank r for the scores under that approximation.
    None where the block has no such structure (a dense eigenbasis, or a transposed block of a
    parameter with more than two axes).
    """
    if len(shape) < 2:
        return None
    m, k = shape[0], math.prod(shape[1:])
    vectors = [q.detach() for q in block.vectors]
    values = block.values.detach()
    if len(vectors) == 1 or (block.transposed and len(shape) > 2):
        return None
    rows = block.rows
    own = values.reshape(rows, -1).abs()
    U, S, Vh = torch.linalg.svd(own, full_matrices=False)
    u = U[:, 0].abs() * S[0].sqrt()
    v = Vh[0].abs() * S[0].sqrt()
    Q_0, Q_1 = vectors if len(vectors) == 2 else (None, None)
    left = _roots_of(Q_0, u)  # in the block's eigenbasis: no eigendecomposition
    if block.bias is None:
        right = _roots_of(Q_1, v)
    else:  # the weight's columns of A: a principal submatrix, decomposed anew
        A = (Q_1 * v) @ Q_1.T if Q_1 is not None else torch.diag(v)
        right = _roots(A[:-1, :-1])
    if block.transposed:
        left, right = right, left
    if left[0].shape != (m, m) or right[0].shape != (k, k):
        return None
    return (*left, *right)


def concat(parts: list[Tensor | LowRank]) -> Tensor | LowRank:
    """The queries of several batches, one after the other."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], LowRank):
        return LowRank(
            parts[0].shape,
            torch.cat([p.left for p in parts]),
            torch.cat([p.right for p in parts]),
        )
    return torch.cat(parts)
