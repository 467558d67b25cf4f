"""The second-order store: curvature of each parameter from the factors at its calls' outputs.

The curvature propagation (`backpack.secondorder`) leaves, at every recorded call's output, the
loss-Hessian factors of each loss. Here each call's rule turns them into diagonals, per-sample
diagonals, square roots, Kronecker factors or matrix products for its parameters; parameters
with several calls, several losses or several sets of samples are combined when all reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from backpack import secondorder
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.secondorder import SecondOrderBackpropExtension
from backpack.functional_calls import FunctionalLinear
from backpack.passes.coverage import cover
from backpack.passes.state import GENERIC_RULE, BackwardState, is_are, mixing_message, names_of
from backpack.passes.views import place_rows
from backpack.recording import Record, call_params, describe, get_param, trainable_params
from backpack.rules import find_rule
from backpack.rules.base import ModuleRule

#: largest parameter (number of entries) whose Kronecker "factors" may be its dense curvature
#: block: a one-element list `[B]` with B of shape `[P, P]`, as for a Linear layer's bias
DENSE_BLOCK_MAX_NUMEL = 4096
#: outputs stored as `[V, N, *param.shape]` columns (a Jacobian is a square root without the
#: loss Hessian; `BatchJacobian.stored` turns it sample-major)
_SQRT_LIKE = ("sqrt", "jacobian")


def _check_dense_size(ext: BackpropExtension, param: Tensor, label: str, why: str) -> None:
    if param.numel() > DENSE_BLOCK_MAX_NUMEL:
        raise NotImplementedError(
            f"{ext.__class__.__name__} has no Kronecker factors for {label} ({why}), and its "
            f"curvature block as one dense matrix would be [{param.numel()}, {param.numel()}], "
            f"above backpack.passes.curvature.DENSE_BLOCK_MAX_NUMEL = {DENSE_BLOCK_MAX_NUMEL} "
            "entries per side. Raise that limit if the matrix fits in memory, or use the "
            "diagonal (DiagGGNExact, DiagGGNMC) or matrix products (GGNMP) for this parameter."
        )


def _dense_blocks(
    ext: BackpropExtension,
    record: Record,
    rule: ModuleRule,
    factors: list[Tensor | None],
    names: list[str],
) -> dict[str, list[Tensor]]:
    """`[B]` per parameter: B = Σ_columns Σ_n (Jₙᵀ s)(Jₙᵀ s)ᵀ, its curvature block, flattened.

    For layers without a Kronecker rule (norm layers, BatchNorm in eval mode, layers on the
    torch.func fallback): with the exact factor (KFLR) it is the parameter's GGN block, with a
    sampled one (KFAC) its Monte-Carlo estimate.
    """
    params = call_params(record)
    for name in names:
        label = f"parameter {name} of {describe(record.module)}"
        _check_dense_size(ext, params[name], label, "its layer has no Kronecker rule")
    roots = rule.sqrt_factor(record, factors, names)
    return {name: [gram_of(roots[name].reshape(-1, params[name].numel()))] for name in names}


def gram_of(rows: Tensor) -> Tensor:
    """`rowsᵀ rows`: the sum of the outer products of the rows."""
    return rows.T @ rows


def nearest_kronecker(pairs: list[list[Tensor]]) -> list[Tensor]:
    """`[R, C]` with R ⊗ C nearest (Frobenius norm) to Σᵤ Rᵤ ⊗ Cᵤ (Van Loan and Pitsianis).

    The sum is rearranged into the rank-U matrix Σᵤ vec(Rᵤ) vec(Cᵤ)ᵀ, whose best rank-one
    approximation needs only the U x U Gram matrices of the R's and of the C's. For positive
    semi-definite factors the Gram matrices are non-negative, so R and C are non-negative
    combinations of the Rᵤ and Cᵤ (positive semi-definite too). Uses with equal input-side
    factors give their exact sum, (Σᵤ Rᵤ) ⊗ C.
    """
    rs, cs = [r for r, _ in pairs], [c for _, c in pairs]
    gram_r, gram_c = _gram_of_flattened(rs), _gram_of_flattened(cs)
    x = _leading_eigenvector(gram_c @ gram_r)
    x = x * torch.where(x.sum() >= 0, 1.0, -1.0)
    weight = x @ gram_r @ x
    ok = weight > 0  # both factors zero where the sum is zero
    y = torch.where(ok, gram_r @ x / torch.where(ok, weight, 1.0), 0.0)
    x = torch.where(ok, x, 0.0)
    # combined in place, in the factors' own dtype: a vocabulary-sized factor ([V, V] of a tied
    # embedding and output layer) must not be stacked or copied to float64
    return [_combine(rs, x), _combine(cs, y)]


def _leading_eigenvector(mat: Tensor) -> Tensor:
    """An eigenvector of the largest eigenvalue of `mat` (`[U, U]`, real spectrum).

    For the usual two uses of a tied weight it is the 2 x 2 closed form, computed where `mat`
    lives without reading a value on the host (a GPU does not wait; meta tensors are counted).
    """
    if mat.shape[0] != 2:
        values, vectors = torch.linalg.eig(mat)
        return vectors[:, values.real.argmax()].real
    (a, b), (c, d) = mat
    root = ((a - d).square() + 4 * b * c).clamp_min(0).sqrt()
    top = (a + d + root) / 2
    # (mat - top I) x = 0: either row gives x; the longer candidate is the better conditioned
    first, second = torch.stack([b, top - a]), torch.stack([top - d, c])
    x = torch.where(first.norm() >= second.norm(), first, second)
    # a diagonal matrix (both candidates zero): the unit vector of its larger entry
    unit = torch.stack([(a >= d).to(mat.dtype), (a < d).to(mat.dtype)])
    x = torch.where(x.norm() > 0, x, unit)
    return x / x.norm()


def _gram_of_flattened(mats: list[Tensor]) -> Tensor:
    """`[U, U]` float64 Gram matrix of the flattened `mats`, where they live.

    Dot products row by row in the factors' dtype, summed in float64: no float64 copy of a
    vocabulary-sized factor.
    """
    rows = [m.reshape(m.shape[0] if m.dim() > 1 else 1, -1) for m in mats]
    entries = {}
    for u, ru in enumerate(rows):
        for v in range(u, len(rows)):
            entries[u, v] = torch.einsum("ij,ij->i", ru, rows[v]).double().sum()
    n = len(rows)
    return torch.stack(
        [torch.stack([entries[min(u, v), max(u, v)] for v in range(n)]) for u in range(n)]
    )


def _combine(mats: list[Tensor], weights: Tensor) -> Tensor:
    """`Σᵤ weights[u] · mats[u]` in one new tensor (`weights` where `mats` live)."""
    weights = weights.to(mats[0].dtype)
    result = mats[0] * weights[0]
    for u, m in enumerate(mats[1:], 1):
        result.addcmul_(m, weights[u])
    return result


def _zero_product(mat: Tensor) -> Tensor:
    """The curvature matrix product of a batch without samples."""
    return torch.zeros_like(mat)


class _SqrtPieces:
    """Square-root factors `[V_l, n, *S]` of one parameter, assembled at the end of the pass.

    Each piece belongs to one loss call (its columns) and one call's samples (its rows); pieces
    at the same columns and rows add (calls sharing samples: cross terms included).
    """

    def __init__(self, param: Tensor, rows: int) -> None:
        self.param = param
        #: number of sample rows of the result (all the pass's samples)
        self.rows = rows
        self.pieces: list[tuple[int, int, Tensor]] = []

    def add(self, loss_pos: int, placement: tuple[int, int] | None, piece: Tensor) -> None:
        self.pieces.append((loss_pos, 0 if placement is None else placement[0], piece))

    def assemble(self, columns: dict[int, int]) -> Tensor:
        """`[V, N, *S]`: every loss's columns in loss order (zero where a loss misses)."""
        for pos, _, piece in self.pieces:
            columns.setdefault(pos, piece.shape[0])
        offsets, start = {}, 0
        for pos in sorted(columns):
            offsets[pos] = start
            start += columns[pos]
        # in the pieces' dtype: float32 for 16-bit weights (rules compute in float32)
        dtype = self.pieces[0][2].dtype if self.pieces else self.param.dtype
        full = self.param.new_zeros(start, self.rows, *self.param.shape, dtype=dtype)
        for pos, row, piece in self.pieces:
            c = offsets[pos]
            full[c : c + piece.shape[0], row : row + piece.shape[1]] += piece
        return full


