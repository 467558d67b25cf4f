"""The engine: observes a backward pass inside `with backpack(...)` and runs the extensions.

Gradient hooks registered at record time call `Engine.on_module_backward` with the gradients that
reach a module call's outputs. The engine asks the module's rule for the quantities the active
extensions need and stores them on the parameters. A parameter used by several calls (a module
applied twice, tied weights) gets the quantities of its summed per-sample gradient: contributions
are accumulated until every live use has reported or the backward ends.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from backpack import distributed, grads_from_samples, secondorder
from backpack.context import CTX
from backpack.extensions.backprop_extension import (
    FAIL_ERROR,
    FAIL_SILENT,
    BackpropExtension,
)
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.extensions.secondorder import SecondOrderBackpropExtension
from backpack.functional_calls import FunctionalLinear, find_functional_calls
from backpack.recording import (
    Record,
    describe,
    get_param,
    is_parametrized,
    promote_half,
    register_call,
    trainable_params,
)
from backpack.rules import find_rule
from backpack.rules.activations import find_activation_rule
from backpack.rules.base import ModuleRule, overridden_base
from backpack.rules.generic import FuncRule
from backpack.rules.losses import is_loss
from backpack.samples import SampleLayout

_GENERIC_RULE = FuncRule()
#: the layout outside backward passes (no losses, nothing walked; never changed)
_NO_LAYOUT = SampleLayout([])
_WARNED_GENERIC: set[type] = set()


def _unsupported_warning(ext: BackpropExtension, module: nn.Module) -> str:
    return (
        f"Extension saving to {ext.savefield} does not have an extension for "
        f"Module {module.__class__} although the module has parameters"
    )


def _normalises_with_batch(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._NormBase) for m in module.modules())


def _mixing_message(module: nn.Module) -> str:
    if not _normalises_with_batch(module):
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


class _Quantities:
    """Lazily computed first-order quantities of one module call (or of accumulated uses)."""

    def __init__(
        self,
        rule: ModuleRule | None,
        record: Record | None,
        grads: tuple,
        names: list[str],
        batch_size: int,
        psg: dict[str, Tensor] | None = None,
    ) -> None:
        self.rule, self.record, self.grads, self.names = rule, record, grads, names
        self.n = batch_size
        self._psg = psg
        self._cache: dict[str, dict[str, Tensor]] = {}

    def psg(self) -> dict[str, Tensor]:
        if self._psg is None:
            self._psg = self.rule.per_sample_grads(self.record, self.grads, self.names)
        return self._psg

    def _fused(self, which: str) -> dict[str, Tensor] | None:
        if self.rule is None:
            return None
        return getattr(self.rule, which)(self.record, self.grads, self.names)

    def get(self, which: str, subsampling: Sequence[int] | None = None) -> dict[str, Tensor]:
        key = which if subsampling is None else f"{which}{list(subsampling)}"
        if key not in self._cache:
            self._cache[key] = getattr(self, f"_{which}")(subsampling)
        return self._cache[key]

    def _grad_batch(self, subsampling: Sequence[int] | None) -> dict[str, Tensor]:
        if subsampling is None:
            return self.psg()
        if self._psg is None and self.rule is not None:
            return self.rule.per_sample_grads(self.record, self.grads, self.names, subsampling)
        index = torch.as_tensor(list(subsampling), dtype=torch.long)
        return {k: v[index.to(v.device)] for k, v in self.psg().items()}

    def _batch_l2(self, _: Any) -> dict[str, Tensor]:
        fused = self._fused("batch_l2")
        if fused is not None:
            return fused
        return {k: v.flatten(1).square().sum(1) for k, v in self.psg().items()}

    def _sum_grad_squared(self, _: Any) -> dict[str, Tensor]:
        fused = self._fused("sum_grad_squared")
        if fused is not None:
            return fused
        return {k: v.square().sum(0) for k, v in self.psg().items()}

    def _batch_dot(self, _: Any) -> dict[str, Tensor]:
        fused = self._fused("batch_dot")
        if fused is not None:
            return fused
        return {k: v.flatten(1) @ v.flatten(1).T for k, v in self.psg().items()}

    def _grad_sum(self, _: Any) -> dict[str, Tensor]:
        fused = self._fused("grad_sum")
        if fused is not None:
            return fused
        return {k: v.sum(0) for k, v in self.psg().items()}

    def fuse_sums(self) -> bool:
        """Compute `grad_sum` and `sum_grad_squared` in one fused pass if the rule can."""
        if "grad_sum" in self._cache and "sum_grad_squared" in self._cache:
            return True
        if self.rule is None or self._psg is not None:
            return False
        fused = self.rule.grad_sum_and_squares(self.record, self.grads, self.names)
        if fused is None:
            return False
        self._cache["grad_sum"], self._cache["sum_grad_squared"] = fused
        return True

    def fuse_gradient(self, wanted: set[str]) -> None:
        """Let the quantities in `wanted` bring this call's gradient along where the rule can.

        For `.grad` summed from per-sample gradients (`backpack.grads_from_samples`): the
        gradient then costs no weight backward of its own.
        """
        if self.rule is None or self._psg is not None or "grad_batch" in wanted:
            return  # the per-sample gradients are summed
        if wanted & {"sum_grad_squared", "variance"} and self.fuse_sums():
            return
        if "batch_l2" in wanted:
            fused = self.rule.batch_l2_and_sum(self.record, self.grads, self.names)
            if fused is not None:
                self._cache["batch_l2"], self._cache["grad_sum"] = fused

    def gradient(self) -> dict[str, Tensor]:
        """This call's gradient: summed per-sample gradients, fused sums, or the rule's own."""
        if self._psg is not None:
            return {k: v.sum(0) for k, v in self._psg.items()}
        return self.get("grad_sum")

    def _variance(self, _: Any) -> dict[str, Tensor]:
        sgs, gsum = self.get("sum_grad_squared"), self.get("grad_sum")
        return {k: _variance_from_sums(sgs[k], gsum[k], self.n) for k in sgs}


#: `Variance` computes a gradient sum itself below this many (sample, entry) products: the
#: coverage check that waiting for autograd's sum needs on every pass costs about 100 us of
#: Python per parameter, a product of this size about as much (2 CPU threads)
VARIANCE_WAIT_MIN_WORK = 2**23


def variance_waits_for_grad(param: Tensor, samples: int) -> bool:
    """Whether `Variance` takes a call's gradient sum from the parameter's own gradient.

    Autograd computes that sum anyway, so waiting for the parameter's hook saves the rule a GEMM
    or convolution weight backward, but costs a coverage check on every pass (the sum must hold
    only extended calls' contributions). That pays on the CPU for large products (`samples`
    times the parameter's size); on GPUs the check's small kernels and host syncs cost more
    than the GEMM (measured on an H100), so there the rule computes it.
    """
    return param.device.type == "cpu" and samples * param.numel() >= VARIANCE_WAIT_MIN_WORK


def _variance_from_sums(
    sum_squares: Tensor, total: Tensor, n: int, overwrite: bool = False
) -> Tensor:
    """Σ g²/N - (Σ g/N)², clipped at 0 against rounding.

    Computed in place: of `sum_squares` itself if `overwrite`, else of one new tensor.
    """
    variance = sum_squares.div_(n) if overwrite else sum_squares / n
    return variance.addcmul_(total, total, value=-1.0 / n**2).clamp_min_(0)


_PROBES: dict[tuple[Any, ...], Tensor] = {}


def _probe_index(param: Tensor, rule: ModuleRule | None = None, name: str = "") -> Tensor:
    """A few fixed flat positions of a parameter (no random numbers: the user's RNG is theirs).

    The rule may pick them (positions that are cheap to compute together); by default they are
    spread evenly over the flattened parameter.
    """
    key = (type(rule), name, param.shape, param.device)
    index = _PROBES.get(key)
    if index is None:
        index = None if rule is None else rule.probe_index(name, param)
        if index is None:
            numel = param.numel()
            index = torch.linspace(0, numel - 1, min(numel, 8), device=param.device).long()
        if len(_PROBES) < 4096:
            _PROBES[key] = index
    return index


class _Coverage:
    """Checks that extended module calls account for all of a parameter's gradient.

    The probes sum this pass's module contributions at a few entries; a hook on the parameter
    compares them with the total gradient autograd accumulates. A difference means the parameter
    is also used outside extended modules (a regulariser, a functional call).
    """

    def __init__(
        self, param: Tensor, name: str, module: nn.Module, rule: ModuleRule, scale: list[Tensor]
    ) -> None:
        self.param = param
        self.index = _probe_index(param, rule, name)
        self.total: Tensor | None = None
        #: largest probed contributions of every parameter of the module (shared): the scale
        #: against which a mismatch counts, so a gradient that cancels to rounding noise (a
        #: bias before a normalisation) is not mistaken for an outside contribution
        self.scale = scale
        self.label = f"{name} of {describe(module)}"
        self.handle: Any = None
        #: whether this pass checks the parameter (see `Engine._cover`)
        self.active = True
        #: whether a contribution came from a 16-bit (autocast) call
        self.low_precision = False
        #: variances waiting for the call's gradient sum: (savefield, Σ g², N, fallback)
        self.pending: list[tuple[str, Tensor, int, Callable[[], Tensor], bool]] = []

    def add(self, part: Tensor) -> None:
        self.total = part if self.total is None else self.total + part

    def on_grad(self, grad: Tensor, fields: list[str]) -> None:
        """Parameter hook: check coverage, then finish pending variances with `grad`."""
        covered = self.check(grad, fields)
        # under autocast autograd's sum went through 16-bit arithmetic: the rule's is better
        self.finish(grad.detach() if covered and not self.low_precision else None)

    def finish(self, grad_sum: Tensor | None) -> None:
        """Store pending variances, from `grad_sum` or (if None) from their fallback."""
        pending, self.pending = self.pending, []
        with torch.no_grad():
            for field, sgs, n, fallback, private in pending:
                total = fallback() if grad_sum is None else grad_sum
                setattr(self.param, field, _variance_from_sums(sgs, total, n, private))

    def check(self, grad: Tensor, fields: list[str]) -> bool:
        """Warn (and return False) if `grad` has more than the extended calls' contributions."""
        if self.total is None or grad.is_sparse or not grad.dtype.is_floating_point:
            return False
        actual = grad.detach().flatten()[self.index].to(self.total.dtype)
        tol = {torch.float64: 1e-7, torch.float32: 1e-4}.get(self.total.dtype, 5e-2)
        if self.low_precision:
            tol = 5e-2
        # |actual - total| <= tol * max(|total|, |actual|) on at most 8 numbers: Python floats
        # (one transfer) are cheaper than a chain of tiny tensor ops
        values = torch.cat([actual, self.total]).tolist()
        pairs = list(zip(values[: len(actual)], values[len(actual) :]))
        if not all(math.isfinite(v) for v in values):
            # NaN or inf (e.g. one sample's input): nothing can be compared, nothing to report
            return False
        bound = tol * max((abs(v) for v in values), default=0.0) + 1e-30
        if not all(abs(a - t) <= bound for a, t in pairs) and self.scale:
            # a gradient cancelling to rounding noise: judge against the module's other entries
            scale = max(float(p.detach().abs().max()) for p in self.scale if p.numel())
            bound = tol * max(bound / tol, scale) + 1e-30
        if not all(abs(a - t) <= bound for a, t in pairs):
            warnings.warn(
                f"Parameter {self.label} also receives gradient from operations outside extended "
                "modules (e.g. a regularisation term, or a functional use such as "
                "F.linear(x, weight)). backpack's quantities "
                f"({', '.join(fields)}) only cover its uses inside extended modules.",
                UserWarning,
                stacklevel=2,
            )
            return False
        return True


#: id(parameter) -> backward passes that met it (entries die with their parameter)
_PASSES: dict[int, int] = {}


def _due_for_check(param: Tensor) -> bool:
    """Coverage schedule: the first 4 passes that meet a parameter, then every 16th."""
    key = id(param)
    seen = _PASSES.get(key)
    if seen is None:
        seen = 0
        weakref.finalize(param, _PASSES.pop, key, None)
    _PASSES[key] = seen + 1
    return seen < 4 or seen % 16 == 0


def _grad_sum_of(quantities: _Quantities, name: str) -> Tensor:
    """One call's gradient w.r.t. parameter `name` (fused rule, else summed per-sample ones)."""
    return quantities.get("grad_sum")[name]


_HALF = (torch.float16, torch.bfloat16)


def _autocast_types() -> list[str]:
    return [t for t in ("cpu", "cuda") if torch.is_autocast_enabled(t)]


@contextmanager
def _no_autocast(types: list[str] | None = None) -> Iterator[None]:
    """Rules run at full precision even if the backward was started inside `torch.autocast`.

    `types` are the device types with autocast on (looked up if not given).
    """
    types = _autocast_types() if types is None else types
    if not types:
        yield
        return
    with ExitStack() as stack:
        for device_type in types:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


_WARNED_KRON: set[tuple[str, type]] = set()


def _warn_no_kron(ext: BackpropExtension, module: nn.Module) -> None:
    """A layer without Kronecker factors: its parameters get none, the others get theirs."""
    key = (ext.savefield, type(module))
    if key in _WARNED_KRON:
        return
    _WARNED_KRON.add(key)
    warnings.warn(
        f"{ext.__class__.__name__} has no Kronecker factors for {describe(module)}; "
        f"its parameters get no '{ext.savefield}' (every other "
        "layer gets its factors). Kronecker factors exist for Linear, convolution, embedding, "
        "normalisation and attention layers; use DiagGGN* or GGNMP for this one.",
        UserWarning,
        stacklevel=2,
    )


def _zero_product(mat: Tensor) -> Tensor:
    """The curvature matrix product of a batch without samples."""
    return torch.zeros_like(mat)


def _store_empty_first_order(
    exts: list[FirstOrderBackpropExtension], params: dict[str, Tensor]
) -> None:
    """A call without samples: empty per-sample quantities, zero sums (variance included)."""
    for ext in exts:
        for p in params.values():
            if ext.quantity == "grad_batch":
                value = p.new_zeros(0, *p.shape)
            elif ext.quantity == "batch_l2":
                value = p.new_zeros(0)
            elif ext.quantity == "batch_dot":
                value = p.new_zeros(0, 0)
            else:
                value = torch.zeros_like(p)
            setattr(p, ext.savefield, value)


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


def _names(exts: Sequence[BackpropExtension]) -> str:
    return ", ".join(e.__class__.__name__ for e in exts)


def _is_are(exts: Sequence[BackpropExtension]) -> str:
    return "is" if len(exts) == 1 else "are"


def _place_rows(value: Tensor, offset: int, total: int, axes: int = 1) -> Tensor:
    """`value`'s sample rows (its first `axes` axes) placed at `offset` among `total` rows."""
    n = value.shape[0]
    shape = (total,) * axes + tuple(value.shape[axes:])
    full = value.new_zeros(shape)
    if axes == 1:
        full[offset : offset + n] = value
    else:
        full[offset : offset + n, offset : offset + n] = value
    return full


def _place(quantity: str, value: Tensor, placement: tuple[int, int] | None) -> Tensor:
    """A first-order quantity of one call's samples, as a quantity of all the pass's samples."""
    if placement is None or quantity in ("sum_grad_squared", "grad_sum", "variance"):
        return value
    offset, total = placement
    return _place_rows(value, offset, total, 2 if quantity == "batch_dot" else 1)


class _Accumulator:
    """Per-sample gradients of a parameter used by several calls of one backward pass.

    Calls holding the same samples (a module applied twice, siamese branches) add their rows;
    calls holding different samples (separate forwards and losses) fill their own rows.
    """

    def __init__(self, param: Tensor, expected_uses: int) -> None:
        self.param = param
        self.expected = expected_uses
        self.seen = 0
        self.parts: list[tuple[Tensor, tuple[int, int] | None, Record]] = []

    def add(self, psg: Tensor, placement: tuple[int, int] | None, record: Record) -> None:
        self.parts.append((psg, placement, record))
        self.seen += 1

    def per_sample_grads(self) -> Tensor | None:
        """All calls' per-sample gradients, as rows of the pass's samples."""
        if not self.parts:
            return None
        placed = [p for p in self.parts if p[1] is not None]
        if placed:
            total = placed[0][1][1]
            full = self.parts[0][0].new_zeros(total, *self.parts[0][0].shape[1:])
            for psg, (offset, _), _ in placed:
                full[offset : offset + psg.shape[0]] += psg
            return full
        sizes = {psg.shape[0] for psg, _, _ in self.parts}
        if len(sizes) > 1:
            calls = ", ".join(f"{describe(r.module)}: {p.shape[0]}" for p, _, r in self.parts)
            raise RuntimeError(
                "A parameter is used by several module calls of this backward pass that "
                f"process different numbers of samples ({calls}), and no extended loss function "
                "tells which samples they hold. Extend the loss function(s) "
                "(lossfunc = backpack.extend(lossfunc)): calls reaching different loss calls "
                "then hold different samples."
            )
        total = self.parts[0][0]
        for psg, _, _ in self.parts[1:]:
            total = total + psg
        return total


class _SqrtPieces:
    """Square-root factors `[V_l, n, *S]` of one parameter, assembled at the end of the pass.

    Each piece belongs to one loss call (its columns) and one call's samples (its rows); pieces
    at the same columns and rows add (calls sharing samples: cross terms included).
    """

    def __init__(self, param: Tensor, rows: int) -> None:
        self.param = param
        #: number of sample rows of the result (all the pass's samples)
        self.rows = rows
        self.pieces: list[tuple[int, int, Tensor]] = []

    def add(self, loss_pos: int, placement: tuple[int, int] | None, piece: Tensor) -> None:
        self.pieces.append((loss_pos, 0 if placement is None else placement[0], piece))

    def assemble(self, columns: dict[int, int]) -> Tensor:
        """`[V, N, *S]`: every loss's columns in loss order (zero where a loss misses)."""
        for pos, _, piece in self.pieces:
            columns.setdefault(pos, piece.shape[0])
        offsets, start = {}, 0
        for pos in sorted(columns):
            offsets[pos] = start
            start += columns[pos]
        full = self.param.new_zeros(start, self.rows, *self.param.shape)
        for pos, row, piece in self.pieces:
            c = offsets[pos]
            full[c : c + piece.shape[0], row : row + piece.shape[1]] += piece
        return full


class _ParamCurvature:
    """Second-order contributions of one parameter in a pass, combined when all calls reported.

    Used when the parameter has several calls in the pass, or when the pass has several losses or
    sets of samples and a square root must be assembled from pieces.
    """

    def __init__(self, param: Tensor, name: str, expected_uses: int) -> None:
        self.param = param
        self.name = name
        self.expected = expected_uses
        self.seen = 0
        #: (record, rule, placement) of each call
        self.calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]] = []

    def add(self, record: Record, rule: ModuleRule, placement: tuple[int, int] | None) -> None:
        self.calls.append((record, rule, placement))
        self.seen += 1


