"""Every sweep sees one fixed function: what the operators and `accumulate` refuse, and
`forward_seed`, which holds a random forward's draws fixed."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from backpack.curvature import (
    EKFAC,
    GGN,
    KFAC,
    EmpiricalFisher,
    Hessian,
    accumulate,
    eigvalsh,
)
from backpack.extensions import BatchGrad, DiagGGNExact

EXACT = [GGN, Hessian, EmpiricalFisher]


def close(a, b, atol=1e-12):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-9)


def _data(n=7, features=4, classes=3):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(n, features, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    return [(X[:3], y[:3]), (X[3:5], y[3:5]), (X[5:], y[5:])]


def _dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 3)).double()


@pytest.mark.parametrize("cls", EXACT)
def test_dropout_in_training_mode_is_refused(cls):
    model = _dropout_model()
    with pytest.raises(ValueError, match=r"model\.eval\(\).*forward_seed") as info:
        cls(model, nn.CrossEntropyLoss(), _data())
    assert "'1' (Dropout)" in str(info.value)
    cls(model.eval(), nn.CrossEntropyLoss(), _data())  # accepted in eval mode


class _NoisyInput(nn.Module):
    """Random numbers drawn inside a forward, outside any dropout module."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x + 0.1 * torch.randn_like(x))


@pytest.mark.parametrize("cls", EXACT)
def test_a_random_forward_is_refused_at_its_first_sweep(cls):
    model = _NoisyInput().double()
    op = cls(model, nn.CrossEntropyLoss(), _data())
    v = torch.ones(op.shape[0], dtype=torch.float64)
    with pytest.raises(ValueError, match="drew random numbers.*forward_seed"):
        op @ v
    with pytest.raises(ValueError, match="drew random numbers"):
        op.diagonal()
    assert model._forward_hooks == {} and model._forward_pre_hooks == {}  # no hook left behind


@pytest.mark.parametrize("cls", EXACT)
def test_forward_seed_holds_the_masks_fixed(cls):
    """One fixed matrix: products repeat, the diagonal is the dense matrix's, RNG untouched."""
    model = _dropout_model()
    op = cls(model, nn.CrossEntropyLoss(), _data(), forward_seed=3)
    V = torch.randn(op.shape[0], 2, dtype=torch.float64)
    state = torch.random.get_rng_state()
    first = op @ V
    close(op @ V, first)
    close(op @ V[:, 0], first[:, 0])
    dense = op.to_dense()
    close(op.diagonal(), dense.diagonal())
    close(op.trace(), dense.trace())
    close(eigvalsh(op, k=1, tol=1e-10), torch.linalg.eigvalsh(dense)[-1:], atol=1e-9)
    assert torch.equal(state, torch.random.get_rng_state())
    # other masks: another matrix; in eval mode: no masks
    other = cls(model, nn.CrossEntropyLoss(), _data(), forward_seed=4) @ V
    assert (other - first).abs().max() > 1e-6
    evaluated = cls(model.eval(), nn.CrossEntropyLoss(), _data()) @ V
    assert (evaluated - first).abs().max() > 1e-6


def test_forward_seed_with_the_hessian_cache_and_monte_carlo_ggn():
    model = _dropout_model()
    op = Hessian(model, nn.CrossEntropyLoss(), _data(), forward_seed=1)
    V = torch.randn(op.shape[0], 3, dtype=torch.float64)
    swept = op @ V
    with op.cached():
        close(op @ V, swept)
        close(op @ V, swept)  # through the kept graphs
    mc = GGN(model, nn.CrossEntropyLoss(), _data(), mc_samples=2, forward_seed=1)
    close(mc.to_dense().diagonal(), mc.diagonal())
    with pytest.raises(ValueError, match="forward_seed"):
        GGN(model, nn.CrossEntropyLoss(), _data(), forward_seed=1.5)


def test_kronecker_operators_and_accumulate_take_random_forwards():
    """Built in one go and fixed afterwards: the masks of the building sweeps (Monte Carlo)."""
    model = _dropout_model()
    kfac = KFAC(model, nn.CrossEntropyLoss(), _data())
    ekfac = EKFAC(model, nn.CrossEntropyLoss(), _data())
    for op in (kfac, ekfac):
        v = torch.randn(op.shape[0], dtype=torch.float64)
        close(op @ v, op @ v)
        close(op.to_dense() @ v, op @ v)
    accumulate(model, nn.CrossEntropyLoss(), _data(), [BatchGrad(), DiagGGNExact()])


