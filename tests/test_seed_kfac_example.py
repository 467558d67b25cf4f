"""Seed 003 (the original's quickstart) with KFAC, on the offline MNIST batch.

The example runs as a user would write it (float32); the factors are then checked against their
definitions, and KFLR's output factors of the bias terms against exact GGN blocks from brute-force
autograd in float64.
"""

import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from backpack import backpack, extend
from backpack.extensions import KFAC, KFLR
from backpack.utils.examples import load_one_batch_mnist

BATCH = 32


def load_data():
    return load_one_batch_mnist(batch_size=BATCH, flat=True)


def test_quickstart_with_kfac():
    torch.manual_seed(0)
    X, y = load_data()
    model = torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    lossfunc = torch.nn.CrossEntropyLoss()
    model = extend(model)
    lossfunc = extend(lossfunc)

    loss = lossfunc(model(X), y)
    with backpack(KFAC()):
        loss.backward()

    shapes = {
        "0.weight": [(64, 64), (784, 784)],
        "0.bias": [(64, 64)],
        "2.weight": [(10, 10), (64, 64)],
        "2.bias": [(10, 10)],
    }
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.shape == param.shape
        assert isinstance(param.kfac, list)
        assert [tuple(f.shape) for f in param.kfac] == shapes[name], name
        for factor in param.kfac:
            assert factor.dtype == param.dtype
            torch.testing.assert_close(factor, factor.T)
            assert torch.linalg.eigvalsh(factor.double()).min() > -1e-5
    # A: batch mean of the layer inputs' outer products
    with torch.no_grad():
        hidden = model[1](model[0](X))
    torch.testing.assert_close(model[0].weight.kfac[1], X.T @ X / BATCH, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        model[2].weight.kfac[1], hidden.T @ hidden / BATCH, rtol=1e-5, atol=1e-5
    )
    # the bias shares the weight's output factor
    torch.testing.assert_close(model[0].bias.kfac[0], model[0].weight.kfac[0])
    torch.testing.assert_close(model[2].bias.kfac[0], model[2].weight.kfac[0])


def ggn_bias_block(model, x, y, lossfunc, name):
    """J_bᵀ H J_b with J_b the Jacobian of the output w.r.t. one bias (torch.func, dense)."""
    params = {k: p.detach() for k, p in model.named_parameters()}

    def out_of(bias):
        return functional_call(model, {**params, name: bias}, (x,))

    out = out_of(params[name])
    jac = jacrev(out_of)(params[name]).reshape(out.numel(), -1)
    hess = hessian(lambda o: lossfunc(o.reshape(out.shape), y))(out.detach().flatten())
    return jac.T @ hess @ jac


def test_quickstart_kflr_bias_factors_are_exact_ggn_blocks():
    torch.manual_seed(0)
    X, y = load_data()
    X = X.double()
    model = torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model = model.double()
    lossfunc = nn.CrossEntropyLoss()
    expected = {name: ggn_bias_block(model, X, y, lossfunc, name) for name in ("0.bias", "2.bias")}

    model, lossfunc = extend(model), extend(lossfunc)
    loss = lossfunc(model(X), y)
    with backpack(KFLR(), KFAC()):
        loss.backward()
    for name, param in model.named_parameters():
        assert [f.shape for f in param.kflr] == [f.shape for f in param.kfac]
        if name in expected:
            torch.testing.assert_close(param.kflr[0], expected[name], rtol=1e-10, atol=1e-12)
    # KFLR and KFAC share the input factor A
    for layer in (model[0], model[2]):
        torch.testing.assert_close(layer.weight.kflr[1], layer.weight.kfac[1])
