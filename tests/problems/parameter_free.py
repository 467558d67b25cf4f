"""Parameter-free layers inside small parametrized models, under non-default options.

Pooling (max, average, adaptive average), padding, dropout (eval mode and p=0 in train mode),
flatten, identity and elementwise activations sit between Linear/Conv layers so that the curvature
has to pass through them. The last problems vary the loss: BCEWithLogitsLoss, CrossEntropyLoss
with extra spatial axes, and CrossEntropyLoss with class weights, ignore_index and label smoothing.

Tags: {"first", "second", "hessian", "kron"} where every parametrized layer is a Linear layer on
2-D inputs. Models with convolutions lack "kron" while the convolution rule defines no
`kron_factors` (KFLR/KFAC raise NotImplementedError there); `pool-after-linear` covers pooling
under KFLR/KFAC meanwhile.
"""

import torch
from torch import nn

from problems import DTYPE, Problem, randn

ALL = {"first", "second", "hessian", "kron"}
CONV = ALL
CONV_OPTIONS: dict = {}


def with_head(body: list[nn.Module], in_shape: tuple[int, ...], classes: int = 3) -> nn.Sequential:
    """`body`, then Flatten(start_dim=1) and a Linear layer sized from a dry run."""
    with torch.no_grad():
        features = nn.Sequential(*body)(torch.zeros(1, *in_shape)).numel()
    return nn.Sequential(*body, nn.Flatten(start_dim=1), nn.Linear(features, classes))


def scaled_randn(scale: float, *shape: int):
    """Input builder: standard normal times `scale` (reaches saturating regions)."""
    return lambda: scale * torch.randn(*shape, dtype=DTYPE)


# --- pooling --------------------------------------------------------------------------------
def maxpool1d():
    body = [
        nn.Conv1d(2, 3, 3, padding=1),
        nn.MaxPool1d(3, stride=2, padding=1, dilation=2, ceil_mode=True),
    ]
    return with_head(body, (2, 10))


def maxpool2d():
    body = [
        nn.Conv2d(2, 2, 2),
        nn.ReLU(),
        nn.MaxPool2d((3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), ceil_mode=True),
    ]
    return with_head(body, (2, 7, 7))


def maxpool3d():
    body = [
        nn.Conv3d(1, 2, 2),
        nn.MaxPool3d(
            (2, 3, 2), stride=(2, 1, 2), padding=(0, 1, 1), dilation=(1, 2, 1), ceil_mode=True
        ),
    ]
    return with_head(body, (1, 4, 5, 4), classes=2)


def avgpool1d():
    body = [
        nn.Conv1d(2, 3, 2),
        nn.AvgPool1d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        nn.Tanh(),
    ]
    return with_head(body, (2, 9))


def avgpool2d():
    body = [
        nn.Conv2d(2, 2, 3, padding=1),
        nn.AvgPool2d((3, 2), stride=(2, 3), padding=1, ceil_mode=True, count_include_pad=False),
        nn.Sigmoid(),
    ]
    return with_head(body, (2, 6, 7))


def avgpool3d():
    body = [
        nn.Conv3d(1, 2, 2),
        nn.AvgPool3d(
            (2, 3, 2),
            stride=(1, 2, 2),
            padding=(1, 1, 0),
            ceil_mode=True,
            count_include_pad=False,
        ),
    ]
    return with_head(body, (1, 3, 6, 6), classes=2)


def avgpool2d_divisor():
    body = [
        nn.Conv2d(1, 2, 2),
        nn.AvgPool2d(2, stride=1, padding=1, count_include_pad=True, divisor_override=3),
        nn.ReLU(),
    ]
    return with_head(body, (1, 4, 3))


def adaptive1d():
    return with_head([nn.Conv1d(2, 3, 2), nn.AdaptiveAvgPool1d(3)], (2, 8))  # 7 -> 3


