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
    call_params,
    describe,
    get_param,
    is_parametrized,
    map_tensors,
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


class _SampleCalls:
    """A recorded call split into calls on single samples (a batch of one each)."""

    def __init__(self, rule: ModuleRule, record: Record, subsampling: Sequence[int] | None):
        module = self.module = record.module
        n = rule.batch_size(record)
        args, kwargs = record.args, record.kwargs

        def batched(t: Any) -> bool:
            """A tensor with the samples along axis 0, or a tuple/list of such (an RNN state)."""
            if isinstance(t, (tuple, list)):
                return bool(t) and all(batched(item) for item in t)
            return isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == n

        self.arg_dims = tuple(0 if batched(a) else None for a in args)
        kwarg_keys = [k for k, v in kwargs.items() if batched(v)]
        self.static_kwargs = {k: v for k, v in kwargs.items() if k not in kwarg_keys}
        self.index = None
        if subsampling is not None:
            index = self.index = torch.as_tensor(list(subsampling), device=_device(record))

            def select(t: Any) -> Any:
                return map_tensors(t, lambda x: x.index_select(0, index))

            args = tuple(select(a) if d == 0 else a for a, d in zip(args, self.arg_dims))
            kwargs = {k: (select(v) if k in kwarg_keys else v) for k, v in kwargs.items()}
        self.args = args
        self.batched_kwargs = {k: kwargs[k] for k in kwarg_keys}
        self.count = n if subsampling is None else len(subsampling)
        # running statistics that a training-mode forward updates are updated on copies
        self.buffers = (
            {k: b.clone() for k, b in module.named_buffers()} if module.training else {}
        )
        # 16-bit weights: the call runs in float32 like its promoted inputs (`_working`), the
        # parameters and buffers not differentiated too
        for k, t in (*module.named_parameters(), *module.named_buffers()):
            if t.dtype in (torch.float16, torch.bfloat16):
                self.buffers.setdefault(k, t.detach().float())

    def call(self, sample_args: tuple, sample_kwargs: dict, p: dict) -> tuple[Tensor, ...]:
        """The module on one sample with parameters `p`: its output tensors."""
        call_args = tuple(
            map_tensors(a, lambda x: x.unsqueeze(0)) if d == 0 else a
            for a, d in zip(sample_args, self.arg_dims)
        )
        call_kwargs = {
            k: map_tensors(v, lambda x: x.unsqueeze(0)) for k, v in sample_kwargs.items()
        }
        call_kwargs.update(self.static_kwargs)
        out = functional_call(self.module, {**self.buffers, **p}, call_args, call_kwargs)
        return tuple(tensors_in(out))

    def over_samples(self, fn: Callable[[tuple, dict, list], Any], per_sample: list) -> Any:
        """`fn(sample args, sample kwargs, [t[i] for t in per_sample])` for every sample, stacked.

        Vectorised with vmap; some modules cannot run under vmap (RNN cells fill their default
        state in place, ...) and get a Python loop over the samples, with the same numbers.
        """
        module, args, arg_dims, kwargs = self.module, self.args, self.arg_dims, self.batched_kwargs
        if type(module) not in _NO_VMAP:
            try:
                return vmap(fn, in_dims=(arg_dims, 0, 0), randomness="same")(
                    args, kwargs, per_sample
                )
            except (RuntimeError, ValueError, NotImplementedError):
                _NO_VMAP.add(type(module))
        rows = []
        for i in range(self.count):

            def pick(t: Any, i: int = i) -> Any:
                return map_tensors(t, lambda x: x[i])

            rows.append(
                fn(
                    tuple(pick(a) if d == 0 else a for a, d in zip(args, arg_dims)),
                    {k: pick(v) for k, v in kwargs.items()},
                    [t[i] for t in per_sample],
                )
            )
        if isinstance(rows[0], dict):
            return {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
        return tuple(torch.stack(parts) for parts in zip(*rows))


def _working(param: Tensor) -> Tensor:
    """A parameter as the fallback computes with it: detached, 16-bit ones in float32.

    Recorded 16-bit inputs are promoted to float32 before rules run (`Record.promote_half`), so
    the parameters follow: quantities of bf16/fp16 weights are computed and accumulated in
    float32, as the dedicated rules do.
    """
    param = param.detach()
    return param.float() if param.dtype in (torch.float16, torch.bfloat16) else param


def _device(record: Record) -> torch.device:
    tensor = next(tensors_in((record.args, tuple(record.kwargs.values()))), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class FuncRule(ModuleRule):
    """Per-sample gradients of an arbitrary module via `vmap(vjp(functional_call))`."""

    def mixes_samples(self, record: Record) -> bool:
        """Whether the call's samples are not independent (per-sample results are undefined).

        A batch normalisation inside using statistics of the batch, or any call whose samples
        give other outputs alone than within the batch (`samples_independent`).
        """
        if any(
            isinstance(m, nn.modules.batchnorm._BatchNorm)
            and (m.training or (m.running_mean is None and m.running_var is None))
            for m in record.module.modules()
        ):
            return True
        return not self.samples_independent(record)

    def samples_independent(self, record: Record) -> bool:
        """Whether each sample, run alone, gives its output of the recorded call (cached).

        The fallback computes a sample's gradient from a call on that sample alone, which is
        its gradient only if the call treats samples independently: batch statistics,
        `.item()` of a batch reduction, a branch on batch values or a random mask drawn anew
        (dropout in training mode) would give wrong numbers.
        Undecided (True) inside torch.func transforms and for shape-only records.
        """
        known = record.extra.get(_SAMPLES_INDEPENDENT)
        if known is not None:
            return known
        if record.shape_only or _inside_transform():
            return True
        calls = _SampleCalls(self, record, None)
        names = call_params(record)
        params = {k: _working(get_param(record.module, k)) for k in names}
        try:
            with torch.no_grad(), CTX.internal(), transformable(record.module):
                alone = calls.over_samples(
                    lambda a, k, _: calls.call(a, k, params), [torch.empty(calls.count, 0)]
                )
                recorded = record.output_structure
                if record.outputs_modified():
                    # an in-place operation after the call (`nn.ReLU(inplace=True)`) changed the
                    # recorded output: the batch's output is computed again
                    recorded = functional_call(
                        record.module,
                        {**calls.buffers, **params},
                        record.args,
                        record.kwargs,
                    )
        except Exception:  # noqa: BLE001 - cannot run per sample at all: the rules will say so
            return True
        independent = _same_outputs(alone, list(tensors_in(recorded)))
        record.extra[_SAMPLES_INDEPENDENT] = independent
        return independent

    def _require_independent(self, record: Record) -> None:
        if not self.samples_independent(record):
            raise NotImplementedError(
                f"{describe(record.module)} gives another output for a sample alone than within "
                "its batch, so its samples are not independent (batch statistics, a reduction "
                "over the batch, a branch on batch values, or random operations such as dropout "
                "in training mode) and per-sample quantities are undefined for it."
            )

    def sqrt_factor(
        self,
        record: Record,
        factors: Sequence[Tensor | None],
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """Jᵀ f per factor column and sample, once the samples are known to be independent."""
        self._require_independent(record)  # here: per_sample_grads runs inside a vmap
        return super().sqrt_factor(record, factors, names, subsampling)

    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """Per-sample gradients for the parameters `names` of `record.module`."""
        self._require_independent(record)
        out_tensors = list(tensors_in(record.output_structure))
        cotangents = _cotangents(record, grad_outputs, out_tensors)
        calls = _SampleCalls(self, record, subsampling)
        if calls.index is not None:
            cotangents = [c.index_select(0, calls.index) for c in cotangents]
        params = {name: _working(get_param(record.module, name)) for name in names}

        def one_sample(sample_args: tuple, sample_kwargs: dict, sample_cots: list) -> dict:
            _, pullback = vjp(lambda p: calls.call(sample_args, sample_kwargs, p), params)
            return pullback(tuple(c.unsqueeze(0) for c in sample_cots))[0]

        with torch.enable_grad(), CTX.internal(), transformable(record.module):
            return calls.over_samples(one_sample, cotangents)


#: `Record.extra` key: whether the call's samples give their outputs alone (`samples_independent`)
_SAMPLES_INDEPENDENT = "generic_samples_independent"
#: module classes whose functional calls failed under vmap (the per-sample loop serves them)
_NO_VMAP: set[type] = set()


def _inside_transform() -> bool:
    """Whether a torch.func transform is running (its tensors cannot be compared to values)."""
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None


#: relative deviation of a sample's output computed alone from its output in the batch beyond
#: which the module is taken to couple its samples (16-bit forwards round to about 4e-3)
_ALONE_TOLERANCE = {torch.float64: 1e-8}
_ALONE_TOLERANCE_DEFAULT = 1e-2


def _same_outputs(alone: tuple[Tensor, ...], recorded: list[Tensor]) -> bool:
    """Whether outputs of single-sample calls `[N, 1, ...]` match the recorded batch outputs."""
    for computed, expected in zip(alone, recorded):
        if computed.dim() < 2 or computed.shape[1] != 1 or computed.shape[0] != expected.shape[0]:
            continue
        computed = computed.squeeze(1)
        if computed.shape != expected.shape or not expected.is_floating_point():
            continue
        scale = max(expected.abs().max().item(), 1e-30)
        tol = _ALONE_TOLERANCE.get(expected.dtype, _ALONE_TOLERANCE_DEFAULT) * scale
        if (computed.to(expected.dtype) - expected).abs().max() > tol:
            return False
    return True


#: module classes whose functional calls failed under vmap (the per-sample loop serves them)
_NO_VMAP: set[type] = set()


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
    primal = _working(get_param(module, name))

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
    primal = _working(get_param(module, name))
    with torch.enable_grad(), CTX.internal(), transformable(module):
        outputs, pullback = vjp(f, primal)
        k = next(c for c in cotangents if c is not None).shape[0]
        filled = [
            torch.zeros(k, *o.shape, dtype=o.dtype, device=o.device) if c is None else c
            for c, o in zip(cotangents, outputs)
        ]
        return vmap(lambda *cs: pullback(tuple(cs))[0])(*filled)