class _ParamCurvature:
    """Second-order contributions of one parameter in a pass, combined when all calls reported.

    Used when the parameter has several calls in the pass, or when the pass has several losses or
    sets of samples and a square root must be assembled from pieces.
    """

    def __init__(self, param: Tensor, name: str, expected_uses: int) -> None:
        self.param = param
        self.name = name
        self.expected = expected_uses
        self.seen = 0
        #: (record, rule, placement) of each call
        self.calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]] = []

    def add(self, record: Record, rule: ModuleRule, placement: tuple[int, int] | None) -> None:
        self.calls.append((record, rule, placement))
        self.seen += 1


def run_second_order(
    state: BackwardState, record: Record, grads: tuple[Tensor | None, ...]
) -> bool:
    """Second-order quantities of one call; True if some wait for other uses."""
    module = record.module
    params = trainable_params(module)
    if not params:
        return False
    exts = state.second_order
    names = names_of(exts)
    if not state.loss_seen:
        raise RuntimeError(
            f"{names} could not find a loss function backpack knows in this backward pass. "
            "Second-order extensions start from the loss: extend it, e.g. "
            "lossfunc = extend(torch.nn.CrossEntropyLoss()), and call backward on its "
            "output (or a weighted sum of such outputs). Losses called as functions are "
            "recognised too: F.cross_entropy (without label_smoothing), F.mse_loss, "
            "F.binary_cross_entropy_with_logits."
        )
    sited = secondorder.SITE_PARAMS in record.extra
    rule = SITE_RULE if sited else find_rule(module) or GENERIC_RULE
    if rule.mixes_samples(record):
        raise NotImplementedError(f"{names} {is_are(exts)} {mixing_message(module)}")
    if record.recomputed:
        raise NotImplementedError(
            f"{names} cannot reach {describe(module)}: it runs inside "
            "torch.utils.checkpoint(..., use_reentrant=True), whose forward is recomputed "
            "during the backward, after the curvature factors were propagated. Use "
            "torch.utils.checkpoint(..., use_reentrant=False) (first-order extensions work "
            "with both)."
        )
    record.check_unmodified(exts[0].__class__.__name__)
    filled = tuple(torch.zeros_like(o) if g is None else g for g, o in zip(grads, record.outputs))
    placement = state.layout.placement(record)
    if rule.batch_size(record) == 0 and placement is None:
        _store_empty_second_order(state, record, params)
        return False
    for name, p in params.items():
        if not sited:  # a site is the parameter's only use (`samples.ParamSite`)
            cover(state, record, filled, rule, name, p, None)
    direct, shared = state.split_uses(record, params)
    if direct:
        for ext in exts:
            if ext.factor == "sum":
                continue  # KFRA writes its factors from the module chain
            values = _second_order_values(state, ext, record, rule, direct, placement)
            for name in direct:
                if name in values:
                    setattr(params[name], ext.savefield, ext.stored(values[name]))
    for name, uses in shared:
        p = params[name]
        curvature = state.curvatures.get(id(p))
        if curvature is None:
            curvature = state.curvatures[id(p)] = _ParamCurvature(p, name, uses)
        curvature.add(record, rule, placement)
        if curvature.seen >= curvature.expected:
            finalize_curvature(state, curvature)
    return any(id(p) in state.curvatures for p in params.values())


