"""Influence functions: `fit` a curvature approximation once, then score query/training pairs.

The score of a query example q and a training example t is

    s(q, t) = ∇ℓ_qᵀ (F + λI)⁻¹ ∇ℓ_t,

with `ℓ_n` example n's own loss (no reduction factor; for sequences, the sum over its tokens),
gradients at the model's current parameters, and `F` the Fisher of the training set, the mean
over its N examples:

- `fisher="true"`: `F = (1/N) Σ_n E_ŷ[∇ℓ_n(ŷ) ∇ℓ_n(ŷ)ᵀ]` with labels ŷ sampled from the model
  (Monte Carlo, `mc_samples` per example);
- `fisher="type-2"`: the same expectation in closed form (the GGN of the mean loss);
- `fisher="empirical"`: `F = (1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ` with the data's labels.

The strategy approximates `F` (block diagonal over the parameters except "identity").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack.api import disable
from backpack.curvature._data import Normaliser, digest, first_tensor, trainable
from backpack.curvature._distributed import (
    all_sum,
    guarded,
    process_group,
    rank_of,
)
from backpack.curvature._fsdp import _Owned, is_fully_sharded, plain_zeros, reshard
from backpack.curvature._fsdp import _reduce_scatter as reduce_onto
from backpack.curvature._lent import kron_layer, kron_targets
from backpack.curvature._quantities import wide, wide_dtype
from backpack.curvature._rows import row_batches
from backpack.curvature._sweep import Sweep
from backpack.curvature.ekfac import EKFAC, EigenBlock, kfac_eigenblocks
from backpack.curvature.kfac import KFAC
from backpack.influence._lowrank import compress
from backpack.influence._scoring import (
    batch_scores,
    joined,
    query_rows,
    rank_errors,
    rank_weights,
    scores_to_disk,
)
from backpack.influence._sharded import (
    Placement,
    device_of,
    lent_blocks,
    place,
    placed,
    whole_blocks,
)
from backpack.influence._sites import (
    CHUNK_ENTRIES,
    Site,
    dense,
    norm_is_ghost,
    recorded_classes,
    site_batches,
    square_sum,
)
from backpack.influence._store import (
    cast_floats,
    is_block_folder,
    load_block_state,
    load_block_states,
    load_head,
    read_scores,
    save_blocks,
    tensor_hash,
)

__all__ = ["Influence", "fit", "load", "load_block", "read_scores", "STRATEGIES"]

STRATEGIES = ("identity", "diagonal", "kfac", "ekfac")
#: the operators' `fisher_type` of each `fisher`
_FISHERS = {"true": "mc", "type-2": "type-2", "empirical": "empirical"}
#: the heuristic damping: this times the mean eigenvalue of each block
HEURISTIC_DAMPING = 0.1
_FORMAT = 1


def _diagonal_blocks(
    sweep: Sweep, fisher: str, mc_samples: int, seed: int, folded: Mapping[str, str]
) -> tuple[list[EigenBlock], int, Placement | None]:
    """`diag F` (the mean over the examples) per parameter, from one sweep of rows.

    `folded`: `{weight: bias}` whose entries share one block (and one heuristic damping).

    Under torch.distributed (the sweep's group), the data is this rank's shard: the sums and
    counts of all ranks are added (one all-reduce) and sampled labels use `seed + rank`. On a
    model sharded with FSDP2 each block's sums go to its owner after every batch (`_sharded`).
    """
    params = sweep.trainable()
    if sweep.sharded:
        return _sharded_diagonal(sweep, fisher, mc_samples, seed, folded, params)
    group = sweep.group

    def zeros() -> dict[str, Tensor]:  # float64 sums: the same in any batch order
        return {
            n: wide(torch.zeros_like(p, memory_format=torch.contiguous_format)) for n, p in params
        }

    def local() -> tuple[dict[str, Tensor], int]:
        sums = zeros()
        count = 0
        for n, pairs in _diagonal_sums(sweep, fisher, mc_samples, seed + sweep.rank, params):
            count += n
            for name, value in pairs:
                sums[name] += value
        return sums, count

    done, error = guarded(group, local, "influence.fit")
    if group is None:
        sums, count = done
    else:
        sums = done[0] if done is not None else zeros()
        (total,) = all_sum(
            group,
            list(sums.values()),
            [done[1] if done is not None else 0],
            error,
            "influence.fit",
        )
        count = int(round(total))
    return _diagonal_result(params, sums, count, folded), count, None


def _sharded_diagonal(sweep, fisher, mc_samples, seed, folded, params):
    """`_diagonal_blocks` on an FSDP2 model: each block's sums reduced onto its owner."""
    names = [name for name, _ in params]
    biases = {b for w, b in folded.items() if w in names and b in names}
    members = {
        n: [n] + ([folded[n]] if folded.get(n) in biases else []) for n in names if n not in biases
    }
    numels = {n: p.numel() for n, p in params}
    sizes = {b: sum(numels[n] for n in group) for b, group in members.items()}
    placement = Placement.balanced(sizes, members, device_of(sweep.model))
    owner = {n: placement.owner[b] for b, group in members.items() for n in group}
    mine = placement.owned_names()
    sums = {  # float64 sums: the same in any batch order, and as one process's
        name: wide(plain_zeros(p)) if name in mine else torch.empty(p.shape, device="meta")
        for name, p in params
    }
    count = 0
    seed += placement.me
    for n, pairs in _diagonal_sums(sweep, fisher, mc_samples, seed, params):
        count += n
        for name, value in pairs:  # one parameter at a time: whole on its owner, in float64
            item = (
                _Owned(owner[name], tuple(value.shape), placement.world, wide_dtype(value)),
                value,
            )
            (reduced,) = reduce_onto(placement.group, [item], "reduce the diagonal")
            if name in mine:
                sums[name] += reduced.view(value.shape)
    (total,) = all_sum(placement.group, [], [count], None, "influence.fit")
    return _diagonal_result(params, sums, int(round(total)), folded), int(round(total)), placement


def _diagonal_sums(
    sweep: Sweep, fisher: str, mc_samples: int, seed: int, params
) -> Iterator[tuple[int, Iterator[tuple[str, Tensor]]]]:
    """Per batch: its number of examples and its sums of squared rows, parameter by parameter.

    Each batch's pairs must be consumed before the next batch is asked for.
    """
    devices = [p.device for _, p in params[:1] if p.device.type == "cuda"]
    kind = {"true": "mc", "type-2": "type-2", "empirical": "grad"}[fisher]
    if fisher == "empirical":  # the gradients' squares, from factors where they allow
        classes, _ = recorded_classes(sweep.model, False)
        for batch, sites in site_batches(sweep, classes, "diagonal"):
            yield batch.num_samples, ((name, square_sum(value)) for name, value in sites.items())
            del sites
        return
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for batch, rows, _ in row_batches(sweep, kind, mc_samples, "diagonal"):
            pairs = ((name, value.square().sum(0).detach()) for name, value in rows.items())
            yield batch.num_samples, pairs
            del rows


def _diagonal_result(params, sums, count, folded: Mapping[str, str]) -> list[EigenBlock]:
    """One diagonal block per parameter, or per weight with its bias (`folded`)."""
    shapes = {name: tuple(p.shape) for name, p in params}
    biases = {b for w, b in folded.items() if w in shapes and b in shapes}
    blocks = []
    # the means in the parameters' dtype (the sums are float64)
    means = {name: (sums[name] / count).detach().to(p.dtype) for name, p in params}
    for name, _ in params:
        if name in biases:
            continue
        values = means[name]
        bias = folded.get(name)
        if bias is None or bias not in shapes:
            blocks.append(EigenBlock(name, shapes[name], [], values.flatten(), False))
            continue
        # the weight's rows are its first axis, or its second (transformers' `Conv1D`)
        transposed = shapes[name][0] != shapes[bias][0]
        block = EigenBlock(name, shapes[name], [], values, transposed, bias)
        block.values = values.new_empty(block.rows, block.numel // block.rows)  # its coordinates
        flat = torch.cat([values.flatten(), means[bias].flatten()])
        block.values = block.to_own(flat[None])[0]
        blocks.append(block)
    return blocks


class Influence:
    """A fitted training-data attribution: scores query examples against training examples.

    Build it with `fit` (or `load`). `blocks` hold `F`'s approximation at the scale of the
    mean over the training examples, `damping` the λ of each block.

    Args:
        model: The model whose gradients are scored (`extend`-ed when scoring).
        lossfunc: The loss (torch loss module, reduction "mean" or "sum").
        strategy: "identity", "diagonal", "kfac" or "ekfac".
        blocks: One `EigenBlock` per trainable parameter (None for "identity").
        damping: `{parameter name: λ}` (None for "identity").
        info: Plain facts about the fit (fisher, number of samples, ...).
        normaliser: Custom `(output, y) -> ν_b`.
        num_samples: Custom `X -> number of samples`.
    """

    def __init__(
        self,
        model: nn.Module,
        lossfunc: Any,
        strategy: str,
        blocks: list[EigenBlock] | None = None,
        damping: Mapping[str, float] | None = None,
        info: Mapping[str, Any] | None = None,
        normaliser: Normaliser | None = None,
        num_samples: Callable[[Any], int] | None = None,
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
        # the model and loss whose gradients are scored (each call's data: `sweep.over`);
        # built here, which fails early on an unusable loss
        sweep = Sweep(
            model,
            lossfunc,
            None,
            normaliser=normaliser,
            num_samples=num_samples,
            distributed=False,
            what="backpack.influence",
        )
        placement = None
        if sweep.sharded:  # each block on one rank (whole blocks given: kept where owned)
            placement = place(sweep.model, blocks)
            blocks = placed(blocks, placement) if blocks is not None else None
        self._setup(sweep, strategy, blocks, damping, info, placement)

    @classmethod
    def _from_sweep(
        cls,
        sweep: Sweep,
        strategy: str,
        blocks: list[EigenBlock] | None,
        damping: Mapping[str, float] | None,
        info: Mapping[str, Any],
        placement: Placement | None = None,
    ) -> Influence:
        """The fit of `sweep`'s model and loss (`fit`'s own entry; arguments as above)."""
        out = cls.__new__(cls)
        local = sweep.replace(data=None, group=None, distributed=False, progress=False)
        out._setup(local, strategy, blocks, damping, info, placement)
        return out

    def _setup(
        self,
        sweep: Sweep,
        strategy: str,
        blocks: list[EigenBlock] | None,
        damping: Mapping[str, float] | None,
        info: Mapping[str, Any] | None,
        placement: Placement | None = None,
    ) -> None:
        params = sweep.trainable()
        if strategy != "identity":
            if blocks is None or damping is None:
                raise ValueError(f"strategy {strategy!r} needs blocks and damping.")
            names = [name for name, _ in params]
            covered = [n for b in blocks for n in b.names]
            if sorted(covered) != sorted(names) or len(set(covered)) != len(covered):
                raise ValueError(
                    "The model's trainable parameters are not those of the fit: "
                    f"{names} vs. {covered}."
                )
            shapes = {name: tuple(p.shape) for name, p in params}
            for b in blocks:
                expected = {b.name: tuple(b.shape)}
                if b.bias is not None:
                    expected[b.bias] = (b.rows,)
                for name, shape in expected.items():
                    if shapes[name] != shape:
                        raise ValueError(f"{name} has shape {shapes[name]}, the fit's has {shape}.")
        self.strategy = strategy
        self.blocks = blocks
        self.damping = dict(damping) if damping is not None else None
        self.info = dict(info or {})
        #: the model and loss whose gradients are scored (each call's data: `sweep.over`)
        self.sweep = sweep
        #: on a model sharded with FSDP2: the rank of each block (`_sharded`); else None
        self.placement = placement

    model = property(lambda self: self.sweep.model, doc="The model whose gradients are scored.")
    lossfunc = property(lambda self: self.sweep.lossfunc, doc="The loss.")
    normaliser = property(lambda self: self.sweep.normaliser, doc="Custom `(output, y) -> ν_b`.")
    num_samples = property(lambda self: self.sweep.num_samples, doc="Custom sample count.")

    # --- per-example gradients and the preconditioner ---------------------------------------
    def gradients(self, data: Iterable, progress: bool = False) -> Iterator[dict[str, Tensor]]:
        """Yield `{parameter name: [n_b, *shape]}`: each batch's gradients of its own losses."""
        for _, rows, _ in row_batches(self.sweep.over(data, progress), "grad", desc="gradients"):
            yield {name: value.detach() for name, value in rows.items()}

    def _scale(self, block: EigenBlock) -> Tensor:
        """`1 / (values + λ)`, and 0 where both vanish (a pseudo-inverse there)."""
        denominator = block.values + self.damping[block.name]
        positive = denominator > 0
        return torch.where(positive, 1 / torch.where(positive, denominator, 1), 0)

    def precondition(self, rows: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """`(F + λI)⁻¹ g` for gradients `{name: [K, *shape]}`; `{name: [K, numel]}` out."""
        if self.strategy == "identity":
            return {name: value.flatten(1) for name, value in rows.items()}
        out: dict[str, Tensor] = {}
        for b in self.blocks:
            out.update(b.scatter(b.apply(b.gather(rows), self._scale(b))))
        return out

    def _sites(
        self, data: Iterable, progress: bool, per_token: bool, factored: bool, desc: str, same=False
    ):
        """`site_batches` recording the layers that `per_token` / `factored` need."""
        classes: set[type] = set()
        if per_token or factored:
            classes, uncovered = recorded_classes(self.model, per_token)
            if uncovered:
                raise ValueError(
                    "per_token=True needs every trainable parameter in a layer with terms per "
                    f"position; not: {', '.join(uncovered)}. Freeze them "
                    "(requires_grad_(False)) or score whole sequences (per_token=False)."
                )
        return site_batches(self.sweep.over(data, progress), classes, desc, same)

    def _precondition_sites(
        self, sites: Mapping[str, list[Site]], block: EigenBlock
    ) -> dict[str, Tensor]:
        """`(F + λI)⁻¹ g` of one block, `{name: [N, numel]}`, a few samples at a time."""
        names = block.names
        n = sites[names[0]][0].num_samples
        numel = block.numel
        out = None
        step = max(1, CHUNK_ENTRIES // max(numel, 1))
        scale = self._scale(block)
        for start in range(0, n, step):
            stop = min(start + step, n)
            rows = {name: dense(sites[name], start, stop) for name in names}
            value = block.apply(block.gather(rows), scale)
            if out is None:
                out = value.new_empty(n, numel)
            out[start : start + value.shape[0]] = value
        return block.scatter(out)

    # --- scores ------------------------------------------------------------------------------
    def scores(
        self,
        query_data: Iterable,
        train_data: Iterable,
        progress: bool = False,
        per_token: bool = False,
        factored: bool = True,
        gather: bool = False,
        query_rank: int | None = None,
        per_module: bool = False,
        out_dir: Any = None,
        chunk_size: int = 16,
        dtype: torch.dtype | None = None,
        query_rank_norm: str = "fisher",
    ) -> Tensor | dict[str, Tensor]:
        """`[n_query, n_train]` influence scores `∇ℓ_qᵀ (F + λI)⁻¹ ∇ℓ_t`.

        The preconditioned query gradients are kept (`[n_query, P]`, or at rank `query_rank`);
        the training data are swept once, batch by batch (at most one batch's gradients at a
        time). For Linear-like layers (`nn.Linear`, Hugging Face's `Conv1D`) the products with
        a training batch are taken in the cheapest of three forms, by a count of multiply-adds
        per layer and batch (`_sites.pair_costs`): from the per-sample gradients, factored
        (`Σ_t b_tᵀ M_q a_t`, never forming them) or, for "identity", from Gram matrices of
        both sides' factors.

        Args:
            query_data: `(X, y)` batches of the query examples.
            train_data: `(X, y)` batches of the training examples.
            progress: Show progress bars (tqdm).
            per_token: Return `[n_query, n_train, T]`: the score of each query with each
                position t of each training sequence, `Σ_layers ⟨(F + λI)⁻¹ ∇ℓ_q, term_t⟩`
                with `term_t` the part of the training sequence's gradient that enters through
                position t (for `nn.Linear`: `b_t a_tᵀ`, output gradient times input). They sum
                over t to the sequence's score (kronfluence's per-token scores). Needs every
                trainable parameter in an `nn.Linear`, `Conv1D`, `nn.Embedding`,
                `nn.LayerNorm`, `nn.MultiheadAttention` (key and value terms: per position of
                the key/value input, which must then have T positions) or `nn.Conv1d/2d/3d`
                (terms per output position, flattened), and the same T in every layer and
                training batch (docs/influence.md).
            factored: False: always from per-sample gradients (every layer's `grad_batch`).
            gather: Under torch.distributed, where `train_data` is this rank's shard: every
                rank returns the whole matrix, the ranks' columns in rank order (a collective
                call). Without torch.distributed (or one process), the local scores.
            query_rank: Keep each query's preconditioned gradient of every matrix parameter
                (a weight `m × k`; a convolution's `C_out × C_in·prod(kernel)`) as its best
                rank-r approximation (in `query_rank_norm`), computed once per query batch; products
                with training gradients then use the factors (`Q N T r (m + k)` per Linear-like
                layer and batch). Biases and other one-axis parameters stay exact (kronfluence's
                `query_gradient_low_rank`; see `query_rank_error` for what it costs).
            query_rank_norm: What "best" rank r means: "fisher" (default) minimises the
                scores' expected squared error over the training gradients, with their
                second moment approximated per weight by a Kronecker product `G ⊗ A` from the
                fit (`‖G^{1/2} (M − M_r) A^{1/2}‖_F`; for "identity", and blocks without
                Kronecker or diagonal structure, the Frobenius norm); "frobenius" minimises
                `‖M − M_r‖_F` (a plain truncated SVD, kronfluence's criterion).
            per_module: Return `{module name: scores}`, the part of the scores from each
                module's own parameters (they sum to the scores).
            out_dir: Write the scores to this folder as they are computed, one plain tensor
                file per `chunk_size` training batches, with a manifest; a rerun with the same
                model, fit, queries and options resumes after the finished chunks (their
                batches are drawn from `train_data` but not run through the model) and other
                inputs are refused. Returns the whole result read back (`read_scores`).
            chunk_size: Training batches per chunk file (with `out_dir`).
            dtype: The dtype the scores are returned and stored in (computed in the
                parameters'); None: the parameters'.

        Raises:
            ValueError: For `per_token` on a model or data it does not apply to, a
                `query_rank` below 1, or an `out_dir` holding other inputs' scores.
        """
        if query_rank is not None and (int(query_rank) != query_rank or query_rank < 1):
            raise ValueError(f"query_rank must be a positive integer, got {query_rank}.")
        if query_rank_norm not in ("fisher", "frobenius"):
            raise ValueError(
                f"query_rank_norm must be 'fisher' or 'frobenius', got {query_rank_norm!r}."
            )
        if gather:
            if out_dir is not None or per_module:
                raise ValueError(
                    "gather=True takes neither out_dir nor per_module: write each rank's columns "
                    "to its own out_dir, or gather the total scores."
                )
            return _gathered(
                lambda: self.scores(
                    query_data,
                    train_data,
                    progress,
                    per_token,
                    factored,
                    query_rank=query_rank,
                    dtype=dtype,
                    query_rank_norm=query_rank_norm,
                ),
                1,
                "influence.scores(..., gather=True)",
            )
        query, n_query, ghost = query_rows(
            self, query_data, progress, factored, query_rank, query_rank_norm
        )
        if out_dir is not None:
            options = {
                "per_token": per_token,
                "per_module": per_module,
                "query_rank": query_rank,
                "query_rank_norm": query_rank_norm if query_rank is not None else None,
                "dtype": str(dtype),
                "n_query": n_query,
            }
            key = tensor_hash(
                _FORMAT,
                self.strategy,
                self.damping,
                self.info,
                [b.state() for b in self.blocks] if self.blocks is not None else None,
                self.model.state_dict(),
                dict(query),
                dict(options),
            )
            if self.placement is not None:  # every rank's shards and blocks: one key
                keys = [None] * self.placement.world
                dist.all_gather_object(keys, key, group=self.placement.group)
                key = tensor_hash(keys)
            return scores_to_disk(
                self,
                key,
                query,
                n_query,
                ghost,
                train_data,
                progress,
                per_token,
                factored,
                per_module,
                out_dir,
                chunk_size,
                dtype,
                options,
            )
        columns = []
        length: list[int | None] = [None]
        for _, sites in self._sites(train_data, progress, per_token, factored, "gradients"):
            columns.append(
                batch_scores(
                    query, n_query, ghost, sites, per_token, per_module, length, self.placement
                )
            )
            del sites
        return joined(columns, n_query, per_module, dtype)

    def query_rank_error(
        self,
        query_data: Iterable,
        train_data: Iterable,
        ranks: Iterable[int],
        progress: bool = False,
        query_rank_norm: str = "fisher",
    ) -> dict[int, float]:
        """`{r: ‖S_r − S‖_F / ‖S‖_F}`: what `scores(..., query_rank=r)` costs on these data.

        `S` are the full scores, `S_r` those of the rank-r query gradients (truncated in
        `query_rank_norm`, see `scores`), all from one sweep over `train_data` (a sample of the
        training set is enough to choose r).
        """
        full, n_query, ghost = query_rows(self, query_data, progress, True)
        shapes = {name: tuple(p.shape) for name, p in self.sweep.trainable()}
        ranks = sorted({int(r) for r in ranks})
        if not ranks or ranks[0] < 1:
            raise ValueError(f"ranks must be positive integers, got {ranks}.")
        if query_rank_norm not in ("fisher", "frobenius"):
            raise ValueError(
                f"query_rank_norm must be 'fisher' or 'frobenius', got {query_rank_norm!r}."
            )
        weights = rank_weights(self.blocks, shapes) if query_rank_norm == "fisher" else {}
        low = {
            r: {n: compress(v, shapes[n], r, weights.get(n)) for n, v in full.items()}
            for r in ranks
        }
        return rank_errors(self, full, low, n_query, ghost, train_data, progress)

    def self_scores(
        self,
        train_data: Iterable,
        progress: bool = False,
        factored: bool = True,
        gather: bool = False,
    ) -> Tensor:
        """`[n_train]` self-influence `∇ℓ_tᵀ (F + λI)⁻¹ ∇ℓ_t`, batch by batch.

        For "identity", a Linear-like layer's squared norms come from Gram matrices of its
        factors where that is cheaper (`T² (in + out) < T in out`), as `BatchL2Grad` does.
        `gather=True`: every rank gets all ranks' entries in rank order (see `scores`).
        """
        if gather:
            return _gathered(
                lambda: self.self_scores(train_data, progress, factored),
                0,
                "influence.self_scores(..., gather=True)",
            )
        out = []
        for _, sites in self._sites(train_data, progress, False, factored, "gradients"):
            if self.strategy == "identity":
                total = 0.0
                for value in sites.values():
                    if len(value) == 1 and value[0].kind == "outer" and norm_is_ghost(value[0]):
                        total = total + value[0].ghost_norms()
                    else:
                        total = total + dense(value).flatten(1).square().sum(1)
                out.append(total)
            else:
                blocks = zip(self.blocks, map(self._scale, self.blocks))
                if self.placement is not None:  # each block lent by its owner in turn
                    blocks = lent_blocks(self.blocks, self._scale, self.placement)
                out.append(
                    sum(
                        b.quadratic(b.gather({n: dense(sites[n]) for n in b.names}), v)
                        for b, v in blocks
                    )
                )
        return torch.cat(out)

    # --- persistence -------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The fit as plain tensors, numbers and strings (what `save` writes).

        On an FSDP2 model a collective: every rank gets every block whole.
        """
        blocks = self.blocks
        if blocks is not None and self.placement is not None:
            blocks = whole_blocks(blocks, self.placement)
        return {
            "format": _FORMAT,
            "strategy": self.strategy,
            "blocks": [b.state() for b in blocks] if blocks is not None else None,
            "damping": self.damping,
            "info": self.info,
        }

    def save(self, path: Any, dtype: torch.dtype | None = None, per_module: bool = False) -> None:
        """`torch.save` the fit (plain tensors: `load` reads it with `weights_only=True`).

        Args:
            path: The file, or with `per_module=True` the folder.
            dtype: Store the eigenvectors and eigenvalues in this dtype (e.g. `torch.bfloat16`
                to halve them; `load` casts them back to the parameters' dtype); None: as they
                are (the parameters' dtype).
            per_module: Write a folder with `fit.pt` and one file per block (a parameter, or a
                layer with a folded bias) under `blocks/`, each loadable on its own
                (`load_block`).

        On an FSDP2 model a collective on one shared `path`: each rank writes its own blocks'
        files (`per_module=True`), or rank 0 the file, getting the blocks one at a time.
        """
        if self.placement is not None:
            _save_sharded(self, path, dtype, per_module)
            return
        state = self.state()
        if dtype is not None:
            _check_storable(self, dtype)
            state["blocks"] = [_stored(b, dtype) for b in state["blocks"] or []] or None
        if per_module:
            save_blocks(path, state)
        else:
            torch.save(state, path)

    @classmethod
    def load(
        cls,
        path: Any,
        model: nn.Module,
        lossfunc: Any,
        normaliser: Normaliser | None = None,
        num_samples: Callable[[Any], int] | None = None,
    ) -> Influence:
        """A fit saved with `save` (a file or a per-module folder), for `model` and `lossfunc`.

        The model must have the fit's trainable parameters; stored tensors are cast to the
        dtype of its parameters.

        Raises:
            ValueError: For another format, or parameters that differ from the fit's.
        """
        device, dtype = next((p.device, p.dtype) for _, p in trainable(model))
        if is_block_folder(path):
            state = load_head(path, device)
            keep = None
            if is_fully_sharded(model):  # only this rank's blocks, by the ctor's placement

                def keep(states: list[dict[str, Any]]) -> list[bool]:
                    shapes = [EigenBlock.from_state(_restored(b, dtype)) for b in states]
                    placement = place(model, shapes)
                    return [placement.owns(b.name) for b in shapes]

            state["blocks"] = load_block_states(path, device, keep)
        else:
            state = torch.load(path, map_location=device, weights_only=True)
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"{path} does not hold an influence fit (format {_FORMAT}).")
        blocks = state["blocks"]
        if blocks is not None:  # stored in another dtype: the model's
            blocks = [_restored(b, dtype) for b in blocks]
        return cls(
            model,
            lossfunc,
            state["strategy"],
            [EigenBlock.from_state(b) for b in blocks] if blocks is not None else None,
            state["damping"],
            state["info"],
            normaliser,
            num_samples,
        )

    def __repr__(self) -> str:
        return f"Influence(strategy={self.strategy!r}, info={self.info})"


def _save_sharded(influence: Influence, path: Any, dtype: torch.dtype | None, per_module: bool):
    """`Influence.save` of an FSDP2 fit (see there); errors on one rank reach every rank."""
    placement, blocks = influence.placement, influence.blocks
    what = "Influence.save"
    _, error = guarded(placement.group, lambda: dtype and _check_storable(influence, dtype), what)
    all_sum(placement.group, [], [], error, what)

    def stored(b: EigenBlock) -> dict[str, Any]:
        return _stored(b.state(), dtype) if dtype is not None else b.state()

    head = {
        "format": _FORMAT,
        "strategy": influence.strategy,
        "damping": influence.damping,
        "info": influence.info,
    }

    def write() -> None:
        if per_module:
            states = (
                None
                if blocks is None
                else [stored(b) if placement.owns(b.name) else {"name": b.name} for b in blocks]
            )
            save_blocks(path, {**head, "blocks": states}, placement.owns, placement.me == 0)
            return
        first = placement.me == 0
        whole = whole_blocks(blocks, placement, keep=first) if blocks is not None else None
        if first:
            torch.save(
                {**head, "blocks": None if whole is None else [stored(b) for b in whole]}, path
            )

    _, error = guarded(placement.group, write, what)
    all_sum(placement.group, [], [], error, what)


def _check_storable(influence: Influence, dtype: torch.dtype) -> None:
    """Refuse a storage dtype that changes a block's `1 / (values + λ)` beyond its rounding.

    The eigenvalues are stored divided by a power of two near their largest (`_stored`).
    Rounding to `dtype` changes each by at most half its unit in the last place, so the
    damped inverse by less than `eps(dtype)` relative: more (an eigenvalue that underflows
    while it still matters next to λ: float16's narrow range) is refused. Eigenvectors
    (entries of at most 1 in magnitude) only round.
    """
    if influence.blocks is None:
        return
    eps = torch.finfo(dtype).eps
    for b in influence.blocks:
        if b.values.device.type == "meta":  # another rank's block (FSDP2): checked there
            continue
        scale = _power_of_two(b.values)
        values = (b.values / scale).to(dtype).to(b.values) * scale
        rounded = EigenBlock(b.name, b.shape, [], values, False)
        rounded.bias = b.bias
        before, after = influence._scale(b), influence._scale(rounded)
        error = float(((after - before).abs() / before.abs().clamp_min(1e-300)).max())
        if not error <= eps:
            raise ValueError(
                f"Storing the fit in {dtype} changes block {b.name}'s damped inverse by "
                f"{error:.2g} relative (its eigenvalues leave {dtype}'s range); store it in "
                "torch.bfloat16 (float32's range) or float32."
            )


def _damping(
    blocks: list[EigenBlock],
    damping: float | Mapping[str, float] | None,
    placement: Placement | None = None,
) -> dict[str, float]:
    """λ per block: the heuristic (None), one value, or `{block name: λ}`.

    On an FSDP2 fit the owners compute the heuristic of their blocks, and every rank gets all.
    """
    if damping is None:
        if placement is None:
            return {b.name: HEURISTIC_DAMPING * float(b.values.mean()) for b in blocks}
        local = [
            HEURISTIC_DAMPING * float(b.values.mean()) if placement.owns(b.name) else 0.0
            for b in blocks
        ]
        values = all_sum(placement.group, [], local, None, "influence.fit")
        return {b.name: value for b, value in zip(blocks, values)}
    if isinstance(damping, Mapping):
        missing = [b.name for b in blocks if b.name not in damping]
        if missing:
            raise ValueError(f"damping has no value for the blocks {missing}.")
        return {b.name: float(damping[b.name]) for b in blocks}
    return {b.name: float(damping) for b in blocks}


def _positions(sweep: Sweep, blocks: list[EigenBlock]) -> dict[str, int]:
    """`{block name: T}`: the output positions per example of each Kronecker block's layer.

    For the blocks of `nn.Linear` (and `Conv1D`) layers and convolutions, from one forward of
    the sweep's first batch: the layer's output entries per example over its output features
    (a Linear layer on `[N, T, in]`: T; a convolution: its output positions). Other blocks: 1.
    """
    model, X = sweep.model, sweep.first_inputs()
    modules = dict(model.named_modules())
    layers = {}
    for b in blocks:
        owner = modules.get(b.name.rpartition(".")[0])
        if len(b.vectors) == 2 and owner is not None and kron_layer(owner):
            layers.setdefault(owner, []).append(b)
    sizes: dict[nn.Module, int] = {}

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        out = first_tensor(output)
        sizes[module] = sizes.get(module, 0) + (out.numel() if out is not None else 0)

    handles = [m.register_forward_hook(hook) for m in layers]
    try:
        with torch.no_grad(), disable():
            model(X)
    finally:
        for handle in handles:
            handle.remove()
        reshard(model)  # FSDP2 keeps the root gathered after a forward without a backward
    n = sweep.samples(X)
    out = {b.name: 1 for b in blocks}
    for module, members in layers.items():
        for b in members:
            out[b.name] = max(1, sizes.get(module, 0) // (n * b.rows))
    return out


def fit(
    model: nn.Module,
    lossfunc: Any,
    train_data: Iterable,
    strategy: str = "ekfac",
    damping: float | Mapping[str, float] | None = None,
    fisher: str = "true",
    mc_samples: int = 1,
    seed: int = 0,
    kfac_approx: str = "expand",
    progress: bool = False,
    normaliser: Normaliser | None = None,
    num_samples: Callable[[Any], int] | None = None,
    distributed: bool | None = None,
    separate_weight_and_bias: bool = True,
    kfac_positions: str = "sum",
) -> Influence:
    """Fit the curvature approximation of `strategy` to the training data (once).

    Args:
        model: The trained model (`extend`-ed here); put it in `eval()` mode if it has dropout
            or batch normalisation.
        lossfunc: The training loss (torch loss module, reduction "mean" or "sum").
        train_data: Re-iterable `(X, y)` batches of the training set.
        strategy: How `F` is approximated: "identity" (`F + λI` replaced by `I`: plain
            gradient dot products, no fit), "diagonal" (`diag F`), "kfac" (`G ⊗ A` per
            parameter) or "ekfac" (KFAC's eigenbasis with `F`'s own eigenvalues in it).
        damping: λ for every block, or `{block name: λ}` per block (a block's name is its
            parameter's; the weight's for a folded bias); None: per block, `0.1 ×` the mean of
            its eigenvalues (for "diagonal": of its diagonal entries). Directions where both the
            approximation and λ vanish are left out (a pseudo-inverse).
        fisher: "true" (labels sampled from the model), "type-2" (its exact expectation, the
            GGN) or "empirical" (the data's labels).
        mc_samples: Sampled labels per example for "true".
        seed: Seed of the sampled labels (the global RNG is forked, not advanced).
        kfac_approx: "expand" or "reduce", the Kronecker factors' convention for weights shared
            over positions.
        progress: Show progress bars (tqdm).
        normaliser: Custom `(output, y) -> ν_b`.
        num_samples: Custom `X -> number of samples`.
        distributed: Under torch.distributed, `train_data` is this rank's shard of the
            training set and every rank gets the fit of the whole set (None: whenever
            torch.distributed runs with more than one process; a collective call then). Each
            rank's `scores(query_data, train_data)` are then the columns of its own shard.
        separate_weight_and_bias: False folds the bias of an `nn.Linear`, `Conv1D` or
            convolution into its weight's block: for "kfac" and "ekfac" one Kronecker block per
            layer (the K-FAC papers' and kronfluence's, see `KFAC`), for "diagonal" one block
            per layer as far as the heuristic damping goes (kronfluence's mean per module).
        kfac_positions: For "kfac": "sum" (default) takes `F` per example, summed over a
            layer's positions (the published "expand" definition); "mean" divides the block of
            every `nn.Linear`/`Conv1D` layer and convolution by its number of output positions
            T (a sequence's tokens, a convolution's output pixels), kronfluence's covariances
            averaged over all positions. With `damping=None` the heuristic λ scales along.

    Returns:
        An `Influence` with `scores`, `self_scores`, `save`.

    Cost: "identity" none; "diagonal" one sweep (one backward per batch); "kfac" one sweep and
    the factors' eigendecompositions; "ekfac" those and one more sweep for the corrected
    eigenvalues.

    Raises:
        ValueError: For an unknown strategy or fisher, or a negative damping.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if fisher not in _FISHERS:
        raise ValueError(f"fisher must be one of {tuple(_FISHERS)}, got {fisher!r}.")
    values = damping.values() if isinstance(damping, Mapping) else [damping]
    if any(v is not None and v < 0 for v in values):
        raise ValueError(f"damping must be non-negative, got {damping}.")
    if kfac_positions not in ("sum", "mean"):
        raise ValueError(f"kfac_positions must be 'sum' or 'mean', got {kfac_positions!r}.")
    info: dict[str, Any] = {
        "fisher": fisher,
        "kfac_approx": kfac_approx,
        "separate_weight_and_bias": separate_weight_and_bias,
        "kfac_positions": kfac_positions,
    }
    if strategy == "identity":
        return Influence(
            model, lossfunc, strategy, info=info, normaliser=normaliser, num_samples=num_samples
        )
    sweep = Sweep(
        model,
        lossfunc,
        train_data,
        progress=progress,
        normaliser=normaliser,
        num_samples=num_samples,
        distributed=distributed,
        what="influence.fit",
    )
    if strategy == "diagonal":
        folded = {} if separate_weight_and_bias else kron_targets(sweep.model, "", False)[1]
        blocks, count, placement = _diagonal_blocks(sweep, fisher, mc_samples, seed, folded)
    else:
        operator_args = dict(
            fisher_type=_FISHERS[fisher],
            kfac_approx=kfac_approx,
            mc_samples=mc_samples,
            seed=seed,
            separate_weight_and_bias=separate_weight_and_bias,
        )
        if strategy == "kfac":
            op = KFAC._from_sweep(sweep, **operator_args)
            blocks = kfac_eigenblocks(op)
        else:
            op = EKFAC._from_sweep(sweep, **operator_args)
            blocks = op.blocks
        count = op.num_samples_total
        placement = None
        if op.owners is not None:  # FSDP2: each block on its factors' owner
            members = {b.name: b.names for b in blocks}
            placement = Placement(op.owners, members, device_of(sweep.model))
        # the operators' scale is the data-set loss's (R Σ_n); F is the mean over examples
        factor = op.normaliser_total / count
        scale = dict.fromkeys([b.name for b in blocks], factor)
        if strategy == "kfac" and kfac_positions == "mean":
            for name, t in _positions(sweep, blocks).items():
                scale[name] = factor / t
        blocks = [
            EigenBlock(b.name, b.shape, b.vectors, b.values * scale[b.name], b.transposed, b.bias)
            for b in blocks
        ]
    info["num_samples"] = count
    damping_of = _damping(blocks, damping, placement)
    return Influence._from_sweep(sweep, strategy, blocks, damping_of, info, placement)


def load(
    path: Any,
    model: nn.Module,
    lossfunc: Any,
    normaliser: Normaliser | None = None,
    num_samples: Callable[[Any], int] | None = None,
) -> Influence:
    """`Influence.load`: a fit saved with `Influence.save`, for `model` and `lossfunc`."""
    return Influence.load(path, model, lossfunc, normaliser, num_samples)


def load_block(path: Any, name: str, dtype: torch.dtype | None = None) -> EigenBlock:
    """One block of a fit saved with `save(path, per_module=True)`, by its name, on the CPU.

    `name`: the block's parameter name (the weight's for a folded bias); `dtype`: cast to it
    (None: as stored, float32 for a half-precision file).
    """
    state = load_block_state(path, name)
    if dtype is None:
        dtype = state["values"].dtype
        dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return EigenBlock.from_state(_restored(state, dtype))


def _power_of_two(values: Tensor) -> float:
    """A power of two near `max |values|` (1 for zeros): dividing by it is exact."""
    top = float(values.abs().max()) if values.numel() else 0.0
    return 2.0 ** round(math.log2(top)) if top > 0 and math.isfinite(top) else 1.0


def _stored(block: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """A block's state in `dtype`, its eigenvalues divided by `values_scale` (a power of two).

    float16's range is narrow (6e-8 to 65504): eigenvalues of a Fisher (often ~1e-6 and below)
    would underflow unscaled.
    """
    scale = _power_of_two(block["values"])
    out = cast_floats({**block, "values": block["values"] / scale}, dtype)
    out["values_scale"] = scale
    return out


def _restored(block: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Inverse of `_stored` (any block state), the tensors in `dtype`."""
    out = cast_floats(dict(block), dtype)
    scale = out.pop("values_scale", None)
    if scale is not None:
        out["values"] = out["values"] * scale
    return out


def _gathered(local: Callable[[], Tensor], dim: int, what: str) -> Tensor:
    """`local()` on every rank, concatenated along `dim` in rank order, on every rank.

    The columns are exchanged with one sum of a zero-padded `[.., n_total, ..]` tensor (each rank
    writes its own slice), after agreeing on the sizes and on the other dimensions.
    """
    group = process_group(None, what)
    done, error = guarded(group, local, what)
    if group is None:
        return done
    world, rank = dist.get_world_size(group), rank_of(group)
    sizes = [0.0] * world
    other: list[float] = [0.0, 0.0]
    if done is not None:
        sizes[rank] = float(done.shape[dim])
        rest = done.shape[:dim] + done.shape[dim + 1 :]
        other = [digest((tuple(rest), str(done.dtype))), 1.0]
    head = all_sum(group, [], [*sizes, *other], error, what)
    sizes, (key, agreed) = [int(n) for n in head[:world]], head[world:]
    if int(agreed) != world or abs(key - world * other[0]) > 0.5:
        raise RuntimeError(
            f"{what}: the ranks' scores differ in their other dimensions or dtype (the same "
            "query data and model on every rank, and for per_token the same T, are needed)."
        )
    shape = list(done.shape)
    shape[dim] = sum(sizes)
    full = done.new_zeros(shape)
    full.narrow(dim, sum(sizes[:rank]), sizes[rank]).copy_(done)
    all_sum(group, [full], [], None, what)
    return full
