"""`ScaleModule`: multiply the input by a constant."""

from __future__ import annotations

from torch import Tensor, nn


class ScaleModule(nn.Module):
    """Multiply the input by the constant `weight` (e.g. a functional `0.5 * x` as a module).

    Args:
        weight: The scale factor.
    """

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        if not isinstance(weight, (int, float)):
            raise ValueError(f"ScaleModule's weight must be a float, got {type(weight).__name__}.")
        self.weight = float(weight)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """`weight * input`."""
        return input * self.weight

    def extra_repr(self) -> str:
        """Show the scale."""
        return f"weight={self.weight}"
