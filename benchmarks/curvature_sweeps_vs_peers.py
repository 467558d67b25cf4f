"""Sweeps over a loader: KFAC / EK-FAC fits, the GGN diagonal, the top eigenvalue, memory.

    python -m benchmarks.curvature_sweeps_vs_peers [--tiny] [--repeats 3] [--out FILE]

The data-set rows of the curvature issue that `curvature_vs_peers` (products and agreement)
does not cover, measured side by side in one run (needs `make install-bench`; without the peers
it prints a note and exits 0):

- **Fit over a 10-batch loader**, float32, on `benchmarks.problems`' mlp, 3c3d, allcnnc_small
  and resnet_small (batch sizes as there): ours `KFAC(...)` / `EKFAC(...)` (the operator's
  construction fits everything) against curvlinops 3.0.1's `KFACLinearOperator` +
  `compute_kronecker_factors()` and `EKFACLinearOperator` + `compute_eigenvalue_correction()`,
  type-2 Fisher, `kfac_approx="expand"`. For scale, "KFLR loop": a plain loop of backward passes
  inside `backpack(KFLR())` that sums the factors (what the operator does, without its
  bookkeeping). Time ratio = median of interleaved paired ratios ours / curvlinops, in CPU time
  of the process (`time.process_time`, robust to other jobs on a shared machine).
- **GGN diagonal**: ours is exact, one sweep (`GGN(...).diagonal()`, `DiagGGNExact`);
  curvlinops estimates it with `hutchinson_diag(GGNLinearOperator, m)`. Reported: the error of
  their estimate for several m, and the m needed for 10% and 1% relative error, against our
  exact diagonal (they agree with the dense GGN to rounding, see `curvature_vs_peers`).
- **Top Hessian eigenvalue to 1e-3 relative**: ours `eigvalsh(Hessian(...), k=1, tol=...)`
  (Lanczos) against PyHessian's `eigenvalues(tol=...)` (power iteration) on the small MLP and
  CNN of `curvature_vs_peers` (float64, 10 batches), each with the loosest tolerance of a list
  whose eigenvalue is within 1e-3 of the dense Hessian's top eigenvalue.
- **Streaming memory**: peak extra CPU memory of our KFAC fit and GGN diagonal over 10 and 40
  batches (torch profiler): independent of the number of batches.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from backpack import backpack, extend
from backpack.curvature import EKFAC, GGN, KFAC, Hessian, eigvalsh
from backpack.extensions import KFLR
from benchmarks import curvature_vs_peers, problems
from benchmarks.curvature_vs_peers import peers_available
from benchmarks.report import finish, report_parser
from benchmarks.run import peak_extra_bytes

FIT_PROBLEMS = ("mlp", "3c3d", "allcnnc_small", "resnet_small")


def loader(name: str, batches: int, tiny: bool) -> tuple[nn.Module, nn.Module, list]:
    """`benchmarks.problems` problem `name` with `batches` batches of its size (float32)."""
    model, x, y, lossfunc = problems.build(name, tiny)
    gen = torch.Generator().manual_seed(1)
    data = []
    for b in range(batches):
        noise = 0.1 * torch.randn(x.shape, generator=gen) if b else torch.zeros_like(x)
        data.append((x + noise, y.roll(b)))
    return model, lossfunc, data


def paired(ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int) -> list[float]:
    """Times (seconds) of ours and theirs, interleaved; returns the ratios ours / theirs."""
    ours(), theirs()  # warm-up
    ratios = []
    for _ in range(repeats):
        start = time.process_time()
        ours()
        mid = time.process_time()
        theirs()
        ratios.append((mid - start) / (time.process_time() - mid))
    return ratios


def seconds(step: Callable[[], Any], repeats: int) -> float:
    """Median time of `step` after a warm-up."""
    step()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


def fit_rows(name: str, tiny: bool, repeats: int) -> list[str]:
    """KFAC and EK-FAC fits over 10 batches: ours vs curvlinops, and the plain KFLR loop."""
    import curvlinops as C

    model, lossfunc, data = loader(name, 10, tiny)
    params = [p for p in model.parameters() if p.requires_grad]

    def ours_kfac():
        return KFAC(model, lossfunc, data, fisher_type="type-2")

    def ours_ekfac():
        return EKFAC(model, lossfunc, data, fisher_type="type-2")

    def theirs(cls, correct: bool):
        def run():
            op = cls(
                model,
                lossfunc,
                params,
                data,
                check_deterministic=False,
                fisher_type="type-2",
                kfac_approx="expand",
            )
            op.compute_kronecker_factors()
            if correct:
                op.compute_eigenvalue_correction()
            return op

        return run

    extend(model)
    extend(lossfunc)

    def kflr_loop():
        sums: dict[int, list[Tensor]] = {}
        for X, y in data:
            with backpack(KFLR()):
                lossfunc(model(X), y).backward()
            for p in params:
                factors = getattr(p, "kflr", None)
                if factors is None:
                    continue
                held = sums.setdefault(id(p), [torch.zeros_like(f) for f in factors])
                for acc, f in zip(held, factors):
                    acc += f
                del p.kflr
        model.zero_grad()
        return sums

    rows = []
    kfac = paired(ours_kfac, theirs(C.KFACLinearOperator, False), repeats)
    loop = paired(kflr_loop, theirs(C.KFACLinearOperator, False), repeats)
    ekfac = paired(ours_ekfac, theirs(C.EKFACLinearOperator, True), repeats)
    size = sum(p.numel() for p in params)
    rows.append(
        f"| {name} | {size} | {statistics.median(kfac):.2f} ({min(kfac):.2f}–{max(kfac):.2f}) "
        f"| {statistics.median(ekfac):.2f} ({min(ekfac):.2f}–{max(ekfac):.2f}) "
        f"| {statistics.median(loop):.2f} |"
    )
    return rows


def diagonal_rows(name: str, tiny: bool, repeats: int) -> list[str]:
    """Exact GGN diagonal (ours) against curvlinops' Hutchinson estimate with m products."""
    import curvlinops as C

    model, lossfunc, data = loader(name, 10, tiny)
    params = [p for p in model.parameters() if p.requires_grad]
    exact = GGN(model, lossfunc, data).diagonal()
    ours_s = seconds(lambda: GGN(model, lossfunc, data).diagonal(), repeats)
    op = C.GGNLinearOperator(model, lossfunc, params, data, check_deterministic=False)
    size = exact.numel()
    rows, needed = [], {0.1: None, 0.01: None}
    for m in (1, 4, 16, 64, 256):
        if m >= size:
            break
        torch.manual_seed(0)
        start = time.process_time()
        estimate = C.hutchinson_diag(op, m)
        their_s = time.process_time() - start
        error = float((estimate - exact).norm() / exact.norm())
        for level in needed:
            if needed[level] is None and error <= level:
                needed[level] = m
        rows.append(f"| {name} | {size} | {ours_s:.3f} s | {m} | {their_s:.3f} s | {error:.2e} |")
    # the error of Hutchinson falls like 1/√m: extrapolate where not reached
    last_m, last_error = m, error
    notes = []
    for level, m_needed in needed.items():
        if m_needed is None:
            m_needed = f"≈{int(last_m * (last_error / level) ** 2)} (extrapolated, 1/√m)"
        notes.append(f"{level:.0%}: m = {m_needed}")
    rows.append(f"| {name} | | | {'; '.join(notes)} | | |")
    return rows


