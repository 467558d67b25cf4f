"""Engine behaviour of `backpack(...)`, `extend`, `disable` and the extension-authoring API.

Every number is checked against plain autograd in float64: per-sample gradients by brute force
(one backward per sample term), `.grad` bit for bit against a never-extended copy of the model.
"""

import copy
import gc
import warnings
import weakref

import pytest
import torch
from problems import first_order_reference, per_sample_losses, reference_per_sample_grads
from torch import nn

from backpack import backpack, disable, extend
from backpack.context import CTX
from backpack.extensions import (
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SumGradSquared,
    Variance,
)
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
from backpack.recording import live_records
from backpack.rules import register_standard_forward

DTYPE = torch.float64
N, D_IN, D_HID, D_OUT = 5, 4, 6, 3

FIRST_ORDER = {
    "grad_batch": BatchGrad,
    "batch_l2": BatchL2Grad,
    "sum_grad_squared": SumGradSquared,
    "variance": Variance,
    "batch_dot": BatchDotGrad,
}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def mlp():
    """A float64 Linear-ReLU-Linear model (not extended)."""
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT)).to(DTYPE)


def batch(n=N, seed=None):
    """Random inputs and class labels."""
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(n, D_IN, dtype=DTYPE), torch.randint(0, D_OUT, (n,))


def extended_pair(make=mlp):
    """A model, extended, and a never-extended deep copy with the same parameters."""
    model = make()
    plain = copy.deepcopy(model)
    return extend(model), plain


def reference(model, x, y, lossfunc=None):
    """Brute-force per-sample gradients of every trainable parameter (by name)."""
    lossfunc = lossfunc or nn.CrossEntropyLoss()
    return reference_per_sample_grads(model, x, lossfunc, y)


def plain_grads(model, x, y, lossfunc=None):
    """`.grad` of one plain backward on a never-extended model (fresh, not accumulated)."""
    lossfunc = lossfunc or nn.CrossEntropyLoss()
    model.zero_grad(set_to_none=True)
    lossfunc(model(x), y).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_quantity(model, quantity, ref, attr=None):
    """Each parameter's `attr` (default: the quantity's name) equals its brute-force value."""
    for name, param in model.named_parameters():
        expected = first_order_reference(ref[name], quantity)
        value = getattr(param, attr or quantity)
        assert value.shape == expected.shape, (name, quantity)
        torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-12, msg=f"{name} {quantity}")


def assert_grads_exact(model, expected):
    """`.grad` of `model` is bit-identical to `expected` (plain autograd's)."""
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, expected[name]), name


def clear_quantities(model, *attrs):
    """Remove backpack attributes from every parameter."""
    for param in model.parameters():
        for attr in attrs:
            if hasattr(param, attr):
                delattr(param, attr)


def has_any(model, attr):
    """Whether any parameter of `model` carries `attr`."""
    return any(hasattr(p, attr) for p in model.parameters())


class ForwardCounter:
    """Counts calls of a module (also those the torch.func fallback makes) and stops runaways.

    The fallback legitimately reruns a module's forward once per quantity it computes. A
    fallback that re-enters itself (its own functional call recorded and backpropagated again)
    would recurse without end; the counter turns that into a quick, visible failure.
    """

    def __init__(self, module, limit=8):
        self.calls, self.limit = 0, limit
        module.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        if self.calls > self.limit:
            raise RuntimeError(f"forward of {type(module).__name__} re-entered {self.calls} times")

    def check(self):
        assert self.calls <= self.limit, (
            "the torch.func fallback re-entered the module's forward recursively"
        )


FALLBACK_RECURSION = (
    "engine bug: the torch.func fallback reruns an extended module's forward with grad enabled, "
    "which records it again; the vjp's autograd.grad then fires that record's hook, the active "
    "engine runs the fallback again, and so on without end (with subsampling the nested call "
    "fails instead and nothing is stored)"
)


@pytest.fixture(autouse=True)
def _no_leftover_engine():
    """No test may leave an active backpack context behind (or start with one)."""
    assert CTX.engines == []
    yield
    assert CTX.engines == []


# --------------------------------------------------------------------------------------------
# 1. validation of backpack(...)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ext_cls", list(FIRST_ORDER.values()))
def test_class_instead_of_instance_raises(ext_cls):
    with pytest.raises(ValueError) as info:
        backpack(ext_cls)
    message = str(info.value)
    assert "received a class instead" in message
    assert "Instantiate it before passing it to backpack" in message


@pytest.mark.parametrize("obj", [None, 3, "grad_batch", nn.Linear(2, 2), object()])
def test_non_extension_raises(obj):
    with pytest.raises(ValueError):
        backpack(obj)
    with pytest.raises(ValueError):
        backpack(BatchGrad(), obj)


def test_two_extensions_same_attribute_raise():
    with pytest.raises(ValueError, match="grad_batch"):
        backpack(BatchGrad(), BatchGrad(subsampling=[0]))
    with pytest.raises(ValueError):
        backpack(Variance(), BatchL2Grad(), Variance())


def test_validation_error_leaves_no_state():
    with pytest.raises(ValueError):
        with backpack(BatchGrad, BatchL2Grad()):
            pass  # pragma: no cover
    assert CTX.engines == []


def test_several_extensions_each_write_their_own_attribute():
    model, plain = extended_pair()
    x, y = batch()
    ref = reference(plain, x, y)
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(*(cls() for cls in FIRST_ORDER.values())):
        loss.backward()
    for quantity in FIRST_ORDER:
        assert_quantity(model, quantity, ref)
    assert_grads_exact(model, plain_grads(plain, x, y))


def test_no_context_no_quantities():
    model, plain = extended_pair()
    x, y = batch()
    nn.CrossEntropyLoss()(model(x), y).backward()
    for quantity in FIRST_ORDER:
        assert not has_any(model, quantity)
    assert_grads_exact(model, plain_grads(plain, x, y))


