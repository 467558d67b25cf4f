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
from backpack.jacobian import jacobians
from backpack.verification import VerifyReport, verify


def _warn_if_original_installed() -> None:
    """Warn when the original BackPACK's distribution is installed in this environment too.

    Both distributions install the import name `backpack`: whichever was installed last
    overwrote the other's files, so an import may mix both packages.
    """
    import importlib.metadata
    import warnings

    try:
        importlib.metadata.distribution("backpack-for-pytorch")
    except importlib.metadata.PackageNotFoundError:
        return
    warnings.warn(
        "The original BackPACK (distribution 'backpack-for-pytorch') is installed next to this "
        "package (backpack-torch); both provide the import name `backpack`, so one overwrote "
        "the other's files. Use one per environment: `pip uninstall -y backpack-for-pytorch` "
        "then reinstall this one (from its checkout: `pip install --force-reinstall --no-deps "
        "-e .`). Libraries that depend on backpack-for-pytorch (laplace-torch, ...) can be "
        "installed with `pip install --no-deps` so that it is not pulled in again.",
        UserWarning,
        stacklevel=2,
    )


_warn_if_original_installed()

__all__ = [
    "backpack",
    "extend",
    "disable",
    "memory_cleanup",
    "convert_module_to_backpack",
    "jacobians",
    "extensions",
    "verify",
    "VerifyReport",
    "__version__",
]
