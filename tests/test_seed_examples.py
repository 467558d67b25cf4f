"""The seed documents' examples, run as tests on the embedded offline digits.

- Quickstart ("How to use BackPACK"): the 784-64-10 MLP, extended model and loss, extensions
  activated around `loss.backward()`; first-order extensions and the quickstart's `KFAC`.
- Residual networks, "Custom ResNet": `MyFirstResNet` (convolutions and a residual `x + residual`
  in a hand-written forward, a linear head) with `BatchGrad`, and the example's own check of
  `grad_batch[sample]` against a single-sample backward.
"""

import pytest
import torch
from problems import first_order_reference, reference_per_sample_grads
from torch.nn import Conv2d, CrossEntropyLoss, Identity, Linear, Module, ReLU, Sequential
from torch.nn.functional import cross_entropy, relu

from backpack import backpack, extend
from backpack.extensions import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance
from backpack.utils.examples import load_one_batch_mnist


@pytest.fixture(autouse=True)
def _embedded_digits(monkeypatch, tmp_path):
    """Use the embedded digits whatever is on this machine (no real MNIST copy)."""
    monkeypatch.setenv("BACKPACK_MNIST_ROOT", str(tmp_path / "no-mnist-here"))


# --------------------------------------------------------------------------------------------
# Quickstart
# --------------------------------------------------------------------------------------------
def quickstart_model():
    return Sequential(Linear(784, 64), ReLU(), Linear(64, 10))


@pytest.mark.parametrize(
    "dtype,rtol,atol", [(torch.float32, 1e-4, 1e-6), (torch.float64, 1e-9, 1e-12)]
)
def test_quickstart_first_order(dtype, rtol, atol):
    torch.manual_seed(0)
    X, y = load_one_batch_mnist(batch_size=16, flat=True)
    X = X.to(dtype)
    model = quickstart_model().to(dtype)
    lossfunc = CrossEntropyLoss()
    reference = reference_per_sample_grads(model, X, lossfunc, y)

    model = extend(model)
    lossfunc = extend(lossfunc)
    model.zero_grad()
    loss = lossfunc(model(X), y)
    with backpack(BatchGrad(), Variance(), BatchL2Grad(), SumGradSquared(), BatchDotGrad()):
        loss.backward()

    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference[name].sum(0), rtol=rtol, atol=atol)
        for quantity in ("grad_batch", "variance", "batch_l2", "sum_grad_squared", "batch_dot"):
            expected = first_order_reference(reference[name], quantity)
            value = getattr(param, quantity)
            assert value.shape == expected.shape, (name, quantity)
            torch.testing.assert_close(value, expected, rtol=rtol, atol=atol, msg=name)
    assert model[0].weight.grad_batch.shape == (16, 64, 784)
    assert model[2].bias.variance.shape == (10,)


def test_quickstart_kfac():
    """The quickstart verbatim: `with backpack(KFAC()): loss.backward()`, then .grad and .kfac."""
    extensions = pytest.importorskip("backpack.extensions")
    if not hasattr(extensions, "KFAC"):
        pytest.skip("KFAC not implemented yet")
    torch.manual_seed(0)
    X, y = load_one_batch_mnist(batch_size=16, flat=True)
    X = X.to(torch.float64)
    model = extend(quickstart_model().to(torch.float64))
    lossfunc = extend(CrossEntropyLoss())
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(lossfunc(model(X), y), list(model.parameters()))
    plain = dict(zip(names, grads, strict=True))

    loss = lossfunc(model(X), y)
    with backpack(extensions.KFAC()):
        loss.backward()

    hidden = relu(model[0](X)).detach()
    inputs = {"0": X, "2": hidden}
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain[name])
        layer, kind = name.split(".")
        out_dim = param.shape[0]
        factors = param.kfac
        assert isinstance(factors, (list, tuple))
        if kind == "weight":
            assert len(factors) == 2
            G, A = factors
            a = inputs[layer]
            # A: batch mean of the input outer products, independent of the loss
            torch.testing.assert_close(A, a.T @ a / a.shape[0])
        else:
            assert len(factors) == 1
            (G,) = factors
        assert G.shape == (out_dim, out_dim)
        torch.testing.assert_close(G, G.T)
        assert torch.linalg.eigvalsh(G).min() > -1e-10


