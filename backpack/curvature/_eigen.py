"""EK-FAC's corrected eigenvalues as diagonals in Kronecker eigenbases, without per-sample rows.

EK-FAC's corrected eigenvalue of entry (i, j) of a block with eigenbases `Q_G` (outputs) and
`Q_A` (inputs) is `Σ_{v,n} (Q_Gᵀ ∇W_vn Q_A)_ij²` over the (factor column, sample) gradients
`∇W_vn = Σ_l f_vnl u_nlᵀ`, with `f_vnl` the backpropagated column v of sample n at position l
(square-root GGN columns, sampled ones, or the output gradient) and `u_nl` the layer's input
there (a convolution's unfolded patch; with a folded bias, `[u; 1]`). The rotation distributes
over the sum over positions, so each side can be rotated before the gradients are formed.

The sweep that computes them is backpack's own diagonal extensions (`DiagGGNExact`,
`DiagGGNMC`, `SumGradSquared`): `eigen_rules` lends each target module, for the duration of the
sweep, a private subclass of its class (`backpack.curvature._lent`) whose rule returns these
squares in place of the plain diagonal. One mechanism for both kinds of layer:

- `nn.Linear` (`_EigenLinearRule`): on `[N, in]` inputs one product
  `Σ_n (Q_Gᵀ f_n)² (Q_Aᵀ x_n)²ᵀ`; on sequences the rotated per-sample gradients, or their
  squares from Gram matrices over positions where that is cheaper;
- convolutions (`_EigenConvRule`, `weight_squares`): the rotated gradients formed chunk by chunk
  from rotated factors and unfolded inputs, each side rotated before or after, whichever costs
  fewer multiply-adds (`plan`).

A bias with its own dense block gets `Σ (Q_Bᵀ Σ_l f_vnl)²`; a folded bias is the last input
column. Results keep the parameters' shapes: a folded block's squares `[g, a + 1]` come back as
the weight's `[g, a]` part and the bias's last column.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from backpack.core.derivatives import convnd
from backpack.curvature._lent import lent, rule_is, state_of
from backpack.rules.conv import CONV_CLASSES, ConvRule
from backpack.rules.linear import LinearRule

#: the record entry caching a call's (rotated) unfolded input across chunks of columns
_CACHE = "ekfac_unfolded"
#: most elements of that cache (beyond it, each chunk of columns unfolds again)
CACHE_ELEMENTS = 1 << 24
#: elements a chunk of samples may occupy in one intermediate
_CHUNK = {"cpu": 1 << 22}
_CHUNK_OTHER = 1 << 24


class EigenState:
    """Eigenbases of one layer's blocks, and the factor columns per sample to expect.

    Attributes:
        q_out: `Q_G` of the weight.
        q_in: `Q_A` of the weight (`[a + 1, a + 1]` with a folded bias).
        q_bias: The eigenbasis of the bias's own block (None: no such bias in the sweep).
        fold: Whether the bias is folded into the weight's block (the last input column).
        columns: Factor columns per sample over a whole backward (the engine may hand them
            over in chunks); only the choice of `plan` depends on it.
    """

    def __init__(
        self,
        q_out: Tensor,
        q_in: Tensor,
        q_bias: Tensor | None = None,
        columns: int = 1,
        fold: bool = False,
    ) -> None:
        self.q_out = q_out
        self.q_in = q_in
        self.q_bias = q_bias
        self.columns = columns
        self.fold = fold
        #: called before the rule uses the eigenbases (FSDP2: they arrive just in time)
        self.fetch: Callable[[], None] | None = None

    def ready(self) -> EigenState:
        """The state, its eigenbases present (fetched first where they arrive just in time)."""
        if self.fetch is not None:
            self.fetch()
        return self


def own_class(module: nn.Module) -> type:
    """The module's class, or the class FSDP2's `fully_shard` subclassed (`FSDP<class>`)."""
    cls = type(module)
    if cls.__name__.startswith("FSDP"):
        bases = [b for b in cls.__bases__ if b.__name__ != "FSDPModule"]
        if len(bases) == 1 and len(cls.__bases__) == 2:
            return bases[0]
    return cls


def is_target(module: nn.Module) -> bool:
    """Whether `module` can take its diagonals in an eigenbasis: `nn.Linear`, torch's convs."""
    if own_class(module) in CONV_CLASSES:
        return rule_is(module, ConvRule)
    return rule_is(module, LinearRule)


