"""Training-data attribution: which training examples support or oppose a prediction.

- `fit(model, lossfunc, train_data, strategy="ekfac")`: fit a curvature approximation of the
  training set's Fisher once ("identity", "diagonal", "kfac", "ekfac"); the returned `Influence`
  scores query examples against training examples, `∇ℓ_qᵀ (F + λI)⁻¹ ∇ℓ_t`
  (`scores`, `self_scores`), and saves to plain tensors (`save`, `load`, `load_block`). At
  scale: low-rank query gradients (`query_rank`), scores per module (`per_module`), scores
  written to disk in resumable chunks (`out_dir`, read back with `read_scores`), storage dtypes.
- `tracin(checkpoints, lossfunc, query_data, train_data, learning_rates)`: TracIn, the sum over
  checkpoints of learning rate times gradient dot product.

Built on `backpack.curvature` (Kronecker factors, `EKFAC`) and backpack's per-sample gradients.
"""

from backpack.influence.attribution import (
    STRATEGIES,
    Influence,
    fit,
    load,
    load_block,
    read_scores,
)
from backpack.influence.tracin import tracin

__all__ = ["fit", "load", "load_block", "read_scores", "Influence", "tracin", "STRATEGIES"]
