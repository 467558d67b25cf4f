"""Curvature products on a model sharded with FSDP2 (`fully_shard`), by distributed autograd.

A vector on such a model is this rank's local shards: the flat concatenation of
`p.to_local().reshape(-1)` over the trainable parameters. A product sweeps every rank's data
at once; each rank gets its rows of the product over the whole data set.

How. FSDP2 gathers a module's parameters only inside its own forward and backward hooks,
which know nothing of a second backward. Products therefore run the model without FSDP's
hooks (only for the duration of the product forward) and gather each module's parameters
themselves, one module at a time, through two autograd functions:

- `_Gather`: local shard → full parameter (all-gather); its backward is `_Scatter`;
- `_Scatter`: full tensor → this rank's chunk of the sum over ranks (reduce-scatter); its
  backward is `_Gather`.

With the local shards θ_r as the leaves, rank r's loss `L_r(gather(θ))` differentiates to
`chunk_r Σ_r' ∇L_r'`: the reduce-scatter in the backward sums the ranks' contributions, so
every derivative (gradient, Hessian- or GGN-vector product, twice differentiated) is taken of
the global loss and comes out as this rank's rows, while every rank calls the same
collectives in the same order (the same graph on every rank). The gathered parameters are not
kept by autograd: a saved-tensors hook stores a token instead and gathers the parameter again
when the backward needs it, so at most one module's parameters (plus what autograd holds for
the node running) are whole at a time, as in FSDP's own backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack import distributed as _dist
from backpack.curvature._fsdp import _fsdp_params, _reduce_scatter, _Shard, chunk_ranks

#: modules whose forward hooks belong to FSDP2 (bypassed while a product runs)
_FSDP_HOOK_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable")


def header_group(group: Any) -> Any:
    """The group of the small agreements and sums: backpack's, or the default one alone."""
    if group is not None:
        return group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "Curvature products on a model sharded with FSDP2 (fully_shard) need "
            "torch.distributed: call torch.distributed.init_process_group(...) first."
        )
    return _dist._group() if dist.get_world_size() > 1 else dist.group.WORLD


#: `[(default group, timeout, group of the products' gathers and reduce-scatters)]`
_PRODUCTS: list[tuple[Any, float, Any]] = []


def product_group() -> Any:
    """The group of the products' gathers and reduce-scatters (collective on first use).

    Apart from the agreements' group, so that a rank that failed half-way through a product
    (and waits in an agreement) never meets another rank's gather: both sides wait for the
    group's timeout (`backpack.distributed.TIMEOUT_S`) and raise, instead of gloo aborting on
    mismatched messages.
    """
    header_group(None)  # raises without torch.distributed
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    world = dist.group.WORLD
    if _PRODUCTS and _PRODUCTS[0][0] is world and _PRODUCTS[0][1] == _dist.TIMEOUT_S:
        return _PRODUCTS[0][2]
    group = dist.new_group(timeout=timedelta(seconds=_dist.TIMEOUT_S))
    _PRODUCTS[:] = [(world, _dist.TIMEOUT_S, group)]
    return group


