"""Rules lent to modules for one sweep: the data-set layer's own conventions on backpack's engine.

Some quantities of the data-set layer are those of backpack's extensions with a layer's rule
changed: Kronecker factors under the published "expand" convention, a bias folded into the
weight's input factor, EK-FAC's diagonals in an eigenbasis. `lent` gives each target module,
for the duration of a block, a private subclass of its class (same forward, same parameters)
whose registered rule is a subclass of the module's own rule; the module's state for it (the
`state` of each target) sits in the module's `__dict__`. Only modules whose rule is exactly the
base rule are targets (a subclass with its own forward, or a parametrized weight, is not).

Kronecker factors (`KronState`):

- convolutions under "expand" follow the published definition (Grosse & Martens, 2016;
  Eschenhagen et al., 2023): output positions act as samples, `G = Σ_{v,n,l} s sᵀ` and
  `A = 1/(N L) Σ_{n,l} u uᵀ` over the `L` output positions (backpack's per-batch `KFLR`/`KFAC`
  extensions keep the original BackPACK's `G = Σ (Σ_l s)(Σ_l s)ᵀ`, `A = 1/N Σ_{n,l} u uᵀ`);
- `fold`: the bias is an appended constant-1 input, `Ã = [[A, m], [mᵀ, 1]]` with `m` the mean
  input (over samples and positions, for both conventions): the factors `[G, Ã]` of `[W | b]`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from backpack.core import device
from backpack.core.derivatives import convnd
from backpack.recording import PRIVATE_VIEW_OUTPUTS, SHAPE_ONLY_OUTPUTS, is_parametrized
from backpack.rules import find_rule
from backpack.rules.base import gram, register_rule
from backpack.rules.conv import ConvRule
from backpack.rules.linear import Conv1DRule, LinearRule

#: the module attribute holding a target's state during the block
FIELD = "_backpack_lent_state"

#: (module class, rule class) -> the private subclass
_SUBCLASSES: dict[tuple[type, type], type] = {}


def _subclass(cls: type, rule_cls: type) -> type:
    sub = _SUBCLASSES.get((cls, rule_cls))
    if sub is None:
        name = f"_{rule_cls.__name__.lstrip('_')}{cls.__name__}"
        sub = type(name, (cls,), {"__module__": __name__})
        register_rule(sub)(rule_cls)
        if cls in SHAPE_ONLY_OUTPUTS:
            SHAPE_ONLY_OUTPUTS.add(sub)
        if cls in PRIVATE_VIEW_OUTPUTS:
            PRIVATE_VIEW_OUTPUTS.add(sub)
        _SUBCLASSES[(cls, rule_cls)] = sub
    return sub


def state_of(module: nn.Module) -> Any:
    """The state a lent rule's module holds (see `lent`)."""
    return module.__dict__[FIELD]


@contextmanager
def lent(targets: Mapping[nn.Module, tuple[type, Any]]) -> Iterator[None]:
    """Every target module runs with its lent rule `(rule class, state)` inside the block."""
    swapped = []
    try:
        for module, (rule_cls, state) in targets.items():
            cls = type(module)
            find_rule(module)  # resolve classes registered by name (their output sets)
            module.__class__ = _subclass(cls, rule_cls)
            swapped.append((module, cls))
            module.__dict__[FIELD] = state
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
            module.__dict__.pop(FIELD, None)


def rule_is(module: nn.Module, rule_cls: type) -> bool:
    """Whether `module`'s rule is exactly `rule_cls` (not a subclass; no parametrization)."""
    if is_parametrized(module):
        return False
    return type(find_rule(module)) is rule_cls


# --- Kronecker factors -------------------------------------------------------------------------
class KronState:
    """How a target's Kronecker factors differ from its rule's.

    Attributes:
        fold: Fold the bias into the weight's input factor (`[G, Ã]` for the weight).
    """

    def __init__(self, fold: bool) -> None:
        self.fold = fold


def _augmented(a: Tensor, mean: Tensor) -> Tensor:
    """`[[A, m], [mᵀ, 1]]`."""
    top = torch.cat([a, mean[:, None]], dim=1)
    bottom = torch.cat([mean, mean.new_ones(1)])[None]
    return torch.cat([top, bottom], dim=0)


