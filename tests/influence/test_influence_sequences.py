"""Sequence models: per-token scores and the factored products of Linear-like layers.

Brute force: the term of position t of a sequence's gradient is the gradient w.r.t. a copy of
every parameter used at position t only (`TinyGPT.functional`), in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from influence_problems import PROBLEMS, Reference, TinyGPT
from test_influence_attribution import approximation, close
from torch import nn

from backpack.influence import _sites, fit

STRATEGIES = ["identity", "diagonal", "kfac", "ekfac"]


def gpt_problem(tied=False, layout="rows"):
    problem = PROBLEMS["gpt"]
    problem = type(problem)(**{**problem.__dict__})
    problem.make_model = lambda: TinyGPT(tied=tied, layout=layout)
    problem.flatten_targets = layout == "rows"
    if tied:  # the shared weight's Kronecker factors are the head's, in its own layout
        problem.transposed = {"pos.weight"}
    return problem


def preconditioner(strategy, problem, model, ref, damping):
    if strategy == "identity":
        return torch.eye(ref.theta.numel(), dtype=torch.float64)
    M = approximation(strategy, "empirical", problem, model, ref, "mean")
    return torch.linalg.inv(M + damping * torch.eye(M.shape[0], dtype=M.dtype))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "tied, layout", [(False, "rows"), (True, "rows"), (False, "channels")], ids=str
)
def test_per_token_scores_match_brute_force(strategy, tied, layout):
    problem = gpt_problem(tied, layout)
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    influence = fit(model, lossfunc, problem.train(), strategy, damping=0.1, fisher="empirical")
    ref = Reference(problem, model)
    terms = ref.terms(problem.X, problem.Y)  # [n, T, P]
    close(terms.sum(1), ref.train_grads())  # the terms add up to the gradients
    inverse = preconditioner(strategy, problem, model, ref, 0.1)
    expected = torch.einsum("qp,pr,ntr->qnt", ref.query_grads(), inverse, terms)
    per_token = influence.scores(problem.query(), problem.train(size=3), per_token=True)
    close(per_token, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tied weights: every use recorded, no coverage warning
        scores = influence.scores(problem.query(), problem.train(size=3))
    close(scores, expected.sum(-1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_factored_products_equal_the_dense_path(strategy, monkeypatch):
    """Every choice of the cost model gives the dense path's numbers (float64)."""
    problem = gpt_problem()
    model = problem.model()
    influence = fit(model, problem.make_loss("mean"), problem.train(), strategy, damping=0.1)
    query, train = problem.query(), problem.train(size=4)
    reference = influence.scores(query, train, factored=False)
    self_reference = influence.self_scores(train, factored=False)
    choices = []
    for how in ("dense", "factored", "ghost"):

        def forced(site, queries, positions=None, how=how):
            choice = how if how != "ghost" or positions is not None else "factored"
            choices.append(choice)
            return choice

        monkeypatch.setattr("backpack.influence._scoring.choose", forced)
        close(influence.scores(query, train), reference)
    assert "factored" in choices and "dense" in choices
    assert ("ghost" in choices) == (strategy == "identity")
    for ghost in (True, False):
        monkeypatch.setattr("backpack.influence.attribution.norm_is_ghost", lambda s, g=ghost: g)
        close(influence.self_scores(train), self_reference)


def test_cost_model():
    a = torch.zeros(2, 1, 30)
    b = torch.zeros(2, 1, 20)
    one_position = _sites.Site("outer", (20, 30), b, a)
    assert _sites.choose(one_position, queries=100) == "factored"  # T = 1: Q N m k vs (Q+1) N m k
    long = _sites.Site("outer", (20, 30), torch.zeros(2, 64, 20), torch.zeros(2, 64, 30))
    assert _sites.choose(long, queries=100) == "dense"
    assert _sites.choose(long, queries=1) == "dense"  # T (m + k) > m k: G_n is smaller
    wide = _sites.Site("outer", (64, 64), torch.zeros(2, 4, 64), torch.zeros(2, 4, 64))
    assert _sites.choose(wide, queries=1) == "factored"
    assert _sites.choose(wide, queries=8) == "dense"
    short = _sites.Site("outer", (200, 300), torch.zeros(2, 3, 200), torch.zeros(2, 3, 300))
    assert _sites.choose(short, queries=4, query_positions=2) == "ghost"
    assert _sites.norm_is_ghost(short) and not _sites.norm_is_ghost(long)


