"""Coverage of a parameter's gradient by the extended calls of one backward pass.

A parameter may also receive gradient from outside extended modules (a regulariser, a
functional use). A few probed entries of every call's contribution are summed and compared
with the gradient autograd accumulates; a mismatch warns that the quantities cover only the
extended uses. Variances waiting for a call's gradient sum are finished from the same hook.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from backpack.recording import Record, describe
from backpack.rules.base import ModuleRule

if TYPE_CHECKING:  # pragma: no cover
    from backpack.passes.state import BackwardState




_PROBES: dict[tuple[Any, ...], Tensor] = {}


def _probe_index(param: Tensor, rule: ModuleRule | None = None, name: str = "") -> Tensor:
    """A few fixed flat positions of a parameter (no random numbers: the user's RNG is theirs).

    The rule may pick them (positions that are cheap to compute together); by default they are
    spread evenly over the flattened parameter.
    """
    key = (type(rule), name, param.shape, param.device)
    index = _PROBES.get(key)
    if index is None:
        index = None if rule is None else rule.probe_index(name, param)
        if index is None:
            # integer arithmetic: a float32 linspace rounds the last position of a parameter
            # with more than 2**24 entries (a vocabulary-sized embedding) past its end
            numel = param.numel()
            k = min(numel, 8)
            steps = torch.arange(k, device=param.device, dtype=torch.long)
            index = steps * (numel - 1) // max(k - 1, 1)
        if len(_PROBES) < 4096:
            _PROBES[key] = index
    return index


class _Coverage:
    """Checks that extended module calls account for all of a parameter's gradient.

    The probes sum this pass's module contributions at a few entries; a hook on the parameter
    compares them with the total gradient autograd accumulates. A difference means the parameter
    is also used outside extended modules (a regulariser, a functional call).
    """

    def __init__(
        self,
        param: Tensor,
        name: str,
        module: nn.Module,
        rule: ModuleRule,
        scale: list[Tensor],
        pass_scale: list[Tensor] | None = None,
    ) -> None:
        self.param = param
        self.index = _probe_index(param, rule, name)
        self.total: Tensor | None = None
        #: largest probed contributions of every parameter of the module (shared): the scale
        #: against which a mismatch counts, so a gradient that cancels to rounding noise (a
        #: bias before a normalisation) is not mistaken for an outside contribution
        self.scale = scale
        #: probed contributions of every parameter of the pass (shared): the last resort for a
        #: gradient that cancels to rounding noise in a module whose other parameters are frozen
        #: or cancel too (attention's key bias)
        self.pass_scale = pass_scale if pass_scale is not None else []
        self.label = f"{name} of {describe(module)}"
        self.handle: Any = None
        #: whether this pass checks the parameter (see `cover`)
        self.active = True
        #: whether a contribution came from a 16-bit (autocast) call
        self.low_precision = False
        #: variances waiting for the call's gradient sum: (savefield, variance from the sum)
        self.pending: list[tuple[str, Callable[[Tensor | None], Tensor]]] = []

    def add(self, part: Tensor) -> None:
        self.total = part if self.total is None else self.total + part

    def on_grad(self, grad: Tensor, fields: list[str]) -> None:
        """Parameter hook: check coverage, then finish pending variances with `grad`."""
        covered = self.check(grad, fields)
        # under autocast autograd's sum went through 16-bit arithmetic: the rule's is better
        self.finish(grad.detach() if covered and not self.low_precision else None)

    def finish(self, grad_sum: Tensor | None) -> None:
        """Store pending variances, from `grad_sum` or (if None) the rule's own sum."""
        pending, self.pending = self.pending, []
        with torch.no_grad():
            for field, variance in pending:
                setattr(self.param, field, variance(grad_sum))

    def check(self, grad: Tensor, fields: list[str]) -> bool:
        """Warn (and return False) if `grad` has more than the extended calls' contributions."""
        if self.total is None or grad.is_sparse or not grad.dtype.is_floating_point:
            return False
        actual = grad.detach().flatten()[self.index].to(self.total.dtype)
        tol = {torch.float64: 1e-7, torch.float32: 1e-4}.get(self.total.dtype, 5e-2)
        if self.low_precision:
            tol = 5e-2
        # |actual - total| <= tol * max(|total|, |actual|) on at most 8 numbers: Python floats
        # (one transfer) are cheaper than a chain of tiny tensor ops
        values = torch.cat([actual, self.total]).tolist()
        pairs = list(zip(values[: len(actual)], values[len(actual) :]))
        if not all(math.isfinite(v) for v in values):
            # NaN or inf (e.g. one sample's input): nothing can be compared, nothing to report
            return False
        bound = tol * max((abs(v) for v in values), default=0.0) + 1e-30
        for reference in (self.scale, self.pass_scale):
            if all(abs(a - t) <= bound for a, t in pairs) or not reference:
                break
            # a gradient cancelling to rounding noise: judge against the module's other
            # entries, then against the pass's largest probed entry
            scale = max((float(p.detach().abs().max()) for p in reference if p.numel()), default=0)
            bound = tol * max(bound / tol, scale) + 1e-30
        if not all(abs(a - t) <= bound for a, t in pairs):
            warnings.warn(
                f"Parameter {self.label} also receives gradient from operations outside extended "
                "modules (e.g. a regularisation term, or a functional use such as "
                "F.linear(x, weight)). backpack's quantities "
                f"({', '.join(fields)}) only cover its uses inside extended modules.",
                UserWarning,
                stacklevel=2,
            )
            return False
        return True


#: id(object) -> backward passes that met it (entries die with their object)
_PASSES: dict[int, int] = {}


def due_for_check(obj: Any) -> bool:
    """Whether a check that reads values on the host (a GPU waits for it) runs in this pass.

    The first 4 passes that meet `obj` (a parameter, a module) are checked, then every 16th.
    """
    key = id(obj)
    seen = _PASSES.get(key)
    if seen is None:
        seen = 0
        weakref.finalize(obj, _PASSES.pop, key, None)
    _PASSES[key] = seen + 1
    return seen < 4 or seen % 16 == 0


class _Unchecked:
    """The coverage of a parameter this pass does not check (shared; it holds nothing)."""

    active = False
    handle = None
    low_precision = False

    @property
    def pending(self) -> list:
        """No variance waits on an unchecked parameter (they force a check)."""
        return []

    @pending.setter
    def pending(self, value: list) -> None:
        pass


_UNCHECKED: Any = _Unchecked()


def assume_checked(obj: Any) -> None:
    """Treat `obj` (a parameter, a module) as past the checks of its first passes.

    For benchmarks and tests of a training loop's typical step, which `due_for_check` skips.
    """
    if _PASSES.get(id(obj)) is None:
        weakref.finalize(obj, _PASSES.pop, id(obj), None)
    _PASSES[id(obj)] = max(_PASSES.get(id(obj), 0), 5)


def cover(
    state: BackwardState,
    record: Record,
    grads: tuple,
    rule: ModuleRule,
    name: str,
    param: Tensor,
    psg: Tensor | None,
    always: bool = False,
) -> _Coverage:
    """Add this call's gradient at the probe entries of `param` (once per call).

    `psg` are this call's per-sample gradients if they were materialised anyway; only the
    probed entries are read from them (or computed by the rule otherwise). The check runs
    on a parameter's first passes and then on every 16th (`always`: on every pass, e.g.
    when a variance waits for the parameter's gradient).
    """
    coverage = state.coverage.get(id(param))
    if coverage is None and not always and not due_for_check(param):
        # not checked in this pass: nothing to probe (the common case of a training loop)
        coverage = state.coverage[id(param)] = _UNCHECKED
        return coverage
    if coverage is None or (always and coverage is _UNCHECKED):
        scale = state.scales.setdefault(id(record.module), [])
        pass_scale = state.scales.setdefault("pass", [])
        # an earlier call of the pass went unchecked: this one holds pending variances only
        active = coverage is None
        coverage = state.coverage[id(param)] = _Coverage(
            param, name, record.module, rule, scale, pass_scale
        )
        coverage.active = active
        if coverage.active:
            fields = [e.savefield for e in state.extensions]

            def hook(grad: Tensor, coverage: _Coverage = coverage) -> None:
                coverage.on_grad(grad, fields)

            coverage.handle = param.register_hook(hook)
    key = (id(record), id(param))
    if key in state.covered or not coverage.active:
        return coverage
    state.covered.add(key)
    if psg is not None:
        part = psg.flatten(1)[:, coverage.index].sum(0)
    else:
        part = rule.grad_sum_entries(record, grads, name, coverage.index)
    coverage.add(part)
    coverage.scale.append(part)
    coverage.pass_scale.append(part)
    coverage.low_precision = coverage.low_precision or state.low_precision
    return coverage
