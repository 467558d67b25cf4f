"""`nn.MultiheadAttention`: every parameter, from one recomputation of the attention.

Per sample (batch-first layout; the module's `batch_first=False` only moves the batch axis), with
query, key and value inputs X_q `[L, E_q]`, X_k, X_v `[S₀, E_k/E_v]`, H heads of width d = E/H:

    q = X_q W_qᵀ + b_q,   k = X_k W_kᵀ + b_k,   v = X_v W_vᵀ + b_v
    k, v ← [k; bias_k], [v; bias_v]                      (add_bias_kv: one more key row)
    k_h, v_h ← [k_h; 0], [v_h; 0]                        (add_zero_attn, per head)
    P_h = softmax(q_h k_hᵀ / √d + M),   o_h = (P_h ⊙ D) v_h,   y = o W_oᵀ + b_o

with M the additive mask (attn_mask, key_padding_mask, or the causal mask of `is_causal`) and D
the dropout multipliers (1 without dropout). The second output is P ⊙ D per head, or its mean
over heads (`average_attn_weights`). W_q, W_k, W_v are the three row blocks of `in_proj_weight`
(or `q_proj_weight`, `k_proj_weight`, `v_proj_weight` when kdim/vdim differ from embed_dim),
W_o, b_o are `out_proj.weight/bias`: the module calls `F.linear` on them without running its
`out_proj` submodule, so this rule owns them (`OWNS_CHILD_PARAMETERS`, dotted names).

The rule recomputes q, k, v, P and o from the recorded inputs once per call (the same options as
`F.multi_head_attention_forward`, including the SDPA path's zero output for fully masked rows
with `need_weights=False`), and backpropagates the output gradients δ_y (and δ_P of the weights
output) by hand:

    δ_o = δ_y W_o,   δ(P⊙D)_h = δo_h v_hᵀ + δ_P,h,   δv_h = (P_h ⊙ D)ᵀ δo_h,
    δs_h = P_h ⊙ (δP_h − rowsum(δP_h ⊙ P_h)) with δP_h = δ(P⊙D)_h ⊙ D,
    δq_h = δs_h k_h / √d,   δk_h = δs_hᵀ q_h / √d.

Every weight gradient is then a Linear-like contraction over positions, δᵀ X for the pairs
(X_q, δq), (X_k, δk), (X_v, δv), (o, δ_y); the biases sum δ over positions, bias_k/bias_v take
the δk/δv row of their key. The reductions use the fused forms of `nn.Linear` on sequences: the
Gram ("ghost") form Σ_{t,s} (δ_t·δ_s)(x_t·x_s) for squared norms and Gram matrices when it is
cheaper than materialising `[N, out, in]`. A leading axis of V factor columns broadcasts through
the same backward, so second-order quantities (`[V, N, *param]` square roots, diagonals in
chunks of columns) come from one pass per chunk.

Kronecker factors: `out_proj` is a Linear on o (`[G, A]`, positions act as samples in A); in
self-attention (query, key and value the same tensor) `in_proj_weight` is one Linear `[3E, E]`
on x, and separate `q/k/v_proj_weight` are each a Linear on their input. Where no Kronecker
structure exists (the packed `in_proj_weight` and `in_proj_bias` of cross-attention, `bias_k`,
`bias_v`, `in_proj_bias` with separate weights), the factor list holds one dense matrix, the
exact block Σ_{v,n} (Jᵀf)(Jᵀf)ᵀ.

Dropout in training mode: D is the mask the forward drew. The extended module's forward
pre-hook keeps the state of the default generator of the input's device from just before the
call (`Record.rng`; reading it draws nothing). Nothing else in the module's forward draws random
numbers before its one dropout call, so repeating that call (`torch.dropout` on ones of the
shape and dtype the forward dropped: `[N·H, L, S]` with the weights, `[N, H, L, S]` in SDPA's
math kernel) from that state, with the generator restored afterwards, draws the same mask bit
for bit. Every recovered mask is checked: y recomputed with it must match the recorded output,
else the call is refused (a fused kernel that draws its own masks, `torch.compile`), never
computed with another mask. Without a saved state, the mask is read off the per-head weights
output (`need_weights=True, average_attn_weights=False`) where there is one. All quantities are
those of the network with the drawn masks held fixed; the curvature matrix products re-run the
call through `module_for_products`, which holds them fixed too.
"""

from __future__ import annotations

import math
import struct
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack.recording import (
    OWNS_CHILD_PARAMETERS,
    RANDOM_CALLS,
    GeneratorState,
    Record,
    describe,
    tensors_in,
)
from backpack.rules.base import GradOutputs, ModuleRule, Names, gram, register_rule

OWNS_CHILD_PARAMETERS.add(nn.MultiheadAttention)


def _draws_dropout(module: nn.Module) -> bool:
    """Whether a call applies dropout to the attention weights (training mode, p > 0)."""
    return module.training and module.dropout > 0


RANDOM_CALLS[nn.MultiheadAttention] = _draws_dropout

#: positional parameters of `MultiheadAttention.forward` after (query, key, value), with defaults
_OPTIONS = (
    ("key_padding_mask", None),
    ("need_weights", True),
    ("attn_mask", None),
    ("average_attn_weights", True),
    ("is_causal", False),
)
#: keys of the per-record caches in `Record.extra`
_FORWARD = "mha_forward"
_GRADS = "mha_grads"
_MASKS = "mha_dropout"
#: largest dense Kronecker factor side (numel of the parameter) formed for one parameter
MAX_DENSE_NUMEL = 8192
#: budget (elements) of the largest intermediate per chunk of factor columns
_CHUNK_ELEMENTS = 2**24

_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight")


