"""`KFAC`: a block-diagonal, Kronecker-factored curvature operator of a data set.

One block per trainable parameter: `G ⊗ A` for weights with Kronecker factors (as backpack's
`KFLR`/`KFAC` extensions store them, accumulated over the data set by `accumulate`), one dense
factor `B` for biases (`[G]`) and for parameters without a Kronecker rule. Products, the
diagonal, the trace, the damped inverse `(G ⊗ A + λI)⁻¹` and the log-determinant are closed forms
in the factors (the inverse and log-determinant from their eigendecompositions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from backpack.api import disable
from backpack.curvature._blocks import (
    BlockLayout,
    assemble_dense,
    assemble_diagonal,
    blockwise,
)
from backpack.curvature._data import Normaliser, first_tensor
from backpack.curvature._distributed import all_sum, local_module
from backpack.curvature._forward import refuse_unfaithful_gradients
from backpack.curvature._fsdp import is_fully_sharded
from backpack.curvature._fsdp_blocks import (
    ShardedBlocks,
    refuse_dense,
    sharded_diagonal,
    sharded_matmul,
)
from backpack.curvature._lent import kron_targets, lent
from backpack.curvature._sweep import Sweep
from backpack.curvature.accumulate import accumulate_over
from backpack.curvature.operators import CurvatureOperator
from backpack.distributed import _group as _dist_group
from backpack.extensions import KFAC as KFACExtension
from backpack.extensions import KFLR
from backpack.rules import find_rule

__all__ = ["KFAC", "KFACInverse"]

#: modules whose weight's factors belong to `weight.transpose(0, 1)`
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Embedding)


class _Block(BlockLayout):
    """One block's factors and how they act on its entries (see `BlockLayout`).

    `factors` is `[G, A]` (the block is `G ⊗ A` on the `[g, a]` coordinates: the parameter, or
    `parameter.transpose(0, 1)` when `transposed`, with a folded bias as a last column) or
    `[B]` (dense on the flattening).
    """

    def __init__(
        self,
        name: str,
        shape: tuple,
        factors: list[Tensor],
        transposed: bool,
        bias: str | None = None,
    ) -> None:
        super().__init__(name, shape, transposed, bias)
        self.factors = factors
        self._eig: list[tuple[Tensor, Tensor]] | None = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(f.shape[0] for f in self.factors)

    def own_shape(self) -> tuple[int, ...]:  # noqa: D102
        return self.sizes

    def apply(self, v: Tensor, mats: list[Tensor]) -> Tensor:
        """`(M_0 ⊗ M_1) v` (or `M_0 v`) for `v` `[K, numel]`, flattened `[K, numel]` out."""
        w = self.to_own(v)
        if len(mats) == 2:
            w = mats[0] @ w @ mats[1].T
        else:
            w = w @ mats[0].T
        return self.from_own(w)

    def dense(self, mats: list[Tensor]) -> Tensor:
        """`M_0 ⊗ M_1` (or `M_0`) as `[numel, numel]` in the parameters' order."""
        own = torch.kron(mats[0], mats[1]) if len(mats) == 2 else mats[0]
        return self.place_dense(own)

    def diagonal_of(self, diags: list[Tensor]) -> Tensor:
        """The diagonal of `M_0 ⊗ M_1` from the factors' diagonals, in the parameters' order."""
        d = torch.outer(diags[0], diags[1]).flatten() if len(diags) == 2 else diags[0]
        return self.place_diagonal(d)

    def eig(self) -> list[tuple[Tensor, Tensor]]:
        """Eigenvalues (clamped at 0: the factors are PSD up to rounding) and eigenvectors."""
        if self._eig is None:
            self._eig = []
            for f in self.factors:
                # in float64 at least (as kronfluence): float32's eigenvectors of an
                # ill-conditioned factor cost scores ~3e-4 relative on a small GPT, 30x its error
                wide = f.to(torch.promote_types(f.dtype, torch.float64))
                values, vectors = torch.linalg.eigh((wide + wide.T) / 2)
                self._eig.append((values.clamp(min=0).to(f.dtype), vectors.to(f.dtype)))
        return self._eig

    def eigenvalues(self) -> Tensor:
        """The block's eigenvalues (products of the factors' eigenvalues), in its coordinates."""
        values = [v for v, _ in self.eig()]
        return torch.outer(values[0], values[1]) if len(values) == 2 else values[0]


