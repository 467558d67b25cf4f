"""Kronecker-factored curvature (KFAC, KFLR, KFRA) and the names of its strategies.

Client libraries import `LossHessianStrategy` from here to name the two ways the loss Hessian is
factorised: `EXACT` (one column per output entry, as in `SqrtGGNExact`) and `SAMPLING`
(Monte-Carlo columns, as in `SqrtGGNMC`); `SUM` is KFRA's batch-summed dense Hessian.
"""

from backpack.extensions.secondorder import HBP, KFAC, KFLR, KFRA


class LossHessianStrategy:
    """How the Hessian of the loss w.r.t. the model output is represented (string constants)."""

    EXACT = "exact"
    SAMPLING = "sampling"
    SUM = "sum"

    CHOICES = (EXACT, SAMPLING, SUM)

    @classmethod
    def check_exists(cls, strategy: str) -> None:
        """Raise `AttributeError` unless `strategy` is one of `CHOICES`."""
        if strategy not in cls.CHOICES:
            raise AttributeError(
                f"Unknown loss Hessian strategy {strategy!r}; choose one of {cls.CHOICES}."
            )


__all__ = ["HBP", "KFAC", "KFLR", "KFRA", "LossHessianStrategy"]
