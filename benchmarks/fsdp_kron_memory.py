"""`python -m benchmarks.fsdp_kron_memory [--ranks 1 2 4]`: KFAC's factor bytes per FSDP2 rank.

For each number of ranks, that many gloo processes shard a several-layer MLP with `fully_shard`
(per layer and at the root), build `backpack.curvature.KFAC` over their own batches and count,
per rank, the bytes of the Kronecker factors it holds (its owned blocks), of those plus their
eigendecompositions after one product with the damped inverse, and of the largest buffer a
batch's collectives send (the reduce onto each owner of its layers' summed factor
contributions, or the reduce-scatter of the gradient; transient). Bytes are counted from the
tensors, not measured from the allocator. The header gives the whole model's factors: what
every rank would hold with a replicated model.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.distributed import free_port

#: the MLP's widths: five Linear layers of different sizes
WIDTHS = (64, 256, 192, 256, 128, 10)


def mlp(widths: tuple[int, ...] = WIDTHS) -> nn.Module:
    """Linear layers of `widths` with Tanh between them (seeded)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def sharded_mlp(widths: tuple[int, ...] = WIDTHS) -> nn.Module:
    """`mlp(widths)` with `fully_shard` on every Linear layer and at the root."""
    from torch.distributed.fsdp import fully_shard

    model = mlp(widths)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from backpack.curvature import KFAC, _fsdp

    sent = [0]  # the largest buffer a batch's reduce-scatter or reduce sends
    reduce_scatter, reduce = _fsdp._REDUCE_SCATTER, _fsdp._REDUCE

    def counting(output, flat, **kwargs):
        sent[0] = max(sent[0], flat.numel() * flat.element_size())
        return reduce_scatter(output, flat, **kwargs)

    def counting_reduce(flat, **kwargs):
        sent[0] = max(sent[0], flat.numel() * flat.element_size())
        return reduce(flat, **kwargs)

    _fsdp._REDUCE_SCATTER, _fsdp._REDUCE = counting, counting_reduce
    model = sharded_mlp()
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(16, WIDTHS[0], generator=g), torch.randint(0, 10, (16,), generator=g))]
    op = KFAC(model, nn.CrossEntropyLoss(), data)
    factors = _bytes(f for fs in op.factors.values() for f in fs)
    inv = op.inverse(1e-3)
    inv @ torch.ones(op.shape[0])
    eig = _bytes(t for b in op._owned() for pair in b.eig() for t in pair)
    Path(out, f"{rank}.txt").write_text(f"{factors} {eig} {len(op.factors)} {sent[0]}")
    dist.barrier()
    dist.destroy_process_group()


def _whole() -> int:
    """Bytes of every layer's factors (float32): `[G, A]` of the weight, `[G]` of the bias."""
    return sum((b * b + a * a + b * b) * 4 for a, b in zip(WIDTHS[:-1], WIDTHS[1:]))


def spawn_rows(worker, world: int) -> list[list[str]]:
    """Run `worker(rank, world, port, out)` on `world` gloo processes; each rank's words.

    Rank r writes its numbers, separated by spaces, to `out/<r>.txt`.
    """
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        mp.start_processes(worker, (world, port, out), nprocs=world, start_method="spawn")
        return [Path(out, f"{r}.txt").read_text().split() for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    print(f"MLP {WIDTHS}, float32; the whole model's factors: {_whole()} bytes")
    print(
        "| ranks | factors per rank (bytes) | with eigendecompositions | blocks per rank | "
        "largest per-batch collective buffer (bytes) |"
    )
    print("|---|---|---|---|---|")
    for world in args.ranks:
        rows = spawn_rows(_worker, world)
        factors = " / ".join(r[0] for r in rows)
        both = " / ".join(str(int(r[0]) + int(r[1])) for r in rows)
        blocks = " / ".join(r[2] for r in rows)
        sent = " / ".join(r[3] for r in rows)
        print(f"| {world} | {factors} | {both} | {blocks} | {sent} |")


if __name__ == "__main__":
    main()
