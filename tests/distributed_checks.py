"""Checks run inside gloo processes by tests/test_distributed.py (not collected by pytest).

Each rank builds the same global batch from a fixed seed, runs its shard under
`with backpack(...)`, and compares with one process computing on the concatenated batch
(`sync=False`, in the same worker). A scenario is a list of named checks; each rank records
every check's failure (or None) in `outdir/rank<r>.json`, after every check, so that a hang
still leaves the earlier results behind.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from backpack import backpack, distributed, extend
from backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchDotGrad,
    BatchGrad,
    BatchJacobian,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)

#: per-sample quantities: axis of the samples ("block": batch_dot's [N, N])
ROWS = {
    "grad_batch": 0,
    "batch_l2": 0,
    "batch_dot": "block",
    "diag_ggn_exact_batch": 0,
    "diag_ggn_mc_batch": 0,
    "diag_h_batch": 0,
    "sqrt_ggn_exact": 1,
    "sqrt_ggn_mc": 1,
    "jac_batch": 0,
}
GLOBAL = ["sum_grad_squared", "variance", "diag_ggn_exact", "diag_ggn_mc", "diag_h"]
KRON = ["kflr", "kfac"]
PRODUCTS = ["ggnmp", "hmp", "pchmp"]
SIZES = {2: [3, 5], 3: [2, 4, 3]}


def _preload() -> None:
    """Import what the extensions load lazily once, in the fork server (tests/test_distributed)."""
    GGNMP()
    KFLR()


def exact_extensions() -> list:
    return [
        BatchGrad(),
        BatchL2Grad(),
        SumGradSquared(),
        Variance(),
        BatchDotGrad(),
        DiagGGNExact(),
        BatchDiagGGNExact(),
        SqrtGGNExact(),
        BatchJacobian(),
        DiagHessian(),
        BatchDiagHessian(),
        KFLR(),
        GGNMP(),
        HMP(),
        PCHMP(),
    ]


def reduced_extensions() -> list:
    """Quantities that convolutional graphs sum column by column (`secondorder._reduce_columns`)."""
    return [
        Variance(),
        DiagGGNExact(),
        BatchDiagGGNExact(),
        DiagHessian(),
        BatchDiagHessian(),
        KFLR(),
    ]


def mc_extensions() -> list:
    return [BatchGrad(), DiagGGNMC(), BatchDiagGGNMC(), SqrtGGNMC(), KFAC()]


class Checker:
    def __init__(self, rank: int, world: int, outdir: str) -> None:
        self.rank, self.world, self.outdir = rank, world, outdir
        self.results: dict[str, str | None] = {}

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.results[name] = None
        except Exception:  # noqa: BLE001 - every failure is reported by name
            self.results[name] = traceback.format_exc(limit=6)[-3000:]
        path = os.path.join(self.outdir, f"rank{self.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.results, f)
        os.replace(path + ".tmp", path)


# --- problems ----------------------------------------------------------------------------------
def mlp(out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, out))


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3))


def batch(kind: str, n: int, in_shape: tuple, out: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *in_shape, generator=g, dtype=torch.float64)
    if kind == "ce":
        y = torch.randint(0, out, (n,), generator=g)
    elif kind == "ce_ignore":
        y = torch.randint(0, out, (n,), generator=g)
        y[::3] = -100  # a different number of ignored targets on each rank
    elif kind == "bce":
        y = torch.rand(n, out, generator=g, dtype=torch.float64).round()
    else:
        y = torch.randn(n, out, generator=g, dtype=torch.float64)
    return x, y


def loss_function(kind: str, reduction: str) -> nn.Module:
    if kind in ("ce", "ce_ignore"):
        return nn.CrossEntropyLoss(reduction=reduction)
    if kind == "bce":
        return nn.BCEWithLogitsLoss(reduction=reduction)
    return nn.MSELoss(reduction=reduction)


def pair(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """The rank's model and a reference copy (same parameters on every rank)."""
    torch.manual_seed(0)
    model = extend(make().double())
    return model, extend(copy.deepcopy(model))


def shard(tensors, sizes: list[int], rank: int):
    start = sum(sizes[:rank])
    return [t[start : start + sizes[rank]] for t in tensors], start, start + sizes[rank]