def test_empty_context_writes_nothing():
    model, plain = extended_pair()
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack():
        loss.backward()
    for quantity in FIRST_ORDER:
        assert not has_any(model, quantity)
    assert_grads_exact(model, plain_grads(plain, x, y))


# --------------------------------------------------------------------------------------------
# 2. overwrite, never accumulate; .grad untouched
# --------------------------------------------------------------------------------------------
def test_second_backward_overwrites_quantities():
    model, plain = extended_pair()
    lossfunc = nn.CrossEntropyLoss()
    x1, y1 = batch(seed=1)
    x2, y2 = batch(n=N + 2, seed=2)  # another batch size too
    with backpack(BatchGrad(), Variance(), BatchL2Grad()):
        lossfunc(model(x1), y1).backward()
        lossfunc(model(x2), y2).backward()
    ref2 = reference(plain, x2, y2)
    for quantity in ("grad_batch", "variance", "batch_l2"):
        assert_quantity(model, quantity, ref2)
    # .grad accumulates as in plain PyTorch
    g1, g2 = plain_grads(plain, x1, y1), plain_grads(plain, x2, y2)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, g1[name] + g2[name], rtol=1e-14, atol=0)


def test_zero_grad_keeps_quantities():
    model, plain = extended_pair()
    x, y = batch()
    with backpack(BatchGrad(), SumGradSquared()):
        nn.CrossEntropyLoss()(model(x), y).backward()
    model.zero_grad()
    ref = reference(plain, x, y)
    assert_quantity(model, "grad_batch", ref)
    assert_quantity(model, "sum_grad_squared", ref)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_plain_backward_leaves_stale_quantities():
    model, plain = extended_pair()
    lossfunc = nn.CrossEntropyLoss()
    x1, y1 = batch(seed=1)
    x2, y2 = batch(seed=2)
    with backpack(BatchGrad(), BatchDotGrad()):
        lossfunc(model(x1), y1).backward()
    stale = {name: p.grad_batch for name, p in model.named_parameters()}
    model.zero_grad()
    lossfunc(model(x2), y2).backward()  # outside backpack
    ref1 = reference(plain, x1, y1)
    assert_quantity(model, "grad_batch", ref1)
    assert_quantity(model, "batch_dot", ref1)
    for name, param in model.named_parameters():
        assert param.grad_batch is stale[name]
    assert_grads_exact(model, plain_grads(plain, x2, y2))


@pytest.mark.parametrize("quantity", list(FIRST_ORDER))
def test_grad_bit_identical_with_and_without_extension(quantity):
    model, plain = extended_pair()
    x, y = batch()
    expected = plain_grads(plain, x, y)
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(FIRST_ORDER[quantity]()):
        loss.backward()
    assert_grads_exact(model, expected)
    assert_quantity(model, quantity, reference(plain, x, y))


@pytest.mark.parametrize("quantity", list(FIRST_ORDER))
def test_parameter_used_outside_extended_modules_warns_and_covers_extended_uses(quantity):
    """A regulariser on a weight: warn; the quantities are those of the extended calls alone."""
    model, plain = extended_pair()
    x, y = batch(seed=3)
    weight = model[0].weight
    loss = nn.CrossEntropyLoss()(model(x), y) + 0.3 * weight.square().sum()
    with pytest.warns(UserWarning, match="outside extended modules"), backpack(
        FIRST_ORDER[quantity]()
    ):
        loss.backward()
    assert_quantity(model, quantity, reference(plain, x, y))


@pytest.mark.cpu_only  # on GPUs Variance takes the rule's sum instead (see the next test)
def test_coverage_check_schedule_and_variance_always_checked(monkeypatch):
    """Checks run on a parameter's first passes and every 16th; with Variance on every pass."""
    import backpack.passes.first_order as engine_module

    # the test's layers are small: make Variance wait for autograd's sum as on large ones
    monkeypatch.setattr(engine_module, "VARIANCE_WAIT_MIN_WORK", 0)
    model, plain = extended_pair()
    x, y = batch(seed=5)

    def step(ext, regularise):
        loss = nn.CrossEntropyLoss()(model(x), y)
        if regularise:
            loss = loss + 0.3 * model[0].weight.square().sum()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with backpack(ext):
                loss.backward()
        return any("outside extended modules" in str(w.message) for w in caught)

    for _ in range(4):  # checked passes, nothing to report
        assert not step(BatchL2Grad(), False)
    assert not step(BatchL2Grad(), True)  # 5th pass: skipped (cheap), no warning
    # Variance takes the gradient sum from the hook, so it always checks and stays exact
    assert step(Variance(), True)
    assert_quantity(model, "variance", reference(plain, x, y))


def test_variance_from_the_rules_gradient_sum_as_on_gpus(monkeypatch):
    """Off the CPU the rule computes the gradient sum: exact too, with or without other uses."""
    import backpack.passes.first_order as engine_module

    monkeypatch.setattr(engine_module, "variance_waits_for_grad", lambda param, samples: False)
    model, plain = extended_pair()
    x, y = batch(seed=6)
    for regularise in (False, True):
        loss = nn.CrossEntropyLoss()(model(x), y)
        if regularise:
            loss = loss + 0.3 * model[0].weight.square().sum()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with backpack(Variance()):
                loss.backward()
        assert_quantity(model, "variance", reference(plain, x, y))


def test_variance_without_parameter_gradients():
    """autograd.grad w.r.t. the input only: parameter hooks never run, Variance is still set."""
    model, plain = extended_pair()
    x, y = batch(seed=4)
    x.requires_grad_(True)
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(Variance(), SumGradSquared()):
        (grad_x,) = torch.autograd.grad(loss, [x])
    assert grad_x.shape == x.shape
    assert_quantity(model, "variance", reference(plain, x.detach(), y))
    assert_quantity(model, "sum_grad_squared", reference(plain, x.detach(), y))


