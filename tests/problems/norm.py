"""Problems with LayerNorm, RMSNorm, GroupNorm and InstanceNorm1d/2d/3d (per-sample statistics).

Each normalisation sits after a parametrized layer, so the curvature has to pass through its
input Jacobian, and its γ, β are randomised so that it is far from the identity. Inputs are
`[N, D]`, sequences `[N, T, D]` (a sample is a whole sequence) and conv-style `[N, C, *spatial]`.
The transformer-like blocks put LayerNorm between Linear layers on sequences, with the
cross-entropy over `[N, C, T]` logits or the MSE over `[N, T, C]` outputs.

Tags: "first", "second", "kron" everywhere. No "hessian": these layers are nonlinear in their
input and the exact-Hessian extensions refuse models containing them (see
tests/rules/test_norm_rules.py). `bias_block_is_G` is False where a Linear layer acts on
sequences (its Kronecker factors follow the "expand" convention, so G is not its bias block);
the normalisation layers' own factors are exact blocks everywhere (checked in the rules test).
"""

import torch
from torch import nn

from backpack.custom_module.permute import Permute
from problems import Problem, randn

TAGS = {"first", "second", "kron"}
SEQ = {"bias_block_is_G": False}


def randomise(norm: nn.Module) -> nn.Module:
    """Random γ, β (and running statistics, if tracked) so that the layer is not the identity."""
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
        if getattr(norm, "running_mean", None) is not None:
            norm.running_mean.normal_()
            norm.running_var.uniform_(0.5, 2.0)
    return norm


def around(norm: nn.Module, features: int, act: nn.Module | None = None) -> nn.Sequential:
    """Linear(5, features) -> norm -> activation -> Linear(features, 3) on `[N, 5]` inputs."""
    act = nn.Tanh() if act is None else act
    return nn.Sequential(nn.Linear(5, features), randomise(norm), act, nn.Linear(features, 3))


def conv_net(conv: nn.Module, norm: nn.Module, in_shape: tuple[int, ...], classes: int = 3):
    """conv -> norm -> Tanh -> Flatten -> Linear, the head sized from a dry run."""
    body = nn.Sequential(conv, norm, nn.Tanh(), nn.Flatten())
    with torch.no_grad():
        features = body(torch.zeros(2, *in_shape)).shape[1]
    randomise(norm)  # after the dry run, which may update running statistics
    return nn.Sequential(*body, nn.Linear(features, classes))


def transformer_block(norm: nn.Module, d: int = 4, hidden: int = 5, classes: int = 3, ce=True):
    """Linear -> norm -> Linear -> GELU -> Linear on `[N, T, d]`, logits `[N, C, T]` for CE."""
    layers = [
        nn.Linear(d, d),
        randomise(norm),
        nn.Linear(d, hidden),
        nn.GELU(),
        nn.Linear(hidden, classes),
    ]
    if ce:
        layers.append(Permute(0, 2, 1))
    return nn.Sequential(*layers)


class PreNormResidual(nn.Module):
    """h = x + W₂ GELU(W₁ LN₁(x)); out = head(LN₂(h)): a pre-norm transformer MLP block."""

    def __init__(self, d=4, hidden=6, classes=3):
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.ln1 = randomise(nn.LayerNorm(d))
        self.up = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, d)
        self.ln2 = randomise(nn.LayerNorm(d, bias=False))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.embed(x)
        h = x + self.down(self.act(self.up(self.ln1(x))))
        return self.head(self.ln2(h))


def instance_net(cls, channels, in_shape, tracked, train, classes=3):
    """Conv -> InstanceNorm(affine) -> Tanh -> Flatten -> Linear in train or eval mode."""
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[len(in_shape) - 1]
    norm = cls(channels, affine=True, track_running_stats=tracked)
    model = conv_net(conv(in_shape[0], channels, 2), norm, in_shape, classes)
    return model.train() if train else model.eval()


def _instance(dims, tracked, train, n=4):
    cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims]
    in_shape = {1: (2, 6), 2: (2, 4, 3), 3: (1, 3, 3, 3)}[dims]
    mode = "train" if train else "eval"
    stats = "tracked" if tracked else "untracked"
    return Problem(
        f"instancenorm{dims}d-{stats}-{mode}",
        lambda: instance_net(cls, 3 if dims < 3 else 2, in_shape, tracked, train),
        randn(n, *in_shape),
        (lambda: nn.MSELoss()) if dims == 2 else (lambda: nn.CrossEntropyLoss(reduction="sum")),
        tags=TAGS,
    )


