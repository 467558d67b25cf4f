"""The engine: orchestrates one backward pass inside `with backpack(...)`.

Gradient hooks registered at record time call `Engine.on_module_backward` with the gradients that
reach a module call's outputs. The engine owns the backward's state (`BackwardState`), orders the
work and hands each call to the passes: first order (`passes.first_order`), the curvature
propagation started at losses (`secondorder`, `kfra`) and the curvature store
(`passes.curvature`). It frees what was recorded, runs `extension_hook` and `debug`, and lets a
synchronisation strategy (torch.distributed) make the quantities global at the end of a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from backpack import grads_from_samples, kfra, secondorder
from backpack.context import CTX
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.functional_calls import find_functional_calls
from backpack.passes import curvature, first_order
from backpack.passes.state import BackwardState, make_sync
from backpack.passes.views import check_sample_count, view_for_rules
from backpack.recording import Record, describe, promote_half, register_call
from backpack.rules.activations import find_activation_rule
from backpack.rules.losses import is_loss
from backpack.samples import SampleLayout

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


#: first-order quantities along which a call's gradient comes cheaply (`_Quantities.gradient`)
_SUMMABLE = {"grad_batch", "batch_l2", "sum_grad_squared", "variance", "batch_dot"}


class Engine:
    """Orchestrates the backward passes of one active `backpack(...)` context.

    The data of a running backward live in `state` (a `BackwardState`) and are handed to the
    passes; the engine decides when each pass runs, frees records and runs user hooks.
    """

    def __init__(
        self,
        extensions: Sequence[BackpropExtension],
        extension_hook: Callable[[nn.Module], None] | None,
        debug: bool,
        retain_graph: bool,
        sync: Any = None,
    ) -> None:
        extensions = list(extensions)
        self.extension_hook = extension_hook
        #: device types with autocast on during the running pass
        self._autocast: list[str] = []
        #: a context without extensions, hook or debug output only frees the records
        self.idle = not extensions and extension_hook is None and not debug
        self.debug = debug
        self.retain_graph = retain_graph
        #: torch.distributed: makes quantities global at the end of each pass (or None)
        strategy = (
            None  # what make_sync answers without extensions
            if not extensions and (sync is None or sync is False)
            else make_sync(sync, extensions)
        )
        self.state = BackwardState(extensions, strategy)
        #: losses called as functions in the running `backward()`: (record, autograd node)
        self._functional: list[tuple[Record, Any]] = []
        #: records of functional linear calls on tied weights in the running `backward()`
        self._functional_linears: list[Record] = []
        #: extended loss calls the running `backward()`'s roots reach (None: not known)
        self._root_losses: list[Record] | None = None
        self._task_id: int | None = None
        self._deferred_hooks: dict[nn.Module, Record] = {}
        #: id(record) -> (record, output gradients so far, [output nodes reported])
        self._partial: dict[int, tuple[Record, list, list[int]]] = {}
        self._dirty = False
        #: calls of extended modules other than losses that the context's backward passes met
        self.layers_met = 0

    @property
    def extensions(self) -> list[BackpropExtension]:
        """The context's extensions."""
        return self.state.extensions

    @property
    def sync(self) -> Any:
        """The synchronisation strategy across processes (None: local quantities)."""
        return self.state.sync

    @property
    def passes(self) -> int:
        """Backward passes that met an extended module while the context was active."""
        return self.state.passes

    @passes.setter
    def passes(self, value: int) -> None:
        self.state.passes = value

    # --- pass bookkeeping --------------------------------------------------------------------
    def _enter_pass(self) -> None:
        if self._task_id is not None:
            # same pass, or a backward nested inside it (its end callback has not run yet)
            return
        self.reset()
        self._dirty = True
        self._autocast = _autocast_types()
        self._task_id = torch._C._current_graph_task_id()
        state = self.state
        state.passes += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_pass)
        functional = [r for r, _ in self._functional]
        state.layout = SampleLayout.discover(state.batch_size, functional, self._root_losses)

    def reset(self) -> None:
        """Forget everything about the current backward pass (also after an exception)."""
        if not self._dirty:
            return  # nothing happened since the last reset
        self._dirty = False
        self._task_id = None
        self._deferred_hooks = {}
        self._partial = {}
        self.state.reset()

    def _abort(self) -> None:
        """The pass failed here: let other processes fail too, and forget it."""
        if self.state.sync is not None:  # distributed: the other ranks raise instead of waiting
            self.state.sync.abort_pass(self.state)
        self.reset()

    def _finish_pass(self) -> None:
        state = self.state
        try:
            # multi-output calls some of whose outputs the loss does not use
            for record, grads, _ in list(self._partial.values()):
                self._process(record, tuple(grads))
            # parameters whose gradient hook did not run (autograd.grad without them as inputs)
            for coverage in state.coverage.values():
                if coverage.pending:
                    coverage.finish(None)
            first_order.finish_param_sites(state)
            for acc in list(state.accumulators.values()):
                first_order.finalize_accumulator(state, acc)
            for shared in list(state.curvatures.values()):
                curvature.finalize_curvature(state, shared)
            curvature.assemble_sqrt(state)
            for module, record in list(self._deferred_hooks.items()):
                self._after_module(module, record)
            if state.sync is not None:  # distributed: global quantities (backpack/distributed.py)
                state.sync.finish_pass(state)
        except BaseException:
            if state.sync is not None:  # distributed: the other ranks raise instead of waiting
                state.sync.abort_pass(state)
            raise
        finally:
            self.reset()

    def start_backward(self, roots: list[Tensor], implicit_grad: bool = False) -> list[Any]:
        """Before a `backward()` from `roots` runs: find the losses called as functions.

        `implicit_grad`: the roots' gradient is autograd's implicit 1 (no `grad_tensors`).
        Returns the pre-hooks installed on their nodes (the caller removes them afterwards).
        """
        self.state.unit_roots = (
            tuple(r.grad_fn for r in roots if r.grad_fn is not None) if implicit_grad else ()
        )
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
        self.state.unit_roots = ()
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
            if self.state.sync is not None:  # distributed: the loss's normaliser
                self.state.sync.on_call(self.state, record)
            if self.state.second_order:
                with _no_autocast():
                    self._start_curvature(record, promote_half(grads))
        except BaseException:
            self._abort()
            raise

    def _start_curvature(self, record: Record, grads: tuple[Tensor | None, ...]) -> None:
        """An extended loss: propagate its Hessian factors (and start KFRA's recursion)."""
        sum_hessian = secondorder.on_loss_backward(self.state, record, grads)
        if sum_hessian is not None:
            kfra.start_kfra(self.state, record, sum_hessian)

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
            self.state.layout.explore(torch._C._current_autograd_node())
            self._process(record, grads)
        except BaseException:
            self._abort()  # the backward aborts: its end-of-pass callback will not run
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
            self._abort()
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
        if not is_loss(module):
            self.layers_met += 1
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
            self.state.low_precision = True
        with _no_autocast(self._autocast):
            view, grads = view_for_rules(self.state, record, grads)
            self._dispatch_rules(view, grads)

    def _dispatch_rules(self, record: Record, grads: tuple[Tensor | None, ...]) -> None:
        module, state = record.module, self.state
        if state.sync is not None:  # distributed: the call's parameters, a loss's normaliser
            state.sync.on_call(state, record)
        if is_loss(module):
            if state.second_order:
                self._start_curvature(record, grads)
            self._after_module(module, record)
            return
        if not state.extensions:
            self._after_module(module, record)
            return
        check_sample_count(state, record)
        deferred = first_order.run_first_order(state, record, grads)
        if state.second_order:
            if find_activation_rule(module) is not None:
                secondorder.on_activation_backward(state, record, grads)
            deferred = curvature.run_second_order(state, record, grads) or deferred
        if deferred:
            self._deferred_hooks[module] = record
        else:
            self._after_module(module, record)

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

    # --- .grad of convolutions summed from per-sample gradients (backpack.grads_from_samples) -
    def plan_grads_from_samples(
        self, roots: list[Tensor], arguments: dict[str, Any]
    ) -> tuple[list[Tensor], list[Tensor]] | None:
        """(leaves to request, parameters whose `.grad` is derived) for one `backward()`.

        Only for first-order extensions alone (without subsampling, not distributed) on a
        plain `backward()` (no `inputs`, no `create_graph`); see `backpack.grads_from_samples`.
        """
        state = self.state
        if (
            not grads_from_samples.ENABLED
            or state.derived_sums is not None
            or not state.extensions
            or state.sync is not None
            or arguments.get("create_graph")
            or arguments.get("inputs") is not None
            or arguments.get("grad_variables") is not None
            or not grads_from_samples.accumulator_hooks_unlikely()
        ):
            return None
        for ext in state.extensions:
            if not isinstance(ext, FirstOrderBackpropExtension):
                return None
            if ext.quantity not in _SUMMABLE or ext.get_subsampling() is not None:
                return None

        def allowed(module: nn.Module) -> bool:
            return all(ext.get_module_extension(module) is None for ext in state.extensions)

        found = grads_from_samples.plan(roots, allowed)
        if found is not None:
            state.derived_sums = {id(p): None for p in found[1]}
        return found

    def finish_grads_from_samples(self, derived: list[Tensor], succeeded: bool) -> None:
        """After the `backward()`: accumulate the derived `.grad`s (if it succeeded)."""
        sums, self.state.derived_sums = self.state.derived_sums or {}, None
        if succeeded:
            grads_from_samples.assign(derived, {k: v for k, v in sums.items() if v is not None})
