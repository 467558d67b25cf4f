"""Per-module-type math, registered in one table (see `backpack.rules.base`)."""

from backpack.rules import linear  # noqa: F401  (registers the rules)
from backpack.rules.base import ModuleRule, find_rule, register_rule, registered_module_classes

__all__ = ["ModuleRule", "find_rule", "register_rule", "registered_module_classes"]
