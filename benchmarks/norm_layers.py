"""LayerNorm per-sample gradients + squared norms: dedicated rule against the torch.func fallback.

`python -m benchmarks.norm_layers [--threads 2]` times a forward + backward with
`BatchGrad(), BatchL2Grad()` on float32 inputs `[N=32, T=64, D=128]` for a lone LayerNorm and a
Linear -> LayerNorm -> Linear block (MSE loss), once with backpack's LayerNorm rule and once with
the rule unregistered (the generic torch.func path), and prints each as a multiple of a plain
forward + backward of the same model. Rows are interleaved and the minimum over rounds is kept,
so that noise from other processes affects all of them alike. Not part of `benchmarks.run`.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn

from backpack import backpack, extend
from backpack.extensions import BatchGrad, BatchL2Grad
from backpack.rules import base

N, T, D = 32, 64, 128


def _make(kind: str) -> nn.Module:
    if kind == "layernorm":
        return nn.Sequential(nn.LayerNorm(D))
    return nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, D))


def _best(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(N, T, D, generator=gen), torch.randn(N, T, D, generator=gen)
    lossfunc = nn.MSELoss()
    rule = base._RULES[nn.LayerNorm]
    for kind in ("layernorm", "block"):
        torch.manual_seed(0)
        plain_model, model = _make(kind), _make(kind)
        model.load_state_dict(plain_model.state_dict())
        extend(model)

        def plain(plain_model: nn.Module = plain_model) -> None:
            plain_model.zero_grad()
            lossfunc(plain_model(x), target).backward()

        def extended(model: nn.Module = model) -> None:
            model.zero_grad()
            with backpack(BatchGrad(), BatchL2Grad()):
                lossfunc(model(x), target).backward()

        times: dict[str, list[float]] = {"plain": [], "rule": [], "torch.func": []}
        try:
            for _ in range(args.rounds):
                times["plain"].append(_best(plain))
                times["rule"].append(_best(extended))
                del base._RULES[nn.LayerNorm]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "no dedicated rule" notice
                    times["torch.func"].append(_best(extended))
                base._RULES[nn.LayerNorm] = rule
        finally:
            base._RULES[nn.LayerNorm] = rule
        p, r, f = (min(times[k]) for k in ("plain", "rule", "torch.func"))
        print(
            f"{kind:9s} plain {p * 1e3:6.2f} ms | rule {r * 1e3:6.2f} ms ({r / p:.2f}x) | "
            f"torch.func {f * 1e3:6.2f} ms ({f / p:.2f}x)"
        )


if __name__ == "__main__":
    main()
