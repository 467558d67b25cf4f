"""The tour's figure: what per-sample gradients and curvature look like on real data.

One row per model, three panels each:

1. a histogram of the per-sample gradient norms ``‖∇ℓₙ‖`` (from `BatchL2Grad`), misclassified
   samples stacked in red, with the norm of their mean (the ordinary gradient) for comparison;
2. the GGN diagonal (`DiagGGNExact`) against the empirical Fisher diagonal
   ``(1/N) Σₙ (∇ℓₙ)²`` (from `SumGradSquared`), entry by entry on log-log axes, one colour per
   layer;
3. the eigenvalues of the Kronecker factors G and A of every layer (from `KFAC`).

matplotlib is optional (``pip install matplotlib``, or the ``plot`` extra) and imported only
when drawing. The figure is rendered with the Agg canvas directly, so no global backend is
switched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

#: at most this many points per layer in the scatter plot (a random subset)
MAX_POINTS = 3000
#: the scatter plot shows entries down to this fraction of the largest one
SCATTER_RANGE = 1e-10
#: eigenvalues below this fraction of the largest are not drawn (float32 round-off, exact zeros)
EIGENVALUE_CUTOFF = 1e-6


@dataclass
class LayerCurvature:
    """GGN and empirical Fisher diagonals of one layer's parameters (flattened, concatenated)."""

    name: str
    ggn_diag: Tensor
    empirical_fisher: Tensor


@dataclass
class LayerSpectrum:
    """Eigenvalues of one layer's Kronecker factors G (output side) and A (input side)."""

    name: str
    g_eigenvalues: Tensor
    a_eigenvalues: Tensor


@dataclass
class ModelPanel:
    """Everything the figure shows about one model.

    Args:
        name: Model name.
        description: One line describing the model.
        sample_grad_norms: ``[N]`` norms of the per-sample loss gradients, or None.
        mean_grad_norm: Norm of the batch-mean gradient, or None.
        misclassified: ``[N]`` booleans, True where the model's prediction is wrong, or None.
        curvature: Per-layer GGN vs empirical Fisher diagonals (may be empty).
        spectra: Per-layer Kronecker factor eigenvalues (may be empty).

    """

    name: str
    description: str
    sample_grad_norms: Tensor | None = None
    mean_grad_norm: float | None = None
    misclassified: Tensor | None = None
    curvature: list[LayerCurvature] = field(default_factory=list)
    spectra: list[LayerSpectrum] = field(default_factory=list)


