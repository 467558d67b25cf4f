"""Second-order part of the engine: loss-Hessian factors propagated by autograd.

When the gradient reaches an extended loss, the loss rule factorises the loss Hessian w.r.t. the
model output (S, `[V, N, *out]`). One batched vector-Jacobian product
(`torch.autograd.grad(..., is_grads_batched=True)`) carries S from the model output to the outputs
of every recorded parametrized module. Because autograd does the propagation, residual additions,
functional ops and custom forwards need no conversion.

For the exact Hessian (DiagHessian, HMP) and its positive-curvature variant (PCHMP), each
elementwise activation module with a second derivative adds a residual term: with δ the gradient
at its output and z its input, r = δ ⊙ φ''(z) is a diagonal curvature at z, factorised as
sqrt(|r|) times unit columns and a sign, and propagated the same way to upstream modules. That
only covers nonlinearities that are modules, so those extensions check the graph for functional
nonlinearities first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backpack.recording import Record, records_at
from backpack.rules import find_rule
from backpack.rules.activations import find_activation_rule, is_curvature_free
from backpack.rules.base import ModuleRule
from backpack.rules.generic import FuncRule
from backpack.rules.losses import find_loss_rule

if TYPE_CHECKING:  # pragma: no cover
    from backpack.engine import Engine
    from backpack.extensions.secondorder import SecondOrderBackpropExtension

#: graph nodes a residual-aware extension may meet outside modules: their second derivative
#: vanishes (linear, or piecewise linear almost everywhere)
_CURVATURE_FREE_NODES = {
    "AddBackward0",
    "AddBackward1",
    "SubBackward0",
    "SubBackward1",
    "NegBackward0",
    "ViewBackward0",
    "ReshapeAliasBackward0",
    "UnsafeViewBackward0",
    "PermuteBackward0",
    "TransposeBackward0",
    "TransposeBackward1",
    "TBackward0",
    "CloneBackward0",
    "ExpandBackward0",
    "SliceBackward0",
    "SelectBackward0",
    "CatBackward0",
    "StackBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SqueezeBackward2",
    "SqueezeBackward3",
    "SqueezeBackward4",
    "UnsqueezeBackward0",
    "SumBackward0",
    "SumBackward1",
    "MeanBackward0",
    "MeanBackward1",
    "ReluBackward0",
    "ThresholdBackward0",
    "ThresholdBackward1",
    "torch::autograd::AccumulateGrad",
    "SplitBackward0",
    "SplitWithSizesBackward0",
    "UnbindBackward0",
    "IndexBackward0",
    "ConstantPadNdBackward0",
    "FlattenBackward0",
    "AsStridedBackward0",
    "MaxPool1DWithIndicesBackward0",
    "MaxPool2DWithIndicesBackward0",
    "MaxPool3DWithIndicesBackward0",
    "AvgPool2DBackward0",
    "AvgPool3DBackward0",
    "AdaptiveAvgPool2DBackward0",
    "AdaptiveAvgPool3DBackward0",
    "LeakyReluBackward0",
    "LeakyReluBackward1",
    "HardtanhBackward0",
    "HardtanhBackward1",
    "CopySlices",
    "AliasBackward0",
    "ExpandAsBackward0",
    "RepeatBackward0",
}
#: products and quotients are linear when only one operand depends on the parameters
_LINEAR_IF_ONE_OPERAND = {"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"}


def graph_records(edge: Any) -> Iterator[tuple[Record, int, GradientEdge]]:
    """Records of module outputs reachable backward from `edge` (each once), with their edges."""
    if edge is None:
        return
    stack = [edge.node]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for record, index, output_nr in records_at(node):
            yield record, index, GradientEdge(node, output_nr)
        stack.extend(next_node for next_node, _ in node.next_functions)


def _is_parametrized(record: Record) -> bool:
    return any(p.requires_grad for p in record.module.parameters(recurse=False))


def propagate(
    engine: Engine, output_edge: GradientEdge, targets: list[GradientEdge], factor: Tensor
) -> list[Tensor | None]:
    """Backpropagate the columns of `factor` (`[V, *output]`) from `output_edge` to `targets`."""
    if not targets:
        return []
    engine.propagating = True
    try:
        try:
            return list(
                torch.autograd.grad(
                    [output_edge],
                    targets,
                    [factor],
                    retain_graph=True,
                    allow_unused=True,
                    is_grads_batched=True,
                )
            )
        except RuntimeError:
            # some operation has no batching rule: one vector-Jacobian product per column
            columns = [
                torch.autograd.grad(
                    [output_edge], targets, [column], retain_graph=True, allow_unused=True
                )
                for column in factor
            ]
            return [
                None if column_results[0] is None else torch.stack(column_results)
                for column_results in zip(*columns)
            ]
    finally:
        engine.propagating = False


_GENERIC = FuncRule()


class Entry:
    """One term of a curvature block: Σ_{v,n} coef[v,n] · (Jᵀ f_vn)(Jᵀ f_vn)ᵀ.

    `factors[i]` is the factor at the module's i-th output, `[V, N, *out_i]` (None if that output
    does not influence the loss); `coef` is None (all ones) or `[V, N]`.
    """

    __slots__ = ("factors", "coef")

    def __init__(self, factors: list[Tensor | None], coef: Tensor | None = None) -> None:
        self.factors = factors
        self.coef = coef


def _needs_residual(exts: list[SecondOrderBackpropExtension]) -> set[str]:
    return {e.residual for e in exts if e.residual is not None}


def check_module_graph(loss_record: Record, exts: list[SecondOrderBackpropExtension]) -> None:
    """Raise if a nonlinearity between parameters and loss is not an extended module."""
    names = ", ".join(sorted({e.__class__.__name__ for e in exts}))
    edge = loss_record.input_edges[0] if loss_record.input_edges else None
    if edge is None:
        return
    stack, seen = [edge.node], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        records = [r for r, _, _ in records_at(node)]
        if records:
            for record in records:
                module = record.module
                if not is_curvature_free(module) and find_activation_rule(module) is None:
                    raise NotImplementedError(
                        f"{names} cannot handle {module.__class__.__name__} ({module}): its "
                        "second derivatives are not supported. Supported are elementwise "
                        "activation modules and layers that are linear in their input."
                    )
                if record.inplace:  # its only node is the one we are at
                    stack.extend(n for n, _ in node.next_functions)
                else:
                    stack.extend(e.node for e in record.input_edges if e is not None)
            continue
        name = node.name()
        operands = sum(n is not None for n, _ in node.next_functions)
        linear_product = name in _LINEAR_IF_ONE_OPERAND and operands <= 1
        if name not in _CURVATURE_FREE_NODES and not linear_product:
            raise NotImplementedError(
                f"{names} need every nonlinear operation between the parameters and the loss "
                f"to be an extended module, but found the functional operation {name} outside "
                "any module. Replace it by its module (e.g. torch.tanh -> nn.Tanh()) or extend "
                "the model with extend(model, use_converter=True)."
            )
        stack.extend(n for n, _ in node.next_functions)


def on_loss_backward(engine: Engine, record: Record, grads: tuple[Tensor | None, ...]) -> None:
    """Factorise the loss Hessian and propagate it to all parametrized module outputs."""
    exts = engine.second_order
    module = record.module
    rule = find_loss_rule(module)
    names = ", ".join(e.__class__.__name__ for e in exts)
    if rule is None:
        raise NotImplementedError(
            f"{names} does not support the loss function {module.__class__.__name__}. Supported: "
            "MSELoss, CrossEntropyLoss, BCEWithLogitsLoss."
        )
    for ext in exts:
        rule.check(module, ext.__class__.__name__)
    scale = grads[0]
    if scale is None or scale.numel() != 1:
        raise NotImplementedError(f"{names} needs a scalar loss.")
    scale_value = float(scale)
    if scale_value < 0:
        raise NotImplementedError(
            f"{names}: the loss enters the differentiated quantity with a negative factor "
            f"({scale_value}), so its curvature has no real square root."
        )
    engine.loss_seen = True
    out_edge = record.input_edges[0] if record.input_edges else None
    if out_edge is None:
        return
    if _needs_residual(exts):
        # KFRA needs no such check: its recursion only uses Jacobians (see backpack.kfra)
        check_module_graph(record, [e for e in exts if e.residual])
    found = [(r, i, e) for r, i, e in graph_records(out_edge) if _is_parametrized(r)]
    keys = sorted({e.factor_key for e in exts if e.factor != "sum"})
    if keys:
        factors = []
        for key in keys:
            if key[0] == "exact":
                s = rule.sqrt_hessian(record)
            else:
                s = rule.sqrt_hessian_sampled(record, key[1])
            factors.append(s * scale_value**0.5 if scale_value != 1 else s)
        sizes = [f.shape[0] for f in factors]
        results = propagate(engine, out_edge, [e for _, _, e in found], torch.cat(factors))
        for (target, index, _), result in zip(found, results):
            per_key = target.extra.setdefault("factors", {})
            parts = [None] * len(sizes) if result is None else result.split(sizes)
            for key, part in zip(keys, parts):
                slot = per_key.setdefault(key, [None] * len(target.outputs))
                slot[index] = part
    if any(e.factor == "sum" for e in exts):
        from backpack.kfra import start_kfra

        start_kfra(engine, record, rule.sum_hessian(record) * scale_value)


def on_activation_backward(
    engine: Engine, record: Record, grads: tuple[Tensor | None, ...]
) -> None:
    """Add the activation's residual curvature to the modules before it."""
    modes = _needs_residual(engine.second_order)
    if not modes or not engine.loss_seen:
        return
    rule = find_activation_rule(record.module)
    if rule is None or grads[0] is None:
        return
    z = record.args[0]
    d2 = rule.second_derivative(record)
    if d2 is None:
        return
    edge = record.input_edges[0] if record.input_edges else None
    if edge is None:
        raise NotImplementedError(
            f"{record.module.__class__.__name__} ran in place, so the curvature extensions "
            "cannot reach its input. Use inplace=False."
        )
    residual = (grads[0] * d2).reshape(z.shape[0], -1)  # [N, D]
    columns = residual.ne(0).any(0).nonzero().squeeze(1)
    if columns.numel() == 0:
        return
    found = [(r, i, e) for r, i, e in graph_records(edge) if _is_parametrized(r)]
    if not found:
        return
    n, d = residual.shape
    selected = residual[:, columns].T  # [V, N]
    for mode in modes:
        if mode == "signed":
            magnitude, coef = selected.abs(), selected.sign()
        elif mode == "clip":
            magnitude, coef = selected.clamp_min(0), None
        else:
            magnitude, coef = selected.abs(), None
        unit = torch.zeros(columns.numel(), n, d, dtype=z.dtype, device=z.device)
        unit.scatter_(2, columns.reshape(-1, 1, 1).expand(-1, n, 1), magnitude.sqrt().unsqueeze(2))
        results = propagate(engine, edge, [e for _, _, e in found], unit.reshape(-1, *z.shape))
        for (target, index, _), result in zip(found, results):
            if result is None:
                continue
            entry_list = target.extra.setdefault("residuals", {}).setdefault(mode, [])
            factors: list[Tensor | None] = [None] * len(target.outputs)
            factors[index] = result
            entry_list.append(Entry(factors, coef))


