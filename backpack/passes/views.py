"""Calls as rules expect them: samples along axis 0, placed among all the pass's samples.

Layers inside sequence-first transformer layers see their samples along axis 1; calls whose
output holds no sample axis are broadcast over the samples; calls of several forwards hold
different rows of the pass's samples. Rules see every call with its samples first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from backpack.passes.coverage import due_for_check
from backpack.passes.state import GENERIC_RULE
from backpack.recording import Record, call_params, describe, promote_half
from backpack.rules import find_rule
from backpack.rules.losses import is_loss

if TYPE_CHECKING:  # pragma: no cover
    from backpack.passes.state import BackwardState


def _move(obj: Any, axis: int) -> Any:
    """`obj` (a tensor, or tuples/lists of them) with `axis` moved to the front."""
    if isinstance(obj, Tensor):
        return obj.movedim(axis, 0) if obj.dim() > axis else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(o, axis) for o in obj)
    return obj


def _moved_view(record: Record, axis: int) -> Record:
    """A call whose samples run along `axis`, seen with samples along axis 0."""
    extra = dict(record.extra)
    if "factors" in extra:
        extra["factors"] = {
            key: {
                pos: ([None if f is None else f.movedim(axis + 1, 1) for f in factors], sign)
                for pos, (factors, sign) in per_loss.items()
            }
            for key, per_loss in extra["factors"].items()
        }
    for key in ("residuals", "residuals_diag", "residuals_mp"):
        if extra.get(key):
            raise NotImplementedError(
                f"The Hessian extensions do not support {describe(record.module)} with its "
                f"samples along axis {axis} (a sequence-first transformer layer). Use "
                "batch_first=True, or the GGN extensions."
            )
    return record.view(
        _move(record.args, axis),
        {k: _move(v, axis) for k, v in record.kwargs.items()},
        _move(record.outputs, axis),
        _move(record.output_structure, axis),
        extra,
    )


def _broadcast(obj: Any, n: int, front: bool) -> Any:
    """`obj` repeated for `n` samples: along its size-1 axis 0 (`front`), else a new axis 0."""
    if isinstance(obj, Tensor):
        if front and obj.dim() > 0 and obj.shape[0] == 1:
            return obj.expand(n, *obj.shape[1:])
        return obj.unsqueeze(0).expand(n, *obj.shape)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_broadcast(o, n, front) for o in obj)
    return obj


def _broadcast_view(record: Record, n: int) -> Record:
    """A call without a sample axis whose output is broadcast over `n` samples, per sample."""
    front = record.outputs[0].dim() > 0 and record.outputs[0].shape[0] == 1
    return record.view(
        _broadcast(record.args, n, front),
        dict(record.kwargs),
        _broadcast(record.outputs, n, front),
        _broadcast(record.output_structure, n, front),
        record.extra,
    )


def place_rows(value: Tensor, offset: int, total: int, axes: int = 1) -> Tensor:
    """`value`'s sample rows (its first `axes` axes) placed at `offset` among `total` rows."""
    n = value.shape[0]
    shape = (total,) * axes + tuple(value.shape[axes:])
    full = value.new_zeros(shape)
    if axes == 1:
        full[offset : offset + n] = value
    else:
        full[offset : offset + n, offset : offset + n] = value
    return full


def place(quantity: str, value: Tensor, placement: tuple[int, int] | None) -> Tensor:
    """A first-order quantity of one call's samples, as a quantity of all the pass's samples."""
    if placement is None or quantity in ("sum_grad_squared", "grad_sum", "variance"):
        return value
    offset, total = placement
    return place_rows(value, offset, total, 2 if quantity == "batch_dot" else 1)


