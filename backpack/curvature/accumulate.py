"""`accumulate`: extension quantities of a whole data set, one backward per batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack.api import backpack
from backpack.curvature._data import Normaliser, fingerprint, trainable
from backpack.curvature._distributed import all_sum, combine, guarded, local_module
from backpack.curvature._forward import refuse_unfaithful_gradients
from backpack.curvature._fsdp import count_total, is_fully_sharded, sharded_sweep
from backpack.curvature._quantities import (
    BatchScale,
    Callback,
    GradKind,
    Kind,
    Rows,
    isclose,
    kind_of,
)
from backpack.curvature._sweep import Sweep
from backpack.distributed import _group as _dist_group
from backpack.extensions.backprop_extension import BackpropExtension

__all__ = ["accumulate", "Accumulated"]


@dataclass
class Accumulated:
    """Partial or complete result of a sweep: states at the scale of `reduction="sum"`.

    Attributes:
        reduction: The loss's reduction, "mean" or "sum".
        total: `ν = Σ_b ν_b`, the data-set loss's normaliser ("mean" divides by it; for "sum" it
            is the number of batches' `1`s and is not used).
        num_samples: Number of samples swept.
        num_batches: Number of batches swept.
        names: Names of the trainable parameters, in `model.parameters()` order.
        stream_total: The normaliser per-sample rows were streamed with (callback mode).
        ref_scale: `s_ref`, the first batch's scale (states are relative to it).
        ref_count: `N_ref`, the first batch's number of samples.
        ranks: Number of torch.distributed ranks whose shards this result combines (their
            per-sample rows stay on their rank: this rank's rows of the global data set).
        sharded: The sweep of a model sharded with FSDP2 (`fully_shard`): states and gradient
            are this rank's shards of the data-set quantities (`p.to_local()`'s shape).
        owners: For a sharded sweep with Kronecker factors: `{parameter name: rank}` holding
            that parameter's whole factors (the other ranks hold none of them).
    """

    reduction: str
    total: float
    num_samples: int
    num_batches: int
    names: list[str]
    kinds: dict[str, Kind]
    states: dict[str, dict[str, Any]]
    grad: dict[str, Tensor]
    model_fingerprint: tuple
    signature: Any = None
    stream_total: float | None = None
    ref_scale: float = 1.0
    ref_count: int = 1
    ranks: int = 1
    sharded: bool = False
    owners: dict[str, int] | None = None

    @property
    def normaliser(self) -> float:
        """What the data-set loss divides the summed terms by: `ν` for "mean", 1 for "sum"."""
        return self.total if self.reduction == "mean" else 1.0

    def _relative(self) -> tuple[float, float]:
        """`ν / s_ref` and `N / N_ref`: the divisors of the relative states."""
        total = self.total / self.ref_scale if self.reduction == "mean" else 1.0
        return total, self.num_samples / self.ref_count

    @property
    def savefields(self) -> list[str]:
        """The attributes this result holds, one per extension."""
        return list(self.kinds)

    def quantity(self, savefield: str) -> dict[str, Any]:
        """`{parameter name: value}` of one extension's quantity of the data-set loss.

        Per-sample quantities streamed to a callback are `None`; so are, on a model sharded with
        FSDP2, the Kronecker factors of the parameters another rank owns (`owners`).
        """
        values = self._quantity(savefield)
        return {name: None if _placeholder(v) else v for name, v in values.items()}

    def _quantity(self, savefield: str) -> dict[str, Any]:
        """`quantity`, with shape-only (meta) factors where another rank owns them."""
        if savefield not in self.kinds:
            raise KeyError(f"No {savefield!r} in this result; it holds {self.savefields}.")
        kind = self.kinds[savefield]
        total, count = self._relative()
        return {name: kind.final(self.states[savefield][name], total, count) for name in self.names}

    def __getitem__(self, savefield: str) -> dict[str, Any]:
        return self.quantity(savefield)

    def gradient(self) -> dict[str, Tensor]:
        """`{parameter name: gradient of the data-set loss}`."""
        total, _ = self._relative()
        return {name: self.grad[name] / total for name in self.names}

    def merge(self, other: Accumulated) -> Accumulated:
        """The result of both sweeps together (exact: resume a sweep, or combine shards).

        Per-sample rows are concatenated, self's first.

        Raises:
            ValueError: If the sweeps differ in their model's parameters, extensions, reduction
                or batch shapes, or streamed rows with a normaliser the merged total contradicts.
        """
        if self.model_fingerprint != other.model_fingerprint:
            raise ValueError(
                "Cannot merge sweeps of different models: the parameters changed between the "
                "two sweeps (or the models differ)."
            )
        if list(self.kinds) != list(other.kinds):
            raise ValueError(
                f"Cannot merge sweeps of different extensions: {self.savefields} and "
                f"{other.savefields}."
            )
        if self.reduction != other.reduction:
            raise ValueError(
                f"Cannot merge a reduction={self.reduction!r} sweep with a "
                f"reduction={other.reduction!r} one."
            )
        if self.signature is not None and other.signature not in (None, self.signature):
            raise ValueError(
                f"Cannot merge sweeps over batches of different shapes: {self.signature} and "
                f"{other.signature}."
            )
        if self.owners != other.owners:
            raise ValueError(
                "Cannot merge FSDP2 sweeps whose Kronecker factors have different owner ranks."
            )
        ratio, count_ratio = other.ref_scale / self.ref_scale, other.ref_count / self.ref_count
        merged = Accumulated(
            reduction=self.reduction,
            total=self.total + other.total,
            num_samples=self.num_samples + other.num_samples,
            num_batches=self.num_batches + other.num_batches,
            names=list(self.names),
            kinds=self.kinds,
            states={
                f: {
                    n: k.merge(self.states[f][n], k.rescale(other.states[f][n], ratio, count_ratio))
                    for n in self.names
                }
                for f, k in self.kinds.items()
            },
            grad={n: self.grad[n] + other.grad[n] * ratio for n in self.names},
            model_fingerprint=self.model_fingerprint,
            signature=self.signature if self.signature is not None else other.signature,
            stream_total=self.stream_total,
            ref_scale=self.ref_scale,
            ref_count=self.ref_count,
            ranks=max(self.ranks, other.ranks),
            sharded=self.sharded,
            owners=self.owners,
        )
        if self.stream_total is not None or other.stream_total is not None:
            streamed = {t for t in (self.stream_total, other.stream_total) if t is not None}
            if len(streamed) > 1 or not isclose(streamed.pop(), merged.normaliser):
                raise ValueError(
                    "Per-sample rows were streamed normalised by "
                    f"{self.stream_total} and {other.stream_total}, but the merged data set's "
                    f"normaliser is {merged.normaliser}: pass total=<data-set normaliser> to "
                    "every partial sweep."
                )
        return merged

    def write(self, model: nn.Module, grad: bool = True) -> None:
        """Store the quantities on `model`'s trainable parameters (and `.grad` unless False).

        On a model sharded with FSDP2 each rank's shards become DTensors laid out like the
        parameter (`p.diag_ggn_exact.to_local()`: this rank's shard; `.full_tensor()`: the whole
        quantity, a collective), as FSDP2's `.grad`; `batch_l2` rows stay plain tensors, and
        Kronecker factors are plain `[G, A]` lists on their owner rank (`owners`), absent on the
        other ranks.

        Raises:
            ValueError: If `model`'s trainable parameters are not those swept.
        """
        params = trainable(model)
        if [name for name, _ in params] != self.names:
            raise ValueError(
                "The model's trainable parameters are not those of the sweep: "
                f"{[name for name, _ in params]} vs. {self.names}."
            )
        values = {f: self.quantity(f) for f in self.kinds}
        gradient = self.gradient() if grad else None
        for name, p in params:
            for f in self.kinds:
                if values[f][name] is not None:
                    shard = self.sharded and not isinstance(self.kinds[f], Rows)
                    setattr(p, f, _like(p, values[f][name], shard))
            if gradient is not None:
                p.grad = _like(p, gradient[name].detach().clone(), self.sharded)


def _placeholder(value: Any) -> bool:
    """Whether `value` is a list of shape-only (meta) factors another rank owns."""
    return isinstance(value, list) and any(
        isinstance(v, Tensor) and v.device.type == "meta" for v in value
    )


def _like(p: Tensor, value: Any, sharded: bool) -> Any:
    """`value`, this rank's shard of a quantity of `p`, as a DTensor laid out like `p`."""
    if not sharded or not hasattr(p, "to_local") or not isinstance(value, Tensor):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _extensions(extensions: BackpropExtension | Sequence[BackpropExtension]) -> dict[str, Kind]:
    if isinstance(extensions, BackpropExtension):
        extensions = [extensions]
    kinds: dict[str, Kind] = {}
    for ext in extensions:
        if not isinstance(ext, BackpropExtension):
            raise ValueError(
                f"accumulate needs extension instances (e.g. DiagGGNExact()), got {ext!r}."
            )
        if ext.savefield in kinds:
            raise ValueError(f"Two extensions write {ext.savefield!r}.")
        kinds[ext.savefield] = kind_of(ext)
    return kinds