def rows_of(value, axis, start, stop):
    if axis == "block":
        return value[start:stop, start:stop]
    index = [slice(None)] * value.dim()
    index[axis] = slice(start, stop)
    return value[tuple(index)]


def close(a, b, what: str) -> None:
    if isinstance(a, list):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{what}[{i}]")
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a, b, rtol=1e-7, atol=1e-10), (
        f"{what}: max abs diff {(a - b).abs().max().item():.3e} (scale {b.abs().max().item():.3e})"
    )


def all_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def compare(model, ref, start, stop, fields=None, products=True, rows_sum=True) -> None:
    """Global quantities equal, local rows equal the reference's rows of this shard.

    Returns the quantities compared (those the reference has).
    """
    g = torch.Generator().manual_seed(11)
    seen = set()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        for field in fields or [*ROWS, *GLOBAL, *KRON, *PRODUCTS]:
            if not hasattr(q, field):
                continue
            seen.add(field)
            ours, theirs = getattr(p, field), getattr(q, field)
            what = f"{name}.{field}"
            if field in ROWS:
                close(ours, rows_of(theirs, ROWS[field], start, stop), what)
            elif field in PRODUCTS:
                if not products:
                    continue
                mat = torch.randn(2, *p.shape, generator=g, dtype=p.dtype)
                close(ours(mat), theirs(mat), what)
                close(all_sum(ours.local(mat)), theirs(mat), what + ".local")
            else:
                close(ours, theirs, what)
        if rows_sum and hasattr(p, "grad_batch") and p.grad_batch.shape[0] == stop - start:
            # the ranks' rows add up to the gradient of the global batch
            close(all_sum(p.grad_batch.sum(0)), q.grad, f"{name}: sum of grad_batch rows")
    return seen


# --- scenarios ---------------------------------------------------------------------------------
def exact_case(
    kind: str, reduction: str, make=mlp, in_shape=(4,), ddp: bool = False, exts=exact_extensions
):
    def check(rank: int, world: int) -> None:
        model, ref = pair(make)
        x, y = batch(kind, sum(SIZES[world]), in_shape, 3)
        (xr, yr), start, stop = shard([x, y], SIZES[world], rank)
        lf = extend(loss_function(kind, reduction))
        net = nn.parallel.DistributedDataParallel(model) if ddp else model
        with backpack(*exts()):
            lf(net(xr), yr).backward()
        with backpack(*exts(), sync=False):
            lf(ref(x), y).backward()
        seen = compare(model, ref, start, stop)
        assert seen == {e.savefield for e in exts()}, seen

    return check


def mc_case(kind: str, reduction: str):
    """Monte-Carlo quantities: ranks sample independently; compare with the seeded shards."""

    def local(model, lf, x, y, seed):
        torch.manual_seed(seed)
        with backpack(*mc_extensions(), sync=False):
            lf(model(x), y).backward()
        out = {}
        for name, p in model.named_parameters():
            out[name] = {e.savefield: getattr(p, e.savefield) for e in mc_extensions()}
        return out

    def check(rank: int, world: int) -> None:
        model, ref = pair(mlp)
        sizes = SIZES[world]
        x, y = batch(kind, sum(sizes), (4,), 3)
        lf = extend(loss_function(kind, reduction))
        shards = [shard([x, y], sizes, r)[0] for r in range(world)]
        nus = [
            1.0 if reduction == "sum" else float(s[1].numel() if kind != "ce" else len(s[1]))
            for s in shards
        ]
        rho = [nu / sum(nus) if reduction == "mean" else 1.0 for nu in nus]
        each = [local(ref, lf, sx, sy, 100 + r) for r, (sx, sy) in enumerate(shards)]
        torch.manual_seed(100 + rank)
        with backpack(*mc_extensions()):
            lf(model(shards[rank][0]), shards[rank][1]).backward()
        for name, p in model.named_parameters():
            mine = each[rank][name]
            close(p.grad_batch, mine["grad_batch"] * rho[rank], f"{name}.grad_batch")
            close(p.diag_ggn_mc_batch, mine["diag_ggn_mc_batch"] * rho[rank], f"{name}.batch mc")
            close(p.sqrt_ggn_mc, mine["sqrt_ggn_mc"] * rho[rank] ** 0.5, f"{name}.sqrt_ggn_mc")
            diag = sum(r * e[name]["diag_ggn_mc"] for r, e in zip(rho, each))
            close(p.diag_ggn_mc, diag, f"{name}.diag_ggn_mc")
            kfac = [sum(r * e[name]["kfac"][0] for r, e in zip(rho, each))]
            if len(mine["kfac"]) > 1:
                kfac.append(sum(s * e[name]["kfac"][1] for s, e in zip(sizes, each)) / sum(sizes))
            close(p.kfac, kfac, f"{name}.kfac")

    return check