def adaptive2d():
    return with_head([nn.Conv2d(1, 2, 2), nn.AdaptiveAvgPool2d((3, 4))], (1, 6, 8))  # 5x7


def adaptive3d():
    body = [nn.Conv3d(1, 2, 2), nn.AdaptiveAvgPool3d((2, None, 3))]  # 3x4x5 -> 2x4x3
    return with_head(body, (1, 4, 5, 6), classes=2)


def pool_after_linear():
    """Pooling on Linear features reshaped to `[N, C, L]`: no convolution, so KFLR applies."""
    body = [
        nn.Linear(4, 16),
        nn.Unflatten(1, (2, 8)),
        nn.AvgPool1d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        nn.ReLU(),
        nn.MaxPool1d(2, stride=1, padding=1, dilation=2, ceil_mode=True),
    ]
    return with_head(body, (4,))


# --- padding, dropout -----------------------------------------------------------------------
def zeropad2d():
    body = [
        nn.Conv2d(2, 2, 2),
        nn.ZeroPad2d((1, 0, 2, 1)),
        nn.Conv2d(2, 2, 3, stride=2),
        nn.ELU(alpha=0.7),
    ]
    return with_head(body, (2, 4, 5))


def dropout_eval():
    return nn.Sequential(
        nn.Linear(5, 4),
        nn.Dropout(0.5),
        nn.ReLU(),
        nn.Linear(4, 4),
        nn.Dropout(0.3),
        nn.Linear(4, 3),
    ).eval()


def dropout_p0_train():
    return nn.Sequential(nn.Linear(5, 4), nn.Dropout(p=0.0), nn.Tanh(), nn.Linear(4, 3)).train()


# --- activations ----------------------------------------------------------------------------
def act_leaky_logsigmoid_elu():
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.LeakyReLU(negative_slope=0.2),
        nn.Linear(5, 4),
        nn.LogSigmoid(),
        nn.Linear(4, 4),
        nn.ELU(alpha=0.7),
        nn.Linear(4, 3),
    )


def act_selu_identity_softplus():
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.SELU(),
        nn.Identity(),
        nn.Linear(5, 4),
        nn.Softplus(beta=2, threshold=1.5),
        nn.Linear(4, 3),
    )


def act_silu_gelu():
    return nn.Sequential(
        nn.Linear(4, 4),
        nn.SiLU(),
        nn.Linear(4, 4),
        nn.GELU(),
        nn.Linear(4, 4),
        nn.GELU(approximate="tanh"),
        nn.Linear(4, 3),
    )


def act_celu_hardtanh_relu6():
    # inputs scaled by 8 so that ReLU6 saturates; Hardtanh(-0.5, 0.8) clips on both sides
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.ReLU6(),
        nn.Linear(5, 4),
        nn.CELU(alpha=0.5),
        nn.Linear(4, 4),
        nn.Hardtanh(min_val=-0.5, max_val=0.8),
        nn.Linear(4, 3),
    )


def act_relu_sigmoid_tanh_flatten():
    return nn.Sequential(
        nn.Flatten(start_dim=1),
        nn.Linear(6, 5),
        nn.ReLU(),
        nn.Linear(5, 4),
        nn.Sigmoid(),
        nn.Linear(4, 4),
        nn.Tanh(),
        nn.Linear(4, 3),
    )


# --- losses ---------------------------------------------------------------------------------
def bce_mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Softplus(), nn.Linear(5, 3))


def ce_spatial():
    """Output `[N, C=4, L=4]`: one cross-entropy term per position."""
    return nn.Sequential(
        nn.Conv1d(2, 2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool1d(2, stride=1),
        nn.Conv1d(2, 4, 2),
    )


def ce_weighted_mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 4))


def ce_weighted_loss():
    # reduction="sum": with class weights or ignored targets, torch's "mean" divides by the
    # summed target weights, while the brute-force reference divides by the number of terms
    weight = torch.tensor([0.5, 2.0, 1.0, 1.5], dtype=DTYPE)
    return nn.CrossEntropyLoss(weight=weight, ignore_index=2, label_smoothing=0.1, reduction="sum")


