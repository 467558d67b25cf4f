"""Problems with nn.Embedding (padding_idx, max_norm, scale_grad_by_freq) and tied weights."""

import torch
from torch import nn

from problems import Problem


class MeanTokens(nn.Module):
    """Average over the token axis: `[N, T, D]` -> `[N, D]`."""

    def forward(self, x):
        return x.mean(1)


class TiedLM(nn.Module):
    """Tiny language model whose output layer shares the embedding matrix."""

    def __init__(self, vocab=6, dim=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.hidden(self.emb(x)))
        return self.head(h).transpose(1, 2)  # [N, V, T] for the per-token cross-entropy


class RelativeBias(nn.Module):
    """T5's relative position bias: an embedding of a `[T, T]` index, added to every sample.

    The lookup has no sample axis (its index comes from `torch.arange(T)`); its `[T, T, H]`
    output is permuted to `[1, H, T, T]` and broadcast over the samples by the addition.
    """

    def __init__(self, dim=4, heads=2, span=3):
        super().__init__()
        self.span = span
        self.rel = nn.Embedding(2 * span + 1, heads)
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        r = torch.arange(x.shape[1], device=x.device)
        bias = self.rel((r[None] - r[:, None]).clamp(-self.span, self.span) + self.span)
        scores = (x @ x.transpose(1, 2)).unsqueeze(1) + bias.permute(2, 0, 1).unsqueeze(0)
        return self.out((scores.softmax(-1) @ x.unsqueeze(1)).sum(1)).mean(1)


def floats(*shape):
    """Input builder: standard normal float64 numbers."""
    return lambda: torch.randn(*shape, dtype=torch.float64)


def indices(num_embeddings, *shape, force=None):
    """Input builder: random indices; `force` puts that index at the last position of each row."""

    def make():
        x = torch.randint(0, num_embeddings, shape)
        if force is not None:
            x[..., -1] = force
        return x

    return make


PROBLEMS = [
    # the smallest model whose forward-mode Jacobian moves the padding row autograd keeps fixed
    Problem(
        "embedding-padding-idx-flatten",
        lambda: nn.Sequential(nn.Embedding(5, 3, padding_idx=2), nn.Flatten(), nn.Linear(6, 3)),
        indices(5, 7, 2, force=2),
    ),
    Problem(
        "embedding-padding-idx",
        lambda: nn.Sequential(nn.Embedding(7, 4, padding_idx=2), nn.Flatten(), nn.Linear(20, 3)),
        indices(7, 6, 5, force=2),
    ),
    Problem(
        "embedding-max-norm",
        lambda: nn.Sequential(nn.Embedding(7, 4, max_norm=1.0), MeanTokens(), nn.Linear(4, 3)),
        indices(7, 5, 4),
    ),
    Problem(
        "embedding-scale-grad-by-freq",
        lambda: nn.Sequential(
            nn.Embedding(5, 3, scale_grad_by_freq=True), nn.Flatten(), nn.Linear(12, 2)
        ),
        indices(5, 6, 4),
        lambda: nn.MSELoss(reduction="sum"),
    ),
    Problem(
        "embedding-freq-padding-1d",
        lambda: nn.Sequential(
            nn.Embedding(4, 3, padding_idx=-1, scale_grad_by_freq=True), nn.Linear(3, 2)
        ),
        lambda: torch.tensor([0, 3, 1, 1, 3, 2, 1]),
    ),
    Problem("embedding-tied-lm", TiedLM, indices(6, 5, 4), tags={"first", "reuse"}),
    # T == N: a shape test (axis 0 of size N) would take the T rows for the samples
    Problem(
        "embedding-relative-bias-t-eq-n", RelativeBias, floats(4, 4, 4), tags={"first", "second"}
    ),
    Problem(
        "embedding-relative-bias",
        RelativeBias,
        floats(3, 5, 4),
        lambda: nn.MSELoss(reduction="sum"),
        tags={"first", "second"},
    ),
]
