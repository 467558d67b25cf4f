"""Self-attention per-sample gradients + squared norms: the rule against the torch.func fallback.

`python -m benchmarks.attention [--threads 2]` times a forward + backward with
`BatchGrad(), BatchL2Grad()` on float32 inputs `[N=16, T=64, E=128]` through one
`nn.MultiheadAttention(128, 4, batch_first=True)` self-attention layer (MSE loss), with
`need_weights=False` (the SDPA path transformer layers take) and with the default
`need_weights=True`, once with backpack's rule and once with the rule unregistered (the generic
torch.func path, which then also covers `out_proj`), and prints each as a multiple of a plain
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

N, T, E, HEADS = 16, 64, 128, 4


class SelfAttention(nn.Module):
    """y = MultiheadAttention(x, x, x)[0]."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=self.need_weights)[0]


def _best(fn, reps: int = 10) -> float:
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
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(N, T, E, generator=gen), torch.randn(N, T, E, generator=gen)
    lossfunc = nn.MSELoss()
    rule = base._RULES[nn.MultiheadAttention]
    for need_weights in (False, True):
        torch.manual_seed(0)
        plain_model, model = SelfAttention(need_weights), SelfAttention(need_weights)
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
                times["plain"].append(_best(plain, args.reps))
                times["rule"].append(_best(extended, args.reps))
                del base._RULES[nn.MultiheadAttention]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "no dedicated rule", vmap fallbacks
                    times["torch.func"].append(_best(extended, args.reps))
                base._RULES[nn.MultiheadAttention] = rule
        finally:
            base._RULES[nn.MultiheadAttention] = rule
        p, r, f = (min(times[k]) for k in ("plain", "rule", "torch.func"))
        label = f"need_weights={need_weights!s:5s}"
        print(
            f"{label} plain {p * 1e3:7.2f} ms | rule {r * 1e3:7.2f} ms ({r / p:.2f}x) | "
            f"torch.func {f * 1e3:7.2f} ms ({f / p:.2f}x)"
        )


if __name__ == "__main__":
    main()
