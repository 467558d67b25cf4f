"""How each extension's batch quantity combines into the quantity of the data-set loss.

A quantity carrying the reduction factor R to the power k is brought to the scale of
`reduction="sum"` by multiplying batch b's value by `s_b^k` (`s_b = ν_b` for "mean", 1 for "sum"),
summed (or concatenated) over batches and divided by `ν^k` (`ν = Σ_b ν_b`, 1 for "sum"). States
are kept relative to the sweep's first batch, `s_b / s_ref` and `N_b / N_ref` (first batch's
scale and sample count), so that a one-batch sweep gives that batch's values bit for bit; merging
two sweeps rescales the second's states to the first's references.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from backpack.extensions import (
    GGNMP,
    HMP,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
    BatchDotGrad,
    BatchGrad,
    BatchJacobian,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.secondorder import HBP

#: called with (batch index, parameter name, value): per-sample rows streamed out of a sweep
Callback = Callable[[int, str, Tensor], None]


def wide(t: Tensor, copy: bool = False) -> Tensor:
    """`t` in float64 where it is a lower-precision float (sums over a data set are kept so).

    Summed in float32, a data set's factors depend on the order of the batches (and on how the
    ranks split them) by float32's rounding, which nearly equal eigenvalues amplify about a
    thousandfold into EK-FAC's scores. Summed in float64 and cast back once, they come out the
    same in any order. With `copy`, always a new tensor (a state later batches add into).
    """
    return t.to(wide_dtype(t), copy=copy)


def wide_dtype(t: Tensor) -> torch.dtype:
    """The dtype `wide(t)` has."""
    return torch.float64 if t.is_floating_point() and t.dtype.itemsize < 8 else t.dtype


@dataclass
class BatchScale:
    """What a batch contributes with.

    Attributes:
        index: Position in the sweep.
        scale: `s_b / s_ref`.
        num_samples: `N_b`.
        count_scale: `N_b / N_ref`.
        stream_total: `ν / s_ref` that streamed rows are divided by (to the power k).
    """

    index: int
    scale: float
    num_samples: int
    count_scale: float = 1.0
    stream_total: float | None = None


class Kind:
    """The combination rule of one extension's quantity (see the module docstring)."""

    #: power of the reduction factor R the quantity carries
    power: float = 1.0

    def __init__(self, savefield: str) -> None:
        self.savefield = savefield

    def add(self, state, value, batch: BatchScale, name: str, grad: Tensor | None):
        """The state after adding one batch's `value` of parameter `name`."""
        raise NotImplementedError

    def skip(self, state, batch: BatchScale, name: str, param: Tensor):
        """The state after a batch without any loss term (ν_b = 0 under "mean")."""
        return state

    def merge(self, a, b):
        """The state of two sweeps together."""
        if a is None:
            return b
        if b is None:
            return a
        return a + b

    def rescale(self, state, ratio: float, count_ratio: float):
        """The state relative to references `ratio` (scale) and `count_ratio` times larger."""
        if state is None:
            return None
        return state * ratio**self.power

    def final(self, state, total: float, count: float):
        """The quantity of the data-set loss (`total = ν / s_ref`, `count = N / N_ref`)."""
        return state / total**self.power


class Summed(Kind):
    """Sums over samples (diagonals, second moments): `Σ_b s_b^k Q_b / ν^k`.

    Summed in float64 (`wide`) and given back in the values' own dtype.
    """

    #: whether the states are kept in float64
    widen = True

    def __init__(self, savefield: str, power: float) -> None:
        super().__init__(savefield)
        self.power = power
        #: the dtype of the batches' values (and of `final`)
        self.dtype: torch.dtype | None = None

    def widened(self, value: Tensor) -> Tensor:
        """`value` as the state sums it (remembering its own dtype)."""
        if not self.widen:
            return value
        self.dtype = self.dtype or value.dtype
        return wide(value, copy=True)  # later batches add into it in place

    def add(self, state, value, batch, name, grad):  # noqa: D102
        if batch.scale != 1:
            value = value * batch.scale**self.power
        if state is not None and self.widen:  # the float64 state is the sweep's own
            return state.add_(value)
        value = self.widened(value)
        return value if state is None else state + value

    def final(self, state, total, count):  # noqa: D102
        out = state if total == 1 else state / total**self.power
        return out if self.dtype is None or out is None else out.to(self.dtype)