def _orientation(name: str, p: Tensor, factors: list[Tensor], owner: nn.Module | None) -> bool:
    """Whether the `[G, A]` factors of `p` belong to `p.transpose(0, 1)`."""
    numel = p.numel()
    if len(factors) == 1:
        if factors[0].shape[0] != numel:
            raise ValueError(f"{name}: factor {tuple(factors[0].shape)} for {numel} entries.")
        return False
    g, a = factors[0].shape[0], factors[1].shape[0]
    fits = []
    if g * a == numel and p.dim() >= 1 and p.shape[0] == g:
        fits.append(False)
    if g * a == numel and p.dim() >= 2 and p.shape[1] == g:
        fits.append(True)
    if not fits:
        raise ValueError(
            f"{name} of shape {tuple(p.shape)} got Kronecker factors of sizes {g} and {a}, which "
            "match neither its first nor its second axis."
        )
    if len(fits) == 2:  # a square weight: ask the owner's rule (e.g. transformers' Conv1D)
        if isinstance(owner, _TRANSPOSED):
            return True
        rule = find_rule(owner) if owner is not None else None
        return name.rsplit(".", 1)[-1] in getattr(rule, "KRON_TRANSPOSED", ())
    return fits[0]


def _blocks(
    model: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    factors: dict[str, list[Tensor]],
    folded: dict[str, str],
) -> list[_Block]:
    """One block per parameter, or per folded weight and bias, in the parameters' order.

    A weight of `folded` whose input factor did not get the constant-1 input (its layer's own
    call did not compute its factors: a weight used outside its module) keeps separate blocks.
    """
    owners = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), module)
    shapes = {name: p for name, p in params}
    joint = {}
    for weight, bias in folded.items():
        fs = factors.get(weight, [])
        if bias not in shapes or weight not in shapes or len(fs) != 2:
            continue
        p = shapes[weight]
        rows = fs[0].shape[0]
        if rows * (fs[1].shape[0] - 1) == p.numel() and shapes[bias].numel() == rows:
            joint[weight] = bias
    skipped = set(joint.values())
    blocks = []
    for name, p in params:
        if name in skipped:
            continue
        fs = factors[name]
        owner = owners.get(id(p))
        if name in joint:
            plain = [fs[0], fs[1][:-1, :-1]]
            transposed = _orientation(name, p, plain, owner)
            blocks.append(_Block(name, tuple(p.shape), fs, transposed, joint[name]))
        else:
            blocks.append(_Block(name, tuple(p.shape), fs, _orientation(name, p, fs, owner)))
    return blocks


class _GradientProjection(nn.Module):
    """`u_n = g_nᵀ f_n`: the model's output of sample n times the (fixed) gradient of its loss.

    With `L' = Σ_n u_n²` (`MSELoss(reduction="sum")` against zeros), the exact loss-Hessian
    factor at `u` is `√2`, so backpack's `KFLR` of `L'` backpropagates `√2 g_n` from the output:
    its `G` is twice the sum of the outer products of the per-sample loss gradients w.r.t. each
    layer's output (its `A` does not depend on the loss). That is the empirical-Fisher `G`.
    """

    def __init__(self, sweep: Sweep) -> None:
        super().__init__()
        self.inner = sweep.model
        self.sweep = sweep
        self.total = 0.0

    def forward(self, inputs):  # noqa: D102
        X, y = inputs
        f = self.inner(X)
        nu = self.sweep.nu(f, y)
        self.total += nu
        with torch.enable_grad(), disable():
            detached = f.detach().requires_grad_()
            (g,) = torch.autograd.grad(self.sweep.lossfunc(detached, y), detached)
        if self.sweep.reduction == "mean":
            g = g * nu  # gradients of the samples' unreduced losses
        n = self.sweep.samples(X)
        return (f * g).reshape(n, -1).sum(1, keepdim=True)


