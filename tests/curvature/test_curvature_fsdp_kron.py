"""Kronecker factors and the KFAC/EKFAC operators on FSDP2 models: gloo processes, each
sweeping an uneven shard, against one process over all data (curvature_fsdp_kron_checks.py)."""

from __future__ import annotations

import multiprocessing

import curvature_fsdp_kron_checks
import pytest
from test_distributed import assert_passed, spawn_workers

pytestmark = pytest.mark.cpu_only

multiprocessing.set_forkserver_preload(["curvature_fsdp_kron_checks"])


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_kronecker(world, tmp_path):
    """Factors on their owners and every KFAC/EKFAC result equal one process's over all data."""
    names = [name for name, _ in curvature_fsdp_kron_checks.SCENARIOS["main"]]
    worker = curvature_fsdp_kron_checks.worker
    assert_passed(spawn_workers(worker, ("main",), names, world, tmp_path, 240.0))
