"""`KFRA` at the original's module path."""

from backpack.extensions.secondorder import KFRA

__all__ = ["KFRA"]
