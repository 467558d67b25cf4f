"""`python -m benchmarks.run`: time every extension against a plain forward + backward.

For each problem (see `benchmarks.problems`) and each row (an extension, "extended, no
extension", and the per-sample baselines torch.func and Opacus), the cell is the ratio

    time(forward + backward with the row's work) / time(plain forward + backward)

of the same model, where "plain" is an un-extended copy with the same parameters. Timing:
`time.perf_counter` around forward + backward (synchronised on CUDA), two warm-up runs, then k
repeats with plain and row runs interleaved (alternating which goes first) so that a change of
machine load hits both; the ratio is the median of the k paired ratios. k adapts so that a case
costs about `--case-budget` seconds; a case whose first run exceeds `--case-cap` seconds is not
repeated ("capped", with the ratio of that single run).

Extra peak memory: the second warm-up run is profiled. On CPU, `torch.profiler` with
`profile_memory=True` reports every allocation and free of the CPU allocator with a timestamp;
the peak of their running sum is the most memory the step held at once on top of what existed
before it (parameters, inputs). On CUDA, `torch.cuda.max_memory_allocated` above the memory
allocated before the step. The table shows the row's peak minus the plain step's peak.

Each problem runs in its own worker process (`--in-process` runs everything in this one), with
`torch.set_num_threads(--threads)`. Results go to `<out>/results.json` and `<out>/results.md`;
the markdown table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import problems as P

# ------------------------------------------------------------------------------------------------
# Configuration


@dataclass
class Config:
    """How to measure (shared by the parent and its worker processes)."""

    device: str = "cpu"
    threads: int = 2
    tiny: bool = False
    warmup: int = 2
    min_repeats: int = 3
    max_repeats: int = 30
    case_budget: float = 3.0
    case_cap: float = 20.0
    rows: tuple[str, ...] = P.EXTENSION_ROWS + P.BASELINE_ROWS
    deadline: float = math.inf  # absolute time.time() after which cases are skipped


def _extension_factories() -> dict[str, Callable[[], Any]]:
    from backpack import extensions as E

    return {
        P.NO_EXTENSION: lambda: None,
        "BatchGrad": E.BatchGrad,
        "BatchL2Grad": E.BatchL2Grad,
        "SumGradSquared": E.SumGradSquared,
        "Variance": E.Variance,
        "BatchDotGrad": E.BatchDotGrad,
        "DiagGGNExact": E.DiagGGNExact,
        "DiagGGNMC": E.DiagGGNMC,
        "BatchDiagGGNExact": E.BatchDiagGGNExact,
        "BatchDiagGGNMC": E.BatchDiagGGNMC,
        "SqrtGGNExact": E.SqrtGGNExact,
        "SqrtGGNMC": E.SqrtGGNMC,
        "BatchJacobian": E.BatchJacobian,
        "KFAC": E.KFAC,
        "KFLR": E.KFLR,
        "KFRA": E.KFRA,
        "DiagHessian": E.DiagHessian,
        "BatchDiagHessian": E.BatchDiagHessian,
        "GGNMP": E.GGNMP,
        "HMP": E.HMP,
        "PCHMP": E.PCHMP,
    }


#: attributes extensions write on parameters (removed between runs so memory is comparable)
SAVEFIELDS = (
    "grad_batch",
    "batch_l2",
    "sum_grad_squared",
    "variance",
    "batch_dot",
    "diag_ggn_exact",
    "diag_ggn_mc",
    "diag_ggn_exact_batch",
    "diag_ggn_mc_batch",
    "sqrt_ggn_exact",
    "sqrt_ggn_mc",
    "jac_batch",
    "kfac",
    "kflr",
    "kfra",
    "diag_h",
    "diag_h_batch",
    "hmp",
    "ggnmp",
    "pchmp",
    "grad_sample",
)


# ------------------------------------------------------------------------------------------------
# Measurement primitives


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clear(model: nn.Module) -> None:
    """Drop gradients and extension quantities of `model` (not timed)."""
    for p in model.parameters():
        p.grad = None
        for field in SAVEFIELDS:
            if field in p.__dict__:
                delattr(p, field)


def _timed(step: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _collect_aborted_graph() -> None:
    """Free the graph of a backward that raised.

    Records of multi-output modules (LSTM) hang on reference cycles through torch's multi-grad
    hooks; after an aborted backward they would stay "live" until the cyclic garbage collector
    runs, and the next case would see a second use of the module.
    """
    gc.collect()


@contextlib.contextmanager
def _quiet_stderr() -> Any:
    """Silence file descriptor 2 (the profiler backend logs every start and stop there)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no real stderr (e.g. captured): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_extra_bytes(step: Callable[[], Any], device: torch.device) -> int:
    """Most bytes allocated at once during `step`, beyond what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings(), _quiet_stderr():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return int(peak)


@dataclass
class Case:
    """The outcome of one (row, problem) cell."""

    status: str  # "ok", "refused", "error", "capped", "skipped", "n/a"
    ratio: float | None = None  # median of the paired ratios
    ratio_of_minima: float | None = None  # fastest row run / fastest plain run (less noisy)
    seconds: float | None = None  # median time of the row's step
    plain_seconds: float | None = None  # median time of the interleaved plain steps
    repeats: int = 0
    first_run_seconds: float | None = None
    peak_bytes: int | None = None
    extra_peak_bytes: int | None = None
    reason: str = ""
    note: str = ""
    warnings: tuple[str, ...] = ()
    loadavg: float | None = None  # 1-minute load average when the case finished


_CPU_ALLOC_FAILURE = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def _short_error(err: BaseException) -> str:
    text = " ".join(str(err).split())
    failed = _CPU_ALLOC_FAILURE.search(text)
    if failed:  # torch's CPU allocator message starts with a C++ source location
        return f"out of memory: one allocation of {int(failed.group(1)) / 2**30:.1f} GiB failed"
    return f"{type(err).__name__}: {text}" if not isinstance(err, NotImplementedError) else text


def measure_case(
    step: Callable[[], Any],
    plain: Callable[[], Any],
    clear: Callable[[], None],
    plain_estimate: float,
    plain_peak: int | None,
    cfg: Config,
    device: torch.device,
    memory: bool = True,
) -> Case:
    """Warm up, check the cap, profile memory once, then time interleaved with the plain step."""
    if time.time() > cfg.deadline:
        return Case("skipped", reason="time limit of the whole run reached")
    caught: list[str] = []
    clear()
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            _timed(step, device)
        caught = list(dict.fromkeys(str(w.message).split("\n")[0][:200] for w in seen))
    except NotImplementedError as err:
        failure = Case("refused", reason=_short_error(err))
    except Exception as err:  # noqa: BLE001 - any failure is a result to report
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        failure = Case("error", reason=_short_error(err))
    else:
        failure = None
    if failure is not None:
        failure.first_run_seconds = time.perf_counter() - start
        # outside the except clause: the traceback (and the graph it holds) is gone
        _collect_aborted_graph()
        return failure
    first = time.perf_counter() - start
    warned = tuple(caught)
    if first > cfg.case_cap:
        return Case(
            "capped",
            ratio=first / plain_estimate,
            seconds=first,
            plain_seconds=plain_estimate,
            repeats=1,
            first_run_seconds=first,
            reason=f"first run took {first:.1f} s > cap {cfg.case_cap:g} s; not repeated "
            "(ratio of that single cold run)",
            warnings=warned,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peak = None
        slow = first > cfg.case_budget / 2
        for i in range(1, cfg.warmup):
            if slow and i > 1:
                break
            clear()
            if memory and i == cfg.warmup - 1:
                peak = peak_extra_bytes(step, device)
            else:
                step()
        if memory and peak is None:
            clear()
            peak = peak_extra_bytes(step, device)
        pair = plain_estimate + first
        k = int(cfg.case_budget // max(pair, 1e-9))
        k = max(1 if slow else cfg.min_repeats, min(cfg.max_repeats, k))
        ts, tp = [], []
        loop_start = time.perf_counter()
        for i in range(k):
            order = (True, False) if i % 2 == 0 else (False, True)
            for is_row in order:
                clear()
                torch.manual_seed(i)
                if is_row:
                    ts.append(_timed(step, device))
                else:
                    tp.append(_timed(plain, device))
            # the cold run can misjudge the cost (e.g. when the machine gets busy): stop early
            spent = time.perf_counter() - loop_start
            done = i + 1
            if spent > 2 * cfg.case_budget or (spent > cfg.case_budget and done >= cfg.min_repeats):
                break
        clear()
    ratio = statistics.median(s / p for s, p in zip(ts, tp))
    extra = None if peak is None or plain_peak is None else peak - plain_peak
    return Case(
        "ok",
        ratio=ratio,
        ratio_of_minima=min(ts) / min(tp),
        seconds=statistics.median(ts),
        plain_seconds=statistics.median(tp),
        repeats=len(ts),
        first_run_seconds=first,
        peak_bytes=peak,
        extra_peak_bytes=extra,
        warnings=warned,
    )


# ------------------------------------------------------------------------------------------------
# One problem


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _opacus_step(
    model: nn.Module, lossfunc: nn.Module, x, y, ghost: bool = False
) -> tuple[Callable, Callable, str]:
    """Opacus's `GradSampleModule`, or with `ghost` its ghost-clipping norm module.

    Layers Opacus cannot hook are replaced by its own (`ModuleValidator.fix`, e.g. nn.LSTM ->
    DPLSTM, nn.MultiheadAttention -> DPMultiheadAttention). A problem's model may provide
    `for_opacus(ghost) -> (model, note)`, a copy adapted to what Opacus accepts.
    """
    from opacus import GradSampleModule
    from opacus.validators import ModuleValidator

    notes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(model, "for_opacus"):
            model, adapted = model.for_opacus(ghost)
            notes.append("model adapted for Opacus: " + adapted)
        else:
            model = copy.deepcopy(model)
        problems = ModuleValidator.validate(model, strict=False)
        if problems:
            model = ModuleValidator.fix(model)
            notes.append(
                "model adapted with opacus ModuleValidator.fix: "
                + "; ".join(str(p).split(". ")[0] for p in problems)
            )
        if ghost:
            from opacus.grad_sample import GradSampleModuleFastGradientClipping

            gsm = GradSampleModuleFastGradientClipping(
                model,
                loss_reduction=getattr(lossfunc, "reduction", "mean"),
                use_ghost_clipping=True,
            )
        else:
            gsm = GradSampleModule(model)

    def step() -> None:
        lossfunc(gsm(x), y).backward()
        if ghost:  # the per-sample norms of the whole model, from each parameter's norms
            gsm.get_norm_sample()

    def clear() -> None:
        for p in gsm.parameters():
            p.grad = None
            p.grad_sample = None
            if hasattr(p, "_norm_sample"):
                p._norm_sample = None

    return step, clear, "; ".join(notes)


def _torch_func_step(model: nn.Module, lossfunc: nn.Module, x, y) -> Callable:
    """Per-sample gradients of every parameter with `vmap(grad(functional_call))`."""
    from torch.func import functional_call, grad, vmap

    from backpack.rules.generic import transformable

    params = {k: v.detach() for k, v in model.named_parameters()}
    scale = 1.0 / x.shape[0] if getattr(lossfunc, "reduction", "mean") == "mean" else 1.0

    def one(p: dict, xn: torch.Tensor, yn: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xn.unsqueeze(0),))
        return lossfunc(out, yn.unsqueeze(0)) * scale

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))
    holder: dict[str, Any] = {}

    def step() -> None:
        # cuDNN's RNN kernels do not support vmap: torch's own kernels run instead
        with transformable(model):
            holder["g"] = per_sample(params, x, y)
        holder.clear()

    return step


def run_problem(name: str, cfg: Config) -> dict[str, Any]:
    """Measure every selected row on one problem; returns a JSON-ready dict."""
    from backpack import backpack, extend

    torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    model, x, y, lossfunc = P.build(name, cfg.tiny)
    model, x, y = model.to(device), x.to(device), y.to(device)
    plain_model = copy.deepcopy(model)
    plain_loss = copy.deepcopy(lossfunc)
    ext_model = extend(copy.deepcopy(model))
    ext_loss = extend(copy.deepcopy(lossfunc))

    def plain_step() -> None:
        plain_loss(plain_model(x), y).backward()

    def clear_plain() -> None:
        _clear(plain_model)

    # plain baseline: warm up, estimate, memory
    started = time.perf_counter()
    times = []
    for _ in range(max(cfg.warmup, 1) + 3):
        clear_plain()
        times.append(_timed(plain_step, device))
    plain_estimate = statistics.median(times[max(cfg.warmup, 1) :])
    clear_plain()
    plain_peak = peak_extra_bytes(plain_step, device)
    clear_plain()
    _log(f"[{name}] plain forward+backward {plain_estimate * 1e3:.2f} ms, peak {_mb(plain_peak)}")

    factories = _extension_factories()
    cases: dict[str, Case] = {}
    torch_func_ratio = write_once_ratio = None
    opacus_ratios: dict[str, float] = {}
    ordered = [r for r in P.BASELINE_ROWS if r in cfg.rows]
    ordered += [r for r in P.EXTENSION_ROWS if r in cfg.rows]
    for row in ordered:
        t0 = time.perf_counter()
        if row == P.TORCH_FUNC:
            try:
                step = _torch_func_step(plain_model, plain_loss, x, y)
            except Exception as err:  # noqa: BLE001
                cases[row] = Case("error", reason=_short_error(err))
                continue
            case = measure_case(
                step, plain_step, clear_plain, plain_estimate, plain_peak, cfg, device
            )
            if case.status == "ok":
                torch_func_ratio = case.ratio
        elif row == P.WRITE_ONCE:
            shapes = [(x.shape[0], *p.shape) for p in plain_model.parameters() if p.requires_grad]

            def step(shapes: list = shapes) -> None:
                plain_step()
                for shape in shapes:
                    torch.empty(shape, dtype=x.dtype, device=x.device).fill_(1.0)

            case = measure_case(
                step, plain_step, clear_plain, plain_estimate, plain_peak, cfg, device
            )
            if case.status == "ok":
                write_once_ratio = case.ratio
        elif row in (P.OPACUS, P.OPACUS_NORMS):
            try:
                step, clear_opacus, note = _opacus_step(
                    model, plain_loss, x, y, ghost=row == P.OPACUS_NORMS
                )
            except ImportError:
                cases[row] = Case("n/a", reason="Opacus is not installed")
                continue
            except Exception as err:  # noqa: BLE001 - e.g. unsupported layers
                cases[row] = Case("refused", reason=_short_error(err))
                _log(f"[{name}] {row}: refused ({cases[row].reason[:100]})")
                continue

            def clear_both(clear_opacus: Callable = clear_opacus) -> None:
                clear_opacus()
                clear_plain()

            case = measure_case(
                step, plain_step, clear_both, plain_estimate, plain_peak, cfg, device
            )
            case.note = note
            if case.status == "ok":
                opacus_ratios[row] = case.ratio
        else:
            make = factories[row]

            def step(make: Callable = make) -> None:
                ext = make()
                loss = ext_loss(ext_model(x), y)
                with backpack(*(() if ext is None else (ext,))):
                    loss.backward()

            def clear_ext() -> None:
                _clear(ext_model)
                clear_plain()

            case = measure_case(
                step, plain_step, clear_ext, plain_estimate, plain_peak, cfg, device
            )
        case.loadavg = round(os.getloadavg()[0], 2)
        cases[row] = case
        spent = time.perf_counter() - t0
        detail = (
            f"{case.ratio:.2f}x (min/min {case.ratio_of_minima:.2f}x, k={case.repeats}, "
            f"extra peak {_mb(case.extra_peak_bytes)})"
            if case.status == "ok"
            else f"{case.status} {case.reason[:100]}"
        )
        _log(f"[{name}] {row}: {detail} [{spent:.1f} s]")
    return {
        "description": P.PROBLEMS[name].description,
        "plain_seconds": plain_estimate,
        "plain_peak_bytes": plain_peak,
        "input_shape": list(x.shape),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds_total": time.perf_counter() - started,
        "torch_func_ratio": torch_func_ratio,
        "write_once_ratio": write_once_ratio,
        "opacus_ratio": opacus_ratios.get(P.OPACUS),
        "opacus_norms_ratio": opacus_ratios.get(P.OPACUS_NORMS),
        "cases": {row: asdict(case) for row, case in cases.items()},
    }


# ------------------------------------------------------------------------------------------------
# Targets and output


def _mb(nbytes: int | None) -> str:
    if nbytes is None:
        return "—"
    return f"{nbytes / 2**20:+.1f} MB" if nbytes < 0 else f"{nbytes / 2**20:.1f} MB"


def judge(
    row: str,
    problem: str,
    case: dict,
    torch_func_ratio: float | None,
    write_once_ratio: float | None = None,
    opacus_ratio: float | None = None,
    opacus_norms_ratio: float | None = None,
) -> dict | None:
    """Evaluate the issue's targets on one cell: met True/False, or None if undetermined."""
    targets = P.target_for(
        row, problem, torch_func_ratio, write_once_ratio, opacus_ratio, opacus_norms_ratio
    )
    if not targets:
        return None
    verdicts = []
    for t in targets:
        if t.kind == "finish_or_refuse":
            first = case.get("first_run_seconds")
            if case["status"] == "ok":
                met = True
            elif case["status"] == "refused":
                met = first is not None and first < 1.0
            elif case["status"] in ("capped", "error"):
                met = False
            else:
                met = None
        elif case["status"] == "ok" or case["status"] == "capped":
            ratio = case["ratio"]
            if ratio <= t.limit:
                met = True
            elif t.lenient is not None and ratio <= t.lenient:
                met = None
            else:
                met = False
        elif case["status"] in ("refused", "error"):
            met = False
        else:
            met = None
        verdicts.append({"target": t.text, "met": met})
    if any(v["met"] is False for v in verdicts):
        overall = False
    elif all(v["met"] is True for v in verdicts):
        overall = True
    else:
        overall = None
    return {"met": overall, "targets": verdicts}


