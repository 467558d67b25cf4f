"""`influence.fit` under torch.distributed: each rank fits on its own shard of the training set
(gloo, uneven shards) and gets the whole set's fit; its scores are its shard's columns."""

from __future__ import annotations

import multiprocessing

import influence_distributed_checks
import pytest
from test_distributed import assert_passed, spawn_workers

pytestmark = pytest.mark.cpu_only

multiprocessing.set_forkserver_preload(["influence_distributed_checks"])


def spawn(world: int, tmp_path, limit: float = 300.0) -> dict:
    names = [name for name, _ in influence_distributed_checks.CHECKS]
    worker = influence_distributed_checks.worker
    return spawn_workers(worker, (), names, world, tmp_path, limit)


@pytest.mark.parametrize("world", [2, 3])
def test_fit_over_sharded_training_data(world, tmp_path):
    assert_passed(spawn(world, tmp_path))
