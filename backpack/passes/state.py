"""What the passes of one backward share: the backward's state as plain data.

`BackwardState` holds the active extensions and everything one backward pass accumulates (the
sample layout, per-parameter accumulators, curvature waiting for other uses, coverage probes).
The engine owns one per `backpack(...)` context and hands it to the passes; the passes never
see the engine. `SyncStrategy` is the interface through which an integration (torch.distributed)
makes quantities global at the end of a pass; integrations register a factory for it here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor, nn

from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.extensions.secondorder import SecondOrderBackpropExtension
from backpack.recording import Record, describe
from backpack.rules import find_rule
from backpack.rules.generic import FuncRule
from backpack.samples import SampleLayout

#: the rule of modules without one of their own (torch.func)
GENERIC_RULE = FuncRule()
#: the layout outside backward passes (no losses, nothing walked; never changed)
NO_LAYOUT = SampleLayout([])


class SyncStrategy(Protocol):
    """Makes one context's quantities global across processes (see `backpack.distributed`)."""

    def on_call(self, state: BackwardState, record: Record) -> None:
        """A module or loss call is about to be processed."""

    def finish_pass(self, state: BackwardState) -> None:
        """The pass's quantities are stored: reduce them across processes."""

    def abort_pass(self, state: BackwardState) -> None:
        """The pass failed on this process: let the others fail instead of waiting."""

    def stash_variance(
        self, param: Tensor, savefield: str, sum_squares: Tensor, total: Tensor, n: int
    ) -> None:
        """Keep a variance's local sums: the global variance is computed from global sums."""


#: builds the synchronisation of a context from its `sync` argument (set by an integration)
_SYNC_FACTORY: list[Callable[[Any, Sequence[BackpropExtension]], SyncStrategy | None]] = []


def register_sync_factory(
    factory: Callable[[Any, Sequence[BackpropExtension]], SyncStrategy | None],
) -> None:
    """Install how contexts synchronise across processes (one factory; the last one wins)."""
    _SYNC_FACTORY[:] = [factory]


def make_sync(sync: Any, extensions: Sequence[BackpropExtension]) -> SyncStrategy | None:
    """The synchronisation of a context with argument `sync` (None without an integration)."""
    if not _SYNC_FACTORY:
        if sync is True:
            raise RuntimeError("backpack(sync=True) needs backpack.distributed (not imported).")
        return None
    return _SYNC_FACTORY[0](sync, extensions)


def names_of(exts: Sequence[BackpropExtension]) -> str:
    """The extensions' class names, for messages."""
    return ", ".join(e.__class__.__name__ for e in exts)


def is_are(exts: Sequence[BackpropExtension]) -> str:
    """'is' or 'are', agreeing with the number of extensions."""
    return "is" if len(exts) == 1 else "are"


