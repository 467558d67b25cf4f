"""Per-sample gradient clipping, as in differentially private SGD (DP-SGD).

DP-SGD bounds the influence of each training sample: every sample's gradient is rescaled to a
norm of at most C, the clipped gradients are summed, Gaussian noise with standard deviation
sigma * C is added, and the result is averaged over the batch. One backward pass with
`BatchGrad` (the per-sample gradients) and `BatchL2Grad` (their squared norms, per parameter)
gives everything the step needs.

The first step is checked against a loop that computes, clips and sums each sample's gradient
with plain autograd. (Privacy accounting, i.e. turning sigma and the number of steps into an
(epsilon, delta) guarantee, is outside the scope of this example.)

    python examples/example_per_sample_clipping.py --max-norm 1.0 --noise-multiplier 1.0
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

from backpack import backpack, extend
from backpack.extensions import BatchGrad, BatchL2Grad
from backpack.utils.examples import load_one_batch_mnist


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--max-norm", type=float, default=1.0, help="clipping threshold C")
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="sigma")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def clipped_gradient_sum(model: nn.Module, max_norm: float) -> tuple[list[Tensor], Tensor]:
    """Sum over samples of the clipped per-sample gradients, from backpack's quantities.

    Returns the per-parameter sums and the per-sample gradient norms before clipping.
    """
    params = list(model.parameters())
    norms = torch.stack([p.batch_l2 for p in params]).sum(0).sqrt()  # [N], whole model
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    sums = [torch.einsum("n,n...->...", scale, p.grad_batch) for p in params]
    return sums, norms


def loop_clipped_gradient_sum(
    model: nn.Module, X: Tensor, y: Tensor, max_norm: float
) -> tuple[list[Tensor], Tensor]:
    """The same, one sample at a time with plain autograd."""
    params = list(model.parameters())
    sums = [torch.zeros_like(p) for p in params]
    norms = []
    for i in range(X.shape[0]):
        loss = nn.functional.cross_entropy(model(X[i : i + 1]), y[i : i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = torch.cat([g.flatten() for g in grads]).norm()
        norms.append(norm)
        scale = min(1.0, max_norm / (norm.item() + 1e-6))
        for s, g in zip(sums, grads):
            s += scale * g
    return sums, torch.stack(norms)


def main(argv: list[str] | None = None) -> dict[str, Tensor]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    X, y = load_one_batch_mnist(batch_size=args.batch_size, flat=True)
    model = extend(
        nn.Sequential(nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    )
    # reduction="sum": grad_batch[n] is the gradient of sample n's own loss (no 1/N factor)
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    noise_gen = torch.Generator().manual_seed(args.seed + 1)
    n = args.batch_size

    losses = []
    for step in range(args.steps):
        model.zero_grad()
        loss = lossfunc(model(X), y)
        with backpack(BatchGrad(), BatchL2Grad()):
            loss.backward()
        sums, norms = clipped_gradient_sum(model, args.max_norm)

        if step == 0:  # independent check of the clipped sum and the norms
            ref_sums, ref_norms = loop_clipped_gradient_sum(model, X, y, args.max_norm)
            if not torch.allclose(norms, ref_norms, rtol=1e-4, atol=1e-6):
                raise AssertionError("per-sample gradient norms differ from the loop")
            for s, r in zip(sums, ref_sums):
                error = (s - r).abs().max() / r.abs().max().clamp_min(1e-12)
                if not error < 1e-4:
                    raise AssertionError(f"clipped gradient sum differs (relative {error:.1e})")
            clipped_fraction = (norms > args.max_norm).float().mean().item()
            print(
                f"clipped sum matches a loop over {n} samples; "
                f"{100 * clipped_fraction:.0f}% of the samples were clipped"
            )

        with torch.no_grad():
            for p, s in zip(model.parameters(), sums):
                noise = torch.randn(p.shape, generator=noise_gen, device=noise_gen.device)
                noise = noise.to(p.device) * (
                    args.noise_multiplier * args.max_norm
                )
                p -= args.lr * (s + noise) / n
        losses.append(loss.item() / n)
        print(f"step {step}: mean loss {losses[-1]:.4f}, largest norm {norms.max().item():.3f}")
    return {"losses": torch.tensor(losses), "norms": norms}


if __name__ == "__main__":
    main()
