"""The first-order pass: per-sample gradients and their reductions, stored on parameters.

For each recorded call that the backward reaches, the call's rule computes what the active
first-order extensions need (fused where it can skip per-sample gradients). A parameter used by
several calls of the pass gets the quantities of its summed per-sample gradient: contributions
wait in an accumulator until every use has reported or the pass ends.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from backpack.core import device
from backpack.extensions.backprop_extension import FAIL_ERROR, FAIL_SILENT, BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.passes.coverage import cover, due_for_check
from backpack.passes.state import (
    BackwardState,
    mixing_message,
    normalises_with_batch,
)
from backpack.passes.views import place
from backpack.recording import (
    Record,
    call_params,
    describe,
    is_parametrized,
    promote_half,
)
from backpack.rules import find_rule
from backpack.rules.base import ModuleRule, overridden_base
from backpack.rules.generic import FuncRule
from backpack.variance import centred_squares

_WARNED_GENERIC: set[type] = set()


def _unsupported_warning(ext: BackpropExtension, module: nn.Module) -> str:
    return (
        f"Extension saving to {ext.savefield} does not have an extension for "
        f"Module {module.__class__} although the module has parameters"
    )


class _Quantities:
    """Lazily computed first-order quantities of one module call (or of accumulated uses)."""

    def __init__(
        self,
        rule: ModuleRule | None,
        record: Record | None,
        grads: tuple,
        names: list[str],
        batch_size: int,
        psg: dict[str, Tensor] | None = None,
    ) -> None:
        self.rule, self.record, self.grads, self.names = rule, record, grads, names
        self.n = batch_size
        self._psg = psg
        self._cache: dict[str, dict[str, Tensor]] = {}

    def psg(self) -> dict[str, Tensor]:
        if self._psg is None:
            self._psg = self.rule.per_sample_grads(self.record, self.grads, self.names)
        return self._psg

    def _fused(self, which: str) -> dict[str, Tensor] | None:
        if self.rule is None:
            return None
        return getattr(self.rule, which)(self.record, self.grads, self.names)

    def get(self, which: str, subsampling: Sequence[int] | None = None) -> dict[str, Tensor]:
        key = which if subsampling is None else f"{which}{list(subsampling)}"
        if key not in self._cache:
            self._cache[key] = getattr(self, f"_{which}")(subsampling)
        return self._cache[key]

    def _grad_batch(self, subsampling: Sequence[int] | None) -> dict[str, Tensor]:
        if subsampling is None:
            return self.psg()
        if self._psg is None and self.rule is not None:
            return self.rule.per_sample_grads(self.record, self.grads, self.names, subsampling)
        index = torch.as_tensor(list(subsampling), dtype=torch.long)
        return {k: v[index.to(v.device)] for k, v in self.psg().items()}

    def _batch_l2(self, _: Any) -> dict[str, Tensor]:
        fused = self._fused("batch_l2")
        if fused is not None:
            return fused
        return {k: v.flatten(1).square().sum(1) for k, v in self.psg().items()}

    def _sum_grad_squared(self, _: Any) -> dict[str, Tensor]:
        m2, sums = self._cache.get("centred_squares"), self._cache.get("grad_sum")
        if m2 is not None and sums is not None:
            # computed for a variance already: Σg² = M2 + (Σg)²/N adds nonnegative terms
            return {k: sums[k].square().div_(self.n).add_(m2[k]) for k in m2}
        fused = self._fused("sum_grad_squared")
        if fused is not None:
            return fused
        return {k: v.square().sum(0) for k, v in self.psg().items()}

    def _batch_dot(self, _: Any) -> dict[str, Tensor]:
        fused = self._fused("batch_dot")
        if fused is not None:
            return fused
        return {k: v.flatten(1) @ v.flatten(1).T for k, v in self.psg().items()}

    def _grad_sum(self, _: Any) -> dict[str, Tensor]:
        fused = self._fused("grad_sum")
        if fused is not None:
            return fused
        return {k: v.sum(0) for k, v in self.psg().items()}

    def fuse_sums(self) -> bool:
        """Compute `grad_sum` and `sum_grad_squared` in one fused pass if the rule can."""
        if "grad_sum" in self._cache and "sum_grad_squared" in self._cache:
            return True
        if self.rule is None or self._psg is not None:
            return False
        fused = self.rule.grad_sum_and_squares(self.record, self.grads, self.names)
        if fused is None:
            return False
        self._cache["grad_sum"], self._cache["sum_grad_squared"] = fused
        return True

    def fuse_centred(self) -> bool:
        """Compute `grad_sum` and `centred_squares` in one fused pass if the rule can."""
        if "centred_squares" in self._cache:
            return True
        if self.rule is None or self._psg is not None:
            return False
        fused = self.rule.grad_sum_and_centred_squares(self.record, self.grads, self.names)
        if fused is None:
            return False
        self._cache.setdefault("grad_sum", fused[0])
        self._cache["centred_squares"] = fused[1]
        return True

    def fuse_gradient(self, wanted: set[str]) -> None:
        """Let the quantities in `wanted` bring this call's gradient along where the rule can.

        For `.grad` summed from per-sample gradients (`backpack.grads_from_samples`): the
        gradient then costs no weight backward of its own.
        """
        if self.rule is None or self._psg is not None or "grad_batch" in wanted:
            return  # the per-sample gradients are summed
        if "variance" in wanted and self.fuse_centred():
            return
        if "sum_grad_squared" in wanted and self.fuse_sums():
            return
        if "batch_l2" in wanted:
            fused = self.rule.batch_l2_and_sum(self.record, self.grads, self.names)
            if fused is not None:
                self._cache["batch_l2"], self._cache["grad_sum"] = fused

    def gradient(self) -> dict[str, Tensor]:
        """This call's gradient: summed per-sample gradients, fused sums, or the rule's own."""
        if self._psg is not None:
            return {k: v.sum(0) for k, v in self._psg.items()}
        return self.get("grad_sum")

    def _centred_squares(self, _: Any) -> dict[str, Tensor]:
        """Σ_n (g_n − ḡ)² (see `backpack.variance`): the rule's, else from per-sample gradients."""
        if self.fuse_centred():
            return self._cache["centred_squares"]
        sums, squares = {}, {}
        for k, v in self.psg().items():
            sums[k], squares[k] = centred_squares(v)
        self._cache.setdefault("grad_sum", sums)
        return squares

    def _variance(self, _: Any) -> dict[str, Tensor]:
        return {k: v / self.n for k, v in self.get("centred_squares").items()}


