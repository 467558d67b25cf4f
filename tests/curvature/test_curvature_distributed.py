"""Distributed sweeps: gloo processes, each sweeping an uneven shard, against one process.

Each test spawns its processes once and runs every check of a scenario in them
(curvature_distributed_checks.py), reported by name and rank.
"""

from __future__ import annotations

import multiprocessing

import curvature_distributed_checks
import pytest
import torch
from curvature_problems import PROBLEMS
from test_distributed import assert_passed, spawn_workers

from backpack.curvature import GGN, accumulate
from backpack.extensions import DiagGGNExact

pytestmark = pytest.mark.cpu_only

multiprocessing.set_forkserver_preload(["curvature_distributed_checks"])


def spawn(world: int, tmp_path, limit: float = 240.0) -> dict:
    names = [name for name, _ in curvature_distributed_checks.SCENARIOS["main"]]
    worker = curvature_distributed_checks.worker
    return spawn_workers(worker, ("main",), names, world, tmp_path, limit)


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_sweeps(world, tmp_path):
    """Every quantity and operator over uneven shards equals one process's over all data."""
    assert_passed(spawn(world, tmp_path))


def test_hsdp_sweeps(tmp_path):
    """accumulate on HSDP's 2-D meshes of 4 ranks: each rank's chunk equals one process's."""
    names = [name for name, _ in curvature_distributed_checks.SCENARIOS["hsdp"]]
    worker = curvature_distributed_checks.worker
    assert_passed(spawn_workers(worker, ("hsdp",), names, 4, tmp_path, 600.0))


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
