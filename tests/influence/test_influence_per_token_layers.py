"""Per-token scores of `nn.MultiheadAttention` and convolutions against brute force.

Brute force: the models' `functional(params, x)` (in `influence_problems`) give every parameter
one copy per position, float64; the gradient w.r.t. copy t is the term of position t (keys and
values: of position t of the memory; convolutions: of output position t). The preconditioner is
the fit's own (`Influence.precondition` of brute-force query gradients): what is checked here
is the split into positions, the fits themselves are checked in `test_influence_attribution`.
"""

from __future__ import annotations

import pytest
import torch
from influence_problems import Problem, Reference, TinyAttention, TinyConv1d, TinyViT
from test_influence_attribution import close
from torch import nn

from backpack.influence import fit

STRATEGIES = ["identity", "diagonal", "kfac", "ekfac"]


def _problem(make_model, X, Y, Xq, Yq, rows) -> Problem:
    return Problem(
        "per-token",
        make_model,
        lambda r: nn.CrossEntropyLoss(reduction=r, ignore_index=-100),
        X,
        Y,
        Xq,
        Yq,
        flatten_targets=rows,
    )


def _tokens(g, n, high, length):
    return torch.randint(0, high, (n, length), generator=g)


def attention_problem(kind="self", batch_first=True, layout="rows") -> Problem:
    g = torch.Generator().manual_seed(3)
    X, Y = _tokens(g, 7, 7, 5), _tokens(g, 7, 7, 5)
    Y[1, :2] = Y[4, 3] = -100
    return _problem(
        lambda: TinyAttention(kind=kind, batch_first=batch_first, layout=layout),
        X,
        Y,
        _tokens(g, 3, 7, 5),
        _tokens(g, 3, 7, 5),
        layout == "rows",
    )


def conv_problem(layout="channels") -> Problem:
    g = torch.Generator().manual_seed(4)
    X, Y = _tokens(g, 7, 7, 6), _tokens(g, 7, 7, 6)
    Y[2, 0] = -100
    return _problem(
        lambda: TinyConv1d(layout=layout),
        X,
        Y,
        _tokens(g, 3, 7, 6),
        _tokens(g, 3, 7, 6),
        layout == "rows",
    )


def vit_problem() -> Problem:
    g = torch.Generator().manual_seed(5)

    def images(n):
        return torch.randn(n, 2, 4, 6, generator=g, dtype=torch.float64)

    return _problem(TinyViT, images(7), _tokens(g, 7, 3, 6), images(3), _tokens(g, 3, 3, 6), True)


def preconditioned(influence, ref: Reference, G: torch.Tensor) -> torch.Tensor:
    """`[K, P]`: the fit's `(F + λI)⁻¹ g` of brute-force gradients `G` `[K, P]`."""
    rows = {
        name: G[:, a:b].reshape(-1, *shape)
        for name, shape, (a, b) in zip(ref.names, ref.shapes, ref.blocks())
    }
    out = influence.precondition(rows)
    return torch.cat([out[name] for name in ref.names], 1)