# --------------------------------------------------------------------------------------------
# Residual networks: Custom ResNet
# --------------------------------------------------------------------------------------------
class MyFirstResNet(Module):
    def __init__(self, C_in=1, C_hid=5, input_dim=(28, 28), output_dim=10):  # noqa: N803
        """Instantiate submodules that are used in the forward pass."""
        super().__init__()
        self.conv1 = Conv2d(C_in, C_hid, kernel_size=3, stride=1, padding=1)
        self.conv2 = Conv2d(C_hid, C_hid, kernel_size=3, stride=1, padding=1)
        self.linear1 = Linear(input_dim[0] * input_dim[1] * C_hid, output_dim)
        if C_in == C_hid:
            self.shortcut = Identity()
        else:
            self.shortcut = Conv2d(C_in, C_hid, kernel_size=1, stride=1)

    def forward(self, x):
        """Manual implementation of the forward pass."""
        residual = self.shortcut(x)
        x = self.conv2(relu(self.conv1(x)))
        x = x + residual  # don't use: x += residual
        x = x.flatten(start_dim=1)
        x = self.linear1(x)
        return x


EXPECTED_SHAPES = {
    "conv1.weight": (32, 5, 1, 3, 3),
    "conv1.bias": (32, 5),
    "conv2.weight": (32, 5, 5, 3, 3),
    "conv2.bias": (32, 5),
    "linear1.weight": (32, 10, 3920),
    "linear1.bias": (32, 10),
    "shortcut.weight": (32, 5, 1, 1, 1),
    "shortcut.bias": (32, 5),
}


def test_custom_resnet_batch_grad():
    torch.manual_seed(0)
    x, y = load_one_batch_mnist(batch_size=32)

    model = extend(MyFirstResNet())

    loss = cross_entropy(model(x), y, reduction="sum")
    with backpack(BatchGrad()):
        loss.backward()

    names = [name for name, _ in model.named_parameters()]
    assert names == list(EXPECTED_SHAPES)
    for name, parameter in model.named_parameters():
        assert parameter.grad_batch.shape == EXPECTED_SHAPES[name], name

    grad_batch = {name: p.grad_batch.clone() for name, p in model.named_parameters()}
    for sample_to_check in (1, 0, 17, 31):
        x_to_check = x[[sample_to_check]]
        y_to_check = y[[sample_to_check]]

        model.zero_grad()
        loss = cross_entropy(model(x_to_check), y_to_check)
        loss.backward()

        for name, parameter in model.named_parameters():
            match = torch.allclose(grad_batch[name][sample_to_check], parameter.grad, atol=1e-6)
            assert match, f"Individual gradients don't match: {name}, sample {sample_to_check}"


def test_custom_resnet_first_order_float64_all_quantities():
    """The same model in float64 with every first-order extension, against brute force."""
    torch.manual_seed(0)
    x, y = load_one_batch_mnist(batch_size=6)
    x = x.to(torch.float64)
    model = MyFirstResNet(C_hid=2).to(torch.float64)
    lossfunc = CrossEntropyLoss()
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    extend(model)
    loss = lossfunc(model(x), y)
    exts = {
        "grad_batch": BatchGrad(),
        "batch_l2": BatchL2Grad(),
        "sum_grad_squared": SumGradSquared(),
        "variance": Variance(),
        "batch_dot": BatchDotGrad(),
    }
    with backpack(*exts.values()):
        loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference[name].sum(0), msg=name)
        for quantity in exts:
            expected = first_order_reference(reference[name], quantity)
            torch.testing.assert_close(
                getattr(param, quantity), expected, rtol=1e-9, atol=1e-12, msg=f"{name} {quantity}"
            )


def test_custom_resnet_identity_shortcut():
    """With C_in == C_hid the shortcut is an Identity: the residual carries no parameters."""
    torch.manual_seed(0)
    x, y = load_one_batch_mnist(batch_size=4)
    x = x.to(torch.float64).expand(-1, 2, -1, -1).contiguous()
    model = MyFirstResNet(C_in=2, C_hid=2).to(torch.float64)
    reference = reference_per_sample_grads(model, x, CrossEntropyLoss(reduction="sum"), y)
    extend(model)
    loss = cross_entropy(model(x), y, reduction="sum")
    with backpack(BatchGrad()):
        loss.backward()
    assert isinstance(model.shortcut, Identity)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad_batch, reference[name], msg=name)
