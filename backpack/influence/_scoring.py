"""Scores of training batches against preconditioned queries: in memory, on disk, errors.

The per-batch arithmetic of `Influence.scores` and `Influence.query_rank_error`, and the
chunked, resumable sweep behind `scores(..., out_dir=...)`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from backpack.curvature._distributed import all_sum
from backpack.curvature._fsdp import agree_done
from backpack.influence._lowrank import LowRank, compress, concat, fisher_weights
from backpack.influence._sites import Site, choose, dense
from backpack.influence._store import ScoreChunks, batch_digest, read_scores


def batch_scores(
    query: Mapping[str, Tensor | LowRank],
    n_query: int,
    ghost: Mapping[str, Site | None],
    sites: Mapping[str, list[Site]],
    per_token: bool,
    per_module: bool,
    length: list[int | None],
    placement: Any = None,
) -> dict[str, Tensor]:
    """One training batch's scores, `{module name: ...}` (per_module) or `{"": ...}`.

    `length`: the positions T seen so far (per_token), updated in place. With a `placement`
    (an FSDP2 fit, `_sharded`), `query` and `ghost` hold this rank's blocks only: each block's
    are lent by its owner in turn.
    """
    totals: dict[str, Tensor] = {}
    if placement is not None:
        error = None
        try:  # a rank's error here must not leave the others waiting for a lent block
            if per_token:
                _check_positions(sites, length)
        except ValueError as err:
            error = err
        agree_done(error, "backpack.influence")
        for block, names in placement.members.items():
            mine = None
            if placement.owns(block):
                mine = ({n: query[n] for n in names}, {n: ghost.get(n) for n in names})
            lent, lent_ghost = placement.lend(block, mine)
            picked = {n: sites[n] for n in names}
            part = batch_scores(lent, n_query, lent_ghost, picked, per_token, per_module, length)
            del lent, lent_ghost
            for key, value in part.items():
                totals[key] = value if key not in totals else totals[key] + value
        return totals
    if per_token:
        _check_positions(sites, length)
    for name, value in sites.items():
        M = query[name]
        if isinstance(M, LowRank):
            part = M.products(value, per_token)
        elif per_token:
            part = sum(site.token_products(M.reshape(n_query, *site.shape)) for site in value)
        else:
            part = pair_products(name, value, M, n_query, ghost)
        key = name.rpartition(".")[0] if per_module else ""
        totals[key] = part if key not in totals else totals[key] + part
    return totals


def _check_positions(sites: Mapping[str, list[Site]], length: list[int | None]) -> None:
    """Refuse sites without terms per position, or with another T than seen so far."""
    for name, value in sites.items():
        for site in value:
            if site.kind == "sample":
                raise ValueError(
                    f"per_token=True: {name} has no terms per position (its module "
                    "was not called as a layer of its own). Freeze it or use "
                    "per_token=False."
                )
            if length[0] is None:
                length[0] = site.positions
            if site.positions != length[0]:
                raise ValueError(
                    f"per_token=True needs one sequence length T in every layer and "
                    f"batch; {name} has {site.positions} positions, others "
                    f"{length[0]}. Pad the sequences (ignored targets) to one length "
                    "(a convolution's positions are its output positions: keep "
                    "its output as long as the sequence, e.g. stride 1 and "
                    "causal or 'same' padding)."
                )


def query_rows(
    influence: Any,
    query_data: Iterable,
    progress: bool,
    factored: bool,
    rank: int | None = None,
    norm: str = "fisher",
) -> tuple[dict[str, Tensor | LowRank], int, dict[str, Site | None]]:
    """Preconditioned query gradients `{name: [Q, numel]}`, Q, and the ghost factors.

    The factors (for "identity" only) are those of single-call Linear-like parameters.
    `rank`: matrix parameters' gradients truncated to that rank in the norm `norm`, batch by
    batch (`LowRank`). On an FSDP2 fit (`influence.placement`) every rank runs the same query
    batches and keeps the rows of its own blocks only.
    """
    shapes = {name: tuple(p.shape) for name, p in influence.sweep.trainable()}
    weights = (
        rank_weights(influence.blocks, shapes) if rank is not None and norm == "fisher" else {}
    )
    placement = influence.placement
    mine = placement.owned_names() if placement is not None else set(shapes)
    blocks = [b for b in influence.blocks or [] if b.name in mine]
    pieces: dict[str, list[Tensor | LowRank]] = {}
    factors: dict[str, list[Site] | None] = {}
    n_query = 0
    data = influence._sites(query_data, progress, False, factored, "query gradients", same=True)
    for batch, sites in data:
        n_query += batch.num_samples
        sites = {name: value for name, value in sites.items() if name in mine}
        if influence.blocks is None:  # identity
            for name, value in sites.items():
                pieces.setdefault(name, []).append(dense(value).reshape(batch.num_samples, -1))
        else:
            for block in blocks:
                for name, value in influence._precondition_sites(sites, block).items():
                    pieces.setdefault(name, []).append(value)
        if rank is not None:  # this batch's rows at rank `rank`, before the next batch
            for name, values in pieces.items():
                values[-1] = compress(values[-1], shapes[name], rank, weights.get(name))
        for name, value in sites.items():
            keep = influence.strategy == "identity" and len(value) == 1 and value[0].kind == "outer"
            if not keep:
                factors[name] = None
            elif factors.setdefault(name, []) is not None:
                factors[name].append(value[0])
        del sites
    merged = {}
    for name in list(pieces):  # one parameter's copy at a time
        values = pieces.pop(name)
        merged[name] = concat(values)
        del values
    ghost: dict[str, Site | None] = {}
    for name, value in factors.items():
        same = value is not None and len({s.positions for s in value}) == 1
        same = same and not isinstance(merged[name], LowRank)
        ghost[name] = (
            Site(
                "outer",
                value[0].shape,
                torch.cat([s.left for s in value]),
                torch.cat([s.right for s in value]),
            )
            if same
            else None
        )
    return merged, n_query, ghost


def rank_weights(blocks: list[Any] | None, shapes: Mapping[str, tuple]) -> dict[str, Any]:
    """`{weight name: fisher_weights}` of the blocks with Kronecker or diagonal structure.

    Blocks this rank does not hold (meta placeholders of an FSDP2 fit) are left out.
    """
    if blocks is None:
        return {}
    out = {}
    for b in blocks:
        if b.values.device.type == "meta":
            continue
        found = fisher_weights(b, shapes[b.name])
        if found is not None:
            out[b.name] = found
    return out


def pair_products(
    name: str, value: list[Site], M: Tensor, n_query: int, ghost: Mapping[str, Site | None]
) -> Tensor:
    """`[Q, N]` products of a parameter's full query rows with its training sites."""
    if len(value) == 1 and value[0].kind == "outer":
        site = value[0]
        q_site = ghost.get(name)
        how = choose(site, n_query, q_site.positions if q_site is not None else None)
        if how == "ghost":
            return site.ghost_products(q_site)
        if how == "factored":
            return site.token_products(M.reshape(n_query, *site.shape)).sum(-1)
    return M @ dense(value).flatten(1).T


