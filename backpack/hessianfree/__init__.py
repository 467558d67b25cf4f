"""Matrix-free curvature products with plain autograd (no `extend` or `backpack(...)` needed).

- `lop.L_op` (alias `lop.transposed_jacobian_vector_product`): vector-Jacobian products (Jᵀ w),
- `rop.R_op` (alias `rop.jacobian_vector_product`): Jacobian-vector products (J v) by
  differentiating a vector-Jacobian product,
- `hvp.hessian_vector_product`: Hessian of a scalar times a vector,
- `ggnvp.ggn_vector_product` / `ggn_vector_product_from_plist`: generalised Gauss-Newton times a
  vector, Jᵀ H J v, with J the Jacobian of the model output and H the loss Hessian w.r.t. it.

Every function returns a tuple of tensors, one per differentiated tensor, detached by default.
"""

from backpack.hessianfree import ggnvp, hvp, lop, rop
from backpack.hessianfree.ggnvp import ggn_vector_product, ggn_vector_product_from_plist
from backpack.hessianfree.hvp import hessian_vector_product
from backpack.hessianfree.lop import L_op, transposed_jacobian_vector_product
from backpack.hessianfree.rop import R_op, jacobian_vector_product

__all__ = [
    "L_op",
    "R_op",
    "ggn_vector_product",
    "ggn_vector_product_from_plist",
    "ggnvp",
    "hessian_vector_product",
    "hvp",
    "jacobian_vector_product",
    "lop",
    "rop",
    "transposed_jacobian_vector_product",
]
