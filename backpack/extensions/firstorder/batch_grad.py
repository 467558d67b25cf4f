"""`BatchGrad` at the original's module path."""

from backpack.extensions.firstorder import BatchGrad

__all__ = ["BatchGrad"]
