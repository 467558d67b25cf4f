"""Render the "Supported layers" table from backpack's rule registries.

The table is built at documentation build time (this file is registered as an MkDocs hook in
`mkdocs.yml`), so it always describes the code that is installed:

- `backpack.rules.registered_module_classes()`: layers with parameters and a dedicated rule;
- `backpack.rules.base.registered_class_names()`: rules of classes named by their qualified name
  (transformers, timm), which backpack never imports;
- `backpack.rules.activations`: elementwise activations with a second derivative (`_RULES`) and
  the modules that are linear or piecewise linear in their input (`_CURVATURE_FREE`);
- `backpack.rules.losses._LOSS_RULES`: losses whose Hessian w.r.t. the model output is factorised;
- `backpack.secondorder`: functional (non-module) operations the Hessian extensions accept.

Run `python docs/gen_layers.py` to print the Markdown.
"""

from __future__ import annotations

import re

from torch import nn

from backpack import rules as _rules
from backpack.rules import activations as _activations
from backpack.rules import losses as _losses
from backpack.rules.base import (
    ModuleRule,
    qualified_name,
    registered_class_names,
    standard_forward_names,
)

#: placeholder in docs/supported-layers.md that the hook replaces by the table
MARKER = "<!-- generated: layer-table -->"

YES = "✓"
NO = "✗"
NONE = "—"

_HEADER = (
    "| module | first-order | GGN family | Kronecker factors | Hessian |\n|---|---|---|---|---|\n"
)


def _name(cls: type) -> str:
    """Public dotted name: `torch.nn.X` for torch layers, the full path otherwise."""
    if cls.__module__.startswith("torch.nn"):
        return f"`torch.nn.{cls.__name__}`"
    return f"`{cls.__module__}.{cls.__name__}`"


def _overrides(rule: object, method: str) -> bool:
    """Whether a rule's class defines its own `method` instead of `ModuleRule`'s default."""
    return getattr(type(rule), method) is not getattr(ModuleRule, method)


def _curvature_free_classes() -> list[type[nn.Module]]:
    """Module classes backpack treats as linear (or piecewise linear) in their input."""
    classes = list(_activations._CURVATURE_FREE) + list(_activations._EXTRA_CURVATURE_FREE)
    return [c for c in classes if not issubclass(c, nn.modules.loss._Loss)]


def _is_curvature_free(cls: type) -> bool:
    return any(issubclass(cls, c) for c in _curvature_free_classes())


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |\n"


#: footnote for layers whose rule can report that a call mixed the samples of the batch
MIXING_NOTE = (
    "only when a call does not mix the samples of the batch (for batch normalisation: "
    "evaluation mode with running statistics); otherwise `BatchGrad` warns that its result may "
    "be meaningless and the other extensions raise `NotImplementedError`."
)


def _kron_form(cls: type) -> str:
    """What the Kronecker-factor extensions store for layers whose factors are not `[G, A]`."""
    from torch.nn.modules.instancenorm import _InstanceNorm

    norms = (nn.LayerNorm, nn.GroupNorm, _InstanceNorm, getattr(nn, "RMSNorm", nn.LayerNorm))
    if issubclass(cls, norms):
        return " (one dense block per parameter)"
    if issubclass(cls, nn.Embedding):
        return " (for `weight.T`)"
    if issubclass(cls, nn.MultiheadAttention):
        return " (dense blocks for some parameters, see notes)"
    return ""


def parametrized_rows() -> list[list[str]]:
    """One row per layer class with a dedicated rule, then one per class registered by name.

    Classes with a rule come in registration order; classes registered by their qualified name
    (layers of transformers and timm) follow, whether or not one was met in this process.
    """
    named = registered_class_names()
    rows = []
    for cls in _rules.registered_module_classes():
        if qualified_name(cls) in named:
            continue  # listed by name below, whether or not one was met in this process
        rule = _rules.find_rule(cls.__new__(cls))
        mark = "¹" if _overrides(rule, "mixes_samples") else ""
        kron = YES + mark + _kron_form(cls) if _overrides(rule, "kron_factors") else NO
        hessian = YES + mark if _is_curvature_free(cls) else f"{NO} (nonlinear in its input)"
        rows.append([_name(cls), YES + mark, YES + mark, kron, hessian])
    for name, rule in named.items():
        kron = YES + _kron_form_of_rule(rule) if _overrides(rule, "kron_factors") else NO
        linear = name in _activations._CURVATURE_FREE_NAMES
        hessian = YES if linear else f"{NO} (nonlinear in its input)"
        rows.append([f"`{name}`", YES, YES, kron, hessian])
    return rows


