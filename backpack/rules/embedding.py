"""`nn.Embedding`: output row (n, t) is weight row i_nt, for index inputs `[N, *]`.

With the index tensor flattened per sample to `[N, T]` and the output gradient to `[N, T, D]`,
sample n's weight gradient `[V, D]` is the scatter-add of its rows δ_nt at rows i_nt. Options of
the layer change the rows that are scattered, never the scatter itself:

- `padding_idx`: positions looking up that row contribute nothing;
- `scale_grad_by_freq`: δ_nt is divided by how often i_nt occurs in the whole index tensor of the
  call (as torch's backward does), so the per-sample gradients still sum to `.grad`;
- `max_norm`: the forward renormalises weight rows in place; the gradient formula is unchanged;
- `sparse`: only `.grad` is sparse; the quantities here are dense.

Per-sample gradients are one `index_add_` into a flat `[N·V, D]` buffer. The reductions never build
`[N, V, D]`: the distinct (sample, row) pairs of the batch (at most N·T of them) are found with
`torch.unique`, their gradients summed into a `[U, D]` buffer, and squared norms and sums of
squares scattered from there; the Gram matrix picks the cheaper of a dense product over the rows
the batch actually uses and the pairwise "ghost" form Σ_{t,s} [i_nt = i_ms] δ_nt·δ_ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from backpack.recording import Record
from backpack.rules.base import GradOutputs, ModuleRule, Names, gram, register_rule

#: a fixed largest vocabulary for the Kronecker input factor (a dense `[V, V]` matrix); None:
#: decided by memory (`kron_vocabulary_fits`)
MAX_KRON_VOCABULARY: int | None = None
#: vocabularies up to this size always get their factors (`[V, V]` at most 268 MB in float32)
KRON_VOCABULARY_ALWAYS = 8192
#: the share of the device's free memory a layer's dense `[V, V]` factors may take
KRON_MEMORY_SHARE = 0.5
#: dense `[V, V]` matrices alive at once for one layer: its input factor, a tied output layer's
#: output factor and their combination (`passes.curvature.nearest_kronecker`)
_KRON_VV_COPIES = 3


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes free on `device` now, None where unknown (meta tensors, other devices).

    CUDA: the driver's count; CPU: Linux's MemAvailable.
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def kron_vocabulary_fits(vocab: int, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether an embedding of `vocab` rows gets Kronecker factors, and why not if it does not.

    A fixed `MAX_KRON_VOCABULARY` decides alone. Otherwise vocabularies up to
    `KRON_VOCABULARY_ALWAYS` always do; larger ones when the dense `[V, V]` matrices a layer holds
    at once take at most `KRON_MEMORY_SHARE` of the memory free on the device (meta tensors,
    which hold none, always fit).
    """
    if MAX_KRON_VOCABULARY is not None:
        if vocab <= MAX_KRON_VOCABULARY:
            return True, ""
        return False, f"above backpack.rules.embedding.MAX_KRON_VOCABULARY = {MAX_KRON_VOCABULARY}"
    if vocab <= KRON_VOCABULARY_ALWAYS:
        return True, ""
    need = _KRON_VV_COPIES * vocab * vocab * torch.empty((), dtype=dtype).element_size()
    free = free_memory_bytes(device)
    if free is None or need <= KRON_MEMORY_SHARE * free:
        return True, ""
    return False, (
        f"its dense [{vocab}, {vocab}] factors need {need / 2**20:,.0f} MiB at once, more than "
        f"{KRON_MEMORY_SHARE:g} of the {free / 2**20:,.0f} MiB free on {device}"
    )


def _rows(record: Record, grad_outputs: GradOutputs) -> tuple[Tensor, Tensor]:
    """Return indices `[N, T]` (int64) and effective output gradients `[N, T, D]`.

    The gradients are masked at `padding_idx` and divided by the index frequencies when
    `scale_grad_by_freq` is set, so that the weight gradient is a plain scatter-add of them.
    """
    module = record.module
    idx, g = record.args[0], grad_outputs[0]
    n = idx.shape[0]
    idx = idx.reshape(n, -1).long()
    g = g.reshape(n, idx.shape[1], g.shape[-1])
    padding_idx = module.padding_idx
    if padding_idx is not None:
        if padding_idx < 0:
            padding_idx += module.num_embeddings
        g = g * (idx != padding_idx).unsqueeze(-1).to(g.dtype)
    if module.scale_grad_by_freq:
        _, inverse, counts = torch.unique(idx, return_inverse=True, return_counts=True)
        g = g / counts[inverse].unsqueeze(-1).to(g.dtype)
    return idx, g


