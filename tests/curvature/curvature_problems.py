"""Tiny float64 problems and brute-force references of the data-set loss (torch.func, no backpack).

The data-set loss is the loss of the whole data set as one batch. Its per-sample terms are each
sample's loss with reduction="sum", divided by the data set's normaliser ν for "mean".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev


class TokenModel(nn.Module):
    """Embedding → Tanh → Linear on [N, T] tokens, logits flattened to [N·T, C]."""

    def __init__(self, vocab=6, dim=3, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.act = nn.Tanh()
        self.lin = nn.Linear(dim, classes)

    def forward(self, x):
        return self.lin(self.act(self.emb(x))).flatten(0, 1)


@dataclass
class Problem:
    name: str
    make_model: Callable[[], nn.Module]
    make_loss: Callable[[str], nn.Module]
    X: Tensor
    Y: Tensor
    #: targets of a batch are Y[batch].flatten() (token losses on flattened logits)
    flatten_targets: bool = False

    @property
    def N(self) -> int:
        return self.X.shape[0]

    def model(self) -> nn.Module:
        torch.manual_seed(1)
        return self.make_model().double()

    def targets(self, Y: Tensor) -> Tensor:
        return Y.flatten() if self.flatten_targets else Y

    def batches(self, sizes) -> list[tuple[Tensor, Tensor]]:
        assert sum(sizes) == self.N
        out, start = [], 0
        for size in sizes:
            out.append((self.X[start : start + size], self.targets(self.Y[start : start + size])))
            start += size
        return out

    def normaliser(self, reduction: str) -> float:
        if reduction == "sum":
            return 1.0
        if self.Y.dtype.is_floating_point:
            return float(self.Y.numel())
        return float((self.Y != -100).sum())


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _mlp_mse():
    return nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 2))


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3))


def make_problems() -> dict[str, Problem]:
    g = torch.Generator().manual_seed(0)
    n = 11
    tokens_y = torch.randint(0, 4, (n, 3), generator=g)
    tokens_y[0, 1] = tokens_y[3, 0] = tokens_y[3, 2] = tokens_y[9, 1] = -100
    return {
        "mlp_ce": Problem(
            "mlp_ce",
            _mlp,
            lambda r: nn.CrossEntropyLoss(reduction=r),
            torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        ),
        "mlp_mse": Problem(
            "mlp_mse",
            _mlp_mse,
            lambda r: nn.MSELoss(reduction=r),
            torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randn(n, 2, generator=g, dtype=torch.float64),
        ),
        "cnn_ce": Problem(
            "cnn_ce",
            _cnn,
            lambda r: nn.CrossEntropyLoss(reduction=r),
            torch.randn(n, 1, 5, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        ),
        "token_ce": Problem(
            "token_ce",
            TokenModel,
            lambda r: nn.CrossEntropyLoss(reduction=r, ignore_index=-100),
            torch.randint(0, 6, (n, 3), generator=g),
            tokens_y,
            flatten_targets=True,
        ),
    }


PROBLEMS = make_problems()


class Reference:
    """Brute-force quantities of the data-set loss of `problem` at `model`'s parameters."""

    def __init__(self, problem: Problem, model: nn.Module, reduction: str):
        self.problem = problem
        self.model = model
        self.reduction = reduction
        self.nu = problem.normaliser(reduction)
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.shapes = [p.shape for name, p in model.named_parameters() if p.requires_grad]
        self.numels = [s.numel() for s in self.shapes]
        self.theta = torch.cat(
            [p.detach().flatten() for p in model.parameters() if p.requires_grad]
        )
        self.sum_loss = problem.make_loss("sum")

    def params(self, theta):
        return {
            name: piece.reshape(shape)
            for name, piece, shape in zip(self.names, theta.split(self.numels), self.shapes)
        }

    def output(self, theta, X):
        return functional_call(self.model, self.params(theta), (X,))

    def loss(self, theta):
        """The data-set loss."""
        out = self.output(theta, self.problem.X)
        return self.sum_loss(out, self.problem.targets(self.problem.Y)) / self.nu

    def term(self, theta, i):
        """Sample i's term of the data-set loss."""
        X, Y = self.problem.X[i : i + 1], self.problem.targets(self.problem.Y[i : i + 1])
        return self.sum_loss(self.output(theta, X), Y) / self.nu

    def per_sample_grads(self) -> Tensor:
        """[N, P]: gradients of the samples' terms."""
        return torch.stack([jacrev(self.term)(self.theta, i) for i in range(self.problem.N)])

    def gradient(self) -> Tensor:
        return jacrev(self.loss)(self.theta)

    def hessian(self) -> Tensor:
        return hessian(self.loss)(self.theta)

    def per_sample_hessians(self) -> Tensor:
        return torch.stack([hessian(self.term)(self.theta, i) for i in range(self.problem.N)])

    def per_sample_ggns(self) -> Tensor:
        out = []
        for i in range(self.problem.N):
            X = self.problem.X[i : i + 1]
            Y = self.problem.targets(self.problem.Y[i : i + 1])
            f = self.output(self.theta, X)
            J = jacrev(lambda t, X=X: self.output(t, X))(self.theta).reshape(f.numel(), -1)
            H = hessian(lambda o, Y=Y: self.sum_loss(o, Y) / self.nu)(f)
            H = H.reshape(f.numel(), f.numel())
            out.append(J.T @ H @ J)
        return torch.stack(out)

    def ggn(self) -> Tensor:
        return self.per_sample_ggns().sum(0)

    def empirical_fisher(self) -> Tensor:
        """R Σ_n ∇ℓ_n ∇ℓ_nᵀ with ℓ_n the unreduced sample loss (= ν Σ g_n g_nᵀ)."""
        G = self.per_sample_grads()
        return G.T @ G * self.nu

    def split(self, flat: Tensor) -> dict[str, Tensor]:
        """Split the last axis of `flat` into parameter-shaped pieces."""
        pieces = flat.split(self.numels, dim=-1)
        return {
            name: piece.reshape(*flat.shape[:-1], *shape)
            for name, piece, shape in zip(self.names, pieces, self.shapes)
        }
