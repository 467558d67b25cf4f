"""Branching: run several modules on one input (`Parallel`) and merge their outputs.

Merge modules take any number of tensors: `SumModule` adds them (residual connections),
`MultiplyModule` multiplies them elementwise (gates, squeeze-and-excitation) and `CatModule`
concatenates them along one axis (Inception/DenseNet-style feature stacking). `ActiveIdentity`
is an identity that still creates a new tensor, for branches that must not alias their input.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class SumModule(nn.Module):
    """Add all inputs: `SumModule()(a, b, c) == a + b + c` (the merge of residual branches)."""

    def forward(self, *inputs: Tensor) -> Tensor:
        """Sum of the inputs (broadcasting like `+`)."""
        if not inputs:
            raise ValueError("SumModule needs at least one input.")
        result = inputs[0]
        for other in inputs[1:]:
            result = result + other
        return result


class MultiplyModule(nn.Module):
    """Multiply all inputs elementwise: `MultiplyModule()(a, b) == a * b` (broadcasting).

    Bilinear, not linear, in its inputs: the GGN family and first-order extensions pass through
    it, but exact-Hessian extensions report it as unsupported.
    """

    def forward(self, *inputs: Tensor) -> Tensor:
        """Elementwise product of the inputs."""
        if not inputs:
            raise ValueError("MultiplyModule needs at least one input.")
        result = inputs[0]
        for other in inputs[1:]:
            result = result * other
        return result


class CatModule(nn.Module):
    """Concatenate all inputs along axis `dim`: `CatModule(dim)(a, b) == torch.cat([a, b], dim)`.

    Args:
        dim: The axis to concatenate along (default 1, the channel/feature axis; axis 0 would
            stack samples, which per-sample quantities cannot follow).
    """

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise ValueError(f"CatModule's dim must be an int, got {dim!r}.")
        self.dim = dim

    def forward(self, *inputs: Tensor) -> Tensor:
        """The inputs concatenated along `dim`."""
        if not inputs:
            raise ValueError("CatModule needs at least one input.")
        return torch.cat(inputs, self.dim)

    def extra_repr(self) -> str:
        """Show the axis."""
        return f"dim={self.dim}"


class ActiveIdentity(nn.Module):
    """Identity that creates a new tensor (and autograd node) instead of returning its input."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """A copy-free alias of the input with its own autograd node."""
        return input.view_as(input)


class Parallel(nn.Module):
    """Feed the same input to every branch and merge the branch outputs.

    `Parallel(nn.Identity(), nn.Sequential(conv, relu))` with the default `SumModule` merge is a
    residual block built only from modules, usable inside `nn.Sequential`. The branches are
    stored in the `ModuleList` `branch` (parameter names `branch.<k>.<...>`), the merge module
    as `merge`.

    Args:
        *layers: The branches.
        merge_module: Module called with all branch outputs as positional arguments (default:
            `SumModule()`; e.g. `CatModule(dim=1)` stacks the branch features instead).
    """

    def __init__(self, *layers: nn.Module, merge_module: nn.Module | None = None) -> None:
        super().__init__()
        if not layers:
            raise ValueError("Parallel needs at least one branch.")
        for layer in layers:
            if not isinstance(layer, nn.Module):
                raise TypeError(
                    f"Parallel's branches must be modules, got {type(layer).__name__}. Pass the "
                    "merge as merge_module=... (a keyword argument)."
                )
        if merge_module is not None and not isinstance(merge_module, nn.Module):
            raise TypeError(
                f"Parallel's merge_module must be a module, got {type(merge_module).__name__}."
            )
        self.branch = nn.ModuleList(layers)
        self.merge = SumModule() if merge_module is None else merge_module

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """Merge of all branches applied to `input`."""
        return self.merge(*(layer(input) for layer in self.branch))