class Engine:
    """State of one active `backpack(...)` context while backward passes run."""

    def __init__(
        self,
        extensions: Sequence[BackpropExtension],
        extension_hook: Callable[[nn.Module], None] | None,
        debug: bool,
        retain_graph: bool,
        sync: Any = None,
    ) -> None:
        self.extensions = list(extensions)
        self.extension_hook = extension_hook
        #: device types with autocast on during the running pass
        self._autocast: list[str] = []
        #: a context without extensions, hook or debug output only frees the records
        self.idle = not self.extensions and extension_hook is None and not debug
        self.debug = debug
        self.retain_graph = retain_graph
        self.first_order: list[FirstOrderBackpropExtension] = []
        self.second_order: list[SecondOrderBackpropExtension] = []
        if self.extensions:  # (empty contexts, entered on every step of some loops, skip this)
            self.first_order = [
                e for e in self.extensions if isinstance(e, FirstOrderBackpropExtension)
            ]
            self.second_order = [
                e for e in self.extensions if isinstance(e, SecondOrderBackpropExtension)
            ]
        #: backward passes that met an extended module while this context was active
        self.passes = 0
        #: losses called as functions in the running `backward()`: (record, autograd node)
        self._functional: list[tuple[Record, Any]] = []
        #: records of functional linear calls on tied weights in the running `backward()`
        self._functional_linears: list[Record] = []
        #: extended loss calls the running `backward()`'s roots reach (None: not known)
        self._root_losses: list[Record] | None = None
        #: torch.distributed: makes quantities global at the end of each pass (or None)
        self.sync = (
            None  # what make_sync answers without extensions
            if not self.extensions and (sync is None or sync is False)
            else distributed.make_sync(sync, self.extensions)
        )
        self._task_id: int | None = None
        #: during a `backward()` whose convolution `.grad` is derived (`grads_from_samples`):
        #: id(parameter) -> sum of its per-sample gradients so far (None: not derived)
        self._derived_sums: dict[int, Tensor | None] | None = None
        self.reset()

    # --- pass bookkeeping --------------------------------------------------------------------
    def _enter_pass(self) -> None:
        if self._task_id is not None:
            # same pass, or a backward nested inside it (its end callback has not run yet)
            return
        self.reset()
        self._dirty = True
        self._autocast = _autocast_types()
        self._task_id = torch._C._current_graph_task_id()
        self.passes += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)
        functional = [r for r, _ in self._functional]
        self.layout = SampleLayout.discover(self.batch_size, functional, self._root_losses)

    def reset(self) -> None:
        """Forget everything about the current backward pass (also after an exception)."""
        if not self.__dict__.get("_dirty", True):
            return  # nothing happened since the last reset
        self._dirty = False
        self._task_id = None
        if getattr(self, "layout", None) is not None:
            self.layout.close()
        self.layout = _NO_LAYOUT
        #: whether an extended loss started the second-order factors in this pass
        self.loss_seen = False
        #: whether this pass met 16-bit tensors (autocast): autograd's own sums are rounded
        self.low_precision = False
        #: factor key -> loss position -> (columns of that loss's factor, sign of its weight)
        self.loss_columns: dict[Any, dict[int, tuple[int, float]]] = {}
        self._accumulators: dict[int, _Accumulator] = {}
        self._curvatures: dict[int, _ParamCurvature] = {}
        self._sqrt_pieces: dict[tuple[int, Any], tuple[SecondOrderBackpropExtension, _SqrtPieces]]
        self._sqrt_pieces = {}
        self._written: set[int] = set()
        self._deferred_hooks: dict[nn.Module, Record] = {}
        #: id(record) -> (record, output gradients so far, [output nodes reported])
        self._partial: dict[int, tuple[Record, list, list[int]]] = {}
        for coverage in getattr(self, "_coverage", {}).values():
            coverage.pending = []
            if coverage.handle is not None:
                coverage.handle.remove()
        self._coverage: dict[int, _Coverage] = {}
        self._covered: set[tuple[int, int]] = set()
        #: id(module) -> probed contribution magnitudes of its parameters (see `_Coverage`)
        self._scales: dict[int, list[Tensor]] = {}
        #: group of samples -> (sample count, first module seen with it) in this pass
        self._sample_counts: dict[Any, tuple[int, nn.Module]] = {}

    def batch_size(self, record: Record) -> int:
        """Number of samples of a recorded call (by its rule's batch axis)."""
        return (find_rule(record.module) or _GENERIC_RULE).batch_size(record)

    def uses(self, param: Tensor) -> int:
        """How many module calls of the running backward use `param` directly."""
        return self.layout.uses(param, self.batch_size)

    def _finish_pass(self) -> None:
        try:
            # multi-output calls some of whose outputs the loss does not use
            for record, grads, _ in list(self._partial.values()):
                self._process(record, tuple(grads))
            # parameters whose gradient hook did not run (autograd.grad without them as inputs)
            for coverage in self._coverage.values():
                if coverage.pending:
                    coverage.finish(None)
            for acc in list(self._accumulators.values()):
                self._finalize_accumulator(acc)
            for curvature in list(self._curvatures.values()):
                self._finalize_curvature(curvature)
            self._assemble_sqrt()
            for module, record in list(self._deferred_hooks.items()):
                self._after_module(module, record)
            if self.sync is not None:  # distributed: global quantities (backpack/distributed.py)
                self.sync.finish_pass(self)
        except BaseException:
            if self.sync is not None:  # distributed: the other ranks raise instead of waiting
                self.sync.abort_pass(self)
            raise
        finally:
            self.reset()

    def start_backward(self, roots: list[Tensor]) -> list[Any]:
        """Before a `backward()` from `roots` runs: find the losses called as functions.

        Returns the pre-hooks installed on their nodes (the caller removes them afterwards).
        """
        self._functional, linears, self._root_losses = find_functional_calls(roots)
        handles = []
        for record, node in self._functional:

            def hook(grads: tuple, record: Record = record) -> None:
                self.on_functional_loss(record, grads)

            handles.append(node.register_prehook(hook))
        # functional linear calls on tied weights: kept alive until the backward is over
        self._functional_linears = [record for record, _ in linears]
        handles.extend(register_call(record, node) for record, node in linears)
        return handles

    def end_backward(self) -> None:
        """After a `backward()` returned (or raised)."""
        self._functional = []
        self._root_losses = None
        for record in self._functional_linears:
            record.free()
        self._functional_linears = []

    def on_functional_loss(self, record: Record, grads: tuple) -> None:
        """Autograd reached a loss called as a function (`F.cross_entropy`, ...)."""
        if CTX.propagating:
            return
        try:
            self._enter_pass()
            record.promote_half()  # rules read its (possibly 16-bit) saved values in float32
            if self.sync is not None:  # distributed: the loss's normaliser
                self.sync.on_call(self, record)
            if self.second_order:
                with _no_autocast():
                    secondorder.on_loss_backward(self, record, promote_half(grads))
        except BaseException:
            if self.sync is not None:  # distributed: the other ranks raise instead of waiting
                self.sync.abort_pass(self)
            self.reset()
            raise

    # --- entry point from the gradient hooks -------------------------------------------------
    def on_module_backward(self, record: Record, grads: tuple[Tensor | None, ...]) -> None:
        """Run the active extensions on one module call whose output gradients are known."""
        if self.idle:
            # nothing to compute or call: only free what the forward recorded
            if not record.disabled and not self.retain_graph:
                record.free()
            return
        try:
            self._enter_pass()
            self.layout.explore(torch._C._current_autograd_node())
            self._process(record, grads)
        except BaseException:
            if self.sync is not None:  # distributed: the other ranks raise instead of waiting
                self.sync.abort_pass(self)
            self.reset()  # the backward aborts: its end-of-pass callback will not run
            raise

    def on_module_output_part(
        self, record: Record, parts: list[tuple[int, Tensor | None]], nodes: int
    ) -> None:
        """Gradients of some outputs of a multi-output call (one of its `nodes` output nodes)."""
        if self.idle:
            if not record.disabled and not self.retain_graph:
                record.free()
            return
        try:
            self._enter_pass()
        except BaseException:
            if self.sync is not None:  # distributed: the other ranks raise instead of waiting
                self.sync.abort_pass(self)
            self.reset()
            raise
        entry = self._partial.get(id(record))
        if entry is None:
            entry = self._partial[id(record)] = (record, [None] * len(record.outputs), [0])
        for index, grad in parts:
            entry[1][index] = grad
        entry[2][0] += 1
        if entry[2][0] >= nodes:
            del self._partial[id(record)]
            self.on_module_backward(record, tuple(entry[1]))

    def _process(self, record: Record, grads: tuple[Tensor | None, ...]) -> None:
        module = record.module
        if record.disabled:
            raise RuntimeError(
                f"The forward of {describe(module)} ran under backpack.disable(), so nothing "
                "was recorded for the backward inside "
                f"backpack({', '.join(map(repr, self.extensions))}). Run the forward outside "
                "disable() to compute backpack quantities."
            )
        if record.freed:
            raise RuntimeError(
                f"What was recorded for {describe(module)} was freed after the previous "
                "backward pass. To backpropagate several times through one forward, use "
                "backpack(..., retain_graph=True) together with backward(retain_graph=True)."
            )
        if self.debug:
            print(f"[backpack] backward through {describe(module)}")
        if record.promote_half() or any(g is not None and g.dtype in _HALF for g in grads):
            # mixed precision: rules compute and accumulate in float32
            grads = promote_half(grads)
            self.low_precision = True
        with _no_autocast(self._autocast):
            view, grads = self._view_for_rules(record, grads)
            self._dispatch_rules(view, grads)

    def _view_for_rules(
        self, record: Record, grads: tuple[Tensor | None, ...]
    ) -> tuple[Record, tuple[Tensor | None, ...]]:
        """The call as rules expect it: samples along axis 0 of every input and output.

        Two kinds of calls need a view: layers inside sequence-first transformer layers (their
        samples run along axis 1), and calls whose output holds no sample axis at all but is
        broadcast over the samples (a position embedding of `torch.arange(T)`).
        """
        site = self.layout.broadcast.get(id(record))
        if site is not None and not record.freed:
            per_sample = None
            if site.captured is not None and grads[0] is not None:
                per_sample = site.per_sample(site.captured, record.outputs[0].shape)
            if per_sample is not None or record.extra.get("broadcast"):
                n = per_sample.shape[0] if per_sample is not None else record.extra["broadcast"]
                view = _broadcast_view(record, n)
                if per_sample is not None:
                    per_sample = promote_half(per_sample)
                    total = per_sample.sum(0).reshape(grads[0].shape)
                    expected = grads[0].to(total)
                    finite = bool(torch.isfinite(total).all()) and bool(
                        torch.isfinite(expected).all()
                    )  # NaN/inf (a diverging run) cannot be compared: keep the rows
                    if finite and not torch.allclose(total, expected, rtol=1e-4, atol=1e-6):
                        raise RuntimeError(
                            f"The output of {describe(record.module)} holds no sample axis and "
                            "is broadcast over the samples, but also used elsewhere, so its "
                            "per-sample gradients cannot be told apart. Add the sample axis "
                            "yourself (e.g. expand the positions to [N, T] before the embedding)."
                        )
                    grads = (per_sample.reshape(view.outputs[0].shape),)
                return view, grads
        axis = record.module.__dict__.get("_backpack_batch_axis", 0)
        if axis and not record.freed and not is_loss(record.module):
            return _moved_view(record, axis), tuple(_move(g, axis) for g in grads)
        return record, grads

    def _dispatch_rules(self, record: Record, grads: tuple[Tensor | None, ...]) -> None:
        module = record.module
        if self.sync is not None:  # distributed: the call's parameters, a loss's normaliser
            self.sync.on_call(self, record)
        if is_loss(module):
            if self.second_order:
                secondorder.on_loss_backward(self, record, grads)
            self._after_module(module, record)
            return
        if not self.extensions:
            self._after_module(module, record)
            return
        self._check_sample_count(record)
        deferred = self._run_first_order(record, grads)
        if self.second_order:
            if find_activation_rule(module) is not None:
                secondorder.on_activation_backward(self, record, grads)
            deferred = self._run_second_order(record, grads) or deferred
        if deferred:
            self._deferred_hooks[module] = record
        else:
            self._after_module(module, record)

    def _check_sample_count(self, record: Record) -> None:
        """Refuse calls of one loss's samples that disagree on how many samples there are.

        A layer applied to sequence-first tensors (`[T, N, D]`, samples along axis 1) or to
        flattened samples (`[N·T, D]`) would otherwise give per-position rows, and curvature
        mixing the positions of a sample, without any error.
        """
        if not self.layout.losses or record.disabled or not trainable_params(record.module):
            return
        first = record.args[0] if record.args else None
        if not isinstance(first, Tensor):
            return
        if first.dim() < 2 and not isinstance(record.module, nn.Embedding):
            return  # unbatched calls (an embedding's [N] indices are a batch)
        size = (find_rule(record.module) or _GENERIC_RULE).batch_size(record)
        key = self.layout.group_of(record)
        seen = self._sample_counts.get(key)
        if seen is None:
            self._sample_counts[key] = (size, record.module)
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

    def _after_module(self, module: nn.Module, record: Record) -> None:
        self._deferred_hooks.pop(module, None)
        if self.extension_hook is not None:
            module.input0 = record.input_values()
            module.output = record.output_values()
            try:
                self.extension_hook(module)
            finally:
                for attr in ("input0", "output"):
                    module.__dict__.pop(attr, None)
        if not self.retain_graph:
            record.free()
            if record.origin is not None:
                record.origin.free()

    def _split_uses(
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

    # --- first order ---------------------------------------------------------------------------
    def _run_first_order(self, record: Record, grads: tuple[Tensor | None, ...]) -> bool:
        """Compute first-order quantities of one call; True if some wait for other uses."""
        try:
            return self._first_order_quantities(record, grads)
        except _SkipModule:
            return False

    def _first_order_quantities(self, record: Record, grads: tuple[Tensor | None, ...]) -> bool:
        module = record.module
        params = trainable_params(module)
        if not params:
            return False
        builtin = []
        for ext in self.extensions:
            user_ext = ext.get_module_extension(module)
            if user_ext is not None:
                self._run_user_extension(user_ext, ext, record, grads)
            elif isinstance(ext, FirstOrderBackpropExtension):
                builtin.append(ext)
            elif not getattr(ext, "_engine_handles", False):
                self._unsupported(ext, module)
        if not builtin:
            return False
        record.check_unmodified(builtin[0].__class__.__name__)
        rule = self._rule_for(record, builtin)
        if rule is None:
            return False
        if rule.mixes_samples(record):
            builtin = self._check_sample_mixing(record, builtin)
            if not builtin:
                return False
        grads = tuple(
            torch.zeros_like(o) if g is None else g for g, o in zip(grads, record.outputs)
        )
        placement = self.layout.placement(record)
        if rule.batch_size(record) == 0 and placement is None:
            _store_empty_first_order(builtin, params)
            for p in params.values():
                self._add_derived(p, torch.zeros_like(p))
            return False
        direct, shared = self._split_uses(record, params)
        if direct:
            self._first_order_direct(record, grads, rule, builtin, params, direct, placement)
        for name, uses in shared:
            p = params[name]
            if id(p) in self._written:
                raise RuntimeError(
                    f"Parameter {name} of {describe(module)} is used by a module call that "
                    "reaches none of the extended loss functions of this backward and by one "
                    "that does. Extend every loss function of the backward "
                    "(backpack.extend(loss))."
                )
            acc = self._accumulators.get(id(p))
            if acc is None:
                acc = self._accumulators[id(p)] = _Accumulator(p, uses)
            psg = rule.per_sample_grads(record, grads, [name])[name]
            acc.add(psg, placement, record)
            self._cover(record, grads, rule, name, p, psg, always=True)
            if acc.seen >= acc.expected:
                self._finalize_accumulator(acc)
        return any(id(p) in self._accumulators for p in params.values())

    def _first_order_direct(
        self,
        record: Record,
        grads: tuple,
        rule: ModuleRule,
        builtin: list[FirstOrderBackpropExtension],
        params: dict[str, Tensor],
        direct: list[str],
        placement: tuple[int, int] | None,
    ) -> None:
        """First-order quantities of parameters only this call uses in the pass."""
        n = rule.batch_size(record) if placement is None else placement[1]
        quantities = _Quantities(rule, record, grads, direct, n)
        summing = self._derived_sums
        derived = [] if summing is None else [k for k in direct if id(params[k]) in summing]
        if derived:
            quantities.fuse_gradient({e.quantity for e in builtin})
        variances = [e for e in builtin if e.quantity == "variance"]
        # the rule's own gradient sum (from the chunks it squares anyway) spares the variance
        # waiting for autograd's, and that wait's coverage check on every pass
        own_sums = bool(variances) and quantities.fuse_sums()
        for ext in builtin:
            if ext.quantity == "variance":
                continue
            subsampling = ext.get_subsampling()
            if placement is not None and subsampling is not None:
                # sample indices refer to all the pass's samples
                values = quantities.get(ext.quantity)
                index = torch.as_tensor(subsampling, dtype=torch.long)
                values = {
                    k: _place(ext.quantity, v, placement)[index.to(v.device)]
                    for k, v in values.items()
                }
            else:
                values = quantities.get(ext.quantity, subsampling)
                values = {k: _place(ext.quantity, v, placement) for k, v in values.items()}
            for name in direct:
                setattr(params[name], ext.savefield, values[name])
        for name in direct:
            self._written.add(id(params[name]))
        if derived:
            gradient = quantities.gradient()
            for name in derived:
                self._add_derived(params[name], gradient[name])
        sgs = quantities.get("sum_grad_squared") if variances else {}
        # nobody else stores these sums: the variance may be computed in their place
        private = len(variances) == 1 and all(e.quantity != "sum_grad_squared" for e in builtin)
        private = private and self.sync is None  # distributed: the sums are reduced later
        # one decision per call: the rule computes the sums of all its parameters at once
        wait = bool(variances) and not own_sums and self.sync is None  # distributed: reduced later
        wait = wait and any(variance_waits_for_grad(params[name], n) for name in direct)
        if wait:
            # the fallback below may run after the record is freed
            # a private copy survives `record.free()` and is never counted
            quantities.record = record.copy(extra={})
        psg = quantities._psg
        # not waiting: the sums now, while the rule's per-call caches are still there
        sums = quantities.get("grad_sum") if variances and not wait else {}
        for name in direct:
            part = None if psg is None else psg[name]
            if part is None and name in sums:
                part = sums[name].unsqueeze(0)  # the probes read it like one sample's gradient
            coverage = self._cover(record, grads, rule, name, params[name], part, wait)
            for ext in variances:
                fallback = partial(_grad_sum_of, quantities, name)
                if wait:
                    coverage.pending.append((ext.savefield, sgs[name], n, fallback, private))
                    continue
                variance = _variance_from_sums(sgs[name], fallback(), n, private)
                setattr(params[name], ext.savefield, variance)
                if self.sync is not None:  # distributed: the local sums of the global variance
                    self.sync.stash_variance(params[name], ext.savefield, sgs[name], fallback(), n)

    def _add_derived(self, param: Tensor, gradient: Tensor) -> None:
        """Add a call's gradient of `param` if its `.grad` is summed from per-sample gradients."""
        sums = self._derived_sums
        if sums is None or id(param) not in sums:
            return
        gradient = gradient.detach()
        previous = sums[id(param)]
        sums[id(param)] = gradient if previous is None else previous + gradient

    def plan_grads_from_samples(
        self, roots: list[Tensor], arguments: dict[str, Any]
    ) -> tuple[list[Tensor], list[Tensor]] | None:
        """(leaves to request, parameters whose `.grad` is derived) for one `backward()`.

        Only for first-order extensions alone (without subsampling, not distributed) on a
        plain `backward()` (no `inputs`, no `create_graph`); see `backpack.grads_from_samples`.
        """
        if (
            not grads_from_samples.ENABLED
            or self._derived_sums is not None
            or not self.extensions
            or self.sync is not None
            or arguments.get("create_graph")
            or arguments.get("inputs") is not None
            or arguments.get("grad_variables") is not None
            or not grads_from_samples.accumulator_hooks_unlikely()
        ):
            return None
        for ext in self.extensions:
            if not isinstance(ext, FirstOrderBackpropExtension):
                return None
            if ext.quantity not in _SUMMABLE or ext.get_subsampling() is not None:
                return None

        def allowed(module: nn.Module) -> bool:
            return all(ext.get_module_extension(module) is None for ext in self.extensions)

        found = grads_from_samples.plan(roots, allowed)
        if found is not None:
            self._derived_sums = {id(p): None for p in found[1]}
        return found

    def finish_grads_from_samples(self, derived: list[Tensor], succeeded: bool) -> None:
        """After the `backward()`: accumulate the derived `.grad`s (if it succeeded)."""
        sums, self._derived_sums = self._derived_sums or {}, None
        if succeeded:
            grads_from_samples.assign(derived, {k: v for k, v in sums.items() if v is not None})

    def _finalize_accumulator(self, acc: _Accumulator) -> None:
        self._accumulators.pop(id(acc.param), None)
        psg = acc.per_sample_grads()
        if psg is None:
            return
        self._add_derived(acc.param, psg.sum(0))
        quantities = _Quantities(None, None, (), ["p"], psg.shape[0], psg={"p": psg})
        for ext in self.first_order:
            value = quantities.get(ext.quantity, ext.get_subsampling())["p"]
            setattr(acc.param, ext.savefield, value)
            if ext.quantity == "variance" and self.sync is not None:  # distributed: local sums
                sums = quantities.get("sum_grad_squared")["p"], quantities.get("grad_sum")["p"]
                self.sync.stash_variance(acc.param, ext.savefield, *sums, psg.shape[0])

    # --- second order --------------------------------------------------------------------------
    def _run_second_order(self, record: Record, grads: tuple[Tensor | None, ...]) -> bool:
        """Second-order quantities of one call; True if some wait for other uses."""
        module = record.module
        params = trainable_params(module)
        if not params:
            return False
        exts = self.second_order
        names = _names(exts)
        if not self.loss_seen:
            raise RuntimeError(
                f"{names} could not find a loss function backpack knows in this backward pass. "
                "Second-order extensions start from the loss: extend it, e.g. "
                "lossfunc = extend(torch.nn.CrossEntropyLoss()), and call backward on its "
                "output (or a weighted sum of such outputs). Losses called as functions are "
                "recognised too: F.cross_entropy (without label_smoothing), F.mse_loss, "
                "F.binary_cross_entropy_with_logits."
            )
        rule = find_rule(module)
        if rule is None:
            rule = _GENERIC_RULE
        if rule.mixes_samples(record):
            raise NotImplementedError(f"{names} {_is_are(exts)} {_mixing_message(module)}")
        if record.recomputed:
            raise NotImplementedError(
                f"{names} cannot reach {describe(module)}: it runs inside "
                "torch.utils.checkpoint(..., use_reentrant=True), whose forward is recomputed "
                "during the backward, after the curvature factors were propagated. Use "
                "torch.utils.checkpoint(..., use_reentrant=False) (first-order extensions work "
                "with both)."
            )
        record.check_unmodified(exts[0].__class__.__name__)
        filled = tuple(
            torch.zeros_like(o) if g is None else g for g, o in zip(grads, record.outputs)
        )
        placement = self.layout.placement(record)
        if rule.batch_size(record) == 0 and placement is None:
            self._store_empty_second_order(record, params)
            return False
        for name, p in params.items():
            self._cover(record, filled, rule, name, p, None)
        direct, shared = self._split_uses(record, params)
        if direct:
            for ext in exts:
                if ext.factor == "sum":
                    continue  # KFRA writes its factors from the module chain
                values = self._second_order_values(ext, record, rule, direct, placement)
                for name in direct:
                    if name in values:
                        setattr(params[name], ext.savefield, values[name])
        for name, uses in shared:
            p = params[name]
            curvature = self._curvatures.get(id(p))
            if curvature is None:
                curvature = self._curvatures[id(p)] = _ParamCurvature(p, name, uses)
            curvature.add(record, rule, placement)
            if curvature.seen >= curvature.expected:
                self._finalize_curvature(curvature)
        return any(id(p) in self._curvatures for p in params.values())

    def _store_empty_second_order(self, record: Record, params: dict[str, Tensor]) -> None:
        """A call without samples: zero curvature, empty per-sample terms."""
        for ext in self.second_order:
            if ext.factor == "sum":
                continue
            if ext.output == "kron":
                raise NotImplementedError(
                    f"{ext.__class__.__name__} got a batch without samples at "
                    f"{describe(record.module)}: Kronecker input factors are means over the "
                    "samples. Skip empty batches."
                )
            columns = sum(v for v, _ in self.loss_columns.get(ext.factor_key, {}).values())
            for p in params.values():
                if ext.output == "diag":
                    value: Any = torch.zeros_like(p)
                elif ext.output == "batch_diag":
                    value = p.new_zeros(0, *p.shape)
                elif ext.output == "sqrt":
                    value = p.new_zeros(columns, 0, *p.shape)
                else:
                    value = _zero_product
                setattr(p, ext.savefield, value)

    def _simple_sqrt(self, ext: SecondOrderBackpropExtension, record: Record, placement) -> bool:
        """Whether a call's square root is its only term's factor as is (no assembly)."""
        terms = secondorder.terms_for(record, ext)
        columns = self.loss_columns.get(ext.factor_key, {})
        return placement is None and len(columns) <= 1 and len(terms) == 1 and terms[0][2] > 0

    def _second_order_values(
        self,
        ext: SecondOrderBackpropExtension,
        record: Record,
        rule: ModuleRule,
        names: list,
        placement: tuple[int, int] | None,
    ) -> dict[str, Any]:
        entries = secondorder.entries_for(record, ext)
        module = record.module
        if ext.output in ("diag", "batch_diag"):
            per_sample = ext.output == "batch_diag"
            if not entries:
                n = rule.batch_size(record) if per_sample else None
                values = secondorder.zero_like_params(module, names, n)
            else:
                values = secondorder.reduce_entries(record, entries, names, per_sample, rule)
            if per_sample and placement is not None:
                values = {k: _place_rows(v, *placement) for k, v in values.items()}
            return values
        if ext.output == "sqrt":
            self._check_signs(ext, record)
            terms = secondorder.terms_for(record, ext)
            if self._simple_sqrt(ext, record, placement):
                return rule.sqrt_factor(record, terms[0][1], names, ext.get_subsampling())
            # several losses or sets of samples: the pieces are assembled when the pass ends
            rows = rule.batch_size(record) if placement is None else placement[1]
            for name in names:
                self._pieces(ext, get_param(module, name), rows)
            for pos, factors, _ in terms:
                pieces = rule.sqrt_factor(record, factors, names)
                for name in names:
                    target = self._pieces(ext, get_param(module, name), rows)
                    target.add(pos, placement, pieces[name])
            return {}
        if ext.output == "kron":
            return self._kron(ext, record, rule, names) or {}
        # "mp": a matrix-product closure per parameter
        return {n: secondorder.matrix_product([(record, entries)], n) for n in names}

    def _kron(
        self, ext: SecondOrderBackpropExtension, record: Record, rule: ModuleRule, names: list
    ) -> dict[str, list[Tensor]] | None:
        """Kronecker factors of one call from all losses' factors at its outputs.

        The output-side factor (first in each list) sums over losses; a loss entering with a
        negative weight is subtracted.
        """
        terms = []
        for sign in (1.0, -1.0):
            factors = secondorder.joint_factors(record, ext, sign)
            if factors is None:
                continue
            kron = rule.kron_factors(record, factors, names, ext.kfac_approx)
            if kron is None:
                _warn_no_kron(ext, record.module)
                return None
            terms.append((kron, sign))
        # terms whose G was summed column by column during the propagation
        reduced = record.extra.get("reduced_kron", {}).get(ext.factor_key, {})
        for pos in sorted(reduced):
            by_approx, sign = reduced[pos]
            kron = {k: v for k, v in by_approx[ext.kfac_approx].items() if k in names}
            terms.append((kron, sign))
        result = None
        for kron, sign in terms:
            if sign < 0:
                kron = {k: [-v[0], *v[1:]] for k, v in kron.items()}
            if result is None:
                result = kron
            else:
                result = {k: [result[k][0] + v[0], *result[k][1:]] for k, v in kron.items()}
        return result

    def _check_signs(self, ext: SecondOrderBackpropExtension, record: Record) -> None:
        for pos, _, sign in secondorder.terms_for(record, ext):
            if sign < 0:
                loss = self.layout.losses[pos].module if self.layout.losses else None
                what = describe(loss) if loss is not None else "a loss function"
                raise NotImplementedError(
                    f"{ext.__class__.__name__}: {what} enters this backward with a negative "
                    "weight, so its curvature has no real square root. Diagonals, Kronecker "
                    "factors and matrix products (DiagGGNExact, KFLR, GGNMP, ...) support "
                    "negative weights."
                )

    def _pieces(
        self, ext: SecondOrderBackpropExtension, param: Tensor, rows: int
    ) -> _SqrtPieces:
        key = (id(param), ext.savefield)
        entry = self._sqrt_pieces.get(key)
        if entry is None:
            entry = self._sqrt_pieces[key] = (ext, _SqrtPieces(param, rows))
        return entry[1]

    def _assemble_sqrt(self) -> None:
        """Store square roots that several losses or sets of samples contributed to."""
        pending, self._sqrt_pieces = self._sqrt_pieces, {}
        for ext, pieces in pending.values():
            columns = {
                pos: v for pos, (v, _) in self.loss_columns.get(ext.factor_key, {}).items()
            }
            full = pieces.assemble(columns)
            subsampling = ext.get_subsampling()
            if subsampling is not None:
                index = torch.as_tensor(subsampling, dtype=torch.long, device=full.device)
                full = full[:, index]
            setattr(pieces.param, ext.savefield, full)

    def _finalize_curvature(self, curvature: _ParamCurvature) -> None:
        """Second-order quantities of a parameter with several calls in the pass."""
        self._curvatures.pop(id(curvature.param), None)
        calls = curvature.calls
        if not calls:
            return
        param, name = curvature.param, curvature.name
        groups: dict[Any, list] = {}
        for call in calls:
            groups.setdefault(None if call[2] is None else call[2][0], []).append(call)
        cross = any(len(members) > 1 for members in groups.values())
        for ext in self.second_order:
            if ext.factor == "sum":
                continue
            value = self._shared_value(ext, param, name, calls, cross)
            if value is not None:
                setattr(param, ext.savefield, value)

    def _shared_value(
        self,
        ext: SecondOrderBackpropExtension,
        param: Tensor,
        name: str,
        calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]],
        cross: bool,
    ) -> Any:
        # name the parameter by its module, not by a functional call's stand-in
        owner = next(
            (c[0].module for c in calls if not isinstance(c[0].module, FunctionalLinear)),
            calls[0][0].module,
        )
        label = f"parameter {name} of {describe(owner)}"
        if ext.output == "mp":
            return self._shared_product(ext, name, calls)
        if ext.output == "kron":
            if cross:
                warnings.warn(
                    f"{ext.__class__.__name__} skips {label}: it is used several times on the "
                    "same samples (weight sharing), for which Kronecker factors are not "
                    "defined here. The other parameters get their factors.",
                    UserWarning,
                    stacklevel=2,
                )
                return None
            return self._shared_kron(ext, name, calls)
        if ext.residual is not None:
            if cross:
                raise NotImplementedError(
                    f"{ext.__class__.__name__} does not support {label}: it is used several "
                    "times on the same samples (the Hessian's cross terms between the uses are "
                    "not computed). Use DiagGGNExact or GGNMP, or a model without reuse."
                )
            total = None
            for record, rule, placement in calls:
                values = self._second_order_values(ext, record, rule, [name], placement)
                value = values[name]
                total = value if total is None else total + value
            return total
        if ext.output in ("diag", "batch_diag") and not cross:
            total = None
            for record, rule, placement in calls:
                value = self._second_order_values(ext, record, rule, [name], placement)[name]
                total = value if total is None else total + value
            return total
        # square roots of all calls (cross terms between calls on the same samples included)
        record, rule, placement = calls[0]
        pieces = _SqrtPieces(param, rule.batch_size(record) if placement is None else placement[1])
        columns = {p: v for p, (v, _) in self.loss_columns.get(ext.factor_key, {}).items()}
        signs = {p: s for p, (_, s) in self.loss_columns.get(ext.factor_key, {}).items()}
        for record, rule, placement in calls:
            if ext.output == "sqrt":
                self._check_signs(ext, record)
            for pos, factors, _ in secondorder.terms_for(record, ext):
                piece = rule.sqrt_factor(record, factors, [name])[name]
                pieces.add(pos, placement, piece)
        full = pieces.assemble(columns)
        if ext.output == "sqrt":
            subsampling = ext.get_subsampling()
            if subsampling is not None:
                full = full[:, torch.as_tensor(subsampling, dtype=torch.long, device=full.device)]
            return full
        sign = torch.cat(
            [full.new_full((columns[p],), signs.get(p, 1.0)) for p in sorted(columns)]
        ).reshape(-1, *([1] * (full.dim() - 1)))
        squares = full.square() * sign
        return squares.sum(0) if ext.output == "batch_diag" else squares.sum((0, 1))

    def _shared_kron(
        self,
        ext: SecondOrderBackpropExtension,
        name: str,
        calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]],
    ) -> list[Tensor] | None:
        """Kronecker factors of a parameter whose calls hold different samples.

        The first factor sums over samples (it adds up); the others are means over a call's
        samples (weighted by the calls' sample counts).
        """
        result: list[Tensor] | None = None
        weights = 0
        for record, rule, _ in calls:
            kron = self._kron(ext, record, rule, [name])
            if kron is None:
                continue
            n = rule.batch_size(record)
            factors_of = kron[name]
            if result is None:
                result = [factors_of[0]] + [f * n for f in factors_of[1:]]
            else:
                result[0] = result[0] + factors_of[0]
                for i, f in enumerate(factors_of[1:], 1):
                    result[i] = result[i] + f * n
            weights += n
        if result is None:
            return None
        return [result[0]] + [f / weights for f in result[1:]]

    def _shared_product(
        self,
        ext: SecondOrderBackpropExtension,
        name: str,
        calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]],
    ) -> Callable[[Tensor], Tensor]:
        """Matrix products of a shared parameter: cross terms within each set of samples."""
        groups: dict[Any, list] = {}
        for record, _, placement in calls:
            key = None if placement is None else placement[0]
            groups.setdefault(key, []).append(record)
        products = []
        for records in groups.values():
            if len(records) == 1:
                entries = secondorder.entries_for(records[0], ext)
                products.append(secondorder.matrix_product([(records[0], entries)], name))
                continue
            if ext.residual is not None:
                raise NotImplementedError(
                    f"{ext.__class__.__name__} does not support parameter {name} of "
                    f"{describe(records[0].module)}: it is used several times on the same "
                    "samples (the Hessian's cross terms between the uses are not computed)."
                )
            uses = secondorder.aligned_entries(records, ext)
            products.append(secondorder.matrix_product(uses, name))
        if len(products) == 1:
            return products[0]

        def product(mat: Tensor) -> Tensor:
            result = products[0](mat)
            for other in products[1:]:
                result = result + other(mat)
            return result

        return product

    def _cover(
        self,
        record: Record,
        grads: tuple,
        rule: ModuleRule,
        name: str,
        param: Tensor,
        psg: Tensor | None,
        always: bool = False,
    ) -> _Coverage:
        """Add this call's gradient at the probe entries of `param` (once per call).

        `psg` are this call's per-sample gradients if they were materialised anyway; only the
        probed entries are read from them (or computed by the rule otherwise). The check runs
        on a parameter's first passes and then on every 16th (`always`: on every pass, e.g.
        when a variance waits for the parameter's gradient).
        """
        coverage = self._coverage.get(id(param))
        if coverage is None:
            scale = self._scales.setdefault(id(record.module), [])
            coverage = self._coverage[id(param)] = _Coverage(
                param, name, record.module, rule, scale
            )
            coverage.active = always or _due_for_check(param)
            if coverage.active:
                fields = [e.savefield for e in self.extensions]

                def hook(grad: Tensor, coverage: _Coverage = coverage) -> None:
                    coverage.on_grad(grad, fields)

                coverage.handle = param.register_hook(hook)
        key = (id(record), id(param))
        if key in self._covered or not coverage.active:
            return coverage
        self._covered.add(key)
        if psg is not None:
            part = psg.flatten(1)[:, coverage.index].sum(0)
        else:
            part = rule.grad_sum_entries(record, grads, name, coverage.index)
        coverage.add(part)
        coverage.scale.append(part)
        coverage.low_precision = coverage.low_precision or self.low_precision
        return coverage

    def _rule_for(
        self, record: Record, exts: list[FirstOrderBackpropExtension]
    ) -> ModuleRule | None:
        rule = find_rule(record.module)
        if rule is not None:
            return rule
        cls = type(record.module)
        if cls not in _WARNED_GENERIC:
            _WARNED_GENERIC.add(cls)
            base = overridden_base(record.module)
            if is_parametrized(record.module):
                why = (
                    " (tensors it uses are computed from its parameters by "
                    "torch.nn.utils.parametrize or weight_norm/spectral_norm: the gradients "
                    "w.r.t. those parameters go through that computation)"
                )
            elif base is not None:
                why = (
                    f" (it overrides the forward of {base.__name__}, whose rule would read the "
                    "recorded input as if that forward had run; if its forward computes the "
                    "same, declare it with "
                    f"backpack.rules.register_standard_forward({cls.__name__}))"
                )
            else:
                why = ""
            warnings.warn(
                f"backpack has no dedicated rule for {cls.__name__}{why}; computing its "
                "per-sample gradients with torch.func (correct, but slower).",
                UserWarning,
                stacklevel=2,
            )
        return _GenericGuard(exts)

    def _check_sample_mixing(
        self, record: Record, exts: list[FirstOrderBackpropExtension]
    ) -> list[FirstOrderBackpropExtension]:
        module = record.module
        for ext in exts:
            if ext.quantity != "grad_batch":
                raise NotImplementedError(f"{ext.__class__.__name__} is {_mixing_message(module)}")
        if _normalises_with_batch(module):
            why = (
                "normalises with statistics of the whole batch (training mode or "
                "track_running_stats=False), so it mixes samples: BatchGrad's per-sample results "
                "may be meaningless. Use eval mode with running statistics for true per-sample "
                "gradients."
            )
        else:
            why = (
                "mixes samples (a sample alone gives another output than within its batch): "
                "BatchGrad's per-sample results may be meaningless."
            )
        warnings.warn(f"{module.__class__.__name__} {why}", UserWarning, stacklevel=2)
        return exts

    def _run_user_extension(
        self, user_ext: Any, ext: BackpropExtension, record: Record, grads: tuple
    ) -> None:
        module = record.module
        module.input0 = record.input_values()
        module.output = record.output_values()
        try:
            with torch.no_grad():
                user_ext.apply(ext, module, tuple(None for _ in record.args), grads)
        finally:
            for attr in ("input0", "output"):
                module.__dict__.pop(attr, None)

    def _unsupported(self, ext: BackpropExtension, module: nn.Module) -> None:
        mode = getattr(ext, "_fail_mode", FAIL_ERROR)
        if mode == FAIL_SILENT:
            return
        if mode == FAIL_ERROR:
            raise NotImplementedError(
                f"Extension saving to {ext.savefield} does not support module "
                f"{module.__class__} (no module extension registered for it)."
            )
        warnings.warn(_unsupported_warning(ext, module), UserWarning, stacklevel=2)