def joined(
    columns: list[dict[str, Tensor]], n_query: int, per_module: bool, dtype: torch.dtype | None
) -> Tensor | dict[str, Tensor]:
    """The batches' scores side by side (per module, or the total), in `dtype`."""
    if not columns:
        return torch.zeros(n_query, 0, dtype=dtype)
    out = {}
    for key in columns[0]:
        value = torch.cat([c[key] for c in columns], dim=1)
        stored = value.to(dtype or value.dtype)
        if not torch.equal(stored.isfinite(), value.isfinite()):
            raise ValueError(
                f"Scores of magnitude up to {float(value.abs().max()):.3g} overflow {dtype}; "
                "use dtype=torch.bfloat16 (float32's range) or float32."
            )
        out[key] = stored
    return out if per_module else out[""]


def scores_to_disk(
    influence: Any,
    key: str,
    query: Mapping[str, Tensor | LowRank],
    n_query: int,
    ghost: Mapping[str, Site | None],
    train_data: Iterable,
    progress: bool,
    per_token: bool,
    factored: bool,
    per_module: bool,
    out_dir: Any,
    chunk_size: int,
    dtype: torch.dtype | None,
    options: Mapping[str, Any],
) -> Tensor | dict[str, Tensor]:
    """`influence.scores` written chunk by chunk to `out_dir`.

    A manifest there with the fingerprint `key` resumes the sweep after its finished chunks.
    """
    store = ScoreChunks(out_dir, key, chunk_size, options)
    if store.manifest["complete"]:
        return read_scores(out_dir)
    chunk_size = store.chunk_size
    waiting: deque[tuple[int, str]] = deque()
    seen = [0]

    def pending() -> Iterator[Any]:
        """The batches of unfinished chunks; those of finished ones are checked, skipped."""
        skipped: tuple[int, list[str]] | None = None
        for i, batch in enumerate(train_data):
            chunk = i // chunk_size
            if skipped is not None and skipped[0] != chunk:
                store.check(*skipped)
                skipped = None
            seen[0] = i + 1
            digest_of = batch_digest(batch)
            if store.done(chunk):
                skipped = skipped or (chunk, [])
                skipped[1].append(digest_of)
                continue
            waiting.append((i, digest_of))
            yield batch
        if skipped is not None:
            store.check(*skipped)

    batches = pending()
    first = next(batches, None)
    if first is not None:
        buffer: list[dict[str, Tensor]] = []
        digests: list[str] = []
        length: list[int | None] = [None]
        chunk = 0
        data = itertools.chain([first], batches)
        for _, sites in influence._sites(data, progress, per_token, factored, "gradients"):
            i, digest_of = waiting.popleft()
            chunk = i // chunk_size
            part = batch_scores(
                query, n_query, ghost, sites, per_token, per_module, length, influence.placement
            )
            buffer.append(part)
            digests.append(digest_of)
            del sites
            if len(buffer) == chunk_size:
                store.write(chunk, joined(buffer, n_query, per_module, dtype), digests)
                buffer, digests = [], []
        if buffer:
            store.write(chunk, joined(buffer, n_query, per_module, dtype), digests)
    store.finish(seen[0])
    return read_scores(out_dir)


