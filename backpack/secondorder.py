"""The curvature propagation pass: loss-Hessian factors propagated by autograd.

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

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backpack.context import CTX
from backpack.recording import (
    Record,
    call_params,
    describe,
    get_param,
    is_parametrized,
    nearest_records,
    promote_half,
    records_at,
    walk_nodes,
)
from backpack.rules import find_rule
from backpack.rules.activations import (
    elementwise_derivative,
    find_activation_rule,
    is_curvature_free,
)
from backpack.rules.base import ModuleRule
from backpack.rules.generic import FuncRule
from backpack.rules.losses import find_loss_rule, identity_columns

if TYPE_CHECKING:  # pragma: no cover
    from backpack.extensions.secondorder import SecondOrderBackpropExtension
    from backpack.passes.state import BackwardState

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
    "RegisterPostBackwardFunctionBackward",  # FSDP2's identity on a sharded module's inputs
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
    "ToCopyBackward0",  # dtype and device casts (`logits.float()` before the loss)
}
#: products and quotients are linear when only one operand depends on the parameters
_LINEAR_IF_ONE_OPERAND = {"MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"}


def graph_records(edge: Any) -> Iterator[tuple[Record, int, GradientEdge]]:
    """Records of module outputs reachable backward from `edge` (each once), with their edges."""
    if edge is None:
        return
    stack = [edge.node]
    for node in walk_nodes(stack):
        for record, index, output_nr in records_at(node):
            yield record, index, GradientEdge(node, output_nr)
        stack.extend(next_node for next_node, _ in node.next_functions)


def _is_parametrized(record: Record) -> bool:
    return bool(call_params(record))


#: column counts up to which convolutional graphs are backpropagated one column at a time:
#: autograd's batched mode runs convolution backward as a loop inside vmap plus a stack, which
#: measured 1.3-1.5x slower than plain per-column backward passes on the CNN benchmarks
_LOOP_MAX_COLUMNS = 64


def propagate(
    state: BackwardState,
    output_edge: GradientEdge,
    targets: list[GradientEdge],
    factor: Tensor,
    loop: bool = False,
) -> list[Tensor | None]:
    """Backpropagate the columns of `factor` (`[V, *output]`) from `output_edge` to `targets`.

    One batched backward pass, or with `loop` one pass per column (faster through
    convolutions, and only one column's intermediates alive at a time).
    """
    if not targets:
        return []
    with CTX.propagation(), _explain_compiled():
        if factor.shape[0] == 1 or (loop and factor.shape[0] <= _LOOP_MAX_COLUMNS):
            # (one column, a Monte-Carlo sample: a plain backward, without vmap's batching)
            return _propagate_columns(output_edge, targets, factor)
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
        except RuntimeError as err:
            if "donated buffers" in str(err):
                raise
            # some operation has no batching rule: one vector-Jacobian product per column
            return _propagate_columns(output_edge, targets, factor)


@contextmanager
def _explain_compiled() -> Iterator[None]:
    """Turn torch.compile's refusal to backpropagate twice into an actionable error."""
    try:
        yield
    except RuntimeError as err:
        if "donated buffers" not in str(err):
            raise
        raise RuntimeError(
            "Second-order extensions backpropagate curvature factors through the graph a second "
            "time, which this torch.compile'd graph does not allow (it was compiled with "
            "donated buffers, before backpack.extend was called). Call backpack.extend(model) "
            "before torch.compile(model) (extend switches donated buffers off), or set "
            "torch._functorch.config.donated_buffer = False before compiling, or run the "
            "backward through the uncompiled model."
        ) from err


def _propagate_columns(
    output_edge: GradientEdge, targets: list[GradientEdge], factor: Tensor
) -> list[Tensor | None]:
    """`propagate` by one backward pass per column, written into preallocated results."""
    if factor.shape[0] == 1:  # a single column needs no copy into a result
        grads = torch.autograd.grad(
            [output_edge], targets, [factor[0]], retain_graph=True, allow_unused=True
        )
        return [None if g is None else g.unsqueeze(0) for g in grads]
    results: list[Tensor | None] = [None] * len(targets)
    for v, column in enumerate(factor):
        grads = torch.autograd.grad(
            [output_edge], targets, [column], retain_graph=True, allow_unused=True
        )
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            if results[i] is None:
                # every column writes its slice (a target unused by one column is unused by all)
                results[i] = grad.new_empty(factor.shape[0], *grad.shape)
            results[i][v] = grad
    return results


_GENERIC = FuncRule()


class Entry:
    """One term of a curvature block: sign · Σ_{v,n} coef[v,n] · (Jᵀ f_vn)(Jᵀ f_vn)ᵀ.

    `factors[i]` is the factor at the module's i-th output, `[V, N, *out_i]` (None if that output
    does not influence the loss); `coef` is None (all ones) or `[V, N]`; `sign` is -1 for a loss
    that enters the backward with a negative weight.
    """

    __slots__ = ("factors", "coef", "sign")

    def __init__(
        self, factors: list[Tensor | None], coef: Tensor | None = None, sign: float = 1.0
    ) -> None:
        self.factors = factors
        self.coef = coef
        self.sign = sign


def _needs_residual(exts: list[SecondOrderBackpropExtension]) -> set[str]:
    return {e.residual for e in exts if e.residual is not None}


#: autograd node names whose functional operation is not `torch.<lowercased name>`
_OPERATION_NAMES = {
    "MulBackward0": "a product of two tensors that both depend on the parameters (*)",
    "MulBackward1": "a product of two tensors that both depend on the parameters (*)",
    "DivBackward0": "a quotient of two tensors that both depend on the parameters (/)",
    "DivBackward1": "a quotient of two tensors that both depend on the parameters (/)",
    "PowBackward0": "torch.pow (**)",
    "PowBackward1": "torch.pow (**)",
    "GeluBackward0": "torch.nn.functional.gelu",
    "SiluBackward0": "torch.nn.functional.silu",
    "EluBackward0": "torch.nn.functional.elu",
    "SoftplusBackward0": "torch.nn.functional.softplus",
    "LogSoftmaxBackward0": "torch.log_softmax",
    "SoftmaxBackward0": "torch.softmax",
    "MmBackward0": "a matrix product of two tensors that both depend on the parameters (@)",
    "BmmBackward0": "a matrix product of two tensors that both depend on the parameters (@)",
}


def operation_name(node_name: str) -> str:
    """The user-facing name of the functional operation behind an autograd node."""
    known = _OPERATION_NAMES.get(node_name)
    if known is not None:
        return f"the functional operation {known}"
    base = node_name.split("::")[-1]
    while base and base[-1].isdigit():
        base = base[:-1]
    base = base.removesuffix("Backward")
    return f"the functional operation torch.{base.lower()} (autograd node {node_name})"


def check_module_graph(loss_record: Record, exts: list[SecondOrderBackpropExtension]) -> None:
    """Raise if a nonlinearity between parameters and loss is not an extended module."""
    names = ", ".join(sorted({e.__class__.__name__ for e in exts}))
    edge = loss_record.input_edges[0] if loss_record.input_edges else None
    if edge is None:
        return
    stack = [edge.node]
    for node in walk_nodes(stack):
        records = [r for r, _, _ in records_at(node)]
        if records:
            for record in records:
                module = record.module
                if not is_curvature_free(module) and find_activation_rule(module) is None:
                    raise NotImplementedError(
                        f"{names} cannot handle {describe(module)}: its "
                        "second derivatives are not supported. Supported are elementwise "
                        "activation modules and layers that are linear in their input."
                    )
                if is_parametrized(module):
                    raise NotImplementedError(
                        f"{names} cannot handle {describe(module)}: tensors it uses are "
                        "computed from its parameters (torch.nn.utils.parametrize or "
                        "weight_norm/spectral_norm), whose second derivatives are not "
                        "supported. The GGN family (DiagGGN*, SqrtGGN*, GGNMP) and the "
                        "first-order extensions are."
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
            verb = "needs" if len(exts) == 1 else "need"
            raise NotImplementedError(
                f"{names} {verb} every nonlinear operation between the parameters and the loss "
                f"to be an extended module, but found {operation_name(name)} outside any "
                "module. Replace it by its module (e.g. torch.tanh -> nn.Tanh()) or extend "
                "the model with extend(model, use_converter=True)."
            )
        stack.extend(n for n, _ in node.next_functions)


def on_loss_backward(
    state: BackwardState, record: Record, grads: tuple[Tensor | None, ...]
) -> Callable[[], Tensor] | None:
    """Factorise the loss Hessian and propagate it to all parametrized module outputs.

    Returns what KFRA starts from (a function building the batch-summed loss Hessian) when
    a KFRA extension is active, else None.

    The weight w with which the loss enters the backward (the gradient reaching its output:
    `0.3 * l1 + l2` gives 0.3) scales its curvature: factors carry sqrt(|w|) and the sign of w.
    Each loss of a backward adds its own term (columns) to every module call it reaches.
    Jacobians (`BatchJacobian`) start from unit columns instead, whatever the loss and its
    weight: the loss only marks the model output.
    """
    exts = state.second_order
    module = record.module
    rule = find_loss_rule(module)
    # Jacobians start from unit columns at the loss input: any loss, any weight will do
    curvature = [e for e in exts if e.factor != "jacobian"]
    names = ", ".join(e.__class__.__name__ for e in curvature)
    if rule is None and curvature:
        raise NotImplementedError(
            f"{names} {'does' if len(curvature) == 1 else 'do'} not support the loss function "
            f"{describe(module)}. Supported: MSELoss, CrossEntropyLoss, BCEWithLogitsLoss."
        )
    for ext in curvature:
        rule.check(module, ext.__class__.__name__)
    scale = grads[0]
    scalar = scale is not None and scale.numel() == 1
    if curvature and not scalar:
        raise NotImplementedError(
            f"{names} {'needs' if len(curvature) == 1 else 'need'} a scalar loss "
            f"({describe(module)} has reduction='none'?)."
        )
    if scalar and torch._C._current_autograd_node() in state.unit_roots:
        scale_value = 1.0  # the root's implicit gradient: reading it would stall a GPU
    else:
        scale_value = float(scale) if scalar else 1.0
    sign = -1.0 if scale_value < 0 else 1.0
    weight = abs(scale_value)
    state.loss_seen = True
    out_edge = record.input_edges[0] if record.input_edges else None
    if out_edge is None or (curvature and not math.isfinite(scale_value)):
        return None
    if _needs_residual(exts):
        # KFRA needs no such check: its recursion only uses Jacobians (see backpack.kfra)
        check_module_graph(record, [e for e in exts if e.residual])
    found = [(r, i, e) for r, i, e in graph_records(out_edge) if _is_parametrized(r)]
    keys = sorted({e.factor_key for e in exts if e.factor != "sum"})
    pos = state.layout.loss_position(record)
    if keys:
        positions = rows_within_samples(record, out_edge, found)
        factors = []
        for key in keys:
            if key[0] == "jacobian":
                _check_exact_size(record, [e for e in exts if e.factor_key == key])
                s = identity_columns(record.args[0])
                if positions is not None:  # columns (t, c): t a row's position in its sample
                    s = _spread_columns(s, *positions, position_major=True)
                factors.append(s)
                state.loss_columns.setdefault(key, {})[pos] = (s.shape[0], 1.0)
                continue
            if key[0] == "exact":
                _check_exact_size(record, [e for e in exts if e.factor_key == key])
                # square roots keep one column per output entry (their documented shape);
                # everything else sums over columns and takes the cheapest factor
                wants_sqrt = any(e.output == "sqrt" and e.factor_key == key for e in exts)
                s = rule.sqrt_hessian(record, reduced=not wants_sqrt)
            else:
                s = rule.sqrt_hessian_sampled(record, key[1])
            if weight != 1:
                s = s * weight**0.5
            if positions is not None and key[0] == "exact":
                # exact columns must not mix two positions of a sample; sampled columns may
                # (as for [N, C, T] outputs): their cross terms vanish in expectation
                s = _spread_columns(s, *positions)
            factors.append(s)
            state.loss_columns.setdefault(key, {})[pos] = (s.shape[0], sign)
        convolutional = any(isinstance(r.module, nn.modules.conv._ConvNd) for r, _, _ in found)
        broadcast = any(id(r) in state.layout.broadcast for r, _, _ in found)
        sites = site_calls(state, found)
        columns = _LossColumns(out_edge, found, keys, factors, pos, sign, sites)
        plain_rows = positions is None and not broadcast and not sites
        if convolutional and plain_rows and _reducible_now(state, columns):
            _reduce_columns(state, columns)
        else:
            _store_factors(state, columns, convolutional)
    if any(e.factor == "sum" for e in exts):
        if len(state.layout.losses) > 1:
            raise NotImplementedError(
                "KFRA needs a single extended loss in the backward pass (its recursion follows "
                f"one module chain), but this one has {len(state.layout.losses)}. Use KFLR or "
                "KFAC, whose factors add up over losses."
            )
        if rows_within_samples(record, out_edge, found) is not None:
            raise NotImplementedError(
                "KFRA needs the rows of the loss input to be the model's samples; "
                f"{describe(module)} gets a flattened output. Use KFLR or KFAC."
            )
        # the engine starts KFRA's recursion (backpack.kfra) from here
        return lambda: rule.sum_hessian(record) * scale_value
    return None


#: largest exact loss-Hessian factor (columns x output entries) built before refusing
EXACT_FACTOR_MAX_ELEMENTS = 2**31


def _check_exact_size(record: Record, exts: list[SecondOrderBackpropExtension]) -> None:
    """Refuse an exact factor that could not be held (one column per output entry of a sample).

    A token loss on `[N, V, T]` logits has V·T columns of N·V·T entries each: 64 GiB for a small
    GPT. Better a clear message than an allocation failure deep inside the backward.
    """
    out = record.args[0] if record.args else None
    if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] == 0:
        return
    per_sample = out[0].numel()
    elements = per_sample * out.numel()
    if elements <= EXACT_FACTOR_MAX_ELEMENTS:
        return
    names = ", ".join(sorted({e.__class__.__name__ for e in exts}))
    size = elements * max(out.element_size(), 4) / 2**30
    jacobian = all(e.factor == "jacobian" for e in exts)
    what = (
        "unit columns (one per output entry of a sample) at"
        if jacobian
        else "the exact Hessian factor of"
    )
    instead = (
        ""
        if jacobian
        else "the Monte-Carlo versions (DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC), "
    )
    raise NotImplementedError(
        f"{names} need{'s' if len(exts) == 1 else ''} {what} "
        f"{describe(record.module)} w.r.t. its input {list(out.shape)}: about {per_sample} "
        f"columns of {out.numel()} entries ({size:.0f} GiB) to backpropagate. Use {instead}"
        "fewer output entries per sample, or raise "
        "backpack.secondorder.EXACT_FACTOR_MAX_ELEMENTS "
        f"(now {EXACT_FACTOR_MAX_ELEMENTS})."
    )


class _LossColumns(NamedTuple):
    """One loss's Hessian factors on their way backward to the calls the loss reaches."""

    edge: GradientEdge  #: the loss input, where the columns start
    found: list[tuple[Record, int, GradientEdge]]  #: parametrized calls reached (output index)
    keys: list[tuple]  #: factor keys (`SecondOrderBackpropExtension.factor_key`)
    factors: list[Tensor]  #: `[V, N, *out]` per key
    pos: int  #: the loss's position in the pass
    sign: float  #: -1 for a loss entering the backward with a negative weight
    #: id(record) -> the sites of a rule-less call's own parameters (`site_calls`)
    sites: dict[int, dict[str, Any]]


def site_calls(state: BackwardState, found: list[tuple[Record, int, Any]]) -> dict[int, Any]:
    """Rule-less calls whose own parameters' square roots are read at their sites.

    A vision transformer's class token and position embedding meet the samples where they
    are broadcast over them (`samples.ParamSite`): backpropagating the factor columns to those
    operations gives each sample's share, where the `torch.func` fallback would re-run the
    whole model per sample (and read values on the host to check it may). For square roots,
    diagonals and Kronecker (dense) blocks; matrix products, residual terms, modules called more
    than once and sums over samples of another layout (distributed, placed rows) keep the
    fallback.
    """
    layout = state.layout
    if not layout.param_sites or state.sync is not None or layout.several_groups:
        return {}
    if any(
        e.output not in _SITE_OUTPUTS or e.residual is not None or e.factor == "sum"
        for e in state.second_order
    ):
        return {}
    calls = {}
    for record, _, _ in found:
        sites = None if record.freed else layout.sites_of(record)
        if not sites or not any(site.parts for site in sites.values()):
            continue
        # a site holds every use of its parameter: a module called twice (on the same or other
        # samples) would get all uses' shares at each call, so its calls take the fallback
        if all(state.uses(p) <= 1 for p in call_params(record).values()):
            calls[id(record)] = sites
    return calls


#: second-order outputs a rule-less call's parameters may take from their sites
_SITE_OUTPUTS = ("diag", "batch_diag", "sqrt", "jacobian", "kron")


def _store_factors(state: BackwardState, columns: _LossColumns, convolutional: bool) -> None:
    """Backpropagate the factors to every target and store them there for the module rules."""
    out_edge, found, keys, factors, pos, sign, param_sites = columns
    sizes = [f.shape[0] for f in factors]
    # calls broadcast over the samples (position embeddings) take the factor before the
    # broadcast's sum over samples
    sites = [state.layout.broadcast.get(id(r)) for r, _, _ in found]
    extra_edges = [edge for site in sites if site is not None for edge in site.edges]
    # rule-less calls' own parameters take it where they are broadcast (once per call)
    own = {id(r): r for r, _, _ in found if id(r) in param_sites}
    own_edges = [edge for key in own for site in param_sites[key].values() for edge in site.edges]
    columns_in = torch.cat(factors)
    results = propagate(
        state,
        out_edge,
        [e for _, _, e in found] + extra_edges + own_edges,
        columns_in,
        loop=convolutional,
    )
    broadcast_results = iter(results[len(found) : len(found) + len(extra_edges)])
    site_results = iter(results[len(found) + len(extra_edges) :])
    own_roots = {
        key: _site_roots(r, param_sites[key], site_results, columns_in) for key, r in own.items()
    }
    for (target, index, _), result, site in zip(found, results, sites):
        if id(target) in param_sites:
            # the first output the loss reaches holds all of it (the others hold none)
            result = own_roots.pop(id(target), None)
            if result is None:
                continue
        else:
            target.extra.pop(SITE_PARAMS, None)  # factors at the outputs (an earlier pass's?)
            if site is not None:
                spread = [next(broadcast_results) for _ in site.parts]
                shape = target.outputs[index].shape
                per_sample = site.per_sample(spread, shape, lead=1)
                if per_sample is not None:
                    n = per_sample.shape[1]
                    target.extra["broadcast"] = n
                    front = len(shape) > 0 and shape[0] == 1
                    expanded = (n, *shape[1:]) if front else (n, *shape)
                    result = per_sample.reshape(per_sample.shape[0], *expanded)
        # in the module's dtype (a loss may run in another, e.g. on `logits.float()`), float32
        # for 16-bit outputs (mixed precision)
        result = promote_half(result)
        per_key = target.extra.setdefault("factors", {})
        if result is None:
            parts = [None] * len(sizes)
        else:  # (one key: no split, which is an operator call too)
            parts = [result] if len(sizes) == 1 else result.split(sizes)
        for key, part in zip(keys, parts):
            # a Jacobian's columns carry no loss weight, hence no sign
            key_sign = 1.0 if key[0] == "jacobian" else sign
            slot = per_key.setdefault(key, {}).setdefault(
                pos, ([None] * len(target.outputs), key_sign)
            )
            slot[0][index] = part


def _site_roots(
    record: Record, sites: dict[str, Any], results: Iterator, columns: Tensor
) -> Tensor:
    """`[V, N, P]`: the square roots of a call's own parameters, flattened and concatenated.

    Stored as the call's factor; `record.extra[SITE_PARAMS]` names the parts (`SiteRule`).
    """
    roots: dict[str, Tensor] = {}
    for name, site in sites.items():
        if not site.parts:
            continue  # unused by this backward (zeros below)
        grads = [next(results) for _ in site.parts]
        root = site.per_sample_of(grads, columns.shape[:1], columns)
        if root is None:
            raise RuntimeError(
                f"Parameter {name} of {describe(record.module)} meets the samples where it is "
                "broadcast over them, but its per-sample shares of the curvature factor cannot "
                "be split there. Compute it inside a submodule, or report the model to backpack."
            )
        roots[name] = root.flatten(2)
    first = next(iter(roots.values()))
    lead = first.shape[:2]
    flat = [
        roots[name] if name in roots else first.new_zeros(*lead, math.prod(site.shape))
        for name, site in sites.items()
    ]
    record.extra[SITE_PARAMS] = (lead[1], [(name, site.shape) for name, site in sites.items()])
    return torch.cat(flat, dim=2)


#: `Record.extra` key: the samples, and (name, shape) of each parameter whose roots the call's
#: factor holds
SITE_PARAMS = "site_params"


def _reducible_now(state: BackwardState, columns: _LossColumns) -> bool:
    """Whether every quantity of these factors is a sum over columns the targets can take at once.

    Diagonals, and Kronecker factors of rules whose G sums over columns (`kron_output_gram`).
    Then no `[V, N, *out]` factor is ever stored: each propagated column is reduced at once.
    Calls that need the engine's later handling keep the stored factors:
    rules that mix samples, views (samples along another axis, other sample counts) and
    parameters used by several calls on the same samples (cross terms).
    """
    keys = columns.keys
    outputs = {e.output for e in state.second_order if e.factor_key in keys}
    if not outputs <= {"diag", "batch_diag", "kron"}:
        return False
    n = columns.factors[0].shape[1]
    for record, index, _ in columns.found:
        if "kron" in outputs and not hasattr(find_rule(record.module), "kron_output_gram"):
            return False
        out = record.outputs[index]
        if record.module.__dict__.get("_backpack_batch_axis", 0) or record.freed:
            return False
        if out.dim() == 0 or out.shape[0] != n:
            return False
        if (find_rule(record.module) or _GENERIC).mixes_samples(record):
            return False
        params = call_params(record).values()
        if any(state.layout.cross_terms(p, state.batch_size) for p in params):
            return False
    return True


#: elements of the column buffer of one target in `_reduce_columns`: large outputs are reduced
#: column by column, small ones in chunks of columns (their stacked weight-gradient products are
#: the efficient shape; measured on the CNN benchmarks)
REDUCE_CHUNK_ELEMENTS = 2**22


def _reduce_columns(state: BackwardState, columns: _LossColumns) -> None:
    """Backpropagate one column at a time and sum its squares into each target's diagonals.

    Through convolutions this is how columns travel anyway (see `_LOOP_MAX_COLUMNS`); reducing
    the columns where they arrive, in small chunks, skips writing (and touching fresh memory for)
    the `V`-column factor of every target, and keeps one column's intermediates alive instead
    of `V`.
    """
    out_edge, found, keys, factors, pos, sign, _ = columns
    flags, approxes = {}, {}
    for key in keys:
        users = [e for e in state.second_order if e.factor_key == key]
        flags[key] = sorted({e.output == "batch_diag" for e in users if e.output != "kron"})
        approxes[key] = sorted({e.kfac_approx for e in users if e.output == "kron"})
    targets = [edge for _, _, edge in found]
    totals: dict[tuple[int, tuple], dict[bool, dict[str, Tensor]]] = {}
    grams: dict[tuple[int, tuple], dict[str, Tensor]] = {}

    def reduce(target: Record, index: int, key: tuple, columns: Tensor) -> None:
        target.promote_half()  # as the engine does before any rule runs (mixed precision)
        rule = find_rule(target.module) or _GENERIC
        names = list(call_params(target))
        at_outputs: list[Tensor | None] = [None] * len(target.outputs)
        at_outputs[index] = columns
        slot = totals.setdefault((id(target), key), {})
        for per_sample in flags[key]:
            part = rule.diag_from_factor(target, at_outputs, names, None, per_sample)
            acc = slot.setdefault(per_sample, {})
            for name, value in part.items():
                # parts are fresh sums, so the first one can take the others in place
                acc[name] = value if name not in acc else acc[name].add_(value)
        gram = grams.setdefault((id(target), key), {})
        for approx in approxes[key]:
            g = rule.kron_output_gram(target, at_outputs, approx)
            gram[approx] = g if approx not in gram else gram[approx].add_(g)

    with CTX.propagation(), _explain_compiled():
        for key, factor in zip(keys, factors):
            v = factor.shape[0]
            chunk = [
                max(1, min(v, REDUCE_CHUNK_ELEMENTS // max(1, r.outputs[i].numel())))
                for r, i, _ in found
            ]
            buffers: list[Tensor | None] = [None] * len(found)
            filled = [0] * len(found)
            for column in factor:
                grads = torch.autograd.grad(
                    [out_edge], targets, [column], retain_graph=True, allow_unused=True
                )
                for t, ((target, index, _), grad) in enumerate(zip(found, grads)):
                    if grad is None:
                        continue
                    grad = promote_half(grad)  # as in `_store_factors`
                    if chunk[t] == 1:
                        reduce(target, index, key, grad.unsqueeze(0))
                        continue
                    if buffers[t] is None:
                        buffers[t] = grad.new_empty(chunk[t], *grad.shape)
                    buffers[t][filled[t]] = grad
                    filled[t] += 1
                    if filled[t] == chunk[t]:
                        reduce(target, index, key, buffers[t])
                        filled[t] = 0
                del grads
            for t, (target, index, _) in enumerate(found):
                if filled[t]:  # the last, partial chunk
                    reduce(target, index, key, buffers[t][: filled[t]])
    for target, index, _ in found:
        for key in keys:
            values = totals.get((id(target), key))
            if values:
                if sign < 0:
                    values = {f: {k: -v for k, v in d.items()} for f, d in values.items()}
                terms = target.extra.setdefault("reduced_terms", {}).setdefault(key, {})
                terms[pos] = ReducedEntry(values)
            gram = grams.get((id(target), key))
            if gram:
                kron = target.extra.setdefault("reduced_kron", {}).setdefault(key, {})
                kron[pos] = (_kron_with_gram(target, index, gram), sign)


def _kron_with_gram(
    record: Record, index: int, grams: dict[str, Tensor]
) -> dict[str, dict[str, list[Tensor]]]:
    """Each approximation's Kronecker factors of a call, with G summed over all columns.

    The rule computes A (and the G of one zero column) from a zero factor; G is then replaced.
    """
    rule = find_rule(record.module)
    names = list(call_params(record))
    out = record.outputs[index]
    empty: list[Tensor | None] = [None] * len(record.outputs)
    dtype = next(iter(grams.values())).dtype
    empty[index] = torch.zeros(1, *out.shape, dtype=dtype, device=out.device)
    result = {}
    for approx, g in grams.items():
        kron = rule.kron_factors(record, empty, names, approx)
        result[approx] = {name: [g, *factors[1:]] for name, factors in kron.items()}
    return result


#: autograd nodes that only move entries around (a loss input reaching modules through them
#: can be mapped row by row to the modules' samples); all are free of curvature
_INDEX_NODES = {
    name
    for name in _CURVATURE_FREE_NODES
    if name.startswith(
        (
            "View",
            "ReshapeAlias",
            "UnsafeView",
            "Permute",
            "Transpose",
            "TBackward",
            "Clone",
            "Squeeze",
            "Unsqueeze",
            "Slice",
            "Select",
            "Index",
            "Cat",
            "Stack",
            "Split",
            "Unbind",
            "Flatten",
            "AsStrided",
            "Alias",
        )
    )
} | {"ToCopyBackward0"}


def _sample_axis(record: Record, index: int) -> int:
    rule = find_rule(record.module)
    if rule is None:
        return 0
    return rule.output_batch_axes(record)[index]


#: entries of the (row, sample) presence table that `_row_owners` fills at once
_PRESENCE_CHUNK = 1 << 27


def _row_owners(row: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Each loss row's sample, and the number of samples feeding it.

    `row[n, m]` is the loss row that entry m of sample n feeds (-1 for none). A boolean (row,
    sample) presence table is filled chunk of samples by chunk with plain stores, where a
    scatter of minima and maxima would contend for the same few addresses (every class of a
    token row carries the row's id: 100M entries onto 2048 rows for GPT-2's logits).
    """
    n = row.shape[0]
    owner = torch.zeros(rows, dtype=torch.long, device=row.device)
    count = torch.zeros(rows, dtype=torch.long, device=row.device)
    step = max(1, _PRESENCE_CHUNK // (rows + 1))
    for start in range(0, n, step):
        part = row[start : start + step]
        k = part.shape[0]
        target = torch.where(part >= 0, part, rows)  # an extra row for entries without one
        presence = torch.zeros(rows + 1, k, dtype=torch.bool, device=row.device)
        column = torch.arange(k, device=row.device).unsqueeze(1).expand_as(part)
        presence.index_put_((target, column), torch.ones((), dtype=torch.bool, device=row.device))
        presence = presence[:rows]
        count += presence.sum(1)
        owner = torch.where(presence.any(1), start + presence.long().argmax(1), owner)
    return owner, count


def rows_within_samples(
    record: Record, edge: GradientEdge, found: list[tuple[Record, int, GradientEdge]]
) -> tuple[Tensor, int] | None:
    """For a loss whose input rows are not the model's samples, each row's slot in its sample.

    A token loss on flattened outputs (`logits.view(-1, C)` of `[N, T, C]`) has N·T rows. Its
    factor's columns must not mix two rows of one sample (that would add cross terms between
    positions), so each row gets a slot k (its position within its sample) and the columns are
    spread over K slots. Which sample a row belongs to is read off a probe: row ids sent back to
    the nearest module outputs. Returns (slot of each row, K), or None if rows are samples.
    `found` are the parametrized calls the loss reaches.
    """
    out = record.args[0]
    rows = out.shape[0] if out.dim() > 0 else 1
    if rows <= 1 or not found:
        return None
    nearest = nearest_records(edge, through=_INDEX_NODES)
    if nearest is None:
        # computation between the modules and the loss: rows must be samples
        if rows not in {r.outputs[i].shape[_sample_axis(r, i)] for r, i, _ in found}:
            _unmappable(record)
        return None
    if not nearest:
        return None
    sizes = {r.outputs[i].shape[_sample_axis(r, i)] for r, i, _ in nearest}
    if sizes == {rows}:
        return None
    flattened = _flattened_rows(edge, nearest, out)
    if flattened is not None:
        return flattened
    base = {torch.float16: 2048, torch.bfloat16: 256}.get(out.dtype, 2**24)
    digits = max(1, math.ceil(math.log(rows + 1, base)))
    ids = torch.arange(1, rows + 1, device=out.device)
    shape = (rows,) + (1,) * (out.dim() - 1)
    targets = [e for _, _, e in nearest]
    per_digit = []
    with CTX.propagation():
        for d in range(digits):
            probe = ((ids // base**d) % base).to(out.dtype).reshape(shape).expand(out.shape)
            per_digit.append(
                torch.autograd.grad([edge], targets, [probe], retain_graph=True, allow_unused=True)
            )
    owner = torch.full((rows,), -1, dtype=torch.long, device=out.device)
    for j, (target, index, _) in enumerate(nearest):
        if per_digit[0][j] is None:
            continue
        axis = _sample_axis(target, index)
        values = None
        for d, grads in enumerate(per_digit):
            g = grads[j].movedim(axis, 0)
            g = g.reshape(g.shape[0], -1).double()
            rounded = g.round()
            if bool((g - rounded).abs().max() > 0.25) or bool(rounded.min() < 0):
                _unmappable(record)
            values = rounded * base**d if values is None else values + rounded * base**d
        row = values.long() - 1  # [N, M]; -1 where no row arrives
        if bool((row >= rows).any()):
            _unmappable(record)
        found, count = _row_owners(row, rows)
        hit = count > 0
        if bool((count > 1).any()) or bool(((owner[hit] >= 0) & (owner[hit] != found[hit])).any()):
            _unmappable(record)
        owner[hit] = found[hit]
    order = torch.argsort(owner * rows + torch.arange(rows, device=owner.device))
    sorted_owner = owner[order]
    start = torch.searchsorted(sorted_owner, sorted_owner)
    slot = torch.empty_like(owner)
    slot[order] = torch.arange(rows, device=owner.device) - start
    return slot, int(slot.max()) + 1


#: autograd nodes that keep the row-major order of their input's entries
_ORDER_KEEPING = ("View", "ReshapeAlias", "UnsafeView", "Clone", "Squeeze", "Unsqueeze", "Alias")


def _flattened_rows(
    edge: GradientEdge, nearest: list[tuple[Record, int, GradientEdge]], out: Tensor
) -> tuple[Tensor, int] | None:
    """Slots of the rows of `out` read off the graph's structure, without probing values.

    When a single module output `[N, ...]` (samples first) reaches the loss only through
    reshaping nodes that keep the entries' row-major order (`logits.view(-1, C)` of
    `[N, T, C]`) and `out` has a multiple of N rows, row r belongs to sample r // (rows / N)
    at slot r % (rows / N). None when the structure says less (then the probe decides).
    """
    if len(nearest) != 1:
        return None
    target, index, _ = nearest[0]
    if _sample_axis(target, index) != 0:
        return None
    node = edge.node
    while not records_at(node):
        if not node.name().startswith(_ORDER_KEEPING):
            return None
        following = [n for n, _ in node.next_functions if n is not None]
        if len(following) != 1:
            return None
        node = following[0]
    rows, n = out.shape[0], target.outputs[index].shape[0]
    if node is not nearest[0][2].node or target.outputs[index].numel() != out.numel():
        return None
    if n == 0 or rows % n:
        return None
    slots = rows // n
    return torch.arange(rows, device=out.device) % slots, slots


def _unmappable(record: Record) -> None:
    raise NotImplementedError(
        f"The input of {describe(record.module)} has rows that are not the model's samples "
        "(e.g. a loss on logits.view(-1, C)), and backpack cannot tell which sample each row "
        "belongs to: the rows mix samples, or something other than reshaping lies between the "
        "last extended module and the loss. Apply the loss to the module output reshaped "
        "without computation (view/reshape/permute/flatten), or to [N, C, T] logits."
    )


def _spread_columns(
    factor: Tensor, slot: Tensor, slots: int, position_major: bool = False
) -> Tensor:
    """`[V, R, *]` → `[V·K, R, *]`: column (v, k) holds the rows in slot k only.

    Columns are ordered (v, k), or (k, v) with `position_major`.
    """
    v, rows = factor.shape[0], factor.shape[1]
    spread = factor.new_zeros(v, slots, *factor.shape[1:])
    spread[:, slot, torch.arange(rows, device=factor.device)] = factor
    if position_major:
        spread = spread.transpose(0, 1)
    return spread.reshape(v * slots, *factor.shape[1:])


class DiagEntry:
    """A diagonal curvature at one module output: Σ_{n,d} c[n, d] ∇y_nd ∇y_ndᵀ.

    `index` is the output it sits at, `diag` (c) has that output's shape. This is an
    activation's residual δ ⊙ φ'' when the module's output is the activation's input; rules with
    `diag_from_residual` turn it into parameter diagonals directly, others get unit columns.
    """

    __slots__ = ("index", "diag")

    def __init__(self, index: int, diag: Tensor) -> None:
        self.index = index
        self.diag = diag


class OutputDiagEntry(DiagEntry):
    """Only the diagonal `diag` of a dense output curvature that couples no two positions.

    Valid for diagonals (never for matrix products) and only for rules whose
    `accepts_output_diag` says their parameter diagonals read nothing else.
    """


class ChainEntry(DiagEntry):
    """A diagonal curvature c at the end of a chain of recorded single-input modules.

    The term is Σ_{n,d} c[n, d] ∇u_nd ∇u_ndᵀ with u = chain(y), y the module's output `index`.
    Matrix products push tangents through the chain's Jacobians (recomputed from the recorded
    inputs) instead of storing one propagated column per entry of c.
    """

    __slots__ = ("chain",)

    def __init__(self, index: int, diag: Tensor, chain: list[Record]) -> None:
        super().__init__(index, diag)
        self.chain = [(r.module, r.args, r.kwargs) for r in chain]

    def forward(self, tangents: Tensor) -> Tensor:
        """Chain Jacobian times each slice of `tangents` (`[K, *y]` -> `[K, *u]`)."""
        from torch.func import jvp, vmap

        from backpack.rules.generic import _load_jvp_decompositions

        _load_jvp_decompositions()
        with torch.enable_grad(), CTX.internal():
            for module, args, kwargs in self.chain:
                f = _input_function(module, args, kwargs)
                tangents = vmap(lambda t, f=f, a=args[0]: jvp(f, (a,), (t,))[1])(tangents)
        return tangents

    def backward(self, cotangents: Tensor) -> Tensor:
        """Transposed chain Jacobian times each slice (`[K, *u]` -> `[K, *y]`)."""
        from torch.func import vjp, vmap

        with torch.enable_grad(), CTX.internal():
            for module, args, kwargs in reversed(self.chain):
                _, pullback = vjp(_input_function(module, args, kwargs), args[0])
                cotangents = vmap(lambda c, pb=pullback: pb(c)[0])(cotangents)
        return cotangents


class ReducedEntry:
    """Parameter diagonals computed ahead of time: `values[per_sample][name]`."""

    __slots__ = ("values",)

    def __init__(self, values: dict[bool, dict[str, Tensor]]) -> None:
        self.values = values


def _input_function(module: nn.Module, args: tuple, kwargs: dict) -> Callable[[Tensor], Tensor]:
    def f(inp: Tensor) -> Tensor:
        return module(inp, *args[1:], **kwargs)

    return f


#: bound on the entries of one chunk of propagated residual unit columns ([columns, N, D]);
#: tests lower it to exercise the chunked path
RESIDUAL_CHUNK_ELEMENTS = 2**24

_RESIDUAL_MODES: dict[str, Callable[[Tensor], Tensor]] = {
    "signed": lambda r: r,
    "clip": lambda r: r.clamp_min(0),
    "abs": lambda r: r.abs(),
}


def _record_at(edge: Any) -> tuple[Record, int] | None:
    """The single recorded module call whose output is exactly `edge` (and its output index)."""
    if edge is None or edge.node is None:
        return None
    found = [(r, i) for r, i, nr in records_at(edge.node) if nr == edge.output_nr]
    return found[0] if len(found) == 1 else None


def _single_input_edge(record: Record) -> Any:
    """The edge of the first positional input if it is the call's only differentiable input."""
    edges = record.input_edges
    if record.inplace or not edges or edges[0] is None or any(e is not None for e in edges[1:]):
        return None
    if len(record.outputs) != 1 or not isinstance(record.args[0], Tensor):
        return None
    if any(isinstance(v, Tensor) and v.requires_grad for v in record.kwargs.values()):
        return None
    return edges[0]


def _passable(record: Record) -> bool:
    """Whether matrix products may re-run this call to apply its input Jacobian."""
    module = record.module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or not module.track_running_stats
    ):
        return False  # re-running would mix samples or update running statistics
    if isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
        return False  # re-running would draw a new mask
    return is_curvature_free(module) or find_activation_rule(module) is not None


