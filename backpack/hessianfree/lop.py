"""Vector-Jacobian products ("left" products, Jᵀ w) with autograd."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

TensorOrSequence = Tensor | Sequence[Tensor]


def as_tuple(tensors: TensorOrSequence) -> tuple[Tensor, ...]:
    """Turn a single tensor into a one-element tuple and a sequence into a tuple."""
    if isinstance(tensors, Tensor):
        return (tensors,)
    return tuple(tensors)


def check_vectors(
    op: str, tensors: tuple[Tensor, ...], vectors: tuple[Tensor, ...], what: str
) -> None:
    """Raise `ValueError` unless there is one vector per tensor, each of the tensor's shape."""
    if len(tensors) != len(vectors):
        raise ValueError(
            f"{op} needs one vector per {what}: got {len(tensors)} {what}s and "
            f"{len(vectors)} vectors."
        )
    for t, v in zip(tensors, vectors, strict=True):
        if t.shape != v.shape:
            raise ValueError(
                f"Vector of shape {tuple(v.shape)} does not match {what} shape {tuple(t.shape)}."
            )


def check_differentiable(xs: tuple[Tensor, ...]) -> None:
    """Raise `RuntimeError` naming the first tensor of `xs` that autograd does not track."""
    for i, x in enumerate(xs):
        if not x.requires_grad:
            raise RuntimeError(
                f"Cannot differentiate w.r.t. tensor {i} (shape {tuple(x.shape)}): it does not "
                "require grad (a frozen parameter?). Pass only the trainable ones, e.g. "
                "[p for p in model.parameters() if p.requires_grad], with one vector each."
            )


def vjp(
    ys: TensorOrSequence,
    xs: TensorOrSequence,
    ws: TensorOrSequence,
    retain_graph: bool = True,
) -> tuple[Tensor, ...]:
    """Σ_i J_{y_i}ᵀ w_i w.r.t. each x, differentiable (`create_graph=True`), zeros where unused."""
    ys_t, xs_t, ws_t = as_tuple(ys), as_tuple(xs), as_tuple(ws)
    check_vectors("L_op", ys_t, ws_t, "output")
    pairs = [(y, w) for y, w in zip(ys_t, ws_t, strict=True) if y.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(x) for x in xs_t)
    check_differentiable(xs_t)
    grads = torch.autograd.grad(
        [y for y, _ in pairs],
        xs_t,
        grad_outputs=[w for _, w in pairs],
        create_graph=True,
        retain_graph=retain_graph,
        allow_unused=True,
    )
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs_t, strict=True))


def L_op(  # noqa: N802 (public name of the original API)
    ys: TensorOrSequence,
    xs: TensorOrSequence,
    ws: TensorOrSequence,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Vector-Jacobian product: Σ_i (∂y_i/∂x)ᵀ w_i for every x in `xs`.

    The graph is built with `create_graph=True` and kept (`retain_graph=True` by default), so the
    same forward can serve further products.

    Args:
        ys: Output tensor(s) of the graph.
        xs: Tensor(s) to differentiate with respect to.
        ws: Vectors shaped like `ys`, one per output.
        retain_graph: Keep the graph of `ys` for further backward passes.
        detach: Return detached tensors (otherwise they stay differentiable).

    Returns:
        One tensor per entry of `xs`, shaped like it (zeros where `ys` does not depend on it).

    """
    result = vjp(ys, xs, ws, retain_graph=retain_graph)
    return tuple(r.detach() for r in result) if detach else result


def transposed_jacobian_vector_product(
    f: TensorOrSequence,
    x: TensorOrSequence,
    v: TensorOrSequence,
    retain_graph: bool = True,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Jᵀ v: the transposed Jacobian of `f` w.r.t. `x` times `v` (the name client libraries use).

    Same as `L_op(f, x, v, retain_graph, detach)`.

    Args:
        f: Output tensor(s) of the graph.
        x: Tensor(s) to differentiate with respect to.
        v: Vectors shaped like `f`, one per output.
        retain_graph: Keep the graph of `f` for further backward passes.
        detach: Return detached tensors (otherwise they stay differentiable).

    Returns:
        One tensor per entry of `x`, shaped like it.

    """
    return L_op(f, x, v, retain_graph=retain_graph, detach=detach)
