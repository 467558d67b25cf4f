"""Checks of attribution on FSDP2 models, run inside gloo processes by test_influence_fsdp.py
(not collected by pytest).

Each rank fits on its own shard of the training set (the same number of batches per rank,
uneven sizes) with a `fully_shard`-ed model and compares with one process fitting an unsharded
copy on the whole set (in the same worker): each block lives on one rank (shape-only elsewhere)
with one process's eigenvalues, every rank has every damping, and the scores, self-scores and
TracIn scores of its shard are that shard's columns of one process's.
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from distributed_checks import fsdp_kwargs, run_checks, under_hsdp
from influence_distributed_checks import shard as distributed_shard
from influence_problems import PROBLEMS, TinyGPT

from backpack import distributed
from backpack.influence import Influence, fit, tracin

#: batch sizes of each rank's shard (11 training examples in all, the same number of batches)
SHARDS = {2: [[3, 4], [2, 2]], 3: [[2, 1], [4, 1], [2, 1]], 4: [[2, 1], [3, 1], [1, 1], [1, 1]]}
CASES = [
    ("mlp", "identity", "empirical", True),
    ("mlp", "diagonal", "type-2", True),
    ("mlp", "kfac", "empirical", False),
    ("mlp", "ekfac", "type-2", True),
    ("cnn", "diagonal", "empirical", False),
    ("cnn", "kfac", "type-2", True),
    ("cnn", "ekfac", "empirical", True),
    ("tokens", "identity", "type-2", True),
    ("tokens", "kfac", "type-2", True),
    ("gpt", "diagonal", "empirical", True),
    ("gpt", "kfac", "type-2", True),
    ("gpt", "ekfac", "empirical", False),  # embeddings and norms: corrected from rows
]
TOL = {"rtol": 1e-8, "atol": 1e-10}


def close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def sharded(problem, nested: bool):
    """The problem's model with fully_shard on each child with parameters (nested) and the root."""
    from torch.distributed.fsdp import fully_shard

    model = problem.model()
    if nested:
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, **fsdp_kwargs())
    fully_shard(model, **fsdp_kwargs())
    return model


def shard(problem, rank: int, world: int) -> tuple[list, slice]:
    """Rank `rank`'s batches (`SHARDS`: the same number on every rank) and their columns."""
    return distributed_shard(problem, rank, world, SHARDS)


def check(name: str, strategy: str, fisher: str, nested: bool, rank: int, world: int) -> None:
    problem = PROBLEMS[name]
    model, ref = sharded(problem, nested), problem.model()
    lossfunc = problem.make_loss("mean")
    local, columns = shard(problem, rank, world)
    train, query = problem.train(), problem.query()
    # TinyGPT's key bias gets no gradient (softmax ignores a shift): a fixed λ, not 0.1 × ~0
    damping = 1e-2 if name == "gpt" else None
    ours = fit(model, lossfunc, local, strategy, damping, fisher=fisher)
    whole = fit(ref, lossfunc, train, strategy, damping, fisher=fisher, distributed=False)
    assert ours.info == whole.info, (ours.info, whole.info)
    if strategy != "identity":
        held = 0
        for a, b in zip(ours.blocks, whole.blocks, strict=True):
            assert a.name == b.name and a.names == b.names
            if ours.placement.owns(a.name):
                # as multisets: tied eigenvalues of a factor may come in another order
                sort = lambda v: v.flatten().sort().values  # noqa: E731
                close(sort(a.values), sort(b.values), f"eigenvalues of {a.name}")
                held += a.values.numel()
            else:
                assert a.values.device.type == "meta", a.name
            lam, want = ours.damping[a.name], whole.damping[b.name]
            assert abs(lam - want) <= 1e-9 * want + 1e-15, (a.name, lam, want)
        total = sum(b.values.numel() for b in whole.blocks)
        assert held < total or world == 1 or len(whole.blocks) == 1, (held, total)
    expected = whole.scores(query, train)
    close(ours.scores(query, local), expected[:, columns], "scores")
    close(ours.scores(query, local, factored=False), expected[:, columns], "scores, per-sample")
    close(ours.scores(query, local, gather=True), expected, "gathered scores")
    close(ours.self_scores(local), whole.self_scores(train)[columns], "self-scores")
    modules = whole.scores(query, train, per_module=True)
    for key, value in ours.scores(query, local, per_module=True).items():
        close(value, modules[key][:, columns], f"scores of module {key}")
    if name in ("mlp", "gpt"):
        low = whole.scores(query, train, query_rank=1)
        close(ours.scores(query, local, query_rank=1), low[:, columns], "rank-1 scores")
        errors = whole.query_rank_error(query, train, [1, 2])
        mine = ours.query_rank_error(query, local, [1, 2])
        for r in (1, 2):
            assert abs(mine[r] - errors[r]) <= 1e-8 * errors[r] + 1e-12, (r, mine, errors)
    if name == "gpt":
        tokens = whole.scores(query, train, per_token=True)
        close(ours.scores(query, local, per_token=True), tokens[:, columns], "per-token scores")
    variants = {
        ("mlp", "kfac"): {"separate_weight_and_bias": False},  # one block per layer
        ("cnn", "diagonal"): {"separate_weight_and_bias": False},
        ("tokens", "kfac"): {"kfac_positions": "mean"},  # a forward without backward first
    }
    options = variants.get((name, strategy))
    if options is not None:
        a = fit(model, lossfunc, local, strategy, fisher=fisher, **options)
        b = fit(ref, lossfunc, train, strategy, fisher=fisher, distributed=False, **options)
        assert all(a.placement.members[x.name] == x.names for x in b.blocks)
        close(a.scores(query, local), b.scores(query, train)[:, columns], f"scores, {options}")
        close(a.self_scores(local), b.self_scores(train)[columns], f"self-scores, {options}")
    if strategy == "identity":
        lr = [0.5]
        close(
            tracin([model], lossfunc, query, local, lr),
            tracin([ref], lossfunc, query, train, lr)[:, columns],
            "tracin",
        )


