"""Checks run inside gloo processes by test_curvature_fsdp_products.py (not collected by pytest).

Each rank holds a model sharded with FSDP2 (`fully_shard`, per layer or at the root only) and
its own shard of a tiny float64 data set (the same number of batches per rank, uneven sizes).
Every product, diagonal, trace, eigenvalue, solve and estimate of the operators must equal this
rank's rows of one process's over the concatenated data (built in the same worker).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from curvature_problems import PROBLEMS
from distributed_checks import chunk_position, fsdp_kwargs, local_vector, run_checks, under_hsdp
from torch import nn

from backpack import distributed
from backpack.curvature import GGN, EmpiricalFisher, Hessian, eigvalsh
from backpack.curvature.estimators import (
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    xdiag,
    xtrace,
)
from backpack.curvature.spectral import lanczos_quadrature

#: batch sizes of each rank's shard: the same number of batches, uneven sizes
SHARDS = {
    2: [[3, 1], [2, 5]],
    3: [[2, 1], [4, 1], [1, 2]],
    4: [[2, 1], [1, 3], [1, 1], [1, 1]],
}
OPERATORS = {"ggn": GGN, "hessian": Hessian, "ef": EmpiricalFisher}


def close(a, b, what: str, rtol: float = 1e-9, atol: float = 1e-11) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a, b, rtol=rtol, atol=atol), (
        f"{what}: max abs diff {(a - b).abs().max().item():.3e} (scale {b.abs().max().item():.3e})"
    )


def sharded_model(problem, nested: bool | str, param_dtype=None) -> nn.Module:
    """The problem's model with fully_shard on each child with parameters (nested) and the root.

    `nested="last"`: root only, parameters sharded along their last dimension where it divides
    evenly (FSDP2 shards other dimensions only evenly), else along dimension 0.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    model = problem.model()
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype), **fsdp_kwargs()}
    if nested == "last":  # FSDP2 shards other dimensions than 0 only evenly
        world = dist.get_world_size()
        options["shard_placement_fn"] = lambda p: Shard(
            p.dim() - 1 if p.shape[-1] % world == 0 else 0
        )
    elif nested:
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, **options)
    fully_shard(model, **options)
    return model


def data(name: str, rank: int, world: int):
    """This rank's batches and the concatenated data set's batches (same sizes, in order)."""
    problem = PROBLEMS[name]
    sizes = SHARDS[world]
    everything = problem.batches([s for shard in sizes for s in shard])
    before = sum(len(s) for s in sizes[:rank])
    return problem, everything[before : before + len(sizes[rank])], everything


def pair(kind: str, name: str, reduction: str, nested, rank: int, world: int):
    """The operator on the sharded model over this rank's data, and one process's."""
    problem, mine, everything = data(name, rank, world)
    lossfunc = problem.make_loss(reduction)
    cls = OPERATORS[kind]
    op = cls(sharded_model(problem, nested), lossfunc, mine)
    ref = cls(problem.model(), lossfunc, everything, distributed=False)
    return op, ref


def ignored_batch_case(rank: int, world: int) -> None:
    """A rank's batch whose targets are all ignored (ν_b = 0): no term, same collectives."""
    problem, mine, everything = data("token_ce", rank, world)
    lossfunc = problem.make_loss("mean")
    position = sum(len(s) for s in SHARDS[world][:1])  # rank 1's first batch
    X, y = everything[position]
    everything = list(everything)
    everything[position] = (X, torch.full_like(y, -100))
    if rank == 1:
        mine = [everything[position], *mine[1:]]
    V = random_matrix(sum(p.numel() for p in problem.model().parameters()), 2)
    for cls in (GGN, Hessian):
        op = cls(sharded_model(problem, True), lossfunc, mine)
        ref = cls(problem.model(), lossfunc, everything, distributed=False)
        close(op @ op.local_rows(V), op.local_rows(ref @ V), f"{cls.__name__} ignored batch")


def random_matrix(size: int, columns: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, columns, generator=g, dtype=torch.float64)


