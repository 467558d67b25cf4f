"""laplace-torch's workflow with each curvature backend: backpack's `LaplaceGGN` against the others.

    python -m benchmarks.laplace_backends [--tiny] [--repeats 3] [--threads 2] [--out FILE]

Needs laplace-torch (installed by `make install`, see docs/laplace.md); without it, prints a note
and exits 0. On the tour's MLP and CNN (float32, random digit-shaped inputs, 10 classes, a loader
of `--batches` batches of 64), for each Hessian structure (diag, kron) and backend:

- `LaplaceGGN`: this package's backend (one backward per batch; Jacobians in one backward);
- `BackPackGGN`: laplace-torch's own BackPACK backend, running on this package (per-batch
  extensions; Jacobians from one `BatchGrad` pass per output);
- `CurvlinopsGGN` and `AsdlGGN`: laplace-torch's other backends (skipped where they fail).

A row times `Laplace(...).fit(loader)` and the GLM predictive on one batch of 64 test inputs
(`la(x, pred_type="glm", link_approx="probit")`, whose Jacobians come from the backend), median
of `--repeats` runs after a warm-up, backends interleaved; the ratio is each backend's time over
`LaplaceGGN`'s (> 1: backpack faster). The fitted curvature of every backend is compared with
`LaplaceGGN`'s (relative difference of the diagonals; for "kron", of the Kronecker blocks').
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from backpack import tour
from benchmarks.report import finish, report_parser


def available() -> bool:
    """Whether laplace-torch is installed."""
    return importlib.util.find_spec("laplace") is not None


def problem(name: str, batches: int, tiny: bool) -> tuple[nn.Module, DataLoader, Tensor]:
    """Model, a loader of `(X, y)` batches, and test inputs."""
    torch.manual_seed(0)
    model = tour.mlp() if name == "mlp" else tour.cnn()
    n = 8 if tiny else 64
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(batches * n, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (batches * n,), generator=gen)
    data = DataLoader(TensorDataset(X, y), batch_size=n)  # laplace-torch reads `.dataset`
    return model, data, torch.randn(n, 1, 28, 28, generator=gen)


def backends() -> dict[str, Any]:
    """Backend classes by name (this package's first)."""
    from laplace.curvature import AsdlGGN, BackPackGGN, CurvlinopsGGN

    from backpack.laplace import LaplaceGGN

    return {
        "LaplaceGGN": LaplaceGGN,
        "BackPackGGN": BackPackGGN,
        "CurvlinopsGGN": CurvlinopsGGN,
        "AsdlGGN": AsdlGGN,
    }


def run(model: nn.Module, data: DataLoader, test: Tensor, structure: str, backend: Any):
    """Fit one Laplace approximation and run the GLM predictive; return it."""
    from laplace import Laplace

    la = Laplace(
        model, "classification", subset_of_weights="all", hessian_structure=structure,
        backend=backend,
    )
    la.fit(data)
    la(test, pred_type="glm", link_approx="probit")
    return la


def curvature(la: Any) -> Tensor:
    """The fitted curvature's diagonal (of the Kronecker blocks for "kron")."""
    H = la.H
    return (H if isinstance(H, Tensor) else H.diag()).detach().flatten()


def rows(name: str, structure: str, batches: int, repeats: int, tiny: bool) -> list[str]:
    """One table row per backend for one model and structure."""
    model, data, test = problem(name, batches, tiny)
    steps: dict[str, Callable[[], Any]] = {}
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    for label, backend in backends().items():
        try:
            results[label] = run(model, data, test, structure, backend)  # warm-up
        except Exception as err:  # noqa: BLE001 - report, do not stop the table
            failures[label] = f"{type(err).__name__}: {str(err)[:60]}"
            continue
        steps[label] = lambda backend=backend: run(model, data, test, structure, backend)
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(repeats):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - start)
    ours = statistics.median(times["LaplaceGGN"])
    reference = curvature(results["LaplaceGGN"])
    out = []
    for label in backends():
        if label in failures:
            out.append(f"| {name} | {structure} | {label} | — | — | failed: {failures[label]} |")
            continue
        median = statistics.median(times[label])
        value = curvature(results[label])
        diff = float((value - reference).norm() / reference.norm().clamp_min(1e-30))
        out.append(
            f"| {name} | {structure} | {label} | {median * 1e3:.0f} ms | {median / ours:.2f} "
            f"| {diff:.1e} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Print (and with `--out` write) the markdown report."""
    parser = report_parser(__doc__, threads=2)
    parser.add_argument("--batches", type=int, default=10)
    args = parser.parse_args(argv)
    if not available():
        print("laplace-torch is not installed (see docs/laplace.md).")
        return 0
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    batches = 2 if args.tiny else args.batches
    lines = [
        "# laplace-torch backends: fit + GLM predictive (CPU)",
        "",
        f"torch {torch.__version__}, {args.threads} threads, float32, the tour's models, "
        f"{batches} batches of {8 if args.tiny else 64}, `python -m benchmarks.laplace_backends"
        f"{' --tiny' if args.tiny else ''}`. Ratio: the backend's time / `LaplaceGGN`'s "
        "(> 1: backpack faster). Difference: of the curvature's diagonal, relative to "
        "`LaplaceGGN`'s.",
        "",
        "| model | structure | backend | fit + GLM predictive | ratio | curvature difference |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("mlp", "cnn"):
        for structure in ("diag", "kron"):
            for row in rows(name, structure, batches, args.repeats, args.tiny):
                print(row, flush=True)
                lines.append(row)
    return finish(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
