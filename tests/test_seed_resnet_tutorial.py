"""Seed 004, "Residual networks", run as a test: the tutorial's code, unchanged, on the digits.

The three approaches of the tutorial, each with the tutorial's own assertions
(`allclose(..., atol=1e-6)`) in float32:

1. a custom-forward ResNet (`MyFirstResNet`) with `BatchGrad`, checked against a single-sample
   backward;
2. a ResNet built from `Parallel`/`SumModule` with `DiagGGNExact`, checked against
   `autograd_diag_ggn_exact` at ten indices;
3. torchvision's `resnet18` through `extend(..., use_converter=True)`, its graph table (which must
   read exactly like the tutorial's), `DiagGGNExact` under `MSELoss` on `rand(4, 3, 7, 7)`, checked
   against `autograd_diag_ggn_exact` at ten `linspace` indices.

Part 3's backward and its autograd reference on 11M parameters take ~20 s, so the full script
(all three parts in order, same random stream as the tutorial) is `@pytest.mark.slow`; the fast
test runs parts 1 and 2 and part 3 up to the table.
"""

import pytest
from torch import (
    allclose,
    cat,
    cuda,
    device,
    int32,
    linspace,
    manual_seed,
    rand,
    rand_like,
)
from torch.nn import (
    Conv2d,
    CrossEntropyLoss,
    Flatten,
    Identity,
    Linear,
    Module,
    MSELoss,
    ReLU,
    Sequential,
)
from torch.nn.functional import cross_entropy, relu
from torchvision.models import resnet18

from backpack import backpack, extend
from backpack.custom_module.branching import Parallel, SumModule
from backpack.custom_module.graph_utils import BackpackTracer
from backpack.extensions import BatchGrad, DiagGGNExact
from backpack.utils.examples import autograd_diag_ggn_exact, load_one_batch_mnist


@pytest.fixture(autouse=True)
def _embedded_digits(monkeypatch, tmp_path):
    """Use the embedded digits whatever is on this machine (no real MNIST copy)."""
    monkeypatch.setenv("BACKPACK_MNIST_ROOT", str(tmp_path / "no-mnist-here"))


# ---- the tutorial's code ----------------------------------------------------------------------
class MyFirstResNet(Module):
    def __init__(self, C_in=1, C_hid=5, input_dim=(28, 28), output_dim=10):
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


def print_table(module: Module) -> None:
    """Prints a table of the module.

    Args:
        module: module to analyze
    """
    graph = BackpackTracer().trace(module)
    graph.print_tabular()


