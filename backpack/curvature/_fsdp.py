"""Sweeps of a model sharded with FSDP2 (`fully_shard`): each rank keeps its shard of the result.

FSDP2 gathers a module's parameters only inside its forward and backward. During a backward in
`backpack(...)`, the extension quantities therefore land on FSDP's temporary unsharded
parameters, computed from this rank's batch only; afterwards the module holds its sharded
(DTensor) parameters again. After every batch the sweep

1. agrees with the other ranks that every rank has a batch (a rank without one makes every rank
   raise: FSDP's own collectives need the same number of batches on every rank);
2. exchanges a small header (error flag, `ν_r`, `N_r`, a digest of the extensions and batch
   shapes), so that every rank scales its batch by `ν_r / s_ref` with one reference;
3. reduce-scatters (one collective per device and dtype) this rank's full-size contributions,
   arranged so that rank r receives the sum over all ranks of its own shard (torch.chunk
   along the sharded dimension, as FSDP2 shards);
4. adds the shard to its shard-size accumulators and deletes the quantities from the unsharded
   parameters.

Summed quantities (gradient, `SumGradSquared`, diagonals) sum their contributions. `Variance`
sends `Σ_r n_r var_r`, `Σ_r n_r mean_r` and `Σ_r n_r mean_r²`: the batch's variance over all
ranks' samples is `(Σ n_r var_r + Σ n_r mean_r² − n mean²) / n`, merged into the running state
with Chan et al.'s formula. Per-sample rows (`BatchGrad`, `BatchL2Grad`, `SqrtGGN*`, ...: of
whole parameters, from FSDP's unsharded ones) stay on their rank, kept or streamed to a callback,
like under `distributed=True` without sharding. The gradient is taken
from the unsharded parameter when autograd accumulates it (before FSDP reduce-scatters it,
averaged over ranks, into `.grad`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack import distributed as _dist
from backpack.api import backpack, disable
from backpack.curvature._data import (
    digest,
    fingerprint,
    trainable,
)
from backpack.curvature._quantities import (
    BatchScale,
    Kind,
    KronKind,
    Rows,
    VarianceKind,
    wide_dtype,
)
from backpack.extensions.backprop_extension import BackpropExtension

#: torch.distributed's reduce-scatter of one flat tensor (renamed in newer torch)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
#: torch.distributed's reduce onto one rank (a name of its own, for the memory benchmarks)
_REDUCE = dist.reduce

#: what a sweep of an FSDP2 model supports (named in errors)
SUPPORTED = (
    "the gradient, SumGradSquared, Variance, DiagGGNExact, DiagGGNMC, DiagHessian (each rank "
    "keeps its shard), per-sample rows (this rank's samples, whole parameters; kept or "
    "streamed), KFLR and KFAC (each layer's factors on one owner rank), the operators GGN, "
    "Hessian, EmpiricalFisher, KFAC and EKFAC (each block's eigenbasis and corrected "
    "eigenvalues on its owner) and backpack.influence (each block of the fit on one rank)"
)


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether `model` has parameters sharded by FSDP2 (`fully_shard`) or other DTensors."""
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return True
    return any("FSDP" in type(m).__name__ for m in model.modules())


def refuse(what: str, why: str | None = None) -> NotImplementedError:
    """The error of a curvature tool that does not support FSDP2 models (`why`: the reason)."""
    why = why or "its products or factors need whole parameters on every rank"
    return NotImplementedError(
        f"{what} does not support a model sharded with FSDP2 (fully_shard): {why}. "
        "accumulate(model, lossfunc, data, "
        f"extensions) does: {SUPPORTED}. For {what}, sweep a replicated copy: load "
        "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) into an "
        "unsharded instance of the model and use it with distributed=True (docs: 'Curvature of "
        "a data set', 'Distributed sweeps')."
    )


