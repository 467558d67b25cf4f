"""`backpack.influence` against kronfluence: scores, run time and peak memory, side by side.

    python -m benchmarks.influence_vs_kronfluence [--tiny] [--repeats 3] [--out FILE]

Needs the benchmark environment (`make install-bench`: kronfluence in `.venv-bench`); without
kronfluence it prints a note and exits 0. Everything is float64 and deterministic: both libraries
use the empirical Fisher (the data's labels; kronfluence's `use_empirical_fisher=True`), the same
models, data, batches, strategy and damping.

Both score `∇ℓ_qᵀ (F + λI)⁻¹ ∇ℓ_t` with each example's summed loss and `F` the mean over the
training examples. kronfluence's numbers are ours with the options `KRONFLUENCE` (docs/influence.md,
"Reproducing kronfluence"):

- `separate_weight_and_bias=False`: kronfluence folds a layer's bias into its weight's factors
  (an appended constant-1 input), one block per module; its heuristic damping `0.1 × mean` is
  then per module for every strategy ("diagonal" included), as ours per (folded) block;
- `kfac_positions="mean"`: kronfluence's KFAC covariances average over all positions seen (N·T:
  a sequence's tokens, a convolution's output pixels), so its block of a layer on T positions is
  ours divided by T (ours: `F` per example, summed over the positions; EK-FAC, whose eigenvalues
  come from per-example gradients, is the same in both);
- convolutions under `kfac_approx="expand"` follow the published definition in both;
- `fisher="empirical"`: kronfluence's `use_empirical_fisher=True` (its sampled labels come from
  its own generator: the "true" Fisher agrees in expectation only).

The agreement rows compare the score matrices directly; the time rows run both libraries' defaults
for the empirical Fisher (separate biases here, no bias in those models).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack.influence import fit
from benchmarks.report import finish, report_parser

STRATEGIES = ("identity", "diagonal", "kfac", "ekfac")
#: `fit`'s options that reproduce kronfluence's scores (float64; docs/influence.md)
KRONFLUENCE = {"fisher": "empirical", "separate_weight_and_bias": False, "kfac_positions": "mean"}


def peers_available() -> bool:
    """Whether kronfluence is installed (the benchmark environment)."""
    return importlib.util.find_spec("kronfluence") is not None


# --- problems --------------------------------------------------------------------------------
def _add_block_layers(m: nn.Module, dim: int, heads: int, bias: bool) -> None:
    """Give `m` the layers of one pre-norm transformer block (attention and MLP in `nn.Linear`)."""
    m.heads = heads
    m.ln1 = nn.LayerNorm(dim)
    m.q = nn.Linear(dim, dim, bias=bias)
    m.k = nn.Linear(dim, dim, bias=bias)
    m.v = nn.Linear(dim, dim, bias=bias)
    m.o = nn.Linear(dim, dim, bias=bias)
    m.ln2 = nn.LayerNorm(dim)
    m.up = nn.Linear(dim, 4 * dim, bias=bias)
    m.down = nn.Linear(4 * dim, dim, bias=bias)


def _block_forward(m: Any, h: Tensor) -> Tensor:
    """The block whose layers `_add_block_layers` gave `m`, on hidden states `[N, T, D]`."""
    n, t, _ = h.shape
    a = m.ln1(h)
    d = a.shape[-1] // m.heads

    def split(z: Tensor) -> Tensor:
        return z.reshape(n, t, m.heads, d).transpose(1, 2)

    q, k, v = split(m.q(a)), split(m.k(a)), split(m.v(a))
    mask = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
    att = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
    y = (att.softmax(-1) @ v).transpose(1, 2).reshape(n, t, -1)
    h = h + m.o(y)
    return h + m.down(F.gelu(m.up(m.ln2(h))))


class Block(nn.Module):
    """One transformer block of `GPT` (layers as in `TinyGPT`)."""

    def __init__(self, dim: int, heads: int, bias: bool) -> None:
        super().__init__()
        _add_block_layers(self, dim, heads, bias)

    def forward(self, h: Tensor) -> Tensor:  # noqa: D102
        return _block_forward(self, h)


class TinyGPT(nn.Module):
    """Decoder-only transformer whose attention is built from `nn.Linear` layers (kronfluence's
    coverage): embeddings, LayerNorms and the position embedding are not `nn.Linear`."""

    def __init__(
        self, vocab: int = 32, context: int = 8, dim: int = 16, heads: int = 2, bias: bool = False
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(context, dim))
        _add_block_layers(self, dim, heads, bias)
        self.lnf = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=bias)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = _block_forward(self, h)
        return self.head(self.lnf(h)).transpose(1, 2)  # [N, V, T] for CE with targets [N, T]


class GPT(nn.Module):
    """`layers` blocks of `TinyGPT`'s kind: GPT-2 small's shapes with the defaults (124M)."""

    def __init__(
        self,
        vocab: int = 50257,
        context: int = 1024,
        dim: int = 768,
        heads: int = 12,
        layers: int = 12,
        bias: bool = True,
        tied: bool = True,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, bias) for _ in range(layers))
        self.lnf = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=bias)
        nn.init.normal_(self.tok.weight, std=0.02)
        if tied:  # GPT-2 ties its head to the token embedding
            self.head.weight = self.tok.weight

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.lnf(h)).transpose(1, 2)


def build(name: str, n_train: int, n_query: int, bias: bool = False):
    """`(model, X_train, y_train, X_query, y_query)`, seeded, float64."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(64, 128, bias=bias),
            nn.Tanh(),
            nn.Linear(128, 128, bias=bias),
            nn.Tanh(),
            nn.Linear(128, 10, bias=bias),
        )
        shape, classes = (64,), 10
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, bias=bias),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, bias=bias),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 6 * 6, 10, bias=bias),
        )
        shape, classes = (3, 16, 16), 10
    elif name == "gpt":
        model = TinyGPT(bias=bias)
        n = n_train + n_query
        tokens = torch.randint(0, 32, (n, 9), generator=gen)
        X, y = tokens[:, :-1], tokens[:, 1:]
        return model.double(), X[:n_train], y[:n_train], X[n_train:], y[n_train:]
    else:
        raise ValueError(name)
    n = n_train + n_query
    X = torch.randn(n, *shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=gen)
    return model.double(), X[:n_train], y[:n_train], X[n_train:], y[n_train:]


