"""Curvature matrices of a data-set loss as linear operators: `GGN`, `Hessian`, `EmpiricalFisher`.

Every operator is a symmetric `[P, P]` matrix over the trainable parameters, in
`model.parameters()` order, of the data-set loss (see `backpack.curvature.accumulate`). `op @ V`
sweeps the data once for all K columns of `V`: per batch, the K products are batched with
`torch.func.vmap` over reverse-mode derivatives of one plain autograd forward (so they
differentiate what `.grad` differentiates), or formed from backpack's per-sample quantities.
Every sweep must see one fixed function of the parameters (`backpack.curvature._forward`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import grad, vjp, vmap

from backpack.api import backpack, disable
from backpack.curvature._data import (
    Batch,
    Normaliser,
    needs_reiterable,
    trainable,
)
from backpack.curvature._distributed import (
    all_sum,
    check_not_fully_sharded,
    guarded,
    local_module,
    rank_of,
)
from backpack.curvature._forward import (
    fixed_forward,
    product_forward,
    refuse_unfaithful_gradients,
    refuse_unfixed_forward,
)
from backpack.curvature._sweep import Sweep
from backpack.curvature.accumulate import accumulate_over
from backpack.curvature.cg import CGInfo, NotPositiveDefiniteError, conjugate_gradients
from backpack.extensions import BatchGrad, DiagGGNExact, DiagHessian, SqrtGGNMC, SumGradSquared

__all__ = ["CurvatureOperator", "CGInverse", "GGN", "Hessian", "EmpiricalFisher"]


class CurvatureOperator:
    """A symmetric `[P, P]` matrix over the model's trainable parameters.

    Subclasses implement `_matmat` on `[P, K]` matrices (and may override `diagonal`).

    Attributes:
        names: Trainable parameter names, in `model.parameters()` order.
        shapes: Their shapes.
    """

    def __init__(self, model: nn.Module, params: list[tuple[str, nn.Parameter]]) -> None:
        if not params:
            raise ValueError("The model has no trainable parameter.")
        self.model = model
        self.names = [name for name, _ in params]
        self.shapes = [tuple(p.shape) for _, p in params]
        self.numels = [p.numel() for _, p in params]
        self.dtype = params[0][1].dtype
        self.device = params[0][1].device

    @property
    def shape(self) -> tuple[int, int]:
        """`(P, P)`."""
        size = sum(self.numels)
        return size, size

    def _matmat(self, V: Tensor) -> Tensor:
        raise NotImplementedError

    @contextmanager
    def cached(self, max_bytes: int | None = None) -> Iterator[None]:
        """Reuse work between the products made inside the block (see `Hessian.cached`).

        A no-op for operators whose products have nothing to keep.
        """
        yield

    def __matmul__(self, v: Tensor) -> Tensor:
        """The product with `v` of shape `[P]` or `[P, K]` (same shape out)."""
        if not isinstance(v, Tensor):
            return NotImplemented
        if v.dim() not in (1, 2) or v.shape[0] != self.shape[0]:
            raise ValueError(
                f"{type(self).__name__} multiplies [P] or [P, K] tensors with P = "
                f"{self.shape[0]}, got shape {tuple(v.shape)}."
            )
        V = v.reshape(self.shape[0], -1).to(device=self.device, dtype=self.dtype)
        return self._matmat(V).reshape(v.shape)

    def matmat(self, V: Tensor) -> Tensor:
        """The product with a `[P, K]` matrix."""
        return self @ V

    def split(self, V: Tensor) -> list[Tensor]:
        """`[P, K]` → one `[K, *shape]` tensor per parameter."""
        blocks = V.split(self.numels, dim=0)
        return [b.T.reshape(-1, *s) for b, s in zip(blocks, self.shapes)]

    def join(self, blocks: list[Tensor]) -> Tensor:
        """Inverse of `split`: one `[K, *shape]` tensor per parameter → `[P, K]`."""
        return torch.cat([b.reshape(b.shape[0], -1) for b in blocks], dim=1).T

    def to_dense(self) -> Tensor:
        """The dense `[P, P]` matrix (P products; mind the memory)."""
        eye = torch.eye(self.shape[0], dtype=self.dtype, device=self.device)
        dense = self @ eye
        return (dense + dense.T) / 2

    def diagonal(self) -> Tensor:
        """The diagonal `[P]` (default: of the dense matrix)."""
        return self.to_dense().diagonal().clone()

    def trace(self) -> Tensor:
        """The trace (sum of `diagonal()`)."""
        return self.diagonal().sum()

    def to_scipy(self):
        """A `scipy.sparse.linalg.LinearOperator` (float64 numpy in and out; needs SciPy)."""
        try:
            from scipy.sparse.linalg import LinearOperator
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "to_scipy() needs SciPy, an optional dependency: pip install scipy."
            ) from err
        import numpy as np

        def matmat(x):
            x = np.asarray(x)
            out = self @ torch.as_tensor(x, dtype=self.dtype, device=self.device)
            return out.detach().cpu().to(torch.float64).numpy()

        return LinearOperator(
            self.shape,
            matvec=matmat,
            rmatvec=matmat,
            matmat=matmat,
            rmatmat=matmat,
            dtype=np.float64,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"


class CGInverse(CurvatureOperator):
    """`(A + λI)⁻¹` of a symmetric operator `A`, each product solved by conjugate gradients.

    Built by `inverse(damping)` of `GGN`, `Hessian` and `EmpiricalFisher`. `inv @ v` for `v` of
    shape `[P]` or `[P, K]` returns `x` with `‖v_k − (A + λI) x_k‖ ≤ tol · ‖v_k‖` for every column
    k (batched CG, `backpack.curvature.cg.conjugate_gradients`), or warns when `max_iter`
    iterations did not get there (the last iterate is returned). `inv.info` describes the last
    solve (a `CGInfo`: iterations, residuals, converged).

    CG needs a positive definite system. `GGN` (convex losses) and `EmpiricalFisher` are positive
    semi-definite: any `λ > 0` makes them definite. The `Hessian` is indefinite in general:
    `H + λI` is definite only for `λ > −λ_min(H)`. A search direction of non-positive curvature
    proves the system indefinite and raises `ValueError`; negative directions the iteration
    never meets go unnoticed (the result still solves the system if the residual reached `tol`).

    Cost: per iteration one product with `A` of the columns still running (one sweep over the
    data for all of them) and one of the preconditioner. The number of iterations grows like
    `√κ`, `κ = (λ_max + λ)/(λ_min + λ)`: more damping, fewer sweeps. At most `max_iter` sweeps
    per product with `inv`; `to_dense()` solves P systems.
    """

    def __init__(
        self,
        op: CurvatureOperator,
        damping: float,
        tol: float = 1e-6,
        max_iter: int | None = None,
        preconditioner: Any = None,
    ) -> None:
        for label, value, strict in (("damping", damping, False), ("tol", tol, True)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value < 0
                or (strict and value == 0)
            ):
                relation = "positive" if strict else "non-negative"
                raise ValueError(f"{label} must be a {relation} number, got {value!r}.")
        if max_iter is not None and (
            isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1
        ):
            raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}.")
        self.op = op
        self.model = op.model
        self.names, self.shapes, self.numels = op.names, op.shapes, op.numels
        self.dtype, self.device = op.dtype, op.device
        self.damping = float(damping)
        self.tol = float(tol)
        self.max_iter = max_iter if max_iter is not None else min(2 * op.shape[0], 1000)
        self.preconditioner = preconditioner
        self.info: CGInfo | None = None

    def _matmat(self, V: Tensor) -> Tensor:
        name = f"({type(self.op).__name__} + {self.damping:g}·I)"
        precondition = None
        if self.preconditioner is not None:
            precondition = self.preconditioner.__matmul__
        try:
            with self.op.cached():  # e.g. the Hessian's graphs, kept over the iterations
                X, self.info = conjugate_gradients(
                    lambda W: self.op @ W + self.damping * W,
                    V,
                    tol=self.tol,
                    max_iter=self.max_iter,
                    preconditioner=precondition,
                    name=name,
                )
        except NotPositiveDefiniteError as err:
            if isinstance(self.op, Hessian) and "pᵀSp" in str(err):
                raise NotPositiveDefiniteError(
                    f"{err} The Hessian is indefinite in general: use a damping above "
                    "−λ_min(H) (estimate λ_min with eigvalsh of the negated Hessian), or the GGN, "
                    "which is positive semi-definite."
                ) from None
            raise
        return X

    def __repr__(self) -> str:
        return (
            f"CGInverse({type(self.op).__name__}, damping={self.damping:g}, tol={self.tol:g}, "
            f"shape={self.shape})"
        )


class _DataOperator(CurvatureOperator):
    """An operator of a data-set loss: products sweep the data, summing batches' contributions.

    A batch contributes its product at the scale of `reduction="sum"` (`_batch_product`); the
    sum over batches is divided by `ν` once for "mean". Under torch.distributed (`distributed`,
    as in `accumulate`) `data` is this rank's shard: every product sums the ranks' partial
    products and normalisers in one all-reduce, so it is a collective (every rank multiplies,
    with the same matrix) and every rank gets the whole data set's product.

    Every sweep must see one fixed function of the parameters: models with batch statistics
    (BatchNorm in training mode), layers whose gradient is not the loss's derivative
    (`scale_grad_by_freq`) and random forwards (dropout in training mode) are refused, the last
    unless `forward_seed` is given: every sweep (products, diagonal) then starts the random
    generators from that seed, so each batch gets the same masks in every sweep.
    """

    def __init__(
        self,
        model: nn.Module,
        lossfunc: Any,
        data: Iterable,
        progress: bool = False,
        column_chunk: int = 64,
        normaliser: Normaliser | None = None,
        num_samples: Callable[[Any], int] | None = None,
        distributed: bool | None = None,
        forward_seed: int | None = None,
    ) -> None:
        name = type(self).__name__
        needs_reiterable(data, name)
        model = local_module(model)
        check_not_fully_sharded(model, name)
        if forward_seed is not None and (
            isinstance(forward_seed, bool) or not isinstance(forward_seed, int)
        ):
            raise ValueError(f"forward_seed must be None or an integer, got {forward_seed!r}.")
        refuse_unfaithful_gradients(model, name)
        refuse_unfixed_forward(model, name, forward_seed)
        super().__init__(model, trainable(model))
        self.forward_seed = forward_seed
        self.column_chunk = column_chunk
        #: the model, loss and data every product sweeps (see `backpack.curvature._sweep`)
        self.sweep = Sweep(
            model,
            lossfunc,
            data,
            progress=progress,
            normaliser=normaliser,
            num_samples=num_samples,
            distributed=distributed,
            what=name,
        )
        self._fingerprint = self.sweep.fingerprint()

    lossfunc = property(lambda self: self.sweep.lossfunc, doc="The loss.")
    data = property(lambda self: self.sweep.data, doc="The batches every product sweeps.")
    progress = property(lambda self: self.sweep.progress, doc="Whether sweeps show a bar.")
    normaliser = property(lambda self: self.sweep.normaliser, doc="Custom `(output, y) -> ν_b`.")
    num_samples = property(lambda self: self.sweep.num_samples, doc="Custom sample count.")
    reduction = property(lambda self: self.sweep.reduction, doc='"mean" or "sum".')
    distributed = property(lambda self: self.sweep.distributed, doc="`distributed` as given.")
    _group = property(lambda self: self.sweep.group)

    def inverse(
        self,
        damping: float,
        tol: float = 1e-6,
        max_iter: int | None = None,
        preconditioner: Any = None,
    ) -> CGInverse:
        """`(A + damping·I)⁻¹` by conjugate gradients (see `CGInverse` for costs and limits).

        Args:
            damping: `λ ≥ 0`; the damped matrix must be positive definite (for the Hessian:
                `λ > −λ_min(H)`).
            tol: Relative residual `‖v − (A + λI)x‖ / ‖v‖` at which a column stops.
            max_iter: Most iterations (sweeps) per product (default `min(2P, 1000)`).
            preconditioner: Optional symmetric positive definite `M ≈ (A + λI)⁻¹` with `M @ R`
                for `[P, K]` matrices, e.g. `KFAC(...).inverse(λ)`.

        Raises:
            ValueError: For a negative damping, a non-positive tol or a bad max_iter; (on a
                product) when the damped system turns out not to be positive definite.
        """
        return CGInverse(self, damping, tol=tol, max_iter=max_iter, preconditioner=preconditioner)

    def _check_model(self) -> None:
        if self.sweep.fingerprint() != self._fingerprint:
            raise ValueError(
                f"The model's parameters changed since this {type(self).__name__} was built; "
                "build a new operator for the new parameters."
            )

    def _nu(self, output: Tensor, y: Any) -> float:
        return self.sweep.nu(output, y)

    def _scale(self, nu: float) -> float:
        return self.sweep.scale(nu)

    def _sweep(self, desc: str, seeded: bool = True) -> Iterator[Batch]:
        """The batches of one sweep, every forward inside it fixed (see `fixed_forward`).

        `seeded=False`: the caller seeds the random generators itself (the Monte-Carlo GGN).
        """
        self._check_model()
        refuse_unfaithful_gradients(self.model, type(self).__name__)
        with self._fixed(seeded):
            yield from self.sweep.batches(desc)

    def _fixed(self, seeded: bool = True) -> ExitStack:
        """`fixed_forward` of this operator's model (both modules of a compiled one).

        `seeded=False` with a `forward_seed`: nothing (the caller seeds the generators itself).
        """
        stack = ExitStack()
        what = type(self).__name__
        if self.forward_seed is not None:
            if seeded:
                rank = rank_of(self._group)
                seed = self.forward_seed
                stack.enter_context(fixed_forward(self.model, what, seed, self.device, rank))
            return stack
        inner = getattr(self.model, "_orig_mod", self.model)
        for module in dict.fromkeys([self.model, inner]):
            stack.enter_context(fixed_forward(module, what, None, self.device))
        return stack

    def _matmat(self, V: Tensor) -> Tensor:
        def local() -> tuple[Tensor, float]:
            out = torch.zeros_like(V)
            total = 0.0
            for batch in self._sweep(f"{type(self).__name__} @ [P, {V.shape[1]}]"):
                contribution, nu = self._batch_product(batch, V)
                total += nu
                if contribution is not None:
                    out += contribution
            return out, total

        out, total = self._global(local, torch.zeros_like(V))
        return out / self.sweep.total(total)

    def _global(
        self, local: Callable[[], tuple[Tensor, float]], empty: Tensor
    ) -> tuple[Tensor, float]:
        """This rank's `(summed product, ν)`, summed over the ranks under torch.distributed."""
        group = self._group
        done, error = guarded(group, local, type(self).__name__)
        if group is None:
            return done
        out, total = done if done is not None else (empty, 0.0)
        (total,) = all_sum(group, [out], [total], error, f"sum {type(self).__name__}'s products")
        return out, total

    def _batch_product(self, batch: Batch, V: Tensor) -> tuple[Tensor | None, float]:
        raise NotImplementedError

    def _columns(self, V: Tensor, product: Callable[[dict[str, Tensor]], dict]) -> Tensor:
        """Apply a vmapped per-column `product` to V's columns in chunks of `column_chunk`."""
        pieces = []
        with warnings.catch_warnings():
            # torch's first forward-mode derivative compiles its decompositions with the
            # deprecated torch.jit.script, which warns about torch's own code
            warnings.filterwarnings("ignore", ".*torch.jit.script.*", FutureWarning)
            for start in range(0, V.shape[1], self.column_chunk):
                blocks = self.split(V[:, start : start + self.column_chunk])
                tangents = dict(zip(self.names, blocks))
                result = product(tangents)
                pieces.append(self.join([result[name] for name in self.names]))
        return torch.cat(pieces, dim=1)

    def _accumulated(self, extension) -> tuple[Tensor, Any]:
        """The flattened quantity of `extension` over the data set, and the result."""
        self._check_model()
        with self._fixed():
            result = accumulate_over(self.sweep, [extension])
        values = result.quantity(extension.savefield)
        return torch.cat([values[name].flatten() for name in self.names]), result


