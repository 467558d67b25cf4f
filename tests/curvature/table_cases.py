"""Every problem of the shared table (tests/problems) as a data set swept in uneven batches.

`case(problem)` builds the problem's float64 model, loss and data, splits the data along its
sample axis into uneven batches (3, 2, 2, ... samples) and computes brute-force references of
the data-set loss (the problem's whole data as one batch) with plain autograd and torch.func,
without backpack:

- the GGN `Jᵀ (∇²_f L) J`, J the Jacobian of the whole output by reverse mode (`jacrev`);
- the Hessian by double backward (`jacrev` of `jacrev`);
- the empirical Fisher `R Σ_n ∇ℓ_n ∇ℓ_nᵀ`, ℓ_n sample n's unreduced loss and `R` the loss's
  reduction factor (`L_mean / Σ_n ℓ_n`, 1 for "sum").

Reverse mode defines the references: a parameter entry that autograd treats as constant (an
embedding's padding row) has zero rows and columns in all three.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from problems import ALL_PROBLEMS, Problem, per_sample_losses
from torch import Tensor, nn
from torch.func import functional_call, jacrev

#: engine limitation: backpack's extensions cannot tell the sample axis of a one-sample batch in
#: these models (a layer called without a sample axis, or a sequence-first layer whose batch
#: axis then has size 1): their sweeps avoid single-sample batches (test_single_sample_batches)
SINGLE_SAMPLE_BATCH_REFUSED = {
    "mha-residual-inplace-seq-first-mse-mean": "holds no sample axis",
    "decoder-layer-post-norm-seq-first-mse-mean": "holds no sample axis",
    "gpt-learned-positions-ce-mean": "along its batch axis",
    "embedding-relative-bias-t-eq-n": "along its batch axis",
    "embedding-relative-bias": "along its batch axis",
}
#: Hugging Face's RMS norm takes its mean square in float32: curvature float32-accurate only
FLOAT32_ACCURATE = {"hf-llama-tiny-ce-sum"}


def batch_sizes(n: int) -> list[int]:
    """Uneven sizes summing to n, at least two batches: 7 → 3, 2, 2; 4 → 3, 1; 3 → 2, 1."""
    if n <= 3:
        return [n - 1, 1]
    sizes, left = [3], n - 3
    while left > 0:
        sizes.append(min(2, left))
        left -= sizes[-1]
    return sizes


def _sample_axis(model: nn.Module, x: Tensor, out: Tensor) -> int:
    """The axis of `x` that holds the samples (the output's first axis)."""
    n = out.shape[0]
    candidates = [a for a in range(x.dim()) if x.shape[a] == n]
    assert candidates, f"no input axis of size {n}"
    if len(candidates) == 1:
        return candidates[0]
    for axis in candidates:  # several: the one whose first sample alone gives the first row
        try:
            with torch.no_grad():
                one = model(x.narrow(axis, 0, 1))
        except (RuntimeError, ValueError, IndexError):
            continue
        if one.shape[1:] == out.shape[1:] and torch.allclose(one[0], out[0], atol=1e-10):
            return axis
    return candidates[0]


@dataclass
class Case:
    """A problem of the table as a data set: model, loss, batches and brute-force references."""

    problem: Problem
    model: nn.Module
    lossfunc: nn.Module
    x: Tensor
    y: Tensor
    axis: int
    sizes: list[int]
    names: list[str]
    shapes: list[torch.Size]
    ggn: Tensor
    hessian: Tensor
    empirical_fisher: Tensor
    gradient: Tensor
    #: `[N, P]` gradients of the samples' unreduced losses ℓ_n
    sample_grads: Tensor
    #: the loss's reduction factor R (`1/ν` for "mean", 1 for "sum")
    factor: float

    @property
    def batches(self) -> list[tuple[Tensor, Tensor]]:
        """`(X_b, y_b)` in uneven batches (fresh tensors: a model may modify its input)."""
        out, start = [], 0
        for size in self.sizes:
            X = self.x.narrow(self.axis, start, size).clone()
            out.append((X, self.y[start : start + size].clone()))
            start += size
        return out

    @property
    def num_samples(self):
        """`num_samples=` for the sweeps (None: the samples are on the inputs' first axis)."""
        axis = self.axis
        return None if axis == 0 else (lambda X: X.shape[axis])

    @property
    def reduction(self) -> str:
        return self.lossfunc.reduction

    def close(self, actual: Tensor, expected: Tensor, msg: Any = "") -> None:
        """`close` at this problem's accuracy."""
        close(actual, expected, msg, float32=self.problem.id in FLOAT32_ACCURATE)

    def fresh(self) -> tuple[nn.Module, nn.Module]:
        """The problem's model and loss built anew (same values): extensions stay off ours."""
        model, _, lossfunc, _ = self.problem.build()
        return prepare(model), lossfunc


def _sum_loss(lossfunc: nn.Module) -> nn.Module:
    summed = copy.deepcopy(lossfunc)
    summed.reduction = "sum"
    return summed


def prepare(model: nn.Module) -> nn.Module:
    """The problem's model as the sweeps accept it (they refuse the raw one, see the tests).

    Embedding rows above `max_norm` are renormalised (the forward would change them during a
    sweep) and `scale_grad_by_freq` is off (the gradient would not be the loss's derivative).
    """
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.scale_grad_by_freq = False
            if module.max_norm is not None:
                with torch.no_grad():
                    module(torch.arange(module.num_embeddings, device=module.weight.device))
    return model


def _math_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])  # fused kernels have no double backward


