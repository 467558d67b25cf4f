"""The shared problem table: every extension's tests run over these problems.

Each module in this package defines `PROBLEMS: list[Problem]` for one layer family. A problem
builds a float64 model (with or without extension; the tests extend it), an input, a loss
function and targets. References are brute force: per-sample gradients from one autograd
backward per sample of the full-batch per-sample loss.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

DTYPE = torch.float64
#: where built problems live: BACKPACK_TEST_DEVICE=cuda moves every model, input and target there
#: (built on the CPU first, so the numbers are those of a CPU run); defaults to torch's default
_ENV = os.environ
DEVICE = torch.device(
    _ENV.get("BACKPACK_TEST_DEVICE") or _ENV.get("BACKPACK_TEST_DEFAULT_DEVICE") or "cpu"
)


def to_device(obj: Any) -> Any:
    """`obj` (a tensor, or tuples/lists/dicts of them) on `DEVICE`; leaves keep requires_grad."""
    if isinstance(obj, Tensor):
        moved = obj.detach().to(DEVICE)
        return moved.requires_grad_(obj.requires_grad) if obj.is_leaf else obj.to(DEVICE)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v) for k, v in obj.items()}
    return obj


@dataclass
class Problem:
    """One model + data + loss configuration."""

    id: str
    make_model: Callable[[], nn.Module]
    make_input: Callable[[], Any]
    make_loss: Callable[[], nn.Module] = lambda: nn.CrossEntropyLoss()
    make_target: Callable[[Tensor], Tensor] | None = None
    #: which extension families apply ("first", "second", "diag_h", "kfac", ...)
    tags: set[str] = field(default_factory=lambda: {"first"})
    #: extra keyword flags the tests may read
    options: dict[str, Any] = field(default_factory=dict)

    def build(self, seed: int = 0) -> tuple[nn.Module, Any, nn.Module, Tensor]:
        """Fresh float64 model, input, loss function and targets (deterministic for `seed`)."""
        torch.manual_seed(seed)
        model = self.make_model().to(DTYPE).to(DEVICE)
        x = to_device(self.make_input())
        lossfunc = self.make_loss().to(DEVICE)
        with torch.no_grad():
            out = model(x)
        y = self.make_target(out) if self.make_target is not None else default_target(lossfunc, out)
        return model, x, lossfunc, to_device(y)


def assert_same_grad(actual: Tensor, expected: Tensor, summed_from_samples: bool = False) -> None:
    """`.grad` with extensions equals plain autograd's: bit for bit on the CPU; on GPUs, where
    kernels with atomic adds (pooling, convolution backward) differ between two plain runs, to
    the last few bits. With first-order extensions alone, convolution gradients may be sums of
    per-sample gradients (`backpack.grads_from_samples`): also equal to the last few bits."""
    exact = DEVICE.type == "cpu" and not summed_from_samples
    rtol, atol = (0.0, 0.0) if exact else (1e-12, 1e-15)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def default_target(lossfunc: nn.Module, out: Tensor) -> Tensor:
    """Random targets fitting the loss: class indices for CE, values for MSE, {0,1} for BCE."""
    if isinstance(lossfunc, nn.CrossEntropyLoss):
        n, c = out.shape[0], out.shape[1]
        return torch.randint(0, c, (n, *out.shape[2:]))
    if isinstance(lossfunc, nn.BCEWithLogitsLoss):
        return torch.randint(0, 2, out.shape).to(out.dtype)
    return torch.randn_like(out)


def per_sample_losses(lossfunc: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    """The terms R * l_n of the loss, one per sample (R: the reduction factor)."""
    none = type(lossfunc)(reduction="none")
    for attr in ("weight", "ignore_index", "label_smoothing", "pos_weight"):
        if hasattr(lossfunc, attr) and getattr(lossfunc, attr) is not None:
            setattr(none, attr, getattr(lossfunc, attr))
    terms = none(out, y)
    scale = 1.0 if lossfunc.reduction == "sum" else 1.0 / terms.numel()
    return terms.reshape(terms.shape[0], -1).sum(1) * scale


def reference_per_sample_grads(
    model: nn.Module, x: Any, lossfunc: nn.Module, y: Tensor, create_graph: bool = False
) -> dict[str, Tensor]:
    """Brute force: one backward per sample through the full-batch forward."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    out = model(x)
    terms = per_sample_losses(lossfunc, out, y)
    rows = []
    for n in range(terms.shape[0]):
        grads = torch.autograd.grad(
            terms[n],
            list(params.values()),
            retain_graph=True,
            allow_unused=True,
            create_graph=create_graph,
        )
        rows.append(
            [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
        )
    return {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(params)}


def first_order_reference(psg: Tensor, quantity: str, subsampling=None) -> Tensor:
    """A first-order quantity from per-sample gradients, by its definition."""
    if quantity == "grad_batch":
        return psg if subsampling is None else psg[list(subsampling)]
    if quantity == "batch_l2":
        return psg.flatten(1).square().sum(1)
    if quantity == "sum_grad_squared":
        return psg.square().sum(0)
    if quantity == "variance":
        return psg.var(0, unbiased=False)
    if quantity == "batch_dot":
        flat = psg.flatten(1)
        return flat @ flat.T
    raise ValueError(quantity)


def _collect() -> list[Problem]:
    problems: list[Problem] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        problems.extend(getattr(module, "PROBLEMS", []))
    ids = [p.id for p in problems]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"duplicate problem ids: {duplicates}"
    return problems


def randn(*shape: int) -> Callable[[], Tensor]:
    """Input builder: standard normal float64 tensor of the given shape."""
    return lambda: torch.randn(*shape, dtype=DTYPE)


ALL_PROBLEMS = _collect()


def problems_with(tag: str) -> list[Problem]:
    """Problems tagged with `tag`."""
    return [p for p in ALL_PROBLEMS if tag in p.tags]


FIRST_ORDER_QUANTITIES = ["grad_batch", "batch_l2", "sum_grad_squared", "variance", "batch_dot"]


def check_first_order_without_fallback(problem: Problem, monkeypatch: Any) -> nn.Module:
    """Every first-order extension at once, no torch.func fallback and no warning, checked
    against brute force; returns the extended model (for further checks)."""
    import warnings

    from backpack import backpack, extend
    from backpack.extensions import (
        BatchDotGrad,
        BatchGrad,
        BatchL2Grad,
        SumGradSquared,
        Variance,
    )
    from backpack.rules.generic import FuncRule

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.func fallback used")

    monkeypatch.setattr(FuncRule, "per_sample_grads", forbidden)
    model, x, lossfunc, y = problem.build()
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    extend(model)
    exts = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with backpack(*exts):
            lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        for quantity in FIRST_ORDER_QUANTITIES:
            expected = first_order_reference(reference[name], quantity)
            torch.testing.assert_close(getattr(p, quantity), expected, msg=f"{name} {quantity}")
    return model
