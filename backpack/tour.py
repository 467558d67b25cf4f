"""A guided check of the library: `python -m backpack`.

For every model of the tour and every extension, one backward pass inside `with backpack(...)`
computes the extension's quantity on one batch of the embedded handwritten digits. Each quantity
is compared against a brute-force reference that never touches backpack (a float64 copy of the
un-extended model, one autograd backward per sample), and its cost is measured relative to a plain
forward + backward pass. The result is a plain-text table; the exit code is 1 if any quantity is
off by more than the tolerance.

To add a model, append a `TourModel` to `MODELS`; to add an extension, append a `TourExtension`
to `EXTENSIONS` with a reference function computing the expected value from a `Reference`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import torch
from torch import Tensor, nn

from backpack import backpack, extend
from backpack.extensions import (
    BackpropExtension,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    SumGradSquared,
    Variance,
)
from backpack.utils.examples import load_one_batch_mnist

# ------------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class TourModel:
    """A model of the tour.

    Args:
        name: Short name shown in the output.
        description: One line describing architecture and loss.
        make_model: Builds a fresh float32 model (parameters from torch's global generator).
        make_loss: Builds the loss function.
        flat: Whether the model takes flat `[N, 784]` inputs (else `[N, 1, 28, 28]` images).

    """

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    make_loss: Callable[[], nn.Module]
    flat: bool = True


def mlp() -> nn.Module:
    """Build the quickstart's MLP: Flatten, Linear 784->64, ReLU, Linear 64->10."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))


MODELS: list[TourModel] = [
    TourModel(
        name="mlp",
        description="Flatten / Linear 784-64 / ReLU / Linear 64-10, CrossEntropyLoss",
        make_model=mlp,
        make_loss=nn.CrossEntropyLoss,
        flat=True,
    ),
]

# ------------------------------------------------------------------------------------------------
# Brute-force references (independent of backpack)


class Reference:
    """Brute-force autograd quantities of one problem, computed in float64 without backpack.

    Holds a float64 copy of the *un-extended* model (taken before `extend`), the inputs, the
    targets and the loss function. Results are cached, so several extensions share them.
    """

    def __init__(self, model: nn.Module, lossfunc: nn.Module, x: Tensor, y: Tensor) -> None:
        self.model = copy.deepcopy(model).to(torch.float64)
        self.lossfunc = copy.deepcopy(lossfunc)
        self.x = x.to(torch.float64)
        self.y = y
        self._per_sample_grads: dict[str, Tensor] | None = None

    def sample_loss(self, n: int) -> Tensor:
        """Return sample `n`'s term of the batch loss, including the loss's reduction factor."""
        none = copy.deepcopy(self.lossfunc)
        reduction = none.reduction
        none.reduction = "none"
        terms = none(self.model(self.x[n : n + 1]), self.y[n : n + 1])
        if reduction == "sum":
            return terms.sum()
        # "mean" divides by the number of terms of the whole batch
        return terms.sum() / (terms.numel() * self.x.shape[0])

    def per_sample_grads(self) -> dict[str, Tensor]:
        """`{name: [N, *param.shape]}`: one single-sample forward and backward per sample."""
        if self._per_sample_grads is None:
            params = {k: p for k, p in self.model.named_parameters() if p.requires_grad}
            rows = []
            for n in range(self.x.shape[0]):
                grads = torch.autograd.grad(
                    self.sample_loss(n), list(params.values()), allow_unused=True
                )
                rows.append(
                    [
                        torch.zeros_like(p) if g is None else g
                        for g, p in zip(grads, params.values(), strict=True)
                    ]
                )
            self._per_sample_grads = {
                k: torch.stack([row[i] for row in rows]) for i, k in enumerate(params)
            }
        return self._per_sample_grads


def _ref_grad_batch(ref: Reference, name: str) -> Tensor:
    return ref.per_sample_grads()[name]


def _ref_batch_l2(ref: Reference, name: str) -> Tensor:
    return ref.per_sample_grads()[name].flatten(1).square().sum(1)


def _ref_sum_grad_squared(ref: Reference, name: str) -> Tensor:
    return ref.per_sample_grads()[name].square().sum(0)


def _ref_variance(ref: Reference, name: str) -> Tensor:
    g = ref.per_sample_grads()[name]
    return (g - g.mean(0)).square().mean(0)


def _ref_batch_dot(ref: Reference, name: str) -> Tensor:
    g = ref.per_sample_grads()[name].flatten(1)
    return g @ g.T


# ------------------------------------------------------------------------------------------------
# Extensions


@dataclass(frozen=True)
class TourExtension:
    """An extension of the tour and how to check it.

    Args:
        name: Name shown in the output (the extension's class name).
        make: Builds a fresh extension instance.
        savefield: Attribute the extension writes on each parameter.
        reference: `reference(ref, param_name)` -> expected value of the attribute.

    """

    name: str
    make: Callable[[], BackpropExtension]
    savefield: str
    reference: Callable[[Reference, str], Tensor]


EXTENSIONS: list[TourExtension] = [
    TourExtension("BatchGrad", BatchGrad, "grad_batch", _ref_grad_batch),
    TourExtension("BatchL2Grad", BatchL2Grad, "batch_l2", _ref_batch_l2),
    TourExtension("SumGradSquared", SumGradSquared, "sum_grad_squared", _ref_sum_grad_squared),
    TourExtension("Variance", Variance, "variance", _ref_variance),
    TourExtension("BatchDotGrad", BatchDotGrad, "batch_dot", _ref_batch_dot),
]

#: relative tolerance (w.r.t. the largest reference entry) per computation dtype
RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}
#: absolute floor of the tolerance (for quantities that are exactly zero)
ATOL = {torch.float32: 1e-12, torch.float64: 1e-20}

