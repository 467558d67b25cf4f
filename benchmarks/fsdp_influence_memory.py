"""`python -m benchmarks.fsdp_influence_memory [--ranks 1 2 4]`: attribution memory per FSDP2 rank.

For each number of ranks, that many gloo processes shard an MLP with `fully_shard` (per layer and
at the root), fit `backpack.influence.fit(..., "ekfac", fisher="type-2")` on their own training
batches and score the same query batches against them. Per rank it counts the bytes of the fit
it holds (its blocks' eigenvectors and eigenvalues), of the preconditioned query gradients it
keeps (its blocks' rows, full and at `query_rank=8`), the number of blocks lent per training
batch, and the growth of the process's peak resident memory over fit and scores (measured, so
noisy; it includes one batch's activations and per-sample gradients, which do not shrink with
the ranks). The header gives the whole fit's and query rows' bytes: what every rank would hold
with a replicated model. Float32; bytes are counted from the tensors.
"""

from __future__ import annotations

import argparse
import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.fsdp_kron_memory import sharded_mlp, spawn_rows

#: the MLP's widths: five Linear layers of different sizes
WIDTHS = (256, 1024, 768, 1024, 512, 10)
QUERIES, BATCH, BATCHES = 16, 32, 2


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def _rows_bytes(rows) -> int:
    out = 0
    for value in rows.values():
        parts = [value] if isinstance(value, torch.Tensor) else [value.left, value.right]
        out += _bytes(parts)
    return out


def _data(seed: int, n: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, WIDTHS[0], generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(n)
    ]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from backpack.influence import fit
    from backpack.influence._scoring import query_rows

    model = sharded_mlp(WIDTHS)
    train = _data(1 + rank, BATCHES)
    query = [(x[: QUERIES // 2], y[: QUERIES // 2]) for x, y in _data(0, 2)]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    influence = fit(model, nn.CrossEntropyLoss(), train, "ekfac", fisher="type-2")
    influence.scores(query, train)
    lent = influence.placement.lent
    influence.scores(query, train[:1])
    per_batch = influence.placement.lent - lent
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    held = _bytes(t for b in influence.blocks for t in (*b.vectors, b.values))
    rows = _rows_bytes(query_rows(influence, query, False, True)[0])
    low = _rows_bytes(query_rows(influence, query, False, True, rank=8)[0])
    blocks = sum(influence.placement.owns(b.name) for b in influence.blocks)
    Path(out, f"{rank}.txt").write_text(f"{held} {rows} {low} {blocks} {per_batch} {peak}")
    dist.barrier()
    dist.destroy_process_group()


def _whole() -> tuple[int, int]:
    """Bytes (float32) of the whole fit (`[G, G]`, `[A, A]`, `[G, A]` per weight; `[G, G]`,
    `[G]` per bias) and of the whole preconditioned query rows (`Q × P`)."""
    fit = sum((b * b + a * a + b * a + b * b + b) * 4 for a, b in zip(WIDTHS[:-1], WIDTHS[1:]))
    params = sum(b * a + b for a, b in zip(WIDTHS[:-1], WIDTHS[1:]))
    return fit, QUERIES * params * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    fit_bytes, rows_bytes = _whole()
    print(
        f"MLP {WIDTHS}, float32, {QUERIES} queries, {BATCHES} training batches of {BATCH} per "
        f"rank; the whole fit: {fit_bytes} bytes, the whole preconditioned query rows: "
        f"{rows_bytes} bytes"
    )
    print(
        "| ranks | fit per rank (bytes) | query rows per rank | at query_rank=8 | blocks per "
        "rank | blocks lent per training batch | peak RSS growth per rank (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for world in args.ranks:
        rows = spawn_rows(_worker, world)
        cols = [" / ".join(r[i] for r in rows) for i in range(5)]
        peak = " / ".join(f"{int(r[5]) / 2**20:.0f}" for r in rows)
        print(f"| {world} | {' | '.join(cols)} | {peak} |")


if __name__ == "__main__":
    main()