class _GenericGuard(FuncRule):
    """The torch.func fallback; if it cannot handle a module, warn as for an unknown module."""

    def __init__(self, exts: list[FirstOrderBackpropExtension]) -> None:
        self._exts = exts

    def per_sample_grads(self, record, grad_outputs, names, subsampling=None):  # noqa: D102
        try:
            return super().per_sample_grads(record, grad_outputs, names, subsampling)
        except Exception as err:  # noqa: BLE001 - any failure means "cannot handle"
            for ext in self._exts:
                warnings.warn(
                    _unsupported_warning(ext, record.module) + f" (torch.func failed: {err})",
                    UserWarning,
                    stacklevel=2,
                )
            raise _SkipModule from err


class _SkipModule(Exception):
    """Internal: nothing can be computed for this module."""


class backpack:  # noqa: N801 (public name of the original API)
    """Context manager: backward passes inside it also compute the given extensions.

    Args:
        *exts: Extension instances, e.g. `BatchGrad()`, `DiagGGNExact()`.
        extension_hook: Called with each module after all extensions ran on it (its recorded
            input and output are available as `module.input0` and `module.output`).
        debug: Print what happens, module by module.
        retain_graph: Keep what was recorded after a backward, so that several backward passes
            (with `backward(retain_graph=True)`) can run over one forward.
        sync: Data-parallel training on torch.distributed (see "Distributed training" in the
            docs). None (default): when torch.distributed is initialised with more than one
            process, quantities summing over samples become those of the global batch (all
            ranks' samples) and per-sample ones are scaled as its rows. False: keep this rank's
            local quantities. True: like None, but raise if torch.distributed is not
            initialised. A `DistributedDataParallel` model: like None, except in backward passes
            inside its `no_sync()` (local quantities, no communication).

    Raises:
        ValueError: For a class instead of an instance, a non-extension, or two extensions
            writing the same attribute.
    """

    def __init__(
        self,
        *exts: BackpropExtension,
        extension_hook: Callable[[nn.Module], None] | None = None,
        debug: bool = False,
        retain_graph: bool = False,
        sync: Any = None,
    ) -> None:
        for ext in exts:
            if isinstance(ext, type) and issubclass(ext, BackpropExtension):
                raise ValueError(
                    f"backpack() received a class instead of an instance: {ext.__name__}. "
                    f"Instantiate it before passing it to backpack, e.g. {ext.__name__}()."
                )
            if not isinstance(ext, BackpropExtension):
                raise ValueError(
                    f"backpack() expects extension instances (BackpropExtension), got {ext!r}."
                )
        if len(exts) > 1:  # (skipped for the empty contexts some loops enter on every step)
            fields = [ext.savefield for ext in exts]
            duplicates = sorted({f for f in fields if fields.count(f) > 1})
            if duplicates:
                raise ValueError(
                    f"Several extensions passed to backpack() write the same attribute(s) "
                    f"{duplicates}; pass each quantity once."
                )
        self.exts = tuple(exts)
        self.extension_hook = extension_hook
        self.debug = debug
        self.retain_graph = retain_graph
        self.sync = sync  # distributed (backpack/distributed.py)
        self._engine: Engine | None = None

    def __enter__(self) -> backpack:
        self._engine = Engine(
            self.exts, self.extension_hook, self.debug, self.retain_graph, self.sync
        )
        CTX.push_engine(self._engine)
        if not self._engine.idle:
            _ROOTS.enter()
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        engine = self._engine
        if engine is not None:
            engine.reset()
            CTX.pop_engine(engine)
            if not engine.idle:
                _ROOTS.exit()
            if exc_type is None and engine.extensions and engine.passes == 0:
                _warn_nothing_extended(engine)
        self._engine = None