def batches(X: Tensor, y: Tensor, size: int) -> list[tuple[Tensor, Tensor]]:
    return [(X[i : i + size], y[i : i + size]) for i in range(0, len(X), size)]


def positions(model: nn.Module, module: nn.Module, X: Tensor) -> int:
    """How many positions a module's weight is shared over (P of the KFAC mapping)."""
    seen = {}

    def hook(mod, inputs, output) -> None:
        seen["out"] = output.shape

    handle = module.register_forward_hook(hook)
    with torch.no_grad():
        model(X[:1])
    handle.remove()
    shape = seen["out"]
    if isinstance(module, nn.Conv2d):
        return shape[-1] * shape[-2]
    return math.prod(shape[1:-1])


# --- backpack ----------------------------------------------------------------------------------
def backpack_scores(model, train, query, strategy, damping):
    """`fit` + `scores` with the empirical Fisher."""
    influence = fit(model, nn.CrossEntropyLoss(), train, strategy, damping, fisher="empirical")
    return influence, influence.scores(query, train)


# --- kronfluence -------------------------------------------------------------------------------
def _task(tracked: list[str] | None = None):
    from kronfluence.task import Task

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            X, y = batch
            out = model(X)
            if sample:  # not used: the comparison is with the empirical Fisher
                with torch.no_grad():
                    probs = out.detach().movedim(1, -1).softmax(-1)
                    y = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).reshape(y.shape)
            return F.cross_entropy(out, y, reduction="sum")

        def compute_measurement(self, batch, model):
            X, y = batch
            return F.cross_entropy(model(X), y, reduction="sum")

        def get_influence_tracked_modules(self):
            return tracked

    return Classification()


