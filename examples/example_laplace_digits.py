"""Diagonal and KFAC Laplace approximations of a small CNN on digits, and its sharpness in training.

A small convolutional network is trained on the handwritten digits that ship with the package.
Every few steps the largest eigenvalue of the training loss's Hessian (the sharpness) is
computed by Lanczos on the `Hessian` operator of `backpack.curvature` (one sweep over the
training batches per Lanczos step). At the end:

- the Hessian's top eigenvalue is checked against the dense Hessian of `torch.func`, and its
  spectral density is estimated by stochastic Lanczos quadrature (`spectral_density`);
- two Laplace approximations of the posterior around the trained weights θ* (prior precision τ,
  the summed negative log-likelihood), with the GGN as curvature:
  diagonal, `Σ = (diag GGN + τ)⁻¹` from `accumulate(DiagGGNExact())`, checked against
  `Σ_n J_nᵀ H_n J_n` from torch.func Jacobians; and KFAC, `Σ = (G ⊗ A + τI)⁻¹` per layer
  from `KFAC(...)`, whose closed-form inverse is checked against a dense solve;
- both give the linearised predictive: logits `f(x) ~ N(f_θ*(x), J Σ Jᵀ)`, mapped to class
  probabilities with the probit approximation `softmax(f / √(1 + π/8 · diag(J Σ Jᵀ)))`. τ is
  chosen per method on validation digits; the test digits compare MAP, diagonal and KFAC.

With matplotlib installed, the sharpness curve and the spectral density are saved to
`--figure` (skipped with a note otherwise, or with `--no-figure`).

    python examples/example_laplace_digits.py --train-steps 300 --figure laplace_digits.png
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev, vmap

from backpack.curvature import KFAC, Hessian, accumulate, eigvalsh, spectral_density
from backpack.extensions import DiagGGNExact
from backpack.utils.examples import load_one_batch_mnist


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-size", type=int, default=512, help="training digits")
    parser.add_argument("--batch-size", type=int, default=128, help="batches of a sweep")
    parser.add_argument("--channels", type=int, default=6, help="convolution channels")
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--track-every", type=int, default=25, help="steps between sharpness")
    parser.add_argument("--probes", type=int, default=4, help="spectral density probes")
    parser.add_argument("--lanczos-steps", type=int, default=30)
    parser.add_argument("--figure", default="laplace_digits.png")
    parser.add_argument("--no-figure", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_model(channels: int) -> nn.Module:
    """4x4 average pooling (7x7 images), a 3x3 convolution of stride 2, a linear classifier."""
    return nn.Sequential(
        nn.AvgPool2d(4),
        nn.Conv2d(1, channels, 3, stride=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(channels * 3 * 3, 10),
    ).double()


def flat_params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def unflatten(model: nn.Module, theta: Tensor) -> dict[str, Tensor]:
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    pieces = theta.split([s.numel() for s in shapes])
    return {n: piece.reshape(s) for n, piece, s in zip(names, pieces, shapes)}


def top_hessian_eigenvalue(model: nn.Module, data: list) -> float:
    """Sharpness of the mean training loss: Lanczos on the Hessian operator."""
    op = Hessian(model, nn.CrossEntropyLoss(), data)
    # stops when the Ritz residual is below 1e-4 · |θ|: θ is then that close to an eigenvalue
    return float(eigvalsh(op, k=1, tol=1e-4, max_iter=40)[0])


def dense_hessian(model: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    """The mean loss's Hessian from torch.func (no backpack): the brute-force reference."""

    def loss(theta):
        out = functional_call(model, unflatten(model, theta), (X,))
        return nn.functional.cross_entropy(out, y)

    with warnings.catch_warnings():
        # torch's forward-mode derivatives compile their decompositions with the deprecated
        # torch.jit.script, which warns about torch's own code
        warnings.filterwarnings("ignore", ".*torch.jit.script.*", FutureWarning)
        return hessian(loss)(flat_params(model))


def jacobians(model: nn.Module, X: Tensor) -> tuple[Tensor, Tensor]:
    """Logits `[N, 10]` and their Jacobians w.r.t. the flat parameters `[N, 10, P]`."""
    theta = flat_params(model)

    def logits(t, x):
        return functional_call(model, unflatten(model, t), (x[None],))[0]

    J = vmap(jacrev(logits), in_dims=(None, 0))(theta, X)
    with torch.no_grad():
        return model(X), J


def probit_predictive(logits: Tensor, variances: Tensor) -> Tensor:
    """`softmax(f / √(1 + π/8 · var))`: the probit approximation of the linearised predictive."""
    return (logits / (1 + math.pi / 8 * variances).sqrt()).softmax(-1)


def nll_and_accuracy(probs: Tensor, y: Tensor) -> tuple[float, float]:
    nll = -probs[torch.arange(len(y)), y].clamp_min(1e-12).log().mean().item()
    return nll, (probs.argmax(-1) == y).double().mean().item()