# --------------------------------------------------------------------------------------------
# 3. forward outside the context
# --------------------------------------------------------------------------------------------
def test_forward_outside_backward_inside():
    model, plain = extended_pair()
    x, y = batch()
    loss = nn.CrossEntropyLoss(reduction="sum")(model(x), y)
    with backpack(BatchGrad(), BatchL2Grad()):
        loss.backward()
    ref = reference(plain, x, y, nn.CrossEntropyLoss(reduction="sum"))
    assert_quantity(model, "grad_batch", ref)
    assert_quantity(model, "batch_l2", ref)
    assert_grads_exact(model, plain_grads(plain, x, y, nn.CrossEntropyLoss(reduction="sum")))


@pytest.mark.filterwarnings("ignore:.*saw no extended module take part:UserWarning")
def test_forward_in_one_context_backward_in_another():
    model, plain = extended_pair()
    x, y = batch()
    with backpack(BatchL2Grad()):
        loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    assert_quantity(model, "grad_batch", reference(plain, x, y))
    assert not has_any(model, "batch_l2")


# --------------------------------------------------------------------------------------------
# 4. disable()
# --------------------------------------------------------------------------------------------
def test_disable_is_active():
    assert not disable.is_active()
    with disable():
        assert disable.is_active()
        with disable():
            assert disable.is_active()
        assert disable.is_active()
    assert not disable.is_active()


def test_disable_is_reset_after_exception():
    with pytest.raises(KeyError):
        with disable():
            raise KeyError("boom")
    assert not disable.is_active()


def test_forward_under_disable_then_backpack_backward_raises():
    model, _ = extended_pair()
    x, y = batch()
    with disable():
        out = model(x)
    loss = nn.CrossEntropyLoss()(out, y)
    with backpack(BatchGrad()):
        with pytest.raises(RuntimeError, match="disable"):
            loss.backward()


def test_forward_under_disable_inside_backpack_still_fails():
    """Seed: `with backpack(...)` in a `with disable()` context fails."""
    model, _ = extended_pair()
    x, y = batch()
    with backpack(BatchGrad()):
        with disable():
            loss = nn.CrossEntropyLoss()(model(x), y)
        with pytest.raises(RuntimeError, match="disable"):
            loss.backward()


def test_forward_under_disable_plain_backward_works():
    model, plain = extended_pair()
    x, y = batch()
    with disable():
        out = model(x)
        # nothing with tensors is recorded
        assert all(not r.args for r in live_records(model[0]))
    nn.CrossEntropyLoss()(out, y).backward()
    assert_grads_exact(model, plain_grads(plain, x, y))
    assert not has_any(model, "grad_batch")


def test_after_disable_recording_resumes():
    model, plain = extended_pair()
    x, y = batch()
    with disable():
        model(x)
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    assert_quantity(model, "grad_batch", reference(plain, x, y))


# --------------------------------------------------------------------------------------------
# 5. nesting, exceptions
# --------------------------------------------------------------------------------------------
def test_nested_contexts():
    model, plain = extended_pair()
    lossfunc = nn.CrossEntropyLoss()
    (x1, y1), (x2, y2), (x3, y3) = batch(seed=1), batch(seed=2), batch(seed=3)
    with backpack(BatchGrad()):
        with backpack(BatchL2Grad()):
            lossfunc(model(x1), y1).backward()
            assert_quantity(model, "batch_l2", reference(plain, x1, y1))
            assert not has_any(model, "grad_batch")
        assert len(CTX.engines) == 1
        lossfunc(model(x2), y2).backward()
        assert_quantity(model, "grad_batch", reference(plain, x2, y2))
        # the inner quantity is stale, not recomputed
        assert_quantity(model, "batch_l2", reference(plain, x1, y1))
    assert CTX.engines == []
    clear_quantities(model, "grad_batch", "batch_l2")
    lossfunc(model(x3), y3).backward()
    assert not has_any(model, "grad_batch") and not has_any(model, "batch_l2")


def test_same_context_object_reused():
    model, plain = extended_pair()
    ctx = backpack(BatchGrad())
    for seed in (1, 2):
        x, y = batch(seed=seed)
        with ctx:
            nn.CrossEntropyLoss()(model(x), y).backward()
        assert CTX.engines == []
        assert_quantity(model, "grad_batch", reference(plain, x, y))


def test_exception_inside_context_leaves_no_state():
    model, plain = extended_pair()
    x, y = batch()
    with pytest.raises(ZeroDivisionError):
        with backpack(BatchGrad()):
            nn.CrossEntropyLoss()(model(x), y)
            raise ZeroDivisionError
    assert CTX.engines == []
    nn.CrossEntropyLoss()(model(x), y).backward()
    assert not has_any(model, "grad_batch")


def _failing_hook(module):
    if isinstance(module, nn.Linear):
        raise ValueError("hook failed on purpose")


def test_exception_in_backward_then_new_context_is_correct():
    model, plain = extended_pair()
    lossfunc = nn.CrossEntropyLoss()
    x1, y1 = batch(seed=1)
    loss = lossfunc(model(x1), y1)
    with pytest.raises(ValueError, match="on purpose"):
        with backpack(BatchGrad(), extension_hook=_failing_hook):
            loss.backward()
    assert CTX.engines == []
    del loss
    gc.collect()
    x2, y2 = batch(seed=2)
    model.zero_grad()
    loss = lossfunc(model(x2), y2)
    with backpack(BatchGrad(), Variance()):
        loss.backward()
    ref = reference(plain, x2, y2)
    assert_quantity(model, "grad_batch", ref)
    assert_quantity(model, "variance", ref)
    assert_grads_exact(model, plain_grads(plain, x2, y2))


