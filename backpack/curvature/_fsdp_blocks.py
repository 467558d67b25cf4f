"""Block-diagonal operators (`KFAC`) of a model sharded with FSDP2: one owner rank per block.

Every block's factors live whole on one rank, its owner (`accumulate` reduces them there,
`_fsdp.assign_owners` balances the factor bytes over the ranks); every rank knows the owners and
the blocks' shapes. A vector is this rank's local shards, the concatenation of
`p.to_local().reshape(-1)` over the trainable parameters. A product routes each block's shards
to its owner (one `gather` per owner), the owner applies its blocks, and the rows go back to
the ranks that hold them (one `scatter` per owner). Errors are agreed between the ranks before
and after the owners' work, so that a failing rank makes every rank raise instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack import distributed as _dist
from backpack.curvature._blocks import BlockLayout
from backpack.curvature._fsdp import (
    _Shard,
    check_replicas,
    replica_digest,
    replica_holder,
    shards,
)


class ShardedBlocks:
    """The routing of an FSDP2 model's local shards to the owners of its blocks.

    Args:
        model: The FSDP2 model.
        blocks: Every block (owned here or not), in the parameters' order.
        owners: `{block name: owner rank}`.
        group: Backpack's process group (every rank).
        what: The tool, named in errors.
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[BlockLayout],
        owners: dict[str, int],
        group: Any,
        what: str,
    ) -> None:
        self.group = group
        self.what = what
        self.world = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.shards: dict[str, _Shard] = {s.name: s for s in shards(model, group)}
        self.names = list(self.shards)
        self.blocks = list(blocks)
        self.owner = {b.name: owners[b.name] for b in self.blocks}

    @property
    def local_shapes(self) -> list[tuple[int, ...]]:
        """This rank's shard shape of every parameter."""
        return [s.chunk_shape(s.chunk_of[self.me]) for s in self.shards.values()]

    @property
    def local_numels(self) -> list[int]:
        """This rank's number of entries of every parameter."""
        return [int(torch.Size(shape).numel()) for shape in self.local_shapes]

    def owned(self) -> list[BlockLayout]:
        """The blocks this rank owns."""
        return [b for b in self.blocks if self.owner[b.name] == self.me]

    # --- agreement ---------------------------------------------------------------------------
    def agree(self, error: BaseException | None, values: Sequence[float], step: str) -> Tensor:
        """All-gather `[error flag, *values]` per rank; raise on every rank if one failed.

        Returns:
            The `[world, len(values)]` table of the ranks' values.
        """
        device = _dist._header_device(self.group)
        own = torch.tensor([float(error is not None), *values], dtype=torch.float64)
        own = own.to(device)
        table = [torch.zeros_like(own) for _ in range(self.world)]
        try:
            dist.all_gather(table, own, group=self.group)
        except Exception as err:  # pragma: no cover - a rank died or timed out
            raise RuntimeError(
                f"{self.what} (FSDP2) could not {step}: a rank did not get there within "
                f"{_dist.TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S)."
            ) from err
        result = torch.stack(table).cpu()
        if error is not None:
            raise error
        bad = [r for r, f in enumerate(result[:, 0].tolist()) if f]
        if bad:
            raise RuntimeError(
                f"{self.what} (FSDP2): rank {bad[0]} failed to {step} (see its error); every "
                "rank stops here."
            )
        return result[:, 1:]

    def total(self, compute: Callable[[], float | Tensor], step: str) -> Tensor:
        """The sum over the ranks of `compute()` (this rank's owned blocks' part), on every rank."""
        error, value = None, 0.0
        try:
            value = float(compute())
        except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
            error = err
        table = self.agree(error, [value], step)
        return table[:, 0].sum()

    # --- routing -----------------------------------------------------------------------------
    def _run(self, step: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, group=self.group, **kwargs)
        except Exception as err:  # pragma: no cover - a rank died or timed out
            raise RuntimeError(
                f"{self.what} (FSDP2) could not {step}: a rank did not get there within "
                f"{_dist.TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S)."
            ) from err

    def _sizes(self, names: Sequence[str], k: int, rank: int) -> list[int]:
        shards_ = [self.shards[n] for n in names]
        return [k * int(torch.Size(s.chunk_shape(s.chunk_of[rank])).numel()) for s in shards_]

    def apply(
        self,
        pieces: dict[str, Tensor] | None,
        k: int,
        fn: Callable[[BlockLayout, Tensor | None], Tensor],
        like: Tensor,
        step: str,
    ) -> dict[str, Tensor]:
        """This rank's rows of `fn(block, block's whole [K, numel] input)` for every block.

        `pieces` are this rank's `[K, *local shape]` shards per parameter (None: `fn` gets None,
        e.g. for a diagonal); `fn` returns the block's `[K, numel]` rows (parameters' order) and
        runs on the block's owner only. `like` gives the dtype and device of the buffers. A
        collective: every rank calls it with the same `k`.

        Returns:
            `{parameter name: [K, *local shape]}`.
        """
        by_owner = self._by_owner()
        full = {} if pieces is None else self.collect(pieces, k, like, step)
        # 2. the owner's blocks, errors agreed before anyone waits for rows
        results: dict[str, Tensor] = {}
        error = None
        try:
            for b in by_owner[self.me]:
                v = None if pieces is None else b.gather(full)
                out = fn(b, v)
                results.update(
                    {n: r.reshape(k, *self.shards[n].shape) for n, r in b.scatter(out).items()}
                )
        except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
            error = err
        full.clear()
        self.agree(error, [], step)
        # 3. the rows back to the ranks that hold them
        mine: dict[str, Tensor] = {}
        for owner, blocks in enumerate(by_owner):
            names = [n for b in blocks for n in b.names]
            if not names:
                continue
            length = max(max(sum(self._sizes(names, k, g)) for g in range(self.world)), 1)
            recv = like.new_empty(length)
            src = dist.get_global_rank(self.group, owner)
            if owner == self.me:
                outgoing = []
                for g in range(self.world):
                    buf = like.new_zeros(length)
                    offset = 0
                    for n in names:
                        s = self.shards[n]
                        chunk = _chunk_rows(s, results[n], s.chunk_of[g])
                        buf[offset : offset + chunk.numel()] = chunk.reshape(-1)
                        offset += chunk.numel()
                    outgoing.append(buf)
                self._run(f"{step} (scatter)", dist.scatter, recv, outgoing, src=src)
                del outgoing
            else:
                self._run(f"{step} (scatter)", dist.scatter, recv, None, src=src)
            offset = 0
            for n, size in zip(names, self._sizes(names, k, self.me)):
                s = self.shards[n]
                mine[n] = recv[offset : offset + size].view(k, *s.chunk_shape(s.chunk_of[self.me]))
                offset += size
        return mine

    def _by_owner(self) -> list[list[BlockLayout]]:
        by_owner: list[list[BlockLayout]] = [[] for _ in range(self.world)]
        for b in self.blocks:
            by_owner[self.owner[b.name]].append(b)
        return by_owner

    def collect(
        self, pieces: dict[str, Tensor], k: int, like: Tensor, step: str
    ) -> dict[str, Tensor]:
        """Every block's whole parameters `[K, *shape]` on its owner, from the ranks' shards.

        `pieces` are this rank's `[K, *local shape]` shards of every parameter. A collective
        (one `gather` per owner); the result holds the parameters of the blocks this rank owns.
        """
        full: dict[str, Tensor] = {}
        for owner, blocks in enumerate(self._by_owner()):
            names = [n for b in blocks for n in b.names]
            if not names:
                continue
            length = max(sum(self._sizes(names, k, g)) for g in range(self.world))
            send = like.new_zeros(max(length, 1))
            offset = 0
            for n, size in zip(names, self._sizes(names, k, self.me)):
                send[offset : offset + size] = pieces[n].reshape(-1)
                offset += size
            dst = dist.get_global_rank(self.group, owner)
            if owner == self.me:
                received = [torch.empty_like(send) for _ in range(self.world)]
                self._run(f"{step} (gather)", dist.gather, send, received, dst=dst)
                full.update(self._assemble(names, received, k))
            else:
                self._run(f"{step} (gather)", dist.gather, send, None, dst=dst)
            del send
        return full

    def _assemble(self, names: Sequence[str], received: list[Tensor], k: int) -> dict[str, Tensor]:
        """Whole `[K, *shape]` parameters from every rank's gathered shards.

        Under HSDP a chunk arrives from each replica group; the holder's copy is taken.
        """
        chunks: dict[str, list[tuple[int, Tensor]]] = {n: [] for n in names}
        for g, buf in enumerate(received):
            offset = 0
            for n, size in zip(names, self._sizes(names, k, g)):
                s = self.shards[n]
                index = s.chunk_of[g]
                if s.holder[index] == g:
                    piece = buf[offset : offset + size].view(k, *s.chunk_shape(index))
                    chunks[n].append((index, piece))
                offset += size
        out = {}
        for n in names:
            s = self.shards[n]
            ordered = [c for _, c in sorted(chunks[n], key=lambda item: item[0])]
            out[n] = torch.cat(ordered, dim=1 + s.dim)
        return out


