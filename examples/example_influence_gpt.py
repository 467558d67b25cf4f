"""Which training sequences taught a tiny GPT a continuation: per-sequence and per-token influence.

A character-level GPT (token and position embeddings, causal attention written with
`nn.Linear` projections, an MLP, LayerNorms, the head tied to the token embedding) is trained
for a few steps on a small toy text that ships with this script. The training set is the text
cut into windows; a query is a prompt and its continuation, scored on the continuation only
(the prompt's targets are `ignore_index`). `backpack.influence.fit` fits EK-FAC to the training
windows once, and

- `scores(query, train)` gives `[n_query, n_train]`: which windows support (positive) or oppose
  (negative) the continuation;
- `scores(query, train, per_token=True)` gives `[n_query, n_train, T]`: the same scores split
  over the positions of each training window (they sum to the window's score), printed under
  the characters of the most helpful window.

Checks: the scores equal dense linear algebra with per-sequence gradients from `torch.func` and
the fitted EK-FAC written out as a matrix, and the per-token scores add up to the scores.

    python examples/example_influence_gpt.py --train-steps 200
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad

from backpack.influence import fit

#: the toy text (written for this example)
TEXT = (
    "the baker opens the shop at seven. the baker sells bread and buns. "
    "the miller brings flour at eight. the miller drinks tea with the baker. "
    "at noon the shop is full. at night the shop is dark and the baker sleeps. "
    "the cat of the baker sleeps on the flour. the miller laughs at the cat. "
)
QUERIES = [("the baker opens the", " shop at seven."), ("the miller drinks", " tea with")]


class CausalGPT(nn.Module):
    """One pre-norm block; attention from `nn.Linear` layers; logits `[N·T, V]`."""

    def __init__(self, vocab: int, context: int, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.lnf = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        nn.init.normal_(self.tok.weight, std=0.1)

    def forward(self, idx: Tensor) -> Tensor:
        n, t = idx.shape
        positions = torch.arange(t, device=idx.device).expand(n, t)  # batch axis first
        x = self.tok(idx) + self.pos(positions)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        d = q.shape[-1] // self.heads

        def split(z: Tensor) -> Tensor:
            return z.reshape(n, t, self.heads, d).transpose(1, 2)

        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        att = (split(q) @ split(k).transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, -1e9)
        y = (att.softmax(-1) @ split(v)).transpose(1, 2).reshape(n, t, -1)
        x = x + self.proj(y)
        x = x + self.down(torch.tanh(self.up(self.ln2(x))))
        return self.head(self.lnf(x)).flatten(0, 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=24, help="characters per window")
    parser.add_argument("--stride", type=int, default=12, help="characters between windows")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--strategy", default="ekfac", choices=["identity", "diagonal", "kfac", "ekfac"]
    )
    parser.add_argument("--top", type=int, default=2, help="helpful/harmful windows shown")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def encode(text: str, chars: list[str]) -> Tensor:
    return torch.tensor([chars.index(c) for c in text])


def query_batch(chars: list[str], context: int) -> tuple[Tensor, Tensor]:
    """Prompt + continuation, right-padded to `context`; targets only on the continuation."""
    X = torch.zeros(len(QUERIES), context, dtype=torch.long)
    Y = torch.full((len(QUERIES), context), -100)
    for i, (prompt, continuation) in enumerate(QUERIES):
        ids = encode((prompt + continuation)[: context + 1], chars)
        X[i, : len(ids) - 1] = ids[:-1]
        Y[i, len(prompt) - 1 : len(ids) - 1] = ids[len(prompt) :]
    return X, Y


def per_sequence_grads(model: nn.Module, X: Tensor, Y: Tensor) -> Tensor:
    """`[n, P]`: each sequence's gradient of its summed token loss (`torch.func`, no backpack)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, x, y):
        out = functional_call(model, p, (x[None],))
        return nn.functional.cross_entropy(out, y, ignore_index=-100, reduction="sum")

    g = grad(loss)
    rows = [g(params, X[i], Y[i]) for i in range(len(X))]
    return torch.stack([torch.cat([r[n].flatten() for n in params]) for r in rows])


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    chars = sorted(set(TEXT))
    data = encode(TEXT, chars)
    starts = torch.arange(0, len(data) - args.context - 1, args.stride)
    offsets = torch.arange(args.context + 1)
    chunks = data[starts[:, None] + offsets]
    X_train, Y_train = chunks[:, :-1], chunks[:, 1:]
    model = CausalGPT(len(chars), args.context, args.dim).double()
    lossfunc = nn.CrossEntropyLoss(ignore_index=-100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(args.train_steps):
        pick = torch.randint(0, len(X_train), (args.batch_size,))
        optimizer.zero_grad()
        lossfunc(model(X_train[pick]), Y_train[pick].flatten()).backward()
        optimizer.step()
    with torch.no_grad():
        train_loss = lossfunc(model(X_train), Y_train.flatten()).item()
    print(f"{len(X_train)} windows of {args.context} characters; training loss {train_loss:.3f}")

    def batches(X, Y):
        return [
            (X[i : i + args.batch_size], Y[i : i + args.batch_size].flatten())
            for i in range(0, len(X), args.batch_size)
        ]

    Xq, Yq = query_batch(chars, args.context)
    train, query = batches(X_train, Y_train), batches(Xq, Yq)
    influence = fit(model, lossfunc, train, strategy=args.strategy)
    scores = influence.scores(query, train)
    tokens = influence.scores(query, train, per_token=True)
    print(f"{args.strategy}: scores {tuple(scores.shape)}, per-token {tuple(tokens.shape)}")

    # checks: dense linear algebra with torch.func gradients; per-token scores add up
    G_query = per_sequence_grads(model, Xq, Yq)
    G_train = per_sequence_grads(model, X_train, Y_train)
    if args.strategy == "identity":
        expected = G_query @ G_train.T
    else:
        dense = torch.block_diag(*[b.dense(b.values) for b in influence.blocks])
        damping = torch.cat(
            [
                torch.full((b.numel,), influence.damping[b.name], dtype=dense.dtype)
                for b in influence.blocks
            ]
        )
        expected = G_query @ torch.linalg.solve(dense + torch.diag(damping), G_train.T)
    error = ((scores - expected).abs().max() / expected.abs().max()).item()
    if not error < 1e-8:
        raise AssertionError(f"influence scores differ from dense linear algebra ({error:.1e})")
    token_error = ((tokens.sum(-1) - scores).abs().max() / scores.abs().max()).item()
    if not token_error < 1e-10:
        raise AssertionError(f"per-token scores do not add up to the scores ({token_error:.1e})")
    print(f"scores match dense linear algebra with torch.func gradients ({error:.1e})")

    def window(j: int) -> str:
        return "".join(chars[c] for c in X_train[j])

    for i, (prompt, continuation) in enumerate(QUERIES):
        print(f"\nquery {i}: {prompt!r} -> {continuation!r}")
        for sign, label in ((1, "helpful"), (-1, "harmful")):
            for j in (sign * scores[i]).topk(args.top).indices.tolist():
                print(f"  {label:8s} {scores[i, j]:+9.3g}  {window(j)!r}")
        best = int(scores[i].argmax())
        share = tokens[i, best] / tokens[i, best].abs().sum()
        print("  per-token share of the most helpful window (position: character share):")
        print("   " + " ".join(f"{chars[c]!r}:{s:+.2f}" for c, s in zip(X_train[best], share)))
    return {"scores": scores, "per_token": tokens, "relative_error": error}


if __name__ == "__main__":
    main()
