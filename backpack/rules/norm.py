"""Normalisation with statistics of each sample: LayerNorm, RMSNorm, GroupNorm, InstanceNorm.

All four compute y = x̂ ⊙ γ + β, where x̂ depends on the input only (never on γ, β) and is
computed within one sample: LayerNorm and RMSNorm over the trailing `normalized_shape` axes of
each position, GroupNorm over groups of channels and all positions, InstanceNorm over the
positions of each channel (or, in evaluation mode with tracked statistics, with the running
estimates). So samples never mix, and the layer is linear in its parameters: with δ the output
gradient, sample n's gradients are

    γ: Σ_p δ_np ⊙ x̂_np,        β: Σ_p δ_np,

p running over the positions of the sample that share a parameter entry (tokens of a sequence,
spatial positions of a channel). Every quantity is a contraction of x̂ (recomputed from the
recorded input by one functional normalisation without affine parameters, never by re-running the
module) with δ or with the columns of a curvature factor, over positions, into tensors of at most
`[columns, N, *γ.shape]` entries: the parameters are small, so their per-sample gradients are
cheap and every reduction is taken from them. The first-order ones are cached on the record for
the output gradient they came from, so that several extensions share one contraction.

Layout: the input is viewed as three axes `[N, positions, entries]` ("npk": LayerNorm, RMSNorm,
the parameter axes trail) or `[N, entries, positions]` ("nkp": GroupNorm, InstanceNorm, channels
at axis 1). Output gradients and curvature factors are viewed the same way.

Second order: J_θᵀ f for a factor column f is the same contraction with f in place of δ
(`sqrt_factor`); diagonals square and sum it; `kron_factors` returns one dense factor per
parameter, the exact curvature block Σ_{v,n} (J_θᵀ f_vn)(J_θᵀ f_vn)ᵀ (these layers have no
Kronecker structure). A factor with a single sample broadcast over a batch of N (KFRA's
batch-averaged curvature) gives the batch average (1/N) Σ_n J_nᵀ Ḡ J_n, as for Linear layers.
The layers are nonlinear in their input, so the exact-Hessian extensions refuse models in which
they sit between the parameters and the loss.

Also, registered by qualified name (backpack imports neither package): Hugging Face's RMS norms
(`LlamaRMSNorm`, `T5LayerNorm` and copies), timm's `RmsNorm` and `LayerNorm2d`, and timm's
`LayerScale`/`LayerScale2d` (y = x ⊙ γ: the same math with x̂ = x, linear in the input, so the
Hessian extensions accept them).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack.recording import Record, describe
from backpack.rules.base import (
    GradOutputs,
    ModuleRule,
    Names,
    gram,
    register_rule,
    register_standard_forward,
)

#: key of the per-sample gradient cache in `Record.extra`
_CACHE = "norm_per_sample"


def _times(xhat: Tensor, g: Tensor) -> Tensor:
    """x̂ ⊙ g, overwriting the fresh x̂ where nothing broadcasts or promotes (one temporary less).

    Followed by a sum over positions, this beats einsum's permuted batched matmul (on the CPU
    5-7x for the "npk" layout, on par for "nkp").
    """
    if g.shape == xhat.shape and g.dtype == xhat.dtype:
        return xhat.mul_(g)
    return g * xhat


class _PerSampleNormRule(ModuleRule):
    """Shared math of y = x̂ ⊙ γ + β with x̂ computed within each sample."""

    #: "npk" (parameter entries on the last axis) or "nkp" (on axis 1)
    layout = "npk"
    #: name of γ (the parameter multiplying x̂); β is always "bias"
    scale_name = "weight"

    # --- layer-specific parts ----------------------------------------------------------------
    def normalised(self, record: Record, x: Tensor) -> Tensor:
        """x̂ for a batched input `x` (any subset of the recorded samples), shaped like `x`.

        Always a new tensor: callers overwrite it.
        """
        raise NotImplementedError

    def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:
        """x̂ at the parameter entries `index` only, from the 3-axis view `x3` of the input."""
        raise NotImplementedError

    def entries(self, record: Record) -> int:
        """Number of parameter entries (K): numel of γ."""
        raise NotImplementedError

    def unbatched(self, record: Record) -> bool:
        """Whether the recorded call had no batch axis (then it is one sample)."""
        return False

    # --- views -------------------------------------------------------------------------------
    def batch_size(self, record: Record) -> int:  # noqa: D102
        return 1 if self.unbatched(record) else record.args[0].shape[0]

    def _input(self, record: Record) -> Tensor:
        x = record.args[0]
        return x.unsqueeze(0) if self.unbatched(record) else x

    def _view(self, record: Record, t: Tensor, lead: int = 1) -> Tensor:
        """`t` (`[*lead axes, N, *x.shape[1:]]`) as `[*lead, N, P, K]` or `[*lead, N, K, P]`."""
        k = self.entries(record)
        head = t.shape[: lead + 1]
        if t.dim() == lead + 3 and t.shape[-1 if self.layout == "npk" else lead + 1] == k:
            return t  # already in that layout (a reshape is an operator call too)
        if self.layout == "npk":
            return t.reshape(*head, -1, k)
        return t.reshape(*head, k, -1)

    def _io(self, record: Record, grad_outputs: GradOutputs) -> tuple[Tensor, Tensor]:
        x, g = self._input(record), grad_outputs[0]
        if self.unbatched(record):
            g = g.unsqueeze(0)
        return x, g

    @property
    def _pos(self) -> int:
        """Position axis of the 3-axis view."""
        return 1 if self.layout == "npk" else 2

    def _shapes(self, record: Record, names: Names) -> dict[str, torch.Size]:
        return {n: getattr(record.module, n).shape for n in names}

    # --- contractions ------------------------------------------------------------------------
    def _contract(
        self, record: Record, x: Tensor, g: Tensor, names: Names, lead: int = 0
    ) -> dict[str, Tensor]:
        """Σ_p g ⊙ x̂ (weight) and Σ_p g (bias) per sample: `[*lead, N', *param.shape]`.

        `x` is the batched input `[N, ...]`; `g` has `lead` extra leading axes and N or 1
        samples (a single sample broadcasts against every sample of `x`).
        """
        shapes = self._shapes(record, names)
        g3 = self._view(record, g, lead)
        broadcast = g.shape[lead] == 1 and x.shape[0] != 1
        result = {}
        if "bias" in names:
            bias = g3.sum(lead + self._pos)
            if broadcast:
                bias = bias.expand(*bias.shape[:lead], x.shape[0], bias.shape[-1])
            result["bias"] = bias
        if self.scale_name in names:
            # a product and a sum beat einsum's permuted batched matmul here (measured on the
            # CPU: 5-7x for the "npk" layout, on par for "nkp"); a single-sample g broadcasts
            xhat = self._view(record, self.normalised(record, x), 0)
            result[self.scale_name] = _times(xhat, g3).sum(lead + self._pos)
        return {
            n: v
            if v.shape[lead + 1 :] == shapes[n]
            else v.reshape(*v.shape[: lead + 1], *shapes[n])
            for n, v in result.items()
        }

    def _cached(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """Per-sample gradients of the whole batch, computed once per output gradient."""
        g = grad_outputs[0]
        cached = record.extra.get(_CACHE)
        if cached is None or cached[0]() is not g:
            cached = (weakref.ref(g), {})
            record.extra[_CACHE] = cached
        store = cached[1]
        missing = [n for n in names if n not in store]
        if missing:
            x, g = self._io(record, grad_outputs)
            store.update(self._contract(record, x, g, missing))
        return {n: store[n] for n in names}

    def _peek(self, record: Record, grad_outputs: GradOutputs, name: str) -> Tensor | None:
        """The cached per-sample gradient of `name` for these output gradients, if any."""
        cached = record.extra.get(_CACHE)
        if cached is None or cached[0]() is not grad_outputs[0]:
            return None
        return cached[1].get(name)

    # --- first order -------------------------------------------------------------------------
    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """`[N, *param.shape]`: γ Σ_p δ ⊙ x̂, β Σ_p δ (x̂ of the requested samples only)."""
        if subsampling is None:
            return self._cached(record, grad_outputs, names)
        x, g = self._io(record, grad_outputs)
        index = torch.as_tensor(list(subsampling), dtype=torch.long, device=x.device)
        cached = {n: self._peek(record, grad_outputs, n) for n in names}
        if all(v is not None for v in cached.values()):
            return {n: v[index] for n, v in cached.items()}
        # statistics are per sample, so x̂ of a subset is the subset of x̂
        return self._contract(record, x[index], g[index], names)

    def batch_l2(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[N]` squared norms of the (small) per-sample gradients."""
        psg = self._cached(record, grad_outputs, names)
        return {n: v.flatten(1).square().sum(1) for n, v in psg.items()}

    def sum_grad_squared(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """Σ_n of the squared per-sample gradients."""
        psg = self._cached(record, grad_outputs, names)
        return {n: v.square().sum(0) for n, v in psg.items()}

    def batch_dot(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[N, N]` Gram matrices of the per-sample gradients."""
        psg = self._cached(record, grad_outputs, names)
        return {n: v.flatten(1) @ v.flatten(1).T for n, v in psg.items()}

    def grad_sum(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """This call's gradient: one contraction over samples and positions (or the cache)."""
        result = {}
        todo = []
        for name in names:
            psg = self._peek(record, grad_outputs, name)
            if psg is None:
                todo.append(name)
            else:
                result[name] = psg.sum(0)
        if todo:
            x, g = self._io(record, grad_outputs)
            g3 = self._view(record, g, 0)
            reduce = (0, self._pos)
            if self.scale_name in todo:
                xhat = self._view(record, self.normalised(record, x), 0)
                result[self.scale_name] = _times(xhat, g3).sum(reduce)
            if "bias" in todo:
                result["bias"] = g3.sum(reduce)
            shapes = self._shapes(record, todo)
            result.update({n: result[n].reshape(shapes[n]) for n in todo})
        return result

    def grad_sum_entries(
        self, record: Record, grad_outputs: GradOutputs, name: str, index: Tensor
    ) -> Tensor:
        """Entries `index` of this call's gradient, from x̂ at those entries only."""
        psg = self._peek(record, grad_outputs, name)
        if psg is not None:
            return psg.flatten(1)[:, index].sum(0)
        x, g = self._io(record, grad_outputs)
        g3 = self._view(record, g, 0)
        axis = 2 if self.layout == "npk" else 1
        g_at = g3.index_select(axis, index)
        if name == "bias":
            return g_at.sum((0, self._pos))
        xhat = self.normalised_at(record, self._view(record, x, 0), index)
        return (g_at * xhat).sum((0, self._pos))

    # --- second order ------------------------------------------------------------------------
    def _factor(self, record: Record, factors: Sequence[Tensor | None]) -> Tensor | None:
        f = factors[0]
        if f is not None and self.unbatched(record):
            f = f.unsqueeze(1)
        return f

    def sqrt_factor(self, record, factors, names, subsampling=None):  # noqa: D102
        x, f = self._input(record), self._factor(record, factors)
        if f is None:
            n = x.shape[0] if subsampling is None else len(subsampling)
            shapes = self._shapes(record, names)
            return {k: x.new_zeros(1, n, *s) for k, s in shapes.items()}
        if subsampling is not None:
            index = torch.as_tensor(list(subsampling), dtype=torch.long, device=x.device)
            x = x[index]
            f = f[:, index] if f.shape[1] != 1 else f
        return self._contract(record, x, f, names, lead=1)

    def kron_factors(self, record, factors, names, approx="expand"):  # noqa: D102
        """One dense factor per parameter: Σ_{v,n} (Jᵀ f)(Jᵀ f)ᵀ, `[numel, numel]`.

        A factor with one sample and a recorded batch of N > 1 is KFRA's batch-averaged
        curvature Ḡ, shared by every sample: the block is then (1/N) Σ_n J_nᵀ Ḡ J_n.
        """
        x, f = self._input(record), self._factor(record, factors)
        if f is None:
            shapes = self._shapes(record, names)
            return {k: [x.new_zeros(math.prod(s), math.prod(s))] for k, s in shapes.items()}
        sqrt = self._contract(record, x, f, names, lead=1)
        scale = 1.0 / x.shape[0] if f.shape[1] == 1 and x.shape[0] != 1 else 1.0
        result = {}
        for name, value in sqrt.items():
            flat = value.flatten(2)
            block = gram(flat)
            result[name] = [block * scale if scale != 1.0 else block]
        return result


def _flat_shape(shape: Sequence[int] | int) -> int:
    return math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)


@register_rule(nn.LayerNorm)
class LayerNormRule(_PerSampleNormRule):
    """`nn.LayerNorm`: x̂ normalises the trailing `normalized_shape` axes of each position."""

    layout = "npk"

    def entries(self, record: Record) -> int:  # noqa: D102
        return _flat_shape(record.module.normalized_shape)

    def normalised(self, record: Record, x: Tensor) -> Tensor:  # noqa: D102
        module = record.module
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)

    def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:  # noqa: D102
        var, mean = torch.var_mean(x3, dim=2, keepdim=True, correction=0)
        return (x3.index_select(2, index) - mean) * torch.rsqrt(var + record.module.eps)


if hasattr(nn, "RMSNorm"):  # torch >= 2.4

    @register_rule(nn.RMSNorm)
    class RMSNormRule(_PerSampleNormRule):
        """`nn.RMSNorm`: x̂ = x / sqrt(mean(x²) + eps) over the trailing axes (γ only)."""

        layout = "npk"

        def entries(self, record: Record) -> int:  # noqa: D102
            return _flat_shape(record.module.normalized_shape)

        def normalised(self, record: Record, x: Tensor) -> Tensor:  # noqa: D102
            module = record.module
            return F.rms_norm(x, module.normalized_shape, None, module.eps)

        def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:  # noqa: D102
            eps = record.module.eps
            if eps is None:
                eps = torch.finfo(x3.dtype).eps
            rms = torch.rsqrt(x3.square().mean(2, keepdim=True) + eps)
            return x3.index_select(2, index) * rms


@register_rule(nn.GroupNorm)
class GroupNormRule(_PerSampleNormRule):
    """`nn.GroupNorm` on `[N, C, *]`: x̂ normalises each group of channels of a sample."""

    layout = "nkp"

    def entries(self, record: Record) -> int:  # noqa: D102
        return record.module.num_channels

    def normalised(self, record: Record, x: Tensor) -> Tensor:  # noqa: D102
        module = record.module
        return F.group_norm(x, module.num_groups, None, None, module.eps)

    def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:  # noqa: D102
        module = record.module
        groups = module.num_groups
        n, c = x3.shape[0], x3.shape[1]
        var, mean = torch.var_mean(x3.reshape(n, groups, -1), dim=2, correction=0)
        group = index // (c // groups)
        rstd = torch.rsqrt(var[:, group] + module.eps)
        return (x3.index_select(1, index) - mean[:, group, None]) * rstd[:, :, None]


def _uses_input_statistics(record: Record) -> bool:
    """InstanceNorm normalises with the input's statistics unless eval mode tracks them."""
    module = record.module
    return record.training or not module.track_running_stats or module.running_mean is None


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(_PerSampleNormRule):
    """`nn.InstanceNorm1d/2d/3d` with `affine=True`: each channel of each sample normalised.

    In evaluation mode with `track_running_stats=True`, the running estimates are used instead
    of the input's statistics (the transformation is then affine in the input). Unbatched
    inputs `[C, *spatial]` are one sample.
    """

    layout = "nkp"

    def unbatched(self, record: Record) -> bool:  # noqa: D102
        return record.args[0].dim() == record.module._get_no_batch_dim()

    def entries(self, record: Record) -> int:  # noqa: D102
        return record.module.num_features

    def _running(self, record: Record, x: Tensor) -> tuple[Tensor, Tensor]:
        module = record.module
        return module.running_mean.to(x.dtype), module.running_var.to(x.dtype)

    def normalised(self, record: Record, x: Tensor) -> Tensor:  # noqa: D102
        eps = record.module.eps
        if _uses_input_statistics(record):
            return F.instance_norm(x, use_input_stats=True, eps=eps)
        mean, var = self._running(record, x)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - mean.reshape(shape)) * torch.rsqrt(var + eps).reshape(shape)

    def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:  # noqa: D102
        eps = record.module.eps
        x_at = x3.index_select(1, index)
        if _uses_input_statistics(record):
            var, mean = torch.var_mean(x_at, dim=2, keepdim=True, correction=0)
            return (x_at - mean) * torch.rsqrt(var + eps)
        mean, var = self._running(record, x3)
        return (x_at - mean[index, None]) * torch.rsqrt(var[index, None] + eps)


#: subclasses whose own forward applies the parent's functional op to the same input and
#: parameters (timm's optional "fast norm" path runs the same function in another kernel or
#: in autocast's 16-bit type); checked against the installed timm by
#: tests/rules/test_thirdparty_rules.py
register_standard_forward(
    "timm.layers.norm.LayerNorm", "timm.layers.norm.GroupNorm", "timm.layers.norm.GroupNorm1"
)

if hasattr(nn, "RMSNorm"):
    # timm's RmsNorm: F.rms_norm's function (timm's own formula or apex's fused kernel) of the
    # same attributes (`normalized_shape`, `eps`, `weight`)
    register_rule("timm.layers.norm.RmsNorm")(RMSNormRule)


#: Hugging Face RMS norms whose forward is LlamaRMSNorm's (checked against the installed
#: transformers by tests/rules/test_thirdparty_rules.py)
LLAMA_RMS_NORMS = tuple(
    f"transformers.models.{module}.{name}"
    for module, name in (
        ("llama.modeling_llama", "LlamaRMSNorm"),
        ("mistral.modeling_mistral", "MistralRMSNorm"),
        ("mixtral.modeling_mixtral", "MixtralRMSNorm"),
        ("qwen2.modeling_qwen2", "Qwen2RMSNorm"),
        ("qwen2_moe.modeling_qwen2_moe", "Qwen2MoeRMSNorm"),
        ("qwen3.modeling_qwen3", "Qwen3RMSNorm"),
        ("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeRMSNorm"),
        ("phi3.modeling_phi3", "Phi3RMSNorm"),
        ("granite.modeling_granite", "GraniteRMSNorm"),
        ("deepseek_v3.modeling_deepseek_v3", "DeepseekV3RMSNorm"),
    )
)
#: Hugging Face RMS norms whose forward is T5LayerNorm's
T5_RMS_NORMS = tuple(
    f"transformers.models.{module}.{name}"
    for module, name in (
        ("t5.modeling_t5", "T5LayerNorm"),
        ("mt5.modeling_mt5", "MT5LayerNorm"),
        ("longt5.modeling_longt5", "LongT5LayerNorm"),
        ("umt5.modeling_umt5", "UMT5LayerNorm"),
        ("switch_transformers.modeling_switch_transformers", "SwitchTransformersLayerNorm"),
    )
)


class _HFRMSNormRule(_PerSampleNormRule):
    """Hugging Face's RMS norms: y = γ ⊙ x̂, x̂ = x / sqrt(mean(x²) + eps) over the last axis.

    Their forward takes the mean square in float32 whatever the input's dtype (float64 inputs
    included), with eps = `variance_epsilon`; the rule recomputes x̂ exactly as the forward
    did, so its quantities are the derivatives of what the module computed. Under
    `torch.autocast` and for 16-bit inputs the engine hands rules float32 inputs, and x̂ stays
    in float32 (the forward rounds it to the input's or weight's 16-bit type).
    """

    layout = "npk"

    def entries(self, record: Record) -> int:  # noqa: D102
        return record.module.weight.numel()

    def _rsqrt(self, record: Record, x: Tensor, axis: int) -> Tensor:
        """1 / sqrt(mean(x²) + eps) over `axis`, in float32 as the forward computes it."""
        mean_square = x.to(torch.float32).pow(2).mean(axis, keepdim=True)
        return torch.rsqrt(mean_square + record.module.variance_epsilon)


@register_rule(*LLAMA_RMS_NORMS)
class LlamaRMSNormRule(_HFRMSNormRule):
    """`LlamaRMSNorm` and its copies: x̂ = (x₃₂ · rsqrt(mean(x₃₂²) + eps)).to(x.dtype)."""

    def normalised(self, record: Record, x: Tensor) -> Tensor:  # noqa: D102
        return (x.to(torch.float32) * self._rsqrt(record, x, -1)).to(x.dtype)

    def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:  # noqa: D102
        at = x3.index_select(2, index).to(torch.float32)
        return (at * self._rsqrt(record, x3, 2)).to(x3.dtype)


@register_rule(*T5_RMS_NORMS)
class T5LayerNormRule(_HFRMSNormRule):
    """`T5LayerNorm` and its copies: x̂ = x · rsqrt(mean(x₃₂²) + eps) (x's dtype, or float32)."""

    def normalised(self, record: Record, x: Tensor) -> Tensor:  # noqa: D102
        return x * self._rsqrt(record, x, -1)

    def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:  # noqa: D102
        return x3.index_select(2, index) * self._rsqrt(record, x3, 2)


class _ScaleRule(_PerSampleNormRule):
    """y = x ⊙ γ with γ broadcast over positions (x̂ = x): linear in its input and in γ."""

    scale_name = "gamma"

    def entries(self, record: Record) -> int:  # noqa: D102
        return record.module.gamma.numel()

    def _input(self, record: Record) -> Tensor:
        if record.inplace:
            raise NotImplementedError(
                f"{describe(record.module)} multiplied its input in place (inplace=True), so "
                "the input its parameter's gradient needs is gone. Construct it with "
                "inplace=False."
            )
        return record.args[0]

    def normalised(self, record: Record, x: Tensor) -> Tensor:  # noqa: D102
        return x.clone()

    def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:  # noqa: D102
        return x3.index_select(1 if self.layout == "nkp" else 2, index)


@register_rule("timm.layers.layer_scale.LayerScale")
class LayerScaleRule(_ScaleRule):
    """timm's `LayerScale`: x ⊙ γ on `[N, *, dim]` (γ `[dim]`, the attribute `gamma`)."""

    layout = "npk"


@register_rule("timm.layers.layer_scale.LayerScale2d")
class LayerScale2dRule(_ScaleRule):
    """timm's `LayerScale2d`: x ⊙ γ on `[N, C, H, W]` (γ `[C]` broadcast over positions)."""

    layout = "nkp"


@register_rule("timm.layers.norm.LayerNorm2d")
class LayerNorm2dRule(_PerSampleNormRule):
    """timm's `LayerNorm2d`: LayerNorm over the channels of each position of `[N, C, H, W]`.

    Its forward moves the channels last, applies `F.layer_norm` over them and moves them back:
    x̂ normalises the C channels at every position, γ and β are per channel.
    """

    layout = "nkp"

    def entries(self, record: Record) -> int:  # noqa: D102
        return _flat_shape(record.module.normalized_shape)

    def normalised(self, record: Record, x: Tensor) -> Tensor:  # noqa: D102
        module = record.module
        last = F.layer_norm(x.permute(0, 2, 3, 1), module.normalized_shape, None, None, module.eps)
        return last.permute(0, 3, 1, 2)

    def normalised_at(self, record: Record, x3: Tensor, index: Tensor) -> Tensor:  # noqa: D102
        var, mean = torch.var_mean(x3, dim=1, keepdim=True, correction=0)
        return (x3.index_select(1, index) - mean) * torch.rsqrt(var + record.module.eps)
