"""Checks run inside gloo processes by test_curvature_distributed.py (not collected by pytest).

Each rank sweeps its own shard of a tiny float64 data set (the shards differ in their numbers
and sizes of batches) with `distributed=True`, and compares with one process sweeping the
concatenation of all shards (`distributed=False`, in the same worker). Each rank records every
check's failure (or None) in `outdir/rank<r>.json` after every check.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from curvature_problems import PROBLEMS
from distributed_checks import chunk_position, fsdp_kwargs, run_checks, under_hsdp
from torch import nn

from backpack import distributed
from backpack.curvature import EKFAC, GGN, KFAC, EmpiricalFisher, Hessian, accumulate
from backpack.extensions import (
    KFLR,
    BatchDiagGGNExact,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from backpack.passes import state

#: batch sizes of each rank's shard (11 samples in all): uneven numbers and sizes of batches
SHARDS = {2: [[3, 4], [1, 2, 1]], 3: [[2, 1, 3], [4], [1]]}
#: per-sample quantities: the axis of the samples
ROWS = {"grad_batch": 0, "batch_l2": 0, "diag_ggn_exact_batch": 0, "sqrt_ggn_exact": 1}


def extensions() -> list:
    return [
        BatchGrad(),
        BatchL2Grad(),
        SumGradSquared(),
        Variance(),
        DiagGGNExact(),
        BatchDiagGGNExact(),
        SqrtGGNExact(),
        DiagHessian(),
        KFLR(),
    ]


def close(a, b, what: str) -> None:
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{what}[{i}]")
        return
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), (
        f"{what}: max abs diff {(a - b).abs().max().item():.3e} (scale {b.abs().max().item():.3e})"
    )


def shards(name: str, rank: int, world: int):
    """This rank's batches, the concatenated data set's batches, this rank's sample range."""
    problem = PROBLEMS[name]
    sizes = [s for shard in SHARDS[world] for s in shard]
    everything = problem.batches(sizes)
    before = sum(len(s) for s in SHARDS[world][:rank])
    mine = everything[before : before + len(SHARDS[world][rank])]
    start = sum(sum(s) for s in SHARDS[world][:rank])
    return problem, mine, everything, start, start + sum(SHARDS[world][rank])


def rows_of(value, axis: int, start: int, stop: int):
    index = [slice(None)] * value.dim()
    index[axis] = slice(start, stop)
    return value[tuple(index)]


class NoPassSync:
    """Fails if backpack's per-pass synchronisation is set up inside a sweep (double counting)."""

    def __enter__(self):
        self.factory = state._SYNC_FACTORY[0]
        self.made = 0

        def factory(sync, exts):
            made = self.factory(sync, exts)
            self.made += made is not None
            return made

        state.register_sync_factory(factory)
        return self

    def __exit__(self, *exc):
        state.register_sync_factory(self.factory)
        assert self.made == 0, f"{self.made} per-pass PassSync inside a sweep"


def accumulate_case(name: str, reduction: str):
    def check(rank: int, world: int) -> None:
        problem, mine, everything, start, stop = shards(name, rank, world)
        model, ref = problem.model(), problem.model()
        lossfunc = problem.make_loss(reduction)
        with NoPassSync():
            result = accumulate(model, lossfunc, mine, extensions(), distributed=True)
        expected = accumulate(ref, lossfunc, everything, extensions(), distributed=False)
        assert result.total == expected.total, (result.total, expected.total)
        assert result.num_samples == expected.num_samples == problem.N
        assert result.num_batches == expected.num_batches and result.ranks == world
        for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            close(p.grad, q.grad, f"{pname}.grad")
            for field in expected.savefields:
                if field in ROWS:
                    value = rows_of(getattr(q, field), ROWS[field], start, stop)
                else:
                    value = getattr(q, field)
                close(getattr(p, field), value, f"{pname}.{field}")

    return check


