"""What counts as a sample in one backward pass.

A backward's samples are defined by the extended loss calls it reaches, never by tensor shapes:

- module calls whose outputs reach a common loss call share their samples: row n of every such
  call is sample n (one forward with several losses; siamese calls meeting in one loss, whose
  rows are summed);
- calls that reach *different* loss calls with no call in common hold different samples: the
  backward's samples are the union, group after group in the order of the loss calls' forwards
  (`grad_batch` of a model run on X1 and X2 with separate losses has N1 + N2 rows);
- calls that reach no loss of the backward (unused forwards, earlier graphs still referenced) do
  not take part.

`SampleLayout.discover` finds the extended loss calls of the running backward (those whose input
autograd will run) and, when there are several, walks the graph from each to the recorded module
calls. With one loss or none, every call of the pass shares one set of samples and nothing is
walked unless a parameter has several live calls (then the walk tells how many take part).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backpack.context import CTX
from backpack.recording import (
    Record,
    call_params,
    container_records,
    describe,
    has_sample_free_records,
    live_loss_records,
    live_record_count,
    param_owners,
    records_at,
    sample_free,
    trainable_params,
    walk_nodes,
)
from backpack.rules import find_rule


def will_run(edge: Any) -> bool:
    """Whether the running backward pass will execute the node of `edge`."""
    return edge is not None and bool(torch._C._will_engine_execute_node(edge.node))


def loss_in_pass(record: Record) -> bool:
    """Whether the loss call of `record` takes part in the running backward pass.

    The node of the loss's own output is not kept (it would own the record that keeps it), so
    the test is on the loss's inputs: autograd runs them iff some root reaches them.
    """
    if record.freed or record.disabled:
        return False
    return any(will_run(e) for e in record.input_edges if e is not None)


def reachable_records(
    edges: list[Any],
    parents: dict[int, list[tuple[Any, int]]] | None = None,
    skip: dict[int, Any] | None = None,
) -> dict[int, tuple[Record, Any]]:
    """Recorded module calls reachable backward from `edges`: id -> (record, producing node).

    With `parents`, also collects the consumers of every node:
    id(node) -> [(consumer, index of the edge in its next_functions)]. Nodes in `skip` are not
    visited again (and newly visited ones are added to it).
    """
    found: dict[int, tuple[Record, Any]] = {}
    stack = [e.node for e in edges if e is not None]
    for node in walk_nodes(stack):
        if skip is not None:
            if id(node) in skip:
                continue
            skip[id(node)] = node
        for record, _, _ in records_at(node, freed=True):
            found[id(record)] = (record, node)
        for index, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            if parents is not None:
                parents.setdefault(id(child), []).append((node, index))
            stack.append(child)
    return found


#: nodes that only reshape: the gradient passes through them unchanged (up to its shape)
_RESHAPE_NODES = {
    "ViewBackward0",
    "ReshapeAliasBackward0",
    "UnsafeViewBackward0",
    "UnsqueezeBackward0",
    "ExpandBackward0",
    "CloneBackward0",
    "AliasBackward0",
    "ToCopyBackward0",
}

#: nodes a broadcast output may pass on its way to the additions: linear in it, no sample
#: mixing; the chain through them is mapped back by autograd (`where` masks the T5 decoder's
#: position bias and may bring in the sample axis itself, with a padding mask)
_AXIS_NODES = {
    "WhereBackward0",
    "PermuteBackward0",
    "TransposeBackward0",
    "TBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SqueezeBackward2",
}


#: entries of the columns one batched backward through a broadcast chain takes at once
_CHAIN_CHUNK_ELEMENTS = 2**24


class _Addition:
    """One addition that broadcasts a sample-free call's output over the samples."""

    def __init__(
        self,
        node: Any,
        scale: float,
        operand: GradientEdge | None = None,
        start: Any = None,
        out_shape: torch.Size | None = None,
    ) -> None:
        self.node = node
        #: factor between the addition's output gradient and this operand's (alpha, -1 for -)
        self.scale = scale
        #: the addition's input edge of this operand, the call's output node and its shape,
        #: when the chain between them moves axes (then autograd maps gradients back along it)
        self.operand = operand
        self.start = start
        self.out_shape = out_shape
        #: the gradient at the addition's output; through a chain, already the per-sample
        #: gradients at the call's output (mapped while the chain's saved tensors exist)
        self.captured: Tensor | None = None
        self.handle = node.register_prehook(self._capture)

    def _capture(self, grads: tuple) -> None:
        if self.operand is None or grads[0] is None:
            self.captured = grads[0]
        else:
            self.captured = self._per_sample_through_chain(grads[0], self.out_shape, 0)

    def captured_share(self, out_shape: torch.Size) -> Tensor | None:
        """`[N, *out_shape]` from the captured gradient (None if it cannot be split)."""
        if self.captured is None or self.operand is not None:
            return self.captured
        return self.per_sample(self.captured, out_shape)

    def close(self) -> None:
        """Remove the pre-hook and forget the captured gradient."""
        self.handle.remove()
        self.captured = None

    @property
    def edge(self) -> GradientEdge:
        """The gradient edge of the addition's output (a target for curvature factors)."""
        return GradientEdge(self.node, 0)

    def operand_grad(self, grad: Tensor) -> Tensor:
        """The broadcast operand's side of the output gradient `grad` (an addition passes it)."""
        return grad

    def per_sample(self, grad: Tensor, out_shape: torch.Size, lead: int = 0) -> Tensor | None:
        """`[*lead, N, *out_shape]` per-sample gradients from the addition's, or None.

        `grad` is `[*lead, *P]` with P the addition's output shape; None if P is not a broadcast
        of `out_shape` along a leading sample axis.
        """
        if self.operand is not None:
            return self._per_sample_through_chain(grad, out_shape, lead)
        p_shape = grad.shape[lead:]
        padded = (1,) * (len(p_shape) - len(out_shape)) + tuple(out_shape)
        if len(padded) != len(p_shape) or padded[0] != 1 or p_shape[0] <= 1:
            return None
        dims = []
        for i, (a, b) in enumerate(zip(padded, p_shape)):
            if a != b and a != 1:
                return None
            if i > 0 and a == 1 and b != 1:
                dims.append(lead + i)
        reduced = grad.sum(dims, keepdim=True) if dims else grad
        reduced = reduced.reshape(*grad.shape[:lead], p_shape[0], *out_shape)
        return reduced * self.scale if self.scale != 1 else reduced

    def _per_sample_through_chain(
        self, grad: Tensor, out_shape: torch.Size, lead: int
    ) -> Tensor | None:
        """Per-sample gradients at the operand, carried back to the call's output by autograd.

        The chain (permutes, transposes, unsqueezes, views) holds no saved tensors, so it can
        be backpropagated again, batched over the samples, after the main backward passed it.
        """
        node, nr = self.operand.node, self.operand.output_nr
        operand_shape = tuple(node._input_metadata[nr].shape)
        p_shape = grad.shape[lead:]
        padded = (1,) * (len(p_shape) - len(operand_shape)) + operand_shape
        n = p_shape[0]
        if len(padded) != len(p_shape) or padded[0] not in (1, n) or n <= 1:
            return None
        if any(a != b and a != 1 for a, b in zip(padded, p_shape)):
            return None
        dims = [lead + i for i, (a, b) in enumerate(zip(padded, p_shape)) if i and a == 1 != b]
        reduced = grad.sum(dims, keepdim=True) if dims else grad
        if self.scale != 1:
            reduced = reduced * self.scale
        reduced = reduced.reshape(-1, *padded)  # [lead, N or 1 ... ] -> rows of columns
        if padded[0] == 1:
            columns = reduced.reshape(-1, *operand_shape)  # [lead · N, *operand]
        else:
            # the operand carries the sample axis already (a mask brought it in): column n
            # keeps sample n's row of the operand's gradient, zero elsewhere
            rows = reduced.reshape(-1, n, *padded[1:])
            eye = torch.eye(n, dtype=rows.dtype, device=rows.device)
            eye = eye.reshape(1, n, n, *([1] * (len(padded) - 1)))
            columns = (rows.unsqueeze(1) * eye).reshape(-1, *operand_shape)
        parts = []
        chunk = max(1, _CHAIN_CHUNK_ELEMENTS // max(1, columns[0].numel()))
        with CTX.propagation(), torch.enable_grad():
            for block in columns.split(chunk):
                (result,) = torch.autograd.grad(
                    [self.operand],
                    [GradientEdge(self.start, 0)],
                    [block],
                    retain_graph=True,
                    is_grads_batched=True,
                )
                if result is None or tuple(result.shape[1:]) != tuple(out_shape):
                    return None
                parts.append(result)
        return torch.cat(parts).reshape(*grad.shape[:lead], n, *out_shape)


class _Product(_Addition):
    """A product that broadcasts a parameter over the samples (`x * gamma`).

    The pre-hook multiplies the product's output gradient by the other factor, read from the
    node's saved tensors while they exist; the per-sample share then sums like an addition's.
    """

    def __init__(self, node: Any, index: int) -> None:
        super().__init__(node, 1.0)
        #: the saved tensor of the other factor (the parameter is operand `index`)
        self._other = "_saved_self" if index == 1 else "_saved_other"

    def _capture(self, grads: tuple) -> None:
        self.captured = None if grads[0] is None else self.operand_grad(grads[0])

    def operand_grad(self, grad: Tensor) -> Tensor:
        """The parameter side's gradient: the output's times the other factor."""
        other = getattr(self.node, self._other)
        return grad * other.to(grad.dtype)


class BroadcastSite:
    """Where a call whose output holds no sample axis is broadcast over the samples.

    A position embedding `nn.Embedding(T, D)(torch.arange(T))` is added to `[N, T, D]` token
    embeddings: autograd sums the `[N, T, D]` gradient over the samples before it reaches the
    embedding. A pre-hook on each broadcasting addition keeps the gradient of each sample. The
    output may reach several additions (T5 adds its relative position bias in every layer),
    through views and permutes; the per-sample gradient sums their contributions.
    """

    def __init__(self, parts: list[_Addition]) -> None:
        self.parts = parts

    @property
    def captured(self) -> bool:
        """Whether every addition's gradient was captured in the running backward."""
        return all(part.captured is not None for part in self.parts)

    def captured_per_sample(self, out_shape: torch.Size) -> Tensor | None:
        """`[N, *out_shape]` per-sample gradients at the call's output from the captured ones."""
        total = None
        for part in self.parts:
            share = part.captured_share(out_shape)
            if share is None or (total is not None and share.shape != total.shape):
                return None
            total = share if total is None else total + share
        return total

    @property
    def edges(self) -> list[GradientEdge]:
        """The additions' output edges (targets for curvature factors)."""
        return [part.edge for part in self.parts]

    def per_sample(
        self, grads: list[Tensor], out_shape: torch.Size, lead: int = 0
    ) -> Tensor | None:
        """`[*lead, N, *out_shape]`: the sum of every addition's per-sample share, or None."""
        total = None
        for part, grad in zip(self.parts, grads):
            if grad is None:
                continue
            share = part.per_sample(grad, out_shape, lead)
            if share is None or (total is not None and share.shape != total.shape):
                return None
            total = share if total is None else total + share
        return total

    def close(self) -> None:
        """Remove the pre-hooks (end of the pass)."""
        for part in self.parts:
            part.close()


def _forward_shape(node: Any) -> tuple[int, ...] | None:
    """Shape of a node's (first) forward output, from autograd's metadata."""
    try:
        return tuple(node._input_metadata[0].shape)
    except (AttributeError, IndexError, RuntimeError):
        return None


def _adds_sample_axis(before: tuple[int, ...], after: tuple[int, ...] | None) -> bool:
    """Whether output shape `after` broadcasts operand shape `before` on a new leading axis."""
    if after is None or not after or after[0] <= 1:
        return False
    return len(after) > len(before) or (len(before) > 0 and before[0] == 1)


def _broadcast_site(
    record: Record, node: Any, parents: dict[int, list[tuple[Any, int]]]
) -> BroadcastSite | str | None:
    """The additions broadcasting `record`'s output (produced by `node`) over the samples.

    Every path from the output must pass only views, permutes and the like and end in an
    addition (or subtraction); anything else, and the call is not taken as broadcast. Returns a
    reason (a string) when the output is broadcast over a new leading axis on a path that ends
    elsewhere (a product with per-sample tensors, say): its per-sample gradients cannot be
    recovered, and taking its leading axis as the samples would give wrong numbers.
    """
    if len(record.outputs) != 1 or any(e is not None for e in record.input_edges):
        return None
    start = node
    parts: list[_Addition] = []
    seen: set[int] = set()
    unhandled: str | None = None
    stack = [(node, False, tuple(record.outputs[0].shape), False)]
    while stack:
        node, moves_axes, shape, expanded = stack.pop()
        consumers = {(id(p), i): (p, i) for p, i in parents.get(id(node), [])}
        if not consumers:
            return None
        for consumer, index in consumers.values():
            name = consumer.name()
            after = _forward_shape(consumer)
            if name in _RESHAPE_NODES or name in _AXIS_NODES:
                if id(consumer) in seen:
                    return None
                seen.add(id(consumer))
                grown = name == "ExpandBackward0" and _adds_sample_axis(shape, after)
                following = shape if after is None else after
                stack.append(
                    (consumer, moves_axes or name in _AXIS_NODES, following, expanded or grown)
                )
                continue
            if name not in ("AddBackward0", "SubBackward0"):
                # broadcast over a new leading axis, or the right operand of a matrix product
                # (a matrix shared by every row: the rows of the other operand hold the samples)
                shared = name in ("MmBackward0", "BmmBackward0") and index == 1
                if unhandled is None and (expanded or shared or _adds_sample_axis(shape, after)):
                    unhandled = name
                continue
            alpha = float(getattr(consumer, "_saved_alpha", 1)) if index == 1 else 1.0
            if name == "SubBackward0" and index == 1:
                alpha = -alpha
            if moves_axes:
                operand = GradientEdge(*consumer.next_functions[index])
                out_shape = record.outputs[0].shape
                parts.append(_Addition(consumer, alpha, operand, start, out_shape))
            else:
                parts.append(_Addition(consumer, alpha))
    if unhandled is not None:
        for part in parts:
            part.close()
        return unhandled
    return BroadcastSite(parts) if parts else None


#: nodes a parameter may pass on its way to where it is broadcast (its shape follows them)
_PARAM_VIEW_NODES = _RESHAPE_NODES - {"ExpandBackward0"}


class ParamSite:
    """Where a parameter used directly by a module without a rule meets the samples.

    A vision transformer adds its position embedding `[1, L, D]` to `[N, L, D]` tokens and
    expands its class token `[1, 1, D]` to `[N, 1, D]`: autograd sums over the samples right
    there. Pre-hooks on those operations keep each sample's share, so the parameter's
    per-sample gradients need no `torch.func` re-run of the whole model.
    """

    def __init__(
        self, param: Tensor, node: Any, parts: list[tuple[_Addition, tuple[int, ...]]]
    ) -> None:
        self.shape = tuple(param.shape)
        #: (capturing operation, the parameter's shape where it meets the samples)
        self.parts = parts
        #: the parameter's whole gradient in this pass (what the shares must add up to)
        self.total: Tensor | None = None
        self._handle = node.register_prehook(self._keep_total)

    def _keep_total(self, grads: tuple) -> None:
        self.total = grads[0]

    def per_sample(self) -> Tensor | None:
        """`[N, *param.shape]` from every use's captured gradient (None: one is missing)."""
        return self._shares([part.captured for part, _ in self.parts], 0)

    @property
    def edges(self) -> list[GradientEdge]:
        """The output edges of the operations that broadcast the parameter (factor targets)."""
        return [part.edge for part, _ in self.parts]

    def per_sample_of(
        self, grads: list[Tensor | None], lead: tuple[int, ...], like: Tensor
    ) -> Tensor | None:
        """`[*lead, N, *param.shape]` from output gradients at `edges` with `lead` axes first.

        The curvature pass backpropagates its factor columns to `edges`; each sample's share of
        a column is the parameter's square-root factor (None: some share cannot be split). A
        missing gradient (an operation the columns do not reach) counts as zeros like `like`.
        """
        sides = []
        for (part, _), grad in zip(self.parts, grads):
            if grad is None:
                shape = _forward_shape(part.node)
                if shape is None:
                    return None
                grad = like.new_zeros(*lead, *shape)
            sides.append(part.operand_grad(grad))
        return self._shares(sides, len(lead))

    def _shares(self, grads: list[Tensor | None], lead: int) -> Tensor | None:
        total = None
        for (part, shape), grad in zip(self.parts, grads):
            if grad is None:
                return None
            share = part.per_sample(grad, torch.Size(shape), lead)
            if share is None:
                return None
            share = share.reshape(*share.shape[: lead + 1], *self.shape)
            if total is not None and share.shape != total.shape:
                return None
            total = share if total is None else total + share
        return total

    def close(self) -> None:
        """Remove the pre-hooks and forget the gradients."""
        for part, _ in self.parts:
            part.close()
        self._handle.remove()
        self.total = None


def _param_site(param: Tensor, parents: dict[int, list[tuple[Any, int]]]) -> ParamSite | None:
    """The operations broadcasting `param` over the samples, if that is all it is used for.

    Paths from the parameter may pass reshaping views, then end in an addition or subtraction
    that broadcasts it over a leading sample axis, or in an expansion that creates that axis.
    """
    try:
        node = torch.autograd.graph.get_gradient_edge(param).node
    except (AttributeError, RuntimeError):
        return None
    start = node
    parts: list[tuple[_Addition, tuple[int, ...]]] = []
    if not parents.get(id(node)):
        return ParamSite(param, start, parts)  # unused by this backward (a mask token)
    stack = [(node, tuple(param.shape))]
    while stack:
        node, shape = stack.pop()
        consumers = {(id(p), i): (p, i) for p, i in parents.get(id(node), [])}
        if not consumers:
            return _close_all(parts)
        for consumer, index in consumers.values():
            name = consumer.name()
            after = _forward_shape(consumer)
            if after is None:
                return None
            if name in _PARAM_VIEW_NODES:
                stack.append((consumer, after))
                continue
            if name == "ExpandBackward0" and _adds_sample_axis(shape, after):
                parts.append((_Addition(consumer, 1.0), shape))
                continue
            if name == "MulBackward0" and _adds_sample_axis(shape, after):
                # a scale (LayerScale's gamma): the share is the gradient times the other factor
                parts.append((_Product(consumer, index), shape))
                continue
            if name not in ("AddBackward0", "SubBackward0") or not _adds_sample_axis(shape, after):
                return _close_all(parts)
            alpha = float(getattr(consumer, "_saved_alpha", 1)) if index == 1 else 1.0
            if name == "SubBackward0" and index == 1:
                alpha = -alpha
            parts.append((_Addition(consumer, alpha), shape))
    return ParamSite(param, start, parts)


def _batch_statistics_inside(module: nn.Module) -> bool:
    """Whether a batch normalisation inside `module` normalises with the batch's statistics."""
    return any(
        isinstance(m, nn.modules.batchnorm._BatchNorm)
        and (m.training or (m.running_mean is None and m.running_var is None))
        for m in module.modules()
    )


def _close_all(parts: list[tuple[_Addition, tuple[int, ...]]]) -> None:
    for part, _ in parts:
        part.close()
    return None


class SampleLayout:
    """The loss calls of one backward pass and how their samples line up."""

    def __init__(self, losses: list[Record]) -> None:
        #: extended loss calls taking part, in the order of their forwards
        self.losses = losses
        #: autograd edges of the losses' inputs (the records are freed once processed)
        self._loss_edges = [[e for e in r.input_edges if e is not None] for r in losses]
        self._position = {id(r): i for i, r in enumerate(losses)}
        #: whether the graph was walked (then `_groups` and `_by_module` are exact)
        self.walked = False
        #: id(record) -> group index, for calls reached by some loss
        self._groups: dict[int, int] = {}
        #: id(module) -> its calls reached by some loss
        self._by_module: dict[int, list[Record]] = {}
        #: per group: (first row, number of rows)
        self._rows: list[tuple[int, int]] = []
        self.total: int | None = None
        #: per group: rows of the model (groups sharing parameters) it belongs to
        self._model_rows: dict[int, int] = {}
        #: groups that are the only samples of their model (no placement needed)
        self._alone: set[int] = set()
        #: per group: why its rows cannot be told apart (an error message), if they cannot
        self._broken: dict[int, str] = {}
        #: id(record) -> where its sample-free output is broadcast over the samples
        self.broadcast: dict[int, BroadcastSite] = {}
        #: id(record) -> the operation that broadcasts its sample-free output over the samples
        #: where no per-sample gradient can be recovered (refused when the call is processed)
        self.unhandled_broadcast: dict[int, str] = {}
        #: id(parameter) -> where a rule-less module's own parameter meets the samples
        self.param_sites: dict[int, ParamSite] = {}
        #: records of rule-less modules owning parameters and holding submodules
        self._containers: list[Record] = []
        #: whether calls of this pass may be broadcast over the samples (then they are searched)
        self.candidates = False
        #: nodes explored for broadcast sites, and the consumers of each node seen
        self._visited: dict[int, Any] = {}
        self._parents: dict[int, list[tuple[Any, int]]] = {}

    @classmethod
    def discover(
        cls,
        batch_size: Any,
        functional: list[Record] | None = None,
        extended: list[Record] | None = None,
    ) -> SampleLayout:
        """The layout of the running backward; `batch_size(record)` gives a call's sample count.

        `functional` are the records of losses called as functions that this backward reaches,
        `extended` those of the extended loss calls its roots reach (both found from the roots
        before it started; None: the roots are unknown, live loss records are checked instead).
        """
        if extended is None:
            extended = [r for r in live_loss_records() if loss_in_pass(r)]
        else:
            extended = sorted({id(r): r for r in extended}.values(), key=lambda r: r.order)
        layout = cls(extended + list(functional or ()))
        # calls that may be broadcast over the samples need the graph's consumers, several
        # losses need to know which calls they reach; otherwise nothing is walked up front
        layout.candidates = has_sample_free_records()
        layout._containers = [r for r in container_records() if find_rule(r.module) is None]
        if layout.losses and (len(layout.losses) > 1 or layout.candidates or layout._containers):
            layout.walk(batch_size)
        return layout

    # --- losses ------------------------------------------------------------------------------
    def loss_position(self, record: Record) -> int:
        """Position of a loss call among the pass's losses (0 when it was not found)."""
        return self._position.get(id(record), 0)

    # --- graph walk --------------------------------------------------------------------------
    def walk(self, batch_size: Any) -> None:
        """Find which loss calls each recorded call reaches; group the losses by shared calls."""
        if self.walked:
            return
        self.walked = True
        reached: dict[int, tuple[Record, set[int]]] = {}
        parents: dict[int, list[tuple[Any, int]]] = {}
        nodes: dict[int, Any] = {}
        for pos, edges in enumerate(self._loss_edges):
            for key, (record, node) in reachable_records(edges, parents).items():
                reached.setdefault(key, (record, set()))[1].add(pos)
                nodes[key] = node
        # everything the losses reach is explored: later hooks need not walk again
        for consumers in parents.values():
            for node, _ in consumers:
                self._visited[id(node)] = node
        for edges in self._loss_edges:
            for e in edges:
                self._visited[id(e.node)] = e.node
        self._parents = parents
        self._find_sites({k: (r, nodes[k]) for k, (r, _) in reached.items()})
        self._find_param_sites(reached)
        parent = list(range(len(self.losses)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for _, positions in reached.values():
            first, *rest = sorted(positions)
            for other in rest:
                a, b = find(first), find(other)
                if a != b:
                    parent[max(a, b)] = min(a, b)
        roots = sorted({find(i) for i in range(len(self.losses))})
        group_of_root = {root: g for g, root in enumerate(roots)}
        sizes: list[dict[int, Record]] = [{} for _ in roots]
        for key, (record, positions) in reached.items():
            group = group_of_root[find(min(positions))]
            self._groups[key] = group
            self._by_module.setdefault(id(record.module), []).append(record)
            if len(roots) > 1 and not record.freed and call_params(record):
                if key not in self.broadcast:  # their samples are the broadcast's
                    sizes[group].setdefault(int(batch_size(record)), record)
        if len(roots) < 2:
            return
        # groups whose calls share a parameter belong to one model: its parameters get rows
        # for all of them; separate models keep their own rows
        model_of = list(range(len(roots)))

        def top(g: int) -> int:
            while model_of[g] != g:
                model_of[g] = model_of[model_of[g]]
                g = model_of[g]
            return g

        param_groups: dict[int, set[int]] = {}
        for key, (record, _) in reached.items():
            for p in call_params(record).values():
                param_groups.setdefault(id(p), set()).add(self._groups[key])
        for groups in param_groups.values():
            first, *rest = sorted(groups)
            for other in rest:
                a, b = top(first), top(other)
                if a != b:
                    model_of[max(a, b)] = min(a, b)
        starts: dict[int, int] = {}
        self._rows = [(0, 0)] * len(roots)
        for group, found in enumerate(sizes):
            if len(found) > 1:
                names = ", ".join(f"{describe(r.module)}: {n}" for n, r in found.items())
                self._broken[group] = (
                    "module calls whose outputs meet in one loss call process different numbers "
                    f"of samples ({names}), so their samples cannot be matched"
                )
            rows = next(iter(found), 0)
            model = top(group)
            start = starts.get(model, 0)
            self._rows[group] = (start, rows)
            starts[model] = start + rows
        self._model_rows = {g: starts[top(g)] for g in range(len(roots))}
        self._alone = {g for g in range(len(roots)) if self._model_rows[g] == self._rows[g][1]}
        self.total = max(starts.values())

    def explore(self, node: Any) -> None:
        """Look for broadcast sites upstream of `node` (the node whose hook is running).

        Without an extended loss nothing was walked at the start of the pass; the first hook
        runs at a node downstream of every call it can reach, before their consumers ran.
        """
        if node is None or not self.candidates or id(node) in self._visited:
            return
        edges = [GradientEdge(node, 0)]
        found = reachable_records(edges, self._parents, self._visited)
        self._find_sites(found)

    def _find_sites(self, found: dict[int, tuple[Record, Any]]) -> None:
        for key, (record, node) in found.items():
            if key in self.broadcast or record.freed or not call_params(record):
                continue
            if not sample_free(record.args):
                continue
            site = _broadcast_site(record, node, self._parents)
            if isinstance(site, str):
                self.unhandled_broadcast[key] = site
            elif site is not None:
                self.broadcast[key] = site

    def _find_param_sites(self, reached: dict[int, tuple[Record, set[int]]]) -> None:
        for record in self._containers:
            if id(record) not in reached:
                continue
            for p in record.module._parameters.values():
                if p is None or not p.requires_grad or id(p) in self.param_sites:
                    continue
                site = _param_site(p, self._parents)
                if site is not None:
                    self.param_sites[id(p)] = site

    def close(self) -> None:
        """Remove the hooks of the broadcast sites (end of the pass)."""
        for site in self.broadcast.values():
            site.close()
        self.broadcast = {}
        for param_site in self.param_sites.values():
            param_site.close()
        self.param_sites = {}

    def sites_of(self, record: Record) -> dict[str, ParamSite] | None:
        """The sites of a rule-less call's own parameters, if all meet the samples only there.

        Their per-sample quantities are then read off the pass's own graph, without a
        `torch.func` re-run of the call; so, unlike that fallback, they need no check that a
        sample alone gives its output (dropout masks are the forward's). Not for calls that
        normalise with their batch's statistics, whose samples are coupled.
        """
        params = call_params(record)
        sites = {name: self.param_sites.get(id(p)) for name, p in params.items()}
        if not sites or any(site is None for site in sites.values()):
            return None
        if find_rule(record.module) is not None or _batch_statistics_inside(record.module):
            return None
        return sites  # type: ignore[return-value]

    # --- per call ----------------------------------------------------------------------------
    @property
    def several_groups(self) -> bool:
        """Whether the pass holds several disjoint sets of samples (rows are then placed)."""
        return self.total is not None

    def placement(self, record: Record) -> tuple[int, int] | None:
        """(first row, total rows) of a call's samples among the pass's, or None (all rows)."""
        if not self.several_groups:
            return None
        group = self._groups.get(id(record.origin or record))
        if group is None:
            raise RuntimeError(
                f"The call of {describe(record.module)} reaches none of the extended loss "
                "functions of this backward pass, which holds several sets of samples (several "
                "forwards with separate loss calls), so backpack cannot tell which samples it "
                "belongs to. Extend every loss function of the backward (backpack.extend(loss))."
            )
        if group in self._broken:
            raise RuntimeError(f"{describe(record.module)}: {self._broken[group]}.")
        if group in self._alone:
            return None  # the only samples of its model
        return self._rows[group][0], self._model_rows[group]

    def group_of(self, record: Record) -> int | None:
        """Which set of samples a call belongs to (0 when the pass has one)."""
        if not self.several_groups:
            return 0
        return self._groups.get(id(record.origin or record))

    def reached(self, record: Record) -> bool:
        """Whether the walk found `record` (always True before a walk)."""
        return not self.walked or id(record.origin or record) in self._groups

    def uses(self, param: Tensor, batch_size: Any) -> int:
        """How many module calls of this pass use `param` directly."""
        owners = param_owners(param)
        live = sum(live_record_count(m) for m in owners)
        if live <= 1 or not self.losses:
            return live
        # several live calls: only those some loss of this pass reaches take part
        self.walk(batch_size)
        return sum(len(self._by_module.get(id(m), ())) for m in owners)

    def cross_terms(self, param: Tensor, batch_size: Any) -> bool:
        """Whether two calls of this pass that use `param` hold the same samples."""
        if self.uses(param, batch_size) <= 1:
            return False
        groups = [
            self.group_of(r) for m in param_owners(param) for r in self._by_module.get(id(m), ())
        ]
        return None in groups or len(set(groups)) < len(groups)

    def module_uses(self, module: nn.Module, batch_size: Any) -> int:
        """The largest number of calls of this pass using one of `module`'s parameters."""
        params = trainable_params(module).values()
        return max((self.uses(p, batch_size) for p in params), default=0)
