"""For which kind of device the rules choose among their implementations.

Several rules have two or more implementations of one quantity with the same numbers and
different costs (unfolding or folding a convolution, waiting for autograd's gradient sum or
computing it, channel correlations for a Kronecker factor). Which one is cheaper depends on
the device: a GPU waits for every operator call and every host-device synchronisation, a CPU
for every pass over memory. All such choices ask `kind(tensor)`.

`planning_for("cuda")` makes the rules choose as they would on a GPU while the tensors live on
the CPU: the cost model (`benchmarks/cost_model.py`) counts the calls, FLOPs and bytes of a
GPU's step on any machine that way, and tests check the GPU's implementations on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_PLANNED: list[str] = []


def kind(t: Tensor) -> str:
    """The device type whose cheapest implementation the rules pick for tensor `t`."""
    return _PLANNED[-1] if _PLANNED else t.device.type


@contextmanager
def planning_for(device_type: str) -> Iterator[None]:
    """Inside the block, rules choose implementations as on `device_type` ("cuda", "cpu")."""
    _PLANNED.append(device_type)
    try:
        yield
    finally:
        _PLANNED.pop()


#: host reads of device values skipped on the meta device (`host_bool`); the cost model counts
#: them as synchronisations
META_READS = [0]


def host_bool(flag: Tensor) -> bool:
    """`bool(flag)` for a one-element tensor: on a GPU the host waits for the card to get there.

    On the meta device (shapes only, as the cost model runs) there is no value: the answer is
    False, the case the rules expect to be common, and the read is counted in `META_READS`.
    """
    if flag.device.type == "meta":
        META_READS[0] += 1
        return False
    return bool(flag)


class _Tf32Products:
    """Context: float32 matrix products may use TF32 tensor cores (restored on exit)."""

    __slots__ = ("before",)

    def __enter__(self) -> None:
        self.before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc_info: object) -> None:
        torch.backends.cuda.matmul.allow_tf32 = self.before


def products_like_convolutions(t: Tensor) -> contextlib.AbstractContextManager:
    """Run the matrix products that stand in for a convolution's work in its precision.

    Products of unfolded inputs (per-sample weight gradients, Gram matrices of patches) are a
    convolution's arithmetic in another form. On a GPU, torch runs the plain step's
    convolutions in TF32 unless `torch.backends.cudnn.allow_tf32` is False, while it keeps
    float32 matrix products in full precision by default; inside this context such products
    follow the convolutions' setting (TF32 where cuDNN may use it), so that an extension's
    convolution work costs what the plain step's does. Elsewhere (CPU, other dtypes, TF32
    products already allowed, or cuDNN's TF32 off) nothing changes.
    """
    if (
        t.dtype is torch.float32
        and kind(t) == "cuda"
        and torch.backends.cudnn.allow_tf32
        and not torch.backends.cuda.matmul.allow_tf32
    ):
        return _Tf32Products()
    return contextlib.nullcontext()
