"""Attribution on a model sharded with FSDP2 (`fully_shard`): each block of the fit on one rank.

A fit's blocks (one per parameter, or per layer with a folded bias) are spread over the ranks
like the Kronecker factors of `KFAC` on such a model: each block lives whole on one owner rank
(`_fsdp.assign_owners`, balancing bytes; KFAC's and EKFAC's own owners where they fit), the other
ranks hold shape-only (meta) placeholders. A whole block on one rank is what its eigenbasis
needs (a rotation mixes every entry of the layer), and spread over W ranks the fit takes about
1/W of its size per rank.

The query gradients are preconditioned by the owners: every rank runs the (same) query batches
through the sharded model and keeps the preconditioned rows of its own blocks only, `[Q, P/W]`
in all. Scoring a training batch (each rank its own shard of the training set) lends one block at
a time: its owner broadcasts the block's preconditioned query rows (or their low-rank factors),
every rank takes the products with its own samples' gradients of that block (whole, from FSDP's
unsharded parameters in the backward) and frees the rows before the next block. A rank thus holds
its own blocks' rows and one lent block; the per-sample gradients never leave their rank. The
other way, sending each training sample's gradients to the owners, would move `N·P` numbers per
batch instead of `Q·P` (fewer queries than training samples per batch, in every use we know), or
`Q·r·(m + k)` per layer with `query_rank=r`.

Self-influence lends the blocks themselves (eigenvectors and damped inverse eigenvalues) the same
way; "identity" needs no block at all.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack import distributed as _dist
from backpack.curvature._data import trainable
from backpack.curvature._fsdp import assign_owners
from backpack.influence._lowrank import LowRank
from backpack.influence._sites import Site


class Placement:
    """Which rank holds each block of a fit on an FSDP2 model, and lending blocks to all ranks.

    Args:
        owner: `{block name: rank}`.
        members: `{block name: [parameter names]}` (the weight first), in the fit's order.
        device: Where lent tensors go on the ranks that do not own them.
    """

    def __init__(
        self, owner: Mapping[str, int], members: Mapping[str, list[str]], device: torch.device
    ) -> None:
        self.group = _dist._group()
        self.me = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.owner = {name: int(owner[name]) for name in members}
        self.members = {name: list(names) for name, names in members.items()}
        self.device = device
        #: number of broadcasts of lent values
        self.lent = 0

    @classmethod
    def balanced(
        cls, sizes: Mapping[str, int], members: Mapping[str, list[str]], device: torch.device
    ) -> Placement:
        """Owners that balance the blocks' `sizes` (entries) over the ranks."""
        world = dist.get_world_size(_dist._group())
        return cls(assign_owners(dict(sizes), world), members, device)

    def owns(self, block: str) -> bool:
        """Whether this rank holds `block`."""
        return self.owner[block] == self.me

    def owned_names(self) -> set[str]:
        """The parameters of this rank's blocks."""
        return {n for b, names in self.members.items() if self.owns(b) for n in names}

    def lend(self, block: str, value: Any) -> Any:
        """`value` (tensors in lists, dicts, `LowRank`s, `Site`s) of `block`'s owner, on every rank.

        A collective: every rank calls it for the same block; `value` is read on the owner only.
        """
        owner = self.owner[block]
        src = dist.get_global_rank(self.group, owner)
        tensors: list[Tensor] = []
        spec = _flatten(value, tensors) if owner == self.me else None
        header = [spec, [(tuple(t.shape), t.dtype) for t in tensors]]
        cuda = self.device if self.device.type == "cuda" else None
        try:
            dist.broadcast_object_list(header, src=src, group=self.group, device=cuda)
            spec, layout = header
            dtypes = list(dict.fromkeys(dtype for _, dtype in layout))
            out: list[Tensor | None] = [None] * len(layout)
            for dtype in dtypes:  # one broadcast per dtype
                picked = [i for i, (_, d) in enumerate(layout) if d == dtype]
                sizes = [int(torch.Size(layout[i][0]).numel()) for i in picked]
                if owner == self.me:
                    flat = torch.cat([tensors[i].reshape(-1).to(self.device) for i in picked])
                else:
                    flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
                dist.broadcast(flat, src=src, group=self.group)
                for i, piece in zip(picked, flat.split(sizes)):
                    out[i] = piece.view(layout[i][0])
        except Exception as err:  # pragma: no cover - a rank died or timed out
            raise RuntimeError(
                f"backpack.influence (FSDP2) could not lend block {block} from rank {owner}: a "
                f"rank did not get there within {_dist.TIMEOUT_S:g} s "
                "(backpack.distributed.TIMEOUT_S)."
            ) from err
        self.lent += 1
        if owner == self.me:
            return value
        return _unflatten(spec, iter(out))