class _Recurrent(nn.Module):
    """Embedding → GRU → Linear, logits `[N·T, V]` (the GRU has no terms per position)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.gru = nn.GRU(4, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.gru(self.emb(x))[0]).flatten(0, 1)


def test_per_token_needs_position_wise_layers():
    problem = type(PROBLEMS["transformer"])(**{**PROBLEMS["transformer"].__dict__})
    problem.make_model = _Recurrent
    model = problem.model()
    influence = fit(model, problem.make_loss("mean"), problem.train(), "identity")
    with pytest.raises(ValueError, match=r"gru.weight_ih_l0 \(in a GRU"):
        influence.scores(problem.query(), problem.train(), per_token=True)
    model.gru.requires_grad_(False)
    influence = fit(model, problem.make_loss("mean"), problem.train(), "identity")
    tokens = influence.scores(problem.query(), problem.train(), per_token=True)
    assert tokens.shape == (3, 11, 3)
    close(tokens.sum(-1), influence.scores(problem.query(), problem.train()))


def test_per_token_refuses_mixed_lengths():
    problem = gpt_problem()
    model = problem.model()
    influence = fit(model, problem.make_loss("sum"), problem.train(), "identity")
    train = [
        (problem.X[:3], problem.Y[:3].flatten()),
        (problem.X[3:6, :4], problem.Y[3:6, :4].flatten()),
    ]
    with pytest.raises(ValueError, match="pad sequences"):
        influence.scores(problem.query(), train, per_token=True)


def test_padding_idx_rows_get_no_terms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3, padding_idx=0), nn.Linear(3, 4)).double()
    X = torch.tensor([[0, 1, 2], [3, 0, 4]])
    Y = torch.tensor([[1, 2, 3], [0, 1, 2]])
    data = [(X, Y.flatten())]

    class Rows(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x).flatten(0, 1)

    wrapped = Rows()
    loss = nn.CrossEntropyLoss(reduction="sum")
    influence = fit(wrapped, loss, data, "identity")
    tokens = influence.scores(data, data, per_token=True)
    close(tokens.sum(-1), influence.scores(data, data, factored=False))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_chunked_products_give_the_same_numbers(name, strategy, monkeypatch):
    """Tiny chunks (one query, one sample at a time) change nothing.

    (A fixed damping: the key bias of attention has zero gradient in exact arithmetic, so the
    heuristic damping there is ~1e-36 and rounding differences would be amplified.)"""
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    influence = fit(model, lossfunc, problem.train(), strategy, 0.1, fisher="empirical")
    expected = influence.scores(problem.query(), problem.train(), factored=False)
    self_expected = influence.self_scores(problem.train(), factored=False)
    monkeypatch.setattr("backpack.influence._sites.CHUNK_ENTRIES", 1)
    monkeypatch.setattr("backpack.influence.attribution.CHUNK_ENTRIES", 1)
    chunked = fit(model, lossfunc, problem.train(), strategy, 0.1, fisher="empirical")
    close(chunked.scores(problem.query(), problem.train()), expected)
    close(chunked.scores(problem.query(), problem.train(), per_token=True).sum(-1), expected)
    close(chunked.self_scores(problem.train()), self_expected)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hugging_face_conv1d(strategy):
    """`Conv1D` (weight stored `[in, out]`): the factored products, the diagonal's and EK-FAC's
    closed forms on one position, and per-token scores, against brute force."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    base = PROBLEMS["mlp"]
    problem = type(base)(**{**base.__dict__})
    problem.make_model = lambda: nn.Sequential(conv1d(5, 4), nn.Tanh(), nn.Linear(5, 3))
    problem.transposed = {"0.weight"}  # Kronecker factors of weight.T
    model = problem.model()
    influence = fit(model, problem.make_loss("mean"), problem.train(), strategy, 0.1, "empirical")
    ref = Reference(problem, model)
    inverse = preconditioner(strategy, problem, model, ref, 0.1)
    expected = ref.query_grads() @ inverse @ ref.train_grads().T
    close(influence.scores(problem.query(), problem.train()), expected)
    close(influence.scores(problem.query(), problem.train(), per_token=True)[..., 0], expected)
    close(
        influence.self_scores(problem.train()),
        ((ref.train_grads() @ inverse) * ref.train_grads()).sum(1),
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_hugging_face_gpt2_every_parameter_per_token():
    """A tiny random GPT-2 (Conv1D, LayerNorm, token and position embeddings, the head tied to
    the token embedding): per-token scores add up to the scores, which equal `torch.func`'s."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(config)

        def forward(self, x):
            return self.gpt(input_ids=x).logits.flatten(0, 1)

    model = Logits().double().eval()
    X, Y = torch.randint(0, 11, (5, 4)), torch.randint(0, 11, (5, 4))
    Y[1, 0] = -100
    data = [(X[:3], Y[:3].flatten()), (X[3:], Y[3:].flatten())]
    lossfunc = nn.CrossEntropyLoss()
    influence = fit(model, lossfunc, data, "identity")
    tokens = influence.scores(data, data, per_token=True)
    assert tokens.shape == (5, 5, 4)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def own_loss(p, x, y):
        out = torch.func.functional_call(model, p, (x[None],))
        return nn.functional.cross_entropy(out, y, reduction="sum")

    g = [torch.func.grad(own_loss)(params, X[i], Y[i]) for i in range(5)]
    G = torch.stack([torch.cat([gi[n].flatten() for n in params]) for gi in g])
    close(tokens.sum(-1), G @ G.T)
    close(influence.scores(data, data), G @ G.T)
