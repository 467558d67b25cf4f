"""Per-sample Jacobians of the model output: one backward (`backpack.jacobians`) against C passes.

`python -m benchmarks.jacobians [--threads 2] [--output results.md]` times, for C = 10 outputs,
- "C passes": what a GLM predictive's BatchGrad backend does, one forward and one backward with
  `BatchGrad()` on `out[:, c].sum()` per output c, the per-sample gradients flattened and
  stacked into `J [N, C, P]`;
- "one backward": `backpack.jacobians(model, X, flatten=True)`, the same `J` from one forward and
  one backward (`BatchJacobian`: the C columns travel together);
- "plain": one forward and backward of `out.sum()` without backpack, for scale;
- "floor": "plain" plus writing a fresh `[N, C, P]` tensor once, what any method returning `J`
  must at least do,
on the tour's MLP and CNN (`python -m backpack`; float32, CPU, N = 64). The two results are
checked to agree. Variants are interleaved round by round (the best of `--reps` runs each)
and each round's ratio
one backward / C passes is kept, so that noise from other processes affects both alike; the
table reports the median over rounds against the target ratio 2/C. Not part of
`benchmarks.run`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

import backpack as bp
from backpack import backpack, extend, tour
from backpack.extensions import BatchGrad

#: number of outputs (classes)
C = 10


def mlp(tiny: bool) -> tuple[nn.Module, Tensor]:
    """The tour's MLP (Flatten, 784-64-10 with ReLU) on N=64 digit-shaped inputs (tiny: N=3)."""
    return tour.mlp(), torch.randn(3 if tiny else 64, 1, 28, 28)


def cnn(tiny: bool) -> tuple[nn.Module, Tensor]:
    """The tour's CNN (Conv2d 1->8, ReLU, MaxPool2d, Linear 1352->10) on N=64 digit-shaped
    inputs (tiny: N=3)."""
    return tour.cnn(), torch.randn(3 if tiny else 64, 1, 28, 28)


MODELS: dict[str, Callable[[bool], tuple[nn.Module, Tensor]]] = {"mlp": mlp, "cnn": cnn}


def c_passes(model: nn.Module, x: Tensor) -> Tensor:
    """`[N, C, P]` from one BatchGrad pass per output."""
    rows = []
    for c in range(C):
        model.zero_grad()
        out = model(x)
        with backpack(BatchGrad()):
            out[:, c].sum().backward()
        rows.append(torch.cat([p.grad_batch.flatten(1) for p in model.parameters()], 1))
        for p in model.parameters():
            del p.grad_batch
    return torch.stack(rows, 1)


def one_backward(model: nn.Module, x: Tensor) -> Tensor:
    """`[N, C, P]` from `backpack.jacobians` (one backward)."""
    return bp.jacobians(model, x, flatten=True)[1]


def plain(model: nn.Module, x: Tensor) -> None:
    """One forward and backward without backpack."""
    model.zero_grad()
    model(x).sum().backward()


def floor(model: nn.Module, x: Tensor, numel: int) -> Tensor:
    """A plain step plus writing a fresh tensor of `J`'s size once."""
    plain(model, x)
    return torch.ones(numel)


#: the clock of `_best`: wall time, or with `--clock cpu` this process's CPU time (kernel time
#: included: page faults of fresh memory count), less disturbed by other processes
CLOCK: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCK["wall"]


def _best(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = _clock()
        fn()
        times.append(_clock() - start)
    return min(times)


def measure(name: str, tiny: bool, rounds: int, reps: int) -> dict[str, float]:
    """Times (seconds, best per round, median over rounds) and the median round ratio."""
    torch.manual_seed(0)
    model, x = MODELS[name](tiny)
    extend(model)
    expected, got = c_passes(model, x), one_backward(model, x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    times: dict[str, list[float]] = {"plain": [], "floor": [], "passes": [], "one": []}
    ratios = []
    for _ in range(rounds):
        times["plain"].append(_best(lambda: plain(model, x), reps))
        times["floor"].append(_best(lambda: floor(model, x, expected.numel()), reps))
        times["passes"].append(_best(lambda: c_passes(model, x), reps))
        times["one"].append(_best(lambda: one_backward(model, x), reps))
        ratios.append(times["one"][-1] / times["passes"][-1])
    result = {k: statistics.median(v) for k, v in times.items()}
    result["ratio"] = statistics.median(ratios)
    result["n"] = x.shape[0]
    result["params"] = sum(p.numel() for p in model.parameters())
    return result


def table(results: dict[str, dict[str, float]]) -> str:
    """The markdown table of `measure`'s results."""
    target = 2 / C
    lines = [
        "| model | N | P | plain fwd+bwd | floor: plain + writing J once "
        "| C = 10 BatchGrad passes | one backward "
        f"| ratio one / C passes | target ≤ 2/C = {target:.2f} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        met = "✓" if r["ratio"] <= target else "✗"
        lines.append(
            f"| {name} | {int(r['n'])} | {int(r['params'])} | {r['plain'] * 1e3:.2f} ms "
            f"| {r['floor'] * 1e3:.2f} ms | {r['passes'] * 1e3:.2f} ms "
            f"| {r['one'] * 1e3:.2f} ms | {r['ratio']:.3f} | {met} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark, print (and with `--output` write) the markdown report."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument("--reps", type=int, default=5, help="best of this many (default: 5)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--output", type=Path, help="also write the report to this file")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall", help="wall or cpu time")
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    results = {name: measure(name, args.tiny, args.rounds, args.reps) for name in MODELS}
    report = "\n".join(
        [
            "# Per-sample Jacobians: one backward against C BatchGrad passes",
            "",
            f"`python -m benchmarks.jacobians --threads {args.threads} --rounds {args.rounds} "
            f"--reps {args.reps} --clock {args.clock}`{' --tiny' if args.tiny else ''}: "
            "float32, CPU "
            f"({platform.processor() or platform.machine()}, {args.threads} threads), "
            f"torch {torch.__version__}. Times are the median over rounds of the best of "
            "`--reps` runs; the ratio is the median of each round's ratio (variants "
            "interleaved). Both give the same `J [N, C, P]` (checked).",
            "",
            table(results),
            "",
        ]
    )
    print(report)
    if args.output is not None:
        args.output.write_text(report)
    return report


if __name__ == "__main__":
    main()
