"""`EKFAC`: KFAC's eigenbasis with eigenvalues refitted to the curvature (George et al., 2018).

Per parameter block, KFAC's `G ⊗ A` has the eigenbasis `Q = Q_G ⊗ Q_A` and the eigenvalues
`λ_G,i λ_A,j`. EK-FAC keeps `Q` and replaces the eigenvalues by the diagonal of the curvature
itself in that basis, `Λ*_k = q_kᵀ F q_k`, which for `F = R Σ_r u_r u_rᵀ` (rows `u_r`: per-sample
gradients, or square-root factors of the GGN) is `R Σ_r (q_kᵀ u_r)²`. Among all matrices
`Q diag(d) Qᵀ`, that `d` is the closest to `F`'s block in the Frobenius norm. Blocks with one dense
factor `B` (biases, parameters without a Kronecker rule) use `B`'s eigenbasis the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from backpack.api import disable
from backpack.core.derivatives import convnd
from backpack.curvature import _distributed as _dist
from backpack.curvature._blocks import (
    BlockLayout,
    assemble_dense,
    assemble_diagonal,
    blockwise,
)
from backpack.curvature._data import Normaliser, first_tensor, needs_reiterable, trainable
from backpack.curvature._distributed import local_module, rank_of
from backpack.curvature._eigen import EigenState, eigen_rules, is_target
from backpack.curvature._forward import refuse_unfaithful_gradients
from backpack.curvature._fsdp import is_fully_sharded
from backpack.curvature._fsdp_blocks import (
    ShardedBlocks,
    refuse_dense,
    sharded_diagonal,
    sharded_matmul,
)
from backpack.curvature._fsdp_eigen import check_calls, rows_correction, sharded_correction
from backpack.curvature._quantities import wide
from backpack.curvature._rows import row_batches
from backpack.curvature._sweep import Sweep
from backpack.curvature.accumulate import accumulate_over
from backpack.curvature.kfac import KFAC
from backpack.curvature.operators import CurvatureOperator
from backpack.distributed import _group as _dist_group
from backpack.extensions import DiagGGNExact, DiagGGNMC, SumGradSquared

__all__ = ["EKFAC", "EKFACInverse", "EigenBlock"]

#: which rows (see `_rows`) give the curvature of each `fisher_type`
_ROWS = {"type-2": "type-2", "mc": "mc", "empirical": "grad"}


class EigenBlock(BlockLayout):
    """One block `Q diag(values) Qᵀ` with `Q = Q_0 ⊗ Q_1`, `Q_0`, or the identity.

    Args:
        name: The (weight's) parameter name.
        shape: The parameter's shape.
        vectors: `[Q_0, Q_1]` (Kronecker eigenbasis), `[Q_0]` (dense eigenbasis) or `[]`
            (identity: a diagonal block).
        values: The eigenvalues, of shape `(size_0, size_1)`, `(size_0,)` or `(numel,)`.
        transposed: Whether the coordinates are those of `parameter.transpose(0, 1)` (the
            Kronecker factors of embeddings and transposed convolutions).
        bias: The name of a bias folded into the block as the last input column (see
            `BlockLayout`), or None.

    Vectors go in and out as `[K, numel]` (the block's parameters flattened and concatenated,
    see `BlockLayout.gather`), or `[K, *shape]` for a one-parameter block.
    """

    def __init__(
        self,
        name: str,
        shape: tuple,
        vectors: list[Tensor],
        values: Tensor,
        transposed: bool,
        bias: str | None = None,
    ) -> None:
        super().__init__(name, shape, transposed, bias)
        self.vectors = list(vectors)
        self.values = values

    def own_shape(self) -> tuple[int, ...]:  # noqa: D102
        return tuple(self.values.shape)

    def rotate(self, w: Tensor) -> Tensor:
        """`Qᵀ w` for `w` `[K, *values.shape]` in the block's coordinates."""
        if len(self.vectors) == 2:
            return self.vectors[0].T @ w @ self.vectors[1]
        if len(self.vectors) == 1:
            return w @ self.vectors[0]
        return w

    def unrotate(self, w: Tensor) -> Tensor:
        """`Q w`: inverse of `rotate`."""
        if len(self.vectors) == 2:
            return self.vectors[0] @ w @ self.vectors[1].T
        if len(self.vectors) == 1:
            return w @ self.vectors[0].T
        return w

    def apply(self, v: Tensor, scale: Tensor) -> Tensor:
        """`Q diag(scale) Qᵀ v` for `v` `[K, numel]` (or `[K, *shape]`), `[K, numel]` out."""
        return self.from_own(self.unrotate(self.rotate(self.to_own(v)) * scale))

    def squares(self, rows: Tensor) -> Tensor:
        """`Σ_r (Qᵀ u_r)²` over rows `[R, numel]`, of shape `values.shape`."""
        return self.rotate(self.to_own(rows)).square().sum(0)

    def quadratic(self, rows: Tensor, scale: Tensor) -> Tensor:
        """`u_rᵀ Q diag(scale) Qᵀ u_r` for every row `[R, numel]`: `[R]`."""
        rotated = self.rotate(self.to_own(rows)).square() * scale
        return rotated.reshape(rows.shape[0], -1).sum(1)

    def dense(self, scale: Tensor) -> Tensor:
        """`Q diag(scale) Qᵀ` as a `[numel, numel]` matrix in the parameters' flattening."""
        if len(self.vectors) == 2:
            q = torch.kron(self.vectors[0], self.vectors[1])
        elif len(self.vectors) == 1:
            q = self.vectors[0]
        else:
            q = torch.eye(self.numel, dtype=scale.dtype, device=scale.device)
        return self.place_dense((q * scale.flatten()) @ q.T)

    def diagonal(self, scale: Tensor) -> Tensor:
        """The diagonal of `Q diag(scale) Qᵀ`, `[numel]` in the parameters' flattening."""
        if len(self.vectors) == 2:
            d = (self.vectors[0].square() @ scale @ self.vectors[1].square().T).flatten()
        elif len(self.vectors) == 1:
            d = self.vectors[0].square() @ scale
        else:
            d = scale.flatten()
        return self.place_diagonal(d)

    def state(self) -> dict[str, Any]:
        """The block as plain tensors and numbers (for `torch.save`)."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "vectors": list(self.vectors),
            "values": self.values,
            "transposed": self.transposed,
            "bias": self.bias,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> EigenBlock:
        """Inverse of `state`."""
        return cls(
            state["name"],
            tuple(state["shape"]),
            list(state["vectors"]),
            state["values"],
            bool(state["transposed"]),
            state.get("bias"),
        )


def kfac_eigenblocks(kfac: KFAC) -> list[EigenBlock]:
    """KFAC's blocks in their eigenbases: `Q_G ⊗ Q_A` with eigenvalues `λ_G,i λ_A,j` (or `Q_B`).

    On a model sharded with FSDP2 only the owner of a block (`kfac.owners`) decomposes its
    factors; the other ranks get shape-only (meta) eigenvectors and eigenvalues.
    """
    blocks = []
    owned = {b.name for b in kfac._owned()}
    for b in kfac.blocks:
        if b.name not in owned:
            sizes = [f.shape[0] for f in b.factors]
            dtype = b.factors[0].dtype
            vectors = [torch.empty(n, n, dtype=dtype, device="meta") for n in sizes]
            values = torch.empty(*sizes, dtype=dtype, device="meta")
            blocks.append(EigenBlock(b.name, b.shape, vectors, values, b.transposed, b.bias))
            continue
        eig = b.eig()
        vectors = [q for _, q in eig]
        blocks.append(EigenBlock(b.name, b.shape, vectors, b.eigenvalues(), b.transposed, b.bias))
    return blocks


def _per_block(damping: float | Mapping[str, float], names: list[str]) -> dict[str, float]:
    if isinstance(damping, Mapping):
        missing = [n for n in names if n not in damping]
        if missing:
            raise ValueError(f"damping has no value for {missing}.")
        values = {n: float(damping[n]) for n in names}
    else:
        values = dict.fromkeys(names, float(damping))
    negative = {n: v for n, v in values.items() if v < 0}
    if negative:
        raise ValueError(f"damping must be non-negative, got {negative}.")
    return values


def _owned(model: nn.Module, blocks: list[EigenBlock]) -> Iterator[tuple[EigenBlock, Any, str]]:
    """Each block with the module owning its parameter and the parameter's attribute name."""
    modules = dict(model.named_modules())
    for block in blocks:
        owner, _, attr = block.name.rpartition(".")
        yield block, modules.get(owner), attr


def _exact_bias_blocks(model: nn.Module, blocks: list[EigenBlock], approx: str) -> set[str]:
    """Names of the dense-factor blocks of `nn.Linear` (and under "reduce" convolution) biases.

    Under "expand" a convolution's output positions act as samples in its `G`.
    """
    layers = (nn.Linear, nn.modules.conv._ConvNd) if approx == "reduce" else (nn.Linear,)
    return {
        block.name
        for block, module, attr in _owned(model, blocks)
        if attr == "bias" and isinstance(module, layers) and len(block.vectors) == 1
    }


def _inexact_linear_biases(model: nn.Module, names: set[str], first: Any) -> set[str]:
    """Those of the `nn.Linear` biases `names` whose dense factor is not the GGN's block.

    The factor is the block only for a layer called as a module on `[N, in]` inputs. A layer
    that sees positions besides the samples has a factor that treats them as samples
    (`Σ_{n,t} s sᵀ`, not `Σ_n (Σ_t s)(Σ_t s)ᵀ`), and one used functionally (attention's output
    projection) has none of its own: their corrected eigenvalues need the curvature's rows.
    Found with one forward of the first batch's inputs `first`.
    """
    modules = dict(model.named_modules())
    owners = {modules[name.rpartition(".")[0]]: name for name in names}
    owners = {m: name for m, name in owners.items() if isinstance(m, nn.Linear)}
    flat: dict[nn.Module, bool] = {}

    def hook(module: nn.Module, args: tuple) -> None:
        ok = bool(args) and isinstance(args[0], Tensor) and args[0].dim() == 2
        flat[module] = flat.get(module, True) and ok

    handles = [m.register_forward_pre_hook(hook) for m in owners]
    try:
        with torch.no_grad(), disable():
            model(first)
    finally:
        for handle in handles:
            handle.remove()
    return {name for m, name in owners.items() if not flat.get(m, False)}


def _eigen_targets(
    model: nn.Module, blocks: list[EigenBlock], exact: set[str]
) -> dict[nn.Module, tuple[EigenBlock, EigenBlock | None]]:
    """Layers whose blocks take their corrected eigenvalues as diagonals in their eigenbases.

    `nn.Linear` layers and torch's convolutions (their own rule, not tied, not parametrized)
    whose weight block is in a Kronecker eigenbasis of the layer's orientation, by module; each
    with its bias's own block where that has a dense factor and is not `exact` (its corrected
    eigenvalues then come from the same sweep), else None. A folded bias is in the weight's
    block.
    """
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    by_name = {b.name: b for b in blocks}
    found = {}
    for block, module, attr in _owned(model, blocks):
        if attr != "weight" or module is None or not is_target(module):
            continue
        transposed = isinstance(module, nn.modules.conv._ConvNd) and convnd.is_transposed(module)
        if (
            len(block.vectors) != 2
            or block.transposed != transposed
            or uses[id(module.weight)] != 1
            or block.vectors[0].dtype != module.weight.dtype
            or (block.bias is not None and uses[id(module.bias)] != 1)
        ):
            continue
        bias = by_name.get(block.name[: -len("weight")] + "bias")
        if bias is not None and (
            bias.name in exact
            or len(bias.vectors) != 1
            or uses[id(module.bias)] != 1
            or bias.vectors[0].dtype != module.bias.dtype
        ):
            bias = None
        found[module] = (block, bias)
    return found


def _swept_params(module: nn.Module, pair: tuple[EigenBlock, EigenBlock | None]) -> list[str]:
    """The attribute names of the module's parameters the sweep takes (weight, bias)."""
    weight, bias = pair
    return ["weight", "bias"] if weight.bias is not None or bias is not None else ["weight"]


@contextmanager
def _outside_calls(targets: Mapping[nn.Module, list[str]]):
    """The targets' parameters hold other values outside the targets' own calls.

    Inside a call the module holds its parameters; outside, each is replaced by a shifted copy.
    A forward that gives the same output used them only inside the calls.
    """
    originals = {m: {n: m._parameters[n] for n in names} for m, names in targets.items()}
    shifted = {
        m: {n: nn.Parameter(p.detach() + p.detach().abs().max() + 1, False) for n, p in ps.items()}
        for m, ps in originals.items()
    }
    handles = []

    def swap(values):
        def hook(module, *args):
            for n, p in values[module].items():
                module._parameters[n] = p

        return hook

    try:
        for m in targets:
            handles.append(m.register_forward_pre_hook(swap(originals)))
            handles.append(m.register_forward_hook(swap(shifted)))
            for n, p in shifted[m].items():
                m._parameters[n] = p
        yield
    finally:
        for handle in handles:
            handle.remove()
        for m, ps in originals.items():
            for n, p in ps.items():
                m._parameters[n] = p


def _first_batch(
    model: nn.Module, targets: Mapping[nn.Module, list[str]], X: Any
) -> tuple[list[bool], list[bool], int]:
    """Checks on the first batch's inputs `X`, per target: used only in its own call, called once.

    Returns whether each target's parameters enter the output only through its own call (the
    output does not change when they are shifted outside it), whether each is called exactly
    once per forward, and the number of output entries per sample (what the exact loss-Hessian
    factor has columns).
    """
    buffers = [(b, b.clone()) for b in model.buffers()]
    calls: Counter = Counter()
    handles = [m.register_forward_hook(lambda m, *_: calls.update([id(m)])) for m in targets]

    def same(outside: Mapping[nn.Module, list[str]], plain: Any) -> bool:
        with _outside_calls(outside):
            other = first_tensor(model(X))
        if not isinstance(plain, Tensor) or not isinstance(other, Tensor):
            return False
        scale = plain.abs().max().clamp_min(1.0)
        return bool(((plain - other).abs().max() <= 1e-3 * scale).item())

    try:
        with torch.no_grad(), disable():
            out = model(X)
            for handle in handles:
                handle.remove()
            plain = first_tensor(out)
            if same(targets, plain):
                faithful = [True] * len(targets)
            else:  # find the ones used elsewhere
                faithful = [same({m: names}, plain) for m, names in targets.items()]
            for buffer, saved in buffers:  # running statistics are not this check's to update
                buffer.copy_(saved)
    finally:
        for handle in handles:
            handle.remove()
    once = [calls[id(m)] == 1 for m in targets]
    width = plain[0].numel() if isinstance(plain, Tensor) and plain.dim() > 0 else 1
    return faithful, once, width


@contextmanager
def _frozen(params: list[Tensor]):
    """`params` without gradients (none of their quantities computed) inside the block."""
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _eigen_states(targets: Mapping[Any, tuple[EigenBlock, EigenBlock | None]], columns: int):
    """`{module: EigenState}`: the eigenbases each swept layer's lent rule rotates into."""
    return {
        module: EigenState(
            *weight.vectors,
            bias.vectors[0] if bias is not None else None,
            columns,
            fold=weight.bias is not None,
        )
        for module, (weight, bias) in targets.items()
    }


def _diagonal_extension(fisher_type: str, mc_samples: int) -> Any:
    """The diagonal extension whose sweep in the eigenbases gives the corrected eigenvalues."""
    if fisher_type == "type-2":
        return DiagGGNExact()
    if fisher_type == "mc":
        return DiagGGNMC(mc_samples=mc_samples)
    return SumGradSquared()


def _set_corrected(block: EigenBlock, diagonal: Mapping[str, Tensor], scale: float) -> None:
    """`block.values` from the swept diagonal (a folded bias: the last input column)."""
    values = diagonal[block.name]
    if block.bias is not None:
        values = torch.cat(
            [values.reshape(block.rows, -1), diagonal[block.bias].reshape(block.rows, 1)], dim=1
        )
    block.values = values.reshape(block.values.shape) * scale


def _correct(
    sweep: Sweep, blocks: list[EigenBlock], fisher_type: str, mc_samples: int, kfac_approx: str
) -> tuple[float, int]:
    """Set every block's corrected eigenvalues `R Σ_r (q_kᵀ u_r)²`; return `(ν, N)`.

    Under torch.distributed (the sweep's group), the data is this rank's shard and the sums
    are global.

    One mechanism for `nn.Linear` layers and convolutions (`_eigen`): in one sweep of
    backpack's diagonal extension of the curvature (`DiagGGNExact`, `DiagGGNMC`,
    `SumGradSquared`), each target layer's rule is lent one that returns the diagonal in the
    layer's eigenbases (folded biases and the bias's own block included), computed from rotated
    factors and inputs, never from rows. Other blocks (tied weights, layers called several times
    or whose parameters are used outside their call, the remaining dense blocks) project their
    rows.
    """
    model, group = sweep.model, sweep.group
    # for the GGN, the dense factor of a convolution bias under "reduce", or of a Linear bias
    # without positions, is the exact block B
    # (Σ over samples and outputs of (Σ_positions s)(Σ_positions s)ᵀ), so qᵀ B q is B's
    # eigenvalue, the value the block already has. Not so for sampled draws ("mc": the
    # correction takes fresh ones), the empirical factors of token losses, or the dense
    # factors of other layers (attention's, e.g., approximate their block).
    exact = _exact_bias_blocks(model, blocks, kfac_approx) if fisher_type == "type-2" else set()
    if exact:
        exact -= _inexact_linear_biases(model, exact, sweep.first_inputs())
    targets = _eigen_targets(model, blocks, exact)
    columns = {"type-2": 1, "mc": mc_samples, "empirical": 1}[fisher_type]
    if targets:
        swept_params = {m: _swept_params(m, pair) for m, pair in targets.items()}
        faithful, once, width = _first_batch(model, swept_params, sweep.first_inputs())
        if fisher_type == "type-2":
            columns = width
        ok = [a and b for a, b in zip(faithful, once)]
        if group is not None:  # the same path on every rank
            agreed = _dist.all_sum(group, [], [float(x) for x in ok], None, "EKFAC")
            ok = [a == _dist.world_size(group) for a in agreed]
        targets = {m: pair for (m, pair), keep in zip(targets.items(), ok) if keep}
    states = _eigen_states(targets, columns)
    swept: dict[str, EigenBlock] = {}
    for weight, bias in targets.values():
        swept[weight.name] = weight
        if bias is not None:
            swept[bias.name] = bias
    params = dict(trainable(model))
    covered = {name for b in swept.values() for name in b.names}
    total, count = 0.0, 0
    if swept:
        others = [p for name, p in params.items() if name not in covered]
        extension = _diagonal_extension(fisher_type, mc_samples)
        try:
            with _frozen(others), eigen_rules(states):
                result = accumulate_over(sweep, extension)
        except NotImplementedError:
            # a layer the engine needs per-sample quantities of (called on several sets of
            # samples, or its parameter shared): rotate rows instead
            swept, covered = {}, set()
    rest = [b for b in blocks if b.name not in swept and b.name not in exact]
    if swept:
        diagonal = result.quantity(extension.savefield)
        # SumGradSquared holds Σ_n (∇ℓ_n / ν)²: one factor ν back to R Σ_n (qᵀ∇ℓ_n)²
        scale = result.normaliser if fisher_type == "empirical" else 1.0
        for block in swept.values():
            _set_corrected(block, diagonal, scale)
        total, count = result.total, result.num_samples
    if not rest:
        return total, count
    frozen = [params[name] for name in covered]

    def rows_sums(frozen: list[Tensor]) -> tuple[list[Tensor], float, int]:
        sums = [wide(torch.zeros_like(b.values)) for b in rest]  # in any batch order alike
        total, count = 0.0, 0
        with _frozen(frozen):
            for batch, rows, nu in row_batches(
                sweep, _ROWS[fisher_type], mc_samples, "EKFAC eigenvalues"
            ):
                total += nu
                count += batch.num_samples
                for s, b in zip(sums, rest):
                    s += b.squares(b.gather(rows))
        return sums, total, count

    def local() -> tuple[list[Tensor], float, int]:
        try:
            return rows_sums(frozen)
        except NotImplementedError:
            if not frozen:
                raise
            # the engine can need the swept layers' gradients to map the loss's rows to the
            # samples (a loss reached through them by more than reshapes): all rows, unfrozen
            return rows_sums([])

    done, error = _dist.guarded(group, local, "EKFAC")
    if group is None:
        sums, total, count = done
    else:
        empty = ([wide(torch.zeros_like(b.values)) for b in rest], 0.0, 0)
        sums, total, count = done if done is not None else empty
        total, count = _dist.all_sum(
            group, sums, [total, float(count)], error, "sum EKFAC's corrected eigenvalues"
        )
        count = int(count)
    normaliser_total = sweep.total(total)
    for s, b in zip(sums, rest):
        b.values = (s / normaliser_total).to(b.values.dtype)
    return total, count


def _correct_sharded(
    sweep: Sweep,
    blocks: list[EigenBlock],
    routing: ShardedBlocks,
    fisher_type: str,
    mc_samples: int,
    kfac_approx: str,
    device: torch.device,
) -> tuple[float, int]:
    """`_correct` on a model sharded with FSDP2: the owners' blocks get corrected eigenvalues.

    The blocks of the eigenbasis rules' targets (`nn.Linear` and convolutions called once per
    forward) take `_fsdp_eigen.sharded_correction` (eigenbases broadcast just in time, squares
    inside the backward); the others (embeddings, normalisations, dense blocks, tied or
    twice-called layers) take `rows_correction`, one more sweep of per-sample rows.
    """
    model = sweep.model
    exact = _exact_bias_blocks(model, blocks, kfac_approx) if fisher_type == "type-2" else set()
    if exact:
        exact -= _inexact_linear_biases(model, exact, sweep.first_inputs())
    targets = _eigen_targets(model, blocks, exact)
    swept = {n for weight, bias in targets.values() for n in (weight.name, bias and bias.name)}
    # blocks the correction sweep cannot take: from per-sample rows (`rows_correction`)
    rest = [b for b in blocks if b.name not in swept and b.name not in exact]
    swept_params = {m: _swept_params(m, pair) for m, pair in targets.items()}
    error, ok, width = None, [], 1
    try:
        dtypes = {m: weight.vectors[0].dtype for m, (weight, _) in targets.items()}
        ok, width = check_calls(model, swept_params, dtypes, sweep.first_inputs())
    except Exception as err:  # noqa: BLE001 - agreed with the other ranks first
        error = err
    table = routing.agree(error, [float(x) for x in ok] or [0.0] * len(targets), "check layers")
    good = table.min(0).values.tolist() if targets else []
    for (weight, bias), keep in zip(list(targets.values()), good):
        if not keep:  # called twice, used outside its call, or computing in another dtype
            rest += [weight] + ([bias] if bias is not None else [])
    targets = {m: pair for (m, pair), keep in zip(targets.items(), good) if keep}
    total, count = 0.0, 0
    if targets:
        columns = {"type-2": width, "mc": mc_samples, "empirical": 1}[fisher_type]
        states = _eigen_states(targets, columns)
        extension = _diagonal_extension(fisher_type, mc_samples)
        try:
            diagonal, result = sharded_correction(
                sweep, routing, targets, states, extension, device
            )
        except NotImplementedError:  # the engine needs per-sample quantities of a layer
            rest += [b for pair in targets.values() for b in pair if b is not None]
            targets = {}
    if targets:
        # SumGradSquared holds Σ_n (∇ℓ_n / ν)²: one factor ν back to R Σ_n (qᵀ∇ℓ_n)²
        scale = result.normaliser if fisher_type == "empirical" else 1.0
        for weight, bias in targets.values():
            for block in (weight, bias):
                if block is None or routing.owner[block.name] != routing.me:
                    continue
                _set_corrected(block, diagonal, scale)
        total, count = result.total, result.num_samples
    if rest:
        kind = _ROWS[fisher_type]
        total, count = rows_correction(sweep, rest, routing, kind, mc_samples, device)
    return total, count


class EKFAC(CurvatureOperator):
    """Eigenvalue-corrected KFAC of a data set, block diagonal over the parameters.

    Args:
        model: The model (`extend`-ed here).
        lossfunc: The loss (torch loss module, reduction "mean" or "sum"; `extend`-ed here).
        data: Re-iterable `(X, y)` batches (swept twice, here).
        fisher_type: The curvature whose KFAC eigenbasis and whose diagonal in that basis are
            used, as for `KFAC`: "type-2" (the GGN; corrected eigenvalues from `SqrtGGNExact`,
            one row per output entry of a sample), "mc" (sampled labels: factors from
            backpack's `KFAC`, corrected eigenvalues from `SqrtGGNMC`, both with `mc_samples`
            draws per sample) or "empirical" (the gradients of the samples' own losses, from
            `BatchGrad`).
        kfac_approx: "expand" or "reduce", the convention of the Kronecker factors.
        mc_samples: Number of sampled labels per sample for "mc".
        seed: Seed of the "mc" draws: `seed` for the factors, `seed + 1` for the corrected
            eigenvalues (the global RNG is forked, not advanced; under torch.distributed rank
            r adds r to both).
        progress: Show progress bars (tqdm).
        normaliser: Custom `(output, y) -> ν_b`.
        num_samples: Custom `X -> number of samples`.
        distributed: `data` is this rank's shard (see `accumulate`): None (default) when
            torch.distributed runs with more than one process, True, or False. Both sweeps are
            then collectives and every rank gets the whole data set's operator.
        separate_weight_and_bias: As for `KFAC`: False folds a layer's bias into its weight's
            block (one eigenbasis `Q_G ⊗ Q_Ã` of `[W | b]`, its corrected eigenvalues from the
            gradients of `[W | b]`).

    On a model sharded with FSDP2 (`fully_shard`) each block's eigenbasis and corrected
    eigenvalues live on its KFAC owner (`owners`); the correction sweep broadcasts each layer's
    eigenbases from their owners just before the layer's backward and frees them after (one
    layer's at a time per rank) for `nn.Linear` and convolution blocks (called once per forward,
    parameters used only in their call, no mixed precision); the other blocks take a sweep of
    per-sample rows, each block's eigenbasis lent by its owner per batch. Vectors, products and
    the other methods are as for `KFAC` on FSDP2 (docs: "Distributed sweeps", FSDP2).

    Its scale is the data-set loss's, like `KFAC`'s: the corrected eigenvalues are
    `R Σ_r (q_kᵀ u_r)²` with `R` the reduction factor (`1/ν` or 1). Cost: one sweep for the
    Kronecker factors (as `KFAC`), their eigendecompositions, and one sweep for the corrected
    eigenvalues (per batch: one diagonal extension's backward in which every `nn.Linear` and
    convolution block, folded biases included, takes its diagonal in its eigenbasis from rotated
    factors; for other blocks the rows and two small matrix products per block). Everything
    else is closed-form in the eigenbases and the corrected eigenvalues.
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
        needs_reiterable(data, "EKFAC")
        if not is_fully_sharded(model):
            refuse_unfaithful_gradients(model, "EKFAC")
        sweep = Sweep(
            model,
            lossfunc,
            data,
            progress=progress,
            normaliser=normaliser,
            num_samples=num_samples,
            distributed=distributed,
            what="EKFAC",
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
    ) -> EKFAC:
        """`EKFAC` of a prepared `Sweep` (the data-set layer's own entry; arguments as above)."""
        sweep.needs_reiterable("EKFAC")
        if not sweep.sharded:
            refuse_unfaithful_gradients(sweep.model, "EKFAC")
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
        kfac = KFAC._from_sweep(
            sweep,
            fisher_type=fisher_type,
            kfac_approx=kfac_approx,
            mc_samples=mc_samples,
            seed=seed,
            separate_weight_and_bias=separate_weight_and_bias,
        )
        super().__init__(kfac.model, trainable(kfac.model))
        self.sweep = sweep
        self.kfac = kfac
        self.fisher_type = fisher_type
        self.blocks = kfac_eigenblocks(kfac)
        group = sweep.group
        #: on an FSDP2 model: each block's owner rank (KFAC's) and the routing of local shards
        self._sharded: ShardedBlocks | None = None
        rank = rank_of(group)
        if sweep.sharded:
            assert kfac.owners is not None
            self._sharded = ShardedBlocks(
                kfac.model, self.blocks, kfac.owners, _dist_group(), "EKFAC"
            )
            self.shapes = self._sharded.local_shapes
            self.numels = self._sharded.local_numels
            rank = self._sharded.me
        elif group is not None:  # one eigenbasis on every rank (eigh may differ across ranks)
            vectors = _dist.all_reduce_flat(
                group,
                [q * (rank_of(group) == 0) for b in self.blocks for q in b.vectors],
                "share EKFAC's eigenbases",
            )
            for b in self.blocks:
                b.vectors = [vectors.pop(0) for _ in b.vectors]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + 1 + rank)
            if self._sharded is not None:
                total, count = _correct_sharded(
                    sweep,
                    self.blocks,
                    self._sharded,
                    fisher_type,
                    mc_samples,
                    kfac_approx,
                    self.device,
                )
            else:
                total, count = _correct(sweep, self.blocks, fisher_type, mc_samples, kfac_approx)
        #: what the data-set loss divides its summed terms by (`ν` for "mean", 1 for "sum")
        self.normaliser_total = sweep.total(total)
        #: the number of samples of the data set
        self.num_samples_total = count

    @property
    def owners(self) -> dict[str, int] | None:
        """On a model sharded with FSDP2: `{block name: rank holding its eigenbasis}`; else None."""
        return None if self._sharded is None else dict(self._sharded.owner)

    def _owned(self) -> list[EigenBlock]:
        """The blocks whose eigenbases this rank holds (every block without FSDP2)."""
        return self.blocks if self._sharded is None else self._sharded.owned()  # type: ignore

    def _like(self) -> Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device)

    @property
    def corrected(self) -> dict[str, Tensor]:
        """`{block name: corrected eigenvalues}`, `(size_G, size_A)` or `(size_B,)`.

        On a model sharded with FSDP2: the blocks this rank owns (see `owners`).
        """
        return {b.name: b.values for b in self._owned()}

    def __matmul__(self, v: Tensor) -> Tensor:
        """The product with `v` `[P]` or `[P, K]`; on an FSDP2 model a collective of local rows.

        On a model sharded with FSDP2, `v` is this rank's local shards (`[P_local]` or
        `[P_local, K]`, as for `KFAC`) and the result this rank's rows; every rank must call it.
        """
        if self._sharded is None:
            return super().__matmul__(v)
        return sharded_matmul(self, self._sharded, v, lambda b, w: b.apply(w, b.values))

    def to_scipy(self):
        """A SciPy `LinearOperator` (refused on a model sharded with FSDP2: per-rank vectors)."""
        if self._sharded is not None:
            raise refuse_dense("EKFAC.to_scipy")
        return super().to_scipy()

    def _matmat(self, V: Tensor) -> Tensor:
        pieces = blockwise(
            self.blocks, self.names, self.split(V), lambda b, v: b.apply(v, b.values)
        )
        return torch.cat(pieces, dim=1).T

    def to_dense(self) -> Tensor:
        """The dense block-diagonal `[P, P]` matrix (refused on a model sharded with FSDP2)."""
        if self._sharded is not None:
            raise refuse_dense("EKFAC")
        dense = [b.dense(b.values) for b in self.blocks]
        return assemble_dense(self.blocks, self.names, self.numels, dense)

    def diagonal(self) -> Tensor:
        """The diagonal, `(Q_G∘Q_G) Λ* (Q_A∘Q_A)ᵀ` per block (FSDP2: this rank's rows)."""
        if self._sharded is not None:
            return sharded_diagonal(self._sharded, lambda b: b.diagonal(b.values), self._like())
        diags = [b.diagonal(b.values) for b in self.blocks]
        return assemble_diagonal(self.blocks, self.names, self.numels, diags)

    def trace(self) -> Tensor:
        """The trace: the sum of the corrected eigenvalues (equal to the curvature's trace).

        On a model sharded with FSDP2: the whole operator's, on every rank (a collective).
        """
        if self._sharded is not None:
            return self._sharded.total(
                lambda: sum(float(b.values.sum()) for b in self._owned()), "sum the trace"
            ).to(self.dtype)
        return sum(b.values.sum() for b in self.blocks)

    def eigenvalues(self) -> Tensor:
        """All P corrected eigenvalues, in ascending order.

        On a model sharded with FSDP2: those of the blocks this rank owns (`owners`); the
        ranks' results together are the whole spectrum. Not a collective.
        """
        owned = self._owned()
        if not owned:
            return self._like()
        return torch.cat([b.values.flatten() for b in owned]).sort().values

    def inverse(self, damping: float | Mapping[str, float] = 0.0) -> EKFACInverse:
        """`(E + λI)⁻¹`: `Q (Λ* + λ)⁻¹ Qᵀ` per block.

        Args:
            damping: λ, one for all blocks or `{block name: λ}` per block (a block's name is
                its parameter's, the weight's for a folded bias).

        Raises:
            ValueError: For a negative damping or a block without one.
        """
        return EKFACInverse(self, _per_block(damping, [b.name for b in self.blocks]))

    def logdet(self, damping: float | Mapping[str, float] = 0.0) -> Tensor:
        """`log det(E + λI) = Σ log(Λ* + λ)` (-inf if singular; FSDP2: a collective)."""
        per_block = _per_block(damping, [b.name for b in self.blocks])
        if self._sharded is not None:
            return self._sharded.total(
                lambda: sum(
                    float((b.values + per_block[b.name]).log().sum()) for b in self._owned()
                ),
                "sum the log-determinant",
            ).to(self.dtype)
        return sum((b.values + per_block[b.name]).log().sum() for b in self.blocks)


