"""Distributed sweeps: gloo processes, each sweeping an uneven shard, against one process.

Each test spawns its processes once and runs every check of a scenario in them
(curvature_distributed_checks.py), reported by name and rank.
"""

from __future__ import annotations

import multiprocessing

import curvature_distributed_checks
import pytest
import torch
import torch.multiprocessing as mp
from curvature_problems import PROBLEMS
from test_distributed import assert_passed, free_port

from backpack.curvature import GGN, accumulate
from backpack.extensions import DiagGGNExact

pytestmark = pytest.mark.cpu_only

multiprocessing.set_forkserver_preload(["curvature_distributed_checks"])


def spawn(world: int, tmp_path, limit: float = 240.0) -> dict:
    import json
    import time

    context = mp.start_processes(
        curvature_distributed_checks.worker,
        args=(world, free_port(), "main", str(tmp_path)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + limit
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                break
    except Exception as err:  # a worker died: report what the others wrote
        print(err)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    results: dict[str, dict[int, str | None]] = {}
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        found = json.loads(path.read_text()) if path.exists() else {}
        for name, _ in curvature_distributed_checks.SCENARIOS["main"]:
            results.setdefault(name, {})[rank] = found.get(name, "no result (hang or crash)")
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_sweeps(world, tmp_path):
    """Every quantity and operator over uneven shards equals one process's over all data."""
    assert_passed(spawn(world, tmp_path))


def test_without_torch_distributed():
    """Not initialised: None sweeps locally, True says what is missing, others are refused."""
    problem = PROBLEMS["mlp_ce"]
    data = problem.batches([5, 6])
    lossfunc = problem.make_loss("mean")
    result = accumulate(problem.model(), lossfunc, data, DiagGGNExact())
    assert result.ranks == 1
    with pytest.raises(RuntimeError, match="init_process_group"):
        accumulate(problem.model(), lossfunc, data, DiagGGNExact(), distributed=True)
    with pytest.raises(RuntimeError, match="init_process_group"):
        GGN(problem.model(), lossfunc, data, distributed=True)
    with pytest.raises(TypeError, match="distributed"):
        accumulate(problem.model(), lossfunc, data, DiagGGNExact(), distributed="auto")
    assert not torch.distributed.is_initialized()
