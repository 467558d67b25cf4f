"""Convert a model into a `torch.fx.GraphModule` made only of modules.

`convert_module_to_backpack` traces the model with `BackpackTracer` and rewrites every
operation it can into a module call, so that extensions which need the module graph (the exact
Hessian family, KFRA) see each step:

- `a + b`, `a += b`, `torch.add(a, b)` of two tensors -> `SumModule`;
- `a * b` of two tensors -> `MultiplyModule`; a tensor times a float -> `ScaleModule`;
- `torch.cat([a, b, ...], dim)` -> `CatModule(dim)`;
- functional activations (`F.relu`, `torch.sigmoid`, `F.hardswish`, `x.relu()`, ...), pooling
  (`F.max_pool2d`, `F.adaptive_avg_pool2d`, ...) and `F.pad` -> their modules;
- `torch.flatten`, `x.flatten(1)`, `x.view(x.size(0), -1)`, `x.reshape(x.shape[0], -1)` ->
  `nn.Flatten`;
- `x.permute(0, ...)`, `x.transpose(i, j)` (i, j != 0) -> `Permute`;
- `x[:, ...]` with constant slices -> `Slicing`; `rnn_output[k]` -> `ReduceTuple(k)`.

In-place operations (`inplace=True`, `relu_()`, `+=`) become out-of-place; later uses of the
overwritten tensor are redirected to the result, so the function is unchanged. A parameter-free
module called several times is duplicated, so that each call has its own module (`relu` ->
`relu0`, `relu1`). New modules are registered on the root (`sum_module0`, `flatten0`, ...);
parametrized modules stay where they are, so parameter names (and tied parameters) are kept.

What stays outside modules: operations the converter does not know (e.g. `x / 3`, `x - y`,
`torch.where`, `x.mean((2, 3))`) and shape queries that still feed one of them
(`x.size()`, `x.shape`, `getattr`/`getitem` on them). First-order extensions and the GGN family
handle those anyway (autograd carries the curvature through them); the exact-Hessian family
accepts them when they are linear and raises a clear error otherwise. Data-dependent Python
control flow cannot be traced and raises `ConversionError`.
"""

from __future__ import annotations

import copy
import operator
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from backpack.custom_module.branching import (
    ActiveIdentity,
    CatModule,
    MultiplyModule,
    Parallel,
    SumModule,
)
from backpack.custom_module.pad import Pad
from backpack.custom_module.permute import Permute
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing
from backpack.rules.activations import is_curvature_free, register_curvature_free

_CUSTOM_LEAVES = (
    SumModule,
    MultiplyModule,
    CatModule,
    ActiveIdentity,
    ScaleModule,
    Permute,
    Slicing,
    Pad,
    ReduceTuple,
)
#: modules of other libraries that stay leaves: (defining module, class name). torchvision's
#: StochasticDepth multiplies by a random mask in training mode and is the identity in eval
#: mode, both linear in the input.
_FOREIGN_LEAVES = {("torchvision.ops.stochastic_depth", "StochasticDepth")}

# CatModule is linear in its inputs: no second-derivative (residual) term for the exact Hessian.
if not is_curvature_free(CatModule()):
    register_curvature_free(CatModule)


def _is_foreign_leaf(module: nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__name__) in _FOREIGN_LEAVES


class BackpackTracer(fx.Tracer):
    """A `torch.fx` tracer that keeps backpack's custom modules as leaves of the graph.

    `torch.nn` layers and backpack's custom modules (`SumModule`, `ScaleModule`, ...) appear as
    `call_module` nodes; containers (`Sequential`, `Parallel`, your own modules) are traced
    through. `BackpackTracer().trace(model).print_tabular()` prints the graph (needs the
    `tabulate` package).
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Custom modules and `torch.nn` layers are leaves; other containers are traced through."""
        if isinstance(m, _CUSTOM_LEAVES) or _is_foreign_leaf(m):
            return True
        if isinstance(m, Parallel):
            return False
        return super().is_leaf_module(m, module_qualified_name)


class ConversionError(RuntimeError):
    """The converter could not turn the model into a graph of modules."""