def _chain_targets(edge: Any) -> dict[int, tuple[Record, int, list[Record]]]:
    """Parametrized calls reached from `edge` through a chain of single-input module calls.

    Maps id(record) to (record, output index, chain of calls from its output to `edge`).
    The producer of `edge` itself (empty chain) is left out.
    """
    found: dict[int, tuple[Record, int, list[Record]]] = {}
    chain: list[Record] = []
    while True:
        at = _record_at(edge)
        if at is None:
            return found
        record, index = at
        if chain and _is_parametrized(record):
            found[id(record)] = (record, index, list(chain))
        edge = _single_input_edge(record)
        if edge is None or not _passable(record) or record.module is None:
            return found
        chain.insert(0, record)


def _diag_route(edge: Any, diags: dict[str, Tensor]) -> tuple[Record, int, dict] | None:
    """The diagonal of the residual curvature at the nearest parametrized call upstream.

    Exact route (no propagation): `edge` is the output of a layer whose rule has
    `residual_input_diag` (Linear: (W∘W)ᵀ c per position), followed upstream by elementwise
    modules (φ'² each) up to a parametrized call whose rule `accepts_output_diag`.
    """
    at = _record_at(edge)
    if at is None:
        return None
    producer = at[0]
    to_input = getattr(find_rule(producer.module), "residual_input_diag", None)
    edge = _single_input_edge(producer)
    if to_input is None or edge is None:
        return None
    diags = {mode: to_input(producer, d) for mode, d in diags.items()}
    while True:
        at = _record_at(edge)
        if at is None:
            return None
        record, index = at
        if _is_parametrized(record):
            rule = find_rule(record.module)
            accepts = getattr(rule, "accepts_output_diag", None)
            if accepts is None or not hasattr(rule, "diag_from_residual"):
                return None
            if not accepts(record) or rule.mixes_samples(record):
                return None
            return record, index, diags
        edge = _single_input_edge(record)
        d1 = elementwise_derivative(record) if edge is not None else None
        if d1 is None:
            return None
        d1 = d1.square()
        diags = {mode: d * d1 for mode, d in diags.items()}


