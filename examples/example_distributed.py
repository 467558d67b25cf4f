"""Data-parallel training with DDP: backpack's quantities of the global batch on every rank.

    torchrun --nproc_per_node=2 examples/example_distributed.py

(`python examples/example_distributed.py` relaunches itself that way.) Every rank trains the same
`DistributedDataParallel(extend(model))` on its own shard of each batch, on the CPU with the gloo
backend (`--device cuda` uses NCCL, one GPU per rank). Inside `with backpack(...)`, backpack
all-reduces at the end of the backward pass, so on every rank

- `variance` is the elementwise variance of the per-sample gradients of the *global* batch and
  `diag_ggn_exact` its GGN diagonal, with the loss's `mean` over the global batch;
- `grad_batch` holds this rank's rows, scaled as rows of the global batch: summed over all
  ranks they give DDP's averaged `.grad` (equal shards).

The script uses them for a per-layer gradient signal-to-noise ratio and a diagonal Gauss-Newton
step, and on the last step checks them against one process computing on the concatenated batch
(`sync=False`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

from backpack import backpack, extend
from backpack.extensions import BatchGrad, DiagGGNExact, Variance


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--damping", type=float, default=1.0)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks when relaunched")
    return parser.parse_args(argv)


def make_data(step: int, n: int, dim: int = 10, classes: int = 3):
    """The global batch of one step (every rank draws the same and keeps its shard)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, dim, generator=g)
    y = (x[:, :classes].argmax(1) + (torch.rand(n, generator=g) < 0.1).long()) % classes
    return x, y


def extensions() -> list:
    return [BatchGrad(), Variance(), DiagGGNExact()]


def check_against_one_process(model, reference, lossfunc, x, y, rank, batch) -> float:
    """backpack's global quantities = one process on the concatenated batch (largest error)."""
    with backpack(*extensions(), sync=False):
        lossfunc(reference(x), y).backward()
    rows = slice(rank * batch, (rank + 1) * batch)
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        pairs = [
            (p.variance, q.variance),
            (p.diag_ggn_exact, q.diag_ggn_exact),
            (p.grad_batch, q.grad_batch[rows]),
            (p.grad, q.grad),  # DDP's average = the global batch's gradient (equal shards)
        ]
        for ours, theirs in pairs:
            error = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12)).item()
            worst = max(worst, error)
    return worst


def train(args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)  # the same initial model on every rank
    model = extend(nn.Sequential(nn.Linear(10, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 3)))
    model = model.to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    n = args.batch_size * world
    log = []
    for step in range(args.steps):
        x, y = (t.to(device) for t in make_data(step, n))
        mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        last = step == args.steps - 1
        # for the check below: the parameters before this step's update
        reference = extend(copy.deepcopy(model)) if last else None
        ddp.zero_grad()
        loss = lossfunc(ddp(x[mine]), y[mine])
        with backpack(*extensions()):
            loss.backward()
        # every rank now holds the global quantities: the same update everywhere
        snr = {}
        with torch.no_grad():
            for name, p in model.named_parameters():
                # per-sample gradients carry 1/n: n * variance is the variance of the mean
                noise = n * p.variance.sum()
                snr[name] = (p.grad.square().sum() / noise.clamp_min(1e-30)).item()
                p -= args.lr * p.grad / (p.diag_ggn_exact + args.damping)
        global_loss = loss.detach() * len(y[mine]) / n
        dist.all_reduce(global_loss)
        entry = {"step": step, "loss": global_loss.item(), "snr": snr}
        if last:
            entry["max_rel_error"] = check_against_one_process(
                model, reference, lossfunc, x, y, rank, args.batch_size
            )
            assert entry["max_rel_error"] < 1e-4, entry
        log.append(entry)
        if rank == 0:
            snrs = ", ".join(f"{k} {v:.2f}" for k, v in snr.items())
            print(f"step {step}: global loss {entry['loss']:.4f}; gradient SNR {snrs}")
    if rank == 0:
        print(
            f"{world} ranks x {args.batch_size} samples: variance, diag_ggn_exact, grad_batch "
            f"and .grad match one process on the global batch (max rel. error "
            f"{log[-1]['max_rel_error']:.1e})"
        )
        print("RESULT " + json.dumps(log))
    return {"log": log}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # not under torchrun: relaunch with it
        return relaunch(args, argv or [])
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    try:
        return train(args)
    finally:
        dist.destroy_process_group()


def relaunch(args: argparse.Namespace, argv: list[str]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        os.path.abspath(__file__),
        *argv,
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    out = [line for line in result.stdout.splitlines() if not line.startswith("RESULT ")]
    print("\n".join(out))
    if result.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    found = [line[7:] for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    log = [json.loads(line) for line in found]
    return {"log": log[0]}


if __name__ == "__main__":
    main(sys.argv[1:])
