"""Recording: `extend` marks modules; their forwards leave a `Record` for the next backward.

A record holds detached aliases of a module call's inputs and outputs (no extra memory, no graph)
and is owned by the autograd graph of that forward: the gradient hook registered on the outputs
keeps it alive, so it is freed together with the graph and never outlives it. The module only keeps
weak references, which the engine uses to count how often a module was used in a live graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from backpack.context import CTX

#: module -> weak set of its live records (uses in graphs that still exist)
_LIVE_RECORDS: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Record]] = (
    weakref.WeakKeyDictionary()
)
#: id(parameter) -> weak set of the modules that use it directly (tied weights have several).
#: Keyed by id because tensors compare elementwise; entries die with their parameter.
_PARAM_OWNERS: dict[int, weakref.WeakSet[nn.Module]] = {}

#: key under which records are attached to the autograd node that produced a module output
GRAPH_METADATA_KEY = "backpack_records"


class Record:
    """What one call of an extended module left for the backward pass."""

    __slots__ = (
        "module",
        "args",
        "kwargs",
        "outputs",
        "output_structure",
        "versions",
        "training",
        "out_requires_grad",
        "disabled",
        "freed",
        "extra",
        "input_edges",
        "inplace",
        "__weakref__",
    )

    def __init__(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs: tuple[Tensor, ...],
        output_structure: Any,
        disabled: bool = False,
    ) -> None:
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs
        self.output_structure = output_structure
        self.versions = tuple(a._version if isinstance(a, Tensor) else None for a in args)
        self.training = module.training
        #: for each tensor of the output structure (depth first): does it require grad?
        self.out_requires_grad: tuple[bool, ...] = ()
        self.disabled = disabled
        self.freed = False
        #: per-backward scratch space of the engine (second-order factors, ...)
        self.extra: dict[str, Any] = {}
        #: autograd edges of the tensor inputs (None where an input needs no grad or aliases
        #: an output, which would make the graph own a reference to itself)
        self.input_edges: tuple[Any, ...] = ()

    @property
    def input0(self) -> Tensor:
        """The first positional input of the call."""
        return self.args[0]

    @property
    def output(self) -> Any:
        """The call's output (a tensor, or the module's tuple structure of tensors)."""
        return self.output_structure

    def free(self) -> None:
        """Drop the recorded tensors (memory is returned as soon as autograd is done too)."""
        self.args = ()
        self.kwargs = {}
        self.outputs = ()
        self.output_structure = None
        self.extra = {}
        self.input_edges = ()
        self.freed = True

    def check_unmodified(self, extension_name: str) -> None:
        """Raise if an input was modified in place after the module's forward."""
        for arg, version in zip(self.args, self.versions):
            if isinstance(arg, Tensor) and version is not None and arg._version != version:
                raise RuntimeError(
                    f"The input of {self.module.__class__.__name__} ({self.module}) was modified "
                    f"in place after its forward, so {extension_name} cannot use it. Make the "
                    "in-place operation that follows this module out-of-place (e.g. "
                    "inplace=False, `x = x + y` instead of `x += y`)."
                )


def live_records(module: nn.Module) -> list[Record]:
    """The records of `module` whose graphs are alive and whose tensors were not freed."""
    records = _LIVE_RECORDS.get(module)
    if records is None:
        return []
    return [r for r in records if not r.freed]


def param_owners(param: Tensor) -> list[nn.Module]:
    """Modules that used `param` directly in a recorded forward."""
    owners = _PARAM_OWNERS.get(id(param))
    return list(owners) if owners is not None else []


def _register_owner(param: Tensor, module: nn.Module) -> None:
    key = id(param)
    owners = _PARAM_OWNERS.get(key)
    if owners is None:
        owners = _PARAM_OWNERS[key] = weakref.WeakSet()
        weakref.finalize(param, _PARAM_OWNERS.pop, key, None)
    owners.add(module)


