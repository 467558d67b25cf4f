"""Client libraries built on the original BackPACK, run on top of this one (`make test-clients`).

Skipped where a client is not installed. The clients' own dependency on `backpack-for-pytorch`
must be left uninstalled, so that `import backpack` is this package (checked below).
"""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import backpack

pytestmark = pytest.mark.clients

ROOT = Path(__file__).resolve().parents[2]


def test_backpack_is_this_package():
    assert Path(backpack.__file__).resolve().is_relative_to(ROOT), backpack.__file__


def _regression(n=40):
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, n).unsqueeze(1)
    y = torch.sin(2 * x) + 0.1 * torch.randn_like(x)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)


def _classification(n=60):
    torch.manual_seed(0)
    x = torch.randn(n, 4)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=15)


def _fit(model, loader, lossfunc, steps=60):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        for x, y in loader:
            opt.zero_grad()
            lossfunc(model(x), y).backward()
            opt.step()
    return model


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("likelihood", ["regression", "classification"])
def test_laplace_with_the_backpack_backend(structure, likelihood):
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import BackPackGGN

    if likelihood == "regression":
        loader, out, lossfunc = _regression(), 1, nn.MSELoss()
    else:
        loader, out, lossfunc = _classification(), 3, nn.CrossEntropyLoss()
    torch.manual_seed(0)
    model = _fit(nn.Sequential(nn.Linear(loader.dataset[0][0].numel(), 8), nn.Tanh(),
                               nn.Linear(8, out)), loader, lossfunc)
    la = laplace.Laplace(
        model, likelihood, subset_of_weights="all", hessian_structure=structure,
        backend=BackPackGGN,
    )
    la.fit(loader)
    la.optimize_prior_precision(method="marglik", n_steps=20)
    x = loader.dataset.tensors[0][:5]
    if likelihood == "regression":
        mean, var = la(x)
        assert mean.shape == (5, 1) and (var > 0).all()
    else:
        probs = la(x, link_approx="probit")
        torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    assert math.isfinite(la.log_marginal_likelihood().item())


def test_laplace_diag_ggn_equals_backpack_diag_ggn():
    """The curvature Laplace gets through its BackPACK backend is our DiagGGNExact."""
    pytest.importorskip("laplace")
    from laplace.curvature import BackPackGGN

    loader = _classification()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = loader.dataset.tensors
    backend = BackPackGGN(model, "classification")
    _, diag = backend.diag(x, y)
    reference = backpack.verify(model, nn.CrossEntropyLoss(reduction="sum"), x, y,
                                extensions="DiagGGNExact", samples=len(x))
    assert reference.ok, str(reference)
    params = list(model.parameters())
    ours = torch.cat([p.diag_ggn_exact.flatten() for p in params])
    torch.testing.assert_close(diag, ours)


def test_cockpit_default_quantities():
    cockpit = pytest.importorskip("cockpit")
    from backpack import extend

    torch.manual_seed(0)
    loader = _classification(n=64)
    model = extend(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    lossfunc = extend(nn.CrossEntropyLoss())
    individual = extend(nn.CrossEntropyLoss(reduction="none"))
    from cockpit.utils.configuration import configuration

    quantities = configuration("full")
    cp = cockpit.Cockpit(model.parameters(), quantities=quantities)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    for x, y in loader:
        opt.zero_grad()
        outputs = model(x)
        loss = lossfunc(outputs, y)
        losses = individual(outputs, y)
        info = {"batch_size": x.shape[0], "individual_losses": losses, "loss": loss,
                "optimizer": opt}
        with cp(steps, info=info):
            loss.backward(create_graph=cp.create_graph(steps))
        opt.step()
        steps += 1
    output = cp.get_output()
    assert output, "cockpit tracked nothing"
    tracked = {name for per_step in output.values() for name in per_step}
    expected = {"Loss", "GradNorm", "NormTest", "InnerTest", "OrthoTest", "TICDiag", "Alpha",
                "HessTrace", "HessMaxEV", "GradHist1d", "GradHist2d", "Distance"}
    assert expected <= tracked, sorted(tracked)
    for per_step in output.values():
        for name, value in per_step.items():
            if isinstance(value, float):
                assert math.isfinite(value), (name, value)
