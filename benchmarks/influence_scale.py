"""What the scale options of `backpack.influence` cost in accuracy: query rank and storage dtypes.

    python -m benchmarks.influence_scale [--out FILE]

Float64 throughout; the models are trained briefly (Adam) on random data so that their gradients
are those of a fitted model, not of an initialisation. Two models: an MLP (64-128-128-10, with
biases) and a small GPT (vocabulary 64, 16 tokens, width 32, 4 heads, MLP width 128, with
biases), both with kronfluence's options (`separate_weight_and_bias=False`: one block per
layer, as kronfluence's modules).

- **Query rank.** `‖S_r − S‖_F / ‖S‖_F` of the scores with the preconditioned query gradients at
  rank r against the full ones, for `scores(..., query_rank=r)` (each weight matrix truncated,
  biases exact: in the fit's Kronecker norm of the training gradients, the default
  `query_rank_norm="fisher"`, or by an exact SVD, `"frobenius"`) and for kronfluence's query
  compression as its documentation describes it (each module's `[W | b]` truncated jointly,
  with its default randomized `torch.svd_lowrank` and with its `use_full_svd=True`), emulated
  here with torch.
- **Storage dtypes.** The fit saved in float32, bfloat16 or float16 and loaded back (computed
  in float64 again), and the scores stored in those dtypes: largest deviation relative to the
  largest score.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from backpack.influence import fit, load
from backpack.influence._lowrank import LowRank, compress
from benchmarks.influence_vs_kronfluence import TinyGPT, batches

RANKS = (1, 2, 4, 8, 16, 32)


def _trained(name: str) -> tuple[nn.Module, nn.Module, list, list]:
    """`(model, lossfunc, train batches, query batches)`, trained for 150 Adam steps."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    n_train, n_query = 256, 16
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)
        ).double()
        X = torch.randn(n_train + n_query, 64, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (n_train + n_query,), generator=gen)
    else:
        model = TinyGPT(vocab=64, context=16, dim=32, heads=4, bias=True).double()
        tokens = torch.randint(0, 64, (n_train + n_query, 17), generator=gen)
        X, y = tokens[:, :-1], tokens[:, 1:]
    lossfunc = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(150):
        i = (step * 32) % n_train
        opt.zero_grad()
        lossfunc(model(X[i : i + 32]), y[i : i + 32]).backward()
        opt.step()
    train = batches(X[:n_train], y[:n_train], 32)
    query = batches(X[n_train:], y[n_train:], n_query)
    return model, lossfunc, train, query


def _rows(influence, data) -> dict[str, Tensor]:
    out: dict[str, list[Tensor]] = {}
    for rows in influence.gradients(data):
        for name, value in rows.items():
            out.setdefault(name, []).append(value)
    return {name: torch.cat(v) for name, v in out.items()}


def _dense(value: Tensor | LowRank) -> Tensor:
    if isinstance(value, LowRank):
        return value.matrices().flatten(1)
    return value


def _joint(M: dict[str, Tensor], shapes: dict, rank: int, full_svd: bool) -> dict[str, Tensor]:
    """kronfluence-like: each layer's `[W | b]` truncated to rank `rank` together."""
    out = dict(M)
    for name, shape in shapes.items():
        if len(shape) < 2:
            continue
        q = M[name].shape[0]
        W = M[name].reshape(q, shape[0], -1)
        bias = name[: -len("weight")] + "bias" if name.endswith("weight") else None
        cols = [W] + ([M[bias][..., None]] if bias in M else [])
        J = torch.cat(cols, dim=2)
        if min(J.shape[1:]) <= rank:
            continue
        if full_svd:
            U, S, Vh = torch.linalg.svd(J, full_matrices=False)
            U, S, V = U[..., :rank], S[..., :rank], Vh[:, :rank].transpose(1, 2)
        else:
            torch.manual_seed(0)
            parts = [torch.svd_lowrank(J[i], q=rank) for i in range(q)]
            U = torch.stack([p[0] for p in parts])
            S = torch.stack([p[1] for p in parts])
            V = torch.stack([p[2] for p in parts])
        R = (U * S[:, None]) @ V.transpose(1, 2)
        out[name] = R[..., : W.shape[2]].reshape(q, -1)
        if bias in M:
            out[bias] = R[..., -1]
    return out