class Layout:
    """Where each parameter of an FSDP2 model lives: its shard, chunking and local leaf.

    Attributes:
        group: The process group of the products' gathers and reduce-scatters.
        header: The process group of the agreements between batches (backpack's).
        trainable: `_Shard` of every trainable parameter, in `model.named_parameters()` order.
        frozen: `_Shard` of every FSDP-managed parameter without `requires_grad`.
    """

    def __init__(self, model: nn.Module, header: Any, what: str) -> None:
        self.header = header_group(header)
        self.group = group = product_group()
        fsdp = _fsdp_params(model)
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        self.trainable: list[_Shard] = []
        self.frozen: list[_Shard] = []
        self.by_id: dict[int, _Shard] = {}
        for name, p in model.named_parameters():
            fsdp_param = fsdp.get(id(p))
            if fsdp_param is None:
                raise NotImplementedError(
                    f"{what}: parameter {name} ({type(p).__name__}) is not managed by FSDP2: "
                    "apply fully_shard to the model (or its root) so that FSDP2 manages every "
                    "parameter."
                )
            chunk_of = chunk_ranks(name, p, world, what)
            if getattr(fsdp_param, "offload_to_cpu", False):
                raise NotImplementedError(
                    f"{what}: parameter {name} is offloaded to the CPU by FSDP2's "
                    "CPUOffloadPolicy, which curvature products do not support."
                )
            shard = _Shard(name, p, fsdp_param, chunk_of, me)
            (self.trainable if p.requires_grad else self.frozen).append(shard)
            self.by_id[id(p)] = shard
        if not self.trainable:
            raise ValueError("The model has no trainable parameter.")
        #: `{module: MixedPrecisionPolicy}` of every module FSDP2's hooks cast inputs or
        #: outputs of (the products run without those hooks and cast as they would)
        self.policies = _casting_policies(model)
        #: `{id(parameter): dtype}` where FSDP2 computes in another dtype than it stores
        self.compute_dtypes = _param_dtypes(model)
        #: `{module: [(attribute name, shard)]}`: where FSDP2 registers each parameter, whether
        #: the module holds it sharded or unsharded right now
        self.sites: dict[nn.Module, list[tuple[str, _Shard]]] = {}
        for shard in [*self.trainable, *self.frozen]:
            info = shard.fsdp_param._module_info
            pairs = [(info.module, info.param_name)]
            pairs += list(zip(info.shared_modules, info.shared_param_names))
            for module, attr in pairs:
                self.sites.setdefault(module, []).append((attr, shard))


def _casting_policies(model: nn.Module) -> dict[nn.Module, Any]:
    """`{module: its FSDP2 MixedPrecisionPolicy}` where the policy casts inputs or outputs."""
    found = {}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        policy = getattr(get_state(), "_mp_policy", None) if get_state is not None else None
        inputs = getattr(policy, "cast_forward_inputs", False) and policy.param_dtype is not None
        if inputs or getattr(policy, "output_dtype", None) is not None:
            found[module] = policy
    return found