def test_exception_in_backward_then_same_context_is_correct():
    """The failed pass must not leak into the next backward of the same context."""
    model, plain = extended_pair()
    lossfunc = nn.CrossEntropyLoss()
    calls = []

    def hook(module):
        calls.append(module)
        if len(calls) == 1:
            raise ValueError("hook failed on purpose")

    x1, y1 = batch(seed=1)
    x2, y2 = batch(seed=2)
    with backpack(BatchGrad(), BatchL2Grad(), extension_hook=hook):
        with pytest.raises(ValueError, match="on purpose"):
            lossfunc(model(x1), y1).backward()
        clear_quantities(model, "grad_batch", "batch_l2")
        calls.clear()
        calls.append(None)  # do not fail again
        lossfunc(model(x2), y2).backward()
    ref = reference(plain, x2, y2)
    assert_quantity(model, "grad_batch", ref)
    assert_quantity(model, "batch_l2", ref)
    assert len(calls) == 1 + 3  # every module of the second pass once


def test_exception_from_rule_leaves_no_state():
    """A module whose forward input was modified in place makes the backward fail cleanly."""
    model, plain = extended_pair()
    x, y = batch()
    h = torch.randn(N, D_IN, dtype=DTYPE)
    out = model[0](h)
    h.mul_(2.0)  # invalidates what Linear recorded (autograd itself does not need h)
    with backpack(BatchGrad()):
        with pytest.raises(RuntimeError, match="in place"):
            out.sum().backward()
    assert CTX.engines == []
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    assert_quantity(model, "grad_batch", reference(plain, x, y))


# --------------------------------------------------------------------------------------------
# 6. several models, no backpack, memory
# --------------------------------------------------------------------------------------------
def test_several_extended_models():
    model_a, plain_a = extended_pair()
    model_b, plain_b = extended_pair(
        lambda: nn.Sequential(nn.Linear(D_IN, 2), nn.Tanh(), nn.Linear(2, D_OUT)).to(DTYPE)
    )
    x, y = batch()
    lossfunc = nn.CrossEntropyLoss()
    with backpack(BatchGrad()):
        lossfunc(model_a(x), y).backward()
        assert not has_any(model_b, "grad_batch")
        lossfunc(model_b(x), y).backward()
    assert_quantity(model_a, "grad_batch", reference(plain_a, x, y))
    assert_quantity(model_b, "grad_batch", reference(plain_b, x, y))
    # one backward through both models at once
    clear_quantities(model_a, "grad_batch")
    clear_quantities(model_b, "grad_batch")
    with backpack(BatchGrad()):
        (lossfunc(model_a(x), y) + lossfunc(model_b(x), y)).backward()
    assert_quantity(model_a, "grad_batch", reference(plain_a, x, y))
    assert_quantity(model_b, "grad_batch", reference(plain_b, x, y))


def test_extended_model_trains_like_plain_model():
    model, plain = extended_pair()
    lossfunc = nn.CrossEntropyLoss()
    for step in range(4):
        x, y = batch(seed=10 + step)
        for m in (model, plain):
            m.zero_grad()
            lossfunc(m(x), y).backward()
        assert_grads_exact(model, {k: p.grad for k, p in plain.named_parameters()})
        with torch.no_grad():
            for m in (model, plain):
                for p in m.parameters():
                    p -= 0.1 * p.grad
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not has_any(model, "grad_batch")


def test_records_freed_after_backward_inside_backpack():
    model, _ = extended_pair()
    x, y = batch()
    out = model(x)
    loss = nn.CrossEntropyLoss()(out, y)
    recorded = {i: live_records(m) for i, m in enumerate(model)}
    assert all(len(r) == 1 for r in recorded.values())
    # inputs are recorded as they are; the first one is `x`, which this test holds
    assert recorded[0][0].args[0] is x
    aliases = [weakref.ref(r[0].args[0]) for i, r in recorded.items() if i > 0]
    del recorded
    with backpack(BatchGrad()):
        loss.backward()
    for module in model:
        assert live_records(module) == []
    gc.collect()
    # the recorded inputs are released although the graph (out, loss) still exists
    assert aliases and all(a() is None for a in aliases)


def test_records_freed_with_the_graph_without_backward():
    model, _ = extended_pair()
    x, y = batch()
    out = model(x)
    loss = nn.CrossEntropyLoss()(out, y)
    record = weakref.ref(live_records(model[0])[0])
    assert record() is not None
    del loss, out
    gc.collect()
    assert record() is None
    for module in model:
        assert live_records(module) == []


def test_records_released_by_refcounting_alone():
    """No reference cycles: records and recorded tensors go as soon as the graph goes."""
    model, _ = extended_pair()
    x, y = batch()
    gc.collect()
    gc.disable()
    try:
        out = model(x)
        record = weakref.ref(live_records(model[2])[0])
        alias = weakref.ref(live_records(model[2])[0].args[0])
        del out
        assert record() is None and alias() is None
        loss = nn.CrossEntropyLoss()(model(x), y)
        record = weakref.ref(live_records(model[0])[0])
        with backpack(BatchGrad()):
            loss.backward()
        del loss
        assert record() is None
    finally:
        gc.enable()


def test_records_freed_after_plain_backward_and_graph_drop():
    model, _ = extended_pair()
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward()
    del loss
    gc.collect()
    for module in model:
        assert live_records(module) == []


def test_forward_loop_does_not_accumulate_records():
    model, _ = extended_pair()
    x, _ = batch()
    out = None
    for _ in range(50):
        out = model(x)  # drops the previous graph
        assert len(live_records(model[0])) == 1
        assert len(live_records(model[2])) == 1
    del out
    gc.collect()
    assert live_records(model[0]) == []


def test_no_grad_forward_records_nothing():
    model, _ = extended_pair()
    x, _ = batch()
    with torch.no_grad():
        model(x)
    with torch.inference_mode():
        model(x)
    for module in model:
        assert live_records(module) == []


