"""The peer comparisons (benchmarks/influence_vs_kronfluence.py, curvature_vs_peers.py).

The peers live in the benchmark environment only (`make install-bench`): without them the
scripts print a note and exit 0; their own problems build without the peers.
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import curvature_vs_peers as CV  # noqa: E402
from benchmarks import influence_vs_kronfluence as IK  # noqa: E402


@pytest.mark.parametrize("module", [IK, CV], ids=["influence", "curvature"])
def test_skips_cleanly_without_peers(module, capsys):
    if module.peers_available():
        pytest.skip("the peers are installed (benchmark environment): run the script itself")
    assert module.main(["--tiny"]) == 0
    assert "make install-bench" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_influence_problems_build_deterministically(name):
    a, b = IK.build(name, 6, 2), IK.build(name, 6, 2)
    for x, y in zip(a[1:], b[1:]):
        assert torch.equal(x, y)
    out = a[0](a[1])
    assert out.dtype == torch.float64 and out.shape[0] == 6


def test_kfac_positions():
    model, X, *_ = IK.build("cnn", 2, 1)
    assert [IK.positions(model, model[i], X) for i in (0, 2, 5)] == [196, 36, 1]
    model, X, *_ = IK.build("gpt", 2, 1)
    assert IK.positions(model, model.q, X) == X.shape[1]


def test_laplace_backends_tiny_run(capsys):
    """laplace-torch is a test dependency: the backend comparison runs, and every backend that
    fits gives LaplaceGGN's diagonal curvature (to float32 rounding) on the MLP."""
    from benchmarks import laplace_backends as LB

    if not LB.available():
        pytest.skip("laplace-torch is not installed")
    assert LB.main(["--tiny", "--repeats", "1", "--threads", "1"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()]
    diag = [r for r in rows if len(r) > 6 and r[1].strip() == "mlp" and r[2].strip() == "diag"]
    assert {r[3].strip() for r in diag} >= {"LaplaceGGN", "BackPackGGN"}
    for r in diag:
        if "failed" not in r[6]:
            assert float(r[6]) < 1e-5, r


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_kronfluence_options_fit_the_benchmark_problems(name):
    """The options the agreement rows use (`KRONFLUENCE`) fit the problems with biases, every
    strategy, and fold every bias (kronfluence's one block per module); the GPT is restricted
    to kronfluence's `nn.Linear` layers as in the script."""
    from backpack.influence import fit

    model, Xt, yt, Xq, yq = IK.build(name, 6, 2, bias=True)
    IK._tracked(name, model)
    train, query = IK.batches(Xt, yt, 3), IK.batches(Xq, yq, 2)
    for strategy in IK.STRATEGIES:
        influence = fit(model, torch.nn.CrossEntropyLoss(), train, strategy, **IK.KRONFLUENCE)
        assert torch.isfinite(influence.scores(query, train)).all()
        if strategy != "identity":
            assert all(b.bias is not None for b in influence.blocks)


def test_llm_scale_problem_and_one_process_run(capsys):
    """The LLM-scale benchmark's GPT has GPT-2 small's parameter count at full size; a tiny run
    of backpack's one-process row (a spawned process) reports time, memory and no error."""
    from benchmarks import influence_llm_scale as LS

    full = LS.GPT(**{k: LS.FULL[k] for k in ("vocab", "dim", "heads", "layers")}, context=1024)
    assert round(sum(p.numel() for p in full.parameters()) / 1e6) == 124
    del full
    assert LS.main(["--tiny", "--ranks", "1", "--without-kronfluence"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if "1 process |" in line][-1]
    seconds, peak = (float(c) for c in row.split("|")[2:4])
    assert seconds > 0 and peak >= 0
