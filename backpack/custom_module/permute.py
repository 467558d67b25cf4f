"""`Permute`: reorder axes (the batch axis stays first)."""

from __future__ import annotations

from torch import Tensor, nn


class Permute(nn.Module):
    """Permute the input's axes, like `input.permute(*dims)`, as a module.

    Args:
        *dims: The new order of all axes; must start with 0 (samples stay on axis 0). With
            `init_transpose=True`, instead two axes to swap, like `input.transpose(*dims)`
            (neither may be the batch axis 0).
        init_transpose: Interpret `dims` as a transposition of two axes.

    Raises:
        ValueError: If `dims` are not ints, not a permutation, or move the batch axis.
    """

    def __init__(self, *dims: int, init_transpose: bool = False) -> None:
        super().__init__()
        if any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise ValueError(f"Permute takes int axes, got {dims}.")
        self.dims = tuple(dims)
        self.init_transpose = init_transpose
        if init_transpose:
            if len(self.dims) != 2 or 0 in self.dims:
                raise ValueError(
                    "Permute(init_transpose=True) takes two axes to swap, neither the batch "
                    f"axis 0; got {self.dims}."
                )
            return
        if not self.dims or self.dims[0] != 0:
            raise ValueError(
                "Permute must keep the batch axis first (dims[0] == 0), because per-sample "
                f"quantities are taken along axis 0; got {self.dims}."
            )
        ndim = len(self.dims)
        if sorted(d % ndim for d in self.dims) != list(range(ndim)):
            raise ValueError(f"Permute's dims must be a permutation of 0..{ndim - 1}; got {dims}.")

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        """The permuted (or transposed) input."""
        if self.init_transpose:
            return input.transpose(*self.dims)
        return input.permute(*self.dims)

    def extra_repr(self) -> str:
        """Show the axes."""
        return f"dims={self.dims}, init_transpose={self.init_transpose}"