class _Shard:
    """One trainable parameter of an FSDP2 model: its unsharded twin and how it is chunked.

    `chunk_of` maps every rank to the index of the chunk it holds. Under HSDP several ranks
    (one per replica group) hold the same chunk; `holder` names the lowest of them, whose copy
    counts when the ranks' local rows are concatenated or their partial sums added.
    """

    def __init__(
        self, name: str, param: Tensor, fsdp_param: Any, chunk_of: dict[int, int], me: int
    ):
        self.name = name
        self.param = param
        self.fsdp_param = fsdp_param
        self.dim = next(p.dim for p in param.placements if type(p).__name__ == "Shard")
        self.shape = tuple(param.shape)
        #: chunk index of every rank of backpack's group (= world rank)
        self.chunk_of = chunk_of
        #: the number of chunks (the size of the mesh dimension the parameter is sharded over)
        self.chunks = len(set(chunk_of.values()))
        #: `{chunk index: the lowest rank holding it}`
        self.holder = holders(chunk_of)
        self.me = me
        local = tuple(param.to_local().shape)
        if local != self.chunk_shape(self.chunk_of[me]):
            raise NotImplementedError(
                f"accumulate: parameter {name} of the FSDP2 model is sharded unlike torch.chunk "
                f"(local shard {local}, expected {self.chunk_shape(self.chunk_of[me])}); only "
                "FSDP2's default even sharding along one dimension is supported."
            )

    def chunk_shape(self, index: int) -> tuple[int, ...]:
        size = self.shape[self.dim]
        step = -(-size // self.chunks)
        length = max(0, min(size, (index + 1) * step) - min(size, index * step))
        return self.shape[: self.dim] + (length,) + self.shape[self.dim + 1 :]

    def chunk(self, value: Tensor, index: int) -> Tensor:
        """Chunk `index` of a full-size `value` (torch.chunk semantics, empty past the end)."""
        step = -(-self.shape[self.dim] // self.chunks)
        return value.narrow(
            self.dim,
            min(self.shape[self.dim], index * step),
            self.chunk_shape(index)[self.dim],
        )

    @property
    def unsharded(self) -> Tensor | None:
        return getattr(self.fsdp_param, "_unsharded_param", None)


def mesh_chunks(device_mesh: Any, placements: Any) -> dict[int, int]:
    """`{rank: chunk index}` of a DTensor sharded along one dimension of `device_mesh`."""
    mesh = device_mesh.mesh
    axis = [type(x).__name__ for x in placements].index("Shard")
    return {int(mesh[i]): i[axis] for i in itertools.product(*map(range, mesh.shape))}


def holders(chunk_of: dict[int, int]) -> dict[int, int]:
    """`{chunk index: the lowest rank holding it}` of a `{rank: chunk index}` map."""
    found: dict[int, int] = {}
    for rank in sorted(chunk_of):
        found.setdefault(chunk_of[rank], rank)
    return found


def replica_holder(chunk_maps: list[dict[int, int]], me: int, what: str) -> int | None:
    """The rank whose rows rank `me`'s equal (HSDP), or None when no rank shares a chunk.

    `chunk_maps`: every parameter's `{rank: chunk index}`. Under HSDP that is the lowest rank
    holding this rank's chunks; sums and stacks over the ranks take each row from it only.

    Raises:
        NotImplementedError: When the parameters are replicated over different groups of ranks.
    """
    if all(len(set(m.values())) == len(m) for m in chunk_maps):
        return None
    found = {holders(m)[m[me]] for m in chunk_maps}
    if len(found) > 1:
        raise NotImplementedError(
            f"{what}: the parameters of the FSDP2 model are replicated over different groups of "
            "ranks (several HSDP meshes); shard them over one mesh."
        )
    return found.pop()


def replica_digest(V: Tensor | None) -> list[float]:
    """`[Σ v², Σ w v, √Σ w² v², tolerance]` of a vector: tells apart the rows replicas pass.

    `w` is a fixed zero-mean pattern of weights. Rows that differ by rounding (`δ_i` of about
    `ε |v_i|`) move `Σ w v` by about `ε √Σ w² v²`; rows that differ otherwise move it by `w_i δ_i`
    summed over the entries that differ.
    """
    if V is None:
        return [math.nan] * 4
    flat = V.detach().reshape(-1)
    sums = torch.zeros(3, dtype=torch.float64, device=flat.device)
    step = 1 << 20  # in pieces: a float64 copy of a whole shard could be large
    for start in range(0, flat.numel(), step):
        v = flat[start : start + step].to(torch.float64)
        w = torch.arange(start, start + v.numel(), dtype=torch.float64, device=v.device)
        w = w.mul_(0.6180339887).frac_().sub_(0.5)
        sums += torch.stack([v.square().sum(), w @ v, (w * v).square().sum()])
    square, weighted, spread = sums.tolist()
    tolerance = min(0.1, 64 * torch.finfo(V.dtype).eps)
    return [square, weighted, spread**0.5, tolerance]


def check_replicas(table: Tensor, what: str) -> None:
    """Raise on every rank unless each rank's vector equals its chunk holder's (HSDP).

    `table` has a row per rank of backpack's group: `[*replica_digest(V), holder's rank]`.
    Ranks holding the same chunks hold the same rows of a vector; another vector on a
    replica would silently get the product of the holder's. Rows equal up to rounding pass.
    """
    bad = []
    for rank, row in enumerate(table.tolist()):
        other = table[int(row[4])].tolist()
        tol = row[3]
        same = abs(row[0] - other[0]) <= tol * max(row[0], other[0]) and abs(
            row[1] - other[1]
        ) <= tol * max(row[2], other[2])
        if not same and not all(math.isnan(x) for x in row[:2]):
            bad.append((rank, int(row[4])))
    if bad:
        raise ValueError(
            f"{what} on an HSDP model: rank(s) {[r for r, _ in bad]} pass other local rows than "
            f"rank(s) {[h for _, h in bad]}, which hold the same chunks. Every replica group must "
            "pass the same rows of a vector (op.local_rows(full) gives each rank its rows)."
        )


def chunk_ranks(name: str, p: Tensor, world: int, what: str) -> dict[int, int]:
    """`{rank: index of the chunk it holds}` of a parameter FSDP2 shards (a DTensor).

    FSDP2 shards along one dimension of its device mesh: a 1-D mesh over every rank, or HSDP's
    2-D `(replicate, shard)` mesh, whose replica groups each hold every chunk once.

    Raises:
        NotImplementedError: For other placements (tensor parallelism: two sharded mesh
            dimensions) or a mesh that does not span every rank once.
    """
    placements = getattr(p, "placements", ())
    kinds = [type(x).__name__ for x in placements]
    if kinds.count("Shard") != 1 or any(k not in ("Shard", "Replicate") for k in kinds):
        raise NotImplementedError(
            f"{what}: parameter {name} ({type(p).__name__}, placements {placements}) is not "
            "sharded by FSDP2's fully_shard along one dimension of its mesh: apply fully_shard "
            "to the model (or its root) so that FSDP2 manages every parameter; tensor "
            "parallelism (a second sharded mesh dimension) is not supported."
        )
    mesh = p.device_mesh.mesh
    chunk_of = mesh_chunks(p.device_mesh, placements)
    if mesh.numel() != world or sorted(chunk_of) != list(range(world)):
        raise NotImplementedError(
            f"{what}: parameter {name} is sharded over ranks "
            f"{sorted(int(r) for r in mesh.flatten().tolist())}, not over all {world} ranks: "
            "sub-meshes are not supported."
        )
    return chunk_of


class _Owned:
    """A whole tensor that one rank (`owner`) receives: `_reduce_scatter`'s other item kind.

    It answers like a `_Shard` whose chunk for the owner is everything and empty for the rest.
    """

    def __init__(
        self, owner: int, shape: tuple[int, ...], world: int, dtype: torch.dtype | None = None
    ) -> None:
        self.owner = owner
        self.shape = tuple(shape)
        self.chunk_of = {g: g for g in range(world)}
        #: the dtype the sum travels and arrives in (None: the tensor's own)
        self.dtype = dtype

    def chunk_shape(self, index: int) -> tuple[int, ...]:
        return self.shape if index == self.owner else (0,)

    def chunk(self, value: Tensor, index: int) -> Tensor:
        return value if index == self.owner else value.new_empty(0)


class _Wide:
    """A `_Shard` item of `_reduce_scatter` whose sum travels and arrives in float64."""

    dtype = torch.float64

    def __init__(self, shard: _Shard) -> None:
        self.shard = shard
        self.shape, self.chunk_of = shard.shape, shard.chunk_of

    def chunk_shape(self, index: int) -> tuple[int, ...]:
        return self.shard.chunk_shape(index)

    def chunk(self, value: Tensor, index: int) -> Tensor:
        return self.shard.chunk(value, index)


def assign_owners(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Each name's owner rank, balancing the summed `sizes` (bytes) over the ranks.

    Greedy: the largest first, each to the least loaded rank (the lowest rank on ties), so
    every rank computes the same assignment from the same sizes.
    """
    load = [0] * world
    owners: dict[str, int] = {}
    position = {name: i for i, name in enumerate(sizes)}
    order = sorted(sizes, key=lambda n: (-sizes[n], position[n]))
    for name in order:
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return {name: owners[name] for name in sizes}


def _fsdp_params(model: nn.Module) -> dict[int, Any]:
    """`{id(sharded parameter): FSDPParam}` of every FSDP2 module in `model`."""
    found: dict[int, Any] = {}
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def shards(model: nn.Module, group: Any) -> list[_Shard]:
    """The trainable parameters of an FSDP2 `model` with their sharding.

    Raises:
        NotImplementedError: For a parameter FSDP2 does not manage, placements other than
            FSDP2's (or HSDP's) over every rank of `group`, or uneven sharding.
    """
    fsdp = _fsdp_params(model)
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    out = []
    for name, p in trainable(model):
        fsdp_param = fsdp.get(id(p))
        if fsdp_param is None:
            raise NotImplementedError(
                f"accumulate: parameter {name} ({type(p).__name__}) is not managed by FSDP2: "
                "apply fully_shard to the model (or its root) so that FSDP2 manages every "
                "trainable parameter."
            )
        out.append(_Shard(name, p, fsdp_param, chunk_ranks(name, p, world, "accumulate"), me))
    if not out:
        raise ValueError("The model has no trainable parameter.")
    return out


def _gather(group: Any, values: list[float], what: str, tool: str = "accumulate") -> Tensor:
    """All-gather a few float64 numbers per rank: a `[world, len(values)]` table."""
    device = _dist._header_device(group)
    own = torch.tensor(values, dtype=torch.float64, device=device)
    table = [torch.zeros_like(own) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(table, own, group=group)
    except Exception as err:  # pragma: no cover - a rank died or timed out
        raise RuntimeError(
            f"{tool} (FSDP2) could not {what}: a rank did not get there within "
            f"{_dist.TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S)."
        ) from err
    return torch.stack(table).cpu()


def _agreed(
    table: Tensor, error: BaseException | None, what: str, tool: str = "accumulate"
) -> None:
    """Raise this rank's error, or one naming the first rank that failed (column 0)."""
    if error is not None:
        raise error
    bad = [r for r, f in enumerate(table[:, 0].tolist()) if f]
    if bad:
        raise RuntimeError(
            f"{tool} (FSDP2): rank {bad[0]} failed {what} (see its error); every rank stops here."
        )


#: the most bytes one reduce onto an owner sends (more items go in several reduces)
REDUCE_CHUNK_BYTES = 64 << 20


def _in_chunks(indices: list[int], items: list, itemsize: int) -> list[list[int]]:
    """`indices` in consecutive groups of at most `REDUCE_CHUNK_BYTES` (or one item each)."""
    groups: list[list[int]] = []
    size = 0
    for i in indices:
        nbytes = int(torch.Size(items[i][0].shape).numel()) * itemsize
        if not groups or size + nbytes > REDUCE_CHUNK_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def _reduce_scatter(
    group: Any, items: list[tuple[Any, Any]], what: str, consume: bool = False
) -> list[Tensor]:
    """This rank's chunk of the sum over ranks of each full-size tensor.

    One reduce-scatter per device and dtype for the `_Shard` items: rank g's segment of the flat
    input holds chunk g of every tensor, padded to the longest segment. `_Owned` items (whole
    on one rank) go by one reduce per owner, device and dtype instead: a reduce-scatter would
    pad every rank's segment to the most loaded owner's (a `world ×` larger buffer), in reduces
    of at most `REDUCE_CHUNK_BYTES` (then the buffer does not grow with the model). An item's
    `dtype` (`_Owned(..., dtype=)`, `_Wide`) is the one its sum travels in, cast as it is
    copied into the buffer; `consume`: each tensor is dropped from `items` once copied.
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    buckets: dict[tuple, list[int]] = {}
    owned: dict[tuple, list[int]] = {}
    for i, (item, t) in enumerate(items):
        dtype = getattr(item, "dtype", None) or t.dtype
        if isinstance(item, _Owned):
            owned.setdefault((item.owner, t.device, dtype), []).append(i)
        else:
            buckets.setdefault((t.device, dtype), []).append(i)
    out: list[Tensor | None] = [None] * len(items)
    for (owner, device, dtype), indices in owned.items():
        for group_indices in _in_chunks(indices, items, dtype.itemsize):
            flat, sizes = _packed(items, group_indices, dtype, device, consume)
            _collective(what, _REDUCE, flat, dst=dist.get_global_rank(group, owner), group=group)
            offset = 0
            for i, size in zip(group_indices, sizes):
                if owner == me:
                    out[i] = flat[offset : offset + size].view(items[i][0].shape)
                else:  # not a view: it would keep the whole buffer alive
                    out[i] = flat.new_empty(0)
                offset += size
            del flat
    for (device, dtype), indices in buckets.items():
        if any(len(set(items[i][0].chunk_of.values())) < world for i in indices):
            _all_reduce_chunks(group, items, indices, dtype, out, me, what, consume)
            continue
        sizes = [
            [
                int(torch.Size(items[i][0].chunk_shape(items[i][0].chunk_of[g])).numel())
                for i in indices
            ]
            for g in range(world)
        ]
        length = max(sum(row) for row in sizes)
        flat = torch.zeros(world * length, dtype=dtype, device=device)
        for g in range(world):
            offset = g * length
            for i, size in zip(indices, sizes[g]):
                shard, value = items[i]
                flat[offset : offset + size].view(shard.chunk_shape(shard.chunk_of[g])).copy_(
                    shard.chunk(value, shard.chunk_of[g])
                )
                offset += size
        if consume:
            for i in indices:
                items[i] = (items[i][0], None)
        mine = torch.empty(length, dtype=dtype, device=device)
        _collective(what, _REDUCE_SCATTER, mine, flat, group=group)
        del flat
        offset = 0
        for i in indices:
            shard = items[i][0]
            shape = shard.chunk_shape(shard.chunk_of[me])
            size = int(torch.Size(shape).numel())
            out[i] = mine[offset : offset + size].view(shape)
            offset += size
    return out  # type: ignore[return-value]


def _packed(
    items: list, indices: list[int], dtype: torch.dtype, device: Any, consume: bool
) -> tuple[Tensor, list[int]]:
    """The tensors of `items[indices]` back to back in one flat buffer, cast to `dtype`.

    `consume`: each tensor is dropped from `items` once copied. Returns the buffer and sizes.
    """
    sizes = [int(torch.Size(items[i][0].shape).numel()) for i in indices]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    offset = 0
    for i, size in zip(indices, sizes):
        flat[offset : offset + size].copy_(items[i][1].reshape(-1))
        offset += size
        if consume:
            items[i] = (items[i][0], None)
    return flat, sizes


def _collective(what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    """Run one of the sweep's collectives; a rank that does not come names the timeout."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # pragma: no cover - a rank died or timed out
        raise RuntimeError(
            f"The FSDP2 sweep could not {what}: a rank did not get there within "
            f"{_dist.TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S)."
        ) from err


def _all_reduce_chunks(
    group: Any,
    items: list,
    indices: list[int],
    dtype: torch.dtype,
    out: list,
    me: int,
    what: str,
    consume: bool,
) -> None:
    """`_reduce_scatter`'s bucket when ranks share chunks (HSDP): one all-reduce, own chunks kept.

    A reduce-scatter would send each shared chunk once per holder (R times the data), and
    its holders could receive sums added in different orders; an all-reduce gives every
    rank the same bits, so replica groups stay identical.
    """
    flat, sizes = _packed(items, indices, dtype, items[indices[0]][1].device, consume)
    _collective(what, dist.all_reduce, flat, group=group)
    offset = 0
    for i, size in zip(indices, sizes):
        shard = items[i][0]
        whole = flat[offset : offset + size].view(shard.shape)
        out[i] = shard.chunk(whole, shard.chunk_of[me]).clone()  # not a view of the buffer
        offset += size


def count_total(sweep: Any) -> float:
    """`ν` of every rank's data together: one forward per batch without gradients, in lockstep."""
    total = 0.0
    with torch.no_grad(), disable():
        work = lambda batch: sweep.nu(sweep.model(batch.X), batch.y)  # noqa: E731
        for _, nu in batch_results(sweep, work, "count ν"):
            total += nu
    reshard(sweep.model)  # forwards without a backward leave the root gathered
    return float(_gather(_dist._group(), [total], "count ν").sum())


def sharded_sweep(
    sweep: Any,
    extensions: list[BackpropExtension],
    kinds: dict[str, Kind],
    group: Any,
    stream_total: float | None = None,
) -> dict[str, Any]:
    """Every rank's shard of the data-set quantities of an FSDP2 model (see the module doc).

    `sweep` is the `Sweep` (`backpack.curvature._sweep`) of the model, loss and this rank's
    data; `stream_total`: the whole data set's `ν` that rows streamed to the `Rows` kinds'
    callback are divided by.

    Returns:
        The fields of an `Accumulated` (states and gradient: this rank's shards).

    Raises:
        RuntimeError: When the ranks have different numbers of batches, another rank failed,
            or the ranks swept different extensions, reductions or batch shapes.
    """
    reduction = sweep.reduction
    sweep.extend()
    model, lossfunc = sweep.model, sweep.lossfunc
    params = shards(model, group)
    names = [s.name for s in params]
    world = dist.get_world_size(group)
    before = fingerprint(model)
    saved_grads = [s.param.grad for s in params]
    setup = digest((reduction, list(kinds), [type(e).__name__ for e in extensions]))
    grads: dict[int, Tensor] = {}  # id(unsharded parameter) -> this batch's local gradient
    hooked: dict[int, Any] = {}
    states: dict[str, dict[str, Any]] = {f: dict.fromkeys(names) for f in kinds}
    grad_state: dict[str, Any] = dict.fromkeys(names)
    nu_total, samples, batches, signature = 0.0, 0, 0, None
    ref_scale: float | None = None
    ref_count: int | None = None
    kron = [f for f, kind in kinds.items() if isinstance(kind, KronKind)]
    owners: dict[str, int] | None = None  # each parameter's owner of its Kronecker factors

    def keep_grad(p: Tensor) -> None:
        grads[id(p)] = p.grad.detach().clone()

    batches_iter = iter(sweep.batches("accumulate"))
    try:
        for s in params:  # quantities of an earlier sweep or backward
            _clean(s, kinds)
        while True:
            batch, error = None, None
            try:
                batch = next(batches_iter)
            except StopIteration:
                pass
            except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
                error = err
            table = _gather(group, [float(error is not None), float(batch is not None)], "agree")
            _agreed(table, error, f"before batch {batches}")
            has = table[:, 1].tolist()
            if not any(has):
                break
            if not all(has):
                raise RuntimeError(
                    "accumulate (FSDP2): the ranks' shards have different numbers of batches: "
                    f"ranks {[r for r, h in enumerate(has) if h]} have a batch {batches}, ranks "
                    f"{[r for r, h in enumerate(has) if not h]} have none. FSDP2 runs "
                    "collectives in every forward and backward, so every rank must sweep the "
                    "same number of batches (their sizes may differ)."
                )
            assert batch is not None
            for s in params:
                s.param.grad = None
            with torch.enable_grad():
                output = model(batch.X)
                nu = sweep.nu(output, batch.y)
                for s in params:
                    p = s.unsharded
                    if p is not None and id(p) not in hooked:
                        hooked[id(p)] = p.register_post_accumulate_grad_hook(keep_grad)
                # without loss terms (ν = 0 under "mean") the backward still runs, with the
                # same collectives as the other ranks'; its quantities are dropped
                loss = lossfunc(output, batch.y)
                with backpack(*extensions, sync=False):
                    loss.backward()
            del output
            error, values = None, {}
            try:
                values = _take(params, kinds, grads, skip=sweep.empty(nu))
            except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
                error = err
            layout = {}
            if error is None:
                layout = {
                    f: {n: [tuple(t.shape) for t in values[f][n]] for n in names} for f in kron
                }
            head = [float(error is not None), nu, float(batch.num_samples), setup, digest(layout)]
            table = _gather(group, head, "exchange the batch's normalisers")
            _agreed(table, error, f"in batch {batches}")
            if len(set(table[:, 3].tolist())) > 1:
                raise RuntimeError(
                    "accumulate (FSDP2): the ranks swept different extensions or reductions."
                )
            if len(set(table[:, 4].tolist())) > 1:
                raise RuntimeError(
                    "accumulate (FSDP2): the ranks' Kronecker factors have different shapes "
                    f"(this rank's: {layout}); every rank must sweep the same model."
                )
            if owners is None and kron:  # the same sizes on every rank: the same owners
                sizes = {
                    n: sum(math.prod(shape) for f in kron for shape in layout[f][n]) for n in names
                }
                owners = assign_owners(sizes, world)
            batch_nu, batch_count = float(table[:, 1].sum()), int(table[:, 2].sum())
            scale = sweep.scale(nu)
            if ref_scale is None and reduction == "mean" and batch_nu != 0:
                ref_scale = batch_nu
            if ref_count is None:
                ref_count = batch_count
            rel = scale / (ref_scale or 1.0)
            info = BatchScale(
                index=batches,
                scale=rel,
                num_samples=batch.num_samples,
                count_scale=batch.num_samples / ref_count,
                stream_total=None if stream_total is None else stream_total / (ref_scale or 1.0),
            )
            rows = _add(params, kinds, states, grad_state, values, info, batch_count, group, owners)
            values.clear()
            if rows:  # kept or streamed (a callback may fail on one rank): then agreed
                error = None
                try:
                    _add_rows(rows, kinds, states, info)
                except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
                    error = err
                rows.clear()
                table = _gather(group, [float(error is not None)], "agree after the rows")
                _agreed(table, error, f"in batch {batches} (its rows)")
            nu_total += batch_nu
            samples += batch_count
            batches += 1
            if signature is None:
                signature = batch.signature
    finally:
        for handle in hooked.values():
            handle.remove()
        for s in params:
            _clean(s, kinds)
        for s, saved in zip(params, saved_grads):
            s.param.grad = saved
    if fingerprint(model) != before:
        raise ValueError("The model's parameters changed during the sweep.")
    for s in params:
        if grad_state[s.name] is None:
            grad_state[s.name] = torch.zeros_like(s.param.to_local())
    return {
        "reduction": reduction,
        "total": nu_total,
        "num_samples": samples,
        "num_batches": batches * world,
        "names": names,
        "kinds": kinds,
        "states": states,
        "grad": grad_state,
        "model_fingerprint": before,
        "signature": signature,
        "ref_scale": ref_scale or 1.0,
        "ref_count": ref_count or 1,
        "ranks": world,
        "sharded": True,
        "owners": owners,
        "stream_total": stream_total,
    }


def _take(params: list[_Shard], kinds, grads, skip: bool) -> dict[str, dict[str, Any]]:
    """This batch's full-size local quantities, removed from the unsharded parameters."""
    values: dict[str, dict[str, Any]] = {"grad": {}}
    for f in kinds:
        values[f] = {}
    for s in params:
        p = s.unsharded
        grad = grads.pop(id(p), None) if p is not None else None
        if grad is not None and skip:
            grad = torch.zeros_like(grad)
        if grad is None:
            raise ValueError(
                f"Parameter {s.name} got no gradient in this batch: accumulate needs every "
                "trainable parameter to take part in the loss (freeze unused ones)."
            )
        values["grad"][s.name] = grad
        for f in kinds:
            # where the quantity lands: on the unsharded parameter, or on the sharded one when
            # the module's rule ran before FSDP gathered it again for the backward
            value = None
            for holder in (p, s.param):
                if value is None and not skip:
                    value = getattr(holder, f, None)
            if value is None and not skip:
                raise ValueError(
                    f"Parameter {s.name} got no {f!r} in this batch (is its layer supported by "
                    "this extension? see the warnings)."
                )
            refused = isinstance(kinds[f], KronKind) or getattr(kinds[f], "dim", 0) != 0
            if skip and refused:  # no factors or rows for a batch without loss terms
                kinds[f].skip(None, BatchScale(0, 1.0, 0), s.name, s.param)  # raises
            values[f][s.name] = value
            _clean(s, [f])
    return values


def _clean(s: _Shard, fields) -> None:
    """Delete the quantities `fields` from the unsharded and sharded parameter."""
    for holder in (s.unsharded, s.param):
        for f in fields:
            if holder is not None and f in holder.__dict__:
                delattr(holder, f)


def _add(
    params, kinds, states, grad_state, values, info: BatchScale, batch_count, group, owners
) -> list[tuple[str, str, Tensor | None, Tensor]]:
    """Reduce-scatter one batch's scaled contributions and add them to the shard states.

    Kronecker factors go whole to their parameter's owner (`owners`); the other ranks keep
    shape-only placeholders (tensors on the meta device). Returns the per-sample rows, which
    stay on this rank, for `_add_rows`: `[(field, name, rows or None to skip, parameter)]`.
    """
    rows: list[tuple[str, str, Tensor | None, Tensor]] = []
    world, me = dist.get_world_size(group), dist.get_rank(group)
    items: list[tuple[Any, Tensor]] = []
    slots: list[tuple[str, str, str]] = []  # (field, name, part)
    # sums of the Kinds that keep float64 states travel in float64 (`wide`: then one process's
    # in any split of the data), each contribution cast as it is copied into the buffer
    for s in params:
        dtype = s.param.dtype  # FSDP's sharded dtype (mixed precision computes in another)
        grad = values["grad"].pop(s.name).to(dtype) * info.scale
        items.append((s, grad))
        slots.append(("grad", s.name, ""))
        for f, kind in kinds.items():
            value = values[f].pop(s.name)
            if isinstance(kind, KronKind):
                if len(value) not in (1, 2):
                    raise ValueError(f"{f} of {s.name} has {len(value)} factors, not 1 or 2.")
                kind.dtype = kind.dtype or dtype
                scales = [info.scale, info.count_scale]
                for i, factor in enumerate(value):
                    factor = factor.to(dtype) if scales[i] == 1 else factor.to(dtype) * scales[i]
                    owned = _Owned(owners[s.name], tuple(factor.shape), world, wide_dtype(factor))
                    items.append((owned, factor))
                    slots.append((f, s.name, f"kron{i}"))
                del value
                continue
            if value is not None and value.is_floating_point():
                value = value.to(dtype)
            if isinstance(kind, Rows):  # this rank's rows (of whole parameters)
                rows.append((f, s.name, value, s.param))
                continue
            if isinstance(kind, VarianceKind):
                n = info.num_samples
                var = torch.zeros_like(grad) if value is None else value * info.scale**2
                mean = grad / n
                items += [(s, var * n), (s, mean * grad)]  # n var, n mean²
                slots += [(f, s.name, "var"), (f, s.name, "sq")]
                continue
            if value is None:
                value = torch.zeros_like(grad)
            elif info.scale != 1:
                value = value * info.scale**kind.power
            if getattr(kind, "widen", False) and wide_dtype(value) != value.dtype:
                kind.dtype = kind.dtype or dtype
                items.append((_Wide(s), value))
            else:
                items.append((s, value))
            slots.append((f, s.name, ""))
    reduced = _reduce_scatter(group, items, "reduce the batch's quantities", consume=True)
    batch_grad: dict[str, Tensor] = {}
    parts: dict[tuple[str, str], dict[str, Tensor]] = {}
    kron: dict[tuple[str, str], list[tuple[tuple[int, ...], Tensor]]] = {}
    for (f, name, part), value, (owned, _) in zip(slots, reduced, items):
        if part.startswith("kron"):
            kron.setdefault((f, name), []).append((owned.shape, value))
        elif f == "grad":
            batch_grad[name] = value
            grad_state[name] = _added(grad_state[name], value)
        elif part:
            parts.setdefault((f, name), {})[part] = value
        else:
            states[f][name] = _added(states[f][name], value)
    for (f, name), factors in kron.items():
        if owners[name] == me:
            state = states[f][name]
            if state is not None and len(state) != len(factors):
                raise ValueError(f"{f} of {name}: different numbers of factors in two batches.")
            states[f][name] = (
                [v.clone() for _, v in factors]
                if state is None
                else [_added(x, v) for x, (_, v) in zip(state, factors)]
            )
        elif states[f][name] is None:
            dtype = factors[0][1].dtype
            states[f][name] = [
                torch.empty(shape, dtype=dtype, device="meta") for shape, _ in factors
            ]
    for (f, name), p in parts.items():
        n = batch_count
        mean = batch_grad[name] / n
        spread = (p["sq"] - mean.square() * n).clamp_min(0)
        var = (p["var"] + spread) / n
        states[f][name] = kinds[f].merge(states[f][name], (n, mean, var))
    return rows


def _added(state: Tensor | None, value: Tensor) -> Tensor:
    """`state + value`, in place (the sweep's own accumulator), or a copy of the first value."""
    return value.clone() if state is None else state.add_(value)


def _add_rows(rows, kinds, states, info: BatchScale) -> None:
    """Keep (or stream to the callback) this rank's rows of one batch; zeros without a loss."""
    for f, name, value, param in rows:
        kind = kinds[f]
        if value is None:
            states[f][name] = kind.skip(states[f][name], info, name, param)
        else:
            states[f][name] = kind.add(states[f][name], value, info, name, None)


def landing(model: nn.Module) -> Any:
    """`p -> (holders...)`: where a backward's quantities of each parameter of `model` land.

    On an FSDP2 model a backward in `backpack(...)` writes to FSDP's unsharded parameter (or,
    for a rule that ran before FSDP gathered the module again, to the sharded one); elsewhere
    to the parameter itself. Call it after a forward (FSDP2 creates the unsharded ones then).
    """
    fsdp = _fsdp_params(model)

    def holders(p: Tensor) -> tuple[Tensor, ...]:
        unsharded = getattr(fsdp.get(id(p)), "_unsharded_param", None)
        return (p,) if unsharded is None else (unsharded, p)

    return holders


def plain_zeros(p: Tensor, *leading: int) -> Tensor:
    """Zeros `[*leading, *p.shape]` of `p`'s dtype on its device (a plain tensor for DTensors)."""
    local = p.to_local() if hasattr(p, "to_local") else p
    return torch.zeros(*leading, *p.shape, dtype=p.dtype, device=local.device)


def lockstep(batches: Any, what: str, key: Any = None) -> Any:
    """The batches of this rank, each only once every rank of backpack's group has one.

    FSDP2 runs collectives in every forward and backward, so the ranks must take the same number
    of batches: before each batch the ranks agree that all (or none) have one, and that none
    failed to read it. `key(batch) -> float`: a digest that must be equal on every rank (the
    same data everywhere), else every rank raises.
    """
    group = _dist._group()
    index = 0
    iterator = iter(batches)
    while True:
        batch, error, digest_of = None, None, 0.0
        try:
            batch = next(iterator)
            digest_of = float(key(batch)) if key is not None else 0.0
        except StopIteration:
            pass
        except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
            error = err
        flags = [float(error is not None), float(batch is not None), digest_of]
        table = _gather(group, flags, "agree on a batch", what)
        _agreed(table, error, f"before batch {index}", what)
        has = table[:, 1].tolist()
        if not any(has):
            return
        if not all(has):
            raise RuntimeError(
                f"{what} (FSDP2): the ranks have different numbers of batches: ranks "
                f"{[r for r, h in enumerate(has) if h]} have a batch {index}, ranks "
                f"{[r for r, h in enumerate(has) if not h]} have none. FSDP2 runs collectives in "
                "every forward and backward, so every rank must take the same number of "
                "batches (their sizes may differ)."
            )
        if key is not None and len(set(table[:, 2].tolist())) > 1:
            raise RuntimeError(
                f"{what} (FSDP2): the ranks' batch {index} differ; this data must be the same "
                "on every rank (the query examples of a sharded model are scored by all ranks)."
            )
        yield batch
        index += 1


def batch_results(sweep: Any, work: Any, desc: str, key: Any = None) -> Any:
    """`(batch, work(batch))` for each batch of `sweep`; on an FSDP2 model in lockstep.

    On FSDP2 (`sweep.sharded`) the ranks take their batches together (`lockstep`, with `key`)
    and agree after each batch's `work`, so that an error on one rank raises on every rank.
    """
    batches = sweep.batches(desc)
    if sweep.sharded:
        batches = lockstep(batches, sweep.what, key)
    for batch in batches:
        error, result = None, None
        try:
            result = work(batch)
        except Exception as err:  # noqa: BLE001 - on FSDP2 agreed with the other ranks first
            error = err
        if sweep.sharded:
            agree_done(error, sweep.what)
        elif error is not None:
            raise error
        yield batch, result


def agree_done(error: BaseException | None, what: str) -> None:
    """After a rank's part of a batch: raise its error, or on every rank one naming who failed."""
    table = _gather(_dist._group(), [float(error is not None)], "agree on a batch", what)
    _agreed(table, error, "in a batch", what)


def reshard(model: nn.Module) -> None:
    """Free the parameters FSDP2 gathered in a forward without a backward (the root keeps them)."""
    for module in model.modules():
        release = getattr(module, "reshard", None)
        if callable(release) and type(module).__name__.startswith("FSDP"):
            release()
