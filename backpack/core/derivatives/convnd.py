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
    return torch.matmul(a, b.transpose(-1, -2)).reshape(a.shape[0], *module.weight.shape)


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
    if module.groups != 1 or grad_output.device.type != "cpu":
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
    budget = _UNFOLD_CHUNK.get(x.device.type, _UNFOLD_CHUNK_DEFAULT)
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
    grad = factor.reshape(v, n, groups, per_group, *out_grid).transpose(0, 1).transpose(1, 2)
    grad = grad.reshape(1, n * groups * v * per_group, *out_grid)
    if transposed:
        shape = (n * c_in, v * per_group, *kernel)
    else:
        shape = (n * groups * v * per_group, c_in // groups, *kernel)
    weight = factor.new_empty(()).expand(shape)  # only its shape matters for the weight gradient
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


def prefer_fold(module: nn.Module, x: Tensor, out_grid: Sequence[int]) -> bool:
    """Whether the rules should use `pair_weight_grads_fold` (saving memory, or faster)."""
    if _SAVE_MEMORY:
        return True
    if module.groups != 1 or x.device.type != "cpu":
        return False
    return _large_grid(module, x, out_grid, thin_ok=True)


# --- the input Kronecker factor from channel correlations -----------------------------------
#: grids (output positions) and unfolded rows from which `input_gram_by_correlation` is used
_CORRELATION_MIN_POSITIONS = 256
_CORRELATION_MIN_ROWS = 128
#: ... and the work (samples x positions from 32x32 grids on, times channels on smaller grids)
#: from which it pays:
#: the border corrections cost a fixed number of thin products per call. Measured on CPU
#: (2 threads, 3x3 kernels, C = 16-64, N = 16-64): 0.5-0.75x the unfolded Gram's time above
#: these sizes, up to 1.5x (16x16, C = 32, N = 16) or 3x (12x12) below them
_CORRELATION_MIN_SAMPLE_POSITIONS = 2**14
_CORRELATION_MIN_WORK = 2**19


def _correlations(
    x: Tensor, padded: Tensor, kernel: Sequence[int], dilation: Sequence[int], rows, cols
) -> Tensor:
    """Σ_n Σ_{(r, q) ∈ rows × cols} x[n, :, r, q] ⊗ x[n, :, r + δh, q + δw] for every offset.

    δ = ((i - Kh + 1) dh, (j - Kw + 1) dw) for entry `[..., i, j]` of the `[C, C, 2Kh - 1,
    2Kw - 1]` result; values outside the input count as zero (`padded` is x padded by
    (K - 1) d on each side). This is the weight gradient of a convolution with a (2K - 1)-sized
    dilated kernel, so torch's conv backward computes it.
    """
    (kh, kw), (dh, dw) = kernel, dilation
    ph, pw = (kh - 1) * dh, (kw - 1) * dw
    window = padded[:, :, rows[0] : rows[1] + 2 * ph, cols[0] : cols[1] + 2 * pw]
    strip = x[:, :, rows[0] : rows[1], cols[0] : cols[1]]
    return _shifted_products(strip, window, (2 * kh - 1, 2 * kw - 1), dilation)


def _shifted_products(
    x: Tensor, window: Tensor, offsets: Sequence[int], dilation: Sequence[int]
) -> Tensor:
    """`[C, C, *offsets]`: Σ x[n, c, p] window[n, c', p + δ d] per offset δ (a weight backward)."""
    c = x.shape[1]
    return torch.ops.aten.convolution_backward(
        x,
        window,
        x.new_empty(c, c, *offsets),
        None,
        [1, 1],
        [0, 0],
        list(dilation),
        False,
        [0, 0],
        1,
        [False, True, False],
    )[1]


def _full_correlations(x: Tensor, kernel: Sequence[int], dilation: Sequence[int]) -> Tensor:
    """`_correlations` over the whole input, from its half with nonnegative row offsets.

    Over the whole (zero-padded) input, the correlation at offset -δ is the one at δ with the
    two channels swapped, so one conv weight backward with a `[K, 2K - 1]` kernel (rows shifted
    downwards only) gives all `(2K - 1)²` offsets: (2K - 1)K instead of (2K - 1)² products.
    """
    (kh, kw), (dh, dw) = kernel, dilation
    ph, pw = (kh - 1) * dh, (kw - 1) * dw
    # [C, C, Kh, 2Kw - 1]: row offsets 0, dh, ..., (Kh - 1) dh
    half = _shifted_products(x, F.pad(x, [pw, pw, 0, ph]), (kh, 2 * kw - 1), (dh, dw))
    upper = half[:, :, 1:].flip(2, 3).transpose(0, 1)  # row offsets -(Kh - 1) dh, ..., -dh
    return torch.cat([upper, half], 2)


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
        or x.device.type != "cpu"
    ):
        return False
    rows = x.shape[1] * math.prod(module.kernel_size)
    positions = math.prod(out_size)
    if positions < _CORRELATION_MIN_POSITIONS or rows < _CORRELATION_MIN_ROWS:
        return False
    work = x.shape[0] * positions
    if positions >= 4 * _CORRELATION_MIN_POSITIONS:
        if work < _CORRELATION_MIN_SAMPLE_POSITIONS:
            return False
    elif work * x.shape[1] < _CORRELATION_MIN_WORK:
        return False
    # each input row/column some offset never reads costs one more (thin) correlation
    excluded = 0
    for axis, windows in enumerate(_kernel_windows(module, x, out_size)):
        size = x.shape[2 + axis]
        excluded += size - min(w[1] - w[0] for w in windows) if windows else 0
    return excluded <= 2 * sum(module.kernel_size)