def run_tutorial(converter_backward: bool) -> None:
    """The tutorial script; without `converter_backward` it stops after part 3's table."""
    manual_seed(0)

    DEVICE = device("cuda:0" if cuda.is_available() else "cpu")
    x, y = load_one_batch_mnist(batch_size=32)
    x, y = x.to(DEVICE), y.to(DEVICE)

    # -- Custom ResNet --
    model = extend(MyFirstResNet()).to(DEVICE)

    loss = cross_entropy(model(x), y, reduction="sum")

    with backpack(BatchGrad()):
        loss.backward()

    for name, parameter in model.named_parameters():
        print(f"{name:>20}'s grad_batch shape: {parameter.grad_batch.shape}")

    sample_to_check = 1
    x_to_check = x[[sample_to_check]]
    y_to_check = y[[sample_to_check]]

    model.zero_grad()
    loss = cross_entropy(model(x_to_check), y_to_check)
    loss.backward()

    print("Do the individual gradients match?")
    for name, parameter in model.named_parameters():
        match = allclose(parameter.grad_batch[sample_to_check], parameter.grad, atol=1e-6)
        print(f"{name:>20}: {match}")
        if not match:
            raise AssertionError("Individual gradients don't match!")

    # -- Custom ResNet with BackPACK custom modules --
    C_in = 1
    C_hid = 2
    input_dim = (28, 28)
    output_dim = 10

    model = Sequential(
        Conv2d(C_in, C_hid, kernel_size=3, stride=1, padding=1),
        ReLU(),
        Parallel(  # skip connection with ReLU-activated convolution
            Identity(),
            Sequential(
                Conv2d(C_hid, C_hid, kernel_size=3, stride=1, padding=1),
                ReLU(),
            ),
            merge_module=SumModule(),
        ),
        Flatten(),
        Linear(input_dim[0] * input_dim[1] * C_hid, output_dim),
    )

    model = extend(model.to(DEVICE))
    loss_function = extend(CrossEntropyLoss(reduction="mean")).to(DEVICE)

    loss = loss_function(model(x), y)

    with backpack(DiagGGNExact()):
        loss.backward()

    for name, parameter in model.named_parameters():
        print(f"{name}'s diag_ggn_exact: {parameter.diag_ggn_exact.shape}")

    diag_ggn_exact_vector = cat([p.diag_ggn_exact.flatten() for p in model.parameters()])

    num_params = sum(p.numel() for p in model.parameters())
    num_to_compare = 10
    idx_to_compare = linspace(0, num_params - 1, num_to_compare, device=DEVICE, dtype=int32)

    diag_ggn_exact_to_compare = autograd_diag_ggn_exact(
        x, y, model, loss_function, idx=idx_to_compare
    )

    print("Do the exact GGN diagonals match?")
    for idx, element in zip(idx_to_compare, diag_ggn_exact_to_compare):
        match = allclose(element, diag_ggn_exact_vector[idx], atol=1e-6)
        print(f"Diagonal entry {idx:>6}: {match}")
        if not match:
            raise AssertionError("Exact GGN diagonals don't match!")

    # -- Any ResNet with BackPACK's converter --
    loss_function = extend(MSELoss().to(DEVICE))
    model = resnet18(num_classes=5).to(DEVICE).eval()

    # use BackPACK's converter to extend the model (turned off by default)
    model = extend(model, use_converter=True)

    print_table(model)

    if not converter_backward:
        return

    x = rand(4, 3, 7, 7, device=DEVICE)  # (128, 3, 224, 224)
    output = model(x)
    y = rand_like(output)

    loss = loss_function(output, y)

    with backpack(DiagGGNExact()):
        loss.backward()

    for name, parameter in model.named_parameters():
        print(f"{name}'s diag_ggn_exact: {parameter.diag_ggn_exact.shape}")

    diag_ggn_exact_vector = cat([p.diag_ggn_exact.flatten() for p in model.parameters()])

    num_params = sum(p.numel() for p in model.parameters())
    num_to_compare = 10
    idx_to_compare = linspace(0, num_params - 1, num_to_compare, device=DEVICE, dtype=int32)

    diag_ggn_exact_to_compare = autograd_diag_ggn_exact(
        x, y, model, loss_function, idx=idx_to_compare
    )

    print("Do the exact GGN diagonals match?")
    for idx, element in zip(idx_to_compare, diag_ggn_exact_to_compare):
        match = allclose(element, diag_ggn_exact_vector[idx], atol=1e-6)
        print(f"Diagonal entry {idx:>8}: {match}")
        if not match:
            raise AssertionError("Exact GGN diagonals don't match!")