def eigen_rows(name: str, repeats: int, tiny: bool) -> list[str]:
    """Top Hessian eigenvalue to 1e-3 relative: ours (Lanczos) vs PyHessian (power iteration)."""
    from pyhessian import hessian as pyhessian

    n, batch = (16, 4) if tiny else (320, 32)
    model, data = curvature_vs_peers.build(name, n, batch)
    lossfunc = nn.CrossEntropyLoss()
    top = float(torch.linalg.eigvalsh(Hessian(model, lossfunc, data).to_dense())[-1])

    def ours(tol: float) -> float:
        return float(eigvalsh(Hessian(model, lossfunc, data), k=1, tol=tol)[-1])

    def theirs(tol: float) -> float:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # PyHessian draws float32 vectors otherwise
        try:
            torch.manual_seed(0)
            h = pyhessian(model, lossfunc, dataloader=data, cuda=False)
            return float(h.eigenvalues(maxIter=300, tol=tol)[0][0])
        finally:
            torch.set_default_dtype(default)

    def loosest(run: Callable[[float], float], tols: tuple[float, ...]) -> tuple[float, float]:
        """The loosest tolerance (and its value) whose eigenvalue is within 1e-3 of the top."""
        for tol in tols:
            value = run(tol)
            if abs(value - top) <= 1e-3 * abs(top):
                return tol, value
        return tols[-1], value

    tol_a, a = loosest(ours, (1e-1, 5e-2, 3e-2, 1e-2, 1e-3))
    tol_b, b = loosest(theirs, (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5))
    ratios = paired(lambda: ours(tol_a), lambda: theirs(tol_b), repeats)
    return [
        f"| {name} | {top:.8g} | {a:.8g} ({abs(a - top) / abs(top):.0e}, tol {tol_a:g}) "
        f"| {b:.8g} ({abs(b - top) / abs(top):.0e}, tol {tol_b:g}) "
        f"| {statistics.median(ratios):.2f} |"
    ]