@pytest.mark.parametrize("cls", EXACT)
@pytest.mark.parametrize("mode", ["train", "untracked"])
def test_batch_statistics_are_refused(cls, mode):
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(6, track_running_stats=mode == "train")
    model = nn.Sequential(nn.Linear(4, 6), norm, nn.Tanh(), nn.Linear(6, 3)).double()
    if mode == "untracked":
        model.eval()  # without running statistics, eval mode still normalises per batch
    with pytest.raises(ValueError, match=r"statistics of each batch.*model\.eval\(\)"):
        cls(model, nn.CrossEntropyLoss(), _data())


def _embedding_model(**options):
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(5, 3, **options), nn.Flatten(), nn.Linear(6, 3)).double()


def _tokens():
    g = torch.Generator().manual_seed(1)
    X = torch.randint(0, 5, (7, 2), generator=g)
    X[:, 1] = 2
    y = torch.randint(0, 3, (7,), generator=g)
    return [(X[:3], y[:3]), (X[3:5], y[3:5]), (X[5:], y[5:])]


BUILDERS = {
    "GGN": lambda m, d: GGN(m, nn.CrossEntropyLoss(), d),
    "Hessian": lambda m, d: Hessian(m, nn.CrossEntropyLoss(), d),
    "EmpiricalFisher": lambda m, d: EmpiricalFisher(m, nn.CrossEntropyLoss(), d),
    "KFAC": lambda m, d: KFAC(m, nn.CrossEntropyLoss(), d),
    "EKFAC": lambda m, d: EKFAC(m, nn.CrossEntropyLoss(), d),
    "accumulate": lambda m, d: accumulate(m, nn.CrossEntropyLoss(), d, [BatchGrad()]),
}


@pytest.mark.parametrize("what", list(BUILDERS))
def test_scale_grad_by_freq_is_refused(what):
    """Its gradient is not the loss's derivative and depends on the batching."""
    model = _embedding_model(scale_grad_by_freq=True)
    with pytest.raises(ValueError, match=f"{what}: '0' \\(Embedding\\) has scale_grad_by_freq"):
        BUILDERS[what](model, _tokens())
    model[0].scale_grad_by_freq = False  # the same loss: its data-set quantities
    BUILDERS[what](model, _tokens())


@pytest.mark.parametrize("what", list(BUILDERS))
def test_max_norm_rows_to_renormalise_are_refused(what):
    model = _embedding_model(max_norm=0.5)
    before = model[0].weight.detach().clone()
    with pytest.raises(ValueError, match="max_norm=0.5 and rows whose norm exceeds it"):
        BUILDERS[what](model, _tokens())
    assert torch.equal(model[0].weight, before)
    with torch.no_grad():  # the fix the message names: every row renormalised once
        model[0](torch.arange(5))
    BUILDERS[what](model, _tokens())


def test_sparse_embeddings_with_padding():
    """GGN and Hessian products of a sparse embedding: dense results, the flag restored."""
    model = _embedding_model(padding_idx=2, sparse=True)
    data = _tokens()
    X, y = torch.cat([x for x, _ in data]), torch.cat([t for _, t in data])
    lossfunc = nn.CrossEntropyLoss()
    reference = _embedding_model(padding_idx=2)  # the same values, dense gradients
    names = [n for n, _ in reference.named_parameters()]
    shapes = [p.shape for p in reference.parameters()]
    theta = torch.cat([p.detach().flatten() for p in reference.parameters()])

    def output(t):
        pieces = t.split([s.numel() for s in shapes])
        params = {n: q.reshape(s) for n, q, s in zip(names, pieces, shapes)}
        return functional_call(reference, params, (X,))

    out = output(theta).detach()
    J = jacrev(output)(theta).reshape(out.numel(), -1)
    H = jacrev(jacrev(lambda o: lossfunc(o.reshape(out.shape), y)))(out.flatten())
    expected = J.T @ H @ J
    assert expected[6:9].abs().max() == 0  # the padding row is constant
    op = GGN(model, lossfunc, data)
    close(op.to_dense(), expected)
    close(op.diagonal(), expected.diagonal())
    hessian = Hessian(model, lossfunc, data).to_dense()
    assert hessian[6:9].abs().max() == 0
    assert model[0].sparse