class SiteRule(ModuleRule):
    """A rule-less call whose own parameters' square roots were read at their sites.

    `secondorder.site_calls`: the call's factor holds them, `[V, N, P]` flattened and
    concatenated in the order of `record.extra[secondorder.SITE_PARAMS]` (after the sample
    count). Diagonals and dense Kronecker blocks follow from the square roots (the base rule's
    defaults).
    """

    def batch_size(self, record: Record) -> int:  # noqa: D102
        return record.extra[secondorder.SITE_PARAMS][0]

    def sqrt_factor(self, record, factors, names, subsampling=None):  # noqa: D102
        flat = next(f for f in factors if f is not None)
        layout = record.extra[secondorder.SITE_PARAMS][1]
        parts = flat.split([math.prod(shape) for _, shape in layout], dim=2)
        roots = {
            name: part.reshape(*flat.shape[:2], *shape)
            for (name, shape), part in zip(layout, parts)
            if name in names
        }
        if subsampling is not None:
            index = torch.as_tensor(subsampling, dtype=torch.long, device=flat.device)
            roots = {name: root.index_select(1, index) for name, root in roots.items()}
        return roots


SITE_RULE = SiteRule()


def _store_empty_second_order(
    state: BackwardState, record: Record, params: dict[str, Tensor]
) -> None:
    """A call without samples: zero curvature, empty per-sample terms."""
    for ext in state.second_order:
        if ext.factor == "sum":
            continue
        if ext.output == "kron":
            raise NotImplementedError(
                f"{ext.__class__.__name__} got a batch without samples at "
                f"{describe(record.module)}: Kronecker input factors are means over the "
                "samples. Skip empty batches."
            )
        columns = sum(v for v, _ in state.loss_columns.get(ext.factor_key, {}).values())
        for p in params.values():
            if ext.output == "diag":
                value: Any = torch.zeros_like(p)
            elif ext.output == "batch_diag":
                value = p.new_zeros(0, *p.shape)
            elif ext.output in _SQRT_LIKE:
                value = ext.stored(p.new_zeros(columns, 0, *p.shape))
            else:
                value = _zero_product
            setattr(p, ext.savefield, value)