def matplotlib_missing() -> str | None:
    """None if matplotlib can be imported, else a short reason."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed"
    return None


def _positive(values: Tensor) -> Tensor:
    values = values.detach().cpu().to(torch.float64).flatten()
    return values[values > 0]


def _plain_log_ticks(axis, decades: float) -> None:  # noqa: ANN001 (matplotlib Axis)
    """Label a log axis with plain numbers (0.02, 0.5, 10); at 2 and 5 x 10^k too if short."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    subs = (1.0, 2.0, 5.0) if decades < 3 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _note(ax, text: str) -> None:  # noqa: ANN001
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _histogram(ax, panel: ModelPanel) -> None:  # noqa: ANN001
    if panel.sample_grad_norms is None or _positive(panel.sample_grad_norms).numel() == 0:
        _note(ax, "BatchL2Grad not run")
        return
    norms = panel.sample_grad_norms.detach().cpu().to(torch.float64).flatten()
    wrong = panel.misclassified
    if wrong is None or wrong.shape != norms.shape:
        wrong = torch.zeros_like(norms, dtype=torch.bool)
    keep = norms > 0
    norms, wrong = norms[keep], wrong[keep]
    low, high = norms.min().item(), norms.max().item()
    if panel.mean_grad_norm:
        low, high = min(low, panel.mean_grad_norm), max(high, panel.mean_grad_norm)
    edges = torch.logspace(math.log10(low / 1.2), math.log10(high * 1.2), 31, device="cpu").numpy()
    ax.hist(
        [norms[~wrong].numpy(), norms[wrong].numpy()],
        bins=edges,
        stacked=True,
        color=["#4C72B0", "#C44E52"],
        edgecolor="white",
        linewidth=0.5,
        label=[
            f"classified correctly ({int((~wrong).sum())})",
            f"misclassified ({int(wrong.sum())})",
        ],
    )
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis, math.log10(high / low))
    if panel.mean_grad_norm:
        ax.axvline(
            panel.mean_grad_norm,
            color="0.2",
            linestyle="--",
            linewidth=1.5,
            label="norm of the batch gradient ‖∇L‖",
        )
    ax.set_ylim(top=ax.get_ylim()[1] * 1.35)  # room for the legend
    ax.set_xlabel("per-sample gradient norm ‖∇ℓₙ‖")
    ax.set_ylabel("samples")
    ax.set_title("per-sample gradient norms (BatchL2Grad)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def _scatter(ax, panel: ModelPanel, colors: Sequence[str]) -> None:  # noqa: ANN001
    if not panel.curvature:
        _note(ax, "DiagGGNExact / SumGradSquared not run")
        return
    gen = torch.Generator("cpu").manual_seed(0)
    top = max(
        max(layer.ggn_diag.max().item(), layer.empirical_fisher.max().item())
        for layer in panel.curvature
    )
    floor = top * SCATTER_RANGE  # entries far below are (numerically) zero, not informative
    low, high = float("inf"), 0.0
    for layer, color in zip(panel.curvature, colors):
        ggn = layer.ggn_diag.detach().cpu().to(torch.float64).flatten()
        fisher = layer.empirical_fisher.detach().cpu().to(torch.float64).flatten()
        keep = (ggn > floor) & (fisher > floor)
        ggn, fisher = ggn[keep], fisher[keep]
        if ggn.numel() == 0:
            continue
        if ggn.numel() > MAX_POINTS:
            pick = torch.randperm(ggn.numel(), generator=gen, device="cpu")[:MAX_POINTS]
            ggn, fisher = ggn[pick], fisher[pick]
        few = ggn.numel() < 400  # small layers (biases, first convolutions) drawn on top
        ax.scatter(
            fisher.numpy(),
            ggn.numpy(),
            s=14 if few else 5,
            alpha=0.8 if few else 0.35,
            zorder=3 if few else 2,
            color=color,
            linewidths=0,
            label=layer.name,
            rasterized=True,
        )
        low = min(low, ggn.min().item(), fisher.min().item())
        high = max(high, ggn.max().item(), fisher.max().item())
    if high > 0:
        ax.plot([low, high], [low, high], color="0.3", linestyle="--", linewidth=1, label="equal")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("empirical Fisher diagonal  (1/N) Σₙ (∇ℓₙ)²   [SumGradSquared]")
    ax.set_ylabel("GGN diagonal   [DiagGGNExact]")
    ax.set_title("curvature per parameter: GGN vs empirical Fisher", fontsize=10)
    legend = ax.legend(fontsize=8, loc="upper left", markerscale=3)
    for handle in legend.legend_handles:
        handle.set_alpha(1)


def _spectra(ax, panel: ModelPanel, colors: Sequence[str]) -> None:  # noqa: ANN001
    if not panel.spectra:
        _note(ax, "KFAC not run")
        return
    for layer, color in zip(panel.spectra, colors):
        for values, style, factor in (
            (layer.a_eigenvalues, "-", "A"),
            (layer.g_eigenvalues, "--", "G"),
        ):
            values = values.detach().cpu().to(torch.float64).flatten().sort(descending=True).values
            if values.numel() == 0 or values[0] <= 0:
                continue
            dim = values.numel()
            values = values[values > values[0] * EIGENVALUE_CUTOFF]
            ranks = torch.arange(1, values.numel() + 1, device="cpu")
            ax.plot(
                ranks.numpy(),
                values.numpy(),
                style,
                color=color,
                linewidth=1.6,
                label=f"{layer.name} {factor} ({dim}×{dim})",
                marker="o" if values.numel() < 12 else None,
                markersize=3,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_ticks(ax.xaxis, 1.0)
    ax.set_xlabel("rank")
    ax.set_ylabel("eigenvalue")
    ax.set_title("Kronecker factors (KFAC): eigenvalues of A (solid), G (dashed)", fontsize=10)
    ax.legend(fontsize=7, ncol=2, loc="lower left")


def plot_tour(panels: Sequence[ModelPanel], path: str | Path, batch_size: int) -> Path:
    """Draw the tour's figure (one row of three panels per model) and save it as a PNG.

    Args:
        panels: One `ModelPanel` per model.
        path: Where to write the PNG.
        batch_size: Number of samples, for the title.

    Returns:
        The absolute path of the written file.

    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = ["#4C72B0", "#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3"]
    rows = max(1, len(panels))
    fig = Figure(figsize=(16, 4.6 * rows + 0.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    subfigs = fig.subfigures(rows, 1, squeeze=False)[:, 0]
    for subfig, panel in zip(subfigs, panels):
        axes = subfig.subplots(1, 3)
        _histogram(axes[0], panel)
        _scatter(axes[1], panel, colors)
        _spectra(axes[2], panel, colors)
        subfig.suptitle(
            f"{panel.name}: {panel.description}",
            fontsize=11,
            fontweight="bold",
            x=0.01,
            ha="left",
        )
    fig.suptitle(
        f"backpack tour: quantities from one backward pass on a batch of {batch_size} "
        "handwritten digits",
        fontsize=13,
    )
    path = Path(path).expanduser().resolve()
    fig.savefig(path, format="png")
    return path