def check_per_token(problem: Problem, strategy: str) -> None:
    """Per-token scores, their sums, the scores and the self-scores against brute force."""
    model = problem.model()
    influence = fit(model, problem.make_loss("mean"), problem.train(), strategy, 0.1, "empirical")
    ref = Reference(problem, model)
    terms = ref.terms(problem.X, problem.Y)  # [n, T, P]
    G = ref.train_grads()
    close(terms.sum(1), G)  # the copies' gradients add up to the gradients
    query = preconditioned(influence, ref, ref.query_grads())
    expected = torch.einsum("qp,ntp->qnt", query, terms)
    train = problem.train(size=3)
    close(influence.scores(problem.query(), train, per_token=True), expected)
    close(influence.scores(problem.query(), train), expected.sum(-1))
    close(influence.scores(problem.query(), train, factored=False), expected.sum(-1))
    close(influence.self_scores(train), (preconditioned(influence, ref, G) * G).sum(1))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    "kind, batch_first, layout",
    [
        ("self", True, "rows"),
        ("self", False, "channels"),
        ("cross", True, "channels"),
        ("kdim", False, "rows"),
    ],
    ids=str,
)
def test_attention_per_token(strategy, kind, batch_first, layout):
    """Self-attention (packed weights), cross-attention on a memory of the same length (packed
    weights, three row blocks with their own inputs), separate q/k/v weights; causal mask."""
    check_per_token(attention_problem(kind, batch_first, layout), strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", ["channels", "rows"])
def test_conv1d_per_token(strategy, layout):
    """Causal dilated, grouped with replicate padding, and 1×1 Conv1d: terms per output position."""
    check_per_token(conv_problem(layout), strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vit_patch_embedding_per_token(strategy):
    """Conv2d with kernel = stride: its output pixels, row-major, are the tokens."""
    check_per_token(vit_problem(), strategy)


class _Wrapped(nn.Module):
    """Embedding → `layer` (a callable on `[N, T, E]`) → Linear: logits `[N·T, V]`."""

    def __init__(self, layer, dim=4, vocab=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layer = layer
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + self.layer(h)).flatten(0, 1)


class _Memory(nn.Module):
    """Attention of the sequence over its first `keys` positions (another length)."""

    def __init__(self, keys, **options):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, **options)
        self.keys = keys

    def forward(self, h):
        memory = h[:, : self.keys] if self.keys else h
        return self.attn(h, memory, memory, need_weights=False)[0]


class _Conv(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, h):
        y = self.conv(h.transpose(1, 2)).transpose(1, 2)
        t = h.shape[1]
        return y.repeat_interleave(-(-t // y.shape[1]), 1)[:, :t]  # strided: each output twice


def _scores(model, freeze=()):
    torch.manual_seed(0)
    model = model.double()
    for name in freeze:
        model.get_parameter(name).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randint(0, 5, (4, 4), generator=g), torch.randint(0, 5, (4, 4), generator=g)
    data = [(X[:2], Y[:2].flatten()), (X[2:], Y[2:].flatten())]
    influence = fit(model, nn.CrossEntropyLoss(), data, "identity")
    tokens = influence.scores(data, data, per_token=True)
    assert tokens.shape == (4, 4, 4)
    close(tokens.sum(-1), influence.scores(data, data, factored=False))


def test_attention_over_another_length_refuses_its_key_value_terms():
    model = _Wrapped(_Memory(keys=2))
    with pytest.raises(ValueError, match="2 key/value positions from 4 query positions"):
        _scores(model)
    _scores(model, freeze=["layer.attn.in_proj_weight", "layer.attn.in_proj_bias"])


def test_attention_bias_kv_refused_unless_frozen_and_zero_attn_supported():
    with pytest.raises(ValueError, match="layer.attn.bias_k .*add_bias_kv"):
        _scores(_Wrapped(_Memory(keys=0, add_bias_kv=True)))
    _scores(_Wrapped(_Memory(keys=0, add_bias_kv=True)), ["layer.attn.bias_k", "layer.attn.bias_v"])
    _scores(_Wrapped(_Memory(keys=0, add_zero_attn=True)))


def test_convolution_with_other_output_length_refused():
    with pytest.raises(ValueError, match="a convolution's positions are its output positions"):
        _scores(_Wrapped(_Conv(nn.Conv1d(4, 4, 2, stride=2))))
    _scores(_Wrapped(_Conv(nn.Conv1d(4, 4, 3, padding="same", padding_mode="circular"))))
    with pytest.raises(ValueError, match="layer.conv.weight .*ConvTranspose1d"):
        _scores(_Wrapped(_Conv(nn.ConvTranspose1d(4, 4, 3, padding=1))))


class _Tubelets(nn.Module):
    """Video `[N, 2, 4, 4, 6]` → tubelets (2×2×2, no overlap) → Linear head per token.

    `conv=True`: a Conv3d with kernel = stride; else the patches cut by hand through an
    `nn.Linear` with the same weights (flattened): the same function, token for token.
    """

    def __init__(self, conv: bool):
        super().__init__()
        self.conv = conv
        self.embed = nn.Conv3d(2, 4, 2, stride=2) if conv else nn.Linear(16, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        if self.conv:
            h = self.embed(x).flatten(2).transpose(1, 2)
        else:
            n, c, d, a, b = x.shape
            h = x.reshape(n, c, d // 2, 2, a // 2, 2, b // 2, 2).permute(0, 2, 4, 6, 1, 3, 5, 7)
            h = self.embed(h.reshape(n, -1, c * 8))
        return self.head(torch.tanh(h)).flatten(0, 1)


@pytest.mark.parametrize("strategy", ["identity", "diagonal"])
def test_conv3d_tokens_are_its_output_voxels(strategy):
    """A Conv3d tubelet embedding gives the per-token scores of the same map as a Linear on
    patches cut by hand (tokens: output voxels, row-major).

    (Not "kfac"/"ekfac": a convolution's G sums the output factor over positions first, a
    Linear's on positions does not (`rules/conv.py`, `rules/linear.py`), so the fits differ.)"""
    g = torch.Generator().manual_seed(6)
    X = torch.randn(5, 2, 4, 4, 6, generator=g, dtype=torch.float64)
    Y = torch.randint(0, 3, (5, 12), generator=g)
    data = [(X[:3], Y[:3].flatten()), (X[3:], Y[3:].flatten())]
    torch.manual_seed(0)
    conv = _Tubelets(True).double()
    patches = _Tubelets(False).double()
    with torch.no_grad():
        for name, p in conv.named_parameters():
            patches.get_parameter(name).copy_(p.flatten(1) if name == "embed.weight" else p)
    scores = []
    for model in (conv, patches):
        lossfunc = nn.CrossEntropyLoss()
        influence = fit(model, lossfunc, data, strategy, damping=0.1, fisher="empirical")
        scores.append(influence.scores(data, data, per_token=True))
    assert scores[0].shape == (5, 5, 12)
    close(scores[0], scores[1])
