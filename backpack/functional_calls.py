"""Functional calls between the model and the loss, recognised in the autograd graph.

Training scripts often call `F.cross_entropy(logits.view(-1, V), y.view(-1))` instead of an
extended `nn.CrossEntropyLoss`, and tie the output layer to the embedding with
`F.linear(h, embedding.weight)`. Such calls leave no record, but their autograd nodes keep
what the rules need. A walk from the backward's roots, before autograd runs them, turns them
into records:

- losses: the log-probabilities (for cross-entropy, `softmax(log_softmax(x))` is `softmax(x)`),
  targets, class weights, `ignore_index` and the reduction give a record of the matching loss
  module, so functional losses work like extended ones;
- `F.linear(h, w)` (or `h @ w.T`) with a parameter `w` of an extended module gives a record of
  a `Linear` layer holding `w`: the parameter is then used by two calls (the embedding and the
  output layer), and its quantities are those of its summed per-sample gradient.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backpack.recording import Record, is_loss_module, param_owners, records_at, walk_nodes

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_NLL = ("NllLossBackward0", "NllLoss2DBackward0")
_RESHAPES = ("ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0")


def _index(value: int) -> int:
    """A saved int64 read back as an unsigned 64-bit number (negative ignore_index)."""
    return value - 2**64 if value >= 2**63 else value


def _record(module: nn.Module, args: tuple, edge: Any) -> Record:
    detached = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    record = Record(module, detached, {}, (), None)
    record.input_edges = (edge, None)
    record.recomputed = False  # built during the backward, but from the forward's values
    return record


def _cross_entropy(node: Any) -> Record | None:
    source = node.next_functions[0][0]
    while source is not None and source.name() in _RESHAPES:
        source = source.next_functions[0][0]
    if source is None or source.name() != "LogSoftmaxBackward0" or source._saved_dim != 1:
        return None
    log_probs = source._saved_result
    target = node._saved_target
    # NllLoss2d sees [N, C, *d] reshaped to 4-D: give the target the logits' layout back
    target = target.reshape(log_probs.shape[:1] + log_probs.shape[2:])
    module = nn.CrossEntropyLoss(
        weight=node._saved_weight,
        ignore_index=_index(int(node._saved_ignore_index)),
        reduction=_REDUCTIONS[int(node._saved_reduction)],
    )
    edge = source.next_functions[0]
    return _record(module, (log_probs, target), GradientEdge(edge[0], edge[1]))


def _mse(node: Any) -> Record | None:
    module = nn.MSELoss(reduction=_REDUCTIONS[int(node._saved_reduction)])
    edge = node.next_functions[0]
    if edge[0] is None:
        return None
    return _record(module, (node._saved_self, node._saved_target), GradientEdge(*edge))


def _bce_with_logits(node: Any) -> Record | None:
    module = nn.BCEWithLogitsLoss(
        weight=node._saved_weight,
        pos_weight=node._saved_pos_weight,
        reduction=_REDUCTIONS[int(node._saved_reduction)],
    )
    edge = node.next_functions[0]
    if edge[0] is None:
        return None
    return _record(module, (node._saved_self, node._saved_target), GradientEdge(*edge))


_PATTERNS = {
    **dict.fromkeys(_NLL, _cross_entropy),
    "MseLossBackward0": _mse,
    "BinaryCrossEntropyWithLogitsBackward0": _bce_with_logits,
}


class FunctionalLinear(nn.Linear):
    """A `Linear` layer standing for a functional `F.linear(h, weight, bias)` call."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.__dict__["_backpack_path"] = "F.linear"


def _tracked_parameter(node: Any) -> nn.Parameter | None:
    """The parameter behind an `AccumulateGrad` node, if an extended module uses it."""
    if node is None or node.name() != "torch::autograd::AccumulateGrad":
        return None
    variable = node.variable
    if isinstance(variable, nn.Parameter) and param_owners(variable):
        return variable
    return None


def _transposed_parameter(edge: tuple) -> nn.Parameter | None:
    """The tracked parameter w behind `w.t()` / `w.T` (the weight side of a linear call)."""
    node = edge[0]
    if node is None:
        return None
    name = node.name()
    if name == "PermuteBackward0" and tuple(node._saved_dims) != (1, 0):
        return None
    if name not in ("TBackward0", "PermuteBackward0"):
        return None
    return _tracked_parameter(node.next_functions[0][0])