def products_case(kind: str, name: str, reduction: str, nested) -> Callable:
    """Products with K columns and with a vector, diagonal, trace, DTensor lists; .grad kept."""

    def check(rank: int, world: int) -> None:
        op, ref = pair(kind, name, reduction, nested, rank, world)
        assert op.sharded and op.global_size == ref.shape[0]
        dense = ref.to_dense()
        V = random_matrix(ref.shape[0], 3)
        local = op.local_rows(V)
        assert torch.equal(local, local_vector(op.model, V)), "local_rows"
        assert op.shape == (local.shape[0], local.shape[0])
        # the user's FSDP step: .grad set by FSDP, a forward without backward left behind
        params = list(op.model.parameters())
        X, y = op.data[0]
        op.lossfunc(op.model(X), y).backward()
        with torch.no_grad():
            op.model(X)
        grads = [p.grad.to_local().clone() for p in params]
        close(op @ local, op.local_rows(dense @ V), f"{kind} @ [P, 3]")
        close(op @ local[:, 0], op.local_rows(dense @ V[:, :1])[:, 0], f"{kind} @ [P]")
        for p, g in zip(params, grads):
            assert torch.equal(p.grad.to_local(), g), ".grad changed"
        close(op.diagonal(), op.local_rows(dense.diagonal()[:, None])[:, 0], "diagonal")
        close(op.trace(), dense.trace(), "trace")
        if kind == "ggn":
            from torch.distributed.tensor import DTensor

            params = [p for p in op.model.parameters() if p.requires_grad]
            blocks = local[:, 1].split(op.numels)
            vs = [
                DTensor.from_local(
                    b.reshape(s), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
                for b, s, p in zip(blocks, op.shapes, params)
            ]
            out = op @ vs
            assert all(isinstance(t, DTensor) for t in out)
            flat = torch.cat([t.to_local().reshape(-1) for t in out])
            close(flat, op.local_rows(dense @ V[:, 1:2])[:, 0], "DTensor list product")

    return check


def spectral_case(kind: str, name: str, reduction: str, nested: bool) -> Callable:
    """eigvalsh top-k, CG solve and the estimators equal one process's with the same seeds."""

    def check(rank: int, world: int) -> None:
        op, ref = pair(kind, name, reduction, nested, rank, world)
        dense = ref.to_dense()
        exact = torch.linalg.eigvalsh(dense).flip(0)[:3]
        values, vectors = eigvalsh(op, k=3, return_eigenvectors=True, seed=1)
        close(values, exact, "eigvalsh top 3", rtol=1e-7, atol=1e-9)
        ref_values, ref_vectors = eigvalsh(ref, k=3, return_eigenvectors=True, seed=1)
        close(values, ref_values, "eigvalsh = one process", rtol=1e-7, atol=1e-9)
        close(vectors, op.local_rows(ref_vectors), "eigenvectors' rows", rtol=1e-5, atol=1e-7)
        b = random_matrix(ref.shape[0], 2, seed=7)
        smallest = float(torch.linalg.eigvalsh(dense)[0])
        damping = max(0.0, -smallest) + 0.5 if kind == "hessian" else 0.1
        solve = torch.linalg.solve(dense + damping * torch.eye(dense.shape[0]), b)
        inverse = op.inverse(damping, tol=1e-12)
        close(inverse @ op.local_rows(b), op.local_rows(solve), "CG solve", rtol=1e-7, atol=1e-9)
        assert inverse.info.converged
        close(hutchinson_trace(op, 5, seed=2), hutchinson_trace(ref, 5, seed=2), "hutchinson")
        close(
            hutchinson_diagonal(op, 4, seed=2),
            op.local_rows(hutchinson_diagonal(ref, 4, seed=2)[:, None])[:, 0],
            "hutchinson diagonal",
        )
        nodes, weights = lanczos_quadrature(op, 2, 4, seed=3)
        ref_nodes, ref_weights = lanczos_quadrature(ref, 2, 4, seed=3)
        close(nodes, ref_nodes, "lanczos nodes", rtol=1e-7, atol=1e-9)
        close(weights, ref_weights, "lanczos weights", rtol=1e-7, atol=1e-9)
        # the orthogonalising estimators: QR over the ranks (TSQR), one process's numbers
        close(hutchpp_trace(op, 7, seed=4), hutchpp_trace(ref, 7, seed=4), "hutch++")
        close(xtrace(op, 6, seed=4), xtrace(ref, 6, seed=4), "xtrace")
        estimate, std = xtrace(op, 6, seed=4, return_std=True)
        close(std, xtrace(ref, 6, seed=4, return_std=True)[1], "xtrace std")
        diagonal = op.local_rows(xdiag(ref, 6, seed=4)[:, None])[:, 0]
        close(xdiag(op, 6, seed=4), diagonal, "xdiag")
        # exact once the sketch holds the whole range (more vectors than P)
        size = ref.shape[0]
        close(xtrace(op, 2 * size + 2, seed=5), torch.trace(dense), "xtrace, full sketch")

    return check


def raises(error: type, match: str, fn: Callable) -> None:
    try:
        fn()
    except error as err:
        assert match in str(err), f"{match!r} not in {err}"
        return
    raise AssertionError(f"no {error.__name__}")


def refusals_case(rank: int, world: int) -> None:
    """What sharded operators cannot do raises a clear error on every rank."""
    op, _ = pair("ggn", "mlp_ce", "mean", True, rank, world)
    raises(NotImplementedError, "to_dense()", op.to_dense)
    raises(NotImplementedError, "to_scipy()", op.to_scipy)
    problem, mine, _ = data("mlp_ce", rank, world)
    lossfunc = problem.make_loss("mean")
    model = sharded_model(problem, True)
    # the Monte-Carlo GGN: each rank draws from seed + rank, as a replicated copy under DDP
    mc = GGN(model, lossfunc, mine, mc_samples=2, seed=3)
    replicated = GGN(problem.model(), lossfunc, mine, mc_samples=2, seed=3, distributed=True)
    V = random_matrix(replicated.shape[0], 2, seed=9)
    close(mc @ op.local_rows(V), op.local_rows(replicated @ V), "MC GGN products")
    close(mc @ op.local_rows(V), op.local_rows(replicated @ V), "MC GGN: the same draws again")
    diagonal = op.local_rows(replicated.diagonal()[:, None])[:, 0]
    close(mc.diagonal(), diagonal, "MC GGN diagonal")
    raises(ValueError, "distributed=False", lambda: GGN(model, lossfunc, mine, distributed=False))
    dropout = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Linear(5, 3)).double()
    from torch.distributed.fsdp import fully_shard

    fully_shard(dropout)
    raises(ValueError, "forward_seed", lambda: Hessian(dropout, lossfunc, mine))


