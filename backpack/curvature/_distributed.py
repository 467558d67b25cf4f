"""Sweeps of a sharded data set under `torch.distributed`: local sweeps, one exchange at the end.

Every rank sweeps its own batches locally (no collective per batch, so shards may differ in their
number and size of batches) and the ranks combine their partial results once at the end, with
the arithmetic of `Accumulated.merge`, which is exact:

- a header all-gather: every rank's error flag, normaliser `ν_r`, sample and batch counts, the
  references its states are relative to, and digests of its model, extensions and batch shapes
  (a rank whose sweep failed still sends it, flagged, so that the others raise instead of
  waiting);
- one all-reduce of every summed state (gradients, diagonals, second moments, Kronecker
  factors), rescaled to rank 0's references first;
- with `Variance`, a second all-reduce: the ranks' centred sums of squares plus the spread of
  their means around the global mean (Chan et al.'s merge for any number of parts).

Per-sample rows stay on their rank (this rank's rows, scaled as rows of the global data-set
loss). Operator products sum each rank's partial product and normaliser in one all-reduce. The
collectives run on backpack's own process group (`backpack.distributed`), so they never
interleave with DDP's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack import distributed as _dist
from backpack.curvature._data import digest
from backpack.curvature._fsdp import is_fully_sharded, refuse
from backpack.curvature._quantities import Rows, VarianceKind

T = TypeVar("T")

_HEADER = ("failed", "total", "samples", "batches", "ref_scale", "ref_count", "model", "setup")


def process_group(distributed: bool | None, what: str) -> Any:
    """Backpack's process group when `what` combines ranks, else None.

    `distributed`: None combines when torch.distributed runs with more than one process; True
    always (raises if torch.distributed is not initialised); False never.

    Raises:
        TypeError: For another value of `distributed`.
        RuntimeError: For True without an initialised torch.distributed.
    """
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(
            f"{what}(..., distributed=...) takes None (combine the ranks' shards when "
            f"torch.distributed is initialised), True or False, got {distributed!r}."
        )
    if distributed is False:
        return None
    ready = dist.is_available() and dist.is_initialized()
    if distributed is True and not ready:
        raise RuntimeError(
            f"{what}(..., distributed=True) needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first (e.g. run the script with torchrun)."
        )
    if not ready or dist.get_world_size() < 2:
        return None
    return _dist._group()


def check_not_fully_sharded(model: nn.Module, what: str, why: str | None = None) -> None:
    """Refuse a model with FSDP2-sharded (`fully_shard`) parameters (operators, KFAC).

    Raises:
        NotImplementedError: Naming what `accumulate` supports and the replicated-copy recipe.
    """
    if is_fully_sharded(model):
        raise refuse(what, why)


def local_module(model: Any) -> Any:
    """The module a `DistributedDataParallel` wraps (its backward would synchronise per batch)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    return model


def rank_of(group: Any) -> int:
    """This process's rank in `group` (0 without one)."""
    return 0 if group is None else dist.get_rank(group)


def world_size(group: Any) -> int:
    """The number of ranks in `group` (1 without one)."""
    return 1 if group is None else dist.get_world_size(group)


def _failed(group: Any, flags: Tensor, own: BaseException | None, what: str) -> None:
    """Raise this rank's own error, or an error naming the first rank that failed."""
    if own is not None:
        raise own
    bad = [r for r, f in enumerate(flags.tolist()) if f]
    if bad:
        raise RuntimeError(
            f"{what}: rank {bad[0]} failed during its local sweep (see its error); every rank "
            "stops here."
        )


def guarded(group: Any, run: Callable[[], T], what: str) -> tuple[T | None, BaseException | None]:
    """Run this rank's local part; return its result, or the error it raised (to send first)."""
    if group is None:
        return run(), None
    try:
        return run(), None
    except Exception as err:  # noqa: BLE001 - agreed with the other ranks, then re-raised
        return None, err


def all_sum(
    group: Any,
    tensors: list[Tensor],
    scalars: list[float],
    error: BaseException | None,
    what: str,
) -> list[float]:
    """All-reduce (sum) `tensors` in place and `scalars` (float64), after an error agreement.

    A rank whose local part failed (`error`) sends zeros, flagged, and re-raises its error; the
    others raise an error naming it. One collective round.
    """
    head = torch.tensor([1.0 if error is not None else 0.0, *scalars], dtype=torch.float64)
    head = head.to(_dist._header_device(group))
    if error is not None:
        for t in tensors:
            t.zero_()
    _dist._communicate(what, [head, *tensors], group, missing="finish its local sweep")
    if head[0].item():
        if error is not None:
            raise error
        raise RuntimeError(
            f"{what}: another rank failed during its local sweep (see its error); every rank "
            "stops here."
        )
    return head[1:].tolist()