_MARK = {True: "✓", False: "✗", None: "~"}


def _md_text(text: str) -> str:
    """Text safe inside a markdown table cell (no pipes, no HTML-looking `<class ...>`)."""
    return text.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")


def _short_reason(reason: str, limit: int = 70) -> str:
    first = reason.split(". ")[0]
    first = first if len(first) <= limit else first[: limit - 1] + "…"
    return _md_text(first)


def _cell(case: dict | None, verdict: dict | None) -> str:
    if case is None:
        return "—"
    status = case["status"]
    mark = "" if verdict is None else " " + _MARK[verdict["met"]]
    if status == "ok":
        return f"{case['ratio']:.2f}x{mark}"
    if status == "capped":
        return f"capped: 1 run {case['first_run_seconds']:.1f} s ≈ {case['ratio']:.0f}x{mark}"
    if status == "n/a":
        return "—"
    return f"{status}: {_short_reason(case['reason'])}{mark}"


def _plain_ms(problem: dict) -> str:
    """Median time of all plain runs that were interleaved with measured cases."""
    times = [
        c["plain_seconds"]
        for c in problem.get("cases", {}).values()
        if c["status"] == "ok" and c.get("plain_seconds")
    ]
    if not times and problem.get("plain_seconds") is None:
        return "—"
    value = statistics.median(times) if times else problem["plain_seconds"]
    return f"{value * 1e3:.2f} ms"


