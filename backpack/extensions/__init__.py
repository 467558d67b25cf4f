"""The extensions: what to compute during the backward pass."""

from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder import (
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    SumGradSquared,
    Variance,
)

__all__ = [
    "BackpropExtension",
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "BatchDotGrad",
]
