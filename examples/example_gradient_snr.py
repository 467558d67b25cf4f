"""Gradient signal-to-noise ratio per layer, from `Variance` and `BatchGrad`.

How informative is a mini-batch gradient? Compare its mean over the samples, the *signal*
μ = (1/N) Σₙ ∇ℓₙ, with the spread of the individual gradients, the *noise* σ² = Varₙ[∇ℓₙ]
(elementwise). Per parameter tensor, the signal-to-noise ratio

    SNR = ‖μ‖² / Σ σ²

is large when the samples agree on the direction and small when the average is dominated by
noise. (The mean over N samples has N times this SNR.)

With `reduction="mean"`, backpack's per-sample gradients carry the factor 1/N, so μ is `.grad`
and σ² is `N² · variance`. The script computes both with one backward pass, checks `variance`
against `torch.var` of per-sample gradients from a loop over samples and against `grad_batch`,
and prints the SNR of every layer.

    python examples/example_gradient_snr.py --batch-size 64 --channels 4
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

from backpack import backpack, extend
from backpack.extensions import BatchGrad, Variance
from backpack.utils.examples import load_one_batch_mnist


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_model(channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, channels, kernel_size=3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * 13 * 13, 10),
    )


def loop_per_sample_grads(model: nn.Module, X: Tensor, y: Tensor) -> list[Tensor]:
    """Gradients of each sample's own loss ∇ℓₙ, one backward pass each: `[N, *p.shape]`."""
    params = list(model.parameters())
    rows = []
    for i in range(X.shape[0]):
        loss = nn.functional.cross_entropy(model(X[i : i + 1]), y[i : i + 1])
        rows.append(torch.autograd.grad(loss, params))
    return [torch.stack(g) for g in zip(*rows)]


def check_close(what: str, actual: Tensor, expected: Tensor, scale: Tensor) -> None:
    error = (actual - expected).abs().max() / scale.abs().max().clamp_min(1e-12)
    if not error < 1e-4:
        raise AssertionError(f"{what}: relative error {error:.2e}")


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    X, y = load_one_batch_mnist(batch_size=args.batch_size)
    n = args.batch_size

    model = extend(make_model(args.channels))
    loss = nn.functional.cross_entropy(model(X), y)  # reduction="mean"
    with backpack(Variance(), BatchGrad()):
        loss.backward()

    reference = loop_per_sample_grads(model, X, y)
    snr = {}
    print(f"{'parameter':10} {'‖μ‖²':>10} {'Σσ²':>10} {'SNR':>8}")
    for (name, p), grads in zip(model.named_parameters(), reference):
        signal = p.grad  # mean of the per-sample loss gradients
        noise = n**2 * p.variance  # variance of the per-sample loss gradients

        second_moment = grads.square().mean(0)
        check_close(f"{name}: mean", signal, grads.mean(0), signal)
        check_close(f"{name}: variance", noise, torch.var(grads, 0, unbiased=False), second_moment)
        from_batch = torch.var(n * p.grad_batch, 0, unbiased=False)
        check_close(f"{name}: variance vs grad_batch", noise, from_batch, second_moment)

        snr[name] = (signal.square().sum() / noise.sum()).item()
        print(
            f"{name:10} {signal.square().sum().item():10.3e} {noise.sum().item():10.3e} "
            f"{snr[name]:8.4f}"
        )
    print(f"Variance matches torch.var of {n} per-sample gradients from a loop")
    return snr


if __name__ == "__main__":
    main()