def ce_weighted_target(out):
    return torch.tensor([0, 2, 1, 3, 2, 1])[: out.shape[0]]


def conv_problem(problem_id, make_model, make_input, make_loss):
    """A problem with convolutions: no "kron" tag yet, and G is not the bias block."""
    return Problem(problem_id, make_model, make_input, make_loss, tags=CONV, options=CONV_OPTIONS)


def ce(reduction="mean"):
    return lambda: nn.CrossEntropyLoss(reduction=reduction)


def mse(reduction="mean"):
    return lambda: nn.MSELoss(reduction=reduction)


PROBLEMS = [
    conv_problem("maxpool1d-dilated-ceil", maxpool1d, randn(4, 2, 10), ce("mean")),
    conv_problem("maxpool2d-dilated-ceil", maxpool2d, randn(3, 2, 7, 7), mse("sum")),
    conv_problem("maxpool3d-dilated-ceil", maxpool3d, randn(3, 1, 4, 5, 4), ce("sum")),
    conv_problem("avgpool1d-ceil-nopadcount", avgpool1d, randn(4, 2, 9), mse("mean")),
    conv_problem("avgpool2d-ceil-nopadcount", avgpool2d, randn(3, 2, 6, 7), ce("mean")),
    conv_problem("avgpool3d-ceil-nopadcount", avgpool3d, randn(3, 1, 3, 6, 6), mse("sum")),
    conv_problem("avgpool2d-divisor", avgpool2d_divisor, randn(3, 1, 4, 3), ce("sum")),
    conv_problem("adaptiveavgpool1d", adaptive1d, randn(4, 2, 8), ce("sum")),
    conv_problem("adaptiveavgpool2d", adaptive2d, randn(3, 1, 6, 8), mse("mean")),
    conv_problem("adaptiveavgpool3d", adaptive3d, randn(3, 1, 4, 5, 6), ce("mean")),
    Problem("pool-after-linear", pool_after_linear, randn(4, 4), mse("sum"), tags=ALL),
    conv_problem("zeropad2d-asymmetric-elu", zeropad2d, randn(3, 2, 4, 5), mse("sum")),
    Problem("dropout-eval", dropout_eval, randn(5, 5), ce("sum"), tags=ALL),
    Problem("dropout-p0-train", dropout_p0_train, randn(5, 5), mse("mean"), tags=ALL),
    Problem(
        "act-leakyrelu-logsigmoid-elu",
        act_leaky_logsigmoid_elu,
        scaled_randn(2.0, 5, 4),
        ce("mean"),
        tags=ALL,
    ),
    Problem(
        "act-selu-identity-softplus",
        act_selu_identity_softplus,
        scaled_randn(2.0, 5, 4),
        mse("sum"),
        tags=ALL,
    ),
    Problem("act-silu-gelu", act_silu_gelu, scaled_randn(2.0, 5, 4), ce("sum"), tags=ALL),
    Problem(
        "act-celu-hardtanh-relu6",
        act_celu_hardtanh_relu6,
        scaled_randn(8.0, 5, 4),
        mse("mean"),
        tags=ALL,
    ),
    Problem(
        "act-relu-sigmoid-tanh-flatten",
        act_relu_sigmoid_tanh_flatten,
        randn(5, 2, 3),
        ce("mean"),
        tags=ALL,
    ),
    Problem("loss-bcewithlogits", bce_mlp, randn(5, 4), lambda: nn.BCEWithLogitsLoss(), tags=ALL),
    conv_problem("loss-ce-spatial", ce_spatial, randn(3, 2, 6), ce("mean")),
    Problem(
        "loss-ce-weight-ignore-smoothing",
        ce_weighted_mlp,
        randn(6, 4),
        ce_weighted_loss,
        ce_weighted_target,
        tags=ALL,
    ),
]