def _param_dtypes(model: nn.Module) -> dict[int, torch.dtype]:
    """`{id(sharded parameter): its policy's param_dtype}` where that is not its own dtype.

    Read from the groups' policies (FSDP2 sets `FSDPParam.param_dtype` only at its first
    forward).
    """
    found = {}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state else None
        dtype = getattr(getattr(group, "mp_policy", None), "param_dtype", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            p = fsdp_param.sharded_param
            if dtype is not None and dtype != p.dtype and p.is_floating_point():
                found[id(p)] = dtype
    return found


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """`obj` (nested tuples, lists, dicts) with its floating-point tensors cast to `dtype`."""
    if isinstance(obj, Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        cast = [_cast_floats(o, dtype) for o in obj]
        return type(obj)(*cast) if hasattr(obj, "_fields") else type(obj)(cast)
    if isinstance(obj, dict):
        return type(obj)((k, _cast_floats(v, dtype)) for k, v in obj.items())
    return obj


def all_gather_param(shard: _Shard | Columns, local: Tensor, group: Any) -> Tensor:
    """The full parameter from every rank's local shard (plain tensors, one all-gather).

    Under HSDP the replica groups send the same chunks; the holder's copy is taken.
    """
    chunks = shard.chunks
    dim = shard.dim
    step = -(-shard.shape[dim] // chunks)
    if chunks == 1:  # every rank holds the whole parameter
        return local.clone()
    padded_shape = list(shard.shape)
    padded_shape[dim] = step
    padded = local.new_zeros(padded_shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    pieces = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(pieces, padded, group=group)
    except Exception as err:  # pragma: no cover - a rank died or timed out
        raise RuntimeError(
            f"A curvature product on the FSDP2 model could not gather {shard.name}: a rank did "
            f"not get there within {_dist.TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S); see "
            "the other ranks' errors."
        ) from err
    parts = [
        pieces[shard.holder[index]].narrow(dim, 0, shard.chunk_shape(index)[dim])
        for index in range(chunks)
    ]
    return torch.cat(parts, dim=dim)


class Columns:
    """A parameter's `_Shard` seen with K trailing columns: `[*shape, K]` tensors.

    Chunked along the parameter's own dimension, so `all_gather_param` and `reduce` move K
    vectors of the parameter's layout in one collective.
    """

    def __init__(self, shard: _Shard, count: int) -> None:
        self.shard, self.count = shard, count
        self.name, self.dim, self.chunks = shard.name, shard.dim, shard.chunks
        self.chunk_of, self.holder = shard.chunk_of, shard.holder
        self.shape = (*shard.shape, count)

    def chunk_shape(self, index: int) -> tuple[int, ...]:
        return (*self.shard.chunk_shape(index), self.count)

    def chunk(self, value: Tensor, index: int) -> Tensor:
        return self.shard.chunk(value, index)

    def reduce(self, full: Tensor, group: Any, what: str) -> Tensor:
        """This rank's chunk `[*local shape, K]` of `full` summed over the ranks."""
        if dist.get_world_size(group) == 1:
            return full
        (mine,) = _reduce_scatter(group, [(self, full.contiguous())], what)  # type: ignore[list-item]
        return mine


class _Gather(torch.autograd.Function):
    """Local shard → full parameter; backward: reduce-scatter (sum over ranks)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, shard: _Shard, group: Any) -> Tensor:
        ctx.shard, ctx.group = shard, group
        return all_gather_param(shard, local, group)

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple:
        return _Scatter.apply(grad_full, ctx.shard, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    """Full tensor → this rank's chunk of its sum over ranks; backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, full: Tensor, shard: _Shard, group: Any) -> Tensor:
        ctx.shard, ctx.group = shard, group
        if dist.get_world_size(group) == 1:
            return full.clone()
        (mine,) = _reduce_scatter(group, [(shard, full.contiguous())], "reduce a product")
        return mine.clone()

    @staticmethod
    def backward(ctx: Any, grad_local: Tensor) -> tuple:
        return _Gather.apply(grad_local, ctx.shard, ctx.group), None, None


class _Token:
    """What autograd keeps instead of a gathered parameter (or a view of its storage)."""

    __slots__ = ("shard", "local", "size", "stride", "offset", "dtype")

    def __init__(self, shard: _Shard, local: Tensor, t: Tensor) -> None:
        self.shard, self.local, self.dtype = shard, local, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class Gathering:
    """Inside `running(model)`: forwards of `model` gather parameters module by module.

    `leaves` maps the id of every sharded parameter to the local tensor the forward uses
    (for trainable ones, a leaf that requires grad: the variables of the products).
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.group = layout.group
        self.leaves: dict[int, Tensor] = {}
        for s in layout.trainable:
            self.leaves[id(s.param)] = s.param.to_local().detach().requires_grad_(True)
        for s in layout.frozen:
            self.leaves[id(s.param)] = s.param.to_local().detach()
        # storage of every gathered parameter (also the ones gathered again for a backward)
        # -> (shard, local); an entry lives as long as the storage
        self._owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def variables(self) -> list[Tensor]:
        """The local leaves of the trainable parameters, in layout order."""
        return [self.leaves[id(s.param)] for s in self.layout.trainable]

    def gather(self, shard: _Shard, local: Tensor) -> Tensor:
        """The whole parameter, in the dtype FSDP2 computes with (its `param_dtype`)."""
        if local.requires_grad:
            full = _Gather.apply(local, shard, self.group)
        else:
            full = all_gather_param(shard, local, self.group)
        # in the dtype FSDP2 computes in; autograd casts the derivatives back
        full = full.to(self.layout.compute_dtypes.get(id(shard.param), full.dtype))
        self._owned[full.untyped_storage()] = (shard, local)
        return full

    # --- saved tensors: tokens instead of gathered parameters -----------------------------
    def _pack(self, t: Tensor) -> Any:
        # any tensor on a gathered parameter's storage (the parameter, its views, the ones
        # autograd rebuilt from an earlier token) becomes a token
        if not isinstance(t, Tensor) or t.layout != torch.strided or _is_subclass(t):
            return t
        entry = self._owned.get(t.untyped_storage())
        if entry is None:
            return t
        shard, local = entry
        return _Token(shard, local.detach(), t)

    def _unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Token):
            return packed
        # gathered parameters are contiguous from offset 0, so the geometry carries over
        full = all_gather_param(packed.shard, packed.local, self.group).to(packed.dtype)
        self._owned[full.untyped_storage()] = (packed.shard, packed.local)
        return full.as_strided(packed.size, packed.stride, packed.offset)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Autograd keeps tokens for gathered parameters inside the block (forward and backward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    # --- forwards ----------------------------------------------------------------------
    @contextmanager
    def running(self, model: nn.Module) -> Iterator[None]:
        """FSDP's forward hooks off; each module gathers its own parameters in its forward."""
        with ExitStack() as stack:
            for module in model.modules():
                stack.enter_context(_without_fsdp_hooks(module))
            for module, owned in self.layout.sites.items():
                saved: list[dict[str, Any]] = []

                def pre(mod: nn.Module, args: Any, owned=owned, saved=saved) -> None:
                    saved.append({n: mod._parameters[n] for n, _ in owned})
                    for n, shard in owned:
                        leaf = self.leaves[id(shard.param)]
                        mod._parameters[n] = self.gather(shard, leaf)

                def post(mod: nn.Module, args: Any, output: Any, saved=saved) -> None:
                    mod._parameters.update(saved.pop())

                def restore(module=module, saved=saved) -> None:
                    while saved:  # a forward that raised half-way
                        module._parameters.update(saved.pop())

                stack.callback(restore)
                stack.callback(module.register_forward_pre_hook(pre).remove)
                stack.callback(module.register_forward_hook(post, always_call=True).remove)
            for module, policy in self.layout.policies.items():
                stack.enter_context(_casting(module, policy))
            yield


@contextmanager
def _casting(module: nn.Module, policy: Any) -> Iterator[None]:
    """`module`'s inputs and outputs cast as FSDP2's hooks cast them under `policy`."""

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> Any:
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            return _cast_floats(args, policy.param_dtype), _cast_floats(kwargs, policy.param_dtype)
        return None

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        return _cast_floats(output, policy.output_dtype) if policy.output_dtype else None

    handles = [
        module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True),
        module.register_forward_hook(post),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _is_subclass(t: Tensor) -> bool:
    """Whether `t` is a tensor subclass (a DTensor, a fake tensor): never a gathered parameter."""
    return type(t) is not Tensor and type(t) is not nn.Parameter


@contextmanager
def _without_fsdp_hooks(module: nn.Module) -> Iterator[None]:
    """`module`'s forward hook tables without FSDP2's entries, restored afterwards."""
    tables = ("_forward_pre_hooks", "_forward_hooks")
    originals = {t: getattr(module, t) for t in tables}

    def fsdp(hook: Any) -> bool:
        fn = getattr(hook, "func", hook)
        fn = getattr(fn, "__func__", fn)
        return str(getattr(fn, "__module__", "")).startswith(_FSDP_HOOK_MODULES)

    if not any(fsdp(h) for t in tables for h in originals[t].values()):
        yield
        return
    try:
        for t, table in originals.items():
            filtered = type(table)((k, h) for k, h in table.items() if not fsdp(h))
            setattr(module, t, filtered)
        yield
    finally:
        for t, table in originals.items():
            setattr(module, t, table)


def all_sum_values(group: Any, t: Tensor) -> Tensor:
    """`t` summed over the ranks of `group` (a new tensor; `t` is left as it is)."""
    out = t.detach().clone()
    if dist.get_world_size(group) > 1:
        try:
            dist.all_reduce(out, group=group)
        except Exception as err:  # pragma: no cover - a rank died or timed out
            raise RuntimeError(
                "Could not sum over the ranks of the FSDP2 model: a rank did not get there "
                f"within {_dist.TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S)."
            ) from err
    return out


def agree(group: Any, values: list[float], error: BaseException | None, what: str) -> Tensor:
    """All-gather a few float64 numbers per rank after this rank's outcome (column 0: failed).

    Raises this rank's `error`, or an error naming the first rank that failed.
    """
    device = _dist._header_device(group)
    own = torch.tensor([float(error is not None), *values], dtype=torch.float64, device=device)
    table = [torch.zeros_like(own) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(table, own, group=group)
    except Exception as err:  # pragma: no cover - a rank died or timed out
        raise RuntimeError(
            f"{what}: a rank did not get there within {_dist.TIMEOUT_S:g} s "
            "(backpack.distributed.TIMEOUT_S); see the other ranks' errors."
        ) from err
    rows = torch.stack(table).cpu()
    if error is not None:
        raise error
    bad = [r for r, f in enumerate(rows[:, 0].tolist()) if f]
    if bad:
        raise RuntimeError(f"{what}: rank {bad[0]} failed (see its error); every rank stops here.")
    return rows[:, 1:]
