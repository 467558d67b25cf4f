"""Recording: `extend` marks modules; their forwards leave a `Record` for the next backward.

A record holds a module call's inputs and detached aliases of its outputs (no extra memory)
and is owned by the autograd graph of that forward: the gradient hook registered on the outputs
keeps it alive, so it is freed together with the graph and never outlives it. A backward that
passes the call for good (one without backpack that does not retain the graph) drops the
record's tensors at once, as autograd drops its saved tensors. The module only keeps weak
references, which the engine uses to count how often a module was used in a live graph.
"""

from __future__ import annotations

import importlib
import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from backpack.context import CTX

#: id(module) -> weak references to its records (uses in graphs that may still exist); entries
#: die with their module. Each registry of records here is a set of weak references whose
#: callback is the set's `discard`: a record leaves when it dies, and adding or leaving is one
#: C call without lock (a WeakSet costs Python calls; a list needs pruning under a lock).
_LIVE_RECORDS: dict[int, set[weakref.ref[Record]]] = {}
#: id(parameter) -> weak set of the modules that use it directly (tied weights have several).
#: Keyed by id because tensors compare elementwise; entries die with their parameter.
_PARAM_OWNERS: dict[int, weakref.WeakSet[nn.Module]] = {}

#: key of the records a node's `metadata` holds (the module calls that node produced)
_META_KEY = "backpack_records"
#: guards new entries of the registries above against concurrent forwards in several threads
_LOCK = threading.RLock()
#: creation order of records (losses of one backward are ordered by it)
_ORDER = itertools.count()
#: called for every record (module-level names are a lookup cheaper)
_get_ident = threading.get_ident
_graph_task_id = torch._C._current_graph_task_id
#: module classes whose calls are loss calls (the loss rules register theirs)
LOSS_CLASSES: set[type] = {nn.modules.loss._Loss}
#: records of loss calls whose graphs may still exist (weak references, see `_LIVE_RECORDS`)
_LOSS_RECORDS: set[weakref.ref[Record]] = set()
#: records of parametrized calls whose output may hold no sample axis (see `sample_free`)
_SAMPLE_FREE: set[weakref.ref[Record]] = set()
#: records of modules that own parameters and have child modules (a vision transformer's class
#: token and position embedding belong to the model itself)
_CONTAINERS: set[weakref.ref[Record]] = set()


#: module classes whose rules and the engine read only the shape, dtype and device of the
#: output: their records keep a one-element NaN stand-in (`_shape_only`), not the values. The
#: output of a Conv or Linear layer is the pre-activation of the next layer, which autograd
#: does not save; holding it for the whole forward and backward (as the original's hooks do)
#: made CPU steps 10-25% slower (the allocator then hands out fresh memory). User extensions
#: that read `module.output` get it recomputed (`Record.output_values`).
SHAPE_ONLY_OUTPUTS: set[type] = set()
#: activations f with f(f(x)) = f(x) and the same derivative at f(x) as at x (ReLU, clamps):
#: their records keep the output, which autograd saves anyway, in place of the input
IDEMPOTENT_ACTIVATIONS: set[type] = set()


#: module classes that return their input object itself (`nn.Identity`; dropout layers do in
#: eval mode): their records never keep its values (see `_forget_identity_values`)
PASS_THROUGH: set[type] = {
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
}


#: outputs smaller than this are kept as they are (holding them costs nothing measurable, and
#: a stand-in costs as much as a view)
SHAPE_ONLY_MIN_ELEMENTS = 2**16
#: (shape, dtype, device) -> stand-in: every step of a training loop has the same shapes, and
#: building the view (a dispatched op) cost about 10 us per call right after a large layer
_STAND_INS: dict[tuple[Any, ...], Tensor] = {}


