"""Module paths and functions that client libraries (Laplace, curvature operators, ViViT,
Cockpit) import from the original, checked against plain autograd in float64."""

import importlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import backpack.extensions as bp_extensions
from backpack import backpack, extend
from backpack.hessianfree.hvp import hessian_vector_product
from backpack.hessianfree.lop import transposed_jacobian_vector_product
from backpack.hessianfree.rop import jacobian_vector_product

DTYPE = torch.float64


def _graph():
    x = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
    w = torch.randn(4, 2, dtype=DTYPE, requires_grad=True)
    f = torch.tanh(x @ w)
    return x, w, f


def _jacobian(x, w):
    return torch.autograd.functional.jacobian(lambda a, b: torch.tanh(a @ b), (x, w))


def test_transposed_jacobian_vector_product_is_vjp():
    x, w, f = _graph()
    v = torch.randn_like(f)
    jx, jw = _jacobian(x, w)  # [3, 2, 3, 4], [3, 2, 4, 2]
    tx, tw = transposed_jacobian_vector_product(f, (x, w), v)
    torch.testing.assert_close(tx, torch.einsum("ij,ijkl->kl", v, jx))
    torch.testing.assert_close(tw, torch.einsum("ij,ijkl->kl", v, jw))
    assert not tx.requires_grad
    # graph kept by default: a second product on the same f works
    (again,) = transposed_jacobian_vector_product(f, x, v, detach=False)
    assert again.requires_grad
    torch.testing.assert_close(again.detach(), tx)


def test_jacobian_vector_product_is_jvp():
    x, w, f = _graph()
    vx, vw = torch.randn_like(x), torch.randn_like(w)
    jx, jw = _jacobian(x, w)
    (jv,) = jacobian_vector_product(f, (x, w), (vx, vw))
    expected = torch.einsum("ijkl,kl->ij", jx, vx) + torch.einsum("ijkl,kl->ij", jw, vw)
    torch.testing.assert_close(jv, expected)
    assert jv.shape == f.shape and not jv.requires_grad
    (single,) = jacobian_vector_product(f, x, vx, retain_graph=False)
    torch.testing.assert_close(single, torch.einsum("ijkl,kl->ij", jx, vx))


def test_keyword_signature_matches_clients():
    x, w, f = _graph()
    out = transposed_jacobian_vector_product(f=f, x=x, v=torch.ones_like(f), retain_graph=True)
    assert out[0].shape == x.shape
    out = jacobian_vector_product(f=f, x=x, v=torch.ones_like(x), detach=True)
    assert out[0].shape == f.shape


def test_hessian_vector_product_reuses_grad_params():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DTYPE)
    x, y = torch.randn(5, 3, dtype=DTYPE), torch.randint(0, 2, (5,))
    params = list(model.parameters())
    loss = nn.CrossEntropyLoss()(model(x), y)
    v = [torch.randn_like(p) for p in params]
    plain = hessian_vector_product(loss, params, v)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    reused = hessian_vector_product(loss, params, v, grad_params=grads)
    again = hessian_vector_product(loss, params, v, grads, detach=False)
    for a, b, c in zip(plain, reused, again, strict=True):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c.detach())
    assert all(c.requires_grad for c in again)
    # against the dense Hessian of the flattened parameters
    sizes, shapes = [p.numel() for p in params], [p.shape for p in params]
    names = [n for n, _ in model.named_parameters()]

    def loss_of(flat):
        chunks = dict(zip(names, (c.view(s) for c, s in zip(flat.split(sizes), shapes))))
        return nn.CrossEntropyLoss()(torch.func.functional_call(model, chunks, (x,)), y)

    flat = torch.cat([p.detach().flatten() for p in params])
    dense = torch.autograd.functional.hessian(loss_of, flat)
    expected = dense @ torch.cat([t.flatten() for t in v])
    torch.testing.assert_close(torch.cat([r.flatten() for r in reused]), expected)
    with pytest.raises(ValueError, match="gradients in grad_params"):
        hessian_vector_product(loss, params, v, grad_params=grads[:1])