def test_two_live_forwards_backward_on_one():
    """Quantities come from the graph that is backpropagated, not from another live one."""
    model, plain = extended_pair()
    lossfunc = nn.CrossEntropyLoss()
    (x1, y1), (x2, y2) = batch(seed=1), batch(n=N + 1, seed=2)
    loss1 = lossfunc(model(x1), y1)
    loss2 = lossfunc(model(x2), y2)
    with backpack(BatchGrad(), BatchDotGrad()):
        loss2.backward()
    ref2 = reference(plain, x2, y2)
    assert_quantity(model, "grad_batch", ref2)
    assert_quantity(model, "batch_dot", ref2)
    with backpack(BatchGrad(), BatchDotGrad()):
        loss1.backward()
    ref1 = reference(plain, x1, y1)
    assert_quantity(model, "grad_batch", ref1)
    assert_quantity(model, "batch_dot", ref1)


# --------------------------------------------------------------------------------------------
# 7. retain_graph
# --------------------------------------------------------------------------------------------
def test_retain_graph_allows_several_backwards():
    model, plain = extended_pair()
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    ref = reference(plain, x, y)
    results = []
    with backpack(BatchGrad(), SumGradSquared(), retain_graph=True):
        for _ in range(2):
            loss.backward(retain_graph=True)
            results.append({k: p.grad_batch.clone() for k, p in model.named_parameters()})
            assert_quantity(model, "grad_batch", ref)
            assert_quantity(model, "sum_grad_squared", ref)
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name])
    # .grad accumulated twice, as plain autograd does
    g = plain_grads(plain, x, y)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, 2 * g[name], rtol=1e-14, atol=0)
    del loss
    gc.collect()
    for module in model:
        assert live_records(module) == []


def test_second_backward_without_retain_graph_raises():
    model, plain = extended_pair()
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(BatchGrad(), retain_graph=False):
        loss.backward(retain_graph=True)
        assert_quantity(model, "grad_batch", reference(plain, x, y))
        with pytest.raises(RuntimeError, match="retain_graph"):
            loss.backward(retain_graph=True)


def test_retain_graph_mixed_with_plain_backward():
    """A plain backward in between does not consume the retained records."""
    model, plain = extended_pair()
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    loss.backward(retain_graph=True)
    with backpack(BatchL2Grad(), retain_graph=True):
        loss.backward(retain_graph=True)
    assert_quantity(model, "batch_l2", reference(plain, x, y))


# --------------------------------------------------------------------------------------------
# 8. extension_hook and debug
# --------------------------------------------------------------------------------------------
def test_extension_hook_sees_quantities_input_and_output():
    model, plain = extended_pair()
    x, y = batch()
    ref = reference(plain, x, y)
    with torch.no_grad():
        hidden = model[0](x)
        expected_io = {
            0: (x, hidden),
            1: (hidden, hidden.relu()),
            2: (hidden.relu(), model[2](hidden.relu())),
        }
    index = {id(m): i for i, m in enumerate(model)}
    calls = []

    def hook(module):
        i = index[id(module)]
        calls.append(i)
        inp, out = expected_io[i]
        torch.testing.assert_close(module.input0, inp)
        torch.testing.assert_close(module.output, out)
        for pname, param in module.named_parameters():
            expected = first_order_reference(ref[f"{i}.{pname}"], "grad_batch")
            torch.testing.assert_close(param.grad_batch, expected)
            torch.testing.assert_close(param.batch_l2, expected.flatten(1).square().sum(1))

    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(BatchGrad(), BatchL2Grad(), extension_hook=hook):
        loss.backward()
    assert sorted(calls) == [0, 1, 2]
    assert calls == [2, 1, 0]  # backward order
    for module in model:
        assert not hasattr(module, "input0")
        assert not hasattr(module, "output")


def test_extension_hook_not_called_for_unused_modules_or_outside():
    model, _ = extended_pair()
    unused = extend(nn.Linear(D_IN, 2).to(DTYPE))
    x, y = batch()
    calls = []
    loss = nn.CrossEntropyLoss()(model(x), y)
    unused(x)  # recorded, but not part of the loss
    with backpack(BatchGrad(), extension_hook=calls.append):
        loss.backward()
    assert unused not in calls and len(calls) == 3
    calls.clear()
    nn.CrossEntropyLoss()(model(x), y).backward()  # no backpack: hook never called
    assert calls == []


def test_extension_hook_can_delete_quantities():
    model, plain = extended_pair()
    x, y = batch()
    ref = reference(plain, x, y)
    norms = {}

    released = []

    def compact(module):
        for pname, param in module.named_parameters():
            norms[(module, pname)] = param.grad_batch.flatten(1).norm(dim=1)
            released.append(weakref.ref(param.grad_batch))
            del param.grad_batch

    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(BatchGrad(), extension_hook=compact):
        loss.backward()
    assert not has_any(model, "grad_batch")
    assert len(released) == 4 and all(r() is None for r in released)  # nothing else holds them
    for (module, pname), value in norms.items():
        name = f"{list(model).index(module)}.{pname}"
        torch.testing.assert_close(value, ref[name].flatten(1).norm(dim=1))
    assert len(norms) == 4
    assert_grads_exact(model, plain_grads(plain, x, y))


def test_debug_prints_modules(capsys):
    model, _ = extended_pair()
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    capsys.readouterr()
    with backpack(BatchGrad(), debug=True):
        loss.backward()
    printed = capsys.readouterr().out
    assert "Linear" in printed and "ReLU" in printed


def test_no_debug_prints_nothing(capsys):
    model, _ = extended_pair()
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    capsys.readouterr()
    with backpack(BatchGrad()):
        loss.backward()
    assert capsys.readouterr().out == ""


def test_extend_debug_prints(capsys):
    extend(mlp(), debug=True)
    assert "Linear" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# 9. extend
# --------------------------------------------------------------------------------------------
def test_extend_returns_the_module_and_is_idempotent():
    model = mlp()
    assert extend(model) is model
    assert extend(model) is model
    for module in model:
        assert len(module._forward_hooks) == 1
    assert len(model._forward_hooks) == 0  # containers are not hooked
    x, _ = batch()
    out = model(x)
    for module in model:
        assert len(live_records(module)) == 1
    assert live_records(model) == []
    del out


