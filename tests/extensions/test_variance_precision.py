"""`Variance` equals `grad_batch.var(0, unbiased=False)` where samples agree to many digits.

Nearly identical samples give per-sample gradients whose mean is far larger than their spread:
Σg²/N − (Σg/N)² then cancels to rounding noise (or 0 after clamping). Every way backpack
computes a variance runs here: fused rules (Linear on 2-D and sequence inputs, convolutions,
embeddings), centred per-sample gradients (normalisation layers, the torch.func fallback),
accumulated shared parameters, the wait for autograd's gradient sum, and the entries of a
Linear weight that `outer_centred_squares` recomputes. The reference centres brute-force
per-sample gradients in float64 (float32: the float64 variance of backpack's own float32
per-sample gradients).
"""

import pytest
import torch
from problems import reference_per_sample_grads
from torch import nn

from backpack import backpack, extend
from backpack.extensions import BatchGrad, SumGradSquared, Variance

#: expected warnings: problems of the table whose layers have no rule use the torch.func
#: fallback (it warns once per layer class), and torch's vmap notices missing batching rules
pytestmark = [
    pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:There is a performance drop because we have not yet implemented the batching "
        "rule:UserWarning"
    ),
]


class Affine(nn.Module):
    """Parameters and no rule: the torch.func fallback."""

    def __init__(self, features, out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(features, out) / features**0.5)
        self.b = nn.Parameter(torch.randn(out))

    def forward(self, x):
        return x @ self.w + self.b


