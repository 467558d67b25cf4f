"""backpack's custom modules inside `nn.Sequential`: branches, merges, scaling, axis shuffles.

Every problem routes the curvature through one custom module (Parallel with the default
SumModule merge, nested Parallel, Parallel with CatModule/MultiplyModule merges, ScaleModule,
Permute, Slicing, Pad, ReduceTuple after an RNN/LSTM, ActiveIdentity) between Linear/Conv
layers with module nonlinearities, so every first- and second-order extension test runs over it.

Tags: {"first", "second", "hessian", "kron"} wherever the exact-Hessian family applies (all
nonlinearities are modules with second derivatives or piecewise linear). Not "hessian":
MultiplyModule (bilinear, no residual rule) and RNN/LSTM (no second derivatives of the
recurrence). Linear layers on `[N, T, F]` inputs, and RNN/LSTM weights (one Linear map per
step), treat positions as samples in their Kronecker factors, so their G is not the bias block
of the GGN (`bias_block_is_G=False`).
"""

import torch
from torch import nn

from backpack.custom_module.branching import (
    ActiveIdentity,
    CatModule,
    MultiplyModule,
    Parallel,
    SumModule,
)
from backpack.custom_module.pad import Pad
from backpack.custom_module.permute import Permute
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing
from problems import Problem, randn

ALL = {"first", "second", "hessian", "kron"}
NO_HESSIAN = {"first", "second", "kron"}


def parallel_residual():
    """The seed's residual block: Identity + Sequential(Linear, Tanh), merged by SumModule."""
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.Sigmoid(),
        Parallel(nn.Identity(), nn.Sequential(nn.Linear(5, 5), nn.Tanh())),
        nn.Linear(5, 3),
    )


def parallel_nested():
    inner = Parallel(
        ActiveIdentity(),
        nn.Sequential(nn.Linear(5, 5), nn.Sigmoid()),
        merge_module=SumModule(),
    )
    return nn.Sequential(
        nn.Linear(4, 5),
        Parallel(nn.Identity(), nn.Sequential(nn.Tanh(), inner), nn.Linear(5, 5)),
        nn.ELU(),
        nn.Linear(5, 3),
    )


def parallel_cat_merge():
    """Inception-like: two branches of different widths stacked along the feature axis."""
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.Tanh(),
        Parallel(
            nn.Linear(5, 3),
            nn.Sequential(nn.Linear(5, 2), nn.Sigmoid()),
            merge_module=CatModule(dim=1),
        ),
        nn.Linear(5, 3),
    )


def parallel_multiply_merge():
    """A gate: Linear features times sigmoid(Linear) features (bilinear merge)."""
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.ReLU(),
        Parallel(
            nn.Linear(5, 4),
            nn.Sequential(nn.Linear(5, 4), nn.Sigmoid()),
            merge_module=MultiplyModule(),
        ),
        nn.Linear(4, 3),
    )


def scale():
    return nn.Sequential(nn.Linear(4, 5), ScaleModule(0.5), nn.Tanh(), nn.Linear(5, 3))


def permute():
    """`[N, 3, 4]` -> Permute(0, 2, 1) -> Linear on the last axis -> transpose back."""
    return nn.Sequential(
        Permute(0, 2, 1),  # [N, 4, 3]
        nn.Linear(3, 5),  # [N, 4, 5]
        nn.Tanh(),
        Permute(1, 2, init_transpose=True),  # [N, 5, 4]
        nn.Linear(4, 2),  # [N, 5, 2]
        nn.Flatten(),
        nn.Linear(10, 3),
    )


def slicing():
    return nn.Sequential(
        nn.Linear(4, 6),
        Slicing((slice(None), slice(1, 4))),
        nn.Sigmoid(),
        nn.Linear(3, 3),
    )


def pad_constant():
    return nn.Sequential(
        nn.Conv1d(2, 3, 2),  # [N, 3, 5]
        Pad((1, 2), mode="constant", value=0.3),  # [N, 3, 8]
        nn.Tanh(),
        nn.Conv1d(3, 2, 3, stride=2),  # [N, 2, 3]
        nn.Flatten(),
        nn.Linear(6, 3),
    )


def pad_reflect():
    return nn.Sequential(
        nn.Conv1d(2, 3, 2),  # [N, 3, 5]
        nn.Sigmoid(),
        Pad((2, 1), mode="reflect"),  # [N, 3, 8]
        nn.Conv1d(3, 2, 3),  # [N, 2, 6]
        nn.Flatten(),
        nn.Linear(12, 3),
    )


def active_identity():
    return nn.Sequential(
        nn.Linear(4, 5),
        ActiveIdentity(),
        nn.Tanh(),
        Parallel(ActiveIdentity(), nn.Linear(5, 5)),
        nn.Linear(5, 3),
    )


def rnn_reduce_tuple():
    return nn.Sequential(
        nn.RNN(3, 4, batch_first=True),
        ReduceTuple(index=0),  # the sequence output [N, T, 4]
        nn.Flatten(),
        nn.Linear(12, 3),
    )


def lstm_reduce_tuple():
    return nn.Sequential(
        nn.LSTM(3, 4, batch_first=True),
        ReduceTuple(),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(12, 2),
    )


def ce(reduction="mean"):
    return lambda: nn.CrossEntropyLoss(reduction=reduction)


def mse(reduction="mean"):
    return lambda: nn.MSELoss(reduction=reduction)


def _has_rnn_rule() -> bool:
    from backpack.rules import find_rule

    return find_rule(nn.RNN(1, 1)) is not None and find_rule(nn.LSTM(1, 1)) is not None


SEQ_G = {"bias_block_is_G": False}

PROBLEMS = [
    Problem("custom-parallel-residual", parallel_residual, randn(5, 4), ce("mean"), tags=ALL),
    Problem("custom-parallel-nested", parallel_nested, randn(5, 4), mse("sum"), tags=ALL),
    Problem("custom-parallel-cat-merge", parallel_cat_merge, randn(5, 4), ce("sum"), tags=ALL),
    Problem(
        "custom-parallel-multiply-merge",
        parallel_multiply_merge,
        randn(5, 4),
        mse("mean"),
        tags=NO_HESSIAN,
    ),
    Problem("custom-scale", scale, randn(5, 4), ce("mean"), tags=ALL),
    Problem("custom-permute", permute, randn(4, 3, 4), mse("sum"), tags=ALL, options=SEQ_G),
    Problem("custom-slicing", slicing, randn(5, 4), ce("sum"), tags=ALL),
    Problem("custom-pad-constant", pad_constant, randn(4, 2, 6), ce("mean"), tags=ALL),
    Problem("custom-pad-reflect", pad_reflect, randn(4, 2, 6), mse("mean"), tags=ALL),
    Problem("custom-active-identity", active_identity, randn(5, 4), mse("sum"), tags=ALL),
]
if _has_rnn_rule():
    PROBLEMS += [
        Problem(
            "custom-reduce-tuple-rnn",
            rnn_reduce_tuple,
            lambda: torch.randn(4, 3, 3, dtype=torch.float64),
            ce("mean"),
            tags={"first", "second", "kron"},
            options=SEQ_G,
        ),
        Problem(
            "custom-reduce-tuple-lstm",
            lstm_reduce_tuple,
            lambda: torch.randn(3, 3, 3, dtype=torch.float64),
            mse("sum"),
            tags={"first", "second", "kron"},
            options=SEQ_G,
        ),
    ]
