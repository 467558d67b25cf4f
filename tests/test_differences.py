"""The claims of docs/differences.md where our numbers differ from the original BackPACK 1.7.1:
each one checked against the quantity's definition, by brute force in float64."""

import torch
from torch import nn

from backpack import backpack, extend
from backpack.extensions import (
    KFLR,
    PCHMP,
    BatchDiagGGNExact,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
)

DTYPE = torch.float64


def per_sample_grads(model, x, y, lossfunc):
    none = type(lossfunc)(reduction="none")
    out = model(x)
    terms = none(out, y).reshape(x.shape[0], -1).sum(1)
    if lossfunc.reduction == "mean":
        terms = terms / none(out, y).numel()
    params = list(model.parameters())
    rows = [torch.autograd.grad(t, params, retain_graph=True) for t in terms]
    return [torch.stack(r) for r in zip(*rows)]


def test_pchmp_clip_clips_the_backpropagated_residual():
    """PCHMP(clip) = GGN + Σₙ Jₙᵀ diag(max(σ''(zₙ) ⊙ δₙ, 0)) Jₙ for the layer before a sigmoid:
    the residual (second derivative times the gradient reaching the activation) is clipped,
    not the second derivative alone."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(3, 4).to(DTYPE), nn.Linear(4, 2).to(DTYPE)
    model = extend(nn.Sequential(lin1, nn.Sigmoid(), lin2))
    lossfunc = extend(nn.MSELoss(reduction="sum"))
    x, y = torch.randn(5, 3, dtype=DTYPE), torch.randn(5, 2, dtype=DTYPE)
    loss = lossfunc(model(x), y)
    with backpack(PCHMP(modify="clip")):
        loss.backward()
    # brute force for lin1.weight (flattened row-major [4 * 3])
    z = lin1(x).detach()
    s = torch.sigmoid(z)
    out = lin2(s)
    delta = (2 * (out - y)) @ lin2.weight  # dL/da at the sigmoid output, [N, 4]
    second = s * (1 - s) * (1 - 2 * s)  # sigmoid''
    residual = (second * delta).clamp(min=0)  # clipped per sample and unit
    first = s * (1 - s)
    w2 = lin2.weight.detach()
    block = torch.zeros(12, 12, dtype=DTYPE)
    for n in range(5):
        jz = torch.kron(torch.eye(4, dtype=DTYPE), x[n][None])  # dz/dvec(W): [4, 12]
        jout = w2 @ torch.diag(first[n]) @ jz  # [2, 12]
        block += 2 * jout.T @ jout + jz.T @ torch.diag(residual[n]) @ jz
    mat = torch.randn(3, 4, 3, dtype=DTYPE)
    expected = (block @ mat.flatten(1).T).T.reshape(mat.shape)
    torch.testing.assert_close(lin1.weight.pchmp(mat), expected)
    assert (second * delta < 0).any() and (second * delta > 0).any()  # clipping matters here


def _patches_by_autograd(conv_t, x):
    """u[n, p]: d out[n, c, p] / d weight.transpose(0, 1)[c] (the same for every c)."""
    out = conv_t(x)
    n_samples, _, length = out.shape
    rows = []
    for n in range(n_samples):
        for p in range(length):
            (g,) = torch.autograd.grad(out[n, 0, p], conv_t.weight, retain_graph=True)
            rows.append(g.transpose(0, 1)[0].flatten())
    return torch.stack(rows)  # [N * L, Cin * k]


def test_conv_transpose_with_output_padding_first_order_and_input_factor():
    torch.manual_seed(0)
    conv_t = nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=1).to(DTYPE)
    model = extend(nn.Sequential(conv_t, nn.Flatten(), nn.Linear(30, 4).to(DTYPE)))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(3, 2, 4, dtype=DTYPE), torch.randint(0, 4, (3,))
    loss = lossfunc(model(x), y)
    with backpack(BatchGrad(), BatchL2Grad(), KFLR()):
        loss.backward()
    psg = per_sample_grads(model, x, y, lossfunc)
    torch.testing.assert_close(conv_t.weight.grad_batch, psg[0])
    torch.testing.assert_close(conv_t.bias.grad_batch, psg[1])
    torch.testing.assert_close(conv_t.weight.batch_l2, psg[0].flatten(1).square().sum(1))
    patches = _patches_by_autograd(conv_t, x)
    expected_a = patches.T @ patches / x.shape[0]
    g, a = conv_t.weight.kflr
    assert g.shape == (3, 3)
    torch.testing.assert_close(a, expected_a)


def test_batch_l2_of_grouped_convolutions():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, groups=2, padding=1).to(DTYPE)
    model = extend(nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(6 * 16, 3).to(DTYPE)))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(5, 4, 4, 4, dtype=DTYPE), torch.randint(0, 3, (5,))
    loss = lossfunc(model(x), y)
    with backpack(BatchL2Grad()):
        loss.backward()
    psg = per_sample_grads(model, x, y, lossfunc)
    torch.testing.assert_close(conv.weight.batch_l2, psg[0].flatten(1).square().sum(1))
    torch.testing.assert_close(conv.bias.batch_l2, psg[1].flatten(1).square().sum(1))


def _token_model():
    torch.manual_seed(0)
    emb = nn.Linear(3, 5).to(DTYPE)

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = emb

        def forward(self, x):  # [N, T, 3] -> [N, C=5, T]
            return self.lin(x).transpose(1, 2)

    return extend(Tokens())


def test_ggn_of_a_token_loss_whose_targets_are_all_ignored():
    """Tokens with ignore_index contribute nothing: a sample whose tokens are all ignored has a
    zero per-sample GGN, and a batch without any counted token a zero GGN (not NaN)."""
    model = _token_model()
    x = torch.randn(3, 4, 3, dtype=DTYPE)
    y = torch.randint(0, 5, (3, 4))
    y[1] = -100  # sample 1: every token ignored
    lossfunc = extend(nn.CrossEntropyLoss(ignore_index=-100))
    loss = lossfunc(model(x), y)
    with backpack(DiagGGNExact(), BatchDiagGGNExact()):
        loss.backward()
    weight = model.lin.weight
    assert torch.equal(weight.diag_ggn_exact_batch[1], torch.zeros_like(weight))
    # against the GGN of the loss restricted to the counted tokens
    counted = y != -100
    out = model(x).detach()
    probs = out.softmax(1)  # [N, C, T]
    total = torch.zeros(weight.numel(), dtype=DTYPE)
    for n in range(3):
        for t in range(4):
            if not counted[n, t]:
                continue
            p = probs[n, :, t]
            h = (torch.diag(p) - torch.outer(p, p)) / counted.sum()
            jac = torch.kron(torch.eye(5, dtype=DTYPE), x[n, t][None])  # [5, 15]
            total += torch.diagonal(jac.T @ h @ jac)
    torch.testing.assert_close(weight.diag_ggn_exact.flatten(), total)
    # no counted token at all (sum reduction: the loss is 0): every GGN entry is 0
    lossfunc = extend(nn.CrossEntropyLoss(ignore_index=-100, reduction="sum"))
    model.zero_grad()
    loss = lossfunc(model(x), torch.full_like(y, -100))
    with backpack(DiagGGNExact()):
        loss.backward()
    assert torch.equal(weight.diag_ggn_exact, torch.zeros_like(weight))
