"""The autograd behaviours the engine is built on (DESIGN.md), pinned on the installed torch."""

import torch
from torch.autograd.graph import GradientEdge


def test_node_prehook_sees_gradient_before_later_inplace_op():
    x = torch.randn(4, 3, dtype=torch.float64)
    lin = torch.nn.Linear(3, 2).double()
    y = lin(x)
    seen = []
    y.grad_fn.register_prehook(lambda grads: seen.append(grads[0].clone()))
    pre = y.detach().clone()
    y.relu_()
    (y * 3).sum().backward()
    torch.testing.assert_close(seen[0], 3.0 * (pre > 0).double())


def test_batched_grad_from_inside_a_hook_during_backward():
    x = torch.randn(5, 3, dtype=torch.float64)
    l1, l2 = torch.nn.Linear(3, 4).double(), torch.nn.Linear(4, 2).double()
    h = l1(x)
    edge = GradientEdge(h.grad_fn, h.output_nr)
    out = l2(torch.tanh(h))
    factor = torch.randn(3, *out.shape, dtype=torch.float64)
    result = []

    def hook(grad):
        (propagated,) = torch.autograd.grad(
            [out], [edge], [factor], retain_graph=True, is_grads_batched=True
        )
        result.append(propagated)

    loss = out.sum()
    loss.register_hook(hook)
    loss.backward()
    jac = (1 - torch.tanh(h.detach()) ** 2) * 1.0
    expected = (factor @ l2.weight.detach()) * jac
    torch.testing.assert_close(result[0], expected)
    assert l1.weight.grad is not None  # the main backward completed
