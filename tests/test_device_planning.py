"""The GPU's implementation choices, checked on the CPU, and a steady step without host reads.

`backpack.core.device.planning_for("cuda")` makes the rules choose as on a GPU (folded
convolution weight backwards, larger chunks, no waiting for autograd's gradient sums). Those
implementations must give the numbers of the table's brute force too. On a GPU, every value read
on the host stalls the card: a training loop's typical step (after the checks of the first
passes) must read none. Meta tensors carry no values, so a step on the meta device shows any read.
"""

import pytest
import torch
from problems import first_order_reference, problems_with, reference_per_sample_grads
from second_order_reference import Curvature
from torch import nn

from backpack import backpack, extend
from backpack import extensions as E
from backpack.core import device
from backpack.passes.coverage import assume_checked

pytestmark = [
    pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
]

#: problems whose choices depend on the device: convolutions, normalisation, linear layers
PLANNED = [
    p
    for p in problems_with("first")
    if any(k in p.id for k in ("conv", "batchnorm", "linear", "embedding"))
]
FIRST = ["grad_batch", "batch_l2", "sum_grad_squared", "variance", "batch_dot"]


@pytest.mark.parametrize("problem", PLANNED, ids=[p.id for p in PLANNED])
def test_first_order_with_the_gpus_choices(problem):
    model, x, lossfunc, y = problem.build()
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    extend(model)
    exts = [E.BatchGrad(), E.BatchL2Grad(), E.SumGradSquared(), E.Variance(), E.BatchDotGrad()]
    with device.planning_for("cuda"), backpack(*exts):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        for quantity in FIRST:
            expected = first_order_reference(reference[name], quantity)
            torch.testing.assert_close(
                getattr(p, quantity), expected, rtol=1e-7, atol=1e-10, msg=f"{name} {quantity}"
            )


SECOND = [p for p in problems_with("second") if p in PLANNED]


@pytest.mark.parametrize("problem", SECOND, ids=[p.id for p in SECOND])
def test_second_order_with_the_gpus_choices(problem):
    model, x, lossfunc, y = problem.build()
    curvature = Curvature(model, x, lossfunc, y, hessian=False)
    extend(model)
    extend(lossfunc)
    exts = (E.DiagGGNExact(), E.BatchDiagGGNExact(), E.SqrtGGNExact())
    with device.planning_for("cuda"), backpack(*exts):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        ggn = curvature.ggn
        torch.testing.assert_close(p.diag_ggn_exact, curvature.diag(ggn, name), msg=name)
        per_sample = curvature.diag(curvature.ggn_per_sample, name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, per_sample, msg=name)
        sqrt = p.sqrt_ggn_exact.flatten(2)
        block = torch.einsum("vnp,vnq->pq", sqrt, sqrt)
        torch.testing.assert_close(block, curvature.block(ggn, name), msg=name)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32, 5),
    ).eval()


class _TokenModel(nn.Module):
    """Embedding, a sequence Linear and flattened `[N·T, V]` logits (a language model's loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens)))).flatten(0, 1)


STEADY = ["BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance", "DiagGGNMC", "KFAC"]


@pytest.mark.parametrize("extension", STEADY)
@pytest.mark.parametrize("model_name", ["cnn", "tokens"])
def test_a_steady_step_reads_no_value_on_the_host(model_name, extension):
    with torch.device("meta"):
        if model_name == "cnn":
            model, x = _cnn(), torch.randn(4, 3, 8, 8)
            y = torch.randint(0, 5, (4,))
        else:
            model, x = _TokenModel(), torch.randint(0, 11, (3, 7))
            y = torch.randint(0, 11, (21,))
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    for obj in [*model.parameters(), *model.modules()]:
        assume_checked(obj)
    reads = device.META_READS[0]
    for _ in range(2):
        with device.planning_for("cuda"), backpack(getattr(E, extension)()):
            lossfunc(model(x), y).backward()  # a host read raises on meta tensors
        for p in model.parameters():
            p.grad = None
    # the one read rules may make (Variance's cancellation check of a linear layer) is counted
    allowed = 2 if extension == "Variance" else 0
    assert device.META_READS[0] - reads <= allowed


def test_convolution_products_follow_cudnns_precision(monkeypatch):
    """Under the GPU's choices, float32 products inside a convolution rule may use TF32 when
    cuDNN's convolutions do, and the setting is restored afterwards."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name() in ("aten::bmm", "aten::mm", "aten::baddbmm_"):
                seen.append(torch.backends.cuda.matmul.allow_tf32)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    conv = extend(nn.Conv2d(3, 4, 3))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(2, 3, 6, 6), torch.randint(0, 4, (2,))
    before = torch.backends.cuda.matmul.allow_tf32
    with device.planning_for("cuda"), backpack(E.BatchGrad()), Watch():
        lossfunc(conv(x).sum((2, 3)), y).backward()
    assert seen and all(seen)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    seen.clear()
    with backpack(E.BatchGrad()), Watch():  # on the CPU nothing changes
        lossfunc(conv(x).sum((2, 3)), y).backward()
    assert seen and not any(seen)
