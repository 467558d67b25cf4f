"""Checks run inside gloo processes by test_influence_distributed.py (not collected by pytest).

Each rank fits on its own shard of the training set (uneven numbers and sizes of batches) with
`distributed=True` and compares with one process fitting on the whole set (`distributed=False`,
in the same worker): the same blocks and damping on every rank, and the scores of its shard are
that shard's columns of the whole set's scores. Each rank writes every check's failure (or
None) to `outdir/rank<r>.json`.
"""

from __future__ import annotations

from functools import partial

import torch
from distributed_checks import run_checks
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


def shard(problem, rank: int, world: int, shards=SHARDS) -> tuple[list, slice]:
    """Rank `rank`'s batches of the training set (sizes `shards[world]`) and their columns."""
    sizes = shards[world]
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
    if strategy == "kfac":  # every rank gets the whole matrix, columns in rank order
        everything = whole.scores(query, problem.train())
        torch.testing.assert_close(
            ours.scores(query, local, gather=True), everything, rtol=1e-8, atol=1e-10
        )
        torch.testing.assert_close(
            ours.self_scores(local, gather=True),
            whole.self_scores(problem.train()),
            rtol=1e-8,
            atol=1e-10,
        )
        # different query data on one rank: every rank raises instead of mixing matrices
        mine = query[:1] if rank == 0 else query
        try:
            ours.scores(mine, local, gather=True)
        except RuntimeError as err:
            assert "other dimensions" in str(err), err
        else:
            raise AssertionError("mismatched gathers were not refused")


#: `(label, check(rank, world))` of every case
CHECKS = [("-".join(case), partial(check, *case)) for case in CASES]


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    distributed.TIMEOUT_S = 60.0
    run_checks(rank, world, port, outdir, CHECKS, timeout_s=60.0)
