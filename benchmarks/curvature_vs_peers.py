"""`backpack.curvature` against curvlinops 3.0.1 and PyHessian 0.1: agreement and time ratios.

    python -m benchmarks.curvature_vs_peers [--tiny] [--repeats 3] [--out FILE]

Needs the benchmark environment (`make install-bench`); without the peers it prints a note and
exits 0. float64, a small MLP (Tanh) and a small CNN (ReLU), CrossEntropyLoss(reduction="mean"),
a list of equal batches (the data-set loss is the mean over all examples in both libraries).

- GGN, Hessian, empirical Fisher: products with K random columns, ours vs `GGNLinearOperator`,
  `HessianLinearOperator`, `EFLinearOperator`.
- KFAC (type-2, empirical and Monte-Carlo; "expand" and "reduce") and EK-FAC: products with the
  same columns, ours vs `KFACLinearOperator` / `EKFACLinearOperator`, per parameter block; with
  `separate_weight_and_bias=False` too (a bias folded into its weight's input factor, in both
  libraries). Convolutions follow the published definitions in both ("expand": `A` the mean
  over examples and output positions, `G = Σ_{n,p} s sᵀ`; backpack's per-batch `KFLR`/`KFAC`
  extensions keep the original BackPACK's scale instead, docs/curvature.md). Monte-Carlo labels
  come from different generators: compared in expectation only (distance to type-2).
- Top Hessian eigenvalue and trace: ours (`eigvalsh`, Lanczos; `hutchinson_trace`; the exact
  `Hessian.trace()`) vs PyHessian's power iteration and Hutchinson, and the dense eigenvalues.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from backpack.curvature import (
    EKFAC,
    GGN,
    KFAC,
    EmpiricalFisher,
    Hessian,
    eigvalsh,
    hutchinson_trace,
)
from benchmarks.report import finish, report_parser

PEERS = ("curvlinops", "pyhessian")


def peers_available() -> bool:
    """Whether curvlinops and PyHessian are installed (the benchmark environment)."""
    return all(importlib.util.find_spec(name) is not None for name in PEERS)


def build(name: str, n: int, batch: int):
    """`(model, data)`: seeded float64 model and a list of equal `(X, y)` batches."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 5))
        shape = (10,)
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 3 * 3, 5),
        )
        shape = (3, 10, 10)
    else:
        raise ValueError(name)
    X = torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (n,), generator=gen)
    data = [(X[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]
    return model.double(), data


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def timed(step: Callable[[], Tensor], repeats: int) -> tuple[Tensor, float]:
    out = step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def paired(ours: Callable[[], Tensor], theirs: Callable[[], Tensor], repeats: int):
    """Outputs, and the median of interleaved time ratios ours / theirs (after a warm-up)."""
    a, b = ours(), theirs()
    ratios = []
    for _ in range(repeats):
        start = time.perf_counter()
        a = ours()
        mid = time.perf_counter()
        b = theirs()
        ratios.append((mid - start) / (time.perf_counter() - mid))
    return a, b, statistics.median(ratios)


def matvec_rows(
    name: str, n: int, batch: int, k: int, repeats: int, only: list[str] | None = None
) -> list[str]:
    """Exact operators and Kronecker ones, ours vs curvlinops (build + one product).

    `only`: the labels of the rows to run (default: all).
    """
    import curvlinops as C

    model, data = build(name, n, batch)
    loss = nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    size = sum(p.numel() for p in params)
    V = torch.randn(size, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rows = []

    def exact(ours_cls, theirs_cls):
        def o():
            return ours_cls(model, loss, data) @ V

        def t():
            return theirs_cls(model, loss, params, data, check_deterministic=False) @ V

        return o, t

    cases = [
        ("GGN", *exact(GGN, C.GGNLinearOperator)),
        ("Hessian", *exact(Hessian, C.HessianLinearOperator)),
        ("EmpiricalFisher", *exact(EmpiricalFisher, C.EFLinearOperator)),
    ]
    for label, o, t in cases:
        if only is not None and label not in only:
            continue
        a, b, ratio = paired(o, t, repeats)
        rows.append(f"| {name} | {label} | {rel(a, b):.1e} | — | {ratio:.2f} |")

    def kron(ours_cls, theirs_cls, fisher, ours_fisher, mc=1, approx="expand", separate=True):
        def o():
            op = ours_cls(
                model,
                loss,
                data,
                fisher_type=ours_fisher,
                mc_samples=mc,
                kfac_approx=approx,
                separate_weight_and_bias=separate,
            )
            return op @ V

        def t():
            op = theirs_cls(
                model,
                loss,
                params,
                data,
                check_deterministic=False,
                fisher_type=fisher,
                mc_samples=mc,
                kfac_approx=approx,
                separate_weight_and_bias=separate,
            )
            return op @ V

        return o, t

    def per_block(a: Tensor, b: Tensor) -> str:
        out, start = [], 0
        for pname, p in model.named_parameters():
            end = start + p.numel()
            out.append(f"{pname}: {rel(a[start:end], b[start:end]):.0e}")
            start = end
        return "; ".join(out)

    K, E = C.KFACLinearOperator, C.EKFACLinearOperator
    kcases = [
        ("KFAC type-2", *kron(KFAC, K, "type-2", "type-2")),
        ("KFAC type-2 reduce", *kron(KFAC, K, "type-2", "type-2", approx="reduce")),
        ("KFAC empirical", *kron(KFAC, K, "empirical", "empirical")),
        ("KFAC empirical reduce", *kron(KFAC, K, "empirical", "empirical", approx="reduce")),
        ("EKFAC type-2", *kron(EKFAC, E, "type-2", "type-2")),
        ("EKFAC type-2 reduce", *kron(EKFAC, E, "type-2", "type-2", approx="reduce")),
        ("EKFAC empirical", *kron(EKFAC, E, "empirical", "empirical")),
        ("KFAC type-2, biases folded", *kron(KFAC, K, "type-2", "type-2", separate=False)),
        ("EKFAC type-2, biases folded", *kron(EKFAC, E, "type-2", "type-2", separate=False)),
        (
            "EKFAC empirical, biases folded",
            *kron(EKFAC, E, "empirical", "empirical", separate=False),
        ),
    ]
    for label, o, t in kcases:
        if only is not None and label not in only:
            continue
        a, b, ratio = paired(o, t, repeats)
        rows.append(f"| {name} | {label} | {rel(a, b):.1e} | {per_block(a, b)} | {ratio:.2f} |")
    if only is not None and "KFAC MC" not in only:
        return rows
    # Monte Carlo: different generators; distance of each to the type-2 product
    mc = 20
    o, t = kron(KFAC, C.KFACLinearOperator, "mc", "mc", mc)
    a, b, ratio = paired(o, t, repeats)
    ref_o, ref_t = kron(KFAC, C.KFACLinearOperator, "type-2", "type-2")
    ra, rb = ref_o(), ref_t()
    rows.append(
        f"| {name} | KFAC MC ({mc} samples) | {rel(a, b):.1e} | MC vs own type-2: ours "
        f"{rel(a, ra):.0e}, curvlinops {rel(b, rb):.0e} | {ratio:.2f} |"
    )
    return rows


def spectrum_rows(name: str, n: int, batch: int, repeats: int) -> list[str]:
    """Top Hessian eigenvalue and trace: ours vs PyHessian vs dense."""
    from pyhessian import hessian as pyhessian

    model, data = build(name, n, batch)
    loss = nn.CrossEntropyLoss()
    dense = Hessian(model, loss, data).to_dense()
    top = float(torch.linalg.eigvalsh(dense)[-1])
    exact_trace = float(dense.trace())

    def ours_eig():
        return float(eigvalsh(Hessian(model, loss, data), k=1, tol=1e-10)[-1])

    def ours_trace():
        return float(hutchinson_trace(Hessian(model, loss, data), 100, seed=0))

    def ours_exact_trace():
        return float(Hessian(model, loss, data).trace())

    def with_f64(f):
        def run():
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)  # PyHessian draws float32 vectors otherwise
            try:
                torch.manual_seed(0)
                return f(pyhessian(model, loss, dataloader=data, cuda=False))
            finally:
                torch.set_default_dtype(default)

        return run

    their_eig = with_f64(lambda h: float(h.eigenvalues(maxIter=300, tol=1e-7)[0][0]))
    their_trace = with_f64(lambda h: float(sum(h.trace(maxIter=100, tol=float("-inf"))) / 100))
    rows = []
    a, b, ratio = paired(ours_eig, their_eig, repeats)
    rows.append(
        f"| {name} | top eigenvalue (dense: {top:.10g}) | {a:.10g} ({abs(a - top) / abs(top):.0e}) "
        f"| {b:.10g} ({abs(b - top) / abs(top):.0e}) | {ratio:.2f} |"
    )
    a, b, ratio = paired(ours_trace, their_trace, repeats)
    rows.append(
        f"| {name} | Hutchinson trace, 100 vectors (dense: {exact_trace:.6g}) | {a:.6g} "
        f"({abs(a - exact_trace) / abs(exact_trace):.0e}) | {b:.6g} "
        f"({abs(b - exact_trace) / abs(exact_trace):.0e}) | {ratio:.2f} |"
    )
    a, seconds = timed(ours_exact_trace, repeats)
    rows.append(
        f"| {name} | exact trace `Hessian.trace()` (DiagHessian, one sweep) | {a:.10g} "
        f"({abs(a - exact_trace) / abs(exact_trace):.0e}), {seconds:.3f} s | — | — |"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = report_parser(__doc__, threads=2)
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only the product rows with these labels (e.g. Hessian, 'KFAC type-2 reduce', "
        "'KFAC MC'), no spectrum rows",
    )
    args = parser.parse_args(argv)
    if not peers_available():
        print("curvlinops/PyHessian are not installed: run `make install-bench`, use .venv-bench.")
        return 0
    torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    n, batch, k = (16, 8, 3) if args.tiny else (128, 32, 10)
    lines = [
        "# backpack.curvature vs curvlinops 3.0.1 and PyHessian 0.1 (CPU)",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64, "
        f"CrossEntropyLoss (mean), {n} examples in batches of {batch}, "
        "`python -m benchmarks.curvature_vs_peers`.",
        "",
        f"## Products with {k} random columns (operator built + one product)",
        "",
        "Relative error `‖ours − curvlinops‖ / ‖curvlinops‖` of the `[P, K]` product; time "
        f"ratio = median of {args.repeats} interleaved paired ratios ours / curvlinops "
        "(< 1: ours faster).",
        "",
        "| model | operator | relative error | per parameter block | time ratio |",
        "|---|---|---|---|---|",
    ]
    for name in ("mlp", "cnn"):
        for row in matvec_rows(name, n, batch, k, args.repeats, args.only):
            print(row, flush=True)
            lines.append(row)
    if args.only is not None:
        print("\n".join(lines))
        return 0
    lines += [
        "",
        "## Hessian spectrum: ours vs PyHessian",
        "",
        "Ours: `eigvalsh(Hessian(...), k=1, tol=1e-10)` (Lanczos), `hutchinson_trace(..., 100)`; "
        "PyHessian: `eigenvalues(maxIter=300, tol=1e-7)` (power iteration), `trace(maxIter=100, "
        "tol=-inf)` (its stopping rule divides by the running mean, so with a negative mean and "
        "tol=0 it stops at once). In brackets: relative error to the dense matrix. Time ratio "
        "ours / PyHessian.",
        "",
        "| model | quantity | ours | PyHessian | time ratio |",
        "|---|---|---|---|---|",
    ]
    for name in ("mlp", "cnn"):
        for row in spectrum_rows(name, n, batch, 1):  # PyHessian is slow: one paired run
            print(row, flush=True)
            lines.append(row)
    return finish(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