def rank_errors(
    influence: Any,
    full: Mapping[str, Tensor],
    low: Mapping[int, Mapping[str, Any]],
    n_query: int,
    ghost: Mapping[str, Site | None],
    train_data: Iterable,
    progress: bool,
) -> dict[int, float]:
    """`{r: ‖S_r − S‖_F / ‖S‖_F}` of the rank-r queries `low[r]` against `full`, one sweep."""
    ranks = sorted(low)
    errors = dict.fromkeys(ranks, 0.0)
    norm = 0.0
    length: list[int | None] = [None]
    for _, sites in influence._sites(train_data, progress, False, True, "gradients"):
        where = influence.placement
        exact = batch_scores(full, n_query, ghost, sites, False, False, length, where)[""]
        norm += float(exact.double().square().sum())
        for r in ranks:
            approx = batch_scores(low[r], n_query, {}, sites, False, False, length, where)[""]
            errors[r] += float((approx - exact).double().square().sum())
        del sites
    if influence.placement is not None:  # every rank's shard of the training set
        what = "influence.query_rank_error"
        sums = all_sum(
            influence.placement.group, [], [norm, *(errors[r] for r in ranks)], None, what
        )
        norm, errors = sums[0], dict(zip(ranks, sums[1:]))
    return {r: (errors[r] / norm) ** 0.5 if norm > 0 else 0.0 for r in ranks}