#: `Variance` computes a gradient sum itself below this many (sample, entry) products: the
#: coverage check that waiting for autograd's sum needs on every pass costs about 100 us of
#: Python per parameter, a product of this size about as much (2 CPU threads)
VARIANCE_WAIT_MIN_WORK = 2**23


def variance_waits_for_grad(param: Tensor, samples: int) -> bool:
    """Whether `Variance` takes a call's gradient sum from the parameter's own gradient.

    Autograd computes that sum anyway, so waiting for the parameter's hook saves the rule a GEMM
    (`ModuleRule.uses_grad_sums`), but costs a coverage check on every pass (the sum must hold
    only extended calls' contributions). That pays on the CPU for large products (`samples`
    times the parameter's size); on GPUs the check's small kernels and host syncs cost more
    than the GEMM (measured on an H100), so there the rule computes it.
    """
    return device.kind(param) == "cpu" and samples * param.numel() >= VARIANCE_WAIT_MIN_WORK


def _variance_given_sum(quantities: _Quantities, name: str, grad_sum: Tensor | None) -> Tensor:
    """A waiting variance of parameter `name`, with autograd's gradient sum (None: the rule's)."""
    given = None if grad_sum is None else {name: grad_sum}
    rule, record, grads = quantities.rule, quantities.record, quantities.grads
    _, squares = rule.grad_sum_and_centred_squares(record, grads, [name], given)
    return squares[name].div_(quantities.n)


