"""First-order extensions: reductions of the per-sample gradients g_n.

g_n is the gradient of sample n's term of the loss, including the loss's reduction factor
(1/N for `reduction="mean"`), so that Σ_n g_n equals `.grad` of one backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

from backpack.extensions.firstorder.base import (
    FirstOrderBackpropExtension,
    FirstOrderModuleExtension,
)


class BatchGrad(FirstOrderBackpropExtension):
    """Per-sample gradients, saved as `grad_batch` with shape `[N, *param.shape]`.

    Args:
        subsampling: Indices of the samples to keep (may repeat; order kept). The loss's
            reduction factor stays that of the full batch.
    """

    quantity = "grad_batch"

    def __init__(self, subsampling: Sequence[int] | None = None) -> None:
        super().__init__("grad_batch", subsampling=subsampling)


class BatchL2Grad(FirstOrderBackpropExtension):
    """Squared L2 norm of each per-sample gradient, saved as `batch_l2` with shape `[N]`."""

    quantity = "batch_l2"

    def __init__(self) -> None:
        super().__init__("batch_l2")


class SumGradSquared(FirstOrderBackpropExtension):
    """Sum over samples of the squared per-sample gradients, saved as `sum_grad_squared`."""

    quantity = "sum_grad_squared"

    def __init__(self) -> None:
        super().__init__("sum_grad_squared")


class Variance(FirstOrderBackpropExtension):
    """Elementwise variance of the per-sample gradients over the batch, saved as `variance`.

    Equals `grad_batch.var(0, unbiased=False)`.
    """

    quantity = "variance"

    def __init__(self) -> None:
        super().__init__("variance")


class BatchDotGrad(FirstOrderBackpropExtension):
    """Pairwise dot products `<g_n, g_m>` of per-sample gradients, saved as `batch_dot` `[N, N]`."""

    quantity = "batch_dot"

    def __init__(self) -> None:
        super().__init__("batch_dot")


__all__ = [
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "BatchDotGrad",
    "FirstOrderModuleExtension",
    "FirstOrderBackpropExtension",
]