def _shape_only(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A tensor with `t`'s shape, dtype and device holding one NaN (any value read shows).

    Stand-ins are shared between records (they are read-only: expanded views cannot be written
    in place).
    """
    key = (t.shape, dtype or t.dtype, t.device)
    stand_in = _STAND_INS.get(key)
    if stand_in is None:
        if len(_STAND_INS) >= 1024:
            _STAND_INS.clear()
        nan = torch.full((), math.nan, dtype=key[1], device=key[2])
        stand_in = _STAND_INS[key] = nan.expand(t.shape)
    return stand_in


#: class -> is it a loss class (cleared when a loss class is added)
_IS_LOSS_CLASS: dict[type, bool] = {}


def is_loss_module(module: nn.Module) -> bool:
    """Whether calls of `module` are loss calls (they define the samples of a backward)."""
    cls = type(module)
    known = _IS_LOSS_CLASS.get(cls)
    if known is None or len(_IS_LOSS_CLASS) > 4096:
        known = _IS_LOSS_CLASS[cls] = issubclass(cls, tuple(LOSS_CLASSES))
    return known


def describe(module: nn.Module) -> str:
    """How messages name a module: its path in the extended model and its class."""
    path = module.__dict__.get("_backpack_path")
    name = module.__class__.__name__
    return f"'{path}' ({name})" if path else name


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
        "_input_edges",
        "inplace",
        "identity",
        "thread",
        "order",
        "recomputed",
        "origin",
        "_half_checked",
        "shape_only",
        "input_producer",
        "rng",
        "out_versions",
        "params",
        "holders",
        "free_pending",
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
        versions = tuple([a._version if isinstance(a, Tensor) else None for a in args])
        self._setup(
            module,
            args,
            kwargs,
            outputs,
            output_structure,
            disabled,
            versions,
            (),
            False,
            False,
            None,
            (),
            tuple([o._version for o in outputs]),
        )

    def _setup(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs: tuple[Tensor, ...],
        output_structure: Any,
        disabled: bool,
        versions: tuple[int | None, ...],
        input_edges: tuple[Any, ...] | list[Any],
        inplace: bool,
        shape_only: bool,
        input_producer: Record | None,
        out_requires_grad: tuple[bool, ...],
        out_versions: tuple[int, ...],
    ) -> None:
        # Every slot is set here. The forward hook calls this on `Record.__new__(Record)` with
        # what it already knows: calling the class (with keywords) cost as much as all of this.
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs
        self.output_structure = output_structure
        #: versions of the tensor inputs at the call (None for other inputs)
        self.versions = versions
        #: versions of the recorded outputs at the call (`outputs_modified`)
        self.out_versions = out_versions
        self.training = module.training
        #: for each tensor of the output structure (depth first): does it require grad?
        self.out_requires_grad = out_requires_grad
        self.disabled = disabled
        self.freed = False
        #: per-backward scratch space of the engine (second-order factors, ...)
        self.extra: dict[str, Any] = {}
        #: autograd edges of the tensor inputs (None where an input needs no grad or aliases
        #: an output, which would make the graph own a reference to itself); a list: what
        #: the forward noted, made edges on first read (`input_edges`)
        self._input_edges = input_edges
        self.inplace = inplace
        #: the call returned its input unchanged (Identity, Dropout in eval mode): graph walks
        #: look through it
        self.identity = False
        #: the thread that ran the forward (CUDA backward hooks run on other threads)
        self.thread = _get_ident()
        self.order = next(_ORDER)
        #: the forward ran inside a backward pass (a reentrant checkpoint's recomputation)
        self.recomputed = _graph_task_id() != -1
        #: for a view of another record (rules see a reshaped call): that record
        self.origin: Record | None = None
        self._half_checked = False
        #: the outputs are `_shape_only` stand-ins (see `SHAPE_ONLY_OUTPUTS`)
        self.shape_only = shape_only
        #: for an idempotent activation keeping its output as input: the shape-only record
        #: whose output the true input was (`input_values` recomputes it from there)
        self.input_producer = input_producer
        #: for calls that draw random numbers (`RANDOM_CALLS`): the generator before the call
        self.rng: GeneratorState | None = None
        #: the call's trainable parameters, once asked for in the backward (`call_params`)
        self.params: dict[str, Tensor] | None = None
        #: identity calls that pass this call's output on and read it from here
        #: (`_forget_identity_values`): `free` waits for them
        self.holders = 0
        self.free_pending = False

    @property
    def input0(self) -> Tensor:
        """The first positional input of the call."""
        return self.args[0]

    @property
    def output(self) -> Any:
        """The call's output (a tensor, or the module's tuple structure of tensors)."""
        return self.output_structure

    def input_values(self) -> Any:
        """The first positional input with its true values (what `module.input0` shows)."""
        producer = self.input_producer
        if producer is not None and not self.freed:
            if producer.freed:
                raise RuntimeError(
                    f"The input of {describe(self.module)} was the output of "
                    f"{describe(producer.module)}, whose record is already freed, so it cannot "
                    "be recomputed. Read module.input0 before the backward pass moves past "
                    "that module."
                )
            return producer.output_values()
        if producer is None and self.identity and self.shape_only and not self.freed:
            raise RuntimeError(
                f"The values that {describe(self.module)} passed through are not kept (the "
                "call returns its input unchanged). Read them from the module that produced "
                "them, or wrap the identity in a module of your own."
            )
        return self.args[0] if self.args else None

    def output_values(self) -> Any:
        """The output with its values.

        Recomputed from the inputs for shape-only records, and where an in-place operation after
        the call changed them.
        """
        if self.identity and self.input_producer is not None:
            return self.input_values()  # an identity's output is its input
        if self.freed or not (self.shape_only or self.outputs_modified()):
            return self.output_structure
        with torch.no_grad(), CTX.internal():
            return self.module(*self.args, **self.kwargs)

    @property
    def input_edges(self) -> tuple[Any, ...]:
        """Autograd edges of the tensor inputs (None where no gradient flows or in place)."""
        edges = self._input_edges
        if type(edges) is list:
            # as the forward left them (see `_as_edge`): made edges on first use
            edges = self._input_edges = tuple([_as_edge(e) for e in edges])
        return edges

    @input_edges.setter
    def input_edges(self, edges: tuple[Any, ...]) -> None:
        self._input_edges = list(edges)

    def free(self) -> None:
        """Drop the recorded tensors (memory is returned as soon as autograd is done too).

        A record that identity calls read their values from is freed after the last of them.
        """
        if self.holders:
            self.free_pending = True
            return
        if self.identity and self.input_producer is not None and not self.freed:
            producer = self.input_producer
            producer.holders -= 1
            if not producer.holders and producer.free_pending:
                producer.free()
        self.input_producer = None
        self.args = ()
        self.kwargs = {}
        self.outputs = ()
        self.output_structure = None
        self.extra = {}
        self._input_edges = ()
        self.rng = None
        self.freed = True

    def modified(self) -> bool:
        """Whether an input was modified in place after the module's forward."""
        return any(
            isinstance(arg, Tensor) and version is not None and arg._version != version
            for arg, version in zip(self.args, self.versions)
        )

    def outputs_modified(self) -> bool:
        """Whether an output was modified in place after the call (`nn.ReLU(inplace=True)`).

        The recorded outputs then hold the modified values; rules reading them must recompute.
        """
        return any(o._version != v for o, v in zip(self.outputs, self.out_versions))

    def promote_half(self) -> bool:
        """Use float32 copies of 16-bit floating tensors (mixed precision); True if any.

        Rules then compute and accumulate in float32. Whether an input was modified in place
        is decided first (the copies have versions of their own).
        """
        if self._half_checked:
            return False
        self._half_checked = True
        if not any(_is_half(t) for t in (*self.args, *self.outputs)):
            return False
        stale = self.modified()
        outputs_stale = self.outputs_modified()
        self.args = tuple(promote_half(a) for a in self.args)
        self.kwargs = {k: promote_half(v) for k, v in self.kwargs.items()}
        if self.shape_only:
            self.outputs = tuple(_shape_only(o, torch.float32) for o in self.outputs)
            self.output_structure = self.outputs[0]
        else:
            self.outputs = tuple(promote_half(o) for o in self.outputs)
            self.output_structure = promote_half(self.output_structure)
        # a stale input keeps failing `check_unmodified` (no version equals -1)
        self.versions = tuple(
            (-1 if stale else a._version) if isinstance(a, Tensor) else None for a in self.args
        )
        self.out_versions = tuple(-1 if outputs_stale else o._version for o in self.outputs)
        return True

    def copy(self, **changes: Any) -> Record:
        """A new record with the same references, except those in `changes` (slot names)."""
        copy = Record.__new__(Record)
        for slot in Record.__slots__:
            if slot != "__weakref__":
                setattr(copy, slot, changes[slot] if slot in changes else getattr(self, slot))
        return copy

    def view(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs: tuple[Tensor, ...],
        output_structure: Any,
        extra: dict[str, Any],
    ) -> Record:
        """The same call seen through other tensors (a moved or broadcast sample axis).

        Views share their bases' version counters: the original versions still apply.
        """
        stale = self.outputs_modified()
        return self.copy(
            args=args,
            kwargs=kwargs,
            outputs=outputs,
            output_structure=output_structure,
            extra=extra,
            origin=self.origin or self,
            out_versions=tuple(-1 if stale else o._version for o in outputs),
        )

    def check_unmodified(self, extension_name: str) -> None:
        """Raise if an input was modified in place after the module's forward."""
        for arg, version in zip(self.args, self.versions):
            if isinstance(arg, Tensor) and version is not None and arg._version != version:
                raise RuntimeError(
                    f"The input of {describe(self.module)} was modified "
                    f"in place after its forward, so {extension_name} cannot use it. Make the "
                    "in-place operation that follows this module out-of-place (e.g. "
                    "inplace=False, `x = x + y` instead of `x += y`)."
                )