def float32_passes(rank: int, world: int) -> None:
    """float32 (header in a float32 buffer), several passes per context (retain_graph)."""
    torch.manual_seed(0)
    model = extend(mlp())
    ref = extend(copy.deepcopy(model))
    x, y = batch("mse", sum(SIZES[world]), (4,), 3)
    x, y = x.float(), y.float()
    (xr, yr), start, stop = shard([x, y], SIZES[world], rank)
    lf = extend(nn.MSELoss())
    exts = [BatchGrad, SumGradSquared, Variance, DiagGGNExact, KFLR]
    for _ in range(2):
        with backpack(*[e() for e in exts], retain_graph=True):
            loss = lf(model(xr), yr)
            loss.backward(retain_graph=True)
            loss.backward()
    with backpack(*[e() for e in exts], sync=False):
        lf(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        pairs = [(p.grad_batch, q.grad_batch[start:stop])]
        pairs += [(getattr(p, f), getattr(q, f)) for f in GLOBAL if hasattr(q, f)]
        pairs += list(zip(p.kflr, q.kflr))
        for ours, theirs in pairs:
            assert ours.dtype == torch.float32
            error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
            assert error < 1e-5, f"{name}: relative error {error:.2e}"


def sync_false(rank: int, world: int) -> None:
    model, ref = pair(mlp)
    x, y = batch("ce", sum(SIZES[world]), (4,), 3)
    (xr, yr), _, _ = shard([x, y], SIZES[world], rank)
    lf = extend(nn.CrossEntropyLoss())
    with backpack(*exact_extensions(), sync=False):
        lf(model(xr), yr).backward()
    with backpack(*exact_extensions(), sync=False):
        lf(ref(xr), yr).backward()
    compare(model, ref, 0, len(xr), products=False, rows_sum=False)


def equal_batches_ddp_grad(rank: int, world: int) -> None:
    """Equal shards, mean: DDP's .grad is the global gradient, = the sum of all ranks' rows."""
    model, ref = pair(mlp)
    sizes = [4] * world
    x, y = batch("ce", sum(sizes), (4,), 3)
    (xr, yr), start, stop = shard([x, y], sizes, rank)
    lf = extend(nn.CrossEntropyLoss())
    net = nn.parallel.DistributedDataParallel(model)
    with backpack(BatchGrad(), SumGradSquared(), Variance(), KFLR()):
        lf(net(xr), yr).backward()
    with backpack(BatchGrad(), SumGradSquared(), Variance(), KFLR(), sync=False):
        lf(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.grad, q.grad, f"{name}: DDP .grad")
        close(all_sum(p.grad_batch.sum(0)), p.grad, f"{name}: rows vs DDP .grad")
    compare(model, ref, start, stop, ["grad_batch", "sum_grad_squared", "variance", "kflr"])


def variance_precision(rank: int, world: int) -> None:
    """Samples agreeing to 5 digits: the global variance is that of the concatenated batch's
    per-sample gradients, with the ranks' centred sums and the spread of their means (the
    one-pass Σg²/N − (Σg/N)² kept about 6 digits of 16 in float64, none in float32)."""
    sizes = SIZES[world]
    for dtype, spread, rtol in ((torch.float64, 1e-5, 1e-8), (torch.float32, 1e-3, 1e-2)):
        torch.manual_seed(0)
        model = extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).to(dtype))
        ref = extend(copy.deepcopy(model))
        g = torch.Generator().manual_seed(3)
        x = 1.0 + spread * torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
        y = 3.0 + spread * torch.randn(sum(sizes), 2, generator=g, dtype=torch.float64)
        x, y = x.to(dtype), y.to(dtype)
        (xr, yr), _, _ = shard([x, y], sizes, rank)
        for reduction in ("mean", "sum"):
            lf = extend(nn.MSELoss(reduction=reduction))
            with backpack(Variance()):
                lf(model(xr), yr).backward()
            with backpack(BatchGrad(), sync=False):
                lf(ref(x), y).backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                expected = q.grad_batch.double().var(0, unbiased=False)
                what = f"{name}.variance ({dtype}, {reduction})"
                assert torch.allclose(p.variance.double(), expected, rtol=rtol, atol=0), (
                    f"{what}: max rel diff "
                    f"{((p.variance.double() - expected).abs() / expected).max().item():.3e}"
                )


