"""Residual networks: three ways to write them, all with per-sample gradients and curvature.

1. **Your own forward.** The skip connection is an addition in `forward`. backpack follows the
   gradient through it with autograd, so `BatchGrad` *and* `DiagGGNExact` work as they are.
2. **Containers of modules.** `Parallel` and `SumModule` from `backpack.custom_module` express
   the same block as nested modules, inside `nn.Sequential`.
3. **The converter.** `extend(model, use_converter=True)` rewrites a model with functional
   nonlinearities (here `torch.tanh`) into a graph of modules, which the exact-Hessian
   extension `DiagHessian` needs.

Every result is compared with brute-force autograd on a few entries.

    python examples/example_diag_ggn_resnet.py --batch-size 16 --channels 3
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.functional import cross_entropy, relu

from backpack import backpack, extend
from backpack.custom_module.branching import Parallel, SumModule
from backpack.custom_module.graph_utils import BackpackTracer
from backpack.extensions import BatchGrad, DiagGGNExact, DiagHessian
from backpack.utils.examples import autograd_diag_ggn_exact, load_one_batch_mnist


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--channels", type=int, default=3, help="hidden channels")
    parser.add_argument("--entries", type=int, default=10, help="diagonal entries to check")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class MyResNet(nn.Module):
    """conv -> act -> (conv -> act) + shortcut -> linear, with a 1x1-conv shortcut."""

    def __init__(self, channels: int, act: Callable[[Tensor], Tensor] = relu) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.shortcut = nn.Conv2d(1, channels, kernel_size=1)
        self.linear = nn.Linear(channels * 28 * 28, 10)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        residual = self.shortcut(x)
        x = self.conv2(self.act(self.conv1(x)))
        x = x + residual
        return self.linear(x.flatten(start_dim=1))


def flat_diag(model: nn.Module, savefield: str) -> Tensor:
    return torch.cat([getattr(p, savefield).flatten() for p in model.parameters()])


def check_close(what: str, actual: Tensor, expected: Tensor, rtol: float = 1e-4) -> None:
    scale = expected.abs().max().clamp_min(1e-12)
    error = (actual - expected).abs().max() / scale
    if not error < rtol:
        raise AssertionError(f"{what}: relative error {error:.2e}")
    print(f"  {what}: matches autograd (relative error {error:.1e})")


def autograd_hessian_diag(loss: Tensor, params: list[Tensor], idx: Tensor) -> Tensor:
    """Selected entries of the Hessian diagonal, one double-backward pass per entry."""
    grads = torch.autograd.grad(loss, params, create_graph=True)
    flat_grad = torch.cat([g.flatten() for g in grads])
    entries = []
    for i in idx.tolist():
        row = torch.autograd.grad(flat_grad[i], params, retain_graph=True)
        entries.append(torch.cat([r.flatten() for r in row])[i])
    return torch.stack(entries)


def main(argv: list[str] | None = None) -> dict[str, Tensor]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    X, y = load_one_batch_mnist(batch_size=args.batch_size)
    lossfunc = extend(nn.CrossEntropyLoss())
    results = {}

    # 1. custom forward: first- and second-order extensions without any rewriting
    print("1. ResNet with its own forward")
    model = extend(MyResNet(args.channels))
    with backpack(BatchGrad(), DiagGGNExact()):
        lossfunc(model(X), y).backward()

    n = 1  # one sample's gradient by plain autograd (the loss of one sample, scaled by 1/N)
    loss_n = cross_entropy(model(X[n : n + 1]), y[n : n + 1]) / args.batch_size
    grads_n = torch.autograd.grad(loss_n, list(model.parameters()))
    check_close(
        f"grad_batch[{n}]",
        torch.cat([p.grad_batch[n].flatten() for p in model.parameters()]),
        torch.cat([g.flatten() for g in grads_n]),
    )
    diag = flat_diag(model, "diag_ggn_exact")
    idx = torch.linspace(0, diag.numel() - 1, args.entries).long()
    reference = autograd_diag_ggn_exact(X, y, model, lossfunc, idx=idx)
    check_close("diag_ggn_exact", diag[idx], reference)
    results["custom_forward"] = diag

    # 2. the same architecture from modules only
    print("2. ResNet from Parallel/SumModule containers")
    c = args.channels
    container = extend(
        nn.Sequential(
            Parallel(
                nn.Conv2d(1, c, kernel_size=1),  # shortcut
                nn.Sequential(
                    nn.Conv2d(1, c, kernel_size=3, padding=1),
                    nn.ReLU(),
                    nn.Conv2d(c, c, kernel_size=3, padding=1),
                ),
                merge_module=SumModule(),
            ),
            nn.Flatten(),
            nn.Linear(c * 28 * 28, 10),
        )
    )
    with backpack(DiagGGNExact()):
        lossfunc(container(X), y).backward()
    diag = flat_diag(container, "diag_ggn_exact")
    idx = torch.linspace(0, diag.numel() - 1, args.entries).long()
    reference = autograd_diag_ggn_exact(X, y, container, lossfunc, idx=idx)
    check_close("diag_ggn_exact", diag[idx], reference)
    results["containers"] = diag

    # 3. functional tanh: DiagHessian needs modules, the converter provides them
    print("3. ResNet with torch.tanh, converted for DiagHessian")
    original = MyResNet(args.channels, act=torch.tanh)
    converted = extend(original, use_converter=True)
    modules = [node.target for node in BackpackTracer().trace(converted).nodes]
    print(f"  converted graph: {' -> '.join(str(m) for m in modules)}")
    with backpack(DiagHessian(), DiagGGNExact()):
        lossfunc(converted(X), y).backward()
    diag_h = flat_diag(converted, "diag_h")
    idx = torch.linspace(0, diag_h.numel() - 1, args.entries).long()
    params = list(converted.parameters())
    reference = autograd_hessian_diag(lossfunc(converted(X), y), params, idx)
    check_close("diag_h", diag_h[idx], reference)
    ggn_gap = (diag_h - flat_diag(converted, "diag_ggn_exact")).abs().max().item()
    print(f"  largest |Hessian - GGN| on the diagonal: {ggn_gap:.2e} (tanh's curvature)")
    results["converted_diag_h"] = diag_h
    return results


if __name__ == "__main__":
    main()