_new_record = Record.__new__


def _as_edge(entry: Any) -> Any:
    """The autograd edge of what a forward noted for an input (None stays None).

    A `GradientEdge`; a leaf tensor (its edge, the grad accumulator, is built on first use: it
    cannot move); or a plain `(node, output_nr)` tuple (a `GradientEdge` costs a Python call
    on every forward).
    """
    if isinstance(entry, Tensor):
        return get_gradient_edge(entry)
    if type(entry) is tuple:
        return GradientEdge(*entry)
    return entry


_HALF = (torch.float16, torch.bfloat16)


def _is_half(obj: Any) -> bool:
    return isinstance(obj, Tensor) and obj.dtype in _HALF


def map_tensors(obj: Any, fn: Callable[[Tensor], Any]) -> Any:
    """`obj` with `fn` applied to every tensor in it (nested tuples, named tuples and lists)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(o, fn) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    return obj


def promote_half(obj: Any) -> Any:
    """`obj` with 16-bit floating tensors (also inside tuples and lists) as float32."""
    return map_tensors(obj, lambda t: t.float() if t.dtype in _HALF else t)


def _live_refs(module: nn.Module) -> set[weakref.ref[Record]]:
    """`module`'s entry of `_LIVE_RECORDS` (created on its first call)."""
    key = id(module)
    refs = _LIVE_RECORDS.get(key)
    if refs is None:
        with _LOCK:
            refs = _LIVE_RECORDS.get(key)
            if refs is None:
                refs = _LIVE_RECORDS[key] = set()
                weakref.finalize(module, _LIVE_RECORDS.pop, key, None)
    return refs


def _alive(refs: set[weakref.ref[Record]]) -> list[Record]:
    """The records of a registry that are still alive, in creation order."""
    # a copy first: records die (and leave the set) at any time, also in other threads
    found = [r() for r in tuple(refs)]
    return sorted([r for r in found if r is not None], key=_creation_order)


def _creation_order(record: Record) -> int:
    return record.order


def _remember(module: nn.Module, record: Record) -> None:
    refs = _LIVE_RECORDS.get(id(module))
    if refs is None:
        refs = _live_refs(module)
    refs.add(weakref.ref(record, refs.discard))
    if record.disabled:
        return
    if is_loss_module(module):
        _LOSS_RECORDS.add(weakref.ref(record, _LOSS_RECORDS.discard))
    elif module._parameters and sample_free(record.args):
        _SAMPLE_FREE.add(weakref.ref(record, _SAMPLE_FREE.discard))
    if module._parameters and module._modules and not is_loss_module(module):
        _CONTAINERS.add(weakref.ref(record, _CONTAINERS.discard))


def sample_free(args: tuple) -> bool:
    """Whether a call on `args` may produce an output without a sample axis.

    Such calls take no input that depends on the parameters, and index tensors (a position
    embedding of `torch.arange(T)`) or inputs with a leading axis of size 1 (positional
    features `[1, T, D]`). Calls on float data batches, the usual first layers, do not count.
    """
    first = None
    for a in args:
        if isinstance(a, Tensor):
            if a.requires_grad:
                return False
            if first is None:
                first = a
    if first is None:
        return False
    return not first.dtype.is_floating_point or first.dim() == 0 or first.shape[0] == 1


def container_records() -> list[Record]:
    """Live records of modules that own parameters and have child modules."""
    return [r for r in _alive(_CONTAINERS) if not r.freed] if _CONTAINERS else []


def has_sample_free_records() -> bool:
    """Whether calls that may produce outputs without a sample axis have live records."""
    return bool(_SAMPLE_FREE) and any(not r.freed for r in _alive(_SAMPLE_FREE))


def live_loss_records() -> list[Record]:
    """Records of loss calls whose graphs may still be run backward, in creation order."""
    return [r for r in _alive(_LOSS_RECORDS) if not r.freed]


def _records(module: nn.Module) -> list[Record]:
    refs = _LIVE_RECORDS.get(id(module))
    return _alive(refs) if refs else []


def live_records(module: nn.Module) -> list[Record]:
    """The records of `module` whose graphs are alive and whose tensors were not freed."""
    return [r for r in _records(module) if not r.freed]


def live_record_count(module: nn.Module) -> int:
    """`len(live_records(module))`, without ordering the records (asked for every call)."""
    refs = _LIVE_RECORDS.get(id(module))
    if not refs:
        return 0
    count = 0
    for ref in tuple(refs):
        record = ref()
        if record is not None and not record.freed:
            count += 1
    return count


def param_owners(param: Tensor) -> list[nn.Module]:
    """Modules that used `param` directly in a recorded forward."""
    owners = _PARAM_OWNERS.get(id(param))
    return list(owners) if owners is not None else []


#: module classes whose rule also covers their submodules' parameters (their forward uses
#: them functionally, e.g. `MultiheadAttention`'s `out_proj`); rules register them
OWNS_CHILD_PARAMETERS: set[type] = set()


def _has_parametrizations(module: nn.Module) -> bool:
    """Whether `torch.nn.utils.parametrize` computes tensors of `module` (`parametrizations`)."""
    modules = module.__dict__.get("_modules")
    return modules is not None and isinstance(modules.get("parametrizations"), nn.ModuleDict)


#: the hook classes of the older `nn.utils.weight_norm` and `spectral_norm` (the functions of
#: those names shadow their modules as attributes of `torch.nn.utils`)
_REPARAMETRIZATION_HOOKS = tuple(
    getattr(importlib.import_module(f"torch.nn.utils.{name}"), cls, ())
    for name, cls in (("weight_norm", "WeightNorm"), ("spectral_norm", "SpectralNorm"))
)


def reparametrization_hooks(module: nn.Module) -> list[Any]:
    """The forward pre-hooks of the older `torch.nn.utils.weight_norm` and `spectral_norm`.

    Each recomputes a tensor attribute (`module.weight`) from parameters of the module
    (`weight_g` and `weight_v`, `weight_orig`) before every forward.
    """
    hooks = module.__dict__.get("_forward_pre_hooks")
    if not hooks:
        return []
    return [h for h in hooks.values() if isinstance(h, _REPARAMETRIZATION_HOOKS)]


def is_parametrized(module: nn.Module) -> bool:
    """Whether tensors that `module`'s forward reads are computed from its parameters.

    By `torch.nn.utils.parametrize` (`module.weight` comes from `parametrizations.weight`, whose
    `original` parameters require grad) or by the older `weight_norm`/`spectral_norm` hooks.
    A layer's rule would give gradients w.r.t. the computed tensor, not the parameters.
    """
    return _has_parametrizations(module) or bool(reparametrization_hooks(module))


