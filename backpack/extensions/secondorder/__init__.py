"""Second-order extensions: curvature of the loss w.r.t. each parameter block.

All of them start from a symmetric factor S of the loss Hessian w.r.t. the model output (exact or
Monte-Carlo sampled), which autograd propagates backward to every parametrized module; each
module's rule turns the factor at its output into the requested quantity. The loss function must
be `extend`-ed.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from backpack.extensions.backprop_extension import BackpropExtension

_PRELOADED: set[str] = set()


def _preload_torch(products: bool = False) -> None:
    """Import the parts of torch that second-order backward passes would load lazily, once.

    Batched `torch.autograd.grad` imports torch's symbolic-shape machinery (sympy) on first use.
    The first forward-mode derivative (`torch.func.jvp`, used by `GGNMP`/`HMP`/`PCHMP` products)
    compiles torch's jvp decompositions with the deprecated `torch.jit.script`, which emits a
    `FutureWarning` about torch's own code, and imports `torch._dynamo` (`products=True`).
    Loading them when the extension is created keeps up to 0.6 s out of the first backward pass
    or product (and out of its timing) and keeps that warning away from users; first-order
    users pay nothing.
    """
    wanted = ["torch.fx.experimental.symbolic_shapes"]
    if products:
        wanted += ["torch._decomp.decompositions_for_jvp", "torch._dynamo"]
    for name in wanted:
        if name in _PRELOADED:
            continue
        _PRELOADED.add(name)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*torch.jit.script.*", FutureWarning)
                importlib.import_module(name)
        except Exception:  # pragma: no cover - an optimisation only; torch loads them later
            pass


class SecondOrderBackpropExtension(BackpropExtension):
    """A built-in second-order extension, described declaratively for the engine.

    Attributes:
        factor: "exact" (one column per output entry), "mc" (`mc_samples` sampled columns),
            "sum" (KFRA's batch-summed dense Hessian, backpropagated through the module chain)
            or "jacobian" (unit columns at the loss input: no loss Hessian, see BatchJacobian).
        output: What is stored: "diag", "batch_diag", "sqrt", "kron", "mp" (a callable) or
            "jacobian" (a square root without the loss Hessian, stored sample-major).
        residual: None (GGN), "signed" (exact Hessian), "clip" or "abs" (positive-curvature
            Hessian): how second derivatives of activations enter.
    """

    factor: str = "exact"
    output: str = "diag"
    residual: str | None = None
    _engine_handles = True

    def __init__(
        self,
        savefield: str,
        mc_samples: int = 1,
        subsampling: Sequence[int] | None = None,
    ) -> None:
        if self.factor == "mc" and (
            isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1
        ):
            raise ValueError(
                f"{self.__class__.__name__} needs mc_samples to be a positive integer, "
                f"got {mc_samples!r}."
            )
        super().__init__(savefield, subsampling=subsampling)
        self.mc_samples = mc_samples
        _preload_torch(products=self.output == "mp")

    @property
    def factor_key(self) -> tuple:
        """Identifies the loss-Hessian factor this extension needs (shared between extensions)."""
        return ("mc", self.mc_samples) if self.factor == "mc" else (self.factor,)

    def stored(self, value: Any) -> Any:
        """What is written to `savefield`, from the engine's value (layout changes only)."""
        return value

    def __repr__(self) -> str:
        if self.factor == "mc":
            return f"{self.__class__.__name__}(mc_samples={self.mc_samples})"
        return f"{self.__class__.__name__}()"


class DiagGGNExact(SecondOrderBackpropExtension):
    """Diagonal of the generalised Gauss-Newton matrix, saved as `diag_ggn_exact`."""

    def __init__(self) -> None:
        super().__init__("diag_ggn_exact")


class DiagGGNMC(SecondOrderBackpropExtension):
    """Monte-Carlo estimate of the GGN diagonal, saved as `diag_ggn_mc`."""

    factor = "mc"

    def __init__(self, mc_samples: int = 1) -> None:
        super().__init__("diag_ggn_mc", mc_samples=mc_samples)


class BatchDiagGGNExact(SecondOrderBackpropExtension):
    """Per-sample terms of the GGN diagonal `[N, *param.shape]`, saved as `diag_ggn_exact_batch`."""

    output = "batch_diag"

    def __init__(self) -> None:
        super().__init__("diag_ggn_exact_batch")


class BatchDiagGGNMC(SecondOrderBackpropExtension):
    """Per-sample terms of the MC GGN diagonal, saved as `diag_ggn_mc_batch`."""

    factor = "mc"
    output = "batch_diag"

    def __init__(self, mc_samples: int = 1) -> None:
        super().__init__("diag_ggn_mc_batch", mc_samples=mc_samples)


class SqrtGGNExact(SecondOrderBackpropExtension):
    """Symmetric factor `Jᵀ S` of the GGN block `[V, N, *param.shape]`, saved as `sqrt_ggn_exact`.

    Args:
        subsampling: Indices of the samples to keep.
    """

    output = "sqrt"

    def __init__(self, subsampling: Sequence[int] | None = None) -> None:
        super().__init__("sqrt_ggn_exact", subsampling=subsampling)


class SqrtGGNMC(SecondOrderBackpropExtension):
    """Monte-Carlo symmetric factor of the GGN `[M, N, *param.shape]`, saved as `sqrt_ggn_mc`."""

    factor = "mc"
    output = "sqrt"

    def __init__(self, mc_samples: int = 1, subsampling: Sequence[int] | None = None) -> None:
        super().__init__("sqrt_ggn_mc", mc_samples=mc_samples, subsampling=subsampling)


class BatchJacobian(SecondOrderBackpropExtension):
    """Per-sample Jacobians of the model output `[N, V, *param.shape]`, saved as `jac_batch`.

    Entry `[n, v]` is the derivative of entry v of sample n's output (the loss's input, flattened
    per sample: V = C for `[N, C]`, V = T·C for `[N, T, C]` in (t, c) order) w.r.t. the
    parameter. It rides the curvature pass of `SqrtGGNExact` with the identity in place of the
    loss Hessian's square root: unit columns start at the loss input, so the loss function, its
    value, reduction and weight in the backward do not matter (any extended loss, or none with
    `backpack.jacobians`). All V columns travel in one backward pass; C passes of `BatchGrad`
    on `out[:, c].sum()` give the same numbers.

    With several losses in one backward, each adds its own block of columns (in the order the
    losses were called). A token loss on flattened logits (`[N·T, C]` rows) gets columns
    (t, c), t being a row's position within its sample.

    The stored tensor is a transposed view of column-major storage (not contiguous).

    Args:
        subsampling: Indices of the samples to keep (rows of the result).
    """

    factor = "jacobian"
    output = "jacobian"

    def __init__(self, subsampling: Sequence[int] | None = None) -> None:
        super().__init__("jac_batch", subsampling=subsampling)
        #: parameter id -> `[V, N, *param.shape]` view where its result is to be written
        #: (set by `backpack.jacobians(flatten=True)`: slices of one flat buffer)
        self.destinations: dict[int, Tensor] = {}

    def stored(self, value: Any) -> Any:
        """`[N, V, *param.shape]`: the engine's `[V, N, *param.shape]`, transposed as a view.

        No copy (a copy of every Jacobian costs as much as writing it): the result is not
        contiguous; `.reshape` works, `.view` may need `.contiguous()` first.
        """
        return value.transpose(0, 1)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class DiagHessian(SecondOrderBackpropExtension):
    """Exact diagonal of the Hessian (incl. activations' second derivatives), saved as `diag_h`."""

    residual = "signed"

    def __init__(self) -> None:
        super().__init__("diag_h")


class BatchDiagHessian(SecondOrderBackpropExtension):
    """Per-sample terms of the Hessian diagonal `[N, *param.shape]`, saved as `diag_h_batch`."""

    residual = "signed"
    output = "batch_diag"

    def __init__(self) -> None:
        super().__init__("diag_h_batch")


class GGNMP(SecondOrderBackpropExtension):
    """Saves `ggnmp`: a function multiplying `[K, *param.shape]` by the parameter's GGN block."""

    output = "mp"

    def __init__(self) -> None:
        super().__init__("ggnmp")


class HMP(SecondOrderBackpropExtension):
    """Saves `hmp`: a function multiplying `[K, *param.shape]` by the parameter's Hessian block."""

    output = "mp"
    residual = "signed"

    def __init__(self) -> None:
        super().__init__("hmp")


class PCHMP(SecondOrderBackpropExtension):
    """Saves `pchmp`: products with the positive-curvature Hessian block.

    Args:
        modify: How negative second derivatives of activations are made non-negative:
            "clip" (set to zero) or "abs" (absolute value).
    """

    output = "mp"

    def __init__(self, modify: str = "clip") -> None:
        if modify not in ("clip", "abs"):
            raise ValueError(f"PCHMP's modify must be 'clip' or 'abs', got {modify!r}.")
        self.residual = modify
        super().__init__("pchmp")
        self.modify = modify


class HBP(SecondOrderBackpropExtension):
    """Kronecker-factored curvature (Hessian backpropagation), the family of KFAC/KFLR/KFRA.

    Args:
        savefield: Attribute name to save the list of Kronecker factors under.
        curvature: "mc" (KFAC: sampled loss-Hessian factor), "exact" (KFLR) or "sum"
            (KFRA: batch-averaged dense backpropagation through the module chain).
        mc_samples: Number of MC samples for curvature "mc".
        kfac_approx: How layers sharing their weight over positions (Linear on `[N, T, D]`,
            convolutions) are factored: "expand" (positions act like samples; the original
            BackPACK's convention for convolutions) or "reduce" (inputs averaged and output
            factors summed over positions first). See the docs' "Transformers" page.
    """

    output = "kron"

    def __init__(
        self,
        savefield: str = "hbp",
        curvature: str = "exact",
        mc_samples: int = 1,
        kfac_approx: str = "expand",
    ) -> None:
        if curvature not in ("mc", "exact", "sum"):
            raise ValueError(f"HBP curvature must be 'mc', 'exact' or 'sum', got {curvature!r}.")
        if kfac_approx not in ("expand", "reduce"):
            raise ValueError(
                f"{self.__class__.__name__} needs kfac_approx 'expand' or 'reduce', "
                f"got {kfac_approx!r}."
            )
        self.factor = curvature
        self.kfac_approx = kfac_approx
        super().__init__(savefield, mc_samples=mc_samples)

    def __repr__(self) -> str:
        args = [f"mc_samples={self.mc_samples}"] if self.factor == "mc" else []
        if self.kfac_approx != "expand":
            args.append(f"kfac_approx={self.kfac_approx!r}")
        return f"{self.__class__.__name__}({', '.join(args)})"


class KFAC(HBP):
    """Kronecker factors with a Monte-Carlo loss-Hessian factor, saved as `kfac`."""

    def __init__(self, mc_samples: int = 1, kfac_approx: str = "expand") -> None:
        super().__init__("kfac", curvature="mc", mc_samples=mc_samples, kfac_approx=kfac_approx)


class KFLR(HBP):
    """Kronecker factors with the exact loss-Hessian factor, saved as `kflr`."""

    def __init__(self, kfac_approx: str = "expand") -> None:
        super().__init__("kflr", curvature="exact", kfac_approx=kfac_approx)


class KFRA(HBP):
    """Kronecker factors with batch-averaged recursive curvature, saved as `kfra`."""

    def __init__(self) -> None:
        super().__init__("kfra", curvature="sum")


__all__ = [
    "SecondOrderBackpropExtension",
    "DiagGGNExact",
    "DiagGGNMC",
    "BatchDiagGGNExact",
    "BatchDiagGGNMC",
    "SqrtGGNExact",
    "SqrtGGNMC",
    "BatchJacobian",
    "DiagHessian",
    "BatchDiagHessian",
    "GGNMP",
    "HMP",
    "PCHMP",
    "HBP",
    "KFAC",
    "KFLR",
    "KFRA",
]