def memory_rows(name: str, tiny: bool) -> list[str]:
    """Peak extra memory of our KFAC fit and GGN diagonal over 10 and 40 batches."""
    cpu = torch.device("cpu")
    cells = []
    for batches in (10, 40):
        model, lossfunc, data = loader(name, batches, tiny)

        def fit(model=model, lossfunc=lossfunc, data=data):
            return KFAC(model, lossfunc, data, fisher_type="type-2")

        def diagonal(model=model, lossfunc=lossfunc, data=data):
            return GGN(model, lossfunc, data).diagonal()

        kfac, diag = peak_extra_bytes(fit, cpu), peak_extra_bytes(diagonal, cpu)
        cells.append((kfac / 2**20, diag / 2**20))
    (k10, d10), (k40, d40) = cells
    return [f"| {name} | {k10:.1f} | {k40:.1f} | {d10:.1f} | {d40:.1f} |"]


def main(argv: list[str] | None = None) -> int:
    """Run every section; print (and with `--out` write) the markdown report."""
    parser = report_parser(__doc__)
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["fit", "diagonal", "eigen", "memory"],
        help="which sections to run (default: all)",
    )
    parser.add_argument("--fit-problems", nargs="+", default=None, help="problems of the fits")
    parser.add_argument("--diagonal-problems", nargs="+", default=None, help="of the diagonal")
    args = parser.parse_args(argv)
    if not peers_available():
        print("curvlinops/PyHessian are not installed: run `make install-bench`, use .venv-bench.")
        return 0
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    lines = [
        "# Sweeps over a loader: backpack.curvature vs curvlinops 3.0.1 and PyHessian 0.1 (CPU)",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        "`python -m benchmarks.curvature_sweeps_vs_peers`"
        f"{' --tiny' if args.tiny else ''}. Time ratios ours / theirs (< 1: ours faster), "
        f"median (and range) of {args.repeats} interleaved pairs after a warm-up, "
        "in CPU time of the process (robust to other jobs on a shared machine).",
        "",
        "## KFAC and EK-FAC fits over a 10-batch loader (float32, type-2, expand)",
        "",
        "| problem | parameters | KFAC: ours / curvlinops | EK-FAC: ours / curvlinops "
        "| KFLR loop / curvlinops KFAC |",
        "|---|---|---|---|---|",
    ]

    def emit(rows: list[str]) -> None:
        for row in rows:
            print(row, flush=True)
            lines.append(row)

    fit_names = args.fit_problems or (("mlp", "3c3d") if args.tiny else FIT_PROBLEMS)
    for name in fit_names if "fit" in args.sections else ():
        emit(fit_rows(name, args.tiny, args.repeats))
    lines += [
        "",
        "## GGN diagonal over a 10-batch loader (float32): exact vs Hutchinson",
        "",
        "Ours: the exact diagonal in one sweep (`GGN(...).diagonal()`). curvlinops: "
        "`hutchinson_diag(GGNLinearOperator, m)`, m products (one sweep each); error = "
        "`‖estimate − exact‖ / ‖exact‖`.",
        "",
        "| problem | parameters | ours (exact) | m | curvlinops | relative error |",
        "|---|---|---|---|---|---|",
    ]
    diagonal_names = args.diagonal_problems or (("mlp",) if args.tiny else ("mlp", "3c3d"))
    for name in diagonal_names if "diagonal" in args.sections else ():
        emit(diagonal_rows(name, args.tiny, args.repeats))
    lines += [
        "",
        "## Top Hessian eigenvalue to 1e-3 relative (float64, 10 batches)",
        "",
        "Ours: `eigvalsh(Hessian(...), k=1, tol=...)` (Lanczos; the Hessian's gradient graphs "
        "are kept between its products, `Hessian.cached`). PyHessian: "
        "`eigenvalues(maxIter=300, tol=...)` (power iteration). Each with the loosest of its "
        "tolerances whose eigenvalue is within 1e-3 of the dense Hessian's top eigenvalue "
        "(ours from 1e-1, 5e-2, 3e-2, 1e-2, 1e-3; PyHessian's from 1e-2, 3e-3, 1e-3, 3e-4, "
        "1e-4, 1e-5). In brackets: relative error to the dense top eigenvalue, and the tolerance.",
        "",
        "| model | dense | ours | PyHessian | time ratio |",
        "|---|---|---|---|---|",
    ]
    for name in ("mlp", "cnn") if "eigen" in args.sections else ():
        emit(eigen_rows(name, args.repeats, args.tiny))
    lines += [
        "",
        "## Streaming memory: peak extra MiB of a sweep (ours, float32)",
        "",
        "| problem | KFAC fit, 10 batches | 40 batches | GGN diagonal, 10 batches | 40 batches |",
        "|---|---|---|---|---|",
    ]
    for name in (("mlp",) if args.tiny else ("mlp", "3c3d")) if "memory" in args.sections else ():
        emit(memory_rows(name, args.tiny))
    return finish(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
