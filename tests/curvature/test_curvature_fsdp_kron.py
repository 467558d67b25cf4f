"""Kronecker factors and the KFAC/EKFAC operators on FSDP2 models: gloo processes, each
sweeping an uneven shard, against one process over all data (curvature_fsdp_kron_checks.py)."""

from __future__ import annotations

import multiprocessing

import curvature_fsdp_kron_checks
import pytest
import torch
from test_distributed import assert_passed, spawn_workers

from backpack.curvature._fsdp import assign_owners, check_replicas, replica_digest

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_replica_digests_tell_rounding_from_other_rows(dtype):
    """HSDP's replica check: a replica's rows equal to its holder's up to rounding pass; other
    rows (another draw, one entry changed, a shift) raise naming both ranks. The digest is
    taken in pieces (3M entries: several of them) and matches one float64 pass."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3_000_001, generator=g, dtype=torch.float64).to(dtype)
    digest = replica_digest(v)
    w = torch.arange(v.numel(), dtype=torch.float64).mul_(0.6180339887).frac_().sub_(0.5)
    wide = v.double()
    expected = [float(wide.square().sum()), float(w @ wide), float((w * wide).norm())]
    assert torch.allclose(torch.tensor(digest[:3]), torch.tensor(expected), rtol=1e-10)
    # every entry one unit in the last place off, in random directions
    sign = torch.randint(0, 2, v.shape, generator=g).double().mul_(2).sub_(1)
    rounded = (v.double() * (1 + sign * torch.finfo(dtype).eps)).to(dtype)
    assert not torch.equal(rounded, v)
    one_changed = v.clone()
    one_changed[17] += 1.0
    others = [torch.randn(v.shape, generator=g, dtype=dtype), one_changed, v + 1e-2]

    def table(*rows):
        return torch.tensor([[*replica_digest(r), 0.0] for r in rows], dtype=torch.float64)

    scaled = (v.double() * (1 + torch.finfo(dtype).eps)).to(dtype)  # all in one direction
    check_replicas(table(v, rounded, scaled), "op @ V")
    for other in others:
        with pytest.raises(ValueError, match=r"rank\(s\) \[2\] pass other local rows"):
            check_replicas(table(v, rounded, other), "op @ V")
