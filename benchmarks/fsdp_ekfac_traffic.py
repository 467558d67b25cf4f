"""`python -m benchmarks.fsdp_ekfac_traffic [--ranks 2 4]`: EKFAC's eigenbases per FSDP2 rank.

For each number of ranks, that many gloo processes shard the MLP of `fsdp_kron_memory` with
`fully_shard` (per layer and at the root) and build `backpack.curvature.EKFAC` ("type-2",
cross-entropy over 10 classes) over their own batches. Per rank it counts the bytes of the
eigenbases the rank owns, the most bytes of other ranks' eigenbases it holds at any time during
the correction sweep (they are broadcast just in time, one layer at a time), and the bytes the
correction sweep broadcasts per batch. For comparison, the bytes per batch that sending each
sample's inputs and backpropagated factor columns to the owners would move instead,
`N·(a + V·g)` per layer (`V` = 10 columns). Bytes are counted from the tensors.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.fsdp_kron_memory import WIDTHS, _bytes, sharded_mlp, spawn_rows

#: samples per batch and batches per rank
BATCH, BATCHES = 32, 4


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from backpack.curvature import EKFAC, _fsdp_eigen

    held, sent = [0], [0]
    lendings: list = []
    fetch = _fsdp_eigen.JustInTime.fetch

    def counting(self, module):
        before = self.broadcasts
        fetch(self, module)
        lendings.append(self)
        if self.broadcasts > before:  # every part of the layer was broadcast
            sent[0] += _bytes(v for block, _, _ in self.parts[module] for v in block.vectors)
        foreign = [
            getattr(self.states[m], f)
            for m, parts in self.parts.items()
            for _, owner, fields in parts
            if owner != self.me
            for f in fields
        ]
        held[0] = max(held[0], _bytes(t for t in foreign if t is not None))

    _fsdp_eigen.JustInTime.fetch = counting
    model = sharded_mlp()
    g = torch.Generator().manual_seed(rank)
    data = [
        (torch.randn(BATCH, WIDTHS[0], generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(BATCHES)
    ]
    op = EKFAC(model, nn.CrossEntropyLoss(), data)
    owned = _bytes(v for b in op._owned() for v in b.vectors)
    broadcasts = lendings[0].broadcasts
    Path(out, f"{rank}.txt").write_text(f"{owned} {held[0]} {sent[0] // BATCHES} {broadcasts}")
    dist.barrier()
    dist.destroy_process_group()


def _per_sample() -> int:
    """Bytes per batch of one rank's inputs and 10 backpropagated columns of every layer."""
    return sum(BATCH * (a + 10 * b) * 4 for a, b in zip(WIDTHS[:-1], WIDTHS[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    whole = sum((a * a + b * b) * 4 for a, b in zip(WIDTHS[:-1], WIDTHS[1:]))
    print(
        f"MLP {WIDTHS}, float32, {BATCHES} batches of {BATCH} per rank; the weights' "
        f"eigenbases: {whole} bytes; per-sample alternative: {_per_sample()} bytes per batch "
        "and rank"
    )
    print(
        "| ranks | eigenbases owned (bytes) | others' held at most | broadcast per batch | "
        "broadcasts |"
    )
    print("|---|---|---|---|---|")
    for world in args.ranks:
        rows = spawn_rows(_worker, world)
        cols = [" / ".join(r[i] for r in rows) for i in range(2)]
        print(f"| {world} | {cols[0]} | {cols[1]} | {rows[0][2]} | {rows[0][3]} |")


if __name__ == "__main__":
    main()
