"""`HMP` at the original's module path."""

from backpack.extensions.secondorder import HMP

__all__ = ["HMP"]
