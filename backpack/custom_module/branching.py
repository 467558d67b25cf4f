"""Branching containers: run several modules on one input and merge their outputs."""

from __future__ import annotations

from torch import Tensor, nn


class SumModule(nn.Module):
    """Add all inputs: `SumModule()(a, b, c) == a + b + c` (the merge of residual branches)."""

    def forward(self, *inputs: Tensor) -> Tensor:
        """Sum of the inputs."""
        if not inputs:
            raise ValueError("SumModule needs at least one input.")
        result = inputs[0]
        for other in inputs[1:]:
            result = result + other
        return result


class ActiveIdentity(nn.Module):
    """Identity that creates a new tensor (and autograd node) instead of returning its input."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """A copy-free alias of the input with its own autograd node."""
        return input.view_as(input)


class Parallel(nn.Module):
    """Feed the same input to every branch and merge the branch outputs.

    `Parallel(nn.Identity(), nn.Sequential(conv, relu))` with the default `SumModule` merge is a
    residual block built only from modules, usable inside `nn.Sequential`.

    Args:
        *layers: The branches.
        merge_module: Module called with all branch outputs (default: `SumModule()`).
    """

    def __init__(self, *layers: nn.Module, merge_module: nn.Module | None = None) -> None:
        super().__init__()
        if not layers:
            raise ValueError("Parallel needs at least one branch.")
        self.branch = nn.ModuleList(layers)
        self.merge = SumModule() if merge_module is None else merge_module

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """Merge of all branches applied to `input`."""
        return self.merge(*(layer(input) for layer in self.branch))
