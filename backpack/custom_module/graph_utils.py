"""Convert a model into a `torch.fx.GraphModule` made only of modules.

`convert_module_to_backpack` traces the model with `BackpackTracer` and rewrites the graph:
additions of two tensors become `SumModule`s, functional activations and `flatten` become their
modules, in-place activations are made out-of-place, and a parameter-free module called several
times is duplicated so that each call has its own module. Parametrized modules are left where
they are, so parameter names (and tying) are kept; new modules are inserted, so the order of
`named_modules()` may change.
"""

from __future__ import annotations

import copy
import operator
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from backpack.custom_module.branching import ActiveIdentity, Parallel, SumModule
from backpack.custom_module.pad import Pad
from backpack.custom_module.permute import Permute
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing

_CUSTOM_LEAVES = (SumModule, ActiveIdentity, ScaleModule, Permute, Slicing, Pad, ReduceTuple)


class BackpackTracer(fx.Tracer):
    """A `torch.fx` tracer that keeps backpack's custom modules as leaves of the graph."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Custom modules and `torch.nn` layers are leaves; other containers are traced through."""
        if isinstance(m, _CUSTOM_LEAVES):
            return True
        if isinstance(m, Parallel):
            return False
        return super().is_leaf_module(m, module_qualified_name)


_ADDITIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_", "__add__", "__iadd__"}

#: functional activation -> module factory (args after the input are passed on)
_FUNCTIONAL_MODULES: dict[Any, Callable[..., nn.Module]] = {
    F.relu: lambda *a, **k: nn.ReLU(),
    torch.relu: lambda *a, **k: nn.ReLU(),
    torch.relu_: lambda *a, **k: nn.ReLU(),
    F.relu_: lambda *a, **k: nn.ReLU(),
    torch.sigmoid: lambda *a, **k: nn.Sigmoid(),
    F.sigmoid: lambda *a, **k: nn.Sigmoid(),
    torch.tanh: lambda *a, **k: nn.Tanh(),
    F.tanh: lambda *a, **k: nn.Tanh(),
    F.elu: lambda *a, alpha=1.0, **k: nn.ELU(alpha=alpha),
    F.selu: lambda *a, **k: nn.SELU(),
    F.logsigmoid: lambda *a, **k: nn.LogSigmoid(),
    F.silu: lambda *a, **k: nn.SiLU(),
    F.gelu: lambda *a, approximate="none", **k: nn.GELU(approximate=approximate),
    F.leaky_relu: lambda *a, negative_slope=0.01, **k: nn.LeakyReLU(negative_slope),
    F.softplus: lambda *a, beta=1.0, threshold=20.0, **k: nn.Softplus(beta, threshold),
    torch.flatten: lambda start_dim=0, end_dim=-1: nn.Flatten(start_dim, end_dim),
}
_METHOD_MODULES: dict[str, Callable[..., nn.Module]] = {
    "relu": lambda: nn.ReLU(),
    "relu_": lambda: nn.ReLU(),
    "sigmoid": lambda: nn.Sigmoid(),
    "tanh": lambda: nn.Tanh(),
    "flatten": lambda start_dim=0, end_dim=-1: nn.Flatten(start_dim, end_dim),
}


class ConversionError(RuntimeError):
    """The converter could not turn the model into a graph of modules."""


def _trace(module: nn.Module) -> fx.Graph:
    try:
        return BackpackTracer().trace(module)
    except Exception as err:  # noqa: BLE001 - every tracing failure gets the same advice
        frames = [
            f for f in traceback.extract_tb(err.__traceback__) if "torch/fx" not in f.filename
        ]
        where = (
            f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
        )
        raise ConversionError(
            f"backpack's converter cannot trace {module.__class__.__name__}{where}: {err}. "
            "torch.fx tracing needs a forward without data-dependent Python control flow. Make "
            "that branch independent of tensor values, move it into a leaf module, or use the "
            "model without use_converter=True (first-order extensions and the GGN family need no "
            "conversion)."
        ) from err


