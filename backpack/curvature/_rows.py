"""Rows of a data set, batch by batch: per-sample gradients or square-root factors of the Fisher.

A row is a vector over the parameters; a batch gives a few of them and the sum of their outer
products over the data set is the curvature at the scale of `reduction="sum"`:

- `"grad"`: each sample's gradient of its own loss (`BatchGrad`, times `ν_b` for "mean"), so
  `Σ rows rowsᵀ = Σ_n ∇ℓ_n ∇ℓ_nᵀ` (the empirical Fisher without the reduction factor);
- `"type-2"`: the exact loss-Hessian square roots (`SqrtGGNExact`, times `√ν_b`), summing to the
  GGN of the summed losses;
- `"mc"`: gradients with sampled labels (`SqrtGGNMC`, times `√ν_b`), summing to a Monte-Carlo
  estimate of it (the "true" Fisher).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from backpack.api import backpack
from backpack.curvature._data import Batch, first_tensor
from backpack.curvature._fsdp import batch_results, landing, plain_zeros
from backpack.curvature._sweep import Sweep
from backpack.extensions import BatchGrad, SqrtGGNExact, SqrtGGNMC

KINDS = ("grad", "type-2", "mc")


def row_batches(
    sweep: Sweep, kind: str = "grad", mc_samples: int = 1, desc: str = "rows"
) -> Iterator[tuple[Batch, dict[str, Tensor], float]]:
    """Yield `(batch, {name: rows [R_b, *shape]}, ν_b)` for every batch of the `Sweep`.

    The rows are at the scale of `reduction="sum"` (see the module docstring). For `"grad"`,
    `R_b` is the batch's number of samples, row n the gradient of sample n's own loss. A batch
    without loss terms (all targets ignored) gives zero rows. The parameters' `.grad` is kept.

    Raises:
        ValueError: For an unknown `kind`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    sweep.extend()
    params = sweep.trainable()
    # on FSDP2 every rank takes a batch (its collectives), rows from its own samples
    work = lambda batch: batch_rows(sweep, params, batch, kind, mc_samples)  # noqa: E731
    for batch, (rows, nu) in batch_results(sweep, work, desc):
        yield batch, rows, nu


def batch_rows(
    sweep: Sweep, params: list, batch: Batch, kind: str = "grad", mc_samples: int = 1
) -> tuple[dict[str, Tensor], float]:
    """One batch of `row_batches`: `({name: rows}, ν_b)` (the model and loss `extend`-ed).

    `params`: `sweep.trainable()`. On FSDP2 the rows are of whole parameters (FSDP's
    unsharded ones, in its own backward), a collective of every rank.
    """
    if kind == "grad":
        extension, field = BatchGrad(), "grad_batch"
    elif kind == "type-2":
        extension, field = SqrtGGNExact(), "sqrt_ggn_exact"
    else:
        extension, field = SqrtGGNMC(mc_samples=mc_samples), "sqrt_ggn_mc"
    model, lossfunc = sweep.model, sweep.lossfunc
    with torch.enable_grad():
        output = model(batch.X)
        nu = sweep.nu(output, batch.y)
        saved = [p.grad for _, p in params]
        if sweep.empty(nu):
            if sweep.sharded:  # the other ranks' backwards run FSDP2's collectives: one too
                (first_tensor(output).sum() * 0).backward()
                for (_, p), g in zip(params, saved):
                    p.grad = g
            return {name: plain_zeros(p, batch.num_samples) for name, p in params}, nu
        loss = lossfunc(output, batch.y)
        holders = landing(model)
        for _, p in params:  # backward would add into the saved tensors in place
            p.grad = None
        try:
            with backpack(extension, sync=False):
                loss.backward()
        except BaseException:  # leave the parameters as they were
            for (_, p), g in zip(params, saved):
                for h in holders(p):
                    h.__dict__.pop(field, None)
                p.grad = g
            raise
    scale = sweep.scale(nu)
    rows = {}
    for (name, p), g in zip(params, saved):
        p.grad = g
        value = None
        for h in holders(p):
            found = h.__dict__.pop(field, None)
            value = found if value is None else value
        if value is None:
            raise ValueError(
                f"Parameter {name} got no {field!r} in batch {batch.index} (does it take "
                "part in the loss, and is its layer supported? see the warnings)."
            )
        # at least in the parameter's own dtype: FSDP2's mixed precision computes in a lower one
        dtype = torch.promote_types(value.dtype, p.dtype)
        if kind == "grad":
            rows[name] = (value * scale).to(dtype)
        else:  # [C or M, N, *shape] -> [C·N, *shape]
            rows[name] = (value.flatten(0, 1) * scale**0.5).to(dtype)
    return rows, nu
