"""`Slicing`: index the input with a fixed slice (the batch axis is kept whole)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


class Slicing(nn.Module):
    """Return `input[slice_info]` as a module.

    Args:
        slice_info: A tuple of slices/ints/Ellipsis; its first entry must be `slice(None)`
            so that all samples are kept.
    """

    def __init__(self, slice_info: tuple[Any, ...]) -> None:
        super().__init__()
        slice_info = tuple(slice_info) if isinstance(slice_info, (tuple, list)) else (slice_info,)
        if not slice_info or slice_info[0] != slice(None):
            raise ValueError(
                "Slicing must keep the batch axis whole (first entry slice(None)); "
                f"got {slice_info}."
            )
        self.slice_info = slice_info

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """The sliced input."""
        return input[self.slice_info]

    def extra_repr(self) -> str:
        """Show the slice."""
        return f"slice_info={self.slice_info}"
