"""Walking the autograd graph when node wrappers are short-lived (as torch 2.11 makes them)."""

import pytest
import torch
from torch import nn

from backpack import recording, secondorder
from backpack.rules.generic import transformable

DEPTH = 40


class _FreshWrapperNode:
    """A chain node whose `next_functions` builds a fresh wrapper per access, like torch 2.11:
    once the walk drops a visited wrapper, CPython may hand its address (id) to the next one."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    @property
    def next_functions(self):
        return ((_FreshWrapperNode(self.depth - 1), 0),) if self.depth > 0 else ()

    def name(self) -> str:
        return "FakeBackward0"


def _visits(monkeypatch, module) -> list[int]:
    visited = []

    def records_at(node):
        visited.append(node.depth)
        return []

    monkeypatch.setattr(module, "records_at", records_at)
    return visited


def test_graph_records_visits_every_node_of_a_chain(monkeypatch):
    visited = _visits(monkeypatch, secondorder)
    edge = torch.autograd.graph.GradientEdge(_FreshWrapperNode(DEPTH), 0)
    assert list(secondorder.graph_records(edge)) == []
    assert visited == list(range(DEPTH, -1, -1))


def test_nearest_records_visits_every_node_of_a_chain(monkeypatch):
    """The walk KFRA (and the flattened-loss probe) use to find the nearest module outputs."""
    visited = _visits(monkeypatch, recording)
    edge = torch.autograd.graph.GradientEdge(_FreshWrapperNode(DEPTH), 0)
    assert recording.nearest_records(edge) == []
    assert visited == list(range(DEPTH, -1, -1))


@pytest.mark.parametrize("module", [nn.LSTM(2, 3), nn.Sequential(nn.Linear(2, 2), nn.GRU(2, 2))])
def test_transformable_switches_cudnn_off_for_rnns_only_while_inside(module):
    before = torch.backends.cudnn.enabled
    try:
        torch.backends.cudnn.enabled = True
        with transformable(module):
            assert not torch.backends.cudnn.enabled
        assert torch.backends.cudnn.enabled
        with transformable(nn.Linear(2, 2)):
            assert torch.backends.cudnn.enabled
        with pytest.raises(ValueError), transformable(module):
            raise ValueError
        assert torch.backends.cudnn.enabled
    finally:
        torch.backends.cudnn.enabled = before
