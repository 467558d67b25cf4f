"""Per-sample gradients kept in factored form: what each module call adds to a parameter.

A sample's gradient of a position-wise layer is a sum over its positions t (tokens, pixels) of
one term per position. For `nn.Linear` on inputs a `[T, in]` with output gradients b `[T, out]`
that term is the outer product b_t a_tᵀ, so the gradient `G = Σ_t b_t a_tᵀ` has rank ≤ T and
never needs to be formed to take inner products with it:

    ⟨M, G⟩ = Σ_t b_tᵀ M a_t,        ⟨G_q, G_n⟩ = Σ_{s,t} (b_qs·b_nt)(a_qs·a_nt).

The first ("factored") form costs `T·in·out` per (matrix, sample) pair, the second ("ghost", the
form of backpack's `BatchL2Grad` and `BatchDotGrad` rules) `T_q·T·(in + out)` per pair; forming
`G` costs `T·in·out` per sample and then `in·out` per pair. `choose` picks the cheapest.

The terms per position are also what per-token scores are made of (kronfluence's and Grosse
et al.'s definition): the score of a query with position t of a training sequence is
`Σ_layers ⟨M_q, term_t⟩`, and these sum over t to the sequence's score.

The factors come from the library's own recording: a user `ModuleExtension` of `BatchGrad`
(`module.input0` and the output gradients the engine hands it) records them for the layers
below instead of their per-sample gradients; every other layer gets backpack's `grad_batch`.
For per-token scores it also records `nn.MultiheadAttention` (from its rule's backward of the
recorded call, `module._backpack_record`: the gradients at q, k, v and the output projection)
and convolutions (output gradients times the unfolded input patches, per output position).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack.api import backpack
from backpack.curvature._data import Batch, first_tensor
from backpack.curvature._fsdp import batch_results, landing, plain_zeros
from backpack.curvature._sweep import Sweep
from backpack.extensions import BatchGrad
from backpack.extensions.firstorder import FirstOrderModuleExtension
from backpack.influence._store import batch_digest
from backpack.recording import describe, is_parametrized
from backpack.rules.attention import MultiheadAttentionRule
from backpack.rules.base import keeps_forward_of

#: the attribute that collects a parameter's sites during one backward
_FIELD = "_influence_sites"
#: most entries of one intermediate tensor of the factored products (chunked over queries)
CHUNK_ENTRIES = 1 << 19
_CONV1D = "transformers.pytorch_utils.Conv1D"


class Site:
    """One module call's contribution to a parameter's per-sample gradients.

    Kinds (N samples, T positions):
        "outer": `G_n = Σ_t L_nt R_ntᵀ` with `left` `[N, T, m]`, `right` `[N, T, k]`, the
            parameter of shape `(m, k)` (or `(m, *rest)` with `k = prod(rest)`, a convolution's
            weight);
        "rows": `G_n[idx_nt] += R_nt` with `left` the indices `[N, T]`, `right` `[N, T, k]`, the
            parameter of shape `(V, k)` (an embedding);
        "dense": `G_n = Σ_t C_nt` with `left` the terms `[N, T, numel]`;
        "sample": `left` the per-sample gradients `[N, *shape]` (no terms per position).
    """

    def __init__(self, kind: str, shape: tuple, left: Tensor, right: Tensor | None = None):
        self.kind = kind
        self.shape = tuple(shape)
        self.left = left
        self.right = right

    @property
    def num_samples(self) -> int:
        """N."""
        return self.left.shape[0]

    @property
    def positions(self) -> int | None:
        """T (None for "sample")."""
        return None if self.kind == "sample" else self.left.shape[1]

    def scaled(self, factor: float) -> Site:
        """The site of `factor × G`."""
        if factor == 1.0:
            return self
        if self.kind == "sample":  # not in place: two parameters' rows may share memory
            return Site(self.kind, self.shape, self.left * factor)
        if self.kind in ("outer", "rows"):
            return Site(self.kind, self.shape, self.left, self.right * factor)
        return Site(self.kind, self.shape, self.left * factor)

    def promoted(self, dtype: torch.dtype) -> Site:
        """The site with its values at least in `dtype`'s precision (indices stay integers)."""
        values = [t for t in (self.left, self.right) if t is not None and t.is_floating_point()]
        if all(torch.promote_types(t.dtype, dtype) == t.dtype for t in values):
            return self
        left = self.left if self.kind == "rows" else self.left.to(dtype)
        right = None if self.right is None else self.right.to(dtype)
        return Site(self.kind, self.shape, left, right)

    def select(self, start: int, stop: int) -> Site:
        """The site of samples `start:stop`."""
        right = None if self.right is None else self.right[start:stop]
        return Site(self.kind, self.shape, self.left[start:stop], right)

    def dense(self) -> Tensor:
        """`[N, *shape]` per-sample gradients."""
        n = self.num_samples
        if self.kind == "sample":
            return self.left
        if self.kind == "dense":
            return self.left.sum(1).reshape(n, *self.shape)
        if self.kind == "outer":
            return torch.einsum("ntm,ntk->nmk", self.left, self.right).reshape(n, *self.shape)
        rows, k = self.shape[0], self.right.shape[-1]
        out = self.right.new_zeros(n * rows, k)
        offsets = torch.arange(n, device=self.left.device)[:, None] * rows
        out.index_add_(0, (self.left + offsets).flatten(), self.right.flatten(0, 1))
        return out.reshape(n, *self.shape)

    def token_products(self, M: Tensor) -> Tensor:
        """`[Q, N, T]`: `⟨M_q, term_nt⟩` for matrices `M` `[Q, *shape]`, chunked over Q."""
        if self.kind == "sample":
            raise ValueError("per-sample gradients have no terms per position")
        n, t = self.left.shape[:2]
        q = M.shape[0]
        if self.kind == "dense":
            flat = self.left.flatten(0, 1)
            return (M.reshape(q, -1) @ flat.T).reshape(q, n, t)
        if self.kind == "rows":
            per = n * t * self.shape[1]
            out = []
            for chunk in M.split(max(1, CHUNK_ENTRIES // max(per, 1))):
                picked = chunk[:, self.left]  # [Q_c, N, T, k]
                out.append((picked * self.right).sum(-1))
            return torch.cat(out)
        m, k = _matrix(self.shape)
        M = M.reshape(q, m, k)
        L, R = self.left.flatten(0, 1), self.right.flatten(0, 1)  # [NT, m], [NT, k]
        if m > k:  # contract the larger side first: intermediate [Q_c, k, NT]
            M, L, R, m, k = M.transpose(1, 2), R, L, k, m
        per = m * n * t
        out = M.new_empty(q, n * t)
        start = 0
        for chunk in M.split(max(1, CHUNK_ENTRIES // max(per, 1))):
            y = (chunk.reshape(-1, k) @ R.T).view(chunk.shape[0], m, n * t)  # M_q R_ntᵀ
            torch.sum(y.mul_(L.T), dim=1, out=out[start : start + chunk.shape[0]])
            start += chunk.shape[0]
        return out.view(q, n, t)

    def ghost_products(self, query: Site) -> Tensor:
        """`[Q, N]`: `⟨G_q, G_n⟩` of two "outer" sites, from Gram matrices of the factors."""
        lq, rq = query.left, query.right  # [Q, S, m], [Q, S, k]
        q, s = lq.shape[:2]
        n, t = self.left.shape[:2]
        per = s * n * t
        out = []
        for a, b in zip(
            lq.split(max(1, CHUNK_ENTRIES // per)), rq.split(max(1, CHUNK_ENTRIES // per))
        ):
            left = torch.einsum("qsm,ntm->qnst", a, self.left)
            left.mul_(torch.einsum("qsk,ntk->qnst", b, self.right))
            out.append(left.sum((2, 3)))
        return torch.cat(out)

    def ghost_norms(self) -> Tensor:
        """`[N]`: `‖G_n‖²` of an "outer" site, `Σ_{s,t} (L_s·L_t)(R_s·R_t)`."""
        gl = torch.bmm(self.left, self.left.transpose(1, 2))
        return (gl * torch.bmm(self.right, self.right.transpose(1, 2))).sum((1, 2))


def _matrix(shape: tuple) -> tuple[int, int]:
    """`(m, k)` of an "outer" site's parameter `(m, *rest)`."""
    return shape[0], math.prod(shape[1:])


# --- cost model ---------------------------------------------------------------------------------
def pair_costs(site: Site, queries: int, query_positions: int | None) -> dict[str, float]:
    """Multiply-adds of `⟨M_q, G_n⟩` for Q queries and one batch of an "outer" site.

    "dense": form `G_n` (`N T m k`), then the products (`Q N m k`); "factored":
    `Σ_t b_tᵀ M_q a_t` (`Q N T m k`); "ghost" (plain gradients only, queries with `S`
    positions): `Q N S T (m + k)`.
    """
    n, t = site.left.shape[:2]
    m, k = _matrix(site.shape)
    costs = {"dense": n * t * m * k + queries * n * m * k, "factored": queries * n * t * m * k}
    if query_positions is not None:
        costs["ghost"] = queries * n * query_positions * t * (m + k)
    return costs


def choose(site: Site, queries: int, query_positions: int | None = None) -> str:
    """The cheapest of `pair_costs` (ties: the factored forms).

    The factored forms are eligible only where the factors are smaller than the gradient they
    stand for, `T (m + k) < m k` (else forming `G_n` also holds less).
    """
    costs = pair_costs(site, queries, query_positions)
    t = site.left.shape[1]
    m, k = _matrix(site.shape)
    if not t * (m + k) < m * k:
        return "dense"
    order = {"ghost": 0, "factored": 1, "dense": 2}
    return min(costs, key=lambda name: (costs[name], order[name]))


def norm_is_ghost(site: Site) -> bool:
    """Whether `‖G_n‖²` is cheaper from Gram matrices (`T² (m + k)`) than from `G_n` (`T m k`)."""
    t = site.left.shape[1]
    m, k = _matrix(site.shape)
    return t * t * (m + k) < t * m * k


# --- recording ----------------------------------------------------------------------------------
def _is_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}" == _CONV1D


def _computes_as(module: nn.Module, base: type) -> bool:
    """Whether `module` is a `base` computing its output with `base`'s own forward.

    A subclass with its own forward (a scaled weight, say) or a parametrized weight computes
    something else from the recorded input: its per-sample gradients come from backpack's
    `grad_batch` instead (the engine's rule or fallback for it).
    """
    return (
        isinstance(module, base)
        and keeps_forward_of(type(module), base)
        and not is_parametrized(module)
    )


def is_linear_like(module: nn.Module) -> bool:
    """`nn.Linear` (and subclasses with its forward) or Hugging Face's `Conv1D`."""
    return _computes_as(module, nn.Linear) or (_is_conv1d(module) and not is_parametrized(module))


def _positions(x: Tensor, trailing: int) -> Tensor:
    """`[N, *, *rest]` → `[N, T, *rest]` with `trailing` axes kept."""
    keep = x.shape[x.dim() - trailing :]
    return x.reshape(x.shape[0], -1, *keep)


def _is_conv(module: nn.Module) -> bool:
    """`nn.Conv1d/2d/3d` (and subclasses with their forward), not the transposed ones."""
    convs = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return any(_computes_as(module, cls) for cls in convs)


def _patches(module: nn.Module, x: Tensor) -> Tensor:
    """`[N, T, C_in·prod(kernel)]`: the input patch of each output position (row-major).

    The padding (any `padding_mode`, "same" included) is applied first, as the layer does, then
    each spatial axis is unfolded with the layer's stride and dilation.
    """
    dims = len(module.kernel_size)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
    for i, (k, s, d) in enumerate(zip(module.kernel_size, module.stride, module.dilation)):
        x = x.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]
    # [N, C, *out, *kernel] -> [N, *out, C, *kernel]
    x = x.movedim(1, 1 + dims)
    return x.reshape(x.shape[0], math.prod(x.shape[1 : 1 + dims]), -1)


def _conv_sites(module: nn.Module, x: Tensor, g: Tensor, params: dict) -> dict[str, Site]:
    """Terms per output position (flattened row-major) of a convolution's weight and bias."""
    dims = len(module.kernel_size)
    if x.dim() == dims + 1:  # unbatched [C, *spatial]
        x, g = x.unsqueeze(0), g.unsqueeze(0)
    b = g.movedim(1, -1).reshape(g.shape[0], -1, g.shape[1])  # [N, T, C_out]
    out: dict[str, Site] = {}
    if "weight" in params:
        shape = tuple(params["weight"].shape)
        a = _patches(module, x)
        if module.groups == 1:
            out["weight"] = Site("outer", shape, b, a)
        else:  # output channel o sees only its group's input channels: the terms themselves
            n, t, groups = b.shape[0], b.shape[1], module.groups
            terms = b.reshape(n, t, groups, -1, 1) * a.reshape(n, t, groups, 1, -1)
            out["weight"] = Site("dense", shape, terms.reshape(n, t, -1))
    if "bias" in params:
        out["bias"] = Site("dense", tuple(params["bias"].shape), b)
    return out


def _attention_sites(module: nn.Module, record: Any, grads: tuple) -> dict[str, Site | list[Site]]:
    """Terms per position of `nn.MultiheadAttention`'s parameters, from its rule's backward.

    Query-side weights (`q_proj_weight`, the query rows of `in_proj_weight`, `out_proj`) have
    one term per query position; key and value weights one per key/value position, which are
    the same positions in self-attention and are taken as position t of the memory otherwise
    (only where it has as many positions as the query).
    """
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    rule = MultiheadAttentionRule()
    g, _ = rule._grads(record, grads)
    g = {k: v.detach() for k, v in g.items()}
    fwd = rule._forward(record)
    xq, xk, xv, o = (t.detach() for t in (fwd.xq, fwd.xk, fwd.xv, fwd.o))
    if fwd.xk is fwd.xv:
        xv = xk
    if fwd.xq is fwd.xk:
        xq = xk
    length, keys = xq.shape[1], xk.shape[1]
    keyed = ("in_proj_weight", "in_proj_bias", "k_proj_weight", "v_proj_weight")
    memory = [n for n in keyed if n in params]
    if keys != length and memory:
        raise ValueError(
            f"per_token=True: {describe(module)} attends over {keys} key/value positions from "
            f"{length} query positions; the terms of {', '.join(memory)} are per key/value "
            "position, not per token of the sequence. Freeze them (requires_grad_(False)) or "
            "score whole sequences (per_token=False)."
        )
    out: dict[str, Site | list[Site]] = {}
    e = module.embed_dim
    if "in_proj_weight" in params:
        shape = tuple(params["in_proj_weight"].shape)
        if "qkv" in g and xq is xk and xk is xv:
            out["in_proj_weight"] = Site("outer", shape, g["qkv"], xq)
        else:  # three row blocks with their own inputs: one site each, zero elsewhere
            sites = []
            for i, (x, name) in enumerate(((xq, "q"), (xk, "k"), (xv, "v"))):
                left = F.pad(g[name], (i * e, (2 - i) * e))
                sites.append(Site("outer", shape, left, x))
            out["in_proj_weight"] = sites
    for c, x in (("q", xq), ("k", xk), ("v", xv)):
        name = f"{c}_proj_weight"
        if name in params:
            out[name] = Site("outer", tuple(params[name].shape), g[c], x)
    if "in_proj_bias" in params:
        qkv = g["qkv"] if "qkv" in g else torch.cat([g["q"], g["k"], g["v"]], -1)
        out["in_proj_bias"] = Site("dense", tuple(params["in_proj_bias"].shape), qkv)
    if "out_proj.weight" in params:
        shape = tuple(params["out_proj.weight"].shape)
        out["out_proj.weight"] = Site("outer", shape, g["y"], o)
    if "out_proj.bias" in params:
        out["out_proj.bias"] = Site("dense", tuple(params["out_proj.bias"].shape), g["y"])
    return out


def module_sites(module: nn.Module, x: Any, g: Tensor) -> dict[str, Site]:
    """`{parameter name: Site}` of one call of a supported module (not attention)."""
    out: dict[str, Site] = {}
    params = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    if _is_conv(module):
        return _conv_sites(module, x, g, params)
    if is_linear_like(module):
        a, b = _positions(x, 1), _positions(g, 1)
        if "weight" in params:
            w = tuple(params["weight"].shape)
            out["weight"] = Site("outer", w, a, b) if _is_conv1d(module) else Site("outer", w, b, a)
        if "bias" in params:
            out["bias"] = Site("dense", tuple(params["bias"].shape), b)
    elif isinstance(module, nn.Embedding):
        b = _positions(g, 1)
        idx = x.reshape(x.shape[0], -1)
        if module.padding_idx is not None:
            b = b * (idx != module.padding_idx).unsqueeze(-1)
        if "weight" in params:
            out["weight"] = Site("rows", tuple(params["weight"].shape), idx, b)
    elif isinstance(module, nn.LayerNorm):
        k = len(module.normalized_shape)
        dims = tuple(range(x.dim() - k, x.dim()))
        mean = x.mean(dims, keepdim=True)
        var = x.var(dims, unbiased=False, keepdim=True)
        xhat = (x - mean) / torch.sqrt(var + module.eps)
        b = _positions(g, k).flatten(2)
        if "weight" in params:
            shape = tuple(params["weight"].shape)
            out["weight"] = Site("dense", shape, b * _positions(xhat, k).flatten(2))
        if "bias" in params:
            out["bias"] = Site("dense", tuple(params["bias"].shape), b)
    return out


def supports_positions(module: nn.Module) -> str | None:
    """Why `module`'s terms per position cannot be recorded (None: they can)."""
    if is_linear_like(module):
        return None
    if _computes_as(module, nn.Embedding):
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            return "an nn.Embedding with max_norm, scale_grad_by_freq or sparse"
        return None
    if _computes_as(module, nn.LayerNorm):
        return None
    if _is_conv(module):
        return None
    if _computes_as(module, nn.MultiheadAttention):
        kv = (module.bias_k, module.bias_v)
        if any(p is not None and p.requires_grad for p in kv):
            return (
                "an nn.MultiheadAttention with add_bias_kv (bias_k and bias_v are one extra "
                "key and value shared by every position, no position's own)"
            )
        return None
    return (
        f"a {type(module).__name__} (terms per position: Linear, Conv1D, Embedding, LayerNorm, "
        "MultiheadAttention, Conv1d/2d/3d)"
    )


class _Record(FirstOrderModuleExtension):
    """Appends each call's `Site`s to its parameters (instead of writing `grad_batch`)."""

    def apply(self, ext: Any, module: nn.Module, g_inp: tuple, g_out: tuple) -> None:  # noqa: D102
        if isinstance(module, nn.MultiheadAttention):
            found = _attention_sites(module, module._backpack_record, g_out)
        else:
            x, g = module.input0, g_out[0]
            if g is None:
                g = torch.zeros_like(module.output)
            found = module_sites(module, x.detach(), g.detach())
        for name, value in found.items():
            param = module.get_parameter(name)
            sites = getattr(param, _FIELD, None)
            if sites is None:
                sites = []
                setattr(param, _FIELD, sites)
            sites.extend(value if isinstance(value, list) else [value])

    __call__ = apply


def recorded_classes(model: nn.Module, per_token: bool) -> tuple[set[type], list[str]]:
    """Module classes whose sites are recorded, and (per_token) the parameters not covered."""
    classes, uncovered = set(), []
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    for shared in owners.values():  # a weight tied to a Linear's: record all of its uses
        if len(shared) > 1 and any(is_linear_like(m) for m in shared):
            classes |= {type(m) for m in shared if supports_positions(m) is None}
    for prefix, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if per_token and isinstance(module, nn.MultiheadAttention):  # it owns out_proj's too
            own = [n for n, p in module.named_parameters() if p.requires_grad]
        if not own:
            continue
        if is_linear_like(module) or (per_token and supports_positions(module) is None):
            classes.add(type(module))
        elif per_token:
            why = supports_positions(module)
            uncovered += [f"{prefix + '.' if prefix else ''}{n} (in {why})" for n in own]
    # a module extension for a class serves its subclasses too: a class with a member that
    # computes something else (its own forward, a parametrized weight) is not recorded at all
    for module in model.modules():
        if supports_positions(module) is not None:  # not recordable
            classes = {c for c in classes if not isinstance(module, c)}
    return classes, uncovered


def site_batches(
    sweep: Sweep, classes: set[type], desc: str = "gradients", same: bool = False
) -> Iterator[tuple[Batch, dict[str, list[Site]]]]:
    """Yield `(batch, {name: [Site, ...]})`: each batch's gradients of its samples' own losses.

    Over the `Sweep`'s data; layers of `classes` give their factors, every other parameter one
    "sample" site (backpack's `grad_batch`); all at the scale of the sample's own loss (times
    `ν_b`). On a model sharded with FSDP2 the sites are whole (taken from FSDP's unsharded
    parameters in the backward), the ranks take their batches in lockstep and with `same` the
    batches must be equal on every rank.

    Raises:
        ValueError: For a parameter without gradients, or a recorded call whose samples are not
            the batch's (several forwards per batch: use `factored=False`).
    """
    sweep.extend()
    model, lossfunc = sweep.model, sweep.lossfunc
    params = sweep.trainable()
    extension = BatchGrad()
    recorder = _Record()
    for cls in classes:
        extension.set_module_extension(cls, recorder, overwrite=True)
    key = (lambda b: int(batch_digest((b.X, b.y))[:12], 16)) if same else None
    work = lambda batch: _batch_sites(sweep, model, lossfunc, params, extension, batch)  # noqa: E731
    yield from batch_results(sweep, work, desc, key)


def _batch_sites(sweep, model, lossfunc, params, extension, batch) -> dict[str, list[Site]]:
    """One batch of `site_batches`: `{name: [Site, ...]}`."""
    n = batch.num_samples
    with torch.enable_grad():
        output = model(batch.X)
        nu = sweep.nu(output, batch.y)
        if sweep.empty(nu):
            if sweep.sharded:  # the other ranks' backwards run FSDP2's collectives: run one too
                saved = [p.grad for _, p in params]
                (first_tensor(output).sum() * 0).backward()
                for (_, p), g in zip(params, saved):
                    p.grad = g
            return {name: [Site("sample", p.shape, plain_zeros(p, n))] for name, p in params}
        loss = lossfunc(output, batch.y)
        holders = landing(model)
        saved = [p.grad for _, p in params]
        for _, p in params:
            p.grad = None
        try:
            with backpack(extension, sync=False):
                loss.backward()
        except BaseException:  # a refused layer: leave no sites behind for the next sweep
            for (_, p), g in zip(params, saved):
                for h in holders(p):
                    h.__dict__.pop(_FIELD, None)
                    h.__dict__.pop("grad_batch", None)
                p.grad = g
            raise
    scale = sweep.scale(nu)
    result: dict[str, list[Site]] = {}
    for (name, p), g in zip(params, saved):
        p.grad = g
        sites, value = [], None
        for h in holders(p):
            sites += h.__dict__.pop(_FIELD, None) or []
            found = h.__dict__.pop("grad_batch", None)
            value = found if value is None else value
        if value is not None:
            sites.append(Site("sample", tuple(p.shape), value.detach()))
        if not sites:
            raise ValueError(
                f"Parameter {name} got no gradients in batch {batch.index} (does it take "
                "part in the loss, and is its layer supported? see the warnings)."
            )
        wrong = [s.num_samples for s in sites if s.num_samples != n]
        if wrong:
            raise ValueError(
                f"Parameter {name}: a module call saw {wrong[0]} samples, the batch has {n} "
                "(several forwards per batch?); use factored=False."
            )
        # at least in the parameter's own dtype: FSDP2's mixed precision computes in a lower one
        result[name] = [s.scaled(scale).promoted(p.dtype) for s in sites]
    return result


def dense(sites: list[Site], start: int = 0, stop: int | None = None) -> Tensor:
    """`[N, *shape]`: the per-sample gradients of a parameter's sites (samples `start:stop`)."""
    if start != 0 or stop is not None:
        stop = sites[0].num_samples if stop is None else stop
        sites = [s.select(start, stop) for s in sites]
    out = sites[0].dense()
    for s in sites[1:]:
        out = out + s.dense()
    return out


def square_sum(sites: list[Site]) -> Tensor:
    """`Σ_n G_n²` (elementwise) of a parameter's sites: `(L²)ᵀ R²` for one position, else chunks."""
    if len(sites) == 1 and sites[0].kind == "outer" and sites[0].positions == 1:
        site = sites[0]
        return (site.left[:, 0].square().T @ site.right[:, 0].square()).reshape(site.shape)
    n = sites[0].num_samples
    step = max(1, CHUNK_ENTRIES // max(math.prod(sites[0].shape), 1))
    total = None
    for start in range(0, n, step):
        part = dense(sites, start, min(start + step, n)).square().sum(0)
        total = part if total is None else total + part
    return total
