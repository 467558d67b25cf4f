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
from curvature_distributed_checks import (
    FSDP_SHARDS,
    close,
    fsdp_model,
    fsdp_shards,
    last_dim_problem,
    own_chunk,
)
from distributed_checks import local_vector, run_checks, under_hsdp

from backpack import distributed
from backpack.curvature import (
    EKFAC,
    KFAC,
    accumulate,
    eigvalsh,
    hutchinson_trace,
    hutchpp_trace,
    xtrace,
)
from backpack.extensions import KFAC as KFACExtension
from backpack.extensions import KFLR, DiagGGNExact


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


def _expect_everywhere(run, error, match: str) -> None:
    try:
        run()
    except error as err:
        assert match in str(err), err
    else:
        raise AssertionError(f"not raised: {match}")


def kfac_operator_case(name: str, reduction: str, nested: bool, **options):
    """The KFAC operator on FSDP2: products (vector and matrix), the damped inverse, logdet,
    trace, diagonal and eigenvalues equal one process's; products of local shards."""

    def check(rank: int, world: int) -> None:
        problem, mine, everything, _, _ = fsdp_shards(name, rank, world)
        model, ref = fsdp_model(problem, nested), problem.model()
        lossfunc = problem.make_loss(reduction)
        op = KFAC(model, lossfunc, mine, **options)
        expected = KFAC(ref, lossfunc, everything, distributed=False, **options)
        size = sum(p.to_local().numel() for p in model.parameters())
        assert op.shape == (size, size), (op.shape, size)
        g = torch.Generator().manual_seed(7)
        V = torch.randn(expected.shape[0], 3, generator=g, dtype=torch.float64)
        local = local_vector(model, V)
        close(op @ local, local_vector(model, expected @ V), "K @ V")
        close(op @ local[:, 0], local_vector(model, expected @ V[:, 0]), "K @ v")
        inv, inv_ref = op.inverse(0.1), expected.inverse(0.1)
        close(inv @ local, local_vector(model, inv_ref @ V), "(K + λI)⁻¹ @ V")
        close(inv.logdet(), inv_ref.logdet(), "inverse logdet")
        close(inv.diagonal(), local_vector(model, inv_ref.diagonal()), "inverse diagonal")
        close(inv.trace(), inv_ref.trace(), "inverse trace")
        close(op.logdet(0.1), expected.logdet(0.1), "logdet")
        close(op.trace(), expected.trace(), "trace")
        close(op.diagonal(), local_vector(model, expected.diagonal()), "diagonal")
        spectra = [None] * world
        dist.all_gather_object(spectra, op.eigenvalues())
        close(torch.cat(spectra).sort().values, expected.eigenvalues(), "eigenvalues")
        for block, factors in op.factors.items():
            assert op.owners[block] == rank
            close(factors, expected.factors[block], f"factors of {block}")
        held = sum(f.numel() for fs in op.factors.values() for f in fs)
        assert held < sum(f.numel() for fs in expected.factors.values() for f in fs) or world == 1
        _expect_everywhere(op.to_dense, NotImplementedError, "to_dense")
        _expect_everywhere(op.to_scipy, NotImplementedError, "to_scipy")
        # the estimators sum their inner products over the ranks: one process's numbers
        close(hutchinson_trace(op, 4, seed=2), hutchinson_trace(expected, 4, seed=2), "hutchinson")
        close(xtrace(op, 6, seed=4), xtrace(expected, 6, seed=4), "xtrace")
        close(eigvalsh(op, k=2, seed=1), eigvalsh(expected, k=2, seed=1), "eigvalsh")

    return check


