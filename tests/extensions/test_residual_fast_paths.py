"""The exact-Hessian residual shortcuts and KFRA's closed forms against brute force.

Each branch of `backpack.secondorder.on_activation_backward` (closed form at the layer before the
activation, the diagonal route through one Linear layer and elementwise modules, chain products,
chunked propagation with early reduction or kept columns) and of `backpack.kfra` (Linear and
elementwise closed forms, generic sandwich) is checked in float64.
"""

import pytest
import torch
from second_order_reference import Curvature
from torch import nn

from backpack import backpack, extend, kfra, secondorder
from backpack.extensions import HMP, KFRA, PCHMP, BatchDiagHessian, DiagHessian
from backpack.rules.linear import LinearRule

DTYPE = torch.float64


class TwoActivations(nn.Module):
    """One Linear output feeding two activations, and one Tanh module called twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.sig = nn.Sigmoid()
        self.tanh = nn.Tanh()
        self.mid = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = self.lin(x)
        h = self.sig(h) + self.tanh(h)
        return self.head(self.tanh(self.mid(h)))


def deep():
    return nn.Sequential(
        nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid(),
        nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3),
    )


def elementwise_chain():
    return nn.Sequential(
        nn.Linear(5, 4), nn.Sigmoid(), nn.ReLU(), nn.Identity(), nn.Dropout(0.5),
        nn.Linear(4, 4), nn.Softplus(), nn.Linear(4, 3),
    )


def through_batchnorm():
    return nn.Sequential(
        nn.Linear(5, 4), nn.Tanh(), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Sigmoid(),
        nn.Linear(4, 3),
    )


def tokens():
    return nn.Sequential(
        nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(9, 2),
    )


def activation_first():
    return nn.Sequential(nn.Sigmoid(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


MODELS = {
    "deep": (deep, (6, 5)),
    "elementwise-chain": (elementwise_chain, (6, 5)),
    "batchnorm-eval": (through_batchnorm, (6, 5)),
    "tokens": (tokens, (4, 3, 5)),
    "activation-first": (activation_first, (6, 5)),
    "two-activations": (TwoActivations, (6, 4)),
}


def build(name, loss="ce"):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().to(DTYPE).eval()
    x = torch.randn(*shape, dtype=DTYPE)
    if loss == "ce":
        lossfunc = nn.CrossEntropyLoss()
        y = torch.randint(0, model(x).shape[1], (shape[0],))
    else:
        lossfunc = nn.MSELoss(reduction="sum")
        y = torch.randn_like(model(x))
    return model, x, lossfunc, y


def run(model, x, lossfunc, y, *exts):
    extend(model)
    extend(lossfunc)
    with backpack(*exts):
        lossfunc(model(x), y).backward()


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-10, msg=msg)


def check_hessian(name, loss="ce", exts=("diag", "batch", "hmp")):
    model, x, lossfunc, y = build(name, loss)
    ref = Curvature(model, x, lossfunc, y, hessian=True, per_sample="batch" in exts)
    chosen = {"diag": DiagHessian(), "batch": BatchDiagHessian(), "hmp": HMP()}
    run(model, x, lossfunc, y, *(chosen[e] for e in exts))
    torch.manual_seed(1)
    for pname, p in model.named_parameters():
        if "diag" in exts:
            close(p.diag_h, ref.diag(ref.hessian, pname), pname)
        if "batch" in exts:
            close(p.diag_h_batch, ref.diag(ref.hessian_per_sample, pname), pname)
        if "hmp" in exts:
            mat = torch.randn(2, *p.shape, dtype=DTYPE)
            expected = (ref.block(ref.hessian, pname) @ mat.flatten(1).T).T.reshape(mat.shape)
            close(p.hmp(mat), expected, pname)


@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hessian_fast_paths(name, loss):
    check_hessian(name, loss)


@pytest.mark.parametrize("exts", [("diag",), ("batch",), ("hmp",), ("diag", "hmp")])
@pytest.mark.parametrize("name", ["deep", "batchnorm-eval", "tokens"])
def test_chunked_propagation(name, exts, monkeypatch):
    """One column per chunk; diagonals alone are reduced chunk by chunk, products keep columns."""
    monkeypatch.setattr(secondorder, "RESIDUAL_CHUNK_ELEMENTS", 1)
    check_hessian(name, exts=exts)


@pytest.mark.parametrize("name", ["deep", "elementwise-chain", "tokens", "two-activations"])
def test_without_closed_forms(name, monkeypatch):
    """Fallbacks: unit columns for a rule without `diag_from_residual`, propagation for products."""
    monkeypatch.delattr(LinearRule, "diag_from_residual")
    monkeypatch.delattr(LinearRule, "residual_input_diag")
    monkeypatch.setattr(secondorder, "_chain_targets", lambda edge: {})
    monkeypatch.setattr(secondorder, "RESIDUAL_CHUNK_ELEMENTS", 7)
    check_hessian(name)


def pchmp_products(name, modify, slow, monkeypatch):
    with monkeypatch.context() as m:
        if slow:
            m.delattr(LinearRule, "diag_from_residual")
            m.setattr(secondorder, "_chain_targets", lambda edge: {})
        model, x, lossfunc, y = build(name)
        run(model, x, lossfunc, y, PCHMP(modify=modify))
        torch.manual_seed(2)
        return {
            k: p.pchmp(torch.randn(3, *p.shape, dtype=DTYPE)) for k, p in model.named_parameters()
        }


@pytest.mark.parametrize("modify", ["clip", "abs"])
@pytest.mark.parametrize("name", ["deep", "elementwise-chain", "two-activations"])
def test_pchmp_fast_matches_propagated(name, modify, monkeypatch):
    fast = pchmp_products(name, modify, False, monkeypatch)
    slow = pchmp_products(name, modify, True, monkeypatch)
    for k in fast:
        close(fast[k], slow[k], k)


def test_shared_parameters_still_refused():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin, nn.Linear(4, 2)).to(DTYPE)
    x = torch.randn(5, 4, dtype=DTYPE)
    with pytest.raises(NotImplementedError, match="several times"):
        run(model, x, nn.CrossEntropyLoss(), torch.randint(0, 2, (5,)), DiagHessian())


def test_activation_on_input_that_requires_grad():
    """No parametrized module upstream of the first Sigmoid, even though x requires grad."""
    model, x, lossfunc, y = build("activation-first")
    ref = Curvature(model, x, lossfunc, y, hessian=True, per_sample=False)
    run(model, x.requires_grad_(), lossfunc, y, DiagHessian())
    for pname, p in model.named_parameters():
        close(p.diag_h, ref.diag(ref.hessian, pname), pname)


def kfra_factors(model, x, y):
    lossfunc = extend(nn.CrossEntropyLoss())
    extend(model)
    with backpack(KFRA()):
        lossfunc(model(x), y).backward()
    return {k: [f.clone() for f in p.kfra] for k, p in model.named_parameters()}


def kfra_chain():
    # Identity and eval-mode Dropout return their input itself, which KFRA's chain walk refuses
    return nn.Sequential(
        nn.Linear(5, 4), nn.Sigmoid(), nn.ReLU(), nn.Linear(4, 4), nn.Softplus(), nn.Linear(4, 3)
    )


MODELS["kfra-chain"] = (kfra_chain, (6, 5))


@pytest.mark.parametrize("name", ["deep", "kfra-chain", "tokens"])
def test_kfra_closed_forms_match_generic_sandwich(name, monkeypatch):
    model, x, _, y = build(name)
    fast = kfra_factors(model, x, y)
    with monkeypatch.context() as m:
        m.setattr(kfra, "_module_step", lambda record, gbar, n: None)
        m.setattr(LinearRule, "kron_factors_dense", None)
        slow = kfra_factors(model, x, y)
    for k in fast:
        assert len(fast[k]) == len(slow[k])
        for a, b in zip(fast[k], slow[k]):
            close(a, b, k)


def test_kfra_linear_on_tokens_by_hand():
    """Ḡ at the input of a Linear on [N, T, in] is (I ⊗ Wᵀ) Ḡ (I ⊗ W), per position block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Flatten(), nn.Linear(8, 3)).to(DTYPE)
    model.insert(1, nn.Linear(2, 2).to(DTYPE))
    x = torch.randn(5, 4, 3, dtype=DTYPE)
    y = torch.randint(0, 3, (5,))
    factors = kfra_factors(model, x, y)
    prob = model(x).detach().softmax(1)
    gbar = (torch.diag_embed(prob) - prob[:, :, None] * prob[:, None, :]).mean(0)
    w_head = model[3].weight.detach()
    g_flat = w_head.T @ gbar @ w_head  # at the Flatten input, [4*2, 4*2]
    lift = torch.block_diag(*[model[1].weight.detach()] * 4)
    g_first = lift.T @ g_flat @ lift
    blocks = lambda g: sum(g[2 * t : 2 * t + 2, 2 * t : 2 * t + 2] for t in range(4))  # noqa: E731
    close(factors["1.weight"][0], blocks(g_flat))
    close(factors["0.weight"][0], blocks(g_first))
    flat = x.reshape(-1, 3)
    close(factors["0.weight"][1], flat.T @ flat / 20)