class EKFACInverse(CurvatureOperator):
    """`(E + λI)⁻¹` of an `EKFAC` operator `E`, applied in its eigenbases."""

    def __init__(self, ekfac: EKFAC, damping: dict[str, float]) -> None:
        self._layout_of(ekfac)
        self.ekfac = ekfac
        self.damping = damping

    def _block(self, b: EigenBlock, v: Tensor) -> Tensor:
        return b.apply(v, 1 / (b.values + self.damping[b.name]))

    def _matmat(self, V: Tensor) -> Tensor:
        pieces = blockwise(self.ekfac.blocks, self.names, self.split(V), self._block)
        return torch.cat(pieces, dim=1).T

    def __matmul__(self, v: Tensor) -> Tensor:
        """The product with `v`; on an FSDP2 model a collective of local rows (see `EKFAC`)."""
        if self.ekfac._sharded is None:
            return super().__matmul__(v)
        return sharded_matmul(self, self.ekfac._sharded, v, self._block)

    def to_dense(self) -> Tensor:
        """The dense `[P, P]` inverse (refused on a model sharded with FSDP2)."""
        if self.ekfac._sharded is not None:
            raise refuse_dense("EKFACInverse")
        return super().to_dense()

    def to_scipy(self):
        """A SciPy `LinearOperator` (refused on a model sharded with FSDP2: per-rank vectors)."""
        if self.ekfac._sharded is not None:
            raise refuse_dense("EKFACInverse.to_scipy")
        return super().to_scipy()

    def diagonal(self) -> Tensor:
        """The diagonal, `(Q_G∘Q_G) (Λ* + λ)⁻¹ (Q_A∘Q_A)ᵀ` per block (FSDP2: this rank's rows)."""
        sharded = self.ekfac._sharded
        if sharded is None:
            return super().diagonal()
        inverse = lambda b: b.diagonal(1 / (b.values + self.damping[b.name]))  # noqa: E731
        return sharded_diagonal(sharded, inverse, self.ekfac._like())

    def trace(self) -> Tensor:
        """The trace `Σ (Λ* + λ)⁻¹` (FSDP2: the whole matrix's on every rank; a collective)."""
        sharded = self.ekfac._sharded
        if sharded is None:
            return super().trace()
        return sharded.total(
            lambda: sum(
                float((1 / (b.values + self.damping[b.name])).sum()) for b in self.ekfac._owned()
            ),
            "sum the inverse's trace",
        ).to(self.dtype)

    def logdet(self) -> Tensor:
        """`log det((E + λI)⁻¹) = −log det(E + λI)`."""
        return -self.ekfac.logdet(self.damping)