def _store_empty_first_order(
    exts: list[FirstOrderBackpropExtension], params: dict[str, Tensor]
) -> None:
    """A call without samples: empty per-sample quantities, zero sums (variance included)."""
    for ext in exts:
        for p in params.values():
            if ext.quantity == "grad_batch":
                value = p.new_zeros(0, *p.shape)
            elif ext.quantity == "batch_l2":
                value = p.new_zeros(0)
            elif ext.quantity == "batch_dot":
                value = p.new_zeros(0, 0)
            else:
                value = torch.zeros_like(p)
            setattr(p, ext.savefield, value)


class _Accumulator:
    """Per-sample gradients of a parameter used by several calls of one backward pass.

    Calls holding the same samples (a module applied twice, siamese branches) add their rows;
    calls holding different samples (separate forwards and losses) fill their own rows.
    """

    def __init__(self, param: Tensor, expected_uses: int) -> None:
        self.param = param
        self.expected = expected_uses
        self.seen = 0
        self.parts: list[tuple[Tensor, tuple[int, int] | None, Record]] = []

    def add(self, psg: Tensor, placement: tuple[int, int] | None, record: Record) -> None:
        self.parts.append((psg, placement, record))
        self.seen += 1

    def per_sample_grads(self) -> Tensor | None:
        """All calls' per-sample gradients, as rows of the pass's samples."""
        if not self.parts:
            return None
        placed = [p for p in self.parts if p[1] is not None]
        if placed:
            total = placed[0][1][1]
            full = self.parts[0][0].new_zeros(total, *self.parts[0][0].shape[1:])
            for psg, (offset, _), _ in placed:
                full[offset : offset + psg.shape[0]] += psg
            return full
        sizes = {psg.shape[0] for psg, _, _ in self.parts}
        if len(sizes) > 1:
            calls = ", ".join(f"{describe(r.module)}: {p.shape[0]}" for p, _, r in self.parts)
            raise RuntimeError(
                "A parameter is used by several module calls of this backward pass that "
                f"process different numbers of samples ({calls}), and no extended loss function "
                "tells which samples they hold. Extend the loss function(s) "
                "(lossfunc = backpack.extend(lossfunc)): calls reaching different loss calls "
                "then hold different samples."
            )
        total = self.parts[0][0]
        for psg, _, _ in self.parts[1:]:
            total = total + psg
        return total


def run_first_order(state: BackwardState, record: Record, grads: tuple[Tensor | None, ...]) -> bool:
    """Compute first-order quantities of one call; True if some wait for other uses."""
    try:
        return _first_order_quantities(state, record, grads)
    except _SkipModule:
        return False