def _empirical_factors(sweep: Sweep, extension: Any):
    """`[G, A]` of the empirical Fisher `R Σ_n ∇ℓ_n ∇ℓ_nᵀ` (see `_GradientProjection`)."""
    wrapper = _GradientProjection(sweep)
    dtype = sweep.dtype

    def projected():
        for X, y in sweep.data:
            target = torch.zeros(sweep.samples(X), 1, dtype=dtype, device=first_tensor(X).device)
            yield (X, y), target

    projection = sweep.replace(
        model=wrapper,
        lossfunc=nn.MSELoss(reduction="sum"),
        data=projected(),
        normaliser=None,
        num_samples=lambda inputs: sweep.samples(inputs[0]),
    )
    result = accumulate_over(projection, [extension])
    group = _dist_group() if sweep.sharded else sweep.group
    if group is not None:  # every rank's sweep succeeded (accumulate agreed on it)
        (wrapper.total,) = all_sum(group, [], [wrapper.total], None, "sum KFAC's normalisers")
    scale = 2 * sweep.total(wrapper.total)
    factors = result._quantity(extension.savefield)  # shape-only where another rank owns
    factors = {name[len("inner.") :]: [f[0] / scale, *f[1:]] for name, f in factors.items()}
    owners = result.owners and {name[len("inner.") :]: r for name, r in result.owners.items()}
    return factors, scale / 2, result.num_samples, owners