# ---- what the tutorial printed ----------------------------------------------------------------
GRAD_BATCH_SHAPES = [
    "conv1.weight's grad_batch shape: torch.Size([32, 5, 1, 3, 3])",
    "conv1.bias's grad_batch shape: torch.Size([32, 5])",
    "conv2.weight's grad_batch shape: torch.Size([32, 5, 5, 3, 3])",
    "conv2.bias's grad_batch shape: torch.Size([32, 5])",
    "linear1.weight's grad_batch shape: torch.Size([32, 10, 3920])",
    "linear1.bias's grad_batch shape: torch.Size([32, 10])",
    "shortcut.weight's grad_batch shape: torch.Size([32, 5, 1, 1, 1])",
    "shortcut.bias's grad_batch shape: torch.Size([32, 5])",
]
DIAG_GGN_SHAPES = [
    "0.weight's diag_ggn_exact: torch.Size([2, 1, 3, 3])",
    "0.bias's diag_ggn_exact: torch.Size([2])",
    "2.branch.1.0.weight's diag_ggn_exact: torch.Size([2, 2, 3, 3])",
    "2.branch.1.0.bias's diag_ggn_exact: torch.Size([2])",
    "4.weight's diag_ggn_exact: torch.Size([10, 1568])",
    "4.bias's diag_ggn_exact: torch.Size([10])",
]
GGN_INDICES = [0, 1749, 3499, 5249, 6998, 8748, 10498, 12247, 13997, 15747]
RESNET18_INDICES = [
    0,
    1242119,
    2484239,
    3726358,
    4968478,
    6210597,
    7452717,
    8694836,
    9936956,
    11179076,
]
#: the converted resnet18's graph as the tutorial printed it (whitespace collapsed)
RESNET18_TABLE = """
placeholder x x () {}
call_module conv1 conv1 (x,) {}
call_module bn1 bn1 (conv1,) {}
call_module relu relu (bn1,) {}
call_module maxpool maxpool (relu,) {}
call_module layer1_0_conv1 layer1.0.conv1 (maxpool,) {}
call_module layer1_0_bn1 layer1.0.bn1 (layer1_0_conv1,) {}
call_module layer1_0_relu0 layer1.0.relu0 (layer1_0_bn1,) {}
call_module layer1_0_conv2 layer1.0.conv2 (layer1_0_relu0,) {}
call_module layer1_0_bn2 layer1.0.bn2 (layer1_0_conv2,) {}
call_module sum_module0 sum_module0 (layer1_0_bn2, maxpool) {}
call_module layer1_0_relu1 layer1.0.relu1 (sum_module0,) {}
call_module layer1_1_conv1 layer1.1.conv1 (layer1_0_relu1,) {}
call_module layer1_1_bn1 layer1.1.bn1 (layer1_1_conv1,) {}
call_module layer1_1_relu0 layer1.1.relu0 (layer1_1_bn1,) {}
call_module layer1_1_conv2 layer1.1.conv2 (layer1_1_relu0,) {}
call_module layer1_1_bn2 layer1.1.bn2 (layer1_1_conv2,) {}
call_module sum_module1 sum_module1 (layer1_1_bn2, layer1_0_relu1) {}
call_module layer1_1_relu1 layer1.1.relu1 (sum_module1,) {}
call_module layer2_0_conv1 layer2.0.conv1 (layer1_1_relu1,) {}
call_module layer2_0_bn1 layer2.0.bn1 (layer2_0_conv1,) {}
call_module layer2_0_relu0 layer2.0.relu0 (layer2_0_bn1,) {}
call_module layer2_0_conv2 layer2.0.conv2 (layer2_0_relu0,) {}
call_module layer2_0_bn2 layer2.0.bn2 (layer2_0_conv2,) {}
call_module layer2_0_downsample_0 layer2.0.downsample.0 (layer1_1_relu1,) {}
call_module layer2_0_downsample_1 layer2.0.downsample.1 (layer2_0_downsample_0,) {}
call_module sum_module2 sum_module2 (layer2_0_bn2, layer2_0_downsample_1) {}
call_module layer2_0_relu1 layer2.0.relu1 (sum_module2,) {}
call_module layer2_1_conv1 layer2.1.conv1 (layer2_0_relu1,) {}
call_module layer2_1_bn1 layer2.1.bn1 (layer2_1_conv1,) {}
call_module layer2_1_relu0 layer2.1.relu0 (layer2_1_bn1,) {}
call_module layer2_1_conv2 layer2.1.conv2 (layer2_1_relu0,) {}
call_module layer2_1_bn2 layer2.1.bn2 (layer2_1_conv2,) {}
call_module sum_module3 sum_module3 (layer2_1_bn2, layer2_0_relu1) {}
call_module layer2_1_relu1 layer2.1.relu1 (sum_module3,) {}
call_module layer3_0_conv1 layer3.0.conv1 (layer2_1_relu1,) {}
call_module layer3_0_bn1 layer3.0.bn1 (layer3_0_conv1,) {}
call_module layer3_0_relu0 layer3.0.relu0 (layer3_0_bn1,) {}
call_module layer3_0_conv2 layer3.0.conv2 (layer3_0_relu0,) {}
call_module layer3_0_bn2 layer3.0.bn2 (layer3_0_conv2,) {}
call_module layer3_0_downsample_0 layer3.0.downsample.0 (layer2_1_relu1,) {}
call_module layer3_0_downsample_1 layer3.0.downsample.1 (layer3_0_downsample_0,) {}
call_module sum_module4 sum_module4 (layer3_0_bn2, layer3_0_downsample_1) {}
call_module layer3_0_relu1 layer3.0.relu1 (sum_module4,) {}
call_module layer3_1_conv1 layer3.1.conv1 (layer3_0_relu1,) {}
call_module layer3_1_bn1 layer3.1.bn1 (layer3_1_conv1,) {}
call_module layer3_1_relu0 layer3.1.relu0 (layer3_1_bn1,) {}
call_module layer3_1_conv2 layer3.1.conv2 (layer3_1_relu0,) {}
call_module layer3_1_bn2 layer3.1.bn2 (layer3_1_conv2,) {}
call_module sum_module5 sum_module5 (layer3_1_bn2, layer3_0_relu1) {}
call_module layer3_1_relu1 layer3.1.relu1 (sum_module5,) {}
call_module layer4_0_conv1 layer4.0.conv1 (layer3_1_relu1,) {}
call_module layer4_0_bn1 layer4.0.bn1 (layer4_0_conv1,) {}
call_module layer4_0_relu0 layer4.0.relu0 (layer4_0_bn1,) {}
call_module layer4_0_conv2 layer4.0.conv2 (layer4_0_relu0,) {}
call_module layer4_0_bn2 layer4.0.bn2 (layer4_0_conv2,) {}
call_module layer4_0_downsample_0 layer4.0.downsample.0 (layer3_1_relu1,) {}
call_module layer4_0_downsample_1 layer4.0.downsample.1 (layer4_0_downsample_0,) {}
call_module sum_module6 sum_module6 (layer4_0_bn2, layer4_0_downsample_1) {}
call_module layer4_0_relu1 layer4.0.relu1 (sum_module6,) {}
call_module layer4_1_conv1 layer4.1.conv1 (layer4_0_relu1,) {}
call_module layer4_1_bn1 layer4.1.bn1 (layer4_1_conv1,) {}
call_module layer4_1_relu0 layer4.1.relu0 (layer4_1_bn1,) {}
call_module layer4_1_conv2 layer4.1.conv2 (layer4_1_relu0,) {}
call_module layer4_1_bn2 layer4.1.bn2 (layer4_1_conv2,) {}
call_module sum_module7 sum_module7 (layer4_1_bn2, layer4_0_relu1) {}
call_module layer4_1_relu1 layer4.1.relu1 (sum_module7,) {}
call_module avgpool avgpool (layer4_1_relu1,) {}
call_module flatten0 flatten0 (avgpool,) {}
call_module fc fc (flatten0,) {}
output output output (fc,) {}
"""


