"""Smoke test of the benchmark code (benchmarks/): every problem and row once, on tiny sizes.

No timing assertions: only that the runner produces a complete, well-formed table and JSON, and
that the memory accounting measures a known allocation correctly.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import problems as P  # noqa: E402
from benchmarks import run as R  # noqa: E402

STATUSES = {"ok", "refused", "error", "capped", "skipped", "n/a"}
CELL = re.compile(r"^(\d+\.\d\dx( [✓✗~])?|(refused|error|skipped): .+|capped: .+|—)$")


def _table_rows(markdown: str, title: str) -> dict[str, list[str]]:
    section = markdown.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_peak_memory_of_a_known_allocation():
    def step():
        a = torch.empty(1 << 20, device="cpu")  # 4 MiB
        del a
        b = torch.empty(1 << 18, device="cpu")  # 1 MiB, freed at the end
        return b.sum()

    peak = R.peak_extra_bytes(step, torch.device("cpu"))
    assert 4 * 2**20 <= peak < 5 * 2**20


def test_problems_build_deterministically():
    for name in P.PROBLEMS:
        m1, x1, y1, _ = P.build(name, tiny=True)
        m2, x2, y2, _ = P.build(name, tiny=True)
        torch.testing.assert_close(x1, x2, rtol=0, atol=0)
        assert torch.equal(y1, y2)
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(p1, p2, rtol=0, atol=0)
        with torch.no_grad():
            out = m1(x1)
        if name.startswith("gpt"):  # next-token logits [N, vocab, T] for targets [N, T]
            assert out.shape == (x1.shape[0], m1.tok.num_embeddings, x1.shape[1])
            assert y1.shape == x1.shape
        else:
            assert out.shape == (x1.shape[0], 10)


def test_gpu_size_problems_only_named_or_on_cuda():
    gpu = [name for name, p in P.PROBLEMS.items() if p.gpu_size]
    assert sorted(gpu) == ["gpt_long", "resnet18"]
    model, x, y, _ = P.build("resnet18", tiny=True)
    assert not model.training  # BatchNorm in eval mode: per-sample quantities are defined
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 1 + 16 + 3  # stem, 8 blocks of 2, 3 projection shortcuts


def test_full_size_shapes_of_3c3d():
    model, x, _, _ = P.build("3c3d")
    assert tuple(x.shape) == (64, 3, 32, 32)
    convs = [m for m in model if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 96, 128]
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [
        (1152, 512),
        (512, 256),
        (256, 10),
    ]


def _run_tiny(tmp_path, capsys, problems, rows):
    out = tmp_path / "out"
    argv = ["--tiny", "--in-process", "--threads", "1", "--case-budget", "0", "--out", str(out)]
    code = R.main([*argv, "--problems", *problems, "--extensions", *rows])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    markdown = (out / "results.md").read_text()
    assert markdown in capsys.readouterr().out
    return results, markdown


def _check(results, markdown, problems, rows):
    assert list(results["problems"]) == problems
    # tiny sizes: targets are not judged, and descriptions do not claim the full sizes
    assert "## Targets" not in markdown and "✗" not in markdown
    assert "Targets are not judged in tiny mode" in markdown
    for name, problem in results["problems"].items():
        assert "error" not in problem, problem.get("error")
        assert "verdicts" not in problem
        assert problem["description"].startswith("tiny version (shrunk sizes) of: ")
        assert set(problem["cases"]) == set(rows)
        for row, case in problem["cases"].items():
            assert case["status"] in STATUSES, (name, row)
            if case["status"] == "ok":
                assert case["ratio"] > 0 and case["repeats"] >= 1
                assert isinstance(case["peak_bytes"], int)
            elif case["status"] in ("refused", "error"):
                assert case["reason"], (name, row)
    ratios = _table_rows(markdown, "Ratio to plain forward + backward")
    memory = _table_rows(markdown, "Extra peak memory")
    for row in rows:
        assert len(ratios[row]) == len(problems)
        assert len(memory[row]) == len(problems)
        if row not in (P.OPACUS, P.OPACUS_NORMS):  # "—" when Opacus is not installed
            for cell in ratios[row]:
                assert CELL.match(cell), (row, cell)


SOME_ROWS = [P.NO_EXTENSION, "BatchGrad", "Variance", "DiagGGNExact", "KFLR", P.TORCH_FUNC]


def test_tiny_run_every_problem(tmp_path, capsys):
    problems = list(P.PROBLEMS)
    results, markdown = _run_tiny(tmp_path, capsys, problems, SOME_ROWS)
    _check(results, markdown, problems, SOME_ROWS)


def test_tiny_run_every_row(tmp_path, capsys):
    rows = list(P.EXTENSION_ROWS + P.BASELINE_ROWS)
    results, markdown = _run_tiny(tmp_path, capsys, ["mlp_big"], rows)
    _check(results, markdown, ["mlp_big"], rows)


def test_tiny_run_gpt_every_row(tmp_path, capsys):
    rows = list(P.EXTENSION_ROWS + P.BASELINE_ROWS)
    results, markdown = _run_tiny(tmp_path, capsys, ["gpt"], rows)
    _check(results, markdown, ["gpt"], rows)
    cases = results["problems"]["gpt"]["cases"]
    for row in ("BatchGrad", "BatchL2Grad", "DiagGGNMC", "KFAC", P.TORCH_FUNC):
        assert cases[row]["status"] == "ok", (row, cases[row]["reason"])
    # attention and layer norms have no exact Hessian rule: refused, not wrong numbers
    assert cases["DiagHessian"]["status"] == "refused"
    if results["meta"]["opacus"] is not None:
        assert cases[P.OPACUS]["status"] == "ok", cases[P.OPACUS]["reason"]
        assert "model adapted for Opacus" in cases[P.OPACUS]["note"]


def test_gpt_variant_for_opacus_keeps_the_parameters():
    model, x, _, _ = P.build("gpt", tiny=True)
    for ghost in (False, True):
        copy, note = model.for_opacus(ghost)
        assert copy is not model and not copy.causal and copy.positions_per_sample
        assert (copy.head.weight is copy.tok.weight) is not ghost
        assert ("untied" in note) is ghost
        with torch.no_grad():
            assert copy(x).shape == model(x).shape
    assert model.causal and model.head.weight is model.tok.weight


def test_allocation_failures_are_reported_in_gib():
    err = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 68719476736 bytes. Error code 12"
    )
    assert R._short_error(err) == "out of memory: one allocation of 64.0 GiB failed"


@pytest.mark.parametrize("row", ["BatchGrad"])
def test_worker_process(tmp_path, row):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.run", "--tiny", "--threads", "1", "--case-budget", "0"]
    cmd += ["--problems", "mlp", "--extensions", row, "none", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    cases = results["problems"]["mlp"]["cases"]
    assert set(cases) == {row, P.NO_EXTENSION}
    assert cases[row]["status"] == "ok"
    # at the end of the step, .grad and the [N, *param] float32 per-sample gradients are alive
    model, x, _, _ = P.build("mlp", tiny=True)
    params = sum(p.numel() for p in model.parameters())
    assert cases[row]["peak_bytes"] >= (x.shape[0] + 1) * params * 4
    assert cases[row]["extra_peak_bytes"] > 0
    assert f"| {row} |" in proc.stdout


def test_targets_are_judged():
    ok = {"status": "ok", "ratio": 1.2, "first_run_seconds": 0.1}
    assert R.judge("BatchL2Grad", "3c3d", ok, None)["met"] is True
    assert R.judge("BatchL2Grad", "3c3d", {**ok, "ratio": 2.0}, None)["met"] is False
    assert R.judge("BatchGrad", "mlp", ok, 1.1)["met"] is False
    # output-bound mlp_big: within 10% of writing the result once (and at most torch.func)
    assert R.judge("BatchGrad", "mlp_big", {**ok, "ratio": 10.5}, 20.0, 10.0)["met"] is True
    assert R.judge("BatchGrad", "mlp_big", {**ok, "ratio": 11.5}, 20.0, 10.0)["met"] is False
    assert R.judge("DiagGGNExact", "3c3d", {**ok, "ratio": 5.0}, None)["met"] is None
    # the transformer problem: its own targets, including beating Opacus's same quantity
    assert R.judge("BatchL2Grad", "gpt", {**ok, "ratio": 1.4}, None)["met"] is True
    assert R.judge("BatchL2Grad", "gpt", {**ok, "ratio": 1.4}, None, None, 5.0, 1.3)["met"] is False
    assert R.judge("BatchGrad", "gpt", {**ok, "ratio": 3.0}, 4.0, None, 2.0)["met"] is False
    assert R.judge("KFAC", "gpt", {**ok, "ratio": 2.9}, None)["met"] is True
    assert R.judge("DiagGGNMC", "gpt", {**ok, "ratio": 3.1}, None)["met"] is False
    assert R.judge("Variance", "gpt", ok, None) is None
    refused = {"status": "refused", "ratio": None, "first_run_seconds": 0.01, "reason": "x"}
    assert R.judge("KFRA", "3c3d", refused, None)["met"] is True
    assert R.judge("SqrtGGNMC", "mlp", ok, None) is None


def test_help_gives_every_default(capsys):
    with pytest.raises(SystemExit):
        R.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("(default: all)", "(default: cpu)", "(default: 2)", "(default: bench-results)",
                 "(default: 3, or 0.5 with --quick/--tiny)", "(default: 840)"):
        assert text in out, text


def test_distributed_table_renders():
    """The `--distributed` mode's table (the processes themselves: the slow test below)."""
    from benchmarks import distributed as D

    row = {
        "ddp_ms": 2.0,
        "local_ms": 3.0,
        "global_ms": 4.0,
        "extra_ms": 1.0,
        "sync_ms": 0.9,
        "reduced_bytes": 2_000_000,
        "repeats": 5,
    }
    results = {"mlp": {"SumGradSquared": row, "KFLR": {"error": "RuntimeError: boom"}}}
    meta = {"world": 2, "backend": "gloo", "torch": "x", "threads": 1, "tiny": True}
    table = D.render(results, meta)
    assert "| mlp | SumGradSquared | 2.00 ms | 1.50x | 1.00 ms | 50% | 0.90 ms | 2.00 MB |" in table
    assert "error: RuntimeError: boom" in table
    args = R.build_parser().parse_args(["--distributed", "2", "--tiny"])
    assert args.distributed == 2


