"""`KFAC` at the original's module path."""

from backpack.extensions.secondorder import KFAC

__all__ = ["KFAC"]
