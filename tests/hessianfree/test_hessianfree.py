"""backpack.hessianfree: matrix-free products against dense torch.func references (float64)."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from backpack.hessianfree import (
    L_op,
    R_op,
    ggn_vector_product,
    ggn_vector_product_from_plist,
    hessian_vector_product,
)
from backpack.hessianfree.ggnvp import ggn_vector_product as ggnvp_direct
from backpack.hessianfree.hvp import hessian_vector_product as hvp_direct
from backpack.utils.convert_parameters import vector_to_parameter_list

DT = torch.float64


def make_problem(loss_name="ce"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3), nn.Sigmoid()).to(DT)
    x = torch.randn(5, 3, dtype=DT)
    if loss_name == "ce":
        lossfunc = nn.CrossEntropyLoss()
        y = torch.randint(0, 3, (5,))
    else:
        lossfunc = nn.MSELoss(reduction="sum")
        y = torch.randn(5, 3, dtype=DT)
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def unflatten(vec):
        return dict(zip(names, vector_to_parameter_list(vec, [torch.empty(s) for s in shapes])))

    def f(vec):
        return functional_call(model, unflatten(vec), (x,))

    return model, x, lossfunc, y, flat, f


def flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


def rand_like_params(model):
    return [torch.randn_like(p) for p in model.parameters()]


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)


def test_l_op_matches_jacobian_transpose():
    model, x, _, _, vec, f = make_problem()
    out = model(x)
    w = torch.randn_like(out)
    result = L_op(out, list(model.parameters()), w)
    assert isinstance(result, tuple) and len(result) == 4
    assert all(not r.requires_grad for r in result)
    assert [r.shape for r in result] == [p.shape for p in model.parameters()]
    jac = jacrev(f)(vec).reshape(out.numel(), -1)
    close(flat(result), jac.T @ w.flatten())
    # the graph is kept: a second product over the same forward works
    again = L_op(out, list(model.parameters()), 2 * w)
    close(flat(again), 2 * flat(result))


def test_l_op_several_outputs_and_inputs():
    torch.manual_seed(1)
    a = torch.randn(3, dtype=DT, requires_grad=True)
    b = torch.randn(2, 3, dtype=DT, requires_grad=True)
    unused = torch.randn(4, dtype=DT, requires_grad=True)
    y1 = torch.sin(b @ a)
    y2 = (a * b).exp().sum(0)
    w1, w2 = torch.randn_like(y1), torch.randn_like(y2)
    ga, gb, gu = L_op((y1, y2), [a, b, unused], (w1, w2))

    def ys(a_, b_):
        return torch.cat([torch.sin(b_ @ a_), (a_ * b_).exp().sum(0)])

    ja, jb = jacrev(ys, argnums=(0, 1))(a.detach(), b.detach())
    w = torch.cat([w1, w2])
    close(ga, ja.T @ w)
    close(gb, torch.einsum("o,oij->ij", w, jb))
    close(gu, torch.zeros(4, dtype=DT))


def test_l_op_without_detach_is_differentiable():
    x = torch.tensor([0.3, -1.2], dtype=DT, requires_grad=True)
    y = x**3
    (g,) = L_op(y, x, torch.ones_like(y), detach=False)
    assert g.requires_grad
    (h,) = torch.autograd.grad(g.sum(), x)
    close(h, 6 * x.detach())


def test_r_op_matches_jacobian():
    model, x, _, _, vec, f = make_problem()
    out = model(x)
    v = rand_like_params(model)
    (jv,) = R_op(out, list(model.parameters()), v)
    assert jv.shape == out.shape and not jv.requires_grad
    jac = jacrev(f)(vec).reshape(out.numel(), -1)
    close(jv.flatten(), jac @ flat(v))
    # against forward-mode autograd too
    _, ref = torch.func.jvp(f, (vec,), (flat(v),))
    close(jv, ref)


def test_r_op_several_outputs_and_unused_input():
    torch.manual_seed(2)
    a = torch.randn(3, dtype=DT, requires_grad=True)
    b = torch.randn(3, dtype=DT, requires_grad=True)
    c = torch.randn(2, dtype=DT, requires_grad=True)
    y1 = torch.tanh(a * b)
    y2 = (a**2).sum().reshape(1)
    y3 = c.detach() * 2  # constant output: its J v is zero
    va, vb, vc = torch.randn(3, dtype=DT), torch.randn(3, dtype=DT), torch.randn(2, dtype=DT)
    r1, r2, r3 = R_op([y1, y2, y3], [a, b, c], [va, vb, vc])
    _, (t1, t2) = torch.func.jvp(
        lambda a_, b_: (torch.tanh(a_ * b_), (a_**2).sum().reshape(1)),
        (a.detach(), b.detach()),
        (va, vb),
    )
    close(r1, t1)
    close(r2, t2)
    close(r3, torch.zeros(2, dtype=DT))


def test_r_op_input_shape_mismatch_raises():
    a = torch.randn(3, dtype=DT, requires_grad=True)
    with pytest.raises(ValueError, match="shape"):
        R_op(a * 2, a, torch.randn(4, dtype=DT))


@pytest.mark.parametrize("loss_name", ["ce", "mse"])
def test_hessian_vector_product_matches_hessian(loss_name):
    model, x, lossfunc, y, vec, f = make_problem(loss_name)
    loss = lossfunc(model(x), y)
    v = rand_like_params(model)
    result = hessian_vector_product(loss, list(model.parameters()), v)
    assert hvp_direct is hessian_vector_product
    assert [r.shape for r in result] == [p.shape for p in model.parameters()]
    dense = hessian(lambda p: lossfunc(f(p), y))(vec)
    close(flat(result), dense @ flat(v))
    # a subset of the parameters: the corresponding diagonal block only
    first = model[0].weight
    (block_v,) = hessian_vector_product(loss, [first], [v[0]])
    n = first.numel()
    close(block_v.flatten(), dense[:n, :n] @ v[0].flatten())


def test_hessian_vector_product_of_a_plain_function():
    x = torch.tensor([0.5, -0.3, 1.1], dtype=DT, requires_grad=True)

    def fun(t):
        return (t[0] * t[1] ** 2 + torch.sin(t[2]) * t[0]).sum()

    v = torch.tensor([1.0, 2.0, -1.0], dtype=DT)
    (hv,) = hessian_vector_product(fun(x), x, v)
    close(hv, hessian(fun)(x.detach()) @ v)
    with pytest.raises(ValueError, match="scalar"):
        hessian_vector_product(x * 2, x, v)


@pytest.mark.parametrize("loss_name", ["ce", "mse"])
def test_ggn_vector_product_matches_dense_ggn(loss_name):
    model, x, lossfunc, y, vec, f = make_problem(loss_name)
    out = model(x)
    loss = lossfunc(out, y)
    v = rand_like_params(model)
    result = ggn_vector_product(loss, out, model, v)
    assert ggnvp_direct is ggn_vector_product
    assert all(not r.requires_grad for r in result)
    jac = jacrev(f)(vec).reshape(out.numel(), -1)
    out_flat = out.detach().flatten()
    h_out = hessian(lambda o: lossfunc(o.reshape(out.shape), y))(out_flat)
    ggn = jac.T @ h_out @ jac
    close(flat(result), ggn @ flat(v))
    # the same graph serves another product
    again = ggn_vector_product_from_plist(loss, out, list(model.parameters()), [2 * t for t in v])
    close(flat(again), 2 * ggn @ flat(v))


def test_ggn_vector_product_from_plist_subset_is_block():
    model, x, lossfunc, y, vec, f = make_problem("ce")
    out = model(x)
    loss = lossfunc(out, y)
    plist = [model[2].weight, model[0].bias]
    v = [torch.randn_like(p) for p in plist]
    result = ggn_vector_product_from_plist(loss, out, plist, v)
    jac = jacrev(f)(vec).reshape(out.numel(), -1)
    h_out = hessian(lambda o: lossfunc(o.reshape(out.shape), y))(out.detach().flatten())
    ggn = jac.T @ h_out @ jac
    sizes = [p.numel() for p in model.parameters()]
    offsets = torch.tensor([0, *sizes]).cumsum(0).tolist()
    index = torch.cat([torch.arange(offsets[2], offsets[3]), torch.arange(offsets[1], offsets[2])])
    close(flat(result), ggn[index][:, index] @ flat(v))