def kfac_last_dim(rank: int, world: int) -> None:
    """shard_placement_fn=Shard(last dimension): products and diagonals of those chunks."""
    from torch import nn

    model, ref, mine, everything, g = last_dim_problem(rank, world)
    lossfunc = nn.CrossEntropyLoss()
    op = KFAC(model, lossfunc, mine, separate_weight_and_bias=False)
    expected = KFAC(ref, lossfunc, everything, distributed=False, separate_weight_and_bias=False)
    V = torch.randn(expected.shape[0], 2, generator=g, dtype=torch.float64)
    close(op @ local_vector(model, V), local_vector(model, expected @ V), "last-dim K @ V")
    inv, inv_ref = op.inverse(0.05), expected.inverse(0.05)
    close(inv @ local_vector(model, V), local_vector(model, inv_ref @ V), "last-dim inverse")
    close(op.diagonal(), local_vector(model, expected.diagonal()), "last-dim diagonal")


def kfac_errors(rank: int, world: int) -> None:
    """A wrong vector on one rank makes every rank raise (no rank waits in a collective)."""
    problem, mine, _, _, _ = fsdp_shards("mlp_ce", rank, world)
    model = fsdp_model(problem, nested=True)
    op = KFAC(model, problem.make_loss("mean"), mine)
    size = op.shape[0]
    bad = torch.zeros(size + (rank == world - 1), dtype=torch.float64)
    _expect_everywhere(lambda: op @ bad, (ValueError, RuntimeError), "")
    cols = torch.zeros(size, 1 + (rank == 0), dtype=torch.float64)
    _expect_everywhere(lambda: op @ cols, ValueError, "same number of columns")
    # a block failing on its owner: the owner raises its error, every other rank names it
    block = op.blocks[0]
    owner = op.owners[block.name]
    if rank == owner:

        def broken(v, mats):
            raise FloatingPointError("broken block")

        block.apply = broken
    try:
        op @ torch.ones(size, dtype=torch.float64)
    except FloatingPointError as err:
        assert rank == owner and "broken block" in str(err), err
    except RuntimeError as err:
        assert rank != owner and f"rank {owner} failed" in str(err), err
    else:
        raise AssertionError("a failing owner was not agreed")
    finally:
        block.__dict__.pop("apply", None)
    # a batch without loss terms (every target ignored) on rank 0: its inputs would count in A
    # without a G, as without FSDP: rank 0 raises that, the others name rank 0
    ignored = [(X, torch.full_like(y, -100) if i == 0 else y) for i, (X, y) in enumerate(mine)]
    data = ignored if rank == 0 else mine
    try:
        accumulate(model, problem.make_loss("mean"), data, KFLR())
    except ValueError as err:
        assert rank == 0 and "no loss term" in str(err), err
    except RuntimeError as err:
        assert rank != 0 and "rank 0 failed" in str(err), err
    else:
        raise AssertionError("a batch without loss terms was not refused")
    # Monte-Carlo factors: each rank draws for its own samples
    mc = KFAC(model, problem.make_loss("mean"), mine, fisher_type="mc", mc_samples=2)
    out = mc.inverse(0.1) @ torch.ones(size, 2, dtype=torch.float64)
    assert out.shape == (size, 2) and torch.isfinite(out).all()
    assert torch.isfinite(mc.logdet(0.1)) and mc.trace() > 0
    # still usable afterwards
    out = op @ torch.ones(size, dtype=torch.float64)
    assert out.shape == (size,) and torch.isfinite(out).all()


def ekfac_operator_case(name: str, reduction: str, nested: bool, **options):
    """EKFAC on FSDP2: products, the damped inverse, logdet, trace, diagonal, eigenvalues and
    the corrected eigenvalues (on their owners) equal one process's over all data."""

    def check(rank: int, world: int) -> None:
        problem, mine, everything, _, _ = fsdp_shards(name, rank, world)
        model, ref = fsdp_model(problem, nested), problem.model()
        lossfunc = problem.make_loss(reduction)
        compare_ekfac(model, ref, lossfunc, mine, everything, rank, world, **options)

    return check


