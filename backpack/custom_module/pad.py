"""`Pad`: `torch.nn.functional.pad` as a module."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

_MODES = ("constant", "reflect", "replicate", "circular")


class Pad(nn.Module):
    """Pad the input like `F.pad(input, pad, mode, value)`.

    Args:
        pad: Padding sizes, last axis first, two per padded axis (see
            `torch.nn.functional.pad`); negative sizes crop.
        mode: "constant", "reflect", "replicate" or "circular".
        value: Fill value for mode "constant".

    Raises:
        ValueError: For an unknown mode, an odd number of sizes, or a fill value with a
            non-constant mode.
    """

    def __init__(self, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> None:
        super().__init__()
        self.pad = tuple(pad)
        if len(self.pad) % 2 != 0 or any(
            isinstance(p, bool) or not isinstance(p, int) for p in self.pad
        ):
            raise ValueError(f"Pad takes an even number of int sizes, got {pad}.")
        if mode not in _MODES:
            raise ValueError(f"Pad's mode must be one of {_MODES}, got {mode!r}.")
        if mode != "constant" and value not in (0, 0.0, None):
            raise ValueError(f"Pad's value only applies to mode 'constant', not {mode!r}.")
        self.mode = mode
        self.value = 0.0 if value is None else value

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """The padded input."""
        if self.mode == "constant":
            return F.pad(input, self.pad, mode="constant", value=self.value)
        return F.pad(input, self.pad, mode=self.mode)

    def extra_repr(self) -> str:
        """Show the padding."""
        return f"pad={self.pad}, mode={self.mode!r}, value={self.value}"