def _lines(text):
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def _check_printed(lines, converter_backward):
    assert sum(line.endswith(": True") for line in lines) == 8 + 10 + 10 * converter_backward
    assert not any(line.endswith(": False") for line in lines)
    for expected in GRAD_BATCH_SHAPES + DIAG_GGN_SHAPES:
        assert expected in lines
    for idx in GGN_INDICES:
        assert f"Diagonal entry {idx}: True" in lines
    header = lines.index("opcode name target args kwargs")
    table = lines[header + 2 : header + 2 + len(_lines(RESNET18_TABLE))]
    assert table == _lines(RESNET18_TABLE)


def test_seed_resnet_tutorial_fast(capsys):
    """Parts 1 and 2 with their checks; part 3 up to the converted model's table."""
    run_tutorial(converter_backward=False)
    _check_printed(_lines(capsys.readouterr().out), converter_backward=False)


@pytest.mark.slow
def test_seed_resnet_tutorial_full_script(capsys):
    """The whole tutorial, including DiagGGNExact on the converted resnet18."""
    run_tutorial(converter_backward=True)
    lines = _lines(capsys.readouterr().out)
    _check_printed(lines, converter_backward=True)
    for idx in RESNET18_INDICES:
        assert f"Diagonal entry {idx}: True" in lines
    assert "fc.weight's diag_ggn_exact: torch.Size([5, 512])" in lines
    assert "layer4.1.conv2.weight's diag_ggn_exact: torch.Size([512, 512, 3, 3])" in lines