def weighted_mean(state: dict, bucket):
    """DDP communication hook (docs/distributed.md): each rank's gradient weighs N_r / N."""
    buffer = bucket.buffer().mul_(state["weight"])
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def uneven_ddp_comm_hook(rank: int, world: int) -> None:
    """Uneven shards: with the hook of the docs, DDP's .grad is the global batch's gradient."""
    model, ref = pair(mlp)
    sizes = SIZES[world]
    x, y = batch("ce", sum(sizes), (4,), 3)
    (xr, yr), start, stop = shard([x, y], sizes, rank)
    lf = extend(nn.CrossEntropyLoss())
    net = nn.parallel.DistributedDataParallel(model)
    net.register_comm_hook({"weight": len(yr) / len(y)}, weighted_mean)
    with backpack(BatchGrad(), Variance()):
        lf(net(xr), yr).backward()
    with backpack(BatchGrad(), Variance(), sync=False):
        lf(ref(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(p.grad, q.grad, f"{name}: DDP .grad with the weighting hook")
    compare(model, ref, start, stop, ["grad_batch", "variance"])


def two_losses(rank: int, world: int) -> None:
    """CE + MSE on one output: equal local-to-global ratios on every rank, so exact."""
    model, ref = pair(mlp)
    sizes = SIZES[world]
    x, y = batch("ce", sum(sizes), (4,), 3)
    t = batch("mse", sum(sizes), (4,), 3, seed=7)[1]
    (xr, yr, tr), start, stop = shard([x, y, t], sizes, rank)
    ce, mse = extend(nn.CrossEntropyLoss()), extend(nn.MSELoss())
    exts = [BatchGrad, SumGradSquared, Variance, DiagGGNExact, KFLR, SqrtGGNExact, GGNMP]
    with backpack(*[e() for e in exts]):
        out = model(xr)
        (ce(out, yr) + 0.5 * mse(out, tr)).backward()
    with backpack(*[e() for e in exts], sync=False):
        out = ref(x)
        (ce(out, y) + 0.5 * mse(out, t)).backward()
    compare(model, ref, start, stop)


def two_losses_refused(rank: int, world: int) -> None:
    model, _ = pair(mlp)
    sizes = SIZES[world]
    x, y = batch("ce_ignore", sum(sizes), (4,), 3)
    t = batch("mse", sum(sizes), (4,), 3, seed=7)[1]
    (xr, yr, tr), _, _ = shard([x, y, t], sizes, rank)
    ce, mse = extend(nn.CrossEntropyLoss()), extend(nn.MSELoss())
    try:
        with backpack(SumGradSquared(), BatchGrad()):
            out = model(xr)
            (ce(out, yr) + mse(out, tr)).backward()
    except NotImplementedError as err:
        assert "share of the global batch" in str(err), err
    else:
        raise AssertionError("several losses with different ratios were not refused")


def no_sync(rank: int, world: int) -> None:
    """DDP gradient accumulation: sync=ddp follows no_sync(); sync=None always synchronises."""
    model, ref = pair(mlp)
    local_ref = copy.deepcopy(ref)
    sizes = SIZES[world]
    net = nn.parallel.DistributedDataParallel(model)
    lf = extend(nn.CrossEntropyLoss())
    steps = [batch("ce", sum(sizes), (4,), 3, seed=s) for s in (21, 22)]
    exts = [BatchGrad, SumGradSquared, Variance, DiagGGNExact, KFLR]
    for follow in (net, None):
        for step, (x, y) in enumerate(steps):
            (xr, yr), start, stop = shard([x, y], sizes, rank)
            last = step == len(steps) - 1
            with net.no_sync() if not last else nullcontext():
                with backpack(*[e() for e in exts], sync=follow):
                    lf(net(xr), yr).backward()
            if follow is net and not last:
                # inside no_sync: this rank's local quantities, no communication
                with backpack(*[e() for e in exts], sync=False):
                    lf(local_ref(xr), yr).backward()
                compare(model, local_ref, 0, stop - start, rows_sum=False)
            else:
                ref.zero_grad()
                with backpack(*[e() for e in exts], sync=False):
                    lf(ref(x), y).backward()
                compare(model, ref, start, stop)
        net.zero_grad()


def collectives(rank: int, world: int) -> None:
    """One all-reduce per pass: two in the first pass of a set of quantities, then one.

    `Variance` adds one (the spread of the ranks' means, known after the first).
    """
    calls = []
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    model, _ = pair(mlp)
    x, y = batch("ce", 4, (4,), 3)
    lf = extend(nn.CrossEntropyLoss())
    distributed._LAYOUTS.clear()  # as in a fresh process (on every rank)
    dist.all_reduce = counting
    try:
        without = [e for e in exact_extensions()[:-3] if not isinstance(e, Variance)]
        for variance in (False, True):
            distributed._LAYOUTS.clear()
            counts = []
            for _ in range(3):
                with backpack(*without, *([Variance()] if variance else [])):
                    lf(model(x), y).backward()
                counts.append(len(calls))
                calls.clear()
            assert counts == ([3, 2, 2] if variance else [2, 1, 1]), (variance, counts)
        for _ in range(2):  # per-sample quantities only: the header alone
            with backpack(BatchGrad(), BatchL2Grad()):
                lf(model(x), y).backward()
            assert len(calls) == 1, calls
            calls.clear()
    finally:
        dist.all_reduce = original


def functional_loss(rank: int, world: int) -> None:
    """A loss called as a function (recognised by backpack) scales like an extended one."""
    model, ref = pair(mlp)
    x, y = batch("ce_ignore", sum(SIZES[world]), (4,), 3)
    (xr, yr), start, stop = shard([x, y], SIZES[world], rank)
    exts = [BatchGrad, SumGradSquared, Variance, DiagGGNExact, KFLR, SqrtGGNExact]
    with backpack(*[e() for e in exts]):
        nn.functional.cross_entropy(model(xr), yr).backward()
    with backpack(*[e() for e in exts], sync=False):
        nn.functional.cross_entropy(ref(x), y).backward()
    compare(model, ref, start, stop)


def unextended_loss(rank: int, world: int) -> None:
    model, _ = pair(mlp)
    x, t = batch("mse", 4, (4,), 3)
    try:
        with backpack(BatchGrad()):
            nn.functional.l1_loss(model(x), t).backward()  # a loss backpack does not know
    except RuntimeError as err:
        assert "extend" in str(err), err
    else:
        raise AssertionError("no error without an extended loss")


def different_quantities(rank: int, world: int) -> None:
    """A rank that computes other quantities (a frozen parameter) makes every rank raise.

    Before and after, the ranks agree (the agreed buffer shape survives the refused pass).
    """
    model, ref = pair(mlp)
    x, y = batch("ce", 4, (4,), 3)
    lf = extend(nn.CrossEntropyLoss())
    with backpack(SumGradSquared(), Variance()):
        lf(model(x), y).backward()
    if rank == world - 1:
        model[0].bias.requires_grad_(False)
    try:
        with backpack(SumGradSquared(), Variance()):
            lf(model(x), y).backward()
    except RuntimeError as err:
        assert "different quantities" in str(err), err
    else:
        raise AssertionError("different quantities were not refused")
    model[0].bias.requires_grad_(True)
    with backpack(SumGradSquared(), Variance()):
        lf(model(x), y).backward()
    xs, ys = torch.cat([x] * world), torch.cat([y] * world)  # every rank holds the same batch
    with backpack(SumGradSquared(), Variance(), sync=False):
        lf(ref(xs), ys).backward()
    compare(model, ref, 0, 0, ["sum_grad_squared", "variance"])


def kfra_refused(rank: int, world: int) -> None:
    try:
        with backpack(KFRA()):
            pass
    except NotImplementedError as err:
        assert "sync=False" in str(err), err
    else:
        raise AssertionError("KFRA under sync was not refused")
    with backpack(KFRA(), sync=False) as ctx:
        assert ctx._engine.sync is None
        ctx._engine.passes = 1  # nothing ran: no "nothing extended" warning


def fsdp_refused(rank: int, world: int) -> None:
    """FSDP2 (fully_shard): a clear error when the context is entered."""
    from torch.distributed.fsdp import fully_shard

    model, _ = pair(mlp)
    fully_shard(model)
    try:
        with backpack(SumGradSquared()):
            pass
    except NotImplementedError as err:
        assert "DistributedDataParallel" in str(err) and "accumulate" in str(err), err
    else:
        raise AssertionError("fully_shard was not refused")
    with backpack(SumGradSquared(), sync=False) as ctx:
        ctx._engine.passes = 1  # nothing ran: no "nothing extended" warning


MAIN: list[tuple[str, Callable]] = [
    *[
        (f"exact-{kind}-{red}", exact_case(kind, red))
        for kind in ("ce", "mse")
        for red in ("mean", "sum")
    ],
    ("exact-ce_ignore-mean", exact_case("ce_ignore", "mean")),
    ("exact-bce-mean", exact_case("bce", "mean")),
    ("exact-conv-ce-mean-ddp", exact_case("ce", "mean", convnet, (2, 6), ddp=True)),
    (
        "reduced-conv-ce-sum-ddp",
        exact_case("ce", "sum", convnet, (2, 6), ddp=True, exts=reduced_extensions),
    ),
    ("mc-ce-mean", mc_case("ce", "mean")),
    ("mc-mse-sum", mc_case("mse", "sum")),
    ("float32-passes", float32_passes),
    ("variance-precision", variance_precision),
    ("sync-false", sync_false),
    ("equal-batches-ddp-grad", equal_batches_ddp_grad),
    ("uneven-ddp-comm-hook", uneven_ddp_comm_hook),
    ("two-losses", two_losses),
    ("two-losses-refused", two_losses_refused),
    ("no-sync", no_sync),
    ("collectives", collectives),
    ("functional-loss", functional_loss),
    ("unextended-loss", unextended_loss),
    ("different-quantities", different_quantities),
    ("kfra-refused", kfra_refused),
    ("fsdp-refused", fsdp_refused),  # last: the sharded model stays registered with FSDP
]


# --- errors ------------------------------------------------------------------------------------
def _expect_error(rank: int, failing: int, run: Callable[[], None], limit: float) -> None:
    start = time.monotonic()
    try:
        run()
    except ValueError as err:
        assert rank == failing and "boom" in str(err), err
    except RuntimeError as err:
        assert rank != failing, err
        assert f"rank(s) [{failing}]" in str(err), err
    else:
        raise AssertionError("no error")
    elapsed = time.monotonic() - start
    assert elapsed < limit, f"the error took {elapsed:.1f} s"


def error_in_backward(rank: int, world: int, ddp: bool = False) -> None:
    """A rank raising inside backpack's backward: the others raise at once, none waits."""
    model, _ = pair(mlp)
    net = nn.parallel.DistributedDataParallel(model) if ddp else model
    x, y = batch("ce", 4, (4,), 3)
    lf = extend(nn.CrossEntropyLoss())
    failing = world - 1

    def hook(module):
        if rank == failing:
            raise ValueError("boom")

    with backpack(BatchGrad(), DiagGGNExact()):  # agree on the buffers: one collective next
        lf(net(x), y).backward()
    net.zero_grad()

    def run():
        with backpack(BatchGrad(), DiagGGNExact(), extension_hook=hook):
            lf(net(x), y).backward()

    _expect_error(rank, failing, run, limit=5.0)


def after_error(rank: int, world: int) -> None:
    """The ranks stay in step after an agreed error: the next passes are global again."""
    model, ref = pair(mlp)
    x, y = batch("ce", sum(SIZES[world]), (4,), 3)
    (xr, yr), start, stop = shard([x, y], SIZES[world], rank)
    lf = extend(nn.CrossEntropyLoss())
    with backpack(BatchGrad(), DiagGGNExact()):  # the extensions of the failed pass
        lf(model(xr), yr).backward()
    with backpack(BatchGrad(), DiagGGNExact(), sync=False):
        lf(ref(x), y).backward()
    compare(model, ref, start, stop, ["grad_batch", "diag_ggn_exact"])
    exact_case("ce", "mean")(rank, world)


def timeout(rank: int, world: int) -> None:
    """A rank that never reaches its backward: the others raise after the timeout."""
    distributed.TIMEOUT_S = 3.0
    model, _ = pair(mlp)
    x, y = batch("ce", 4, (4,), 3)
    lf = extend(nn.CrossEntropyLoss())
    start = time.monotonic()
    try:
        with backpack(SumGradSquared()):  # creates backpack's group with the short timeout
            if rank == world - 1:
                raise KeyError("an error outside backpack")
            lf(model(x), y).backward()
    except KeyError:
        assert rank == world - 1
    except RuntimeError as err:
        assert rank != world - 1 and "within 3 s" in str(err), err
        elapsed = time.monotonic() - start
        assert 2.5 < elapsed < 15, f"the timeout took {elapsed:.1f} s"
    else:
        raise AssertionError("no error")
    finally:
        dist.barrier()
        distributed._forget_group()
        distributed.TIMEOUT_S = 300.0


ERRORS: list[tuple[str, Callable]] = [
    ("error-in-backward", error_in_backward),
    ("after-error", after_error),
    ("timeout", timeout),
    # last: DDP's own reduction is left unfinished on the ranks that did not fail
    ("error-in-backward-ddp", lambda r, w: error_in_backward(r, w, ddp=True)),
]
SCENARIOS = {"main": MAIN, "errors": ERRORS}
_preload()


#: `(replicas, shards)` of HSDP's 2-D mesh while a check runs `under_hsdp` (empty otherwise)
_HSDP: list[tuple[int, int]] = []
_MESHES: dict[tuple[int, int], object] = {}


def fsdp_kwargs() -> dict:
    """fully_shard's mesh argument in the checks: HSDP's 2-D mesh `under_hsdp`, else none."""
    if not _HSDP:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    shape = _HSDP[0]
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return {"mesh": _MESHES[shape]}


def chunk_position(rank: int, world: int) -> tuple[int, int]:
    """`(index, count)` of the chunk rank `rank` holds of a parameter FSDP2 shards.

    FSDP2's 1-D mesh: chunk `rank` of `world`. HSDP's `(R, S)` mesh (ranks row-major): chunk
    `rank % S` of S, the same in every replica group.
    """
    if not _HSDP:
        return rank, world
    shards = _HSDP[0][1]
    return rank % shards, shards


def local_vector(model, full):
    """This rank's rows of a whole-model vector/matrix `full` `[P, ...]` (FSDP2 chunks along
    each parameter's sharded dimension)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out, start = [], 0
    for _, p in model.named_parameters():
        n = p.numel()
        piece = full[start : start + n].reshape(*p.shape, *full.shape[1:])
        dim = next(x.dim for x in p.placements if type(x).__name__ == "Shard")
        index, count = chunk_position(rank, world)
        chunks = piece.chunk(count, dim=dim)
        mine = chunks[index] if index < len(chunks) else piece.narrow(dim, 0, 0)
        out.append(mine.reshape(-1, *full.shape[1:]))
        start += n
    return torch.cat(out)


def under_hsdp(check: Callable, replicas: int = 2) -> Callable:
    """`check` with fully_shard on HSDP's `(replicas, world // replicas)` mesh in the checks."""

    def run(rank: int, world: int) -> None:
        _HSDP[:] = [(replicas, world // replicas)]
        try:
            check(rank, world)
        finally:
            _HSDP.clear()

    return run


def run_checks(
    rank: int,
    world: int,
    port: int,
    outdir: str,
    checks: list[tuple[str, Callable]],
    timeout_s: float = 30.0,
) -> None:
    """A worker's body: join the gloo group, run every `check(rank, world)` and record its
    failure (or None) by name in `outdir/rank<r>.json`, then exit without teardown."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    checker = Checker(rank, world, outdir)
    for name, check in checks:
        checker.run(name, lambda check=check: check(rank, world))
    sys.stdout.flush()
    os._exit(0)  # skip teardown: an error check may leave DDP's reduction pending


def worker(rank: int, world: int, port: int, scenario: str, outdir: str) -> None:
    run_checks(rank, world, port, outdir, SCENARIOS[scenario])
