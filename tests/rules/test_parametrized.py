"""Layers with `torch.nn.utils.parametrize` tensors: what the problem table cannot cover.

The table (`tests/problems/parametrized.py`) checks every first-order quantity and the GGN
family against brute force. Here: spectral norm in training mode (its weight changes at every
forward), the user's state after a backward, the cache of `parametrize.cached()`, a
parametrization registered after `extend`, and the refusal of the Hessian extensions.
"""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from backpack import backpack, extend
from backpack.extensions import (
    HMP,
    PCHMP,
    BatchDiagHessian,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
)

DT = torch.float64


def _model(train=True, old_style=False):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old one is deprecated
        spectral = (nn.utils.spectral_norm if old_style else parametrizations.spectral_norm)(
            nn.Linear(4, 6)
        )
    model = nn.Sequential(spectral, nn.Tanh(), nn.Linear(6, 3)).to(DT)
    return model.train(train)


def _data(n=5):
    return torch.randn(n, 4, dtype=DT), torch.randint(0, 3, (n,))


def _per_sample_reference(model, out, y):
    """Per-sample gradients through the graph of `out` (the very forward the extension sees)."""
    terms = nn.functional.cross_entropy(out, y, reduction="none")
    params = list(model.parameters())
    rows = [torch.autograd.grad(t, params, retain_graph=True) for t in terms]
    return [torch.stack([r[i] for r in rows]) for i in range(len(params))]


@pytest.mark.parametrize(
    "cached, old_style",
    [(False, False), (True, False), (False, True)],
    ids=["plain", "parametrize.cached", "old-style-hook"],
)
def test_spectral_norm_in_training_mode_gives_the_forwards_gradients(cached, old_style):
    model = extend(_model(old_style=old_style))
    x, y = _data()
    ctx = parametrize.cached() if cached else torch.enable_grad()
    with ctx:
        out = model(x)
        reference = _per_sample_reference(model, out, y)
        state = {k: b.clone() for k, b in model.state_dict().items()}
        forward_weight = model[0].__dict__.get("weight")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's one-time notice
            with backpack(BatchGrad(), BatchL2Grad()):
                nn.functional.cross_entropy(out, y, reduction="sum").backward()
    for p, ref in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad_batch, ref)
        torch.testing.assert_close(p.batch_l2, ref.flatten(1).square().sum(1))
    # the power iteration's vectors are the forward's: the backward ran nothing in train mode
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert all(m.training for m in model.modules())
    if old_style:  # the hook's attribute still holds the forward's weight, not a transform's
        assert model[0].__dict__["weight"] is forward_weight


def test_parametrization_registered_after_extend():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 3)).to(DT))
    parametrizations.weight_norm(model[0])
    x, y = _data()
    out = model(x)
    reference = _per_sample_reference(model, out, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with backpack(BatchGrad()):
            nn.functional.cross_entropy(out, y, reduction="sum").backward()
    names = [n for n, _ in model.named_parameters()]
    assert "0.parametrizations.weight.original1" in names
    for p, ref in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad_batch, ref)


def test_parametrization_modules_are_not_recorded_as_layers():
    model = extend(_model(train=False))
    spectral = model[0].parametrizations.weight
    assert not any(getattr(m, "_backpack_extend", False) for m in spectral.modules())
    assert getattr(model[0], "_backpack_extend", False)


def test_ggn_diagonal_of_the_original_parameters():
    """GGN = Jᵀ H J with J the Jacobian w.r.t. the originals: brute force by torch.func."""
    model = extend(_model(train=False))
    x, y = _data()
    lossfunc = extend(nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with backpack(DiagGGNExact()):
            lossfunc(model(x), y).backward()
    names = [n for n, _ in model.named_parameters()]
    values = {n: p.detach() for n, p in model.named_parameters()}

    def outputs(params):
        return torch.func.functional_call(model, params, (x,))

    out = model(x).detach()
    probs = out.softmax(1)
    hessian = (torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]) / x.shape[0]
    jac = torch.func.jacrev(outputs)(values)
    for name, p in zip(names, model.parameters()):
        j = jac[name].reshape(*out.shape, -1)  # [N, C, P]
        ggn_diag = torch.einsum("ncp,ncd,ndp->p", j, hessian, j)
        torch.testing.assert_close(p.diag_ggn_exact.flatten(), ggn_diag, msg=name)


@pytest.mark.parametrize("old_style", [False, True], ids=["parametrize", "old-style-hook"])
@pytest.mark.parametrize("extension", [DiagHessian, BatchDiagHessian, HMP, PCHMP])
def test_hessian_extensions_refuse_parametrized_layers(extension, old_style):
    """The parametrization's own second derivatives are missing: refuse, never a wrong number."""
    model = extend(_model(train=False, old_style=old_style))
    x, y = _data()
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with pytest.raises(NotImplementedError, match=r"'0' \((Parametrized)?Linear\).*parametrize"):
        with backpack(extension()):
            loss.backward()
