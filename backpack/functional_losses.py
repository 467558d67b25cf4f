"""Losses called as functions (`F.cross_entropy`, `F.mse_loss`, ...), recognised in the graph.

Training scripts often call `F.cross_entropy(logits.view(-1, V), y.view(-1))` instead of an
extended `nn.CrossEntropyLoss`. Such a call leaves no record, but its autograd node keeps what
the loss rules need: the log-probabilities (for cross-entropy, `softmax(log_softmax(x))` is
`softmax(x)`), the targets, the class weights, `ignore_index` and the reduction. A walk from the
backward's roots finds these nodes before autograd runs them; each becomes a loss record of
the matching loss module, so functional losses work like extended ones.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backpack.recording import Record, records_at, walk_nodes

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


def find_functional_losses(roots: list[Tensor]) -> list[tuple[Record, Any]]:
    """Functional loss calls between the backward's roots and the recorded module calls.

    Returns (loss record, loss node) pairs; the walk stops at recorded calls (extended losses
    and modules) and at each loss found.
    """
    found: list[tuple[Record, Any]] = []
    consumers: dict[int, int] = {}
    stack = [t.grad_fn for t in roots if isinstance(t, Tensor) and t.grad_fn is not None]
    for node in walk_nodes(stack):
        if records_at(node):
            continue
        pattern = _PATTERNS.get(node.name())
        if pattern is not None:
            try:
                record = pattern(node)
            except (AttributeError, RuntimeError):  # saved values already freed, or unknown
                record = None
            if record is not None:
                found.append((record, node))
                continue
        for child, _ in node.next_functions:
            if child is not None:
                consumers[id(child)] = consumers.get(id(child), 0) + 1
                stack.append(child)
    # the log-probabilities of a cross-entropy used elsewhere too (label smoothing computes
    # such a second term) make it another loss: leave it unrecognised
    return [(r, n) for r, n in found if not _shared_log_probs(n, consumers)]


def _shared_log_probs(node: Any, consumers: dict[int, int]) -> bool:
    if node.name() not in _NLL:
        return False
    source = node.next_functions[0][0]
    while source is not None and source.name() in _RESHAPES:
        if consumers.get(id(source), 0):
            return True
        source = source.next_functions[0][0]
    return source is not None and consumers.get(id(source), 0) > 0