class Shared(nn.Module):
    """One Linear applied twice: the accumulated per-sample gradients are centred."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


def _bn_eval():
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2))
    model[1].running_mean.uniform_(-1, 1)
    model[1].running_var.uniform_(0.5, 2)
    return model.eval()


# name -> (model, input shape (or embedding indices), output size)
MODELS = {
    "linear": (lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)), (8, 4)),
    "linear-sequence": (
        lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(9, 2)),
        (8, 3, 4),
    ),
    "conv": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)),
        (8, 2, 4, 4),
    ),
    "embedding": (
        lambda: nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(12, 2)),
        "tokens",
    ),
    "batchnorm-eval": (_bn_eval, (8, 4)),
    "layernorm": (
        lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2)),
        (8, 4),
    ),
    "fallback": (lambda: nn.Sequential(Affine(4, 5), nn.Tanh(), nn.Linear(5, 2)), (8, 4)),
    "shared": (Shared, (8, 4)),
}


def _data(shape, dtype, spread):
    """Samples that agree up to `spread` (inputs and MSE targets around common values)."""
    if shape == "tokens":
        x = torch.tensor([[1, 4, 4, 6]]).expand(8, 4).clone()
    else:
        x = torch.randn(1, *shape[1:], dtype=torch.float64) + 1.0
        x = (x + spread * torch.randn(*shape, dtype=torch.float64)).to(dtype)
    y = torch.randn(1, 2, dtype=torch.float64) + 3.0
    y = (y + spread * torch.randn(8, 2, dtype=torch.float64)).to(dtype)
    return x, y


def _run(name, dtype, spread, *extensions):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model = extend(make().to(dtype))
    x, y = _data(shape, dtype, spread)
    lossfunc = extend(nn.MSELoss(reduction="sum"))
    with backpack(*extensions):
        lossfunc(model(x), y).backward()
    return model, x, lossfunc, y


@pytest.mark.parametrize("wait", [False, True], ids=["own-sums", "autograd-sums"])
@pytest.mark.parametrize("name", list(MODELS))
def test_float64_against_brute_force(name, wait, monkeypatch):
    if wait:  # Variance takes the gradient sum from autograd wherever the rule can use it
        import backpack.passes.first_order as engine_module

        monkeypatch.setattr(engine_module, "VARIANCE_WAIT_MIN_WORK", 0)
    model, x, lossfunc, y = _run(name, torch.float64, 1e-5, Variance(), SumGradSquared())
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    for pname, p in model.named_parameters():
        psg = reference[pname]
        expected = psg.var(0, unbiased=False)
        # the samples agree to about 5 digits: the one-pass formula keeps about 6 of 16
        assert (psg.mean(0).abs() > 1e3 * expected.sqrt()).any(), pname
        torch.testing.assert_close(p.variance, expected, rtol=1e-7, atol=1e-30, msg=pname)
        torch.testing.assert_close(p.sum_grad_squared, psg.square().sum(0), msg=pname)


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_against_its_per_sample_gradients(name):
    model, *_ = _run(name, torch.float32, 1e-3, BatchGrad(), Variance())
    for pname, p in model.named_parameters():
        psg = p.grad_batch.double()
        expected = psg.var(0, unbiased=False)
        assert (psg.mean(0).abs() > 1e2 * expected.sqrt()).any(), pname
        # two passes in float32 lose about log10(|mean| / std) digits of 7
        torch.testing.assert_close(
            p.variance.double(), expected, rtol=5e-3, atol=1e-12 * float(psg.abs().max()) ** 2,
            msg=pname,
        )


def test_the_issue_example_float32():
    """A bias whose residuals are all about 1: 0.0 before, 2.95e-8 by its definition."""
    torch.manual_seed(0)
    model, lossfunc = extend(nn.Linear(3, 1)), extend(nn.MSELoss(reduction="sum"))
    x = torch.randn(8, 3)
    y = model(x).detach() - 1.0 + 1e-4 * torch.randn(8, 1)
    with backpack(BatchGrad(), Variance()):
        lossfunc(model(x), y).backward()
    for p in model.parameters():
        expected = p.grad_batch.double().var(0, unbiased=False)
        torch.testing.assert_close(p.variance.double(), expected, rtol=1e-3, atol=0.0)
    assert model.bias.variance.item() > 1e-8


def test_flagged_entries_are_recomputed():
    """Factors correlated over samples: the shifted products cancel, the flagged entries not.

    g_n = d_n x_n with d_n = s_n (1 + ε_n), x_n = s_n (signs s_n = ±1): every g_n is close to 1
    while d̄ = x̄ = 0, so the covariance of the factors carries the whole mean.
    """
    from backpack import variance

    torch.manual_seed(0)
    signs = torch.tensor([1.0, -1.0] * 4, dtype=torch.float64)
    eps = 1e-6 * torch.randn(8, dtype=torch.float64)
    d, x = (signs * (1 + eps)).unsqueeze(1), signs.unsqueeze(1)
    total, m2, flagged = variance.shifted_outer_squares(d, x)
    assert flagged.all()
    exact = variance.outer_centred_squares_at(d, x, *flagged.nonzero(as_tuple=True))
    psg = (d * x).squeeze(1)
    torch.testing.assert_close(exact / 8, psg.var(unbiased=False).reshape(1), rtol=1e-9, atol=0)
    torch.testing.assert_close(total, psg.sum().reshape(1, 1))

    # the same through the engine: a Linear layer whose input and output gradient are d and x
    lin = extend(nn.Linear(1, 1, bias=False).double())
    with torch.no_grad():
        lin.weight.fill_(0.0)
    with backpack(Variance(), BatchGrad()):
        (lin(x) * -d).sum().backward()  # output gradient -d, so g_n = -d_n x_n
    expected = lin.weight.grad_batch.var(0, unbiased=False)
    torch.testing.assert_close(lin.weight.variance, expected, rtol=1e-9, atol=0)


@pytest.mark.parametrize("flagged", ["none", "few", "most"])
def test_outer_products_each_path(flagged, monkeypatch):
    """`outer_centred_squares`: the one-pass formula, per-sample products for a few flagged
    entries, the shifted factors for many; all equal to two passes over the products."""
    from backpack import variance

    torch.manual_seed(0)
    n = 9
    d, x = torch.randn(n, 3, dtype=torch.float64), torch.randn(n, 4, dtype=torch.float64)
    if flagged == "few":  # a bias-like input column and one output row that agree over samples
        d[:, 0] = 1.0 + 1e-6 * torch.randn(n, dtype=torch.float64)
        x[:, 0] = 2.0 + 1e-6 * torch.randn(n, dtype=torch.float64)
    elif flagged == "most":
        d = 1.0 + 1e-6 * d
        x = 2.0 + 1e-6 * x
    calls = []
    shifted = variance.shifted_outer_squares
    monkeypatch.setattr(
        variance, "shifted_outer_squares", lambda *a: calls.append(1) or shifted(*a)
    )
    psg = d[:, :, None] * x[:, None, :]
    expected = ((psg - psg.mean(0)) ** 2).sum(0)
    for total in (None, psg.sum(0)):
        got_total, m2 = variance.outer_centred_squares(d, x, total)
        torch.testing.assert_close(m2, expected, rtol=1e-9, atol=1e-300)
        torch.testing.assert_close(got_total, psg.sum(0))
    assert bool(calls) == (flagged == "most")


def test_chunks_and_combine_match_two_passes():
    """Chan's update over uneven chunks (the convolution rule's loop, distributed ranks)."""
    from backpack import variance

    torch.manual_seed(0)
    psg = 1e3 + 1e-4 * torch.randn(11, 3, 2, dtype=torch.float64)
    running = variance.Chunks()
    parts = []
    for chunk in (psg[:1], psg[1:5], psg[5:11]):
        running.add(chunk.clone(), overwrite=True)
        parts.append((chunk.shape[0], *variance.centred_squares(chunk)))
    expected = ((psg - psg.mean(0)) ** 2).sum(0)
    total, m2 = running.result(psg.shape[1:], psg)
    torch.testing.assert_close(m2, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(total, psg.sum(0))
    count, total, m2 = variance.combine(parts)
    assert count == 11
    torch.testing.assert_close(m2, expected, rtol=1e-6, atol=0)


def test_autocast_variance_is_that_of_the_per_sample_gradients():
    """Mixed precision: rules run in float32 on promoted records; both quantities agree."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 8), nn.Sigmoid(), nn.Linear(8, 3)))
    lossfunc = extend(nn.CrossEntropyLoss())
    x = 2.0 + 1e-2 * torch.randn(16, 6)
    y = torch.zeros(16, dtype=torch.long)
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):
        loss = lossfunc(model(x), y)
    with backpack(BatchGrad(), Variance()):
        loss.backward()
    for name, p in model.named_parameters():
        assert p.variance.dtype == torch.float32
        expected = p.grad_batch.double().var(0, unbiased=False)
        torch.testing.assert_close(p.variance.double(), expected, rtol=1e-3, atol=1e-14, msg=name)