def _first_order_quantities(
    state: BackwardState, record: Record, grads: tuple[Tensor | None, ...]
) -> bool:
    module = record.module
    params = call_params(record)
    if not params:
        return False
    builtin = []
    for ext in state.extensions:
        user_ext = ext.get_module_extension(module)
        if user_ext is not None:
            _run_user_extension(state, user_ext, ext, record, grads)
        elif isinstance(ext, FirstOrderBackpropExtension):
            builtin.append(ext)
        elif not getattr(ext, "_engine_handles", False):
            _unsupported(state, ext, module)
    if not builtin:
        return False
    record.check_unmodified(builtin[0].__class__.__name__)
    sites = _captured_sites(state, record, params)
    if sites is not None:
        state.pending_sites.append((record, builtin, params, sites))
        return True  # the record stays until the end of the pass
    rule = _rule_for(state, record, builtin)
    if rule is None:
        return False
    if rule.mixes_samples(record):
        builtin = _check_sample_mixing(state, record, builtin)
        if not builtin:
            return False
    grads = tuple(torch.zeros_like(o) if g is None else g for g, o in zip(grads, record.outputs))
    placement = state.layout.placement(record)
    if rule.batch_size(record) == 0 and placement is None:
        _store_empty_first_order(builtin, params)
        for p in params.values():
            add_derived(state, p, torch.zeros_like(p))
        return False
    direct, shared = state.split_uses(record, params)
    if direct:
        _first_order_direct(state, record, grads, rule, builtin, params, direct, placement)
    for name, uses in shared:
        p = params[name]
        if id(p) in state.written:
            raise RuntimeError(
                f"Parameter {name} of {describe(module)} is used by a module call that "
                "reaches none of the extended loss functions of this backward and by one "
                "that does. Extend every loss function of the backward "
                "(backpack.extend(loss))."
            )
        acc = state.accumulators.get(id(p))
        if acc is None:
            acc = state.accumulators[id(p)] = _Accumulator(p, uses)
        psg = rule.per_sample_grads(record, grads, [name])[name]
        acc.add(psg, placement, record)
        cover(state, record, grads, rule, name, p, psg)
        if acc.seen >= acc.expected:
            finalize_accumulator(state, acc)
    return any(id(p) in state.accumulators for p in params.values())


def _first_order_direct(
    state: BackwardState,
    record: Record,
    grads: tuple,
    rule: ModuleRule,
    builtin: list[FirstOrderBackpropExtension],
    params: dict[str, Tensor],
    direct: list[str],
    placement: tuple[int, int] | None,
) -> None:
    """First-order quantities of parameters only this call uses in the pass."""
    n = rule.batch_size(record) if placement is None else placement[1]
    quantities = _Quantities(rule, record, grads, direct, n)
    summing = state.derived_sums
    derived = [] if summing is None else [k for k in direct if id(params[k]) in summing]
    if derived:
        quantities.fuse_gradient({e.quantity for e in builtin})
    variances = [e for e in builtin if e.quantity == "variance"]
    # per-sample gradients that `BatchGrad` stores anyway are centred directly
    stored = any(e.quantity == "grad_batch" and e.get_subsampling() is None for e in builtin)
    # one decision per call: the rule computes the sums of all its parameters at once;
    # waiting for autograd's gradient sum spares a product where the rule says so
    wait = bool(variances) and state.sync is None and rule.uses_grad_sums(record)
    wait = wait and not stored
    wait = wait and any(variance_waits_for_grad(params[name], n) for name in direct)
    if variances and not wait:
        if stored:
            quantities.psg()
        # before the other quantities: `sum_grad_squared` follows from these sums
        quantities.get("centred_squares")
    for ext in builtin:
        if ext.quantity == "variance":
            continue
        subsampling = ext.get_subsampling()
        if placement is not None and subsampling is not None:
            # sample indices refer to all the pass's samples
            values = quantities.get(ext.quantity)
            index = torch.as_tensor(subsampling, dtype=torch.long)
            values = {
                k: place(ext.quantity, v, placement)[index.to(v.device)] for k, v in values.items()
            }
        else:
            values = quantities.get(ext.quantity, subsampling)
            values = {k: place(ext.quantity, v, placement) for k, v in values.items()}
        for name in direct:
            setattr(params[name], ext.savefield, values[name])
    for name in direct:
        state.written.add(id(params[name]))
    if derived:
        gradient = quantities.gradient()
        for name in derived:
            add_derived(state, params[name], gradient[name])
    if wait:
        # the rule runs again at the parameter's hook, possibly after the record is freed:
        # a private copy survives `record.free()` and is never counted
        quantities.record = record.copy(extra={})
    psg = quantities._psg
    # not waiting: the sums now, while the rule's per-call caches are still there
    sums = quantities.get("grad_sum") if variances and not wait else {}
    squares = quantities.get("centred_squares") if variances and not wait else {}
    for name in direct:
        part = None if psg is None else psg[name]
        if part is None and name in sums:
            part = sums[name].unsqueeze(0)  # the probes read it like one sample's gradient
        coverage = cover(state, record, grads, rule, name, params[name], part, wait)
        for ext in variances:
            if wait:
                variance_of = partial(_variance_given_sum, quantities, name)
                coverage.pending.append((ext.savefield, variance_of))
                continue
            setattr(params[name], ext.savefield, squares[name] / n)
            if state.sync is not None:  # distributed: the local sums of the global variance
                local = (squares[name], sums[name], n)
                state.sync.stash_variance(params[name], ext.savefield, *local)


