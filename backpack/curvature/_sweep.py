"""`Sweep`: what sweeping a data set needs, resolved once and handed through the layer.

Every tool of the data-set layer (`accumulate`, the operators, `KFAC`/`EKFAC`, influence, the
Laplace backends) sweeps batches of one model and loss the same way: it reads each batch's
samples and loss normaliser, scales by the loss's reduction, extends the model and loss for
backpack, combines ranks under torch.distributed (or reduce-scatters an FSDP2 model's shards),
shows a progress bar and checks the parameters did not change. A `Sweep` owns all of that:
built once per public call (with the reduction, the process group and the sharding looked up
then), it is handed to the functions that sweep, which take nothing else about the data.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from backpack.api import disable, extend
from backpack.curvature._data import (
    Batch,
    Normaliser,
    fingerprint,
    first_tensor,
    mean_normaliser,
    needs_reiterable,
    reduction_of,
    sweep,
    trainable,
)
from backpack.curvature._distributed import local_module, process_group, rank_of
from backpack.curvature._fsdp import is_fully_sharded


class Sweep:
    """One model and loss over one data set: how its batches are read, scaled and combined.

    Args:
        model: The model (a `DistributedDataParallel` is unwrapped).
        lossfunc: The loss (a torch loss module with reduction "mean" or "sum", or any callable
            with `normaliser`).
        data: Iterable of `(X, y)` batches (None for a sweep whose data come later, `over`).
        progress: Show a progress bar (tqdm) per pass over the data.
        normaliser: Custom `(output, y) -> ν_b`.
        num_samples: Custom `X -> number of samples`.
        distributed: `data` is this rank's shard (see `accumulate`): None, True or False.
        what: The tool's name, for messages.

    Attributes:
        reduction: "mean" or "sum" (looked up once).
        group: backpack's process group when the ranks' shards combine, else None.
        sharded: Whether the model is sharded with FSDP2.

    Raises:
        ValueError: For a loss whose reduction is not "mean" or "sum" (and no `normaliser`).
        TypeError, RuntimeError: For a bad `distributed` (see `process_group`).
    """

    def __init__(
        self,
        model: nn.Module,
        lossfunc: Any,
        data: Iterable | None,
        progress: bool = False,
        normaliser: Normaliser | None = None,
        num_samples: Callable[[Any], int] | None = None,
        distributed: bool | None = None,
        what: str = "accumulate",
    ) -> None:
        self.model = local_module(model)
        self.lossfunc = lossfunc
        self.data = data
        self.progress = progress
        self.normaliser = normaliser
        self.num_samples = num_samples
        self.distributed = distributed
        self.what = what
        self.reduction = reduction_of(lossfunc, normaliser)
        self.sharded = is_fully_sharded(self.model)
        self.group = process_group(distributed, what)
        self._extended: set[int] = set()

    # --- variants ----------------------------------------------------------------------------
    def replace(self, **changes: Any) -> Sweep:
        """A copy with some attributes replaced (the reduction follows a new loss).

        The copies share the record of which modules are extended.
        """
        out = copy.copy(self)
        for name, value in changes.items():
            if not hasattr(self, name):
                raise AttributeError(f"Sweep has no attribute {name!r}.")
            setattr(out, name, value)
        if "lossfunc" in changes or "normaliser" in changes:
            out.reduction = reduction_of(out.lossfunc, out.normaliser)
        if "model" in changes:
            out.model = local_module(out.model)
            out.sharded = is_fully_sharded(out.model)
        return out

    def over(self, data: Iterable, progress: bool | None = None) -> Sweep:
        """The same model and loss over other data (this rank's own: not combined)."""
        changes: dict[str, Any] = {"data": data, "group": None, "distributed": False}
        if progress is not None:
            changes["progress"] = progress
        return self.replace(**changes)

    # --- the model and the loss --------------------------------------------------------------
    def extend(self) -> None:
        """`extend` the model and the loss module (once per sweep object and module)."""
        for module in (self.model, self.lossfunc):
            if isinstance(module, nn.Module) and id(module) not in self._extended:
                extend(module)
                self._extended.add(id(module))

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """Named trainable parameters, in `model.parameters()` order."""
        return trainable(self.model)

    def fingerprint(self) -> tuple:
        """A digest of the model's parameters (see `_data.fingerprint`)."""
        return fingerprint(self.model)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first trainable parameter."""
        return next(p for p in self.model.parameters() if p.requires_grad).dtype

    @property
    def rank(self) -> int:
        """This process's rank in the sweep's group (0 without one)."""
        return rank_of(self.group)

    # --- batches -----------------------------------------------------------------------------
    def needs_reiterable(self, what: str | None = None) -> None:
        """Raise if the data is a one-shot iterator (see `_data.needs_reiterable`)."""
        needs_reiterable(self.data, what or self.what)

    def batches(self, desc: str | None = None) -> Iterator[Batch]:
        """The checked `(X, y)` batches of one pass over the data (see `_data.sweep`)."""
        return sweep(self.data, self.progress, desc or self.what, self.num_samples)

    def first_inputs(self) -> Any:
        """The first batch's inputs."""
        return next(iter(self.data))[0]

    def samples(self, X: Any) -> int:
        """The number of samples of the inputs `X`."""
        if self.num_samples is not None:
            return int(self.num_samples(X))
        return first_tensor(X).shape[0]

    def nu(self, output: Tensor, y: Any) -> float:
        """`ν_b`: the number the batch's loss divides by (1 for "sum")."""
        if self.normaliser is not None:
            return float(self.normaliser(output, y))
        if self.reduction == "sum":
            return 1.0
        return mean_normaliser(self.lossfunc, output, y)

    def scale(self, nu: float) -> float:
        """A batch's factor to the scale of `reduction="sum"`: `ν_b` for "mean", else 1."""
        return nu if self.reduction == "mean" else 1.0

    def empty(self, nu: float) -> bool:
        """Whether a batch with normaliser `nu` has no loss term (all targets ignored)."""
        return self.reduction == "mean" and nu == 0

    def total(self, nu_total: float) -> float:
        """The data-set loss's divisor: `ν` for "mean", 1 for "sum"."""
        return nu_total if self.reduction == "mean" else 1.0

    def count_normaliser(self) -> float:
        """`Σ_b ν_b` of this rank's data: one forward per batch without gradients."""
        total = 0.0
        with torch.no_grad(), disable():
            for batch in sweep(self.data, num_samples=self.num_samples):
                total += self.nu(self.model(batch.X), batch.y)
        return total

    def __repr__(self) -> str:
        return (
            f"Sweep({self.what}, {type(self.model).__name__}, {type(self.lossfunc).__name__}, "
            f"reduction={self.reduction!r}, distributed={self.group is not None}, "
            f"sharded={self.sharded})"
        )