def replica_rows_case(rank: int, world: int) -> None:
    """Under HSDP a replica passing other rows than the rank holding its chunks raises on every
    rank (it would silently get the product of the holder's rows); the same rows work."""
    from backpack.curvature import EKFAC, KFAC

    op, ref = pair("ggn", "mlp_ce", "mean", True, rank, world)
    V = random_matrix(op.global_size, 2)
    local = op.local_rows(V)
    other = local + float(rank == world - 1)
    kfac = KFAC(op.model, op.lossfunc, op.data)
    ekfac = EKFAC(op.model, op.lossfunc, op.data)
    for operator in (op, op.inverse(0.1), kfac, kfac.inverse(0.1), ekfac, ekfac.inverse(0.1)):
        raises(ValueError, "the same rows", lambda operator=operator: operator @ other)
    out = op @ local
    close(out, op.local_rows(ref.to_dense() @ V), "product after the refusal")
    # replica groups get the same bits (one all-reduce), so they stay identical
    outs = [None] * world
    dist.all_gather_object(outs, (chunk_position(rank, world)[0], out, kfac @ local))
    for index, product, kron in outs:
        if index == chunk_position(rank, world)[0]:
            assert torch.equal(product, out) and torch.equal(kron, outs[rank][2]), "replicas"


def mixed_precision_case(name: str) -> Callable:
    """Under a MixedPrecisionPolicy: products of the model FSDP2 runs (in its param_dtype).

    float64 parameters computed in float32 against one process's float32 copy; the layers take
    and give float32 during the products (a float64 weight would raise), the products come in
    float64.
    """

    def check(rank: int, world: int) -> None:
        problem, mine, everything = data(name, rank, world)
        lossfunc = problem.make_loss("mean")
        model = sharded_model(problem, True, param_dtype=torch.float32)
        seen = set()
        for layer in model.modules():
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                layer.register_forward_hook(lambda m, a, o: seen.add((a[0].dtype, o.dtype)))
        copy = problem.model().float()
        copied = [(X.float() if X.is_floating_point() else X, y) for X, y in everything]
        V = random_matrix(sum(p.numel() for p in copy.parameters()), 2)
        for cls in OPERATORS.values():
            op = cls(model, lossfunc, mine)
            ref = cls(copy, lossfunc, copied, distributed=False)
            seen.clear()
            out = op @ op.local_rows(V)
            assert seen == {(torch.float32, torch.float32)}, f"{cls.__name__}: computed in {seen}"
            assert out.dtype == torch.float64
            expected = op.local_rows((ref @ V.float()).double())
            close(out, expected, f"{cls.__name__} in float32", rtol=1e-4, atol=1e-6)

    return check


class _Failing:
    """Re-iterable batches; iterating fails at batch `at` on rank `rank`."""

    def __init__(self, batches, fail: bool, at: int = 1):
        self.batches, self.fail, self.at = batches, fail, at

    def __iter__(self):
        for i, b in enumerate(self.batches):
            if self.fail and i == self.at:
                raise KeyError("broken shard")
            yield b