def streamed(rank: int, world: int) -> None:
    """Rows streamed to a callback: ν counted over all ranks first, rows of the whole data set."""
    problem, mine, everything, start, stop = shards("mlp_ce", rank, world)
    model, ref = problem.model(), problem.model()
    lossfunc = problem.make_loss("mean")
    got: dict[str, list] = {}
    result = accumulate(
        model,
        lossfunc,
        mine,
        [BatchGrad(), DiagGGNExact()],
        callback=lambda i, pname, value: got.setdefault(pname, []).append(value),
    )  # distributed=None: on, torch.distributed runs with several processes
    assert result.stream_total == problem.normaliser("mean")
    accumulate(ref, lossfunc, everything, [BatchGrad(), DiagGGNExact()], distributed=False)
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close(torch.cat(got[pname]), q.grad_batch[start:stop], f"{pname} streamed rows")
        close(p.diag_ggn_exact, q.diag_ggn_exact, f"{pname}.diag_ggn_exact")


def operators_case(name: str, reduction: str):
    def check(rank: int, world: int) -> None:
        problem, mine, everything, _, _ = shards(name, rank, world)
        model = problem.model()
        lossfunc = problem.make_loss(reduction)
        P = sum(p.numel() for p in model.parameters())
        V = torch.randn(P, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        for Op in (GGN, Hessian, EmpiricalFisher):
            op = Op(model, lossfunc, mine, distributed=True)
            ref = Op(model, lossfunc, everything, distributed=False)
            with NoPassSync():
                close(op @ V, ref @ V, f"{Op.__name__} @ V")
            close(op @ V[:, 0], ref @ V[:, 0], f"{Op.__name__} @ v")
            close(op.diagonal(), ref.diagonal(), f"{Op.__name__}.diagonal()")
            close(op.trace(), ref.trace(), f"{Op.__name__}.trace()")
            with op.cached():  # Hessian: kept graphs, each rank its own shard's
                close(op @ V, ref @ V, f"{Op.__name__} @ V, cached")
                close(op @ V[:, 1], ref @ V[:, 1], f"{Op.__name__} @ v, cached")
        x = GGN(model, lossfunc, mine, distributed=True).inverse(0.1) @ V
        close(x, GGN(model, lossfunc, everything, distributed=False).inverse(0.1) @ V, "CG")
        for fisher_type in ("type-2", "empirical"):
            for approx in ("expand", "reduce"):
                kwargs = {"fisher_type": fisher_type, "kfac_approx": approx}
                op = KFAC(model, lossfunc, mine, distributed=True, **kwargs)
                ref = KFAC(model, lossfunc, everything, distributed=False, **kwargs)
                for pname in op.factors:
                    close(op.factors[pname], ref.factors[pname], f"KFAC {kwargs} {pname}")
                close(op @ V, ref @ V, f"KFAC {kwargs} @ V")
                assert op.normaliser_total == ref.normaliser_total
            op = EKFAC(model, lossfunc, mine, fisher_type=fisher_type, distributed=True)
            ref = EKFAC(model, lossfunc, everything, fisher_type=fisher_type, distributed=False)
            close(op @ V, ref @ V, f"EKFAC {fisher_type} @ V")
            assert op.num_samples_total == ref.num_samples_total == problem.N

    return check


def monte_carlo(rank: int, world: int) -> None:
    """Monte-Carlo quantities: every rank gets the same global result (draws seeded per rank)."""
    problem, mine, _, _, _ = shards("mlp_ce", rank, world)
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    P = sum(p.numel() for p in model.parameters())
    V = torch.randn(P, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    values = [
        GGN(model, lossfunc, mine, mc_samples=2) @ V,
        KFAC(model, lossfunc, mine, fisher_type="mc") @ V,
        torch.cat(
            [
                v.flatten()
                for v in accumulate(model, lossfunc, mine, DiagGGNMC())
                .quantity("diag_ggn_mc")
                .values()
            ]
        ),
    ]
    for i, value in enumerate(values):
        gathered = [torch.zeros_like(value) for _ in range(world)]
        dist.all_gather(gathered, value)
        for other in gathered:
            assert torch.equal(other, value), f"value {i} differs between ranks"


def ddp_model(rank: int, world: int) -> None:
    """A DistributedDataParallel model: swept without DDP's per-batch gradient all-reduce."""
    problem, mine, everything, _, _ = shards("mlp_mse", rank, world)
    model, ref = problem.model(), problem.model()
    ddp = nn.parallel.DistributedDataParallel(model)
    lossfunc = problem.make_loss("mean")
    result = accumulate(ddp, lossfunc, mine, [DiagGGNExact(), Variance()])
    accumulate(ref, lossfunc, everything, [DiagGGNExact(), Variance()], distributed=False)
    assert result.names == [n for n, _ in ref.named_parameters()]
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close(p.grad, q.grad, f"{pname}.grad")
        close(p.variance, q.variance, f"{pname}.variance")
    op = GGN(ddp, lossfunc, mine)
    V = torch.ones(op.shape[0], 2, dtype=torch.float64)
    close(op @ V, GGN(ref, lossfunc, everything, distributed=False) @ V, "GGN(ddp) @ V")


def _expect(rank: int, bad: int, run: Callable[[], None], own: type, match: str) -> None:
    expected = own if rank == bad else RuntimeError
    try:
        run()
    except expected as err:
        assert (match if rank == bad else f"rank {bad} failed") in str(err) or (
            rank != bad and "another rank failed" in str(err)
        ), err
    else:
        raise AssertionError("no error")


def failing_rank(rank: int, world: int) -> None:
    """A rank whose sweep fails: it raises its error, the others raise at once (no hang)."""
    problem, mine, _, _, _ = shards("mlp_ce", rank, world)
    lossfunc = problem.make_loss("mean")
    bad = world - 1
    data = mine if rank != bad else [(mine[0][0][:, :3], mine[0][1])]  # wrong input width

    def sweep():
        accumulate(problem.model(), lossfunc, data, DiagGGNExact(), distributed=True)

    _expect(rank, bad, sweep, RuntimeError, "mat1 and mat2")

    def product():
        op = GGN(problem.model(), lossfunc, data, distributed=True)
        op @ torch.ones(op.shape[0], dtype=torch.float64)

    _expect(rank, bad, product, RuntimeError, "mat1 and mat2")
    empty = mine if rank != bad else []
    _expect(
        rank,
        bad,
        lambda: accumulate(problem.model(), lossfunc, empty, DiagGGNExact()),
        ValueError,
        "empty data set",
    )
    # still in step: a global sweep works afterwards
    accumulate_case("mlp_ce", "sum")(rank, world)


def different_models(rank: int, world: int) -> None:
    problem, mine, _, _, _ = shards("mlp_ce", rank, world)
    model = problem.model()
    if rank == 0:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    try:
        accumulate(model, problem.make_loss("mean"), mine, DiagGGNExact())
    except RuntimeError as err:
        assert "different models" in str(err), err
    else:
        raise AssertionError("no error")


#: batch sizes of each rank's shard for FSDP2: the same number of batches, uneven sizes
FSDP_SHARDS = {
    2: [[3, 1], [2, 5]],
    3: [[2, 1], [4, 1], [1, 2]],
    4: [[2, 1], [1, 3], [1, 1], [1, 1]],
}


def fsdp_extensions() -> list:
    return [
        SumGradSquared(),
        Variance(),
        DiagGGNExact(),
        DiagHessian(),
        BatchL2Grad(),
        BatchGrad(),
        BatchDiagGGNExact(),
        SqrtGGNExact(),
    ]


def fsdp_model(problem, nested: bool, param_dtype=None):
    """The problem's model sharded with fully_shard (each child with parameters too if nested)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = problem.model()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    if nested:
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mp_policy=policy, **fsdp_kwargs())
    fully_shard(model, mp_policy=policy, **fsdp_kwargs())
    return model


def fsdp_shards(name: str, rank: int, world: int):
    problem = PROBLEMS[name]
    sizes = FSDP_SHARDS[world]
    everything = problem.batches([s for shard in sizes for s in shard])
    before = sum(len(s) for s in sizes[:rank])
    mine = everything[before : before + len(sizes[rank])]
    start = sum(sum(s) for s in sizes[:rank])
    return problem, mine, everything, start, start + sum(sizes[rank])


def own_chunk(full, rank: int, world: int):
    """This rank's dim-0 chunk of `full`, as FSDP2 shards it (empty past the last chunk)."""
    index, count = chunk_position(rank, world)
    chunks = full.chunk(count, dim=0)
    return chunks[index] if index < len(chunks) else full[:0]


def fully_sharded_case(name: str, reduction: str, nested: bool):
    """Every rank's shard of an FSDP2 sweep equals its chunk of one process's over all data."""

    def check(rank: int, world: int) -> None:
        from backpack.curvature._fsdp import _fsdp_params

        problem, mine, everything, start, stop = fsdp_shards(name, rank, world)
        model, ref = fsdp_model(problem, nested), problem.model()
        lossfunc = problem.make_loss(reduction)
        result = accumulate(model, lossfunc, mine, fsdp_extensions())
        expected = accumulate(ref, lossfunc, everything, fsdp_extensions(), distributed=False)
        assert result.sharded and result.ranks == world
        assert result.total == expected.total, (result.total, expected.total)
        assert result.num_samples == expected.num_samples == problem.N
        assert result.num_batches == expected.num_batches
        gradient = result.gradient()
        for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            close(p.grad.to_local(), own_chunk(q.grad, rank, world), f"{pname}.grad")
            close(gradient[pname], own_chunk(q.grad, rank, world), f"{pname} gradient()")
            for field in expected.savefields:
                if field in ROWS:  # this rank's samples' rows of the whole parameter
                    want = getattr(q, field).narrow(ROWS[field], start, stop - start)
                    close(getattr(p, field), want, f"{pname}.{field}")
                    close(result.quantity(field)[pname], want, f"{pname} result[{field!r}]")
                    continue
                want = own_chunk(getattr(q, field), rank, world)
                close(getattr(p, field).to_local(), want, f"{pname}.{field}")
                close(result.quantity(field)[pname], want, f"{pname} result[{field!r}]")
        # the attributes are DTensors: full_tensor() gathers the whole quantity (collective)
        for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            close(p.diag_ggn_exact.full_tensor(), q.diag_ggn_exact, f"{pname} full diagonal")
        # nothing left on FSDP's unsharded parameters
        for fsdp_param in _fsdp_params(model).values():
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            left = [f for f in expected.savefields if hasattr(unsharded, f)]
            assert not left, f"{left} left on an unsharded parameter"

    return check


def last_dim_problem(rank: int, world: int):
    """An MLP sharded along each parameter's last dimension (`shard_placement_fn`), its unsharded
    twin, this rank's batches, all batches and the data generator (state after the data)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def make():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()

    g = torch.Generator().manual_seed(5)
    sizes = [s for shard in FSDP_SHARDS[world] for s in shard]
    everything = [
        (
            torch.randn(n, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        )
        for n in sizes
    ]
    per_rank = len(FSDP_SHARDS[world][0])
    mine = everything[rank * per_rank : (rank + 1) * per_rank]
    model, ref = make(), make()
    last = lambda p: Shard(p.dim() - 1)  # noqa: E731
    for module in (model[0], model[2], model):
        fully_shard(module, shard_placement_fn=last)
    return model, ref, mine, everything, g


def sharded_last_dim(rank: int, world: int) -> None:
    """shard_placement_fn=Shard(last dimension): each rank's chunk along that dimension."""
    model, ref, mine, everything, _ = last_dim_problem(rank, world)
    lossfunc = nn.CrossEntropyLoss()
    result = accumulate(model, lossfunc, mine, [DiagGGNExact(), Variance()])
    accumulate(ref, lossfunc, everything, [DiagGGNExact(), Variance()], distributed=False)
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        for field in ("diag_ggn_exact", "variance"):
            want = getattr(q, field).chunk(world, dim=q.dim() - 1)[rank]
            close(result[field][pname], want, f"{pname}.{field}")
            close(getattr(p, field).full_tensor(), getattr(q, field), f"{pname}.{field} full")


def fully_sharded(rank: int, world: int) -> None:
    """FSDP2 sweeps: merge, write=False, DiagGGNMC, and what is refused, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    problem, mine, everything, _, _ = fsdp_shards("mlp_ce", rank, world)
    lossfunc = problem.make_loss("mean")
    model, ref = fsdp_model(problem, nested=True), problem.model()
    accumulate(ref, lossfunc, everything, [DiagGGNExact(), Variance()], distributed=False)
    # two sweeps merged: exact, like one sweep
    first = accumulate(model, lossfunc, mine[:1], DiagGGNExact(), write=False)
    both = first.merge(accumulate(model, lossfunc, mine[1:], DiagGGNExact(), write=False))
    for pname, q in ref.named_parameters():
        close(both["diag_ggn_exact"][pname], own_chunk(q.diag_ggn_exact, rank, world), pname)
        close(both.gradient()[pname], own_chunk(q.grad, rank, world), f"{pname} merged grad")
    assert all(p.grad is None and not hasattr(p, "diag_ggn_exact") for p in model.parameters())
    # rank 0's first batch has no loss term (every target ignored): it still runs FSDP's
    # backward (zero gradients) and counts its samples in the variance
    ignored = [
        (X, torch.full_like(y, -100) if i == 0 else y) for i, (X, y) in enumerate(everything)
    ]
    exts = [DiagGGNExact(), Variance(), SumGradSquared(), BatchGrad()]
    result = accumulate(model, lossfunc, ignored[: len(mine)] if rank == 0 else mine, exts)
    expected = accumulate(problem.model(), lossfunc, ignored, exts, distributed=False)
    assert result.total == expected.total < problem.N
    for field in ("diag_ggn_exact", "variance", "sum_grad_squared"):
        for pname, value in expected.quantity(field).items():
            close(result[field][pname], own_chunk(value, rank, world), f"ignored {pname} {field}")
    _, _, _, start, stop = fsdp_shards("mlp_ce", rank, world)
    for pname, value in expected.quantity("grad_batch").items():  # zero rows where ignored
        close(result["grad_batch"][pname], value[start:stop], f"ignored {pname} rows")
    # mixed precision (float32 compute, float64 shards): accumulated in the shards' float64
    mixed = fsdp_model(problem, nested=False, param_dtype=torch.float32)
    floats = [(X.float(), y) for X, y in mine]
    result = accumulate(mixed, lossfunc, floats, [DiagGGNExact(), Variance()])
    for field in ("diag_ggn_exact", "variance"):
        for pname, q in ref.named_parameters():
            got, want = result[field][pname], own_chunk(getattr(q, field), rank, world)
            assert got.dtype == torch.float64, got.dtype
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-8), f"mixed {pname} {field}"
    # Monte-Carlo: each rank draws for its own samples; every rank holds its shard
    mc = accumulate(model, lossfunc, mine, DiagGGNMC()).quantity("diag_ggn_mc")
    for pname, p in model.named_parameters():
        assert mc[pname].shape == p.to_local().shape and torch.isfinite(mc[pname]).all()
        assert p.diag_ggn_mc.shape == p.shape
    # uneven numbers of batches: every rank raises before FSDP's collectives would hang
    data = mine + mine[:1] if rank == 0 else mine
    try:
        accumulate(model, lossfunc, data, DiagGGNExact())
    except RuntimeError as err:
        assert "different numbers of batches" in str(err), err
    else:
        raise AssertionError("uneven numbers of batches were not refused")
    # a rank without data: its error, the others name it (before any collective of FSDP)
    bad = world - 1
    empty = mine if rank != bad else []
    run = lambda: accumulate(model, lossfunc, empty, DiagGGNExact())  # noqa: E731
    _expect(rank, bad, run, ValueError, "empty data set")
    # rows streamed to a callback: ν counted over every rank first (or given), this rank's rows
    _, _, _, start, stop = fsdp_shards("mlp_ce", rank, world)
    accumulate(ref, lossfunc, everything, [BatchGrad(), BatchL2Grad()], distributed=False)
    for given in (None, problem.normaliser("mean")):
        got: dict[tuple, list] = {}

        def keep(i, pname, value, got=got):
            got.setdefault((pname, value.dim()), []).append(value)

        exts = [BatchGrad(), BatchL2Grad(), DiagGGNExact()]
        result = accumulate(model, lossfunc, mine, exts, callback=keep, total=given)
        assert result.stream_total == problem.normaliser("mean"), result.stream_total
        assert result.quantity("grad_batch")[next(iter(result.names))] is None
        for pname, q in ref.named_parameters():
            rows = torch.cat(got[(pname, q.dim() + 1)])
            close(rows, q.grad_batch[start:stop], f"{pname} streamed rows")
            close(torch.cat(got[(pname, 1)]), q.batch_l2[start:stop], f"{pname} streamed l2")
            want = own_chunk(q.diag_ggn_exact, rank, world)
            close(result["diag_ggn_exact"][pname], want, f"{pname} diagonal, streaming")
    # a callback that fails on one rank: every rank raises (not a hang in the next batch)
    failing = world - 1

    def callback(i, pname, value):
        if rank == failing:
            raise KeyError("callback failed")

    run = lambda: accumulate(model, lossfunc, mine, BatchGrad(), callback=callback)  # noqa: E731
    _expect(rank, failing, run, KeyError, "callback failed")
    # refused: distributed=False (influence on FSDP2: its own checks in
    # tests/influence/influence_fsdp_checks.py)
    try:
        accumulate(model, lossfunc, mine, DiagGGNExact(), distributed=False)
    except ValueError as err:
        assert "distributed=False" in str(err), err
    else:
        raise AssertionError("not refused: distributed=False")
    # the recipe for what stays refused: a replicated copy, swept with distributed=True
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    copy = problem.make_model().double()
    copy.load_state_dict(full)
    op = KFAC(copy, lossfunc, mine, distributed=True)
    expected = KFAC(ref, lossfunc, everything, distributed=False)
    for pname in op.factors:
        close(op.factors[pname], expected.factors[pname], f"KFAC of the copy, {pname}")


MAIN: list[tuple[str, Callable]] = [
    ("accumulate-mlp_ce-mean", accumulate_case("mlp_ce", "mean")),
    ("accumulate-mlp_mse-sum", accumulate_case("mlp_mse", "sum")),
    ("accumulate-cnn_ce-sum", accumulate_case("cnn_ce", "sum")),
    ("accumulate-token_ce-mean", accumulate_case("token_ce", "mean")),
    ("streamed", streamed),
    ("operators-mlp_ce-mean", operators_case("mlp_ce", "mean")),
    ("operators-mlp_mse-sum", operators_case("mlp_mse", "sum")),
    ("operators-cnn_ce-mean", operators_case("cnn_ce", "mean")),
    ("monte-carlo", monte_carlo),
    ("ddp-model", ddp_model),
    ("failing-rank", failing_rank),
    ("different-models", different_models),
    # last: a sharded model stays registered with FSDP (synchronising contexts refuse then)
    ("fsdp-mlp_ce-mean-nested", fully_sharded_case("mlp_ce", "mean", nested=True)),
    ("fsdp-mlp_ce-sum", fully_sharded_case("mlp_ce", "sum", nested=False)),
    ("fsdp-mlp_mse-mean", fully_sharded_case("mlp_mse", "mean", nested=False)),
    ("fsdp-token_ce-sum-nested", fully_sharded_case("token_ce", "sum", nested=True)),
    ("fsdp-last-dim", sharded_last_dim),
    ("fully-sharded", fully_sharded),
]
HSDP: list[tuple[str, Callable]] = [
    ("hsdp-mlp_ce-mean-nested", under_hsdp(fully_sharded_case("mlp_ce", "mean", nested=True))),
    ("hsdp-token_ce-sum", under_hsdp(fully_sharded_case("token_ce", "sum", nested=False))),
    ("hsdp-replicas-only", under_hsdp(fully_sharded_case("mlp_mse", "mean", nested=True), 4)),
]
SCENARIOS = {"main": MAIN, "hsdp": HSDP}


def worker(rank: int, world: int, port: int, scenario: str, outdir: str) -> None:
    distributed.TIMEOUT_S = 60.0
    run_checks(rank, world, port, outdir, SCENARIOS[scenario], timeout_s=60.0)