def test_extend_twice_gives_correct_quantities():
    model, plain = extended_pair()
    extend(model)
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    assert_quantity(model, "grad_batch", reference(plain, x, y))


def test_extend_loss_function_is_harmless():
    model, plain = extended_pair()
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = batch()
    loss = lossfunc(model(x), y)
    with backpack(BatchGrad(), Variance()):
        loss.backward()
    ref = reference(plain, x, y)
    assert_quantity(model, "grad_batch", ref)
    assert_quantity(model, "variance", ref)
    assert_grads_exact(model, plain_grads(plain, x, y))


class MyLinear(nn.Linear):
    """A subclass of Linear with its own forward (calls the parent)."""

    def forward(self, x):
        return super().forward(x)


class MyDeclaredLinear(MyLinear):
    """The same, declared to compute Linear's forward."""


register_standard_forward(MyDeclaredLinear)


@pytest.mark.parametrize("declared", [False, True], ids=["own-forward", "declared-standard"])
def test_subclass_of_linear_gets_correct_quantities(declared):
    cls = MyDeclaredLinear if declared else MyLinear

    def make():
        return nn.Sequential(cls(D_IN, D_HID), nn.Tanh(), cls(D_HID, D_OUT)).to(DTYPE)

    model, plain = extended_pair(make)
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with backpack(BatchGrad(), BatchL2Grad(), BatchDotGrad()):
            loss.backward()
    messages = [str(w.message) for w in caught]
    if declared:  # the Linear rule applies, no fallback warning
        assert not messages
    else:  # an override could compute anything: the exact fallback, and how to declare it
        (message,) = messages
        assert "MyLinear (it overrides the forward of Linear" in message
        assert "backpack.rules.register_standard_forward(MyLinear)" in message
    ref = reference(plain, x, y)
    for quantity in ("grad_batch", "batch_l2", "batch_dot"):
        assert_quantity(model, quantity, ref)


def _scale_shift_model():
    class ScaleShift(nn.Module):
        """Elementwise affine map with its own parameters and no backpack rule."""

        def __init__(self, dim):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(dim))
            self.shift = nn.Parameter(torch.randn(dim))

        def forward(self, x):
            return x * self.scale + self.shift

    model = nn.Sequential(nn.Linear(D_IN, D_HID), ScaleShift(D_HID), nn.Linear(D_HID, D_OUT))
    return model.to(DTYPE), ScaleShift


def test_module_without_rule_uses_torch_func_fallback():
    model, cls = _scale_shift_model()
    plain = copy.deepcopy(model)
    extend(model)
    counter = ForwardCounter(model[1])
    lossfunc = nn.CrossEntropyLoss()
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with backpack(*(c() for c in FIRST_ORDER.values())):
            lossfunc(model(x1), y1).backward()
    counter.check()
    named = [w for w in caught if "ScaleShift" in str(w.message)]
    assert len(named) == 1 and issubclass(named[0].category, UserWarning)
    ref = reference(plain, x1, y1)
    for quantity in FIRST_ORDER:
        assert_quantity(model, quantity, ref)
    # only once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with backpack(BatchGrad()):
            lossfunc(model(x2), y2).backward()
    counter.check()
    assert not [w for w in caught if "ScaleShift" in str(w.message)]
    assert_quantity(model, "grad_batch", reference(plain, x2, y2))
    assert isinstance(model[1], cls)


def test_torch_func_fallback_with_subsampling():
    model, _ = _scale_shift_model()
    plain = copy.deepcopy(model)
    extend(model)
    counter = ForwardCounter(model[1])
    x, y = batch()
    subsampling = [3, 0, 3]
    loss = nn.CrossEntropyLoss()(model(x), y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with backpack(BatchGrad(subsampling=subsampling)):
            loss.backward()
    counter.check()
    ref = reference(plain, x, y)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad_batch, ref[name][subsampling], msg=name)


class DataDependent(nn.Module):
    """Python control flow on tensor values: torch.func cannot vmap it."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        if (x * self.weight).sum() > 0:
            return x * self.weight
        return 2 * x * self.weight


class UsesItem(nn.Module):
    """Calls `.item()` on a parameter-dependent tensor."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        factor = (x.abs().mean() * self.weight.abs().sum()).item()
        return x * self.weight * factor


class Centred(nn.Module):
    """Subtracts the batch mean: vmap runs it, one sample at a time, to another function."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        y = x * self.weight
        return y - y.mean(0)


@pytest.mark.parametrize("cls", [DataDependent, UsesItem])
def test_module_where_torch_func_fails_warns_and_writes_nothing(cls):
    """Nothing for their parameters, never a per-sample number computed from a sample alone
    that the batch would not give (the gradients reaching the other layers are unaffected)."""
    model = nn.Sequential(nn.Linear(D_IN, D_HID), cls(D_HID), nn.Linear(D_HID, D_OUT)).to(DTYPE)
    plain = copy.deepcopy(model)
    extend(model)
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with backpack(BatchGrad()):
            loss.backward()
    expected = (
        "Extension saving to grad_batch does not have an extension for Module "
        f"{cls!s} although the module has parameters"
    )
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(expected in m for m in messages), messages
    assert not hasattr(model[1].weight, "grad_batch")
    ref = reference(plain, x, y)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        torch.testing.assert_close(model.get_parameter(name).grad_batch, ref[name])
    assert_grads_exact(model, plain_grads(plain, x, y))


class ScaleThenDropout(nn.Module):
    """Dropout in training mode inside a module without a rule: a call per sample would draw
    other masks than the forward did."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x * self.weight)


@pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for:UserWarning")
@pytest.mark.parametrize("extension", [BatchL2Grad, Variance, DiagGGNExact])
def test_a_module_whose_samples_are_not_independent_is_refused(extension):
    """Subtracting the batch mean mixes samples, as BatchNorm in training mode does; vmap would
    run it on each sample alone (another function) without complaint. (`ScaleThenDropout`,
    whose samples a re-run would give new dropout masks, gets its quantities where its weight
    meets the samples instead, with the forward's own masks: see the next tests.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), Centred(D_HID), nn.Linear(D_HID, D_OUT))
    extend(model.to(DTYPE))
    x, y = batch()
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with pytest.raises(NotImplementedError, match=r"'1' \(Centred\): its samples are not"):
        with backpack(extension()):
            loss.backward()


@pytest.mark.parametrize("extension", [BatchL2Grad, Variance])
def test_dropout_inside_a_module_without_rule_uses_the_forwards_masks(extension):
    """The weight of `ScaleThenDropout` meets the samples in a product: its per-sample
    gradients are read there, from the pass's own graph, so the dropout masks are the
    forward's (no re-run per sample) and the numbers are exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), ScaleThenDropout(D_HID), nn.Linear(D_HID, D_OUT))
    model.to(DTYPE)
    x, y = batch()
    lossfunc = nn.CrossEntropyLoss()
    torch.manual_seed(1)
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    extend(model), extend(lossfunc)
    torch.manual_seed(1)  # the same masks
    with backpack(extension()):
        lossfunc(model(x), y).backward()
    quantity = extension().savefield
    for name, p in model.named_parameters():
        expected = first_order_reference(reference[name], quantity)
        torch.testing.assert_close(getattr(p, quantity), expected, msg=name)


class ScaleThenMask(nn.Module):
    """`ScaleThenDropout` with the dropout's realised multiplier as a fixed tensor."""

    def __init__(self, multiplier):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(multiplier.shape[-1], dtype=multiplier.dtype))
        self.register_buffer("multiplier", multiplier)

    def forward(self, x):
        return x * self.weight * self.multiplier


def test_dropout_inside_a_module_without_rule_curvature_uses_the_forwards_masks():
    """Second order reads the weight of `ScaleThenDropout` at its site as well: the GGN of the
    network with the forward's masks, as for `nn.Dropout` in training mode
    (tests/extensions/test_dropout_second_order.py), and no re-run per sample."""
    from second_order_reference import Curvature

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), ScaleThenDropout(D_HID), nn.Linear(D_HID, D_OUT))
    model.to(DTYPE)
    x, y = batch()
    seen = {}

    def keep_multiplier(module, inputs, output):
        seen["mult"] = output.detach() / inputs[0].detach()

    model[1].drop.register_forward_hook(keep_multiplier)
    lossfunc = extend(nn.CrossEntropyLoss())
    extend(model)
    torch.manual_seed(1)
    with backpack(DiagGGNExact(), BatchDiagGGNExact()):
        lossfunc(model(x), y).backward()
    multiplier = seen["mult"].detach()
    assert (multiplier == 0).any() and (multiplier != 0).any()  # the mask drops some units
    fixed = nn.Sequential(
        nn.Linear(D_IN, D_HID), ScaleThenMask(multiplier), nn.Linear(D_HID, D_OUT)
    )
    fixed.load_state_dict(model.state_dict(), strict=False)
    ref = Curvature(fixed.to(DTYPE), x, nn.CrossEntropyLoss(), y, hessian=False)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref.diag(ref.ggn, name), msg=name)
        expected = ref.diag(ref.ggn_per_sample, name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, expected, msg=name)


@pytest.mark.filterwarnings("ignore:Extension saving to grad_batch does not have:UserWarning")
def test_batch_grad_warns_on_a_module_whose_samples_are_not_independent():
    model = nn.Sequential(nn.Linear(D_IN, D_HID), Centred(D_HID), nn.Linear(D_HID, D_OUT))
    extend(model.to(DTYPE))
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with pytest.warns(UserWarning, match="Centred mixes samples"):
        with backpack(BatchGrad()):
            loss.backward()


def test_frozen_parameters_get_nothing():
    def make():
        model = mlp()
        model[0].weight.requires_grad_(False)
        model[2].bias.requires_grad_(False)
        return model

    model, plain = extended_pair(make)
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(*(c() for c in FIRST_ORDER.values())):
        loss.backward()
    ref = reference(plain, x, y)
    for quantity in FIRST_ORDER:
        assert not hasattr(model[0].weight, quantity)
        assert not hasattr(model[2].bias, quantity)
        for name in ("0.bias", "2.weight"):
            expected = first_order_reference(ref[name], quantity)
            torch.testing.assert_close(getattr(model.get_parameter(name), quantity), expected)


def test_fully_frozen_module_gets_nothing():
    model, plain = extended_pair()
    model[2].requires_grad_(False)
    plain[2].requires_grad_(False)
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    assert not hasattr(model[2].weight, "grad_batch")
    ref = reference(plain, x, y)
    torch.testing.assert_close(model[0].weight.grad_batch, ref["0.weight"])


def test_input_requiring_grad_and_input_gradient():
    """An input that requires grad gets the plain input gradient; quantities are unchanged."""
    model, plain = extended_pair()
    x, y = batch()
    x_ext = x.clone().requires_grad_(True)
    x_plain = x.clone().requires_grad_(True)
    loss = nn.CrossEntropyLoss()(model(x_ext), y)
    with backpack(BatchGrad()):
        loss.backward()
    nn.CrossEntropyLoss()(plain(x_plain), y).backward()
    assert torch.equal(x_ext.grad, x_plain.grad)
    assert_quantity(model, "grad_batch", reference(plain, x, y))


# --------------------------------------------------------------------------------------------
# 10. extension-authoring API
# --------------------------------------------------------------------------------------------
class MyModule(nn.Module):
    """A bias-free linear layer written by hand (no backpack rule)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in))

    def forward(self, x):
        return x @ self.weight.T


class MyExt(FirstOrderModuleExtension):
    """Per-sample gradients of MyModule's weight: outer products of g_out and the input."""

    def __init__(self, scale=1.0):
        super().__init__(params=["weight"])
        self.scale = scale
        self.calls = 0

    def weight(self, ext, module, g_inp, g_out, bpQuantities):  # noqa: N803 (original name)
        self.calls += 1
        return self.scale * torch.einsum("no,ni->noi", g_out[0], module.input0)


