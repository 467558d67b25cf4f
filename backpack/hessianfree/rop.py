"""Jacobian-vector products ("right" products, J v) with autograd's double-backward trick."""

from __future__ import annotations

import torch
from torch import Tensor

from backpack.hessianfree.lop import TensorOrSequence, as_tuple, check_vectors, vjp


def R_op(  # noqa: N802 (public name of the original API)
    ys: TensorOrSequence,
    xs: TensorOrSequence,
    vs: TensorOrSequence,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Jacobian-vector product: Σ_j (∂y/∂x_j) v_j for every y in `ys`.

    With dummy vectors u shaped like `ys`, g(u) = Jᵀ u is linear in u, so differentiating
    <g(u), v> w.r.t. u gives J v. Only reverse-mode autograd is used.

    Args:
        ys: Output tensor(s) of the graph.
        xs: Tensor(s) the outputs depend on.
        vs: Vectors shaped like `xs`, one per input.
        retain_graph: Keep the graph of `ys` for further backward passes.
        detach: Return detached tensors (otherwise they stay differentiable).

    Returns:
        One tensor per entry of `ys`, shaped like it.

    """
    ys_t, xs_t, vs_t = as_tuple(ys), as_tuple(xs), as_tuple(vs)
    check_vectors("R_op", xs_t, vs_t, "input")
    dummies = tuple(torch.zeros_like(y, requires_grad=True) for y in ys_t)
    gs = vjp(ys_t, xs_t, dummies, retain_graph=retain_graph)
    pairs = [(g, v) for g, v in zip(gs, vs_t, strict=True) if g.requires_grad]
    if not pairs:  # no input influences any output
        result = tuple(torch.zeros_like(y) for y in ys_t)
    else:
        result = vjp([g for g, _ in pairs], dummies, [v for _, v in pairs], retain_graph=True)
    return tuple(r.detach() for r in result) if detach else result


def jacobian_vector_product(
    f: TensorOrSequence,
    x: TensorOrSequence,
    v: TensorOrSequence,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """J v: the Jacobian of `f` w.r.t. `x` times `v` (the name client libraries use).

    Same as `R_op(f, x, v, retain_graph, detach)`.

    Args:
        f: Output tensor(s) of the graph.
        x: Tensor(s) the outputs depend on.
        v: Vectors shaped like `x`, one per input.
        retain_graph: Keep the graph of `f` for further backward passes.
        detach: Return detached tensors (otherwise they stay differentiable).

    Returns:
        One tensor per entry of `f`, shaped like it.

    """
    return R_op(f, x, v, retain_graph=retain_graph, detach=detach)
