"""Conversion between a flat vector and a list of parameter-shaped tensors."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def vector_to_parameter_list(vec: Tensor, parameters: Iterable[Tensor]) -> list[Tensor]:
    """Split a flat vector into tensors shaped like ``parameters``.

    Args:
        vec: One-dimensional tensor whose length equals the total number of entries
            of ``parameters``.
        parameters: Tensors that provide the target shapes (only their shapes are used).

    Returns:
        List of views into ``vec``, one per parameter, with matching shapes.

    Raises:
        ValueError: If ``vec`` is not one-dimensional or its length does not match.

    """
    if not isinstance(vec, Tensor):
        raise TypeError(f"Expected a torch.Tensor, got {type(vec).__name__}.")
    if vec.dim() != 1:
        raise ValueError(f"Expected a 1d vector, got a tensor of shape {tuple(vec.shape)}.")
    shapes = [p.shape for p in parameters]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    total = sum(sizes)
    if vec.numel() != total:
        raise ValueError(
            f"Vector has {vec.numel()} entries, but the parameters have {total} entries in "
            f"total (shapes {[tuple(s) for s in shapes]})."
        )
    chunks = torch.split(vec, sizes) if sizes else ()
    return [chunk.view(shape) for chunk, shape in zip(chunks, shapes, strict=True)]


def parameter_list_to_vector(parameters: Iterable[Tensor]) -> Tensor:
    """Flatten and concatenate tensors into one vector (inverse of the split above).

    Args:
        parameters: Tensors to flatten, in order. Must share dtype and device.

    Returns:
        One-dimensional tensor with all entries of ``parameters``.

    Raises:
        ValueError: If ``parameters`` is empty.

    """
    flat = [p.reshape(-1) for p in parameters]
    if not flat:
        raise ValueError("Cannot build a vector from an empty list of parameters.")
    return torch.cat(flat)
