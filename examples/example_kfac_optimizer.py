"""One KFAC-preconditioned gradient step.

KFAC approximates the curvature block of a `Linear` layer's weight `W` (`[out, in]`) by a
Kronecker product `G ⊗ A` of an output factor `G` (`out x out`) and an input factor `A`
(`in x in`). With damping λ, the preconditioned gradient is cheap to apply without ever forming
the product:

    ΔW = (G + λI)⁻¹ ∇W (A + λI)⁻¹,        Δb = (G + λI)⁻¹ ∇b.

The script computes the factors with backpack's `KFAC` extension, takes one step
`θ ← θ − lr · Δθ`, and checks

- each ΔW against solving with the dense matrix `kfacs_to_mat([G + λI, A + λI])`,
- each `A` against the mean outer product of the layer inputs, recorded with a plain hook,
- the last layer's exact-curvature factor `G` (from `KFLR`, computed in the same backward)
  against the Hessian of the loss w.r.t. the logits, computed by autograd.

    python examples/example_kfac_optimizer.py --damping 0.1 --lr 1.0
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

from backpack import backpack, extend
from backpack.extensions import KFAC, KFLR
from backpack.utils.examples import load_one_batch_mnist
from backpack.utils.kroneckers import kfacs_to_mat


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--damping", type=float, default=0.1, help="λ")
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--mc-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_model(hidden: int) -> nn.Sequential:
    # 4x4 average pooling shrinks the 28x28 digits to 49 features, which keeps the dense
    # Kronecker products of the check small
    return nn.Sequential(
        nn.AvgPool2d(4),
        nn.Flatten(),
        nn.Linear(49, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def precondition(weight: Tensor, bias: Tensor, damping: float) -> tuple[Tensor, Tensor]:
    """(G + λI)⁻¹ ∇W (A + λI)⁻¹ and (G + λI)⁻¹ ∇b from the factors stored by KFAC."""
    G, A = weight.kfac
    eye_g = torch.eye(G.shape[0], dtype=G.dtype)
    eye_a = torch.eye(A.shape[0], dtype=A.dtype)
    left = torch.linalg.solve(G + damping * eye_g, weight.grad)
    delta_w = torch.linalg.solve(A + damping * eye_a, left.T).T  # A is symmetric
    (G_b,) = bias.kfac
    delta_b = torch.linalg.solve(G_b + damping * eye_g, bias.grad)
    return delta_w, delta_b


def check_close(what: str, actual: Tensor, expected: Tensor, rtol: float = 1e-3) -> None:
    error = (actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
    if not error < rtol:
        raise AssertionError(f"{what}: relative error {error:.2e}")
    print(f"  {what}: ok (relative error {error:.1e})")


def main(argv: list[str] | None = None) -> dict[str, Tensor]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    X, y = load_one_batch_mnist(batch_size=args.batch_size)
    # float64 keeps the dense solves of the check accurate for small damping
    X = X.double()
    model = extend(make_model(args.hidden).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    linears = [m for m in model if isinstance(m, nn.Linear)]

    # record each Linear layer's input with a plain forward hook, independently of backpack
    inputs: dict[nn.Module, Tensor] = {}
    handles = [
        m.register_forward_hook(lambda mod, inp, out: inputs.__setitem__(mod, inp[0].detach()))
        for m in linears
    ]
    logits = model(X)
    for h in handles:
        h.remove()
    loss = lossfunc(logits, y)
    with backpack(KFAC(mc_samples=args.mc_samples), KFLR()):
        loss.backward()

    print("checks")
    deltas = []
    for i, layer in enumerate(linears):
        delta_w, delta_b = precondition(layer.weight, layer.bias, args.damping)
        deltas += [delta_w, delta_b]

        G, A = layer.weight.kfac
        damped = [F + args.damping * torch.eye(F.shape[0], dtype=F.dtype) for F in (G, A)]
        dense = kfacs_to_mat(damped)  # [out * in, out * in], row-major like W.flatten()
        solved = torch.linalg.solve(dense, layer.weight.grad.flatten())
        check_close(f"layer {i}: ΔW vs dense Kronecker solve", delta_w.flatten(), solved)

        x = inputs[layer]
        check_close(f"layer {i}: A = mean x xᵀ", A, x.T @ x / x.shape[0])
        # the input factor does not depend on how the output factor was obtained
        check_close(f"layer {i}: KFAC and KFLR share A", A, layer.weight.kflr[1])

    # exact output factor of the last layer: Σ_n Hessian of the loss w.r.t. the logits
    last = linears[-1]
    hessian = torch.autograd.functional.hessian(lambda z: lossfunc(z, y), logits.detach())
    n = logits.shape[0]
    G_exact = sum(hessian[k, :, k, :] for k in range(n))
    check_close("last layer: KFLR G = Σ_n ∇²_logits loss", last.weight.kflr[0], G_exact)

    with torch.no_grad():
        for p, delta in zip([p for m in linears for p in (m.weight, m.bias)], deltas):
            p -= args.lr * delta
        new_loss = lossfunc(model(X), y)
    print(f"loss before the step {loss.item():.4f}, after {new_loss.item():.4f}")
    return {"loss_before": loss.detach(), "loss_after": new_loss}


if __name__ == "__main__":
    main()
