"""`.grad` of convolutions summed from per-sample gradients.

Where a convolution parameter's every use is a recorded module call, a `backward()` with
first-order extensions alone skips autograd's weight backward and sums the per-sample gradients
the extensions form anyway (`BatchGrad`'s, or the chunks `BatchL2Grad`, `SumGradSquared` and
`Variance` square): the same `.grad` up to rounding. Everywhere else autograd's own gradient is
kept, bit for bit.
"""

import copy
import sys

import pytest
import torch
from torch import nn

from backpack import backpack, extend, grads_from_samples
from backpack.context import CTX
from backpack.extensions import (
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNMC,
    SumGradSquared,
    Variance,
)

DTYPE = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-15}


def conv_net(conv=nn.Conv2d, size=(6, 6), **kwargs):
    """Two convolutions (only the second one's input needs a gradient) and a linear head."""
    layers = nn.Sequential(
        conv(2, 4, 3, padding=1, **kwargs), nn.ReLU(), conv(4, 4, 3, stride=2, **kwargs), nn.ReLU()
    )
    with torch.no_grad():
        features = layers(torch.zeros(1, 2, *size)).numel()
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(features, 3)).to(DTYPE)


def data(size=(6, 6), n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, *size, generator=gen, dtype=DTYPE, device="cpu")
    y = torch.randint(0, 3, (n,), generator=gen, device="cpu")
    return x.to(torch.get_default_device()), y.to(torch.get_default_device())


@pytest.fixture
def derived(monkeypatch):
    """The parameters whose `.grad` the last backward summed from per-sample gradients."""
    seen: list = []
    original = grads_from_samples.assign

    def spy(params, sums):
        seen[:] = list(params)
        original(params, sums)

    monkeypatch.setattr(grads_from_samples, "assign", spy)
    return seen


def plain_grads(model, x, y, loss_fn=None):
    plain = copy.deepcopy(model)
    (loss_fn or nn.functional.cross_entropy)(plain(x), y).backward()
    return {name: p.grad for name, p in plain.named_parameters()}


def ids(params):
    return {id(p) for p in params}


CONVS = {
    "conv1d": (nn.Conv1d, (7,), {}),
    "conv2d-groups-dilation": (nn.Conv2d, (9, 10), {"groups": 2, "dilation": 2}),
    "conv3d": (nn.Conv3d, (4, 5, 4), {"bias": False}),
    "conv-transpose2d": (nn.ConvTranspose2d, (4, 3), {}),
}


@pytest.mark.parametrize("case", CONVS, ids=list(CONVS))
def test_convolutions_sum_their_per_sample_gradients(case, derived):
    conv, size, kwargs = CONVS[case]
    torch.manual_seed(0)
    model = conv_net(conv, size, **kwargs)
    x, y = data(size)
    expected = plain_grads(model, x, y)
    extend(model)
    with backpack(BatchGrad()):
        nn.functional.cross_entropy(model(x), y).backward()
    # the first convolution's input needs no gradient: its node runs for the output's gradient
    assert ids(derived) == ids([*model[0].parameters(), *model[2].parameters()])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL)
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, **TOL)


EXTENSION_SETS = {
    "batch-l2": [BatchL2Grad],
    "sum-grad-squared": [SumGradSquared],
    "variance": [Variance],
    "batch-dot": [BatchDotGrad],
    "all-first-order": [BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad],
}


@pytest.mark.parametrize("case", EXTENSION_SETS, ids=list(EXTENSION_SETS))
def test_other_first_order_extensions_sum_too_with_unchanged_quantities(
    case, derived, monkeypatch
):
    torch.manual_seed(0)
    model = conv_net()
    x, y = data()
    expected = plain_grads(model, x, y)
    extend(model)
    exts = EXTENSION_SETS[case]

    def run():
        for p in model.parameters():
            p.grad = None
        with backpack(*(cls() for cls in exts)):
            nn.functional.cross_entropy(model(x), y).backward()
        return {
            (name, ext.savefield): getattr(p, ext.savefield).clone()
            for name, p in model.named_parameters()
            for ext in (cls() for cls in exts)
        }

    monkeypatch.setattr(grads_from_samples, "ENABLED", False)
    reference = run()
    assert not derived
    monkeypatch.setattr(grads_from_samples, "ENABLED", True)
    quantities = run()
    assert ids(derived) == ids([*model[0].parameters(), *model[2].parameters()])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL)
    for key, value in reference.items():
        torch.testing.assert_close(quantities[key], value, **TOL)


def test_derived_gradients_accumulate_like_autograds(derived):
    torch.manual_seed(0)
    model = extend(conv_net())
    x, y = data()
    expected = plain_grads(model, x, y)
    nn.functional.cross_entropy(model(x), y).backward()  # .grad already holds one gradient
    loss = nn.functional.cross_entropy(model(x), y)
    with backpack(BatchGrad(), retain_graph=True):
        loss.backward(retain_graph=True)
        loss.backward()
    assert derived
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 3 * expected[name], **TOL)


