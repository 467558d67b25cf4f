"""Curvature-matrix products (`GGNMP`, `HMP`, `PCHMP`), at the original's module path."""

from backpack.extensions.secondorder import GGNMP, HMP, PCHMP

__all__ = ["GGNMP", "HMP", "PCHMP"]
