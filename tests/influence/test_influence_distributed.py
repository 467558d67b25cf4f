"""`influence.fit` under torch.distributed: each rank fits on its own shard of the training set
(gloo, uneven shards) and gets the whole set's fit; its scores are its shard's columns."""

from __future__ import annotations

import json
import multiprocessing
import time

import influence_distributed_checks
import pytest
import torch.multiprocessing as mp
from test_distributed import assert_passed, free_port

pytestmark = pytest.mark.cpu_only

multiprocessing.set_forkserver_preload(["influence_distributed_checks"])


def spawn(world: int, tmp_path, limit: float = 300.0) -> dict:
    context = mp.start_processes(
        influence_distributed_checks.worker,
        args=(world, free_port(), str(tmp_path)),
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
        for case in influence_distributed_checks.CASES:
            label = "-".join(case)
            results.setdefault(label, {})[rank] = found.get(label, "no result (hang or crash)")
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_fit_over_sharded_training_data(world, tmp_path):
    assert_passed(spawn(world, tmp_path))
