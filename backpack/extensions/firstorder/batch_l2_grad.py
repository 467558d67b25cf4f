"""`BatchL2Grad` at the original's module path."""

from backpack.extensions.firstorder import BatchL2Grad

__all__ = ["BatchL2Grad"]