class GGN(_DataOperator):
    """The generalised Gauss-Newton matrix `Σ_n J_nᵀ H_n J_n` of the data-set loss.

    `J_n` is the Jacobian of sample n's model output w.r.t. the parameters and `H_n` the Hessian
    of the data-set loss's term of sample n w.r.t. that output (its reduction factor included).

    Args:
        model: The model (in `eval()` mode if it has dropout or BatchNorm, see `forward_seed`).
        lossfunc: The loss (torch loss module, reduction "mean" or "sum").
        data: Re-iterable `(X, y)` batches (swept once per product).
        mc_samples: None for the exact GGN; an integer for the Monte-Carlo GGN (the type-2
            Fisher estimated with `mc_samples` sampled labels per sample, from backpack's
            `SqrtGGNMC`), a fixed matrix: every sweep draws the same labels from `seed`.
        seed: Seed of the Monte-Carlo draws (the global RNG is forked, not advanced; under
            torch.distributed rank r draws from `seed + r`).
        progress: Show a progress bar per sweep (tqdm).
        column_chunk: At most this many columns per batched product (memory).
        normaliser: Custom `(output, y) -> ν_b`.
        num_samples: Custom `X -> number of samples`.
        distributed: `data` is this rank's shard of the data set (see `accumulate`): None
            (default) when torch.distributed runs with more than one process, True, or False.
            Products (and `diagonal()`) are then collectives giving the whole data set's.
        forward_seed: None (default): a model whose forward is random (dropout in training
            mode) is refused, since every product sweeps again; an integer: every sweep starts
            the random generators from it (forked, not advanced), so each batch gets the same
            masks in every product and in `diagonal()`: the GGN of the network with those masks.

    `J` is the Jacobian that autograd differentiates: where a layer's backward treats entries
    as constant (an embedding's padding row), so does the GGN, as `.grad` and `DiagGGNExact` do.

    Cost: a product with K columns is one sweep: per batch one forward, one backward with
    `create_graph`, then per column a backward through that backward's graph (`J v`), a
    loss-Hessian product and a backward (`Jᵀ H J v`), vmapped over the K columns.
    `diagonal()` is exact, from one `accumulate(DiagGGNExact())` sweep.
    """

    def __init__(
        self,
        model: nn.Module,
        lossfunc: Any,
        data: Iterable,
        mc_samples: int | None = None,
        seed: int = 0,
        progress: bool = False,
        column_chunk: int = 64,
        normaliser: Normaliser | None = None,
        num_samples: Callable[[Any], int] | None = None,
        distributed: bool | None = None,
        forward_seed: int | None = None,
    ) -> None:
        super().__init__(
            model,
            lossfunc,
            data,
            progress,
            column_chunk,
            normaliser,
            num_samples,
            distributed,
            forward_seed,
        )
        if mc_samples is not None and (
            isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1
        ):
            raise ValueError(f"mc_samples must be None or a positive integer, got {mc_samples!r}.")
        self.mc_samples = mc_samples
        self.seed = seed

    def _matmat(self, V: Tensor) -> Tensor:
        if self.mc_samples is None:
            with _twice_differentiable(type(self).__name__):
                return super()._matmat(V)
        return self._mc_sweep(V)

    def _batch_product(self, batch, V):  # noqa: D102
        names, params = zip(*trainable(self.model))
        # torch.compile'd code has no double backward; the original module has the same
        # parameters and function
        model = getattr(self.model, "_orig_mod", self.model)
        with disable(), torch.enable_grad(), product_forward(model):
            output = model(batch.X)
            nu = self._nu(output.detach(), batch.y)
            if (self.sweep.empty(nu)) or not output.requires_grad:
                return None, nu
            # the loss Hessian w.r.t. the output is symmetric: products by reverse-over-reverse
            _, loss_hessian = vjp(grad(lambda o: self.lossfunc(o, batch.y)), output.detach())
            # J v by reverse mode only, as the derivative of the linear map u ↦ Jᵀu along v:
            # J is then exactly the Jacobian autograd differentiates (an embedding's padding row
            # is constant, as in `.grad`), where forward mode would move what backward keeps
            # fixed; and the forward is plain autograd (in-place operations on the input work)
            dummy = torch.zeros_like(output, requires_grad=True)
            pulled = torch.autograd.grad(
                output, params, dummy, create_graph=True, allow_unused=True, materialize_grads=True
            )
        live = [i for i, g in enumerate(pulled) if g.requires_grad]

        def column(tangents: dict[str, Tensor]) -> dict[str, Tensor]:
            (jv,) = torch.autograd.grad(
                [pulled[i] for i in live],
                dummy,
                [tangents[names[i]] for i in live],
                retain_graph=True,
            )
            hjv = loss_hessian(jv)[0]
            jthjv = torch.autograd.grad(
                output, params, hjv, retain_graph=True, allow_unused=True, materialize_grads=True
            )
            return dict(zip(names, jthjv))

        if not live:
            return None, nu
        with torch.enable_grad():
            out = self._columns(V, _over_columns(column))
        return out * self._scale(nu), nu

    # --- Monte-Carlo GGN: products and diagonal from the same sampled square-root factors ---
    def _mc_factors(self):
        """Yield each batch's `[M·N_b, P]` factor at the sum scale, and its ν_b (seeded draws)."""
        self.sweep.extend()
        params = trainable(self.model)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed + rank_of(self._group))
            for batch in self._sweep("GGN (MC)", seeded=False):
                with torch.enable_grad():
                    output = self.model(batch.X)
                    nu = self._nu(output, batch.y)
                    if self.sweep.empty(nu):
                        yield None, nu
                        continue
                    loss = self.lossfunc(output, batch.y)
                    saved = [p.grad for _, p in params]
                    for _, p in params:  # backward would add into the saved tensors in place
                        p.grad = None
                    with backpack(SqrtGGNMC(mc_samples=self.mc_samples), sync=False):
                        loss.backward()
                factor = torch.cat([p.sqrt_ggn_mc.flatten(2) for _, p in params], dim=2)
                for (_, p), g in zip(params, saved):
                    del p.sqrt_ggn_mc
                    p.grad = g
                yield factor.flatten(0, 1) * self._scale(nu) ** 0.5, nu

    def _mc_sweep(self, V: Tensor | None) -> Tensor:
        size = V.shape if V is not None else (self.shape[0],)
        empty = torch.zeros(size, dtype=self.dtype, device=self.device)

        def local() -> tuple[Tensor, float]:
            out, total = empty.clone(), 0.0
            for factor, nu in self._mc_factors():
                total += nu
                if factor is None:
                    continue
                if V is None:
                    out += factor.square().sum(0)
                else:
                    out += factor.T @ (factor @ V)
            return out, total

        out, total = self._global(local, empty)
        return out / self.sweep.total(total)

    def diagonal(self) -> Tensor:
        """The exact diagonal (`DiagGGNExact` over the data), or the MC GGN's own diagonal."""
        if self.mc_samples is not None:
            return self._mc_sweep(None)
        return self._accumulated(DiagGGNExact())[0]


