"""`Variance` at the original's module path."""

from backpack.extensions.firstorder import Variance

__all__ = ["Variance"]
