"""A/B of two checkouts of backpack in one process: ratio of each extension to a plain step.

`python -m benchmarks.ab_versions OLD_TREE NEW_TREE [--problems ...] [--rows ...] [--rounds R]`
loads both packages (swapping `sys.modules` between them, outside the timed region) and times
them interleaved, so that both see the same machine load. Prints, per problem and row, the
median ratio (extension step / plain step) of each tree and their quotient.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from benchmarks import problems as P

_NAMES = ("backpack",)


def _own(name: str) -> bool:
    return name in _NAMES or name.startswith("backpack.")


def _load(path: str) -> dict:
    for key in [k for k in sys.modules if _own(k)]:
        del sys.modules[key]
    sys.path.insert(0, path)
    try:
        import backpack  # noqa: F401
        import backpack.extensions  # noqa: F401
    finally:
        sys.path.remove(path)
    return {k: v for k, v in sys.modules.items() if _own(k)}


def _activate(mods: dict) -> None:
    for key in [k for k in sys.modules if _own(k)]:
        del sys.modules[key]
    sys.modules.update(mods)


def _step(model, x, y, lossfunc, context) -> float:
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    with context():
        lossfunc(model(x), y).backward()
    return time.perf_counter() - start


def main() -> None:
    """Run the interleaved A/B and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trees", nargs=2)
    parser.add_argument("--problems", nargs="+", default=["mlp", "3c3d", "resnet_small", "lstm"])
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["none", "BatchGrad", "BatchL2Grad", "SumGradSquared", "Variance", "BatchDotGrad"],
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    versions = [_load(tree) for tree in args.trees]
    print(f"| problem | row | {args.trees[0]} | {args.trees[1]} | new/old |")
    print("|---|---|---|---|---|")
    for name in args.problems:
        model, x, y, lossfunc = P.build(name)
        setups = []
        for mods in versions:
            _activate(mods)
            bp = mods["backpack"]
            ext_model = bp.extend(copy.deepcopy(model))
            ext_loss = bp.extend(copy.deepcopy(lossfunc))
            setups.append((mods, bp, ext_model, ext_loss))
        plain = copy.deepcopy(model)
        for row in args.rows:
            ratios: list[list[float]] = [[], []]
            for rnd in range(args.rounds):
                order = (0, 1) if rnd % 2 == 0 else (1, 0)
                for i in order:
                    mods, bp, ext_model, ext_loss = setups[i]
                    _activate(mods)
                    exts = [] if row == "none" else [getattr(mods["backpack.extensions"], row)()]

                    def context(bp=bp, exts=exts):
                        return bp.backpack(*exts)

                    base = min(_step(plain, x, y, lossfunc, _null) for _ in range(2))
                    ext = min(_step(ext_model, x, y, ext_loss, context) for _ in range(2))
                    ratios[i].append(ext / base)
            a, b = (statistics.median(r) for r in ratios)
            print(f"| {name} | {row} | {a:.3f} | {b:.3f} | {b / a:.3f} |", flush=True)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