def _offending_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code in the traceback of a tracing error."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if "/torch/fx/" not in f.filename.replace("\\", "/")
        and "/torch/nn/modules/module.py" not in f.filename.replace("\\", "/")
        and f.filename != __file__
    ]
    return frames[-1] if frames else None


def _trace(module: nn.Module) -> fx.Graph:
    try:
        return BackpackTracer().trace(module)
    except Exception as err:  # noqa: BLE001 - every tracing failure gets the same advice
        frame = _offending_frame(err)
        where = (
            f" at {frame.filename}:{frame.lineno}, in {frame.name}: `{frame.line}`"
            if frame is not None
            else ""
        )
        raise ConversionError(
            f"backpack's converter cannot trace {module.__class__.__name__}{where}. torch.fx "
            f"reported: {str(err).rstrip('.')}. The converter needs a forward without Python "
            "control flow that depends on tensor values (`if x.sum() > 0:`, loops over tensor "
            "values, `.item()`). Make that step independent of the values (e.g. `torch.where`), "
            "or use the model without use_converter=True: first-order extensions, the GGN "
            "family (DiagGGN*, SqrtGGN*, GGNMP) and KFAC/KFLR need no conversion; only "
            "DiagHessian, BatchDiagHessian, HMP, PCHMP and KFRA need every nonlinearity to be a "
            "module (KFRA also a chain of modules), which you can also write by hand."
        ) from err


# --- what each rewrite turns into a module ---------------------------------------------------
@dataclass
class _Rewrite:
    """A module that replaces a graph node, called with `inputs`."""

    module: nn.Module
    inputs: tuple[fx.Node, ...]
    base: str  # name stem of the new submodule
    inplace: bool = False  # the operation overwrote inputs[0]


def _is_node(arg: Any) -> bool:
    return isinstance(arg, fx.Node)


def _is_number(arg: Any) -> bool:
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def _has_node(arg: Any) -> bool:
    """Whether `arg` (possibly nested in tuples, lists, dicts, slices) contains a graph node."""
    if _is_node(arg):
        return True
    if isinstance(arg, (tuple, list)):
        return any(_has_node(a) for a in arg)
    if isinstance(arg, dict):
        return any(_has_node(a) for a in arg.values())
    if isinstance(arg, slice):
        return any(_has_node(a) for a in (arg.start, arg.stop, arg.step))
    return False


def _is_call(node: fx.Node, functions: set | tuple, methods: set | tuple) -> bool:
    return (node.op == "call_function" and node.target in functions) or (
        node.op == "call_method" and node.target in methods
    )


_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_", "__add__", "__radd__", "__iadd__"}
_MUL_FUNCTIONS = {operator.mul, operator.imul, torch.mul, torch.multiply}
_MUL_METHODS = {"mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__"}
_INPLACE_TARGETS = {operator.iadd, operator.imul, "add_", "__iadd__", "mul_", "__imul__"}


_SHAPE_METHODS = {"size", "dim", "numel"}
_SHAPE_ATTRIBUTES = {"shape", "ndim"}
_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.getitem}


def _is_shape_value(arg: Any) -> bool:
    """Whether `arg` is a node computing sizes (`x.size(1) * x.size(2)`), not tensor data."""
    if not _is_node(arg):
        return False
    if arg.op == "call_method":
        return arg.target in _SHAPE_METHODS
    if arg.op == "call_function" and arg.target is getattr:
        return arg.args[1] in _SHAPE_ATTRIBUTES
    if arg.op == "call_function" and arg.target in _ARITHMETIC:
        return any(_is_shape_value(a) for a in arg.args)
    return False


def _rewrite_add(node: fx.Node) -> _Rewrite | None:
    if not _is_call(node, _ADD_FUNCTIONS, _ADD_METHODS) or node.kwargs or len(node.args) != 2:
        return None
    if not all(map(_is_node, node.args)) or any(map(_is_shape_value, node.args)):
        return None  # adding a constant, or size arithmetic, stays functional
    return _Rewrite(SumModule(), tuple(node.args), "sum_module", node.target in _INPLACE_TARGETS)


def _produces_float(node: fx.Node) -> bool:
    """Whether `node` is known to give a floating tensor (so `* 2` may become `* 2.0`)."""
    return node.op == "call_module"


