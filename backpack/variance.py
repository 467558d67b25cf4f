"""The variance of per-sample gradients, without the cancellation of `Σg²/N − (Σg/N)²`.

`Variance` promises `grad_batch.var(0, unbiased=False)`. The one-pass formula loses every digit
where the samples' gradients agree to more digits than the mean is large (a bias whose
per-sample gradients are all close to 1 gets 0.0 in float32). Everything here works with the
centred sum of squares M2 = Σ_n (g_n − ḡ)² instead:

- per-sample gradients that exist (or are formed in chunks): two passes (the mean first, then
  the squared deviations), chunks combined by Chan et al.'s pairwise update, which never
  subtracts large numbers;
- `nn.Linear` on `[N, in]` inputs, whose per-sample gradients g_n = d_n x_nᵀ are never formed:
  `outer_centred_squares` (the one-pass formula where it cannot cancel, centred factors or
  per-sample products for the entries where it could);
- several calls (or ranks) with their own M2: `combine`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from backpack.core import device


def centred_squares(psg: Tensor, overwrite: bool = False) -> tuple[Tensor, Tensor]:
    """(Σ_n g_n, Σ_n (g_n − ḡ)²) of per-sample gradients `[N, *S]`, in two passes.

    The deviations overwrite `psg` if `overwrite`, else a fresh tensor: about 1.3 times the time
    of `psg.square().sum(0)` on the CPU (torch.var_mean over axis 0 measured 5-50 times slower).
    """
    n = psg.shape[0]
    total = psg.sum(0)
    if n == 0:
        return total, torch.zeros_like(total)
    deviations = psg.sub_(total / n) if overwrite else psg - total / n
    return total, deviations.square_().sum(0)


class Chunks:
    """Running (count, Σg, M2) over chunks of per-sample gradients (Chan et al.'s update).

    `add` takes a chunk `[..., *S]` whose leading `lead` axes index samples; the running mean
    absorbs it with M2 += M2_chunk + δ² n_a n_b / (n_a + n_b), δ the difference of the means.
    """

    def __init__(self) -> None:
        self.count = 0
        self.total: Tensor | None = None
        self.m2: Tensor | None = None

    def add(self, chunk: Tensor, lead: int = 1, overwrite: bool = False) -> None:
        """Absorb `chunk` (overwritten with its deviations if `overwrite`)."""
        flat = chunk.reshape(-1, *chunk.shape[lead:])
        m = flat.shape[0]
        if m == 0:
            return
        total, m2 = centred_squares(flat, overwrite)
        if self.total is None:
            self.count, self.total, self.m2 = m, total, m2
            return
        n = self.count
        delta = total / m - self.total / n
        self.m2 += m2
        self.m2.add_(delta.square_(), alpha=n * m / (n + m))
        self.total += total
        self.count = n + m

    def result(self, shape: torch.Size, like: Tensor) -> tuple[Tensor, Tensor]:
        """(Σg, M2) reshaped to `shape` (zeros without samples)."""
        if self.total is None:
            zeros = like.new_zeros(shape)
            return zeros, zeros.clone()
        return self.total.reshape(shape), self.m2.reshape(shape)


def combine(parts: Iterable[tuple[int, Tensor, Tensor]]) -> tuple[int, Tensor, Tensor]:
    """(count, Σg, M2) of the union of disjoint groups of samples given as (count, Σg, M2)."""
    count, total, m2 = 0, None, None
    for n, t, q in parts:
        if n == 0:
            continue
        if total is None:
            count, total, m2 = n, t.clone(), q.clone()
            continue
        delta = t / n - total / count
        m2 = m2 + q + delta.square() * (count * n / (count + n))
        total = total + t
        count += n
    if total is None:
        raise ValueError("combine needs at least one group with samples")
    return count, total, m2


#: entries whose one-pass Σg² exceeds this multiple of M2 (|mean| > 3.9 standard deviations)
#: are recomputed: below it the one-pass formula rounds about as a two-pass computation does
#: (within a factor of 4); `shifted_outer_squares` uses the same bound for its cancellation
CANCELLATION_LIMIT = 16.0
#: `outer_centred_squares` takes the shifted factors for the whole layer once more than this
#: share of its entries is flagged (per-sample products of them would cost more)
SHIFT_SHARE = 1 / 8


def outer_centred_squares(
    d: Tensor, x: Tensor, total: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(Σg, M2) for per-sample outer products g_n = d_n x_nᵀ (`d`: `[N, O]`, `x`: `[N, I]`).

    The one-pass M2 = (d²)ᵀ(x²) − (Σg)²/N (one matrix product, plus dᵀx unless `total` brings
    autograd's gradient) is exact enough wherever Σg² ≤ `CANCELLATION_LIMIT` · M2, which holds
    for most entries of most layers (gradients whose mean is within a few standard deviations
    of 0). The other entries are recomputed: from their per-sample products where they are
    few, else by `shifted_outer_squares` (two matrix products), whose own flagged entries then
    get their per-sample products.
    """
    n = d.shape[0]
    if total is None:
        total = d.T @ x
    squares = d.square().T @ x.square()
    m2 = torch.addcmul(squares, total, total, value=-1.0 / n)
    flagged = squares > m2 * CANCELLATION_LIMIT
    if not device.host_bool(flagged.any()):
        return total, m2
    if flagged.sum() > SHIFT_SHARE * flagged.numel():
        _, shifted, unsure = shifted_outer_squares(d, x, total)
        m2 = torch.where(flagged, shifted, m2)
        flagged &= unsure
    rows, cols = flagged.nonzero(as_tuple=True)
    if rows.numel():
        m2[rows, cols] = outer_centred_squares_at(d, x, rows, cols)
    return total, m2


def shifted_outer_squares(
    d: Tensor, x: Tensor, total: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(Σg, M2, mask) for per-sample outer products g_n = d_n x_nᵀ (`d`: `[N, O]`, `x`: `[N, I]`).

    The variance does not change when every g_n is shifted by the same matrix. With
    a_n = d_n − d̄ and b_n = x_n − x̄, h_n = g_n − d̄ x̄ᵀ = a_n x̄ᵀ + d_n b_nᵀ, so
    Σ h² = (d²)ᵀ (b²) + 2 x̄ ∘ ((a ∘ d)ᵀ b) + (Σ a²) x̄², Σ h = dᵀ b, and
    M2 = Σ h² − (Σ h)²/N. What the one-pass formula loses to the mean d̄ x̄ᵀ (all of it where the
    samples agree) is gone; what remains is a cancellation by the covariance c = dᵀb / N of the
    two factors. Entries where c² > `CANCELLATION_LIMIT` · M2/N (and any that came out
    negative) are flagged in `mask`: the caller recomputes them from per-sample products.

    Σ h² is one matrix product over 2N + 1 stacked rows (the three terms). `total` (Σg, e.g.
    autograd's gradient) spares the product dᵀb: Σh = Σg − N d̄ x̄ᵀ, whose rounding stays at that
    of a two-pass computation wherever c is not flagged.
    """
    n = d.shape[0]
    dbar, xbar = d.mean(0), x.mean(0)
    a, b = d - dbar, x - xbar
    spread = a.square().sum(0, keepdim=True)
    left = torch.cat([d.square(), a.mul_(d).mul_(2.0), spread])
    right = torch.cat([b.square(), b * xbar, xbar.square().unsqueeze(0)])
    m2 = left.T @ right
    if total is None:
        hsum = d.T @ b
        total = torch.addr(hsum, dbar, xbar, alpha=n)
    else:
        hsum = torch.addr(total, dbar, xbar, alpha=-n)
    hsum_sq = hsum.square_()
    m2.sub_(hsum_sq, alpha=1.0 / n)
    mask = hsum_sq > m2 * (CANCELLATION_LIMIT * n)
    return total, m2, mask


#: entries (samples x flagged weight entries) of one chunk in `outer_centred_squares_at`
OUTER_CHUNK_ELEMENTS = 2**22


def outer_centred_squares_at(d: Tensor, x: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """Two-pass M2 of the per-sample products d_n[rows] x_n[cols] (the flagged entries)."""
    n, k = d.shape[0], rows.shape[0]
    step = max(1, OUTER_CHUNK_ELEMENTS // max(1, n))
    parts = []
    for start in range(0, k, step):
        r, c = rows[start : start + step], cols[start : start + step]
        parts.append(centred_squares(d[:, r] * x[:, c], overwrite=True)[1])  # [N, K] products
    return torch.cat(parts) if parts else d.new_zeros(0)
