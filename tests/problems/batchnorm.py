"""Problems with BatchNorm1d/2d/3d in eval mode (running statistics: samples independent).

Running statistics, γ and β are randomised before `.eval()` so that the normalisation is far from
the identity. Training-mode behaviour (batch statistics) is tested in
tests/rules/test_norm_embedding_rules.py, since the table expects exact per-sample values.
"""

import torch
from torch import nn

from problems import Problem, randn


def randomise(bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """Random running statistics and affine parameters; switches the module to eval mode."""
    with torch.no_grad():
        if bn.running_mean is not None:
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
        if bn.affine:
            bn.weight.normal_()
            bn.bias.normal_()
    return bn.eval()


def bn1d_flat():
    return nn.Sequential(
        nn.Linear(5, 4), randomise(nn.BatchNorm1d(4)), nn.ReLU(), nn.Linear(4, 3)
    ).eval()


def bn1d_seq():
    return nn.Sequential(
        randomise(nn.BatchNorm1d(3, eps=1e-2)), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4, 2)
    ).eval()


def bn1d_momentum_none():
    """Cumulative running averages (momentum=None) from a few training batches."""
    bn = nn.BatchNorm1d(4, momentum=None)
    with torch.no_grad():
        for _ in range(3):
            bn(2.0 * torch.randn(8, 4) + 1.0)
        bn.weight.normal_()
        bn.bias.normal_()
    return nn.Sequential(nn.Linear(5, 4), bn.eval(), nn.Sigmoid(), nn.Linear(4, 3)).eval()


def bn1d_no_affine():
    """A parameter-free BatchNorm between parametrized layers."""
    return nn.Sequential(
        nn.Linear(5, 4), randomise(nn.BatchNorm1d(4, affine=False)), nn.Tanh(), nn.Linear(4, 3)
    ).eval()


def bn2d():
    return nn.Sequential(
        randomise(nn.BatchNorm2d(3)), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 3 * 2, 3)
    ).eval()


def bn3d():
    return nn.Sequential(
        randomise(nn.BatchNorm3d(2, eps=1e-3)), nn.Sigmoid(), nn.Flatten(), nn.Linear(2 * 8, 2)
    ).eval()


PROBLEMS = [
    Problem("batchnorm1d-flat-eval", bn1d_flat, randn(6, 5), tags={"first", "second"}),
    Problem(
        "batchnorm1d-seq-eval",
        bn1d_seq,
        randn(5, 3, 4),
        lambda: nn.MSELoss(reduction="sum"),
        tags={"first", "second"},
    ),
    Problem(
        "batchnorm1d-momentum-none-eval",
        bn1d_momentum_none,
        randn(6, 5),
        tags={"first", "second"},
    ),
    Problem("batchnorm1d-no-affine-eval", bn1d_no_affine, randn(6, 5), tags={"first", "second"}),
    Problem("batchnorm2d-eval", bn2d, randn(4, 3, 3, 2), tags={"first", "second"}),
    Problem(
        "batchnorm3d-eval",
        bn3d,
        randn(3, 2, 2, 2, 2),
        lambda: nn.MSELoss(),
        tags={"first", "second"},
    ),
]