def _simple_sqrt(
    state: BackwardState, ext: SecondOrderBackpropExtension, record: Record, placement
) -> bool:
    """Whether a call's square root is its only term's factor as is (no assembly)."""
    terms = secondorder.terms_for(record, ext)
    columns = state.loss_columns.get(ext.factor_key, {})
    return placement is None and len(columns) <= 1 and len(terms) == 1 and terms[0][2] > 0


def _second_order_values(
    state: BackwardState,
    ext: SecondOrderBackpropExtension,
    record: Record,
    rule: ModuleRule,
    names: list,
    placement: tuple[int, int] | None,
) -> dict[str, Any]:
    entries = secondorder.entries_for(record, ext)
    module = record.module
    if ext.output in ("diag", "batch_diag"):
        per_sample = ext.output == "batch_diag"
        if not entries:
            n = rule.batch_size(record) if per_sample else None
            values = secondorder.zero_like_params(module, names, n)
        else:
            values = secondorder.reduce_entries(record, entries, names, per_sample, rule)
        if per_sample and placement is not None:
            values = {k: place_rows(v, *placement) for k, v in values.items()}
        return values
    if ext.output in _SQRT_LIKE:
        _check_signs(state, ext, record)
        terms = secondorder.terms_for(record, ext)
        if _simple_sqrt(state, ext, record, placement):
            into = getattr(ext, "destinations", None)
            if into:
                out = {n: into.get(id(get_param(module, n))) for n in names}
                return rule.sqrt_factor_into(record, terms[0][1], names, ext.get_subsampling(), out)
            return rule.sqrt_factor(record, terms[0][1], names, ext.get_subsampling())
        # several losses or sets of samples: the pieces are assembled when the pass ends
        rows = rule.batch_size(record) if placement is None else placement[1]
        for name in names:
            _pieces(state, ext, get_param(module, name), rows)
        for pos, factors, _ in terms:
            pieces = rule.sqrt_factor(record, factors, names)
            for name in names:
                target = _pieces(state, ext, get_param(module, name), rows)
                target.add(pos, placement, pieces[name])
        return {}
    if ext.output == "kron":
        return _kron(state, ext, record, rule, names) or {}
    # "mp": a matrix-product closure per parameter
    return {n: secondorder.matrix_product([(record, entries)], n) for n in names}


