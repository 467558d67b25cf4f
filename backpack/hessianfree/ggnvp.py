"""Generalised Gauss-Newton-vector products Jᵀ H J v with autograd."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from backpack.hessianfree.hvp import hessian_vector_product
from backpack.hessianfree.lop import L_op, as_tuple
from backpack.hessianfree.rop import R_op


def ggn_vector_product_from_plist(
    loss: Tensor, output: Tensor, plist: Sequence[Tensor], v: Sequence[Tensor] | Tensor
) -> tuple[Tensor, ...]:
    """GGN of `loss` w.r.t. the parameters `plist`, through the model `output`, times `v`.

    With J the Jacobian of `output` w.r.t. the parameters and H the Hessian of `loss` w.r.t.
    `output`, returns Jᵀ H J v: one R-op, one Hessian-vector product in output space and one L-op.

    Args:
        loss: Scalar loss computed from `output`.
        output: Model output (a non-leaf tensor of the same graph).
        plist: Parameters (any tensors) the output depends on.
        v: Vectors shaped like `plist`, one per parameter.

    Returns:
        One detached tensor per parameter, shaped like it.

    """
    params = as_tuple(plist)
    (jv,) = R_op(output, params, as_tuple(v))
    (hjv,) = hessian_vector_product(loss, output, jv)
    return L_op(output, params, hjv)


def ggn_vector_product(
    loss: Tensor, output: Tensor, model: nn.Module, v: Sequence[Tensor] | Tensor
) -> tuple[Tensor, ...]:
    """GGN of `loss` w.r.t. the trainable parameters of `model` times `v`.

    The GGN spans the parameters with `requires_grad=True` (frozen ones are left out), in
    `model.parameters()` order; see `ggn_vector_product_from_plist`.

    Args:
        loss: Scalar loss computed from `output`.
        output: The model's output.
        model: Module whose trainable parameters span the GGN.
        v: Vectors shaped like the trainable parameters, in the same order.

    Returns:
        One detached tensor per trainable parameter, shaped like it.

    Raises:
        ValueError: If `v` does not hold one vector per trainable parameter.

    """
    params = [p for p in model.parameters() if p.requires_grad]
    vectors = as_tuple(v)
    if len(vectors) != len(params):
        frozen = sum(1 for p in model.parameters() if not p.requires_grad)
        raise ValueError(
            f"ggn_vector_product needs one vector per trainable parameter: the model has "
            f"{len(params)} trainable (and {frozen} frozen) parameters, got {len(vectors)} "
            "vectors."
        )
    return ggn_vector_product_from_plist(loss, output, params, vectors)
