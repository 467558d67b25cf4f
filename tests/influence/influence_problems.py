"""Tiny float64 problems and brute-force references for training-data attribution.

Per-sample gradients come from `torch.func` (one `grad` per example, no backpack); Fishers are
explicit `[P, P]` matrices built from them (empirical) or from Jacobians and loss Hessians
(type-2, the GGN); every approximation is a dense matrix, inverted with `torch.linalg`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev


class TinyTransformer(nn.Module):
    """Embedding + positions → one-head self-attention (residual) → LayerNorm → Linear head.

    Logits of every token, flattened to `[N·T, C]` (a token loss).
    """

    def __init__(self, vocab=5, dim=4, length=3, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(length, dim)
        self.attn = nn.MultiheadAttention(dim, 1, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        h = self.emb(x) + self.pos(positions)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + a)).flatten(0, 1)


class TokenModel(nn.Module):
    """Embedding → Tanh → Linear on `[N, T]` tokens, logits flattened to `[N·T, C]`."""

    def __init__(self, vocab=6, dim=3, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.act = nn.Tanh()
        self.lin = nn.Linear(dim, classes)

    def forward(self, x):
        return self.lin(self.act(self.emb(x))).flatten(0, 1)


class TinyGPT(nn.Module):
    """A one-block causal GPT from position-wise layers only (Embedding, LayerNorm, Linear).

    `forward(x)` returns logits `[N·T, V]` (`layout="rows"`) or `[N, V, T]` (`"channels"`, what
    `CrossEntropyLoss` takes for sequences). `tied`: the head shares the token embedding.
    `functional(params, x)` is the same network with every parameter given per position
    (`[T, *shape]`): the gradient w.r.t. copy t is the term of position t (brute force).
    """

    def __init__(self, vocab=7, dim=4, length=5, hidden=6, tied=False, layout="rows"):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(length, dim)
        self.ln1 = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.lnf = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        self.layout = layout

    def _net(self, x, emb, norm, lin):
        t = x.shape[1]
        positions = torch.arange(t, device=x.device).expand(x.shape[0], -1)
        h = emb("tok", x) + emb("pos", positions)
        a = norm("ln1", h)
        q, k, v = lin("q", a), lin("k", a), lin("v", a)
        w = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        w = w.masked_fill(~mask, float("-inf")).softmax(-1)
        h = h + lin("o", w @ v)
        h = h + lin("down", torch.tanh(lin("up", norm("ln2", h))))
        logits = lin("head", norm("lnf", h))
        if self.layout == "rows":
            return logits.flatten(0, 1)
        return logits.transpose(1, 2)

    def forward(self, x):
        return self._net(
            x,
            lambda name, i: getattr(self, name)(i),
            lambda name, h: getattr(self, name)(h),
            lambda name, h: getattr(self, name)(h),
        )

    def functional(self, params, x):
        """The network with `params[name]` `[T, *shape]` (copy t used at position t only)."""
        t = x.shape[1]
        names = dict(self.named_parameters(remove_duplicate=False))
        key = {id(p): n for n, p in self.named_parameters()}  # tied: the first name

        def p(name):
            return params[key[id(names[name])]]

        def emb(name, i):
            return p(f"{name}.weight")[torch.arange(t)[None, :], i]

        def norm(name, h):
            mod = getattr(self, name)
            hat = nn.functional.layer_norm(h, h.shape[-1:], eps=mod.eps)
            return hat * p(f"{name}.weight") + p(f"{name}.bias")

        def lin(name, h):
            out = torch.einsum("nti,toi->nto", h, p(f"{name}.weight"))
            if getattr(self, name).bias is not None:
                out = out + p(f"{name}.bias")
            return out

        return self._net(x, emb, norm, lin)


def _copies(params, names, key):
    """`params` by any of a parameter's names (tied: the first), for `functional`."""

    def p(name):
        return params[key[id(names[name])]]

    return p


def _position_linear(h, weight, bias=None):
    """`h` `[N, T, in]` through copy t of `weight` `[T, out, in]` (and `bias` `[T, out]`)."""
    out = torch.einsum("nti,toi->nto", h, weight)
    return out if bias is None else out + bias