def test_an_input_that_needs_a_gradient_gets_autograds_gradient(derived):
    torch.manual_seed(0)
    model = extend(conv_net())
    x, y = data()
    x.requires_grad_(True)
    expected = plain_grads(model, x, y)
    expected_x = x.grad.clone()
    x.grad = None
    with backpack(BatchGrad()):
        nn.functional.cross_entropy(model(x), y).backward()
    assert ids(derived) == ids([*model[0].parameters(), *model[2].parameters()])
    torch.testing.assert_close(x.grad, expected_x, rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL)


def test_a_convolution_used_twice_sums_both_calls(derived):
    torch.manual_seed(0)
    model = conv_net()
    x, y = data()
    x2, _ = data(seed=1)

    def loss_of(m):
        return nn.functional.cross_entropy(m(x), y) + nn.functional.cross_entropy(m(x2), y)

    plain = copy.deepcopy(model)
    loss_of(plain).backward()
    extend(model)
    with backpack(BatchGrad()):
        loss_of(model).backward()
    assert ids(derived) == ids([*model[0].parameters(), *model[2].parameters()])
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def _regularised(model, x, y):
    return nn.functional.cross_entropy(model(x), y) + 0.1 * model[2].weight.square().sum()


def _hooked(model):
    calls = []
    model[2].weight.register_hook(lambda g: calls.append(g.clone()))
    return calls


def _post_accumulate_hooked(model):
    calls = []
    model[2].weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    return calls


@pytest.mark.filterwarnings("ignore:Parameter .* also receives gradient from operations outside")
@pytest.mark.parametrize(
    "case",
    ["regulariser", "tensor-hook", "post-accumulate-hook", "subsampling", "second-order",
     "inputs", "disabled", "horovod"],
)
def test_autograds_own_gradient_where_summing_is_not_exact_or_not_safe(case, monkeypatch):
    """Bit-equal to plain autograd; hooks on the parameter run with autograd's gradient."""
    torch.manual_seed(0)
    model = conv_net()
    x, y = data()
    loss_fn = _regularised if case == "regulariser" else (
        lambda m, x, y: nn.functional.cross_entropy(m(x), y)
    )
    if case == "second-order":
        ce = extend(nn.CrossEntropyLoss())
        loss_fn = lambda m, x, y: ce(m(x), y)  # noqa: E731
    plain = copy.deepcopy(model)
    plain_calls = _hooked(plain) if case == "tensor-hook" else []
    loss_fn(plain, x, y).backward()
    extend(model)
    calls = []
    if case == "tensor-hook":
        calls = _hooked(model)
    if case == "post-accumulate-hook":
        calls = _post_accumulate_hooked(model)
    if case == "disabled":
        monkeypatch.setattr(grads_from_samples, "ENABLED", False)
    if case == "horovod":
        monkeypatch.setitem(sys.modules, "horovod.torch", object())
    extensions = {
        "subsampling": [BatchGrad(subsampling=[0, 2])],
        "second-order": [BatchGrad(), DiagGGNMC()],
    }.get(case, [BatchGrad()])
    planned = []
    original = grads_from_samples.assign

    def spy(params, sums):
        planned.append(list(params))
        original(params, sums)

    monkeypatch.setattr(grads_from_samples, "assign", spy)
    loss = loss_fn(model, x, y)
    with backpack(*extensions):
        if case == "inputs":
            loss.backward(inputs=list(model.parameters()))
        else:
            loss.backward()
    summed = {id(p) for params in planned for p in params}
    for p, q in zip(model.parameters(), plain.parameters()):
        if id(p) in summed:
            torch.testing.assert_close(p.grad, q.grad, **TOL)
        else:
            assert torch.equal(p.grad, q.grad)
    assert id(model[2].weight) not in summed
    if case == "tensor-hook":
        assert len(calls) == 1 and torch.equal(calls[0], plain_calls[0])
    elif case == "post-accumulate-hook":
        assert len(calls) == 1 and torch.equal(calls[0], plain.get_parameter("2.weight").grad)
    if case in ("regulariser", "tensor-hook", "post-accumulate-hook"):
        # the layer's other parameter and the first layer still qualify
        assert summed == ids([*model[0].parameters(), model[2].bias])
    else:
        assert not planned


