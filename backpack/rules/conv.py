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
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack.core.derivatives import convnd
from backpack.recording import Record
from backpack.rules.base import GradOutputs, ModuleRule, Names, register_rule

#: elements a chunk of samples may occupy in one intermediate (Gram matrices, gradients)
_CHUNK_BUDGET = 1 << 24

_CONV_CLASSES = (
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


def _gram(t: Tensor) -> Tensor:
    """`[N, G, L, L]` Gram matrices over the feature axis of factors `[N, G, f, L]`."""
    return torch.matmul(t.transpose(-1, -2), t)


@register_rule(*_CONV_CLASSES)
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
        module = record.module
        x, g = _io(record, grad_outputs)
        result = {}
        if "weight" in names:
            groups, a, b, positions = _factor_sizes(module, x, g)
            if positions * (a + b) < a * b:
                norms = []
                per_sample = groups * max(positions**2, (a + b) * positions)
                for part in _chunks(x.shape[0], per_sample):
                    fa, fb = convnd.weight_grad_factors(module, x[part], g[part])
                    norms.append((_gram(fa) * _gram(fb)).sum((1, 2, 3)))
                result["weight"] = torch.cat(norms)
            elif convnd.save_memory_enabled():
                result["weight"] = torch.cat(
                    [
                        convnd.per_sample_weight_grads(module, x[part], g[part])
                        .flatten(1)
                        .square()
                        .sum(1)
                        for part in _chunks(x.shape[0], module.weight.numel())
                    ]
                )
            else:
                return None
        if "bias" in names:
            result["bias"] = convnd.per_sample_bias_grads(g).square().sum(1)
        return result

    def sum_grad_squared(
        self, record: Record, grad_outputs: GradOutputs, names: Names
    ) -> dict | None:
        """Only when saving memory: Σ_n g_n² accumulated over chunks of samples."""
        if not convnd.save_memory_enabled():
            return None
        module = record.module
        x, g = _io(record, grad_outputs)
        result = {}
        if "weight" in names:
            total = torch.zeros_like(module.weight, dtype=g.dtype)
            for part in _chunks(x.shape[0], module.weight.numel()):
                total += convnd.per_sample_weight_grads(module, x[part], g[part]).square().sum(0)
            result["weight"] = total
        if "bias" in names:
            result["bias"] = convnd.per_sample_bias_grads(g).square().sum(0)
        return result

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

            def gram(t: Tensor) -> Tensor:  # [G, N L, N L]
                flat = t.permute(1, 0, 3, 2).reshape(groups, n * positions, -1)
                return flat @ flat.transpose(1, 2)

            prod = (gram(fa) * gram(fb)).reshape(groups, n, positions, n, positions)
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

    # --- second order ---------------------------------------------------------------------
    def kron_factors(self, record, factors, names):  # noqa: D102
        """`[G, A]` for the weight (`weight.transpose(0, 1)` for transposed convs), `[G]` bias.

        G = Σ_{v,n} (Σ_l s_vnl)(Σ_l s_vnl)ᵀ sums the factor over output positions first (so it
        equals the bias's curvature block); A is the batch mean of the unfolded input's outer
        products summed over positions. For grouped convolutions A averages the groups' input
        factors, which share the weight's `[in_channels / groups * K]` axis.
        """
        module = record.module
        x = _input(record)
        if _is_unbatched(module, x):
            x = x.unsqueeze(0)
        f = factors[0]
        s = f.reshape(f.shape[0], f.shape[1], f.shape[2], -1).sum(-1)  # [V, N, C_out]
        g = torch.einsum("vnc,vnd->cd", s, s)
        result: dict[str, list[Tensor]] = {}
        if "weight" in names:
            n, groups = x.shape[0], module.groups
            if convnd.is_transposed(module):
                if groups != 1:
                    raise NotImplementedError(
                        f"Kronecker factors are not defined for grouped transposed convolutions "
                        f"({module}): the groups share no common input factor."
                    )
                u = _transposed_unfold(module, x, f.shape[3:])
            else:
                xp, padding = convnd.pad_input(module, x)
                u = convnd.unfold(
                    xp, module.kernel_size, module.stride, module.dilation, padding, f.shape[3:]
                )
            u = u.reshape(n, groups, -1, u.shape[-1])
            a = torch.einsum("ngkl,ngjl->kj", u, u) / (n * groups)
            result["weight"] = [g, a]
        if "bias" in names:
            result["bias"] = [g]
        return result


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
