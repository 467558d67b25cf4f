"""EK-FAC's corrected eigenvalues on a model sharded with FSDP2: eigenbases lent just in time.

Each block's Kronecker factors and eigenbasis live whole on one owner rank (`_fsdp`,
`_fsdp_blocks`). Its corrected eigenvalues `R Σ_n (q_kᵀ ∇ℓ_n)²` need every sample's gradient
rotated into that eigenbasis, and the samples are spread over the ranks. The correction sweep
is the sharded sweep (`_fsdp.sharded_sweep`) of backpack's diagonal extension with `_eigen`'s
rules lent to every `nn.Linear` and convolution, as without FSDP: each rank squares its own
samples' rotated gradients inside the backward (on FSDP's unsharded parameters), the sums are
reduce-scattered like diagonals and then gathered whole on the block's owner.

A rank needs a layer's eigenbases only while that layer's rule runs. They are broadcast from
their owners when the rule (or the gradient of the layer's output) first needs them in a
backward, and the previous layer's are freed: a rank holds at most one layer's eigenbases
besides the ones it owns, and every rank rotates its own samples in parallel. The other way,
sending the per-sample quantities to the owners (each sample's inputs and backpropagated
factor columns, `N·T·(a + V·g)` numbers per layer and batch for `N` samples of `T` positions,
`V` columns, a `[g, a]` weight), would move more than the `g² + a²` of an eigenbasis for all
but the smallest batches, and would leave the rotations to the owners alone.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack import distributed as _dist
from backpack.api import disable
from backpack.context import CTX
from backpack.curvature._data import first_tensor
from backpack.curvature._distributed import all_sum as _all_sum
from backpack.curvature._eigen import EigenState, eigen_rules
from backpack.curvature._fsdp import _Owned, _reduce_scatter, reshard
from backpack.curvature._fsdp_blocks import ShardedBlocks
from backpack.curvature._quantities import wide_dtype
from backpack.curvature._rows import row_batches
from backpack.curvature.accumulate import accumulate_over


class JustInTime:
    """Each target layer's eigenbases on every rank while its backward runs, one layer at a time.

    Args:
        parts: `{module: [(block, owner rank, EigenState fields)]}`: the blocks whose
            eigenvectors (`block.vectors`, whole on the owner, shape-only elsewhere) fill those
            fields of the module's `EigenState` (`states`).
        states: `{module: EigenState}` of the lent rules.
        group: Backpack's process group.
        device: Where the broadcast eigenbases go.
    """

    def __init__(
        self,
        parts: Mapping[nn.Module, list[tuple[Any, int, list[str]]]],
        states: Mapping[nn.Module, EigenState],
        group: Any,
        device: torch.device,
    ) -> None:
        self.parts = parts
        self.states = states
        self.group = group
        self.device = device
        self.me = dist.get_rank(group)
        self.current: nn.Module | None = None
        #: number of broadcasts (one per layer and batch, plus one per separate bias block)
        self.broadcasts = 0
        for module in parts:
            self._release(module)
            states[module].fetch = lambda module=module: self.fetch(module)

    def _release(self, module: nn.Module) -> None:
        for _, owner, fields in self.parts[module]:
            if owner != self.me:
                for field in fields:
                    setattr(self.states[module], field, None)

    def release(self) -> None:
        """Free the eigenbases of the layer held now (those this rank does not own)."""
        if self.current is not None:
            self._release(self.current)
        self.current = None

    def fetch(self, module: nn.Module) -> None:
        """Broadcast `module`'s eigenbases from their owners (a collective), freeing the last."""
        if self.current is module:
            return
        self.release()
        for block, owner, fields in self.parts[module]:
            values = broadcast_vectors(block, owner, self.group, self.device)
            self.broadcasts += 1
            if owner != self.me:
                for field, value in zip(fields, values):
                    setattr(self.states[module], field, value)
        self.current = module

    @contextmanager
    def hooked(self):
        """Fetch each target's eigenbases when its rule or its output's gradient needs them.

        Whichever comes first in a backward fetches; the other finds them present. The hook on
        the output makes every rank fetch, also one whose rule does not run (no factor reaches
        the layer); the rule's own call covers the engine taking the layer's quantities at a
        node before that output. Every rank runs the same layers' backwards in the same order
        (as FSDP2 needs too), so the broadcasts match.
        """

        def grad_hook(module: nn.Module) -> None:
            # not in backpack's own propagation of the curvature factors (an autograd pass
            # before the backward in which the rules run): a fetch there would be undone
            if not CTX.propagating:
                self.fetch(module)

        def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
            out = first_tensor(output)
            if torch.is_grad_enabled() and isinstance(out, Tensor) and out.requires_grad:
                out.register_hook(lambda grad, module=module: grad_hook(module))

        handles = [m.register_forward_hook(forward_hook) for m in self.parts]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.release()
            for state in self.states.values():
                state.fetch = None


