"""Problems with nn.MultiheadAttention, transformer layers, a tiny nn.Transformer and GPT blocks.

Every model takes a batch-first input `[N, T, F]` (or token indices `[N, T]`) and returns
batch-first outputs: logits `[N, C, T]` for the cross-entropy, `[N, T, C]` for the MSE. Models
whose attention runs with `batch_first=False` transpose around it. Masks are buffers (they
follow the model's dtype and device); parameters are randomised so that attention is far from
uniform.

Tags: "first", "second" everywhere; "kron" where every parameter has Kronecker factors
(embeddings have none). No "hessian": the exact-Hessian extensions refuse attention (softmax
and products of activations are nonlinear functional operations).

Known engine limitations are strict xfails (`options["xfail"]`, applied by tests/conftest.py),
each with its reason; tests/rules/test_attention_rules.py checks what does work in them:
sequence-first transformer layers (their Linear and LayerNorm modules see `[T, N, F]`), GGNMP
through `need_weights=False` attention (torch.func re-runs the fused SDPA kernel), and the GPT
block whose position embedding runs on `torch.arange(T)` (its call has T rows, not N).
"""

import math

import torch
from torch import nn

from problems import Problem, randn

TAGS = {"first", "second", "kron"}
SEQ = {"bias_block_is_G": False}


def randomise(module: nn.Module, std: float = 0.7) -> nn.Module:
    """Normal parameters (zero-initialised biases of MultiheadAttention included)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module


def causal_mask(t: int, kind: str = "float") -> torch.Tensor:
    """`[t, t]` mask hiding future positions: -inf above the diagonal, or True there."""
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    return mask if kind == "bool" else torch.zeros(t, t).masked_fill(mask, float("-inf"))


class Attention(nn.Module):
    """in Linear -> MultiheadAttention(query, key, value, **options) -> head.

    `cross`: key and value come from another projection of the input (positions `keys`, the
    first ones of the reversed sequence), so query and key differ; with kdim/vdim they have
    their own widths. `use_weights`: the attention weights (per head or averaged) are
    concatenated to the output before the head, so their gradient path is exercised.
    `residual_inplace`: the input projection is added in place to the attention output.
    """

    def __init__(
        self,
        features=5,
        d=6,
        heads=2,
        classes=3,
        ce=True,
        batch_first=True,
        cross=False,
        keys=None,
        use_weights=False,
        masks=None,
        call=None,
        residual_inplace=False,
        **mha,
    ):
        super().__init__()
        self.inp = nn.Linear(features, d)
        self.attn = randomise(nn.MultiheadAttention(d, heads, batch_first=batch_first, **mha))
        self.batch_first, self.cross, self.keys = batch_first, cross, keys
        if cross:
            separate = mha.get("kdim") or mha.get("vdim")
            # a bias feeding only the keys shifts every score of a row alike: its gradient
            # cancels to rounding noise (which the engine's coverage check would flag)
            self.key_in = nn.Linear(features, mha.get("kdim") or d, bias=not separate)
            self.value_in = nn.Linear(features, mha.get("vdim") or d) if separate else self.key_in
        self.call = dict(call or {})
        for name, mask in (masks or {}).items():
            self.register_buffer(name, mask)
        self.use_weights = use_weights
        self.residual_inplace = residual_inplace
        extra = 0
        if use_weights:
            s = (
                (keys or 0)
                + int(mha.get("add_bias_kv", False))
                + int(mha.get("add_zero_attn", False))
            )
            self.weight_width = s
            extra = s * (1 if self.call.get("average_attn_weights", True) else heads)
        self.head = nn.Linear(d + extra, classes)
        self.ce = ce

    def forward(self, x):
        q = residual = self.inp(x)
        if self.cross:
            src = x.flip(1)[:, : self.keys]
            k = self.key_in(src)
            v = self.value_in(src) if self.value_in is not self.key_in else k
        else:
            k = v = q
        if not self.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            if not self.cross:
                k = v = q
        kwargs = dict(self.call)
        for name, _ in self.named_buffers():
            kwargs[name] = getattr(self, name)
        y, w = self.attn(q, k, v, **kwargs)
        if not self.batch_first:
            y = y.transpose(0, 1)
        if self.residual_inplace:
            y += residual  # in place on the attention's output (a view)
        if self.use_weights:
            if w.dim() == 4:  # [N, H, L, S] -> [N, L, H·S]
                w = w.permute(0, 2, 1, 3).flatten(2)
            y = torch.cat([y, w], -1)
        out = self.head(torch.tanh(y))
        return out.transpose(1, 2) if self.ce else out


def _seq_ce_target(out):
    return torch.randint(0, out.shape[1], (out.shape[0], out.shape[2]))


def attention_problem(pid, loss="ce-mean", n=4, t=3, features=5, tags=TAGS, xfail=None, **kwargs):
    """A problem around `Attention(**kwargs)` with the given loss."""
    ce = loss.startswith("ce")
    make_loss = {
        "ce-mean": lambda: nn.CrossEntropyLoss(),
        "ce-sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
        "mse-mean": lambda: nn.MSELoss(),
        "mse-sum": lambda: nn.MSELoss(reduction="sum"),
    }[loss]
    if kwargs.get("use_weights") and kwargs.get("keys") is None:
        kwargs["keys"] = t
    eval_mode = kwargs.pop("eval_mode", False)

    def make():
        model = Attention(features=features, ce=ce, **kwargs)
        return model.eval() if eval_mode else model

    return Problem(
        pid,
        make,
        randn(n, t, features),
        make_loss,
        make_target=_seq_ce_target if ce else None,
        tags=tags,
        options={**SEQ, "xfail": xfail},
    )


def _bool_mask_3d(n, heads, t, s, seed=3):
    """`[N·H, t, s]` boolean mask with random hidden keys; key 0 stays visible in every row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n * heads, t, s, generator=g, device=g.device) > 0.6
    mask = mask.to(torch.get_default_device())
    mask[..., 0] = False
    return mask


