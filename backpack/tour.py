"""A guided tour of the library: `python -m backpack` (also `make demo`).

Three small networks (an MLP, a CNN and a residual network with a custom `forward`) are trained
for a few Adam steps on the embedded handwritten digits, then see one batch of them. For every
extension, one backward pass inside `with backpack(...)` computes its quantity, which is

* checked against a reference that never touches backpack: a float64 copy of the un-extended
  model differentiated by plain autograd (a loop over samples for first-order quantities,
  `torch.func` forward- and reverse-mode derivatives for curvature; diagonals are compared at up
  to `MAX_ENTRIES` entries per parameter, matrix-valued quantities through products with random
  directions);
* timed relative to a plain forward + backward pass of the same model without backpack.

Monte-Carlo quantities have no exact reference; the tour shows how far one sample lies from the
exact value instead (not a check). An extension that refuses a model (`NotImplementedError`) is
listed as "n/a" with its reason. The result is a table per model, a figure (see
`backpack.plotting`) and an exit code: 1 if any checked quantity is off by more than its
tolerance, else 0.

To add a model, append a `TourModel` to `MODELS`; to add an extension, append a `TourExtension`
to `EXTENSIONS` with a `check` that turns the stored value into (result, expected) pairs.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack import backpack, extend, extensions
from backpack.extensions import (
    KFAC,
    BackpropExtension,
    BatchL2Grad,
    DiagGGNExact,
    SumGradSquared,
)
from backpack.reference import (  # noqa: F401 (re-exported: the tour's references)
    CHECKS,
    MAX_ENTRIES,
    NUM_DIRECTIONS,
    RTOL,
    SUMMANDS_PER_RTOL,
    Check,
    Pair,
    Reference,
    ShapeError,
    Unchecked,
    compare,
)
from backpack.reference import first_sentence as _first_sentence
from backpack.utils.examples import load_one_batch_mnist

# ------------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class TourModel:
    """A model of the tour.

    Args:
        name: Short name, used on the command line and in the output.
        description: One line describing the architecture.
        make_model: Builds a fresh float32 model (parameters from torch's global generator).
        make_loss: Builds the loss function.
        flat: Whether the model takes flat `[N, 784]` inputs (else `[N, 1, 28, 28]` images).
        note: Printed under the model's heading.

    """

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    make_loss: Callable[[], nn.Module] = nn.CrossEntropyLoss
    flat: bool = True
    note: str = ""


def mlp() -> nn.Module:
    """The MLP of the examples: Flatten, Linear 784->64, ReLU, Linear 64->10."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    """A small CNN: Conv2d 1->8 (3x3), ReLU, MaxPool2d(2), Flatten, Linear 1352->10."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 13 * 13, 10),
    )


