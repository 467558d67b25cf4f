"""`BatchDotGrad` at the original's module path."""

from backpack.extensions.firstorder import BatchDotGrad

__all__ = ["BatchDotGrad"]