def broadcast_vectors(block: Any, owner: int, group: Any, device: torch.device) -> list[Tensor]:
    """`block.vectors` (whole on the `owner` rank, shape-only elsewhere) on every rank."""
    if not block.vectors:
        return []
    shapes = [tuple(v.shape) for v in block.vectors]
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    mine = owner == dist.get_rank(group)
    if mine:
        flat = torch.cat([v.reshape(-1) for v in block.vectors]).to(device)
    else:
        flat = torch.empty(sum(sizes), dtype=block.vectors[0].dtype, device=device)
    try:
        dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
    except Exception as err:  # pragma: no cover - a rank died or timed out
        raise RuntimeError(
            f"EKFAC (FSDP2) could not broadcast the eigenbasis of {block.name}: a rank "
            f"did not get there within {_dist.TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S)."
        ) from err
    if mine:
        return list(block.vectors)
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def rows_correction(
    sweep: Any,
    blocks: list[Any],
    routing: ShardedBlocks,
    kind: str,
    mc_samples: int,
    device: torch.device,
) -> tuple[float, int]:
    """Corrected eigenvalues of `blocks` from per-sample rows, on their owners (FSDP2).

    For the blocks the correction sweep cannot take (embeddings, normalisations, dense blocks,
    tied or twice-called layers): each rank takes its own samples' rows of whole parameters
    (`row_batches`, from FSDP's unsharded parameters in the backward), rotates them with each
    block's eigenbasis, lent by its owner for that block and batch, and the squares are summed
    onto the owner (`_fsdp._Owned`). Sets the owners' `values`; returns the data's `Σ ν` and
    number of samples.
    """
    group, me = routing.group, routing.me
    world = dist.get_world_size(group)
    sums: dict[str, Tensor] = {}
    total, count = 0.0, 0
    for batch, rows, nu in row_batches(sweep, kind, mc_samples, "EKFAC eigenvalues"):
        total += nu
        count += batch.num_samples
        for b in blocks:
            owner = routing.owner[b.name]
            lent = copy.copy(b)
            lent.vectors = broadcast_vectors(b, owner, group, device)
            dtype = lent.vectors[0].dtype if lent.vectors else b.values.dtype
            picked = {n: rows[n].to(dtype) for n in b.names}
            squares = lent.squares(lent.gather(picked))
            # summed in float64 (cast into the reduce's buffer)
            item = (_Owned(owner, tuple(squares.shape), world, wide_dtype(squares)), squares)
            (received,) = _reduce_scatter(group, [item], "sum EKFAC's corrected eigenvalues")
            if owner == me:
                mine = received.view(squares.shape)
                sums[b.name] = mine.clone() if b.name not in sums else sums[b.name] + mine
        del rows
    total, count = _all_sum(group, [], [total, float(count)], None, "EKFAC")
    normaliser = sweep.total(total)
    for b in blocks:  # the owner's (the others hold shape-only values)
        if b.name in sums:
            b.values = (sums[b.name] / normaliser).to(b.values.dtype)
    return total, int(count)