def _flatten(value: Any, tensors: list[Tensor]) -> Any:
    """A picklable description of `value` with its tensors appended to `tensors`."""
    if isinstance(value, Tensor):
        tensors.append(value.detach())
        return ("tensor",)
    if isinstance(value, LowRank):
        return (
            "lowrank",
            value.shape,
            _flatten(value.left, tensors),
            _flatten(value.right, tensors),
        )
    if isinstance(value, Site):
        parts = (_flatten(value.left, tensors), _flatten(value.right, tensors))
        return ("site", value.kind, value.shape, *parts)
    if isinstance(value, Mapping):
        return ("dict", [(k, _flatten(v, tensors)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return ("list", [_flatten(v, tensors) for v in value])
    return ("plain", value)


def _unflatten(spec: Any, tensors: Iterable[Tensor]) -> Any:
    """Inverse of `_flatten` (`tensors` an iterator, in order)."""
    kind = spec[0]
    if kind == "tensor":
        return next(tensors)
    if kind == "lowrank":
        return LowRank(spec[1], _unflatten(spec[2], tensors), _unflatten(spec[3], tensors))
    if kind == "site":
        return Site(spec[1], spec[2], _unflatten(spec[3], tensors), _unflatten(spec[4], tensors))
    if kind == "dict":
        return {k: _unflatten(v, tensors) for k, v in spec[1]}
    if kind == "list":
        return [_unflatten(v, tensors) for v in spec[1]]
    return spec[1]


def device_of(model: nn.Module) -> torch.device:
    """The device of the first parameter's local shard."""
    p = next(model.parameters())
    return (p.to_local() if hasattr(p, "to_local") else p).device


def meta_like(block: Any) -> Any:
    """A shape-only (meta) copy of an `EigenBlock` (what the ranks that do not own it hold)."""
    out = copy.copy(block)
    out.vectors = [torch.empty_like(v, device="meta") for v in block.vectors]
    out.values = torch.empty_like(block.values, device="meta")
    return out


def block_sizes(blocks: list[Any]) -> dict[str, int]:
    """`{block name: entries}` of eigenvectors and eigenvalues (shapes only: meta works)."""
    return {b.name: sum(v.numel() for v in b.vectors) + b.values.numel() for b in blocks}


def placed(blocks: list[Any], placement: Placement) -> list[Any]:
    """The blocks with shape-only placeholders for those this rank does not own."""
    return [b if placement.owns(b.name) else meta_like(b) for b in blocks]


def lent_block(block: Any, placement: Placement, values_of: Any) -> Any:
    """`block` whole on every rank, with `values_of(block)` as its values (a collective).

    The owner lends the eigenvectors and values; it keeps its own block when they are its own.
    """
    own = placement.owns(block.name)
    mine = (block.vectors, values_of(block)) if own else None
    vectors, values = placement.lend(block.name, mine)
    if own and values is block.values:
        return block
    out = copy.copy(block)
    out.vectors, out.values = list(vectors), values
    return out


def lent_blocks(
    blocks: list[Any], scale_of: Any, placement: Placement
) -> Iterable[tuple[Any, Tensor]]:
    """Each block whole with its damped inverse eigenvalues `scale_of(block)`, one at a time."""
    for b in blocks:
        lent = lent_block(b, placement, scale_of)
        yield lent, lent.values


def place(model: nn.Module, blocks: list[Any] | None) -> Placement:
    """The placement of a fit from its blocks' sizes ("identity", None: one per parameter).

    Shapes decide it, so whole blocks and shape-only ones give the same placement.
    """
    if blocks is None:
        params = trainable(model)
        members = {name: [name] for name, _ in params}
        sizes = {name: p.numel() for name, p in params}
    else:
        members = {b.name: b.names for b in blocks}
        sizes = block_sizes(blocks)
    return Placement.balanced(sizes, members, device_of(model))


def whole_blocks(blocks: list[Any], placement: Placement, keep: bool = True) -> list[Any]:
    """Every block whole, lent by its owner in turn (a collective); `keep=False`: none kept."""
    out = []
    for b in blocks:
        lent = lent_block(b, placement, lambda block: block.values)
        if keep:
            out.append(lent)
    return out
