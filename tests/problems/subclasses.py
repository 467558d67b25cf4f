"""Subclasses of supported layers, with and without a forward of their own.

A subclass that keeps its parent's forward (or is declared with
`backpack.rules.register_standard_forward`) gets the parent's rule and every extension the
parent supports. One that overrides the forward (a scaled input, a standardised or scaled
weight, another activation function) computes something the parent's rule cannot see: it gets
the torch.func fallback, so first-order quantities and the GGN family only (tags "first",
"second"); the Kronecker and Hessian extensions refuse it (`tests/rules/test_base.py`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from backpack.rules import register_standard_forward
from problems import Problem, randn

ALL = {"first", "second", "hessian", "kron"}
FALLBACK = {"first", "second"}


class ScaledInputConv(nn.Conv2d):
    """Feeds the convolution twice its input."""

    def forward(self, x):
        return super().forward(2.0 * x)


class StandardisedConv(nn.Conv2d):
    """Weight standardisation (zero mean, unit deviation per output channel)."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class PaddedConv(nn.Conv1d):
    """Overrides only `_conv_forward` (which `Conv1d.forward` calls): pads by one on the left."""

    def _conv_forward(self, x, weight, bias):
        return F.conv1d(F.pad(x, (1, 0)), weight, bias, self.stride)


class ScaledWeightLinear(nn.Linear):
    """Uses three times its weight."""

    def forward(self, x):
        return F.linear(x, 3.0 * self.weight, self.bias)


class Affine(nn.Module):
    """A module with parameters and no rule (torch.func fallback): x W + b."""

    def __init__(self, features, out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(features, out) / features**0.5)
        self.b = nn.Parameter(torch.randn(out) / 2)

    def forward(self, x):
        return x @ self.w + self.b


class SoftReLU(nn.ReLU):
    """A smooth activation that only borrows ReLU's class."""

    def forward(self, x):
        return F.softplus(x)


class PlainSubclassLinear(nn.Linear):
    """A subclass without a forward of its own (e.g. torch's NonDynamicallyQuantizableLinear)."""


class CheckedLinear(nn.Linear):
    """A forward of its own that computes the parent's (declared standard below)."""

    def forward(self, x):
        assert x.dim() >= 2
        return super().forward(x)


register_standard_forward(CheckedLinear)


PROBLEMS = [
    Problem(
        "subclass-conv-scaled-input",
        lambda: nn.Sequential(
            ScaledInputConv(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 3)
        ),
        randn(4, 2, 4, 4),
        tags=FALLBACK,
    ),
    Problem(
        "subclass-conv-standardised-weight",
        lambda: nn.Sequential(
            StandardisedConv(2, 3, 2, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4, 3)
        ),
        randn(3, 2, 4, 4),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        tags=FALLBACK,
    ),
    Problem(
        "subclass-conv1d-own-conv-forward",
        lambda: nn.Sequential(PaddedConv(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6, 2)),
        randn(4, 2, 7),
        tags=FALLBACK,
    ),
    Problem(
        "subclass-linear-scaled-weight",
        lambda: nn.Sequential(ScaledWeightLinear(4, 5), nn.Sigmoid(), nn.Linear(5, 3)),
        randn(5, 4),
        lambda: nn.MSELoss(),
        tags=FALLBACK,
    ),
    Problem(
        # the in-place ReLU overwrites the output the fallback's independence check reads
        "fallback-custom-module-inplace-relu",
        lambda: nn.Sequential(Affine(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)),
        randn(5, 4),
        tags=FALLBACK,
    ),
    Problem(
        # F.linear on `[N, T, D]` returns a view, which the in-place ReLU rebases
        "fallback-linear-view-inplace-relu",
        lambda: nn.Sequential(
            ScaledWeightLinear(3, 4), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(8, 3)
        ),
        randn(5, 2, 3),
        lambda: nn.MSELoss(reduction="sum"),
        tags=FALLBACK,
    ),
    Problem(
        "subclass-activation-own-forward",
        lambda: nn.Sequential(nn.Linear(4, 5), SoftReLU(), nn.Linear(5, 3)),
        randn(5, 4),
        tags=FALLBACK,
    ),
    Problem(
        "subclass-linear-keeps-forward",
        lambda: nn.Sequential(PlainSubclassLinear(4, 5), nn.Tanh(), PlainSubclassLinear(5, 3)),
        randn(5, 4),
        tags=ALL,
    ),
    Problem(
        "subclass-linear-declared-standard",
        lambda: nn.Sequential(CheckedLinear(4, 5), nn.ELU(), CheckedLinear(5, 3)),
        randn(5, 4),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        tags=ALL,
    ),
]