def _mem_cell(case: dict | None) -> str:
    if case is None or case.get("extra_peak_bytes") is None:
        return "—"
    return _mb(case["extra_peak_bytes"])


def render_markdown(results: dict) -> str:
    """The markdown report: ratio table, memory table, notes and target verdicts."""
    meta = results["meta"]
    probs = results["problems"]
    names = list(probs)
    lines = [
        "# backpack benchmark",
        "",
        f"torch {meta['torch']}, device {meta['device']}, {meta['threads']} threads, "
        f"{meta['cpu_count']} CPUs, load average at start {meta['loadavg_start']}, at end "
        f"{meta['loadavg_end']}; {meta['mode']} mode; total {meta['seconds_total']:.0f} s.",
        "",
        "Cells: time of forward + backward with the row's work / time of a plain forward + "
        "backward of the same, non-extended model (median of interleaved pairs after warm-up). "
        + (
            "Targets are not judged in tiny mode (shrunk sizes, a smoke test of the code). "
            if meta["mode"] == "tiny"
            else "Target marks: ✓ met, ✗ missed, ~ undetermined (target relative to an original "
            "ratio only known as a range). "
        )
        + "`—`: not applicable / not measured.",
        "",
    ]
    if meta["loadavg_start"][0] > meta["threads"] or meta["loadavg_end"][0] > meta["threads"]:
        lines += [
            f"**Warning: the machine was busy (load average above {meta['threads']}); ratios "
            "may be noisy.**",
            "",
        ]
    header = "| | " + " | ".join(names) + " |"
    sep = "|---|" + "---|" * len(names)
    lines += ["## Ratio to plain forward + backward", "", header, sep]
    plain = [_plain_ms(probs[n]) for n in names]
    lines.append("| plain forward+backward (absolute, median) | " + " | ".join(plain) + " |")
    rows = [
        r
        for r in (*P.EXTENSION_ROWS, *P.BASELINE_ROWS)
        if any(r in probs[n].get("cases", {}) for n in names)
    ]
    for row in rows:
        cells = []
        for n in names:
            case = probs[n].get("cases", {}).get(row)
            cells.append(_cell(case, probs[n].get("verdicts", {}).get(row)))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += ["", "## Extra peak memory (row's peak minus plain step's peak)", "", header, sep]
    peaks = [_mb(probs[n].get("plain_peak_bytes")) for n in names]
    lines.append("| plain forward+backward (absolute peak) | " + " | ".join(peaks) + " |")
    for row in rows:
        cells = [_mem_cell(probs[n].get("cases", {}).get(row)) for n in names]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Ratio of the fastest runs (fastest row run / fastest plain run; less load-sensitive)",
        "",
        header,
        sep,
    ]
    for row in rows:
        cells = []
        for n in names:
            case = probs[n].get("cases", {}).get(row)
            value = None if case is None else case.get("ratio_of_minima")
            cells.append("—" if value is None else f"{value:.2f}x")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    notes = []
    for n in names:
        if "error" in probs[n]:
            notes.append(f"- **{n}**: worker failed: {probs[n]['error']}")
        for row, case in probs[n].get("cases", {}).items():
            if case["status"] in ("refused", "error", "capped", "skipped") and case["reason"]:
                notes.append(f"- **{row} @ {n}** ({case['status']}): {_md_text(case['reason'])}")
            if case.get("note"):
                notes.append(f"- **{row} @ {n}**: {_md_text(case['note'])}")
    if notes:
        lines += ["", "## Refusals, errors, caps, notes", "", *notes]
    verdict_lines = []
    for n in names:
        for row, verdict in probs[n].get("verdicts", {}).items():
            if verdict is None:
                continue
            case = probs[n]["cases"][row]
            value = _cell(case, None)
            text = "; ".join(f"{v['target']} {_MARK[v['met']]}" for v in verdict["targets"])
            verdict_lines.append(f"| {row} | {n} | {value} | {text} | {_MARK[verdict['met']]} |")
    if verdict_lines:
        lines += [
            "",
            "## Targets",
            "",
            "| row | problem | measured | target(s) | met |",
            "|---|---|---|---|---|",
            *verdict_lines,
        ]
    lines += ["", "## Problems", ""]
    for n in names:
        p = probs[n]
        lines.append(
            f"- **{n}**: {p.get('description', '')} (input {p.get('input_shape')}, "
            f"{p.get('parameters')} parameters)"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Driver


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Time backpack extensions against a plain forward + backward pass "
        "(see benchmarks/README.md).",
    )
    parser.add_argument(
        "--problems",
        nargs="+",
        choices=list(P.PROBLEMS),
        default=None,
        metavar="PROBLEM",
        help=f"problems to run, of {', '.join(P.PROBLEMS)} (default: all; the GPU-size "
        "problems resnet18 and gpt_long only with --device cuda)",
    )
    parser.add_argument(
        "--extensions",
        nargs="+",
        default=None,
        metavar="ROW",
        help="extension class names and/or 'none' (extended, no extension), 'torch.func', "
        "'opacus', 'opacus-norms' (ghost clipping), 'write-once' (the floor of per-sample "
        "results) (default: all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repeats, 0.5 s per case and a 5 s cap (rough numbers)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="shrink every problem (a smoke test of the code: targets are not judged)",
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default: cpu)"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads per worker (default: 2)"
    )
    parser.add_argument(
        "--out",
        default="bench-results",
        help="folder for results.md and results.json (default: bench-results)",
    )
    parser.add_argument(
        "--case-budget",
        type=float,
        default=None,
        metavar="S",
        help="seconds of repeats per case (default: 3, or 0.5 with --quick/--tiny)",
    )
    parser.add_argument(
        "--case-cap",
        type=float,
        default=None,
        metavar="S",
        help="a case whose first run takes longer is not repeated (default: 20, or 5 with "
        "--quick/--tiny)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=840.0,
        metavar="S",
        help="seconds for the whole run; cases after it are skipped (default: 840)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every problem in this process (default: one worker process per problem)",
    )
    parser.add_argument(
        "--distributed",
        type=int,
        default=0,
        metavar="N",
        help="instead: time backpack's all-reductions on N DDP processes (gloo on the CPU, "
        "NCCL with --device cuda) against DDP's own step (benchmarks/distributed.py)",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    return parser


_ALIASES = {
    "none": P.NO_EXTENSION,
    "torch.func": P.TORCH_FUNC,
    "opacus": P.OPACUS,
    "opacus-norms": P.OPACUS_NORMS,
    "write-once": P.WRITE_ONCE,
}


def _rows(selected: Sequence[str] | None) -> tuple[str, ...]:
    if not selected:
        return P.EXTENSION_ROWS + P.BASELINE_ROWS
    rows = []
    known = {r.lower(): r for r in P.EXTENSION_ROWS + P.BASELINE_ROWS}
    for s in selected:
        row = _ALIASES.get(s.lower(), known.get(s.lower()))
        if row is None:
            raise SystemExit(f"unknown extension/row {s!r}; choose from {sorted(known)}")
        rows.append(row)
    return tuple(rows)


def config_from_args(args: argparse.Namespace) -> Config:
    """Measurement settings for the mode (`--quick`, `--tiny`) and explicit overrides."""
    cfg = Config(
        device=args.device, threads=args.threads, tiny=args.tiny, rows=_rows(args.extensions)
    )
    if args.quick or args.tiny:
        cfg.warmup, cfg.min_repeats, cfg.max_repeats = 2, 1, 5
        cfg.case_budget, cfg.case_cap = 0.5, 5.0
    if args.case_budget is not None:
        cfg.case_budget = args.case_budget
    if args.case_cap is not None:
        cfg.case_cap = args.case_cap
    cfg.deadline = args.deadline
    return cfg


def _worker_argv(args: argparse.Namespace, name: str, out: str, deadline: float) -> list[str]:
    argv = [sys.executable, "-m", "benchmarks.run", "--worker", name, "--worker-out", out]
    argv += ["--device", args.device, "--threads", str(args.threads), "--deadline", str(deadline)]
    if args.quick:
        argv.append("--quick")
    if args.tiny:
        argv.append("--tiny")
    if args.extensions:
        argv += ["--extensions", *args.extensions]
    if args.case_budget is not None:
        argv += ["--case-budget", str(args.case_budget)]
    if args.case_cap is not None:
        argv += ["--case-cap", str(args.case_cap)]
    return argv


def _add_verdicts(name: str, result: dict) -> None:
    tf = result.get("torch_func_ratio")
    result["verdicts"] = {
        row: judge(
            row,
            name,
            case,
            tf,
            result.get("write_once_ratio"),
            result.get("opacus_ratio"),
            result.get("opacus_norms_ratio"),
        )
        for row, case in result.get("cases", {}).items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if args.distributed:
        from benchmarks.distributed import run_distributed

        return run_distributed(args)
    if args.worker is not None:
        if args.device == "cpu":
            _limit_address_space()
        cfg = config_from_args(args)
        result = run_problem(args.worker, cfg)
        Path(args.worker_out).write_text(json.dumps(result))
        return 0

    names = args.problems or [
        name for name, p in P.PROBLEMS.items() if not p.gpu_size or args.device == "cuda"
    ]
    cfg = config_from_args(args)
    start = time.time()
    end = start + args.time_limit
    reserve = 45.0 if not (args.quick or args.tiny) else 5.0
    load_start = [round(v, 2) for v in os.getloadavg()]
    problems: dict[str, Any] = {}
    for i, name in enumerate(names):
        deadline = end - reserve * (len(names) - i - 1)
        cfg.deadline = deadline
        if args.in_process:
            threads = torch.get_num_threads()
            try:
                problems[name] = run_problem(name, cfg)
            except Exception as err:  # noqa: BLE001
                problems[name] = {"error": _short_error(err)}
            finally:
                torch.set_num_threads(threads)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "result.json")
                timeout = max(60.0, deadline - time.time() + 300.0)
                try:
                    proc = subprocess.run(
                        _worker_argv(args, name, out, deadline), timeout=timeout, check=False
                    )
                    if proc.returncode == 0 and Path(out).exists():
                        problems[name] = json.loads(Path(out).read_text())
                    else:
                        problems[name] = {"error": f"worker exited with code {proc.returncode}"}
                except subprocess.TimeoutExpired:
                    problems[name] = {"error": f"worker timed out after {timeout:.0f} s"}
        problems[name].setdefault("description", P.PROBLEMS[name].description)
        if args.tiny:  # shrunk sizes: the description's sizes and the targets do not apply
            problems[name]["description"] = (
                "tiny version (shrunk sizes) of: " + problems[name]["description"]
            )
        else:
            _add_verdicts(name, problems[name])

    results = {
        "meta": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "device": args.device,
            "threads": args.threads,
            "cpu_count": os.cpu_count(),
            "mode": "tiny" if args.tiny else ("quick" if args.quick else "full"),
            "config": {k: v for k, v in asdict(cfg).items() if k != "deadline"},
            "opacus": _opacus_version(),
            "loadavg_start": load_start,
            "loadavg_end": [round(v, 2) for v in os.getloadavg()],
            "seconds_total": time.time() - start,
            "memory_method": "torch.profiler CPU allocator events (peak of running sum)"
            if args.device == "cpu"
            else "torch.cuda.max_memory_allocated",
        },
        "problems": problems,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    markdown = render_markdown(results)
    (out_dir / "results.md").write_text(markdown)
    print(markdown)
    return 0


#: share of the physical memory a CPU worker may map (see `_limit_address_space`)
MEMORY_SHARE = 0.8


def _limit_address_space() -> None:
    """Let a CPU worker map at most `MEMORY_SHARE` of the physical memory.

    A case that needs more (e.g. an exact loss-Hessian factor with one column per class and
    position) then fails with an allocation error, recorded as its result, instead of pushing
    the machine into swap or getting the whole worker killed.
    """
    try:
        import resource

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = int(MEMORY_SHARE * total)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft == resource.RLIM_INFINITY or soft > limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # not on this platform: run without the guard
        pass


def _opacus_version() -> str | None:
    with contextlib.suppress(ImportError):
        import opacus

        return opacus.__version__
    return None


if __name__ == "__main__":
    raise SystemExit(main())
