"""Squares of convolution gradients in a Kronecker eigenbasis (`backpack.curvature._conv_eigen`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backpack import backpack, extend
from backpack.curvature import _conv_eigen
from backpack.curvature._conv_eigen import Bases, eigenbasis_rules
from backpack.extensions import SumGradSquared

LAYERS = {
    "conv": lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2),
    "transposed": lambda: nn.ConvTranspose1d(4, 3, 3, stride=2),
}
INPUTS = {"conv": (5, 4, 5, 6), "transposed": (5, 4, 6)}


def orthogonal(n: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))[0]


def block_grads(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`[N, C_out, D]` per-sample gradients in the block's coordinates, by autograd per sample."""
    rows = []
    for n in range(x.shape[0]):
        out = layer(x[n : n + 1])
        (grad,) = torch.autograd.grad(out, layer.weight, g[n : n + 1])
        if isinstance(layer, nn.ConvTranspose1d):
            grad = grad.transpose(0, 1)
        rows.append(grad.reshape(grad.shape[0], -1))
    return torch.stack(rows)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_squares_and_gradient_of_the_sweep(kind, native, monkeypatch):
    """`SumGradSquared` on a target gives `Σ_n (Q_Gᵀ g_n Q_A)²` and `(Q_Bᵀ Σ_l g_n)²`, and the
    `.grad` derived from the same chunks is autograd's."""
    torch.manual_seed(0)
    layer = LAYERS[kind]().double()
    x = torch.randn(*INPUTS[kind], dtype=torch.float64)
    g = torch.randn_like(layer(x))
    grads = block_grads(layer, x, g)
    q_out, q_in, q_bias = orthogonal(grads.shape[1]), orthogonal(grads.shape[2]), None
    q_bias = orthogonal(layer.bias.shape[0])
    expected = (q_out.T @ grads @ q_in).square().sum(0)
    bias = g.sum(tuple(range(2, g.dim())))
    (plain,) = torch.autograd.grad(layer(x), layer.weight, g)
    chosen = _conv_eigen.plan
    monkeypatch.setattr(
        _conv_eigen, "plan", lambda *args: {**chosen(*args), "native": native and kind != "conv"}
    )
    extend(layer)
    with eigenbasis_rules({layer: Bases(q_out, q_in, q_bias)}):
        with backpack(SumGradSquared()):
            (layer(x) * g).sum().backward()
    assert type(layer) is LAYERS[kind]().__class__
    torch.testing.assert_close(layer.weight.sum_grad_squared.reshape(expected.shape), expected)
    torch.testing.assert_close(layer.bias.sum_grad_squared, (bias @ q_bias).square().sum(0))
    torch.testing.assert_close(layer.weight.grad, plain)
    torch.testing.assert_close(layer.bias.grad, bias.sum(0))
