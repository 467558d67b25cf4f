"""`Pad`: `torch.nn.functional.pad` as a module."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn


class Pad(nn.Module):
    """Pad the input like `F.pad(input, pad, mode, value)`.

    Args:
        pad: Padding sizes, last axis first (see `torch.nn.functional.pad`).
        mode: "constant", "reflect", "replicate" or "circular".
        value: Fill value for mode "constant".
    """

    def __init__(self, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> None:
        super().__init__()
        self.pad = tuple(pad)
        self.mode = mode
        self.value = value

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """The padded input."""
        if self.mode == "constant":
            return F.pad(input, self.pad, mode="constant", value=self.value)
        return F.pad(input, self.pad, mode=self.mode)

    def extra_repr(self) -> str:
        """Show the padding."""
        return f"pad={self.pad}, mode={self.mode!r}, value={self.value}"