def _rewrite_mul(node: fx.Node) -> _Rewrite | None:
    if not _is_call(node, _MUL_FUNCTIONS, _MUL_METHODS) or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    inplace = node.target in _INPLACE_TARGETS
    if _is_shape_value(a) or _is_shape_value(b):
        return None
    if _is_node(a) and _is_node(b):
        return _Rewrite(MultiplyModule(), (a, b), "multiply_module", inplace)
    tensor, number = (a, b) if _is_node(a) else (b, a)
    if not _is_node(tensor) or not _is_number(number):
        return None
    # an int factor on an integer tensor must not turn it into floats
    if isinstance(number, int) and not _produces_float(tensor):
        return None
    return _Rewrite(ScaleModule(float(number)), (tensor,), "scale_module", inplace and a is tensor)


_CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}


def _rewrite_cat(node: fx.Node) -> _Rewrite | None:
    if node.op != "call_function" or node.target not in _CAT_FUNCTIONS or not node.args:
        return None
    tensors = node.args[0]
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(map(_is_node, tensors)):
        return None
    extra = dict(node.kwargs)
    if set(extra) - {"dim", "axis"}:
        return None  # e.g. out=...
    dim = node.args[1] if len(node.args) > 1 else extra.get("dim", extra.get("axis", 0))
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None
    return _Rewrite(CatModule(dim), tuple(tensors), "cat_module")


#: functional activation -> module factory (called with the arguments after the input, booleans
#: -- the `inplace` flags -- removed)
_FUNCTIONAL_MODULES: dict[Any, Callable[..., nn.Module]] = {
    F.relu: lambda: nn.ReLU(),
    torch.relu: lambda: nn.ReLU(),
    torch.relu_: lambda: nn.ReLU(),
    F.relu_: lambda: nn.ReLU(),
    F.relu6: lambda: nn.ReLU6(),
    torch.sigmoid: lambda: nn.Sigmoid(),
    F.sigmoid: lambda: nn.Sigmoid(),
    torch.tanh: lambda: nn.Tanh(),
    F.tanh: lambda: nn.Tanh(),
    F.elu: lambda alpha=1.0: nn.ELU(alpha=alpha),
    F.celu: lambda alpha=1.0: nn.CELU(alpha=alpha),
    F.selu: lambda: nn.SELU(),
    torch.selu: lambda: nn.SELU(),
    F.logsigmoid: lambda: nn.LogSigmoid(),
    F.silu: lambda: nn.SiLU(),
    F.mish: lambda: nn.Mish(),
    F.gelu: lambda approximate="none": nn.GELU(approximate=approximate),
    F.leaky_relu: lambda negative_slope=0.01: nn.LeakyReLU(negative_slope),
    F.softplus: lambda beta=1.0, threshold=20.0: nn.Softplus(beta, threshold),
    F.softsign: lambda: nn.Softsign(),
    F.hardtanh: lambda min_val=-1.0, max_val=1.0: nn.Hardtanh(min_val, max_val),
    F.hardswish: lambda: nn.Hardswish(),
    F.hardsigmoid: lambda: nn.Hardsigmoid(),
    F.threshold: lambda threshold, value: nn.Threshold(threshold, value),
    torch.flatten: lambda start_dim=0, end_dim=-1: nn.Flatten(start_dim, end_dim),
}
_INPLACE_FUNCTIONS = {torch.relu_, F.relu_}
_METHOD_MODULES: dict[str, Callable[..., nn.Module]] = {
    "relu": lambda: nn.ReLU(),
    "relu_": lambda: nn.ReLU(),
    "sigmoid": lambda: nn.Sigmoid(),
    "sigmoid_": lambda: nn.Sigmoid(),
    "tanh": lambda: nn.Tanh(),
    "tanh_": lambda: nn.Tanh(),
    "flatten": lambda start_dim=0, end_dim=-1: nn.Flatten(start_dim, end_dim),
}


def _module_base(module: nn.Module) -> str:
    return type(module).__name__.lower()


