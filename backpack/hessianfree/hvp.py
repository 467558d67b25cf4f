"""Hessian-vector products of a scalar function with autograd."""

from __future__ import annotations

import torch
from torch import Tensor

from backpack.hessianfree.lop import TensorOrSequence, as_tuple, vjp


def hessian_vector_product(
    f: Tensor,
    params: TensorOrSequence,
    v: TensorOrSequence,
    grad_params: TensorOrSequence | None = None,
    detach: bool = True,
) -> tuple[Tensor, ...]:
    """Hessian of the scalar `f` w.r.t. all of `params` (one joint block matrix) times `v`.

    The gradient of `f` is formed with a graph; its vector-Jacobian product with `v` is H v
    because the Hessian is symmetric. Cross terms between different parameters are included.

    Args:
        f: Scalar tensor depending on `params`.
        params: Tensor(s) to differentiate with respect to.
        v: Vectors shaped like `params`, one per tensor.
        grad_params: Gradients of `f` w.r.t. `params`, already computed with
            `create_graph=True`; they are reused instead of differentiating `f` again (handy for
            several products from one gradient).
        detach: Return detached tensors (otherwise they stay differentiable).

    Returns:
        One tensor per entry of `params`, shaped like it.

    """
    if f.numel() != 1:
        raise ValueError(f"hessian_vector_product needs a scalar f, got shape {tuple(f.shape)}.")
    params_t, v_t = as_tuple(params), as_tuple(v)
    if len(params_t) != len(v_t):
        raise ValueError(
            f"Got {len(params_t)} parameters but {len(v_t)} vectors; pass one vector per parameter."
        )
    if grad_params is None:
        grads = vjp(f, params_t, torch.ones_like(f))
    else:
        grads = as_tuple(grad_params)
        if len(grads) != len(params_t):
            raise ValueError(
                f"Got {len(params_t)} parameters but {len(grads)} gradients in grad_params."
            )
    result = vjp(grads, params_t, v_t)
    return tuple(r.detach() for r in result) if detach else result