def _kron_form_of_rule(rule: ModuleRule) -> str:
    """`_kron_form` for classes registered by name (their classes may not be importable)."""
    from backpack.rules.linear import Conv1DRule
    from backpack.rules.norm import _PerSampleNormRule

    if isinstance(rule, _PerSampleNormRule):
        return " (one dense block per parameter)"
    if isinstance(rule, Conv1DRule):
        return " (of the stored `[in, out]` weight, see notes)"
    return ""


def standard_forward_sentence() -> str:
    """The subclasses declared (by name) to compute their parent's forward."""
    names = ", ".join(f"`{n}`" for n in standard_forward_names())
    return (
        "\nSubclasses overriding `forward` that backpack knows to compute their parent's "
        f"function, so they use the parent's rule: {names}.\n"
    )


def parameter_free_rows() -> list[list[str]]:
    """Activations with a second derivative, then modules that are linear in their input."""
    registered = set(_rules.registered_module_classes())
    rows = []
    activations = sorted(_activations._RULES, key=lambda c: c.__name__)
    for cls in activations:
        rows.append([_name(cls), NONE, YES, YES, f"{YES} (second derivative)"])
    linear = [
        c for c in _curvature_free_classes() if c not in registered and c not in _activations._RULES
    ]
    seen: set[type] = set()
    for cls in sorted(linear, key=lambda c: (not c.__module__.startswith("torch"), c.__name__)):
        if cls in seen:
            continue
        seen.add(cls)
        rows.append([_name(cls), NONE, YES, YES, f"{YES} (linear or piecewise linear)"])
    return rows


def loss_rows() -> list[list[str]]:
    """One row per loss with a Hessian factorisation."""
    rows = []
    for cls, rule in _losses._LOSS_RULES.items():
        sampled = type(rule).sqrt_hessian_sampled is not _losses.LossRule.sqrt_hessian_sampled
        ggn = f"{YES} exact and Monte-Carlo" if sampled else f"{YES} exact only"
        rows.append([_name(cls), f"{YES} (extending it is optional)", ggn, YES, YES])
    return rows


def fallback_rows() -> list[list[str]]:
    """What happens to modules that appear in none of the registries."""
    return [
        [
            "any other module **with** parameters",
            f"{YES} through `torch.func` (slower; warns once per class)",
            f"{YES} through `torch.func`",
            f"{NO} (raises `NotImplementedError`)",
            f"{NO} (raises `NotImplementedError`)",
        ],
        [
            "any other module or functional operation **without** parameters",
            NONE,
            f"{YES} (autograd propagates through it)",
            f"KFAC, KFLR: {YES}; KFRA: {NO} unless listed below",
            f"{NO} unless listed below (raises `NotImplementedError`)",
        ],
    ]


def _functional_ops() -> list[str]:
    """Names of functional operations the Hessian extensions accept outside modules."""
    from backpack import secondorder

    names = set()
    for node in secondorder._CURVATURE_FREE_NODES | secondorder._LINEAR_IF_ONE_OPERAND:
        if node.startswith("torch::"):
            continue
        base = re.sub(r"Backward\d*$", "", node)
        names.add(base)
    return sorted(names, key=str.lower)


def render_layer_table() -> str:
    """The complete generated section: tables for layers, parameter-free modules and losses."""
    out = ["### Layers with parameters\n\n", _HEADER]
    out += [_row(r) for r in parametrized_rows()]
    out.append(f"\n¹ {MIXING_NOTE}\n")
    out.append(standard_forward_sentence())
    out += ["\n### Modules without parameters\n\n", _HEADER]
    out += [_row(r) for r in parameter_free_rows()]
    out += ["\n### Loss functions\n\n", _HEADER]
    out += [_row(r) for r in loss_rows()]
    out += ["\n### Everything else\n\n", _HEADER]
    out += [_row(r) for r in fallback_rows()]
    ops = ", ".join(f"`{op}`" for op in _functional_ops())
    out.append(
        "\nFunctional operations (not modules) that the Hessian extensions and KFRA accept "
        "between the parameters and the loss, by the name of their autograd node "
        f"(`Mul` and `Div` only when one operand is constant): {ops}.\n"
    )
    return "".join(out)


#: placeholder (home page) that the hook replaces by the package version
VERSION_MARKER = "<!-- generated: version -->"


def on_page_markdown(markdown: str, page: object, config: object, files: object) -> str:
    """MkDocs hook: fill in the layer tables (supported-layers page) and the package version."""
    if VERSION_MARKER in markdown:
        from backpack import __version__

        markdown = markdown.replace(VERSION_MARKER, __version__)
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_layer_table())


if __name__ == "__main__":
    print(render_layer_table())