def _bind(record: Record) -> dict[str, Any]:
    """The recorded call's arguments by name (positional or keyword), with defaults."""
    args, kwargs = record.args, record.kwargs
    names = ("query", "key", "value") + tuple(k for k, _ in _OPTIONS)
    bound: dict[str, Any] = dict(_OPTIONS)
    for name, value in zip(names, args):
        bound[name] = value
    for name, value in kwargs.items():
        if name not in names:
            raise NotImplementedError(
                f"MultiheadAttention was called with an unknown argument {name!r}."
            )
        bound[name] = value
    return bound


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Additive float mask (boolean masks: -inf where True), as the module canonicalises it."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf")
        )
    return mask.to(dtype)


@dataclass
class _Call:
    """The recorded call in batch-first layout: inputs `[N, T, E_*]` and the options."""

    module: nn.Module
    xq: Tensor
    xk: Tensor
    xv: Tensor
    #: query, key and value are the same tensor (in_proj is then one Linear on x)
    self_attention: bool
    unbatched: bool
    need_weights: bool
    average: bool
    #: additive mask broadcastable to `[N, H, L, S]` (None: no mask)
    mask: Tensor | None
    #: softmax with zeros for fully masked rows (the SDPA path, `need_weights=False`)
    safe: bool
    #: dropout multipliers `[N, H, L, S]` the forward drew (0 or 1/(1-p)), or None
    dropout: Tensor | None


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Whether two recorded inputs hold the same values (aliases of one tensor, or equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b))


def _training_dropout(record: Record) -> bool:
    return record.training and record.module.dropout > 0


def _refuse_dropout(record: Record, what: str, advice: str = "") -> NoReturn:
    raise NotImplementedError(
        f"{describe(record.module)} applied dropout={record.module.dropout} to its attention "
        f"weights in training mode, and {what}. {advice}Call model.eval() or use dropout=0 "
        "to compute backpack quantities of this layer."
    )


class _Forward:
    """Recomputed intermediates of one call (batch-first; heads `[N, H, T, d]`, contiguous)."""

    def __init__(
        self, call: _Call, index: Tensor | None = None, params: nn.Module | None = None
    ) -> None:
        """Recompute the call (the samples `index` only, if given).

        `params`: read the parameters from this module (same names, not detached) instead of
        the detached parameters of the call's module (the matrix products' `_FixedMasks`).
        """
        module = call.module
        xq, xk, xv = call.xq, call.xk, call.xv
        mask, drop = call.mask, call.dropout
        if index is not None:
            picked: dict[int, Tensor] = {}
            xq, xk, xv = (picked.setdefault(id(t), t[index]) for t in (xq, xk, xv))
            if mask is not None and mask.shape[0] != 1:
                mask = mask[index]
            if drop is not None:
                drop = drop[index]
        self.xq, self.xk, self.xv = xq, xk, xv
        self.self_attention = call.self_attention
        self.average = call.average
        dtype = xq.dtype
        e, h = module.embed_dim, module.num_heads
        d = e // h
        self.heads, self.head_dim, self.scale = h, d, 1.0 / math.sqrt(d)
        n, length, s0 = xq.shape[0], xq.shape[1], xk.shape[1]
        self.keys = s0
        self.bias_kv = module.bias_k is not None
        self.zero_attn = bool(module.add_zero_attn)
        source = module if params is None else params

        def param(name: str) -> Tensor | None:
            t = getattr(source, name)
            if t is None:
                return None
            return (t.detach() if params is None else t).to(dtype)

        b = param("in_proj_bias")
        if call.self_attention and module.in_proj_weight is not None and not self.bias_kv:
            # one GEMM and one copy into the head-major layout of q, k and v together
            qkv = F.linear(xq, param("in_proj_weight"), b)
            qkv = qkv.reshape(n, length, 3, h, d).permute(2, 0, 3, 1, 4).contiguous()
            qh, kh, vh = qkv.unbind(0)
        else:
            w_q, w_k, w_v = _projection_weights(module, param)
            b_q, b_k, b_v = (None, None, None) if b is None else b.chunk(3)
            q, k, v = F.linear(xq, w_q, b_q), F.linear(xk, w_k, b_k), F.linear(xv, w_v, b_v)
            if self.bias_kv:
                k = torch.cat([k, param("bias_k").expand(n, 1, e)], 1)
                v = torch.cat([v, param("bias_v").expand(n, 1, e)], 1)
            qh = q.reshape(n, length, h, d).transpose(1, 2).contiguous()
            kh = k.reshape(n, k.shape[1], h, d).transpose(1, 2).contiguous()
            vh = v.reshape(n, v.shape[1], h, d).transpose(1, 2).contiguous()
        if self.zero_attn:
            kh = F.pad(kh, (0, 0, 0, 1))
            vh = F.pad(vh, (0, 0, 0, 1))
        self.qh, self.kh, self.vh = qh, kh, vh
        scores = torch.matmul(qh, kh.transpose(-1, -2)).mul_(self.scale)
        if mask is not None:
            scores = scores.add_(mask)
        p = torch.softmax(scores, -1)
        if call.safe and mask is not None:
            rows = torch.isneginf(scores).all(-1, keepdim=True)
            # out of place where autograd differentiates it (softmax saves its output)
            p = p.masked_fill_(rows, 0.0) if params is None else p.masked_fill(rows, 0.0)
        del scores
        self.p = p
        self.dropout = drop
        self.pd = p if drop is None else p * drop
        self.o = torch.matmul(self.pd, vh).transpose(1, 2).reshape(n, length, e)
        out_proj = module.out_proj if params is None else params.out_proj
        w_out, b_out = out_proj.weight, out_proj.bias
        if params is None:
            w_out, b_out = w_out.detach(), None if b_out is None else b_out.detach()
        self.w_out = w_out.to(dtype)
        self.b_out = None if b_out is None else b_out.to(dtype)

    def output(self) -> Tensor:
        """The attention output y = o W_oᵀ + b_o `[N, L, E]`."""
        return F.linear(self.o, self.w_out, self.b_out)

    def backward(self, gy: Tensor | None, gw: Tensor | None) -> dict[str, Tensor]:
        """δq `[*, N, L, E]`, δk, δv `[*, N, S₀, E]` and δbias_k/v `[*, N, E]` (if any).

        `gy` `[*, N, L, E]` and `gw` (`[*, N, L, S]` averaged, else `[*, N, H, L, S]`) may carry
        leading column axes `*`; either may be None (no gradient at that output). With as many
        keys as queries, δq, δk, δv are views into one `[*, N, L, 3E]` tensor, "qkv".
        """
        h, d = self.heads, self.head_dim
        n, length, e = self.qh.shape[0], self.qh.shape[2], h * d
        ref = gy if gy is not None else gw
        average = self.average
        lead = ref.shape[: ref.dim() - (3 if gy is not None or average else 4)]
        gpd = None
        gvh = None
        if gy is not None:
            go = torch.matmul(gy, self.w_out)
            goh = go.reshape(*lead, n, length, h, d).transpose(-3, -2).contiguous()
            del go
            gpd = torch.matmul(goh, self.vh.transpose(-1, -2))
            gvh = torch.matmul(self.pd.transpose(-1, -2), goh)
            del goh
        if gw is not None:
            extra = gw.unsqueeze(-3) / h if average else gw
            gpd = extra.expand(*lead, *self.p.shape) if gpd is None else gpd.add_(extra)
        gp = gpd if self.dropout is None else gpd * self.dropout
        # δs = P ⊙ (δP − rowsum(δP ⊙ P)), scaled by 1/√d for both products below
        gs = (gp - (gp * self.p).sum(-1, keepdim=True)).mul_(self.p).mul_(self.scale)
        del gp, gpd
        gqh = torch.matmul(gs, self.kh)
        gkh = torch.matmul(gs.transpose(-1, -2), self.qh)
        del gs
        s0 = self.keys
        result = {}
        if self.bias_kv:
            result["bias_k"] = gkh[..., s0, :].reshape(*lead, n, e)
            result["bias_v"] = (
                gvh[..., s0, :].reshape(*lead, n, e)
                if gvh is not None
                else gkh.new_zeros(*lead, n, e)
            )
        if s0 == length:
            qkv = torch.empty(*lead, n, length, 3, h, d, dtype=ref.dtype, device=ref.device)
            qkv[..., 0, :, :].copy_(gqh.transpose(-3, -2))
            qkv[..., 1, :, :].copy_(gkh[..., :s0, :].transpose(-3, -2))
            if gvh is None:
                qkv[..., 2, :, :].zero_()
            else:
                qkv[..., 2, :, :].copy_(gvh[..., :s0, :].transpose(-3, -2))
            qkv = qkv.reshape(*lead, n, length, 3 * e)
            result["qkv"] = qkv
            result["q"], result["k"], result["v"] = qkv.split(e, -1)
            return result

        def merge(t: Tensor) -> Tensor:
            return t[..., :s0, :].transpose(-3, -2).reshape(*lead, n, s0, e)

        result["q"] = gqh.transpose(-3, -2).reshape(*lead, n, length, e)
        result["k"] = merge(gkh)
        result["v"] = merge(gvh) if gvh is not None else result["k"].new_zeros(result["k"].shape)
        return result