def _rewrite_activation(node: fx.Node) -> _Rewrite | None:
    if not node.args or not _is_node(node.args[0]) or _has_node(node.args[1:]):
        return None
    if node.op == "call_function" and node.target in _FUNCTIONAL_MODULES:
        factory = _FUNCTIONAL_MODULES[node.target]
        inplace = node.target in _INPLACE_FUNCTIONS or bool(node.kwargs.get("inplace", False))
        inplace = inplace or any(a is True for a in node.args[1:])
        kwargs = {k: v for k, v in node.kwargs.items() if k != "inplace"}
        extra = tuple(a for a in node.args[1:] if not isinstance(a, bool))
    elif node.op == "call_method" and node.target in _METHOD_MODULES:
        factory = _METHOD_MODULES[node.target]
        inplace = node.target.endswith("_")
        kwargs, extra = dict(node.kwargs), tuple(node.args[1:])
    else:
        return None
    try:
        module = factory(*extra, **kwargs)
    except TypeError:
        return None  # an argument the module does not take: leave the call as it is
    return _Rewrite(module, (node.args[0],), _module_base(module), inplace)


#: functional pooling -> (module class, names of the arguments after the input, in order)
_POOL_ARGS_MAX = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_POOL_ARGS_AVG1 = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
_POOL_ARGS_AVG = (*_POOL_ARGS_AVG1, "divisor_override")
_POOLING: dict[Any, tuple[type[nn.Module], tuple[str, ...]]] = {
    F.max_pool1d: (nn.MaxPool1d, _POOL_ARGS_MAX),
    F.max_pool2d: (nn.MaxPool2d, _POOL_ARGS_MAX),
    F.max_pool3d: (nn.MaxPool3d, _POOL_ARGS_MAX),
    F.avg_pool1d: (nn.AvgPool1d, _POOL_ARGS_AVG1),
    F.avg_pool2d: (nn.AvgPool2d, _POOL_ARGS_AVG),
    F.avg_pool3d: (nn.AvgPool3d, _POOL_ARGS_AVG),
    F.adaptive_avg_pool1d: (nn.AdaptiveAvgPool1d, ("output_size",)),
    F.adaptive_avg_pool2d: (nn.AdaptiveAvgPool2d, ("output_size",)),
    F.adaptive_avg_pool3d: (nn.AdaptiveAvgPool3d, ("output_size",)),
    F.adaptive_max_pool1d: (nn.AdaptiveMaxPool1d, ("output_size", "return_indices")),
    F.adaptive_max_pool2d: (nn.AdaptiveMaxPool2d, ("output_size", "return_indices")),
    F.adaptive_max_pool3d: (nn.AdaptiveMaxPool3d, ("output_size", "return_indices")),
}


def _rewrite_pooling(node: fx.Node) -> _Rewrite | None:
    if node.op != "call_function" or node.target not in _POOLING:
        return None
    if not node.args or not _is_node(node.args[0]) or _has_node((node.args[1:], node.kwargs)):
        return None
    cls, names = _POOLING[node.target]
    if len(node.args) - 1 > len(names):
        return None
    kwargs = dict(zip(names, node.args[1:]))
    kwargs.update(node.kwargs)
    if set(kwargs) - set(names) or kwargs.get("return_indices", False):
        return None  # pooling indices are a second output no module call replaces here
    module = cls(**kwargs)
    return _Rewrite(module, (node.args[0],), _module_base(module))


def _rewrite_pad(node: fx.Node) -> _Rewrite | None:
    if node.op != "call_function" or node.target is not F.pad or len(node.args) < 2:
        return None
    if not _is_node(node.args[0]) or _has_node((node.args[1:], node.kwargs)):
        return None
    kwargs = dict(zip(("pad", "mode", "value"), node.args[1:]))
    kwargs.update(node.kwargs)
    if set(kwargs) - {"pad", "mode", "value"}:
        return None
    try:
        module = Pad(kwargs["pad"], kwargs.get("mode", "constant"), kwargs.get("value"))
    except ValueError:
        return None
    return _Rewrite(module, (node.args[0],), "pad")