def _add(record: Record, key: str, mode: str, entry: Any) -> None:
    record.extra.setdefault(key, {}).setdefault(mode, []).append(entry)


def _unit_chunks(
    residual: Tensor, chunk_elements: int, per_column: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Columns where the residual `[N, D]` is nonzero, in chunks: (column indices, units).

    `units` is `[C, N, D]` with a one at [c, n, column c] for every sample n.
    """
    n, d = residual.shape
    columns = residual.ne(0).any(0).nonzero().squeeze(1)
    size = max(1, chunk_elements // max(1, n * per_column))
    for start in range(0, columns.numel(), size):
        cols = columns[start : start + size]
        units = torch.zeros(cols.numel(), n, d, dtype=residual.dtype, device=residual.device)
        units[torch.arange(cols.numel(), device=cols.device), :, cols] = 1
        yield cols, units


def _fallback_diag(
    rule: ModuleRule, record: Record, entry: DiagEntry, names: list[str], per_sample: bool
) -> dict[str, Tensor]:
    """Parameter diagonals of a diagonal output curvature through unit columns, chunked."""
    diag = entry.diag
    flat = diag.reshape(diag.shape[0], -1)
    total: dict[str, Tensor] = {}
    for cols, units in _unit_chunks(flat, RESIDUAL_CHUNK_ELEMENTS, flat.shape[1]):
        factors: list[Tensor | None] = [None] * len(record.outputs)
        factors[entry.index] = units.reshape(-1, *diag.shape)
        part = rule.diag_from_factor(record, factors, names, flat[:, cols].T, per_sample)
        for name, value in part.items():
            total[name] = value if name not in total else total[name] + value
    if not total:
        batch = rule.batch_size(record) if per_sample else None
        return zero_like_params(record.module, names, batch)
    return total


def on_activation_backward(
    state: BackwardState, record: Record, grads: tuple[Tensor | None, ...]
) -> None:
    """Add the activation's residual curvature to the modules before it.

    With z the activation's input, the term is Σ r ∇z ∇zᵀ with r = δ ⊙ φ''(z) (modified for
    PCHMP). The call producing z gets r itself (`DiagEntry`: closed-form diagonals, cheap
    products). Further upstream, diagonals use the exact route of `_diag_route` where it applies
    and matrix products a `ChainEntry`; everything else gets unit columns of z propagated by
    autograd (in chunks; reduced at once when only diagonals need them).
    """
    exts = state.second_order
    modes = _needs_residual(exts)
    if not modes or not state.loss_seen:
        return
    rule = find_activation_rule(record.module)
    if rule is None or grads[0] is None:
        return
    d2 = rule.second_derivative(record)
    if d2 is None:
        return
    edge = record.input_edges[0] if record.input_edges else None
    if edge is None:
        raise NotImplementedError(
            f"{record.module.__class__.__name__} ran in place, so the curvature extensions "
            "cannot reach its input. Use inplace=False."
        )
    residual = grads[0] * d2
    if not residual.ne(0).any():
        return
    found = [(r, i, e) for r, i, e in graph_records(edge) if _is_parametrized(r)]
    if not found:
        return
    diags = {mode: _RESIDUAL_MODES[mode](residual) for mode in modes}
    diag_modes = {e.residual for e in exts if e.residual and e.output in ("diag", "batch_diag")}
    mp_modes = {e.residual for e in exts if e.residual and e.output == "mp"}
    others = []
    for target, index, target_edge in found:
        if target_edge.node is edge.node and target_edge.output_nr == edge.output_nr:
            for mode in modes:
                _add(target, "residuals", mode, DiagEntry(index, diags[mode]))
        else:
            others.append((target, index, target_edge))
    if not others:
        return
    route = _diag_route(edge, {m: diags[m] for m in diag_modes}) if diag_modes else None
    chains = _chain_targets(edge) if mp_modes else {}
    if route is not None:
        target, index, route_diags = route
        for mode in diag_modes:
            _add(target, "residuals_diag", mode, OutputDiagEntry(index, route_diags[mode]))
    for target, index, _ in others:
        if id(target) in chains:
            _, _, chain = chains[id(target)]
            for mode in mp_modes:
                _add(target, "residuals_mp", mode, ChainEntry(index, diags[mode], chain))
    routed = {id(route[0])} if route is not None else set()
    for_diag = [t for t in others if diag_modes and id(t[0]) not in routed]
    for_mp = [t for t in others if mp_modes and id(t[0]) not in chains]
    _propagate_residual(state, edge, residual, diags, for_diag, diag_modes, for_mp, mp_modes)


def _propagate_residual(
    state: BackwardState,
    edge: GradientEdge,
    residual: Tensor,
    diags: dict[str, Tensor],
    for_diag: list[tuple[Record, int, GradientEdge]],
    diag_modes: set[str],
    for_mp: list[tuple[Record, int, GradientEdge]],
    mp_modes: set[str],
) -> None:
    """Unit columns of z propagated to the targets no closed form reaches.

    The propagated column c at sample n is the row of sample n's Jacobian dz_c/dy, and the
    residual enters as the coefficient r[n, c] (one propagation serves every residual mode).
    Targets only diagonals need are reduced chunk by chunk; products keep the columns.
    """
    keep = {id(t[0]) for t in for_mp}
    # a rule that mixes samples cannot be reduced ahead of the engine's own checks
    reduce_now = [
        t
        for t in for_diag
        if id(t[0]) not in keep and not (find_rule(t[0].module) or _GENERIC).mixes_samples(t[0])
    ]
    reduce_ids = {id(t[0]) for t in reduce_now}
    targets = for_mp + [t for t in for_diag if id(t[0]) not in keep]
    if not targets:
        return
    n = residual.shape[0]
    flat = residual.reshape(n, -1)
    flat_diags = {mode: d.reshape(n, -1) for mode, d in diags.items()}
    widest = max([flat.shape[1]] + [math.prod(t[0].outputs[t[1]].shape[1:]) for t in targets])
    per_sample_flags = {
        mode: sorted({e.output == "batch_diag" for e in state.second_order if e.residual == mode})
        for mode in diag_modes
    }
    reduced: dict[int, dict[str, dict[bool, dict[str, Tensor]]]] = {}
    kept: dict[int, list[tuple[Tensor, Tensor]]] = {}
    for cols, units in _unit_chunks(flat, RESIDUAL_CHUNK_ELEMENTS, widest):
        cotangent = units.reshape(-1, *residual.shape)
        results = propagate(state, edge, [t[2] for t in targets], cotangent)
        for (target, index, _), result in zip(targets, results):
            if result is None:
                continue
            if id(target) not in reduce_ids:
                kept.setdefault(id(target), []).append((cols, result))
                continue
            rule = find_rule(target.module) or _GENERIC
            names = list(call_params(target))
            factors: list[Tensor | None] = [None] * len(target.outputs)
            factors[index] = result
            for mode in diag_modes:
                coef = flat_diags[mode][:, cols].T
                slot = reduced.setdefault(id(target), {}).setdefault(mode, {})
                for per_sample in per_sample_flags[mode]:
                    part = rule.diag_from_factor(target, factors, names, coef, per_sample)
                    acc = slot.setdefault(per_sample, {})
                    for name, value in part.items():
                        acc[name] = value if name not in acc else acc[name] + value
    for target, index, _ in targets:
        if id(target) in reduced:
            for mode, values in reduced[id(target)].items():
                _add(target, "residuals_diag", mode, ReducedEntry(values))
            continue
        pieces = kept.get(id(target))
        if not pieces:
            continue
        cols = torch.cat([c for c, _ in pieces])
        factors = [None] * len(target.outputs)
        factors[index] = torch.cat([r for _, r in pieces])
        in_mp = id(target) in keep
        in_diag = id(target) in {id(t[0]) for t in for_diag}
        for mode in diag_modes | mp_modes:
            want_mp, want_diag = in_mp and mode in mp_modes, in_diag and mode in diag_modes
            if not (want_mp or want_diag):
                continue
            key = "residuals_mp" if not want_diag else "residuals_diag"
            if want_mp and want_diag:
                key = "residuals"
            _add(target, key, mode, Entry(list(factors), flat_diags[mode][:, cols].T))


def terms_for(
    record: Record, ext: SecondOrderBackpropExtension
) -> list[tuple[int, list[Tensor | None], float]]:
    """The loss terms at `record`'s outputs for `ext`'s factor: (loss position, factors, sign)."""
    per_loss = record.extra.get("factors", {}).get(ext.factor_key)
    if not per_loss:
        return []
    return [(pos, factors, sign) for pos, (factors, sign) in sorted(per_loss.items())]


def entries_for(record: Record, ext: SecondOrderBackpropExtension) -> list[Entry]:
    """The curvature terms of `record` that `ext` sums: each loss's GGN term and the residuals."""
    entries: list[Any] = [Entry(f, sign=sign) for _, f, sign in terms_for(record, ext)]
    reduced = record.extra.get("reduced_terms", {}).get(ext.factor_key, {})
    entries.extend(reduced[pos] for pos in sorted(reduced))
    if ext.residual is not None:
        entries.extend(record.extra.get("residuals", {}).get(ext.residual, []))
        extra = "residuals_mp" if ext.output == "mp" else "residuals_diag"
        entries.extend(record.extra.get(extra, {}).get(ext.residual, []))
    return entries


