"""`KFLR` at the original's module path."""

from backpack.extensions.secondorder import KFLR

__all__ = ["KFLR"]
