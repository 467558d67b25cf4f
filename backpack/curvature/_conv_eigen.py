"""Squares of convolution weight gradients in a Kronecker eigenbasis, without per-sample rows.

EK-FAC's corrected eigenvalue of entry (i, j) of a convolution weight block with eigenbases
`Q_G` (output channels) and `Q_A` (unfolded input, `D = C_in/groups · K`) is

    Σ_{v,n} ( Σ_l (Q_Gᵀ f_vnl)_i (Q_Aᵀ u_nl)_j )²,

f_vnl the factor column v of sample n at output position l (square-root GGN columns, sampled
ones, or the output gradient), u_nl the unfolded input there. The rotation distributes over the
sum over positions, so each side can be rotated before the per-sample gradients are formed
(per position: `V N L C_out²` and `N L D²`) or after (per gradient: `V N C_out² D` and
`V N C_out D²`); forming costs `V N L C_out D` either way. Rotating the rows, as `EigenBlock`
does, is "after" on both sides. `weight_squares` picks the cheaper side by side, forms each
chunk of samples' gradients with one batched product and squares it in place.

The sweep that computes them is backpack's own diagonal extensions (`DiagGGNExact`,
`DiagGGNMC`, `SumGradSquared`: they all reduce through the convolution rule's
`diag_from_factor`): `eigenbasis_rules` lends each target module, for the duration of the sweep,
a private subclass of its class (same forward) whose rule returns these squares in place of the
plain diagonal. Bias blocks with a dense factor get `Σ (Q_Bᵀ Σ_l f_vnl)²` the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from backpack.core.derivatives import convnd
from backpack.recording import SHAPE_ONLY_OUTPUTS
from backpack.rules.base import register_rule
from backpack.rules.conv import (
    CONV_CLASSES,
    ConvRule,
    _input_and_factor,
    _pair_grads,
    _transposed_unfold,
)

#: the module attribute holding its `Bases` while it is a target
_FIELD = "_ekfac_bases"
#: the record entry caching a call's (rotated) unfolded input across chunks of columns
_CACHE = "ekfac_unfolded"
#: most elements of that cache (beyond it, each chunk of columns unfolds again)
CACHE_ELEMENTS = 1 << 24
#: elements a chunk of samples may occupy in one intermediate
_CHUNK = {"cpu": 1 << 22}
_CHUNK_OTHER = 1 << 24


class Bases:
    """Eigenbases of one convolution's blocks, and the factor columns per sample to expect.

    Attributes:
        q_out: `Q_G` of the weight.
        q_in: `Q_A` of the weight.
        q_bias: The bias block's eigenbasis (None: no bias in the sweep).
        columns: Factor columns per sample over a whole backward (the engine may hand them
            over in chunks); only the choice of `plan` depends on it.
    """

    def __init__(
        self, q_out: Tensor, q_in: Tensor, q_bias: Tensor | None, columns: int = 1
    ) -> None:
        self.q_out = q_out
        self.q_in = q_in
        self.q_bias = q_bias
        self.columns = columns


def plan(module: nn.Module, x: Tensor, f: Tensor, columns: int = 1) -> dict[str, Any]:
    """Which way `weight_squares` goes for a call: `{"g", "a": "before" | "after", "native"}`.

    Costs in multiply-adds over the call's `columns` (at least `f`'s) factor columns, see the
    module docstring; rotating the input "before" is paid once per call where the rotated input
    is cached (`CACHE_ELEMENTS`), else once per chunk of columns. "native" forms the rule's own
    per-pair gradients and rotates them afterwards (for transposed convolutions, whose gradients
    the rule forms over the input positions, fewer than the output positions used here).
    """
    v, n, c_out = f.shape[0], f.shape[1], f.shape[2]
    total = max(v, columns)
    positions = math.prod(f.shape[3:])
    groups = module.groups
    kernel = math.prod(module.kernel_size)
    d = x.shape[1] * kernel if convnd.is_transposed(module) else x.shape[1] // groups * kernel
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
    if convnd.is_transposed(module):
        native_cost = total * n * math.prod(x.shape[2:]) * c_out * d + g_costs["after"]
        native = native_cost + a_costs["after"] < cost
    return {"g": g, "a": a, "native": native, "d": d, "positions": positions, "cache": cache}


def _unfolded(module: nn.Module, x: Tensor, out_size, groups: int, d: int) -> Tensor:
    """`[N, G, L, D]`: the unfolded input of each sample and group, positions by features."""
    if convnd.is_transposed(module):
        return _transposed_unfold(module, x, out_size).transpose(1, 2).unsqueeze(1)
    u = convnd.unfold_channels_first(module, x, out_size)  # [G D, N L]
    return u.reshape(groups, d, x.shape[0], -1).permute(2, 0, 3, 1)


def weight_squares(
    module: nn.Module,
    x: Tensor,
    f: Tensor,
    coef: Tensor | None,
    bases: Bases,
    cache: dict[str, Any] | None = None,
    gradient: list[Tensor] | None = None,
) -> Tensor:
    """`Σ_{v,n} coef_vn (Q_Gᵀ ∇W_vn Q_A)²`, `[C_out, D]`, ∇W_vn the (column, sample) gradients.

    `x` is the input `[N, C_in, *in]`, `f` the factor `[V, N, C_out, *out]`; the gradients are
    in the block's coordinates (`weight.transpose(0, 1)` for transposed convolutions). `cache`
    (the call's record's `extra`) keeps the (rotated) unfolded input for the next chunk of
    columns of the same call. A list `gradient` gets `Σ_{v,n} Q_Gᵀ ∇W_vn Q_A` appended (the
    sum of the rotated gradients, from the same chunks; not on the "native" way).
    """
    how = plan(module, x, f, bases.columns)
    q_out, q_in = bases.q_out, bases.q_in
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
            unfolded = _unfolded(module, x, out_size, groups, d)
            unfolded = (unfolded @ q_in) if a_before else unfolded
            if cache is not None:
                cache[key] = unfolded
    per_sample = 2 * groups * d * positions + v * c_out * positions + 2 * v * c_out * d
    budget = _CHUNK.get(x.device.type, _CHUNK_OTHER)
    step = min(n, max(1, budget // max(1, per_sample)))
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
            u = _unfolded(module, x[ns], out_size, groups, d)
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
    for ns, vs, pairs in _pair_grads(module, x, f):
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
    """A convolution whose diagonals are taken in its EK-FAC eigenbases (`Bases` on the module).

    Only the reductions the correction sweep uses are defined; quantities that would need
    per-sample gradients in those coordinates raise `NotImplementedError` (the sweep then falls
    back to rotating rows).
    """

    def diag_from_factor(self, record, factors, names, coef, per_sample):  # noqa: D102
        module = record.module
        if per_sample:
            raise NotImplementedError(f"EKFAC's eigenbasis diagonal of {module} is not per sample")
        x, f = _input_and_factor(record, factors)
        if f is None:
            return {name: torch.zeros_like(getattr(module, name)) for name in names}
        return self._squares(record, x, f, names, coef, None)

    def _squares(self, record, x, f, names, coef, sums: dict | None) -> dict[str, Tensor]:
        """The diagonals in the eigenbases; the (plain) gradients into `sums` if given."""
        module = record.module
        bases: Bases = getattr(module, _FIELD)
        result = {}
        if "weight" in names:
            gradient: list[Tensor] | None = None if sums is None else []
            squares = weight_squares(module, x, f, coef, bases, record.extra, gradient)
            result["weight"] = squares.reshape(module.weight.shape)
            if gradient:  # back from the eigenbases, in the weight's layout
                plain = bases.q_out @ gradient[0] @ bases.q_in.T
                if convnd.is_transposed(module):
                    shape = module.weight.shape
                    plain = plain.reshape(shape[1], shape[0], *shape[2:]).transpose(0, 1)
                sums["weight"] = plain.reshape(module.weight.shape)
        if "bias" in names:
            totals = f.sum(tuple(range(3, f.dim())))  # [V, N, C_out]
            if sums is not None:
                sums["bias"] = totals.sum((0, 1))
            if bases.q_bias is not None:
                totals = totals @ bases.q_bias
            sq = totals.square()
            if coef is not None:
                sq = sq * coef.unsqueeze(-1)
            result["bias"] = sq.sum((0, 1))
        return result

    def grad_sum_and_squares(self, record, grad_outputs, names):  # noqa: D102
        """(Σ_n g_n, the squares in the eigenbases), the sum from the same rotated chunks."""
        x, f = _input_and_factor(record, (grad_outputs[0].unsqueeze(0),))
        sums: dict[str, Tensor] = {}
        squares = self._squares(record, x, f, names, None, sums)
        if "weight" in names and "weight" not in sums:  # the "native" way
            sums.update(self.grad_sum(record, grad_outputs, ["weight"]))
        return sums, squares

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "internal: EKFAC's eigenbasis convolution supports diagonals only (a module called "
            "several times per forward?)"
        )

    per_sample_grads = _refuse
    sqrt_factor = _refuse
    batch_l2 = _refuse
    batch_l2_and_sum = _refuse
    batch_dot = _refuse
    grad_sum_and_centred_squares = _refuse
    kron_factors = _refuse


#: convolution class -> its private eigenbasis subclass
_SUBCLASSES: dict[type, type] = {}


def _subclass(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"_EigenBasis{cls.__name__}", (cls,), {"__module__": __name__})
        register_rule(sub)(_EigenConvRule)
        SHAPE_ONLY_OUTPUTS.add(sub)
        _SUBCLASSES[cls] = sub
    return sub


def is_target_class(module: nn.Module) -> bool:
    """Whether `module` is exactly one of torch's convolution classes."""
    return type(module) in CONV_CLASSES


@contextmanager
def eigenbasis_rules(targets: Mapping[nn.Module, Bases]):
    """The target convolutions' diagonals in their eigenbases, for the duration of the block."""
    swapped = []
    try:
        for module, bases in targets.items():
            cls = type(module)
            module.__class__ = _subclass(cls)
            swapped.append((module, cls))
            module.__dict__[_FIELD] = bases
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
            module.__dict__.pop(_FIELD, None)
