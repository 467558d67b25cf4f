"""Every first-order extension on every problem of the table, against brute-force autograd."""

import pytest
import torch
from problems import (
    assert_same_grad,
    first_order_reference,
    problems_with,
    reference_per_sample_grads,
)

from backpack import backpack, extend
from backpack.extensions import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance

#: expected warnings: problems of the table whose layers have no rule use the torch.func
#: fallback (it warns once per layer class), and torch's vmap notices missing batching rules
pytestmark = [
    pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:There is a performance drop because we have not yet implemented the batching "
        "rule:UserWarning"
    ),
]

PROBLEMS = problems_with("first")
EXTENSIONS = {
    "grad_batch": BatchGrad,
    "batch_l2": BatchL2Grad,
    "sum_grad_squared": SumGradSquared,
    "variance": Variance,
    "batch_dot": BatchDotGrad,
}


def _run(problem, *exts):
    model, x, lossfunc, y = problem.build()
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    model.zero_grad()
    plain = {k: g.clone() for k, g in _grads(model, x, lossfunc, y).items()}
    model.zero_grad()
    extend(model)
    loss = lossfunc(model(x), y)
    with backpack(*exts):
        loss.backward()
    return model, reference, plain


def _grads(model, x, lossfunc, y):
    lossfunc(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.id for p in PROBLEMS])
@pytest.mark.parametrize("quantity", list(EXTENSIONS))
def test_quantity_matches_autograd(problem, quantity):
    model, reference, plain = _run(problem, EXTENSIONS[quantity]())
    for name, param in model.named_parameters():
        expected = first_order_reference(reference[name], quantity)
        result = getattr(param, quantity)
        assert result.shape == expected.shape, name
        torch.testing.assert_close(result, expected, rtol=1e-7, atol=1e-10, msg=name)
        # the plain gradient is untouched by the extension (first-order extensions alone may sum
        # it from per-sample gradients: the same up to rounding)
        assert_same_grad(param.grad, plain[name], summed_from_samples=True)


@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.id for p in PROBLEMS])
def test_all_extensions_at_once_and_subsampling(problem):
    subsampling = [2, 0, 2]
    model, reference, _ = _run(
        problem,
        BatchL2Grad(),
        SumGradSquared(),
        Variance(),
        BatchDotGrad(),
        BatchGrad(subsampling=subsampling),
    )
    for name, param in model.named_parameters():
        for quantity in EXTENSIONS:
            expected = first_order_reference(reference[name], quantity, subsampling)
            torch.testing.assert_close(getattr(param, quantity), expected, msg=f"{name} {quantity}")
