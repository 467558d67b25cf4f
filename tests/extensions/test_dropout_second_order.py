"""Dropout in train mode: backpack's quantities must use the mask the forward pass sampled.

The reference replaces the Dropout by multiplication with the realised mask (recovered with a
forward hook during the very forward pass backpack differentiates) and computes per-sample
gradients and GGN blocks by brute force.
"""

import pytest
import torch
from problems import DTYPE, reference_per_sample_grads
from second_order_reference import Curvature
from torch import nn

from backpack import backpack, extend
from backpack.extensions import GGNMP, BatchDiagGGNExact, BatchGrad, DiagGGNExact, DiagHessian

P = 0.4


class FixedMask(nn.Module):
    """Multiplication by a fixed tensor (the realised dropout multiplier)."""

    def __init__(self, multiplier):
        super().__init__()
        self.register_buffer("multiplier", multiplier)

    def forward(self, x):
        return x * self.multiplier


def make_model():
    return nn.Sequential(nn.Linear(5, 8), nn.Dropout(p=P), nn.Linear(8, 3)).to(DTYPE).train()


def reference_model(model, mask):
    ref = nn.Sequential(nn.Linear(5, 8), FixedMask(mask / (1 - P)), nn.Linear(8, 3)).to(DTYPE)
    ref.load_state_dict(model.state_dict(), strict=False)
    return ref


LOSSES = {
    "ce-mean": (nn.CrossEntropyLoss, lambda n: torch.randint(0, 3, (n,))),
    "mse-sum": (lambda: nn.MSELoss(reduction="sum"), lambda n: torch.randn(n, 3, dtype=DTYPE)),
}


def run_with_mask(loss_name, *extensions):
    """One forward in train mode (hooked to recover the mask) and one backward under backpack."""
    make_loss, make_target = LOSSES[loss_name]
    torch.manual_seed(0)
    model = extend(make_model())
    lossfunc = extend(make_loss())
    x = torch.randn(6, 5, dtype=DTYPE)
    y = make_target(6)
    seen = {}

    def hook(module, inputs, output):
        z = inputs[0].detach()
        assert (z != 0).all()  # so the mask is recoverable everywhere
        seen["mask"] = output.detach() / (z / (1 - module.p))

    model[1].register_forward_hook(hook)
    torch.manual_seed(123)
    loss = lossfunc(model(x), y)
    with backpack(*extensions):
        loss.backward()
    mask = seen["mask"]
    torch.testing.assert_close(mask, mask.round())  # entries are 0 or 1
    assert 0 < mask.sum() < mask.numel()  # the mask really drops some units
    return model, x, lossfunc, y, mask.round()


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_batch_grad_uses_forward_mask(loss_name):
    model, x, lossfunc, y, mask = run_with_mask(loss_name, BatchGrad())
    expected = reference_per_sample_grads(reference_model(model, mask), x, lossfunc, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, expected[name], rtol=1e-7, atol=1e-10, msg=name)
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, msg=name)
    # the first layer's units dropped in a sample get no gradient from that sample
    dropped = (mask == 0).unsqueeze(2).expand_as(model[0].weight.grad_batch)
    assert (model[0].weight.grad_batch[dropped] == 0).all()


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_diag_ggn_uses_forward_mask(loss_name):
    model, x, lossfunc, y, mask = run_with_mask(
        loss_name, DiagGGNExact(), BatchDiagGGNExact(), GGNMP(), DiagHessian()
    )
    ref = Curvature(reference_model(model, mask), x, lossfunc, y, hessian=True, per_sample=False)
    for name, p in model.named_parameters():
        close = dict(rtol=1e-6, atol=1e-9, msg=name)
        torch.testing.assert_close(p.diag_ggn_exact, ref.diag(ref.ggn, name), **close)
        torch.testing.assert_close(
            p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), **close
        )
        mat = torch.randn(2, *p.shape, dtype=DTYPE)
        expected = (ref.block(ref.ggn, name) @ mat.flatten(1).T).T.reshape(mat.shape)
        torch.testing.assert_close(p.ggnmp(mat), expected, **close)
        torch.testing.assert_close(p.diag_h, ref.diag(ref.hessian, name), **close)
    # the dropout changed the result: without it (eval mode) the diagonal differs
    ref_eval = Curvature(model.eval(), x, lossfunc, y, hessian=False, per_sample=False)
    assert not torch.allclose(model[0].weight.diag_ggn_exact, ref.diag(ref_eval.ggn, "0.weight"))
