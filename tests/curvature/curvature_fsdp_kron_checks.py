"""Checks of Kronecker factors and the KFAC operator on FSDP2 models, run inside gloo processes
by test_curvature_fsdp_kron.py (not collected by pytest).

Each rank sweeps its own shard (the same number of batches per rank, uneven sizes) of a tiny
float64 data set with a `fully_shard`-ed model, and compares with one process sweeping the
concatenation of all shards with an unsharded copy (in the same worker).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from curvature_distributed_checks import close, fsdp_model, fsdp_shards, own_chunk
from distributed_checks import run_checks

from backpack import distributed
from backpack.curvature import accumulate
from backpack.extensions import KFAC as KFACExtension
from backpack.extensions import KFLR, DiagGGNExact


def local_vector(model, full):
    """This rank's rows of a whole-model vector/matrix `full` `[P, ...]` (FSDP2 chunks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out, start = [], 0
    for _, p in model.named_parameters():
        n = p.numel()
        piece = full[start : start + n].reshape(*p.shape, *full.shape[1:])
        out.append(own_chunk(piece, rank, world).reshape(-1, *full.shape[1:]))
        start += n
    return torch.cat(out)


def accumulate_kron_case(name: str, reduction: str, nested: bool):
    """KFLR (with DiagGGNExact) on FSDP2: each layer's factors on its owner, equal to one
    process's; the other ranks hold none; the diagonal shards as before."""

    def check(rank: int, world: int) -> None:
        problem, mine, everything, _, _ = fsdp_shards(name, rank, world)
        model, ref = fsdp_model(problem, nested), problem.model()
        lossfunc = problem.make_loss(reduction)
        exts = [KFLR(), DiagGGNExact()]
        result = accumulate(model, lossfunc, mine, exts)
        expected = accumulate(
            ref, lossfunc, everything, [KFLR(), DiagGGNExact()], distributed=False
        )
        owners = result.owners
        assert owners is not None and set(owners) == set(expected.names), owners
        kflr = result.quantity("kflr")
        for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if owners[pname] == rank:
                close(kflr[pname], q.kflr, f"{pname}.kflr")
                close(p.kflr, q.kflr, f"{pname}.kflr written")
            else:
                assert kflr[pname] is None and not hasattr(p, "kflr"), pname
            close(p.diag_ggn_exact.to_local(), own_chunk(q.diag_ggn_exact, rank, world), pname)
            close(p.grad.to_local(), own_chunk(q.grad, rank, world), f"{pname}.grad")
        # every rank owns some layer when there are enough of them; the bytes balance
        held = [0] * world
        for pname, r in owners.items():
            held[r] += sum(f.numel() for f in expected.quantity("kflr")[pname])
        assert max(held) <= sum(held) - max(held) + max(
            sum(f.numel() for f in fs) for fs in expected.quantity("kflr").values()
        ), held
        # MC factors: finite, on their owner
        mc = accumulate(model, lossfunc, mine, KFACExtension()).quantity("kfac")
        for pname, fs in mc.items():
            assert (fs is None) == (owners[pname] != rank), pname
            assert fs is None or all(torch.isfinite(f).all() for f in fs), pname
        # merged sweeps: exact
        first = accumulate(model, lossfunc, mine[:1], KFLR(), write=False)
        both = first.merge(accumulate(model, lossfunc, mine[1:], KFLR(), write=False))
        for pname, fs in both.quantity("kflr").items():
            if fs is not None:
                close(fs, expected.quantity("kflr")[pname], f"merged {pname}")

    return check


MAIN: list[tuple[str, Callable]] = [
    ("kron-mlp_ce-mean-nested", accumulate_kron_case("mlp_ce", "mean", nested=True)),
    ("kron-mlp_mse-sum", accumulate_kron_case("mlp_mse", "sum", nested=False)),
    ("kron-cnn_ce-mean-nested", accumulate_kron_case("cnn_ce", "mean", nested=True)),
    ("kron-token_ce-sum", accumulate_kron_case("token_ce", "sum", nested=False)),
]
SCENARIOS = {"main": MAIN}


def worker(rank: int, world: int, port: int, scenario: str, outdir: str) -> None:
    distributed.TIMEOUT_S = 60.0
    run_checks(rank, world, port, outdir, SCENARIOS[scenario], timeout_s=60.0)
