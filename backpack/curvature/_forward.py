"""What a sweep needs of the model's forward: one fixed function of the parameters.

A data-set quantity sums what each batch's forward and backward give. It is the quantity of the
data-set loss only if every forward computes the same function of the parameters, and an operator
is one fixed matrix only if every product's sweep sees that function. Refused here, with what to
do instead:

- layers whose gradient is not the derivative of the loss (`scale_grad_by_freq`), or whose
  forward changes the parameters (`max_norm` rows that would be renormalised);
- for the operators whose products sweep the data (`GGN`, `Hessian`, `EmpiricalFisher`): batch
  statistics (BatchNorm in training mode) and random forwards (dropout in training mode), unless
  `forward_seed` holds the random draws fixed: every sweep then starts from that seed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from backpack.rules.generic import transformable

#: embedding layers with `padding_idx`, `max_norm`, `scale_grad_by_freq` and `sparse`
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def _label(name: str, module: nn.Module) -> str:
    return f"{name or '<model>'!r} ({type(module).__name__})"


def refuse_unfaithful_gradients(model: nn.Module, what: str) -> None:
    """Raise for layers whose swept quantities would not be those of the data-set loss.

    - `scale_grad_by_freq=True`: autograd divides the weight's gradient by how often each index
      occurs in the batch. That is not a derivative of the loss, and it depends on how the data
      is split into batches (the one-batch quantity counts over the whole data set).
    - `max_norm` with rows whose norm exceeds it: the forward renormalises the rows it looks up in
      place, so the parameters would change during the sweep.

    Raises:
        ValueError: Naming the layer and the fix.
    """
    for name, module in model.named_modules():
        if not isinstance(module, _EMBEDDINGS):
            continue
        if module.scale_grad_by_freq:
            raise ValueError(
                f"{what}: {_label(name, module)} has scale_grad_by_freq=True: autograd divides "
                "its weight gradient by how often each index occurs in the batch, so that "
                "gradient is not the derivative of the loss and the data set's quantities would "
                "depend on how the data is split into batches. The loss does not depend on the "
                f"flag: set `scale_grad_by_freq = False` on {name or 'the model'!r} for the "
                "sweep to get the data-set loss's gradient and curvature."
            )
        if module.max_norm is not None:
            with torch.no_grad():
                norms = module.weight.detach().norm(p=module.norm_type, dim=1)
            if bool((norms > module.max_norm).any()):
                raise ValueError(
                    f"{what}: {_label(name, module)} has max_norm={module.max_norm} and rows "
                    "whose norm exceeds it: its forward renormalises the rows it looks up in "
                    "place, so the parameters would change during the sweep. Renormalise every "
                    "row first, e.g. `with torch.no_grad(): layer(torch.arange("
                    "layer.num_embeddings, device=layer.weight.device))`."
                )


def _batch_statistics(module: nn.Module) -> bool:
    """Whether a batch normalisation layer normalises with the statistics of its batch."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False
    return module.training or not module.track_running_stats


def _random_layers(model: nn.Module) -> list[str]:
    """Layers known to draw random numbers in their forward (dropout in training mode, ...)."""
    found = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        p = 0.0
        if isinstance(m, nn.modules.dropout._DropoutNd):
            p = m.p
        elif isinstance(m, nn.MultiheadAttention):
            p = m.dropout
        elif isinstance(m, nn.RNNBase) and m.num_layers > 1:
            p = m.dropout
        elif isinstance(m, nn.RReLU):
            p = 1.0
        if p > 0:
            found.append(_label(name, m))
    return found


def refuse_unfixed_forward(model: nn.Module, what: str, forward_seed: int | None) -> None:
    """Raise for a forward that is not one fixed function (operators whose products sweep).

    Batch statistics are always refused; random layers unless `forward_seed` is given.

    Raises:
        ValueError: Naming the layers and `model.eval()`.
    """
    mixing = [_label(n, m) for n, m in model.named_modules() if _batch_statistics(m)]
    if mixing:
        raise ValueError(
            f"{what}: the model normalises with the statistics of each batch ({', '.join(mixing)}"
            " in training mode, or with track_running_stats=False), so the samples are mixed, a "
            "product would depend on how the data is batched and every forward would update the "
            "running statistics. Call model.eval() (with track_running_stats=True, so that the "
            "running statistics are used)."
        )
    random = _random_layers(model)
    if random and forward_seed is None:
        raise ValueError(_random_message(what, ", ".join(random)))