def _fold(result: dict, names: Any, mean: Tensor, module: nn.Module) -> dict:
    if state_of(module).fold and "weight" in result and "bias" in names:
        g, a = result["weight"]
        result["weight"] = [g, _augmented(a, mean.to(a.dtype))]
    return result


class _LinearKron(LinearRule):
    """`nn.Linear` with its bias folded into the weight's input factor."""

    def kron_factors(self, record, factors, names, approx="expand"):  # noqa: D102
        result = super().kron_factors(record, factors, names, approx)
        x = record.args[0]
        return _fold(result, names, x.reshape(-1, x.shape[-1]).mean(0), record.module)


class _Conv1DKron(Conv1DRule):
    """Transformers' `Conv1D` with its bias folded into the input factor (of `weight.T`)."""

    def kron_factors(self, record, factors, names, approx="expand"):  # noqa: D102
        result = super().kron_factors(record, factors, names, approx)
        x = record.args[0]
        return _fold(result, names, x.reshape(-1, x.shape[-1]).mean(0), record.module)


def _grid(record: Any) -> tuple[int, ...]:
    out = record.outputs[0]
    return tuple(out.shape[out.dim() - convnd.spatial_dims(record.module) :])


class _ConvKron(ConvRule):
    """A convolution under the published "expand" convention, its bias folded if asked."""

    def kron_output_gram(self, record, factors, approx="expand"):  # noqa: D102
        if approx != "expand":
            return super().kron_output_gram(record, factors, approx)
        f = self.input_and_factor(record, factors)[1]  # [V, N, C_out, *out]
        with device.products_like_convolutions(f):
            return gram(f.flatten(3).transpose(2, 3))  # output positions act as samples

    def kron_factors(self, record, factors, names, approx="expand"):  # noqa: D102
        result = super().kron_factors(record, factors, names, approx)
        module = record.module
        grid = _grid(record)
        positions = math.prod(grid)
        if approx == "expand" and "weight" in result and positions != 1:
            g, a = result["weight"]
            result["weight"] = [g, a / positions]
        if state_of(module).fold:
            x = self.input_and_factor(record, [None])[0]
            # the mean patch, from the patches of the summed input (unfolding is linear)
            u = self.unfolded_input(module, x.sum(0, keepdim=True), grid)  # [1, G, L, D]
            mean = u.sum(2).mean(1)[0] / (x.shape[0] * positions)
            result = _fold(result, names, mean, module)
        return result


#: each base rule's lent Kronecker rule
_KRON_RULES = {LinearRule: _LinearKron, Conv1DRule: _Conv1DKron, ConvRule: _ConvKron}


def kron_targets(
    model: nn.Module, approx: str, separate_weight_and_bias: bool
) -> tuple[dict[nn.Module, tuple[type, KronState]], dict[str, str]]:
    """The modules whose Kronecker factors differ from their rule's, and the folded biases.

    Returns `{module: (lent rule, state)}` and `{weight name: bias name}` of the modules whose
    bias is folded (Linear-like layers and convolutions with a trainable weight and bias, each
    used by this module only).
    """
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    targets: dict[nn.Module, tuple[type, KronState]] = {}
    folded: dict[str, str] = {}
    for prefix, module in model.named_modules():
        base = next((b for b in _KRON_RULES if rule_is(module, b)), None)
        if base is None:
            continue
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        fold = (
            not separate_weight_and_bias
            and isinstance(weight, nn.Parameter)
            and isinstance(bias, nn.Parameter)
            and weight.requires_grad
            and bias.requires_grad
            and uses[id(weight)] == 1
            and uses[id(bias)] == 1
        )
        if fold or (base is ConvRule and approx == "expand"):
            targets[module] = (_KRON_RULES[base], KronState(fold))
        if fold:
            dot = f"{prefix}." if prefix else ""
            folded[f"{dot}weight"] = f"{dot}bias"
    return targets, folded


def kron_layer(module: nn.Module) -> bool:
    """Whether `module` is a Linear-like layer or a convolution computed by its own rule."""
    return any(rule_is(module, base) for base in _KRON_RULES)