def _kron(
    state: BackwardState,
    ext: SecondOrderBackpropExtension,
    record: Record,
    rule: ModuleRule,
    names: list,
) -> dict[str, list[Tensor]] | None:
    """Kronecker factors of one call from all losses' factors at its outputs.

    The output-side factor (first in each list) sums over losses; a loss entering with a
    negative weight is subtracted.
    """
    terms = []
    for sign in (1.0, -1.0):
        factors = secondorder.joint_factors(record, ext, sign)
        if factors is None:
            continue
        kron = rule.kron_factors(record, factors, names, ext.kfac_approx) or {}
        missing = [name for name in names if name not in kron]
        if missing:  # no Kronecker rule: the parameter's whole curvature block
            kron = {**kron, **_dense_blocks(ext, record, rule, factors, missing)}
        terms.append((kron, sign))
    # terms whose G was summed column by column during the propagation
    reduced = record.extra.get("reduced_kron", {}).get(ext.factor_key, {})
    for pos in sorted(reduced):
        by_approx, sign = reduced[pos]
        kron = {k: v for k, v in by_approx[ext.kfac_approx].items() if k in names}
        terms.append((kron, sign))
    result = None
    for kron, sign in terms:
        if sign < 0:
            kron = {k: [-v[0], *v[1:]] for k, v in kron.items()}
        if result is None:
            result = kron
        else:
            result = {k: [result[k][0] + v[0], *result[k][1:]] for k, v in kron.items()}
    return result


def _check_signs(state: BackwardState, ext: SecondOrderBackpropExtension, record: Record) -> None:
    for pos, _, sign in secondorder.terms_for(record, ext):
        if sign < 0:
            loss = state.layout.losses[pos].module if state.layout.losses else None
            what = describe(loss) if loss is not None else "a loss function"
            raise NotImplementedError(
                f"{ext.__class__.__name__}: {what} enters this backward with a negative "
                "weight, so its curvature has no real square root. Diagonals, Kronecker "
                "factors and matrix products (DiagGGNExact, KFLR, GGNMP, ...) support "
                "negative weights."
            )


def _pieces(
    state: BackwardState, ext: SecondOrderBackpropExtension, param: Tensor, rows: int
) -> _SqrtPieces:
    key = (id(param), ext.savefield)
    entry = state.sqrt_pieces.get(key)
    if entry is None:
        entry = state.sqrt_pieces[key] = (ext, _SqrtPieces(param, rows))
    return entry[1]


def assemble_sqrt(state: BackwardState) -> None:
    """Store square roots that several losses or sets of samples contributed to."""
    pending, state.sqrt_pieces = state.sqrt_pieces, {}
    for ext, pieces in pending.values():
        columns = {pos: v for pos, (v, _) in state.loss_columns.get(ext.factor_key, {}).items()}
        full = pieces.assemble(columns)
        subsampling = ext.get_subsampling()
        if subsampling is not None:
            index = torch.as_tensor(subsampling, dtype=torch.long, device=full.device)
            full = full[:, index]
        setattr(pieces.param, ext.savefield, ext.stored(full))