def _captured_sites(
    state: BackwardState, record: Record, params: dict[str, Tensor]
) -> dict[str, Any] | None:
    """Sites of a rule-less call's parameters if all meet the samples only by broadcasting.

    Then their per-sample gradients come from the sites (`samples.ParamSite`), without a
    `torch.func` re-run of the call.
    """
    if state.sync is not None or state.layout.several_groups:
        return None  # distributed sums and placed rows: the general path
    if state.derived_sums is not None and any(id(p) in state.derived_sums for p in params.values()):
        return None
    return state.layout.sites_of(record)


def finish_param_sites(state: BackwardState) -> None:
    """First-order quantities of the parameters met at their sites (end of the pass)."""
    for record, builtin, params, sites in state.pending_sites:
        psg = {}
        for name, site in sites.items():
            if site.total is None:
                continue  # the parameter's gradient was not computed in this pass
            shares = site.per_sample()
            total = site.total
            if shares is not None and due_for_check(record.module):  # host reads: scheduled
                summed = shares.sum(0).to(total)
                scale = float(total.abs().max()) if total.numel() else 0.0
                tol = 1e-2 if total.dtype in (torch.float16, torch.bfloat16) else 1e-5
                if not torch.allclose(summed, total, rtol=tol, atol=tol * scale):
                    shares = None
            if shares is None:
                raise RuntimeError(
                    f"Parameter {name} of {describe(record.module)} meets the samples where "
                    "it is broadcast over them, but its per-sample shares do not add up to its "
                    "gradient (it is also used elsewhere). Compute it inside a submodule, or "
                    "report the model to backpack."
                )
            psg[name] = promote_half(shares)  # as rules do: 16-bit quantities in float32
        if not psg:
            continue
        names = list(psg)
        quantities = _Quantities(None, None, (), names, next(iter(psg.values())).shape[0], psg)
        for ext in builtin:
            values = quantities.get(ext.quantity, ext.get_subsampling())
            for name in names:
                setattr(params[name], ext.savefield, values[name])
        for name in names:
            state.written.add(id(params[name]))
    state.pending_sites = []


def add_derived(state: BackwardState, param: Tensor, gradient: Tensor) -> None:
    """Add a call's gradient of `param` if its `.grad` is summed from per-sample gradients."""
    sums = state.derived_sums
    if sums is None or id(param) not in sums:
        return
    if gradient.requires_grad:
        gradient = gradient.detach()
    previous = sums[id(param)]
    sums[id(param)] = gradient if previous is None else previous + gradient


def finalize_accumulator(state: BackwardState, acc: _Accumulator) -> None:
    """Store the quantities of a shared parameter once its uses reported (or the pass ends)."""
    state.accumulators.pop(id(acc.param), None)
    psg = acc.per_sample_grads()
    if psg is None:
        return
    add_derived(state, acc.param, psg.sum(0))
    quantities = _Quantities(None, None, (), ["p"], psg.shape[0], psg={"p": psg})
    for ext in state.first_order:
        value = quantities.get(ext.quantity, ext.get_subsampling())["p"]
        setattr(acc.param, ext.savefield, value)
        if ext.quantity == "variance" and state.sync is not None:  # distributed: local sums
            sums = quantities.get("centred_squares")["p"], quantities.get("grad_sum")["p"]
            state.sync.stash_variance(acc.param, ext.savefield, *sums, psg.shape[0])


