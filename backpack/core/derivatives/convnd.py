"""Convolution math shared by the rules: geometry, unfolding and weight-gradient factors.

Every per-sample weight gradient of a (transposed) convolution is a product of two matrices per
sample and group. For `ConvNd`, with d the output gradient and u the unfolded (padded) input,
    g_n[o, (i, k)] = Σ_l d_n[o, l] u_n[(i, k), l]        (l: output positions),
and for `ConvTransposeNd`, with x the input and v the unfolded output gradient,
    g_n[i, (o, k)] = Σ_q x_n[i, q] v_n[(o, k), q]        (q: input positions).
`weight_grad_factors` returns this pair `(A, B)` with shapes `[N, G, a, L]` and `[N, G, b, L]`
(G groups); `A Bᵀ` is the per-sample gradient, and Gram matrices of A and B over L give squared
norms and inner products of per-sample gradients without forming them ("ghost" norms).

The alternative that never unfolds anything is torch's own convolution weight backward, batched
over samples with `torch.func.vmap` (torch turns it into one grouped convolution). By default the
faster of the two is picked per call: on CPU the vmap path for ungrouped layers with at least
`_VMAP_MIN_POSITIONS` spatial positions, otherwise unfold + batched GEMM in chunks of samples
(small chunks stay in cache; measured 1.5-2.5x faster than unfolding the whole batch at once).
`weight_jac_t_save_memory` makes the rules always use the vmap path and reduce per-sample
quantities in chunks of samples.

Second-order quantities need one weight gradient per (factor column v, sample n) pair, with the
factor column in place of the output gradient. Both algorithms extend to pairs without repeating
work per column: unfolding (`pair_weight_grads_unfold`) unfolds each sample's input once and stacks
the V columns into the rows of one GEMM per sample and group; folding (`pair_weight_grads_fold`)
stacks the V columns as extra output channels and the samples as extra groups of ONE call of
torch's convolution weight backward. Both return `[n, V, G, *weight.shape]`-shaped views with the
weight's first axis split into (G, weight.shape[0] / G).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

from backpack.core import device

__all__ = [
    "weight_jac_t_save_memory",
    "save_memory_enabled",
    "is_transposed",
    "spatial_dims",
    "explicit_padding",
    "pad_input",
    "unfold",
    "transpose_output_padding",
    "weight_grad_factors",
    "per_sample_weight_grads_from_factors",
    "per_sample_weight_grads_vmap",
    "per_sample_weight_grads_unfold",
    "unfolded_elements_per_sample",
    "per_sample_weight_grads",
    "per_sample_bias_grads",
    "weight_grad_sum",
    "unfold_input",
    "unfold_channels_first",
    "patches",
    "pair_operand",
    "pair_weight_grads_unfold",
    "pair_weight_grads_fold",
    "prefer_fold",
]

#: read by the convolution rules: prefer algorithms that never unfold the input
_SAVE_MEMORY: bool = False


class weight_jac_t_save_memory:  # noqa: N801 (public name of the original API)
    """Context manager choosing the memory-saving algorithm for convolution weight quantities.

    Inside `with weight_jac_t_save_memory(True):` the convolution rules compute per-sample weight
    gradients with torch's convolution weight backward batched over samples, instead of
    unfolding the input (which holds `prod(kernel_size)` copies of it), and reduce per-sample
    quantities in chunks of samples. The numbers are the same either way. The previous setting
    is restored on exit; contexts nest.

    Args:
        save_memory: Whether to use the memory-saving algorithm inside the context.

    """

    def __init__(self, save_memory: bool = True) -> None:
        self._new = bool(save_memory)
        self._previous: list[bool] = []

    def __enter__(self) -> weight_jac_t_save_memory:
        global _SAVE_MEMORY
        self._previous.append(_SAVE_MEMORY)
        _SAVE_MEMORY = self._new
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _SAVE_MEMORY
        _SAVE_MEMORY = self._previous.pop()


def save_memory_enabled() -> bool:
    """Whether the memory-saving algorithm for convolution weight quantities is selected."""
    return _SAVE_MEMORY


# --- geometry -------------------------------------------------------------------------------------
def is_transposed(module: nn.Module) -> bool:
    """Whether `module` is a transposed convolution."""
    return bool(getattr(module, "transposed", False))


def spatial_dims(module: nn.Module) -> int:
    """Return the number of spatial dimensions of a convolution module (1, 2 or 3)."""
    return len(module.kernel_size)


def explicit_padding(module: nn.Module) -> list[tuple[int, int]]:
    """Return the (before, after) padding of each spatial dimension that a `ConvNd` applies."""
    padding: Any = module.padding
    if padding == "valid":
        return [(0, 0)] * spatial_dims(module)
    if padding == "same":
        pairs = []
        for k, d in zip(module.kernel_size, module.dilation, strict=True):
            total = d * (k - 1)
            pairs.append((total // 2, total - total // 2))
        return pairs
    return [(p, p) for p in padding]


def pad_input(module: nn.Module, x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """Apply the padding of a `ConvNd` that is not plain symmetric zero padding to its input.

    Returns the (possibly padded) input and the symmetric zero padding left to the convolution,
    so that `F.convNd(x_p, weight, bias, stride, padding, dilation, groups)` is the module's
    output. Strings ("same", "valid") and padding modes other than "zeros" are applied here.
    """
    dims = spatial_dims(module)
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        pads = [p for pair in reversed(explicit_padding(module)) for p in pair]
        if any(pads):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, pads, mode=mode)
        return x, (0,) * dims
    return x, tuple(module.padding)


def unfold(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    out_size: Sequence[int] | None = None,
) -> Tensor:
    """Patches of `x` `[N, C, *spatial]` as `[N, C * prod(kernel_size), L]`, any dimension count.

    Row `c * K + k` (K = prod(kernel_size), k the row-major kernel offset) at column l holds the
    input value that kernel offset k of channel c meets at output position l (row-major over the
    output grid). `padding` zeros are added on both sides; `out_size` truncates the output grid.
    """
    dims = len(kernel_size)
    if dims == 2 and x.dim() == 4:
        # 2-D: one im2col kernel (same row order) instead of padding, views and a copy
        u = F.unfold(x, tuple(kernel_size), tuple(dilation), tuple(padding), tuple(stride))
        if out_size is None or math.prod(out_size) == u.shape[-1]:
            return u
        grid = [
            (x.shape[2 + i] + 2 * padding[i] - dilation[i] * (kernel_size[i] - 1) - 1)
            // stride[i] + 1
            for i in range(2)
        ]
        u = u.reshape(u.shape[0], u.shape[1], *grid)[:, :, : out_size[0], : out_size[1]]
        return u.reshape(u.shape[0], u.shape[1], -1)
    x = patches(x, kernel_size, stride, dilation, padding, out_size)  # [N, C, *out, *kernel]
    perm = [0, 1, *range(2 + dims, 2 + 2 * dims), *range(2, 2 + dims)]
    x = x.permute(perm)
    return x.reshape(x.shape[0], x.shape[1] * math.prod(kernel_size), -1)


def patches(
    x: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    out_size: Sequence[int] | None,
) -> Tensor:
    """Strided view `[N, C, *out, *kernel]` of the patches of `x` (after zero `padding`)."""
    dims = len(kernel_size)
    if any(padding):
        x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
    for i in range(dims):
        x = x.unfold(2 + i, dilation[i] * (kernel_size[i] - 1) + 1, stride[i])
    index: list[slice] = [slice(None)] * 2
    index += [slice(0, s) for s in out_size] if out_size is not None else [slice(None)] * dims
    index += [slice(None, None, d) for d in dilation]
    return x[tuple(index)]


def unfold_channels_first(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
    """Unfolded padded input of a `ConvNd` call as `[C_in * K, N * L]`, in one copy.

    Row `c * K + k` as in `unfold`; column `n * L + l`. This is the layout in which the sum over
    samples and positions of the patches' outer products is a single matrix product.
    """
    xp, padding = pad_input(module, x)
    dims = spatial_dims(module)
    if dims == 2:
        u = unfold(xp, module.kernel_size, module.stride, module.dilation, padding, out_size)
        return u.transpose(0, 1).reshape(u.shape[1], -1)  # [C_in K, N L]: the one copy
    p = patches(xp, module.kernel_size, module.stride, module.dilation, padding, out_size)
    p = p.permute(1, *range(2 + dims, 2 + 2 * dims), 0, *range(2, 2 + dims))
    return p.reshape(x.shape[1] * math.prod(module.kernel_size), -1)


def transpose_output_padding(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> list[int]:
    """Derive the output padding a `ConvTransposeNd` call used from its actual output size.

    This also covers calls with `forward(x, output_size=...)`.
    """
    result = []
    for i, size in enumerate(out_size):
        k, s, d, p = (
            module.kernel_size[i],
            module.stride[i],
            module.dilation[i],
            module.padding[i],
        )
        result.append(size - ((x.shape[2 + i] - 1) * s - 2 * p + d * (k - 1) + 1))
    return result


# --- weight-gradient factors ----------------------------------------------------------------------
def weight_grad_factors(module: nn.Module, x: Tensor, grad_output: Tensor) -> tuple[Tensor, Tensor]:
    """Factors `(A [N, G, a, L], B [N, G, b, L])` with per-sample weight gradients `A Bᵀ`.

    For `ConvNd`, A is the output gradient (a = out_channels / G) and B the unfolded padded
    input (b = in_channels / G * K); for `ConvTransposeNd`, A is the input (a = in_channels / G)
    and B the unfolded output gradient (b = out_channels / G * K).
    """
    n, groups = x.shape[0], module.groups
    if is_transposed(module):
        v = unfold(
            grad_output,
            module.kernel_size,
            module.stride,
            module.dilation,
            module.padding,
            out_size=x.shape[2:],
        )
        a, b = x.reshape(n, groups, -1, v.shape[-1]), v
    else:
        u = unfold_input(module, x, grad_output.shape[2:])
        a, b = grad_output.reshape(n, groups, -1, u.shape[-1]), u
    return a, b.reshape(n, groups, -1, b.shape[-1])


def per_sample_weight_grads_from_factors(module: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """`[N, *weight.shape]` per-sample weight gradients from the factors `A Bᵀ`."""
    n, groups = a.shape[0], a.shape[1]
    flat_a = a.reshape(n * groups, a.shape[2], a.shape[3])
    flat_b = b.reshape(n * groups, b.shape[2], b.shape[3])
    return torch.bmm(flat_a, flat_b.transpose(1, 2)).view(n, *module.weight.shape)


def per_sample_weight_grads_vmap(module: nn.Module, x: Tensor, grad_output: Tensor) -> Tensor:
    """`[N, *weight.shape]` per-sample weight gradients via torch's convolution weight backward.

    The single-sample backward is batched over samples with `torch.func.vmap`; nothing is
    unfolded.
    """
    weight = module.weight.detach()
    dims = spatial_dims(module)
    if is_transposed(module):
        padding = tuple(module.padding)
        output_padding = transpose_output_padding(module, x, grad_output.shape[2:])
    else:
        x, padding = pad_input(module, x)
        output_padding = [0] * dims
    stride, dilation = list(module.stride), list(module.dilation)
    transposed, groups = is_transposed(module), module.groups

    def one(g_n: Tensor, x_n: Tensor) -> Tensor:
        return torch.ops.aten.convolution_backward(
            g_n.unsqueeze(0),
            x_n.unsqueeze(0),
            weight,
            None,
            stride,
            list(padding),
            dilation,
            transposed,
            output_padding,
            groups,
            [False, True, False],
        )[1]

    return vmap(one)(grad_output, x)


#: spatial positions (of the larger of input and output) from which torch's batched weight
#: backward beats chunked unfold + GEMM on CPU (measured on 3c3d-like layers, 1-2 threads)
_VMAP_MIN_POSITIONS = 512
#: ... and from this many unfolded rows per sample (C_in / groups * kernel positions): for thin
#: inputs (RGB stems) the unfolded input is small and its GEMM wins (measured 1.4 vs 6-8 ms)
_VMAP_MIN_ROWS = 128
#: ... and, for the reduced pair products of `prefer_fold`, on grids of half that size for
#: inputs of at most this many channels per group (measured on All-CNN-C-like 16x16 layers,
#: N = 32: 0.6-0.75x the unfolding path's time with 32 input channels, 1.6x with 64)
_VMAP_THIN_CHANNELS = 32
#: elements of unfolded input processed at once (small chunks stay in cache on CPU)
_UNFOLD_CHUNK = {"cpu": 1 << 20}
_UNFOLD_CHUNK_DEFAULT = 1 << 26


def _prefer_vmap(module: nn.Module, x: Tensor, grad_output: Tensor) -> bool:
    """Cost heuristic (measured on CPU): the vmap path wins on large spatial grids."""
    if module.groups != 1 or device.kind(grad_output) != "cpu":
        return False
    return _large_grid(module, x, grad_output.shape[2:])


def _large_grid(
    module: nn.Module, x: Tensor, out_grid: Sequence[int], thin_ok: bool = False
) -> bool:
    """Many positions and enough unfolded rows: torch's batched weight backward is faster.

    `thin_ok`: half the positions suffice for thin inputs (per-pair products, which are squared
    or reduced in cache-sized chunks; writing `[N, *weight]` per-sample gradients is not).
    """
    positions = max(math.prod(x.shape[2:]), math.prod(out_grid))
    channels = module.out_channels if is_transposed(module) else module.in_channels
    rows = channels // module.groups * math.prod(module.kernel_size)
    if rows < _VMAP_MIN_ROWS:
        return False
    thin = thin_ok and channels // module.groups <= _VMAP_THIN_CHANNELS
    return positions >= (_VMAP_MIN_POSITIONS // 2 if thin else _VMAP_MIN_POSITIONS)


def unfolded_elements_per_sample(module: nn.Module, x: Tensor, grad_output: Tensor) -> int:
    """Count the elements that the unfolded factor `B` of one sample holds."""
    kernel = math.prod(module.kernel_size)
    if is_transposed(module):
        return grad_output.shape[1] * kernel * math.prod(x.shape[2:])
    return x.shape[1] * kernel * math.prod(grad_output.shape[2:])


def per_sample_weight_grads_unfold(module: nn.Module, x: Tensor, grad_output: Tensor) -> Tensor:
    """`[N, *weight.shape]` per-sample weight gradients as `A Bᵀ`, in chunks of samples."""
    n = x.shape[0]
    budget = _UNFOLD_CHUNK.get(device.kind(x), _UNFOLD_CHUNK_DEFAULT)
    step = max(1, budget // max(1, unfolded_elements_per_sample(module, x, grad_output)))
    if step >= n:
        a, b = weight_grad_factors(module, x, grad_output)
        return per_sample_weight_grads_from_factors(module, a, b)
    result = grad_output.new_empty(n, *module.weight.shape)
    for start in range(0, n, step):
        part = slice(start, min(n, start + step))
        a, b = weight_grad_factors(module, x[part], grad_output[part])
        out = result[part].view(*a.shape[:3], b.shape[2])
        torch.matmul(a, b.transpose(-1, -2), out=out)
    return result


def per_sample_weight_grads(module: nn.Module, x: Tensor, grad_output: Tensor) -> Tensor:
    """`[N, *weight.shape]` per-sample weight gradients of a (transposed) convolution call."""
    if _SAVE_MEMORY or _prefer_vmap(module, x, grad_output):
        return per_sample_weight_grads_vmap(module, x, grad_output)
    return per_sample_weight_grads_unfold(module, x, grad_output)


def per_sample_bias_grads(grad_output: Tensor) -> Tensor:
    """`[N, C_out]` per-sample bias gradients: output gradients summed over positions."""
    return grad_output.sum(tuple(range(2, grad_output.dim())))


def weight_grad_sum(module: nn.Module, x: Tensor, grad_output: Tensor) -> Tensor:
    """Weight gradient of the whole call (sum over samples), by torch's conv backward."""
    if is_transposed(module):
        padding = list(module.padding)
        output_padding = transpose_output_padding(module, x, grad_output.shape[2:])
    else:
        x, pad = pad_input(module, x)
        padding, output_padding = list(pad), [0] * spatial_dims(module)
    return torch.ops.aten.convolution_backward(
        grad_output,
        x,
        module.weight.detach(),
        None,
        list(module.stride),
        padding,
        list(module.dilation),
        is_transposed(module),
        output_padding,
        module.groups,
        [False, True, False],
    )[1]


