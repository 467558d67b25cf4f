"""Symmetric factorisations of the GGN, at the original's module path."""

from backpack.extensions.secondorder import SqrtGGNExact, SqrtGGNMC

__all__ = ["SqrtGGNExact", "SqrtGGNMC"]
