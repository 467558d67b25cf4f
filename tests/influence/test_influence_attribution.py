"""`backpack.influence.fit`: every strategy's scores against dense float64 brute force."""

from __future__ import annotations

import copy

import pytest
import torch
from influence_problems import (
    PROBLEMS,
    Reference,
    block_diagonal,
    ekfac_dense,
    heuristic_damping,
)
from torch import nn

from backpack.curvature import KFAC
from backpack.influence import Influence, fit, load

#: expected: torch's vmap has no batching rule for the CPU flash-attention backward, so the
#: curvature columns of the transformer problem go through its (slower) fallback, which warns
pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching "
    "rule:UserWarning"
)

STRATEGIES = ["identity", "diagonal", "kfac", "ekfac"]


def close(a, b, atol=1e-10, rtol=1e-8):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def approximation(strategy, fisher, problem, model, ref, reduction):
    """The dense approximation of F (the mean over the training examples) of `strategy`."""
    exact = ref.empirical_fisher() if fisher == "empirical" else ref.type2_fisher()
    spans = ref.blocks()
    if strategy == "diagonal":
        return torch.diag(exact.diagonal())
    kfac = KFAC(
        model,
        problem.make_loss(reduction),
        problem.train(),
        fisher_type="empirical" if fisher == "empirical" else "type-2",
    )
    if strategy == "kfac":
        # KFAC's scale is the data-set loss's, R Σ_n; F is the mean over the N examples
        nu, n = problem.normaliser(reduction), problem.X.shape[0]
        return kfac.to_dense() * nu / n
    assert strategy == "ekfac"
    return block_diagonal(ekfac_dense(kfac.factors, ref, exact, problem.transposed), spans)


def expected_scores(strategy, fisher, damping, problem, model, ref, reduction):
    Gq, Gt = ref.query_grads(), ref.train_grads()
    if strategy == "identity":
        return Gq @ Gt.T, (Gt * Gt).sum(1)
    M = approximation(strategy, fisher, problem, model, ref, reduction)
    if damping is None:
        lam = heuristic_damping(M, ref.blocks())
    else:
        lam = torch.full((M.shape[0],), damping, dtype=M.dtype)
    inverse = torch.linalg.inv(M + torch.diag(lam))
    return Gq @ inverse @ Gt.T, ((Gt @ inverse) * Gt).sum(1)


@pytest.mark.parametrize("damping", [None, 0.05])
@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens", "transformer"])
def test_scores_match_brute_force(name, strategy, fisher, damping):
    problem = PROBLEMS[name]
    model = problem.model()
    reduction = "mean"
    lossfunc = problem.make_loss(reduction)
    influence = fit(
        model, lossfunc, problem.train(), strategy=strategy, damping=damping, fisher=fisher
    )
    ref = Reference(problem, model)
    scores, self_scores = expected_scores(strategy, fisher, damping, problem, model, ref, reduction)
    close(influence.scores(problem.query(), problem.train(size=3)), scores)
    close(influence.self_scores(problem.train(size=5)), self_scores)


@pytest.mark.parametrize("strategy", ["diagonal", "kfac", "ekfac"])
def test_sum_reduction_gives_the_same_scores(strategy):
    """F is the mean over examples whatever the loss's reduction: the scores do not change."""
    problem = PROBLEMS["mlp"]
    model = problem.model()
    scores = {
        r: fit(model, problem.make_loss(r), problem.train(), strategy, fisher="type-2").scores(
            problem.query(), problem.train()
        )
        for r in ("mean", "sum")
    }
    close(scores["mean"], scores["sum"])
    ref = Reference(problem, model)
    close(scores["sum"], expected_scores(strategy, "type-2", None, problem, model, ref, "sum")[0])


