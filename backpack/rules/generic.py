"""Generic per-sample gradients for any module, through `torch.func`.

For a module without a dedicated rule, the per-sample gradient of sample n is the vector-Jacobian
product of that sample's output gradient with a single-sample functional call of the module.
`vmap` batches these products over the samples. This is slower than a hand-written rule (it reruns
the module's forward) but exact for any module whose samples are independent.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap
from torch.nn.utils import parametrize

from backpack.context import CTX
from backpack.recording import (
    Record,
    get_param,
    is_parametrized,
    reparametrization_hooks,
    tensors_in,
)
from backpack.rules.base import GradOutputs, ModuleRule, Names


@contextmanager
def transformable(module: nn.Module) -> Iterator[None]:
    """Make `module` safe to call inside torch.func transforms (vmap, jvp, vjp).

    cuDNN's RNN kernels support none of them, so for a module containing an RNN cuDNN is off
    for the duration; fused attention kernels have no forward-mode derivative, so attention
    runs with the math kernel.
    """
    with ExitStack() as stack:
        modules = list(module.modules())
        if torch.backends.cudnn.enabled and any(isinstance(m, nn.RNNBase) for m in modules):
            stack.enter_context(torch.backends.cudnn.flags(enabled=False))
        if any(isinstance(m, nn.MultiheadAttention) for m in modules):
            stack.enter_context(_math_attention())
        if any(is_parametrized(m) for m in modules):
            stack.enter_context(_parametrizations_as_in_forward(modules))
        yield


@contextmanager
def _parametrizations_as_in_forward(modules: list[nn.Module]) -> Iterator[None]:
    """Parametrized tensors recomputed as the forward computed them, from the given parameters.

    Parametrizations run in eval mode: in training mode some update state when called
    (spectral_norm's power iteration), which would change the tensor and the user's buffers;
    after the forward's update, eval mode computes the tensor the forward used. The cache of
    `parametrize.cached()` is off, or it would return the forward's tensor whatever parameters
    the transforms pass in.
    """
    inside = [
        m
        for p in modules
        if "parametrizations" in p._modules
        for m in p.parametrizations.modules()
        if m.training
    ]
    # the older weight_norm/spectral_norm hooks set a plain attribute at every call (which the
    # transforms would leave holding one of their tensors); spectral_norm iterates in training
    old_style = [(m, h) for m in modules for h in reparametrization_hooks(m)]
    saved = [(m, h.name, m.__dict__.get(h.name), m.training) for m, h in old_style]
    cache_depth = getattr(parametrize, "_cache_enabled", 0)
    try:
        for m in inside:
            m.training = False
        for m, hook in old_style:
            if hasattr(hook, "n_power_iterations"):  # spectral_norm's
                m.training = False
        parametrize._cache_enabled = 0
        yield
    finally:
        for m in inside:
            m.training = True
        for m, name, value, training in saved:
            m.training = training
            if value is not None:
                m.__dict__[name] = value
        parametrize._cache_enabled = cache_depth


def _math_attention() -> Any:
    """`scaled_dot_product_attention` with its math kernel (differentiable in every mode)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - torch < 2.3
        return nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def _cotangents(record: Record, grad_outputs: GradOutputs, out_tensors: list[Tensor]) -> list:
    """Align the recorded output gradients with all tensors of the output structure."""
    grads = iter(grad_outputs)
    cotangents = []
    for needs_grad, out in zip(record.out_requires_grad, out_tensors):
        g = next(grads) if needs_grad else None
        cotangents.append(torch.zeros_like(out) if g is None else g)
    return cotangents


class FuncRule(ModuleRule):
    """Per-sample gradients of an arbitrary module via `vmap(vjp(functional_call))`."""

    def mixes_samples(self, record: Record) -> bool:
        """Whether a batch normalisation in the module uses statistics of the batch.

        One sample alone would be normalised with its own statistics: per-sample results of
        such a call are undefined (e.g. a BatchNorm subclass with its own forward).
        """
        return any(
            isinstance(m, nn.modules.batchnorm._BatchNorm)
            and (m.training or (m.running_mean is None and m.running_var is None))
            for m in record.module.modules()
        )

    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """Per-sample gradients for the parameters `names` of `record.module`."""
        module = record.module
        n = self.batch_size(record)
        out_tensors = list(tensors_in(record.output_structure))
        cotangents = _cotangents(record, grad_outputs, out_tensors)
        params = {name: get_param(module, name).detach() for name in names}
        args, kwargs = record.args, record.kwargs

        def batched(t: Any) -> bool:
            return isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == n

        arg_dims = tuple(0 if batched(a) else None for a in args)
        kwarg_keys = [k for k, v in kwargs.items() if batched(v)]
        static_kwargs = {k: v for k, v in kwargs.items() if k not in kwarg_keys}
        if subsampling is not None:
            index = torch.as_tensor(subsampling, device=cotangents[0].device)
            args = tuple(a.index_select(0, index) if d == 0 else a for a, d in zip(args, arg_dims))
            kwargs = {
                k: (v.index_select(0, index) if k in kwarg_keys else v) for k, v in kwargs.items()
            }
            cotangents = [c.index_select(0, index) for c in cotangents]

        def one_sample(sample_args: tuple, sample_kwargs: dict, sample_cots: list) -> dict:
            call_args = tuple(
                a.unsqueeze(0) if d == 0 else a for a, d in zip(sample_args, arg_dims)
            )
            call_kwargs = {k: v.unsqueeze(0) for k, v in sample_kwargs.items()}
            call_kwargs.update(static_kwargs)

            def f(p: dict) -> tuple[Tensor, ...]:
                out = functional_call(module, p, call_args, call_kwargs)
                return tuple(tensors_in(out))

            _, pullback = vjp(f, params)
            return pullback(tuple(c.unsqueeze(0) for c in sample_cots))[0]

        batched_kwargs = {k: kwargs[k] for k in kwarg_keys}
        with torch.enable_grad(), CTX.internal(), transformable(module):
            return vmap(one_sample, in_dims=(arg_dims, 0, 0), randomness="same")(
                args, batched_kwargs, cotangents
            )


def _functional_outputs(
    module: nn.Module, args: tuple, kwargs: dict, name: str, requires_grad: tuple[bool, ...]
) -> Callable[[Tensor], tuple[Tensor, ...]]:
    """The module's differentiable outputs as a function of one parameter."""
    # modules updating buffers in training mode (running statistics) update copies
    buffers = {k: b.clone() for k, b in module.named_buffers()} if module.training else {}

    def f(value: Tensor) -> tuple[Tensor, ...]:
        out = functional_call(module, {**buffers, name: value}, args, kwargs)
        return tuple(t for t, rg in zip(tensors_in(out), requires_grad) if rg)

    return f


_JVP_READY: list[bool] = []


def _load_jvp_decompositions() -> None:
    """Import what torch's forward-mode AD loads on first use, without its deprecation noise.

    torch builds these decompositions with `torch.jit.script`, which warns (FutureWarning)
    in recent versions; the warning is about torch's internals, not the user's code.
    """
    if _JVP_READY:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*torch.jit.script.*", FutureWarning)
        try:
            import torch._decomp.decompositions_for_jvp  # noqa: F401
        except ImportError:  # pragma: no cover - other torch versions
            pass
    _JVP_READY.append(True)


def jvp_outputs(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    name: str,
    tangents: Tensor,
    requires_grad: tuple[bool, ...],
) -> list[Tensor]:
    """J·M_k for each slice of `tangents` (`[K, *param.shape]`): `[K, *out_i]` per output."""
    _load_jvp_decompositions()
    f = _functional_outputs(module, args, kwargs, name, requires_grad)
    primal = get_param(module, name).detach()

    def one(tangent: Tensor) -> tuple[Tensor, ...]:
        return jvp(f, (primal,), (tangent,))[1]

    with torch.enable_grad(), CTX.internal(), transformable(module):
        try:
            return list(vmap(one)(tangents))
        except NotImplementedError:
            # a kernel without forward-mode derivative (e.g. CUDA's fused LSTM cell)
            return _jvp_reverse_over_reverse(f, primal, tangents)


def _jvp_reverse_over_reverse(
    f: Callable[[Tensor], tuple[Tensor, ...]], primal: Tensor, tangents: Tensor
) -> list[Tensor]:
    """`jvp_outputs` with reverse mode only: J·t is the derivative of u -> Jᵀu along t."""
    p = primal.detach().requires_grad_()
    outs = f(p)
    dummies = [torch.zeros_like(o, requires_grad=True) for o in outs]
    (jt_u,) = torch.autograd.grad(outs, p, dummies, create_graph=True)
    columns = []
    for tangent in tangents:
        grads = torch.autograd.grad(jt_u, dummies, tangent, retain_graph=True, allow_unused=True)
        columns.append([torch.zeros_like(d) if g is None else g for g, d in zip(grads, dummies)])
    return [torch.stack([c[i] for c in columns]) for i in range(len(outs))]


def vjp_params(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    name: str,
    cotangents: list[Tensor | None],
    requires_grad: tuple[bool, ...],
) -> Tensor:
    """Jᵀ·c_k summed over samples for each slice k of the output cotangents."""
    f = _functional_outputs(module, args, kwargs, name, requires_grad)
    primal = get_param(module, name).detach()
    with torch.enable_grad(), CTX.internal(), transformable(module):
        outputs, pullback = vjp(f, primal)
        k = next(c for c in cotangents if c is not None).shape[0]
        filled = [
            torch.zeros(k, *o.shape, dtype=o.dtype, device=o.device) if c is None else c
            for c, o in zip(cotangents, outputs)
        ]
        return vmap(lambda *cs: pullback(tuple(cs))[0])(*filled)