class _BackwardRoots:
    """Tells the engine which tensors a `backward()` starts from, while a context is active.

    Hooks only see the nodes they sit on; the roots are what a walk needs to find losses
    called as functions. `torch.autograd.backward` (which `Tensor.backward` calls) is wrapped
    while at least one `backpack(...)` context is open, and restored when the last one closes.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._original: Callable[..., Any] | None = None
        self._lock = threading.Lock()
        #: one bound method, so that `exit` recognises its own wrapper
        self._wrapper = self._backward

    def enter(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1 and torch.autograd.backward is not self._wrapper:
                self._original = torch.autograd.backward
                torch.autograd.backward = self._wrapper

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and torch.autograd.backward is self._wrapper:
                torch.autograd.backward = self._original

    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        original = self._original
        engine = CTX.engine
        if engine is None or original is None:
            return (original or _TORCH_BACKWARD)(tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        handles = engine.start_backward(roots)
        derived: list[Tensor] | None = None
        succeeded = False
        try:
            arguments = _backward_arguments(args, kwargs)
            found = None if arguments is None else engine.plan_grads_from_samples(roots, arguments)
            if found is not None:
                requested, derived = found
                arguments["inputs"] = requested
                result = original(tensors, **arguments)
            else:
                result = original(tensors, *args, **kwargs)
            succeeded = True
            return result
        finally:
            for handle in handles:
                handle.remove()
            engine.end_backward()
            if derived is not None:
                engine.finish_grads_from_samples(derived, succeeded)


#: first-order quantities along which a call's gradient comes cheaply (`_Quantities.gradient`)
_SUMMABLE = {"grad_batch", "batch_l2", "sum_grad_squared", "variance", "batch_dot"}

_BACKWARD_PARAMETERS = ("grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")


def _backward_arguments(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """`torch.autograd.backward`'s arguments after `tensors` by name (None if unrecognised)."""
    if len(args) > len(_BACKWARD_PARAMETERS) or not set(kwargs) <= set(_BACKWARD_PARAMETERS):
        return None
    arguments = dict(zip(_BACKWARD_PARAMETERS, args))
    if set(arguments) & set(kwargs):
        return None
    arguments.update(kwargs)
    return arguments


_TORCH_BACKWARD = torch.autograd.backward
_ROOTS = _BackwardRoots()
_WARNED_NOTHING: list[bool] = []


def _warn_nothing_extended(engine: Engine) -> None:
    """Warn once per process: a context with extensions met no extended module."""
    if _WARNED_NOTHING:
        return
    _WARNED_NOTHING.append(True)
    warnings.warn(
        f"backpack({', '.join(map(repr, engine.extensions))}) saw no extended module take part "
        "in a backward pass, so it computed nothing. Call backpack.extend(model) (and "
        "extend(lossfunc) for second-order extensions) before the forward pass, and run "
        "loss.backward() inside the with-block.",
        UserWarning,
        stacklevel=3,
    )