def joint_factors(
    record: Record, ext: SecondOrderBackpropExtension, sign: float | None = None
) -> list[Tensor | None] | None:
    """All losses' factors at each output of `record`, columns concatenated (None if none).

    With `sign`, only the losses entering the backward with a weight of that sign.
    """
    terms = [t for t in terms_for(record, ext) if sign is None or t[2] == sign]
    if not terms:
        return None
    if len(terms) == 1:
        return terms[0][1]
    joint: list[Tensor | None] = []
    for i in range(len(record.outputs)):
        parts = [f[i] for _, f, _ in terms]
        template = next((p for p in parts if p is not None), None)
        if template is None:
            joint.append(None)
            continue
        filled = [
            template.new_zeros(_columns(f), *template.shape[1:]) if p is None else p
            for p, (_, f, _) in zip(parts, terms)
        ]
        joint.append(torch.cat(filled))
    return joint


def _columns(factors: list[Tensor | None]) -> int:
    return next(f.shape[0] for f in factors if f is not None)


def aligned_entries(
    records: list[Record], ext: SecondOrderBackpropExtension
) -> list[tuple[Record, list[Entry]]]:
    """Each call's GGN entries, one per loss of the pass at the same list position.

    Matrix products of calls sharing samples pair entries by position (cross terms between the
    calls); a call that a loss does not reach gets an empty entry there.
    """
    per_record = [{pos: (f, s) for pos, f, s in terms_for(r, ext)} for r in records]
    positions = sorted({pos for terms in per_record for pos in terms})
    uses = []
    for record, terms in zip(records, per_record):
        entries = []
        for pos in positions:
            factors, sign = terms.get(pos, ([None] * len(record.outputs), 1.0))
            sign = next((t[pos][1] for t in per_record if pos in t), sign)
            entries.append(Entry(factors, sign=sign))
        uses.append((record, entries))
    return uses


