"""Base class of the second-order extensions, at the module path client libraries import."""

from backpack.extensions.secondorder import SecondOrderBackpropExtension

__all__ = ["SecondOrderBackpropExtension"]