def entries_for(record: Record, ext: SecondOrderBackpropExtension) -> list[Entry]:
    """The curvature terms of `record` that `ext` sums: the GGN factor and its residuals."""
    factors = record.extra.get("factors", {}).get(ext.factor_key)
    entries = [] if factors is None else [Entry(factors)]
    if ext.residual is not None:
        entries.extend(record.extra.get("residuals", {}).get(ext.residual, []))
    return entries


def reduce_entries(
    record: Record,
    entries: list[Entry],
    names: list[str],
    per_sample: bool,
    rule: ModuleRule,
) -> dict[str, Tensor]:
    """Σ_entries Σ_v coef (Jᵀ f)², summed over samples unless `per_sample`."""
    total: dict[str, Tensor] = {}
    for entry in entries:
        part = rule.diag_from_factor(record, entry.factors, names, entry.coef, per_sample)
        for name, value in part.items():
            total[name] = value if name not in total else total[name] + value
    return total


def matrix_product(uses: list[tuple[Record, list[Entry]]], name: str) -> Callable[[Tensor], Tensor]:
    """A function M ↦ block · M for parameter `name`, the block being Σ_entries coef JᵀffᵀJ.

    `uses` lists each call of the parameter's module(s) with the entries at its outputs; entries
    at the same position of each use's list belong to the same term (cross terms between uses
    included).
    """
    snapshots = []
    for record, entries in uses:
        rule = find_rule(record.module) or _GENERIC
        axes = rule.output_batch_axes(record)
        snapshots.append(
            (record.module, record.args, record.kwargs, record.out_requires_grad, entries, axes)
        )
    n_entries = len(uses[0][1]) if uses else 0

    def product(mat: Tensor) -> Tensor:
        from backpack.rules.generic import jvp_outputs, vjp_params

        result = torch.zeros_like(mat)
        tangents = [jvp_outputs(m, a, kw, name, mat, rg) for m, a, kw, rg, _, _ in snapshots]
        for e in range(n_entries):
            # t[k, v, n] = Σ_uses <f_vn, J_use M_k>, contracting each sample's slice
            t = None
            for (_, _, _, _, entries, axes), outs in zip(snapshots, tangents):
                for factor, tangent, axis in zip(entries[e].factors, outs, axes):
                    if factor is None:
                        continue
                    f = factor.movedim(1 + axis, 1).flatten(2)
                    contrib = torch.einsum(
                        "vnd,knd->kvn", f, tangent.movedim(1 + axis, 1).flatten(2)
                    )
                    t = contrib if t is None else t + contrib
            if t is None:
                continue
            coef = uses[0][1][e].coef
            if coef is not None:
                t = t * coef
            for module, args, kwargs, req, entries, axes in snapshots:
                cots = []
                for f, axis in zip(entries[e].factors, axes):
                    if f is None:
                        cots.append(None)
                        continue
                    moved = f.movedim(1 + axis, 1)
                    cot = torch.einsum("kvn,vnd->knd", t, moved.flatten(2))
                    cots.append(cot.reshape(t.shape[0], *moved.shape[1:]).movedim(1, 1 + axis))
                result = result + vjp_params(module, args, kwargs, name, cots, req)
        return result

    return product


def zero_like_params(module: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """Zeros shaped like the named parameters (modules the loss does not depend on)."""
    return {n: torch.zeros_like(getattr(module, n)) for n in names}
