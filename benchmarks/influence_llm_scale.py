"""Attribution at LLM scale: EK-FAC fit + scores of a GPT-2-small-sized model, against kronfluence.

    python -m benchmarks.influence_llm_scale [--tiny] [--layers 12] [--train 256] [--query 16]
        [--tokens 128] [--batch 8] [--ranks 2] [--threads 2] [--out FILE]

The model is `influence_vs_kronfluence.GPT`: GPT-2 small's shapes (12 blocks of width 768, 12
heads, a vocabulary of 50,257 tied to the head: 124M parameters), random weights, float32. Both
libraries fit EK-FAC on the blocks' `nn.Linear` layers (kronfluence's coverage; 85M parameters, the
embeddings, LayerNorms and the tied head frozen) over `--train` sequences of `--tokens` tokens
and score `--query` query sequences against them, with the options that reproduce kronfluence's
numbers (`KRONFLUENCE`: empirical Fisher, biases folded, covariances averaged over positions, its
heuristic damping 0.1 × mean per module).

Every run is a fresh process (`torch.multiprocessing`, spawn), so that its peak resident memory
(`ru_maxrss`) less what it held once the model and data were built is the run's own: backpack in
one process, kronfluence 1.0.1 in one process, backpack on `--ranks` gloo processes with the
model sharded by FSDP2 (`fully_shard` on every block and the root; each rank sweeps a contiguous
share of the training sequences and `scores(..., gather=True)` returns the whole matrix). Wall
time of fit + scores; the processes share `--threads` threads (each of the sharded ranks gets
`threads // ranks`). Needs kronfluence for its rows (`make install-bench`: `.venv-bench`).
"""

from __future__ import annotations

import importlib.util
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from benchmarks.distributed import free_port
from benchmarks.influence_vs_kronfluence import GPT, KRONFLUENCE, Kronfluence, batches, deviation
from benchmarks.influence_vs_kronfluence import rel as relative_error
from benchmarks.report import finish, report_parser

#: the issue's sizes (GPT-2 small, sequences of 128 tokens) and a smoke-test size
FULL = {"vocab": 50257, "dim": 768, "heads": 12, "layers": 12, "tokens": 128}
TINY = {"vocab": 64, "dim": 32, "heads": 2, "layers": 2, "tokens": 16}


def problem(cfg: dict[str, Any]) -> tuple[nn.Module, list[str], tuple, tuple]:
    """`(model, tracked module names, (X, y) train, (X, y) query)`, seeded, float32.

    Only the blocks' `nn.Linear` layers are trainable (the others frozen).
    """
    torch.manual_seed(0)
    model = GPT(cfg["vocab"], cfg["tokens"], cfg["dim"], cfg["heads"], cfg["layers"])
    tracked = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.startswith("blocks.")
    ]
    for name, p in model.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[0] in tracked)
    gen = torch.Generator().manual_seed(0)
    n = cfg["train"] + cfg["query"]
    tokens = torch.randint(0, cfg["vocab"], (n, cfg["tokens"] + 1), generator=gen)
    X, y = tokens[:, :-1], tokens[:, 1:]
    t = cfg["train"]
    return model, tracked, (X[:t], y[:t]), (X[t:], y[t:])