@pytest.mark.slow
def test_distributed_mode_runs(tmp_path):
    code = R.main(
        ["--distributed", "2", "--tiny", "--problems", "mlp", "--extensions", "Variance",
         "--out", str(tmp_path)]
    )
    assert code == 0
    data = json.loads((tmp_path / "distributed.json").read_text())
    row = data["results"]["mlp"]["Variance"]
    assert "error" not in row and row["reduced_bytes"] > 0


def test_gpu_models_tiny_run_writes_every_row(tmp_path):
    """`benchmarks.gpu_models --tiny` on the CPU: every row of GPT-2 measured or its failure
    reported (Opacus may be absent), and the tables written."""
    from benchmarks import gpu_models

    out = tmp_path / "gpu.md"
    results = gpu_models.main(
        ["--tiny", "--models", "gpt2", "--rounds", "1", "--device", "cpu", "--out", str(out)]
    )
    rows = results["gpt2"]
    for row in ("hooks only", "BatchGrad", "BatchL2Grad", "Variance", "DiagGGNMC",
                "KFAC, embeddings frozen", "torch.func"):
        assert rows[row]["ratio"] > 0 and rows[row]["memory"] > 0, row
    text = out.read_text()
    assert "| BatchL2Grad |" in text and "plain, embeddings frozen step (ms)" in text