class Kronfluence:
    """kronfluence's `Analyzer` on a deep copy of the model, all dtypes float64."""

    def __init__(self, model: nn.Module, workdir: str, tracked: list[str] | None = None):
        from kronfluence.analyzer import Analyzer, prepare_model

        task = _task(tracked)
        self.model = prepare_model(copy.deepcopy(model), task)
        self.analyzer = Analyzer(
            "bench", self.model, task, cpu=True, disable_tqdm=True, output_dir=workdir
        )
        self.count = 0

    def scores(
        self,
        train,
        query,
        strategy,
        damping,
        batch_size,
        per_module=False,
        per_token=False,
        dtype=torch.float64,
    ):
        from kronfluence.arguments import FactorArguments, ScoreArguments
        from torch.utils.data import TensorDataset

        dt = dtype  # kronfluence's computation (eigendecompositions: its float64 default)
        factor_args = FactorArguments(
            strategy=strategy,
            use_empirical_fisher=True,
            activation_covariance_dtype=dt,
            gradient_covariance_dtype=dt,
            eigendecomposition_dtype=torch.float64,
            per_sample_gradient_dtype=dt,
            lambda_dtype=dt,
        )
        score_args = ScoreArguments(
            damping_factor=damping,
            compute_per_module_scores=per_module,
            compute_per_token_scores=per_token,
            per_sample_gradient_dtype=dt,
            precondition_dtype=dt,
            score_dtype=dt,
        )
        self.count += 1
        name = f"{strategy}{self.count}"
        self.analyzer.fit_all_factors(
            name,
            TensorDataset(*train),
            per_device_batch_size=batch_size,
            factor_args=factor_args,
            overwrite_output_dir=True,
        )
        self.analyzer.compute_pairwise_scores(
            name,
            name,
            TensorDataset(*query),
            TensorDataset(*train),
            per_device_query_batch_size=batch_size,
            per_device_train_batch_size=batch_size,
            score_args=score_args,
            overwrite_output_dir=True,
        )
        scores = self.analyzer.load_pairwise_scores(name)
        return scores if per_module else scores["all_modules"]


