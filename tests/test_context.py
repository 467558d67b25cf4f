"""Per-thread engine state and the hook registry of `backpack.context`."""

import gc
import threading
import weakref

import pytest
import torch
from thread_checks import assert_threads_reproduce
from torch import nn

from backpack import backpack, extend
from backpack.context import CTX
from backpack.extensions import (
    KFLR,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SqrtGGNExact,
    Variance,
)

DTYPE = torch.float64
EXTENSIONS = [
    lambda: [BatchGrad()],
    lambda: [Variance(), BatchL2Grad()],
    lambda: [DiagGGNExact(), KFLR(), DiagHessian(), SqrtGGNExact()],
]
FIELDS = ["grad_batch", "variance", "batch_l2", "diag_ggn_exact", "kflr", "diag_h"]
FIELDS.append("sqrt_ggn_exact")


def _setup(seed):
    torch.manual_seed(seed)
    model = extend(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(8, 6, dtype=DTYPE), torch.randint(0, 3, (8,))
    return model, lossfunc, x, y


def _step(setup, exts):
    model, lossfunc, x, y = setup
    model.zero_grad()
    loss = lossfunc(model(x), y)
    with backpack(*exts()):
        loss.backward()
    values = {}
    for name, p in model.named_parameters():
        values[(name, "grad")] = p.grad.clone()
        for field in FIELDS:
            if hasattr(p, field):
                value = getattr(p, field)
                values[(name, field)] = torch.cat([v.flatten() for v in value]).clone() if (
                    isinstance(value, list)
                ) else value.clone()
    return values


def test_three_threads_thirty_passes_match_single_threaded_results():
    # models and data are built up front: the global RNG is not thread-safe
    setups = [_setup(i) for i in range(3)]
    assert_threads_reproduce(lambda i: _step(setups[i], EXTENSIONS[i]), 3, 30)
    assert CTX.engines == []


@pytest.mark.filterwarnings("ignore:.*saw no extended module take part:UserWarning")
def test_contexts_are_per_thread():
    seen = {}

    def worker():
        seen["worker"] = list(CTX.engines)

    with backpack(BatchGrad()):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert len(CTX.engines) == 1
    assert seen["worker"] == []


def test_dropped_models_leave_nothing_behind():
    def make():
        model = extend(nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1)))
        with backpack(BatchGrad()):
            model(torch.randn(4, 3)).sum().backward()
        handles = [weakref.ref(h) for m, h in CTX._hooked.items() if m in list(model.modules())]
        return weakref.ref(model), weakref.ref(model[0].weight), handles

    model_ref, weight_ref, handles = make()
    gc.collect()
    assert len(handles) == 3
    assert model_ref() is None and weight_ref() is None
    assert all(h() is None for h in handles)


def test_remove_hooks_allows_extending_again():
    model = extend(nn.Linear(3, 2))
    CTX.remove_hooks()
    assert not getattr(model, "_backpack_extend", False)
    extend(model)
    with backpack(BatchGrad()):
        model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad_batch.shape == (4, 2, 3)
