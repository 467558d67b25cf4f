"""`nn.Conv1d/2d/3d` and `nn.ConvTranspose1d/2d/3d` with every constructor option.

Per-sample weight gradients are one batched GEMM of two factors per sample and group (see
`backpack.core.derivatives.convnd`): the output gradient times the unfolded input for `ConvNd`,
the input times the unfolded output gradient for `ConvTransposeNd`. Strided, dilated, grouped
convolutions, string paddings ("same" with even kernels pads asymmetrically) and the padding
modes "reflect", "replicate", "circular" are handled by padding the input explicitly as the module
does; transposed convolutions read their output padding off the recorded output gradient, which
also covers `forward(x, output_size=...)`. Bias gradients sum the output gradient over positions.

Squared norms (and, for tiny outputs, Gram matrices) of per-sample weight gradients use the
"ghost" form ‖A_n B_nᵀ‖² = Σ_{l,l'} (A_nᵀ A_n)_{ll'} (B_nᵀ B_n)_{ll'} when its cost
L² (a + b) per sample and group is below the a b L of materialising the gradients; otherwise the
rule declines and the engine reduces the materialised per-sample gradients.
Under `weight_jac_t_save_memory(True)` nothing of the full batch is unfolded: per-sample
gradients come from torch's convolution weight backward batched with `vmap`, and reductions are
computed in chunks of samples.

Second order: square roots and (per-sample) diagonals need the weight gradient of every (factor
column, sample) pair. They are computed in chunks of pairs, each chunk by ONE batched GEMM per
sample and group with the columns stacked (`convnd.pair_weight_grads_unfold`, the input unfolded
once per chunk of samples) or by ONE grouped weight backward (`convnd.pair_weight_grads_fold`, on
large grids and when saving memory); diagonals square each chunk in place and sum it, so no
`[V, N, *weight]` tensor exists. Kronecker factors are single matrix products over contiguous
operands; the input factor's symmetric product only computes its block upper triangle.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack.core import device
from backpack.core.derivatives import convnd
from backpack.recording import SHAPE_ONLY_OUTPUTS, Record
from backpack.rules.base import GradOutputs, ModuleRule, Names, gram, register_rule
from backpack.variance import Chunks, centred_squares

#: elements a chunk of samples may occupy in one intermediate (Gram matrices, gradients)
_CHUNK_BUDGET = 1 << 24
#: elements the (column, sample) weight gradients of one chunk and its copies of factor and
#: unfolded input may occupy, per device type (`_CHUNK_BUDGET` elsewhere); small chunks stay in
#: cache on CPU
_PAIR_CHUNK = {"cpu": 1 << 21}
#: elements of unfolded input a chunk of samples of the input Kronecker factor's Gram product
#: may occupy, per device type: on a GPU (256 MiB in float32) fewer chunks mean fewer kernels
#: and calls (the Gram's blocks are launched once per chunk)
_INPUT_GRAM_CHUNK = {"cpu": 1 << 21, "cuda": 1 << 26}

#: the convolution module classes the rule below covers
CONV_CLASSES = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def _input(record: Record) -> Tensor:
    return record.args[0] if record.args else record.kwargs["input"]


def _is_unbatched(module: nn.Module, x: Tensor) -> bool:
    return x.dim() == convnd.spatial_dims(module) + 1


def _io(record: Record, grad_outputs: GradOutputs) -> tuple[Tensor, Tensor]:
    """Input and output gradient with a batch axis (unbatched calls are one sample)."""
    x, g = _input(record), grad_outputs[0]
    if _is_unbatched(record.module, x):
        x, g = x.unsqueeze(0), g.unsqueeze(0)
    return x, g


def _chunks(n: int, per_sample: int) -> Iterator[slice]:
    """Slices of at most `_CHUNK_BUDGET // per_sample` samples covering `range(n)`."""
    step = max(1, _CHUNK_BUDGET // max(1, per_sample))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _factor_sizes(module: nn.Module, x: Tensor, g: Tensor) -> tuple[int, int, int, int]:
    """Return (groups, a, b, L) of the weight-gradient factors without computing them."""
    groups = module.groups
    kernel = math.prod(module.kernel_size)
    if convnd.is_transposed(module):
        positions = math.prod(x.shape[2:])
        return groups, x.shape[1] // groups, g.shape[1] // groups * kernel, positions
    positions = math.prod(g.shape[2:])
    return groups, g.shape[1] // groups, x.shape[1] // groups * kernel, positions


def _ghost_is_cheaper(a: int, b: int, positions: int) -> bool:
    """Norms from position Gram matrices cost less than per-sample gradients (`[a, b]` each)."""
    return positions * (a + b) < a * b


def _gram(t: Tensor) -> Tensor:
    """`[N G, L, L]` Gram matrices over the feature axis of factors `[N, G, f, L]`."""
    flat = t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])
    return torch.bmm(flat.transpose(1, 2), flat)


def _ghost_norms_of(fa: Tensor, fb: Tensor) -> Tensor:
    """`[N]` squared norms Σ_g ⟨A_gᵀ A_g, B_gᵀ B_g⟩ of per-sample gradients A Bᵀ.

    The factors are `[N, G, ·, L]`; the two `[L, L]` Gram matrices' elementwise product is
    summed as one batched dot product per sample.
    """
    n, positions = fa.shape[0], fa.shape[3]
    area = fa.shape[1] * positions * positions
    ga, gb = _gram(fa).view(n, 1, area), _gram(fb).view(n, area, 1)
    return torch.bmm(ga, gb).view(n)


# the rule reads its outputs' shapes only (see `SHAPE_ONLY_OUTPUTS`)
SHAPE_ONLY_OUTPUTS.update(CONV_CLASSES)


@register_rule(*CONV_CLASSES)
class ConvRule(ModuleRule):
    """Per-sample gradients and fused reductions of (transposed) convolutions."""

    def batch_size(self, record: Record) -> int:
        """Return the number of samples (1 for an unbatched call)."""
        x = _input(record)
        return 1 if _is_unbatched(record.module, x) else x.shape[0]

    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """`[N, *weight.shape]` weight and `[N, out_channels]` bias gradients."""
        module = record.module
        x, g = _io(record, grad_outputs)
        if subsampling is not None:
            index = torch.as_tensor(list(subsampling), device=x.device)
            x, g = x.index_select(0, index), g.index_select(0, index)
        result = {}
        if "weight" in names:
            result["weight"] = convnd.per_sample_weight_grads(module, x, g)
        if "bias" in names:
            result["bias"] = convnd.per_sample_bias_grads(g)
        return result

    def batch_l2(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict | None:
        """Squared norms; ghost form for the weight where cheaper, chunked when saving memory."""
        return self._batch_l2(record, grad_outputs, names, None)

    def batch_l2_and_sum(
        self, record: Record, grad_outputs: GradOutputs, names: Names
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """Squared norms and the gradient, where the norms come from per-sample gradients."""
        x, g = _io(record, grad_outputs)
        if "weight" in names and self._ghost_norms(record.module, x, g):
            return None
        sums: dict[str, Tensor] = {}
        return self._batch_l2(record, grad_outputs, names, sums), sums

    @staticmethod
    def _ghost_norms(module: nn.Module, x: Tensor, g: Tensor) -> bool:
        """Whether the weight's norms come from Gram matrices (no per-sample gradients)."""
        _, a, b, positions = _factor_sizes(module, x, g)
        return _ghost_is_cheaper(a, b, positions)

    def _batch_l2(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        sums: dict[str, Tensor] | None,
    ) -> dict:
        """Squared norms; the gradient into `sums` too if given (per-sample path only)."""
        module = record.module
        x, g = _io(record, grad_outputs)
        result = {}
        if "weight" in names:
            groups, a, b, positions = _factor_sizes(module, x, g)
            if _ghost_is_cheaper(a, b, positions):
                norms = []
                per_sample = groups * max(positions**2, (a + b) * positions)
                for part in _chunks(x.shape[0], per_sample):
                    whole = part.start == 0 and part.stop == x.shape[0]
                    xs, gs = (x, g) if whole else (x[part], g[part])
                    norms.append(_ghost_norms_of(*convnd.weight_grad_factors(module, xs, gs)))
                result["weight"] = norms[0] if len(norms) == 1 else torch.cat(norms)
            else:
                # per-sample gradients chunk by chunk (the output gradient is the only factor
                # column), squared in place: `[N, *weight]` is never formed
                xf, f = _input_and_factor(record, (grad_outputs[0].unsqueeze(0),))
                norms = f.new_zeros(xf.shape[0])
                total = None if sums is None else f.new_zeros(module.weight.shape)
                for ns, _, pairs in _pair_grads(module, xf, f):
                    if total is not None:
                        total += pairs.sum((0, 1)).reshape(total.shape)
                    norms[ns] += pairs.square_().flatten(1).sum(1)
                result["weight"] = norms
                if sums is not None:
                    sums["weight"] = total
        if "bias" in names:
            per_sample_bias = convnd.per_sample_bias_grads(g)
            result["bias"] = per_sample_bias.square().sum(1)
            if sums is not None:
                sums["bias"] = per_sample_bias.sum(0)
        return result

    def sum_grad_squared(
        self, record: Record, grad_outputs: GradOutputs, names: Names
    ) -> dict | None:
        """Σ_n g_n²: the diagonal routine with the output gradient as its one factor column.

        Per-sample gradients exist one bounded chunk at a time and are squared in place.
        """
        return self.diag_from_factor(record, (grad_outputs[0].unsqueeze(0),), names, None, False)

    def grad_sum_and_squares(
        self, record: Record, grad_outputs: GradOutputs, names: Names
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(Σ_n g_n, Σ_n g_n²) from the same chunks of per-sample gradients (summed, then squared).

        `Variance` then needs neither a weight backward for the sum nor autograd's gradient.
        """
        module = record.module
        x, f = _input_and_factor(record, (grad_outputs[0].unsqueeze(0),))
        sums, squares = {}, {}
        if "weight" in names:
            shape = module.weight.shape
            total = f.new_zeros(shape)
            square_total = f.new_zeros(shape)
            for _, _, pairs in _pair_grads(module, x, f):
                total += pairs.sum((0, 1)).reshape(shape)
                square_total += pairs.square_().sum((0, 1)).reshape(shape)
            sums["weight"], squares["weight"] = total, square_total
        if "bias" in names:
            per_sample = convnd.per_sample_bias_grads(f[0])
            sums["bias"], squares["bias"] = per_sample.sum(0), per_sample.square().sum(0)
        return sums, squares

    def grad_sum_and_centred_squares(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        grad_sums: dict[str, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(Σ_n g_n, Σ_n (g_n − ḡ)²) from the chunks of `grad_sum_and_squares`.

        Each chunk is centred on its own mean (in place) and merged by Chan's update
        (`backpack.variance.Chunks`): no cancellation, no second pass over the samples.
        """
        module = record.module
        x, f = _input_and_factor(record, (grad_outputs[0].unsqueeze(0),))
        sums, squares = {}, {}
        if "weight" in names:
            running = Chunks()
            for _, _, pairs in _pair_grads(module, x, f):
                running.add(pairs, lead=2, overwrite=True)
            sums["weight"], squares["weight"] = running.result(module.weight.shape, f)
        if "bias" in names:
            per_sample = convnd.per_sample_bias_grads(f[0])
            sums["bias"], squares["bias"] = centred_squares(per_sample, overwrite=True)
        return sums, squares

    def batch_dot(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict | None:
        """Gram matrix of per-sample gradients; ghost form for the weight on tiny outputs."""
        module = record.module
        x, g = _io(record, grad_outputs)
        n = x.shape[0]
        result = {}
        if "weight" in names:
            groups, a, b, positions = _factor_sizes(module, x, g)
            ghost_cost = n * positions**2 * (a + b)
            too_big = groups * (n * positions) ** 2 > _CHUNK_BUDGET
            if too_big or ghost_cost >= (positions + n) * a * b:
                return None
            fa, fb = convnd.weight_grad_factors(module, x, g)

            def positions_gram(t: Tensor) -> Tensor:  # [G, N L, N L]
                flat = t.permute(1, 0, 3, 2).reshape(groups, n * positions, -1)
                return flat @ flat.transpose(1, 2)

            prod = positions_gram(fa) * positions_gram(fb)
            prod = prod.reshape(groups, n, positions, n, positions)
            result["weight"] = prod.sum((0, 2, 4))
        if "bias" in names:
            bias = convnd.per_sample_bias_grads(g)
            result["bias"] = bias @ bias.T
        return result

    def grad_sum(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict | None:
        """Gradient of this call, by torch's convolution weight backward on the whole batch."""
        module = record.module
        x, g = _io(record, grad_outputs)
        result = {}
        if "weight" in names:
            result["weight"] = convnd.weight_grad_sum(module, x, g)
        if "bias" in names:
            result["bias"] = g.sum((0, *range(2, g.dim())))
        return result

    def probe_index(self, name: str, param: Tensor) -> Tensor | None:
        """Weight probes at the kernel's centre offset, for spread (output, input) channels.

        Sharing one kernel offset lets `grad_sum_entries` compute them in one vectorised step.
        """
        if name != "weight" or param.dim() < 3:
            return None
        count = min(8, param.shape[0])
        # index arithmetic on the CPU whatever the default device (no integer matmul on CUDA)
        cpu = torch.device("cpu")
        outs = torch.linspace(0, param.shape[0] - 1, count, device=cpu).long()
        ins = torch.linspace(0, param.shape[1] - 1, count, device=cpu).long()
        centre = [torch.full((count,), k // 2, device=cpu) for k in param.shape[2:]]
        flat = torch.stack([outs, ins, *centre]).T @ torch.tensor(param.stride(), device=cpu)
        return flat.to(param.device)

    def grad_sum_entries(
        self, record: Record, grad_outputs: GradOutputs, name: str, index: Tensor
    ) -> Tensor:
        """A few entries of this call's gradient from strided views, without a weight backward.

        `ConvNd`: see `_weight_entries_by_slices`. `ConvTransposeNd`: weight entry (i, o, k) is
        Σ_{n,q} x[n, i, q] v[n, (o, k), q] with v the patches of the output gradient; only the
        requested channels' patches are gathered.
        """
        module = record.module
        x, g = _io(record, grad_outputs)
        if name == "bias":
            return g.sum((0, *range(2, g.dim())))[index]
        if not convnd.is_transposed(module):
            return _weight_entries_by_slices(module, x, g, index)
        shape = module.weight.shape
        coords = torch.unravel_index(index.to(x.device), tuple(shape))
        in_channel = coords[0]
        out_channel = in_channel // (shape[0] // module.groups) * shape[1] + coords[1]
        windows = convnd.patches(  # [N, E, *grid, *kernel]
            g[:, out_channel],
            module.kernel_size,
            module.stride,
            module.dilation,
            tuple(module.padding),
            x.shape[2:],
        )
        entries = torch.arange(index.numel(), device=x.device)
        dims = convnd.spatial_dims(module)
        gathered = windows[(slice(None), entries, *([slice(None)] * dims), *coords[2:])]
        return (gathered * x[:, in_channel].movedim(1, 0)).flatten(1).sum(1)

    # --- second order ---------------------------------------------------------------------
    def sqrt_factor(self, record, factors, names, subsampling=None):  # noqa: D102
        """`[V, N, *param.shape]`: every (column, sample) weight gradient, written chunk by chunk.

        The input is unfolded (or folded into one grouped weight backward) once per chunk of
        samples; each chunk's pair gradients go straight into their slice of the result.
        """
        module = record.module
        x, f = _input_and_factor(record, factors)
        if f is None:
            return super().sqrt_factor(record, factors, names, subsampling)
        if subsampling is not None:
            index = torch.as_tensor(list(subsampling), device=x.device)
            x, f = x.index_select(0, index), f.index_select(1, index)
        v, n = f.shape[0], f.shape[1]
        result = {}
        if "weight" in names:
            shape = module.weight.shape
            split = (module.groups, shape[0] // module.groups, *shape[1:])
            out = f.new_empty(v, n, *shape)
            for ns, vs, pairs in _pair_grads(module, x, f):
                out[vs, ns].view(pairs.shape[1], pairs.shape[0], *split).copy_(
                    pairs.transpose(0, 1)
                )
            result["weight"] = out
        if "bias" in names:
            result["bias"] = f.sum(tuple(range(3, f.dim())))
        return result

    def diag_from_factor(self, record, factors, names, coef, per_sample):  # noqa: D102
        """Σ_v coef (Jᵀ f_vn)², squared in place and summed chunk by chunk.

        Only one chunk of (column, sample) weight gradients exists at a time; `[V, N, *weight]`
        is never formed.
        """
        module = record.module
        x, f = _input_and_factor(record, factors)
        n = x.shape[0]
        if f is None:
            zeros = {k: torch.zeros_like(getattr(module, k)) for k in names}
            if per_sample:
                return {k: z.expand(n, *z.shape).clone() for k, z in zeros.items()}
            return zeros
        result = {}
        if "weight" in names:
            shape = module.weight.shape
            total = f.new_empty(n, *shape) if per_sample else None
            for ns, vs, pairs in _pair_grads(module, x, f):
                sq = pairs.square_()
                if coef is not None:
                    weights = coef[vs, ns].T
                    sq.mul_(weights.reshape(*weights.shape, *([1] * (sq.dim() - 2))))
                if per_sample:
                    # the first chunk of columns writes the samples' slice, later ones add
                    target = total[ns].view(sq.shape[0], *sq.shape[2:])
                    if vs.start == 0:
                        torch.sum(sq, 1, out=target)
                    else:
                        target += sq.sum(1)
                else:
                    part = sq.sum((0, 1)).reshape(shape)
                    total = part if total is None else total.add_(part)
            result["weight"] = total if total is not None else f.new_zeros(shape)
        if "bias" in names:
            b2 = f.sum(tuple(range(3, f.dim()))).square()
            if coef is not None:
                b2 = b2 * coef.unsqueeze(-1)
            result["bias"] = b2.sum(0) if per_sample else b2.sum((0, 1))
        return result

    # --- for the data-set layer (`backpack.curvature`): the pieces its own conventions use ---
    @staticmethod
    def input_and_factor(record: Record, factors: Sequence[Tensor | None]) -> tuple[Tensor, Any]:
        """Input `[N, C_in, *in]` and factor `[V, N, C_out, *out]` of a call (unbatched: N = 1)."""
        return _input_and_factor(record, factors)

    @staticmethod
    def pair_gradients(
        module: nn.Module, x: Tensor, f: Tensor
    ) -> Iterator[tuple[slice, slice, Tensor]]:
        """Chunks `(samples, columns, [n, v, G, ...])` of every (column, sample) weight gradient.

        The gradients are in the weight's layout split by groups: `[n, v, G, C_out / G, ...]`.
        """
        return _pair_grads(module, x, f)

    @staticmethod
    def unfolded_input(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
        """`[N, G, L, D]`: each sample's input patch of every output position, per group.

        `D = C_in / G · K` for `ConvNd` (the weight's `[C_out, D]` columns), `C_in · K` with
        `G = 1` for `ConvTransposeNd` (the columns of `weight.transpose(0, 1)`).
        """
        if convnd.is_transposed(module):
            return _transposed_unfold(module, x, out_size).transpose(1, 2).unsqueeze(1)
        groups = module.groups
        u = convnd.unfold_channels_first(module, x, out_size)  # [G D, N L]
        return u.reshape(groups, u.shape[0] // groups, x.shape[0], -1).permute(2, 0, 3, 1)

    def kron_output_gram(
        self, record: Record, factors: Sequence[Tensor | None], approx: str = "expand"
    ) -> Tensor:
        """The output-side Kronecker factor G of these factor columns alone (sums over columns)."""
        f = _input_and_factor(record, factors)[1]
        return gram(f.reshape(f.shape[0] * f.shape[1], f.shape[2], -1).sum(-1))  # [V N, C_out]

    def kron_factors(self, record, factors, names, approx="expand"):  # noqa: D102
        """`[G, A]` for the weight (`weight.transpose(0, 1)` for transposed convs), `[G]` bias.

        G = Σ_{v,n} (Σ_l s_vnl)(Σ_l s_vnl)ᵀ sums the factor over output positions first (so it
        equals the bias's curvature block). With "expand" (the original's convention) A is the
        batch mean of the unfolded input's outer products summed over positions; with "reduce"
        the batch mean of ā āᵀ, ā the unfolded input averaged over positions. For grouped
        convolutions A averages the groups' input factors, which share the weight's
        `[in_channels / groups * K]` axis.
        """
        module = record.module
        x, f = _input_and_factor(record, factors)
        out = record.outputs[0]
        grid = out.shape[out.dim() - convnd.spatial_dims(module) :]
        if f is None:  # the output does not reach the loss
            c_out = out.shape[out.dim() - convnd.spatial_dims(module) - 1]
            g = x.new_zeros(c_out, c_out)
        else:
            g = self.kron_output_gram(record, factors, approx)
        result: dict[str, list[Tensor]] = {}
        if "weight" in names:
            if approx == "reduce":
                a = _reduced_input_kron_factor(module, x, grid)
            else:
                a = _input_kron_factor(module, x, grid)
            result["weight"] = [g, a]
        if "bias" in names:
            result["bias"] = [g]
        return result


def _weight_entries_by_slices(module: nn.Module, x: Tensor, g: Tensor, index: Tensor) -> Tensor:
    """Weight-gradient entries of a `ConvNd` call from strided views of x and g.

    Entry (o, c, k) is Σ_{n,l} g[n, o, l] x[n, c', l·s + k·d - p] over the output positions l
    whose input position lies inside the input (zero padding adds nothing; other padding modes
    are applied to x first); c' is c's channel in o's group. Entries sharing a kernel offset k
    (the rule's own probes all do) are computed together.
    """
    shape = module.weight.shape
    per_group = shape[0] // module.groups
    if module.padding_mode == "zeros":
        pads = [before for before, _ in convnd.explicit_padding(module)]
    else:
        x, remaining = convnd.pad_input(module, x)
        pads = list(remaining)
    coords = [c.tolist() for c in torch.unravel_index(index.cpu(), tuple(shape))]
    by_offset: dict[tuple[int, ...], list[int]] = {}
    for j, offset in enumerate(zip(*coords[2:])):
        by_offset.setdefault(offset, []).append(j)
    values = g.new_zeros(index.numel())
    for offset, members in by_offset.items():
        g_window, x_window = _offset_windows(module, x, g, list(offset), pads)
        if g_window is None:
            continue  # this offset only ever meets padding
        outs = [coords[0][j] for j in members]
        ins = [o // per_group * shape[1] + coords[1][j] for o, j in zip(outs, members)]
        # select channels first (contiguous), then window: much faster than the other order
        x_part = x.index_select(1, torch.tensor(ins, device=x.device))[x_window]
        g_part = g.index_select(1, torch.tensor(outs, device=g.device))[g_window]
        sums = (x_part * g_part).sum([0, *range(2, x_part.dim())])
        values[torch.tensor(members, device=g.device)] = sums
    return values


def _offset_windows(
    module: nn.Module, x: Tensor, g: Tensor, offsets: list[int], pads: list[int]
) -> tuple[Any, Any]:
    """Index tuples of the output positions and the input positions one kernel offset pairs.

    Only positions inside the unpadded input count (padding is zero); (None, None) if none.
    """
    g_index: list[Any] = [slice(None), slice(None)]
    x_index: list[Any] = [slice(None), slice(None)]
    for i, (size_in, size_out) in enumerate(zip(x.shape[2:], g.shape[2:], strict=True)):
        stride, offset = module.stride[i], offsets[i] * module.dilation[i] - pads[i]
        first = max(0, -(offset // stride) if offset < 0 else 0)  # l·s + offset >= 0
        last = min(size_out - 1, (size_in - 1 - offset) // stride)
        if last < first:
            return None, None
        g_index.append(slice(first, last + 1))
        start = first * stride + offset
        x_index.append(slice(start, start + (last - first) * stride + 1, stride))
    return tuple(g_index), tuple(x_index)


def _input_and_factor(record: Record, factors: Sequence[Tensor | None]) -> tuple[Tensor, Any]:
    """Input `[N, C_in, *in]` and factor `[V, N, C_out, *out]` (unbatched calls: N = 1)."""
    x, f = _input(record), factors[0]
    if _is_unbatched(record.module, x):
        x = x.unsqueeze(0)
        f = None if f is None else f.unsqueeze(1)
    return x, f


def _pair_sizes(module: nn.Module, x: Tensor, f: Tensor, fold: bool) -> tuple[int, int]:
    """Elements of the intermediates of one (column, sample) pair and of one sample's input."""
    per_pair = module.weight.numel() + math.prod(f.shape[2:])  # (sizes only: no tensor ops)
    if fold:
        return per_pair, 0
    kernel = math.prod(module.kernel_size)
    if convnd.is_transposed(module):
        # the unfolded factor column and its reordered copy
        unfolded = f.shape[2] * kernel * math.prod(x.shape[2:])
        return per_pair + 2 * unfolded, 0
    # the padded input and its unfolded copy
    return per_pair, 2 * x.shape[1] * kernel * math.prod(f.shape[3:])


def _pair_grads(module: nn.Module, x: Tensor, f: Tensor) -> Iterator[tuple[slice, slice, Tensor]]:
    """Chunks `(samples, columns, [n, v, G, ...] weight gradients)` covering all pairs.

    Chunk sizes keep the pair gradients and the per-chunk copies of factor and unfolded input
    within `_PAIR_CHUNK` elements (small chunks stay in cache on CPU). The unfolding path unfolds
    each chunk of samples once and reuses it for all chunks of columns.
    """
    v, n = f.shape[0], f.shape[1]
    fold = convnd.prefer_fold(module, x, f.shape[3:], columns=v)
    per_pair, per_sample = _pair_sizes(module, x, f, fold)
    budget = _PAIR_CHUNK.get(device.kind(x), _CHUNK_BUDGET)
    if v * per_pair + per_sample <= budget:
        n_step, v_step = max(1, budget // (v * per_pair + per_sample)), v
    else:
        n_step, v_step = 1, max(1, (budget - per_sample) // per_pair)
    whole = n_step >= n and v_step >= v  # one chunk: no slicing
    for start in range(0, n, n_step):
        ns = slice(start, min(n, start + n_step))
        xs = x if whole else x[ns]
        shared = None if fold else convnd.pair_operand(module, xs, f.shape[3:])
        for v_start in range(0, v, v_step):
            vs = slice(v_start, min(v, v_start + v_step))
            fs = f if whole else f[vs, ns]
            if fold:
                yield ns, vs, convnd.pair_weight_grads_fold(module, xs, fs)
            else:
                yield ns, vs, convnd.pair_weight_grads_unfold(module, xs, fs, shared)


def _transposed_without_groups(module: nn.Module) -> bool:
    """Whether `module` is a transposed convolution (refused if grouped: no common A)."""
    if not convnd.is_transposed(module):
        return False
    if module.groups != 1:
        raise NotImplementedError(
            f"Kronecker factors are not defined for grouped transposed convolutions "
            f"({module}): the groups share no common input factor."
        )
    return True


def _reduced_input_kron_factor(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
    """Batch mean of ā āᵀ with ā the unfolded input averaged over positions (groups averaged)."""
    n, groups = x.shape[0], module.groups
    if _transposed_without_groups(module):
        mean = _transposed_unfold(module, x, out_size).mean(-1)  # [N, K']
        return mean.T @ mean / n
    u = convnd.unfold_channels_first(module, x, out_size)  # [C_in K, N L]
    mean = u.reshape(u.shape[0], n, -1).mean(-1)  # [C_in K, N]
    mean = mean.reshape(groups, mean.shape[0] // groups, n)
    return gram(mean.transpose(1, 2)) / (n * groups)


def _input_kron_factor(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
    """Batch mean of Σ_l u_l u_lᵀ over unfolded inputs (groups averaged), chunked over samples."""
    n, groups = x.shape[0], module.groups
    if _transposed_without_groups(module):
        u = _transposed_unfold(module, x, out_size)  # [N, K', L]
        flat = u.transpose(0, 1).reshape(u.shape[1], -1)
        return (flat @ flat.T) / n
    if convnd.correlation_applies(module, x, out_size):
        return convnd.input_gram_by_correlation(module, x, out_size) / n
    size = x.shape[1] * math.prod(module.kernel_size) * math.prod(out_size)  # unfolded, one sample
    budget = _INPUT_GRAM_CHUNK.get(device.kind(x), _CHUNK_BUDGET)
    step = max(1, budget // max(1, size))
    a = None
    for start in range(0, n, step):
        u = convnd.unfold_channels_first(module, x[start : start + step], out_size)
        u = u.reshape(groups, u.shape[0] // groups, -1)  # [G, K', n L]
        a = _add_upper_gram(u, a)
    return _symmetrize_upper(a.sum(0) if groups > 1 else a[0]) / (n * groups)


#: row blocks of the block-triangular Gram product (FLOPs (1 + 1/B) / 2 of the full product)
_GRAM_BLOCKS = 4
#: Gram matrices smaller than this are computed as one full product
_GRAM_MIN_ROWS = 128


def _add_upper_gram(u: Tensor, acc: Tensor | None) -> Tensor:
    """Add the block upper triangle (diagonal blocks included) of `u uᵀ` to `acc`.

    `u` is `[G, K, M]`; only the blocks on and right of the diagonal of the `[G, K, K]` result
    are written (the rest stays zero), so the product costs about half of `u @ uᵀ`.
    """
    groups, k = u.shape[0], u.shape[1]
    if acc is None:
        acc = u.new_zeros(groups, k, k)
    if k < _GRAM_MIN_ROWS:
        return acc.baddbmm_(u, u.transpose(1, 2))
    bounds = [k * i // _GRAM_BLOCKS for i in range(_GRAM_BLOCKS + 1)]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        acc[:, lo:hi, lo:].baddbmm_(u[:, lo:hi], u[:, lo:].transpose(1, 2))
    return acc


def _symmetrize_upper(a: Tensor) -> Tensor:
    """Complete a `[K, K]` matrix whose block upper triangle holds a symmetric matrix."""
    k = a.shape[0]
    if k < _GRAM_MIN_ROWS:
        return a
    bounds = [k * i // _GRAM_BLOCKS for i in range(_GRAM_BLOCKS + 1)]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        a[hi:, lo:hi] = a[lo:hi, hi:].T
    return a


def _transposed_unfold(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
    """For each output position of a transposed conv, the inputs each kernel offset meets.

    A transposed convolution with a one-hot kernel per (channel, offset) pair scatters the input
    exactly like the layer does: `[N, C_in * K, L_out]`.
    """
    c_in, k = x.shape[1], math.prod(module.kernel_size)
    dims = convnd.spatial_dims(module)
    eye = torch.eye(k, dtype=x.dtype, device=x.device).reshape(1, k, *module.kernel_size)
    weight = eye.expand(c_in, k, *module.kernel_size)
    conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
    u = conv_t(
        x,
        weight,
        None,
        module.stride,
        module.padding,
        convnd.transpose_output_padding(module, x, out_size),
        c_in,
        module.dilation,
    )
    return u.reshape(x.shape[0], c_in * k, -1)


def _in_convolution_precision(method: Any) -> Any:
    """`method` of the rule with its matrix products in the convolutions' precision.

    See `backpack.core.device.products_like_convolutions` (TF32 on GPUs where cuDNN uses it).
    """

    @functools.wraps(method)
    def wrapped(self: ConvRule, record: Record, *args: Any, **kwargs: Any) -> Any:
        with device.products_like_convolutions(_input(record)):
            return method(self, record, *args, **kwargs)

    return wrapped


for _method in (
    "per_sample_grads",
    "batch_l2",
    "batch_l2_and_sum",
    "sum_grad_squared",
    "grad_sum_and_squares",
    "grad_sum_and_centred_squares",
    "batch_dot",
    "sqrt_factor",
    "diag_from_factor",
    "kron_output_gram",
    "kron_factors",
):
    setattr(ConvRule, _method, _in_convolution_precision(getattr(ConvRule, _method)))
