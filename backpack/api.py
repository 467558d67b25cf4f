"""The user API: `extend`, `backpack(...)` and `disable`.

`extend` hooks modules for recording (`backpack.recording`), optionally after converting the
model with `torch.fx`; `backpack(...)` opens a context whose `Engine` observes the backward
passes run inside it; `disable()` switches recording off.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from backpack.context import CTX
from backpack.custom_module.graph_utils import convert_module_to_backpack
from backpack.engine import Engine
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.recording import disable, hook_modules, memory_cleanup
from backpack.rules import find_rule

__all__ = ["backpack", "extend", "disable", "memory_cleanup"]


def extend(module: nn.Module, debug: bool = False, use_converter: bool = False) -> nn.Module:
    """Make `module` and its submodules record what backpack needs during forward passes.

    Leaf modules and modules owning parameters are hooked; pure containers (e.g. `Sequential`)
    are only traversed. Extending twice is harmless. Returns the module itself.

    Args:
        module: The model or loss function to extend.
        debug: Print which modules get extended.
        use_converter: Convert the model with `torch.fx` into a graph made only of modules first.

    Returns:
        The extended module (a converted `torch.fx.GraphModule` when `use_converter=True`).
    """
    if use_converter:
        module = convert_module_to_backpack(module, debug)
    module = hook_modules(module, debug)
    for submodule in module.modules():
        # rules registered by a class's qualified name take the class in when first looked up,
        # and with it what the forward hooks need to know (`ModuleRule.on_class_resolved`)
        find_rule(submodule)
    return module


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
            if (
                exc_type is None
                and engine.extensions
                and engine.layers_met == 0
                and engine not in _NOTHING_WARNED
            ):
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
        arguments = _backward_arguments(args, kwargs)
        implicit = arguments is not None and all(
            arguments.get(k) is None for k in ("grad_tensors", "grad_variables")
        )
        # a backward run by another one's backward (reentrant checkpointing) is part of it
        outermost = torch._C._current_graph_task_id() == -1
        layers_before = engine.layers_met
        handles = engine.start_backward(roots, implicit)
        derived: list[Tensor] | None = None
        succeeded = False
        try:
            found = None if arguments is None else engine.plan_grads_from_samples(roots, arguments)
            if found is not None:
                requested, derived = found
                arguments["inputs"] = requested
                result = original(tensors, **arguments)
            else:
                result = original(tensors, *args, **kwargs)
            succeeded = True
        finally:
            for handle in handles:
                handle.remove()
            engine.end_backward()
            if derived is not None:
                engine.finish_grads_from_samples(derived, succeeded)
        if outermost and engine.extensions and engine.layers_met == layers_before:
            _warn_backward_computed_nothing(engine, roots)
        return result



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
#: engines (contexts) that already warned about a backward that computed nothing
_NOTHING_WARNED: weakref.WeakSet[Engine] = weakref.WeakSet()
_FIX = (
    "Call model = backpack.extend(model) before the forward pass, and run loss.backward() "
    "inside the with-block (docs: 'Good to know', 'A quantity is missing')."
)
_TORCH_DIR = Path(torch.__file__).resolve().parent


def _caller_stacklevel() -> int:
    """The `stacklevel` of the first frame outside this module and torch (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != __file__ and not filename.startswith(str(_TORCH_DIR)):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def _reached_parameters(roots: list[Tensor], limit: int = 100_000) -> list[Tensor]:
    """The leaf tensors requiring gradients that a backward from `roots` reaches."""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = [root.grad_fn for root in roots if isinstance(root, Tensor)]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, Tensor):
            found.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def _warn_backward_computed_nothing(engine: Engine, roots: list[Tensor]) -> None:
    """Warn: a backward inside a context with extensions met no extended layer.

    The warning fires for every such backward; its text names the parameters reached (their
    number and shapes), so that Python's default filter shows it once per call site and model
    instead of on every step of a loop, while a second model still gets its own.
    """
    _NOTHING_WARNED.add(engine)
    parameters = _reached_parameters(roots)
    shapes = ", ".join(str(list(p.shape)) for p in parameters[:6])
    if len(parameters) > 6:
        shapes += ", ..."
    reached = (
        f"it reached {len(parameters)} parameter(s) of shape(s) {shapes}, which get .grad only"
        if parameters
        else "it reached no parameter"
    )
    warnings.warn(
        f"A backward pass inside backpack({', '.join(map(repr, engine.extensions))}) saw no "
        f"extended module take part, so it computed nothing ({reached}). {_FIX}",
        UserWarning,
        stacklevel=_caller_stacklevel(),
    )


def _warn_nothing_extended(engine: Engine) -> None:
    """Warn at the end of a context with extensions that computed nothing and had not said so.

    That is: no `backward()` ran inside it (or only `torch.autograd.grad` calls).
    """
    warnings.warn(
        f"backpack({', '.join(map(repr, engine.extensions))}) saw no extended module take part "
        "in a backward pass, so it computed nothing (a backward pass run after the with-block "
        f"computes .grad only). {_FIX}",
        UserWarning,
        stacklevel=3,
    )
