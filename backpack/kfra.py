"""KFRA: Kronecker factors from batch-averaged recursive curvature.

Starting from the batch-summed loss Hessian Ḡ (dense `[D, D]` over one sample's output), each
step backward through the chain of modules replaces Ḡ by the batch average of Jₙᵀ Ḡ Jₙ, where Jₙ
is sample n's Jacobian of that step. A parametrized module takes Ḡ at its output as its output
factor. Linear layers (Jₙ = I ⊗ W for every sample: Wᵀ Ḡ W per position block) and elementwise
modules (Jₙ = diag(φ'ₙ): Ḡ ∘ mean φ'ₙφ'ₙᵀ) use these closed forms. Any other step forms Jₙᵀ Ḡ Jₙ
from a square root Ḡ = L Lᵀ propagated by one batched vector-Jacobian product, so any module
autograd can differentiate works, but the model must be a chain (no branches) and every
intermediate feature dimension must be small enough for a dense `[D, D]` matrix.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backpack import secondorder
from backpack.recording import (
    Record,
    call_params,
    describe,
    nearest_records,
    records_at,
    walk_nodes,
)
from backpack.rules import find_rule
from backpack.rules.activations import elementwise_derivative
from backpack.rules.base import ModuleRule, gram

if TYPE_CHECKING:  # pragma: no cover
    from backpack.passes.state import BackwardState

#: largest per-sample feature dimension for which KFRA forms dense curvature matrices
MAX_KFRA_DIM = 4096


class Planned(Exception):  # noqa: N818 - not an error: KFRA accepted the model
    """Raised by KFRA inside `plan_only()` once it accepts the model, before computing."""


_PLAN_ONLY = [False]


@contextlib.contextmanager
def plan_only() -> Iterator[None]:
    """Inside: KFRA checks that it accepts the model, then raises `Planned` instead of computing.

    `backpack.verify` uses it to learn whether KFRA refuses a model (and why) where it could
    not check the result anyway, without forming KFRA's dense matrices.
    """
    previous, _PLAN_ONLY[0] = _PLAN_ONLY[0], True
    try:
        yield
    finally:
        _PLAN_ONLY[0] = previous


def _same_edge(a: GradientEdge, b: GradientEdge) -> bool:
    return a.node is b.node and a.output_nr == b.output_nr


def _matrix_sqrt(mat: Tensor) -> Tensor:
    """L with L Lᵀ = mat for a symmetric positive semi-definite matrix (columns of L: `[D, r]`)."""
    # float64: single-precision eigh fails to converge on large, low-rank curvature matrices
    sym = ((mat + mat.T) / 2).double()
    evals, evecs = torch.linalg.eigh(sym)
    keep = evals > evals.abs().max().clamp_min(1e-300) * mat.shape[0] * torch.finfo(mat.dtype).eps
    if not keep.any():  # no curvature reaches this point: one zero column keeps shapes valid
        return torch.zeros(mat.shape[0], 1, dtype=mat.dtype, device=mat.device)
    return (evecs[:, keep] * evals[keep].sqrt()).to(mat.dtype)


class _Roots:
    """The square root of the current Ḡ, computed at most once (store and sandwich share it)."""

    def __init__(self) -> None:
        self._of: Tensor | None = None
        self._root: Tensor | None = None

    def __call__(self, gbar: Tensor) -> Tensor:
        if self._of is not gbar:
            self._of, self._root = gbar, _matrix_sqrt(gbar)
        return self._root


def _sandwich(
    state: BackwardState,
    gbar: Tensor,
    src: GradientEdge,
    dst: GradientEdge,
    n: int,
    shape: tuple,
    roots: _Roots | None = None,
) -> Tensor:
    """(1/N) Σₙ Jₙᵀ Ḡ Jₙ for the Jacobian from `dst` to `src` (both per-sample flattened)."""
    root = (roots or _matrix_sqrt)(gbar)  # [D_out, r]
    cot = root.T.reshape(root.shape[1], 1, *shape).expand(root.shape[1], n, *shape)
    (result,) = secondorder.propagate(state, src, [dst], cot.contiguous())
    if result is None:
        raise RuntimeError("KFRA: no gradient path between consecutive modules.")
    flat = result.reshape(result.shape[0], n, -1)
    return gram(flat) / n


def _module_step(record: Record, gbar: Tensor, n: int) -> Tensor | None:
    """(1/N) Σₙ Jₙᵀ Ḡ Jₙ through one module call in closed form, or None if there is none."""
    module = record.module
    if len(record.args) != 1 or record.kwargs:
        return None
    if type(module) is nn.Linear:
        w = module.weight.detach()
        out, inp = w.shape
        t = gbar.shape[0] // out
        if t == 1:
            return w.T @ gbar @ w
        g4 = gbar.reshape(t, out, t, out)
        return torch.einsum("ai,tasb,bj->tisj", w, g4, w).reshape(t * inp, t * inp)
    d1 = elementwise_derivative(record)
    if d1 is None:
        return None
    phi = d1.reshape(n, -1)
    if phi.shape[1] != gbar.shape[0]:
        return None
    return gbar * (phi.T @ phi) / n


def _check_dim(shape: tuple[int, ...], where: str) -> None:
    dim = math.prod(shape)
    if dim > MAX_KFRA_DIM:
        raise NotImplementedError(
            f"KFRA needs a dense [D, D] curvature matrix at the {where}, with D = {dim} > "
            f"{MAX_KFRA_DIM} (backpack.kfra.MAX_KFRA_DIM). That is too large to be practical; "
            "use KFLR or KFAC, which backpropagate factors of the loss Hessian instead of dense "
            "matrices."
        )


def _plan(state: BackwardState, loss_record: Record) -> list[tuple]:
    """Walk the module chain from the loss without computing anything; check it is feasible.

    Returns steps ("sandwich", src, dst, src_shape) between modules, ("module", record, src, dst,
    src_shape) through a module call and ("store", record, shape).
    """
    edge = loss_record.input_edges[0]
    shape = tuple(loss_record.args[0].shape[1:])
    _check_dim(shape, f"input of {loss_record.module.__class__.__name__}")
    steps: list[tuple] = []
    while edge is not None:
        nearest = nearest_records(edge)
        if not nearest:
            break
        if len({id(r) for r, _, _ in nearest}) > 1 or len(nearest[0][0].outputs) > 1:
            modules = ", ".join(sorted({r.module.__class__.__name__ for r, _, _ in nearest}))
            raise NotImplementedError(
                "KFRA needs the model to be a chain of modules; the graph branches into "
                f"{modules}. Use KFLR or KFAC for branching models."
            )
        record, _, out_edge = nearest[0]
        name = record.module.__class__.__name__
        _check_sample_axis(state, record)
        out_shape = tuple(record.outputs[0].shape[1:])
        if not _same_edge(edge, out_edge):
            _check_dim(out_shape, f"output of {name}")
            steps.append(("sandwich", edge, out_edge, shape))
        shape = out_shape
        trainable = list(call_params(record).values())
        if any(state.uses(p) > 1 for p in trainable):
            raise NotImplementedError(
                f"KFRA does not support parameters used several times in one backward "
                f"({describe(record.module)}); use KFLR or KFAC."
            )
        if trainable:
            rule = find_rule(record.module)
            if rule is None or type(rule).kron_factors is ModuleRule.kron_factors:
                raise NotImplementedError(
                    f"KFRA does not support module {record.module.__class__}: Kronecker "
                    "factors are defined for Linear and convolution layers."
                )
            steps.append(("store", record, shape))
        if record.inplace:
            raise NotImplementedError(
                f"KFRA cannot pass through the in-place module {record.module}; use inplace=False."
            )
        edges = [e for e in record.input_edges if e is not None]
        if len(edges) > 1:
            raise NotImplementedError(
                "KFRA needs the model to be a chain of modules; "
                f"{describe(record.module)} takes {len(edges)} inputs that depend on the "
                "parameters (the graph branches). Use KFLR or KFAC for branching models."
            )
        in_edge = record.input_edges[0] if record.input_edges else None
        if in_edge is None or not nearest_records(in_edge):
            break
        in_shape = tuple(record.args[0].shape[1:])
        _check_dim(in_shape, f"input of {name}")
        steps.append(("module", record, out_edge, in_edge, shape))
        edge, shape = in_edge, in_shape
    _check_chain_covers(loss_record, steps)
    return steps


def _check_sample_axis(state: BackwardState, record: Record) -> None:
    """KFRA's dense matrices assume samples along axis 0 of every call in the chain."""
    rule = find_rule(record.module)
    axes = rule.output_batch_axes(record) if rule is not None else [0]
    moved = record.module.__dict__.get("_backpack_batch_axis", 0)
    if moved or any(axes) or id(record) in state.layout.broadcast:
        raise NotImplementedError(
            f"KFRA needs the samples along axis 0 of every call in the chain; "
            f"{describe(record.module)} has them elsewhere (a sequence-first layer, or an output "
            "broadcast over the samples). Use KFLR or KFAC."
        )


