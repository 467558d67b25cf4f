"""`python -m benchmarks.run --distributed N`: what backpack's reductions add to a DDP step.

N processes (gloo on the CPU, NCCL with `--device cuda` and N GPUs) each train
`DistributedDataParallel(extend(model))` on their own copy of a problem's batch (the global
batch is N times the problem's). Per problem and extension, three steps (forward + backward,
gradients cleared between) are timed with their repeats interleaved, every rank starting each
step together after a barrier:

- `DDP`: the plain model under DDP (DDP's own gradient all-reduce included);
- `local`: the extended model under DDP inside `backpack(ext, sync=False)`;
- `global`: the same inside `backpack(ext)`, which all-reduces the quantities.

A step's time is the slowest rank's; each column is the median over the repeats. The table
shows the DDP step, the extension's local step relative to it, and the *extra time of backpack's
reductions*: global - local, absolute and relative to the DDP step, next to the time spent in
backpack's synchronisation itself (`PassSync.finish_pass` on the rank that reaches it last, so
without waiting for slower ranks: the collectives, and rescaling the per-sample quantities) and
the bytes it all-reduces per step.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks import problems as P

DEFAULT_PROBLEMS = ("mlp", "3c3d")
DEFAULT_EXTENSIONS = ("BatchGrad", "SumGradSquared", "Variance", "DiagGGNExact", "KFLR")


def free_port() -> int:
    """A TCP port free on this machine now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_step(step, device: torch.device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _measure(name: str, ext_name: str, cfg: dict, device: torch.device) -> dict[str, Any]:
    from backpack import backpack, distributed, extend
    from backpack.passes.state import BackwardState
    from benchmarks.run import SAVEFIELDS, _extension_factories

    make = _extension_factories()[ext_name]
    model, x, y, lossfunc = P.build(name, cfg["tiny"])
    plain = nn.parallel.DistributedDataParallel(copy.deepcopy(model).to(device))
    extended = extend(model.to(device))
    ddp = nn.parallel.DistributedDataParallel(extended)
    lossfunc_ext = extend(copy.deepcopy(lossfunc))
    x, y = x.to(device), y.to(device)

    reduced = {"bytes": 0, "seconds": 0.0, "inside": False}
    original, all_reduce = distributed.PassSync.finish_pass, dist.all_reduce

    def timed_finish(self, engine: BackwardState) -> None:
        start = time.perf_counter()
        reduced["inside"] = True
        try:
            original(self, engine)
        finally:
            reduced["inside"] = False
        reduced["seconds"] += time.perf_counter() - start

    def counting_all_reduce(tensor, *args, **kwargs):
        if reduced["inside"]:
            reduced["bytes"] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)

    def clear(net: nn.Module) -> None:
        for p in net.parameters():
            p.grad = None
            for field in SAVEFIELDS:
                p.__dict__.pop(field, None)

    def plain_step() -> None:
        clear(plain)
        lossfunc(plain(x), y).backward()

    def step(sync: bool) -> None:
        clear(ddp)
        with backpack(make(), sync=None if sync else False):
            lossfunc_ext(ddp(x), y).backward()

    steps = {"ddp": plain_step, "local": lambda: step(False), "global": lambda: step(True)}
    for _ in range(cfg["warmup"]):
        for run in steps.values():
            run()
    times: dict[str, list[float]] = {k: [] for k in steps}
    sync_seconds = []
    distributed.PassSync.finish_pass = timed_finish
    try:
        # bytes backpack all-reduces in one synchronised step (header and bucket)
        dist.all_reduce = counting_all_reduce
        try:
            step(True)
        finally:
            dist.all_reduce = all_reduce
        deadline = time.perf_counter() + cfg["budget"]
        repeats = 0
        while repeats < cfg["min_repeats"] or (
            time.perf_counter() < deadline and repeats < cfg["max_repeats"]
        ):
            order = list(steps) if repeats % 2 == 0 else list(reversed(steps))
            for key in order:
                reduced["seconds"] = 0.0
                times[key].append(_time_step(steps[key], device))
                if key == "global":
                    spent = torch.tensor([reduced["seconds"]], dtype=torch.float64)
                    # the last rank to arrive waits least: its time is the sync's own cost
                    dist.all_reduce(spent, op=dist.ReduceOp.MIN)
                    sync_seconds.append(spent.item())
            repeats += 1
            go_on = torch.tensor([float(time.perf_counter() < deadline)])
            dist.all_reduce(go_on, op=dist.ReduceOp.MIN)  # every rank repeats equally often
            if not go_on.item() and repeats >= cfg["min_repeats"]:
                break
    finally:
        distributed.PassSync.finish_pass = original
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "ddp_ms": 1e3 * med["ddp"],
        "local_ms": 1e3 * med["local"],
        "global_ms": 1e3 * med["global"],
        "extra_ms": 1e3
        * statistics.median(g - loc for g, loc in zip(times["global"], times["local"])),
        "sync_ms": 1e3 * statistics.median(sync_seconds),
        "reduced_bytes": reduced["bytes"],
        "repeats": repeats,
    }