def reduce_entries(
    record: Record,
    entries: list[Entry],
    names: list[str],
    per_sample: bool,
    rule: ModuleRule,
) -> dict[str, Tensor]:
    """Σ_entries Σ_v coef (Jᵀ f)², summed over samples unless `per_sample`.

    Where the rule can express a term by a diagonal at the output (`factor_output_diag`,
    `DiagEntry`), those diagonals are summed first and turned into parameter diagonals once.
    """
    total: dict[str, Tensor] = {}
    closed = getattr(rule, "diag_from_residual", None)
    to_diag = getattr(rule, "factor_output_diag", None) if closed is not None else None
    at_output: dict[int, Tensor] = {}

    def add(parts: dict[str, Tensor]) -> None:
        for name, value in parts.items():
            total[name] = value if name not in total else total[name] + value

    for entry in entries:
        if isinstance(entry, ReducedEntry):
            add({k: v for k, v in entry.values[per_sample].items() if k in names})
        elif isinstance(entry, ChainEntry):
            raise RuntimeError("internal: a matrix-product entry reached a diagonal reduction")
        elif isinstance(entry, DiagEntry):
            if closed is None:
                add(_fallback_diag(rule, record, entry, names, per_sample))
            else:
                i = entry.index
                at_output[i] = entry.diag if i not in at_output else at_output[i] + entry.diag
        else:
            if all(f is None for f in entry.factors):
                continue
            sign = getattr(entry, "sign", 1.0)
            found = None if to_diag is None else to_diag(record, entry.factors, entry.coef)
            if found is None:
                part = rule.diag_from_factor(record, entry.factors, names, entry.coef, per_sample)
                add(part if sign > 0 else {k: -v for k, v in part.items()})
            else:
                i, c = found
                c = c if sign > 0 else -c
                at_output[i] = c if i not in at_output else at_output[i] + c
    for index, diag in at_output.items():
        add(closed(record, index, diag, names, per_sample))
    return total


