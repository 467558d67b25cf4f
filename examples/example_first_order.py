"""First-order extensions on an MLP: per-sample gradients and their statistics in one backward.

One backward pass inside `with backpack(...)` computes, for every parameter,

- `grad_batch` (BatchGrad): the gradient of each sample's share of the loss,
- `batch_l2` (BatchL2Grad): the squared norm of each of them,
- `sum_grad_squared` (SumGradSquared): their elementwise second moment,
- `variance` (Variance): their elementwise variance over the batch,
- `batch_dot` (BatchDotGrad): their pairwise inner products.

The script then recomputes every per-sample gradient with one ordinary backward pass per sample
and checks all five quantities against it.

    python examples/example_first_order.py --batch-size 64 --hidden 32
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from backpack import backpack, extend
from backpack.extensions import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance
from backpack.utils.examples import load_one_batch_mnist


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32, help="width of the hidden layer")
    parser.add_argument("--reduction", choices=["mean", "sum"], default="mean")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def brute_force_per_sample_grads(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, reduction: str
) -> dict[str, torch.Tensor]:
    """One backward pass per sample; the same scaling as backpack (1/N for reduction="mean")."""
    n = X.shape[0]
    scale = 1.0 / n if reduction == "mean" else 1.0
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    grads: dict[str, list[torch.Tensor]] = {name: [] for name, _ in model.named_parameters()}
    params = dict(model.named_parameters())
    for i in range(n):
        loss = scale * lossfunc(model(X[i : i + 1]), y[i : i + 1])
        sample_grads = torch.autograd.grad(loss, list(params.values()))
        for name, g in zip(params, sample_grads):
            grads[name].append(g)
    return {name: torch.stack(gs) for name, gs in grads.items()}


def check_close(what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Relative agreement up to float32 round-off, measured on the scale of the expected values."""
    scale = expected.abs().max().clamp_min(1e-12)
    error = (actual - expected).abs().max() / scale
    if not error < 1e-4:
        raise AssertionError(f"{what}: relative error {error:.2e}")


def main(argv: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    X, y = load_one_batch_mnist(batch_size=args.batch_size, flat=True)

    model = extend(make_model(args.hidden))
    lossfunc = nn.CrossEntropyLoss(reduction=args.reduction)  # need not be extended

    loss = lossfunc(model(X), y)
    with backpack(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad()):
        loss.backward()

    print(f"loss = {loss.item():.4f} (reduction={args.reduction!r}, N={args.batch_size})")
    print(f"{'parameter':10} {'grad':>14} {'grad_batch':>18} {'batch_l2':>9} {'batch_dot':>10}")
    for name, p in model.named_parameters():
        print(
            f"{name:10} {str(tuple(p.grad.shape)):>14} {str(tuple(p.grad_batch.shape)):>18} "
            f"{str(tuple(p.batch_l2.shape)):>9} {str(tuple(p.batch_dot.shape)):>10}"
        )

    # squared norm of each sample's gradient w.r.t. all parameters: add the per-layer norms
    total_l2 = sum(p.batch_l2 for p in model.parameters())
    print(f"largest per-sample gradient norm: {total_l2.max().sqrt().item():.4f}")

    # independent check: one backward pass per sample
    reference = brute_force_per_sample_grads(model, X, y, args.reduction)
    results = {}
    for name, p in model.named_parameters():
        g = reference[name]
        flat = g.flatten(1)
        check_close(f"{name}.grad_batch", p.grad_batch, g)
        check_close(f"{name}.grad", p.grad_batch.sum(0), p.grad)
        check_close(f"{name}.batch_l2", p.batch_l2, flat.square().sum(1))
        check_close(f"{name}.sum_grad_squared", p.sum_grad_squared, g.square().sum(0))
        # the variance is a difference of moments: compare on the scale of the second moment
        second_moment = g.square().mean(0)
        var_error = (p.variance - g.var(0, unbiased=False)).abs().max()
        if not var_error <= 1e-4 * second_moment.max():
            raise AssertionError(f"{name}.variance: error {var_error:.2e}")
        check_close(f"{name}.batch_dot", p.batch_dot, flat @ flat.T)
        results[name] = {
            "grad_batch": p.grad_batch,
            "batch_l2": p.batch_l2,
            "variance": p.variance,
        }
    print("all quantities match a loop over samples")
    return results


if __name__ == "__main__":
    main()
