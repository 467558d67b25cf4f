"""torch.distributed: gloo processes on the CPU against one process on the concatenated batch.

Each test spawns its processes once and runs a whole scenario of checks in them
(tests/distributed_checks.py); every check is reported by name and rank. The torchrun example
(examples/example_distributed.py) runs in tests/test_examples.py.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time
from collections.abc import Callable
from pathlib import Path

import distributed_checks
import pytest
import torch
import torch.multiprocessing as mp

from backpack import backpack
from backpack.extensions import BatchGrad

pytestmark = pytest.mark.cpu_only


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Workers fork from a clean server process that imported torch, backpack and the checks once
# (safer than forking this multi-threaded test process, faster than importing in each worker).
multiprocessing.set_forkserver_preload(["distributed_checks"])


def spawn_workers(
    worker: Callable, args: tuple, names: list[str], world: int, tmp_path: Path, limit: float
) -> dict:
    """Run `worker(rank, world, port, *args, outdir)` on `world` gloo processes (forkserver);
    {check name: {rank: failure or None}} from the files the workers wrote."""
    context = mp.start_processes(
        worker,
        args=(world, free_port(), *args, str(tmp_path)),
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
        for name in names:
            results.setdefault(name, {})[rank] = found.get(name, "no result (hang or crash)")
    return results


def spawn(scenario: str, world: int, tmp_path: Path, limit: float = 90.0) -> dict:
    """Run a scenario on `world` gloo processes; {check: {rank: failure or None}}."""
    names = [name for name, _ in distributed_checks.SCENARIOS[scenario]]
    return spawn_workers(distributed_checks.worker, (scenario,), names, world, tmp_path, limit)


def assert_passed(results: dict) -> None:
    failures = [
        f"--- {name} on rank {rank}:\n{error}"
        for name, per_rank in results.items()
        for rank, error in per_rank.items()
        if error is not None
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 3])
def test_global_quantities(world, tmp_path):
    """Every quantity, both reductions, uneven shards, no_sync, errors agreed between ranks."""
    assert_passed(spawn("main", world, tmp_path))


def test_errors_do_not_hang(tmp_path):
    assert_passed(spawn("errors", 2, tmp_path))


# the forgotten-extend warning (asserted in test_engine_training_loops): nothing is extended
@pytest.mark.filterwarnings("ignore:.*saw no extended module take part:UserWarning")
def test_without_torch_distributed():
    """Not initialised: sync=None does nothing, sync=True says what is missing."""
    assert not torch.distributed.is_initialized()
    with backpack(BatchGrad()) as ctx:
        assert ctx._engine.sync is None
        ctx._engine.passes = 1  # nothing ran: no "nothing extended" warning
    with pytest.raises(RuntimeError, match="init_process_group"), backpack(BatchGrad(), sync=True):
        pass
    with pytest.raises(TypeError, match="DistributedDataParallel"), backpack(sync="yes"):
        pass
