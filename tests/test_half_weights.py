"""Models with bf16 or fp16 weights (not autocast): every quantity, computed in float32.

The reference is the same model with its (rounded) weights in float64. A quantity passes if its
relative error is within a few times the error of autograd's own 16-bit `.grad` against the
float64 gradient: backpack must not add error beyond what 16-bit training already has.
"""

import copy

import pytest
import torch
from second_order_reference import Curvature
from torch import nn
from torch.func import functional_call, grad, vmap

from backpack import backpack, extend
from backpack.extensions import (
    KFLR,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SumGradSquared,
    Variance,
)


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 layer shape: `x @ weight + bias`, weight `[in, out]` (no rule here)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.3)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(
            *x.shape[:-1], -1
        )


class TinyGPT(nn.Module):
    """Token and broadcast position embeddings, a fallback layer, LayerNorm, a Linear head."""

    def __init__(self, vocab=11, context=5, dim=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.fc = Conv1D(dim, dim)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        h = self.tok(idx) + self.pos(positions)  # [N, T, D] + [T, D]
        h = self.ln(torch.tanh(self.fc(h)))
        return self.head(h[:, -1]).float()  # the loss in float32, as Hugging Face's


def _relative(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30))


@pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for Conv1D:UserWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_weights_give_every_quantity_within_autograds_own_error(dtype):
    torch.manual_seed(0)
    model = TinyGPT().to(dtype)
    idx, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (6,))
    lossfunc = nn.CrossEntropyLoss()
    exact = copy.deepcopy(model).double()
    exact.forward = lambda i, m=exact: TinyGPT.forward(m, i).double()
    names = [n for n, _ in exact.named_parameters()]
    params = {n: p.detach() for n, p in exact.named_parameters()}

    def sample_loss(p, i, t):
        return lossfunc(functional_call(exact, p, (i[None],)), t[None])

    psg = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, idx, y)
    psg = {n: v / len(idx) for n, v in psg.items()}  # reduction="mean"
    curvature = Curvature(exact, idx, lossfunc, y, hessian=False)

    # autograd's own 16-bit gradient: the error budget
    model.zero_grad()
    lossfunc(model(idx), y).backward()
    budget = max(_relative(p.grad, psg[n].sum(0)) for n, p in model.named_parameters())
    tolerance = max(4 * budget, 1e-3)

    extend(model)
    extensions = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), DiagGGNExact(), KFLR()]
    model.zero_grad()
    with backpack(*extensions):
        extend(lossfunc)(model(idx), y).backward()
    for name, p in model.named_parameters():
        g = psg[name]
        expected = {
            "grad_batch": g,
            "batch_l2": g.flatten(1).square().sum(1),
            "sum_grad_squared": g.square().sum(0),
            "variance": g.var(0, unbiased=False),
            "diag_ggn_exact": curvature.diag(curvature.ggn, name),
        }
        for field, value in expected.items():
            actual = getattr(p, field)
            assert actual.dtype == torch.float32, (name, field)
            assert _relative(actual, value) <= tolerance, (name, field, _relative(actual, value))
        assert all(f.dtype == torch.float32 for f in p.kflr)
    assert names  # every parameter was checked
