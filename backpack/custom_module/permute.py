"""`Permute`: reorder axes (the batch axis stays first)."""

from __future__ import annotations

from torch import Tensor, nn


class Permute(nn.Module):
    """Permute the input's axes, like `input.permute(*dims)`, as a module.

    Args:
        *dims: The new order of axes; must start with 0 (samples stay on axis 0). With
            `init_transpose=True`, two axes to swap instead (neither may be 0).
        init_transpose: Interpret `dims` as a transposition of two axes.
    """

    def __init__(self, *dims: int, init_transpose: bool = False) -> None:
        super().__init__()
        self.dims = tuple(dims)
        self.init_transpose = init_transpose
        if init_transpose:
            if len(self.dims) != 2 or 0 in self.dims:
                raise ValueError(
                    "Permute(init_transpose=True) takes two axes to swap, neither the batch "
                    f"axis 0; got {self.dims}."
                )
        elif not self.dims or self.dims[0] != 0:
            raise ValueError(f"Permute must keep the batch axis first (dims[0] == 0); got {dims}.")

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """The permuted (or transposed) input."""
        if self.init_transpose:
            return input.transpose(*self.dims)
        return input.permute(*self.dims)

    def extra_repr(self) -> str:
        """Show the axes."""
        return f"dims={self.dims}, init_transpose={self.init_transpose}"
