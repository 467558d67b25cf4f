"""Backward passes with several losses or forwards: what counts as a sample.

Each scenario builds a float64 model, its loss functions and data, the backward's loss, and a
brute-force description of its samples: `outputs(call)` runs the model like the loss does and
`terms(outputs)` gives the per-sample terms (weights and reduction factors included) whose sum
is the loss. The tests compare every extension with `SampleCurvature` built from these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from problems import DTYPE, to_device


def _factor(reduction: str, count: int) -> float:
    return 1.0 if reduction == "sum" else 1.0 / count


@dataclass
class Scenario:
    """A backward over several losses and/or forwards, with its brute-force sample terms."""

    id: str
    make_model: Callable[[], nn.Module]
    #: data (inputs and targets) by name
    make_data: Callable[[], dict[str, Tensor]]
    #: loss functions by name (built fresh; the tests extend them)
    make_losses: Callable[[], dict[str, nn.Module]]
    #: the backward's loss from the model (or its functional stand-in), losses and data
    loss: Callable[[Any, dict, dict], Tensor]
    #: the tensors the losses take, from the model or its functional stand-in
    outputs: Callable[[Any, dict], tuple[Tensor, ...]]
    #: per-sample terms `[N]` of the loss from those outputs
    terms: Callable[[tuple[Tensor, ...], dict, dict], Tensor]
    #: some loss enters with a negative weight (no square roots then)
    signed: bool = False
    tags: set[str] = field(default_factory=lambda: {"first", "second", "hessian"})

    def build(self, seed: int = 0) -> tuple[nn.Module, dict[str, nn.Module], dict[str, Tensor]]:
        """Fresh float64 model, loss functions and data."""
        torch.manual_seed(seed)
        model = to_device(self.make_model().to(DTYPE))
        model = model.to(to_device(torch.zeros(1)).device)
        return model, self.make_losses(), to_device(self.make_data())


class TwoHeads(nn.Module):
    """A shared trunk with a classification and a regression head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
        self.cls = nn.Linear(5, 3)
        self.reg = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


def _multitask(reduction: str, w1: float, w2: float) -> Scenario:
    n = 6

    def loss(model, losses, data):
        out_cls, out_reg = model(data["x"])
        ce = losses["ce"](out_cls, data["y_cls"])
        return w1 * ce + w2 * losses["mse"](out_reg, data["y_reg"])

    def terms(outs, losses, data):
        out_cls, out_reg = outs
        ce = F.cross_entropy(out_cls, data["y_cls"], reduction="none") * _factor(reduction, n)
        mse = (out_reg - data["y_reg"]).square().sum(1) * _factor(reduction, out_reg.numel())
        return w1 * ce + w2 * mse

    return Scenario(
        f"multitask-{reduction}-{w1}-{w2}",
        TwoHeads,
        lambda: {
            "x": torch.randn(n, 4, dtype=DTYPE),
            "y_cls": torch.randint(0, 3, (n,)),
            "y_reg": torch.randn(n, 2, dtype=DTYPE),
        },
        lambda: {
            "ce": nn.CrossEntropyLoss(reduction=reduction),
            "mse": nn.MSELoss(reduction=reduction),
        },
        loss,
        lambda model, data: model(data["x"]),
        terms,
        signed=w1 < 0 or w2 < 0,
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _two_forwards(reduction: str, n1: int, n2: int) -> Scenario:
    """One model run on two batches, each with its own loss call: N1 + N2 samples."""

    def loss(model, losses, data):
        ce = losses["ce"]
        return ce(model(data["x1"]), data["y1"]) + ce(model(data["x2"]), data["y2"])

    def terms(outs, losses, data):
        o1, o2 = outs
        t1 = F.cross_entropy(o1, data["y1"], reduction="none") * _factor(reduction, n1)
        t2 = F.cross_entropy(o2, data["y2"], reduction="none") * _factor(reduction, n2)
        return torch.cat([t1, t2])

    return Scenario(
        f"two-forwards-{reduction}-{n1}-{n2}",
        _mlp,
        lambda: {
            "x1": torch.randn(n1, 4, dtype=DTYPE),
            "y1": torch.randint(0, 3, (n1,)),
            "x2": torch.randn(n2, 4, dtype=DTYPE),
            "y2": torch.randint(0, 3, (n2,)),
        },
        lambda: {"ce": nn.CrossEntropyLoss(reduction=reduction)},
        loss,
        lambda model, data: (model(data["x1"]), model(data["x2"])),
        terms,
    )


def _siamese(reduction: str) -> Scenario:
    """Two calls whose outputs meet in one loss: sample n is one sample (rows summed)."""
    n = 5

    def loss(model, losses, data):
        return losses["mse"](model(data["x1"]) - model(data["x2"]), data["y"])

    def terms(outs, losses, data):
        (diff,) = outs
        return (diff - data["y"]).square().sum(1) * _factor(reduction, diff.numel())

    return Scenario(
        f"siamese-{reduction}",
        _mlp,
        lambda: {
            "x1": torch.randn(n, 4, dtype=DTYPE),
            "x2": torch.randn(n, 4, dtype=DTYPE),
            "y": torch.randn(n, 3, dtype=DTYPE),
        },
        lambda: {"mse": nn.MSELoss(reduction=reduction)},
        loss,
        lambda model, data: (model(data["x1"]) - model(data["x2"]),),
        terms,
        # the Hessian's cross terms between the two calls are not computed (refused)
        tags={"first", "second"},
    )


def _token_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 4))