# --- weight gradients of (factor column, sample) pairs -------------------------------------------
def unfold_input(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
    """Unfolded padded input `[N, C_in * K, L]` of a `ConvNd` call with output grid `out_size`."""
    xp, padding = pad_input(module, x)
    return unfold(xp, module.kernel_size, module.stride, module.dilation, padding, out_size)


def pair_operand(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
    """The factor that all columns of a sample share in `pair_weight_grads_unfold`.

    `ConvNd`: the unfolded input `[N, G, C_in / G * K, L]`; `ConvTransposeNd`: the input
    `[N, G, C_in / G, L_in]`.
    """
    n, groups = x.shape[0], module.groups
    if is_transposed(module):
        return x.reshape(n, groups, x.shape[1] // groups, -1)
    u = unfold_input(module, x, out_size)
    return u.reshape(n, groups, -1, u.shape[-1])


def _pair_view(module: nn.Module, buf: Tensor, n: int, v: int) -> Tensor:
    """View `[n, V, G, weight.shape[0] / G, *weight.shape[1:]]` of a `[n, G, V, s, t]` buffer.

    `(s, t)` is `(C_out / G, C_in / G * K)` for `ConvNd` and `(C_out / G * K, C_in / G)` for
    `ConvTransposeNd`, whose weight is `[C_in, C_out / G, *kernel]`.
    """
    groups, kernel = module.groups, tuple(module.kernel_size)
    shape = module.weight.shape
    if not is_transposed(module):
        return buf.view(n, groups, v, shape[0] // groups, *shape[1:]).transpose(1, 2)
    k = len(kernel)
    full = buf.view(n, groups, v, shape[1], *kernel, shape[0] // groups)
    return full.permute(0, 2, 1, 3 + 1 + k, 3, *range(4, 4 + k))


def pair_weight_grads_unfold(
    module: nn.Module, x: Tensor, factor: Tensor, shared: Tensor | None = None
) -> Tensor:
    """Weight gradients of all (column, sample) pairs by unfolding: `[n, V, G, ...]` view.

    `factor` `[V, n, C_out, *out]` plays the output gradient; `shared` is `pair_operand` of these
    samples (computed here if None), so callers chunking over columns unfold the input once.
    Per sample and group this is ONE GEMM with the V columns stacked along its rows.
    """
    v, n, groups = factor.shape[0], factor.shape[1], module.groups
    if shared is None:
        shared = pair_operand(module, x, factor.shape[3:])
    if is_transposed(module):
        cols = unfold(
            factor.reshape(v * n, *factor.shape[2:]),
            module.kernel_size,
            module.stride,
            module.dilation,
            module.padding,
            out_size=x.shape[2:],
        )  # [V n, C_out * K, L_in]
        stacked = cols.reshape(v, n, groups, -1, cols.shape[-1])
    else:
        stacked = factor.reshape(v, n, groups, -1, shared.shape[-1])
    s, positions = stacked.shape[3], stacked.shape[4]
    stacked = stacked.permute(1, 2, 0, 3, 4).reshape(n * groups, v * s, positions)
    buf = torch.bmm(stacked, shared.reshape(n * groups, -1, positions).transpose(1, 2))
    return _pair_view(module, buf, n, v)


def pair_weight_grads_fold(module: nn.Module, x: Tensor, factor: Tensor) -> Tensor:
    """Weight gradients of all (column, sample) pairs by ONE convolution weight backward.

    The V columns become extra output channels and the n samples extra groups, so torch's
    weight backward of a single grouped convolution computes every pair; nothing is unfolded.
    Returns the same `[n, V, G, ...]` view as `pair_weight_grads_unfold`.
    """
    v, n, c_out = factor.shape[0], factor.shape[1], factor.shape[2]
    groups, transposed = module.groups, is_transposed(module)
    out_grid, kernel = factor.shape[3:], tuple(module.kernel_size)
    if transposed:
        padding = list(module.padding)
        output_padding = transpose_output_padding(module, x, out_grid)
    else:
        x, pad = pad_input(module, x)
        padding, output_padding = list(pad), [0] * len(kernel)
    c_in = x.shape[1]
    per_group = c_out // groups
    if v == 1:  # (sample, group, channel) order already: no reordering
        grad = factor.reshape(1, n * c_out, *out_grid)
    else:
        grad = factor.reshape(v, n, groups, per_group, *out_grid).transpose(0, 1).transpose(1, 2)
        grad = grad.reshape(1, n * groups * v * per_group, *out_grid)
    if transposed:
        shape = (n * c_in, v * per_group, *kernel)
    else:
        shape = (n * groups * v * per_group, c_in // groups, *kernel)
    weight = _shape_only_weight(factor, shape)  # only its shape matters for the weight gradient
    gw = torch.ops.aten.convolution_backward(
        grad,
        x.reshape(1, n * c_in, *x.shape[2:]),
        weight,
        None,
        list(module.stride),
        padding,
        list(module.dilation),
        transposed,
        output_padding,
        n * groups,
        [False, True, False],
    )[1]
    if transposed:
        # [n, G, C_in / G, V, C_out / G, *k] -> [n, V, G, C_in / G, C_out / G, *k]
        return gw.reshape(n, groups, c_in // groups, v, per_group, *kernel).permute(
            0, 3, 1, 2, *range(4, 5 + len(kernel))
        )
    return gw.reshape(n, groups, v, per_group, c_in // groups, *kernel).transpose(1, 2)


#: (shape, dtype, device) -> an expanded scalar of that shape (`_shape_only_weight`)
_SHAPE_ONLY: dict[tuple, Tensor] = {}


def _shape_only_weight(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A tensor of `shape` (no memory: one expanded scalar) for a weight backward's shape."""
    key = (shape, like.dtype, like.device)
    weight = _SHAPE_ONLY.get(key)
    if weight is None:
        if len(_SHAPE_ONLY) >= 256:
            _SHAPE_ONLY.clear()
        weight = _SHAPE_ONLY[key] = like.new_empty(()).expand(shape)
    return weight


def prefer_fold(module: nn.Module, x: Tensor, out_grid: Sequence[int], columns: int = 1) -> bool:
    """Whether the rules should use `pair_weight_grads_fold` (saving memory, or faster).

    On CUDA with one factor column (squared norms, sums of squares, Monte-Carlo diagonals):
    always, for ungrouped convolutions. The folded weight backward runs in cuDNN (TF32 where
    torch allows it for convolutions), the unfolded `bmm` in float32: BatchL2Grad on ResNet-18
    at 224x224, batch 64, took 3.1x a plain step folded against 5.2x unfolded (H100).
    """
    if _SAVE_MEMORY:
        return True
    if module.groups != 1:
        return False
    kind = device.kind(x)
    if kind == "cuda":
        return columns == 1
    if kind != "cpu":
        return False
    return _large_grid(module, x, out_grid, thin_ok=True)


# --- the input Kronecker factor from channel correlations -----------------------------------
#: unfolded rows (C_in K) and work (samples x channels x output positions) from which
#: `input_gram_by_correlation` is used, and the share of the input's lines (rows plus columns)
#: that kernel offsets may skip: up to `_CORRELATION_MAX_THIN_BORDER` where each offset skips
#: at most one line per axis ('same' padding of 3x3 kernels), `_CORRELATION_MAX_BORDER`
#: otherwise (border corrections then pair more lines with more offsets). Measured on the CPU
#: (1 and 2 threads, 3x3 kernels, N = 16-64, C = 16-96, grids 6-32) against the unfolded Gram:
#: 'same' 0.25-0.75x its time from 8x8 grids on (0.6-1.0x at 6x6 with N C >= 2048, 1.0-1.8x
#: below); 'valid' 0.5-0.9x at 32x32, 1.1-2x at 16x16, 3-6x at 6x6
_CORRELATION_MIN_ROWS = 128
_CORRELATION_MIN_WORK = 2**16
_CORRELATION_MAX_THIN_BORDER = 1 / 6
_CORRELATION_MAX_BORDER = 1 / 16


def _runs(lines: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted indices as maximal runs `[start, stop)` of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in sorted(lines):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _zero_padded_slice(x: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
    """`x[:, :, r0:r1, q0:q1]` where indices outside the input read zeros (a small copy)."""
    (r0, r1), (q0, q1), (h, w) = rows, cols, x.shape[2:]
    inner = x[:, :, max(r0, 0) : min(r1, h), max(q0, 0) : min(q1, w)]
    pads = [max(-q0, 0), max(q1 - w, 0), max(-r0, 0), max(r1 - h, 0)]
    return F.pad(inner, pads) if any(pads) else inner


def _border_correlations(
    x: Tensor,
    kernel: Sequence[int],
    dilation: Sequence[int],
    lines: tuple[Sequence[int], Sequence[int]],
    offsets: tuple[tuple[int, int], tuple[int, int]],
) -> Tensor:
    """Σ_n Σ_{r ∈ rows, q ∈ cols} x[n, :, r, q] ⊗ x[n, :, r + δh, q + δw] per offset δ.

    `lines` holds the rows and the columns (any index sets), `offsets` the ranges of i and j:
    entries `[..., i0:i1, j0:j1]` of the `[C, C, 2Kh - 1, 2Kw - 1]` correlations, whose entry
    (i, j) is at offset δ = ((i - Kh + 1) dh, (j - Kw + 1) dw); x is zero outside the input.
    One matrix product per block of consecutive rows and columns, with a strided view of the
    partners copied so that the copy reads along rows: the border lines are few and thin, and
    torch's convolution weight backward handles such shapes poorly.
    """
    (kh, kw), (dh, dw), n, c = kernel, dilation, x.shape[0], x.shape[1]
    ((i0, i1), (j0, j1)) = offsets
    result = None
    for r0, r1 in _runs(lines[0]):
        for q0, q1 in _runs(lines[1]):
            band = _zero_padded_slice(
                x,
                (r0 + (i0 - kh + 1) * dh, r1 + (i1 - kh) * dh),
                (q0 + (j0 - kw + 1) * dw, q1 + (j1 - kw) * dw),
            )
            sn, sc, sr, sq = band.stride()
            there = band.as_strided(
                (c, i1 - i0, j1 - j0, n, r1 - r0, q1 - q0), (sc, sr * dh, sq * dw, sn, sr, sq)
            ).reshape(c * (i1 - i0) * (j1 - j0), -1)
            here = x[:, :, r0:r1, q0:q1].transpose(0, 1).reshape(c, -1)
            if result is None:
                result = here @ there.T
            else:
                result.addmm_(here, there.T)
    return result.reshape(c, c, i1 - i0, j1 - j0)


#: (h, w, kernel, dilation, dtype, device) -> the DFT matrices of `_whole_correlations`
_DFT_BASES: dict[tuple, tuple[Tensor, ...]] = {}


def _dft_bases(
    size: Sequence[int], kernel: Sequence[int], dilation: Sequence[int], like: Tensor
) -> tuple[Tensor, ...]:
    """Real matrices of the 2-D DFT of a zero-padded input, and of its inverse at our offsets.

    The `[h, w]` input is padded to `[M_h, M_w] = [h + (Kh - 1) dh, w + (Kw - 1) dw]`, so no
    offset we need wraps around. Returns, along w, `[w, 2 F_w]` = [cos | -sin] over the
    F_w = M_w // 2 + 1 frequencies of a real input; along h, `[2 M_h, 2 h]`, the complex
    product as one real matrix; and the inverse's `[(2Kh - 1)(2Kw - 1), M_h F_w]` weights of
    the real and of the imaginary part of the cross-spectrum.
    """
    key = (*size, *kernel, *dilation, like.dtype, like.device)
    bases = _DFT_BASES.get(key)
    if bases is not None:
        return bases
    (h, w), (kh, kw), (dh, dw) = size, kernel, dilation
    mh, mw = h + (kh - 1) * dh, w + (kw - 1) * dw
    fw = mw // 2 + 1
    f64, tau = torch.float64, 2 * math.pi
    ang_w = tau * torch.outer(torch.arange(w, dtype=f64), torch.arange(fw, dtype=f64)) / mw
    along_w = torch.cat([ang_w.cos(), -ang_w.sin()], 1)
    ang_h = tau * torch.outer(torch.arange(mh, dtype=f64), torch.arange(h, dtype=f64)) / mh
    cos_h, sin_h = ang_h.cos(), ang_h.sin()
    along_h = torch.cat([torch.cat([cos_h, sin_h], 1), torch.cat([-sin_h, cos_h], 1)], 0)
    off_h = torch.arange(-(kh - 1), kh, dtype=f64) * dh
    off_w = torch.arange(-(kw - 1), kw, dtype=f64) * dw
    freq_h, freq_w = torch.arange(mh, dtype=f64), torch.arange(fw, dtype=f64)
    theta = tau * (
        (off_h[:, None, None, None] * freq_h[None, None, :, None]) / mh
        + (off_w[None, :, None, None] * freq_w[None, None, None, :]) / mw
    )  # [2Kh - 1, 2Kw - 1, M_h, F_w]
    # a real input's spectrum is Hermitian: the frequencies F_w stand for their mirror images
    weight = torch.full((fw,), 2.0, dtype=f64)
    weight[0] = 1.0
    if mw % 2 == 0:
        weight[-1] = 1.0
    weight = weight / (mh * mw)
    inverse_re = (weight * theta.cos()).reshape((2 * kh - 1) * (2 * kw - 1), mh * fw)
    inverse_im = (weight * theta.sin()).reshape((2 * kh - 1) * (2 * kw - 1), mh * fw)
    bases = tuple(
        t.to(dtype=like.dtype, device=like.device).contiguous()
        for t in (along_w, along_h, inverse_re, inverse_im)
    )
    if len(_DFT_BASES) >= 64:
        _DFT_BASES.clear()
    _DFT_BASES[key] = bases
    return bases


#: cross-spectrum entries (frequencies x C²) formed at once by `_whole_correlations`
_DFT_CHUNK_ELEMENTS = 2**18


def _whole_correlations(x: Tensor, kernel: Sequence[int], dilation: Sequence[int]) -> Tensor:
    """`[C, C, 2Kh - 1, 2Kw - 1]`: Σ_n Σ_p x[n, c, p] x[n, c', p + δ] over the whole input.

    By the correlation theorem: with X the DFT of each zero-padded channel, the correlation is
    the inverse DFT of the cross-spectrum Σ_n conj(X_c) X_c', needed at (2K - 1)² offsets only.
    The transforms and the inverse are matrix products with `_dft_bases`, the cross-spectrum a
    batched product over frequencies: about 4 products per channel pair, sample and input
    position (M_h M_w / 2 complex frequencies), where the direct correlation takes (2K - 1) K.
    Exact up to rounding (float32 rounding is smaller than the direct sum's, measured).
    """
    n, c, h, w = x.shape
    (kh, kw), (dh, dw) = kernel, dilation
    mh, fw = h + (kh - 1) * dh, (w + (kw - 1) * dw) // 2 + 1
    along_w, along_h, inverse_re, inverse_im = _dft_bases((h, w), kernel, dilation, x)
    y = x.reshape(n * c * h, w) @ along_w  # [n c h, (re, im) F_w]
    y = y.reshape(n * c, h, 2, fw).permute(2, 1, 0, 3).reshape(2 * h, n * c * fw)
    z = along_h @ y  # [(re, im) M_h, n c F_w]
    # per frequency, the real and imaginary parts of all samples: [M_h F_w, 2n, C]
    z = z.reshape(2, mh, n, c, fw).permute(1, 4, 0, 2, 3).reshape(mh * fw, 2 * n, c)
    # cross-spectrum Σ_n conj(z_c) z_c' = (re_c re_c' + im_c im_c') + i (re_c im_c' - im_c re_c'),
    # taken to the offsets chunk by chunk of frequencies (the [F, C, C] spectra of wide layers
    # would not stay in cache)
    frequencies = mh * fw
    step = max(1, _DFT_CHUNK_ELEMENTS // (c * c))
    result = turned = None
    for lo in range(0, frequencies, step):
        part = z[lo : lo + step]
        real = torch.bmm(part.transpose(1, 2), part).reshape(-1, c * c)
        mixed = torch.bmm(part[:, :n].transpose(1, 2), part[:, n:]).reshape(-1, c * c)
        if result is None:
            result = inverse_re[:, lo : lo + step] @ real
            turned = inverse_im[:, lo : lo + step] @ mixed
        else:
            result.addmm_(inverse_re[:, lo : lo + step], real)
            turned.addmm_(inverse_im[:, lo : lo + step], mixed)
    offsets = (2 * kh - 1, 2 * kw - 1)
    result, turned = result.reshape(*offsets, c, c), turned.reshape(*offsets, c, c)
    # the imaginary part is mixed - mixedᵀ, and enters with a minus sign
    result = result - turned + turned.transpose(2, 3)
    return result.permute(2, 3, 0, 1)


def _kernel_windows(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> list[list]:
    """Per spatial axis, the input interval each kernel offset reads (clipped to the input)."""
    windows = []
    for i, (before, _) in enumerate(explicit_padding(module)):
        d, size, out = module.dilation[i], x.shape[2 + i], out_size[i]
        starts = [k * d - before for k in range(module.kernel_size[i])]
        windows.append([(max(0, s), min(size, s + out)) for s in starts])
    return windows


def correlation_applies(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> bool:
    """Whether `input_gram_by_correlation` handles this call and is expected to be faster."""
    if (
        is_transposed(module)
        or spatial_dims(module) != 2
        or module.groups != 1
        or module.padding_mode != "zeros"
        or any(s != 1 for s in module.stride)
        or device.kind(x) != "cpu"
        or math.prod(module.kernel_size) == 1
    ):
        return False
    if x.shape[1] * math.prod(module.kernel_size) < _CORRELATION_MIN_ROWS:
        return False
    if x.shape[0] * x.shape[1] * math.prod(out_size) < _CORRELATION_MIN_WORK:
        return False
    # per axis, the most lines one kernel offset skips
    skipped = [
        x.shape[2 + axis] - min(w[1] - w[0] for w in windows) if windows else 0
        for axis, windows in enumerate(_kernel_windows(module, x, out_size))
    ]
    share = sum(skipped) / sum(x.shape[2:])
    thin = max(skipped) <= 1
    return share <= (_CORRELATION_MAX_THIN_BORDER if thin else _CORRELATION_MAX_BORDER)


def _offset_range(
    kernel: int, dilation: int, size: int, lines: Sequence[int], windows: Sequence[int]
) -> tuple[int, int]:
    """Entries i (offset (i - K + 1) d) of border correlations that kernel offsets `windows` use.

    Kernel offset a pairs with every other (entries K - 1 - a to 2K - 2 - a); entries whose
    partners all lie outside the input (lines + offset) are zero and left out.
    """
    lo = max(kernel - 1 - max(windows), kernel - 1 - max(lines) // dilation)
    hi = min(2 * kernel - 1 - min(windows), kernel + (size - 1 - min(lines)) // dilation)
    return lo, hi


def input_gram_by_correlation(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
    """Σ_{n,l} u_nl u_nlᵀ of the unfolded input of a stride-1, ungrouped, zero-padded Conv2d.

    Entry ((c, k), (c', k')) sums x[c, p] x[c', p + (k' - k) d] over the input positions p that
    kernel offset k reads. The sums over the whole input for all offsets are one correlation
    (`_whole_correlations`); the positions offset k = (a, b) does not read, a few border rows
    and columns, are subtracted (one product for the rows offset a skips, one for the columns
    b skips), their intersection added back, each only at the offsets that k pairs with. Same
    numbers as the unfolded `U Uᵀ` up to rounding.
    """
    c, h, w = x.shape[1:]
    (kh, kw), (dh, dw) = module.kernel_size, module.dilation
    row_windows, col_windows = _kernel_windows(module, x, out_size)
    whole = _whole_correlations(x, (kh, kw), (dh, dw))
    skipped_rows = [[r for r in range(h) if not lo <= r < hi] for lo, hi in row_windows]
    skipped_cols = [[q for q in range(w) if not lo <= q < hi] for lo, hi in col_windows]

    def correction(rows: list[int], cols: list[int], by_a: list[int], by_b: list[int]) -> Any:
        """Border correlations as a zero-filled `[C, C, 2Kh - 1, 2Kw - 1]` (None if empty)."""
        if not rows or not cols:
            return None
        (i0, i1), (j0, j1) = (
            _offset_range(kh, dh, h, rows, by_a),
            _offset_range(kw, dw, w, cols, by_b),
        )
        full = x.new_zeros(c, c, 2 * kh - 1, 2 * kw - 1)
        if i0 < i1 and j0 < j1:
            full[:, :, i0:i1, j0:j1] = _border_correlations(
                x, (kh, kw), (dh, dw), (rows, cols), ((i0, i1), (j0, j1))
            )
        return full

    everywhere_a, everywhere_b = list(range(kh)), list(range(kw))
    all_rows, all_cols = list(range(h)), list(range(w))
    row_parts = [correction(r, all_cols, [a], everywhere_b) for a, r in enumerate(skipped_rows)]
    col_parts = [correction(all_rows, q, everywhere_a, [b]) for b, q in enumerate(skipped_cols)]
    blocks = []
    for a in range(kh):
        for b in range(kw):
            # offset (a, b) pairs with (a', b') at entry (a' - a + Kh - 1, b' - b + Kw - 1)
            window = (..., slice(kh - 1 - a, 2 * kh - 1 - a), slice(kw - 1 - b, 2 * kw - 1 - b))
            block = whole[window].clone()
            corner = correction(skipped_rows[a], skipped_cols[b], [a], [b])
            for part, sign in ((row_parts[a], -1), (col_parts[b], -1), (corner, 1)):
                if part is not None:
                    block.add_(part[window], alpha=sign)
            blocks.append(block)
    gram = torch.stack(blocks).reshape(kh, kw, c, c, kh, kw)  # [a, b, c, c', a', b']
    return gram.permute(2, 0, 1, 3, 4, 5).reshape(c * kh * kw, c * kh * kw)