@contextlib.contextmanager
def _composite_weight_norm():
    """torch's fused weight norm has a wrong double backward (its norms are saved outputs
    without derivative): the references compute it by its formula, the same function."""
    old_style = sys.modules["torch.nn.utils.weight_norm"]
    saved = torch._weight_norm, old_style._weight_norm

    def formula(v, g, dim=0):
        return v * (g / torch.norm_except_dim(v, 2, dim))

    torch._weight_norm = old_style._weight_norm = formula
    try:
        yield
    finally:
        torch._weight_norm, old_style._weight_norm = saved


def build_case(problem: Problem) -> Case:
    """The problem's model, loss, data, uneven batches and brute-force references."""
    model, x, lossfunc, y = problem.build()
    prepare(model)
    with torch.no_grad():
        out = model(x.clone())
    axis = _sample_axis(model, x, out)
    sizes = batch_sizes(out.shape[0])
    if problem.id in SINGLE_SAMPLE_BATCH_REFUSED:
        n = out.shape[0]
        sizes = [n - 2, 2] if n > 4 else [n // 2, n - n // 2] if n == 4 else [n]
    if axis != 0:  # the sweeps compare the non-batch shapes of the inputs' tensors on axis 0
        n = out.shape[0]
        sizes = [n // 2, n - n // 2] if n % 2 == 0 else [1] * n
    try:  # a model with a buffer of N rows (a padding mask) takes only the whole data
        starts = [0, *torch.tensor(sizes).cumsum(0)[:-1].tolist()]
        with torch.no_grad():
            parts = [model(x.narrow(axis, s, n).clone()) for s, n in zip(starts, sizes)]
        separable = torch.allclose(torch.cat(parts), out, atol=1e-10)
    except (RuntimeError, ValueError, IndexError, AssertionError):
        separable = False
    if not separable:
        sizes = [out.shape[0]]
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    names = [k for k, _ in named]
    shapes = [p.shape for _, p in named]
    theta = torch.cat([p.detach().flatten() for _, p in named])

    def params(flat: Tensor) -> dict[str, Tensor]:
        # clones, not views: a forward may modify a weight in place (max_norm's renormalisation)
        pieces = flat.split([s.numel() for s in shapes])
        return {k: t.reshape(s).clone() for k, t, s in zip(names, pieces, shapes)}

    def f(flat: Tensor) -> Tensor:
        return functional_call(model, params(flat), (x.clone(),))

    def loss(flat: Tensor) -> Tensor:
        return lossfunc(f(flat), y)

    with torch.backends.cudnn.flags(enabled=False), _math_attention(), _composite_weight_norm():
        output = f(theta).detach()
        jac = jacrev(f)(theta).reshape(output.numel(), -1)
        out_hessian = jacrev(jacrev(lambda o: lossfunc(o.reshape(output.shape), y)))(
            output.flatten()
        )
        ggn = jac.T @ out_hessian @ jac
        # the Hessian by double backward with plain autograd (the second backward batched over
        # the unit vectors); torch.func's jacrev of jacrev is wrong for layer and instance norm
        leaf = theta.clone().requires_grad_()
        (gradient,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
        eye = torch.eye(theta.numel(), dtype=theta.dtype, device=theta.device)
        (hessian,) = torch.autograd.grad(gradient, leaf, eye, is_grads_batched=True)
        summed = _sum_loss(lossfunc)
        grads = jacrev(lambda t: per_sample_losses(summed, f(t), y))(theta)  # [N, P]
        factor = float(lossfunc(output, y) / summed(output, y))
    return Case(
        problem,
        model,
        lossfunc,
        x,
        y,
        axis,
        sizes,
        names,
        shapes,
        ggn,
        hessian,
        factor * grads.T @ grads,
        gradient.detach(),
        grads,
        factor,
    )


@functools.lru_cache(maxsize=2)
def case(problem_id: str) -> Case:
    """The (cached) case of the table's problem `problem_id`."""
    return build_case(next(p for p in ALL_PROBLEMS if p.id == problem_id))


def close(actual: Tensor, expected: Tensor, msg: Any = "", float32: bool = False) -> None:
    """Equal up to float64 rounding of small problems (relative to the larger entries), or to
    float32 rounding (`float32`)."""
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    scale = max(float(expected.detach().abs().max()), 1.0)
    rtol, atol = (1e-5, 1e-6 * scale) if float32 else (1e-7, 1e-9 * scale)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg)
