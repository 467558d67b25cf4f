"""KFAC/KFLR for weights shared over positions: the "expand" and "reduce" conventions.

With inputs a_{n,p} and output factors s_{v,n,p} at the positions p of sample n (R of them):
- expand (Linear): A = 1/(N R) Σ_{n,p} a aᵀ, G = Σ_{v,n,p} s sᵀ;
  expand (convolutions, the original's convention): A = 1/N Σ_{n,p} a aᵀ, G as for reduce;
- reduce: A = 1/N Σ_n ā_n ā_nᵀ with ā_n = 1/R Σ_p a_{n,p}, G = Σ_{v,n} (Σ_p s)(Σ_p s)ᵀ,
  which is the GGN block of a bias shared by all positions.
"""

import pytest
import torch
import torch.nn.functional as F
from second_order_reference import Curvature
from torch import nn

from backpack import backpack, extend
from backpack.extensions import KFAC, KFLR

DT = torch.float64


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10, msg=msg)


class TokenNet(nn.Module):
    """Linear layers on `[N, T, D]`, CE over `[N, C, T]` logits."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).transpose(1, 2)


def _run(model, x, y, ext):
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(ext):
        lossfunc(model(x), y).backward()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_on_sequences(reduction):
    torch.manual_seed(0)
    model = TokenNet().to(DT)
    x, y = torch.randn(3, 4, 3, dtype=DT), torch.randint(0, 5, (3, 4))
    ref = Curvature(model, x, nn.CrossEntropyLoss(reduction=reduction), y, per_sample=False)
    inputs = {"a": x, "b": torch.tanh(model.a(x)).detach()}
    for approx in ("expand", "reduce"):
        extend(model)
        lossfunc = extend(nn.CrossEntropyLoss(reduction=reduction))
        with backpack(KFLR(kfac_approx=approx)):
            lossfunc(model(x), y).backward()
        for name in ("a", "b"):
            layer, a_in = getattr(model, name), inputs[name]
            g, a = layer.weight.kflr
            n, t = a_in.shape[:2]
            if approx == "reduce":
                mean = a_in.mean(1)
                close(a, mean.T @ mean / n, f"{approx} A {name}")
                close(g, ref.block(ref.ggn, f"{name}.bias"), f"{approx} G {name}")
            else:
                flat = a_in.reshape(-1, a_in.shape[-1])
                close(a, flat.T @ flat / (n * t), f"{approx} A {name}")
            close(layer.bias.kflr[0], g)


def test_conv_reduce_and_expand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 3 * 3, 4)).to(DT)
    x, y = torch.randn(5, 2, 6, 6, dtype=DT), torch.randint(0, 4, (5,))
    ref = Curvature(model, x, nn.CrossEntropyLoss(), y, per_sample=False)
    conv = model[0]
    unfolded = F.unfold(x, 3, padding=1, stride=2)  # [N, C K, L]
    for approx in ("expand", "reduce"):
        _run(model, x, y, KFLR(kfac_approx=approx))
        g, a = conv.weight.kflr
        close(g, ref.block(ref.ggn, "0.bias"), approx)
        if approx == "reduce":
            mean = unfolded.mean(-1)
            close(a, mean.T @ mean / 5, approx)
        else:
            close(a, torch.einsum("nkl,njl->kj", unfolded, unfolded) / 5, approx)


def test_plain_linear_layers_are_the_same_either_way():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    x, y = torch.randn(6, 3, dtype=DT), torch.randint(0, 2, (6,))
    results = []
    for approx in ("expand", "reduce"):
        torch.manual_seed(1)
        _run(model, x, y, KFAC(mc_samples=3, kfac_approx=approx))
        results.append([f.clone() for p in model.parameters() for f in p.kfac])
    for a, b in zip(*results):
        close(a, b)


def test_invalid_convention_is_refused():
    with pytest.raises(ValueError, match="kfac_approx 'expand' or 'reduce'"):
        KFAC(kfac_approx="sum")
    assert repr(KFLR(kfac_approx="reduce")) == "KFLR(kfac_approx='reduce')"
    assert repr(KFAC()) == "KFAC(mc_samples=1)"


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_factors_are_those_of_a_linear_layer_on_one_hot_inputs(approx, padding_idx):
    torch.manual_seed(0)
    vocab, dim = 6, 4
    emb = nn.Embedding(vocab, dim, padding_idx=padding_idx).to(DT)
    head = nn.Linear(dim, 3).to(DT)
    lin = nn.Linear(vocab, dim, bias=False).to(DT)
    with torch.no_grad():
        lin.weight.copy_(emb.weight.T)
    idx, y = torch.randint(0, vocab, (5, 3)), torch.randint(0, 3, (5, 3))
    idx[0, 0] = 2
    one_hot = F.one_hot(idx, vocab).to(DT)
    if padding_idx is not None:
        one_hot[idx == padding_idx] = 0
    results = []
    for first, inputs in ((emb, idx), (lin, one_hot)):
        model = extend(nn.Sequential(first, nn.Tanh(), head))
        lossfunc = extend(nn.CrossEntropyLoss())
        with backpack(KFLR(kfac_approx=approx)):
            lossfunc(model(inputs).transpose(1, 2), y).backward()
        results.append(first.weight.kflr)
    for got, expected in zip(*results):
        close(got, expected)
