"""The problem table on a GPU: every deterministic quantity computed on CUDA, in float64 and in
float32, against the same quantity computed on the CPU in float64 (which the extension tests
check against brute-force autograd).

Skipped without CUDA. `BACKPACK_CUDA_CHECK_DEVICE=cpu` runs the same comparisons with the CPU
as the checked device (a dry run of this file on a machine without a GPU: `benchmarks/gpu.sh
--tiny`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from problems import ALL_PROBLEMS, Problem

from backpack import backpack, extend
from backpack.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchJacobian,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)

CHECKED = torch.device(os.environ.get("BACKPACK_CUDA_CHECK_DEVICE", "cuda"))
if CHECKED.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

#: extension groups run in one backward each, by problem tag (Monte-Carlo extensions are left
#: out: CUDA and the CPU draw different random numbers)
GROUPS = {
    "first": [BatchGrad, BatchL2Grad, SumGradSquared, Variance, BatchDotGrad],
    "second": [DiagGGNExact, BatchDiagGGNExact, SqrtGGNExact, BatchJacobian],
    "kron": [KFLR],
    "hessian": [DiagHessian],
}
CASES = [(p, tag) for p in ALL_PROBLEMS for tag in GROUPS if tag in p.tags]
#: float32 results agree with float64 ones to a relative accuracy of about 1e-6 per operation;
#: the tolerance leaves room for deep chains and cancellations (variances), relative to each
#: tensor's largest entry
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3}
#: problems whose float64 forward differs between the CPU and CUDA at float32's level in plain
#: PyTorch: Hugging Face's Llama and T5 norms compute in float32 whatever the model's dtype;
#: weight normalisation (measured on an H100, torch 2.11: 1e-8 relative on the next bias's
#: gradient, while backpack on CUDA matches autograd on CUDA to 1e-13)
FLOAT32_INSIDE = ("hf-llama", "hf-t5", "parametrized-weight-norm", "parametrized-old-weight-norm")


def _moved(obj: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """`obj` (tensors, or tuples/lists/dicts of them) on `device`, floating tensors in `dtype`."""
    if isinstance(obj, torch.Tensor):
        moved = obj.detach().to(device, dtype if obj.is_floating_point() else obj.dtype)
        return moved.requires_grad_(obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_moved(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _moved(v, device, dtype) for k, v in obj.items()}
    return obj


def _quantities(problem: Problem, tag: str, device: torch.device, dtype: torch.dtype) -> dict:
    """`{(parameter, savefield): value}` of the group's extensions, and `.grad`, on `device`."""
    model, x, lossfunc, y = problem.build()  # float64 on the CPU: the same start everywhere
    model = copy.deepcopy(model).to(device, dtype)
    x, y = _moved(x, device, dtype), _moved(y, device, dtype)
    model, lossfunc = extend(model), extend(lossfunc.to(device, dtype))
    extensions = [ext() for ext in GROUPS[tag]]
    with backpack(*extensions):
        lossfunc(model(x), y).backward()
    result = {}
    for name, param in model.named_parameters():
        result[name, "grad"] = param.grad
        for ext in extensions:
            value = getattr(param, ext.savefield, None)
            if value is not None:
                result[name, ext.savefield] = value
    return result


def _flat(value: Any) -> torch.Tensor:
    """A quantity as one float64 CPU vector (Kronecker factors concatenated)."""
    if isinstance(value, (list, tuple)):
        return torch.cat([_flat(v) for v in value])
    return value.detach().to("cpu", torch.float64).flatten()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("problem", "tag"), CASES, ids=[f"{p.id}-{t}" for p, t in CASES])
def test_quantities_on_the_device_match_the_cpu(problem, tag, dtype):
    if CHECKED.type == "cuda" and "not_on_cuda" in problem.options:
        pytest.skip(problem.options["not_on_cuda"])
    expected = _quantities(problem, tag, torch.device("cpu"), torch.float64)
    actual = _quantities(problem, tag, CHECKED, dtype)
    assert actual.keys() == expected.keys()
    # errors relative to each quantity's largest entry over all parameters (a gradient that
    # cancels to zero, as a bias in front of a normalisation, gets the others' scale)
    scales: dict[str, float] = {}
    for (_, field), value in expected.items():
        ref = _flat(value)
        scales[field] = max(scales.get(field, 0.0), float(ref.abs().max()) if ref.numel() else 0)
    for key, value in expected.items():
        ref, got = _flat(value), _flat(actual[key])
        assert got.shape == ref.shape, key
        scale = scales[key[1]]
        tol = TOLERANCE[torch.float32 if problem.id.startswith(FLOAT32_INSIDE) else dtype]
        torch.testing.assert_close(
            got, ref, rtol=tol, atol=tol * scale + 1e-30, msg=lambda m, k=key: f"{k}: {m}"
        )
