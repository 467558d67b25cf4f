"""Where the coordinates of a block-diagonal curvature's blocks lie among the parameters.

A block covers one parameter, or a layer's weight and bias together (`bias` given: the bias
folded into the weight's input factor as an appended constant-1 input, `separate_weight_and_bias
=False`). Its own coordinates are those of its factors:

- a Kronecker block `[G, A]` acts on `[g, a]` matrices: the weight as stored, `weight.transpose(0,
  1)` when `transposed` (embeddings, transposed convolutions, transformers' `Conv1D`), flattened
  to `g` rows; with a folded bias, the bias is an extra last column: `[g, a + 1]`;
- a dense block acts on the parameter's row-major flattening.

Blocks exchange their vectors with the operators as the concatenation of their parameters'
row-major flattenings (weight first): `gather`, `scatter`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor


class BlockLayout:
    """A block's parameters and the map between their entries and the block's coordinates.

    Args:
        name: The (weight's) parameter name; the block's name.
        shape: That parameter's shape.
        transposed: Whether the coordinates are those of `parameter.transpose(0, 1)`.
        bias: The name of a bias folded into the block (its shape is `(g,)`), or None.
    """

    def __init__(
        self, name: str, shape: tuple, transposed: bool = False, bias: str | None = None
    ) -> None:
        self.name = name
        self.shape = tuple(shape)
        self.transposed = transposed
        self.bias = bias

    @property
    def names(self) -> list[str]:
        """The block's parameters, weight first."""
        return [self.name] if self.bias is None else [self.name, self.bias]

    @property
    def rows(self) -> int:
        """`g`: the first axis of the (possibly transposed) weight."""
        return self.shape[1] if self.transposed else self.shape[0]

    @property
    def weight_numel(self) -> int:
        """The (weight) parameter's number of entries."""
        return math.prod(self.shape)

    @property
    def numels(self) -> list[int]:
        """The number of entries of each of `names`."""
        return [self.weight_numel] if self.bias is None else [self.weight_numel, self.rows]

    @property
    def numel(self) -> int:
        """The block's number of entries (bias included)."""
        return sum(self.numels)

    def own_shape(self) -> tuple[int, ...]:
        """The shape of one vector in the block's coordinates (see the subclasses)."""
        raise NotImplementedError

    def to_own(self, v: Tensor) -> Tensor:
        """`[K, numel]` (or `[K, *shape]` of a one-parameter block) → `[K, *own_shape()]`."""
        k = v.shape[0]
        v = v.reshape(k, -1)
        w = v[:, : self.weight_numel].reshape(k, *self.shape)
        if self.transposed:
            w = w.transpose(1, 2)
        if self.bias is not None:
            w = torch.cat([w.reshape(k, self.rows, -1), v[:, self.weight_numel :, None]], dim=2)
        return w.reshape(k, *self.own_shape())

    def from_own(self, w: Tensor) -> Tensor:
        """Inverse of `to_own`, flattened: `[K, numel]` in the parameters' row-major order."""
        k = w.shape[0]
        bias = None
        if self.bias is not None:
            w = w.reshape(k, self.rows, -1)
            w, bias = w[:, :, :-1], w[:, :, -1]
        if self.transposed:
            swapped = (self.shape[1], self.shape[0], *self.shape[2:])
            w = w.reshape(k, *swapped).transpose(1, 2)
        w = w.reshape(k, -1)
        return w if bias is None else torch.cat([w, bias], dim=1)

    def index(self) -> Tensor | None:
        """`idx` with `flat[idx]` = the block's coordinates, flattened (None: the identity)."""
        if not self.transposed and self.bias is None:
            return None
        weight = torch.arange(self.weight_numel).reshape(self.shape)
        if self.transposed:
            weight = weight.transpose(0, 1)
        if self.bias is None:
            return weight.flatten()
        bias = torch.arange(self.weight_numel, self.numel).reshape(self.rows, 1)
        return torch.cat([weight.reshape(self.rows, -1), bias], dim=1).flatten()

    def place_dense(self, own: Tensor) -> Tensor:
        """A `[numel, numel]` matrix in the block's coordinates, in the parameters' order."""
        idx = self.index()
        if idx is None:
            return own
        idx = idx.to(own.device)
        out = torch.empty_like(own)
        out[idx[:, None], idx[None, :]] = own
        return out

    def place_diagonal(self, own: Tensor) -> Tensor:
        """A `[numel]` vector in the block's coordinates, in the parameters' order."""
        idx = self.index()
        if idx is None:
            return own
        out = torch.empty_like(own)
        out[idx.to(own.device)] = own
        return out

    def gather(self, pieces: Mapping[str, Tensor]) -> Tensor:
        """`[K, numel]`: the block's parameters' `[K, ...]` pieces, flattened and concatenated."""
        if self.bias is None:
            v = pieces[self.name]
            return v.reshape(v.shape[0], -1)
        parts = [pieces[n] for n in self.names]
        return torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)

    def scatter(self, flat: Tensor) -> dict[str, Tensor]:
        """Inverse of `gather`: `{name: [K, numel of name]}`."""
        return dict(zip(self.names, flat.split(self.numels, dim=1)))


def blockwise(
    blocks: Sequence[BlockLayout],
    names: Sequence[str],
    pieces: Sequence[Tensor],
    apply: Callable[[BlockLayout, Tensor], Tensor],
) -> list[Tensor]:
    """`apply(block, [K, numel])` on every block; the results split back per parameter.

    `pieces` are the parameters' `[K, ...]` pieces in the order of `names`; the result is one
    `[K, numel]` tensor per name, in that order.
    """
    given = dict(zip(names, pieces))
    out: dict[str, Tensor] = {}
    for block in blocks:
        out.update(block.scatter(apply(block, block.gather(given))))
    return [out[n] for n in names]


def global_index(blocks: Sequence[BlockLayout], names: Sequence[str], numels: Sequence[int]):
    """Each block's entries' positions in the concatenation of the parameters `names`."""
    offsets, start = {}, 0
    for name, numel in zip(names, numels):
        offsets[name] = start
        start += numel
    out = []
    for block in blocks:
        parts = [torch.arange(n) + offsets[name] for name, n in zip(block.names, block.numels)]
        out.append(torch.cat(parts))
    return out


def assemble_dense(
    blocks: Sequence[BlockLayout],
    names: Sequence[str],
    numels: Sequence[int],
    dense: Sequence[Tensor],
) -> Tensor:
    """The `[P, P]` block-diagonal matrix of the blocks' `[numel, numel]` matrices `dense`."""
    size = sum(numels)
    if not dense:
        raise ValueError("No block.")
    out = dense[0].new_zeros(size, size)
    for idx, d in zip(global_index(blocks, names, numels), dense):
        idx = idx.to(d.device)
        out[idx[:, None], idx[None, :]] = d
    return out


def assemble_diagonal(
    blocks: Sequence[BlockLayout],
    names: Sequence[str],
    numels: Sequence[int],
    diagonals: Sequence[Tensor],
) -> Tensor:
    """The `[P]` diagonal from the blocks' `[numel]` diagonals."""
    out = diagonals[0].new_zeros(sum(numels))
    for idx, d in zip(global_index(blocks, names, numels), diagonals):
        out[idx.to(d.device)] = d
    return out