class ResNet(nn.Module):
    """A small residual network whose `forward` uses functional ops.

    A strided convolution, then one residual block `relu(h + conv(h))` written with `torch.add`
    and `F.relu`, max-pooling and a linear classifier. No `Sequential`, no converter.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * 7 * 7, 10)

    def forward(self, x: Tensor) -> Tensor:
        """Classify `[N, 1, 28, 28]` images into 10 classes."""
        h = F.relu(self.stem(x))
        h = F.relu(torch.add(h, self.conv(h)))
        return self.head(F.max_pool2d(h, 2).flatten(1))


MODELS: list[TourModel] = [
    TourModel("mlp", "Flatten, Linear(784→64), ReLU, Linear(64→10)", mlp),
    TourModel(
        "cnn", "Conv2d(1→8, 3×3), ReLU, MaxPool2d(2), Flatten, Linear(1352→10)", cnn, flat=False
    ),
    TourModel(
        "resnet",
        "custom forward: Conv2d stem, F.relu(torch.add(h, Conv2d(h))), max-pool, Linear",
        ResNet,
        flat=False,
        note=(
            "Functional ops need no modules: the Hessian extensions accept F.relu because it has "
            "no curvature (a curved one such as torch.tanh would need nn.Tanh, or "
            "extend(model, use_converter=True))."
        ),
    ),
]

# ------------------------------------------------------------------------------------------------
# References: `backpack.reference` (shared with `backpack.verify`)

@dataclass(frozen=True)
class TourExtension:
    """An extension of the tour and how to check it.

    Args:
        name: Name shown in the output (the extension's class name).
        make: Builds a fresh extension instance.
        savefield: Attribute the extension writes on each parameter.
        order: 1 for first-order, 2 for second-order extensions.
        reference: What the check compares with, in a few words.
        check: Turns the stored value of one parameter into pairs to compare.

    """

    name: str
    make: Callable[[], BackpropExtension]
    savefield: str
    order: int
    reference: str
    check: Check


EXTENSIONS: list[TourExtension] = [
    TourExtension(c.name, getattr(extensions, c.name), c.savefield, c.order, c.reference, c.check)
    for c in CHECKS
]

# ------------------------------------------------------------------------------------------------
# Running


@dataclass
class Row:
    """The outcome of one extension on one model (all parameters together).

    `status` is "ok", "FAIL" (error above tolerance, wrong shape or an unexpected exception),
    "n/a" (the extension refused the model with `NotImplementedError`; `note` says why) or
    "unchecked" (the tour has no reference for this model). `error` is the largest relative
    error, `excess` the largest ratio of error to tolerance, `deviation` the relative distance of
    a Monte-Carlo estimate from the exact value, `ratio` the time relative to plain autograd.
    """

    model: str
    extension: str
    savefield: str
    reference: str
    status: str = "ok"
    shape: str = ""
    error: float | None = None
    tolerance: float = 0.0
    deviation: float | None = None
    excess: float | None = None
    note: str = ""
    ratio: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the row is not a failure."""
        return self.status != "FAIL"


@dataclass
class ModelReport:
    """Results of the tour for one model."""

    model: TourModel
    num_params: int
    first_param: tuple[str, tuple[int, ...]]
    baseline_s: float
    accuracy: float = float("nan")
    rows: list[Row] = field(default_factory=list)
    figure: Any = None


class Progress:
    """A one-line progress indicator, overwritten in place; silent unless `stream` is a TTY."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream if stream is not None and stream.isatty() else None
        self.start = time.perf_counter()

    def update(self, text: str) -> None:
        """Replace the progress line by `text`."""
        if self.stream is not None:
            line = f"[{time.perf_counter() - self.start:5.1f}s] {text}"[:100]
            self.stream.write("\r\033[K" + line)
            self.stream.flush()

    def clear(self) -> None:
        """Erase the progress line."""
        if self.stream is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_times(
    steps: dict[str, Callable[[], None]],
    repeats: int,
    device: torch.device,
    progress: Progress,
    label: str,
) -> dict[str, float]:
    """Median wall time of each step over `repeats` rounds, after one warm-up round.

    The steps run interleaved (one of each per round), so a change of machine load during the
    measurement affects all of them alike and their ratios stay meaningful.
    """
    times: dict[str, list[float]] = {key: [] for key in steps}
    for round_ in range(repeats + 1):
        progress.update(f"{label}: timing, round {round_ + 1}/{repeats + 1}")
        for key, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            if round_ > 0:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def _backward(
    model: nn.Module, lossfunc: nn.Module, x: Tensor, y: Tensor, exts: Sequence[BackpropExtension]
) -> None:
    """One forward + backward, inside `backpack(*exts)` if extensions are given."""
    model.zero_grad()
    loss = lossfunc(model(x), y)
    if exts:
        with backpack(*exts):
            loss.backward()
    else:
        loss.backward()


def _clear(model: nn.Module, savefields: Sequence[str]) -> None:
    for param in model.parameters():
        for savefield in savefields:
            if hasattr(param, savefield):
                delattr(param, savefield)


def _describe(value: Any, sym: dict[str, str]) -> str:
    if isinstance(value, Tensor):
        return "[" + ", ".join(map(str, value.shape)) + "]"
    if isinstance(value, (list, tuple)) and all(isinstance(v, Tensor) for v in value):
        return f" {sym['kron']} ".join(sym["x"].join(map(str, v.shape)) for v in value)
    if callable(value):
        return "callable"
    return type(value).__name__


def _compare(pairs: Sequence[Pair], row: Row) -> None:
    """Fill the row's error (exact pairs) and deviation (Monte-Carlo pairs)."""
    error, deviation, worst = compare(pairs, row.tolerance)
    row.error, row.deviation = error, deviation
    row.excess = worst if error is not None else None
    if error is not None and not worst <= 1.0:
        row.status = "FAIL"


def check_extension(
    ext: TourExtension,
    model: nn.Module,
    lossfunc: nn.Module,
    x: Tensor,
    y: Tensor,
    reference: Reference,
    row: Row,
    sym: dict[str, str],
) -> bool:
    """Run one extension once, check every parameter's quantity; return whether it ran."""
    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    try:
        _backward(model, lossfunc, x, y, (ext.make(),))
    except NotImplementedError as error:
        row.status, row.note = "n/a", _first_sentence(str(error))
        return False
    except Exception as error:  # anything else is a bug worth failing the tour for
        row.status, row.note = "FAIL", f"{type(error).__name__}: {_first_sentence(str(error))}"
        return False
    pairs: list[Pair] = []
    try:
        for i, (name, param) in enumerate(params):
            value = getattr(param, ext.savefield, None)
            if value is None:
                raise ShapeError(f"nothing stored on {name}")
            if i == 0:
                row.shape = _describe(value, sym)
            pairs.extend(ext.check(reference, name, value, param))
        _compare(pairs, row)
    except ShapeError as error:
        row.status, row.note = "FAIL", f"{name}: {error}"
    except (NotImplementedError, Unchecked) as error:  # no reference for this model
        row.status, row.note = "unchecked", _first_sentence(str(error))
    except Exception as error:  # the check itself broke: report it, finish the tour
        row.status, row.note = "FAIL", f"check of {name}: {type(error).__name__}: {error}"
    finally:
        _clear(model, [ext.savefield])
    return True


@dataclass(frozen=True)
class Settings:
    """How the tour runs (from the command line)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    repeats: int = 5
    seed: int = 0
    train_steps: int = 60
    figure: bool = False


def pretrain(spec: TourModel, model: nn.Module, lossfunc: nn.Module, settings: Settings) -> None:
    """A few Adam steps on random batches of the digits, so the tour sees a model that has learned.

    Per-sample gradients and curvature of a freshly initialised network are uninteresting: every
    sample looks alike. A short training run separates well from badly classified samples.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(settings.train_steps):
        x, y = load_one_batch_mnist(batch_size=128, flat=spec.flat)
        optimizer.zero_grad()
        lossfunc(model(x.to(settings.device, settings.dtype)), y.to(settings.device)).backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)