def _chunk_rows(s: _Shard, value: Tensor, index: int) -> Tensor:
    """Chunk `index` of `[K, *shape]` rows of parameter `s` (along its sharded dimension)."""
    step = -(-s.shape[s.dim] // s.chunks)
    size = s.shape[s.dim]
    start = min(size, index * step)
    return value.narrow(1 + s.dim, start, s.chunk_shape(index)[s.dim])


def refuse_dense(what: str) -> NotImplementedError:
    """The error of `to_dense` (or `to_scipy`) on a sharded operator (`what`: the method)."""
    if "." not in what:
        what = f"{what}.to_dense()"
        why = "the dense [P, P] matrix would hold the whole model's curvature on every rank"
    else:
        what = f"{what}()"
        why = "SciPy's solvers would take inner products of each rank's local shards"
    return NotImplementedError(
        f"{what} is not available on a model sharded with FSDP2 (fully_shard): {why}. Use products "
        "(op @ V with V this rank's local shards), diagonal(), trace() or logdet(), or build "
        "the operator on a replicated copy of the model (docs: 'Distributed sweeps')."
    )


def sharded_matmul(
    op: Any,
    routing: ShardedBlocks,
    v: Any,
    fn: Callable[[BlockLayout, Tensor], Tensor],
) -> Tensor:
    """`op @ v` of a block-diagonal operator on an FSDP2 model (a collective).

    `v` is `[P_local]` or `[P_local, K]`, this rank's local shards (see the module doc); the
    result has its shape: this rank's rows of the product. `fn(block, [K, numel])` applies one
    block on its owner.

    Raises:
        TypeError, ValueError: On every rank, when one rank's `v` is not a tensor of the right
            shape or the ranks multiply different numbers of columns.
    """
    error, k, V = None, 0, None
    size = sum(routing.local_numels)
    try:
        if not isinstance(v, Tensor):
            raise TypeError(f"{routing.what} multiplies tensors, got {type(v).__name__}.")
        if v.dim() not in (1, 2) or v.shape[0] != size:
            raise ValueError(
                f"{routing.what} on a model sharded with FSDP2 multiplies [P_local] or "
                f"[P_local, K] tensors, this rank's local shards (the concatenation of "
                f"p.to_local().reshape(-1) over the trainable parameters) with P_local = {size} "
                f"on this rank, got shape {tuple(v.shape)}."
            )
        k = 1 if v.dim() == 1 else v.shape[1]
        V = v.reshape(size, -1).to(device=op.device, dtype=op.dtype)
        parts = V.split(routing.local_numels, dim=0)  # explicit K: a rank's shard may be empty
        shapes = routing.local_shapes
        pieces = {n: b.T.reshape(k, *s) for n, b, s in zip(routing.names, parts, shapes)}
    except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
        error = err
    # under HSDP, a digest of each rank's rows to compare with its chunks' holder's
    chunk_maps = [s.chunk_of for s in routing.shards.values()]
    holder = replica_holder(chunk_maps, routing.me, routing.what)
    digest = [] if holder is None else [holder, *replica_digest(V)]
    table = routing.agree(error, [k, *digest], "check the vectors")
    if len(set(table[:, 0].tolist())) > 1:
        raise ValueError(
            f"{routing.what} @ V on an FSDP2 model is a collective: every rank must multiply "
            f"the same number of columns, got {[int(x) for x in table[:, 0].tolist()]}."
        )
    if holder is not None:
        check_replicas(table[:, [2, 3, 4, 5, 1]], f"{routing.what} @ V")
    rows = routing.apply(pieces, k, fn, V, "multiply")
    out = torch.cat([rows[n].reshape(k, -1) for n in routing.names], dim=1).T
    return out.reshape(v.shape)


def sharded_diagonal(
    routing: ShardedBlocks, fn: Callable[[BlockLayout], Tensor], like: Tensor
) -> Tensor:
    """This rank's rows `[P_local]` of a block-diagonal operator's diagonal (a collective).

    `fn(block)` is the block's `[numel]` diagonal in the parameters' order, on its owner.
    """
    rows = routing.apply(None, 1, lambda b, _: fn(b)[None], like, "form the diagonal")
    return torch.cat([rows[n].reshape(-1) for n in routing.names])
