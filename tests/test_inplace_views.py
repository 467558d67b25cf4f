"""Module outputs that are views, modified in place afterwards (the problem table has the models).

An in-place operation on a view makes autograd route the gradient around the node that made the
view; recording replaces such outputs (see `backpack.recording._unaliased`). These tests check
what the replacement must keep: the forward's values and aliasing that users can observe.
"""

import torch
from torch import nn

from backpack import backpack, extend
from backpack.extensions import BatchGrad, DiagGGNExact


def test_linear_on_sequences_then_inplace_relu_gets_its_quantities():
    """The issue's example: every parameter gets its quantities, equal to brute force."""
    model = extend(
        nn.Sequential(
            nn.Linear(1, 6), nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(18, 4)
        ).double()
    )
    lossfunc = extend(nn.MSELoss(reduction="sum"))
    x, y = torch.randn(4, 3, 1, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    with backpack(BatchGrad(), DiagGGNExact()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        assert hasattr(p, "grad_batch") and hasattr(p, "diag_ggn_exact"), name
    expected = []
    for n in range(4):
        model.zero_grad()
        lossfunc(model(x[n : n + 1]), y[n : n + 1]).backward()
        expected.append(model[1].weight.grad.clone())
    torch.testing.assert_close(model[1].weight.grad_batch, torch.stack(expected))


def test_linear_output_is_no_copy():
    """Linear's replaced output still shares the product's memory (no copy per call)."""
    lin = extend(nn.Linear(3, 4))
    x = torch.randn(2, 5, 3, requires_grad=True)
    out = lin(x)
    assert out._base is None
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert plain._base is not None  # what torch returns: a view of the 2-D product
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


class ViewOfInput(nn.Module):
    """A parametrized module returning a view of its input (next to a use of its parameter)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        self.last = x * self.scale
        return x.view(x.shape[0], -1)


def test_views_of_inputs_keep_aliasing():
    """Writing through a returned view of the input changes the input, as without backpack."""
    module = extend(ViewOfInput())
    base = torch.randn(3, 2, 2, requires_grad=True)
    x = base * 1.0
    out = module(x)
    assert out._base is x
    out.mul_(2.0)
    torch.testing.assert_close(x, base.detach() * 2.0)


def test_recorded_output_values_after_inplace_ops(monkeypatch):
    """`module.output` (read by extension hooks) shows the call's output, not its later change."""
    from backpack import recording

    monkeypatch.setattr(recording, "SHAPE_ONLY_MIN_ELEMENTS", 2**30)  # records keep values
    lin = extend(nn.Linear(3, 4).double())
    model = nn.Sequential(lin, nn.ReLU(inplace=True), nn.Linear(4, 2).double())
    extend(model)
    x = torch.randn(5, 3, dtype=torch.float64)
    seen = {}

    def hook(module):
        if module is lin:
            seen["output"] = module.output.clone()

    with backpack(BatchGrad(), extension_hook=hook):
        model(x).sum().backward()
    torch.testing.assert_close(seen["output"], torch.nn.functional.linear(x, lin.weight, lin.bias))


class FrozenHead(nn.Module):
    """A model owning a (frozen) parameter that returns a view: transposed logits."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 5), nn.Tanh())
        self.head = nn.Parameter(torch.randn(5, 4, dtype=torch.float64), requires_grad=False)

    def forward(self, x):
        return (self.body(x) @ self.head).transpose(1, 2)


def test_a_call_with_frozen_parameters_keeps_its_view_output():
    """Nothing is computed for frozen parameters: their call's view output is not copied (a
    GPT's transposed logits), and its submodules still get their quantities, in-place ops on
    the output included."""
    model = extend(FrozenHead().double())
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    x, y = torch.randn(2, 6, 3, dtype=torch.float64), torch.randint(0, 4, (2, 6))
    out = model(x)
    assert out._base is not None  # no copy
    model.head.requires_grad_(True)
    assert model(x)._base is None  # a trained parameter: the view is replaced
    model.head.requires_grad_(False)
    for inplace in (False, True):
        out = model(x)
        if inplace:
            out.mul_(1.5)
        with backpack(BatchGrad()):
            lossfunc(out, y).backward()
        for n in range(2):
            model.zero_grad()
            single = model(x[n : n + 1])
            lossfunc(single * 1.5 if inplace else single, y[n : n + 1]).backward()
            weight = model.body[0].weight
            torch.testing.assert_close(weight.grad_batch[n], weight.grad)