@contextmanager
def _twice_differentiable(what: str) -> Iterator[None]:
    """Name the fix when a product's double backward meets compiled code."""
    try:
        yield
    except RuntimeError as err:
        if "double backward" not in str(err):
            raise
        raise RuntimeError(
            f"{what} products backpropagate twice, which this model's compiled code does not "
            f"support ({err}). Build the {what} on the uncompiled module (a compiled submodule's "
            "`_orig_mod`: it shares the parameters)."
        ) from err


def _over_columns(column: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """`column` vmapped over the leading (column) axis of its tangents.

    A single column (Lanczos, power iteration) is passed to `column` directly: vmap's set-up
    costs up to a third of a small model's product.
    """
    batched = vmap(column)

    def product(tangents: dict[str, Tensor]) -> dict[str, Tensor]:
        if next(iter(tangents.values())).shape[0] != 1:
            return batched(tangents)
        out = column({name: t[0] for name, t in tangents.items()})
        return {name: value.unsqueeze(0) for name, value in out.items()}

    return product


class Hessian(_DataOperator):
    """The Hessian of the data-set loss w.r.t. the trainable parameters.

    Args: as `GGN` (without `mc_samples`, `seed`).

    The Hessian of what autograd differentiates (reverse over reverse): an embedding's padding
    row is constant, as in `.grad`.

    Cost: a product with K columns is one sweep: per batch a forward, a backward with
    `create_graph` and K backward passes through the gradient's graph (reverse-over-reverse
    Hessian-vector products, vmapped over the K columns).
    `diagonal()` is exact: one `accumulate(DiagHessian())` sweep where backpack supports the
    model's layers, otherwise `P` Hessian-vector products (with a warning).
    `inverse(λ)` (conjugate gradients) needs `H + λI` positive definite, `λ > −λ_min(H)`: the
    Hessian is indefinite in general, and a direction of negative curvature met by CG raises.
    """

    # graphs kept by `cached()`: at most this many bytes of saved tensors over all batches
    KEPT_GRAPH_BYTES = 256 * 2**20
    _kept: _KeptGraphs | None = None

    @contextmanager
    def cached(self, max_bytes: int | None = None) -> Iterator[None]:
        """Keep every batch's gradient graph between the products made inside the block.

        The first product inside the block sweeps the data as usual and keeps each batch's
        graph (the forward and the backward with `create_graph`); later products then cost one
        backward per batch through the kept graphs (about a third of a sweep), with no forward
        and no data loading. Graphs are kept only while the tensors they save take at most
        `max_bytes` (default `KEPT_GRAPH_BYTES`, 256 MiB) over all batches; otherwise every
        product sweeps as outside the block. Everything is freed when the block ends.
        `eigvalsh`, the trace and diagonal estimators, `lanczos_quadrature`, `spectral_density`,
        `slq_logdet` and `inverse(λ)` use this block.

        Inside it the model's parameters must not change (a changed model raises). A random
        forward needs `forward_seed` (see `GGN`): every sweep draws the same masks, so the kept
        graphs and a new sweep give the same products.
        """
        if self._kept is not None:  # nested: the outer block keeps
            yield
            return
        budget = self.KEPT_GRAPH_BYTES if max_bytes is None else max_bytes
        self._kept = _KeptGraphs(budget)
        try:
            yield
        finally:
            self._kept = None

    def _matmat(self, V: Tensor) -> Tensor:
        with _twice_differentiable(type(self).__name__):
            return self._products(V)

    def _products(self, V: Tensor) -> Tensor:
        kept = self._kept
        if kept is None or not kept.complete:
            if kept is not None:
                kept.restart()  # a sweep that raised half-way may have kept some graphs
            out = super()._matmat(V)
            if kept is not None and kept.graphs is not None:
                kept.complete = True
            return out
        self._check_model()

        def local() -> tuple[Tensor, float]:
            out = self._graph_product(kept.graphs, V)
            total = sum(graph.nu for graph in kept.graphs)
            return (torch.zeros_like(V) if out is None else out), total

        out, total = self._global(local, torch.zeros_like(V))
        return out / self.sweep.total(total)

    def _graph(self, batch: Batch) -> _Graph:
        """The batch's loss gradient with its graph (`create_graph`), and its `ν`."""
        names, params = zip(*trainable(self.model))
        # torch.compile'd code has no double backward; the original module has the same
        # parameters and function
        model = getattr(self.model, "_orig_mod", self.model)
        with disable(), torch.enable_grad(), product_forward(model):
            output = model(batch.X)
            nu = self._nu(output.detach(), batch.y) if self.reduction == "mean" else 1.0
            if self.sweep.empty(nu):
                return _Graph(names, params, (), [], nu)
            loss = self.lossfunc(output, batch.y)
            # reverse-over-reverse (forward-over-reverse trips over torch's zero tangents of some
            # losses' targets, e.g. MSELoss): the gradient's graph is built once with plain
            # autograd, and the K second backward passes through it are vmapped by torch.func
            # (whose batching rules cover convolutions' double backward, unlike
            # `is_grads_batched`); symmetric, so these vector-Jacobian products are H v
            grads = torch.autograd.grad(
                loss, params, create_graph=True, allow_unused=True, materialize_grads=True
            )
        live = [i for i, g in enumerate(grads) if g.requires_grad]
        return _Graph(names, params, grads, live, nu)

    def _batch_product(self, batch, V):  # noqa: D102
        kept = self._kept
        if kept is None or kept.graphs is None:
            graph = self._graph(batch)
        else:
            with kept.counting(self.model):
                graph = self._graph(batch)
            kept.add(graph)
        return self._graph_product([graph], V), graph.nu

    def _graph_product(self, graphs: list[_Graph], V: Tensor) -> Tensor | None:
        """`Σ_b s_b H_b V` in one backward through the graphs' gradients (`s_b` the scale)."""
        pairs = [(g.grads[i], self._scale(g.nu), g.names[i]) for g in graphs for i in g.live]
        if not pairs:
            return None
        params = graphs[0].params

        def column(tangents: dict[str, Tensor]) -> dict[str, Tensor]:
            hv = torch.autograd.grad(
                [grad for grad, _, _ in pairs],
                params,
                [tangents[name] * scale for _, scale, name in pairs],
                retain_graph=True,
                allow_unused=True,
                materialize_grads=True,
            )
            return dict(zip(self.names, hv))

        with torch.enable_grad():
            return self._columns(V, _over_columns(column))

    def diagonal(self) -> Tensor:
        """The exact diagonal (`DiagHessian` over the data, or Hessian-vector products)."""
        try:
            return self._accumulated(DiagHessian())[0]
        except NotImplementedError as err:
            warnings.warn(
                f"DiagHessian does not support this model ({err}); the Hessian diagonal is "
                f"computed from {self.shape[0]} Hessian-vector products instead.",
                stacklevel=2,
            )
            return super().diagonal()


class _Graph(NamedTuple):
    """One batch's gradient with its graph: what a Hessian product backpropagates through."""

    names: tuple[str, ...]
    params: tuple[Tensor, ...]
    grads: tuple[Tensor, ...]
    live: list[int]
    nu: float


class _KeptGraphs:
    """The graphs `Hessian.cached` keeps: recorded on the first sweep while within budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.graphs: list[_Graph] | None = []  # None: over budget, products sweep
        self.complete = False
        self.restart()

    def restart(self) -> None:
        """Forget the graphs of an unfinished sweep (not the verdict of being over budget)."""
        if self.graphs is not None:
            self.graphs = []
        self.bytes = 0
        self._seen: set[int] = set()

    @contextmanager
    def counting(self, model: nn.Module) -> Iterator[None]:
        """Count the bytes of the tensors autograd saves inside the block (once per storage)."""
        self._seen |= {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: Tensor) -> Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def add(self, graph: _Graph) -> None:
        if self.graphs is None:
            return
        if self.bytes > self.budget:
            self.graphs = None  # over budget: drop what was kept
            return
        self.graphs.append(graph)


class EmpiricalFisher(_DataOperator):
    """The empirical Fisher `R Σ_n ∇ℓ_n ∇ℓ_nᵀ` of the data set.

    `ℓ_n` is sample n's unreduced loss (for token losses: the sum over its non-ignored tokens)
    and `R` the data-set loss's reduction factor (`1/ν` for "mean", 1 for "sum"), so that the
    empirical Fisher scales with the loss like the GGN. The per-sample gradients come from
    backpack's `BatchGrad` (the model and loss are `extend`-ed).

    Args: as `GGN` (without `mc_samples`, `seed`).

    Cost: a product with K columns is one sweep: per batch one backward with `BatchGrad`
    (an `[N_b, P]` matrix) and two matrix products. `diagonal()` is one
    `accumulate(SumGradSquared())` sweep.
    """

    def _batch_product(self, batch, V):  # noqa: D102
        self.sweep.extend()
        params = trainable(self.model)
        with torch.enable_grad():
            output = self.model(batch.X)
            nu = self._nu(output, batch.y)
            if self.sweep.empty(nu):
                return None, nu
            loss = self.lossfunc(output, batch.y)
            saved = [p.grad for _, p in params]
            for _, p in params:  # backward would add into the saved tensors in place
                p.grad = None
            with backpack(BatchGrad(), sync=False):
                loss.backward()
        rows = torch.cat([p.grad_batch.flatten(1) for _, p in params], dim=1)
        for (_, p), g in zip(params, saved):
            del p.grad_batch
            p.grad = g
        rows = rows * self._scale(nu)  # gradients of the samples' unreduced losses
        return rows.T @ (rows @ V), nu

    def diagonal(self) -> Tensor:
        """The exact diagonal, from `SumGradSquared` over the data."""
        values, result = self._accumulated(SumGradSquared())
        return values * result.normaliser