def _rule_for(
    state: BackwardState, record: Record, exts: list[FirstOrderBackpropExtension]
) -> ModuleRule | None:
    rule = find_rule(record.module)
    if rule is not None:
        return rule
    cls = type(record.module)
    if cls not in _WARNED_GENERIC:
        _WARNED_GENERIC.add(cls)
        base = overridden_base(record.module)
        if is_parametrized(record.module):
            why = (
                " (tensors it uses are computed from its parameters by "
                "torch.nn.utils.parametrize or weight_norm/spectral_norm: the gradients "
                "w.r.t. those parameters go through that computation)"
            )
        elif base is not None:
            why = (
                f" (it overrides the forward of {base.__name__}, whose rule would read the "
                "recorded input as if that forward had run; if its forward computes the "
                "same, declare it with "
                f"backpack.rules.register_standard_forward({cls.__name__}))"
            )
        else:
            why = ""
        warnings.warn(
            f"backpack has no dedicated rule for {cls.__name__}{why}; computing its "
            "per-sample gradients with torch.func (correct, but slower).",
            UserWarning,
            stacklevel=2,
        )
    return _GenericGuard(exts)


def _check_sample_mixing(
    state: BackwardState, record: Record, exts: list[FirstOrderBackpropExtension]
) -> list[FirstOrderBackpropExtension]:
    module = record.module
    for ext in exts:
        if ext.quantity != "grad_batch":
            raise NotImplementedError(f"{ext.__class__.__name__} is {mixing_message(module)}")
    if normalises_with_batch(module):
        why = (
            "normalises with statistics of the whole batch (training mode or "
            "track_running_stats=False), so it mixes samples: BatchGrad's per-sample results "
            "may be meaningless. Use eval mode with running statistics for true per-sample "
            "gradients."
        )
    else:
        why = (
            "mixes samples (a sample alone gives another output than within its batch): "
            "BatchGrad's per-sample results may be meaningless."
        )
    warnings.warn(f"{module.__class__.__name__} {why}", UserWarning, stacklevel=2)
    return exts


def _run_user_extension(
    state: BackwardState, user_ext: Any, ext: BackpropExtension, record: Record, grads: tuple
) -> None:
    module = record.module
    module.input0 = record.input_values()
    module.output = record.output_values()
    # the whole call (every argument, the rule's recomputations), for the library's own
    # module extensions (backpack.influence's per-position terms of MultiheadAttention)
    module._backpack_record = record
    try:
        with torch.no_grad():
            user_ext.apply(ext, module, tuple(None for _ in record.args), grads)
    finally:
        for attr in ("input0", "output", "_backpack_record"):
            module.__dict__.pop(attr, None)


def _unsupported(state: BackwardState, ext: BackpropExtension, module: nn.Module) -> None:
    mode = getattr(ext, "_fail_mode", FAIL_ERROR)
    if mode == FAIL_SILENT:
        return
    if mode == FAIL_ERROR:
        raise NotImplementedError(
            f"Extension saving to {ext.savefield} does not support module "
            f"{module.__class__} (no module extension registered for it)."
        )
    warnings.warn(_unsupported_warning(ext, module), UserWarning, stacklevel=2)


class _GenericGuard(FuncRule):
    """The torch.func fallback; if it cannot handle a module, warn as for an unknown module."""

    def __init__(self, exts: list[FirstOrderBackpropExtension]) -> None:
        self._exts = exts

    def per_sample_grads(self, record, grad_outputs, names, subsampling=None):  # noqa: D102
        try:
            return super().per_sample_grads(record, grad_outputs, names, subsampling)
        except Exception as err:  # noqa: BLE001 - any failure means "cannot handle"
            for ext in self._exts:
                warnings.warn(
                    _unsupported_warning(ext, record.module) + f" (torch.func failed: {err})",
                    UserWarning,
                    stacklevel=2,
                )
            raise _SkipModule from err


class _SkipModule(Exception):
    """Internal: nothing can be computed for this module."""