def matrix_product(uses: list[tuple[Record, list[Entry]]], name: str) -> Callable[[Tensor], Tensor]:
    """A function M ↦ block · M for parameter `name`, the block being Σ_entries coef JᵀffᵀJ.

    `uses` lists each call of the parameter's module(s) with the entries at its outputs; entries
    at the same position of each use's list belong to the same term (cross terms between uses
    included). Diagonal entries (`DiagEntry`, `ChainEntry`) apply J, the chain, c ⊙ ·, and the
    transposes, per use.
    """
    snapshots = []
    for record, entries in uses:
        rule = find_rule(record.module) or _GENERIC
        axes = rule.output_batch_axes(record)
        module = rule.module_for_products(record)  # random draws (dropout) held fixed
        snapshots.append(
            (module, record.args, record.kwargs, record.out_requires_grad, entries, axes)
        )
    n_entries = len(uses[0][1]) if uses else 0

    def product(mat: Tensor) -> Tensor:
        from backpack.rules.generic import jvp_outputs, vjp_params

        result = torch.zeros_like(mat)
        tangents = [jvp_outputs(m, a, kw, name, mat, rg) for m, a, kw, rg, _, _ in snapshots]
        for e in range(n_entries):
            if isinstance(uses[0][1][e], DiagEntry):
                for (module, args, kwargs, req, entries, _), outs in zip(snapshots, tangents):
                    entry = entries[e]
                    u = outs[entry.index]
                    if isinstance(entry, ChainEntry):
                        u = entry.backward(entry.forward(u) * entry.diag)
                    else:
                        u = u * entry.diag
                    cots: list[Tensor | None] = [None] * len(outs)
                    cots[entry.index] = u
                    result = result + vjp_params(module, args, kwargs, name, cots, req)
                continue
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
            if getattr(uses[0][1][e], "sign", 1.0) < 0:
                t = -t
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


def zero_like_params(
    module: nn.Module, names: list[str], batch_size: int | None = None
) -> dict[str, Tensor]:
    """Zeros shaped like the named parameters (`[batch_size, *shape]` if given)."""
    if batch_size is None:
        return {n: torch.zeros_like(get_param(module, n)) for n in names}
    return {
        n: get_param(module, n).new_zeros(batch_size, *get_param(module, n).shape) for n in names
    }
