"""Attribution on FSDP2 models: gloo processes, each fitting and scoring its own uneven shard of
the training set, against one process over all data (influence_fsdp_checks.py)."""

from __future__ import annotations

import multiprocessing

import influence_fsdp_checks
import pytest
from test_distributed import assert_passed, spawn_workers

pytestmark = pytest.mark.cpu_only

multiprocessing.set_forkserver_preload(["influence_fsdp_checks"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", ["fits", "more"])
def test_influence_on_fsdp2(scenario, world, tmp_path):
    """Fits spread over the ranks; scores, self-scores, TracIn, save/load and scores on disk
    equal one process's; different query data and uneven batch counts raise on every rank."""
    names = [name for name, _ in influence_fsdp_checks.SCENARIOS[scenario]]
    worker = influence_fsdp_checks.worker
    assert_passed(spawn_workers(worker, (scenario,), names, world, tmp_path, 600.0))


def test_influence_on_hsdp(tmp_path):
    """Fits and scores on HSDP's (2, 2) mesh of 4 ranks equal one process's."""
    names = [name for name, _ in influence_fsdp_checks.SCENARIOS["hsdp"]]
    worker = influence_fsdp_checks.worker
    assert_passed(spawn_workers(worker, ("hsdp",), names, 4, tmp_path, 600.0))
