"""Curvature matrices of a data-set loss as linear operators: `GGN`, `Hessian`, `EmpiricalFisher`.

Every operator is a symmetric `[P, P]` matrix over the trainable parameters, in
`model.parameters()` order, of the data-set loss (see `backpack.curvature.accumulate`). `op @ V`
sweeps the data once for all K columns of `V`: per batch, the K products are batched with
`torch.func.vmap` over reverse-mode derivatives of one plain autograd forward (so they
differentiate what `.grad` differentiates), or formed from backpack's per-sample quantities.
Every sweep must see one fixed function of the parameters (`backpack.curvature._forward`).

On a model sharded with FSDP2 (`fully_shard`) vectors are this rank's local shards and every
product is a collective over all ranks' data, by distributed autograd that gathers one
module's parameters at a time (`backpack.curvature._fsdp_products`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
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
from backpack.curvature._fsdp import (
    check_replicas,
    is_fully_sharded,
    mesh_chunks,
    replica_digest,
    replica_holder,
    reshard,
)
from backpack.curvature._fsdp_products import (
    Columns,
    Gathering,
    Layout,
    agree,
    all_gather_param,
    all_sum_values,
    header_group,
)
from backpack.curvature._rows import batch_rows
from backpack.curvature._sweep import Sweep
from backpack.curvature.accumulate import accumulate_over
from backpack.curvature.cg import CGInfo, NotPositiveDefiniteError, conjugate_gradients
from backpack.extensions import (
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNMC,
    SumGradSquared,
)
from backpack.rules.losses import find_loss_rule

__all__ = ["CurvatureOperator", "CGInverse", "GGN", "Hessian", "EmpiricalFisher"]


class CurvatureOperator:
    """A symmetric `[P, P]` matrix over the model's trainable parameters.

    Subclasses implement `_matmat` on `[P, K]` matrices (and may override `diagonal`).

    On a model sharded with FSDP2 (`fully_shard`, its parameters DTensors) a vector is this
    rank's local shards: the flat concatenation of `p.to_local().reshape(-1)` over the trainable
    parameters, `shape` is `(P_local, P_local)` and `sharded` is True. Products are then
    collectives (every rank multiplies) returning this rank's rows; `global_size`,
    `local_rows` and `sum_over_ranks` let estimators work with such vectors.

    Attributes:
        names: Trainable parameter names, in `model.parameters()` order.
        shapes: Their shapes (on a sharded model: of the local shards).
        sharded: Whether vectors are local shards of an FSDP2 model.
    """

    def __init__(self, model: nn.Module, params: list[tuple[str, nn.Parameter]]) -> None:
        if not params:
            raise ValueError("The model has no trainable parameter.")
        self.model = model
        self.names = [name for name, _ in params]
        locals_ = [_local(p) for _, p in params]
        self.sharded = any(t is not p for t, (_, p) in zip(locals_, params))
        self.shapes = [tuple(t.shape) for t in locals_]
        self.numels = [t.numel() for t in locals_]
        self.dtype = params[0][1].dtype
        self.device = locals_[0].device
        self._global_numels = [p.numel() for _, p in params]
        #: `(mesh, placements, shape, stride)` of each sharded parameter (DTensor vectors)
        self._placements = [
            (p.device_mesh, p.placements, p.shape, p.stride()) if t is not p else None
            for t, (_, p) in zip(locals_, params)
        ]

    def _layout_of(self, op: CurvatureOperator) -> None:
        """Take `op`'s model, parameters and vector layout (an operator derived from `op`)."""
        self.model = op.model
        self.names, self.shapes, self.numels = op.names, op.shapes, op.numels
        self.dtype, self.device = op.dtype, op.device
        self.sharded = op.sharded
        self._global_numels, self._placements = op._global_numels, op._placements

    @property
    def shape(self) -> tuple[int, int]:
        """`(P, P)` (`(P_local, P_local)` on a sharded model)."""
        size = sum(self.numels)
        return size, size

    @property
    def global_size(self) -> int:
        """P: the number of trainable parameters (unsharded)."""
        return sum(self._global_numels)

    def local_rows(self, full: Tensor) -> Tensor:
        """This rank's rows of a `[P, K]` matrix laid out like the unsharded parameters.

        The identity on an unsharded model; on an FSDP2 model, the rows of this rank's shards
        (torch.chunk along each parameter's sharded dimension, as FSDP2 shards).
        """
        if not self.sharded:
            return full
        pieces, offset = [], 0
        for numel, local, meta in zip(self._global_numels, self.shapes, self._placements):
            block = full[offset : offset + numel]
            offset += numel
            if meta is None:
                pieces.append(block)
                continue
            mesh, placements, shape, _ = meta
            chunk_of = mesh_chunks(mesh, placements)
            dim = next(p.dim for p in placements if type(p).__name__ == "Shard")
            world = len(set(chunk_of.values()))
            step = -(-shape[dim] // world)
            start = min(shape[dim], chunk_of[dist.get_rank()] * step)
            part = block.reshape(*shape, -1).narrow(dim, start, local[dim])
            pieces.append(part.reshape(-1, full.shape[1]))
        return torch.cat(pieces)

    def _replica_holder(self) -> int | None:
        """The rank whose rows this rank's equal under HSDP (`replica_holder`), else None."""
        chunk_maps = [mesh_chunks(m[0], m[1]) for m in self._placements if m is not None]
        return replica_holder(chunk_maps, dist.get_rank(), type(self).__name__)

    def _copy_holder(self) -> int:
        """The rank whose local rows count for this rank's (itself, except under HSDP)."""
        holder = self._replica_holder()
        return dist.get_rank() if holder is None else holder

    def _check_replicas(self, V: Tensor) -> None:
        """Under HSDP, raise on every rank unless the replica groups pass the same rows."""
        holder = self._replica_holder()
        if holder is None:
            return  # no replica groups: nothing to compare (and no collective)
        group = header_group(getattr(self, "_group", None))
        holder = dist.get_group_rank(group, holder)
        what = f"{type(self).__name__} @ V"
        table = agree(group, [*replica_digest(V), float(holder)], None, what)
        check_replicas(table, what)

    def sum_over_ranks(self, t: Tensor) -> Tensor:
        """`t` summed over the ranks (a collective) on a sharded model, else `t` itself.

        For partial sums over this rank's rows (inner products, norms) of sharded vectors;
        under HSDP each replica group's rows count once.
        """
        if not self.sharded:
            return t
        if self._copy_holder() != dist.get_rank():
            t = torch.zeros_like(t)
        return all_sum_values(header_group(getattr(self, "_group", None)), t)

    def stack_over_ranks(self, t: Tensor) -> tuple[Tensor, int]:
        """Every rank's `t` stacked in rank order, and this rank's first row in the stack.

        The ranks' `t` may differ in their number of rows (a collective on a sharded model).
        Under HSDP only the holders' `t` are stacked, and a replica gets its holder's first row.
        """
        if not self.sharded:
            return t, 0
        group = header_group(getattr(self, "_group", None))
        world, me = dist.get_world_size(group), dist.get_rank(group)
        holder = dist.get_group_rank(group, self._copy_holder())
        counts = t.new_zeros(world, dtype=torch.float64)
        if holder == me:
            counts[me] = t.shape[0]
        counts = [int(c) for c in all_sum_values(group, counts).tolist()]
        start = sum(counts[:holder])
        stacked = t.new_zeros(sum(counts), *t.shape[1:])
        if holder == me:
            stacked[start : start + t.shape[0]] = t
        return all_sum_values(group, stacked), start

    def _refuse_sharded(self, what: str, instead: str) -> None:
        if self.sharded:
            raise NotImplementedError(
                f"{type(self).__name__}.{what} is not available on a model sharded with FSDP2 "
                f"(fully_shard): {instead}"
            )

    def _matmat(self, V: Tensor) -> Tensor:
        raise NotImplementedError

    @contextmanager
    def cached(self, max_bytes: int | None = None) -> Iterator[None]:
        """Reuse work between the products made inside the block (see `Hessian.cached`).

        A no-op for operators whose products have nothing to keep.
        """
        yield

    def __matmul__(self, v: Any) -> Any:
        """The product with `v` of shape `[P]` or `[P, K]` (same shape out).

        On a sharded model also a list of DTensors laid out like the trainable parameters
        (a list of DTensors out).
        """
        if isinstance(v, (list, tuple)) and self.sharded:
            return self._matmul_dtensors(list(v))
        if not isinstance(v, Tensor):
            return NotImplemented
        if v.dim() not in (1, 2) or v.shape[0] != self.shape[0]:
            local = " (this rank's local shards)" if self.sharded else ""
            raise ValueError(
                f"{type(self).__name__} multiplies [P] or [P, K] tensors with P = "
                f"{self.shape[0]}{local}, got shape {tuple(v.shape)}."
            )
        V = v.reshape(self.shape[0], -1).to(device=self.device, dtype=self.dtype)
        if self.sharded:
            self._check_replicas(V)
        return self._matmat(V).reshape(v.shape)

    def _matmul_dtensors(self, vs: list[Any]) -> list[Any]:
        from torch.distributed.tensor import DTensor

        if len(vs) != len(self.names) or not all(isinstance(t, DTensor) for t in vs):
            raise ValueError(
                f"{type(self).__name__} multiplies a list of {len(self.names)} DTensors laid out "
                "like the trainable parameters (or this rank's flat local shards), got "
                f"{[type(t).__name__ for t in vs]}."
            )
        flat = []
        for t, meta, name in zip(vs, self._placements, self.names):
            if meta is None or tuple(t.shape) != tuple(meta[2]) or t.placements != meta[1]:
                raise ValueError(
                    f"The DTensor for {name} has shape {tuple(t.shape)} and placements "
                    f"{t.placements}; the parameter has {None if meta is None else meta[2]} and "
                    f"{None if meta is None else meta[1]}."
                )
            flat.append(t.to_local().reshape(-1))
        out = self @ torch.cat(flat)
        result = []
        for block, meta, local in zip(out.split(self.numels), self._placements, self.shapes):
            mesh, placements, shape, stride = meta
            result.append(
                DTensor.from_local(
                    block.reshape(local), mesh, placements, shape=shape, stride=stride
                )
            )
        return result

    def matmat(self, V: Tensor) -> Tensor:
        """The product with a `[P, K]` matrix."""
        return self @ V

    def split(self, V: Tensor) -> list[Tensor]:
        """`[P, K]` → one `[K, *shape]` tensor per parameter."""
        blocks = V.split(self.numels, dim=0)
        return [b.T.reshape(b.shape[1], *s) for b, s in zip(blocks, self.shapes)]

    def join(self, blocks: list[Tensor]) -> Tensor:
        """Inverse of `split`: one `[K, *shape]` tensor per parameter → `[P, K]`."""
        return torch.cat([b.reshape(b.shape[0], -1) for b in blocks], dim=1).T

    def to_dense(self) -> Tensor:
        """The dense `[P, P]` matrix (P products; mind the memory)."""
        self._refuse_sharded(
            "to_dense()",
            "a dense matrix needs every parameter's rows on one rank. Use products, "
            "diagonal(), trace(), eigvalsh or the estimators, or build the operator on an "
            "unsharded copy of the model with distributed=True.",
        )
        eye = torch.eye(self.shape[0], dtype=self.dtype, device=self.device)
        dense = self @ eye
        return (dense + dense.T) / 2

    def diagonal(self) -> Tensor:
        """The diagonal `[P]` (default: of the dense matrix)."""
        return self.to_dense().diagonal().clone()

    def trace(self) -> Tensor:
        """The trace (sum of `diagonal()`; on a sharded model summed over the ranks)."""
        return self.sum_over_ranks(self.diagonal().sum())

    def to_scipy(self):
        """A `scipy.sparse.linalg.LinearOperator` (float64 numpy in and out; needs SciPy)."""
        self._refuse_sharded(
            "to_scipy()",
            "SciPy's solvers take inner products of whole vectors, which a rank's shards are "
            "not. Use backpack.curvature.eigvalsh or inverse(damping) (conjugate gradients), "
            "which sum inner products over the ranks.",
        )
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


def _local(p: Tensor) -> Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) and type(p).__name__ == "DTensor" else p


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
        self._layout_of(op)
        self._group = getattr(op, "_group", None)
        self.damping = float(damping)
        self.tol = float(tol)
        self.max_iter = max_iter if max_iter is not None else min(2 * op.global_size, 1000)
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
                    total=self.sum_over_ranks if self.sharded else None,
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
        if is_fully_sharded(model):
            reshard(model)  # a forward without backward may have left parameters gathered
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
        #: where the parameters of an FSDP2 model live (None for an unsharded model)
        self.layout: Layout | None = None
        if self.sweep.sharded:
            if distributed is False:
                raise ValueError(
                    f"{name}(..., distributed=False) cannot use a model sharded with FSDP2 "
                    "(fully_shard): its products are collectives over every rank, each rank "
                    "sweeping its own shard of the data. Pass distributed=None or True."
                )
            self.layout = Layout(model, self.sweep.group, name)

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
        if self.layout is not None:
            reshard(self.model)
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
        if self.layout is not None:
            return self._sharded_matmat(V)

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

    def _sharded_matmat(self, V: Tensor) -> Tensor:
        """This rank's rows of the product on an FSDP2 model (a collective, see `_fsdp_products`).

        Every rank sweeps its own batches, one batch of each rank at a time: the ranks first
        agree that each has a batch (or stop together), then take the batch's product together
        (the gathers and reduce-scatters inside sum the ranks' contributions), then exchange
        their outcome and `ν_b`. The ranks must have the same number of batches (sizes may
        differ).
        """
        group = self.layout.header
        what = f"{type(self).__name__} @ [P, {V.shape[1]}] (FSDP2)"
        out = torch.zeros_like(V)
        total, index = 0.0, 0
        blocks = self.split(V)  # [K, *local shape] per parameter
        batches = self._sweep(what)
        try:
            while True:
                batch, error = None, None
                try:
                    batch = next(batches)
                except StopIteration:
                    pass
                except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
                    error = err
                table = agree(group, [float(batch is not None)], error, f"{what}, batch {index}")
                has = table[:, 0].tolist()
                if not any(has):
                    break
                if not all(has):
                    raise RuntimeError(
                        f"{what}: the ranks' shards have different numbers of batches: ranks "
                        f"{[r for r, h in enumerate(has) if h]} have a batch {index}, ranks "
                        f"{[r for r, h in enumerate(has) if not h]} have none. Every rank must "
                        "sweep the same number of batches (their sizes may differ): the "
                        "products are collectives over every rank."
                    )
                assert batch is not None
                # the forward and the loss, then (every rank ready) the backward passes: an error
                # in the loss (a target of the wrong shape) is agreed before any backward
                nu, vote, finish, error = 0.0, 0.0, None, None
                try:
                    nu, vote, finish = self._sharded_batch(batch, blocks, Gathering(self.layout))
                except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
                    error = err
                table = agree(group, [nu, vote], error, f"{what}, batch {index}")
                error = None
                try:
                    finish(out, bool(table[:, 1].any()))
                except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
                    error = err
                agree(group, [], error, f"{what}, batch {index}")
                total += float(table[:, 0].sum())
                index += 1
        finally:
            batches.close()
        return out / self.sweep.total(total)

    def _sharded_batch(
        self, batch: Batch, blocks: list[Tensor], gathering: Gathering
    ) -> tuple[float, float, Callable[[Tensor, bool], None]]:
        """The batch's forward and loss; returns `ν_b`, a vote and `finish`.

        `finish(out, voted)` adds this rank's rows of the batch's product (summed over ranks, at
        the sum scale) to `out`; `voted`: whether any rank's vote was nonzero (so that every
        rank takes the same way, with the same collectives). `blocks`: the K columns as one
        `[K, *local shape]` tensor per parameter (`split`).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not support a model sharded with FSDP2 (fully_shard)."
        )

    def _sharded_forward(self, batch: Batch, gathering: Gathering) -> tuple[Tensor, float]:
        """The batch's output with its graph (parameters gathered module by module), and `ν_b`."""
        model = self.model
        with disable(), torch.enable_grad(), product_forward(model):
            with gathering.running(model), gathering.saving():
                output = model(batch.X)
        if not output.requires_grad:
            raise ValueError(
                f"{type(self).__name__}: the model's output does not depend on its trainable "
                "parameters."
            )
        return output, self._nu(output.detach(), batch.y)

    def _output_products(
        self,
        output: Tensor,
        blocks: list[Tensor],
        gathering: Gathering,
        curvature: Callable,
        out: Tensor,
    ) -> None:
        """Add `Jᵀ C J V` to `out`, column by column, `C = curvature` (on output-shaped tensors).

        `J V` by reverse mode only, as in `GGN`: the derivative along v of `u ↦ Jᵀu`.
        """
        variables = gathering.variables
        count = blocks[0].shape[0]
        with torch.enable_grad(), gathering.saving():
            dummy = torch.zeros_like(output, requires_grad=True)
            pulled = torch.autograd.grad(
                output,
                variables,
                dummy,
                create_graph=True,
                allow_unused=True,
                materialize_grads=True,
            )
            live = [i for i, g in enumerate(pulled) if g.requires_grad]
            for k in range(count):
                if live:
                    (jv,) = torch.autograd.grad(
                        [pulled[i] for i in live],
                        dummy,
                        [blocks[i][k] for i in live],
                        retain_graph=True,
                    )
                else:
                    jv = torch.zeros_like(output)
                back = torch.autograd.grad(
                    output,
                    variables,
                    curvature(jv),
                    retain_graph=k + 1 < count,
                    allow_unused=True,
                    materialize_grads=True,
                )
                self._add_column(out, k, back)

    def _add_column(self, out: Tensor, k: int, pieces: tuple[Tensor, ...]) -> None:
        """Add one parameter-shaped piece per parameter to column k of `out` (no copies)."""
        offset = 0
        for piece, numel in zip(pieces, self.numels):
            out[offset : offset + numel, k] += piece.reshape(-1)
            offset += numel

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
        if self.layout is not None:  # FSDP2: the sampled loss factors inside the product
            with self._mc_draws():
                return super()._matmat(V)
        return self._mc_sweep(V)

    @contextmanager
    def _mc_draws(self) -> Iterator[None]:
        """The seeded draws of every sweep (`seed + rank`; the global RNG forked)."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed + rank_of(self._group))
            yield

    def _sharded_batch(self, batch, blocks, gathering):  # noqa: D102
        output, nu = self._sharded_forward(batch, gathering)
        empty = self.sweep.empty(nu)
        target = output.detach().requires_grad_(True)
        factor = None
        if not empty and self.mc_samples is not None:
            # the loss's sampled factor `[M, N, *out]`, drawn as `SqrtGGNMC` draws it
            record = SimpleNamespace(module=self.lossfunc, args=(output.detach(), batch.y))
            rule = find_loss_rule(self.lossfunc)
            if rule is None:
                raise NotImplementedError(
                    f"GGN(mc_samples=...) on FSDP2 needs a loss with a sampled Hessian factor "
                    f"(a backpack loss rule); {type(self.lossfunc).__name__} has none."
                )
            rule.check(self.lossfunc, "GGN(mc_samples=...)")
            factor = rule.sqrt_hessian_sampled(record, self.mc_samples) * self._scale(nu) ** 0.5
        elif not empty:
            with torch.enable_grad():
                loss = self.lossfunc(target, batch.y) * self._scale(nu)
                (slope,) = torch.autograd.grad(loss, target, create_graph=True)

        def curvature(jv: Tensor) -> Tensor:
            if empty:  # no loss term, but the same collectives as the other ranks
                return torch.zeros_like(jv)
            if factor is not None:  # Σ_m s_m (s_mᵀ J v), sample by sample
                dims = tuple(range(2, factor.dim()))
                return (factor * (factor * jv).sum(dims, keepdim=True)).sum(0)
            (hjv,) = torch.autograd.grad(slope, target, jv, retain_graph=True)
            return hjv

        def finish(out: Tensor, voted: bool) -> None:
            self._output_products(output, blocks, gathering, curvature, out)

        return nu, 0.0, finish

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
        with self._mc_draws():
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
        if self.mc_samples is not None and self.layout is not None:  # FSDP2: each rank's shard
            with self._mc_draws():
                return self._accumulated(DiagGGNMC(mc_samples=self.mc_samples))[0]
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
        if self._kept is not None or self.layout is not None:  # nested, or FSDP2: no graphs
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

    def _sharded_batch(self, batch, blocks, gathering):  # noqa: D102
        model = self.model
        with disable(), torch.enable_grad(), product_forward(model), gathering.saving():
            with gathering.running(model):
                output = model(batch.X)
            nu = self._nu(output.detach(), batch.y)
            if self.sweep.empty(nu):  # no loss term, but the same collectives as the others
                loss = output.square().sum() * 0.0
            else:
                loss = self.lossfunc(output, batch.y) * self._scale(nu)

        def finish(out: Tensor, voted: bool) -> None:
            variables = gathering.variables
            count = blocks[0].shape[0]
            with torch.enable_grad(), gathering.saving():
                grads = torch.autograd.grad(
                    loss, variables, create_graph=True, allow_unused=True, materialize_grads=True
                )
                live = [i for i, g in enumerate(grads) if g.requires_grad]
                for k in range(count if live else 0):
                    hv = torch.autograd.grad(
                        [grads[i] for i in live],
                        variables,
                        [blocks[i][k] for i in live],
                        retain_graph=k + 1 < count,
                        allow_unused=True,
                        materialize_grads=True,
                    )
                    self._add_column(out, k, hv)

        return nu, 0.0, finish

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
            if self.layout is not None:
                raise NotImplementedError(
                    f"Hessian.diagonal() on a model sharded with FSDP2 needs DiagHessian to "
                    f"support the model ({err}); estimate it with "
                    "backpack.curvature.hutchinson_diagonal(op, num_matvecs) instead."
                ) from err
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

    def _sharded_batch(self, batch, blocks, gathering):  # noqa: D102
        output, nu = self._sharded_forward(batch, gathering)
        # output rows that are not the samples (flattened tokens): which rows make up a sample
        # is only known inside the model, so per-sample gradients (`BatchGrad`) take over
        by_samples = output.dim() > 0 and output.shape[0] == batch.num_samples
        empty = self.sweep.empty(nu)
        rows = None
        if by_samples and not empty:
            target = output.detach().requires_grad_(True)
            with torch.enable_grad():
                loss = self.lossfunc(target, batch.y) * self._scale(nu)
                (rows,) = torch.autograd.grad(loss, target)

        def curvature(jv: Tensor) -> Tensor:
            # Σ_n g_n g_nᵀ J_n v: each sample's output gradient times its directional derivative
            if rows is None:
                return torch.zeros_like(jv)
            dims = tuple(range(1, jv.dim()))
            return rows * (rows * jv).sum(dim=dims, keepdim=True)

        kept = [output]

        def finish(out: Tensor, voted: bool) -> None:
            if voted:  # some rank's rows are not its samples: every rank takes BatchGrad's way
                kept.clear()  # the product forward's graph
                self._per_sample_product(batch, blocks, out)
            else:
                self._output_products(kept.pop(), blocks, gathering, curvature, out)

        return nu, float(not by_samples), finish

    def _per_sample_product(self, batch: Batch, blocks: list[Tensor], out: Tensor) -> None:
        """Add this rank's rows of `Σ_n g_n g_nᵀ V` (FSDP2), from `BatchGrad`'s whole rows.

        Each rank takes its samples' gradients of whole parameters in FSDP's own backward,
        gathers V's rows parameter by parameter for the directional derivatives `g_nᵀ v`, and
        reduce-scatters `Σ_n g_n (g_nᵀ v)` back onto the shards. Holds a batch's rows of the
        whole model (`[N_b, P]` on every rank), unlike the output-row products.
        """
        layout = self.layout
        count = blocks[0].shape[0]
        self.sweep.extend()
        rows, _ = batch_rows(self.sweep, self.sweep.trainable(), batch, "grad")
        # in V's dtype (`batch_rows` gives at least the parameters' dtype: float32 rows of
        # 16-bit parameters meet V here)
        flat = [rows.pop(s.name).flatten(1).to(b.dtype) for s, b in zip(layout.trainable, blocks)]
        slopes = None  # [N_b, K]: each sample's directional derivatives g_nᵀ v_k
        for shard, r, block in zip(layout.trainable, flat, blocks):
            full = all_gather_param(Columns(shard, count), block.movedim(0, -1), layout.group)
            part = r @ full.reshape(-1, count)
            slopes = part if slopes is None else slopes + part
        offset = 0
        for shard, r, numel in zip(layout.trainable, flat, self.numels):
            columns = Columns(shard, count)
            full = (r.T @ slopes).view(columns.shape)
            mine = columns.reduce(full, layout.group, "reduce an EmpiricalFisher product")
            out[offset : offset + numel] += mine.reshape(numel, count)
            offset += numel

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
