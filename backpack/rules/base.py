"""The rule registry: the math of each module type, and nothing about hooks or storage.

A rule turns one recorded call of a module (its inputs and the gradients reaching its outputs) into
per-sample parameter gradients, and optionally into fused reductions of them that skip
materialising the `[N, *param.shape]` tensors. Rules are looked up along the module's class
hierarchy: a subclass uses its parent's rule as long as it computes its output with the parent's
forward (a rule reads only the recorded input, so a subclass feeding the layer something else,
say a standardised weight or a scaled input, would get wrong numbers from it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from backpack.recording import Record, is_parametrized

GradOutputs = tuple[Tensor | None, ...]
Names = Sequence[str]

_RULES: dict[type[nn.Module], ModuleRule] = {}
#: rules of classes named by their qualified name (`register_rule("pkg.mod.Class")`): taken into
#: `_RULES` when a class of that name is first met in a module's class hierarchy, so that the
#: package defining the class (transformers, timm) is never imported by backpack
_NAMED_RULES: dict[str, ModuleRule] = {}

R = TypeVar("R", bound="type[ModuleRule]")


class ModuleRule:
    """Math for one module type. Subclasses implement at least `per_sample_grads`.

    Every method receives the record of one module call, the gradients w.r.t. its outputs (in
    the order of `record.outputs`) and the names of the parameters to compute; it returns a
    dict from parameter name to tensor. Fused methods may return None to say "no cheaper
    formula here": the engine then reduces the materialised per-sample gradients.
    """

    #: axis of the (first) input that indexes samples
    def batch_axis(self, module: nn.Module) -> int:
        """Axis of the module's inputs and outputs that indexes samples."""
        return 0

    def output_batch_axes(self, record: Record) -> list[int]:
        """Sample axis of each recorded output (used by the curvature matrix products)."""
        return [0] * len(record.outputs)

    def module_for_products(self, record: Record) -> nn.Module:
        """The module the curvature matrix products re-run (through `torch.func`) for a call.

        The recorded module itself, unless re-running it would not compute the recorded call:
        a call that drew random numbers (dropout) gets a module with those draws held fixed,
        with the same parameters under the same names.
        """
        return record.module

    def batch_size(self, record: Record) -> int:
        """Number of samples in the recorded call."""
        return record.args[0].shape[self.batch_axis(record.module)]

    def mixes_samples(self, record: Record) -> bool:
        """Whether the recorded call couples samples (per-sample quantities are then undefined)."""
        return False

    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """Per-sample gradients `[N', *param.shape]` (N' = len(subsampling) if given)."""
        raise NotImplementedError

    def batch_l2(self, record: Record, grad_outputs: GradOutputs, names: Names) -> Any:
        """Fused `[N]` squared norms of per-sample gradients, or None."""
        return None

    def sum_grad_squared(self, record: Record, grad_outputs: GradOutputs, names: Names) -> Any:
        """Fused sum over samples of squared per-sample gradients, or None."""
        return None

    def grad_sum_and_squares(
        self, record: Record, grad_outputs: GradOutputs, names: Names
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """Fused (Σ_n g_n, Σ_n g_n²) in one pass over the per-sample gradients, or None.

        Worth it where per-sample gradients are formed anyway for the squares and the sum would
        otherwise cost a separate weight backward (convolutions).
        """
        return None

    def grad_sum_and_centred_squares(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        grad_sums: dict[str, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """(Σ_n g_n, Σ_n (g_n − ḡ)²) without the cancellation of Σg² − (Σg)²/N, or None.

        For `Variance` (see `backpack.variance`). None: the engine centres the materialised
        per-sample gradients. `grad_sums` may hold this call's gradient sums (autograd's
        gradient) for rules that would otherwise compute them (`uses_grad_sums`).
        """
        return None

    def uses_grad_sums(self, record: Record) -> bool:
        """Whether `grad_sum_and_centred_squares` saves work when given the gradient sums."""
        return False

    def batch_l2_and_sum(
        self, record: Record, grad_outputs: GradOutputs, names: Names
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """Fused (`[N]` squared norms, Σ_n g_n) in one pass over the per-sample gradients.

        None where the norms do not form per-sample gradients (Gram forms, closed forms).
        """
        return None

    def batch_dot(self, record: Record, grad_outputs: GradOutputs, names: Names) -> Any:
        """Fused `[N, N]` Gram matrix of per-sample gradients, or None."""
        return None

    def grad_sum(self, record: Record, grad_outputs: GradOutputs, names: Names) -> Any:
        """Fused sum over samples of per-sample gradients (this call's gradient), or None."""
        return None

    def probe_index(self, name: str, param: Tensor) -> Tensor | None:
        """Flat positions of `param` that `grad_sum_entries` computes cheaply together, or None.

        They probe whether extended calls account for the whole gradient; None means positions
        spread evenly over the parameter.
        """
        return None

    def grad_sum_entries(
        self, record: Record, grad_outputs: GradOutputs, name: str, index: Tensor
    ) -> Tensor:
        """A few entries (flat `index`) of this call's gradient w.r.t. parameter `name`."""
        full = self.grad_sum(record, grad_outputs, [name])
        if full is None:
            full = {name: self.per_sample_grads(record, grad_outputs, [name])[name].sum(0)}
        return full[name].flatten()[index]

    # --- second order ---------------------------------------------------------------------
    def sqrt_factor(
        self,
        record: Record,
        factors: Sequence[Tensor | None],
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """Jᵀ f for each column of the factors at the outputs: `{name: [V, N, *param.shape]}`.

        A column of the factor plays the role of an output gradient, so by default this is the
        per-sample gradient batched over columns.
        """
        template = next(f for f in factors if f is not None)
        filled = [
            torch.zeros(template.shape[0], *out.shape, dtype=out.dtype, device=out.device)
            if f is None
            else f
            for f, out in zip(factors, record.outputs)
        ]

        def one_column(*columns: Tensor) -> dict[str, Tensor]:
            return self.per_sample_grads(record, columns, names, subsampling)

        if template.shape[0] == 1:  # one column (a Monte-Carlo sample): no vmap needed
            single = one_column(*[f[0] for f in filled])
            return {n: v.unsqueeze(0) for n, v in single.items()}
        try:
            return torch.func.vmap(one_column)(*filled)
        except (RuntimeError, ValueError, NotImplementedError):
            per_column = [one_column(*cols) for cols in zip(*filled)]
            return {n: torch.stack([c[n] for c in per_column]) for n in names}

    def sqrt_factor_into(
        self,
        record: Record,
        factors: Sequence[Tensor | None],
        names: Names,
        subsampling: Sequence[int] | None,
        out: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        """`sqrt_factor`, written into the given `[V, N, *param.shape]` tensors where possible.

        Used for results that end up in one preallocated buffer (`backpack.jacobians` with
        `flatten=True`): a rule that can write its result in place saves a second write of it.
        By default the result is computed and copied (a parameter whose result has another
        shape keeps it).
        """
        values = self.sqrt_factor(record, factors, names, subsampling)
        for name, value in values.items():
            dest = out.get(name)
            if dest is not None and dest.shape == value.shape and dest.dtype == value.dtype:
                values[name] = dest.copy_(value)
        return values

    def diag_from_factor(
        self,
        record: Record,
        factors: Sequence[Tensor | None],
        names: Names,
        coef: Tensor | None,
        per_sample: bool,
    ) -> dict[str, Tensor]:
        """Σ_v coef[v, n] (Jᵀ f_vn)², summed over n unless `per_sample`."""
        sqrt = self.sqrt_factor(record, factors, names)
        result = {}
        for name, value in sqrt.items():
            sq = value.square()
            if coef is not None:
                sq = sq * coef.reshape(*coef.shape, *([1] * (sq.dim() - 2)))
            result[name] = sq.sum(0) if per_sample else sq.sum((0, 1))
        return result

    def kron_factors(
        self,
        record: Record,
        factors: Sequence[Tensor | None],
        names: Names,
        approx: str = "expand",
    ) -> dict[str, list[Tensor]] | None:
        """Kronecker factors of each parameter's curvature block, or None if undefined.

        Each list starts with the output-side factor, which sums over samples (and adds up
        over losses); further factors are means over the call's samples. `approx` says how a
        weight shared over positions is factored ("expand" or "reduce").
        """
        return None

    def on_class_resolved(self, cls: type) -> None:
        """Called once when a class registered by name (`register_rule("pkg.Class")`) is met."""


def qualified_name(cls: type) -> str:
    """`module.QualName` of a class, e.g. `transformers.pytorch_utils.Conv1D`."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_rule(*module_classes: type[nn.Module] | str) -> Callable[[R], R]:
    """Class decorator registering a rule for the given module classes.

    A class may be given by its qualified name (`"transformers.pytorch_utils.Conv1D"`, as
    `qualified_name` spells it): the rule then applies to the class of that exact name once one
    is met, without importing its package. Only name classes whose forward the rule was checked
    against (a test building the class): a name says nothing about what the class computes.
    """

    def decorator(rule_cls: R) -> R:
        rule = rule_cls()
        for cls in module_classes:
            if isinstance(cls, str):
                _NAMED_RULES[cls] = rule
            else:
                _RULES[cls] = rule
        clear_class_caches()
        return rule_cls

    return decorator


def _resolve_named(cls: type) -> None:
    """Move the rules registered under the names of `cls`'s bases into `_RULES`."""
    if not _NAMED_RULES:
        return
    for base in cls.__mro__:
        if base not in _RULES:
            rule = _NAMED_RULES.get(qualified_name(base))
            if rule is not None:
                _RULES[base] = rule
                rule.on_class_resolved(base)


#: the methods through which a layer computes its output (`Conv*.forward` calls `_conv_forward`)
_FORWARD_METHODS = ("forward", "_conv_forward")
#: subclasses declared to compute what their parent computes (`register_standard_forward`)
_STANDARD_FORWARD: set[type] = set()
#: the same, by qualified name (classes of packages backpack does not import)
_STANDARD_FORWARD_NAMES: set[str] = set()


def register_standard_forward(*module_classes: type[nn.Module] | str) -> None:
    """Declare that these subclasses' own `forward` computes what their parent's forward does.

    A subclass that overrides `forward` gets the `torch.func` fallback (correct for any forward,
    but slower, and without Kronecker factors or Hessians), since its parent's rule would read
    the recorded input as if the parent's forward had run. Declare overrides that only add
    logging, checks or hooks and then call `super().forward(x)` to use the parent's rule again.
    A class may be given by its qualified name (see `qualified_name`), which imports nothing.
    """
    for cls in module_classes:
        if isinstance(cls, str):
            _STANDARD_FORWARD_NAMES.add(cls)
        else:
            _STANDARD_FORWARD.add(cls)
    clear_class_caches()


def _declared_standard(cls: type) -> bool:
    return cls in _STANDARD_FORWARD or (
        bool(_STANDARD_FORWARD_NAMES) and qualified_name(cls) in _STANDARD_FORWARD_NAMES
    )


def keeps_forward_of(cls: type, base: type) -> bool:
    """Whether `cls` (a subclass of `base`) computes its output with `base`'s forward.

    True when no class between them in the method resolution order defines a forward method
    before one declared with `register_standard_forward` is met, and for abstract bases without
    a forward of their own (`_Loss`: the table then means every subclass).
    """
    if base.forward is nn.Module.forward:
        return True
    for c in cls.__mro__:
        if c is base or _declared_standard(c):
            return True
        if any(m in c.__dict__ for m in _FORWARD_METHODS):
            return False
    return False


def class_match(module: nn.Module, table: Any) -> Any:
    """The entry of `table` (keyed by module class) for `module`, or None.

    The nearest registered class in `module`'s class hierarchy decides: its entry, if
    `module` computes its output with that class's forward, else None.
    """
    cls = type(module)
    for base in cls.__mro__:
        entry = table.get(base)
        if entry is not None:
            return entry if keeps_forward_of(cls, base) else None
    return None


def overridden_base(module: nn.Module) -> type | None:
    """The registered class whose rule `module` does not get because it overrides its forward."""
    _resolve_named(type(module))
    for base in type(module).__mro__:
        if base in _RULES:
            return None if keeps_forward_of(type(module), base) else base
    return None


def is_instance_with_forward(module: nn.Module, classes: Sequence[type]) -> bool:
    """`isinstance(module, classes)`, counting only classes whose forward `module` keeps."""
    cls = type(module)
    return any(isinstance(module, c) and keeps_forward_of(cls, c) for c in classes)


_CLASS_CACHES: list[dict[type, Any]] = []


def class_cache() -> dict[type, Any]:
    """A dict of per-class answers, emptied whenever a rule or a standard forward is registered."""
    cache: dict[type, Any] = {}
    _CLASS_CACHES.append(cache)
    return cache


def clear_class_caches() -> None:
    """Forget every per-class answer (the registries changed)."""
    for cache in _CLASS_CACHES:
        cache.clear()


def cached_per_class(cache: dict[type, Any], module: nn.Module, compute: Callable[[], Any]) -> Any:
    """`compute()` for `module`'s class, computed once per class."""
    cls = type(module)
    try:
        return cache[cls]
    except KeyError:
        if len(cache) > 4096:  # classes made on the fly (parametrizations) come and go
            cache.clear()
        value = cache[cls] = compute()
        return value


#: class -> its rule or None
_FOUND = class_cache()


def find_rule(module: nn.Module) -> ModuleRule | None:
    """The rule for `module`'s class or its nearest registered base class (see `class_match`).

    None for modules with parametrized tensors: a layer's rule gives gradients w.r.t. the
    tensor the forward used, not w.r.t. the parameters it was computed from.
    """
    if is_parametrized(module):
        return None
    return cached_per_class(_FOUND, module, lambda: _match_rule(module))


def _match_rule(module: nn.Module) -> ModuleRule | None:
    _resolve_named(type(module))
    return class_match(module, _RULES)


def registered_module_classes() -> list[type[nn.Module]]:
    """All module classes with a dedicated rule (used to generate the docs' layer table).

    Classes registered by name appear once a module of theirs was looked up; see
    `registered_class_names` for all names.
    """
    return list(_RULES)


def registered_class_names() -> dict[str, ModuleRule]:
    """Qualified class names with a rule registered by name, and their rules."""
    return dict(_NAMED_RULES)


def standard_forward_names() -> list[str]:
    """Qualified names of subclasses declared to compute their parent's forward."""
    return sorted(_STANDARD_FORWARD_NAMES)


def gram(rows: Tensor, other: Tensor | None = None) -> Tensor:
    """Σ_r a_r b_rᵀ over the rows a_r of `rows` and b_r of `other` (default: `rows`).

    `rows` is `[..., D]`, `other` `[..., E]` with the same leading axes; the result `[D, E]` is
    one matrix product.
    `torch.einsum` contracting two leading axes at once ("vnd,vne->de", "tbg,tbi->gi") took
    2.5-8x as long on the CPU for the factor shapes of the benchmarks (measured, torch 2.14).
    """
    a = rows.reshape(-1, rows.shape[-1])
    b = a if other is None else other.reshape(-1, other.shape[-1])
    return a.T @ b


def zeros_for_missing(grad_outputs: GradOutputs, outputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Replace gradients autograd did not compute (outputs unused by the loss) by zeros."""
    return tuple(torch.zeros_like(out) if g is None else g for g, out in zip(grad_outputs, outputs))
