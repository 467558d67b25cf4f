"""Problems with Linear layers and activations (Sequential and custom forwards)."""

import torch
from torch import nn

from problems import Problem, randn


class TwoUses(nn.Module):
    """A Linear layer applied twice in one forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(torch.relu(self.lin(x)))))


class SharedWeight(nn.Module):
    """Two Linear modules holding the same Parameter object."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.b(torch.tanh(self.a(x))))


class InplaceResidual(nn.Module):
    """In-place ReLU and an in-place residual addition after recorded modules."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.relu(self.l1(x))
        r = self.l2(h)
        r += h
        return self.head(torch.nn.functional.relu_(r))


def seq_inplace_relu():
    """Linear on `[N, T, D]` with a bias (`F.linear` returns a view of its product) whose output
    goes straight into an in-place ReLU (an in-place op on a view reroutes autograd)."""
    return nn.Sequential(
        nn.Linear(1, 6), nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(18, 4)
    )


def mlp():
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3))


PROBLEMS = [
    Problem("linear-mlp-ce-mean", mlp, randn(7, 6), tags={"first", "second", "hessian", "kron"}),
    Problem(
        "linear-mlp-ce-sum",
        mlp,
        randn(7, 6),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "linear-mlp-mse-mean",
        mlp,
        randn(5, 6),
        lambda: nn.MSELoss(),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "linear-mlp-mse-sum",
        mlp,
        randn(5, 6),
        lambda: nn.MSELoss(reduction="sum"),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "linear-seq-input",
        lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(15, 2)),
        randn(6, 5, 4),
        tags={"first", "second", "hessian", "kron"},
        options={"bias_block_is_G": False},
    ),
    Problem(
        "linear-seq-input-wide",
        lambda: nn.Sequential(nn.Linear(3, 40), nn.Tanh(), nn.Flatten(), nn.Linear(80, 2)),
        randn(4, 2, 3),
        lambda: nn.MSELoss(reduction="sum"),
        tags={"first", "second", "hessian", "kron"},
        options={"bias_block_is_G": False},
    ),
    Problem(
        "linear-seq-input-inplace-relu",
        seq_inplace_relu,
        randn(4, 3, 1),
        lambda: nn.MSELoss(reduction="sum"),
        tags={"first", "second", "hessian", "kron"},
        options={"bias_block_is_G": False},
    ),
    Problem("linear-nobias", lambda: nn.Sequential(nn.Linear(4, 3, bias=False)), randn(5, 4)),
    Problem("linear-two-uses", TwoUses, randn(6, 4), tags={"first", "second", "reuse"}),
    Problem("linear-shared-weight", SharedWeight, randn(6, 4), tags={"first", "second", "reuse"}),
    Problem(
        "linear-inplace-residual",
        InplaceResidual,
        randn(6, 4),
        tags={"first", "second", "custom", "hessian", "kron"},
    ),
    # the first layer modifies the model's input in place (torch.func transforms refuse that)
    Problem(
        "linear-inplace-relu-first",
        lambda: nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)),
        randn(7, 4),
        tags={"first", "second", "hessian", "kron"},
    ),
]