def _check_chain_covers(loss_record: Record, steps: list[tuple]) -> None:
    """Raise if a parametrized call the loss reaches lies off the planned chain."""
    on_chain = {id(step[1]) for step in steps if step[0] == "store"}
    stack = [e.node for e in loss_record.input_edges if e is not None]
    for node in walk_nodes(stack):
        for record, _, _ in records_at(node):
            if call_params(record) and id(record) not in on_chain:
                raise NotImplementedError(
                    "KFRA needs the model to be a chain of modules; "
                    f"{describe(record.module)} lies on a branch off the chain from the loss "
                    "(e.g. inside Parallel, or behind a module taking several inputs). Use KFLR "
                    "or KFAC for branching models."
                )
        stack.extend(n for n, _ in node.next_functions)


def start_kfra(
    state: BackwardState, loss_record: Record, sum_hessian: Callable[[], Tensor]
) -> None:
    """Run the KFRA recursion from the loss down the module chain and store the factors.

    `sum_hessian` builds the batch-summed loss Hessian; it runs only once the chain is known
    to be feasible (the dense matrix can be large).
    """
    exts = [e for e in state.second_order if e.factor == "sum"]
    steps = _plan(state, loss_record)
    if _PLAN_ONLY[0]:
        raise Planned("KFRA accepts the model (plan_only: nothing computed)")
    n = loss_record.args[0].shape[0]
    gbar = sum_hessian()
    roots = _Roots()
    results: list[tuple[Record, dict]] = []
    with torch.no_grad():
        for step in steps:
            if step[0] == "module":
                _, record, src, dst, shape = step
                closed = _module_step(record, gbar, n)
                if closed is None:
                    closed = _sandwich(state, gbar, src, dst, n, shape, roots)
                gbar = closed
                continue
            if step[0] == "sandwich":
                _, src, dst, shape = step
                gbar = _sandwich(state, gbar, src, dst, n, shape, roots)
                continue
            _, record, shape = step
            names = list(call_params(record))
            rule = find_rule(record.module)
            dense = getattr(rule, "kron_factors_dense", None)
            if dense is not None and type(record.module) is nn.Linear:
                results.append((record, dense(record, gbar, names)))
                continue
            root = roots(gbar)
            factor = root.T.reshape(root.shape[1], 1, *shape)
            results.append((record, rule.kron_factors(record, [factor], names)))
    for record, kron in results:
        params = call_params(record)
        for name, factors in kron.items():
            for ext in exts:
                setattr(params[name], ext.savefield, factors)