def count_normaliser(
    model: nn.Module,
    lossfunc: Any,
    data: Iterable,
    normaliser: Normaliser | None = None,
    num_samples: Callable[[Any], int] | None = None,
) -> float:
    """ν of a data set: one forward pass per batch without gradients (for streaming rows).

    Args:
        model: The model.
        lossfunc: The loss function.
        data: Re-iterable `(X, y)` batches.
        normaliser: Custom `(output, y) -> ν_b`.
        num_samples: Custom `X -> number of samples`.

    Returns:
        `Σ_b ν_b` (the number of batches for `reduction="sum"`, whose normaliser is 1).
    """
    sweep = Sweep(model, lossfunc, data, normaliser=normaliser, num_samples=num_samples)
    return sweep.count_normaliser()


def accumulate(
    model: nn.Module,
    lossfunc: Any,
    data: Iterable,
    extensions: BackpropExtension | Sequence[BackpropExtension],
    progress: bool = False,
    callback: Callback | None = None,
    total: float | None = None,
    normaliser: Normaliser | None = None,
    num_samples: Callable[[Any], int] | None = None,
    write: bool = True,
    distributed: bool | None = None,
) -> Accumulated:
    """Extension quantities of the data-set loss: one backward per batch of `data`.

    The data-set loss is the sum of all samples' terms for `reduction="sum"`, their mean (over
    every non-ignored target, with class weights: divided by the sum of the targets' weights)
    for `reduction="mean"`, as if the whole data set were one batch. Afterwards every trainable
    parameter holds each extension's quantity of that loss under its usual attribute, and
    `.grad` holds its gradient. See the docs page "Curvature of a data set" for each
    extension's definition over batches (the variance is the one over all samples; `KFAC`'s and
    `KFLR`'s `A` averages all inputs, `G` sums with the loss's factor).

    Args:
        model: The model; `extend`-ed here if it is not yet.
        lossfunc: The loss (a torch loss module with reduction "mean" or "sum"; `extend`-ed here).
        data: Any iterable of `(X, y)` batches, e.g. a `DataLoader`. Batches may differ in their
            number of samples, nothing else.
        extensions: One extension instance or several.
        progress: Show a progress bar (needs tqdm).
        callback: Stream per-sample quantities (`BatchGrad`, `BatchL2Grad`, `BatchDiag*`,
            `SqrtGGN*`) instead of keeping them: called with `(batch_index, param_name, value)`,
            `value` being that batch's rows of the data-set loss's quantity.
        total: The data-set normaliser ν that streamed rows are divided by for
            `reduction="mean"`. Default: counted with a forward pass over `data` first.
        normaliser: Custom `(output, y) -> ν_b` for losses the library does not know.
        num_samples: Custom `X -> number of samples` (default: first axis of the first tensor).
        write: Store the quantities and `.grad` on the parameters (`result.write(model)`); with
            False the parameters keep their `.grad` from before the call and get no attribute.
        distributed: Under `torch.distributed`, `data` is this rank's shard: each rank sweeps
            its shard locally (no collective per batch; shards may differ in their numbers and
            sizes of batches) and one exchange at the end gives every rank the quantities of
            the whole data set (per-sample rows: this rank's rows, scaled as rows of the whole
            data set; `total` is the whole data set's). None (default): when torch.distributed
            runs with more than one process; True: always (raises if it is not initialised);
            False: this rank's shard only. Every rank must call `accumulate` together. A
            model sharded with FSDP2 (`fully_shard`) is swept with one reduce-scatter per
            batch (every rank needs the same number of batches) and each rank gets its shard
            of the gradient, `SumGradSquared`, `Variance` and the diagonals, written as
            DTensors like FSDP's `.grad`; `KFLR`/`KFAC` factors are whole on one owner rank
            per parameter (`result.owners`; None on the others); per-sample rows are this
            rank's samples' rows of whole parameters, kept or streamed (docs: "Distributed
            sweeps").

    Returns:
        An `Accumulated` result (mergeable with another sweep's, and `write`-able to a model).

    Raises:
        ValueError: For an empty `data`, batches of changing shapes, parameters changed during
            the sweep, an extension that cannot be combined over batches, or an embedding with
            `scale_grad_by_freq` or with rows its `max_norm` would renormalise (docs: "What a
            sweep refuses").
        NotImplementedError: For `BatchDotGrad`, `KFRA` and the matrix-product extensions.
        RuntimeError: Under torch.distributed, when another rank's sweep failed, or the ranks
            swept different models, extensions or batch shapes.
    """
    model = local_module(model)
    if not is_fully_sharded(model):
        refuse_unfaithful_gradients(model, "accumulate")
    sweep = Sweep(
        model,
        lossfunc,
        data,
        progress=progress,
        normaliser=normaliser,
        num_samples=num_samples,
        distributed=distributed,
    )
    return accumulate_over(sweep, extensions, callback=callback, total=total, write=write)


