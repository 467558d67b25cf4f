"""Curvature of a data set: quantities accumulated over batches, linear operators, estimators.

- `accumulate(model, lossfunc, data, extensions)`: each extension's quantity of the data-set loss
  (one backward per batch), as an `Accumulated` result that merges with other sweeps.
- Operators over a data set: `GGN`, `Hessian`, `EmpiricalFisher` (exact products, batched over
  columns), `KFAC` (Kronecker-factored, closed-form inverse and log-determinant) and `EKFAC`
  (KFAC's eigenbasis with eigenvalues refitted to the curvature).
- Estimators on any symmetric operator: `eigvalsh`, `hutchinson_trace`, `hutchinson_diagonal`,
  `hutchpp_trace`.
- `xtrace`, `xdiag` (exchangeable trace and diagonal estimators); `spectral_density`,
  `lanczos_quadrature` and `slq_logdet` (stochastic Lanczos quadrature); `op.inverse(damping)`
  of the exact operators (`CGInverse`, batched conjugate gradients).

This is the data-set layer: it is built only on `extend` and `backpack(...)`.
"""

from backpack.curvature.accumulate import Accumulated, accumulate
from backpack.curvature.cg import CGInfo, conjugate_gradients
from backpack.curvature.ekfac import EKFAC, EKFACInverse
from backpack.curvature.estimators import (
    eigvalsh,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    xdiag,
    xtrace,
)
from backpack.curvature.kfac import KFAC, KFACInverse
from backpack.curvature.operators import GGN, CGInverse, CurvatureOperator, EmpiricalFisher, Hessian
from backpack.curvature.spectral import lanczos_quadrature, slq_logdet, spectral_density

__all__ = [
    "accumulate",
    "Accumulated",
    "CurvatureOperator",
    "GGN",
    "Hessian",
    "EmpiricalFisher",
    "KFAC",
    "KFACInverse",
    "EKFAC",
    "EKFACInverse",
    "eigvalsh",
    "hutchinson_trace",
    "hutchinson_diagonal",
    "hutchpp_trace",
    "xtrace",
    "xdiag",
    "CGInverse",
    "CGInfo",
    "conjugate_gradients",
    "lanczos_quadrature",
    "spectral_density",
    "slq_logdet",
]