def run_model(
    spec: TourModel,
    extensions: Sequence[TourExtension],
    x: Tensor,
    y: Tensor,
    settings: Settings,
    progress: Progress,
    sym: dict[str, str],
) -> ModelReport:
    """Check and time every extension on one model (and collect the figure's data)."""
    device, dtype, seed = settings.device, settings.dtype, settings.seed
    torch.manual_seed(seed)
    model = spec.make_model().to(device=device, dtype=dtype)
    lossfunc = spec.make_loss()
    inputs = (x if spec.flat else x.reshape(-1, 1, 28, 28)).to(device=device, dtype=dtype)
    targets = y.to(device)
    label = spec.name
    if settings.train_steps:
        progress.update(f"{label}: {settings.train_steps} training steps")
        pretrain(spec, model, lossfunc, settings)
    with torch.no_grad():
        accuracy = (model(inputs).argmax(1) == targets).double().mean().item()

    # taken before `extend`, so neither the reference nor the baseline ever sees backpack
    progress.update(f"{label}: reference forward pass")
    reference = Reference(model, lossfunc, inputs, targets, seed=seed)
    plain = copy.deepcopy(model)
    model = extend(model)
    lossfunc = extend(lossfunc)

    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    report = ModelReport(
        spec,
        num_params=sum(p.numel() for _, p in params),
        first_param=(params[0][0], tuple(params[0][1].shape)),
        baseline_s=float("nan"),
        accuracy=accuracy,
    )
    rtol = RTOL.get(dtype, 1e-4)
    ran: list[TourExtension] = []
    for i, ext in enumerate(extensions):
        progress.update(f"{label}: checking {ext.name} ({i + 1}/{len(extensions)})")
        row = Row(spec.name, ext.name, ext.savefield, ext.reference, tolerance=rtol)
        torch.manual_seed(seed)  # Monte-Carlo extensions sample from the global generator
        if check_extension(ext, model, lossfunc, inputs, targets, reference, row, sym):
            ran.append(ext)
        report.rows.append(row)

    def step(net: nn.Module, ext: TourExtension | None) -> Callable[[], None]:
        def run() -> None:
            _backward(net, lossfunc, inputs, targets, () if ext is None else (ext.make(),))
            if ext is not None:
                _clear(net, [ext.savefield])

        return run

    steps = {"plain": step(plain, None)}
    steps.update({ext.name: step(model, ext) for ext in ran})
    seconds = _median_times(steps, settings.repeats, device, progress, label)
    report.baseline_s = seconds["plain"]
    for row in report.rows:
        if row.extension in seconds:
            row.ratio = seconds[row.extension] / report.baseline_s

    if settings.figure:
        progress.update(f"{label}: data for the figure")
        torch.manual_seed(seed)
        report.figure = figure_data(spec, model, lossfunc, inputs, targets)
    return report


