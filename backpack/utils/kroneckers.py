"""Dense and matrix-free operations with Kronecker products of square matrices."""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import torch
from torch import Tensor


def _check_square(factors: Sequence[Tensor]) -> None:
    if len(factors) == 0:
        raise ValueError("Need at least one Kronecker factor.")
    for i, factor in enumerate(factors):
        if factor.dim() != 2 or factor.shape[0] != factor.shape[1]:
            raise ValueError(
                f"Kronecker factor {i} must be a square matrix, got shape {tuple(factor.shape)}."
            )


def kfacs_to_mat(factors: Sequence[Tensor]) -> Tensor:
    """Form the dense Kronecker product ``F_0 ⊗ F_1 ⊗ ... ⊗ F_{n-1}``.

    Args:
        factors: Square matrices, combined in list order.

    Returns:
        Dense matrix of size ``prod(d_i) x prod(d_i)``.

    """
    _check_square(factors)
    return reduce(torch.kron, factors)


def two_kfacs_to_mat(A: Tensor, B: Tensor) -> Tensor:
    """Form the dense Kronecker product ``A ⊗ B`` of two square matrices.

    Args:
        A: First (outer) factor.
        B: Second (inner) factor.

    Returns:
        Dense matrix ``A ⊗ B``.

    """
    return kfacs_to_mat([A, B])


def kfac_mat_prod(factors: Sequence[Tensor], mat: Tensor) -> Tensor:
    """Multiply ``F_0 ⊗ ... ⊗ F_{n-1}`` with ``mat`` without forming the product.

    Uses that, for row-major flattening, the Kronecker product acts on a vector reshaped
    to ``[d_0, ..., d_{n-1}]`` by applying ``F_i`` along axis ``i``.

    Args:
        factors: Square matrices of sizes ``d_i``.
        mat: Matrix of shape ``[D, K]`` with ``D = prod(d_i)``, or a vector of shape ``[D]``.

    Returns:
        The product, with the same shape as ``mat``.

    Raises:
        ValueError: If the leading dimension of ``mat`` does not equal ``D``.

    """
    _check_square(factors)
    dims = [int(f.shape[0]) for f in factors]
    total = 1
    for d in dims:
        total *= d
    is_vec = mat.dim() == 1
    result = mat.unsqueeze(-1) if is_vec else mat
    if result.dim() != 2 or result.shape[0] != total:
        raise ValueError(
            f"Expected a matrix with leading dimension {total} (= prod {dims}), "
            f"got shape {tuple(mat.shape)}."
        )
    num_cols = result.shape[1]
    result = result.reshape(*dims, num_cols)
    for axis, factor in enumerate(factors):
        # contract factor's column index with ``axis``, keep the new index at ``axis``
        result = torch.tensordot(factor, result, dims=([1], [axis])).movedim(0, axis)
    result = result.reshape(total, num_cols)
    return result.squeeze(-1) if is_vec else result
