"""Every registered activation's second derivative against autograd double backward."""

import pytest
import torch
from torch import nn

from backpack.rules.activations import _RULES, is_curvature_free

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
        self.module, self.args = module, (z,)


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