def finalize_curvature(state: BackwardState, curvature: _ParamCurvature) -> None:
    """Second-order quantities of a parameter with several calls in the pass."""
    state.curvatures.pop(id(curvature.param), None)
    calls = curvature.calls
    if not calls:
        return
    param, name = curvature.param, curvature.name
    groups: dict[Any, list] = {}
    for call in calls:
        groups.setdefault(None if call[2] is None else call[2][0], []).append(call)
    cross = any(len(members) > 1 for members in groups.values())
    for ext in state.second_order:
        if ext.factor == "sum":
            continue
        value = _shared_value(state, ext, param, name, calls, cross)
        if value is not None:
            setattr(param, ext.savefield, ext.stored(value))


def _shared_value(
    state: BackwardState,
    ext: SecondOrderBackpropExtension,
    param: Tensor,
    name: str,
    calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]],
    cross: bool,
) -> Any:
    # name the parameter by its module, not by a functional call's stand-in
    owner = next(
        (c[0].module for c in calls if not isinstance(c[0].module, FunctionalLinear)),
        calls[0][0].module,
    )
    label = f"parameter {name} of {describe(owner)}"
    if ext.output == "mp":
        return _shared_product(state, ext, name, calls)
    if ext.output == "kron":
        if cross:
            return _tied_kron(state, ext, param, name, calls, label)
        return _shared_kron(state, ext, name, calls)
    if ext.residual is not None:
        if cross:
            raise NotImplementedError(
                f"{ext.__class__.__name__} does not support {label}: it is used several "
                "times on the same samples (the Hessian's cross terms between the uses are "
                "not computed). Use DiagGGNExact or GGNMP, or a model without reuse."
            )
        total = None
        for record, rule, placement in calls:
            values = _second_order_values(state, ext, record, rule, [name], placement)
            value = values[name]
            total = value if total is None else total + value
        return total
    if ext.output in ("diag", "batch_diag") and not cross:
        total = None
        for record, rule, placement in calls:
            value = _second_order_values(state, ext, record, rule, [name], placement)[name]
            total = value if total is None else total + value
        return total
    # square roots of all calls (cross terms between calls on the same samples included)
    full, sign = _joint_sqrt(state, ext, param, name, calls)
    if ext.output in _SQRT_LIKE:
        subsampling = ext.get_subsampling()
        if subsampling is not None:
            full = full[:, torch.as_tensor(subsampling, dtype=torch.long, device=full.device)]
        return full
    squares = full.square() * sign.reshape(-1, *([1] * (full.dim() - 1)))
    return squares.sum(0) if ext.output == "batch_diag" else squares.sum((0, 1))


def _joint_sqrt(
    state: BackwardState,
    ext: SecondOrderBackpropExtension,
    param: Tensor,
    name: str,
    calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]],
) -> tuple[Tensor, Tensor]:
    """`[V, N, *P]` square root of all calls' curvature (cross terms included), column signs."""
    record, rule, placement = calls[0]
    pieces = _SqrtPieces(param, rule.batch_size(record) if placement is None else placement[1])
    columns = {p: v for p, (v, _) in state.loss_columns.get(ext.factor_key, {}).items()}
    signs = {p: s for p, (_, s) in state.loss_columns.get(ext.factor_key, {}).items()}
    for record, rule, placement in calls:
        if ext.output in _SQRT_LIKE:
            _check_signs(state, ext, record)
        for pos, factors, _ in secondorder.terms_for(record, ext):
            piece = rule.sqrt_factor(record, factors, [name])[name]
            pieces.add(pos, placement, piece)
    full = pieces.assemble(columns)
    sign = torch.cat([full.new_full((columns[p],), signs.get(p, 1.0)) for p in sorted(columns)])
    return full, sign