def _random_message(what: str, layers: str) -> str:
    return (
        f"{what}: the model's forward is random ({layers}): every product sweeps the data "
        "again and would draw new dropout masks, so the operator would not be one fixed matrix. "
        f"Call model.eval(), or pass forward_seed=<int> to {what} to hold the random draws "
        "fixed (every sweep then draws the same masks for each batch, from that seed)."
    )


def _generators(device: torch.device) -> list[torch.Generator]:
    generators = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    return generators


@contextmanager
def fixed_forward(
    model: nn.Module, what: str, forward_seed: int | None, device: torch.device, rank: int = 0
) -> Iterator[None]:
    """Every forward of `model` inside the block computes the same function of the parameters.

    With `forward_seed`, the global random generators are forked and seeded with
    `forward_seed + rank`: a sweep run inside draws the same random numbers as any other (the
    same dropout masks for each batch). Without, a forward that draws random numbers raises
    (the random generators' states are compared around each call of `model`).

    Raises:
        ValueError: From a forward that drew random numbers (without `forward_seed`).
    """
    devices = [device] if device.type == "cuda" else []
    if forward_seed is not None:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(forward_seed + rank)
            yield
        return
    generators = _generators(device)
    before: list[list[torch.Tensor]] = []

    def pre_hook(module, args):
        before.append([g.get_state() for g in generators])

    def hook(module, args, output):
        states = before.pop()
        if any(not torch.equal(s, g.get_state()) for s, g in zip(states, generators)):
            raise ValueError(_random_message(what, "it drew random numbers"))

    with ExitStack() as stack:
        stack.callback(model.register_forward_pre_hook(pre_hook).remove)
        stack.callback(model.register_forward_hook(hook).remove)
        yield


@contextmanager
def product_forward(model: nn.Module) -> Iterator[None]:
    """A forward whose graph can be differentiated twice, for the products by autograd.

    torch's kernels without a double backward are avoided (cuDNN's RNNs, fused attention, also
    called functionally; parametrizations run without their state updates), and embeddings with
    `sparse=True` give dense gradients (the layout of `.grad` is all the flag changes).
    """
    sparse = [m for m in model.modules() if isinstance(m, _EMBEDDINGS) and m.sparse]
    try:
        for m in sparse:
            m.sparse = False
        with transformable(model), sdpa_kernel([SDPBackend.MATH]), _composite_weight_norm(model):
            yield
    finally:
        for m in sparse:
            m.sparse = True


def _weight_normed(model: nn.Module) -> bool:
    from torch.nn.utils.parametrizations import _WeightNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for m in model.modules():
        if any(isinstance(h, WeightNorm) for h in m._forward_pre_hooks.values()):
            return True
        if isinstance(m, _WeightNorm):
            return True
    return False


def _twice_differentiable_weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0):
    """`torch._weight_norm`'s value by its composite formula, whose double backward is right."""
    return v * (g / torch.norm_except_dim(v, 2, dim))


@contextmanager
def _composite_weight_norm(model: nn.Module) -> Iterator[None]:
    """Weight normalisation computed by its composite formula inside the block.

    torch's fused kernel (`_weight_norm_interface`, used for dim 0 or the last one) saves the
    norms as outputs without a derivative: its double backward misses how they depend on `v`,
    so the Hessian by reverse over reverse is wrong (not even symmetric). The composite formula
    is the same function, differentiable twice.
    """
    if not _weight_normed(model):
        yield
        return
    old_style = sys.modules["torch.nn.utils.weight_norm"]
    saved = (torch._weight_norm, old_style._weight_norm)
    torch._weight_norm = old_style._weight_norm = _twice_differentiable_weight_norm
    try:
        yield
    finally:
        torch._weight_norm, old_style._weight_norm = saved
