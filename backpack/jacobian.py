"""Per-sample Jacobians of a model's output w.r.t. its parameters, in one backward pass.

A GLM predictive (the linearised Laplace approximation) needs `J_n = ∂f(x_n)/∂θ` for every sample
and output entry. One `BatchGrad` pass per output entry gives them, C passes in all; the
curvature pass of `SqrtGGNExact` gives them in one, when the columns it starts from at the model
output are the identity instead of the loss Hessian's square root (`BatchJacobian`). `jacobians`
runs that pass without any loss: a stand-in loss (`OutputSeed`) marks where the columns start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from backpack.api import backpack, extend
from backpack.extensions.secondorder import BatchJacobian

__all__ = ["jacobians", "OutputSeed"]


class OutputSeed(nn.modules.loss._Loss):
    """A stand-in loss where `BatchJacobian`'s columns start: returns `0 · Σ output`.

    Its value and gradient are zero (the parameters' `.grad` gain nothing); it only marks the
    model output as the loss input. Other second-order extensions refuse it (it has no
    Hessian); first-order extensions see zero gradients.
    """

    def forward(self, output: Tensor) -> Tensor:  # noqa: D102
        return output.sum() * 0.0


def jacobians(
    model: nn.Module,
    X: Any,
    flatten: bool = False,
    subsampling: Sequence[int] | None = None,
) -> tuple[Tensor, dict[str, Tensor] | Tensor]:
    """The model output on `X` and its per-sample Jacobians w.r.t. the trainable parameters.

    One forward and one backward pass (`BatchJacobian`), instead of one `BatchGrad` pass per
    output entry. `model` is extended in place (as `extend(model)` does); the parameters'
    `.grad` are left as they were.

    Args:
        model: The model; its output's first axis must be the samples (`[N, C]`, or `[N, T, C]`
            and other shapes: one Jacobian row per output entry of a sample).
        X: The input batch, passed as `model(X)`.
        flatten: Return one `[N, *out.shape[1:], P]` tensor, the parameters' Jacobians
            flattened and concatenated in `model.named_parameters()` order (the layout of a GLM
            predictive's `J`), instead of a dictionary.
        subsampling: Indices of the samples to keep (rows of the Jacobians; the output is the
            whole batch's).

    Returns:
        `(output, jac)`: the detached output `[N, *out]` and, per trainable parameter name,
        `[N, *out, *param.shape]` (or the flattened tensor, see `flatten`). A parameter the
        output does not depend on gets zeros.

    Raises:
        TypeError: If the model output is not a tensor.
        ValueError: If it does not depend on any trainable parameter.
    """
    extend(model)
    seed = extend(OutputSeed())
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        out = model(X)
    if not isinstance(out, Tensor):
        raise TypeError(f"jacobians needs a model returning a tensor, got {type(out).__name__}.")
    if not out.requires_grad or not params:
        raise ValueError(
            "jacobians: the model output does not depend on any trainable parameter "
            "(requires_grad=False everywhere, or run under torch.no_grad/inference_mode)."
        )
    saved = [p.grad for _, p in params]
    ext = BatchJacobian(subsampling=subsampling)
    rows = out.shape[0] if subsampling is None else len(subsampling)
    columns = math.prod(out.shape[1:])
    sizes = [p.numel() for _, p in params]
    flat = None
    if flatten:
        # one buffer `[rows, V, P]`; each parameter's `[V, rows, *shape]` result is written
        # into its slice (in place where the rule can: a Jacobian as large as the model times
        # the outputs is then written once, not once per parameter and again by a `cat`)
        dtype = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype
        flat = out.new_empty(rows, columns, sum(sizes), dtype=dtype)
        for (_, p), piece in zip(params, flat.split(sizes, dim=-1)):
            ext.destinations[id(p)] = piece.transpose(0, 1).view(columns, rows, *p.shape)
    try:
        with backpack(ext):
            seed(out).backward()
        values = [p.__dict__.pop(ext.savefield, None) for _, p in params]
    finally:
        ext.destinations.clear()
        for (_, p), grad in zip(params, saved):
            p.grad = grad
            p.__dict__.pop(ext.savefield, None)
    out = out.detach()
    if flat is not None:
        for value, piece in zip(values, flat.split(sizes, dim=-1)):
            if value is None:
                piece.zero_()
            elif not _same_memory(value, piece):
                piece.copy_(value.reshape(rows, columns, -1))
        return out, flat.reshape(rows, *out.shape[1:], -1)
    jac = {}
    for (name, p), value in zip(params, values):
        if value is None:
            value = out.new_zeros(rows, *out.shape[1:], *p.shape, dtype=p.dtype)
        jac[name] = value.reshape(rows, *out.shape[1:], *p.shape)
    return out, jac


def _same_memory(value: Tensor, piece: Tensor) -> bool:
    """Whether `value` (`[rows, V, *shape]`) is `piece` (`[rows, V, numel]`) already."""
    return (
        value.data_ptr() == piece.data_ptr()
        and value.dtype == piece.dtype
        and value.reshape(piece.shape).stride() == piece.stride()
    )
