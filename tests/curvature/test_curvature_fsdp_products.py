"""Curvature products on models sharded with FSDP2: gloo processes against one process.

Each test spawns its processes once and runs every check of fsdp_product_checks.py in them,
reported by name and rank.
"""

from __future__ import annotations

import multiprocessing

import fsdp_product_checks
import pytest
from test_distributed import assert_passed, spawn_workers

pytestmark = pytest.mark.cpu_only

multiprocessing.set_forkserver_preload(["fsdp_product_checks"])


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_products(world, tmp_path):
    """Products, diagonal, trace, eigvalsh, CG and estimators equal one process's rows."""
    names = [name for name, _ in fsdp_product_checks.SCENARIOS["main"]]
    worker = fsdp_product_checks.worker
    assert_passed(spawn_workers(worker, ("main",), names, world, tmp_path, 400.0))


def test_hsdp_products(tmp_path):
    """On HSDP's 2-D meshes of 4 ranks ((2, 2) and (4, 1)): every replica group holds the same
    rows, and products, estimators and TSQR count each row once: one process's numbers."""
    names = [name for name, _ in fsdp_product_checks.SCENARIOS["hsdp"]]
    worker = fsdp_product_checks.worker
    assert_passed(spawn_workers(worker, ("hsdp",), names, 4, tmp_path, 600.0))
