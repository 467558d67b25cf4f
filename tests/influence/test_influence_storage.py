"""Scores per module, scores written to disk in resumable chunks, fits per block, storage dtypes."""

from __future__ import annotations

import json

import pytest
import torch
from influence_problems import PROBLEMS, Reference

from backpack.influence import fit, load, load_block, read_scores


def _setup(name="gpt", strategy="ekfac", **kwargs):
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    train = problem.train(2)  # 6 batches (2, 2, 2, 2, 2, 1 examples)
    influence = fit(model, lossfunc, train, strategy, damping=0.1, fisher="type-2", **kwargs)
    return problem, model, lossfunc, train, influence


# --- per module ---------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["identity", "kfac", "ekfac"])
@pytest.mark.parametrize("per_token", [False, True])
def test_per_module_scores_sum_to_total(strategy, per_token):
    problem, model, _, train, influence = _setup(strategy=strategy)
    query = problem.query(2)
    total = influence.scores(query, train, per_token=per_token)
    parts = influence.scores(query, train, per_token=per_token, per_module=True)
    modules = {name.rpartition(".")[0] for name, _ in model.named_parameters()}
    assert set(parts) == modules
    assert torch.allclose(sum(parts.values()), total, atol=1e-12 * total.abs().max(), rtol=0)
    # each module's part is its parameters' dot products (brute force, float64)
    ref = Reference(problem, model)
    rows = ref.query_rows()
    M = influence.precondition(rows)
    if not per_token:
        train_grads = dict(zip(ref.names, ref.train_grads().split(ref.numels, 1)))
        for module, value in parts.items():
            names = [n for n in ref.names if n.rpartition(".")[0] == module]
            expected = sum(M[n] @ train_grads[n].T for n in names)
            assert torch.allclose(value, expected, atol=1e-10 * total.abs().max(), rtol=0)
    low = influence.scores(query, train, per_token=per_token, per_module=True, query_rank=1)
    assert torch.allclose(
        sum(low.values()),
        influence.scores(query, train, per_token=per_token, query_rank=1),
        atol=1e-12 * total.abs().max(),
        rtol=0,
    )


# --- chunks on disk -----------------------------------------------------------------------------
class Interrupted(Exception):
    pass


class Counting:
    """Re-iterable batches that count how many were drawn, and can fail at batch `fail_at`."""

    def __init__(self, batches, fail_at=None):
        self.batches = batches
        self.fail_at = fail_at
        self.drawn = 0

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == self.fail_at:
                raise Interrupted(f"batch {i}")
            self.drawn += 1
            yield batch


def _forward_counter(model):
    count = [0]
    model.register_forward_hook(lambda *args: count.__setitem__(0, count[0] + 1))
    return count


@pytest.mark.parametrize("per_module", [False, True])
def test_chunks_resume_after_interruption(tmp_path, per_module):
    problem, model, _, train, influence = _setup()
    query = problem.query(3)  # one query batch
    expected = influence.scores(query, train, per_module=per_module)
    forwards = _forward_counter(model)
    out = tmp_path / "scores"
    with pytest.raises(Interrupted):  # chunks of 2 batches: chunk 0 and 1 finished
        influence.scores(
            query, Counting(train, fail_at=5), out_dir=out, chunk_size=2, per_module=per_module
        )
    assert forwards[0] == 1 + 5  # the query batch and batches 0-4
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["chunks"]) == ["0", "1"] and not manifest["complete"]
    with pytest.raises(ValueError, match="unfinished"):
        read_scores(out)
    partial = read_scores(out, partial=True)
    first = partial if not per_module else partial["q"]
    assert first.shape[1] == 8  # 4 batches of 2 examples
    forwards[0] = 0
    data = Counting(train)
    got = influence.scores(query, data, out_dir=out, chunk_size=2, per_module=per_module)
    assert forwards[0] == 1 + 2  # the query batch and chunk 2 only (batches 4, 5)
    assert data.drawn == 6  # finished chunks' batches are drawn (and checked) but not run
    for value, ref in zip(got.values(), expected.values()) if per_module else [(got, expected)]:
        assert torch.equal(value, ref)
    again = read_scores(out)
    assert torch.equal(again if not per_module else again["q"], got if not per_module else got["q"])
    # a finished computation is read back without running the model
    forwards[0] = 0
    influence.scores(query, train, out_dir=out, chunk_size=2, per_module=per_module)
    assert forwards[0] == 1


def test_chunks_refuse_other_inputs(tmp_path):
    problem, model, _, train, influence = _setup()
    query = problem.query(3)
    out = tmp_path / "scores"
    with pytest.raises(Interrupted):
        influence.scores(query, Counting(train, fail_at=3), out_dir=out, chunk_size=2)
    with pytest.raises(ValueError, match="other inputs"):  # other queries
        influence.scores(problem.query(2)[:1], train, out_dir=out, chunk_size=2)
    with pytest.raises(ValueError, match="other inputs"):  # other options
        influence.scores(query, train, out_dir=out, chunk_size=2, query_rank=1)
    with pytest.raises(ValueError, match="other inputs"):
        influence.scores(query, train, out_dir=out, chunk_size=3)
    changed = [(X.flip(0), y.flip(0)) for X, y in train]  # same model and queries, other data
    with pytest.raises(ValueError, match="batches of chunk 0 differ"):
        influence.scores(query, changed, out_dir=out, chunk_size=2)
    with torch.no_grad():  # another model
        next(model.parameters()).add_(1e-3)
    with pytest.raises(ValueError, match="other inputs"):
        influence.scores(query, train, out_dir=out, chunk_size=2)


