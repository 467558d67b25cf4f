"""Losses and tied output layers called as functions, recognised from the autograd graph."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from second_order_reference import SampleCurvature
from torch import nn

from backpack import backpack, extend
from backpack.extensions import (
    GGNMP,
    KFLR,
    BatchDiagGGNExact,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    Variance,
)

DT = torch.float64
V, D, N, T = 7, 4, 3, 5


class Tied(nn.Module):
    """Embedding, a mixing layer, and an output layer tied to the embedding."""

    def __init__(self, style):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.style = style
        # a bias held by a module the forward never calls: only the functional call uses it
        self.holder = nn.Linear(1, V) if style == "addmm" else None
        if style == "module":
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight

    def forward(self, idx):
        h = torch.tanh(self.mix(self.emb(idx)))
        if self.style == "module":
            logits = self.head(h)
        elif self.style == "linear":
            logits = F.linear(h, self.emb.weight)
        elif self.style == "matmul":
            logits = h @ self.emb.weight.T
        else:  # F.linear with a bias on `[N, D]` (one addmm), every position separately
            steps = [F.linear(h[:, t], self.emb.weight, self.holder.bias) for t in range(T)]
            logits = torch.stack(steps, 1)
        return logits


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10, msg=msg)


@pytest.mark.parametrize("style", ["module", "linear", "matmul", "addmm"])
@pytest.mark.parametrize("flatten", [True, False], ids=["flat-logits", "NVT-logits"])
def test_tied_output_layer_and_functional_loss(style, flatten):
    torch.manual_seed(0)
    model = Tied(style).to(DT)
    idx, y = torch.randint(0, V, (N, T)), torch.randint(0, V, (N, T))
    y[0, 0] = -1  # an ignored token

    def loss_of(logits):
        if flatten:
            return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-1)
        return F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-1)

    def terms(outs):
        (logits,) = outs
        token = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-1, reduction="none")
        return token.sum(1) / (y != -1).sum()

    ref = SampleCurvature(model, lambda f: (f(idx),), terms)
    extend(model)
    exts = [BatchGrad(), BatchL2Grad(), Variance(), DiagGGNExact(), BatchDiagGGNExact(), GGNMP()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "gradient outside extended modules" warning
        with backpack(*exts):
            loss_of(model(idx)).backward()
    for name, p in model.named_parameters():
        if name == "holder.weight":  # never used
            assert p.grad is None and not hasattr(p, "grad_batch")
            continue
        psg = ref.per_sample_grads(name)
        close(p.grad_batch, psg, name)
        close(p.batch_l2, psg.flatten(1).square().sum(1), name)
        close(p.variance, psg.var(0, unbiased=False), name)
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)
        mat = torch.randn(2, *p.shape, dtype=DT)
        close(p.ggnmp(mat), (ref.block(ref.ggn, name) @ mat.flatten(1).T).T.reshape(mat.shape))


def test_tied_weight_kronecker_factors_are_those_of_the_stored_weight():
    torch.manual_seed(0)
    model = extend(Tied("linear").to(DT))
    idx, y = torch.randint(0, V, (N, T)), torch.randint(0, V, (N, T))
    with backpack(KFLR()):
        F.cross_entropy(model(idx).transpose(1, 2), y).backward()
    assert [f.shape for f in model.emb.weight.kflr] == [(V, V), (D, D)]
    for factor in model.emb.weight.kflr:
        assert torch.linalg.eigvalsh(factor).min() > -1e-10  # positive semi-definite
    assert [f.shape for f in model.mix.weight.kflr] == [(D, D), (D, D)]


def test_functional_call_records_are_freed_and_do_not_linger():
    torch.manual_seed(0)
    model = extend(Tied("linear").to(DT))
    idx, y = torch.randint(0, V, (N, T)), torch.randint(0, V, (N, T))
    from backpack.recording import param_owners

    for _ in range(3):
        with backpack(BatchGrad()):
            F.cross_entropy(model(idx).transpose(1, 2), y).backward()
    import gc

    gc.collect()
    # the stand-in Linear layers of past backward passes are gone
    assert [type(m).__name__ for m in param_owners(model.emb.weight)] == ["Embedding"]
    # and a plain backward outside backpack is untouched
    model.zero_grad()
    F.cross_entropy(model(idx).transpose(1, 2), y).backward()
    assert model.emb.weight.grad is not None