def test_samples_mixed_downstream_still_sum_to_the_gradient(derived):
    """BatchNorm in train mode after a convolution: its per-sample gradients are not those of
    separate samples, but Σ_n g_n x_nᵀ over the call's own output gradients still is the
    weight gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3), nn.Flatten()
    ).to(DTYPE)
    x, _ = data()
    expected = plain_grads(model, x, None, lambda out, _: out.square().sum())
    extend(model)
    with pytest.warns(UserWarning, match="mixes samples"), backpack(BatchGrad()):
        model(x).square().sum().backward()
    assert ids(derived) == ids([*model[0].parameters(), *model[2].parameters()])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL)


def test_an_error_in_the_backward_leaves_no_state_and_no_partial_gradient(derived):
    torch.manual_seed(0)
    model = extend(conv_net())
    x, y = data()

    def fail(module):
        raise ValueError("stop")

    with pytest.raises(ValueError, match="stop"), backpack(BatchGrad(), extension_hook=fail):
        nn.functional.cross_entropy(model(x), y).backward()
    assert not derived
    assert all(p.grad is None for p in model[2].parameters())
    assert not CTX.engines
    expected = plain_grads(model, x, y)
    for p in model.parameters():
        p.grad = None
    with backpack(BatchGrad()):
        nn.functional.cross_entropy(model(x), y).backward()
    assert derived
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL)


# --- set-ups where a summed gradient could go wrong ------------------------------------------
def test_several_weighted_losses_sum_to_autograds_gradient(derived):
    """Two losses on two forwards, one negatively weighted: the sum covers both calls."""
    torch.manual_seed(0)
    model = conv_net()
    (x, y), (x2, y2) = data(), data(seed=1)

    def loss_of(m):
        ce = nn.functional.cross_entropy
        return ce(m(x), y) - 0.3 * ce(m(x2), y2, reduction="sum")

    plain = copy.deepcopy(model)
    loss_of(plain).backward()
    extend(model)
    with backpack(BatchGrad(), Variance()):
        loss_of(model).backward()
    assert ids(derived) == ids([*model[0].parameters(), *model[2].parameters()])
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_threads_reproduce_single_threaded_gradients(derived):
    from thread_checks import assert_threads_reproduce

    setups = []
    for seed in range(3):
        torch.manual_seed(seed)
        setups.append((extend(conv_net()), *data(seed=seed)))

    def step(i):
        model, x, y = setups[i]
        model.zero_grad()
        with backpack(BatchGrad(), BatchL2Grad()):
            nn.functional.cross_entropy(model(x), y).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    model, x, y = setups[0]
    expected = plain_grads(model, x, y)
    for name, grad in step(0).items():
        torch.testing.assert_close(grad, expected[name], **TOL)
    assert derived
    assert_threads_reproduce(step, 3, 5)


def test_autocast_keeps_autograds_gradient(derived):
    """Under autocast the weight reaches the convolution through a cast: not summed."""
    torch.manual_seed(0)
    model = conv_net().float()
    x, y = data()
    x = x.float()
    plain = copy.deepcopy(model)
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(plain(x), y)
    loss.backward()
    extend(model)
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    assert not derived
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_compiled_model_gives_the_eager_gradients():
    torch.manual_seed(0)
    model = extend(conv_net())
    x, y = data()
    expected = plain_grads(model, x, y)
    compiled = torch.compile(model)
    for _ in range(2):  # the second pass runs the compiled code
        model.zero_grad()
        with backpack(BatchGrad()):
            nn.functional.cross_entropy(compiled(x), y).backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], **TOL)
            torch.testing.assert_close(p.grad_batch.sum(0), p.grad, **TOL)


def test_nothing_is_summed_while_torch_distributed_is_initialised(derived, monkeypatch):
    """DDP hooks the gradient accumulators, which a summed gradient would skip."""
    with monkeypatch.context() as patched:
        patched.setattr(torch.distributed, "is_initialized", lambda: True)
        assert not grads_from_samples.accumulator_hooks_unlikely()
    assert grads_from_samples.accumulator_hooks_unlikely()
    monkeypatch.setattr(grads_from_samples, "accumulator_hooks_unlikely", lambda: False)
    torch.manual_seed(0)
    model = conv_net()
    x, y = data()
    expected = plain_grads(model, x, y)
    extend(model)
    with backpack(BatchGrad()):
        nn.functional.cross_entropy(model(x), y).backward()
    assert not derived
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name])


class _ScaledInputConv(nn.Conv2d):
    """A subclass whose forward feeds the convolution something else than its input."""

    def forward(self, x):
        return super().forward(2.0 * x)


class _FunctionalConv(nn.Module):
    """A parametrized module without a rule whose output is a convolution's output."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, 3, 3) / 6)

    def forward(self, x):
        return nn.functional.conv2d(x, self.weight, stride=2)


@pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for:UserWarning")
@pytest.mark.parametrize("layer", [_ScaledInputConv, _FunctionalConv])
def test_overridden_forwards_and_modules_without_rule_keep_autograds_gradient(layer, derived):
    torch.manual_seed(0)
    second = _ScaledInputConv(4, 4, 3, stride=2) if layer is _ScaledInputConv else layer()
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), second, nn.Flatten())
    model = nn.Sequential(*model, nn.Linear(16, 3)).to(DTYPE)
    x, y = data()
    expected = plain_grads(model, x, y)
    extend(model)
    with backpack(BatchGrad()):
        nn.functional.cross_entropy(model(x), y).backward()
    assert ids(derived) == ids(model[0].parameters())  # only the standard convolution
    for name, p in model.named_parameters():
        if id(p) in ids(derived):
            torch.testing.assert_close(p.grad, expected[name], **TOL)
        else:
            assert torch.equal(p.grad, expected[name])