@pytest.mark.parametrize("strategy", ["diagonal", "kfac", "ekfac"])
def test_true_fisher_is_seeded_and_tends_to_the_type2_fisher(strategy):
    problem = PROBLEMS["mlp"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    state = torch.random.get_rng_state()
    a = fit(model, lossfunc, problem.train(), strategy, fisher="true", seed=3)
    assert torch.equal(state, torch.random.get_rng_state())
    b = fit(model, lossfunc, problem.train(), strategy, fisher="true", seed=3)
    sa = a.scores(problem.query(), problem.train())
    close(sa, b.scores(problem.query(), problem.train()), atol=0, rtol=0)
    many = fit(model, lossfunc, problem.train(), strategy, fisher="true", mc_samples=4000)
    exact = fit(model, lossfunc, problem.train(), strategy, fisher="type-2")
    s_many = many.scores(problem.query(), problem.train())
    s_exact = exact.scores(problem.query(), problem.train())
    assert (s_many - s_exact).abs().max() / s_exact.abs().max() < 0.05


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_save_load_roundtrip(strategy, tmp_path):
    problem = PROBLEMS["transformer"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    influence = fit(model, lossfunc, problem.train(), strategy, fisher="empirical")
    path = tmp_path / "fit.pt"
    influence.save(path)
    state = torch.load(path, weights_only=True)
    assert state["strategy"] == strategy
    other = copy.deepcopy(problem.model())  # same weights, a fresh module
    loaded = load(path, other, problem.make_loss("mean"))
    assert isinstance(loaded, Influence)
    assert loaded.damping == influence.damping
    before = influence.scores(problem.query(), problem.train())
    close(loaded.scores(problem.query(), problem.train()), before, atol=0, rtol=0)
    close(loaded.self_scores(problem.train()), influence.self_scores(problem.train()))


def test_load_refuses_another_model(tmp_path):
    problem = PROBLEMS["mlp"]
    model = problem.model()
    fit(model, problem.make_loss("mean"), problem.train(), "kfac").save(tmp_path / "f.pt")
    with pytest.raises(ValueError, match="trainable parameters"):
        load(tmp_path / "f.pt", PROBLEMS["cnn"].model(), problem.make_loss("mean"))
    torch.save({"x": torch.ones(1)}, tmp_path / "g.pt")
    with pytest.raises(ValueError, match="influence fit"):
        load(tmp_path / "g.pt", model, problem.make_loss("mean"))


def test_errors_and_frozen_parameters():
    problem = PROBLEMS["mlp"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    with pytest.raises(ValueError, match="strategy"):
        fit(model, lossfunc, problem.train(), "lissa")
    with pytest.raises(ValueError, match="fisher"):
        fit(model, lossfunc, problem.train(), fisher="mc")
    with pytest.raises(ValueError, match="damping"):
        fit(model, lossfunc, problem.train(), "diagonal", damping=-1.0)
    # frozen parameters are left out of the gradients and of F
    model[0].weight.requires_grad_(False)
    influence = fit(model, lossfunc, problem.train(), "ekfac", fisher="empirical", damping=0.1)
    scores = influence.scores(problem.query(), problem.train())
    ref = Reference(problem, model)
    assert ref.theta.numel() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    expected, _ = expected_scores("ekfac", "empirical", 0.1, problem, model, ref, "mean")
    close(scores, expected)


def test_progress_bar(capsys):
    pytest.importorskip("tqdm")
    problem = PROBLEMS["mlp"]
    model = problem.model()
    influence = fit(model, problem.make_loss("mean"), problem.train(), "diagonal", progress=True)
    assert influence.scores(problem.query(), problem.train(), progress=True).shape == (3, 11)


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.extra = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x)


def test_a_parameter_outside_the_loss_is_refused():
    problem = PROBLEMS["mlp"]
    model = _Unused().double()
    with pytest.raises(ValueError, match="got no"):
        fit(model, problem.make_loss("mean"), problem.train(), "diagonal")


@pytest.mark.parametrize("strategy", ["identity", "diagonal"])
def test_examples_without_loss_terms_score_zero(strategy):
    """A batch whose targets are all ignored has zero gradients (and adds nothing to F)."""
    problem = PROBLEMS["tokens"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    Y = problem.Y.clone()
    Y[4:8] = -100
    train = problem.batches(problem.X, Y, 4)  # the second batch has no loss term
    influence = fit(model, lossfunc, train, strategy, fisher="empirical")
    scores = influence.scores(problem.query(), train)
    assert (scores[:, 4:8] == 0).all()
    ref = Reference(problem, model)
    Gt = ref.grads(problem.X, Y)
    Gq = ref.query_grads()
    if strategy == "identity":
        expected = Gq @ Gt.T
    else:
        diag = (Gt * Gt).mean(0)
        lam = torch.cat(
            [
                torch.full((b - a,), 0.1 * diag[a:b].mean().item(), dtype=torch.float64)
                for a, b in ref.blocks()
            ]
        )
        expected = Gq @ torch.diag(1 / (diag + lam)) @ Gt.T
    close(scores, expected)


def test_one_shot_iterators_score_but_ekfac_needs_a_reiterable():
    problem = PROBLEMS["mlp"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    with pytest.raises(TypeError, match="re-iterable"):
        fit(model, lossfunc, iter(problem.train()), "ekfac")
    influence = fit(model, lossfunc, problem.train(), "kfac", damping=0.1)
    expected = influence.scores(problem.query(), problem.train())
    close(influence.scores(iter(problem.query()), iter(problem.train())), expected, atol=0, rtol=0)


def test_zero_damping_on_a_singular_block_is_a_pseudo_inverse():
    """One training sequence: the embedding rows of absent tokens have no curvature; with
    damping 0 they are left out instead of dividing by zero."""
    problem = PROBLEMS["tokens"]
    model = problem.model()
    lossfunc = problem.make_loss("sum")
    train = problem.batches(problem.X[:1], problem.Y[:1], 1)
    influence = fit(model, lossfunc, train, "diagonal", damping=0.0, fisher="empirical")
    ref = Reference(problem, model)
    g = ref.grads(problem.X[:1], problem.Y[:1])[0]
    assert (g == 0).any()
    gq = ref.query_grads()
    inverse = torch.where(g != 0, 1 / torch.where(g != 0, g * g, 1), 0)
    scores = influence.scores(problem.query(), train)
    assert torch.isfinite(scores).all()
    close(scores, (gq * inverse * g).sum(1, keepdim=True))


def test_float32_model_and_untouched_gradients():
    """A float32 model scores like its float64 copy; `.grad` and backpack's fields stay as
    they were."""
    problem = PROBLEMS["cnn"]
    model64 = problem.model()
    model32 = copy.deepcopy(model64).float()
    for p in model32.parameters():
        p.grad = torch.ones_like(p)
    lossfunc = problem.make_loss("mean")

    def data(batches, dtype):
        return [(X.to(dtype), y) for X, y in batches]

    s64 = fit(model64, lossfunc, problem.train(), "ekfac", fisher="empirical").scores(
        problem.query(), problem.train()
    )
    f32 = fit(model32, lossfunc, data(problem.train(), torch.float32), "ekfac", fisher="empirical")
    s32 = f32.scores(data(problem.query(), torch.float32), data(problem.train(), torch.float32))
    assert s32.dtype == torch.float32
    assert (s32.double() - s64).abs().max() < 1e-3 * s64.abs().max()
    for p in model32.parameters():
        assert torch.equal(p.grad, torch.ones_like(p))
        assert not hasattr(p, "grad_batch") and not hasattr(p, "kflr")