def _projection_weights(module: nn.Module, param: Any) -> tuple[Tensor, Tensor, Tensor]:
    if module.in_proj_weight is not None:
        return param("in_proj_weight").chunk(3)
    return tuple(param(f"{c}_proj_weight") for c in "qkv")  # type: ignore[return-value]


# --- Linear-like contractions over positions ------------------------------------------------
# A weight's per-sample gradient is a stack (along its rows) of blocks δ_iᵀ X_i, with X_i
# `[N, T_i, in]` and δ_i `[*, N, T_i, out_i]`.

Blocks = list[tuple[Tensor, Tensor]]


def _ghost_is_cheaper(x: Tensor, g: Tensor) -> bool:
    t = x.shape[-2]
    return t * t * (x.shape[-1] + g.shape[-1]) < t * x.shape[-1] * g.shape[-1]


def _block_psg(x: Tensor, g: Tensor) -> Tensor:
    return torch.matmul(g.transpose(-1, -2), x)


def _blocks_psg(blocks: Blocks) -> Tensor:
    parts = [_block_psg(x, g) for x, g in blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts, -2)


def _blocks_l2(blocks: Blocks, grams: dict[int, Tensor]) -> Tensor:
    """‖Σ_t δ_t x_tᵀ‖² per sample; Gram form Σ_{t,s} (δ_t·δ_s)(x_t·x_s) where cheaper."""
    total = None
    for x, g in blocks:
        if x.shape[1] == 1:
            value = g.square().sum((1, 2)) * x.square().sum((1, 2))
        elif _ghost_is_cheaper(x, g):
            gram_x = grams.get(id(x))
            if gram_x is None:
                gram_x = grams[id(x)] = torch.bmm(x, x.transpose(1, 2))
            value = (torch.bmm(g, g.transpose(1, 2)) * gram_x).sum((1, 2))
        else:
            value = _block_psg(x, g).square().sum((1, 2))
        total = value if total is None else total + value
    return total


