"""`backpack.verify`: check backpack's quantities on your own model against float64 autograd.

`verify(model, lossfunc, X, y)` runs every extension (or those asked for) once on copies of the
model and loss function, on the first `samples` samples of the batch, and compares what each
one stores with a brute-force reference computed by plain autograd in float64 without backpack
(`backpack.reference`). The model and loss you pass are never modified. The report prints as a
table, says which quantities match, which do not apply to the model (and why), and names likely
causes of a mismatch that it finds in the model: BatchNorm or Dropout in train mode, other
stochastic layers, parameters whose gradient flows outside extended modules, a loss backpack
does not know, an unusual reduction.

From the command line, `python -m backpack verify my_module:make_problem` calls
`make_problem()`, which returns `(model, lossfunc, X, y)`, and exits with status 0 when every
computed quantity was checked and matches, 1 on a mismatch, 3 when some could not be checked.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.util
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from backpack import extensions as _extensions
from backpack import kfra
from backpack.api import backpack, extend
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.reference import CHECKS, RTOL, ExtensionCheck, Pair, Reference, ShapeError, Unchecked
from backpack.reference import compare as _compare
from backpack.reference import first_sentence as _first_sentence
from backpack.rules import find_rule

_BY_NAME = {c.name.lower(): c for c in CHECKS}
_GROUPS = {"first": 1, "second": 2}
_SUPPORTED_LOSSES = (nn.MSELoss, nn.CrossEntropyLoss, nn.BCEWithLogitsLoss)


@dataclass
class VerifyRow:
    """The outcome of one extension (all parameters together).

    `status` is "ok", "FAIL", "n/a" (the extension refused the model; `note` says why), "MC"
    (a Monte-Carlo estimate: `deviation` is its relative distance from the exact value, not a
    check) or "unchecked" (no reference for this model; `note` says why). `error` is the largest
    relative error over the parameters, `excess` the largest ratio of error to tolerance.
    """

    extension: str
    savefield: str
    reference: str = ""
    status: str = "ok"
    error: float | None = None
    tolerance: float = 0.0
    excess: float | None = None
    deviation: float | None = None
    note: str = ""
    #: checked for some parameters only (the others are named in `note`)
    partial: bool = False
    #: 1 for first-order extensions, 2 for second-order ones (0: unknown)
    order: int = 0

    @property
    def ok(self) -> bool:
        """Whether the row is not a failure."""
        return self.status != "FAIL"


@dataclass
class VerifyReport:
    """What `verify` found: one row per extension and the likely causes of any mismatch.

    Print it for a table. `ok` is False if any quantity mismatches its reference or an
    extension failed with an unexpected error.
    """

    rows: list[VerifyRow] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    samples: int = 0
    dtype: torch.dtype = torch.float64

    @property
    def ok(self) -> bool:
        """Whether every checked quantity matches its reference."""
        return all(row.ok for row in self.rows)

    @property
    def failed(self) -> list[VerifyRow]:
        """The rows that failed."""
        return [row for row in self.rows if not row.ok]

    @property
    def checked(self) -> list[VerifyRow]:
        """The rows compared against an exact reference (passed or failed)."""
        return [r for r in self.rows if r.status in ("ok", "FAIL")]

    @property
    def unchecked(self) -> list[VerifyRow]:
        """The rows that could not be checked at all, or only for some parameters."""
        return [r for r in self.rows if r.status == "unchecked" or r.partial]

    @property
    def complete(self) -> bool:
        """Whether every quantity computed was checked (or is a Monte-Carlo estimate)."""
        return not self.unchecked

    @property
    def exit_code(self) -> int:
        """The exit status of `python -m backpack verify` for this report.

        0: OK (every quantity computed was checked and matches), 1: FAIL (a mismatch or an
        unexpected error), 3: INCOMPLETE or NOTHING CHECKED (no mismatch, but something
        computed could not be checked, or nothing could be compared at all). 2 is left to
        usage errors and problems `verify` cannot take.
        """
        if self.failed:
            return 1
        if self.unchecked or not self.checked:
            return 3
        return 0

    def summary(self) -> str:
        """One line: how many checked quantities match."""
        checked = len(self.checked)
        other = [
            f"{n} {what}"
            for what, n in (
                ("Monte-Carlo", sum(r.status == "MC" for r in self.rows)),
                ("not applicable", sum(r.status == "n/a" for r in self.rows)),
                ("unchecked", sum(r.status == "unchecked" for r in self.rows)),
            )
            if n
        ]
        tail = f" ({', '.join(other)})" if other else ""
        missing = ""
        if self.unchecked:
            names = ", ".join(
                r.extension + (" (some parameters)" if r.status != "unchecked" else "")
                for r in self.unchecked
            )
            missing = f"; NOT CHECKED: {names}, see their notes above"
        if self.failed:
            return (
                f"FAIL: {len(self.failed)} of {_count(checked, 'checked quantity')} wrong"
                f"{tail}{missing}"
            )
        if self.unchecked:
            if checked == 0:
                return f"INCOMPLETE: nothing could be checked{tail}{missing}"
            match = "matches" if checked == 1 else "match"
            return (
                f"INCOMPLETE: {_count(checked, 'checked quantity')} {match} float64 autograd, "
                f"but not everything could be checked{tail}{missing}"
            )
        if checked == 0:
            return f"NOTHING CHECKED: no quantity could be compared with a reference{tail}"
        if checked == 1:
            return f"OK: the checked quantity matches float64 autograd{tail}"
        return f"OK: all {checked} checked quantities match float64 autograd{tail}"

    def __str__(self) -> str:
        return format_report(self)


def _count(n: int, noun: str) -> str:
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") else f"{n} {noun}s"


# ------------------------------------------------------------------------------------------------
# Choosing extensions


def _select(extensions: Any) -> list[tuple[ExtensionCheck | None, Callable[[], BackpropExtension]]]:
    """(check, factory of a fresh extension) for each requested extension."""
    if extensions is None:
        extensions = "all"
    if isinstance(extensions, str):
        tokens = [t.strip() for t in extensions.split(",") if t.strip()]
        chosen: list[ExtensionCheck] = []
        for token in tokens:
            key = token.lower()
            if key == "all":
                picked = list(CHECKS)
            elif key in _GROUPS:
                picked = [c for c in CHECKS if c.order == _GROUPS[key]]
            elif key in _BY_NAME:
                picked = [_BY_NAME[key]]
            else:
                names = ", ".join(c.name for c in CHECKS)
                raise ValueError(
                    f"unknown extension {token!r}; choose all, first, second or {names}"
                )
            chosen.extend(c for c in picked if c not in chosen)
        if not chosen:
            raise ValueError("no extension selected")
        return [(c, getattr(_extensions, c.name)) for c in CHECKS if c in chosen]
    result = []
    for ext in extensions:
        if isinstance(ext, str):
            result.extend(_select(ext))
        elif isinstance(ext, type):
            raise ValueError(
                f"verify received the class {ext.__name__} instead of an extension: pass "
                f"{ext.__name__}() or the name {ext.__name__!r}."
            )
        elif isinstance(ext, BackpropExtension):
            check = _BY_NAME.get(type(ext).__name__.lower())
            if check is not None and check.savefield != ext.savefield:
                check = None
            result.append((check, lambda e=ext: copy.deepcopy(e)))
        else:
            raise ValueError(f"verify expects backpack extensions or their names, got {ext!r}")
    return result


# ------------------------------------------------------------------------------------------------
# Causes found by inspecting the model and loss


def _is_batchnorm_mixing(module: nn.Module) -> bool:
    bn = nn.modules.batchnorm._BatchNorm
    return isinstance(module, bn) and (module.training or not module.track_running_stats)


def _tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _same_output(a: Any, b: Any) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb, strict=True)
    )


def _model_causes(model: nn.Module, x: Any) -> list[str]:
    causes = []
    mixing = [repr(n or "<model>") for n, m in model.named_modules() if _is_batchnorm_mixing(m)]
    if mixing:
        causes.append(
            f"BatchNorm in train mode ({', '.join(mixing)}): its batch statistics mix the "
            "samples, so per-sample quantities are not defined (BatchGrad warns, the others "
            "refuse). Call model.eval() to use the running statistics."
        )
    dropout = [
        repr(n or "<model>")
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    ]
    if dropout:
        causes.append(
            f"Dropout in train mode ({', '.join(dropout)}): every forward pass draws a new mask, "
            "so no second pass (the reference's) sees the same model. Call model.eval(), or "
            "compare quantities of one and the same forward pass."
        )
    probe = copy.deepcopy(model)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            first = probe(x)
            torch.manual_seed(2)
            second = probe(x)
        if not _same_output(first, second) and not dropout:
            causes.append(
                "The model is stochastic: two forward passes on the same input differ (a random "
                "layer in train mode?). Quantities of one backward cannot match a reference "
                "computed from other forward passes."
            )
    except Exception:  # the forward itself fails: the rows will say so
        pass
    outside = [
        f"{name}.{pname}" if name else pname
        for name, m in model.named_modules()
        if next(m.children(), None) is not None and find_rule(m) is None
        for pname, p in m.named_parameters(recurse=False)
        if p.requires_grad
    ]
    if outside:
        causes.append(
            f"Parameters held directly by a module with submodules ({', '.join(outside)}): the "
            "custom forward uses them in functional operations, outside any extended leaf "
            "module. backpack then treats that whole module as one layer (torch.func "
            "fallback); move such parameters into a small module of their own."
        )
    return causes


def _loss_causes(lossfunc: Any) -> tuple[list[str], list[str]]:
    causes: list[str] = []
    notes: list[str] = []
    if not isinstance(lossfunc, nn.Module):
        return causes, notes  # a function: judged by what the second-order rows say (below)
    if not isinstance(lossfunc, _SUPPORTED_LOSSES):
        causes.append(
            f"The loss {type(lossfunc).__name__} is not one backpack knows (MSELoss, "
            "CrossEntropyLoss, BCEWithLogitsLoss): second-order extensions need the loss "
            "Hessian's factorisation from it."
        )
    reduction = getattr(lossfunc, "reduction", None)
    if reduction is not None and reduction not in ("mean", "sum"):
        causes.append(
            f"Unusual reduction {reduction!r}: backpack needs a scalar loss, reduced with "
            "'mean' or 'sum'."
        )
    return causes, notes


def _function_loss_cause(lossfunc: Any, rows: list[VerifyRow]) -> str | None:
    """Why second-order extensions may refuse a loss given as a function (None: they did not)."""
    if isinstance(lossfunc, nn.Module):
        return None
    if not any(r.order == 2 and r.status in ("n/a", "FAIL") for r in rows):
        return None
    name = getattr(lossfunc, "__name__", type(lossfunc).__name__)
    return (
        f"The loss function ({name}) is a function: second-order extensions recognise "
        "F.cross_entropy, F.mse_loss and F.binary_cross_entropy_with_logits called in it (and "
        "MSELoss, CrossEntropyLoss and BCEWithLogitsLoss modules, extended or not), no other loss."
    )


# ------------------------------------------------------------------------------------------------
# Running


@contextlib.contextmanager
def _reference_kernels() -> Iterator[None]:
    """Run attention with the math kernel while computing references.

    Forward-mode and double derivatives of the fused kernels (flash attention on the CPU, ...)
    are not implemented in torch.
    """
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _group_by_reason(items: list[str]) -> str:
    """'a (why), b (why), c (other)' as 'a, b (why); c (other)'."""
    groups: dict[str, list[str]] = {}
    for item in items:
        name, sep, why = item.partition(" (")
        groups.setdefault(f" ({why}" if sep else "", []).append(name)
    return "; ".join(", ".join(names) + why for why, names in groups.items())


def _take(obj: Any, count: int) -> Any:
    if isinstance(obj, Tensor):
        return obj[:count]
    if isinstance(obj, (tuple, list)):
        return type(obj)(_take(o, count) for o in obj)
    return obj


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to(dtype) if obj.is_floating_point() else obj.detach()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(o, dtype) for o in obj)
    return obj


def _subset(model: nn.Module, x: Any, y: Any, samples: int) -> tuple[Any, Any, str]:
    """The first `samples` samples of (x, y), if the first axis of x is the sample axis."""
    probe = copy.deepcopy(model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        output = probe(x)
    if not isinstance(output, Tensor):
        raise ValueError(
            f"verify needs a model that returns one tensor (the loss is called as "
            f"lossfunc(model(X), y)), but this one returns a {type(output).__name__}. Wrap it in "
            "a module whose forward returns the tensor the loss takes, e.g. "
            "`return self.model(x)[0]` (or `.logits` for Hugging Face outputs)."
        )
    n = output.shape[0]
    if n <= samples:
        return x, y, ""
    xs, ys = _take(x, samples), _take(y, samples)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            ok = probe(xs).shape[0] == samples
    except Exception:
        ok = False
    if ok and isinstance(ys, Tensor) and ys.shape[:1] == (samples,):
        return xs, ys, ""
    return x, y, (
        f"X's first axis is not the sample axis, so all {n} samples are used (samples={samples})."
    )


def verify(
    model: nn.Module,
    lossfunc: Callable[[Tensor, Any], Tensor],
    X: Any,
    y: Any,
    extensions: str | Sequence[BackpropExtension | str] | None = None,
    samples: int = 8,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> VerifyReport:
    """Check backpack's quantities on a model against float64 autograd; return a report.

    Copies of `model` and `lossfunc` are cast to `dtype`, extended, and run once per
    extension on the first `samples` samples of `X` and `y`; each stored quantity is compared
    with its definition, computed without backpack in float64 (`backpack.reference`).
    Diagonals are compared at up to 32 entries per parameter, matrices and product
    functions through products with random directions. The arguments are not modified.

    Args:
        model: The model (extended or not).
        lossfunc: The loss function, called as `lossfunc(model(X), y)`.
        X: A batch of inputs (its first axis, or the model output's, indexes samples).
        y: The targets.
        extensions: Extension instances, names ("BatchGrad", ...), or "first", "second",
            "all" (the default: every built-in extension).
        samples: How many samples of the batch to use (the first ones).
        dtype: Dtype of the copies backpack runs on (the tolerance follows it: 1e-9 relative
            for float64, 1e-4 for float32).
        seed: Seed of torch's generator before each extension (Monte-Carlo sampling).

    Returns:
        A `VerifyReport`; `print` it for a table, `report.ok` says whether all match.

    """
    if samples < 1:
        raise ValueError(f"samples must be positive, got {samples}")
    chosen = _select(extensions)
    report = VerifyReport(samples=samples, dtype=dtype)
    tolerance = RTOL.get(dtype, 1e-4)

    work = copy.deepcopy(model).to(dtype)
    loss_copy = copy.deepcopy(lossfunc) if isinstance(lossfunc, nn.Module) else lossfunc
    x, y = _cast(X, dtype), _cast(y, dtype)
    x, y, note = _subset(work, x, y, samples)
    if note:
        report.notes.append(note)
    report.samples = _tensors(y)[0].shape[0] if _tensors(y) else samples
    report.causes.extend(_model_causes(work, x))
    loss_causes, loss_notes = _loss_causes(lossfunc)
    report.causes.extend(loss_causes)
    report.notes.extend(loss_notes)

    try:
        with torch.random.fork_rng(devices=[]), _reference_kernels():
            torch.manual_seed(seed)
            reference = Reference(work, loss_copy, x, y, seed=seed)
    except Exception as error:  # noqa: BLE001 - reported, not raised
        reference = None
        report.notes.append(f"No reference: {type(error).__name__}: {_first_sentence(error)}.")
    if reference is not None:
        try:
            with _reference_kernels():
                coupling = reference.couples_samples()
        except Exception:  # noqa: BLE001 - e.g. a loss that is not a scalar
            coupling = 0.0
        if coupling > 1e-8:
            report.causes.append(
                "The loss couples the samples (its Hessian w.r.t. the output has blocks between "
                "different samples): it is not a sum of per-sample terms, so per-sample "
                "quantities are not defined."
            )

    extend(work)
    if isinstance(loss_copy, nn.Module):
        extend(loss_copy)
    for check, make in chosen:
        skip = None
        if check is not None and check.unchecked is not None and reference is not None:
            skip = check.unchecked(reference)
        row = _run_one(check, make, work, loss_copy, x, y, reference, tolerance, seed, skip)
        report.rows.append(row)
    cause = _function_loss_cause(lossfunc, report.rows)
    if cause is not None:
        report.causes.append(cause)
    return report


def _run_one(
    check: ExtensionCheck | None,
    make: Callable[[], BackpropExtension],
    model: nn.Module,
    lossfunc: Callable,
    x: Any,
    y: Any,
    reference: Reference | None,
    tolerance: float,
    seed: int,
    skip: str | None = None,
) -> VerifyRow:
    """Run one extension and compare what it stores with the reference.

    With `skip` (why the reference cannot check it on this model), the extension is not
    computed: KFRA only checks whether it accepts the model (an "n/a" row if not), since its
    dense matrices can take long; any other extension is not run at all.
    """
    ext = make()
    name = check.name if check is not None else type(ext).__name__
    row = VerifyRow(name, ext.savefield, check.reference if check else "", tolerance=tolerance)
    row.order = check.order if check is not None else 0
    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None
        if hasattr(p, ext.savefield):
            delattr(p, ext.savefield)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(seed)
        if skip is not None and name != "KFRA":
            row.status, row.note = "unchecked", f"skipped: {skip}"
            return row
        try:
            loss = lossfunc(model(x), y)
            with backpack(ext), kfra.plan_only() if skip else contextlib.nullcontext():
                loss.backward()
        except kfra.Planned:
            row.status, row.note = "unchecked", f"skipped (not computed): {skip}"
            return row
        except NotImplementedError as error:
            row.status, row.note = "n/a", _first_sentence(error)
            return row
        except Exception as error:  # noqa: BLE001 - an unexpected error is a failure
            row.status, row.note = "FAIL", f"{type(error).__name__}: {_first_sentence(error)}"
            return row
    warned = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    try:
        if check is None:
            row.status, row.note = "unchecked", f"no reference for {name}"
            return row
        if reference is None:
            row.status, row.note = "unchecked", "no reference for this model"
            return row
        pairs: list[Pair] = []
        unchecked: list[str] = []
        for pname, param in params:
            value = getattr(param, ext.savefield, None)
            if value is None:
                if param.grad is None:
                    continue  # the parameter took no part in this loss
                if getattr(ext, "output", None) == "kron":
                    # layers without Kronecker factors are skipped with a warning
                    unchecked.append(f"{pname} (no Kronecker factors for its layer)")
                    continue
                raise ShapeError(f"nothing stored on {pname} although it has a gradient")
            try:
                with _reference_kernels():
                    pairs.extend(check.check(reference, pname, value, param))
            except Unchecked as why:
                unchecked.append(f"{pname} ({why})")
        if not pairs and unchecked:
            row.status, row.note = "unchecked", unchecked[0]
            return row
        error, deviation, worst = _compare(pairs, tolerance)
        row.error, row.deviation = error, deviation
        row.excess = worst if error is not None else None
        if error is not None and not worst <= 1.0:
            row.status = "FAIL"
        elif error is None and deviation is not None:
            row.status = "MC"
        if unchecked:
            row.note = f"not checked: {_group_by_reason(unchecked)}"
            row.partial = True
        if warned and row.status == "FAIL":
            row.note = f"warned: {_first_sentence(warned[0])}"
    except ShapeError as error:
        row.status, row.note = "FAIL", str(error)
    except Exception as error:  # noqa: BLE001 - the reference itself broke on this model
        row.status = "unchecked"
        row.note = f"reference failed: {type(error).__name__}: {_first_sentence(error)}"
    finally:
        for _, p in params:
            if hasattr(p, ext.savefield):
                delattr(p, ext.savefield)
    return row


# ------------------------------------------------------------------------------------------------
# Output

_WIDTHS = (17, 20, 9, 7, 5)


def format_report(report: VerifyReport, width: int = 100) -> str:
    """The report as a table, followed by likely causes and notes."""
    dtype = str(report.dtype).replace("torch.", "")
    lines = [
        f"backpack.verify: {len(report.rows)} extension{'s' * (len(report.rows) != 1)} on "
        f"{report.samples} sample{'s' * (report.samples != 1)} ({dtype}) against float64 autograd"
    ]
    header = ("extension", "attribute", "status", "rel err", "tol", "reference / note")
    lines.append(_line(header))
    for row in report.rows:
        error = "-" if row.error is None else f"{row.error:.1e}"
        tol = f"{row.tolerance:.0e}" if row.status in ("ok", "FAIL") else ""
        if row.status == "MC":
            dev = "?" if row.deviation is None else f"{row.deviation:.0%}"
            text = row.reference.replace("{dev}", dev)
        else:
            text = row.reference.replace(" {dev}", "").replace("{dev}", "")
        if row.note:
            text = row.note if row.status in ("n/a", "unchecked", "FAIL") else f"{text}; {row.note}"
        cells = (row.extension, row.savefield, row.status, error, tol)
        lead = _line(cells)
        room = max(20, width - len(lead) - 1)
        if row.status in ("ok", "MC") and not row.partial:
            chunks = textwrap.wrap(text, room, max_lines=2, placeholder=" …") or [""]
        else:  # a reason, or what was left unchecked: never cut
            chunks = textwrap.wrap(text, room) or [""]
        lines.append(lead + " " + chunks[0])
        lines.extend(" " * (len(lead) + 1) + c for c in chunks[1:])
    trouble = not report.ok or any(r.status == "n/a" for r in report.rows)
    title = "Likely causes" if trouble else "Found in the model"
    for heading, items in ((title, report.causes), ("Notes", report.notes)):
        if items:
            lines.append(f"{heading}:")
            for item in items:
                wrapped = textwrap.wrap(item, width, initial_indent="- ", subsequent_indent="  ")
                lines.extend(wrapped)
    lines.extend(textwrap.wrap(report.summary(), width, subsequent_indent="  "))
    return "\n".join(lines)


def _line(cells: Sequence[str]) -> str:
    parts = []
    for i, cell in enumerate(cells):
        if i < len(_WIDTHS):
            parts.append(cell.rjust(_WIDTHS[i]) if i in (3, 4) else cell.ljust(_WIDTHS[i]))
        else:
            parts.append(cell)
    return " ".join(parts)


# ------------------------------------------------------------------------------------------------
# Command line: python -m backpack verify module:factory


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by `module:function` (a module path, or a `.py` file path)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"expected MODULE:FUNCTION (e.g. my_models:make_problem), got {spec!r}")
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"no such file: {target}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(target)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{target} has no callable {attr!r}")
    return factory


#: the exit statuses of `python -m backpack verify`, as its --help lists them
EXIT_STATUS_HELP = """exit status:
  0  OK: every quantity computed was checked and matches float64 autograd
  1  FAIL: a quantity mismatches (or an extension failed with an unexpected error)
  2  bad arguments, or a problem verify cannot take (e.g. a model returning a tuple)
  3  INCOMPLETE: no mismatch, but some quantity could not be checked (no reference
     for this model); also NOTHING CHECKED: no quantity could be compared at all"""


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m backpack verify`."""
    parser = argparse.ArgumentParser(
        prog="python -m backpack verify",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Check backpack's quantities on your model against float64 autograd. FACTORY names "
            "a function (module:function or path/to/file.py:function) that returns "
            "(model, lossfunc, X, y).",
            79,
        ),
        epilog=EXIT_STATUS_HELP,
    )
    parser.add_argument("factory", metavar="FACTORY", help="module:function returning the problem")
    parser.add_argument(
        "--extensions",
        default="all",
        metavar="LIST",
        help='comma-separated extension names, or "first", "second", "all" (default: all)',
    )
    parser.add_argument(
        "--samples", type=int, default=8, help="samples of the batch to use (default: 8)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="dtype backpack runs in; the reference is always float64 (default: float64)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for Monte-Carlo sampling (0)")
    return parser


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> int:
    """Run `verify` on the problem a factory returns; the exit status (`EXIT_STATUS_HELP`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    out = sys.stdout if stream is None else stream
    if args.samples < 1:
        parser.error("--samples must be positive")
    try:
        _select(args.extensions)
        factory = load_factory(args.factory)
    except (ValueError, ImportError) as error:
        parser.error(str(error))
    problem = factory()
    if isinstance(problem, dict):
        problem = tuple(problem[k] for k in ("model", "lossfunc", "X", "y"))
    if not isinstance(problem, (tuple, list)) or len(problem) != 4:
        parser.error(f"{args.factory} must return (model, lossfunc, X, y)")
    model, lossfunc, x, y = problem
    try:
        report = verify(
            model,
            lossfunc,
            x,
            y,
            extensions=args.extensions,
            samples=args.samples,
            dtype=getattr(torch, args.dtype),
            seed=args.seed,
        )
    except ValueError as error:  # a problem verify cannot take (e.g. a tuple output)
        print(f"python -m backpack verify: error: {error}", file=out)
        return 2
    print(report, file=out)
    return report.exit_code


__all__ = ["VerifyReport", "VerifyRow", "format_report", "main", "verify"]
