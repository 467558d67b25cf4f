"""Sweeping a data set: batches, their sample counts and loss normalisers, progress, fingerprints.

The data-set loss of a sweep over batches b with losses `L_b` is

- `reduction="sum"`: `L = Σ_b L_b`;
- `reduction="mean"`: `L = Σ_b (ν_b / ν) L_b` with `ν_b` the normaliser that batch b's mean
  divides by (the number of non-ignored targets of a cross-entropy, weighted by the class weights
  if any; the number of entries of an elementwise loss) and `ν = Σ_b ν_b`.

So a quantity that depends on the reduction factor `R` to the power `k` is brought to the scale of
`reduction="sum"` by multiplying batch b's value by `ν_b^k`, summed, and divided by `ν^k` at the
end.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

#: losses whose `reduction="mean"` divides by the number of entries of the broadcast inputs
_ELEMENTWISE = (
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCELoss,
    nn.BCEWithLogitsLoss,
    nn.SoftMarginLoss,
    nn.PoissonNLLLoss,
)

Normaliser = Callable[[Tensor, Any], float]


def reduction_of(lossfunc: Any, normaliser: Normaliser | None) -> str:
    """`"mean"` or `"sum"`: how `lossfunc` reduces over its terms.

    Raises:
        ValueError: For another reduction, or a loss without a `reduction` attribute and no
            `normaliser` to say how it normalises.
    """
    reduction = getattr(lossfunc, "reduction", None)
    if reduction is None:
        if normaliser is None:
            raise ValueError(
                f"Cannot tell how {type(lossfunc).__name__} normalises its batch loss: use a "
                "torch loss module (nn.CrossEntropyLoss(), nn.MSELoss(), ...) or pass "
                "normaliser=lambda output, y: <number the batch loss divides by> "
                "(1 for a sum)."
            )
        return "mean"
    if reduction == "batchmean" and isinstance(lossfunc, nn.KLDivLoss):
        return "mean"
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"A data-set loss needs reduction='mean' or 'sum', got {reduction!r} on "
            f"{type(lossfunc).__name__}."
        )
    return reduction


def batch_normaliser(
    lossfunc: Any, output: Tensor, target: Any, normaliser: Normaliser | None = None
) -> float:
    """ν_b: the number the batch loss divides by (1 for `reduction="sum"`).

    Args:
        lossfunc: The loss function (a torch loss module unless `normaliser` is given).
        output: The model's output on the batch.
        target: The batch's targets.
        normaliser: Custom `(output, target) -> ν_b`; overrides the built-in rules.

    Raises:
        ValueError: For a loss whose normaliser is unknown.
    """
    if normaliser is not None:
        return float(normaliser(output, target))
    if reduction_of(lossfunc, None) == "sum":
        return 1.0
    return mean_normaliser(lossfunc, output, target)


def mean_normaliser(lossfunc: Any, output: Tensor, target: Any) -> float:
    """ν_b of a torch loss module with `reduction="mean"` (see `batch_normaliser`).

    Raises:
        ValueError: For a loss whose normaliser is unknown.
    """
    if isinstance(lossfunc, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if target.dtype.is_floating_point:  # class probabilities: every position counts
            return float(output.numel() // output.shape[1]) if output.dim() > 1 else 1.0
        keep = target != lossfunc.ignore_index
        if lossfunc.weight is None:
            return float(keep.sum())
        classes = output.shape[1] if output.dim() > 1 else output.shape[0]
        weight = lossfunc.weight.to(output.dtype)[target.clamp(0, classes - 1)]
        return float((weight * keep).sum())
    if isinstance(lossfunc, nn.KLDivLoss):
        if lossfunc.reduction == "batchmean":
            return float(output.shape[0]) if output.dim() else 1.0
        return float(torch.broadcast_shapes(output.shape, target.shape).numel())
    if isinstance(lossfunc, _ELEMENTWISE):
        return float(torch.broadcast_shapes(output.shape, target.shape).numel())
    raise ValueError(
        f"Cannot tell how {type(lossfunc).__name__}(reduction='mean') normalises its batch "
        "loss; pass normaliser=lambda output, y: <number the batch loss divides by>."
    )


def first_tensor(X: Any) -> Tensor | None:
    """The first tensor in `X` (a tensor, or a nested tuple/list/dict of them)."""
    if isinstance(X, Tensor):
        return X
    if isinstance(X, dict):
        X = list(X.values())
    if isinstance(X, (tuple, list)):
        for item in X:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def _signature(obj: Any) -> Any:
    """Non-batch shapes and dtypes of every tensor in `obj` (nested containers)."""
    if isinstance(obj, Tensor):
        return (tuple(obj.shape[1:]), obj.dtype)
    if isinstance(obj, dict):
        return {k: _signature(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return tuple(_signature(v) for v in obj)
    return type(obj).__name__


@dataclass
class Batch:
    """One batch of a sweep: its position, inputs, targets and number of samples."""

    index: int
    X: Any
    y: Any
    num_samples: int
    signature: Any = None


def needs_reiterable(data: Iterable, what: str) -> None:
    """Raise if `data` is a one-shot iterator (operators sweep it once per product)."""
    if iter(data) is data:
        raise TypeError(
            f"{what} sweeps the data several times; pass a re-iterable (a DataLoader, a list "
            "of batches), not a one-shot iterator or generator."
        )


def _progress(data: Iterable, enabled: bool, desc: str) -> Iterable:
    if not enabled:
        return data
    try:
        from tqdm.auto import tqdm
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "progress=True needs tqdm, an optional dependency: pip install tqdm "
            "(or pass progress=False)."
        ) from err
    total = len(data) if hasattr(data, "__len__") else None
    return tqdm(data, desc=desc, total=total, leave=False)


def sweep(
    data: Iterable,
    progress: bool = False,
    desc: str = "backpack",
    num_samples: Callable[[Any], int] | None = None,
) -> Iterator[Batch]:
    """Iterate over `data`'s `(X, y)` batches, checking they are usable and alike.

    Args:
        data: Any iterable of `(X, y)` pairs.
        progress: Show a tqdm progress bar.
        desc: The progress bar's label.
        num_samples: `X -> number of samples` (default: the first axis of the first tensor in X).

    Raises:
        ValueError: For an empty iterable, a batch that is not an `(X, y)` pair, a batch without
            samples, or a batch whose non-batch shapes or dtypes differ from the first batch's.
    """
    first = None
    index = -1
    for index, batch in enumerate(_progress(data, progress, desc)):
        try:
            X, y = batch
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"Batch {index} of the data is not an (X, y) pair: {type(batch).__name__}."
            ) from err
        signature = (_signature(X), _signature(y))
        if first is None:
            first = signature
        elif signature != first:
            raise ValueError(
                f"Batch {index} has non-batch shapes/dtypes {signature} (inputs, targets), but "
                f"batch 0 had {first}: every batch of a sweep must have the same shape apart "
                "from its number of samples (pad sequences to one length)."
            )
        if num_samples is not None:
            count = int(num_samples(X))
        else:
            tensor = first_tensor(X)
            if tensor is None or tensor.dim() == 0:
                raise ValueError(
                    f"Batch {index}: cannot count the samples of the inputs (no tensor with a "
                    "batch axis); pass num_samples=lambda X: <number of samples>."
                )
            count = tensor.shape[0]
        if count == 0:
            raise ValueError(f"Batch {index} holds no sample.")
        yield Batch(index, X, y, count, signature)
    if index < 0:
        raise ValueError("The data yielded no batch: cannot sweep an empty data set.")


def fingerprint(model: nn.Module) -> tuple:
    """A cheap digest of the model's parameters (names, shapes, three weighted sums of values).

    Two sweeps can only be merged when their models had equal fingerprints. Of a parameter
    sharded with FSDP2 (a DTensor) the values are this rank's shard (no collective).
    """
    entries = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            flat = local.detach().flatten().to(torch.float64)
            weights = (torch.arange(flat.numel(), device=flat.device) % 97 + 1).to(flat)
            entries.append(
                (
                    name,
                    tuple(p.shape),
                    p.requires_grad,
                    float(flat.sum()),
                    float(flat.square().sum()),
                    float((flat * weights).sum()),
                )
            )
    return tuple(entries)


def digest(obj: Any) -> float:
    """A 32-bit checksum of `repr(obj)` (exact in float64)."""
    return float(zlib.crc32(repr(obj).encode()))


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named trainable parameters, in `model.parameters()` order."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]