def _rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _run(rank: int, kind: str, world: int, port: int, cfg: dict[str, Any], out: str) -> None:
    """One measured run in this (spawned) process; rank 0 saves its result to `out`."""
    result: dict[str, Any] = {}
    try:
        torch.set_num_threads(max(1, cfg["threads"] // world))
        import logging
        import warnings

        logging.disable(logging.WARNING)
        warnings.filterwarnings("ignore")
        if world > 1:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
        model, tracked, (Xt, yt), (Xq, yq) = problem(cfg)
        if world > 1:
            from torch.distributed.fsdp import fully_shard

            options = {}
            if cfg.get("hsdp"):  # HSDP: `hsdp` replica groups, each sharding the model
                from torch.distributed.device_mesh import init_device_mesh

                shape = (cfg["hsdp"], world // cfg["hsdp"])
                options["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard"))
            for block in model.blocks:
                fully_shard(block, **options)
            fully_shard(model, **options)
            share = -(-len(Xt) // world)
            Xt, yt = Xt[rank * share : (rank + 1) * share], yt[rank * share : (rank + 1) * share]
        train, query = batches(Xt, yt, cfg["batch"]), batches(Xq, yq, cfg["batch"])
        base = _rss_bytes()
        start = time.perf_counter()
        if kind == "kronfluence":
            with tempfile.TemporaryDirectory() as workdir:
                kf = Kronfluence(model, workdir, tracked)
                scores = kf.scores(
                    (Xt, yt), (Xq, yq), "ekfac", None, cfg["batch"], dtype=torch.float32
                )
        else:
            from backpack.influence import fit

            influence = fit(model, nn.CrossEntropyLoss(), train, "ekfac", None, **KRONFLUENCE)
            scores = influence.scores(query, train, gather=world > 1)
        result = {
            "seconds": time.perf_counter() - start,
            "peak": _peak_rss_bytes() - base,
            "scores": scores.detach().cpu(),
        }
        if kind == "backpack" and world == 1 and cfg["ranks_for_error"]:
            # `query_rank`'s cost, on a sample of the training sequences (outside the timing)
            sample = train[: max(1, len(train) // 4)]
            result["rank_errors"] = influence.query_rank_error(
                query, sample, cfg["ranks_for_error"]
            )
    except Exception as err:  # noqa: BLE001 - reported as the row's outcome
        result = {"error": f"{type(err).__name__}: {err}".split("\n")[0][:300]}
        traceback.print_exc()
    if rank == 0:
        torch.save(result, out)
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def measure(kind: str, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run `kind` ("backpack" or "kronfluence") on `world` fresh processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.start_processes(
            _run, args=(kind, world, free_port(), cfg, out), nprocs=world, start_method="spawn"
        )
        return torch.load(out, weights_only=True)


def _row(label: str, r: dict[str, Any], reference: dict[str, Any] | None, ref_name: str) -> str:
    if "error" in r:
        return f"| {label} | — | — | — | {r['error']} |"
    agree = "—"
    if reference is not None and "scores" in reference:
        err = relative_error(r["scores"], reference["scores"])
        dev = deviation(r["scores"], reference["scores"])
        agree = f"{err:.1e} / {dev:.1e} vs {ref_name}"
    return f"| {label} | {r['seconds']:.1f} | {r['peak'] / 2**20:.0f} | {agree} | |"


def floor_flops(model: nn.Module, tracked: list[str], cfg: dict[str, Any]) -> dict[str, float]:
    """The fewest FLOPs any EK-FAC fit + scores of the run needs (counted, not measured).

    Per sequence of T tokens, with the tracked layers' `(d_in + 1, d_out)` (biases folded):
    a forward `F` (their products, the tied head's `2T·d·V`, attention's `4T²d` per block) and
    the backward to their inputs (`≈ F`) in each of the three passes over the training data
    (factors, EK-FAC correction, scores) and once for the queries; the factors' symmetric
    updates `T Σ (d_in² + d_out²)`; the correction's rotation of every token's input and
    output gradient `2T Σ (d_in² + d_out²)` and per-sample sums `2T Σ d_in d_out`; the scores'
    per-sample gradients `2T Σ d_in d_out` and their inner products with each query.
    """
    modules = dict(model.named_modules())
    shapes = [(modules[n].in_features + 1, modules[n].out_features) for n in tracked]
    T, d, V = cfg["tokens"], cfg["dim"], cfg["vocab"]
    mn = sum(a * b for a, b in shapes)
    squares = sum(a * a + b * b for a, b in shapes)
    forward = 2 * T * mn + 2 * T * d * V + 4 * T * T * d * cfg["layers"]
    per_train = 3 * 2 * forward + T * squares + 2 * T * squares + 2 * T * mn
    per_train += 2 * T * mn + 2 * cfg["query"] * mn
    per_query = 2 * forward + 2 * T * mn + 4 * sum(a * b * (a + b) for a, b in shapes)
    return {
        "total": cfg["train"] * per_train + cfg["query"] * per_query,
        "head share": 2 * T * d * V * 2 * (3 * cfg["train"] + cfg["query"]),
    }


def gemm_rate(cfg: dict[str, Any], threads: int) -> float:
    """The best float32 matrix-product rate (FLOP/s) of this machine at the run's shapes."""
    torch.set_num_threads(threads)
    rows, d = cfg["batch"] * cfg["tokens"], cfg["dim"]
    best = 0.0
    for inner, outer in ((d, cfg["vocab"]), (d, 4 * d), (4 * d, d)):
        a, b = torch.randn(rows, inner), torch.randn(inner, outer)
        a @ b  # warm-up
        start, repeats = time.perf_counter(), 5
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * rows * inner * outer * repeats / (time.perf_counter() - start))
    return best


def eigh_seconds(model: nn.Module, tracked: list[str], dtype: torch.dtype) -> float:
    """Seconds of the fit's eigendecompositions (one per Kronecker factor), timed once per size."""
    modules = dict(model.named_modules())
    sizes = [d for n in tracked for d in (modules[n].in_features + 1, modules[n].out_features)]
    timed: dict[int, float] = {}
    for size in set(sizes):
        a = torch.randn(size, size, dtype=dtype)
        a = a @ a.T
        start = time.perf_counter()
        torch.linalg.eigh(a)
        timed[size] = time.perf_counter() - start
    return sum(timed[size] for size in sizes)


def floor_line(model, tracked, cfg, threads: int, ours=None, theirs=None) -> str:
    """The floor as a sentence: the arithmetic at this machine's best matrix-product rate and
    the factors' eigendecompositions in float64 (as both libraries take them)."""
    flops = floor_flops(model, tracked, cfg)
    rate = gemm_rate(cfg, threads)
    eigh64 = eigh_seconds(model, tracked, torch.float64)
    eigh32 = eigh_seconds(model, tracked, torch.float32)
    floor = flops["total"] / rate + eigh64
    line = (
        f"Floor: {flops['total'] / 1e12:.2f} TFLOP of arithmetic (`floor_flops`; "
        f"{flops['head share'] / flops['total']:.0%} of it the tied head's logits and their input "
        f"gradient), {flops['total'] / rate:.0f} s at this machine's best float32 "
        f"matrix-product rate with {threads} threads ({rate / 1e9:.0f} GFLOP/s), plus "
        f"{eigh64:.0f} s for the {2 * len(tracked)} eigendecompositions in float64 "
        f"({eigh32:.0f} s in float32): no implementation takes under {floor:.0f} s."
    )
    if ours and theirs and "seconds" in ours and "seconds" in theirs:
        line += (
            f" backpack takes {ours['seconds'] / floor:.1f}× that floor, kronfluence "
            f"{theirs['seconds'] / floor:.1f}×; half kronfluence's time is "
            f"{theirs['seconds'] / 2 / floor:.2f}× the floor."
        )
    return line


def main(argv: list[str] | None = None) -> int:
    parser = report_parser(__doc__, threads=2)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--train", type=int, default=None)
    parser.add_argument("--query", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--hsdp",
        type=int,
        default=0,
        help="shard on HSDP's 2-D mesh of this many replica groups (--ranks in all)",
    )
    parser.add_argument(
        "--query-ranks",
        type=int,
        nargs="*",
        default=[1, 2, 4, 8, 16, 32, 64, 128],
        help="the query_rank values whose score error is reported (none: skip)",
    )
    parser.add_argument("--without-kronfluence", action="store_true", help="only backpack's rows")
    parser.add_argument(
        "--floor-only", action="store_true", help="print the arithmetic floor, run nothing"
    )
    args = parser.parse_args(argv)
    cfg = dict(TINY if args.tiny else FULL)
    cfg.update(
        train=16 if args.tiny else 256, query=4 if args.tiny else 16, batch=4 if args.tiny else 8
    )
    for key in ("layers", "train", "query", "tokens", "batch"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["threads"] = args.threads
    cfg["hsdp"] = args.hsdp
    cfg["ranks_for_error"] = args.query_ranks
    peers = importlib.util.find_spec("kronfluence") is not None and not args.without_kronfluence
    model, tracked, *_ = problem(cfg)
    if args.floor_only:
        print(floor_line(model, tracked, cfg, args.threads))
        return 0
    swept = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    lines = [
        "# Attribution at LLM scale: backpack vs kronfluence 1.0.1 (CPU)",
        "",
        f"torch {torch.__version__}, {args.threads} threads in all, float32, "
        f"`python -m benchmarks.influence_llm_scale {' '.join(argv or sys.argv[1:])}`.",
        "",
        f"GPT of {cfg['layers']} blocks, width {cfg['dim']}, vocabulary {cfg['vocab']} (tied "
        f"head): {total / 1e6:.1f}M parameters, EK-FAC on the {len(tracked)} block `nn.Linear` "
        f"layers ({swept / 1e6:.1f}M); {cfg['train']} training × {cfg['query']} query "
        f"sequences of {cfg['tokens']} tokens, batches of {cfg['batch']}. Fit + pairwise scores: "
        "wall time, peak resident memory of the run (per process), and the scores' relative "
        "error / largest deviation (`‖S − R‖_F / ‖R‖_F`, `max |S − R| / max |R|`).",
        "",
        "| run | seconds | peak MiB per process | scores vs | note |",
        "|---|---|---|---|---|",
    ]
    ours = measure("backpack", 1, cfg)
    print(_row("backpack, 1 process", ours, None, ""), flush=True)
    theirs = measure("kronfluence", 1, cfg) if peers else None
    lines.append(_row("backpack, 1 process", ours, theirs, "kronfluence"))
    if theirs is not None:
        lines.append(_row("kronfluence, 1 process", theirs, None, ""))
    if args.ranks > 1:
        sharded = measure("backpack", args.ranks, cfg)
        label = f"backpack, FSDP2 on {args.ranks} gloo processes"
        if args.hsdp:
            mesh = f"{args.hsdp} × {args.ranks // args.hsdp}"
            label = f"backpack, HSDP ({mesh} mesh) on {args.ranks} gloo processes"
        lines.append(_row(label, sharded, ours, "1 process"))
    if theirs is not None and "seconds" in ours and "seconds" in theirs:
        lines += [
            "",
            f"Time ratio backpack / kronfluence (one process each): "
            f"{ours['seconds'] / theirs['seconds']:.2f}; peak-memory ratio: "
            f"{ours['peak'] / max(theirs['peak'], 1):.2f}.",
        ]
    lines += ["", floor_line(model, tracked, cfg, args.threads, ours, theirs)]
    errors = ours.get("rank_errors")
    if errors:
        enough = [r for r, e in sorted(errors.items()) if e <= 0.01]
        lines += [
            "",
            "`query_rank=r` (preconditioned query gradients kept at rank r per layer, truncated in "
            "the default Fisher norm): relative error `‖S_r − S‖_F / ‖S‖_F` of the scores "
            "against a quarter of the training sequences (`Influence.query_rank_error`): "
            + ", ".join(f"r = {r}: {e:.1e}" for r, e in sorted(errors.items()))
            + f"; rank for 1 %: {enough[0] if enough else f'> {max(errors)}'}.",
        ]
    return finish(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