def errors_case(rank: int, world: int) -> None:
    """A rank whose data fails, or has another number of batches, stops every rank."""
    problem, mine, _ = data("mlp_ce", rank, world)
    lossfunc = problem.make_loss("mean")
    model = sharded_model(problem, True)
    op = GGN(model, lossfunc, _Failing(mine, fail=rank == world - 1))
    size = op.shape[0]
    if rank == world - 1:
        raises(KeyError, "broken shard", lambda: op @ torch.ones(size))
    else:
        raises(RuntimeError, f"rank {world - 1} failed", lambda: op @ torch.ones(size))
    # a loss that fails on one rank (targets of the wrong shape), after the forward's gathers
    broken = list(mine)
    if rank == world - 1:
        at = max(range(len(broken)), key=lambda i: len(broken[i][1]))  # 2 samples or more
        X, y = broken[at]
        broken[at] = (X, y[:-1])
    op = GGN(model, lossfunc, broken)
    if rank == world - 1:
        raises(ValueError, "batch_size", lambda: op @ torch.ones(size))
    else:
        raises(RuntimeError, f"rank {world - 1} failed", lambda: op @ torch.ones(size))
    uneven = mine if rank else mine[:1]
    op = Hessian(model, lossfunc, uneven)
    raises(RuntimeError, "different numbers of batches", lambda: op @ torch.ones(size))
    # still usable afterwards: the ranks are in step
    op = Hessian(model, lossfunc, mine)
    assert torch.isfinite(op @ torch.ones(size)).all()


MAIN: list[tuple[str, Callable]] = []
for _kind in OPERATORS:
    for _name, _reduction, _nested in (
        ("mlp_ce", "mean", True),
        ("mlp_mse", "sum", False),
        ("cnn_ce", "mean", True),
    ):
        label = f"{_kind}_{_name}_{_reduction}_{'nested' if _nested else 'root'}"
        MAIN.append((f"products_{label}", products_case(_kind, _name, _reduction, _nested)))
MAIN.append(("products_ggn_token_ce_root", products_case("ggn", "token_ce", "mean", False)))
MAIN.append(("products_hessian_token_ce_root", products_case("hessian", "token_ce", "mean", False)))
# output rows that are tokens, not samples: the empirical Fisher from BatchGrad's rows
MAIN.append(("products_ef_token_ce_root", products_case("ef", "token_ce", "mean", False)))
MAIN.append(("products_ef_token_ce_nested", products_case("ef", "token_ce", "sum", True)))
MAIN.append(("spectral_ggn_mlp_ce_nested", spectral_case("ggn", "mlp_ce", "mean", True)))
MAIN.append(("spectral_hessian_cnn_ce_root", spectral_case("hessian", "cnn_ce", "mean", False)))
MAIN.append(("spectral_ef_mlp_mse_nested", spectral_case("ef", "mlp_mse", "sum", True)))
MAIN.append(("products_ggn_cnn_ce_last_dim", products_case("ggn", "cnn_ce", "mean", "last")))
MAIN.append(("products_hessian_cnn_ce_last_dim", products_case("hessian", "cnn_ce", "sum", "last")))
MAIN.append(("mixed_precision_mlp_ce", mixed_precision_case("mlp_ce")))
MAIN.append(("mixed_precision_token_ce", mixed_precision_case("token_ce")))
MAIN.append(("ignored_batch", ignored_batch_case))
MAIN.append(("refusals", refusals_case))
MAIN.append(("errors", errors_case))

#: on HSDP's (2, 2) mesh of 4 ranks, and its (4, 1) mesh (every rank holds every chunk)
HSDP = [
    ("hsdp_products_ggn_mlp_ce", under_hsdp(products_case("ggn", "mlp_ce", "mean", True))),
    ("hsdp_products_hessian_cnn_ce", under_hsdp(products_case("hessian", "cnn_ce", "sum", True))),
    ("hsdp_products_ef_token_ce", under_hsdp(products_case("ef", "token_ce", "mean", False))),
    ("hsdp_spectral_ggn_mlp_ce", under_hsdp(spectral_case("ggn", "mlp_ce", "mean", True))),
    ("hsdp_replica_rows", under_hsdp(replica_rows_case)),
    ("hsdp_mixed_precision_token_ce", under_hsdp(mixed_precision_case("token_ce"))),
    ("hsdp_replicas_only", under_hsdp(products_case("ggn", "mlp_ce", "mean", True), replicas=4)),
]

SCENARIOS = {"main": MAIN, "hsdp": HSDP}


def worker(rank: int, world: int, port: int, scenario: str, outdir: str) -> None:
    distributed.TIMEOUT_S = 60.0
    run_checks(rank, world, port, outdir, SCENARIOS[scenario], timeout_s=60.0)
