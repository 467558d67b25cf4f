"""Names that client libraries built on the original import, beyond the user documentation.

See the last section of CONVENTIONS.md. Numbers are checked against plain autograd in float64.
"""

import gc

import pytest
import torch
from problems import reference_per_sample_grads
from torch import nn

import backpack.extensions as bp_extensions
from backpack import backpack, extend, memory_cleanup
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.recording import live_records

DTYPE = torch.float64


def mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE)


def data(n=6):
    return torch.randn(n, 4, dtype=DTYPE), torch.randint(0, 3, (n,))


def assert_grad_batch(model, x, y):
    ref = reference_per_sample_grads(model, x, nn.CrossEntropyLoss(), y)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad_batch, ref[name], msg=name)


# --------------------------------------------------------------------------------------------
# memory_cleanup
# --------------------------------------------------------------------------------------------
def test_memory_cleanup_without_records():
    model = extend(mlp())
    for module in [model, *model]:
        memory_cleanup(module)  # nothing recorded yet
    memory_cleanup(nn.Linear(2, 2))  # never extended
    x, y = data()
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(bp_extensions.BatchGrad()):
        loss.backward()
    for module in model:
        memory_cleanup(module)  # after a backward that already freed everything
    assert_grad_batch(model, x, y)


def test_memory_cleanup_frees_records():
    model = extend(mlp())
    x, _ = data()
    out = model(x)
    assert all(len(live_records(m)) == 1 for m in model)
    for module in model:
        memory_cleanup(module)
    assert all(live_records(m) == [] for m in model)
    # plain autograd is not affected
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # the next forward records again
    model.zero_grad()
    x2, y2 = data()
    loss = nn.CrossEntropyLoss()(model(x2), y2)
    with backpack(bp_extensions.BatchGrad()):
        loss.backward()
    assert_grad_batch(model, x2, y2)


def test_memory_cleanup_removes_hook_io_attributes():
    model = extend(mlp())
    model[0].input0 = torch.zeros(1)
    model[0].output = torch.zeros(1)
    memory_cleanup(model[0])
    assert not hasattr(model[0], "input0") and not hasattr(model[0], "output")


# --------------------------------------------------------------------------------------------
# CTX.remove_hooks and re-extending
# --------------------------------------------------------------------------------------------
# the forgotten-extend warning (asserted in test_engine_training_loops): the hooks are removed
@pytest.mark.filterwarnings("ignore:.*saw no extended module take part:UserWarning")
def test_remove_hooks_then_reextend():
    from backpack.context import CTX

    model = extend(mlp())
    x, y = data()
    CTX.remove_hooks()
    # behaves as never extended
    out = model(x)
    assert all(live_records(m) == [] for m in model)
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    loss = nn.CrossEntropyLoss()(out, y)
    with backpack(bp_extensions.BatchGrad(), bp_extensions.BatchL2Grad()):
        loss.backward()
    for param in model.parameters():
        assert not hasattr(param, "grad_batch") and not hasattr(param, "batch_l2")
        assert param.grad is not None
    # clients mark modules as un-extended, then extend again
    for module in model.modules():
        module._backpack_extend = False
    assert extend(model) is model
    assert all(len(m._forward_hooks) == 1 for m in model)
    loss = nn.CrossEntropyLoss()(model(x), y)
    with backpack(bp_extensions.BatchGrad()):
        loss.backward()
    assert_grad_batch(model, x, y)


def test_remove_hooks_drops_pending_records_harmlessly():
    """Hooks removed between forward and backward: the backward still works, nothing leaks."""
    from backpack.context import CTX

    model = extend(mlp())
    x, y = data()
    loss = nn.CrossEntropyLoss()(model(x), y)
    CTX.remove_hooks()
    with backpack(bp_extensions.BatchGrad()):
        loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    if all(hasattr(p, "grad_batch") for p in model.parameters()):
        assert_grad_batch(model, x, y)  # if computed at all, it is right
    del loss
    gc.collect()
    assert all(live_records(m) == [] for m in model)


# --------------------------------------------------------------------------------------------
# BackpropExtension
# --------------------------------------------------------------------------------------------
FIRST_ORDER_NAMES = ["BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance", "BatchDotGrad"]
SECOND_ORDER_NAMES = [
    "DiagGGNExact",
    "DiagGGNMC",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "BatchJacobian",
    "DiagHessian",
    "BatchDiagHessian",
    "KFAC",
    "KFLR",
    "KFRA",
    "HMP",
    "GGNMP",
    "PCHMP",
]
SAVEFIELDS = {
    "BatchGrad": "grad_batch",
    "BatchL2Grad": "batch_l2",
    "SumGradSquared": "sum_grad_squared",
    "Variance": "variance",
    "BatchDotGrad": "batch_dot",
    "DiagGGNExact": "diag_ggn_exact",
    "DiagGGNMC": "diag_ggn_mc",
    "BatchDiagGGNExact": "diag_ggn_exact_batch",
    "BatchDiagGGNMC": "diag_ggn_mc_batch",
    "SqrtGGNExact": "sqrt_ggn_exact",
    "SqrtGGNMC": "sqrt_ggn_mc",
    "BatchJacobian": "jac_batch",
    "DiagHessian": "diag_h",
    "BatchDiagHessian": "diag_h_batch",
    "KFAC": "kfac",
    "KFLR": "kflr",
    "KFRA": "kfra",
    "HMP": "hmp",
    "GGNMP": "ggnmp",
    "PCHMP": "pchmp",
}


