"""Checks run inside gloo processes by test_influence_distributed.py (not collected by pytest).

Each rank fits on its own shard of the training set (uneven numbers and sizes of batches) with
`distributed=True` and compares with one process fitting on the whole set (`distributed=False`,
in the same worker): the same blocks and damping on every rank, and the scores of its shard are
that shard's columns of the whole set's scores. Each rank writes every check's failure (or
None) to `outdir/rank<r>.json`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from influence_problems import PROBLEMS

from backpack import distributed
from backpack.influence import fit

#: batch sizes of each rank's shard (11 training examples in all)
SHARDS = {2: [[3, 4], [1, 2, 1]], 3: [[2, 1, 3], [4], [1]]}
CASES = [
    (name, strategy, fisher)
    for name in ("mlp", "cnn", "tokens")
    for strategy in ("diagonal", "kfac", "ekfac")
    for fisher in ("empirical", "type-2")
]


def shard(problem, rank: int, world: int) -> tuple[list, slice]:
    sizes = SHARDS[world]
    start = sum(sum(s) for s in sizes[:rank])
    batches, at = [], start
    for size in sizes[rank]:
        batches.append((problem.X[at : at + size], problem.targets(problem.Y[at : at + size])))
        at += size
    return batches, slice(start, at)


def check(name: str, strategy: str, fisher: str, rank: int, world: int) -> None:
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    local, columns = shard(problem, rank, world)
    ours = fit(model, lossfunc, local, strategy, fisher=fisher, distributed=True)
    whole = fit(model, lossfunc, problem.train(), strategy, fisher=fisher, distributed=False)
    assert ours.info["num_samples"] == whole.info["num_samples"] == problem.X.shape[0]
    for a, b in zip(ours.blocks, whole.blocks):
        torch.testing.assert_close(a.values, b.values, rtol=1e-9, atol=1e-12, msg=a.name)
        assert abs(ours.damping[a.name] - whole.damping[b.name]) <= 1e-9 * whole.damping[b.name]
    query = problem.query()
    expected = whole.scores(query, problem.train())[:, columns]
    torch.testing.assert_close(ours.scores(query, local), expected, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(
        ours.self_scores(local), whole.self_scores(problem.train())[columns], rtol=1e-8, atol=1e-10
    )


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    distributed.TIMEOUT_S = 60.0
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    results: dict[str, str | None] = {}
    path = os.path.join(outdir, f"rank{rank}.json")
    for case in CASES:
        label = "-".join(case)
        try:
            check(*case, rank, world)
            results[label] = None
        except Exception:  # noqa: BLE001 - every failure is reported by name
            results[label] = traceback.format_exc(limit=8)[-3000:]
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)
    sys.stdout.flush()
    os._exit(0)