def normalises_with_batch(module: nn.Module) -> bool:
    """Whether the module contains a batch normalisation layer."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) for m in module.modules())


def mixing_message(module: nn.Module) -> str:
    """Why quantities of a module that mixes samples are undefined, and what to do."""
    if not normalises_with_batch(module):
        return (
            f"undefined for {describe(module)}: its samples are not independent (a sample "
            "alone gives another output than within its batch, as with batch statistics, a "
            "reduction over the batch, a branch on batch values, or random operations such as "
            "dropout in training mode)."
        )
    return (
        f"undefined for {describe(module)}: it normalises with statistics of "
        "the whole batch, so samples are mixed. Call model.eval() before the forward pass (with "
        "track_running_stats=True, so that running statistics are used)."
    )


class BackwardState:
    """The extensions of one `backpack(...)` context and what its running backward gathered."""

    def __init__(self, extensions: Sequence[BackpropExtension], sync: SyncStrategy | None) -> None:
        self.extensions = list(extensions)
        self.first_order: list[FirstOrderBackpropExtension] = []
        self.second_order: list[SecondOrderBackpropExtension] = []
        if self.extensions:  # (empty contexts, entered on every step of some loops, skip this)
            self.first_order = [
                e for e in self.extensions if isinstance(e, FirstOrderBackpropExtension)
            ]
            self.second_order = [
                e for e in self.extensions if isinstance(e, SecondOrderBackpropExtension)
            ]
        #: torch.distributed: makes quantities global at the end of each pass (or None)
        self.sync = sync
        #: backward passes that met an extended module while the context was active
        self.passes = 0
        #: during a `backward()` whose convolution `.grad` is derived (`grads_from_samples`):
        #: id(parameter) -> sum of its per-sample gradients so far (None: not derived)
        self.derived_sums: dict[int, Tensor | None] | None = None
        self.layout = NO_LAYOUT
        #: id(parameter) -> its coverage check in this pass (`coverage._Coverage`)
        self.coverage: dict[int, Any] = {}
        #: autograd nodes of the running `backward()`'s roots whose gradient is autograd's
        #: implicit 1 (a loss there enters with weight 1: no need to read it from the device)
        self.unit_roots: tuple[Any, ...] = ()
        self.reset()

    def reset(self) -> None:
        """Forget everything about the current backward pass (also after an exception)."""
        if self.layout is not NO_LAYOUT:
            self.layout.close()
        self.layout = NO_LAYOUT
        #: whether an extended loss started the second-order factors in this pass
        self.loss_seen = False
        #: whether this pass met 16-bit tensors (autocast): autograd's own sums are rounded
        self.low_precision = False
        #: factor key -> loss position -> (columns of that loss's factor, sign of its weight)
        self.loss_columns: dict[Any, dict[int, tuple[int, float]]] = {}
        #: id(parameter) -> per-sample gradients of its uses so far (`first_order._Accumulator`)
        self.accumulators: dict[int, Any] = {}
        #: id(parameter) -> its calls so far (`curvature._ParamCurvature`)
        self.curvatures: dict[int, Any] = {}
        #: (id(parameter), savefield) -> (extension, square-root pieces)
        self.sqrt_pieces: dict[tuple[int, Any], tuple[SecondOrderBackpropExtension, Any]] = {}
        #: ids of parameters whose first-order quantities are stored in this pass
        self.written: set[int] = set()
        #: rule-less calls whose own parameters' per-sample gradients come from their sites
        #: (`samples.ParamSite`) at the end of the pass: (record, extensions, params, sites)
        self.pending_sites: list[tuple[Record, list, dict[str, Tensor], dict[str, Any]]] = []
        for coverage in self.coverage.values():
            coverage.pending = []
            if coverage.handle is not None:
                coverage.handle.remove()
        self.coverage = {}
        #: (id(record), id(parameter)) pairs already probed
        self.covered: set[tuple[int, int]] = set()
        #: id(module) -> probed contribution magnitudes of its parameters; "pass" -> of all
        #: parameters of the pass (see `_Coverage`)
        self.scales: dict[int | str, list[Tensor]] = {}
        #: group of samples -> (sample count, first module seen with it) in this pass
        self.sample_counts: dict[Any, tuple[int, nn.Module]] = {}

    def batch_size(self, record: Record) -> int:
        """Number of samples of a recorded call (by its rule's batch axis)."""
        return (find_rule(record.module) or GENERIC_RULE).batch_size(record)

    def uses(self, param: Tensor) -> int:
        """How many module calls of the running backward use `param` directly."""
        return self.layout.uses(param, self.batch_size)

    def split_uses(
        self, record: Record, params: dict[str, Tensor]
    ) -> tuple[list[str], list[tuple[str, int]]]:
        """Parameters this call alone uses in the pass, and shared ones with their use count."""
        direct, shared = [], []
        unreached = not self.layout.reached(record)
        for name, p in params.items():
            uses = self.uses(p)
            if uses <= 1 and not unreached:
                direct.append(name)
            else:
                shared.append((name, max(uses + unreached, 1)))
        return direct, shared
