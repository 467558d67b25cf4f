"""Per-sample gradients + squared norms: dedicated rules against the torch.func fallback.

`python -m benchmarks.rule_vs_fallback [--threads 2]` times a forward + backward with
`BatchGrad(), BatchL2Grad()` (MSE loss, float32) for
- a lone `LayerNorm` and a Linear -> LayerNorm -> Linear block on `[N=32, T=64, D=128]`;
- one `nn.MultiheadAttention(128, 4, batch_first=True)` self-attention layer on
  `[N=16, T=64, E=128]`, with `need_weights=False` (the SDPA path transformer layers take) and
  with the default `need_weights=True`,
once with backpack's rule and once with the rule unregistered (the generic torch.func path), and
prints each as a multiple of a plain forward + backward of the same model. Rows are interleaved
and the minimum over rounds is kept, so that noise from other processes affects all of them
alike. Not part of `benchmarks.run`.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from backpack import backpack, extend
from backpack.extensions import BatchGrad, BatchL2Grad
from backpack.rules import base


class SelfAttention(nn.Module):
    """y = MultiheadAttention(x, x, x)[0]."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(128, 4, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=self.need_weights)[0]


#: label -> (model builder, input shape, module class whose rule is compared)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], type[nn.Module]]] = {
    "layernorm": (lambda: nn.Sequential(nn.LayerNorm(128)), (32, 64, 128), nn.LayerNorm),
    "block": (
        lambda: nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.Linear(128, 128)),
        (32, 64, 128),
        nn.LayerNorm,
    ),
    "attention, need_weights=False": (
        lambda: SelfAttention(False),
        (16, 64, 128),
        nn.MultiheadAttention,
    ),
    "attention, need_weights=True": (
        lambda: SelfAttention(True),
        (16, 64, 128),
        nn.MultiheadAttention,
    ),
}


def _best(fn: Callable[[], None], reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument("--reps", type=int, default=10, help="repeats per round (default: 10)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lossfunc = nn.MSELoss()
    for label, (make, shape, cls) in CASES.items():
        gen = torch.Generator().manual_seed(0)
        x, target = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        torch.manual_seed(0)
        plain_model, model = make(), make()
        model.load_state_dict(plain_model.state_dict())
        extend(model)

        def plain(plain_model: nn.Module = plain_model, x=x, target=target) -> None:
            plain_model.zero_grad()
            lossfunc(plain_model(x), target).backward()

        def extended(model: nn.Module = model, x=x, target=target) -> None:
            model.zero_grad()
            with backpack(BatchGrad(), BatchL2Grad()):
                lossfunc(model(x), target).backward()

        rule = base._RULES[cls]
        times: dict[str, list[float]] = {"plain": [], "rule": [], "torch.func": []}
        try:
            for _ in range(args.rounds):
                times["plain"].append(_best(plain, args.reps))
                times["rule"].append(_best(extended, args.reps))
                del base._RULES[cls]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "no dedicated rule", vmap fallbacks
                    times["torch.func"].append(_best(extended, args.reps))
                base._RULES[cls] = rule
        finally:
            base._RULES[cls] = rule
        p, r, f = (min(times[k]) for k in ("plain", "rule", "torch.func"))
        print(
            f"{label:30s} plain {p * 1e3:7.2f} ms | rule {r * 1e3:7.2f} ms ({r / p:.2f}x) | "
            f"torch.func {f * 1e3:7.2f} ms ({f / p:.2f}x)"
        )


if __name__ == "__main__":
    main()