def figure_data(
    spec: TourModel, model: nn.Module, lossfunc: nn.Module, x: Tensor, y: Tensor
) -> Any:
    """One backward with the extensions the figure shows; returns a `plotting.ModelPanel`."""
    from backpack.plotting import LayerCurvature, LayerSpectrum, ModelPanel

    exts: list[BackpropExtension] = [BatchL2Grad(), SumGradSquared(), DiagGGNExact(), KFAC()]
    try:
        _backward(model, lossfunc, x, y, exts)
    except NotImplementedError:
        exts = exts[:2]
        _backward(model, lossfunc, x, y, exts)
    n = x.shape[0]
    with torch.no_grad():
        misclassified = (model(x).argmax(1) != y).cpu()
    # the tour's loss averages over the batch: g_n = ∇ℓ_n / N
    modules: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            modules.setdefault(name.rpartition(".")[0], []).append((name, param))
    l2 = sum(p.batch_l2 for group in modules.values() for _, p in group)
    grad_norm = math.sqrt(sum(p.grad.square().sum().item() for g in modules.values() for _, p in g))
    curvature, spectra = [], []
    for module_name, group in modules.items():
        module = model.get_submodule(module_name)
        label = f"{module_name} ({type(module).__name__})"
        params = [p for _, p in group]
        if all(hasattr(p, "diag_ggn_exact") for p in params):
            curvature.append(
                LayerCurvature(
                    label,
                    torch.cat([p.diag_ggn_exact.flatten() for p in params]).detach().cpu(),
                    torch.cat([n * p.sum_grad_squared.flatten() for p in params]).detach().cpu(),
                )
            )
        weight = dict(group).get(f"{module_name}.weight")
        if weight is not None and isinstance(getattr(weight, "kfac", None), list):
            g, a = (f.detach().cpu().double() for f in weight.kfac)
            spectra.append(
                LayerSpectrum(
                    label,
                    torch.linalg.eigvalsh((g + g.T) / 2),
                    torch.linalg.eigvalsh((a + a.T) / 2),
                )
            )
    _clear(model, [e.savefield for e in exts])
    return ModelPanel(
        name=spec.name,
        description=spec.description,
        sample_grad_norms=(n * l2.detach().cpu().double().sqrt()),
        mean_grad_norm=grad_norm,
        misclassified=misclassified,
        curvature=curvature,
        spectra=spectra,
    )


# ------------------------------------------------------------------------------------------------
# Output

_UNICODE = {"rule": "─", "kron": "⊗", "x": "×", "dot": "·"}
_ASCII = {"rule": "-", "kron": "(x)", "x": "x", "dot": "|"}
_TRANSLITERATE = str.maketrans(
    {
        "→": "->",
        "×": "x",
        "ᵀ": "^T",
        "ₙ": "_n",
        "ᵢ": "_i",
        "²": "^2",
        "∂": "d",
        "ℓ": "l",
        "θ": "t",
        "¹": "*",
        "·": "|",
        "…": "...",
    }
)


