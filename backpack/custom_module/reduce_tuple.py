"""`ReduceTuple`: keep one element of a tuple-valued output (e.g. the sequence output of an RNN)."""

from __future__ import annotations

from typing import Any

from torch import nn


class ReduceTuple(nn.Module):
    """Return `input[index]`, so that modules with tuple outputs fit into `nn.Sequential`.

    Args:
        index: Which element of the incoming tuple to pass on (default: the first).

    """

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        self.index = index

    def forward(self, input: Any) -> Any:  # noqa: A002 (name of the nn.Module convention)
        """Return the element at position `index` of `input`."""
        return input[self.index]

    def extra_repr(self) -> str:
        """Show the selected index in the module's repr."""
        return f"index={self.index}"