REEXPORTS = {
    "backpack.extensions.secondorder.hbp": ["HBP", "KFAC", "KFLR", "KFRA", "LossHessianStrategy"],
    "backpack.extensions.secondorder.hbp.kfac": ["KFAC"],
    "backpack.extensions.secondorder.hbp.kflr": ["KFLR"],
    "backpack.extensions.secondorder.hbp.kfra": ["KFRA"],
    "backpack.extensions.secondorder.sqrt_ggn": ["SqrtGGNExact", "SqrtGGNMC"],
    "backpack.extensions.secondorder.diag_ggn": [
        "DiagGGNExact",
        "DiagGGNMC",
        "BatchDiagGGNExact",
        "BatchDiagGGNMC",
    ],
    "backpack.extensions.secondorder.diag_hessian": ["DiagHessian", "BatchDiagHessian"],
    "backpack.extensions.secondorder.base": ["SecondOrderBackpropExtension"],
    "backpack.extensions.curvmatprod": ["GGNMP", "HMP", "PCHMP"],
    "backpack.extensions.curvmatprod.ggnmp": ["GGNMP"],
    "backpack.extensions.curvmatprod.hmp": ["HMP"],
    "backpack.extensions.curvmatprod.pchmp": ["PCHMP"],
    "backpack.extensions.firstorder.batch_grad": ["BatchGrad"],
    "backpack.extensions.firstorder.batch_l2_grad": ["BatchL2Grad"],
    "backpack.extensions.firstorder.sum_grad_squared": ["SumGradSquared"],
    "backpack.extensions.firstorder.variance": ["Variance"],
    "backpack.extensions.firstorder.batch_dot_grad": ["BatchDotGrad"],
    "backpack.extensions.firstorder.base": ["FirstOrderModuleExtension"],
    "backpack.extensions.module_extension": ["ModuleExtension"],
    "backpack.extensions.backprop_extension": ["BackpropExtension"],
}


@pytest.mark.parametrize("module_name", sorted(REEXPORTS))
def test_original_module_paths_reexport_the_public_classes(module_name):
    module = importlib.import_module(module_name)
    for name in REEXPORTS[module_name]:
        obj = getattr(module, name)
        if hasattr(bp_extensions, name):
            assert obj is getattr(bp_extensions, name)


def test_loss_hessian_strategy_names_the_sqrt_ggn_savefields():
    from backpack.extensions.secondorder.hbp import LossHessianStrategy

    # how a client maps strategies to the attributes SqrtGGN* write
    savefields = {
        LossHessianStrategy.EXACT: bp_extensions.SqrtGGNExact().savefield,
        LossHessianStrategy.SAMPLING: bp_extensions.SqrtGGNMC().savefield,
    }
    assert savefields == {"exact": "sqrt_ggn_exact", "sampling": "sqrt_ggn_mc"}
    LossHessianStrategy.check_exists("sum")
    with pytest.raises(AttributeError, match="Unknown loss Hessian strategy"):
        LossHessianStrategy.check_exists("nope")


def test_gram_matrix_from_sqrt_ggn_in_an_extension_hook():
    """What a GGN-spectrum client does: pairwise dot products of `sqrt_ggn_exact` columns,
    accumulated over parameters in `extension_hook`, give the Gram matrix whose nonzero
    eigenvalues are those of the full GGN."""
    from backpack.extensions.secondorder.hbp import LossHessianStrategy

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3)).to(DTYPE))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(4, 3, dtype=DTYPE), torch.randint(0, 3, (4,))
    savefield = {LossHessianStrategy.EXACT: "sqrt_ggn_exact"}[LossHessianStrategy.EXACT]
    gram = []

    def hook(module):
        for p in module.parameters(recurse=False):
            flat = getattr(p, savefield).flatten(start_dim=2)  # [C, N, P]
            gram.append(torch.einsum("cnp,dmp->cndm", flat, flat))

    loss = lossfunc(model(x), y)
    with backpack(bp_extensions.SqrtGGNExact(), extension_hook=hook):
        loss.backward()
    gram_mat = sum(gram).reshape(12, 12)
    # dense GGN of all parameters
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    sizes, shapes = [p.numel() for p in params], [p.shape for p in params]

    def out_of(flat):
        chunks = dict(zip(names, (c.view(s) for c, s in zip(flat.split(sizes), shapes))))
        return torch.func.functional_call(model, chunks, (x,))

    flat = torch.cat([p.detach().flatten() for p in params])
    jac = torch.autograd.functional.jacobian(out_of, flat)  # [N, C, P]
    out = out_of(flat).detach()
    probs = out.softmax(1)
    h = (torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]) / 4
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, h, jac)
    top_gram = torch.linalg.eigvalsh(gram_mat)[-6:]
    top_ggn = torch.linalg.eigvalsh(ggn)[-6:]
    torch.testing.assert_close(top_gram, top_ggn, atol=1e-10, rtol=1e-8)


def test_products_do_not_emit_torch_jit_deprecation_warnings():
    """`p.ggnmp(M)` uses forward-mode derivatives; torch's first one compiles decompositions
    with the deprecated `torch.jit.script`. Checked in a fresh interpreter, where that first
    time has not happened yet."""
    code = """
import warnings
warnings.simplefilter("error")
import torch
from torch import nn
from backpack import backpack, extend
from backpack.extensions import GGNMP, HMP
model = extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
lossfunc = extend(nn.CrossEntropyLoss())
loss = lossfunc(model(torch.randn(5, 3)), torch.randint(0, 2, (5,)))
with backpack(GGNMP(), HMP()):
    loss.backward()
p = model[0].weight
print(p.ggnmp(torch.randn(2, *p.shape)).shape, p.hmp(torch.randn(2, *p.shape)).shape)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "torch.Size([2, 4, 3])" in result.stdout
