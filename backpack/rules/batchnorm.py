"""`nn.BatchNorm1d/2d/3d`: y = x̂ ⊙ γ + β, normalised per channel (axis 1).

x̂ = (x - μ) / sqrt(σ² + eps). In eval mode with tracked running statistics, μ and σ² are the
running estimates, so every sample is transformed independently and the per-sample gradients are
γ: Σ_s δ_ns ⊙ x̂_ns and β: Σ_s δ_ns (s runs over the spatial positions; δ is the output gradient).

In training mode, or in eval mode without running statistics (`track_running_stats=False`), μ and
σ² (biased) are statistics of the whole batch and samples are coupled. `mixes_samples` then says so;
the engine only lets `BatchGrad` through (with a warning) and its values are the same formulas with
the batch statistics. They still sum to `.grad`, since x̂ does not depend on γ and β.

Every quantity comes from contractions of the centred input with the output gradient into at most
`[N, C]` values, so the fused reductions never allocate more than one input-sized temporary.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from backpack.recording import SHAPE_ONLY_OUTPUTS, Record
from backpack.rules.base import GradOutputs, ModuleRule, Names, register_rule


def uses_batch_statistics(record: Record) -> bool:
    """Whether the recorded call normalised with statistics of its own batch (as torch does)."""
    if record.training:
        return True
    module = record.module
    return module.running_mean is None and module.running_var is None


def _flat(record: Record, grad_outputs: GradOutputs) -> tuple[Tensor, Tensor]:
    """Input and output gradient as `[N, C, S]` (S = product of the spatial sizes, 1 for 2-D)."""
    x, g = record.args[0], grad_outputs[0]
    n, c = x.shape[0], x.shape[1]
    return x.reshape(n, c, -1), g.reshape(n, c, -1)


#: id(module) -> (running statistics' versions, eps, dtype, (mean [C, 1], 1/std [C])): the
#: running statistics of an eval-mode call change only between steps, so a step's backward
#: reuses them instead of launching two kernels per layer (entries die with their module)
_RUNNING: dict[int, tuple[tuple, tuple[Tensor, Tensor]]] = {}


def _statistics(record: Record, x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean `[C, 1]` and inverse standard deviation `[C]` the recorded call normalised with."""
    module = record.module
    if uses_batch_statistics(record):
        var, mean = torch.var_mean(x, dim=(0, 2), correction=0)
        return mean.unsqueeze(1), torch.rsqrt(var + module.eps)
    mean, var = module.running_mean, module.running_var
    key = (mean._version, var._version, id(mean), id(var), module.eps, x.dtype, x.device)
    cached = _RUNNING.get(id(module))
    if cached is not None and cached[0] == key:
        return cached[1]
    if cached is None:
        weakref.finalize(module, _RUNNING.pop, id(module), None)
    mean, var = mean.to(x.dtype), var.to(x.dtype)
    stats = (mean.unsqueeze(1), torch.rsqrt(var + module.eps))
    _RUNNING[id(module)] = (key, stats)
    return stats


def _per_sample(
    record: Record,
    grad_outputs: GradOutputs,
    names: Names,
    subsampling: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """`[N, C]` per-sample gradients of γ ("weight") and β ("bias")."""
    x, g = _flat(record, grad_outputs)
    result: dict[str, Tensor] = {}
    if "weight" in names:
        mean, invstd = _statistics(record, x)  # from the full batch, before subsampling
    if subsampling is not None:
        index = torch.as_tensor(subsampling, device=x.device)
        x, g = x[index], g[index]
    if "weight" in names:
        # Σ_s δ (x − μ), then 1/σ: three passes over the input, no reshuffling of it
        result["weight"] = ((x - mean) * g).sum(2) * invstd
    if "bias" in names:
        result["bias"] = g.sum(2)
    return result


# the rule reads its outputs' shapes only (see `SHAPE_ONLY_OUTPUTS`)
SHAPE_ONLY_OUTPUTS.update({nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d})


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class BatchNormRule(ModuleRule):
    """Per-sample gradients and fused reductions of batch normalisation's γ and β."""

    def mixes_samples(self, record: Record) -> bool:
        """Say whether the call used batch statistics (training mode, or no running stats)."""
        return uses_batch_statistics(record)

    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """`[N, C]` gradients: γ: Σ_s δ ⊙ x̂, β: Σ_s δ."""
        return _per_sample(record, grad_outputs, names, subsampling)

    def batch_l2(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """Squared norms `[N]` from the `[N, C]` per-sample gradients."""
        return {k: v.square().sum(1) for k, v in _per_sample(record, grad_outputs, names).items()}

    def sum_grad_squared(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[C]` sums over samples of squared per-sample gradients."""
        return {k: v.square().sum(0) for k, v in _per_sample(record, grad_outputs, names).items()}

    def grad_sum(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[C]` gradient of this call, contracted over samples and positions in one go."""
        x, g = _flat(record, grad_outputs)
        result: dict[str, Tensor] = {}
        if "weight" in names:
            mean, invstd = _statistics(record, x)
            result["weight"] = ((x - mean) * g).sum((0, 2)) * invstd
        if "bias" in names:
            result["bias"] = g.sum((0, 2))
        return result