class Rows(Kind):
    """Per-sample quantities: rows concatenated over batches along `dim` (or streamed)."""

    def __init__(self, savefield: str, power: float, dim: int = 0) -> None:
        super().__init__(savefield)
        self.power = power
        self.dim = dim
        self.callback: Callback | None = None

    def add(self, state, value, batch, name, grad):  # noqa: D102
        if value.shape[self.dim] != batch.num_samples:
            raise ValueError(
                f"{self.savefield} of {name} has {value.shape[self.dim]} samples in batch "
                f"{batch.index}, but the inputs have {batch.num_samples}: pass "
                "num_samples=lambda X: <number of samples> to count the samples as backpack does."
            )
        if batch.scale != 1:
            value = value * batch.scale**self.power
        if self.callback is not None:
            total = batch.stream_total
            self.callback(batch.index, name, value if total == 1 else value / total**self.power)
            return state
        return [value] if state is None else state + [value]

    def skip(self, state, batch, name, param):  # noqa: D102
        if self.dim != 0:
            raise ValueError(
                f"Batch {batch.index} has no loss term (all targets ignored); {self.savefield} "
                "cannot give it rows."
            )
        shape = (batch.num_samples,) + (
            (tuple(param.shape)) if self.savefield != "batch_l2" else ()
        )
        zeros = torch.zeros(shape, dtype=param.dtype, device=param.device)
        return self.add(state, zeros, batch, name, None)

    def merge(self, a, b):  # noqa: D102
        if a is None or b is None:
            return a if b is None else b
        return a + b

    def rescale(self, state, ratio, count_ratio):  # noqa: D102
        if state is None:
            return None
        return [v * ratio**self.power for v in state]

    def final(self, state, total, count):  # noqa: D102
        if state is None:
            return None
        rows = torch.cat(state, dim=self.dim) if len(state) > 1 else state[0]
        return rows if total == 1 else rows / total**self.power


class VarianceKind(Kind):
    """Variance over all samples: counts, means and variances merged exactly.

    With `g_n` the per-sample gradients at the (relative) scale of `reduction="sum"`, a state is
    `(count, mean, var)` with `var = Σ_n (g_n − mean)² / count`. Two states merge by Chan et
    al.'s formula `n var = n_a var_a + n_b var_b + δ² n_a n_b / n` (δ = mean_b − mean_a); the
    variance of the data set's per-sample gradients `g_n / ν` is `var / ν²`.
    """

    power = 2.0

    def add(self, state, value, batch, name, grad):  # noqa: D102
        if grad is None:
            raise ValueError(f"{name} has no .grad after batch {batch.index}.")
        count = batch.num_samples
        mean = grad * (batch.scale / count)
        var = value if batch.scale == 1 else value * batch.scale**2
        return self.merge(state, (count, mean, var))

    def skip(self, state, batch, name, param):  # noqa: D102
        zeros = torch.zeros_like(param)
        return self.merge(state, (batch.num_samples, zeros, zeros.clone()))

    def merge(self, a, b):  # noqa: D102
        if a is None or b is None:
            return a if b is None else b
        (na, ma, va), (nb, mb, vb) = a, b
        n = na + nb
        delta = mb - ma
        var = (va * na + vb * nb + delta.square() * (na * nb / n)) / n
        return n, ma + delta * (nb / n), var

    def rescale(self, state, ratio, count_ratio):  # noqa: D102
        if state is None:
            return None
        count, mean, var = state
        return count, mean * ratio, var * ratio**2

    def final(self, state, total, count):  # noqa: D102
        return state[2] if total == 1 else state[2] / total**2


