"""`.grad` of convolution parameters as the sum of their per-sample gradients.

First-order extensions form the per-sample gradients of a convolution's weight (`BatchGrad`
stores them, `BatchL2Grad`, `SumGradSquared` and `Variance` square them chunk by chunk), and
their sum over samples is the gradient. Autograd would compute it a second time, a weight
backward as expensive as the per-sample one. A `backward()` inside `with backpack(...)` with
first-order extensions alone therefore asks autograd only for the other leaves
(`backward(inputs=...)`, which skips the weight backward), and sets `.grad` of these parameters
from the per-sample gradients afterwards (`_Quantities.gradient` in the engine). The result
equals autograd's up to the order of summation (rounding).

A parameter qualifies only where that is exactly its gradient: every use in the graph is the
convolution of an extended module that records it (`ConvolutionBackward0` carrying the
module's record), and no hook waits for its gradient. Where the call's input needs no
gradient (a first layer), the node's output edge is requested too, so that autograd still runs
the node's pre-hook, where the engine computes the per-sample gradients (see `plan`).

Autograd does not run the parameter's gradient accumulator then, so hooks registered on that
node itself (not on the tensor) would not run. Tensor hooks are detected; accumulator hooks
are what `torch.distributed` (DDP, FSDP) and Horovod register, so the derivation is off while
either is in use. Set `ENABLED = False` to keep autograd's own sum everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from backpack.recording import _META_KEY, walk_nodes
from backpack.rules.conv import CONV_CLASSES

ENABLED: bool = True
"""Whether first-order extensions alone sum convolution `.grad`s from the per-sample gradients
where that is exact (True by default; False keeps autograd's own gradient everywhere)."""

#: autograd nodes whose parameter edges come from exactly one convolution call
_CONV_NODES = ("ConvolutionBackward0",)
#: convolution node inputs: (input, weight, bias)
_WEIGHT, _BIAS = 1, 2
#: the forwards whose single convolution op the rules describe (a subclass that overrides
#: `forward` may feed the op something else than its recorded input)
_CONV_FORWARDS = {cls.forward for cls in CONV_CLASSES}


def accumulator_hooks_unlikely() -> bool:
    """False while a library that hooks gradient accumulators is in use (DDP, Horovod)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    return "horovod.torch" not in sys.modules


def _hooked(param: Tensor) -> bool:
    """Whether something waits for `param`'s gradient (tensor or post-accumulate hooks)."""
    return bool(getattr(param, "_backward_hooks", None)) or bool(
        getattr(param, "_post_accumulate_grad_hooks", None)
    )


def _recorded_conv_use(
    node: Any, index: int, param: Tensor, allowed: Callable[[nn.Module], bool]
) -> tuple[bool, bool]:
    """Whether edge `index` of `node` is `param`'s use by a recorded convolution module call.

    Also returns whether that call's input needs no gradient (a first layer).
    """
    if node.name() not in _CONV_NODES or index not in (_WEIGHT, _BIAS):
        return False, False
    for record, _, _ in node.metadata.get(_META_KEY, ()):
        module = record.module
        if record.disabled or record.freed or type(module).forward not in _CONV_FORWARDS:
            continue
        if not allowed(module):
            continue
        owned = module.weight if index == _WEIGHT else module.bias
        if owned is param:
            edges = record.input_edges
            return True, not edges or edges[0] is None
    return False, False


def plan(
    roots: list[Tensor], allowed: Callable[[nn.Module], bool]
) -> tuple[list[Tensor], list[Tensor]] | None:
    """The leaves to request from autograd and the parameters whose `.grad` is derived.

    `allowed(module)` says whether the engine computes the module's per-sample gradients
    itself. None if no parameter qualifies (then the backward runs unchanged).
    """
    stack = [t.grad_fn for t in roots if isinstance(t, Tensor) and t.grad_fn is not None]
    if len(stack) != len(roots):
        return None
    leaves: dict[int, Tensor] = {}
    #: id(leaf) -> whether every use seen so far is a recorded convolution call
    qualifies: dict[int, bool] = {}
    #: id(leaf) -> nodes of its uses whose input needs no gradient
    first_layer_nodes: dict[int, list[Any]] = {}
    for node in walk_nodes(stack):
        for index, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            leaf = getattr(child, "variable", None)
            if leaf is None:
                stack.append(child)
                continue
            key = id(leaf)
            leaves[key] = leaf
            use_ok, first_layer = _recorded_conv_use(node, index, leaf, allowed)
            qualifies[key] = qualifies.get(key, True) and use_ok
            if first_layer:
                first_layer_nodes.setdefault(key, []).append(node)
    derived = [
        leaf
        for key, leaf in leaves.items()
        if qualifies[key]
        and isinstance(leaf, nn.Parameter)
        and leaf.requires_grad
        and not leaf.is_sparse
        and leaf.is_contiguous()
        and not _hooked(leaf)
        and (leaf.grad is None or (leaf.grad.is_contiguous() and not leaf.grad.is_sparse))
    ]
    if not derived:
        return None
    chosen = {id(p) for p in derived}
    requested: list[Any] = [leaf for key, leaf in leaves.items() if key not in chosen]
    # a call whose input needs no gradient: asked for no leaf behind its node, autograd would
    # skip the node and its pre-hook; asking for the gradient at the node's output runs the
    # pre-hook without the weight backward
    nodes: dict[int, Any] = {}
    for key in chosen:
        for node in first_layer_nodes.get(key, ()):
            nodes[id(node)] = node
    requested.extend(GradientEdge(node, 0) for node in nodes.values())
    return requested, derived


def assign(derived: list[Tensor], sums: dict[int, Tensor]) -> None:
    """Accumulate each derived parameter's summed per-sample gradients into its `.grad`."""
    missing = [p for p in derived if id(p) not in sums]
    if missing:
        raise RuntimeError(
            "backpack: the per-sample gradients of some convolution parameters were not "
            "computed, so their .grad cannot be derived from them. This is a bug in backpack; "
            "set backpack.grads_from_samples.ENABLED = False to work around it."
        )
    with torch.no_grad():
        for p in derived:
            total = sums[id(p)].to(p.dtype)
            if p.grad is None:
                p.grad = total
            else:
                p.grad.add_(total)