class KFAC(CurvatureOperator):
    """Kronecker-factored curvature of a data set, block diagonal over the parameters.

    Args:
        model: The model (`extend`-ed here).
        lossfunc: The loss (torch loss module, reduction "mean" or "sum"; `extend`-ed here).
        data: Iterable of `(X, y)` batches (swept once, here).
        fisher_type: "type-2": `G` from the exact loss-Hessian factor (backpack's `KFLR`, the
            Kronecker approximation of the GGN); "mc": from `mc_samples` sampled labels per
            sample (backpack's `KFAC`); "empirical": from the gradients of the samples' own
            losses (the Kronecker approximation of `EmpiricalFisher`, one backpropagated column).
        kfac_approx: "expand" or "reduce": the convention for layers sharing their weight over
            positions (sequences, convolutions), see the docs' "Transformers" page. Both are
            the published definitions (Eschenhagen et al., 2023), for convolutions too
            ("expand": output positions act as samples); backpack's per-batch `KFLR`/`KFAC`
            extensions keep the original BackPACK's convolution scale (docs: "Curvature of a
            data set").
        mc_samples: Number of sampled labels for "mc".
        seed: Seed of the "mc" draws (the global RNG is forked, not advanced; under
            torch.distributed rank r draws from `seed + r`).
        progress: Show a progress bar (tqdm).
        normaliser: Custom `(output, y) -> ν_b`.
        num_samples: Custom `X -> number of samples`.
        distributed: `data` is this rank's shard (see `accumulate`): None (default) when
            torch.distributed runs with more than one process, True, or False. Every rank then
            builds the whole data set's factors (a collective).
        separate_weight_and_bias: True (default): every parameter is a block of its own (a
            bias gets `[G]`). False: the bias of an `nn.Linear`, transformers' `Conv1D` or a
            convolution (both trainable, used by that layer only) is folded into its weight's
            block as an appended constant-1 input: one block `G ⊗ Ã` of `[W | b]`,
            `Ã = [[A, m], [mᵀ, 1]]` with `m` the mean input (the K-FAC papers' and kronfluence's
            convention; curvlinops' option of the same name).

    On a model sharded with FSDP2 (`fully_shard`) each block's factors live whole on one owner
    rank (`owners`); vectors are this rank's local shards (`[P_local]` or `[P_local, K]`, the
    concatenation of `p.to_local().reshape(-1)`), products, `inverse`, `logdet`, `trace` and
    `diagonal` are collectives, `eigenvalues` gives the owned blocks' and `to_dense` is refused
    (docs: "Distributed sweeps", FSDP2).

    The factors are those of the data-set loss (see `accumulate`): `A` averages all inputs of
    the data set, `G` sums the backpropagated outer products with the data-set loss's factor.
    Cost: building sweeps the data once (one backward per batch); everything else is closed-form
    in the factors.
    """

    def __init__(
        self,
        model: nn.Module,
        lossfunc: Any,
        data: Iterable,
        fisher_type: str = "type-2",
        kfac_approx: str = "expand",
        mc_samples: int = 1,
        seed: int = 0,
        progress: bool = False,
        normaliser: Normaliser | None = None,
        num_samples: Callable[[Any], int] | None = None,
        distributed: bool | None = None,
        separate_weight_and_bias: bool = True,
    ) -> None:
        model = local_module(model)
        if not is_fully_sharded(model):
            refuse_unfaithful_gradients(model, "KFAC")
        sweep = Sweep(
            model,
            lossfunc,
            data,
            progress=progress,
            normaliser=normaliser,
            num_samples=num_samples,
            distributed=distributed,
            what="KFAC",
        )
        self._build(sweep, fisher_type, kfac_approx, mc_samples, seed, separate_weight_and_bias)

    @classmethod
    def _from_sweep(
        cls,
        sweep: Sweep,
        fisher_type: str = "type-2",
        kfac_approx: str = "expand",
        mc_samples: int = 1,
        seed: int = 0,
        separate_weight_and_bias: bool = True,
    ) -> KFAC:
        """`KFAC` of a prepared `Sweep` (the data-set layer's own entry; arguments as above)."""
        if not sweep.sharded:
            refuse_unfaithful_gradients(sweep.model, "KFAC")
        op = cls.__new__(cls)
        op._build(sweep, fisher_type, kfac_approx, mc_samples, seed, separate_weight_and_bias)
        return op

    def _build(
        self,
        sweep: Sweep,
        fisher_type: str,
        kfac_approx: str,
        mc_samples: int,
        seed: int,
        separate_weight_and_bias: bool,
    ) -> None:
        model = sweep.model
        params = sweep.trainable()
        super().__init__(model, params)
        #: the model, loss and data the factors were swept from
        self.sweep = sweep
        if fisher_type == "type-2":
            extension = KFLR(kfac_approx=kfac_approx)
        elif fisher_type == "mc":
            extension = KFACExtension(mc_samples=mc_samples, kfac_approx=kfac_approx)
        elif fisher_type == "empirical":
            extension = KFLR(kfac_approx=kfac_approx)
        else:
            raise ValueError(
                f"fisher_type must be 'type-2', 'mc' or 'empirical', got {fisher_type!r}."
            )
        self.fisher_type = fisher_type
        self.kfac_approx = kfac_approx
        self.separate_weight_and_bias = separate_weight_and_bias
        targets, folded = kron_targets(model, kfac_approx, separate_weight_and_bias)
        with lent(targets):
            if fisher_type == "empirical":
                factors, total, count, owners = _empirical_factors(sweep, extension)
            else:
                devices = [self.device] if self.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(seed + sweep.rank)
                    result = accumulate_over(sweep, [extension])
                factors = result._quantity(extension.savefield)
                total, count = result.normaliser, result.num_samples
                owners = result.owners
        #: what the data-set loss divides its summed terms by (`ν` for "mean", 1 for "sum")
        self.normaliser_total = total
        #: the number of samples of the data set
        self.num_samples_total = count
        self.blocks = _blocks(model, params, factors, folded)
        #: on an FSDP2 model: each block's owner rank and the routing of the local shards
        self._sharded: ShardedBlocks | None = None
        if sweep.sharded:
            assert owners is not None
            self._sharded = ShardedBlocks(model, self.blocks, owners, _dist_group(), "KFAC")
            self.shapes = self._sharded.local_shapes
            self.numels = self._sharded.local_numels

    _group = property(lambda self: self.sweep.group)

    @property
    def owners(self) -> dict[str, int] | None:
        """On a model sharded with FSDP2: `{block name: rank holding its factors}`; else None."""
        return None if self._sharded is None else dict(self._sharded.owner)

    def _owned(self) -> list[_Block]:
        """The blocks whose factors this rank holds (every block without FSDP2)."""
        return self.blocks if self._sharded is None else self._sharded.owned()  # type: ignore

    def __matmul__(self, v: Tensor) -> Tensor:
        """The product with `v` `[P]` or `[P, K]`; on an FSDP2 model a collective of local rows.

        On a model sharded with FSDP2, `v` is this rank's local shards (`[P_local]` or
        `[P_local, K]`: the concatenation of `p.to_local().reshape(-1)` over the trainable
        parameters) and the result this rank's rows of the product; every rank must call it.
        """
        if self._sharded is None:
            return super().__matmul__(v)
        return sharded_matmul(self, self._sharded, v, lambda b, w: b.apply(w, b.factors))

    @property
    def factors(self) -> dict[str, list[Tensor]]:
        """`{block name: [G, A] or [B]}` of the data-set loss.

        A block's name is its parameter's (the weight's, for a weight with its bias folded in).
        On a model sharded with FSDP2: the blocks this rank owns (see `owners`).
        """
        return {b.name: b.factors for b in self._owned()}

    def _matmat(self, V: Tensor) -> Tensor:
        pieces = blockwise(
            self.blocks, self.names, self.split(V), lambda b, v: b.apply(v, b.factors)
        )
        return torch.cat(pieces, dim=1).T

    def to_dense(self) -> Tensor:
        """The dense block-diagonal `[P, P]` matrix (refused on a model sharded with FSDP2)."""
        if self._sharded is not None:
            raise refuse_dense("KFAC")
        dense = [b.dense(b.factors) for b in self.blocks]
        return assemble_dense(self.blocks, self.names, self.numels, dense)

    def to_scipy(self):
        """A SciPy `LinearOperator` (refused on a model sharded with FSDP2: per-rank vectors)."""
        if self._sharded is not None:
            raise refuse_dense("KFAC.to_scipy")
        return super().to_scipy()

    def diagonal(self) -> Tensor:
        """The diagonal: `diag(G) ⊗ diag(A)` per block (FSDP2: this rank's rows, a collective)."""
        if self._sharded is not None:
            like = torch.empty(0, dtype=self.dtype, device=self.device)
            return sharded_diagonal(
                self._sharded, lambda b: b.diagonal_of([f.diagonal() for f in b.factors]), like
            )
        diags = [b.diagonal_of([f.diagonal() for f in b.factors]) for b in self.blocks]
        return assemble_diagonal(self.blocks, self.names, self.numels, diags)

    def trace(self) -> Tensor:
        """The trace: `Σ tr(G) tr(A)` over the blocks (FSDP2: on every rank, a collective)."""
        if self._sharded is not None:
            return self._sharded.total(
                lambda: sum(math.prod(f.trace() for f in b.factors) for b in self._owned()),
                "sum the trace",
            ).to(self.dtype)
        return sum(math.prod(f.trace() for f in b.factors) for b in self.blocks)

    def eigenvalues(self) -> Tensor:
        """All P eigenvalues (products of the factors' eigenvalues), in ascending order.

        On a model sharded with FSDP2: the eigenvalues of the blocks this rank owns (`owners`),
        in ascending order; the ranks' results together are the whole spectrum. Not a
        collective (each owner decomposes its own factors).
        """
        owned = self._owned()
        if not owned:
            return torch.empty(0, dtype=self.dtype, device=self.device)
        return torch.cat([b.eigenvalues().flatten() for b in owned]).sort().values

    def inverse(self, damping: float = 0.0) -> KFACInverse:
        """`(K + damping·I)⁻¹` in closed form, exact for the damped block-diagonal matrix.

        Per block `(G ⊗ A + λI)⁻¹ = (Q_G ⊗ Q_A) (Λ_G ⊗ Λ_A + λI)⁻¹ (Q_G ⊗ Q_A)ᵀ` from the
        factors' eigendecompositions (not the heuristic damping of each factor).

        Raises:
            ValueError: For a negative damping.
        """
        if damping < 0:
            raise ValueError(f"damping must be non-negative, got {damping}.")
        return KFACInverse(self, damping)

    def logdet(self, damping: float = 0.0) -> Tensor:
        """`log det(K + damping·I)` from the factors' eigenvalues (-inf if singular).

        On a model sharded with FSDP2: the whole matrix's, on every rank (a collective).
        """
        if self._sharded is not None:
            return self._sharded.total(
                lambda: sum(
                    float((b.eigenvalues().flatten() + damping).log().sum()) for b in self._owned()
                ),
                "sum the log-determinant",
            ).to(self.dtype)
        return torch.cat([(b.eigenvalues().flatten() + damping).log() for b in self.blocks]).sum()