def input_gram_by_correlation(module: nn.Module, x: Tensor, out_size: Sequence[int]) -> Tensor:
    """Σ_{n,l} u_nl u_nlᵀ of the unfolded input of a stride-1, ungrouped, zero-padded Conv2d.

    Entry ((c, k), (c', k')) sums x[c, p] x[c', p + (k' - k) d] over the input positions p that
    offset k reads. The sums over the whole input for all offsets are one correlation (a conv
    weight gradient); the positions offset k does not read (a few border rows and columns) are
    subtracted, their intersections added back. Same numbers as the unfolded `U Uᵀ`, with
    (2K - 1) K (`_full_correlations`) instead of K² (K + 1) / 2 products per channel pair and
    position.
    """
    c, h, w = x.shape[1:]
    (kh, kw), dilation = module.kernel_size, module.dilation
    row_windows, col_windows = _kernel_windows(module, x, out_size)
    ph, pw = (kh - 1) * dilation[0], (kw - 1) * dilation[1]
    padded = F.pad(x, [pw, pw, ph, ph])
    full = _full_correlations(x, (kh, kw), dilation)
    cache: dict[tuple, Tensor] = {}

    def part(rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
        if (rows, cols) not in cache:
            cache[rows, cols] = _correlations(x, padded, (kh, kw), dilation, rows, cols)
        return cache[rows, cols]

    blocks = []
    for rw in row_windows:
        skipped_rows = [r for r in range(h) if not rw[0] <= r < rw[1]]
        for cw in col_windows:
            skipped_cols = [q for q in range(w) if not cw[0] <= q < cw[1]]
            block = full.clone()
            for r in skipped_rows:
                block -= part((r, r + 1), (0, w))
            for q in skipped_cols:
                block -= part((0, h), (q, q + 1))
            for r in skipped_rows:
                for q in skipped_cols:
                    block += part((r, r + 1), (q, q + 1))
            blocks.append(block)
    # block (a, b) holds offset k = (a, b) against every k' at index k' - k + K - 1
    per_offset = torch.stack(blocks).reshape(kh, kw, c, c, 2 * kh - 1, 2 * kw - 1)
    a, b, a2, b2 = torch.meshgrid(
        *(torch.arange(k, device=x.device) for k in (kh, kw, kh, kw)), indexing="ij"
    )
    gram = per_offset[a, b, :, :, a2 - a + kh - 1, b2 - b + kw - 1]  # [kh, kw, kh, kw, c, c]
    return gram.permute(4, 0, 1, 5, 2, 3).reshape(c * kh * kw, c * kh * kw)