def _int_args(args: tuple) -> tuple[int, ...] | None:
    """`(0, 2, 1)` from `(0, 2, 1)` or `((0, 2, 1),)`; None unless all are constant ints."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    if all(isinstance(a, int) and not isinstance(a, bool) for a in args):
        return tuple(args)
    return None


def _rewrite_permute(node: fx.Node) -> _Rewrite | None:
    if node.kwargs or not node.args or not _is_node(node.args[0]):
        return None
    if _is_call(node, {torch.permute}, {"permute"}):
        dims = _int_args(node.args[1:])
        if not dims or dims[0] != 0:
            return None
        try:
            module = Permute(*dims)
        except ValueError:
            return None
    elif _is_call(node, {torch.transpose}, {"transpose"}):
        dims = _int_args(node.args[1:])
        if dims is None or len(dims) != 2 or 0 in dims:
            return None
        module = Permute(*dims, init_transpose=True)
    else:
        return None
    return _Rewrite(module, (node.args[0],), "permute")


def _rewrite_getitem(node: fx.Node) -> _Rewrite | None:
    if node.op != "call_function" or node.target is not operator.getitem or node.kwargs:
        return None
    source, index = node.args
    if not _is_node(source) or _has_node(index):
        return None
    if source.op == "call_module" and isinstance(index, int) and not isinstance(index, bool):
        module = node.graph.owning_module.get_submodule(source.target)
        if isinstance(module, nn.RNNBase):  # (output, h_n) or (output, (h_n, c_n))
            return _Rewrite(ReduceTuple(index), (source,), "reduce_tuple")
        return None
    if isinstance(index, tuple) and index and index[0] == slice(None):
        if source.op == "call_module" and isinstance(
            node.graph.owning_module.get_submodule(source.target), nn.RNNBase
        ):
            return None
        return _Rewrite(Slicing(index), (source,), "slicing")
    return None


def _is_batch_size_of(arg: Any, tensor: fx.Node) -> bool:
    """Whether `arg` is `tensor.size(0)`, `tensor.size()[0]` or `tensor.shape[0]`."""
    if not _is_node(arg):
        return False
    if arg.op == "call_method" and arg.target == "size":
        dims = tuple(arg.args[1:]) + tuple(arg.kwargs.values())
        return arg.args[0] is tensor and dims == (0,)
    if arg.op == "call_function" and arg.target is operator.getitem and arg.args[1] == 0:
        shape = arg.args[0]
        if not _is_node(shape):
            return False
        if shape.op == "call_method" and shape.target == "size":
            return shape.args == (tensor,) and not shape.kwargs
        return (
            shape.op == "call_function"
            and shape.target is getattr
            and (shape.args == (tensor, "shape"))
        )
    return False


def _rewrite_view(node: fx.Node) -> _Rewrite | None:
    """`x.view(x.size(0), -1)` and friends: the flattening of all but the batch axis."""
    if node.kwargs or not _is_call(node, {torch.reshape}, {"view", "reshape"}):
        return None
    tensor, *shape = node.args
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = list(shape[0])
    if not _is_node(tensor) or len(shape) != 2 or shape[1] != -1:
        return None
    if not _is_batch_size_of(shape[0], tensor):
        return None
    return _Rewrite(nn.Flatten(), (tensor,), "flatten")


_REWRITES = (
    _rewrite_add,
    _rewrite_mul,
    _rewrite_cat,
    _rewrite_activation,
    _rewrite_pooling,
    _rewrite_pad,
    _rewrite_permute,
    _rewrite_getitem,
    _rewrite_view,
)


# --- the conversion ---------------------------------------------------------------------------
def convert_module_to_backpack(module: nn.Module, debug: bool = False) -> fx.GraphModule:
    """Turn `module` into a `torch.fx.GraphModule` in which every operation is a module.

    See the module docstring for the rewrites. The result computes the same function with the
    same parameter objects under the same names; it shares the parametrized submodules with
    `module`.

    Args:
        module: The model to convert (e.g. a torchvision ResNet in eval mode).
        debug: Print every rewrite.

    Returns:
        The converted model.

    Raises:
        ConversionError: If the model cannot be traced (data-dependent control flow); the
            message names the offending line.
    """
    graph = _trace(module)
    gm = fx.GraphModule(module, graph, class_name=f"{module.__class__.__name__}Backpack")
    gm.training = module.training
    _remove_dead_shape_queries(gm)  # e.g. the unused `_` of `out, _ = self.lstm(x)`
    calls: dict[str, int] = {}
    inplace_targets: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            _make_module_call_out_of_place(gm, node, calls, inplace_targets, debug)
            sub = gm.get_submodule(node.target)
            if _is_foreign_leaf(sub) and not is_curvature_free(sub):
                register_curvature_free(type(sub))  # linear in its input (see _FOREIGN_LEAVES)
            continue
        rewrite = next((r for r in map(lambda f: f(node), _REWRITES) if r is not None), None)
        if rewrite is None:
            continue
        target = _add_module(gm, rewrite.base, rewrite.module)
        if debug:
            print(f"[backpack converter] {node.format_node()} -> module {target}")
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(target, args=rewrite.inputs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        if rewrite.inplace:
            _redirect_later_uses(rewrite.inputs[0], new)
    _duplicate_reused(gm, calls, debug)
    _remove_dead_shape_queries(gm)
    gm.graph.lint()
    gm.recompile()
    gm.delete_all_unused_submodules()
    _restore_order(gm, module)
    return gm


def _restore_order(new: nn.Module, old: nn.Module) -> None:
    """Order submodules, parameters and buffers like in `old` (new ones last).

    `torch.fx` registers the submodules of the converted model in the order the forward uses
    them; restoring the original order keeps `model.parameters()` in the original order too.
    """
    for attr in ("_modules", "_parameters", "_buffers"):
        entries, reference = getattr(new, attr), list(getattr(old, attr))
        rank = {name: i for i, name in enumerate(reference)}
        ordered = sorted(entries.items(), key=lambda item: rank.get(item[0], len(rank)))
        entries.clear()
        entries.update(ordered)
    for name, child in new.named_children():
        old_child = old._modules.get(name)
        if old_child is not None and child is not old_child:
            _restore_order(child, old_child)


def _make_module_call_out_of_place(
    gm: fx.GraphModule,
    node: fx.Node,
    calls: dict[str, int],
    inplace_targets: set[str],
    debug: bool,
) -> None:
    """Count the call; replace an in-place module (`ReLU(inplace=True)`) by an out-of-place copy."""
    calls[node.target] = calls.get(node.target, 0) + 1
    sub = gm.get_submodule(node.target)
    if getattr(sub, "inplace", False) is True:
        sub = copy.copy(sub)
        sub.inplace = False
        _replace_module(gm, node.target, sub)
        inplace_targets.add(node.target)
        if debug:
            print(f"[backpack converter] {node.target}: inplace=True -> inplace=False")
    if node.target in inplace_targets and node.args and _is_node(node.args[0]):
        _redirect_later_uses(node.args[0], node)


def _redirect_later_uses(overwritten: fx.Node, result: fx.Node) -> None:
    """After an in-place op, the overwritten tensor *is* its result: rewire later readers."""
    later = result.next
    while later.op != "root":
        if later is not result and overwritten in later.all_input_nodes:
            later.replace_input_with(overwritten, result)
        later = later.next


def _add_module(gm: fx.GraphModule, base: str, module: nn.Module) -> str:
    """Register `module` on the root under a fresh name `{base}{k}` and return that name."""
    k = 0
    while hasattr(gm, f"{base}{k}"):
        k += 1
    gm.add_module(f"{base}{k}", module)
    return f"{base}{k}"


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
        while hasattr(parent, f"{name}{k}"):
            k += 1
        parent.add_module(f"{name}{k}", copy.deepcopy(sub))
        new_target = f"{prefix}.{name}{k}" if prefix else f"{name}{k}"
        if debug:
            print(f"[backpack converter] call {k} of {node.target} -> {new_target}")
        node.target = new_target


def _remove_dead_shape_queries(gm: fx.GraphModule) -> None:
    """Drop `x.size()`, `x.shape`, `[...]` nodes left without readers by the rewrites."""
    for node in reversed(list(gm.graph.nodes)):
        if node.users:
            continue
        query = (node.op == "call_method" and node.target in ("size", "dim")) or (
            node.op == "call_function" and node.target in (getattr, operator.getitem)
        )
        if query:
            gm.graph.erase_node(node)