def _linear(node: Any, consumer: Any) -> tuple[Record, Any] | None:
    """A functional linear call on a tracked weight: (record, node producing its output)."""
    name = node.name()
    if name == "MmBackward0":
        x_edge, weight = node.next_functions[0], _transposed_parameter(node.next_functions[1])
        bias = None
        x2d = node._saved_self if weight is not None else None
    elif name == "AddmmBackward0":
        x_edge, weight = node.next_functions[1], _transposed_parameter(node.next_functions[2])
        bias_node = node.next_functions[0][0]
        bias = None if bias_node is None else getattr(bias_node, "variable", None)
        if bias is not None and not isinstance(bias, nn.Parameter):
            return None
        if float(node._saved_alpha) != 1 or float(node._saved_beta) != 1:
            return None
        x2d = node._saved_mat1 if weight is not None else None
    else:
        return None
    if weight is None or x2d is None:
        return None
    out_node, in_shape = node, tuple(x2d.shape)
    if consumer is not None and consumer.name() == "UnsafeViewBackward0":
        # a linear call on `[N, *, D]`: its rows must go back to their samples
        source = x_edge[0]
        if source is None or source.name() != "ViewBackward0":
            return None
        in_shape = tuple(source._saved_self_sym_sizes)
        out_node = consumer
        x_edge = source.next_functions[0]
    x = x2d.detach().reshape(in_shape)
    out_shape = (*in_shape[:-1], weight.shape[0])
    module = FunctionalLinear(weight, bias if isinstance(bias, nn.Parameter) else None)
    placeholder = x.new_zeros(()).expand(out_shape)
    record = Record(module, (x,), {}, (placeholder,), placeholder)
    record.out_requires_grad = (True,)
    record.input_edges = (GradientEdge(*x_edge) if x_edge[0] is not None else None,)
    record.recomputed = False
    return record, out_node


def find_functional_calls(
    roots: list[Tensor],
) -> tuple[list[tuple[Record, Any]], list[tuple[Record, Any]], list[Record]]:
    """Functional losses and functional linear calls between the roots and the records.

    Returns (loss record, loss node) pairs, (linear record, output node) pairs and the records
    of the extended loss calls met; the walk stops at recorded calls (extended losses and
    modules) and at each loss found.
    """
    losses: list[tuple[Record, Any]] = []
    linears: list[tuple[Record, Any]] = []
    extended: list[Record] = []
    consumers: dict[int, int] = {}
    parent: dict[int, Any] = {}
    stack = [t.grad_fn for t in roots if isinstance(t, Tensor) and t.grad_fn is not None]
    for node in walk_nodes(stack):
        found = records_at(node)
        if found:
            extended.extend(r for r, _, _ in found if is_loss_module(r.module))
            continue
        pattern = _PATTERNS.get(node.name())
        if pattern is not None:
            try:
                record = pattern(node)
            except (AttributeError, RuntimeError):  # saved values already freed, or unknown
                record = None
            if record is not None:
                losses.append((record, node))
                # keep walking (functional linear calls may lie behind the loss), without
                # counting the loss as a consumer of its log-probabilities
                stack.extend(n for n, _ in node.next_functions if n is not None)
                continue
        try:
            linear = _linear(node, parent.get(id(node)))
        except (AttributeError, RuntimeError):
            linear = None
        if linear is not None:
            linears.append(linear)
        for child, _ in node.next_functions:
            if child is not None:
                consumers[id(child)] = consumers.get(id(child), 0) + 1
                parent.setdefault(id(child), node)
                stack.append(child)
    # the log-probabilities of a cross-entropy used elsewhere too (label smoothing computes
    # such a second term) make it another loss: leave it unrecognised
    losses = [(r, n) for r, n in losses if not _shared_log_probs(n, consumers)]
    return losses, linears, extended


def _shared_log_probs(node: Any, consumers: dict[int, int]) -> bool:
    if node.name() not in _NLL:
        return False
    source = node.next_functions[0][0]
    first = True
    while source is not None and source.name() in _RESHAPES:
        if consumers.get(id(source), 0) > (0 if first else 1):
            return True
        first = False
        source = source.next_functions[0][0]
    # the chain's own reshape (if any) consumes the log-softmax once
    return source is not None and consumers.get(id(source), 0) > (0 if first else 1)