def _detach(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach()
    if isinstance(obj, tuple):
        items = [_detach(o) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_detach(o) for o in obj]
    return obj


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """All tensors in a (nested) tuple/list structure, depth first."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_in(o)


def _forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Record the call for the next backward (only when it can be differentiated)."""
    if not torch.is_grad_enabled() or CTX.internal_depth:
        return
    out_tensors = [t for t in tensors_in(output) if t.requires_grad]
    if not out_tensors:
        return
    disabled = CTX.recording_disabled
    if disabled:
        record = Record(module, (), {}, (), None, disabled=True)
    else:
        record = Record(
            module,
            _detach(args),
            {k: _detach(v) for k, v in kwargs.items()},
            tuple(t.detach() for t in out_tensors),
            _detach(output),
        )
        record.input_edges = tuple(_input_edge(a, out_tensors) for a in args)
        record.inplace = any(a is o for a in args for o in out_tensors)
        for param in module.parameters(recurse=False):
            _register_owner(param, module)
    record.out_requires_grad = tuple(t.requires_grad for t in tensors_in(output))
    _LIVE_RECORDS.setdefault(module, weakref.WeakSet()).add(record)

    # The hook closure (stored on the graph) owns the record: it dies with the graph.
    if len(out_tensors) == 1:
        (tensor,) = out_tensors

        def _hook(grad: Tensor, record: Record = record) -> None:
            _dispatch(record, (grad,))

        tensor.register_hook(_hook)
    else:

        def _multi_hook(grads: Any, record: Record = record) -> None:
            _dispatch(record, tuple(grads))

        torch.autograd.graph.register_multi_grad_hook(out_tensors, _multi_hook)
    if not disabled:
        for nr, tensor in enumerate(out_tensors):
            node = tensor.grad_fn
            if node is not None:
                entry = (record, nr, tensor.output_nr)
                node.metadata.setdefault(GRAPH_METADATA_KEY, []).append(entry)


def _input_edge(arg: Any, out_tensors: list[Tensor]) -> Any:
    if not isinstance(arg, Tensor) or not arg.requires_grad:
        return None
    if any(arg is out for out in out_tensors):
        return None
    return get_gradient_edge(arg)


def _dispatch(record: Record, grads: tuple[Tensor | None, ...]) -> None:
    engine = CTX.engine
    if engine is not None:
        engine.on_module_backward(record, grads)


def _is_leaf_or_parametrized(module: nn.Module) -> bool:
    has_children = next(module.children(), None) is not None
    has_params = next(module.parameters(recurse=False), None) is not None
    return has_params or not has_children


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
        from backpack.custom_module.graph_utils import convert_module_to_backpack

        module = convert_module_to_backpack(module, debug)
    for name, sub in module.named_modules():
        if getattr(sub, "_backpack_extend", False):
            continue
        if not _is_leaf_or_parametrized(sub):
            continue
        handle = sub.register_forward_hook(_forward_hook, with_kwargs=True)
        CTX.add_hook_handle(handle)
        sub._backpack_extend = True
        if debug:
            print(f"[backpack] extending {name or '<root>'}: {sub.__class__.__name__}")
    return module


def memory_cleanup(module: nn.Module) -> None:
    """Free what was recorded on `module` for the next backward (safe if nothing is recorded)."""
    for record in list(_LIVE_RECORDS.get(module, ())):
        record.free()
    for attr in ("input0", "output"):
        if attr in module.__dict__:
            delattr(module, attr)


class disable:  # noqa: N801 (public name of the original API)
    """Context manager: forwards inside it record nothing for backpack (saves time and memory).

    A backward inside `with backpack(...)` through such a forward raises an error.
    """

    def __enter__(self) -> None:
        CTX.disabled_depth += 1

    def __exit__(self, *exc_info: object) -> None:
        CTX.disabled_depth -= 1

    @staticmethod
    def is_active() -> bool:
        """Whether recording is currently disabled."""
        return CTX.recording_disabled