def _seq_ce_target(out):
    return torch.randint(0, out.shape[1], (out.shape[0], out.shape[2]))


PROBLEMS = [
    # --- LayerNorm ---------------------------------------------------------------------------
    Problem("layernorm-flat-ce-mean", lambda: around(nn.LayerNorm(4), 4), randn(6, 5), tags=TAGS),
    Problem(
        "layernorm-nobias-mse-sum",
        lambda: around(nn.LayerNorm(4, bias=False, eps=1e-3), 4, nn.Sigmoid()),
        randn(6, 5),
        lambda: nn.MSELoss(reduction="sum"),
        tags=TAGS,
    ),
    Problem(
        "layernorm-no-affine-between",
        lambda: around(nn.LayerNorm(4, elementwise_affine=False), 4),
        randn(6, 5),
        lambda: nn.MSELoss(),
        tags=TAGS,
    ),
    Problem(
        "layernorm-2d-shape",
        lambda: nn.Sequential(
            nn.Linear(4, 4),
            randomise(nn.LayerNorm((3, 4))),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(2 * 3 * 4, 3),
        ),
        randn(5, 2, 3, 4),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        tags=TAGS,
        options=SEQ,
    ),
    Problem(
        "transformer-block-ce-mean",
        lambda: transformer_block(nn.LayerNorm(4)),
        randn(4, 3, 4),
        make_target=_seq_ce_target,
        tags=TAGS,
        options=SEQ,
    ),
    Problem(
        "transformer-block-ce-sum",
        lambda: transformer_block(nn.LayerNorm(4)),
        randn(4, 3, 4),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        make_target=_seq_ce_target,
        tags=TAGS,
        options=SEQ,
    ),
    Problem(
        "transformer-block-mse-mean",
        lambda: transformer_block(nn.LayerNorm(4), ce=False),
        randn(4, 3, 4),
        lambda: nn.MSELoss(),
        tags=TAGS,
        options=SEQ,
    ),
    Problem(
        "transformer-prenorm-residual-mse-sum",
        PreNormResidual,
        randn(4, 3, 3),
        lambda: nn.MSELoss(reduction="sum"),
        tags=TAGS,
        options=SEQ,
    ),
    # --- RMSNorm -----------------------------------------------------------------------------
    Problem("rmsnorm-eps-none", lambda: around(nn.RMSNorm(4), 4), randn(6, 5), tags=TAGS),
    Problem(
        "rmsnorm-seq-eps-ce-sum",
        lambda: transformer_block(nn.RMSNorm(4, eps=1e-2)),
        randn(4, 3, 4),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        make_target=_seq_ce_target,
        tags=TAGS,
        options=SEQ,
    ),
    Problem(
        "rmsnorm-2d-shape-mse-mean",
        lambda: nn.Sequential(
            nn.Linear(4, 4),
            randomise(nn.RMSNorm((2, 4), eps=1e-3)),
            nn.Sigmoid(),
            nn.Flatten(),
            nn.Linear(3 * 2 * 4, 2),
        ),
        randn(5, 3, 2, 4),
        lambda: nn.MSELoss(),
        tags=TAGS,
        options=SEQ,
    ),
    # --- GroupNorm ---------------------------------------------------------------------------
    Problem(
        "groupnorm-flat",
        lambda: around(nn.GroupNorm(2, 4), 4, nn.Sigmoid()),
        randn(6, 5),
        tags=TAGS,
    ),
    Problem(
        "groupnorm-conv1d",
        lambda: conv_net(nn.Conv1d(2, 4, 3), nn.GroupNorm(2, 4), (2, 6)),
        randn(5, 2, 6),
        tags=TAGS,
    ),
    Problem(
        "groupnorm-conv2d-mse",
        lambda: conv_net(nn.Conv2d(2, 6, 2), nn.GroupNorm(3, 6, eps=1e-3), (2, 3, 4), classes=2),
        randn(4, 2, 3, 4),
        lambda: nn.MSELoss(reduction="sum"),
        tags=TAGS,
    ),
    # --- InstanceNorm ------------------------------------------------------------------------
    _instance(1, tracked=False, train=True),
    _instance(1, tracked=False, train=False),
    _instance(1, tracked=True, train=True),
    _instance(2, tracked=True, train=True),
    _instance(2, tracked=True, train=False),
    _instance(2, tracked=False, train=False),
    _instance(3, tracked=True, train=False),
    _instance(3, tracked=False, train=True),
]