def accumulate_over(
    sweep: Sweep,
    extensions: BackpropExtension | Sequence[BackpropExtension],
    callback: Callback | None = None,
    total: float | None = None,
    write: bool = False,
) -> Accumulated:
    """`accumulate` over a prepared `Sweep` (the data-set layer's own entry; see `accumulate`).

    `write` defaults to False: the layer's tools read the result, not the parameters.
    """
    if sweep.sharded:
        return _sharded(sweep, extensions, callback, total, write)
    refuse_unfaithful_gradients(sweep.model, sweep.what)
    group = sweep.group

    def count() -> float:
        counted, error = guarded(group, sweep.count_normaliser, "accumulate")
        if group is None:
            return counted
        (counted,) = all_sum(group, [], [counted or 0.0], error, "count ν")  # every rank's
        return counted

    stream_total = _stream_total(sweep, callback, total, count)
    result, error = guarded(
        group, lambda: _local_sweep(sweep, extensions, callback, stream_total), "accumulate"
    )
    if group is not None:
        result = combine(result, error, group)
    _check_streamed(result.stream_total, result.reduction, result.total)
    if write:
        result.write(sweep.model)
    return result


def _sharded(sweep: Sweep, extensions, callback, total, write) -> Accumulated:
    """`accumulate` of a model sharded with FSDP2: every rank gets its shard of the result.

    Per-sample rows are this rank's samples' rows of whole parameters, kept or streamed (with
    the whole data set's `ν`, counted in one lockstep pass unless `total` is given).
    """
    if sweep.distributed is False or not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "accumulate(..., distributed=False) cannot sweep a model sharded with FSDP2 "
            "(fully_shard): its forward and backward are collectives over every rank, so the "
            "sweep covers every rank's shard of the data. Pass distributed=None or True."
        )
    kinds = _extensions(extensions)
    exts = [extensions] if isinstance(extensions, BackpropExtension) else list(extensions)
    stream_total = _stream_total(sweep, callback, total, lambda: count_total(sweep))
    for kind in kinds.values():
        if isinstance(kind, Rows):
            kind.callback = callback
    fields = sharded_sweep(sweep, exts, kinds, _dist_group(), stream_total)
    result = Accumulated(**fields)
    _check_streamed(result.stream_total, result.reduction, result.total)
    if write:
        result.write(sweep.model)
    return result


