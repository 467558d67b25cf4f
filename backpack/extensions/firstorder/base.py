"""Base classes of the first-order extensions."""

from __future__ import annotations

from collections.abc import Sequence

from backpack.extensions.backprop_extension import FAIL_WARN, BackpropExtension
from backpack.extensions.module_extension import ModuleExtension


class FirstOrderModuleExtension(ModuleExtension):
    """A `ModuleExtension` for a first-order quantity (per-sample information of the gradient)."""


class FirstOrderBackpropExtension(BackpropExtension):
    """A built-in first-order extension: a named reduction of the per-sample gradients.

    `quantity` is one of "grad_batch", "batch_l2", "sum_grad_squared", "variance", "batch_dot";
    the engine computes it from the module rules, fusing where a rule allows.
    """

    quantity: str = ""

    def __init__(
        self,
        savefield: str,
        subsampling: Sequence[int] | None = None,
        module_exts: dict | None = None,
    ) -> None:
        super().__init__(
            savefield, module_exts=module_exts, fail_mode=FAIL_WARN, subsampling=subsampling
        )