def compare_ekfac(model, ref, lossfunc, mine, everything, rank: int, world: int, **options):
    """Every result of EKFAC on the FSDP2 `model` (this rank's data `mine`) equals one process's
    on the unsharded copy `ref` over all data."""
    op = EKFAC(model, lossfunc, mine, **options)
    expected = EKFAC(ref, lossfunc, everything, distributed=False, **options)
    assert op.num_samples_total == expected.num_samples_total
    close(torch.tensor(op.normaliser_total), torch.tensor(expected.normaliser_total), "ν")
    size = sum(p.to_local().numel() for p in model.parameters())
    assert op.shape == (size, size), (op.shape, size)
    assert op.owners == op.kfac.owners
    for block, values in op.corrected.items():
        assert op.owners[block] == rank
        close(values, expected.corrected[block], f"corrected eigenvalues of {block}")
    held = sum(v.numel() for v in op.corrected.values())
    assert held < sum(v.numel() for v in expected.corrected.values()) or world == 1
    g = torch.Generator().manual_seed(7)
    V = torch.randn(expected.shape[0], 3, generator=g, dtype=torch.float64)
    local = local_vector(model, V)
    close(op @ local, local_vector(model, expected @ V), "E @ V")
    close(op @ local[:, 0], local_vector(model, expected @ V[:, 0]), "E @ v")
    damping = {b: 0.1 + 0.01 * i for i, b in enumerate(op.owners)}
    for lam in (0.1, damping):
        inv, inv_ref = op.inverse(lam), expected.inverse(lam)
        close(inv @ local, local_vector(model, inv_ref @ V), "(E + λI)⁻¹ @ V")
        close(inv.logdet(), inv_ref.logdet(), "inverse logdet")
        close(inv.diagonal(), local_vector(model, inv_ref.diagonal()), "inverse diagonal")
        close(inv.trace(), inv_ref.trace(), "inverse trace")
        close(op.logdet(lam), expected.logdet(lam), "logdet")
    close(op.trace(), expected.trace(), "trace")
    close(op.diagonal(), local_vector(model, expected.diagonal()), "diagonal")
    spectra = [None] * world
    dist.all_gather_object(spectra, op.eigenvalues())
    close(torch.cat(spectra).sort().values, expected.eigenvalues(), "eigenvalues")
    _expect_everywhere(op.to_dense, NotImplementedError, "to_dense")
    _expect_everywhere(op.to_scipy, NotImplementedError, "to_scipy")
    _expect_everywhere(op.inverse(0.1).to_dense, NotImplementedError, "to_dense")
    # the estimators sum their inner products over the ranks: one process's numbers
    close(hutchinson_trace(op, 4, seed=2), hutchinson_trace(expected, 4, seed=2), "hutchinson")
    close(hutchpp_trace(op, 7, seed=4), hutchpp_trace(expected, 7, seed=4), "hutch++")
    close(eigvalsh(op, k=2, seed=1), eigvalsh(expected, k=2, seed=1), "eigvalsh")


