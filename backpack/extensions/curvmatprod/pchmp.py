"""`PCHMP` at the original's module path."""

from backpack.extensions.secondorder import PCHMP

__all__ = ["PCHMP"]