def _worker(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    torch.set_num_threads(cfg["threads"])
    device = torch.device("cpu")
    backend = "gloo"
    if cfg["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    results: dict[str, dict[str, Any]] = {}
    for name in cfg["problems"]:
        for ext_name in cfg["extensions"]:
            try:
                results.setdefault(name, {})[ext_name] = _measure(name, ext_name, cfg, device)
            except Exception as err:  # noqa: BLE001 - reported in the table
                results.setdefault(name, {})[ext_name] = {"error": f"{type(err).__name__}: {err}"}
            if rank == 0:
                Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def render(results: dict, meta: dict) -> str:
    lines = [
        f"## backpack's reductions on {meta['world']} ranks ({meta['backend']})",
        "",
        f"torch {meta['torch']}, {meta['threads']} thread(s) per rank, "
        f"{'tiny problems, ' if meta['tiny'] else ''}global batch = {meta['world']} x the "
        "problem's batch. Times: median over repeats of the slowest rank.",
        "",
        "| problem | extension | DDP step | local / DDP | extra of reductions (global - local) "
        "| extra / DDP | in sync (last rank) | all-reduced |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        for ext, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | {ext} | error: {r['error'][:80]} | | | | | |")
                continue
            lines.append(
                f"| {name} | {ext} | {r['ddp_ms']:.2f} ms | {r['local_ms'] / r['ddp_ms']:.2f}x "
                f"| {r['extra_ms']:.2f} ms | {100 * r['extra_ms'] / r['ddp_ms']:.0f}% "
                f"| {r['sync_ms']:.2f} ms | {r['reduced_bytes'] / 1e6:.2f} MB |"
            )
    return "\n".join(lines) + "\n"


def run_distributed(args: argparse.Namespace) -> int:
    """The `--distributed N` mode of `benchmarks.run`."""
    world = args.distributed
    if args.device == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"--distributed {world} --device cuda needs {world} GPUs")
    quick = args.quick or args.tiny
    cfg = {
        "problems": args.problems or list(DEFAULT_PROBLEMS),
        "extensions": args.extensions or list(DEFAULT_EXTENSIONS),
        "tiny": args.tiny,
        "device": args.device,
        "threads": 1 if args.device == "cpu" else args.threads,
        "warmup": 2,
        "min_repeats": 3 if quick else 5,
        "max_repeats": 10 if quick else 40,
        "budget": args.case_budget or (0.5 if quick else 3.0),
    }
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        env = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(cfg["threads"])
        try:
            mp.start_processes(
                _worker, args=(world, free_port(), cfg, out), nprocs=world, start_method="spawn"
            )
        finally:
            if env is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env
        results = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    meta = {
        "world": world,
        "backend": "nccl" if args.device == "cuda" else "gloo",
        "torch": torch.__version__,
        "threads": cfg["threads"],
        "tiny": args.tiny,
        "seconds_total": time.time() - start,
        "config": cfg,
    }
    markdown = render(results, meta)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "distributed.json").write_text(json.dumps({"meta": meta, "results": results}))
    (out_dir / "distributed.md").write_text(markdown)
    print(markdown)
    return 0