def test_chunk_files_are_plain_tensors(tmp_path):
    problem, _, _, train, influence = _setup("mlp", "kfac")
    got = influence.scores(
        problem.query(2), train, out_dir=tmp_path, chunk_size=4, dtype=torch.bfloat16
    )
    files = sorted(tmp_path.glob("chunk-*.pt"))
    assert len(files) == 2
    parts = [torch.load(f, weights_only=True) for f in files]
    assert [p.shape[1] for p in parts] == [8, 3] and parts[0].dtype == torch.bfloat16
    assert torch.equal(torch.cat(parts, 1), got)


# --- storage dtypes -----------------------------------------------------------------------------
#: measured on these problems (docs/influence.md): largest deviation / largest score
SCORE_BOUNDS = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scores_in_storage_dtype(dtype):
    problem, _, _, train, influence = _setup()
    exact = influence.scores(problem.query(2), train)
    stored = influence.scores(problem.query(2), train, dtype=dtype)
    assert stored.dtype == dtype
    # rounding to nearest: half a unit in the last place, relative (float16 subnormals: absolute)
    tiny = torch.finfo(dtype).tiny
    bound = torch.finfo(dtype).eps / 2 * exact.abs() + tiny
    assert torch.all((stored.double() - exact).abs() <= bound)
    if dtype == torch.float16:  # scores beyond float16's range (65504) are refused
        influence.damping = dict.fromkeys(influence.damping, 1e-6)
        for block in influence.blocks:  # (F + λI)⁻¹ = 10⁶ I
            block.values = torch.zeros_like(block.values)
        with pytest.raises(ValueError, match="overflow"):
            influence.scores(problem.query(2), train, dtype=dtype)


@pytest.mark.parametrize("strategy", ["diagonal", "kfac", "ekfac"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fit_stored_in_dtype(tmp_path, name, strategy, dtype):
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    train = problem.train(4)
    influence = fit(model, lossfunc, train, strategy, fisher="type-2")  # heuristic damping
    exact = influence.scores(problem.query(2), train)
    influence.save(tmp_path / "fit.pt", dtype=dtype)
    state = torch.load(tmp_path / "fit.pt", weights_only=True)
    assert all(b["values"].dtype == dtype for b in state["blocks"])
    again = load(tmp_path / "fit.pt", model, lossfunc)
    assert again.blocks[0].values.dtype == torch.float64  # back in the parameters' dtype
    got = again.scores(problem.query(2), train)
    assert float((got - exact).abs().max() / exact.abs().max()) <= SCORE_BOUNDS[dtype]


def test_float16_refused_where_its_range_changes_the_inverse(tmp_path):
    # eigenvalues are stored relative to a power of two near the largest: one 1e-12 of the
    # largest underflows in float16 (smallest 6e-8), and matters next to a damping of 1e-13
    _, _, _, _, influence = _setup("mlp", "diagonal")
    block = influence.blocks[0]
    block.values = torch.ones_like(block.values)
    block.values.view(-1)[0] = 1e-12
    influence.damping[block.name] = 1e-13
    with pytest.raises(ValueError, match="float16"):
        influence.save(tmp_path / "fit.pt", dtype=torch.float16)
    influence.save(tmp_path / "fit.pt", dtype=torch.bfloat16)  # float32's range


# --- fits per block -----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["identity", "diagonal", "ekfac"])
def test_fit_saved_per_block(tmp_path, strategy):
    problem, model, lossfunc, train, influence = _setup(
        "mlp", strategy, separate_weight_and_bias=False
    )
    query = problem.query(2)
    folder = tmp_path / "fit"
    influence.save(folder, per_module=True)
    again = load(folder, model, lossfunc)
    assert torch.equal(again.scores(query, train), influence.scores(query, train))
    if strategy == "identity":
        assert not list((folder / "blocks").iterdir())
        return
    files = sorted((folder / "blocks").iterdir())
    assert len(files) == len(influence.blocks) == 2  # one per layer (bias folded)
    for block in influence.blocks:
        alone = load_block(folder, block.name)
        assert alone.name == block.name and alone.bias == block.bias
        assert torch.equal(alone.values, block.values)
        assert all(torch.equal(a, b) for a, b in zip(alone.vectors, block.vectors))
    with pytest.raises(KeyError, match="no block"):
        load_block(folder, "nothing")
    influence.save(tmp_path / "half", per_module=True, dtype=torch.bfloat16)
    half = load_block(tmp_path / "half", "0.weight")
    assert half.values.dtype == torch.float32  # eigenvalues stored scaled, rescaled in float32
    expected = influence.blocks[0].values
    assert torch.allclose(half.values.double(), expected, rtol=2**-8, atol=0)