def _stream_total(
    sweep: Sweep, callback: Callback | None, total: float | None, count: Callable[[], float]
) -> float | None:
    """The `ν` streamed rows are divided by: 1 for "sum", `total` if given, else `count()`."""
    if callback is None:
        return None
    if sweep.reduction == "sum":
        return 1.0
    if total is not None:
        return float(total)
    sweep.needs_reiterable("accumulate(callback=...) without total=")
    return count()


def _check_streamed(stream_total: float | None, reduction: str, nu_total: float) -> None:
    if stream_total is not None and reduction == "mean" and not isclose(stream_total, nu_total):
        raise ValueError(
            f"Rows were streamed divided by total={stream_total}, but the data set's normaliser "
            f"is {nu_total} (a loader that drops or reshuffles targets between sweeps? under "
            "torch.distributed: total is the whole data set's, over all ranks)."
        )


def _local_sweep(sweep: Sweep, extensions, callback, stream_total) -> Accumulated:
    """This process's sweep over its data (its shard under torch.distributed), not written."""
    kinds = _extensions(extensions)
    exts = [extensions] if isinstance(extensions, BackpropExtension) else list(extensions)
    reduction = sweep.reduction
    if callback is not None:
        for kind in kinds.values():
            if isinstance(kind, Rows):
                kind.callback = callback
    sweep.extend()
    model = sweep.model
    params = sweep.trainable()
    if not params:
        raise ValueError("The model has no trainable parameter.")
    names = [name for name, _ in params]
    before = fingerprint(model)
    saved_grads = [p.grad for _, p in params]
    grad_kind = GradKind()
    states: dict[str, dict[str, Any]] = {f: dict.fromkeys(names) for f in kinds}
    grads: dict[str, Any] = dict.fromkeys(names)
    nu_total, samples, batches, signature = 0.0, 0, 0, None
    ref_scale, ref_count = None, None
    for batch in sweep.batches("accumulate"):
        for _, p in params:
            p.grad = None
        with torch.enable_grad():
            output = model(batch.X)
            nu = sweep.nu(output, batch.y)
            scale = sweep.scale(nu)
            if ref_scale is None and scale != 0:
                ref_scale = scale
            if ref_count is None:
                ref_count = batch.num_samples
            info = BatchScale(
                index=batch.index,
                scale=scale / (ref_scale or 1.0),
                num_samples=batch.num_samples,
                count_scale=batch.num_samples / ref_count,
                stream_total=None if stream_total is None else stream_total / (ref_scale or 1.0),
            )
            if sweep.empty(nu):
                for name, p in params:
                    for f, kind in kinds.items():
                        states[f][name] = kind.skip(states[f][name], info, name, p)
            else:
                loss = sweep.lossfunc(output, batch.y)
                with backpack(*exts, sync=False):
                    loss.backward()
                _collect(params, kinds, states, grads, grad_kind, info)
        del output
        nu_total += nu
        samples += batch.num_samples
        batches += 1
        if signature is None:
            signature = batch.signature
    if fingerprint(model) != before:
        raise ValueError("The model's parameters changed during the sweep.")
    for name, p in params:
        if grads[name] is None:  # only batches without loss terms
            grads[name] = torch.zeros_like(p)
    result = Accumulated(
        reduction=reduction,
        total=nu_total,
        num_samples=samples,
        num_batches=batches,
        names=names,
        kinds=kinds,
        states=states,
        grad=grads,
        model_fingerprint=before,
        signature=signature,
        stream_total=stream_total,
        ref_scale=ref_scale or 1.0,
        ref_count=ref_count,
    )
    for (_, p), saved in zip(params, saved_grads):
        p.grad = saved
    return result


def _collect(params, kinds, states, grads, grad_kind, info: BatchScale) -> None:
    """Add one batch's quantities of every parameter to the states, then free them."""
    for name, p in params:
        if p.grad is None:
            raise ValueError(
                f"Parameter {name} got no gradient in batch {info.index}: accumulate needs "
                "every trainable parameter to take part in the loss (freeze unused ones)."
            )
        grads[name] = grad_kind.add(grads[name], p.grad, info, name, None)
        for f, kind in kinds.items():
            value = getattr(p, f, None)
            if value is None:
                raise ValueError(
                    f"Parameter {name} got no {f!r} in batch {info.index} (is its layer "
                    "supported by this extension? see the warnings)."
                )
            states[f][name] = kind.add(states[f][name], value, info, name, p.grad)
            delattr(p, f)
