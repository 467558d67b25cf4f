"""backpack: more than the gradient from one PyTorch backward pass.

`extend` a model (and loss), then run `loss.backward()` inside `with backpack(*extensions):` to get
per-sample gradients, gradient statistics and curvature next to `.grad`.
"""

# torch.distributed: registers the synchronisation strategy that contexts use
from backpack import (
    distributed,  # noqa: E402, F401, I001
    extensions,  # noqa: F401
)
from backpack._version import __version__
from backpack.api import backpack, disable, extend, memory_cleanup
from backpack.custom_module.graph_utils import convert_module_to_backpack
from backpack.verification import VerifyReport, verify

__all__ = [
    "backpack",
    "extend",
    "disable",
    "memory_cleanup",
    "convert_module_to_backpack",
    "extensions",
    "verify",
    "VerifyReport",
    "__version__",
]