# ------------------------------------------------------------------------------------------------
# Running


@dataclass
class Row:
    """One checked quantity: a parameter's attribute written by one extension."""

    model: str
    param: str
    extension: str
    shape: tuple[int, ...]
    error: float
    tolerance: float
    ratio: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the error is within tolerance."""
        return self.error <= self.tolerance


@dataclass
class ModelReport:
    """Results of the tour for one model."""

    model: TourModel
    baseline_s: float
    rows: list[Row] = field(default_factory=list)
    all_ratio: float | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_times(
    steps: dict[str, Callable[[], None]], repeats: int, device: torch.device
) -> dict[str, float]:
    """Median wall time of each step over `repeats` rounds, after one warm-up round.

    The steps run interleaved (one of each per round), so a change of machine load during the
    measurement affects all of them alike and their ratios stay meaningful.
    """
    times: dict[str, list[float]] = {key: [] for key in steps}
    for round_ in range(repeats + 1):
        for key, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            if round_ > 0:
                times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def _train_step(
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


def _max_abs_error(result: Tensor, expected: Tensor) -> float:
    return (result.detach().to(torch.float64) - expected).abs().max().item()


def run_model(
    spec: TourModel,
    extensions: Sequence[TourExtension],
    x: Tensor,
    y: Tensor,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
) -> ModelReport:
    """Check and time every extension on one model."""
    model = spec.make_model().to(device=device, dtype=dtype)
    lossfunc = spec.make_loss()
    inputs = (x if spec.flat else x.reshape(-1, 1, 28, 28)).to(device=device, dtype=dtype)
    targets = y.to(device)

    # taken before `extend`, so neither the reference nor the baseline ever sees backpack
    reference = Reference(model, lossfunc, inputs, targets)
    plain = copy.deepcopy(model)
    model = extend(model)
    lossfunc = extend(lossfunc)

    rows: list[Row] = []
    rtol, atol = RTOL.get(dtype, 1e-4), ATOL.get(dtype, 1e-12)
    params = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    for ext in extensions:
        _train_step(model, lossfunc, inputs, targets, (ext.make(),))
        for name, param in params:
            expected = ext.reference(reference, name)
            result = getattr(param, ext.savefield, None)
            if result is None or tuple(result.shape) != tuple(expected.shape):
                error = float("inf")
                shape = () if result is None else tuple(result.shape)
            else:
                error = _max_abs_error(result, expected)
                shape = tuple(result.shape)
            tolerance = atol + rtol * expected.abs().max().item()
            rows.append(Row(spec.name, name, ext.name, shape, error, tolerance))
            if hasattr(param, ext.savefield):
                delattr(param, ext.savefield)

    def step(net: nn.Module, exts: Callable[[], tuple[BackpropExtension, ...]]) -> Callable:
        return lambda: _train_step(net, lossfunc, inputs, targets, exts())

    steps = {"plain": step(plain, tuple)}
    for ext in extensions:
        steps[ext.name] = step(model, lambda ext=ext: (ext.make(),))
    if len(extensions) > 1:
        steps["all"] = step(model, lambda: tuple(e.make() for e in extensions))
    seconds = _median_times(steps, repeats, device)
    baseline = seconds["plain"]
    seen = set()
    for row in rows:
        if row.extension not in seen:
            seen.add(row.extension)
            row.ratio = seconds[row.extension] / baseline
    report = ModelReport(spec, baseline, rows)
    if "all" in seconds:
        report.all_ratio = seconds["all"] / baseline
    return report


# ------------------------------------------------------------------------------------------------
# Output


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def format_report(report: ModelReport, batch_size: int, device: torch.device, dtype: str) -> str:
    """Render the plain-text table of one model."""
    header = ("parameter", "extension", "shape", "max abs err", "tolerance", "", "time")
    body = [
        (
            row.param,
            row.extension,
            _fmt_shape(row.shape),
            f"{row.error:.1e}",
            f"{row.tolerance:.1e}",
            "ok" if row.ok else "FAIL",
            "" if row.ratio is None else f"{row.ratio:.2f}x",
        )
        for row in report.rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    right = {3, 4, 6}

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    out = [
        f"model {report.model.name}: {report.model.description}",
        f"batch {batch_size}, {device.type}, {dtype}; plain forward+backward "
        f"{report.baseline_s * 1e3:.2f} ms",
        "",
        line(header),
        line(["-" * w for w in widths]),
    ]
    previous = None
    for row, cells in zip(report.rows, body, strict=True):
        if previous is not None and row.extension != previous:
            out.append("")
        previous = row.extension
        out.append(line(cells))
    if report.all_ratio is not None:
        out.append("")
        out.append(
            f"all {len({r.extension for r in report.rows})} extensions in one backward: "
            f"{report.all_ratio:.2f}x"
        )
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    """Build the command-line interface of `python -m backpack`."""
    parser = argparse.ArgumentParser(
        prog="python -m backpack",
        description=(
            "Tour of backpack: run every extension on one batch of the embedded handwritten "
            "digits, check each quantity against brute-force autograd (float64, one backward "
            "per sample, without backpack) and time it relative to a plain forward+backward."
        ),
    )
    parser.add_argument("--batch-size", type=int, default=64, help="samples in the batch (64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data and parameters (0)")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where to compute (cpu)"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="dtype of model and data (float32); references always use float64",
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed rounds after one warm-up round; median (7)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice)",
    )
    return parser


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> int:
    """Run the tour; return 0 if every quantity matches its reference, else 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    out = sys.stdout if stream is None else stream
    if args.batch_size < 1:
        parser.error("--batch-size must be positive")
    if args.repeats < 1:
        parser.error("--repeats must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested, but CUDA is not available")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be positive")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(args.seed)
    x, y = load_one_batch_mnist(batch_size=args.batch_size, flat=True)
    reports = []
    with warnings.catch_warnings():
        # the tour reports numbers; fallback notices would only clutter the table
        warnings.simplefilter("ignore", UserWarning)
        for spec in MODELS:
            torch.manual_seed(args.seed)
            report = run_model(spec, EXTENSIONS, x, y, device, dtype, args.repeats)
            reports.append(report)
            print(format_report(report, args.batch_size, device, args.dtype), file=out)
            print(file=out)

    rows = [row for report in reports for row in report.rows]
    failed = [row for row in rows if not row.ok]
    print(
        f"time: median of {args.repeats} runs after a warm-up, relative to plain "
        "forward+backward of the same model without backpack.",
        file=out,
    )
    if failed:
        for row in failed:
            print(
                f"FAILED: {row.model} {row.param} {row.extension}: error {row.error:.2e} "
                f"> tolerance {row.tolerance:.2e}",
                file=out,
            )
        print(f"{len(failed)} of {len(rows)} checks FAILED", file=out)
        return 1
    print(f"all checks passed ({len(rows)} quantities match brute-force autograd)", file=out)
    return 0