#: class -> does it own its children's parameters (subclasses too: a MultiheadAttention
#: subclass still uses out_proj functionally); cached per class, as it is asked on every call,
#: and started over when a rule registers a class (`OWNS_CHILD_PARAMETERS` only grows)
_OWNS_CHILDREN: dict[type, bool] = {}
_OWNS_CHILDREN_SIZE = [0]


def _owned_parameters(module: nn.Module) -> dict[str, Any]:
    cls = type(module)
    owns = _OWNS_CHILDREN.get(cls)
    if owns is None or _OWNS_CHILDREN_SIZE[0] != len(OWNS_CHILD_PARAMETERS):
        if _OWNS_CHILDREN_SIZE[0] != len(OWNS_CHILD_PARAMETERS) or len(_OWNS_CHILDREN) > 4096:
            _OWNS_CHILDREN.clear()
            _OWNS_CHILDREN_SIZE[0] = len(OWNS_CHILD_PARAMETERS)
        owns = _OWNS_CHILDREN[cls] = issubclass(cls, tuple(OWNS_CHILD_PARAMETERS))
    if owns:
        return dict(module.named_parameters())
    if _has_parametrizations(module):
        # the originals (and any parameters of the parametrizations themselves) are used
        # through this call: a plain tensor attribute read inside its forward
        return {
            **module._parameters,
            **dict(module.parametrizations.named_parameters(prefix="parametrizations")),
        }
    return module._parameters


def trainable_params(module: nn.Module) -> dict[str, Tensor]:
    """The parameters a call of `module` uses directly and that require grad, by name.

    Its own parameters, each once; for modules whose rule covers their submodules'
    parameters too, those as well (dotted names, e.g. `out_proj.weight`).
    """
    params: dict[str, Tensor] = {}
    for name, p in _owned_parameters(module).items():
        if p is not None and p.requires_grad and all(p is not q for q in params.values()):
            params[name] = p
    return params


def call_params(record: Record) -> dict[str, Tensor]:
    """`trainable_params` of the recorded call's module, looked up once per record.

    The passes of a backward ask several times per call; within one backward the answer
    cannot change.
    """
    params = record.params
    if params is None:
        params = record.params = trainable_params(record.module)
    return params


def get_param(module: nn.Module, name: str) -> Tensor:
    """The parameter `name` (possibly dotted) of `module`."""
    return module.get_parameter(name) if "." in name else getattr(module, name)


def _register_owners(module: nn.Module, params: dict[str, Any]) -> None:
    """Remember that `module` uses its parameters (skipped when nothing changed since last time)."""
    ids = tuple(map(id, params.values()))
    if module.__dict__.get("_backpack_owner_ids") == ids:
        return
    with _LOCK:
        for param in params.values():
            if param is None:
                continue
            key = id(param)
            owners = _PARAM_OWNERS.get(key)
            if owners is None:
                owners = _PARAM_OWNERS[key] = weakref.WeakSet()
                weakref.finalize(param, _PARAM_OWNERS.pop, key, None)
            owners.add(module)
    module.__dict__["_backpack_owner_ids"] = ids