def save_figure(path: str, steps: list[int], sharpness: list[float], grid, density) -> str:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib is not installed: no figure (pip install matplotlib)"
    figure = Figure(figsize=(9, 3.5))
    left, right = figure.subplots(1, 2)
    left.plot(steps, sharpness, marker="o")
    left.set_xlabel("training step")
    left.set_ylabel("top Hessian eigenvalue")
    left.set_title("sharpness (Lanczos)")
    right.semilogy(grid.numpy(), density.clamp_min(1e-8).numpy())
    right.set_xlabel("eigenvalue")
    right.set_ylabel("density")
    right.set_title("Hessian spectral density (SLQ)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return f"figure saved to {path}"


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    n = args.train_size
    X, y = load_one_batch_mnist(batch_size=2 * n)
    X = X.double()
    X_train, y_train = X[:n], y[:n]
    X_val, y_val = X[n : n + n // 2], y[n : n + n // 2]
    X_test, y_test = X[n + n // 2 :], y[n + n // 2 :]
    data = [
        (X_train[i : i + args.batch_size], y_train[i : i + args.batch_size])
        for i in range(0, n, args.batch_size)
    ]
    model = make_model(args.channels)
    P = sum(p.numel() for p in model.parameters())
    print(f"CNN with {P} parameters, {n} training digits in {len(data)} batches")

    # --- training, with the sharpness every few steps -----------------------------------------
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    steps, sharpness = [], []
    for step in range(args.train_steps + 1):
        if step % args.track_every == 0 or step == args.train_steps:
            steps.append(step)
            sharpness.append(top_hessian_eigenvalue(model, data))
            print(f"  step {step:4d}: top Hessian eigenvalue {sharpness[-1]:.4f}")
        if step == args.train_steps:
            break
        X_b, y_b = data[step % len(data)]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X_b), y_b).backward()
        optimizer.step()
    model.zero_grad()

    dense = dense_hessian(model, X_train, y_train)
    expected = float(torch.linalg.eigvalsh(dense)[-1])
    if not abs(sharpness[-1] - expected) <= 1e-4 * abs(expected):
        raise AssertionError(f"Lanczos sharpness {sharpness[-1]} != dense {expected}")
    print(f"final top eigenvalue matches the dense torch.func Hessian ({expected:.6f})")

    grid, density = spectral_density(
        Hessian(model, nn.CrossEntropyLoss(), data), args.probes, args.lanczos_steps, seed=0
    )
    mass = float(torch.trapezoid(density, grid))
    mean = float(torch.trapezoid(grid * density, grid))
    if not abs(mass - 1) < 1e-4:
        raise AssertionError(f"the spectral density integrates to {mass}")
    std = math.sqrt(2 * float(dense.square().sum()) / args.probes) / P
    if not abs(mean - float(dense.trace()) / P) < 5 * std:
        raise AssertionError("the spectral density's mean is far from tr(H)/P")
    print(f"spectral density: mean {mean:.5f} (tr(H)/P = {float(dense.trace()) / P:.5f})")

    # --- Laplace approximations of the summed negative log-likelihood ---------------------------
    lossfunc = nn.CrossEntropyLoss(reduction="sum")
    result = accumulate(model, lossfunc, data, [DiagGGNExact()], write=False)
    diag = torch.cat([v.flatten() for v in result.quantity("diag_ggn_exact").values()])
    logits, J = jacobians(model, X_train)
    p = logits.softmax(-1)
    H = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # the summed CE's Hessian in f
    reference = torch.einsum("ncp,ncd,ndp->p", J, H, J)
    if not torch.allclose(diag, reference, rtol=1e-9, atol=1e-12):
        raise AssertionError("the accumulated GGN diagonal differs from Σ JᵀHJ")
    print("GGN diagonal over the batches matches Σ_n J_nᵀ H_n J_n (torch.func)")

    kfac = KFAC(model, lossfunc, data)
    v = torch.randn(P, dtype=torch.float64)
    solve = torch.linalg.solve(kfac.to_dense() + torch.eye(P, dtype=torch.float64), v)
    if not torch.allclose(kfac.inverse(1.0) @ v, solve, rtol=1e-8, atol=1e-10):
        raise AssertionError("the KFAC inverse differs from a dense solve")
    print("KFAC's closed-form damped inverse matches a dense solve")

    def logit_variances(method: str, tau: float, J: Tensor) -> Tensor:
        N, C, _ = J.shape
        if method == "diag":
            return (J.square() * (1 / (diag + tau))).sum(-1)
        S = kfac.inverse(tau) @ J.reshape(N * C, P).T  # Σ Jᵀ, all test logits at once
        return (J.reshape(N * C, P) * S.T).sum(-1).reshape(N, C)

    val_logits, J_val = jacobians(model, X_val)
    test_logits, J_test = jacobians(model, X_test)
    map_nll, map_acc = nll_and_accuracy(test_logits.softmax(-1), y_test)
    print(f"test digits ({len(y_test)}): MAP NLL {map_nll:.3f}, accuracy {map_acc:.3f}")
    results = {"map": {"nll": map_nll, "accuracy": map_acc}}
    for method in ("diag", "kfac"):
        scores = []
        for tau in (1.0, 10.0, 100.0, 1000.0, 10000.0):
            probs = probit_predictive(val_logits, logit_variances(method, tau, J_val))
            scores.append((nll_and_accuracy(probs, y_val)[0], tau))
        tau = min(scores)[1]
        probs = probit_predictive(test_logits, logit_variances(method, tau, J_test))
        if not torch.allclose(probs.sum(-1), torch.ones(len(y_test), dtype=probs.dtype)):
            raise AssertionError("predictive probabilities do not sum to one")
        nll, acc = nll_and_accuracy(probs, y_test)
        results[method] = {"nll": nll, "accuracy": acc, "prior_precision": tau}
        print(f"  {method:4} Laplace (τ={tau:g} on validation): NLL {nll:.3f}, accuracy {acc:.3f}")

    best = min(results, key=lambda name: results[name]["nll"])
    print(f"  -> lowest test NLL: {best} (the Laplace predictives differ from MAP only where")
    print("     the posterior spread moves the logits; tune τ on more validation data to see more)")
    if not args.no_figure:
        print(save_figure(args.figure, steps, sharpness, grid, density))
    return {"sharpness": list(zip(steps, sharpness)), "laplace": results, "density": density}


if __name__ == "__main__":
    main()
