"""Base class of every backpack extension."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from backpack.extensions.module_extension import ModuleExtension

FAIL_ERROR = "ERROR"
FAIL_WARN = "WARNING"
FAIL_SILENT = "SILENT"


class BackpropExtension:
    """An extension: a quantity computed during the backward and saved on each parameter.

    Args:
        savefield: Attribute name under which the quantity is stored on parameters.
        module_exts: Optional mapping from module classes to user-written `ModuleExtension`s.
        fail_mode: What to do for a parametrized module without a rule: "ERROR", "WARNING"
            or "SILENT".
        subsampling: Indices of the samples to compute the quantity for (None: all).
    """

    def __init__(
        self,
        savefield: str,
        module_exts: dict[type[nn.Module], ModuleExtension] | None = None,
        fail_mode: str = FAIL_ERROR,
        subsampling: Sequence[int] | None = None,
    ) -> None:
        self.savefield = savefield
        self._module_extensions: dict[type[nn.Module], ModuleExtension] = dict(module_exts or {})
        self._fail_mode = fail_mode
        self._subsampling = None if subsampling is None else list(subsampling)

    def set_module_extension(
        self, module: type[nn.Module], extension: ModuleExtension, overwrite: bool = False
    ) -> None:
        """Use `extension` for modules of class `module` (e.g. a custom layer).

        Raises:
            ValueError: If the class already has a module extension and `overwrite` is False.
        """
        if module in self._module_extensions and not overwrite:
            raise ValueError(
                f"{self.__class__.__name__} already has a module extension for {module}. "
                "Pass overwrite=True to replace it."
            )
        self._module_extensions[module] = extension

    def get_module_extension(self, module: nn.Module) -> ModuleExtension | None:
        """The user-written module extension for `module`'s class (or its nearest base)."""
        for cls in type(module).__mro__:
            ext = self._module_extensions.get(cls)
            if ext is not None:
                return ext
        return None

    def get_subsampling(self) -> list[int] | None:
        """Indices of the active samples, or None for all."""
        return self._subsampling

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"

    # Engine-facing description; overridden by the built-in extensions.
    def _describe(self) -> dict[str, Any]:
        return {"savefield": self.savefield}
