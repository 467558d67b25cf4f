"""Issue 21: the models people train (`transformers`, `timm`, `peft`) against brute force.

Every model of `zoo.ZOO` (tiny, float64, eval mode) runs one backward per quantity inside
`with backpack(...)` with the loss people use: `nn.CrossEntropyLoss` on the logits, flattened to
`[N·T, V]` for language models (the samples stay the model's N sequences). References come from
plain autograd in float64, without backpack: per-sample gradients from one backward per
sample's term of the loss (`problems.reference_per_sample_grads`), GGN diagonals as
`diag(J_nᵀ H_n J_n)` with `J_n` the Jacobian of sample n's logits (one backward per logit) and
`H_n` the Hessian of its loss term w.r.t. its logits (`torch.func.hessian`).

Checks failing today are strict xfails (`Entry.xfail` in the zoo): a fix turns them red (XPASS)
so that the mark is removed with it.
"""

from __future__ import annotations

import functools
import math
import os

import pytest

# offline before the first import of transformers (huggingface_hub reads these at import)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("peft")

import torch  # noqa: E402
from problems import first_order_reference, per_sample_losses, reference_per_sample_grads  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from zoo import FIRST_ORDER, GPT2_BF16, QUANTITIES, ZOO, Entry, by_id  # noqa: E402

from backpack import backpack, extend  # noqa: E402
from backpack.extensions import (  # noqa: E402
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SumGradSquared,
    Variance,
)

