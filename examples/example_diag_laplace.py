"""A diagonal Laplace approximation of a classifier's posterior, with `DiagGGNExact`.

Around a MAP estimate θ* (trained with a Gaussian prior of precision τ), the Laplace
approximation of the posterior is a Gaussian whose precision is the curvature of the negative
log-posterior. With the GGN as curvature and only its diagonal kept, every parameter gets an
independent variance

    σ² = 1 / (diag GGN of Σₙ ℓₙ  +  τ),

where ℓₙ is sample n's negative log-likelihood (so the loss uses `reduction="sum"`). One
backward pass with `DiagGGNExact` gives the diagonal; the script checks it against
`autograd_diag_ggn_exact`, then samples parameters from the approximate posterior and averages
their predictions (the Monte-Carlo predictive), and compares it with the MAP prediction on
held-out digits. (Sampling the network's parameters this way tends to give underconfident
predictions; tuning τ on validation data, or a linearised predictive, are the usual remedies.)

    python examples/example_diag_laplace.py --train-steps 200 --samples 50
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn
from torch.func import functional_call

from backpack import backpack, extend
from backpack.extensions import DiagGGNExact
from backpack.utils.examples import autograd_diag_ggn_exact, load_one_batch_mnist


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=256, help="training samples")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--prior-precision", type=float, default=1.0, help="τ")
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--samples", type=int, default=50, help="posterior samples")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def train_map(model: nn.Module, X: Tensor, y: Tensor, tau: float, steps: int) -> None:
    """Minimise the negative log-posterior Σₙ ℓₙ + τ/2 ‖θ‖² (divided by N for the step size)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    n = X.shape[0]
    for _ in range(steps):
        optimizer.zero_grad()
        nll = nn.functional.cross_entropy(model(X), y, reduction="sum")
        prior = 0.5 * tau * sum(p.square().sum() for p in model.parameters())
        ((nll + prior) / n).backward()
        optimizer.step()


def predictive(model: nn.Module, X: Tensor, samples: list[dict[str, Tensor]]) -> Tensor:
    """Average of the softmax outputs over parameter samples: `[N, classes]`."""
    with torch.no_grad():
        probs = [functional_call(model, s, (X,)).softmax(-1) for s in samples]
    return torch.stack(probs).mean(0)


def summarise(name: str, probs: Tensor, y: Tensor) -> dict[str, float]:
    nll = -probs[torch.arange(len(y)), y].clamp_min(1e-12).log().mean().item()
    accuracy = (probs.argmax(-1) == y).float().mean().item()
    confidence = probs.max(-1).values.mean().item()
    print(f"  {name:8} accuracy {accuracy:.3f}  NLL {nll:.3f}  mean confidence {confidence:.3f}")
    return {"nll": nll, "accuracy": accuracy, "confidence": confidence}


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    X, y = load_one_batch_mnist(batch_size=2 * args.batch_size)
    X_train, y_train = X[: args.batch_size], y[: args.batch_size]
    X_test, y_test = X[args.batch_size :], y[args.batch_size :]

    # 4x4 average pooling: 49 input features keep the brute-force check cheap
    model = nn.Sequential(
        nn.AvgPool2d(4),
        nn.Flatten(),
        nn.Linear(49, args.hidden),
        nn.Tanh(),
        nn.Linear(args.hidden, 10),
    )
    train_map(model, X_train, y_train, args.prior_precision, args.train_steps)

    # curvature of the summed negative log-likelihood at the MAP estimate
    model = extend(model)
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    with backpack(DiagGGNExact()):
        lossfunc(model(X_train), y_train).backward()

    diag_ggn = torch.cat([p.diag_ggn_exact.flatten() for p in model.parameters()])
    reference = autograd_diag_ggn_exact(X_train, y_train, model, lossfunc)
    error = (diag_ggn - reference).abs().max() / reference.abs().max()
    if not error < 1e-4:
        raise AssertionError(f"diag_ggn_exact differs from autograd (relative {error:.1e})")
    print(f"GGN diagonal of {diag_ggn.numel()} parameters matches autograd ({error:.1e})")

    variances = {
        name: 1.0 / (p.diag_ggn_exact + args.prior_precision)
        for name, p in model.named_parameters()
    }
    flat_var = torch.cat([v.flatten() for v in variances.values()])
    if not torch.allclose(flat_var, 1.0 / (reference + args.prior_precision), rtol=1e-4):
        raise AssertionError("posterior variances differ from the brute-force ones")
    print(
        f"posterior standard deviations: min {flat_var.min().sqrt().item():.3f}, "
        f"max {flat_var.max().sqrt().item():.3f} (prior: {args.prior_precision**-0.5:.3f})"
    )

    mean = {name: p.detach() for name, p in model.named_parameters()}
    samples = [
        {name: mean[name] + variances[name].sqrt() * torch.randn_like(mean[name]) for name in mean}
        for _ in range(args.samples)
    ]
    map_probs = predictive(model, X_test, [mean])
    laplace_probs = predictive(model, X_test, samples)
    for probs in (map_probs, laplace_probs):
        if not torch.allclose(probs.sum(-1), torch.ones(len(y_test)), atol=1e-5):
            raise AssertionError("predictive probabilities do not sum to one")
    print(f"held-out digits ({len(y_test)}):")
    map_stats = summarise("MAP", map_probs, y_test)
    laplace_stats = summarise("Laplace", laplace_probs, y_test)
    return {"variances": variances, "map": map_stats, "laplace": laplace_stats}


if __name__ == "__main__":
    main()