def _symbols(stream: TextIO) -> dict[str, str]:
    encoding = getattr(stream, "encoding", None)
    if encoding is None:
        return _UNICODE
    try:
        "─⊗×·→ᵀₙᵢ²∂ℓθ¹…".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return _ASCII
    return _UNICODE


#: column widths of the table: extension, attribute, shape, reference, rel err, time
_WIDTHS = (17, 20, 20, 22, 7, 6)
_LINE = 99


def _format_ratio(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.1f}x"


def format_report(report: ModelReport, sym: dict[str, str]) -> str:
    """Render the table of one model: one row per extension, all parameters together."""
    spec = report.model
    title = f"{sym['rule'] * 2} {spec.name}: {spec.description} "
    out = [
        title + sym["rule"] * max(2, _LINE - len(title)),
        f"  {report.num_params:,} parameters {sym['dot']} {type(spec.make_loss()).__name__} "
        f"{sym['dot']} {report.accuracy:.0%} correct on the batch "
        f"{sym['dot']} plain forward+backward {report.baseline_s * 1e3:.2f} ms",
    ]
    if spec.note:
        out.extend(textwrap.wrap(spec.note, _LINE, initial_indent="  ", subsequent_indent="  "))

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if i >= 4 else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, _WIDTHS))
        ]
        return ("  " + " ".join(parts)).rstrip()

    header = ("extension", "attribute", f"shape ({report.first_param[0]})", "reference")
    out.append(line((*header, "rel err", "time")))
    for row in report.rows:
        if row.status in ("n/a", "FAIL") and row.error is None:
            lead = line((row.extension, row.savefield)) + " " * (_WIDTHS[1] - len(row.savefield))
            text = f"{row.status}: {row.note}"
            chunks = textwrap.wrap(text, _LINE - len(lead) - 1)
            for j, chunk in enumerate(chunks):
                out.append((lead if j == 0 else " " * len(lead)) + " " + chunk)
            continue
        dev = "?" if row.deviation is None else f"{row.deviation:.0%}"
        reference = row.note if row.note else row.reference.replace("{dev}", dev)
        error = "-" if row.error is None else f"{row.error:.1e}"
        cells = (
            row.extension,
            row.savefield,
            row.shape,
            reference,
            error,
            _format_ratio(row.ratio),
        )
        out.append(line(cells) + ("  FAIL" if row.status == "FAIL" else ""))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# Command line

_GROUPS = {"first": 1, "second": 2}