def _tied_kron(
    state: BackwardState,
    ext: SecondOrderBackpropExtension,
    param: Tensor,
    name: str,
    calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]],
    label: str,
) -> list[Tensor]:
    """Kronecker factors of a parameter used several times on the same samples (tied weights).

    When every use has a Kronecker pair, each pair is oriented as the parameter is stored (a
    rule naming the parameter in `KRON_TRANSPOSED` gives the factors of its transpose, as an
    embedding does), and the result is the Kronecker product nearest to the sum of the uses'
    products (`nearest_kronecker`). Like KFAC's "expand" treatment of the positions of a
    sequence, it leaves out the cross terms between uses; for uses with equal input-side
    factors it is exactly "expand" with the uses as extra positions. Otherwise (a use without
    a Kronecker pair, or a bias) the parameter gets its exact curvature block `[B]`, cross
    terms between the uses included, within `DENSE_BLOCK_MAX_NUMEL`.
    """
    pairs = []
    for record, rule, _ in calls:
        kron = _kron(state, ext, record, rule, [name]) if _has_kron(rule, record) else None
        factors = [] if kron is None else list(kron[name])
        if len(factors) != 2:
            break
        if name in getattr(rule, "KRON_TRANSPOSED", ()):
            factors.reverse()
        pairs.append(factors)
    else:
        return nearest_kronecker(pairs)
    _check_dense_size(ext, param, label, "it is used several times on the same samples")
    full, sign = _joint_sqrt(state, ext, param, name, calls)
    flat = full.reshape(full.shape[0], -1, param.numel())
    return [torch.einsum("v,vnp,vnq->pq", sign.to(flat.dtype), flat, flat)]


def _has_kron(rule: ModuleRule, record: Record) -> bool:
    """Whether the rule has Kronecker factors of its own (not the dense fallback)."""
    return type(rule).kron_factors is not ModuleRule.kron_factors


def _shared_kron(
    state: BackwardState,
    ext: SecondOrderBackpropExtension,
    name: str,
    calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]],
) -> list[Tensor] | None:
    """Kronecker factors of a parameter whose calls hold different samples.

    The first factor sums over samples (it adds up); the others are means over a call's
    samples (weighted by the calls' sample counts).
    """
    result: list[Tensor] | None = None
    weights = 0
    for record, rule, _ in calls:
        kron = _kron(state, ext, record, rule, [name])
        if kron is None:
            continue
        n = rule.batch_size(record)
        factors_of = kron[name]
        if result is None:
            result = [factors_of[0]] + [f * n for f in factors_of[1:]]
        else:
            result[0] = result[0] + factors_of[0]
            for i, f in enumerate(factors_of[1:], 1):
                result[i] = result[i] + f * n
        weights += n
    if result is None:
        return None
    return [result[0]] + [f / weights for f in result[1:]]


def _shared_product(
    state: BackwardState,
    ext: SecondOrderBackpropExtension,
    name: str,
    calls: list[tuple[Record, ModuleRule, tuple[int, int] | None]],
) -> Callable[[Tensor], Tensor]:
    """Matrix products of a shared parameter: cross terms within each set of samples."""
    groups: dict[Any, list] = {}
    for record, _, placement in calls:
        key = None if placement is None else placement[0]
        groups.setdefault(key, []).append(record)
    products = []
    for records in groups.values():
        if len(records) == 1:
            entries = secondorder.entries_for(records[0], ext)
            products.append(secondorder.matrix_product([(records[0], entries)], name))
            continue
        if ext.residual is not None:
            raise NotImplementedError(
                f"{ext.__class__.__name__} does not support parameter {name} of "
                f"{describe(records[0].module)}: it is used several times on the same "
                "samples (the Hessian's cross terms between the uses are not computed)."
            )
        uses = secondorder.aligned_entries(records, ext)
        products.append(secondorder.matrix_product(uses, name))
    if len(products) == 1:
        return products[0]

    def product(mat: Tensor) -> Tensor:
        result = products[0](mat)
        for other in products[1:]:
            result = result + other(mat)
        return result

    return product