def _my_module_model():
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), MyModule(D_HID, D_OUT)).to(DTYPE)


def test_user_module_extension_is_used():
    model, plain = extended_pair(_my_module_model)
    x, y = batch()
    ext = BatchGrad()
    my_ext = MyExt()
    ext.set_module_extension(MyModule, my_ext)
    loss = nn.CrossEntropyLoss()(model(x), y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with backpack(ext):
            loss.backward()
    assert my_ext.calls == 1
    assert not [w for w in caught if "MyModule" in str(w.message)]  # no fallback involved
    assert_quantity(model, "grad_batch", reference(plain, x, y))
    assert_grads_exact(model, plain_grads(plain, x, y))


def test_set_module_extension_overwrite():
    ext = BatchGrad()
    first, second = MyExt(), MyExt(scale=-3.0)
    ext.set_module_extension(MyModule, first)
    with pytest.raises(ValueError):
        ext.set_module_extension(MyModule, second)
    ext.set_module_extension(MyModule, second, overwrite=True)

    model, plain = extended_pair(_my_module_model)
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(ext):
        loss.backward()
    assert first.calls == 0 and second.calls == 1
    ref = reference(plain, x, y)
    torch.testing.assert_close(model[2].weight.grad_batch, -3.0 * ref["2.weight"])
    torch.testing.assert_close(model[0].weight.grad_batch, ref["0.weight"])


def test_module_extension_only_on_its_instance():
    """Registering on one extension object does not change another of the same class."""
    with_ext = BatchGrad()
    with_ext.set_module_extension(MyModule, MyExt(scale=5.0))
    model, plain = extended_pair(_my_module_model)
    counter = ForwardCounter(model[2])
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warns for MyModule
        with backpack(BatchGrad()):
            loss.backward()
    counter.check()
    assert_quantity(model, "grad_batch", reference(plain, x, y))


def test_custom_backprop_extension():
    model, plain = extended_pair(
        lambda: nn.Sequential(
            nn.Linear(D_IN, D_HID, bias=False), nn.ReLU(), nn.Linear(D_HID, D_OUT, bias=False)
        ).to(DTYPE)
    )
    my_ext = MyExt()
    ext = BackpropExtension("my_field", {nn.Linear: my_ext})
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(ext):
        loss.backward()
    assert my_ext.calls == 2
    assert_quantity(model, "grad_batch", reference(plain, x, y), attr="my_field")
    assert not has_any(model, "grad_batch")
    assert_grads_exact(model, plain_grads(plain, x, y))


def test_custom_backprop_extension_with_builtin_extension():
    model, plain = extended_pair(
        lambda: nn.Sequential(
            nn.Linear(D_IN, D_HID, bias=False), nn.ReLU(), nn.Linear(D_HID, D_OUT, bias=False)
        ).to(DTYPE)
    )
    ext = BackpropExtension("my_field", {nn.Linear: MyExt(scale=2.0)})
    x, y = batch()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(ext, BatchGrad()):
        loss.backward()
    ref = reference(plain, x, y)
    assert_quantity(model, "grad_batch", ref)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.my_field, 2.0 * ref[name])


# --------------------------------------------------------------------------------------------
# loss reduction and shapes of the per-sample terms
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_batch_sums_to_grad(reduction):
    model, plain = extended_pair()
    x, y = batch()
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    loss = lossfunc(model(x), y)
    with backpack(BatchGrad()):
        loss.backward()
    for param in model.parameters():
        torch.testing.assert_close(param.grad_batch.sum(0), param.grad)
    terms = per_sample_losses(lossfunc, plain(x), y)
    torch.testing.assert_close(terms.sum(), loss.detach())


def test_variance_waits_for_autograds_sum_only_for_large_products():
    """Small layers compute the sum (cheaper than a check on every pass); large ones wait."""
    from backpack.passes.first_order import VARIANCE_WAIT_MIN_WORK, variance_waits_for_grad

    small, large = torch.zeros(10, 64), torch.zeros(512, 784)
    assert not variance_waits_for_grad(small, 128)
    assert not variance_waits_for_grad(torch.zeros(512), 256)  # a bias: a sum over rows
    assert variance_waits_for_grad(large, 256)
    assert 10 * 64 * 128 < VARIANCE_WAIT_MIN_WORK <= 512 * 784 * 256


def test_probe_positions_of_a_vocabulary_sized_parameter_stay_inside_it():
    """Coverage probes of a parameter with more than 2**24 entries (GPT-2's [50257, 768] token
    embedding): a float32 linspace would round the last position past the end."""
    from backpack.passes import coverage

    for numel in (50257 * 768, 2**25 + 3, 5, 1):
        param = torch.zeros(1).expand(numel)  # the shape alone, no memory
        index = coverage._probe_index(param)
        assert int(index.max()) == numel - 1 and int(index.min()) == 0
        assert index.unique().numel() == min(numel, 8)


class _KeyBiasAttention(torch.nn.Module):
    """Attention's key bias has zero gradient (softmax is shift invariant per query)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(3, 3) for _ in range(3))
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):  # x: [N, T, 3]
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        return self.head((scores.softmax(-1) @ self.v(x)).mean(1))


def test_no_coverage_warning_for_a_gradient_that_cancels_in_a_frozen_layer():
    """A key bias whose weight is frozen: nothing in its module to compare its rounding noise
    with, so the pass's other gradients are the scale (no false 'outside' warning)."""
    torch.manual_seed(0)
    model = extend(_KeyBiasAttention().double())
    model.k.weight.requires_grad_(False)
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    x, y = torch.randn(5, 4, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for _ in range(4):
            model.zero_grad()
            with backpack(BatchGrad()):
                lossfunc(model(x), y).backward()
    assert model.k.bias.grad_batch.abs().max() < 1e-12
    assert model.q.weight.grad_batch.abs().max() > 1e-3
