"""Problems with Conv1d/2d/3d and ConvTranspose1d/2d/3d layers under non-default options."""

import torch.nn.functional as F
from torch import nn

from problems import Problem, randn


def head(features, classes=3):
    return [nn.Flatten(), nn.Linear(features, classes)]


def conv1d_strided():
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, stride=2, padding=1, dilation=2, groups=2),
        nn.ReLU(),
        *head(4 * 4),
    )


def conv1d_same_reflect():
    return nn.Sequential(
        nn.Conv1d(2, 3, 4, padding="same", padding_mode="reflect", bias=False),
        nn.Tanh(),
        *head(3 * 7),
    )


def conv2d_same_circular():
    return nn.Sequential(
        nn.Conv2d(2, 3, (2, 3), padding="same", dilation=(1, 2), padding_mode="circular"),
        nn.Sigmoid(),
        *head(3 * 5 * 6),
    )


def conv2d_groups_replicate():
    return nn.Sequential(
        nn.Conv2d(4, 4, 3, stride=(2, 1), padding=(1, 2), groups=2, padding_mode="replicate"),
        nn.ReLU(),
        nn.Conv2d(4, 2, 2, padding="valid", bias=False),
        *head(2 * 2 * 6),
    )


def conv2d_small_output():
    """Few output positions and many features: the fused squared norms use the Gram form."""
    return nn.Sequential(nn.Conv2d(3, 6, 3, stride=2), nn.Tanh(), *head(6 * 2 * 2))


def conv3d_dilated_groups():
    return nn.Sequential(
        nn.Conv3d(
            2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1), groups=2
        ),
        nn.ReLU(),
        *head(4 * 4 * 2 * 5),
    )


def conv3d_same_circular():
    return nn.Sequential(
        nn.Conv3d(2, 2, 2, padding="same", padding_mode="circular", bias=False),
        nn.Tanh(),
        *head(2 * 3 * 3 * 3, 2),
    )


def convtranspose1d():
    return nn.Sequential(
        nn.ConvTranspose1d(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
        nn.Tanh(),
        *head(4 * 10),
    )


def convtranspose2d():
    return nn.Sequential(
        nn.ConvTranspose2d(
            3,
            2,
            (3, 2),
            stride=(2, 3),
            padding=(1, 0),
            output_padding=(1, 2),
            dilation=(1, 2),
            bias=False,
        ),
        nn.ReLU(),
        *head(2 * 8 * 11),
    )


def convtranspose3d():
    return nn.Sequential(
        nn.ConvTranspose3d(2, 2, 2, stride=2, padding=(0, 1, 0), output_padding=(1, 0, 0)),
        nn.Sigmoid(),
        *head(2 * 5 * 2 * 4),
    )


class ConvResidual(nn.Module):
    """Custom forward: functional ReLU, a residual addition, ConvTranspose with output_size."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(3, 3, (2, 2), padding="same", padding_mode="reflect")
        self.up = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)
        self.fc = nn.Linear(2 * 6 * 7, 3)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = h + self.conv2(h)
        h = self.up(h, output_size=[6, 7])
        return self.fc(F.tanh(h).flatten(1))


PROBLEMS = [
    Problem(
        "conv1d-strided-dilated-groups",
        conv1d_strided,
        randn(4, 2, 9),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "conv1d-same-reflect-nobias",
        conv1d_same_reflect,
        randn(3, 2, 7),
        lambda: nn.MSELoss(reduction="sum"),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "conv2d-same-even-circular",
        conv2d_same_circular,
        randn(4, 2, 5, 6),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "conv2d-groups-replicate-valid",
        conv2d_groups_replicate,
        randn(3, 4, 6, 5),
        lambda: nn.MSELoss(),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "conv2d-small-output",
        conv2d_small_output,
        randn(4, 3, 5, 5),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "conv3d-dilated-groups",
        conv3d_dilated_groups,
        randn(3, 2, 4, 6, 4),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "conv3d-same-circular-nobias",
        conv3d_same_circular,
        randn(3, 2, 3, 3, 3),
        lambda: nn.MSELoss(),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "convtranspose1d-outpad-groups",
        convtranspose1d,
        randn(4, 2, 5),
        lambda: nn.MSELoss(reduction="sum"),
        tags={"first", "second", "hessian"},
    ),
    Problem(
        "convtranspose2d-outpad-dilated-nobias",
        convtranspose2d,
        randn(3, 3, 4, 3),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem(
        "convtranspose3d-outpad",
        convtranspose3d,
        randn(3, 2, 2, 2, 2),
        tags={"first", "second", "hessian", "kron"},
    ),
    Problem("conv-custom-residual", ConvResidual, randn(4, 2, 6, 7), tags={"first", "custom"}),
]
