"""Per-module-type math, registered in one table (see `backpack.rules.base`).

Every submodule of this package registers its rules on import; all are imported here.
"""

import importlib
import pkgutil

from backpack.rules.base import (
    ModuleRule,
    find_rule,
    register_rule,
    register_standard_forward,
    registered_module_classes,
)

for _info in pkgutil.iter_modules(__path__):
    if _info.name not in ("base", "generic"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = [
    "ModuleRule",
    "find_rule",
    "register_rule",
    "register_standard_forward",
    "registered_module_classes",
]
