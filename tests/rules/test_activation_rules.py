"""Every registered activation's second derivative against autograd double backward."""

import pytest
import torch
from torch import nn

from backpack.rules.activations import (
    _RULES,
    elementwise_derivative,
    is_curvature_free,
    is_elementwise,
)

MODULES = [
    nn.Sigmoid(),
    nn.Tanh(),
    nn.LogSigmoid(),
    nn.ELU(alpha=0.7),
    nn.SELU(),
    nn.CELU(alpha=0.5),
    nn.Softplus(beta=2, threshold=1.5),
    nn.SiLU(),
    nn.GELU(),
    nn.GELU(approximate="tanh"),
    nn.Hardswish(),
    nn.Mish(),
    nn.Softsign(),
]


class _Record:
    def __init__(self, module, z):
        self.module, self.args, self.kwargs = module, (z,), {}


@pytest.mark.parametrize("module", MODULES, ids=lambda m: repr(m))
def test_second_derivative(module):
    z = torch.linspace(-4, 4, 203, dtype=torch.float64).requires_grad_()
    (d1,) = torch.autograd.grad(module(z).sum(), z, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), z)
    rule = _RULES[type(module)]
    torch.testing.assert_close(rule.second_derivative(_Record(module, z.detach())), d2)


def test_every_rule_is_tested_and_piecewise_linear_ones_are_curvature_free():
    assert {type(m) for m in MODULES} == set(_RULES)
    for module in (nn.ReLU(), nn.LeakyReLU(), nn.Hardtanh(), nn.ReLU6(), nn.Hardsigmoid()):
        assert is_curvature_free(module)


PIECEWISE_LINEAR = [
    nn.ReLU(),
    nn.LeakyReLU(0.2),
    nn.ReLU6(),
    nn.Hardtanh(-0.5, 1.5),
    nn.Hardsigmoid(),
    nn.Threshold(0.3, -1.0),
    nn.Identity(),
    nn.Dropout(0.5).eval(),
]


@pytest.mark.parametrize("module", MODULES + PIECEWISE_LINEAR, ids=lambda m: repr(m))
def test_elementwise_derivative(module):
    z = torch.linspace(-4, 4, 203, dtype=torch.float64).reshape(7, 29).requires_grad_()
    (d1,) = torch.autograd.grad(module(z).sum(), z)
    torch.testing.assert_close(elementwise_derivative(_Record(module, z.detach())), d1)


def test_elementwise_excludes_random_in_place_and_mixing_modules():
    assert is_elementwise(nn.Dropout(0.0).train())
    for module in (nn.Dropout(0.5).train(), nn.ReLU(inplace=True), nn.Linear(2, 2), nn.Softmax(1)):
        assert not is_elementwise(module)
        assert elementwise_derivative(_Record(module, torch.randn(3, 2))) is None
