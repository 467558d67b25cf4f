"""Peak host memory per rank of one curvature product on an FSDP2 model (gloo, CPU).

The model (`LAYERS` Linear layers of `WIDTH`², float32) is built on the meta device and
sharded with `fully_shard` per layer and at the root before its shards are allocated, so no
process ever holds the whole model except through the product itself. Each rank sweeps one
batch. The peak is the rise of the resident set (VmHWM after resetting it through
/proc/self/clear_refs, large allocations returned to the system by mmap) during one product,
after a warm-up product.

    python benchmarks/fsdp_product_memory.py [world ...]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # big tensors: mmap, freed to the OS

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

LAYERS, WIDTH, BATCH = 8, 1024, 16


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_of(fn) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    fn()
    return _status("VmHWM") - base


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard

    from backpack.curvature import GGN, Hessian

    with torch.device("meta"):
        layers = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        model = nn.Sequential(*layers[:-1])
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.copy_(torch.randn(local.shape, generator=g) / WIDTH**0.5)
    X = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randint(0, WIDTH, (BATCH,), generator=g)
    lossfunc = nn.CrossEntropyLoss()
    out = {}
    for name, cls in (("GGN", GGN), ("Hessian", Hessian)):
        op = cls(model, lossfunc, [(X, y)])
        v = torch.randn(op.shape[0], generator=g)
        op @ v  # warm-up
        out[name] = _peak_of(lambda op=op, v=v: op @ v)
    # control: autograd keeps the gathered parameters (no tokens, no gathering again)
    from contextlib import nullcontext

    from backpack.curvature import _fsdp_products

    saving = _fsdp_products.Gathering.saving
    _fsdp_products.Gathering.saving = lambda self: nullcontext()
    try:
        op = GGN(model, lossfunc, [(X, y)])
        v = torch.randn(op.shape[0], generator=g)
        op @ v
        out["kept"] = _peak_of(lambda: op @ v)
    finally:
        _fsdp_products.Gathering.saving = saving
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    queue.put((rank, shard, out))
    dist.barrier()
    dist.destroy_process_group()


def main(worlds: list[int]) -> None:
    full = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    layer = (WIDTH * WIDTH + WIDTH) * 4
    print(f"model: {LAYERS} x Linear({WIDTH}, {WIDTH}) float32 = {full / 2**20:.1f} MiB")
    print(f"one layer = {layer / 2**20:.1f} MiB; batch {BATCH} per rank\n")
    print(
        "| ranks | shard per rank (MiB) | GGN @ v peak (MiB) | Hessian @ v peak (MiB) "
        "| GGN @ v, gathered parameters kept by autograd (MiB) |"
    )
    print("|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for port, world in enumerate(worlds, start=29611):
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
        for p in procs:
            p.start()
        rows = sorted(queue.get() for _ in procs)
        for p in procs:
            p.join()
        shard = max(r[1] for r in rows) / 2**20
        ggn = max(r[2]["GGN"] for r in rows) / 2**20
        hessian = max(r[2]["Hessian"] for r in rows) / 2**20
        kept = max(r[2]["kept"] for r in rows) / 2**20
        print(f"| {world} | {shard:.1f} | {ggn:.1f} | {hessian:.1f} | {kept:.1f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 2, 4])