def ekfac_tokens(rank: int, world: int) -> None:
    """Linear layers over token positions ([N, T, d] inputs, per-sample gradients summed over
    positions), per-layer and root-only sharding, both reductions, folded biases."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(4)
            self.lin1, self.lin2 = nn.Linear(4, 5), nn.Linear(5, 3)

        def forward(self, x):
            return self.lin2(torch.tanh(self.lin1(x))).reshape(-1, 3)

    g = torch.Generator().manual_seed(6)
    sizes = [s for shard in FSDP_SHARDS[world] for s in shard]
    everything = [
        (
            torch.randn(n, 3, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n * 3,), generator=g),
        )
        for n in sizes
    ]
    per_rank = len(FSDP_SHARDS[world][0])
    mine = everything[rank * per_rank : (rank + 1) * per_rank]
    for nested, reduction, fold in ((True, "mean", False), (False, "sum", True)):
        model, ref = Tokens().double(), Tokens().double()
        if nested:
            fully_shard(model.lin1)
            fully_shard(model.lin2)
        fully_shard(model)
        lossfunc = nn.CrossEntropyLoss(reduction=reduction)
        options = {"separate_weight_and_bias": not fold}
        compare_ekfac(model, ref, lossfunc, mine, everything, rank, world, **options)


def small_reduces(check: Callable) -> Callable:
    """`check` with reduces onto owners of at most 1 KiB: several reduces per owner and batch."""

    def run(rank: int, world: int) -> None:
        from backpack.curvature import _fsdp

        limit = _fsdp.REDUCE_CHUNK_BYTES
        _fsdp.REDUCE_CHUNK_BYTES = 1024
        try:
            check(rank, world)
        finally:
            _fsdp.REDUCE_CHUNK_BYTES = limit

    return run


MAIN: list[tuple[str, Callable]] = [
    ("kron-mlp_ce-mean-nested", accumulate_kron_case("mlp_ce", "mean", nested=True)),
    (
        "kron-cnn_ce-sum-small-reduces",
        small_reduces(accumulate_kron_case("cnn_ce", "sum", nested=True)),
    ),
    ("kron-mlp_mse-sum", accumulate_kron_case("mlp_mse", "sum", nested=False)),
    ("kron-cnn_ce-mean-nested", accumulate_kron_case("cnn_ce", "mean", nested=True)),
    ("kron-token_ce-sum", accumulate_kron_case("token_ce", "sum", nested=False)),
    ("kfac-mlp_ce-mean-nested", kfac_operator_case("mlp_ce", "mean", nested=True)),
    ("kfac-mlp_mse-sum", kfac_operator_case("mlp_mse", "sum", nested=False)),
    ("kfac-cnn_ce-mean", kfac_operator_case("cnn_ce", "mean", nested=False)),
    ("kfac-token_ce-sum-nested", kfac_operator_case("token_ce", "sum", nested=True)),
    (
        "kfac-folded-mlp_ce",
        kfac_operator_case("mlp_ce", "mean", nested=True, separate_weight_and_bias=False),
    ),
    (
        "kfac-folded-cnn_ce",
        kfac_operator_case("cnn_ce", "sum", nested=True, separate_weight_and_bias=False),
    ),
    ("kfac-empirical", kfac_operator_case("mlp_ce", "mean", nested=True, fisher_type="empirical")),
    ("kfac-reduce", kfac_operator_case("cnn_ce", "mean", nested=False, kfac_approx="reduce")),
    ("kfac-last-dim", kfac_last_dim),
    ("kfac-errors", kfac_errors),
]


def ekfac_rows(rank: int, world: int) -> None:
    """EKFAC on FSDP2 models with blocks the correction sweep cannot take (an embedding, a layer
    called twice, a weight used outside its layer's call, FSDP2's mixed precision): their
    corrected eigenvalues from per-sample rows, equal to one process's; Monte-Carlo draws; the
    eigenbases a rank holds during the correction sweep (one layer's besides its own)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from backpack.curvature import _fsdp_eigen

    problem, mine, everything, _, _ = fsdp_shards("token_ce", rank, world)
    model, ref = fsdp_model(problem, nested=True), problem.model()
    compare_ekfac(model, ref, problem.make_loss("sum"), mine, everything, rank, world)

    class Outside(nn.Module):
        def __init__(self, twice: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 5)
            self.c = nn.Linear(5, 3)
            self.twice = twice

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if self.twice:  # b called twice
                return self.c(self.b(torch.tanh(self.b(h))))
            return self.c(self.b(h)) + 0.1 * h @ self.c.weight.T  # outside c.s call

    problem, mine, everything, _, _ = fsdp_shards("mlp_ce", rank, world)
    for twice in (False, True):
        model, ref = Outside(twice).double(), Outside(twice).double()
        fully_shard(model)
        compare_ekfac(model, ref, problem.make_loss("mean"), mine, everything, rank, world)
    # FSDP2's mixed precision: the layers compute in float32, the factors are float64; rows
    # cast to the factors' dtype: one process's float64 numbers to float32's rounding
    model = fsdp_model(problem, nested=True, param_dtype=torch.float32)
    op = EKFAC(model, problem.make_loss("mean"), mine)
    expected = EKFAC(problem.model(), problem.make_loss("mean"), everything, distributed=False)
    for block, values in op.corrected.items():
        torch.testing.assert_close(values, expected.corrected[block], rtol=1e-4, atol=1e-6)
    # the eigenbases a rank holds while the correction sweep runs
    model = fsdp_model(problem, nested=True)
    held, instances, fetch = [], [], _fsdp_eigen.JustInTime.fetch

    def counting(self, module):
        fetch(self, module)
        instances.append(self)
        foreign = [
            m
            for m, parts in self.parts.items()
            if any(o != self.me and getattr(self.states[m], f[0]) is not None for _, o, f in parts)
        ]
        held.append(len(foreign))

    _fsdp_eigen.JustInTime.fetch = counting
    try:
        op = EKFAC(model, problem.make_loss("mean"), mine)
    finally:
        _fsdp_eigen.JustInTime.fetch = fetch
    assert held and max(held) <= 1, held
    # one broadcast per layer's block and batch (none in backpack's propagation pass)
    lending = instances[0]
    parts = sum(len(p) for p in lending.parts.values())
    assert lending.broadcasts == len(mine) * parts, (lending.broadcasts, len(mine), parts)
    for b in op.blocks:
        assert all(v.is_meta for v in b.vectors) == (op.owners[b.name] != rank), b.name
    # Monte-Carlo: each rank draws for its own samples
    mc = EKFAC(model, problem.make_loss("mean"), mine, fisher_type="mc", mc_samples=2)
    out = mc.inverse(0.1) @ torch.ones(op.shape[0], 2, dtype=torch.float64)
    assert out.shape == (op.shape[0], 2) and torch.isfinite(out).all()
    assert torch.isfinite(mc.logdet(0.1)) and mc.trace() > 0


EKFAC_CASES: list[tuple[str, Callable]] = [
    ("ekfac-mlp_ce-mean-nested", ekfac_operator_case("mlp_ce", "mean", nested=True)),
    ("ekfac-mlp_mse-sum", ekfac_operator_case("mlp_mse", "sum", nested=False)),
    ("ekfac-cnn_ce-mean-nested", ekfac_operator_case("cnn_ce", "mean", nested=True)),
    ("ekfac-cnn_ce-sum", ekfac_operator_case("cnn_ce", "sum", nested=False)),
    (
        "ekfac-folded-mlp_ce",
        ekfac_operator_case("mlp_ce", "mean", nested=True, separate_weight_and_bias=False),
    ),
    (
        "ekfac-folded-cnn_ce",
        ekfac_operator_case("cnn_ce", "sum", nested=False, separate_weight_and_bias=False),
    ),
    (
        "ekfac-empirical",
        ekfac_operator_case("mlp_ce", "mean", nested=True, fisher_type="empirical"),
    ),
    ("ekfac-reduce", ekfac_operator_case("cnn_ce", "mean", nested=True, kfac_approx="reduce")),
    ("ekfac-tokens", ekfac_tokens),
    ("ekfac-rows", ekfac_rows),
]
HSDP: list[tuple[str, Callable]] = [
    ("hsdp-kron-mlp_ce", under_hsdp(accumulate_kron_case("mlp_ce", "mean", nested=True))),
    ("hsdp-kfac-cnn_ce", under_hsdp(kfac_operator_case("cnn_ce", "mean", nested=False))),
    ("hsdp-kfac-token_ce", under_hsdp(kfac_operator_case("token_ce", "sum", nested=True))),
    ("hsdp-ekfac-mlp_ce", under_hsdp(ekfac_operator_case("mlp_ce", "mean", nested=True))),
    ("hsdp-ekfac-cnn_ce", under_hsdp(ekfac_operator_case("cnn_ce", "mean", nested=True))),
    ("hsdp-kfac-replicas-only", under_hsdp(kfac_operator_case("mlp_mse", "sum", False), 4)),
]
SCENARIOS = {"main": MAIN, "ekfac": EKFAC_CASES, "hsdp": HSDP}


def worker(rank: int, world: int, port: int, scenario: str, outdir: str) -> None:
    distributed.TIMEOUT_S = 60.0
    run_checks(rank, world, port, outdir, SCENARIOS[scenario], timeout_s=60.0)