def select_extensions(spec: str) -> list[TourExtension]:
    """Parse `--extensions`: "all", "first", "second" or a comma list of names (mixable)."""
    by_name = {ext.name.lower(): ext for ext in EXTENSIONS}
    chosen: list[TourExtension] = []
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        key = token.lower()
        if key == "all":
            picked = list(EXTENSIONS)
        elif key in _GROUPS:
            picked = [e for e in EXTENSIONS if e.order == _GROUPS[key]]
        elif key in by_name:
            picked = [by_name[key]]
        else:
            names = ", ".join(e.name for e in EXTENSIONS)
            raise ValueError(f"unknown extension {token!r}; choose all, first, second or {names}")
        chosen.extend(e for e in picked if e not in chosen)
    if not chosen:
        raise ValueError("no extension selected")
    return [e for e in EXTENSIONS if e in chosen]


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line interface of `python -m backpack`."""
    parser = argparse.ArgumentParser(
        prog="python -m backpack",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "A tour of backpack, offline, on the bundled handwritten digits.\n\n"
            + textwrap.fill(
                "Each model (an MLP, a CNN, a residual network with a custom forward) is trained "
                "for a few Adam steps; then, for each extension, one backward pass inside `with "
                "backpack(...)` computes its quantity on one batch. The tour checks it against "
                "plain autograd in float64 (no backpack involved), times it relative to a plain "
                "forward+backward, prints one table per model and draws a PNG figure (per-sample "
                "gradient norms, GGN diagonal vs empirical Fisher, KFAC spectra; needs "
                "matplotlib: pip install matplotlib). Exit code 1 if any checked "
                "quantity is off by more than its tolerance.",
                79,
            )
        ),
        epilog=textwrap.fill("extensions: " + ", ".join(e.name for e in EXTENSIONS), 79)
        + "\n\n"
        + textwrap.fill(
            "To check every quantity on your own model instead: python -m backpack verify "
            "MODULE:FACTORY (python -m backpack verify --help; docs/verify.md).",
            79,
        ),
    )
    parser.add_argument(
        "--model",
        choices=[*(m.name for m in MODELS), "all"],
        default="all",
        help="which model to tour (default: all)",
    )
    parser.add_argument(
        "--extensions",
        default="all",
        metavar="LIST",
        help='comma-separated extension names, or "first", "second", "all" (default: all)',
    )
    parser.add_argument("--batch-size", type=int, default=64, help="samples in the batch (64)")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where to compute (cpu)"
    )
    parser.add_argument(
        "--output",
        default="backpack_tour.png",
        metavar="PNG",
        help="where to write the figure (default: backpack_tour.png)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds after one warm-up round; median (5)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data and parameters (0)")
    parser.add_argument(
        "--train-steps",
        type=int,
        default=60,
        metavar="N",
        help="Adam steps on the digits before the tour, so the models have learned something "
        "(60; 0 = freshly initialised)",
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="dtype of model and data (float32); references always use float64",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (1: the models are tiny, and one thread keeps the timings "
        "steady on a busy machine; 0: torch's default)",
    )
    # the usage line names the second command too (its options: python -m backpack verify -h)
    tour_usage = parser.format_usage().removeprefix("usage: ").rstrip()
    parser.usage = f"{tour_usage}\n       python -m backpack verify [-h] [options] FACTORY"
    return parser


def _notes(reports: Sequence[ModelReport], tolerance: float) -> list[str]:
    rows = [row for report in reports for row in report.rows]
    names = {row.extension for row in rows}
    notes = [
        f"rel err: max |backpack - reference| / max |reference| over all parameters; tolerance "
        f"{tolerance:.0e} (more for entries that sum more than {SUMMANDS_PER_RTOL} terms)."
    ]
    if any(ext.order == 2 for ext in EXTENSIONS if ext.name in names):
        notes.append(
            f"Curvature diagonals are compared at {MAX_ENTRIES} random entries per parameter "
            f"(all entries of smaller ones), matrices and callables through products with "
            f"{NUM_DIRECTIONS} random directions."
        )
    if any(row.deviation is not None for row in rows):
        notes.append(
            "MC: Monte-Carlo estimate with mc_samples=1, so no exact reference; shown is its "
            "relative distance from the exact value, not a check (for KFAC: of G; A is checked)."
        )
    if "PCHMP" in names:
        notes.append(
            "¹ Where activations add no second derivatives (ReLU, max-pooling), the "
            "positive-curvature Hessian equals the Hessian, and is checked against it; elsewhere "
            "its quadratic form along each direction must lie at or above the GGN's."
        )
    return notes


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> int:
    """Run the tour; return 0 if every checked quantity matches its reference, else 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    out = sys.stdout if stream is None else stream
    if args.batch_size < 2:
        parser.error(
            f"--batch-size must be at least 2, got {args.batch_size}: with one sample, Variance "
            "and the per-sample statistics have nothing to compare, and the pairwise dot products "
            "of BatchDotGrad are a single number"
        )
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    if args.train_steps < 0:
        parser.error("--train-steps must not be negative")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested, but CUDA is not available")
    if args.threads < 0:
        parser.error("--threads must not be negative")
    try:
        extensions = select_extensions(args.extensions)
    except ValueError as error:
        parser.error(str(error))
    if not args.no_plot:
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            parser.error(
                f"--output {args.output}: the folder {folder} does not exist (create it first, "
                "or pass --no-plot)"
            )
    saved = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _tour(args, parser, extensions, out)
    finally:
        torch.set_num_threads(saved)


