"""`GGNMP` at the original's module path."""

from backpack.extensions.secondorder import GGNMP

__all__ = ["GGNMP"]
