"""Kronecker factors and the KFAC/EKFAC operators on FSDP2 models: gloo processes, each
sweeping an uneven shard, against one process over all data (curvature_fsdp_kron_checks.py)."""

from __future__ import annotations

import multiprocessing

import curvature_fsdp_kron_checks
import pytest
from test_distributed import assert_passed, spawn_workers

from backpack.curvature._fsdp import assign_owners

pytestmark = pytest.mark.cpu_only

multiprocessing.set_forkserver_preload(["curvature_fsdp_kron_checks"])


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_kronecker(world, tmp_path):
    """Factors on their owners and every KFAC/EKFAC result equal one process's over all data."""
    names = [name for name, _ in curvature_fsdp_kron_checks.SCENARIOS["main"]]
    worker = curvature_fsdp_kron_checks.worker
    assert_passed(spawn_workers(worker, ("main",), names, world, tmp_path, 240.0))


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_ekfac(world, tmp_path):
    """EKFAC's corrected eigenvalues on their owners and every result equal one process's."""
    names = [name for name, _ in curvature_fsdp_kron_checks.SCENARIOS["ekfac"]]
    worker = curvature_fsdp_kron_checks.worker
    assert_passed(spawn_workers(worker, ("ekfac",), names, world, tmp_path, 240.0))


def test_assign_owners_balances_bytes():
    """Largest first to the least loaded rank: deterministic, every rank within one block."""
    sizes = {"a": 10, "b": 40, "c": 25, "d": 25, "e": 5, "f": 1}
    owners = assign_owners(sizes, 3)
    assert list(owners) == list(sizes)
    assert owners == {"b": 0, "c": 1, "d": 2, "a": 1, "e": 2, "f": 2}
    load = [sum(s for n, s in sizes.items() if owners[n] == r) for r in range(3)]
    assert max(load) - min(load) <= max(sizes.values())
    assert assign_owners(sizes, 1) == dict.fromkeys(sizes, 0)
    assert set(assign_owners({"x": 1}, 4).values()) == {0}


def test_hsdp_kronecker(tmp_path):
    """Kronecker factors, KFAC and EKFAC on HSDP's 2-D meshes of 4 ranks: one process's."""
    names = [name for name, _ in curvature_fsdp_kron_checks.SCENARIOS["hsdp"]]
    worker = curvature_fsdp_kron_checks.worker
    assert_passed(spawn_workers(worker, ("hsdp",), names, 4, tmp_path, 600.0))