def _padding(n, s, seed=4, kind="bool"):
    """`[N, s]` key padding mask (True or -inf: hidden); the first key stays visible."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, s, generator=g, device=g.device) > 0.6
    mask = mask.to(torch.get_default_device())
    mask[:, 0] = False
    return mask if kind == "bool" else torch.zeros(n, s).masked_fill(mask, float("-inf"))


# --- transformer layers ------------------------------------------------------------------------


class EncoderModel(nn.Module):
    """in Linear -> TransformerEncoderLayer (causal mask, padding) -> head."""

    def __init__(
        self, d=8, heads=2, classes=3, batch_first=True, norm_first=False, ce=True, dropout=0.0
    ):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.layer = randomise(
            nn.TransformerEncoderLayer(
                d, heads, 12, dropout=dropout, batch_first=batch_first, norm_first=norm_first
            ),
            0.5,
        )
        self.batch_first, self.ce = batch_first, ce
        self.head = nn.Linear(d, classes)
        self.register_buffer("mask", causal_mask(3, "bool"))
        self.register_buffer("padding", torch.tensor([[False, False, True]] + [[False] * 3] * 3))

    def forward(self, x):
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.layer(h, src_mask=self.mask, src_key_padding_mask=self.padding)
        if not self.batch_first:
            h = h.transpose(0, 1)
        out = self.head(h)
        return out.transpose(1, 2) if self.ce else out


class DecoderModel(nn.Module):
    """TransformerDecoderLayer on tgt = Linear(x) with memory = Linear(reversed x[:, :2])."""

    def __init__(
        self, d=8, heads=2, classes=3, batch_first=True, norm_first=False, ce=True, dropout=0.0
    ):
        super().__init__()
        self.tgt = nn.Linear(5, d)
        self.mem = nn.Linear(5, d)
        self.layer = randomise(
            nn.TransformerDecoderLayer(
                d, heads, 12, dropout=dropout, batch_first=batch_first, norm_first=norm_first
            ),
            0.5,
        )
        self.batch_first, self.ce = batch_first, ce
        self.head = nn.Linear(d, classes)
        self.register_buffer("mask", causal_mask(3))

    def forward(self, x):
        tgt, mem = self.tgt(x), self.mem(x.flip(1)[:, :2])
        if not self.batch_first:
            tgt, mem = tgt.transpose(0, 1), mem.transpose(0, 1)
        h = self.layer(tgt, mem, tgt_mask=self.mask, tgt_is_causal=True)
        if not self.batch_first:
            h = h.transpose(0, 1)
        out = self.head(h)
        return out.transpose(1, 2) if self.ce else out


class TinyTransformer(nn.Module):
    """A one-layer encoder-decoder `nn.Transformer` (d_model 4) on src = tgt = Linear(x)."""

    def __init__(self, d=4, classes=3, ce=True, dropout=0.0):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.model = randomise(
            nn.Transformer(d, 2, 1, 1, dim_feedforward=6, dropout=dropout, batch_first=True),
            0.5,
        )
        self.head = nn.Linear(d, classes)
        self.register_buffer("mask", causal_mask(3))

    def forward(self, x):
        h = self.inp(x)
        out = self.model(h, h[:, :3], tgt_mask=self.mask, tgt_is_causal=True)
        return self.head(out).transpose(1, 2)




def _layer_problem(pid, cls, loss, **kwargs):
    ce = loss.startswith("ce")
    make_loss = {
        "ce-mean": lambda: nn.CrossEntropyLoss(),
        "ce-sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
        "mse-mean": lambda: nn.MSELoss(),
        "mse-sum": lambda: nn.MSELoss(reduction="sum"),
    }[loss]
    xfail = None
    return Problem(
        pid,
        lambda: cls(ce=ce, **kwargs),
        randn(4, 3, 5),
        make_loss,
        make_target=_seq_ce_target if ce else None,
        tags=TAGS,
        options={**SEQ, "xfail": xfail},
    )


# --- GPT-like blocks -----------------------------------------------------------------------------


def sinusoidal(t: int, d: int) -> torch.Tensor:
    """`[t, d]` fixed sinusoidal position encodings."""
    pos = torch.arange(t, dtype=torch.float64).unsqueeze(1)
    freq = torch.exp(-math.log(100.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
    enc = torch.zeros(t, d, dtype=torch.float64)
    enc[:, 0::2] = torch.sin(pos * freq)
    enc[:, 1::2] = torch.cos(pos * freq)
    return enc


class GPTBlock(nn.Module):
    """Token + position embedding, pre-norm causal self-attention and MLP, final norm, head.

    `positions`: "learned" (nn.Embedding(T, D) on torch.arange(T), output `[T, D]`),
    "learned-batched" (the same embedding on arange expanded to `[N, T]`) or "sinusoidal" (a
    buffer). `masking`: "is_causal" (attn_mask + is_causal=True, need_weights=False: the SDPA
    causal path) or "mask" (a boolean causal mask, weights computed and unused).
    """

    def __init__(self, vocab=7, t=5, d=6, heads=2, positions="learned", masking="is_causal"):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.positions = positions
        if positions == "sinusoidal":
            self.register_buffer("pos", sinusoidal(t, d))
        else:
            self.pos = nn.Embedding(t, d)
        self.ln1 = randomise(nn.LayerNorm(d), 0.5)
        self.attn = randomise(nn.MultiheadAttention(d, heads, batch_first=True), 0.5)
        self.ln2 = randomise(nn.LayerNorm(d), 0.5)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.masking = masking
        self.register_buffer("mask", causal_mask(t, "float" if masking == "is_causal" else "bool"))

    def forward(self, idx):
        n, t = idx.shape
        positions = torch.arange(t, device=idx.device)
        if self.positions == "sinusoidal":
            pos = self.pos[:t]
        elif self.positions == "learned":
            pos = self.pos(positions)
        else:
            pos = self.pos(positions.expand(n, t))
        h = self.tok(idx) + pos
        a = self.ln1(h)
        mask = self.mask[:t, :t]
        if self.masking == "is_causal":
            y = self.attn(a, a, a, attn_mask=mask, is_causal=True, need_weights=False)[0]
        else:
            y = self.attn(a, a, a, attn_mask=mask)[0]
        h = h + y
        h = h + self.mlp(self.ln2(h))
        return self.head(self.ln_f(h)).transpose(1, 2)  # [N, V, T]


def _tokens(vocab, n, t):
    return lambda: torch.randint(0, vocab, (n, t))


POSITION_XFAIL = (
    "engine: nn.Embedding(T, D) applied to torch.arange(T) has T rows, not the N samples of the "
    "batch; its per-sample quantities are computed as if each position were a sample"
)


def _gpt_problem(pid, positions, masking, loss="ce-mean", xfail=None):
    make_loss = {
        "ce-mean": lambda: nn.CrossEntropyLoss(),
        "ce-sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
    }[loss]
    options = dict(SEQ)
    if xfail:
        options["xfail"] = xfail
    return Problem(
        pid,
        lambda: GPTBlock(positions=positions, masking=masking),
        _tokens(7, 4, 5),
        make_loss,
        make_target=_seq_ce_target,
        tags={"first", "second"},
        options=options,
    )


PROBLEMS = [
    # --- MultiheadAttention options ------------------------------------------------------------
    attention_problem("mha-self-ce-mean", "ce-mean"),
    attention_problem("mha-self-seq-first-mse-sum", "mse-sum", batch_first=False),
    attention_problem("mha-residual-inplace-ce-sum", "ce-sum", residual_inplace=True),
    attention_problem(
        "mha-residual-inplace-seq-first-mse-mean",
        "mse-mean",
        batch_first=False,
        residual_inplace=True,
    ),
    attention_problem(
        "mha-bias-kv-zero-attn-ce-sum", "ce-sum", heads=3, add_bias_kv=True, add_zero_attn=True
    ),
    attention_problem(
        "mha-kdim-vdim-cross-mse-mean", "mse-mean", cross=True, keys=2, kdim=3, vdim=4
    ),
    attention_problem(
        "mha-kdim-seq-first-ce-mean", "ce-mean", cross=True, keys=3, kdim=4, batch_first=False
    ),
    attention_problem("mha-cross-packed-ce-sum", "ce-sum", cross=True, keys=2),
    attention_problem(
        "mha-weights-per-head-mse-sum",
        "mse-sum",
        use_weights=True,
        add_bias_kv=True,
        call={"average_attn_weights": False},
    ),
    attention_problem(
        "mha-weights-averaged-seq-first-ce-mean",
        "ce-mean",
        use_weights=True,
        batch_first=False,
        add_zero_attn=True,
    ),
    attention_problem(
        "mha-float-mask-padding-ce-mean",
        "ce-mean",
        masks={"attn_mask": torch.randn(3, 3), "key_padding_mask": _padding(4, 3, kind="float")},
        call={"need_weights": False},
    ),
    attention_problem(
        "mha-bool-mask-3d-mse-mean",
        "mse-mean",
        masks={"attn_mask": _bool_mask_3d(4, 2, 3, 3)},
        add_bias_kv=True,
    ),
    attention_problem(
        "mha-padding-weights-seq-first-mse-sum",
        "mse-sum",
        batch_first=False,
        use_weights=True,
        masks={"key_padding_mask": _padding(4, 3, seed=5)},
        call={"average_attn_weights": False},
    ),
    attention_problem(
        "mha-causal-sdpa-ce-sum",
        "ce-sum",
        masks={"attn_mask": causal_mask(3)},
        call={"is_causal": True, "need_weights": False},
        add_bias_kv=True,
        add_zero_attn=True,
    ),
    attention_problem(
        "mha-causal-with-weights-ce-mean",
        "ce-mean",
        masks={"attn_mask": causal_mask(3, "bool")},
        call={"is_causal": True},
    ),
    attention_problem("mha-no-bias-mse-mean", "mse-mean", bias=False),
    attention_problem("mha-dropout-eval-ce-mean", "ce-mean", dropout=0.4, eval_mode=True),
    # --- transformer layers ----------------------------------------------------------------------
    _layer_problem("encoder-layer-post-norm-ce-mean", EncoderModel, "ce-mean"),
    _layer_problem(
        "encoder-layer-pre-norm-seq-first-mse-sum",
        EncoderModel,
        "mse-sum",
        batch_first=False,
        norm_first=True,
    ),
    _layer_problem("decoder-layer-pre-norm-ce-sum", DecoderModel, "ce-sum", norm_first=True),
    _layer_problem(
        "decoder-layer-post-norm-seq-first-mse-mean", DecoderModel, "mse-mean", batch_first=False
    ),
    _layer_problem("tiny-transformer-ce-mean", TinyTransformer, "ce-mean"),
    # --- GPT-like blocks -------------------------------------------------------------------------
    _gpt_problem(
        "gpt-sinusoidal-is-causal-ce-mean",
        "sinusoidal",
        "is_causal",
    ),
    _gpt_problem("gpt-batched-positions-mask-ce-sum", "learned-batched", "mask", "ce-sum"),
    _gpt_problem("gpt-learned-positions-ce-mean", "learned", "is_causal"),
]
