"""The engine: observes a backward pass inside `with backpack(...)` and runs the extensions.

Gradient hooks registered at record time call `Engine.on_module_backward` with the gradients that
reach a module call's outputs. The engine asks the module's rule for the quantities the active
extensions need and stores them on the parameters. A parameter used by several calls (a module
applied twice, tied weights) gets the quantities of its summed per-sample gradient: contributions
are accumulated until every live use has reported or the backward ends.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from backpack import secondorder
from backpack.context import CTX
from backpack.extensions.backprop_extension import (
    FAIL_ERROR,
    FAIL_SILENT,
    BackpropExtension,
)
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.extensions.secondorder import SecondOrderBackpropExtension
from backpack.recording import Record, live_records, param_owners, trainable_params
from backpack.rules import find_rule
from backpack.rules.activations import find_activation_rule
from backpack.rules.base import ModuleRule
from backpack.rules.generic import FuncRule
from backpack.rules.losses import is_loss

_GENERIC_RULE = FuncRule()
_WARNED_GENERIC: set[type] = set()


def _unsupported_warning(ext: BackpropExtension, module: nn.Module) -> str:
    return (
        f"Extension saving to {ext.savefield} does not have an extension for "
        f"Module {module.__class__} although the module has parameters"
    )


def _mixing_message(module: nn.Module) -> str:
    return (
        f"undefined for {module.__class__.__name__} ({module}): it normalises with statistics of "
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

    def _variance(self, _: Any) -> dict[str, Tensor]:
        sgs, gsum = self.get("sum_grad_squared"), self.get("grad_sum")
        return {k: _variance_from_sums(sgs[k], gsum[k], self.n) for k in sgs}


def variance_waits_for_grad(param: Tensor) -> bool:
    """Whether `Variance` takes a call's gradient sum from the parameter's own gradient.

    Autograd computes that sum anyway, so waiting for the parameter's hook saves the rule a GEMM
    or convolution weight backward, but costs a coverage check on every pass (the sum must hold
    only extended calls' contributions). That pays on the CPU; on GPUs the check's small kernels
    and host syncs cost more than the GEMM (measured on an H100), so there the rule computes it.
    """
    return param.device.type == "cpu"


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

    def __init__(self, param: Tensor, name: str, module: nn.Module, rule: ModuleRule) -> None:
        self.param = param
        self.index = _probe_index(param, rule, name)
        self.total: Tensor | None = None
        self.label = f"{name} of {module.__class__.__name__}"
        self.handle: Any = None
        #: whether this pass checks the parameter (see `Engine._cover`)
        self.active = True
        #: variances waiting for the call's gradient sum: (savefield, Σ g², N, fallback)
        self.pending: list[tuple[str, Tensor, int, Callable[[], Tensor], bool]] = []

    def add(self, part: Tensor) -> None:
        self.total = part if self.total is None else self.total + part

    def on_grad(self, grad: Tensor, fields: list[str]) -> None:
        """Parameter hook: check coverage, then finish pending variances with `grad`."""
        covered = self.check(grad, fields)
        self.finish(grad.detach() if covered else None)

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
        # |actual - total| <= tol * max(|total|, |actual|) on at most 8 numbers: Python floats
        # (one transfer) are cheaper than a chain of tiny tensor ops; NaN counts as a mismatch
        pairs = torch.stack([actual, self.total], 1).tolist()
        bound = tol * max((abs(v) for pair in pairs for v in pair), default=0.0) + 1e-30
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


def _snapshot(record: Record) -> Record:
    """A private copy of a record's references (it survives `record.free()`, is never counted)."""
    copy = Record.__new__(Record)
    for slot in Record.__slots__:
        if slot != "__weakref__":
            setattr(copy, slot, getattr(record, slot))
    copy.extra = {}
    return copy


def _grad_sum_of(quantities: _Quantities, name: str) -> Tensor:
    """One call's gradient w.r.t. parameter `name` (fused rule, else summed per-sample ones)."""
    return quantities.get("grad_sum")[name]


class _Accumulator:
    """Summed per-sample gradients of a parameter used several times in one graph."""

    def __init__(self, param: Tensor, expected_uses: int, batch_size: int) -> None:
        self.param = param
        self.expected = expected_uses
        self.seen = 0
        self.batch_size = batch_size
        self.psg: Tensor | None = None

    def add(self, psg: Tensor) -> None:
        self.psg = psg if self.psg is None else self.psg + psg
        self.seen += 1


class _SecondOrderAccumulator:
    """Second-order contributions of a parameter used several times in one graph.

    The GGN of a shared parameter includes cross terms between its uses: its square-root
    factor is the sum of the uses' factors, and matrix products sum over pairs of uses.
    """

    def __init__(self, param: Tensor, expected_uses: int) -> None:
        self.param = param
        self.expected = expected_uses
        self.seen = 0
        self.sqrt: dict[Any, Tensor] = {}
        self.uses: dict[Any, list] = {}
        self.exts: list = []

    def add(self, engine: Engine, record: Record, rule: ModuleRule, name: str) -> None:
        self.seen += 1
        added = set()
        for ext in engine.second_order:
            if ext.factor == "sum":
                continue
            if ext.residual is not None or ext.output == "kron":
                raise NotImplementedError(
                    f"{ext.__class__.__name__} does not support parameters used several times "
                    f"in one forward ({record.module.__class__.__name__})."
                )
            if ext not in self.exts:
                self.exts.append(ext)
            entries = secondorder.entries_for(record, ext)
            if ext.output == "mp":
                self.uses.setdefault(ext, []).append((record, entries, name))
                continue
            key = (ext.factor_key, tuple(ext.get_subsampling() or ()))
            if not entries or key in added:
                continue
            added.add(key)
            sqrt = rule.sqrt_factor(record, entries[0].factors, [name], ext.get_subsampling())
            value = sqrt[name]
            self.sqrt[key] = value if key not in self.sqrt else self.sqrt[key] + value

    def values(self) -> dict[Any, Any]:
        result = {}
        for ext in self.exts:
            if ext.output == "mp":
                uses = self.uses.get(ext, [])
                name = uses[0][2]
                result[ext] = secondorder.matrix_product([(r, e) for r, e, _ in uses], name)
                continue
            sqrt = self.sqrt.get((ext.factor_key, tuple(ext.get_subsampling() or ())))
            if sqrt is None:
                sqrt = self.param.new_zeros(1, 1, *self.param.shape)
            if ext.output == "sqrt":
                result[ext] = sqrt
            elif ext.output == "batch_diag":
                result[ext] = sqrt.square().sum(0)
            else:
                result[ext] = sqrt.square().sum((0, 1))
        return result


class Engine:
    """State of one active `backpack(...)` context while backward passes run."""

    def __init__(
        self,
        extensions: Sequence[BackpropExtension],
        extension_hook: Callable[[nn.Module], None] | None,
        debug: bool,
        retain_graph: bool,
    ) -> None:
        self.extensions = list(extensions)
        self.extension_hook = extension_hook
        self.debug = debug
        self.retain_graph = retain_graph
        self.first_order = [
            e for e in self.extensions if isinstance(e, FirstOrderBackpropExtension)
        ]
        self.second_order = [
            e for e in self.extensions if isinstance(e, SecondOrderBackpropExtension)
        ]
        #: whether an extended loss started the second-order factors in this pass
        self.loss_seen = False
        self._coverage: dict[int, _Coverage] = {}
        self._covered: set[tuple[int, int]] = set()
        self._second_acc: dict[Tensor, _SecondOrderAccumulator] = {}
        #: set while the engine itself runs autograd (factor propagation); hooks then do nothing
        self.propagating = False
        self._task_id: int | None = None
        self._accumulators: dict[Tensor, _Accumulator] = {}
        self._deferred_hooks: dict[nn.Module, Record] = {}
        #: id(record) -> (record, output gradients so far, [output nodes reported])
        self._partial: dict[int, tuple[Record, list, list[int]]] = {}

    # --- pass bookkeeping --------------------------------------------------------------------
    def _enter_pass(self) -> None:
        task = torch._C._current_graph_task_id()
        if self._task_id is not None:
            # same pass, or a backward nested inside it (its end callback has not run yet)
            return
        self.reset()
        self._task_id = task
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)

    def reset(self) -> None:
        """Forget everything about the current backward pass (also after an exception)."""
        self._task_id = None
        self._accumulators = {}
        self._second_acc = {}
        self._deferred_hooks = {}
        self._partial = {}
        self.loss_seen = False
        for coverage in self._coverage.values():
            coverage.pending = []
            if coverage.handle is not None:
                coverage.handle.remove()
        self._coverage = {}
        self._covered = set()

    def _finish_pass(self) -> None:
        try:
            # multi-output calls some of whose outputs the loss does not use
            for record, grads, _ in list(self._partial.values()):
                self._process(record, tuple(grads))
            # parameters whose gradient hook did not run (autograd.grad without them as inputs)
            for coverage in self._coverage.values():
                coverage.finish(None)
            for acc in list(self._accumulators.values()):
                self._finalize_accumulator(acc)
            for acc in list(self._second_acc.values()):
                self._finalize_second(acc)
            for module, record in list(self._deferred_hooks.items()):
                self._after_module(module, record)
        finally:
            self.reset()

    # --- entry point from the gradient hooks -------------------------------------------------
    def on_module_backward(self, record: Record, grads: tuple[Tensor | None, ...]) -> None:
        """Run the active extensions on one module call whose output gradients are known."""
        if self.propagating:
            return
        self._enter_pass()
        try:
            self._process(record, grads)
        except BaseException:
            self.reset()  # the backward aborts: its end-of-pass callback will not run
            raise

    def on_module_output_part(
        self, record: Record, parts: list[tuple[int, Tensor | None]], nodes: int
    ) -> None:
        """Gradients of some outputs of a multi-output call (one of its `nodes` output nodes)."""
        if self.propagating:
            return
        self._enter_pass()
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
                f"The forward of {module.__class__.__name__} ({module}) ran under "
                "backpack.disable(), so nothing was recorded for the backward inside "
                f"backpack({', '.join(map(repr, self.extensions))}). Run the forward outside "
                "disable() to compute backpack quantities."
            )
        if record.freed:
            raise RuntimeError(
                f"What was recorded for {module.__class__.__name__} was freed after the previous "
                "backward pass. To backpropagate several times through one forward, use "
                "backpack(..., retain_graph=True) together with backward(retain_graph=True)."
            )
        if self.debug:
            print(f"[backpack] backward through {module.__class__.__name__}")
        if is_loss(module):
            if self.second_order:
                secondorder.on_loss_backward(self, record, grads)
            self._after_module(module, record)
            return
        if not self.extensions:
            self._after_module(module, record)
            return
        deferred = self._run_first_order(record, grads)
        if self.second_order:
            if find_activation_rule(module) is not None:
                secondorder.on_activation_backward(self, record, grads)
            deferred = self._run_second_order(record, grads) or deferred
        if deferred:
            self._deferred_hooks[module] = record
        else:
            self._after_module(module, record)

    def _after_module(self, module: nn.Module, record: Record) -> None:
        self._deferred_hooks.pop(module, None)
        if self.extension_hook is not None:
            module.input0 = record.args[0] if record.args else None
            module.output = record.output_structure
            try:
                self.extension_hook(module)
            finally:
                for attr in ("input0", "output"):
                    module.__dict__.pop(attr, None)
        if not self.retain_graph:
            record.free()

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
        batch_size = rule.batch_size(record)
        direct, shared = [], []
        for name, p in params.items():
            uses = sum(len(live_records(m)) for m in param_owners(p))
            (shared if uses > 1 else direct).append(name)
        if direct:
            with torch.no_grad():
                quantities = _Quantities(rule, record, grads, direct, batch_size)
                variances = [e for e in builtin if e.quantity == "variance"]
                for ext in builtin:
                    if ext.quantity == "variance":
                        continue
                    values = quantities.get(ext.quantity, ext.get_subsampling())
                    for name in direct:
                        setattr(params[name], ext.savefield, values[name])
                sgs = quantities.get("sum_grad_squared") if variances else {}
                # nobody else stores these sums: the variance may be computed in their place
                private = len(variances) == 1 and all(
                    e.quantity != "sum_grad_squared" for e in builtin
                )
                if variances:
                    # the fallback below may run after the record is freed
                    quantities.record = _snapshot(record)
                psg = quantities._psg
                for name in direct:
                    part = None if psg is None else psg[name]
                    wait = bool(variances) and variance_waits_for_grad(params[name])
                    coverage = self._cover(record, grads, rule, name, params[name], part, wait)
                    for ext in variances:
                        fallback = partial(_grad_sum_of, quantities, name)
                        if wait:
                            entry = (ext.savefield, sgs[name], batch_size, fallback, private)
                            coverage.pending.append(entry)
                            continue
                        variance = _variance_from_sums(sgs[name], fallback(), batch_size, private)
                        setattr(params[name], ext.savefield, variance)
        for name in shared:
            p = params[name]
            acc = self._accumulators.get(p)
            if acc is None:
                uses = sum(len(live_records(m)) for m in param_owners(p))
                acc = self._accumulators[p] = _Accumulator(p, uses, batch_size)
            with torch.no_grad():
                psg = rule.per_sample_grads(record, grads, [name])[name]
                acc.add(psg)
                self._cover(record, grads, rule, name, p, psg, always=True)
            if acc.seen >= acc.expected:
                self._finalize_accumulator(acc)
        return any(p in self._accumulators for p in params.values())

    # --- second order --------------------------------------------------------------------------
    def _run_second_order(self, record: Record, grads: tuple[Tensor | None, ...]) -> bool:
        """Second-order quantities of one call; True if some wait for other uses."""
        module = record.module
        params = trainable_params(module)
        if not params:
            return False
        exts = self.second_order
        names = ", ".join(e.__class__.__name__ for e in exts)
        if not self.loss_seen:
            raise RuntimeError(
                f"{names} could not find an extended loss function in this backward pass. "
                "Second-order extensions start from the loss: extend it too, e.g. "
                "lossfunc = extend(torch.nn.CrossEntropyLoss()), and call backward on its output."
            )
        rule = find_rule(module)
        if rule is None:
            rule = _GENERIC_RULE
        if rule.mixes_samples(record):
            raise NotImplementedError(f"{names} are {_mixing_message(module)}")
        record.check_unmodified(exts[0].__class__.__name__)
        filled = tuple(
            torch.zeros_like(o) if g is None else g for g, o in zip(grads, record.outputs)
        )
        with torch.no_grad():
            for name, p in params.items():
                self._cover(record, filled, rule, name, p, None)
        direct, shared = [], []
        for name, p in params.items():
            uses = sum(len(live_records(m)) for m in param_owners(p))
            (shared if uses > 1 else direct).append(name)
        if direct:
            with torch.no_grad():
                for ext in exts:
                    if ext.factor == "sum":
                        continue  # KFRA writes its factors from the module chain
                    values = self._second_order_values(ext, record, rule, direct)
                    for name in direct:
                        setattr(params[name], ext.savefield, values[name])
        for name in shared:
            p = params[name]
            acc = self._second_acc.get(p)
            if acc is None:
                uses = sum(len(live_records(m)) for m in param_owners(p))
                acc = self._second_acc[p] = _SecondOrderAccumulator(p, uses)
            with torch.no_grad():
                acc.add(self, record, rule, name)
            if acc.seen >= acc.expected:
                self._finalize_second(acc)
        return any(p in self._second_acc for p in params.values())

    def _second_order_values(
        self, ext: SecondOrderBackpropExtension, record: Record, rule: ModuleRule, names: list
    ) -> dict[str, Any]:
        entries = secondorder.entries_for(record, ext)
        module = record.module
        if ext.output in ("diag", "batch_diag"):
            per_sample = ext.output == "batch_diag"
            if not entries:
                n = rule.batch_size(record) if per_sample else None
                return secondorder.zero_like_params(module, names, n)
            return secondorder.reduce_entries(record, entries, names, per_sample, rule)
        if ext.output == "sqrt":
            return rule.sqrt_factor(record, entries[0].factors, names, ext.get_subsampling())
        if ext.output == "kron":
            kron = rule.kron_factors(record, entries[0].factors, names)
            if kron is None:
                raise NotImplementedError(
                    f"Extension saving to {ext.savefield} ({ext.__class__.__name__}) does not "
                    f"support module {module.__class__}: Kronecker factors are defined for "
                    "Linear and convolution layers."
                )
            return kron
        # "mp": a matrix-product closure per parameter
        return {n: secondorder.matrix_product([(record, entries)], n) for n in names}

    def _finalize_second(self, acc: _SecondOrderAccumulator) -> None:
        self._second_acc.pop(acc.param, None)
        with torch.no_grad():
            for ext, value in acc.values().items():
                setattr(acc.param, ext.savefield, value)

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
            coverage = self._coverage[id(param)] = _Coverage(param, name, record.module, rule)
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
        return coverage

    def _finalize_accumulator(self, acc: _Accumulator) -> None:
        self._accumulators.pop(acc.param, None)
        if acc.psg is None:
            return
        with torch.no_grad():
            quantities = _Quantities(None, None, (), ["p"], acc.batch_size, psg={"p": acc.psg})
            for ext in self.first_order:
                value = quantities.get(ext.quantity, ext.get_subsampling())["p"]
                setattr(acc.param, ext.savefield, value)

    def _rule_for(
        self, record: Record, exts: list[FirstOrderBackpropExtension]
    ) -> ModuleRule | None:
        rule = find_rule(record.module)
        if rule is not None:
            return rule
        cls = type(record.module)
        if cls not in _WARNED_GENERIC:
            _WARNED_GENERIC.add(cls)
            warnings.warn(
                f"backpack has no dedicated rule for {cls.__name__}; computing its per-sample "
                "gradients with torch.func (correct, but slower).",
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
        warnings.warn(
            f"{module.__class__.__name__} normalises with statistics of the whole batch (training "
            "mode or track_running_stats=False), so it mixes samples: BatchGrad's per-sample "
            "results may be meaningless. Use eval mode with running statistics for true "
            "per-sample gradients.",
            UserWarning,
            stacklevel=2,
        )
        return exts

    def _run_user_extension(
        self, user_ext: Any, ext: BackpropExtension, record: Record, grads: tuple
    ) -> None:
        module = record.module
        module.input0 = record.args[0] if record.args else None
        module.output = record.output_structure
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
        self._engine: Engine | None = None

    def __enter__(self) -> backpack:
        self._engine = Engine(self.exts, self.extension_hook, self.debug, self.retain_graph)
        CTX.engines.append(self._engine)
        return self

    def __exit__(self, *exc_info: object) -> None:
        engine = self._engine
        if engine is not None:
            engine.reset()
            if engine in CTX.engines:
                CTX.engines.remove(engine)
        self._engine = None
