"""Layers whose weights are computed from their parameters (weight norm, spectral norm, ...).

By `torch.nn.utils.parametrize` (weight norm, orthogonal, custom), whose parameters are the
parametrizations' originals, and by the older hook-based `nn.utils.weight_norm` and
`spectral_norm` (`weight_g`/`weight_v`, `weight_orig`). The layers get the torch.func fallback
(first-order quantities and the GGN family). Spectral norm's training-mode power iteration
changes the weight at every forward, so it has a test of its own in
`tests/rules/test_parametrized.py`; here it runs in eval mode.
"""

import warnings

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from problems import Problem, randn

FALLBACK = {"first", "second"}


class Symmetric(nn.Module):
    """A square weight built from its upper triangle."""

    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


class Scaled(nn.Module):
    """A parametrization with a parameter of its own (a learned scale per output)."""

    def __init__(self, rows):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(rows, 1).uniform_(0.5, 1.5))

    def forward(self, x):
        return self.scale * x


def weight_norm_mlp():
    return nn.Sequential(
        parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 3)
    )


def symmetric_no_bias():
    layer = nn.Linear(4, 4, bias=False)  # no parameter of its own left
    parametrize.register_parametrization(layer, "weight", Symmetric())
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), layer, nn.Sigmoid(), nn.Linear(4, 2))


def orthogonal_and_learned_scale():
    layer = parametrizations.orthogonal(nn.Linear(5, 5))
    parametrize.register_parametrization(layer, "weight", Scaled(5))
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), layer, nn.ELU(), nn.Linear(5, 3))


def weight_norm_conv():
    return nn.Sequential(
        parametrizations.weight_norm(nn.Conv2d(2, 3, 3, padding=1, stride=2)),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3, 3),
    )


def _old_style(function, layer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for torch.nn.utils.parametrize
        return function(layer)


def old_weight_norm_conv():
    return nn.Sequential(
        _old_style(nn.utils.weight_norm, nn.Conv2d(2, 3, 2)),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3, 2),
    )


def old_spectral_norm_eval():
    return nn.Sequential(
        nn.Linear(4, 5), nn.ReLU(), _old_style(nn.utils.spectral_norm, nn.Linear(5, 3))
    ).eval()


def spectral_norm_eval():
    return nn.Sequential(
        parametrizations.spectral_norm(nn.Linear(4, 6)), nn.Sigmoid(), nn.Linear(6, 3)
    ).eval()


PROBLEMS = [
    Problem("parametrized-weight-norm-linear", weight_norm_mlp, randn(5, 4), tags=FALLBACK),
    Problem(
        "parametrized-symmetric-no-bias",
        symmetric_no_bias,
        randn(6, 3),
        lambda: nn.MSELoss(reduction="sum"),
        tags=FALLBACK,
    ),
    Problem(
        "parametrized-orthogonal-learned-scale",
        orthogonal_and_learned_scale,
        randn(4, 3),
        tags=FALLBACK,
    ),
    Problem(
        "parametrized-weight-norm-conv",
        weight_norm_conv,
        randn(4, 2, 5, 5),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        tags=FALLBACK,
    ),
    Problem("parametrized-spectral-norm-eval", spectral_norm_eval, randn(5, 4), tags=FALLBACK),
    Problem(
        "parametrized-old-weight-norm-conv",
        old_weight_norm_conv,
        randn(3, 2, 4, 4),
        lambda: nn.MSELoss(),
        tags=FALLBACK,
    ),
    Problem(
        "parametrized-old-spectral-norm-eval", old_spectral_norm_eval, randn(5, 4), tags=FALLBACK
    ),
]
