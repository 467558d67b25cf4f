"""Helpers shared by the rules, and which class's rule a module gets."""

import copy

import pytest
import torch
from problems import ALL_PROBLEMS
from problems.subclasses import (
    CheckedLinear,
    PaddedConv,
    PlainSubclassLinear,
    ScaledInputConv,
    SoftReLU,
)
from second_order_reference import Curvature
from torch import nn

from backpack import backpack, extend
from backpack.extensions import KFAC, KFLR, DiagHessian
from backpack.rules import find_rule, register_standard_forward
from backpack.rules.activations import find_activation_rule, is_curvature_free
from backpack.rules.base import gram, keeps_forward_of, overridden_base


def test_gram_sums_outer_products_over_all_leading_axes():
    torch.manual_seed(0)
    a = torch.randn(3, 4, 2, 5, dtype=torch.float64)
    b = torch.randn(3, 4, 2, 6, dtype=torch.float64)
    rows_a, rows_b = a.reshape(-1, 5), b.reshape(-1, 6)
    expected = sum(torch.outer(x, y) for x, y in zip(rows_a, rows_b))
    torch.testing.assert_close(gram(a, b), expected)
    torch.testing.assert_close(gram(a), sum(torch.outer(x, x) for x in rows_a))
    # non-contiguous leading axes (a transposed view) reshape to the same rows
    torch.testing.assert_close(gram(a.transpose(0, 1)), gram(a))


# --- which class's rule a subclass gets -------------------------------------------------------
def test_subclasses_keep_their_parents_rule_only_with_its_forward():
    linear_rule = find_rule(nn.Linear(2, 2))
    assert find_rule(PlainSubclassLinear(2, 2)) is linear_rule
    assert find_rule(CheckedLinear(2, 2)) is linear_rule  # declared standard
    assert find_rule(ScaledInputConv(1, 1, 1)) is None  # its own forward
    assert find_rule(PaddedConv(1, 1, 1)) is None  # its own `_conv_forward`
    assert overridden_base(ScaledInputConv(1, 1, 1)) is nn.Conv2d
    assert overridden_base(PaddedConv(1, 1, 1)) is nn.Conv1d
    assert overridden_base(PlainSubclassLinear(2, 2)) is None
    # parameter-free tables follow the same rule
    assert find_activation_rule(SoftReLU()) is None and not is_curvature_free(SoftReLU())
    assert is_curvature_free(nn.ReLU6())  # a subclass of Hardtanh keeping its forward
    assert is_curvature_free(nn.CrossEntropyLoss())  # abstract base `_Loss`: every loss


def test_a_declared_forward_covers_subclasses_that_do_not_override_it():
    class Base(nn.Linear):
        def forward(self, x):
            return super().forward(x)

    class Child(Base):
        pass

    class Override(Child):
        def forward(self, x):
            return super().forward(2 * x)

    assert not keeps_forward_of(Child, nn.Linear)
    register_standard_forward(Base)
    assert keeps_forward_of(Child, nn.Linear)
    assert find_rule(Child(2, 2)) is find_rule(nn.Linear(2, 2))
    assert not keeps_forward_of(Override, nn.Linear) and find_rule(Override(2, 2)) is None


_FALLBACK_PROBLEMS = [
    p for p in ALL_PROBLEMS if p.id.startswith("subclass-") and "kron" not in p.tags
]


def _overriding_module(model):
    return next(m for m in model.modules() if type(m).__module__ == "problems.subclasses")


@pytest.mark.parametrize("problem", _FALLBACK_PROBLEMS, ids=lambda p: p.id)
def test_hessian_extensions_refuse_overridden_forwards(problem):
    """An override hides what the layer computes: refuse, never the parent's numbers."""
    model, x, lossfunc, y = problem.build()
    extend(model)
    loss = extend(lossfunc)(model(x), y)
    with pytest.raises(NotImplementedError, match=type(_overriding_module(model)).__name__):
        with backpack(DiagHessian()):
            loss.backward()


@pytest.mark.parametrize(
    "problem", [p for p in _FALLBACK_PROBLEMS if "activation" not in p.id], ids=lambda p: p.id
)
@pytest.mark.parametrize("extension", [KFAC, KFLR])
def test_kronecker_extensions_give_overridden_forwards_their_dense_block(problem, extension):
    """No Kronecker rule applies to an override: each parameter gets its curvature block."""
    model, x, lossfunc, y = problem.build()
    reference = Curvature(copy.deepcopy(model), x, copy.deepcopy(lossfunc), y, hessian=False)
    extend(model)
    layer = _overriding_module(model)
    loss = extend(lossfunc)(model(x), y)
    with backpack(extension()):
        loss.backward()
    savefield = extension().savefield
    names = {id(p): n for n, p in model.named_parameters()}
    for p in layer.parameters():
        (block,) = getattr(p, savefield)
        if extension is KFLR:
            expected = reference.block(reference.ggn, names[id(p)])
            torch.testing.assert_close(block, expected, rtol=1e-6, atol=1e-9)
        else:
            assert block.shape == (p.numel(), p.numel())
    assert all(hasattr(p, savefield) for p in model.parameters())


class _LoggedBatchNorm(nn.BatchNorm1d):
    def forward(self, x):
        return super().forward(x)


@pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for _Logged:UserWarning")
@pytest.mark.filterwarnings("ignore:Extension saving to grad_batch does not have:UserWarning")
def test_fallback_refuses_batch_statistics_of_an_overriding_batchnorm():
    """The fallback's per-sample calls would normalise each sample alone: refused as mixing."""
    from backpack.extensions import BatchGrad, BatchL2Grad

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), _LoggedBatchNorm(4), nn.Linear(4, 2)).double())
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    with pytest.raises(NotImplementedError, match="_LoggedBatchNorm"):
        with backpack(BatchL2Grad()):
            nn.functional.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match="mixes samples"):
        with backpack(BatchGrad()):
            nn.functional.cross_entropy(model(x), y).backward()
    model.eval()  # running statistics: samples are independent, the fallback is exact
    model.zero_grad()
    with backpack(BatchL2Grad(), BatchGrad()):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    bn = model[1]
    for p in bn.parameters():
        rows = []
        for n in range(6):
            (g,) = torch.autograd.grad(
                nn.functional.cross_entropy(model(x[n : n + 1]), y[n : n + 1], reduction="sum"), p
            )
            rows.append(g)
        torch.testing.assert_close(p.grad_batch, torch.stack(rows))