def _buckets(tensors: list[Tensor]) -> dict[tuple, list[Tensor]]:
    out: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def all_reduce_flat(group: Any, tensors: list[Tensor], what: str) -> list[Tensor]:
    """Sums of `tensors` over the ranks (one flat buffer per device and dtype)."""
    buckets = _buckets(tensors)
    flats = {key: torch.cat([t.reshape(-1) for t in ts]) for key, ts in buckets.items()}
    _dist._communicate(what, list(flats.values()), group, missing="finish its local sweep")
    pieces: dict[tuple, list[Tensor]] = {}
    for key, ts in buckets.items():
        pieces[key] = list(flats[key].split([t.numel() for t in ts]))
    out = []
    for t in tensors:
        out.append(pieces[(t.device, t.dtype)].pop(0).view(t.shape))
    return out


def combine(result: Any, error: BaseException | None, group: Any) -> Any:
    """The global result from every rank's partial `Accumulated` (this rank's rows stay local).

    Raises:
        RuntimeError: When another rank failed, or the ranks swept different models, extensions,
            reductions or batch shapes.
    """
    what = "combine the ranks' sweeps"
    world = dist.get_world_size(group)
    own = torch.zeros(len(_HEADER), dtype=torch.float64)
    if error is not None or result is None:
        own[0] = 1.0
    else:
        own[1:] = torch.tensor(
            [
                result.total,
                result.num_samples,
                result.num_batches,
                result.ref_scale,
                result.ref_count,
                digest(result.model_fingerprint),
                digest((result.reduction, list(result.kinds), result.signature, result.names)),
            ],
            dtype=torch.float64,
        )
    device = _dist._header_device(group)
    gathered = [torch.zeros_like(own, device=device) for _ in range(world)]
    try:
        dist.all_gather(gathered, own.to(device), group=group)
    except Exception as err:  # pragma: no cover - a rank died
        raise RuntimeError(
            f"backpack could not {what}: a rank did not finish its local sweep within "
            f"{_dist.TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S)."
        ) from err
    table = torch.stack(gathered).cpu()
    _failed(group, table[:, 0], error, what)
    assert result is not None
    labels = ((6, "models (parameters)"), (7, "extensions, reductions or batch shapes"))
    for column, label in labels:
        if len(set(table[:, column].tolist())) > 1:
            raise RuntimeError(
                f"Cannot {what}: the ranks swept different {label}. Every rank must sweep the "
                "same model (same parameter values) with the same extensions and loss, on "
                "batches of the same shapes."
            )
    ref_scale, ref_count = float(table[0, 4]), float(table[0, 5])
    ratio, count_ratio = result.ref_scale / ref_scale, result.ref_count / ref_count

    # rescale to rank 0's references, gather what is summed
    states: dict[str, dict[str, Any]] = {}
    summed: list[Tensor] = []
    slots: list[tuple[str, str, int]] = []  # (savefield, name, position in a list state)
    variances: list[tuple[str, str]] = []
    for f, kind in result.kinds.items():
        states[f] = {}
        for name in result.names:
            state = kind.rescale(result.states[f][name], ratio, count_ratio)
            states[f][name] = state
            if isinstance(kind, Rows) or state is None:
                continue
            if isinstance(kind, VarianceKind):
                count, mean, _ = state
                summed.append(mean * count)
                variances.append((f, name))
            elif isinstance(state, list):
                for i, t in enumerate(state):
                    summed.append(t)
                    slots.append((f, name, i))
                continue
            else:
                summed.append(state)
            slots.append((f, name, -1))
    grads = [result.grad[n] * ratio for n in result.names]
    reduced = all_reduce_flat(group, grads + summed, what)
    grad = dict(zip(result.names, reduced[: len(grads)]))
    total_samples = int(table[:, 2].sum())
    for (f, name, i), value in zip(slots, reduced[len(grads) :]):
        if i >= 0:
            states[f][name][i] = value
        elif isinstance(result.kinds[f], VarianceKind):
            count, mean, var = states[f][name]
            states[f][name] = [count, mean, var, value / total_samples]  # global mean
        else:
            states[f][name] = value
    if variances:
        spreads = []
        for f, name in variances:
            count, mean, var, global_mean = states[f][name]
            spreads.append(var * count + (mean - global_mean).square() * count)
        spreads = all_reduce_flat(group, spreads, what)
        for (f, name), spread in zip(variances, spreads):
            global_mean = states[f][name][3]
            states[f][name] = (total_samples, global_mean, spread / total_samples)
    return replace(
        result,
        total=float(table[:, 1].sum()),
        num_samples=total_samples,
        num_batches=int(table[:, 3].sum()),
        states=states,
        grad=grad,
        ref_scale=ref_scale,
        ref_count=int(ref_count),
        ranks=world,
    )