def _flattened(reduction: str, loss_name: str, time_major: bool) -> Scenario:
    """A loss on `[N·T, C]` rows flattened from per-token outputs `[N, T, C]`."""
    n, t, c = 3, 4, 4

    def flatten(out: Tensor) -> Tensor:
        return (out.transpose(0, 1) if time_major else out).reshape(-1, c)

    def flat_target(y: Tensor) -> Tensor:
        y = y.transpose(0, 1) if time_major else y
        return y.reshape(-1) if loss_name == "ce" else y.reshape(-1, c)

    def loss(model, losses, data):
        return losses[loss_name](flatten(model(data["x"])), flat_target(data["y"]))

    def terms(outs, losses, data):
        (out,) = outs
        if loss_name == "ce":
            token = F.cross_entropy(out.reshape(-1, c), data["y"].reshape(-1), reduction="none")
            count = n * t
        else:
            token = (out - data["y"]).square().sum(-1)
            count = out.numel()
        return token.reshape(n, t).sum(1) * _factor(reduction, count)

    layout = "time-major" if time_major else "batch-major"
    return Scenario(
        f"flattened-{loss_name}-{reduction}-{layout}",
        _token_mlp,
        lambda: {
            "x": torch.randn(n, t, 2, dtype=DTYPE),
            "y": torch.randint(0, c, (n, t))
            if loss_name == "ce"
            else torch.randn(n, t, c, dtype=DTYPE),
        },
        lambda: {loss_name: nn.CrossEntropyLoss(reduction=reduction) if loss_name == "ce"
                 else nn.MSELoss(reduction=reduction)},
        loss,
        lambda model, data: (model(data["x"]),),
        terms,
    )


def _functional(reduction: str) -> Scenario:
    """nanoGPT's idiom: `F.cross_entropy` on flattened logits, plus a weighted `F.mse_loss`."""
    n, t, c = 3, 4, 4

    def loss(model, losses, data):
        out = model(data["x"])
        ce = F.cross_entropy(out.view(-1, c), data["y"].view(-1), reduction=reduction)
        return ce + 0.5 * F.mse_loss(out, data["z"], reduction=reduction)

    def terms(outs, losses, data):
        (out,) = outs
        ce = F.cross_entropy(out.reshape(-1, c), data["y"].reshape(-1), reduction="none")
        mse = (out - data["z"]).square().sum(-1)
        ce = ce.reshape(n, t).sum(1) * _factor(reduction, n * t)
        return ce + 0.5 * mse.sum(1) * _factor(reduction, out.numel())

    return Scenario(
        f"functional-losses-{reduction}",
        _token_mlp,
        lambda: {
            "x": torch.randn(n, t, 2, dtype=DTYPE),
            "y": torch.randint(0, c, (n, t)),
            "z": torch.randn(n, t, c, dtype=DTYPE),
        },
        lambda: {},
        loss,
        lambda model, data: (model(data["x"]),),
        terms,
    )


SCENARIOS = [
    _functional("mean"),
    _functional("sum"),
    *[_multitask(r, w1, w2) for r in ("mean", "sum") for w1, w2 in ((1.0, 1.0), (0.3, 2.0))],
    _multitask("mean", 0.3, -2.0),
    *[_two_forwards(r, n1, n2) for r in ("mean", "sum") for n1, n2 in ((3, 4), (3, 3))],
    _siamese("mean"),
    _siamese("sum"),
    *[_flattened(r, "ce", False) for r in ("mean", "sum")],
    _flattened("mean", "ce", True),
    _flattened("sum", "mse", False),
]