def query_must_agree(rank: int, world: int) -> None:
    """Different query data, uneven batch counts and a per-token error on one rank: every rank
    raises (instead of mixing rows or waiting for a lent block)."""
    problem = PROBLEMS["mlp"]
    model = sharded(problem, True)
    lossfunc = problem.make_loss("mean")
    local, _ = shard(problem, rank, world)
    ours = fit(model, lossfunc, local, "kfac")
    query = problem.query(1) if rank == 0 else problem.query(1)[::-1]
    try:
        ours.scores(query, local)
    except RuntimeError as err:
        assert "must be the same on every rank" in str(err), err
    else:
        raise AssertionError("different query data was not refused")
    # still usable afterwards, and uneven numbers of training batches are refused everywhere
    ours.scores(problem.query(), local)
    try:
        ours.self_scores(local if rank else local[:1])
    except RuntimeError as err:
        assert "different numbers of batches" in str(err), err
    else:
        raise AssertionError("uneven numbers of batches were not refused")
    # another T in one rank's second batch: its error (the sweep's check of batch shapes), the
    # others name it
    problem = PROBLEMS["gpt"]
    model = sharded(problem, False)
    lossfunc = problem.make_loss("mean")
    local, _ = shard(problem, rank, world)
    ours = fit(model, lossfunc, local, "identity")
    if rank == 0:
        x, y = local[1]
        local = [local[0], (x[:, :4], y.reshape(x.shape[0], -1)[:, :4].flatten())]
    try:
        ours.scores(problem.query(), local, per_token=True)
    except (ValueError, RuntimeError) as err:
        want = "apart from its number of samples" if rank == 0 else "rank 0 failed"
        assert want in str(err), err
    else:
        raise AssertionError("a per-token length mismatch on one rank was not refused")