def rank_rows(name: str, strategy: str) -> list[str]:
    model, lossfunc, train, query = _trained(name)
    influence = fit(
        model, lossfunc, train, strategy, fisher="empirical", separate_weight_and_bias=False
    )
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    G = _rows(influence, train)
    M = influence.precondition(
        {n: v.reshape(v.shape[0], *shapes[n]) for n, v in _rows(influence, query).items()}
    )
    names = list(shapes)

    def scores(rows: dict[str, Tensor]) -> Tensor:
        return sum(rows[n] @ G[n].flatten(1).T for n in names)

    exact = scores(M)
    check = influence.scores(query, train)
    assert float((check - exact).abs().max() / exact.abs().max()) < 1e-10
    errors = influence.query_rank_error(query, train, RANKS)
    weights = influence._rank_weights(shapes)
    out = []

    def error(r: int, norm: str) -> float:
        w = weights if norm == "fisher" else {}
        low = scores({n: _dense(compress(M[n], shapes[n], r, w.get(n))) for n in names})
        return float((low - exact).norm() / exact.norm())

    for r in RANKS:
        fisher = error(r, "fisher")
        assert abs(fisher - errors[r]) <= 1e-9 + 1e-6 * fisher
        kf_random = scores(_joint(M, shapes, r, False))
        kf_full = scores(_joint(M, shapes, r, True))
        out.append(
            f"| {name} | {strategy} | {r} | {fisher:.2e} | {error(r, 'frobenius'):.2e} | "
            f"{float((kf_random - exact).norm() / exact.norm()):.2e} | "
            f"{float((kf_full - exact).norm() / exact.norm()):.2e} |"
        )
    for norm in ("fisher", "frobenius"):
        needed = []
        for bound in (0.01, 0.05, 0.1):
            r = next((r for r in range(1, 129) if error(r, norm) <= bound), None)
            needed.append(f"{r} for {bound:.0%}")
        out.append(f"| {name} | {strategy} | rank needed ({norm}): {', '.join(needed)} | | | | |")
    return out


def dtype_rows(name: str, strategy: str) -> list[str]:
    model, lossfunc, train, query = _trained(name)
    influence = fit(model, lossfunc, train, strategy, fisher="empirical")
    exact = influence.scores(query, train)
    top = float(exact.abs().max())
    cells = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "fit.pt"
            try:
                influence.save(path, dtype=dtype)
                got = load(path, model, lossfunc).scores(query, train)
                fit_cell = f"{float((got - exact).abs().max()) / top:.1e}"
            except ValueError:
                fit_cell = "refused"
        try:
            stored = influence.scores(query, train, dtype=dtype).double()
            score_cell = f"{float((stored - exact).abs().max()) / top:.1e}"
        except ValueError:
            score_cell = "refused"
        cells += [fit_cell, score_cell]
    return [f"| {name} | {strategy} | " + " | ".join(cells) + " |"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        "# Influence at scale: query rank and storage dtypes (CPU, float64)",
        "",
        "`python -m benchmarks.influence_scale` (see its docstring). 256 training and 16 query "
        "examples.",
        "",
        "## Query rank: relative error of the scores, ‖S_r − S‖_F / ‖S‖_F",
        "",
        "| model | strategy | rank | backpack, fisher norm (default) | backpack, frobenius "
        "| kronfluence-like, randomized SVD | kronfluence-like, full SVD |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("mlp", "gpt"):
        for strategy in ("identity", "kfac", "ekfac"):
            lines += rank_rows(name, strategy)
            print("\n".join(lines[-len(RANKS) - 2 :]), flush=True)
    lines += [
        "",
        "## Storage dtypes: largest deviation / largest score (against float64)",
        "",
        "| model | strategy | fit f32 | scores f32 | fit bf16 | scores bf16 | fit f16 "
        "| scores f16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("mlp", "gpt"):
        for strategy in ("diagonal", "kfac", "ekfac"):
            lines += dtype_rows(name, strategy)
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