def _detach(obj: Any) -> Any:
    return map_tensors(obj, Tensor.detach)


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """All tensors in a (nested) tuple/list structure, depth first."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_in(o)


def _collect_tensors(obj: Any, found: list[Tensor]) -> None:
    """Append the tensors in a (nested) tuple/list structure to `found`, depth first.

    `tensors_in` as a list, without a generator per level (the hot path of multi-output calls).
    """
    if isinstance(obj, Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _collect_tensors(o, found)


def _detach_into(obj: Any, detached: list[Tensor]) -> Any:
    """`_detach(obj)`, also appending each detached tensor to `detached`, depth first."""

    def detach(t: Tensor) -> Tensor:
        alias = t.detach()
        detached.append(alias)
        return alias

    return map_tensors(obj, detach)


def _keep(a: Any, out_tensors: list[Tensor]) -> Any:
    """How a record keeps an input: as is, detached if it is also an output (in place)."""
    if isinstance(a, Tensor):
        for o in out_tensors:
            if a is o:
                return a.detach()
        return a
    return _detach(a)


def _forget_identity_values(record: Record, output: Tensor, alias: Tensor) -> None:
    """Let an identity call keep stand-ins, not the values, where it would be their only holder.

    Identity calls are `nn.Identity`, dropout in eval mode and the like. Autograd does not keep
    a Linear's or convolution's output (the next operation, often an addition, does not need
    it); an identity holding it would keep it for the whole step (a vision transformer's
    `Identity` layer scales and drop-paths: a quarter more memory). Its values, should a user
    hook ask (`module.input0`, `module.output`), come from the producer's record (kept until
    the identity's hook ran); the classes of `PASS_THROUGH` keep no values even without a
    recorded producer (an `nn.Identity` on a query in attention would hold the whole
    projection's output), and a hook asking for them then gets an error.
    """
    producer = _producer(output)
    if producer is None and type(record.module) not in PASS_THROUGH:
        return  # no record to read the values from: kept
    stand_in = _shape_only(output)
    record.args = tuple([stand_in if a is alias else a for a in record.args])
    record.versions = tuple([a._version if isinstance(a, Tensor) else None for a in record.args])
    record.outputs = (stand_in,)
    record.output_structure = stand_in
    record.out_versions = (stand_in._version,)
    record.shape_only = True
    record.input_producer = producer
    if producer is not None:
        producer.holders += 1  # both run at the same node: the producer's hook first


def _is_identity(module: nn.Module, node: Any) -> bool:
    """Whether a call returning its own input is an identity (no parameters, a known output)."""
    return not module._parameters and (_META_KEY in node.metadata or type(module) in PASS_THROUGH)


def _identity_stand_in(module: nn.Module, output: Tensor, node: Any) -> Tensor | None:
    """The stand-in an identity call returning `output` will keep (None: it keeps values)."""
    if not _is_identity(module, node):
        return None
    if type(module) not in PASS_THROUGH and _producer(output) is None:
        return None
    return _shape_only(output)


def _producer(x: Any) -> Record | None:
    """The live record whose output `x` is (None if there is none)."""
    node = getattr(x, "grad_fn", None) if isinstance(x, Tensor) else None
    entries = None if node is None else node.metadata.get(_META_KEY)
    for record, _, output_nr in entries or ():
        if output_nr == x.output_nr and not record.freed and not record.identity:
            return record
    return None


def _shape_only_producer(x: Any) -> Record | None:
    """The shape-only record whose output `x` is (None if there is none)."""
    node = getattr(x, "grad_fn", None) if isinstance(x, Tensor) else None
    entries = None if node is None else node.metadata.get(_META_KEY)
    if not entries:
        return None
    for record, _, output_nr in entries:
        if record.shape_only and output_nr == x.output_nr and not record.freed:
            return record
    return None


class _Independent(torch.autograd.Function):
    """Identity on several tensors as one autograd node: gradients reach it from outside only."""

    @staticmethod
    def forward(ctx: Any, *tensors: Tensor) -> tuple[Tensor, ...]:  # noqa: D102
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, ...]:  # noqa: D102
        return grads


def _node_key(node: Any) -> tuple[str, int]:
    # node wrappers may be rebuilt on each access (torch 2.11): compare what they wrap
    return node.name(), node._sequence_nr()


def _outputs_nested(out_tensors: list[Tensor], args: tuple) -> bool:
    """Whether one output of a call was computed from another (LSTMCell: h from c).

    The gradient reaching such an output's node then includes the path through the other
    output inside the call, which is not a gradient w.r.t. the call's output.
    """
    nodes = {_node_key(t.grad_fn): t.grad_fn for t in out_tensors if t.grad_fn is not None}
    if len(nodes) < 2:
        return False
    inputs = {_node_key(a.grad_fn) for a in args if isinstance(a, Tensor) and a.grad_fn is not None}
    stack = [n for node in nodes.values() for n, _ in node.next_functions if n is not None]
    for count, node in enumerate(walk_nodes(stack)):
        key = _node_key(node)
        if key in nodes or count > 10_000:  # unsure after that many nodes: keep them apart
            return True
        if key not in inputs:
            stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


def _independent_outputs(output: Any, out_tensors: list[Tensor]) -> Any:
    """The output structure with its differentiable tensors passed through `_Independent`."""
    replaced = iter(_Independent.apply(*out_tensors))
    return map_tensors(output, lambda t: next(replaced) if t.requires_grad else t)


# --- random draws inside a forward -------------------------------------------------------------

#: module class -> test on a module: does its call draw random numbers that the class's rule
#: replays (dropout on `MultiheadAttention`'s weights in training mode)? Such calls keep the
#: state of their device's default generator from just before the call (`Record.rng`), which
#: a forward pre-hook reads (reading it draws nothing). Rules register their classes.
RANDOM_CALLS: dict[type, Callable[[nn.Module], bool]] = {}
#: (thread, id(module)) -> the generator state saved by the pre-hook of a running call
_PENDING_RNG: dict[tuple[int, int], GeneratorState] = {}
#: replays set a default generator and restore it: one at a time
_REPLAY_LOCK = threading.Lock()


def default_generator(device: torch.device) -> torch.Generator | None:
    """The generator random operations on `device` use by default (None: another device)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


class GeneratorState:
    """A device's default generator as a module call found it: replays repeat its draws."""

    __slots__ = ("device", "state", "dtype", "autocast", "output_versions")

    def __init__(
        self, device: torch.device, state: Tensor, dtype: torch.dtype, autocast: Any
    ) -> None:
        self.device = device
        #: `Generator.get_state()` before the call
        self.state = state
        #: dtype of the call's first tensor input
        self.dtype = dtype
        #: the autocast dtype in effect for the device during the call (None: autocast off)
        self.autocast = autocast
        #: versions of the call's outputs when it returned (an in-place change shows)
        self.output_versions: tuple[int, ...] = ()

    def replay(self, fn: Callable[[], Any]) -> Any:
        """`fn()` with the generator in the saved state; afterwards it is as it was before."""
        generator = default_generator(self.device)
        if generator is None:  # pragma: no cover - only CPU and CUDA states are saved
            raise RuntimeError(f"no default generator known for device {self.device}")
        with _REPLAY_LOCK:
            current = generator.get_state()
            generator.set_state(self.state)
            try:
                return fn()
            finally:
                generator.set_state(current)


def _random_test(module: nn.Module) -> Callable[[nn.Module], bool] | None:
    for cls, test in RANDOM_CALLS.items():
        if isinstance(module, cls):
            return test
    return None


@torch.compiler.disable
def _save_generator(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of `RANDOM_CALLS` modules: keep the generator state for the record."""
    local = _LOCAL
    if local.internal_depth or local.disabled_depth or not torch.is_grad_enabled():
        return
    test = _random_test(module)
    if test is None or not test(module):
        return
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
    if first is None:
        return
    device = first.device
    generator = default_generator(device)
    if generator is None:
        return
    try:
        state = generator.get_state()
    except RuntimeError:  # pragma: no cover - e.g. while a CUDA graph is captured
        return
    kind = device.type
    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    _PENDING_RNG[(_get_ident(), id(module))] = GeneratorState(device, state, first.dtype, autocast)


def _attach_rng(record: Record, rng: GeneratorState, out_tensors: list[Tensor]) -> None:
    rng.output_versions = tuple([t._version for t in out_tensors])
    record.rng = rng


class _Handles:
    """Several hook handles removed as one (`remove_hooks`)."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


#: module classes whose outputs, where they are views, are views of a tensor computed in the
#: call that no autograd node saves (`F.linear` on `[N, T, in]` with a bias views its `addmm`
#: result): `_unaliased` drops the view relation without a copy. Exact classes only: a subclass
#: may override the forward.
PRIVATE_VIEW_OUTPUTS: set[type] = {nn.Linear, nn.MultiheadAttention}


def _unaliased(module: nn.Module, args: tuple, kwargs: dict, out: Tensor) -> Tensor | None:
    """The output `out` of a parametrized call as a tensor that is no view (None: keep `out`).

    An in-place operation on a view (`nn.ReLU(inplace=True)` after `F.linear` on a 3-D input
    with a bias) rebases the view's history on its base: the gradient then bypasses the node
    that produced the view, where the record's hook waits, and the call would get nothing.
    Views of a tensor computed inside the call are replaced: without a copy for the classes of
    `PRIVATE_VIEW_OUTPUTS`, else by a copy (the base may be saved by a node of the call, whose
    check for in-place changes must keep working). Views of inputs, parameters or buffers are
    kept: the user may rely on writing through them. A call whose own parameters are all
    frozen keeps its output, like a call without parameters: nothing is computed for it.
    """
    base = out._base
    if base is None or base.grad_fn is None:
        return None
    if not any(p is not None and p.requires_grad for p in _owned_parameters(module).values()):
        return None
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor) and (a is base or a._base is base):
            return None
    if type(module) in PRIVATE_VIEW_OUTPUTS:
        return torch.ops.aten._unsafe_view(out, out.shape)
    return out.clone()


@torch.compiler.disable
def _forward_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Record the call for the next backward (only when it can be differentiated).

    Returns a replacement output only for calls whose outputs depend on each other.
    """
    # The hot path of every extended call: a few microseconds per call are a measurable share
    # of a small model's step, so the common case (one output tensor) avoids helper calls.
    local = _LOCAL
    if local.internal_depth or not torch.is_grad_enabled():
        return None
    rng = _PENDING_RNG.pop((_get_ident(), id(module)), None) if _PENDING_RNG else None
    replacement = None
    single = isinstance(output, Tensor)
    if single:
        if not output.requires_grad:
            return
        if output._base is not None and not local.disabled_depth:
            replacement = _unaliased(module, args, kwargs, output)
            if replacement is not None:
                output = replacement
        node = output.grad_fn
        if node is not None and not local.disabled_depth:
            record = _record_single(module, args, kwargs, output, node)
            if rng is not None:
                _attach_rng(record, rng, [output])
            return replacement
        out_tensors = [output]
        out_requires_grad: tuple[bool, ...] = (True,)
    else:
        all_out: list[Tensor] = []
        _collect_tensors(output, all_out)
        out_requires_grad = tuple([t.requires_grad for t in all_out])
        if True not in out_requires_grad:
            return
        out_tensors = [t for t, needed in zip(all_out, out_requires_grad) if needed]
        if not local.disabled_depth and any(t._base is not None for t in out_tensors):
            unaliased = {id(t): _unaliased(module, args, kwargs, t) for t in out_tensors}
            if any(u is not None for u in unaliased.values()):
                replacement = output = map_tensors(
                    output, lambda t: t if unaliased.get(id(t)) is None else unaliased[id(t)]
                )
                all_out = []
                _collect_tensors(output, all_out)
                out_tensors = [t for t, needed in zip(all_out, out_requires_grad) if needed]
        if len(out_tensors) > 1 and _outputs_nested(out_tensors, args):
            replacement = output = _independent_outputs(output, out_tensors)
            all_out = []
            _collect_tensors(output, all_out)
            out_requires_grad = tuple([t.requires_grad for t in all_out])
            out_tensors = [t for t, needed in zip(all_out, out_requires_grad) if needed]
    if local.disabled_depth > 0:
        record = Record(module, (), {}, (), None, disabled=True)
    else:
        record = _record_call(module, args, kwargs, output, out_tensors, out_requires_grad)
        if rng is not None:
            _attach_rng(record, rng, out_tensors)
    record.out_requires_grad = out_requires_grad
    _remember(module, record)

    # The hook closure (stored on the graph) owns the record: it dies with the graph.
    if len(out_tensors) == 1:
        (tensor,) = out_tensors
        node = tensor.grad_fn
        if node is None:  # a leaf (e.g. Identity on an input that requires grad)

            def _leaf_hook(grad: Tensor, record: Record = record) -> None:
                _dispatch(record, (grad,))

            tensor.register_hook(_leaf_hook)
        else:
            # A pre-hook on the producing node sees the gradient of the value before any later
            # in-place op changed it (that op gets a node of its own).
            output_nr = tensor.output_nr

            def _node_hook(grads: tuple, record: Record = record, nr: int = output_nr) -> None:
                _dispatch(record, (grads[nr],))

            node.register_prehook(_node_hook)
    elif any(t.grad_fn is None for t in out_tensors):

        def _multi_hook(grads: Any, record: Record = record) -> None:
            _dispatch(record, tuple(grads))

        torch.autograd.graph.register_multi_grad_hook(out_tensors, _multi_hook)
    else:
        _hook_output_nodes(record, out_tensors)
    if not record.disabled and not record.identity:
        # the producing nodes own the record too: graph walks find it there
        for nr, tensor in enumerate(out_tensors):
            node = tensor.grad_fn
            if node is not None:
                node.metadata.setdefault(_META_KEY, []).append((record, nr, tensor.output_nr))
    return replacement


def _record_single(
    module: nn.Module, args: tuple, kwargs: dict, output: Tensor, node: Any
) -> Record:
    """Record a call whose output is one tensor produced by the autograd `node`.

    The common case of `_forward_hook`, `_record_call` and `_remember` in one pass over the
    inputs: every helper call, generator and repeated tensor attribute read showed up in the
    step time of small models (each call costs a few microseconds, more with cold caches).
    """
    cls = type(module)
    inplace = False
    #: whether a kept tensor input requires grad, and the first kept tensor (`sample_free`)
    kept_needs_grad = False
    first = None
    kept = []
    versions = []
    edges = []
    for a in args:
        if isinstance(a, Tensor):
            versions.append(a._version)
            if a is output:
                # in place: kept detached (the graph would otherwise own itself); the same
                # alias serves as the output below. An identity call that will keep a stand-in
                # (`_forget_identity_values`) takes it now: a detach is an operator call too
                inplace = True
                stand_in = _identity_stand_in(module, output, node)
                a = detached_output = a.detach() if stand_in is None else stand_in
                edges.append(None)
            elif a.requires_grad:
                kept_needs_grad = True
                # snapshot (node, output index): later in-place ops on `a` cannot move it
                # (`_as_edge` makes the edge when one is needed)
                a_node = a.grad_fn
                edges.append(a if a_node is None else (a_node, a.output_nr))
            else:
                edges.append(None)
            if first is None:
                first = a
            kept.append(a)
        else:
            versions.append(None)
            edges.append(None)
            kept.append(_detach(a))
    shape_only = (
        cls in SHAPE_ONLY_OUTPUTS and not inplace and output.numel() >= SHAPE_ONLY_MIN_ELEMENTS
    )
    if shape_only:
        structure = _shape_only(output)
    else:
        structure = detached_output if inplace else output.detach()
    producer = None
    if cls in IDEMPOTENT_ACTIVATIONS and len(args) == 1 and not inplace:
        producer = _shape_only_producer(args[0])
        if producer is not None:
            # see `_record_call`: the output stands in for the input
            first = output.detach()
            kept = [first]
            versions = [first._version]
            kept_needs_grad = False
    record = _new_record(Record)
    record._setup(
        module,
        tuple(kept),
        {k: _keep(v, [output]) for k, v in kwargs.items()} if kwargs else {},
        (structure,),
        structure,
        False,
        tuple(versions),
        edges,
        inplace,
        shape_only,
        producer,
        (True,),
        (structure._version,),
    )
    own = module._parameters
    identity = inplace and _is_identity(module, node)
    record.identity = identity
    if identity:
        _forget_identity_values(record, output, detached_output)
    params = _owned_parameters(module)
    if params and module.__dict__.get("_backpack_owner_ids") != tuple(map(id, params.values())):
        _register_owners(module, params)
    # `_remember`, with the loss and `sample_free` tests on what is known already
    is_loss = _IS_LOSS_CLASS.get(cls)
    if is_loss is None:
        is_loss = is_loss_module(module)
    if is_loss:
        _LOSS_RECORDS.add(weakref.ref(record, _LOSS_RECORDS.discard))
    elif (
        own
        and not kept_needs_grad
        and first is not None
        and (not first.is_floating_point() or first.dim() == 0 or first.shape[0] == 1)
    ):
        _SAMPLE_FREE.add(weakref.ref(record, _SAMPLE_FREE.discard))
    if own and module._modules and not is_loss:
        _CONTAINERS.add(weakref.ref(record, _CONTAINERS.discard))
    refs = _LIVE_RECORDS.get(id(module))
    if refs is None:
        refs = _live_refs(module)
    refs.add(weakref.ref(record, refs.discard))
    # The hook closure (stored on the graph) owns the record: it dies with the graph. It
    # decides a plain backward's case itself (`_dispatch` and `free_after_plain_backward`).
    nr = output.output_nr

    def _node_hook(grads: tuple, record: Record = record, nr: int = nr) -> None:
        local = _LOCAL
        if local.propagating:  # the engine's own passes: nothing to do
            return
        engines = local.engines
        if engines:
            engines[-1].on_module_backward(record, (grads[nr],))
        elif _STACKS:  # a context on the forward's thread (see `CTX.hook_engine`)
            _dispatch(record, (grads[nr],))
        elif _KEEPS_GRAPH is not None and not _KEEPS_GRAPH():
            record.free()  # see `free_after_plain_backward`

    node.register_prehook(_node_hook)
    if not identity:
        # the producing node owns the record too: graph walks find it there
        metadata = node.metadata
        entries = metadata.get(_META_KEY)
        if entries is None:
            metadata[_META_KEY] = [(record, 0, nr)]
        else:
            entries.append((record, 0, nr))
    return record


def _record_call(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    output: Any,
    out_tensors: list[Tensor],
    out_requires_grad: tuple[bool, ...],
) -> Record:
    """The record of one (not disabled) call whose outputs `out_tensors` need gradients.

    `out_requires_grad` says which tensors of `output` (depth first) are in `out_tensors`.
    """
    shape_only = False
    producer = None
    kept_args = args
    if isinstance(output, Tensor):
        cls = type(module)
        shape_only = (
            cls in SHAPE_ONLY_OUTPUTS
            and output.numel() >= SHAPE_ONLY_MIN_ELEMENTS
            and not any(a is output for a in args)
        )
        structure = _shape_only(output) if shape_only else output.detach()
        outs: tuple[Tensor, ...] = (structure,)
        if cls in IDEMPOTENT_ACTIVATIONS and len(args) == 1 and args[0] is not output:
            producer = _shape_only_producer(args[0])
        if producer is not None:
            # f(output) = output and f' agrees at both points: the output (saved by autograd
            # anyway) serves every rule, and the input is the producer's to recompute, so the
            # pre-activation can be freed after the forward as without backpack
            kept_args = (output,)  # kept detached below, as an input aliasing an output is
    else:
        # one detached alias per tensor, shared by the structure and `outputs` (as for one
        # output); detaching each twice cost ~1 us per tensor
        detached: list[Tensor] = []
        structure = _detach_into(output, detached)
        outs = tuple([d for d, needed in zip(detached, out_requires_grad) if needed])
    # Inputs are kept as they are (they belong to the graph upstream of this call anyway):
    # with backward(create_graph=True) the quantities stay differentiable w.r.t. them. An
    # input that is also an output (in place) is detached: the node holding this record
    # would otherwise hold itself.
    inplace = False
    edges = []
    for a in args:
        if not isinstance(a, Tensor) or not a.requires_grad:
            edges.append(None)
        elif any(a is o for o in out_tensors):
            inplace = True
            edges.append(None)
        else:
            # snapshot (node, output index): later in-place ops on `a` cannot move it
            # (`_as_edge` makes the edge when one is needed)
            node = a.grad_fn
            edges.append(a if node is None else (node, a.output_nr))
    kept = tuple([_keep(a, out_tensors) for a in kept_args])
    record = _new_record(Record)
    record._setup(
        module,
        kept,
        {k: _keep(v, out_tensors) for k, v in kwargs.items()} if kwargs else {},
        outs,
        structure,
        False,
        tuple([a._version if isinstance(a, Tensor) else None for a in kept]),
        edges,
        inplace,
        shape_only,
        producer,
        out_requires_grad,
        tuple([o._version for o in outs]),
    )
    if inplace and not module._parameters and len(out_tensors) == 1:
        # the output is the input itself: an identity (its node is the producer's, which
        # already carries records) or an in-place operation (a node of its own)
        node = out_tensors[0].grad_fn
        record.identity = node is None or _META_KEY in node.metadata
    params = _owned_parameters(module)
    if params:
        _register_owners(module, params)
    return record


def _hook_output_nodes(record: Record, out_tensors: list[Tensor]) -> None:
    """One pre-hook per node producing some of the outputs of a multi-output call.

    Each hook hands the engine the gradients of its outputs; the engine runs the module once all
    nodes reported, or at the end of the pass (outputs the loss does not use never report).
    Unlike `register_multi_grad_hook`, whose closure holds the output tensors (a reference cycle
    through their nodes that only the garbage collector breaks), the hooks hold only the record,
    so the record dies with the graph.
    """
    groups: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
    for index, tensor in enumerate(out_tensors):
        node = tensor.grad_fn
        groups.setdefault(node._sequence_nr(), (node, []))[1].append((index, tensor.output_nr))
    for node, members in groups.values():

        def _part_hook(
            grads: tuple,
            record: Record = record,
            members: tuple[tuple[int, int], ...] = tuple(members),
            nodes: int = len(groups),
        ) -> None:
            if CTX.propagating:
                return
            engine = CTX.engine_for(record.thread)
            if engine is not None:
                engine.on_module_output_part(record, [(i, grads[nr]) for i, nr in members], nodes)
            elif nodes == 1:  # other nodes may still run in a later backward
                free_after_plain_backward(record)

        node.register_prehook(_part_hook)


def walk_nodes(stack: list[Any]) -> Iterator[Any]:
    """Each autograd node popped from `stack` once (None skipped); the caller pushes what follows.

    The visited nodes are held, not just their id(): some torch versions (2.11) build a fresh
    Python wrapper for a node on each access and free it when unused, so a bare id could be
    reused by another node, which would then be skipped.
    """
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node


def nearest_records(
    edge: GradientEdge, through: Any = None
) -> list[tuple[Record, int, GradientEdge]] | None:
    """The recorded module outputs first met walking backward from `edge`: (record, index, edge).

    With `through` (a set of node names), only nodes of those kinds may lie on the way;
    None is returned when another node does.
    """
    found: list[tuple[Record, int, GradientEdge]] = []
    stack = [edge.node]
    for node in walk_nodes(stack):
        tags = records_at(node)
        if tags:
            found.extend((r, i, GradientEdge(node, nr)) for r, i, nr in tags)
            continue
        if through is not None and node.name() not in through:
            return None
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return found


def records_at(node: Any, freed: bool = False) -> list[tuple[Record, int, int]]:
    """Records whose module output the autograd `node` produced: (record, index, nr).

    Calls that returned their input unchanged are left out (walks look through them); so are
    records already freed, unless `freed`.
    """
    entries = node.metadata.get(_META_KEY)
    if not entries:
        return []
    found = [(r, i, nr) for r, i, nr in entries if freed or not r.freed]
    for record, _, _ in found:
        record.promote_half()  # whoever reads a record computes in float32
    return found


#: the calling thread's engine stack and depths, and the stacks of threads in a context (the
#: hot paths read them directly)
_LOCAL = CTX._local
_STACKS = CTX._stacks
#: whether the running backward keeps its graph (`retain_graph`); None where torch lacks it
_KEEPS_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def _dispatch(record: Record, grads: tuple[Tensor | None, ...]) -> None:
    engine = CTX.hook_engine(record.thread)
    if engine is not None:
        engine.on_module_backward(record, grads)
    else:
        free_after_plain_backward(record)


def free_after_plain_backward(record: Record) -> None:
    """Drop a record's tensors when a backward without backpack passes its call for good.

    A backward that does not keep its graph can never run through this call again, so the
    record is as dead as autograd's own saved tensors, which autograd frees node by node.
    Holding the inputs until the whole graph dies made plain steps of extended CNNs up to 1.3x
    slower (the allocator hands out fresh pages). The engine's own passes keep everything.
    """
    if (
        _KEEPS_GRAPH is not None
        and not record.disabled
        and not CTX.propagating
        and not _KEEPS_GRAPH()
    ):
        record.free()


def _is_leaf_or_parametrized(module: nn.Module) -> bool:
    has_children = next(module.children(), None) is not None
    has_params = next(module.parameters(recurse=False), None) is not None
    return has_params or not has_children or _has_parametrizations(module)


def _parametrization_modules(module: nn.Module) -> set[int]:
    """The ids of the modules inside `parametrizations` of parametrized modules in `module`.

    They run when a parametrized tensor is read, on the parameters alone (no samples): the
    parametrized module's record covers them.
    """
    inside: set[int] = set()
    for sub in module.modules():
        if _has_parametrizations(sub):
            inside.update(id(m) for m in sub.parametrizations.modules())
    return inside


def hook_modules(module: nn.Module, debug: bool = False) -> nn.Module:
    """Make `module` and its submodules record what backpack needs during forward passes.

    Leaf modules and modules owning parameters are hooked; pure containers (e.g. `Sequential`)
    are only traversed. Hooking twice is harmless. Returns the module itself. (`backpack.extend`
    calls this, after converting the model if asked to.)
    """
    _allow_repeated_compiled_backward()
    _mark_sequence_first(module)
    parametrizations = _parametrization_modules(module)
    for name, sub in module.named_modules():
        if name or "_backpack_path" not in sub.__dict__:
            # messages name modules by their path in the outermost model extended so far
            sub.__dict__["_backpack_path"] = name
        if getattr(sub, "_backpack_extend", False) or id(sub) in parametrizations:
            continue
        if not _is_leaf_or_parametrized(sub):
            continue
        handle = sub.register_forward_hook(_forward_hook, with_kwargs=True)
        if _random_test(sub) is not None:
            pre = sub.register_forward_pre_hook(_save_generator, with_kwargs=True)
            handle = _Handles(pre, handle)
        CTX.add_hook_handle(handle, sub)
        sub._backpack_extend = True
        if debug:
            print(f"[backpack] extending {name or '<root>'}: {sub.__class__.__name__}")
    return module


_SEQUENCE_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def _sequence_first(layer: nn.Module) -> bool:
    attention = getattr(layer, "self_attn", None)
    return isinstance(attention, nn.MultiheadAttention) and not attention.batch_first


def _mark_sequence_first(module: nn.Module) -> None:
    """Tell the layers inside sequence-first transformer layers that axis 1 holds the samples.

    `TransformerEncoderLayer(batch_first=False)` runs its Linear and LayerNorm submodules on
    `[T, N, D]`; their rules expect samples along axis 0, and the engine moves the axis for them.
    The stacks' final norms (`TransformerEncoder(norm=...)`) follow their layers.
    """
    for sub in module.modules():
        if isinstance(sub, _SEQUENCE_LAYERS):
            inside = [sub] if _sequence_first(sub) else []
        elif isinstance(sub, (nn.TransformerEncoder, nn.TransformerDecoder)):
            layers = list(sub.layers)
            inside = [sub.norm] if layers and _sequence_first(layers[0]) and sub.norm else []
        else:
            continue
        for owner in inside:
            for child in owner.modules():
                if child is sub or isinstance(child, nn.MultiheadAttention):
                    continue
                if any(
                    child is m
                    for a in owner.modules()
                    if isinstance(a, nn.MultiheadAttention)
                    for m in a.modules()
                ):
                    continue
                child.__dict__["_backpack_batch_axis"] = 1


def _allow_repeated_compiled_backward() -> None:
    """Let `torch.compile`d graphs of extended models be backpropagated more than once.

    Second-order extensions run extra backward passes over the graph (propagating curvature
    factors). torch.compile's "donated buffers" optimisation frees saved tensors after the
    first backward, so it is switched off; this applies to graphs compiled after `extend`.
    """
    try:
        import torch._functorch.config as config
    except ImportError:  # pragma: no cover - torch without functorch
        return
    if getattr(config, "donated_buffer", False):
        config.donated_buffer = False


def register_call(record: Record, node: Any, output_nr: int = 0) -> Any:
    """Make a record built during a backward (a functional call) look like a recorded call.

    Its module becomes an owner of its parameters, the node producing its output carries it
    (graph walks find it there), and a pre-hook hands the engine the gradient at that output.
    Returns the hook's handle (remove it when the backward is over).
    """
    _register_owners(record.module, record.module._parameters)
    _remember(record.module, record)
    node.metadata.setdefault(_META_KEY, []).append((record, 0, output_nr))

    def _hook(grads: tuple, record: Record = record) -> None:
        _dispatch(record, (grads[output_nr],))

    return node.register_prehook(_hook)


def memory_cleanup(module: nn.Module) -> None:
    """Free what was recorded on `module` for the next backward (safe if nothing is recorded)."""
    for record in _records(module):
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
