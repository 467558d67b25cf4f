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

from backpack.recording import (
    Record,
    describe,
    live_loss_records,
    live_records,
    param_owners,
    records_at,
    trainable_params,
    walk_nodes,
)


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


def reachable_records(edges: list[Any]) -> dict[int, Record]:
    """Recorded module calls reachable backward from `edges` (by id)."""
    found: dict[int, Record] = {}
    stack = [e.node for e in edges if e is not None]
    for node in walk_nodes(stack):
        for record, _, _ in records_at(node, freed=True):
            found[id(record)] = record
        stack.extend(n for n, _ in node.next_functions)
    return found


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
        #: per group: why its rows cannot be told apart (an error message), if they cannot
        self._broken: dict[int, str] = {}

    @classmethod
    def discover(cls, batch_size: Any) -> SampleLayout:
        """The layout of the running backward; `batch_size(record)` gives a call's sample count."""
        layout = cls([r for r in live_loss_records() if loss_in_pass(r)])
        if len(layout.losses) > 1:
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
        for pos, edges in enumerate(self._loss_edges):
            for key, record in reachable_records(edges).items():
                reached.setdefault(key, (record, set()))[1].add(pos)
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
            if len(roots) > 1 and not record.freed and trainable_params(record.module):
                sizes[group].setdefault(int(batch_size(record)), record)
        if len(roots) < 2:
            return
        start = 0
        for group, found in enumerate(sizes):
            if len(found) > 1:
                names = ", ".join(f"{describe(r.module)}: {n}" for n, r in found.items())
                self._broken[group] = (
                    "module calls whose outputs meet in one loss call process different numbers "
                    f"of samples ({names}), so their samples cannot be matched"
                )
            rows = next(iter(found), 0)
            self._rows.append((start, rows))
            start += rows
        self.total = start

    # --- per call ----------------------------------------------------------------------------
    @property
    def several_groups(self) -> bool:
        """Whether the pass holds several disjoint sets of samples (rows are then placed)."""
        return self.total is not None

    def placement(self, record: Record) -> tuple[int, int] | None:
        """(first row, total rows) of a call's samples among the pass's, or None (all rows)."""
        if not self.several_groups:
            return None
        group = self._groups.get(id(record))
        if group is None:
            raise RuntimeError(
                f"The call of {describe(record.module)} reaches none of the extended loss "
                "functions of this backward pass, which holds several sets of samples (several "
                "forwards with separate loss calls), so backpack cannot tell which samples it "
                "belongs to. Extend every loss function of the backward (backpack.extend(loss))."
            )
        if group in self._broken:
            raise RuntimeError(f"{describe(record.module)}: {self._broken[group]}.")
        return self._rows[group][0], self.total

    def reached(self, record: Record) -> bool:
        """Whether the walk found `record` (always True before a walk)."""
        return not self.walked or id(record) in self._groups

    def uses(self, param: Tensor, batch_size: Any) -> int:
        """How many module calls of this pass use `param` directly."""
        owners = param_owners(param)
        live = sum(len(live_records(m)) for m in owners)
        if live <= 1 or not self.losses:
            return live
        # several live calls: only those some loss of this pass reaches take part
        self.walk(batch_size)
        return sum(len(self._by_module.get(id(m), ())) for m in owners)

    def module_uses(self, module: nn.Module, batch_size: Any) -> int:
        """The largest number of calls of this pass using one of `module`'s parameters."""
        params = trainable_params(module).values()
        return max((self.uses(p, batch_size) for p in params), default=0)