def _position_attention(q, k, v, heads, causal):
    """Scaled dot-product attention of `[N, T, E]` projections with `heads` heads."""
    n, t, e = q.shape
    d = e // heads

    def split(x):
        return x.reshape(n, x.shape[1], heads, d).transpose(1, 2)

    w = split(q) @ split(k).transpose(-1, -2) / d**0.5
    if causal:
        mask = torch.ones(t, k.shape[1], dtype=torch.bool).tril()
        w = w.masked_fill(~mask, float("-inf"))
    return (w.softmax(-1) @ split(v)).transpose(1, 2).reshape(n, t, e)


class TinyAttention(nn.Module):
    """Embeddings → LayerNorm → `nn.MultiheadAttention` (causal, residual) → Linear head.

    `kind`: "self" (query, key and value one tensor, packed `in_proj_weight`), "cross"
    (key and value a Linear memory of the same length, packed weights) or "kdim" (key and
    value of other widths: separate `q/k/v_proj_weight`). `layout` as in `TinyGPT`;
    `functional(params, x)` gives every parameter one copy per position (keys and values:
    per position of the memory).
    """

    def __init__(
        self, vocab=7, dim=4, heads=2, length=5, kind="self", batch_first=True, layout="rows"
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(length, dim)
        self.ln = nn.LayerNorm(dim)
        kdim, vdim = (3, 5) if kind == "kdim" else (dim, dim)
        if kind != "self":
            self.mk = nn.Linear(dim, kdim)
        if kind == "kdim":
            self.mv = nn.Linear(dim, vdim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=batch_first, kdim=kdim, vdim=vdim)
        self.head = nn.Linear(dim, vocab)
        self.kind, self.layout, self.heads = kind, layout, heads

    def _net(self, x, emb, norm, lin, attend):
        t = x.shape[1]
        positions = torch.arange(t, device=x.device).expand(x.shape[0], -1)
        h = emb("tok", x) + emb("pos", positions)
        a = norm("ln", h)
        if self.kind == "self":
            k = v = a
        else:
            k = lin("mk", torch.tanh(h))
            v = k if self.kind == "cross" else lin("mv", torch.tanh(h))
        logits = lin("head", h + attend(a, k, v))
        return logits.flatten(0, 1) if self.layout == "rows" else logits.transpose(1, 2)

    def forward(self, x):
        def attend(q, k, v):
            t = q.shape[1]
            mask = ~torch.ones(t, k.shape[1], dtype=torch.bool, device=q.device).tril()
            if not self.attn.batch_first:
                q, k, v = (u.transpose(0, 1) for u in (q, k, v))
                if self.kind == "self":
                    k = v = q
                elif self.kind == "cross":
                    v = k
            y, _ = self.attn(q, k, v, attn_mask=mask, need_weights=False)
            return y if self.attn.batch_first else y.transpose(0, 1)

        return self._net(
            x,
            lambda name, i: getattr(self, name)(i),
            lambda name, h: getattr(self, name)(h),
            lambda name, h: getattr(self, name)(h),
            attend,
        )

    def functional(self, params, x):
        """The network with `params[name]` `[T, *shape]` (copy t used at position t only)."""
        t = x.shape[1]
        p = _copies(
            params,
            dict(self.named_parameters(remove_duplicate=False)),
            {id(q): n for n, q in self.named_parameters()},
        )
        e = self.attn.embed_dim

        def emb(name, i):
            return p(f"{name}.weight")[torch.arange(t)[None, :], i]

        def norm(name, h):
            hat = nn.functional.layer_norm(h, h.shape[-1:], eps=getattr(self, name).eps)
            return hat * p(f"{name}.weight") + p(f"{name}.bias")

        def lin(name, h):
            return _position_linear(h, p(f"{name}.weight"), p(f"{name}.bias"))

        def attend(q, k, v):
            if self.kind == "kdim":
                w = [p(f"attn.{c}_proj_weight") for c in "qkv"]
            else:
                w = p("attn.in_proj_weight").split(e, 1)
            b = p("attn.in_proj_bias").split(e, 1)
            q, k, v = (_position_linear(u, wi, bi) for u, wi, bi in zip((q, k, v), w, b))
            o = _position_attention(q, k, v, self.heads, causal=True)
            return _position_linear(o, p("attn.out_proj.weight"), p("attn.out_proj.bias"))

        return self._net(x, emb, norm, lin, attend)


def _position_conv1d(x, weight, bias, conv):
    """`conv` on `[N, C, L]` with copy t of `weight` `[T, *shape]` for output position t."""
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = nn.functional.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    (k,), (s,), (d,), g = conv.kernel_size, conv.stride, conv.dilation, conv.groups
    t = weight.shape[0]
    index = torch.arange(t)[:, None] * s + torch.arange(k)[None, :] * d  # [T, K]
    patches = x[:, :, index]  # [N, C, T, K]
    n, c = patches.shape[:2]
    patches = patches.reshape(n, g, c // g, t, k)
    w = weight.reshape(t, g, -1, c // g, k)
    out = torch.einsum("ngctk,tgock->ngot", patches, w).reshape(n, -1, t)
    return out if bias is None else out + bias.T


class TinyConv1d(nn.Module):
    """Embedding → a causal dilated Conv1d → a grouped 'same' Conv1d (replicate padding) → a
    1×1 Conv1d head: logits `[N, V, T]` ("channels") or `[N·T, V]` ("rows").

    `functional(params, x)`: copy t of every parameter used at output position t only.
    """

    def __init__(self, vocab=7, dim=4, hidden=6, layout="channels"):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.causal = nn.Conv1d(dim, hidden, 3, dilation=2)
        self.mix = nn.Conv1d(hidden, hidden, 3, padding=1, groups=3, padding_mode="replicate")
        self.head = nn.Conv1d(hidden, vocab, 1)
        self.layout = layout

    def _net(self, x, emb, conv):
        h = emb(x).transpose(1, 2)  # [N, C, T]
        h = torch.tanh(conv("causal", nn.functional.pad(h, (4, 0))))
        logits = conv("head", h + torch.tanh(conv("mix", h)))
        return logits if self.layout == "channels" else logits.transpose(1, 2).flatten(0, 1)

    def forward(self, x):
        return self._net(x, self.tok, lambda name, h: getattr(self, name)(h))

    def functional(self, params, x):
        """The network with `params[name]` `[T, *shape]` (copy t used at position t only)."""
        t = x.shape[1]

        def emb(i):
            return params["tok.weight"][torch.arange(t)[None, :], i]

        def conv(name, h):
            weight, bias = params[f"{name}.weight"], params[f"{name}.bias"]
            return _position_conv1d(h, weight, bias, getattr(self, name))

        return self._net(x, emb, conv)


class TinyViT(nn.Module):
    """Patch embedding Conv2d (kernel = stride = 2) → tokens (output pixels, row-major) +
    positions → LayerNorm → self-attention (residual) → Linear head: logits `[N·T, C]`.

    `functional(params, x)`: copy t of every parameter used at token t only.
    """

    def __init__(self, dim=4, heads=2, tokens=6, classes=3):
        super().__init__()
        self.patch = nn.Conv2d(2, dim, 2, stride=2)
        self.register_buffer("pos", torch.randn(tokens, dim))
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        a = self.ln(h)
        y, _ = self.attn(a, a, a, need_weights=False)
        return self.head(h + y).flatten(0, 1)

    def positions(self, x):
        """T: the patch embedding's output pixels."""
        return (x.shape[2] // 2) * (x.shape[3] // 2)

    def functional(self, params, x):
        """The network with `params[name]` `[T, *shape]` (copy t used at position t only)."""
        n, c, height, width = x.shape
        patches = x.reshape(n, c, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(n, -1, c * 4)  # [N, T, C·2·2], row-major output pixels
        w = params["patch.weight"].flatten(2)
        h = _position_linear(patches, w, params["patch.bias"]) + self.pos
        hat = nn.functional.layer_norm(h, h.shape[-1:], eps=self.ln.eps)
        a = hat * params["ln.weight"] + params["ln.bias"]
        e = self.attn.embed_dim
        w, b = params["attn.in_proj_weight"].split(e, 1), params["attn.in_proj_bias"].split(e, 1)
        q, k, v = (_position_linear(a, wi, bi) for wi, bi in zip(w, b))
        o = _position_attention(q, k, v, self.attn.num_heads, causal=False)
        y = _position_linear(o, params["attn.out_proj.weight"], params["attn.out_proj.bias"])
        return _position_linear(h + y, params["head.weight"], params["head.bias"]).flatten(0, 1)


@dataclass
class Problem:
    name: str
    make_model: Callable[[], nn.Module]
    make_loss: Callable[[str], nn.Module]
    X: Tensor
    Y: Tensor
    Xq: Tensor
    Yq: Tensor
    flatten_targets: bool = False
    #: parameters whose Kronecker factors belong to their transpose (embeddings)
    transposed: set = field(default_factory=set)

    def model(self) -> nn.Module:
        torch.manual_seed(1)
        return self.make_model().double()

    def targets(self, Y: Tensor) -> Tensor:
        return Y.flatten() if self.flatten_targets else Y

    def batches(self, X, Y, size) -> list[tuple[Tensor, Tensor]]:
        return [
            (X[i : i + size], self.targets(Y[i : i + size])) for i in range(0, X.shape[0], size)
        ]

    def train(self, size=4):
        return self.batches(self.X, self.Y, size)

    def query(self, size=2):
        return self.batches(self.Xq, self.Yq, size)

    def normaliser(self, reduction: str) -> float:
        """ν of the training set."""
        if reduction == "sum":
            return 1.0
        return float((self.Y != -100).sum())


def make_problems() -> dict[str, Problem]:
    g = torch.Generator().manual_seed(0)
    n, q = 11, 3

    def x(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def tokens(n, vocab, length=3, classes=None):
        return torch.randint(0, classes or vocab, (n, length), generator=g)

    ty = tokens(n, 4)
    ty[0, 1] = ty[3, 0] = ty[3, 2] = -100
    tty = tokens(n, 3)
    tty[2, 2] = -100
    gy = tokens(n, 7, length=5)
    gy[1, :2] = gy[5, 4] = -100
    return {
        "mlp": Problem(
            "mlp",
            lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
            lambda r: nn.CrossEntropyLoss(reduction=r),
            x(n, 4),
            torch.randint(0, 3, (n,), generator=g),
            x(q, 4),
            torch.randint(0, 3, (q,), generator=g),
        ),
        "cnn": Problem(
            "cnn",
            lambda: nn.Sequential(
                nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)
            ),
            lambda r: nn.CrossEntropyLoss(reduction=r),
            x(n, 1, 5, 5),
            torch.randint(0, 3, (n,), generator=g),
            x(q, 1, 5, 5),
            torch.randint(0, 3, (q,), generator=g),
        ),
        "tokens": Problem(
            "tokens",
            TokenModel,
            lambda r: nn.CrossEntropyLoss(reduction=r, ignore_index=-100),
            tokens(n, 6),
            ty,
            tokens(q, 6),
            tokens(q, 4),
            flatten_targets=True,
            transposed={"emb.weight"},
        ),
        "gpt": Problem(
            "gpt",
            TinyGPT,
            lambda r: nn.CrossEntropyLoss(reduction=r, ignore_index=-100),
            tokens(n, 7, length=5),
            gy,
            tokens(q, 7, length=5),
            tokens(q, 7, length=5),
            flatten_targets=True,
            transposed={"tok.weight", "pos.weight"},
        ),
        "transformer": Problem(
            "transformer",
            TinyTransformer,
            lambda r: nn.CrossEntropyLoss(reduction=r, ignore_index=-100),
            tokens(n, 5),
            tty,
            tokens(q, 5),
            tokens(q, 3),
            flatten_targets=True,
            transposed={"emb.weight", "pos.weight"},
        ),
    }


PROBLEMS = make_problems()


class Reference:
    """Brute-force per-sample gradients and Fishers of `problem` at `model`'s parameters."""

    def __init__(self, problem: Problem, model: nn.Module):
        self.problem = problem
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.theta = torch.cat([p.detach().flatten() for _, p in named])
        self.sum_loss = problem.make_loss("sum")

    def params(self, theta):
        pieces = theta.split(self.numels)
        return {n: t.reshape(s) for n, t, s in zip(self.names, pieces, self.shapes)}

    def output(self, theta, X):
        return functional_call(self.model, self.params(theta), (X,))

    def own_loss(self, theta, X, Y):
        """One example's own loss (sum over its tokens), X and Y with a batch axis of 1."""
        return self.sum_loss(self.output(theta, X), self.problem.targets(Y))

    def grads(self, X, Y) -> Tensor:
        """`[n, P]`: every example's gradient of its own loss."""
        g = grad(self.own_loss)
        return torch.stack([g(self.theta, X[i : i + 1], Y[i : i + 1]) for i in range(len(X))])

    def train_grads(self) -> Tensor:
        return self.grads(self.problem.X, self.problem.Y)

    def query_grads(self) -> Tensor:
        return self.grads(self.problem.Xq, self.problem.Yq)

    def query_rows(self) -> dict[str, Tensor]:
        """The query gradients per parameter, `{name: [Q, *shape]}`."""
        q = self.query_grads()
        pieces = q.split(self.numels, 1)
        return {n: t.reshape(q.shape[0], *s) for n, t, s in zip(self.names, pieces, self.shapes)}

    def empirical_fisher(self) -> Tensor:
        """`(1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ`."""
        G = self.train_grads()
        return G.T @ G / G.shape[0]

    def type2_fisher(self) -> Tensor:
        """`(1/N) Σ_n J_nᵀ H_n J_n` (the expected Fisher of the examples' own losses)."""
        X, Y = self.problem.X, self.problem.Y
        out = torch.zeros(self.theta.numel(), self.theta.numel(), dtype=torch.float64)
        for i in range(len(X)):
            x, y = X[i : i + 1], self.problem.targets(Y[i : i + 1])
            f = self.output(self.theta, x)
            J = jacrev(lambda t, x=x: self.output(t, x))(self.theta).reshape(f.numel(), -1)
            H = hessian(lambda o, y=y: self.sum_loss(o, y))(f).reshape(f.numel(), f.numel())
            out += J.T @ H @ J
        return out / len(X)

    def terms(self, X, Y) -> Tensor:
        """`[n, T, P]`: the term of each position of each example's gradient (`TinyGPT`).

        T: the model's `positions(X)` if it has one, else `X.shape[1]`.
        """
        positions = getattr(self.model, "positions", None)
        T = positions(X) if positions is not None else X.shape[1]
        expanded = {n: t.expand(T, *t.shape).clone() for n, t in self.params(self.theta).items()}

        def loss(params, x, y):
            return self.sum_loss(self.model.functional(params, x), self.problem.targets(y))

        g = grad(loss)
        out = []
        for i in range(len(X)):
            gi = g(expanded, X[i : i + 1], Y[i : i + 1])
            out.append(torch.cat([gi[n].reshape(T, -1) for n in self.names], dim=1))
        return torch.stack(out)

    def blocks(self):
        """`(start, stop)` of every parameter in the flattening."""
        out, start = [], 0
        for n in self.numels:
            out.append((start, start + n))
            start += n
        return out


def block_diagonal(matrix: Tensor, spans) -> Tensor:
    out = torch.zeros_like(matrix)
    for a, b in spans:
        out[a:b, a:b] = matrix[a:b, a:b]
    return out


def kronecker_basis(factors, shape, transposed: bool) -> Tensor:
    """The eigenbasis of a KFAC block as a dense matrix in the parameter's flattening."""
    vectors = [torch.linalg.eigh((f + f.T) / 2)[1] for f in factors]
    q = torch.kron(vectors[0], vectors[1]) if len(vectors) == 2 else vectors[0]
    if not transposed:
        return q
    numel = q.shape[0]
    idx = torch.arange(numel).reshape(shape).transpose(0, 1).flatten()
    placed = torch.empty_like(q)
    placed[idx] = q  # row idx[k] of the parameter is row k of the factors' flattening
    return placed


def ekfac_dense(factors_of: dict, ref: Reference, fisher: Tensor, transposed: set) -> Tensor:
    """EK-FAC of `fisher`: per block `Q diag(diag(Qᵀ F Q)) Qᵀ`, Q from the KFAC factors."""
    out = torch.zeros_like(fisher)
    for name, shape, (a, b) in zip(ref.names, ref.shapes, ref.blocks()):
        q = kronecker_basis(factors_of[name], shape, name in transposed)
        block = fisher[a:b, a:b]
        values = (q.T @ block @ q).diagonal()
        out[a:b, a:b] = (q * values) @ q.T
    return out


def heuristic_damping(matrix: Tensor, spans) -> Tensor:
    """`0.1 ×` the mean eigenvalue (trace / size) of each block, per entry: `[P]`."""
    out = torch.empty(matrix.shape[0], dtype=matrix.dtype)
    for a, b in spans:
        out[a:b] = 0.1 * matrix[a:b, a:b].trace() / (b - a)
    return out
