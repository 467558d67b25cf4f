"""`SumGradSquared` at the original's module path."""

from backpack.extensions.firstorder import SumGradSquared

__all__ = ["SumGradSquared"]
