"""Elementwise activations: second derivatives for the Hessian's residual terms.

Only the exact-Hessian extensions (DiagHessian, HMP) and PCHMP need these: for the GGN family,
autograd propagates through activations without any rule. `is_curvature_free` lists the modules
whose output is linear (or piecewise linear) in their input, which add no residual term.
`elementwise_derivative` gives φ'(z) of any elementwise module (with or without curvature); the
closed-form shortcuts of the residual terms and of KFRA use it to pass through activations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack.context import CTX
from backpack.custom_module.branching import ActiveIdentity, CatModule, SumModule
from backpack.custom_module.pad import Pad
from backpack.custom_module.permute import Permute
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing
from backpack.recording import IDEMPOTENT_ACTIVATIONS, Record
from backpack.rules.base import (
    cached_per_class,
    class_cache,
    class_match,
    clear_class_caches,
    is_instance_with_forward,
    keeps_forward_of,
    qualified_name,
)
from backpack.rules.conv import CONV_CLASSES


class ActivationRule:
    """φ''(z) of an elementwise activation, from the recorded input z."""

    def __init__(self, d2: Callable[[nn.Module, Tensor], Tensor]) -> None:
        self._d2 = d2

    def second_derivative(self, record: Record) -> Tensor:
        """φ'' at the recorded input, same shape as the input."""
        return self._d2(record.module, record.args[0])


def _sigmoid_d2(_: nn.Module, z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1 - s) * (1 - 2 * s)


def _tanh_d2(_: nn.Module, z: Tensor) -> Tensor:
    t = torch.tanh(z)
    return -2 * t * (1 - t * t)


def _logsigmoid_d2(_: nn.Module, z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return -s * (1 - s)


def _elu_d2(module: nn.Module, z: Tensor) -> Tensor:
    return torch.where(z > 0, torch.zeros_like(z), module.alpha * torch.exp(z))


def _selu_d2(_: nn.Module, z: Tensor) -> Tensor:
    alpha, scale = 1.6732632423543772, 1.0507009873554805
    return torch.where(z > 0, torch.zeros_like(z), scale * alpha * torch.exp(z))


def _celu_d2(module: nn.Module, z: Tensor) -> Tensor:
    return torch.where(z > 0, torch.zeros_like(z), torch.exp(z / module.alpha) / module.alpha)


def _softplus_d2(module: nn.Module, z: Tensor) -> Tensor:
    bz = module.beta * z
    s = torch.sigmoid(bz)
    d2 = module.beta * s * (1 - s)
    return torch.where(bz > module.threshold, torch.zeros_like(z), d2)


def _silu_d2(_: nn.Module, z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1 - s) * (2 + z * (1 - 2 * s))


def _gelu_d2(module: nn.Module, z: Tensor) -> Tensor:
    if module.approximate == "tanh":
        with torch.enable_grad():
            zz = z.detach().requires_grad_()
            (d1,) = torch.autograd.grad(F.gelu(zz, approximate="tanh").sum(), zz, create_graph=True)
            (d2,) = torch.autograd.grad(d1.sum(), zz)
        return d2
    pdf = torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5
    return pdf * (2 - z * z)


def _hardswish_d2(_: nn.Module, z: Tensor) -> Tensor:
    return torch.where((z > -3) & (z < 3), torch.full_like(z, 1 / 3), torch.zeros_like(z))


def _mish_d2(_: nn.Module, z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    t = torch.tanh(F.softplus(z))
    return (1 - t * t) * (2 * s + z * (s * (1 - s) - 2 * t * s * s))


def _softsign_d2(_: nn.Module, z: Tensor) -> Tensor:
    return -2 * torch.sign(z) / (1 + z.abs()) ** 3


_RULES: dict[type[nn.Module], ActivationRule] = {
    nn.Hardswish: ActivationRule(_hardswish_d2),
    nn.Mish: ActivationRule(_mish_d2),
    nn.Softsign: ActivationRule(_softsign_d2),
    nn.Sigmoid: ActivationRule(_sigmoid_d2),
    nn.Tanh: ActivationRule(_tanh_d2),
    nn.LogSigmoid: ActivationRule(_logsigmoid_d2),
    nn.ELU: ActivationRule(_elu_d2),
    nn.SELU: ActivationRule(_selu_d2),
    nn.CELU: ActivationRule(_celu_d2),
    nn.Softplus: ActivationRule(_softplus_d2),
    nn.SiLU: ActivationRule(_silu_d2),
    nn.GELU: ActivationRule(_gelu_d2),
}

#: piecewise linear modules that act on each entry separately (the activations in `_RULES` do too)
_ELEMENTWISE_PIECEWISE_LINEAR: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.ReLU6,
    nn.Hardtanh,
    nn.Hardsigmoid,
    nn.Threshold,
    nn.Identity,
)

#: modules that are linear or piecewise linear in their input (no residual curvature)
_CURVATURE_FREE: tuple[type[nn.Module], ...] = (
    nn.Linear,
    *CONV_CLASSES,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.Embedding,
    *_ELEMENTWISE_PIECEWISE_LINEAR,
    nn.Flatten,
    nn.Unflatten,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.ZeroPad1d,
    nn.ZeroPad2d,
    nn.ZeroPad3d,
    nn.ConstantPad1d,
    nn.ConstantPad2d,
    nn.ConstantPad3d,
    nn.ReflectionPad1d,
    nn.ReflectionPad2d,
    nn.ReflectionPad3d,
    nn.ReplicationPad1d,
    nn.ReplicationPad2d,
    nn.ReplicationPad3d,
    nn.modules.loss._Loss,
    SumModule,
    CatModule,
    ActiveIdentity,
    ScaleModule,
    Permute,
    Slicing,
    Pad,
    ReduceTuple,
)
_EXTRA_CURVATURE_FREE: list[type[nn.Module]] = []
#: the same by qualified name, for classes of packages backpack does not import (transformers,
#: timm); each is linear in its input (checked by a test building the class)
_CURVATURE_FREE_NAMES: set[str] = {
    "transformers.pytorch_utils.Conv1D",  # x @ W + b
    "timm.layers.layer_scale.LayerScale",  # x * gamma
    "timm.layers.layer_scale.LayerScale2d",
}
#: clamps: f(f(x)) = f(x) with the same derivative (see `IDEMPOTENT_ACTIVATIONS`)
IDEMPOTENT_ACTIVATIONS.update({nn.ReLU, nn.ReLU6, nn.Hardtanh})


def register_curvature_free(*module_classes: type[nn.Module] | str) -> None:
    """Declare module classes linear in their input (e.g. custom containers like SumModule).

    A class may be given by its qualified name (`"pkg.module.Class"`), which imports nothing.
    """
    for cls in module_classes:
        if isinstance(cls, str):
            _CURVATURE_FREE_NAMES.add(cls)
        else:
            _EXTRA_CURVATURE_FREE.append(cls)
    clear_class_caches()


def register_activation(module_class: type[nn.Module], d2: Callable[[nn.Module, Tensor], Tensor]):
    """Register φ'' for an elementwise activation module class."""
    _RULES[module_class] = ActivationRule(d2)
    clear_class_caches()


_ACTIVATION_RULE = class_cache()
_IS_CURVATURE_FREE = class_cache()


def find_activation_rule(module: nn.Module) -> ActivationRule | None:
    """The second-derivative rule of an elementwise activation module, if any.

    A subclass that overrides the activation's forward computes another function: no rule.
    """
    return cached_per_class(_ACTIVATION_RULE, module, lambda: class_match(module, _RULES))


def is_curvature_free(module: nn.Module) -> bool:
    """Whether the module adds no second-derivative term w.r.t. its input.

    Subclasses count only if they keep the listed class's forward.
    """
    return cached_per_class(_IS_CURVATURE_FREE, module, lambda: _curvature_free(type(module)))


def _curvature_free(cls: type) -> bool:
    named = [c for c in cls.__mro__ if qualified_name(c) in _CURVATURE_FREE_NAMES]
    classes = (*_CURVATURE_FREE, *_EXTRA_CURVATURE_FREE, *named)
    return any(issubclass(cls, c) and keeps_forward_of(cls, c) for c in classes)


_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def is_elementwise(module: nn.Module) -> bool:
    """Whether the module maps each input entry to one output entry by a fixed scalar function.

    Dropout counts only when it is the identity (eval mode or p = 0); in-place modules do not
    count (their recorded input is overwritten).
    """
    if getattr(module, "inplace", False):
        return False
    if is_instance_with_forward(module, _DROPOUT):
        return not module.training or module.p == 0
    if is_instance_with_forward(module, _ELEMENTWISE_PIECEWISE_LINEAR):
        return True
    return find_activation_rule(module) is not None


def elementwise_derivative(record: Record) -> Tensor | None:
    """φ'(z) at the recorded input of an elementwise module (same shape), None for other modules.

    Computed by autograd on the recorded input, so it is the derivative the backward pass uses
    (also at kinks such as ReLU's zero).
    """
    module = record.module
    if not is_elementwise(module) or len(record.args) != 1 or record.kwargs:
        return None
    z = record.args[0]
    if not isinstance(z, Tensor) or not z.dtype.is_floating_point:
        return None
    if is_instance_with_forward(module, (nn.Identity, *_DROPOUT)):
        return torch.ones_like(z)
    with torch.enable_grad(), CTX.internal():
        leaf = z.detach().requires_grad_()
        out = module(leaf)
        if out.shape != z.shape:
            return None
        (d1,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    return d1
