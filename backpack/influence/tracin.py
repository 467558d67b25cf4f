"""TracIn: influence as the sum over training checkpoints of learning rate × gradient dot product.

`tracin(q, t) = Σ_c η_c ∇ℓ_q(θ_c) · ∇ℓ_t(θ_c)` (Pruthi et al., 2020, the "checkpoint" variant),
with `ℓ_n` example n's own loss (no reduction factor) at checkpoint c's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from backpack.curvature._data import Normaliser
from backpack.influence.attribution import Influence

__all__ = ["tracin"]


def tracin(
    checkpoints: Sequence[nn.Module | Mapping[str, Tensor]],
    lossfunc: Any,
    query_data: Iterable,
    train_data: Iterable,
    learning_rates: float | Sequence[float],
    model: nn.Module | None = None,
    progress: bool = False,
    normaliser: Normaliser | None = None,
    num_samples: Callable[[Any], int] | None = None,
) -> Tensor:
    """TracIn scores `[n_query, n_train]`: `Σ_c η_c ∇ℓ_q(θ_c)ᵀ ∇ℓ_t(θ_c)`.

    Args:
        checkpoints: The training checkpoints, either models (`nn.Module`, each used as it is
            and `extend`-ed) or state dicts (`model.state_dict()` of each checkpoint; loaded one
            after the other into `model`, whose own state is restored afterwards).
        lossfunc: The loss (torch loss module, reduction "mean" or "sum").
        query_data: Re-iterable `(X, y)` batches of the query examples.
        train_data: Re-iterable `(X, y)` batches of the training examples.
        learning_rates: η_c, one per checkpoint or one for all.
        model: The model to load state dicts into (needed for state dicts only).
        progress: Show progress bars (tqdm).
        normaliser: Custom `(output, y) -> ν_b`.
        num_samples: Custom `X -> number of samples`.

    Cost per checkpoint: the query gradients (kept, `[n_query, P]`) and one sweep over the
    training data; nothing of size `[n_train, P]` is formed.

    Raises:
        ValueError: For no checkpoint, a number of learning rates that differs from theirs, or
            state dicts without `model`.
    """
    checkpoints = list(checkpoints)
    if not checkpoints:
        raise ValueError("tracin needs at least one checkpoint.")
    if isinstance(learning_rates, (int, float)):
        learning_rates = [float(learning_rates)] * len(checkpoints)
    learning_rates = list(learning_rates)
    if len(learning_rates) != len(checkpoints):
        raise ValueError(
            f"{len(checkpoints)} checkpoints but {len(learning_rates)} learning rates."
        )
    needs_model = any(not isinstance(c, nn.Module) for c in checkpoints)
    if needs_model and model is None:
        raise ValueError("Checkpoints given as state dicts need model= to load them into.")
    saved = None
    if needs_model:
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total = None
    try:
        for checkpoint, lr in zip(checkpoints, learning_rates):
            if isinstance(checkpoint, nn.Module):
                current = checkpoint
            else:
                model.load_state_dict(checkpoint)
                current = model
            influence = Influence(
                current, lossfunc, "identity", normaliser=normaliser, num_samples=num_samples
            )
            scores = influence.scores(query_data, train_data, progress) * lr
            total = scores if total is None else total + scores
    finally:
        if saved is not None:
            with torch.no_grad():
                model.load_state_dict(saved)
    return total