def _tour(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    extensions: list[TourExtension],
    out: TextIO,
) -> int:
    models = [m for m in MODELS if args.model in ("all", m.name)]
    dtype = getattr(torch, args.dtype)
    sym = _symbols(out)

    def say(text: str = "") -> None:
        print(text if sym is _UNICODE else text.translate(_TRANSLITERATE), file=out, flush=True)

    plot_problem = None
    if not args.no_plot:
        from backpack.plotting import matplotlib_missing

        plot_problem = matplotlib_missing()
    settings = Settings(
        device=torch.device(args.device),
        dtype=dtype,
        repeats=args.repeats,
        seed=args.seed,
        train_steps=args.train_steps,
        figure=not args.no_plot and plot_problem is None,
    )

    start = time.perf_counter()
    progress = Progress(sys.stderr)
    torch.manual_seed(args.seed)
    try:
        x, y = load_one_batch_mnist(batch_size=args.batch_size, flat=True)
    except ValueError as error:
        parser.error(str(error))
    plural = "s" if len(models) > 1 else ""
    say(
        f"backpack tour: {len(extensions)} extensions x {len(models)} model{plural} on one batch "
        f"of {args.batch_size} handwritten digits ({args.device}, {args.dtype})"
    )
    trained = (
        f"Each model is first trained for {args.train_steps} Adam steps. "
        if args.train_steps
        else ""
    )
    say(
        textwrap.fill(
            f"{trained}Every quantity comes from one backward pass, is checked against float64 "
            "autograd without backpack and timed relative to a plain forward+backward of the "
            f"same model (median of {args.repeats} interleaved run{'s' * (args.repeats > 1)}).",
            _LINE,
        )
    )
    reports = []
    with warnings.catch_warnings():
        # the tour reports numbers; fallback notices would only clutter the table
        warnings.simplefilter("ignore", UserWarning)
        warnings.filterwarnings("ignore", ".*torch.jit.script.*", FutureWarning)
        for spec in models:
            report = run_model(spec, extensions, x, y, settings, progress, sym)
            reports.append(report)
            progress.clear()
            say()
            say(format_report(report, sym))
    say()
    for note in _notes(reports, RTOL.get(dtype, 1e-4)):
        say(textwrap.fill(note, _LINE, subsequent_indent="  "))

    if args.no_plot:
        pass
    elif plot_problem is not None:
        say(f"Figure skipped: {plot_problem}. Get it with: pip install matplotlib")
    else:
        from backpack.plotting import plot_tour

        progress.update("drawing the figure")
        path = plot_tour([r.figure for r in reports], args.output, args.batch_size)
        progress.clear()
        say(f"Figure: {path}")

    rows = [row for report in reports for row in report.rows]
    failed = [r for r in rows if not r.ok]
    checked = [r for r in rows if r.error is not None or r.status == "FAIL"]
    counts = {
        "Monte-Carlo estimates": sum(r.error is None and r.deviation is not None for r in rows),
        "unchecked": sum(r.status == "unchecked" for r in rows),
        "not applicable": sum(r.status == "n/a" for r in rows),
    }
    parts = [f"{v} {k}" for k, v in counts.items() if v]
    tail = "; ".join(
        [", ".join(parts), f"{time.perf_counter() - start:.0f} s"]
        if parts
        else [f"{time.perf_counter() - start:.0f} s"]
    )
    for row in failed:
        detail = row.note or f"rel err {row.error:.1e}, {row.excess:.1f}x its tolerance"
        say(f"FAILED: {row.model} {row.extension}: {detail}")
    if failed:
        what = "checked quantity is" if len(checked) == 1 else "checked quantities are"
        say(f"FAIL: {len(failed)} of {len(checked)} {what} wrong; {tail}")
        return 1
    if not checked:
        say(
            "NOTHING CHECKED: no selected extension produced a quantity that could be compared "
            f"with float64 autograd on the selected model(s) (see the rows above); {tail}"
        )
    elif len(checked) == 1:
        say(f"OK: the checked quantity matches float64 autograd; {tail}")
    else:
        say(f"OK: all {len(checked)} checked quantities match float64 autograd; {tail}")
    return 0