def _add_module(gm: fx.GraphModule, prefix: str, base: str, module: nn.Module) -> str:
    """Register `module` under a fresh name `{prefix}.{base}{k}` and return its target."""
    parent = gm.get_submodule(prefix) if prefix else gm
    k = 0
    while hasattr(parent, f"{base}{k}"):
        k += 1
    name = f"{base}{k}"
    parent.add_module(name, module)
    return f"{prefix}.{name}" if prefix else name


def _node_prefix(node: fx.Node) -> str:
    """Module path of the code that created `node` (where to put its replacement module)."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else ""
    return ""


def _is_tensor_node(arg: Any) -> bool:
    return isinstance(arg, fx.Node)


def convert_module_to_backpack(module: nn.Module, debug: bool = False) -> fx.GraphModule:
    """Turn `module` into a `torch.fx.GraphModule` in which every operation is a module.

    Args:
        module: The model to convert (e.g. a torchvision ResNet in eval mode).
        debug: Print every rewrite.

    Returns:
        The converted model; it computes the same function with the same parameters.

    Raises:
        ConversionError: If the model cannot be traced (data-dependent control flow).
    """
    graph = _trace(module)
    gm = fx.GraphModule(module, graph, class_name=f"{module.__class__.__name__}Backpack")
    calls: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        replacement: nn.Module | None = None
        inputs: tuple = ()
        base = ""
        if node.op == "call_function" and node.target in _ADDITIONS:
            if len(node.args) == 2 and all(map(_is_tensor_node, node.args)) and not node.kwargs:
                replacement, inputs, base = SumModule(), tuple(node.args), "sum_module"
        elif node.op == "call_method" and node.target in _ADD_METHODS:
            if len(node.args) == 2 and all(map(_is_tensor_node, node.args)) and not node.kwargs:
                replacement, inputs, base = SumModule(), tuple(node.args), "sum_module"
        elif node.op == "call_function" and node.target in _FUNCTIONAL_MODULES:
            factory = _FUNCTIONAL_MODULES[node.target]
            kwargs = {k: v for k, v in node.kwargs.items() if k != "inplace"}
            extra = tuple(a for a in node.args[1:] if not isinstance(a, bool))
            replacement = factory(*extra, **kwargs)
            inputs, base = (node.args[0],), type(replacement).__name__.lower()
        elif node.op == "call_method" and node.target in _METHOD_MODULES:
            replacement = _METHOD_MODULES[node.target](*node.args[1:], **node.kwargs)
            inputs, base = (node.args[0],), type(replacement).__name__.lower()
        elif node.op == "call_module":
            sub = gm.get_submodule(node.target)
            count = calls.get(node.target, 0)
            calls[node.target] = count + 1
            if getattr(sub, "inplace", False):
                sub = copy.copy(sub)
                sub.inplace = False
                _replace_module(gm, node.target, sub)
            continue
        if replacement is None:
            continue
        target = _add_module(gm, _node_prefix(node), base, replacement)
        if debug:
            print(f"[backpack converter] {node.format_node()} -> module {target}")
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(target, args=inputs)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    _duplicate_reused(gm, calls, debug)
    gm.graph.lint()
    gm.recompile()
    gm.delete_all_unused_submodules()
    return gm


def _replace_module(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    prefix, _, name = target.rpartition(".")
    parent = gm.get_submodule(prefix) if prefix else gm
    setattr(parent, name, module)


def _duplicate_reused(gm: fx.GraphModule, calls: dict[str, int], debug: bool) -> None:
    """Give each call of a reused parameter-free module its own copy (`relu` -> `relu0`, ...)."""
    seen: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or calls.get(node.target, 0) < 2:
            continue
        sub = gm.get_submodule(node.target)
        if next(sub.parameters(), None) is not None:
            continue  # parameters stay shared: the engine handles reused parametrized modules
        k = seen.get(node.target, 0)
        seen[node.target] = k + 1
        prefix, _, name = node.target.rpartition(".")
        parent = gm.get_submodule(prefix) if prefix else gm
        new_name = f"{name}{k}"
        parent.add_module(new_name, copy.deepcopy(sub))
        new_target = f"{prefix}.{new_name}" if prefix else new_name
        if debug:
            print(f"[backpack converter] call {k} of {node.target} -> {new_target}")
        node.target = new_target