def _pair_sums(
    idx: Tensor, g: Tensor, num_embeddings: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Distinct (sample, row) pairs of the batch and their summed gradients.

    Returns the sample `[M]`, the row `[M]`, the gradient `[M, D]` of each pair (the nonzero
    rows of all per-sample gradients) and whether entry m is a pair `[M]`: M = N·T entries, the
    pairs first, then zero gradients at sample 0, row 0. The number of distinct pairs is never
    read on the host, so a GPU does not wait for it (`torch.unique` would).
    """
    n = idx.shape[0]
    keys = (idx + num_embeddings * torch.arange(n, device=idx.device).unsqueeze(1)).flatten()
    keys, order = torch.sort(keys)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    pair = torch.cumsum(first, 0) - 1  # the distinct pair each (sorted) entry belongs to
    sums = g.new_zeros(keys.shape[0], g.shape[-1])
    sums.index_add_(0, pair, g.reshape(-1, g.shape[-1])[order])
    pair_keys = torch.zeros_like(keys).scatter_(0, pair, keys)
    present = torch.arange(keys.shape[0], device=keys.device) <= pair[-1:]
    return pair_keys // num_embeddings, pair_keys % num_embeddings, sums, present


@register_rule(nn.Embedding)
class EmbeddingRule(ModuleRule):
    """Per-sample gradients and fused reductions of `nn.Embedding`'s weight."""

    #: `kron_factors` gives the factors of `weight.T` (the Linear map on one-hot inputs)
    KRON_TRANSPOSED = frozenset({"weight"})

    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """`[N, V, D]` weight gradients, scattered in one `index_add_`."""
        if "weight" not in names:
            return {}
        idx, g = _rows(record, grad_outputs)  # frequencies from the full batch
        if subsampling is not None:
            index = torch.as_tensor(subsampling, device=idx.device)
            idx, g = idx[index], g[index]
        n, v, d = idx.shape[0], record.module.num_embeddings, g.shape[-1]
        keys = idx + v * torch.arange(n, device=idx.device).unsqueeze(1)
        out = g.new_zeros(n * v, d)
        out.index_add_(0, keys.flatten(), g.reshape(-1, d))
        return {"weight": out.view(n, v, d)}

    def batch_l2(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[N]` squared norms from the distinct (sample, row) pairs."""
        if "weight" not in names:
            return {}
        idx, g = _rows(record, grad_outputs)
        sample, _, sums, _ = _pair_sums(idx, g, record.module.num_embeddings)
        result = g.new_zeros(idx.shape[0])
        result.index_add_(0, sample, sums.square().sum(1))
        return {"weight": result}

    def sum_grad_squared(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[V, D]` sum of squares, scattered from the distinct (sample, row) pairs."""
        if "weight" not in names:
            return {}
        idx, g = _rows(record, grad_outputs)
        v = record.module.num_embeddings
        _, row, sums, _ = _pair_sums(idx, g, v)
        result = g.new_zeros(v, g.shape[-1])
        result.index_add_(0, row, sums.square())
        return {"weight": result}

    def batch_dot(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[N, N]` Gram matrix, by the cheaper of a compact dense product and the ghost form."""
        if "weight" not in names:
            return {}
        idx, g = _rows(record, grad_outputs)
        n, t, d = g.shape
        sample, row, sums, _ = _pair_sums(idx, g, record.module.num_embeddings)
        used_rows, compact_row = torch.unique(row, return_inverse=True)
        used = used_rows.shape[0]
        if n * t * t * (d + 1) <= used * d * (n + 1):
            same_row = idx[:, None, :, None] == idx[None, :, None, :]
            dots = torch.einsum("ntd,msd->nmts", g, g)
            return {"weight": (dots * same_row.to(g.dtype)).sum((2, 3))}
        dense = g.new_zeros(n, used, d)
        dense.index_put_((sample, compact_row), sums, accumulate=True)  # padding adds zeros
        flat = dense.reshape(n, -1)
        return {"weight": flat @ flat.T}

    def grad_sum_and_centred_squares(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        grad_sums: dict[str, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(Σ_n g_n, Σ_n (g_n − ḡ)²) from the distinct (sample, row) pairs, without `[N, V, D]`.

        Row r of the mean is m_r = Σ_n g_nr / N; a sample using the row contributes
        (g_nr − m_r)², each of the N − c_r samples not using it m_r².
        """
        if "weight" not in names:
            return {}, {}
        idx, g = _rows(record, grad_outputs)
        n, v = idx.shape[0], record.module.num_embeddings
        _, row, pair_sums, present = _pair_sums(idx, g, v)
        present = present.to(g.dtype)
        total = g.new_zeros(v, g.shape[-1])
        total.index_add_(0, row, pair_sums)
        mean = total / max(n, 1)
        m2 = g.new_zeros(v, g.shape[-1])
        deviations = pair_sums.sub_(mean[row]).mul_(present.unsqueeze(1))  # padding: 0
        m2.index_add_(0, row, deviations.square_())
        users = torch.zeros(v, dtype=g.dtype, device=g.device)
        users.index_add_(0, row, present)
        m2.addcmul_((n - users).unsqueeze(1), mean.square())
        return {"weight": total}, {"weight": m2}

    def grad_sum(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[V, D]` gradient of this call, one scatter-add over all positions."""
        if "weight" not in names:
            return {}
        idx, g = _rows(record, grad_outputs)
        result = g.new_zeros(record.module.num_embeddings, g.shape[-1])
        result.index_add_(0, idx.flatten(), g.reshape(-1, g.shape[-1]))
        return {"weight": result}

    def kron_factors(self, record, factors, names, approx="expand"):  # noqa: D102
        """`[G, A]` for `weight.T` (`[D, V]`): an embedding is a Linear layer on one-hot inputs.

        The one-hot input of position t, scaled as the gradient is (0 at `padding_idx`, 1/count with
        `scale_grad_by_freq`), gives A; the factor at the output gives G, with positions treated
        as in `LinearRule` ("expand": as samples; "reduce": averaged / summed first).

        Raises:
            NotImplementedError: When the dense `[V, V]` factor does not fit
                (`kron_vocabulary_fits`).
        """
        module = record.module
        vocab = module.num_embeddings
        if "weight" not in names:
            return None
        out = record.outputs[0]
        fits, why = kron_vocabulary_fits(vocab, out.dtype, out.device)
        if not fits:
            raise NotImplementedError(
                f"Kronecker factors (KFAC, KFLR, KFRA) of {module!r}: {why}. Freeze its weight "
                "(`weight.requires_grad_(False)`, which also freezes an output layer tied to "
                "it), use a diagonal (DiagGGNExact, DiagGGNMC) for it, or free memory; "
                "`backpack.rules.embedding.KRON_MEMORY_SHARE` sets the share of free memory "
                "the factors may take."
            )
        idx = record.args[0]
        n = idx.shape[0]
        idx = idx.reshape(n, -1).long()
        ones = torch.ones(*idx.shape, 1, dtype=record.outputs[0].dtype, device=idx.device)
        _, weights = _rows(record, (ones,))
        weights = weights.squeeze(-1)  # [N, T]
        t = idx.shape[1]
        f = factors[0]
        if f is None:
            d = module.embedding_dim
            g = weights.new_zeros(d, d)
        else:
            # the factor's own sample axis: KFRA hands one batch-averaged "sample" (N = 1)
            f = f.reshape(f.shape[0], f.shape[1], t, f.shape[-1])
            if approx == "reduce":
                s = f.sum(2)
                g = gram(s)
            else:
                g = gram(f)
        if approx == "reduce":
            mean = weights.new_zeros(n, vocab)
            mean.scatter_add_(1, idx, weights / t)
            a = mean.T @ mean / n
        else:
            counts = weights.new_zeros(vocab)
            counts.index_add_(0, idx.flatten(), weights.square().flatten())
            a = torch.diag(counts / (n * t))
        return {"weight": [g, a]}