class KronKind(Kind):
    """Kronecker factors: `[G, A]` (or one factor `[G]`, a bias's or a dense block `[B]`).

    `G` (and `B`) are sums over samples and scale with R: summed as `Σ_b s_b G_b / ν`. `A` is a
    mean over a batch's inputs, independent of the loss: averaged over all inputs of the data
    set as `Σ_b N_b A_b / Σ_b N_b` (every sample of a sweep has the same number of positions).
    """

    def __init__(self, savefield: str) -> None:
        super().__init__(savefield)
        #: the dtype of the batches' factors (and of `final`); the states are float64 (`wide`)
        self.dtype: torch.dtype | None = None

    def widened(self, factors: list[Tensor]) -> list[Tensor]:
        """`factors` as the state sums them (remembering their own dtype)."""
        self.dtype = self.dtype or factors[0].dtype
        return [wide(f, copy=True) for f in factors]  # later batches add in place

    def add(self, state, value, batch, name, grad):  # noqa: D102
        if len(value) not in (1, 2):
            raise ValueError(f"{self.savefield} of {name} has {len(value)} factors, not 1 or 2.")
        new = [value[0] if batch.scale == 1 else value[0] * batch.scale]
        if len(value) == 2:
            new.append(value[1] if batch.count_scale == 1 else value[1] * batch.count_scale)
        if state is None:
            return self.widened(new)
        if len(state) != len(new):
            raise ValueError(f"{self.savefield}: different numbers of factors in two batches.")
        return [s.add_(v) for s, v in zip(state, new)]  # the float64 states are the sweep's own

    def skip(self, state, batch, name, param):  # noqa: D102
        raise ValueError(
            f"Batch {batch.index} has no loss term (all targets ignored): its inputs would count "
            f"in the input factors of {self.savefield} with no output factor; drop the batch."
        )

    def merge(self, a, b):  # noqa: D102
        if a is None or b is None:
            return a if b is None else b
        if len(a) != len(b):
            raise ValueError(f"{self.savefield}: different numbers of factors in two sweeps.")
        return [x + y for x, y in zip(a, b)]

    def rescale(self, state, ratio, count_ratio):  # noqa: D102
        if state is None:
            return None
        out = [state[0] * ratio]
        if len(state) == 2:
            out.append(state[1] * count_ratio)
        return out

    def final(self, state, total, count):  # noqa: D102
        out = [state[0] if total == 1 else state[0] / total]
        if len(state) == 2:
            out.append(state[1] if count == 1 else state[1] / count)
        return out if self.dtype is None else [f.to(self.dtype) for f in out]


class GradKind(Summed):
    """The gradient of the data-set loss (kept for `Variance` and written to `.grad`)."""

    widen = False  # read as it is (`Accumulated.gradient`)

    def __init__(self) -> None:
        super().__init__("grad", power=1.0)


def kind_of(extension: BackpropExtension) -> Kind:
    """The combination rule of `extension`'s quantity.

    Raises:
        NotImplementedError: For extensions without an exact data-set version.
        ValueError: For per-sample extensions with `subsampling`.
    """
    field = extension.savefield
    if extension.get_subsampling() is not None:
        raise ValueError(
            f"{extension!r}: subsampling selects samples per batch; a data-set sweep does not "
            "support it (select the samples in the data instead)."
        )
    if isinstance(extension, BatchDotGrad):
        raise NotImplementedError(
            "BatchDotGrad over a data set would be an [N_total, N_total] matrix; compute "
            "BatchGrad rows with a callback and form the products you need blockwise."
        )
    if isinstance(extension, (KFRA, GGNMP, HMP, PCHMP)):
        raise NotImplementedError(
            f"{type(extension).__name__} has no exact data-set version (KFRA's recursion "
            "averages per batch; matrix-product closures would keep every batch's graph). Use "
            "KFLR/KFAC, or the operators GGN/Hessian of backpack.curvature."
        )
    if isinstance(extension, HBP):
        if extension.factor == "sum":
            raise NotImplementedError("HBP with curvature='sum' (KFRA) cannot be accumulated.")
        return KronKind(field)
    if isinstance(extension, Variance):
        return VarianceKind(field)
    if isinstance(extension, (DiagGGNExact, DiagGGNMC, DiagHessian)):
        return Summed(field, power=1.0)
    if isinstance(extension, SumGradSquared):
        return Summed(field, power=2.0)
    if isinstance(extension, (BatchGrad, BatchDiagGGNExact, BatchDiagGGNMC, BatchDiagHessian)):
        return Rows(field, power=1.0)
    if isinstance(extension, BatchL2Grad):
        return Rows(field, power=2.0)
    if isinstance(extension, (SqrtGGNExact, SqrtGGNMC)):
        return Rows(field, power=0.5, dim=1)
    if isinstance(extension, BatchJacobian):  # output Jacobians carry no reduction factor
        return Rows(field, power=0.0)
    raise NotImplementedError(
        f"accumulate does not know how {type(extension).__name__} ({field}) combines over batches."
    )


def isclose(a: float, b: float) -> bool:
    """Normalisers agree (they are sums of weights, so compare with a relative tolerance)."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