def _blocks_dot(blocks: Blocks) -> Tensor:
    """`[N, N]` Gram matrix of the per-sample gradients."""
    total = None
    for x, g in blocks:
        n, t = x.shape[0], x.shape[1]
        if t > 1 and n * t * t * (x.shape[2] + g.shape[2]) < (t + n) * x.shape[2] * g.shape[2]:
            gg = torch.einsum("nto,mso->nmts", g, g)
            xx = torch.einsum("nti,msi->nmts", x, x)
            value = (gg * xx).sum((2, 3))
        else:
            flat = _block_psg(x, g).flatten(1)
            value = flat @ flat.T
        total = value if total is None else total + value
    return total


def _blocks_sum(blocks: Blocks) -> Tensor:
    parts = [gram(g, x) for x, g in blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


def _blocks_entries(blocks: Blocks, index: Tensor) -> Tensor:
    """Entries (flat `index`) of Σ_n δᵀ X for the stacked blocks."""
    cols = blocks[0][0].shape[-1]
    rows, cols_at = index // cols, index % cols
    result = torch.zeros(index.shape, dtype=blocks[0][1].dtype, device=index.device)
    start = 0
    for x, g in blocks:
        stop = start + g.shape[-1]
        inside = (rows >= start) & (rows < stop)
        if bool(inside.any()):
            r, c = rows[inside] - start, cols_at[inside]
            result[inside] = (g[..., r] * x[..., c]).sum((0, 1))
        start = stop
    return result


# --- dropout masks ---------------------------------------------------------------------------


def _replayed_dropout(
    rng: GeneratorState, shape: tuple[int, ...], dtype: torch.dtype, p: float
) -> Tensor:
    """The multipliers `torch.dropout` draws for `shape` from the saved generator state."""
    ones = torch.ones(shape, dtype=dtype, device=rng.device)
    return rng.replay(lambda: torch.dropout(ones, p, True))


def _mem_efficient_masks(rng: GeneratorState, shape: tuple[int, ...], p: float) -> Tensor | None:
    """The masks CUDA's memory-efficient SDPA kernel draws from the saved Philox state.

    The kernel takes its seed and offset from the default CUDA generator (the saved state holds
    both, 8 bytes each) and draws one uniform number per attention weight, kept where > p. Like
    every candidate, the result is checked against the recorded output before use.
    """
    fill = getattr(torch.ops.aten, "_fill_mem_eff_dropout_mask_", None)
    state = rng.state.cpu()
    if fill is None or state.numel() != 16 or p >= 1:
        return None
    seed, offset = struct.unpack("<qq", bytes(state.tolist()))
    try:
        uniform = fill(torch.empty(shape, dtype=torch.float32, device=rng.device), p, seed, offset)
    except (RuntimeError, NotImplementedError):  # pragma: no cover - kernel not built
        return None
    return (uniform > p).to(torch.float32) / (1.0 - p)


#: largest deviation (relative to the largest output entry) of the recomputed output from the
#: recorded one that still counts as the same masks, per dtype of the forward (wrong masks
#: change a sizeable share of the entries by about their own size)
_SAME_MASKS_RTOL = {torch.float64: 1e-7, torch.float32: 5e-3}
_SAME_MASKS_RTOL_DEFAULT = 5e-2


def _reproduces(record: Record, fwd: _Forward) -> bool:
    """Whether the output recomputed with the recovered masks is the recorded output."""
    recorded = record.outputs[0]
    rng = record.rng
    if rng is not None and rng.output_versions and recorded._version != rng.output_versions[0]:
        return True  # changed in place after the call: nothing left to compare with
    y = fwd.output()
    if record.module.batch_first or recorded.dim() == 2:
        expected = recorded.reshape(y.shape)
    else:
        expected = recorded.transpose(0, 1)
    finite = torch.isfinite(expected)  # fully masked rows of the weights path are NaN
    expected = expected.to(y.dtype)
    deviation = torch.where(finite, y - expected, 0.0).abs().max()
    scale = torch.where(finite, expected, 0.0).abs().max()
    dtype = rng.dtype if rng is not None and rng.autocast is None else None
    rtol = _SAME_MASKS_RTOL.get(dtype, _SAME_MASKS_RTOL_DEFAULT)
    return bool(deviation <= rtol * scale)


def _recover_masks(record: Record, recompute: Callable[[], _Forward]) -> _Forward:
    """Find the dropout multipliers the forward drew; `recompute()` made with them.

    Each candidate (see `_mask_candidates`) is checked against the recorded output; the
    first that reproduces it is kept in `record.extra`.
    """
    tried = False
    for masks, check in _mask_candidates(record):
        tried = True
        record.extra[_MASKS] = masks
        fwd = recompute()
        if not check or _reproduces(record, fwd):
            return fwd
        del record.extra[_MASKS]
    if not tried:
        _refuse_dropout(
            record,
            "its random masks cannot be recovered: no state of the random generator was "
            "saved for the call (inputs on a device other than CPU or CUDA, or a forward "
            "outside extend's hooks), and only the weights output with need_weights=True, "
            "average_attn_weights=False shows them",
        )
    _refuse_dropout(
        record,
        "the masks replayed from the random generator's state do not reproduce the call's "
        "output, so they are not the ones the forward drew (a fused attention kernel drew "
        "its own, as CUDA's flash and cuDNN attention do with need_weights=False, or the "
        "forward ran under torch.compile)",
        "Run the forward under torch.nn.attention.sdpa_kernel(SDPBackend.MATH), or the "
        "attention with need_weights=True, average_attn_weights=False. Or: ",
    )


def _mask_candidates(record: Record) -> Iterator[tuple[Tensor, bool]]:
    """Multipliers D `[N, H, L, S]` (0 or 1/(1-p)) the forward may have drawn, in turn.

    (D, whether to check it against the output). From the saved generator state: the
    forward's dropout call repeated (CUDA also: another dtype its math kernel may drop in,
    and the memory-efficient SDPA kernel's own masks). Then, with a per-head weights
    output: D read off P ⊙ D, exact by construction (where P is 0, D does not matter).
    """
    bound = _bind(record)
    module = record.module
    query, key = bound["query"], bound["key"]
    unbatched = query.dim() == 2
    axis = 0 if unbatched or not module.batch_first else 1
    n = 1 if unbatched else query.shape[1 - axis]
    length, h = query.shape[axis], module.num_heads
    s = key.shape[axis] + int(module.bias_k is not None) + int(module.add_zero_attn)
    need_weights = bool(bound["need_weights"])
    p = float(module.dropout)
    rng = record.rng
    if rng is not None:
        # MultiheadAttention drops [N·H, L, S] weights; SDPA's math kernel [N, H, L, S]
        shape = (n * h, length, s) if need_weights else (n, h, length, s)
        dtypes = [rng.dtype]
        if rng.device.type == "cuda":  # CPU masks do not depend on the dtype
            dtypes = list(dict.fromkeys([rng.dtype, torch.float32]))
        for dtype in dtypes:
            yield _replayed_dropout(rng, shape, dtype, p).reshape(n, h, length, s), True
        if rng.device.type == "cuda" and not need_weights:
            masks = _mem_efficient_masks(rng, (n, h, length, s), p)
            if masks is not None:
                yield masks, True
    if need_weights and not bound["average_attn_weights"]:
        weights = list(tensors_in(record.output_structure))[1]
        if unbatched:
            weights = weights.unsqueeze(0)
        keep = 0.0 if p >= 1 else 1.0 / (1.0 - p)
        yield (weights != 0).to(weights.dtype) * keep, False


class _FixedMasks(nn.Module):
    """A recorded MultiheadAttention call with its dropout masks held fixed.

    Holds the module's parameters under their names (`out_proj.weight` in a child module), so
    `torch.func.functional_call` can substitute them; its forward ignores its arguments and
    returns the recorded call's outputs, in the module's layout, computed from them.
    """

    def __init__(self, module: nn.Module, call: _Call) -> None:
        super().__init__()
        self.__dict__["_call"] = call
        self.__dict__["_backpack_path"] = module.__dict__.get("_backpack_path")
        for name, value in module._parameters.items():
            self.register_parameter(name, value)
        self.out_proj = nn.Module()
        for name, value in module.out_proj._parameters.items():
            self.out_proj.register_parameter(name, value)
        self.batch_first = module.batch_first

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:  # noqa: D102
        call = self._call
        fwd = _Forward(call, params=self)
        y = fwd.output()
        weights = None
        if call.need_weights:
            weights = fwd.pd.mean(1) if call.average else fwd.pd
        if call.unbatched:
            return y.squeeze(0), None if weights is None else weights.squeeze(0)
        return (y if self.batch_first else y.transpose(0, 1)), weights


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(ModuleRule):
    """Every parameter of `nn.MultiheadAttention`, all options of its forward.

    Batched (`[N, L, E]` or `[L, N, E]`) and unbatched (`[L, E]`, one sample) inputs, packed or
    separate projection weights, `add_bias_kv`, `add_zero_attn`, boolean and float masks (2-D,
    3-D `[N·H, L, S]`, key padding), `is_causal`, `need_weights` and `average_attn_weights`
    either way. Training-mode dropout with the masks the forward drew held fixed (see the
    module docstring).
    """

    # --- layout ------------------------------------------------------------------------------
    def batch_axis(self, module: nn.Module) -> int:
        """Axis of the sample index: 0 with `batch_first=True`, else 1."""
        return 0 if module.batch_first else 1

    def output_batch_axes(self, record: Record) -> list[int]:
        """Sample axis of (attention output, attention weights): batch axis, then 0."""
        bound = _bind(record)
        if bound["query"].dim() == 2:
            raise NotImplementedError(
                "Curvature matrix products need batched MultiheadAttention inputs; got an "
                "unbatched [L, E] call."
            )
        axes = [self.batch_axis(record.module), 0]
        return axes[: len(record.outputs)]

    def batch_size(self, record: Record) -> int:
        """Number of sequences (1 for an unbatched call)."""
        query = _bind(record)["query"]
        return 1 if query.dim() == 2 else query.shape[self.batch_axis(record.module)]

    def _call(self, record: Record) -> _Call:
        bound = _bind(record)
        module = record.module
        query, key, value = bound["query"], bound["key"], bound["value"]
        unbatched = query.dim() == 2
        dtype = query.dtype
        self_attention = _same_tensor(query, key) and _same_tensor(key, value)
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        elif not module.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # one tensor object per distinct input, so Gram matrices of inputs are shared
        if _same_tensor(key, value):
            value = key
        if _same_tensor(query, key):
            query = key
        n, length, s0 = query.shape[0], query.shape[1], key.shape[1]
        h = module.num_heads
        s = s0 + int(module.bias_k is not None) + int(module.add_zero_attn)
        need_weights, average = bool(bound["need_weights"]), bool(bound["average_attn_weights"])
        kpm = _float_mask(bound["key_padding_mask"], dtype)
        attn_mask = bound["attn_mask"]
        causal = bool(bound["is_causal"]) and kpm is None and not need_weights
        mask = None
        if causal:
            allowed = torch.ones(length, s, dtype=torch.bool, device=query.device).tril()
            mask = _float_mask(~allowed, dtype).reshape(1, 1, length, s)
        else:
            attn = _float_mask(attn_mask, dtype)
            if attn is not None:
                if attn.dim() == 2:
                    attn = attn.reshape(1, 1, length, s0)
                else:  # [N·H, L, S₀], row n·H + h
                    attn = attn.reshape(-1, h, length, s0)
                mask = F.pad(attn, (0, s - s0))
            if kpm is not None:
                kpm = F.pad(kpm.reshape(n, 1, 1, s0), (0, s - s0))
                mask = kpm if mask is None else mask + kpm
        dropout = None
        if _training_dropout(record):
            dropout = record.extra.get(_MASKS)
            if dropout is None:  # recovered (and checked) by `_forward`
                self._forward(record)
                dropout = record.extra[_MASKS]
            dropout = dropout.to(dtype)
        return _Call(
            module,
            query,
            key,
            value,
            self_attention,
            unbatched,
            need_weights,
            average,
            mask,
            not need_weights,
            dropout,
        )

    def _forward(self, record: Record) -> _Forward:
        fwd = record.extra.get(_FORWARD)
        if fwd is None:
            if _training_dropout(record) and _MASKS not in record.extra:
                fwd = _recover_masks(record, lambda: _Forward(self._call(record)))
            else:
                fwd = _Forward(self._call(record))
            record.extra[_FORWARD] = fwd
        return fwd

    def module_for_products(self, record: Record) -> nn.Module:
        """With training-mode dropout: the call with its drawn masks held fixed."""
        if not _training_dropout(record):
            return record.module
        return _FixedMasks(record.module, self._call(record))

    # --- output gradients --------------------------------------------------------------------
    def _output_grads(
        self, record: Record, grads: Sequence[Tensor | None], lead: int
    ) -> tuple[Tensor | None, Tensor | None]:
        """(δ_y `[*, N, L, E]`, δ_P) from the gradients (or factors, `lead` = 1) at the outputs."""
        module = record.module
        gy = grads[0] if len(grads) > 0 else None
        gw = grads[1] if len(grads) > 1 else None
        unbatched = _bind(record)["query"].dim() == 2
        if unbatched:
            gy = None if gy is None else gy.unsqueeze(lead)
            gw = None if gw is None else gw.unsqueeze(lead)
        elif not module.batch_first and gy is not None:
            gy = gy.transpose(lead, lead + 1)
        return gy, gw

    def _grads(
        self, record: Record, grad_outputs: GradOutputs
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Backward of this call's output gradients, once per set of gradients.

        Returns the gradients at q, k, v, o, y and a store of the per-sample parameter
        gradients materialised so far for them (shared by all first-order extensions).
        """
        cached = record.extra.get(_GRADS)
        present = [g for g in grad_outputs if g is not None]
        if cached is not None and len(cached[0]) == len(present):
            if all(r() is g for r, g in zip(cached[0], present)):
                return cached[1], cached[2]
        fwd = self._forward(record)
        gy, gw = self._output_grads(record, grad_outputs, 0)
        if gy is None and gw is None:
            raise RuntimeError("MultiheadAttention: no output gradient reached the call.")
        result = fwd.backward(gy, gw)
        result["y"] = torch.zeros_like(fwd.o) if gy is None else gy
        result["o"] = fwd.o
        store: dict[str, Tensor] = {}
        record.extra[_GRADS] = (tuple(weakref.ref(g) for g in present), result, store)
        return result, store

    # --- parameters as contractions ------------------------------------------------------------
    @staticmethod
    def _blocks(name: str, fwd: _Forward, g: dict[str, Tensor], self_attention: bool) -> Blocks:
        if name == "out_proj.weight":
            return [(fwd.o, g["y"])]
        if name == "q_proj_weight":
            return [(fwd.xq, g["q"])]
        if name == "k_proj_weight":
            return [(fwd.xk, g["k"])]
        if name == "v_proj_weight":
            return [(fwd.xv, g["v"])]
        # in_proj_weight
        if self_attention:
            return [(fwd.xq, g["qkv"])]
        return [(fwd.xq, g["q"]), (fwd.xk, g["k"]), (fwd.xv, g["v"])]

    @staticmethod
    def _bias(name: str, g: dict[str, Tensor]) -> Tensor:
        """`[*, N, *param.shape]` per-sample (per-column) gradient of a bias-like parameter."""
        if name == "out_proj.bias":
            return g["y"].sum(-2)
        if name == "in_proj_bias":
            if "qkv" in g:
                return g["qkv"].sum(-2)
            return torch.cat([g["q"].sum(-2), g["k"].sum(-2), g["v"].sum(-2)], -1)
        value = g[name]  # bias_k, bias_v: [*, N, E] -> [*, N, 1, 1, E]
        return value.unsqueeze(-2).unsqueeze(-2)

    def _is_self_attention(self, record: Record) -> bool:
        return self._forward(record).self_attention

    def _values(
        self,
        record: Record,
        g: dict[str, Tensor],
        fwd: _Forward,
        names: Names,
        how: str,
        store: dict[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """One first-order quantity (`how`) of each parameter from the gradients `g`.

        Per-sample gradients found in `store` are reduced directly; those materialised here
        are added to it. Otherwise weights use the fused Linear-like forms.
        """
        self_attention = self._is_self_attention(record)
        store = {} if store is None else store
        grams: dict[int, Tensor] = {}
        result = {}
        for name in names:
            psg = store.get(name)
            if psg is None and name not in _WEIGHTS:
                psg = store[name] = self._bias(name, g)
            if psg is None:
                blocks = self._blocks(name, fwd, g, self_attention)
                if how == "l2":
                    result[name] = _blocks_l2(blocks, grams)
                    continue
                if how == "dot":
                    result[name] = _blocks_dot(blocks)
                    continue
                if how == "sum":
                    result[name] = _blocks_sum(blocks)
                    continue
                psg = store[name] = _blocks_psg(blocks)
            if how == "psg":
                result[name] = psg
            elif how == "l2":
                result[name] = psg.flatten(1).square().sum(1)
            elif how == "dot":
                result[name] = psg.flatten(1) @ psg.flatten(1).T
            elif how == "sgs":
                result[name] = psg.square().sum(0)
            else:  # "sum"
                result[name] = psg.sum(0)
        return result

    # --- first order -------------------------------------------------------------------------
    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """`[N, *param.shape]` for every requested parameter."""
        if subsampling is None:
            g, store = self._grads(record, grad_outputs)
            return self._values(record, g, self._forward(record), names, "psg", store)
        fwd = self._forward(record)
        index = torch.as_tensor(list(subsampling), dtype=torch.long, device=fwd.o.device)
        gy, gw = self._output_grads(record, grad_outputs, 0)
        gy = None if gy is None else gy[index]
        gw = None if gw is None else gw[index]
        sub = _Forward(self._call(record), index)
        g = sub.backward(gy, gw)
        g["y"] = torch.zeros_like(sub.o) if gy is None else gy
        g["o"] = sub.o
        return self._values(record, g, sub, names, "psg")

    def batch_l2(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """Squared norms; Gram forms over positions where cheaper than materialising."""
        g, store = self._grads(record, grad_outputs)
        return self._values(record, g, self._forward(record), names, "l2", store)

    def sum_grad_squared(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """Σ_n of squared per-sample gradients."""
        g, store = self._grads(record, grad_outputs)
        return self._values(record, g, self._forward(record), names, "sgs", store)

    def batch_dot(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """`[N, N]` Gram matrices of per-sample gradients."""
        g, store = self._grads(record, grad_outputs)
        return self._values(record, g, self._forward(record), names, "dot", store)

    def grad_sum(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict:
        """This call's gradient, contracted over samples and positions at once."""
        g, store = self._grads(record, grad_outputs)
        return self._values(record, g, self._forward(record), names, "sum", store)

    def grad_sum_entries(
        self, record: Record, grad_outputs: GradOutputs, name: str, index: Tensor
    ) -> Tensor:
        """A few entries of this call's gradient (the engine's coverage probes)."""
        g, store = self._grads(record, grad_outputs)
        if name in store:
            return store[name].flatten(1)[:, index].sum(0)
        fwd = self._forward(record)
        if name in _WEIGHTS:
            blocks = self._blocks(name, fwd, g, self._is_self_attention(record))
            return _blocks_entries(blocks, index)
        return self._bias(name, g).sum(0).flatten()[index]

    # --- second order ------------------------------------------------------------------------
    def _factor_grads(
        self, record: Record, factors: Sequence[Tensor | None]
    ) -> tuple[Tensor | None, Tensor | None, float]:
        """Factors at (output, weights) as `[V, N, L, E]`, `[V, N, (H,) L, S]`; KFRA's scale.

        A factor with one sample while the call has N (KFRA's batch-averaged curvature) is
        broadcast over the samples; the returned scale 1/N turns sums over samples into the
        batch average.
        """
        fy, fw = self._output_grads(record, factors, 1)
        n = self.batch_size(record)
        scale = 1.0
        out = record.outputs[0]
        if fy is not None and fy.shape[1] == 1 and n != 1:
            if record.module.batch_first and fy.shape[2:] == out.shape[1:]:
                fy = fy.expand(fy.shape[0], n, *fy.shape[2:])
                scale = 1.0 / n
            else:
                raise NotImplementedError(
                    "A batch-averaged curvature (KFRA) reaches MultiheadAttention, which "
                    "supports it only with batch_first=True."
                )
        if fw is not None and fw.shape[1] == 1 and n != 1:
            fw = fw.expand(fw.shape[0], n, *fw.shape[2:])
        return fy, fw, scale

    def _column_chunks(self, record: Record, v: int, names: Names) -> list[slice]:
        fwd = self._forward(record)
        n = fwd.o.shape[0]
        per_column = n * max(
            fwd.p[0].numel(),
            fwd.o[0].numel() * 4,
            *(p.numel() for p in self._params(record, names).values()),
        )
        size = max(1, _CHUNK_ELEMENTS // max(per_column, 1))
        return [slice(i, min(i + size, v)) for i in range(0, v, size)]

    @staticmethod
    def _params(record: Record, names: Names) -> dict[str, Tensor]:
        module = record.module
        return {n: module.get_parameter(n) for n in names}

    def _column_values(
        self,
        record: Record,
        fwd: _Forward,
        fy: Tensor | None,
        fw: Tensor | None,
        names: Names,
    ) -> dict[str, Tensor]:
        """Jᵀ f for columns `[V, N, *out]`: `{name: [V, N, *param.shape]}`."""
        g = fwd.backward(fy, fw)
        g["y"] = fwd.o.new_zeros(*g["q"].shape[:-2], *fwd.o.shape[1:]) if fy is None else fy
        g["o"] = fwd.o
        self_attention = self._is_self_attention(record)
        result = {}
        for name in names:
            if name in _WEIGHTS:
                result[name] = _blocks_psg(self._blocks(name, fwd, g, self_attention))
            else:
                result[name] = self._bias(name, g)
        return result

    def _zeros(self, record: Record, names: Names, n: int) -> dict[str, Tensor]:
        params = self._params(record, names)
        return {k: p.new_zeros(1, n, *p.shape) for k, p in params.items()}

    def sqrt_factor(self, record, factors, names, subsampling=None):
        """Jᵀ f for every factor column: `[V, N, *param.shape]`, in chunks of columns."""
        fy, fw, _ = self._factor_grads(record, factors)
        fwd = self._forward(record)
        if subsampling is not None:
            index = torch.as_tensor(list(subsampling), dtype=torch.long, device=fwd.o.device)
            fwd = _Forward(self._call(record), index)
            fy = None if fy is None else fy[:, index]
            fw = None if fw is None else fw[:, index]
        if fy is None and fw is None:
            return self._zeros(record, names, fwd.o.shape[0])
        v = (fy if fy is not None else fw).shape[0]
        chunks = self._column_chunks(record, v, names)
        result: dict[str, Tensor] = {}
        for cols in chunks:
            values = self._column_values(
                record,
                fwd,
                None if fy is None else fy[cols],
                None if fw is None else fw[cols],
                names,
            )
            if len(chunks) == 1:
                return values
            for name, value in values.items():
                if name not in result:
                    result[name] = value.new_empty(v, *value.shape[1:])
                result[name][cols] = value
        return result

    def diag_from_factor(self, record, factors, names, coef, per_sample):
        """Σ_v coef (Jᵀ f)², from chunks of columns (never all of `[V, N, *param.shape]`)."""
        fy, fw, _ = self._factor_grads(record, factors)
        fwd = self._forward(record)
        n = fwd.o.shape[0]
        params = self._params(record, names)
        result = {
            k: p.new_zeros(n, *p.shape) if per_sample else torch.zeros_like(p)
            for k, p in params.items()
        }
        if fy is None and fw is None:
            return result
        v = (fy if fy is not None else fw).shape[0]
        for cols in self._column_chunks(record, v, names):
            values = self._column_values(
                record,
                fwd,
                None if fy is None else fy[cols],
                None if fw is None else fw[cols],
                names,
            )
            for name, value in values.items():
                sq = value.square()
                if coef is not None:
                    c = coef[cols]
                    sq = sq * c.reshape(*c.shape, *([1] * (sq.dim() - 2)))
                result[name] += sq.sum(0) if per_sample else sq.sum((0, 1))
        return result

    def kron_factors(self, record, factors, names, approx="expand"):  # noqa: D102
        """`[G, A]` for Linear-like weights, `[G]` for their biases, else one dense block."""
        fy, fw, scale = self._factor_grads(record, factors)
        fwd = self._forward(record)
        params = self._params(record, names)
        self_attention = self._is_self_attention(record)
        if fy is None and fw is None:
            fy = fwd.o.new_zeros(1, *fwd.o.shape)
        v = (fy if fy is not None else fw).shape[0]
        sums: dict[str, Tensor] = {}

        def add(key: str, value: Tensor) -> None:
            sums[key] = value if key not in sums else sums[key] + value

        def outer(t: Tensor) -> Tensor:
            if approx == "reduce":  # sum the factor over positions before the outer product
                t = t.sum(-2)
            flat = t.reshape(-1, t.shape[-1])
            return flat.T @ flat

        dense = {}
        for name in names:
            kind = _kron_kind(name, self_attention)
            if kind == "dense":
                numel = params[name].numel()
                if numel > MAX_DENSE_NUMEL:
                    raise NotImplementedError(
                        f"MultiheadAttention.{name} has no Kronecker structure here (query, "
                        "key and value differ), and its exact curvature block would be a dense "
                        f"[{numel}, {numel}] matrix (> backpack.rules.attention.MAX_DENSE_NUMEL "
                        f"= {MAX_DENSE_NUMEL} rows). Use DiagGGN* or GGNMP for this layer."
                    )
                dense[name] = params[name].new_zeros(numel, numel)
        for cols in self._column_chunks(record, v, names):
            fy_c = None if fy is None else fy[cols]
            fw_c = None if fw is None else fw[cols]
            g = None
            if any(_kron_kind(n, self_attention) != "out" for n in names):
                g = fwd.backward(fy_c, fw_c)
            for kind in {_kron_kind(n, self_attention) for n in names} - {"dense"}:
                if kind == "out":
                    if fy_c is not None:
                        add("out", outer(fy_c))
                else:  # "qkv", "q", "k", "v": the gradient at that projection's output
                    add(kind, outer(g[kind]))
            for name in names:
                if _kron_kind(name, self_attention) != "dense":
                    continue
                # in_proj_* of cross-attention, bias_k, bias_v: no use of y
                if name in _WEIGHTS:
                    sqrt = _blocks_psg(self._blocks(name, fwd, g, self_attention))
                else:
                    sqrt = self._bias(name, g)
                flat = sqrt.reshape(-1, params[name].numel())
                dense[name] += flat.T @ flat
        e = record.module.embed_dim
        result: dict[str, list[Tensor]] = {}
        for name in names:
            kind = _kron_kind(name, self_attention)
            if kind == "dense":
                result[name] = [dense[name] * scale]
                continue
            width = 3 * e if kind == "qkv" else e
            side = sums.get(kind)
            side = params[name].new_zeros(width, width) if side is None else side * scale
            if name.endswith("bias"):
                result[name] = [side]
                continue
            x = {"out": fwd.o, "qkv": fwd.xq, "q": fwd.xq, "k": fwd.xk, "v": fwd.xv}[kind]
            if approx == "reduce":  # the batch mean of the position-averaged inputs
                mean = x.mean(1)
                a = mean.T @ mean / x.shape[0]
            else:
                a = gram(x) / (x.shape[0] * x.shape[1])
            result[name] = [side, a]
        return result


def _kron_kind(name: str, self_attention: bool) -> str:
    """Which Kronecker form a parameter has: "out", "qkv", "q"/"k"/"v", or "dense"."""
    if name.startswith("out_proj."):
        return "out"
    if name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
        return name[0]
    if name in ("in_proj_weight", "in_proj_bias") and self_attention:
        return "qkv"
    return "dense"