def check_calls(
    model: nn.Module,
    targets: Mapping[nn.Module, list[str]],
    dtypes: Mapping[nn.Module, torch.dtype],
    X: Any,
) -> tuple[list[bool], int]:
    """Per target: called once in a forward of `X`, its parameters used only in that call.

    One forward with gradients (not backpropagated; buffers restored): the parameters the
    target's call holds (FSDP2's unsharded ones) must have the eigenbases' dtype (`dtypes`; not
    so under FSDP2's mixed precision) and each feed exactly one node of the output's autograd
    graph, the node of the target's own operation (`nn.Linear` and convolutions use each
    parameter once). A parameter also used outside the call (tied weights, functional uses)
    feeds more. Also returns the number of output entries per sample (the exact loss-Hessian
    factor's columns, for `_eigen.plan`).
    """
    buffers = [(b, b.clone()) for b in model.buffers()]
    calls: Counter = Counter()
    used: dict[nn.Module, list[Tensor]] = {}

    def pre_hook(module: nn.Module, args: Any) -> None:
        calls[module] += 1
        used[module] = [getattr(module, name) for name in targets[module]]

    handles = [m.register_forward_pre_hook(pre_hook) for m in targets]
    edges: Counter = Counter()
    try:
        with torch.enable_grad(), disable():
            out = first_tensor(model(X))
        width = out[0].numel() if isinstance(out, Tensor) and out.dim() > 0 else 1
        seen: dict[int, Any] = {}
        stack = [out.grad_fn] if isinstance(out, Tensor) and out.grad_fn is not None else []
        while stack:
            node = stack.pop()
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                variable = getattr(nxt, "variable", None)
                if variable is not None:
                    edges[id(variable)] += 1
                elif id(nxt) not in seen:
                    seen[id(nxt)] = nxt
                    stack.append(nxt)
        del out, seen, stack
    finally:
        for handle in handles:
            handle.remove()
        reshard(model)  # FSDP2 keeps the root gathered until a backward
        with torch.no_grad():  # running statistics are not this check's to update
            for buffer, saved in buffers:
                buffer.copy_(saved)
    ok = [
        calls[m] == 1 and all(edges[id(p)] == 1 and p.dtype == dtypes[m] for p in used.get(m, []))
        for m in targets
    ]
    return ok, width


def sharded_correction(
    sweep: Any,
    routing: ShardedBlocks,
    targets: Mapping[nn.Module, tuple[Any, Any]],
    states: Mapping[nn.Module, EigenState],
    extension: Any,
    device: torch.device,
) -> tuple[dict[str, Tensor], Any]:
    """The correction sweep on an FSDP2 model: the owners' whole eigen-diagonals, the result.

    `targets` are `{module: (weight block, own bias block or None)}`, `states` their lent
    rules' states (eigenbases filled just in time). Returns `{parameter name: [*shape]}` of the
    parameters of the blocks this rank owns (the squares summed over every rank's samples, as
    `accumulate` scales a diagonal) and the sweep's `Accumulated`.
    """
    group = routing.group
    parts = {}
    for module, (weight, bias) in targets.items():
        parts[module] = [(weight, routing.owner[weight.name], ["q_out", "q_in"])]
        if bias is not None:
            parts[module].append((bias, routing.owner[bias.name], ["q_bias"]))
    lending = JustInTime(parts, states, group, device)
    with eigen_rules(states), lending.hooked():
        result = accumulate_over(sweep, extension)
    local = result.quantity(extension.savefield)
    like = torch.empty(0, dtype=next(iter(local.values())).dtype, device=device)
    pieces = {n: local[n].reshape(1, *local[n].shape) for n in routing.names}
    full = routing.collect(pieces, 1, like, "gather EKFAC's corrected eigenvalues")
    return {n: v[0] for n, v in full.items()}, result