# --- comparisons -------------------------------------------------------------------------------
def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def deviation(a: Tensor, b: Tensor) -> float:
    """`max |a − b| / max |b|`: the largest deviation relative to the largest score."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _tracked(name: str, model: nn.Module) -> list[str] | None:
    """kronfluence's coverage of the GPT: its `nn.Linear` layers; the rest frozen here."""
    if name != "gpt":
        return None
    tracked = [m for m, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for pname, p in model.named_parameters():
        p.requires_grad_(pname.rsplit(".", 1)[0] in tracked)
    return tracked


def compare(name, strategy, damping, n_train, n_query, batch, workdir, bias=False):
    """Relative error and largest deviation of the scores, ours with `KRONFLUENCE`."""
    model, Xt, yt, Xq, yq = build(name, n_train, n_query, bias)
    train, query = batches(Xt, yt, batch), batches(Xq, yq, batch)
    kf = Kronfluence(model, workdir, _tracked(name, model))
    theirs = kf.scores((Xt, yt), (Xq, yq), strategy, damping, batch)
    influence = fit(model, nn.CrossEntropyLoss(), train, strategy, damping, **KRONFLUENCE)
    ours = influence.scores(query, train)
    return rel(ours, theirs), deviation(ours, theirs)


def compare_per_token(strategy, damping, n_train, n_query, batch, workdir, bias=False):
    """Relative error and largest deviation of the GPT's per-token scores `[Q, N, T]`."""
    model, Xt, yt, Xq, yq = build("gpt", n_train, n_query, bias)
    train, query = batches(Xt, yt, batch), batches(Xq, yq, batch)
    kf = Kronfluence(model, workdir, _tracked("gpt", model))
    theirs = kf.scores((Xt, yt), (Xq, yq), strategy, damping, batch, per_token=True)
    influence = fit(model, nn.CrossEntropyLoss(), train, strategy, damping, **KRONFLUENCE)
    ours = influence.scores(query, train, per_token=True)
    return rel(ours, theirs), deviation(ours, theirs)


def peak_bytes(step: Callable[[], Any]) -> int:
    from benchmarks.run import peak_extra_bytes

    return peak_extra_bytes(step, torch.device("cpu"))


#: the clock of `timing`: process CPU time by default (robust to other jobs on a shared
#: machine; kronfluence runs in this process too), wall time with `--clock wall`
CLOCK: Callable[[], float] = time.process_time


def timing(name, strategy, n_train, n_query, batch, repeats, workdir):
    """Median paired time ratio (ours / kronfluence), and peak memories, of fit + scores."""
    model, Xt, yt, Xq, yq = build(name, n_train, n_query)
    train, query = batches(Xt, yt, batch), batches(Xq, yq, batch)
    kf = Kronfluence(model, workdir)

    def ours():
        backpack_scores(model, train, query, strategy, None)

    def theirs():
        kf.scores((Xt, yt), (Xq, yq), strategy, None, batch)

    ours(), theirs()  # warm-up
    t_ours, t_theirs = [], []
    for _ in range(repeats):  # interleaved
        for step, times in ((ours, t_ours), (theirs, t_theirs)):
            start = CLOCK()
            step()
            times.append(CLOCK() - start)
    ratios = [a / b for a, b in zip(t_ours, t_theirs)]
    return {
        "ours_s": statistics.median(t_ours),
        "theirs_s": statistics.median(t_theirs),
        "ratio": statistics.median(ratios),
        "ours_peak": peak_bytes(ours),
        "theirs_peak": peak_bytes(theirs),
    }


def coverage(n: int = 16) -> tuple[int, int]:
    """GPT parameters kronfluence covers (nn.Linear weights) vs all that backpack scores."""
    model = build("gpt", n, 4)[0]
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return linear, sum(p.numel() for p in model.parameters())


def gpt_full_ekfac(n: int, batch: int) -> tuple[int, float]:
    """backpack's EK-FAC on every GPT parameter (what kronfluence cannot): P and seconds."""
    model, Xt, yt, Xq, yq = build("gpt", n, 10)
    start = time.perf_counter()
    _, s = backpack_scores(model, batches(Xt, yt, batch), batches(Xq, yq, batch), "ekfac", None)
    assert torch.isfinite(s).all()
    return sum(p.numel() for p in model.parameters()), time.perf_counter() - start


def factored_vs_dense(
    context: int = 32, dim: int = 128, n_train: int = 32, batch: int = 16, repeats: int = 5
) -> list[tuple[str, int, float, float]]:
    """Scores of a GPT on sequences with the factored products vs per-sample gradients.

    Rows `(strategy, n_query, time ratio, peak-memory ratio)`, factored / dense
    (`scores(..., factored=False)`), fit excluded; every parameter scored.
    """
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = TinyGPT(vocab=64, context=context, dim=dim, heads=4).double()
    tokens = torch.randint(0, 64, (n_train + 8, context + 1), generator=gen)
    X, y = tokens[:, :-1], tokens[:, 1:]
    train = batches(X[:n_train], y[:n_train], batch)
    rows = []
    for strategy in ("identity", "diagonal"):
        influence = fit(model, nn.CrossEntropyLoss(), train, strategy, fisher="empirical")
        for n_query in (1, 8):
            query = batches(X[n_train : n_train + n_query], y[n_train : n_train + n_query], 8)

            def run(factored: bool, query=query, influence=influence) -> Tensor:
                return influence.scores(query, train, factored=factored)

            torch.testing.assert_close(run(True), run(False), rtol=1e-9, atol=1e-12)
            ratios = []
            for _ in range(repeats):  # interleaved, paired
                seconds = {}
                for factored in (True, False):
                    start = time.perf_counter()
                    run(factored)
                    seconds[factored] = time.perf_counter() - start
                ratios.append(seconds[True] / seconds[False])
            peaks = {f: peak_bytes(lambda f=f: run(f)) for f in (True, False)}
            rows.append((strategy, n_query, statistics.median(ratios), peaks[True] / peaks[False]))
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = report_parser(__doc__)
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="time measure of the time rows"
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=("agreement", "time", "gpt"),
        default=["agreement", "time", "gpt"],
    )
    parser.add_argument(
        "--time-rows", nargs="+", default=None, help="only these time rows, e.g. cnn:ekfac"
    )
    args = parser.parse_args(argv)
    if not peers_available():
        print("kronfluence is not installed: run `make install-bench` and use .venv-bench.")
        return 0
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    n_acc, q_acc, batch = (40, 8, 16) if args.tiny else (200, 20, 50)
    n_time, q_time, t_batch = (60, 10, 20) if args.tiny else (1000, 100, 100)
    lines = [
        "# backpack.influence vs kronfluence 1.0.1 (CPU)",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64, empirical "
        "Fisher, `python -m benchmarks.influence_vs_kronfluence`.",
        "",
        f"## Agreement ({n_acc} training × {q_acc} query examples, batches of {batch})",
        "",
        "backpack with `fit(..., fisher=\"empirical\", separate_weight_and_bias=False, "
        "kfac_positions=\"mean\")` (`KRONFLUENCE`); relative error "
        "`‖S_backpack − S_kronfluence‖_F / ‖S_kronfluence‖_F` of the score matrices and the "
        "largest deviation `max |S_backpack − S_kronfluence| / max |S_kronfluence|`.",
        "",
        "| model | strategy | damping | relative error | largest deviation |",
        "|---|---|---|---|---|",
    ]
    cases = [(name, bias) for bias in (False, True) for name in ("mlp", "cnn", "gpt")]
    if "agreement" not in args.sections:
        cases = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, bias in cases:
            label = name + (" (biases)" if bias else "")
            for strategy in STRATEGIES:
                for damping in (None, 1e-3):
                    if strategy == "identity" and damping is not None:
                        continue
                    err, dev = compare(name, strategy, damping, n_acc, q_acc, batch, workdir, bias)
                    d = "0.1 × mean" if damping is None else f"{damping:g}"
                    row = f"| {label} | {strategy} | {d} | {err:.1e} | {dev:.1e} |"
                    print(row, flush=True)
                    lines.append(row)
        for bias in (False, True) if cases else ():
            for strategy in STRATEGIES:
                err, dev = compare_per_token(strategy, None, n_acc, q_acc, batch, workdir, bias)
                label = "gpt (per token" + (", biases)" if bias else ")")
                row = f"| {label} | {strategy} | 0.1 × mean | {err:.1e} | {dev:.1e} |"
                print(row, flush=True)
                lines.append(row)
        lines += [
            "",
            f"## Time and peak memory: fit + pairwise scores, {n_time} training × {q_time} query "
            f"examples, batches of {t_batch}",
            "",
            f"Median of {args.repeats} interleaved runs after a warm-up, "
            f"{'CPU time of the process' if args.clock == 'cpu' else 'wall time'}; ratio = "
            "median of the paired ratios backpack / kronfluence (< 1: backpack faster). "
            "Peak memory: extra CPU "
            "bytes allocated by torch at once (torch profiler), one run each.",
            "",
            "| model | strategy | backpack s | kronfluence s | time ratio | backpack peak MiB "
            "| kronfluence peak MiB | memory ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        rows = [(name, strategy) for name in ("mlp", "cnn") for strategy in STRATEGIES]
        if args.time_rows:
            rows = [tuple(row.split(":")) for row in args.time_rows]
        for name, strategy in rows if "time" in args.sections else ():
            r = timing(name, strategy, n_time, q_time, t_batch, args.repeats, workdir)
            row = (
                f"| {name} | {strategy} | {r['ours_s']:.3f} | {r['theirs_s']:.3f} | "
                f"{r['ratio']:.2f} | {r['ours_peak'] / 2**20:.1f} | "
                f"{r['theirs_peak'] / 2**20:.1f} | "
                f"{r['ours_peak'] / max(r['theirs_peak'], 1):.2f} |"
            )
            print(row, flush=True)
            lines.append(row)
    if "gpt" not in args.sections:
        return finish(lines, args.out)
    linear, total = coverage()
    p_full, seconds = gpt_full_ekfac(n_acc, batch)
    lines += [
        "",
        "## Tiny GPT: coverage",
        "",
        f"kronfluence tracks the `nn.Linear` weights only: {linear} of the {total} parameters "
        "(embedding, position embedding and LayerNorms are left out). The agreement rows above "
        "restrict backpack to the same weights (the other parameters frozen). backpack also fits "
        f"and scores every parameter: EK-FAC on all {p_full} parameters, {n_acc} training × 10 "
        f"query sequences, {seconds:.2f} s.",
    ]
    lines += [
        "",
        "## Tiny GPT: factored products against per-sample gradients",
        "",
        "`scores(query, train)` (factored forms where the cost model picks them, one parameter "
        "at a time) over `scores(..., factored=False)` (every per-sample gradient from "
        "`BatchGrad`), every parameter, 32 training sequences of 32 tokens, width 128, batches "
        "of 16, fit excluded; time: median of 5 paired ratios; same scores (checked, 1e-9).",
        "",
        "| strategy | queries | time ratio | peak-memory ratio |",
        "|---|---|---|---|",
    ]
    for strategy, n_query, t_ratio, m_ratio in factored_vs_dense():
        lines.append(f"| {strategy} | {n_query} | {t_ratio:.2f} | {m_ratio:.2f} |")
    return finish(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
