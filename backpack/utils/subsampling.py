"""Selection of a subset of samples along one tensor dimension."""

from __future__ import annotations

import torch
from torch import Tensor


def subsample(tensor: Tensor, dim: int = 0, subsampling: list[int] | None = None) -> Tensor:
    """Select entries of ``tensor`` along dimension ``dim``.

    Args:
        tensor: Input tensor.
        dim: Dimension to index into (negative values count from the end).
        subsampling: Indices to keep, in the order given; repetitions are allowed.
            ``None`` keeps everything.

    Returns:
        ``tensor`` itself if ``subsampling`` is ``None``, otherwise a new tensor whose
        size along ``dim`` equals ``len(subsampling)``.

    """
    if subsampling is None:
        return tensor
    index = torch.as_tensor(subsampling, dtype=torch.long, device=tensor.device)
    return tensor.index_select(dim, index.reshape(-1))