class KFACInverse(CurvatureOperator):
    """`(K + λI)⁻¹` of a `KFAC` operator `K`, applied in the factors' eigenbases."""

    def __init__(self, kfac: KFAC, damping: float) -> None:
        self._layout_of(kfac)
        self.kfac = kfac
        self.damping = damping

    def _block_inverse(self, block: _Block, v: Tensor) -> Tensor:
        eig = block.eig()
        w = block.to_own(v)
        if len(eig) == 2:
            (lg, qg), (la, qa) = eig
            w = qg.T @ w @ qa
            w = w / (torch.outer(lg, la) + self.damping)
            w = qg @ w @ qa.T
        else:
            (lb, qb) = eig[0]
            w = ((w @ qb) / (lb + self.damping)) @ qb.T
        return block.from_own(w)

    def __matmul__(self, v: Tensor) -> Tensor:
        """The product with `v`; on an FSDP2 model a collective of local rows (see `KFAC`)."""
        if self.kfac._sharded is None:
            return super().__matmul__(v)
        return sharded_matmul(self, self.kfac._sharded, v, self._block_inverse)

    def to_dense(self) -> Tensor:
        """The dense `[P, P]` inverse (refused on a model sharded with FSDP2)."""
        if self.kfac._sharded is not None:
            raise refuse_dense("KFACInverse")
        return super().to_dense()

    def _block_diagonal(self, block: _Block) -> Tensor:
        """The diagonal of the block's damped inverse, `(Q∘Q) (Λ + λ)⁻¹` per factor pair."""
        eig = block.eig()
        if len(eig) == 2:
            (lg, qg), (la, qa) = eig
            inv = 1 / (torch.outer(lg, la) + self.damping)
            own = (qg.square() @ inv @ qa.square().T).flatten()
        else:
            (lb, qb) = eig[0]
            own = qb.square() @ (1 / (lb + self.damping))
        return block.place_diagonal(own)

    def to_scipy(self):
        """A SciPy `LinearOperator` (refused on a model sharded with FSDP2: per-rank vectors)."""
        if self.kfac._sharded is not None:
            raise refuse_dense("KFACInverse.to_scipy")
        return super().to_scipy()

    def diagonal(self) -> Tensor:
        """The diagonal (FSDP2: this rank's rows, from the owners' eigenbases; a collective)."""
        sharded = self.kfac._sharded
        if sharded is None:
            return super().diagonal()
        like = torch.empty(0, dtype=self.dtype, device=self.device)
        return sharded_diagonal(sharded, self._block_diagonal, like)

    def trace(self) -> Tensor:
        """The trace (FSDP2: the whole matrix's on every rank; a collective)."""
        sharded = self.kfac._sharded
        if sharded is None:
            return super().trace()
        return sharded.total(
            lambda: sum(float(self._block_diagonal(b).sum()) for b in self.kfac._owned()),
            "sum the inverse's trace",
        ).to(self.dtype)

    def _matmat(self, V: Tensor) -> Tensor:
        pieces = blockwise(self.kfac.blocks, self.names, self.split(V), self._block_inverse)
        return torch.cat(pieces, dim=1).T

    def logdet(self) -> Tensor:
        """`log det((K + λI)⁻¹) = −log det(K + λI)`."""
        return -self.kfac.logdet(self.damping)