@pytest.mark.parametrize("name", FIRST_ORDER_NAMES + SECOND_ORDER_NAMES)
def test_every_extension_is_a_backprop_extension(name):
    if name in SECOND_ORDER_NAMES and not hasattr(bp_extensions, name):
        pytest.skip(f"{name} not implemented yet")
    cls = getattr(bp_extensions, name)
    ext = cls()
    assert isinstance(ext, BackpropExtension)
    assert issubclass(cls, BackpropExtension)
    assert ext.savefield == SAVEFIELDS[name]
    assert bp_extensions.BackpropExtension is BackpropExtension


# --------------------------------------------------------------------------------------------
# hessian_vector_product, weight_jac_t_save_memory, vector_to_parameter_list
# --------------------------------------------------------------------------------------------
def _full_hessian(f_of_flat, flat):
    return torch.autograd.functional.hessian(f_of_flat, flat)


def test_hessian_vector_product():
    hvp_mod = pytest.importorskip("backpack.hessianfree.hvp")
    model = mlp()
    x, y = data()
    params = list(model.parameters())
    v = [torch.randn_like(p) for p in params]
    loss = nn.CrossEntropyLoss()(model(x), y)
    hv = hvp_mod.hessian_vector_product(loss, params, v)
    assert len(hv) == len(params)

    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]
    names = [n for n, _ in model.named_parameters()]

    def loss_of(flat):
        chunks = torch.split(flat, sizes)
        new = {n: c.view(s) for n, c, s in zip(names, chunks, shapes, strict=True)}
        out = torch.func.functional_call(model, new, (x,))
        return nn.CrossEntropyLoss()(out, y)

    flat = torch.cat([p.detach().flatten() for p in params])
    hessian = _full_hessian(loss_of, flat)
    expected = hessian @ torch.cat([t.flatten() for t in v])
    torch.testing.assert_close(torch.cat([h.flatten() for h in hv]), expected)
    assert all(not h.requires_grad for h in hv)
    for h, p in zip(hv, params, strict=True):
        assert h.shape == p.shape


def test_weight_jac_t_save_memory_same_numbers():
    convnd = pytest.importorskip("backpack.core.derivatives.convnd")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, kernel_size=3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 3)
    ).to(DTYPE)
    extend(model)
    x = torch.randn(4, 2, 4, 4, dtype=DTYPE)
    y = torch.randint(0, 3, (4,))
    results = {}
    for save_memory in (False, True):
        model.zero_grad()
        loss = nn.CrossEntropyLoss()(model(x), y)
        with convnd.weight_jac_t_save_memory(save_memory=save_memory):
            with backpack(bp_extensions.BatchGrad(), bp_extensions.BatchL2Grad()):
                loss.backward()
        results[save_memory] = {
            name: (p.grad_batch.clone(), p.batch_l2.clone()) for name, p in model.named_parameters()
        }
    ref = reference_per_sample_grads(model, x, nn.CrossEntropyLoss(), y)
    for name in ref:
        for save_memory in (False, True):
            grad_batch, batch_l2 = results[save_memory][name]
            torch.testing.assert_close(grad_batch, ref[name], msg=name)
            torch.testing.assert_close(batch_l2, ref[name].flatten(1).square().sum(1), msg=name)
    # positional use, as clients write it, and nesting restores the outer choice
    with convnd.weight_jac_t_save_memory(True):
        with convnd.weight_jac_t_save_memory(False):
            pass


def test_vector_to_parameter_list():
    cp = pytest.importorskip("backpack.utils.convert_parameters")
    model = mlp()
    params = list(model.parameters())
    vec = torch.arange(sum(p.numel() for p in params), dtype=DTYPE)
    chunks = cp.vector_to_parameter_list(vec, params)
    assert [c.shape for c in chunks] == [p.shape for p in params]
    torch.testing.assert_close(torch.cat([c.flatten() for c in chunks]), vec)
    torch.testing.assert_close(
        torch.cat([c.flatten() for c in chunks]),
        torch.nn.utils.parameters_to_vector(chunks),
    )
    with pytest.raises((ValueError, RuntimeError)):
        cp.vector_to_parameter_list(vec[:-1], params)
