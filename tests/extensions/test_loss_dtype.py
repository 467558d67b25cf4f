"""A loss computed in another dtype than the model (`logits.float()`, as Hugging Face does).

Every second-order quantity is in the parameters' dtype and equals the one of the same
computation with the loss in the model's dtype, up to the rounding of the cast.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backpack import backpack, extend
from backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)

SECOND = [
    DiagGGNExact,
    BatchDiagGGNExact,
    DiagGGNMC,
    BatchDiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
    KFAC,
    KFLR,
    KFRA,
    GGNMP,
    DiagHessian,
    BatchDiagHessian,
    HMP,
    PCHMP,
]


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), (7, 4)


def _cnn():
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(3 * 3 * 3, 3)
    )
    return model, (6, 2, 5, 5)


MONTE_CARLO = {DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC}
MODELS = {"mlp": _mlp, "cnn": _cnn}
LOSSES = ["CrossEntropyLoss", "F.cross_entropy", "MSELoss"]


def _loss(kind, out, y):
    if kind == "F.cross_entropy":
        return F.cross_entropy(out, y)
    lossfunc = extend(getattr(nn, kind)())
    return lossfunc(out, y)


def _flat(value, param):
    """A quantity as one flat tensor (lists of factors concatenated, products applied)."""
    if callable(value):
        gen = torch.Generator(device=param.device).manual_seed(3)
        mat = torch.randn(2, *param.shape, generator=gen, device=param.device, dtype=param.dtype)
        value = value(mat)
    if isinstance(value, list):
        assert all(v.dtype == param.dtype for v in value), [v.dtype for v in value]
        return torch.cat([v.flatten() for v in value])
    return value.flatten()


def _quantities(extension, model_name, loss_kind, model_dtype, loss_dtype):
    torch.manual_seed(0)
    model, shape = MODELS[model_name]()
    model = extend(model.to(model_dtype))
    x = torch.randn(*shape, dtype=model_dtype)
    if loss_kind == "MSELoss":
        y = torch.randn(shape[0], 3, dtype=torch.float64).to(loss_dtype)
    else:
        y = torch.randint(0, 3, (shape[0],))
    out = model(x)
    loss = _loss(loss_kind, out.to(loss_dtype), y)
    torch.manual_seed(1)  # Monte-Carlo samples
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # KFRA on the CNN: no dense factor warnings matter here
        with backpack(extension()):
            loss.backward()
    result = {}
    for name, p in model.named_parameters():
        value = _flat(getattr(p, extension().savefield), p)
        assert value.dtype == model_dtype, (name, value.dtype)
        result[name] = value
    return result


@pytest.mark.parametrize("extension", SECOND, ids=lambda e: e.__name__)
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("loss_kind", LOSSES)
@pytest.mark.parametrize(
    "model_dtype, cast", [(torch.float64, torch.float32), (torch.float32, torch.float64)]
)
def test_loss_in_another_dtype(extension, model_name, loss_kind, model_dtype, cast):
    """float64 model with `.float()` logits, float32 model with `.double()` logits."""
    if extension is KFRA and model_name == "cnn":
        pytest.skip("KFRA's dense matrices: covered on the MLP")
    expected = _quantities(extension, model_name, loss_kind, model_dtype, model_dtype)
    actual = _quantities(extension, model_name, loss_kind, model_dtype, cast)
    for name, value in actual.items():
        if loss_kind == "MSELoss" and extension in MONTE_CARLO:
            # Gaussian samples in another dtype are other numbers (classes drawn are the same)
            assert value.shape == expected[name].shape and torch.isfinite(value).all()
            continue
        torch.testing.assert_close(
            value, expected[name], rtol=1e-4, atol=1e-6, msg=f"{name}: {extension.__name__}"
        )