def view_for_rules(
    state: BackwardState, record: Record, grads: tuple[Tensor | None, ...]
) -> tuple[Record, tuple[Tensor | None, ...]]:
    """The call as rules expect it: samples along axis 0 of every input and output.

    Two kinds of calls need a view: layers inside sequence-first transformer layers (their
    samples run along axis 1), and calls whose output holds no sample axis at all but is
    broadcast over the samples (a position embedding of `torch.arange(T)`).
    """
    unhandled = state.layout.unhandled_broadcast.get(id(record))
    if unhandled is not None:
        raise NotImplementedError(
            f"The output of {describe(record.module)} holds no sample axis (its input has "
            f"none) and is broadcast over the samples by an operation other than an addition "
            f"({unhandled}), so its per-sample quantities cannot be told apart; taking its "
            "leading axis as the samples would give wrong numbers. Give the call a sample axis "
            "yourself (e.g. expand the indices to [N, T] before the lookup)."
        )
    site = state.layout.broadcast.get(id(record))
    if site is not None and not record.freed:
        per_sample = None
        if site.captured and grads[0] is not None:
            per_sample = site.captured_per_sample(record.outputs[0].shape)
        if per_sample is not None or record.extra.get("broadcast"):
            n = per_sample.shape[0] if per_sample is not None else record.extra["broadcast"]
            view = _broadcast_view(record, n)
            if per_sample is not None:
                # 16-bit gradients (bf16 weights, autocast) sum in another order than autograd's
                half = per_sample.dtype in (torch.float16, torch.bfloat16) or state.low_precision
                per_sample = promote_half(per_sample)
                if due_for_check(record.module):  # host reads: on the coverage schedule
                    _check_broadcast_rows(record, per_sample, grads[0], half)
                grads = (per_sample.reshape(view.outputs[0].shape),)
            return view, grads
    axis = record.module.__dict__.get("_backpack_batch_axis", 0)
    if axis and not record.freed and not is_loss(record.module):
        return _moved_view(record, axis), tuple(_move(g, axis) for g in grads)
    return record, grads


def _check_broadcast_rows(record: Record, per_sample: Tensor, grad: Tensor, half: bool) -> None:
    """Refuse per-sample rows of a broadcast output that do not add up to its gradient."""
    total = per_sample.sum(0).reshape(grad.shape)
    expected = grad.to(total)
    finite = bool(torch.isfinite(total).all()) and bool(
        torch.isfinite(expected).all()
    )  # NaN/inf (a diverging run) cannot be compared: keep the rows
    rtol, atol = (2e-2, 2e-2 * float(expected.abs().max())) if half else (1e-4, 1e-6)
    if finite and not torch.allclose(total, expected, rtol=rtol, atol=atol):
        raise RuntimeError(
            f"The output of {describe(record.module)} holds no sample axis and "
            "is broadcast over the samples, but also used elsewhere, so its "
            "per-sample gradients cannot be told apart. Add the sample axis "
            "yourself (e.g. expand the positions to [N, T] before the embedding)."
        )


def check_sample_count(state: BackwardState, record: Record) -> None:
    """Refuse calls of one loss's samples that disagree on how many samples there are.

    A layer applied to sequence-first tensors (`[T, N, D]`, samples along axis 1) or to
    flattened samples (`[N·T, D]`) would otherwise give per-position rows, and curvature
    mixing the positions of a sample, without any error.
    """
    if not state.layout.losses or record.disabled or not call_params(record):
        return
    first = record.args[0] if record.args else None
    if not isinstance(first, Tensor):
        return
    if first.dim() < 2 and not isinstance(record.module, nn.Embedding):
        return  # unbatched calls (an embedding's [N] indices are a batch)
    size = (find_rule(record.module) or GENERIC_RULE).batch_size(record)
    key = state.layout.group_of(record)
    seen = state.sample_counts.get(key)
    if seen is None:
        state.sample_counts[key] = (size, record.module)
        return
    if seen[0] != size:
        raise RuntimeError(
            f"{describe(record.module)} processes {size} samples along its batch axis, but "
            f"{describe(seen[1])}, which the same loss reaches, processes {seen[0]}. One of "
            "them sees the samples along another axis (a layer applied to sequence-first "
            "[T, N, ...] tensors) or flattened with other axes ([N·T, ...]), so its "
            "per-sample quantities would be per position. Keep the batch axis first "
            "(batch_first=True, or transpose before such layers) and do not merge it with "
            "other axes inside the model."
        )