# the zoo builds its models and references on the CPU (float64 brute force)
pytestmark = [
    pytest.mark.cpu_only,
    # expected: layers without a rule (timm's blocks, ViT embeddings) use the torch.func
    # fallback; torch's vmap notices missing batching rules; transformers' own deprecation
    pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for:UserWarning"),
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

EXTENSIONS = {
    "grad_batch": BatchGrad,
    "batch_l2": BatchL2Grad,
    "sum_grad_squared": SumGradSquared,
    "variance": Variance,
    "batch_dot": BatchDotGrad,
    "diag_ggn_exact": DiagGGNExact,
    "diag_ggn_exact_batch": BatchDiagGGNExact,
}
assert QUANTITIES == ["grad", *EXTENSIONS]  # `grad`: `.grad` under `BatchGrad` alone
REDUCTIONS = ["mean", "sum"]


class ClassesSecond(nn.Module):
    """Token logits `[N, T, V]` as `[N, V, T]`: the layout the reference helpers' loss takes
    (the same loss terms as on the flattened `[N·T, V]` logits)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x).transpose(1, 2)


def _reference_view(entry: Entry, model: nn.Module) -> tuple[nn.Module, str]:
    return (ClassesSecond(model), "model.") if entry.token_loss else (model, "")


def _loss(entry: Entry, lossfunc: nn.Module, out: Tensor, y: Tensor) -> Tensor:
    if entry.token_loss:
        return lossfunc(out.flatten(0, 1), y.flatten())
    return lossfunc(out, y)


def ggn_diagonals(model: nn.Module, x: Tensor, lossfunc: nn.Module, y: Tensor) -> dict[str, Tensor]:
    """Per-sample GGN diagonals `[N, *S]`: diag(J_nᵀ H_n J_n), brute force in float64."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    out = model(x)
    n = out.shape[0]
    flat = out.reshape(n, -1)
    rows = []
    for i in range(n):
        for d in range(flat.shape[1]):
            grads = torch.autograd.grad(
                flat[i, d], list(params.values()), retain_graph=True, allow_unused=True
            )
            rows.append(
                torch.cat(
                    [
                        torch.zeros(p.numel(), dtype=p.dtype) if g is None else g.flatten()
                        for g, p in zip(grads, params.values())
                    ]
                )
            )
    jac = torch.stack(rows).reshape(n, flat.shape[1], -1)  # [N, D, P]
    hess = torch.func.hessian(lambda o: per_sample_losses(lossfunc, o, y).sum())(out.detach())
    hess = hess.reshape(n, flat.shape[1], n, flat.shape[1])
    blocks = torch.stack([hess[i, :, i] for i in range(n)])  # [N, D, D]
    diag = torch.einsum("ndp,nde,nep->np", jac, blocks, jac)
    result, start = {}, 0
    for k, p in params.items():
        result[k] = diag[:, start : start + p.numel()].reshape(n, *p.shape)
        start += p.numel()
    return result


@functools.cache
def reference(entry_id: str, reduction: str) -> dict[str, dict[str, Tensor]]:
    """Float64 references of every quantity by parameter name (weights of `dtype` entries are
    their rounded values)."""
    entry = by_id(entry_id)
    model, x, y = entry.build()
    model = model.to(torch.float64)
    x = x.to(torch.float64) if x.is_floating_point() else x
    view, prefix = _reference_view(entry, model)
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    psg = reference_per_sample_grads(view, x, lossfunc, y)
    ggn = ggn_diagonals(view, x, lossfunc, y)
    refs: dict[str, dict[str, Tensor]] = {}
    for name, g in psg.items():
        key = name.removeprefix(prefix)
        refs[key] = {q: first_order_reference(g, q) for q in FIRST_ORDER if q != "grad"}
        refs[key]["grad"] = g.sum(0)
        refs[key]["diag_ggn_exact_batch"] = ggn[name]
        refs[key]["diag_ggn_exact"] = ggn[name].sum(0)
    return refs


def run_backpack(entry: Entry, quantity: str, reduction: str):
    """The model after one backward inside `with backpack(...)`, and plain autograd's `.grad`."""
    model, x, y = entry.build()
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    _loss(entry, lossfunc, model(x), y).backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    extend(model)
    extend(lossfunc)
    ext = EXTENSIONS["grad_batch" if quantity == "grad" else quantity]()
    loss = _loss(entry, lossfunc, model(x), y)
    with backpack(ext):
        loss.backward()
    return model, plain


def relative_error(actual: Tensor, expected: Tensor, floor: float = 0.0) -> float:
    """`‖actual - expected‖ / max(‖expected‖, floor)`."""
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    scale = max(expected.norm().item(), floor)
    err = (actual - expected).norm().item()
    return err / scale if scale > 0 else err


#: a parameter's error is relative to its own reference, or to this fraction of the largest
#: parameter's if smaller: some gradients vanish in exact arithmetic (attention key biases, by
#: the softmax's shift invariance) and their float64 references are rounding noise
FLOOR = 1e-6


def _marks(entry: Entry, quantity: str, reduction: str) -> list:
    reason = entry.xfail.get(f"{quantity}/{reduction}") or entry.xfail.get(quantity)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


CASES = [
    pytest.param(e.id, q, r, id=f"{e.id}-{q}-{r}", marks=_marks(e, q, r))
    for e in ZOO
    for q in QUANTITIES
    for r in REDUCTIONS
]


@pytest.mark.parametrize("entry_id,quantity,reduction", CASES)
def test_quantity_matches_autograd(entry_id: str, quantity: str, reduction: str) -> None:
    entry = by_id(entry_id)
    refs = reference(entry_id, reduction)
    model, plain = run_backpack(entry, quantity, reduction)
    pairs = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen (LoRA's base weights): nothing stored
            assert not hasattr(p, quantity) or quantity == "grad", name
            continue
        if quantity == "grad":
            actual = p.grad
        else:
            assert hasattr(p, quantity), f"{name} has no {quantity}"
            actual = getattr(p, quantity)
        expected = refs[name][quantity]
        assert actual.shape == expected.shape, f"{name}: {actual.shape} != {expected.shape}"
        pairs[name] = (actual, expected)
    floor = FLOOR * max(e.norm().item() for _, e in pairs.values())
    errors = {name: relative_error(a, e, floor) for name, (a, e) in pairs.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < entry.rtol, f"relative error {errors[worst]:.2e} at {worst}"
    for name in pairs:
        # with every extension `.grad` is plain autograd's (first-order extensions alone may
        # sum it from per-sample gradients: equal up to rounding)
        grad = dict(model.named_parameters())[name].grad
        torch.testing.assert_close(grad, plain[name], rtol=1e-13, atol=1e-16, msg=name)


# --- bfloat16 --------------------------------------------------------------------------------


@functools.cache
def bf16_autograd_error(reduction: str) -> float:
    """Relative error of plain autograd's bfloat16 `.grad` against float64 on the same weights."""
    model, x, y = GPT2_BF16.build()
    _loss(GPT2_BF16, nn.CrossEntropyLoss(reduction=reduction), model(x), y).backward()
    refs = reference(GPT2_BF16.id, reduction)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    actual = torch.cat([dict(model.named_parameters())[k].grad.flatten() for k in names])
    expected = torch.cat([refs[k]["grad"].flatten() for k in names])
    return relative_error(actual, expected)


BF16_FACTOR = 8  # squares, sums over samples and curvature carry a few roundings more than .grad
BF16_CASES = [
    pytest.param(q, r, id=f"{q}-{r}", marks=_marks(GPT2_BF16, q, r))
    for q in QUANTITIES
    for r in REDUCTIONS
]


@pytest.mark.parametrize("quantity,reduction", BF16_CASES)
def test_gpt2_bfloat16(quantity: str, reduction: str) -> None:
    """GPT-2 with bfloat16 weights: every quantity as close to float64 (on the same rounded
    weights) as `BF16_FACTOR` times plain autograd's bfloat16 `.grad` is."""
    refs = reference(GPT2_BF16.id, reduction)
    tol = BF16_FACTOR * bf16_autograd_error(reduction)
    assert 0 < tol < 0.5 and math.isfinite(tol)
    model, plain = run_backpack(GPT2_BF16, quantity, reduction)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    if quantity == "grad":
        for k in names:
            torch.testing.assert_close(params[k].grad, plain[k], msg=k)
        actual = [params[k].grad for k in names]
    else:
        missing = [k for k in names if not hasattr(params[k], quantity)]
        assert not missing, f"no {quantity} on {missing}"
        actual = [getattr(params[k], quantity) for k in names]
    for k, a in zip(names, actual):
        # `.grad` is autograd's (bf16); backpack's quantities of 16-bit weights are float32
        wanted = torch.bfloat16 if quantity == "grad" else torch.float32
        assert a.dtype == wanted and a.shape == refs[k][quantity].shape, k
    err = relative_error(
        torch.cat([a.flatten() for a in actual]),
        torch.cat([refs[k][quantity].flatten() for k in names]),
    )
    assert err < tol, f"relative error {err:.2e}, autograd's bf16 .grad x {BF16_FACTOR}: {tol:.2e}"