def shared_folder() -> Path:
    """A fresh folder that every rank sees (rank 0 makes it)."""
    name = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def persistence(rank: int, world: int) -> None:
    """save/load (a file, a folder, bf16) and scores written to disk, on FSDP2 like one process."""
    problem = PROBLEMS["cnn"]
    model, ref = sharded(problem, True), problem.model()
    lossfunc = problem.make_loss("mean")
    local, columns = shard(problem, rank, world)
    train, query = problem.train(), problem.query()
    ours = fit(model, lossfunc, local, "ekfac", fisher="type-2")
    whole = fit(ref, lossfunc, train, "ekfac", fisher="type-2", distributed=False)
    expected = whole.scores(query, train)[:, columns]
    root = shared_folder()
    state = ours.state()  # every block whole on every rank
    for a, b in zip(state["blocks"], whole.state()["blocks"]):
        close(a["values"], b["values"], f"state of {a['name']}")
    for target, options in ((root / "fit.pt", {}), (root / "blocks", {"per_module": True})):
        ours.save(target, **options)
        back = Influence.load(target, model, lossfunc)
        assert [b.name for b in back.blocks] == [b.name for b in ours.blocks]
        for a, b in zip(back.blocks, ours.blocks):
            assert (a.values.device.type == "meta") == (b.values.device.type == "meta"), a.name
        close(back.scores(query, local), expected, f"scores after load from {target.name}")
        # the one-process fit loads the FSDP2 fit's files, and the other way round
        close(Influence.load(target, ref, lossfunc).scores(query, train)[:, columns], expected, "1")
    if rank == 0:  # one process's folder, written once
        whole.save(root / "whole", per_module=True)
    dist.barrier()
    close(Influence.load(root / "whole", model, lossfunc).scores(query, local), expected, "2")
    ours.save(root / "bf16", dtype=torch.bfloat16, per_module=True)
    half = Influence.load(root / "bf16", model, lossfunc).scores(query, local)
    want = Influence.load(root / "bf16", ref, lossfunc).scores(query, train)[:, columns]
    close(half, want, "bf16 fit")
    # scores on disk: each rank its own folder, resumable
    mine = root / f"scores-{rank}"
    close(ours.scores(query, local, out_dir=mine, chunk_size=1), expected, "scores on disk")
    close(ours.scores(query, local, out_dir=mine, chunk_size=1), expected, "resumed")
    # per-sample gradients of this rank's samples, whole
    grads = torch.cat([g["0.weight"] for g in ours.gradients(local)])
    want = torch.cat([g["0.weight"] for g in whole.gradients(train)])[columns]
    close(grads, want, "gradients")


def tied(rank: int, world: int) -> None:
    """A GPT whose head shares the token embedding (one parameter, two calls; root-only
    sharding): fits and scores equal one process's on the same batches.

    The tied weight's Kronecker factors combine its two calls per batch (not linear in the
    batch), so the reference sweeps every rank's batches as they are, in rank order.
    """
    from torch.distributed.fsdp import fully_shard

    problem = PROBLEMS["gpt"]
    torch.manual_seed(1)
    model = TinyGPT(tied=True).double()
    torch.manual_seed(1)
    ref = TinyGPT(tied=True).double()
    fully_shard(model)
    lossfunc = problem.make_loss("mean")
    local, columns = shard(problem, rank, world)
    train = [batch for r in range(world) for batch in shard(problem, r, world)[0]]
    query = problem.query()
    for strategy in ("identity", "kfac", "ekfac"):
        ours = fit(model, lossfunc, local, strategy, 1e-2, fisher="type-2")
        whole = fit(ref, lossfunc, train, strategy, 1e-2, fisher="type-2", distributed=False)
        expected = whole.scores(query, train)[:, columns]
        close(ours.scores(query, local), expected, f"{strategy} scores, tied")
        close(ours.self_scores(local), whole.self_scores(train)[columns], f"{strategy} self, tied")


def mixed_precision(rank: int, world: int) -> None:
    """Under a MixedPrecisionPolicy (float64 parameters computed in float32): every strategy's
    scores in float64, equal to one process's on a float32 copy to float32's precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    problem = PROBLEMS["mlp"]
    model = problem.model()
    policy = MixedPrecisionPolicy(param_dtype=torch.float32)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    copy = problem.model().float()
    lossfunc = problem.make_loss("mean")
    local, columns = shard(problem, rank, world)
    single = lambda data: [(X.float(), y) for X, y in data]  # noqa: E731
    train, query = problem.train(), problem.query()
    fits = (("identity", "empirical"), ("diagonal", "type-2"), ("ekfac", "type-2"))
    for strategy, fisher in fits:
        ours = fit(model, lossfunc, local, strategy, fisher=fisher)
        whole = fit(copy, lossfunc, single(train), strategy, fisher=fisher, distributed=False)
        scores = ours.scores(query, local)
        assert scores.dtype == torch.float64, scores.dtype
        expected = whole.scores(single(query), single(train))[:, columns].double()
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


#: `{scenario: [(label, check(rank, world))]}`
SCENARIOS = {
    "fits": [("-".join(map(str, case)), partial(check, *case)) for case in CASES],
    "more": [
        ("query-must-agree", query_must_agree),
        ("persistence", persistence),
        ("tied", tied),
        ("mixed-precision", mixed_precision),
    ],
    "hsdp": [
        (f"hsdp-{'-'.join(map(str, case))}", under_hsdp(partial(check, *case)))
        for case in (CASES[1], CASES[3], CASES[7], CASES[10])
    ],
}


def worker(rank: int, world: int, port: int, scenario: str, outdir: str) -> None:
    # each rank also builds one process's reference between collectives: slow on a busy machine
    distributed.TIMEOUT_S = 150.0
    run_checks(rank, world, port, outdir, SCENARIOS[scenario], timeout_s=150.0)
