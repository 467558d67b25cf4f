"""Models owning parameters next to their submodules, as vision transformers own their class
token and position embedding.

The parameters meet the samples where they are broadcast (added to, or expanded over, the
batch, or multiplied with per-sample features as a scale): backpack reads their per-sample
gradients there (`samples.ParamSite`) instead of re-running the whole model per sample with
torch.func. A parameter used as a matrix takes the torch.func fallback and keeps working.
"""

import torch
from torch import nn

from problems import Problem, randn


class TokensWithClassToken(nn.Module):
    """A miniature vision transformer's stem and head around a token-wise MLP."""

    def __init__(self, subtract: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 4))
        self.pos_embed = nn.Parameter(torch.randn(1, 6, 4))
        self.mlp = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4))
        self.head = nn.Linear(4, 3)
        self.subtract = subtract

    def forward(self, x):  # x: [N, 5, 3]
        tokens = self.embed(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        h = torch.cat([cls, tokens], dim=1)
        h = h - self.pos_embed if self.subtract else h + self.pos_embed
        h = h + self.mlp(h)
        return self.head(h[:, 0])


class ScaledResidual(nn.Module):
    """A residual MLP whose branch is scaled by a parameter of the model itself (LayerScale)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.gamma = nn.Parameter(torch.full((4,), 0.5))
        self.bias = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(x + self.gamma * self.branch(x) + self.bias)


class CalledTwice(nn.Module):
    """A container with its own parameters called twice on the same samples (one loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TokensWithClassToken()

    def forward(self, x):
        return self.inner(x) + self.inner(x.flip(1))


class OwnMatrix(nn.Module):
    """A parameter used as a matrix by the model itself (no broadcast: torch.func fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.mix = nn.Parameter(torch.randn(4, 4) / 2)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x) @ self.mix))


PROBLEMS = [
    Problem(
        "container-cls-token-pos-embed-ce-mean", TokensWithClassToken, randn(4, 5, 3),
        tags={"first", "second"},
    ),
    Problem(
        "container-subtracted-pos-embed-mse-sum", lambda: TokensWithClassToken(subtract=True),
        randn(4, 5, 3), lambda: nn.MSELoss(reduction="sum"), tags={"first", "second"},
    ),
    Problem("container-scaled-residual-ce-sum", ScaledResidual, randn(5, 4),
            lambda: nn.CrossEntropyLoss(reduction="sum"), tags={"first", "second"}),
    Problem("container-own-matrix-ce-mean", OwnMatrix, randn(5, 4), tags={"first", "second"}),
    Problem(
        "container-called-twice-ce-mean",
        CalledTwice,
        randn(4, 5, 3),
        tags={"first", "second", "reuse"},
    ),
]
