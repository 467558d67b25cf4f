"""The extensions: what to compute during the backward pass."""

from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder import (
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    SumGradSquared,
    Variance,
)
from backpack.extensions.secondorder import (
    GGNMP,
    HBP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchJacobian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)

__all__ = [
    "BackpropExtension",
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "BatchDotGrad",
    "DiagGGNExact",
    "DiagGGNMC",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "BatchJacobian",
    "DiagHessian",
    "BatchDiagHessian",
    "KFAC",
    "KFLR",
    "KFRA",
    "HBP",
    "HMP",
    "GGNMP",
    "PCHMP",
]
