"""Squares of gradients in a Kronecker eigenbasis (`backpack.curvature._eigen`): convolutions
and Linear layers, each with its bias in its own basis or folded into the weight's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backpack import backpack, extend
from backpack.curvature import _eigen
from backpack.curvature._eigen import EigenState, eigen_rules
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
    chosen = _eigen.plan
    monkeypatch.setattr(
        _eigen, "plan", lambda *args: {**chosen(*args), "native": native and kind != "conv"}
    )
    extend(layer)
    with eigen_rules({layer: EigenState(q_out, q_in, q_bias)}):
        with backpack(SumGradSquared()):
            (layer(x) * g).sum().backward()
    assert type(layer) is LAYERS[kind]().__class__
    torch.testing.assert_close(layer.weight.sum_grad_squared.reshape(expected.shape), expected)
    torch.testing.assert_close(layer.bias.sum_grad_squared, (bias @ q_bias).square().sum(0))
    torch.testing.assert_close(layer.weight.grad, plain)
    torch.testing.assert_close(layer.bias.grad, bias.sum(0))


def folded_grads(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`[N, C_out, D + 1]`: per-sample gradients of `[W | b]` in the block's coordinates."""
    rows = []
    for n in range(x.shape[0]):
        out = layer(x[n : n + 1])
        w, b = torch.autograd.grad(out, [layer.weight, layer.bias], g[n : n + 1])
        if isinstance(layer, nn.ConvTranspose1d):
            w = w.transpose(0, 1)
        rows.append(torch.cat([w.reshape(w.shape[0], -1), b[:, None]], dim=1))
    return torch.stack(rows)


FOLDED = {
    **LAYERS,
    "linear": lambda: nn.Linear(4, 3),
    "linear-sequence": lambda: nn.Linear(4, 3),
}
FOLDED_INPUTS = {**INPUTS, "linear": (5, 4), "linear-sequence": (5, 3, 4)}


@pytest.mark.parametrize("kind", list(FOLDED))
def test_folded_and_linear_squares_of_the_sweep(kind):
    """A folded bias is the last input column: `SumGradSquared` gives the squares of the
    gradients of `[W | b]` in `Q_G ⊗ Q_Ã`, split into the weight's and the bias's shapes; Linear
    layers take the same mechanism (one product on `[N, in]`, per-sample gradients or Grams on
    sequences); `.grad` stays autograd's."""
    torch.manual_seed(0)
    layer = FOLDED[kind]().double()
    x = torch.randn(*FOLDED_INPUTS[kind], dtype=torch.float64)
    g = torch.randn_like(layer(x))
    grads = folded_grads(layer, x, g)
    q_out, q_in = orthogonal(grads.shape[1]), orthogonal(grads.shape[2])
    expected = (q_out.T @ grads @ q_in).square().sum(0)
    (plain_w, plain_b) = torch.autograd.grad(layer(x), [layer.weight, layer.bias], g)
    extend(layer)
    with eigen_rules({layer: EigenState(q_out, q_in, None, fold=True)}):
        with backpack(SumGradSquared()):
            (layer(x) * g).sum().backward()
    rows = expected.shape[0]
    weight = layer.weight.sum_grad_squared.reshape(rows, -1)
    folded = torch.cat([weight, layer.bias.sum_grad_squared[:, None]], 1)
    torch.testing.assert_close(folded, expected)
    torch.testing.assert_close(layer.weight.grad, plain_w)
    torch.testing.assert_close(layer.bias.grad, plain_b)


@pytest.mark.parametrize("way", ["gradients", "gram"])
def test_linear_sequence_squares_both_ways(way):
    """On sequences the Linear squares come from per-sample gradients or from Gram matrices over
    positions: both equal the brute-force squares, with column weights."""
    torch.manual_seed(1)
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    f = torch.randn(6, 4, 3, 2, dtype=torch.float64)
    coef = torch.rand(6, 4, dtype=torch.float64)
    state = EigenState(orthogonal(2), orthogonal(5))
    grads = torch.einsum("vnto,nti->vnoi", f, x)
    expected = (state.q_out.T @ grads @ state.q_in).square()
    expected = (expected * coef[:, :, None, None]).sum((0, 1))
    torch.testing.assert_close(_eigen.linear_squares(x, f, coef, state, way), expected)