def _device_budget(t: Tensor) -> int:
    return _CHUNK.get(t.device.type, _CHUNK_OTHER)


def _split_folded(squares: Tensor, module: nn.Module, state: EigenState, names) -> dict:
    """`{"weight": [..weight.shape], "bias": [g]}` of the block's squares `[g, a(+1)]`."""
    result = {}
    if state.fold:
        weight, bias = squares[:, :-1], squares[:, -1]
        if "bias" in names:
            result["bias"] = bias.reshape(module.bias.shape)
    else:
        weight = squares
    result["weight"] = weight.reshape(module.weight.shape)
    return result


def _bias_squares(f_sum: Tensor, coef: Tensor | None, state: EigenState) -> Tensor:
    """`Σ_{v,n} coef (Q_Bᵀ b_vn)²` of the bias gradients `b` `[V, N, out]`."""
    if state.q_bias is not None:
        f_sum = f_sum @ state.q_bias
    sq = f_sum.square()
    if coef is not None:
        sq = sq * coef.unsqueeze(-1)
    return sq.sum((0, 1))


# --- nn.Linear ---------------------------------------------------------------------------------
def linear_squares(
    x: Tensor, f: Tensor, coef: Tensor | None, state: EigenState, way: str | None = None
) -> Tensor:
    """`Σ_{v,n} coef_vn (Q_Gᵀ ∇W_vn Q_A)²`, `[g, a]`, of a Linear layer's (column, sample) grads.

    `x` is the input `[N, T, in]`, `f` the factor `[V, N, T, out]`; with a folded bias the
    inputs get a constant-1 column first. On sequences (T > 1) the squares come from the
    rotated per-sample gradients (`way="gradients"`) or from Gram matrices over positions
    (`"gram"`, `Σ_{t,s} (Σ_v f_t ∘ f_s)ᵀ (x_t ∘ x_s)`), by default whichever costs fewer
    multiply-adds.
    """
    if state.fold:
        x = torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)
    xr = x @ state.q_in  # [N, T, a]
    fr = f @ state.q_out  # [V, N, T, g]
    v, n, t, g = fr.shape
    a = xr.shape[-1]
    if t == 1:
        f2 = fr[:, :, 0].square()
        if coef is not None:
            f2 = f2 * coef.unsqueeze(-1)
        return f2.sum(0).T @ xr[:, 0].square()
    budget = _device_budget(f)
    total = f.new_zeros(g, a)
    if way is None:
        way = "gram" if t * t * (v * g + a + g * a) < v * t * g * a + v * g * a else "gradients"
    if way == "gram":  # per sample `[T, T, g]` and `[T, T, a]` products
        step = max(1, budget // max(1, t * t * (v * g + a)))
        for start in range(0, n, step):
            ns = slice(start, min(n, start + step))
            ff = fr[:, ns].unsqueeze(3) * fr[:, ns].unsqueeze(2)  # [V, m, T, T, g]
            if coef is not None:
                ff = ff * coef[:, ns].reshape(v, -1, 1, 1, 1)
            xx = xr[ns].unsqueeze(2) * xr[ns].unsqueeze(1)  # [m, T, T, a]
            total += ff.sum(0).reshape(-1, g).T @ xx.reshape(-1, a)
        return total
    step = max(1, budget // max(1, v * g * a))
    for start in range(0, n, step):
        ns = slice(start, min(n, start + step))
        m = ns.stop - ns.start
        # [m, V·g, T] x [m, T, a]: each sample's rotated gradients for all its columns
        left = fr[:, ns].permute(1, 0, 3, 2).reshape(m, v * g, t)
        grads = torch.bmm(left, xr[ns]).reshape(m, v, g, a).square_()
        if coef is not None:
            grads.mul_(coef[:, ns].T.reshape(m, v, 1, 1))
        total += grads.sum((0, 1))
    return total


def _refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "internal: EKFAC's eigenbasis rules support diagonals only (a module called several "
        "times per forward?)"
    )


class _EigenLinearRule(LinearRule):
    """`nn.Linear` whose diagonals are taken in its EK-FAC eigenbases (`EigenState`).

    Only the reductions the correction sweep uses are defined; the rest raise
    `NotImplementedError` (the sweep then falls back to rows), and the shortcuts through a
    diagonal at the output are off (they would give the plain diagonal).
    """

    diag_from_residual = None
    factor_output_diag = None
    accepts_output_diag = None

    def diag_from_factor(self, record, factors, names, coef, per_sample):  # noqa: D102
        module = record.module
        if per_sample:
            raise NotImplementedError(f"EKFAC's eigenbasis diagonal of {module} is not per sample")
        x = record.args[0]
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        if factors[0] is None:
            return {name: torch.zeros_like(getattr(module, name)) for name in names}
        state: EigenState = state_of(module).ready()
        f = self._flat_factor(record, factors)
        result = {}
        if "weight" in names:
            result = _split_folded(linear_squares(x, f, coef, state), module, state, names)
        if "bias" in names and not state.fold:
            result["bias"] = _bias_squares(f.sum(2), coef, state)
        return result

    def sum_grad_squared(self, record, grad_outputs, names):  # noqa: D102
        return self.diag_from_factor(record, (grad_outputs[0].unsqueeze(0),), names, None, False)

    def grad_sum_and_squares(self, record, grad_outputs, names):  # noqa: D102
        return None  # autograd's gradient, and `sum_grad_squared` for the squares

    per_sample_grads = _refuse
    sqrt_factor = _refuse
    sqrt_factor_into = _refuse
    batch_l2 = _refuse
    batch_l2_and_sum = _refuse
    batch_dot = _refuse
    grad_sum_and_centred_squares = _refuse
    kron_factors = _refuse
    kron_factors_dense = _refuse
    kron_output_gram = _refuse


# --- convolutions ------------------------------------------------------------------------------
def plan(
    module: nn.Module, x: Tensor, f: Tensor, columns: int = 1, fold: bool = False
) -> dict[str, Any]:
    """Which way `weight_squares` goes for a call: `{"g", "a": "before" | "after", "native"}`.

    Costs in multiply-adds over the call's `columns` (at least `f`'s) factor columns: forming
    the gradients costs `V N L C_out D` either way; rotating the output side costs
    `V N L C_out²` before (per position) or `V N C_out² D` after (per gradient), the input side
    `N L D²` before (paid once per call where the rotated input is cached, `CACHE_ELEMENTS`,
    else once per chunk of columns) or `V N C_out D²` after. "native" forms the rule's own
    per-pair gradients and rotates them afterwards (for transposed convolutions, whose gradients
    the rule forms over the input positions, fewer than the output positions used here; not
    with a folded bias).
    """
    v, n, c_out = f.shape[0], f.shape[1], f.shape[2]
    total = max(v, columns)
    positions = math.prod(f.shape[3:])
    groups = module.groups
    kernel = math.prod(module.kernel_size)
    d = x.shape[1] * kernel if convnd.is_transposed(module) else x.shape[1] // groups * kernel
    d += int(fold)
    cache = n * groups * positions * d <= CACHE_ELEMENTS
    form = total * n * positions * c_out * d
    g_costs = {"after": total * n * c_out * c_out * d}
    if groups == 1:
        g_costs["before"] = total * n * positions * c_out * c_out
    rotate_input = n * positions * d * d * groups
    a_costs = {
        "before": rotate_input if cache else rotate_input * -(-total // v),
        "after": total * n * c_out * d * d,
    }
    g = min(g_costs, key=g_costs.__getitem__)
    a = min(a_costs, key=a_costs.__getitem__)
    cost = form + g_costs[g] + a_costs[a]
    native = False
    if convnd.is_transposed(module) and not fold:
        native_cost = total * n * math.prod(x.shape[2:]) * c_out * d + g_costs["after"]
        native = native_cost + a_costs["after"] < cost
    return {"g": g, "a": a, "native": native, "d": d, "positions": positions, "cache": cache}


def _unfolded(module: nn.Module, x: Tensor, out_size, fold: bool) -> Tensor:
    """`[N, G, L, D]`: each sample's input patches per group (with a constant 1 if `fold`)."""
    u = ConvRule.unfolded_input(module, x, out_size)
    if fold:
        u = torch.cat([u, u.new_ones(*u.shape[:-1], 1)], dim=-1)
    return u


def weight_squares(
    module: nn.Module,
    x: Tensor,
    f: Tensor,
    coef: Tensor | None,
    state: EigenState,
    cache: dict[str, Any] | None = None,
    gradient: list[Tensor] | None = None,
) -> Tensor:
    """`Σ_{v,n} coef_vn (Q_Gᵀ ∇W_vn Q_A)²`, `[C_out, D]`, ∇W_vn the (column, sample) gradients.

    `x` is the input `[N, C_in, *in]`, `f` the factor `[V, N, C_out, *out]`; the gradients are
    in the block's coordinates (`weight.transpose(0, 1)` for transposed convolutions; with a
    folded bias `[C_out, D + 1]`, the bias last). `cache` (the call's record's `extra`) keeps
    the (rotated) unfolded input for the next chunk of columns of the same call. A list
    `gradient` gets `Σ_{v,n} Q_Gᵀ ∇W_vn Q_A` appended (the sum of the rotated gradients, from
    the same chunks; not on the "native" way).
    """
    how = plan(module, x, f, state.columns, state.fold)
    q_out, q_in = state.q_out, state.q_in
    if how["native"]:
        return _native_squares(module, x, f, coef, q_out, q_in)
    v, n, c_out = f.shape[0], f.shape[1], f.shape[2]
    groups, d, positions = module.groups, how["d"], how["positions"]
    out_size = f.shape[3:]
    g_before, a_before = how["g"] == "before", how["a"] == "before"
    unfolded = None
    if how["cache"]:
        key = (_CACHE, a_before)
        unfolded = None if cache is None else cache.get(key)
        if unfolded is None:
            unfolded = _unfolded(module, x, out_size, state.fold)
            unfolded = (unfolded @ q_in) if a_before else unfolded
            if cache is not None:
                cache[key] = unfolded
    per_sample = 2 * groups * d * positions + v * c_out * positions + 2 * v * c_out * d
    step = min(n, max(1, _device_budget(x) // max(1, per_sample)))
    # two buffers for the chunk's gradients, reused (fresh large tensors would be paged in anew
    # for every chunk)
    pool = f.new_empty(2, step * v * c_out * d)
    sums = f.new_empty(c_out * d)
    total = f.new_zeros(c_out * d)
    summed = None if gradient is None else f.new_zeros(c_out * d)
    for start in range(0, n, step):
        ns = slice(start, min(n, start + step))
        m = ns.stop - ns.start
        rows = m * v
        if unfolded is not None:
            u = unfolded[ns]
        else:
            u = _unfolded(module, x[ns], out_size, state.fold)
            if a_before:
                u = u @ q_in
        s = f[:, ns].reshape(v, m, c_out, positions)
        if g_before:
            s = q_out.T @ s
        # [V, m, G, a, L] -> [m, G, V a, L]: one batched product per sample and group
        s = s.reshape(v, m, groups, c_out // groups, positions).permute(1, 2, 0, 3, 4)
        grads = pool[0, : rows * c_out * d].view(m, groups, -1, d)
        torch.matmul(s.reshape(m, groups, -1, positions), u, out=grads)
        free = 1
        if groups > 1:  # [m, G, V, a, D] -> [m, V, G, a, D]
            moved = pool[1, : rows * c_out * d].view(m, v, groups, c_out // groups, d)
            moved.copy_(grads.view(m, groups, v, c_out // groups, d).transpose(1, 2))
            grads, free = moved, 0
        grads = grads.view(rows, c_out, d)
        if not g_before:
            grads = torch.matmul(q_out.T, grads, out=pool[free, : grads.numel()].view_as(grads))
            free = 1 - free
        if not a_before:
            grads = torch.matmul(grads, q_in, out=pool[free, : grads.numel()].view_as(grads))
        if summed is not None:
            summed += grads.view(rows, -1).sum(0)
        grads.square_()
        if coef is not None:
            grads.mul_(coef[:, ns].T.reshape(rows, 1, 1))
        torch.sum(grads.view(rows, -1), 0, out=sums)
        total += sums
    if gradient is not None:
        gradient.append(summed.view(c_out, d))
    return total.view(c_out, d)


def _native_squares(module, x, f, coef, q_out, q_in) -> Tensor:
    """`weight_squares` from the rule's own (column, sample) gradients, rotated afterwards."""
    transposed = convnd.is_transposed(module)
    shape = module.weight.shape
    total = None
    for ns, vs, pairs in ConvRule.pair_gradients(module, x, f):
        w = pairs.reshape(-1, *shape)
        if transposed:
            w = w.transpose(1, 2)
        w = q_out.T @ w.reshape(w.shape[0], q_out.shape[0], -1) @ q_in
        sq = w.square_()
        if coef is not None:
            sq = sq * coef[vs, ns].T.reshape(-1, 1, 1)
        part = sq.sum(0)
        total = part if total is None else total + part
    return total


class _EigenConvRule(ConvRule):
    """A convolution whose diagonals are taken in its EK-FAC eigenbases (`EigenState`).

    Only the reductions the correction sweep uses are defined; quantities that would need
    per-sample gradients in those coordinates raise `NotImplementedError` (the sweep then falls
    back to rotating rows).
    """

    def diag_from_factor(self, record, factors, names, coef, per_sample):  # noqa: D102
        module = record.module
        if per_sample:
            raise NotImplementedError(f"EKFAC's eigenbasis diagonal of {module} is not per sample")
        x, f = self.input_and_factor(record, factors)
        if f is None:
            return {name: torch.zeros_like(getattr(module, name)) for name in names}
        return self._squares(record, x, f, names, coef, None)

    def _squares(self, record, x, f, names, coef, sums: dict | None) -> dict[str, Tensor]:
        """The diagonals in the eigenbases; the (plain) gradients into `sums` if given."""
        module = record.module
        state: EigenState = state_of(module).ready()
        result = {}
        if "weight" in names:
            gradient: list[Tensor] | None = None if sums is None else []
            squares = weight_squares(module, x, f, coef, state, record.extra, gradient)
            result = _split_folded(squares, module, state, names)
            if gradient:  # back from the eigenbases, in the parameters' layouts
                plain = state.q_out @ gradient[0] @ state.q_in.T
                if state.fold:
                    plain = plain[:, :-1]
                if convnd.is_transposed(module):
                    shape = module.weight.shape
                    plain = plain.reshape(shape[1], shape[0], *shape[2:]).transpose(0, 1)
                sums["weight"] = plain.reshape(module.weight.shape)
        if "bias" in names:
            totals = f.sum(tuple(range(3, f.dim())))  # [V, N, C_out]
            if sums is not None:
                sums["bias"] = totals.sum((0, 1))
            if not state.fold:
                result["bias"] = _bias_squares(totals, coef, state)
        return result

    def grad_sum_and_squares(self, record, grad_outputs, names):  # noqa: D102
        """(Σ_n g_n, the squares in the eigenbases), the sum from the same rotated chunks."""
        x, f = self.input_and_factor(record, (grad_outputs[0].unsqueeze(0),))
        sums: dict[str, Tensor] = {}
        squares = self._squares(record, x, f, names, None, sums)
        if "weight" in names and "weight" not in sums:  # the "native" way
            sums.update(self.grad_sum(record, grad_outputs, ["weight"]))
        return sums, squares

    per_sample_grads = _refuse
    sqrt_factor = _refuse
    batch_l2 = _refuse
    batch_l2_and_sum = _refuse
    batch_dot = _refuse
    grad_sum_and_centred_squares = _refuse
    kron_factors = _refuse


@contextmanager
def eigen_rules(targets: Mapping[nn.Module, EigenState]):
    """The target layers' diagonals in their eigenbases, for the duration of the block."""
    lent_rules = {
        module: (_EigenConvRule if own_class(module) in CONV_CLASSES else _EigenLinearRule, state)
        for module, state in targets.items()
    }
    with lent(lent_rules):
        yield
