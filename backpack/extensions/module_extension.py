"""User-written per-module rules for an extension (the original's extension-authoring API)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn


class ModuleExtension:
    """Computes an extension's quantity for the parameters of one module type.

    Subclasses name the parameters they handle in `params` and define one method per name,
    `name(ext, module, g_inp, g_out, bpQuantities) -> Tensor`. `module.input0` and
    `module.output` hold the recorded input and output while the method runs; `g_out` is the
    tuple of gradients w.r.t. the module's outputs (`g_inp` is a tuple of Nones: the engine
    observes output gradients only).
    """

    def __init__(self, params: list[str] | None = None) -> None:
        self._params = list(params or [])

    def apply(self, ext: Any, module: nn.Module, g_inp: tuple, g_out: tuple) -> None:
        """Compute and store the quantity of `ext` for each handled parameter of `module`."""
        for name in self._params:
            param = getattr(module, name, None)
            if not isinstance(param, Tensor) or not param.requires_grad:
                continue
            value = getattr(self, name)(ext, module, g_inp, g_out, None)
            setattr(param, ext.savefield, value)

    __call__ = apply
