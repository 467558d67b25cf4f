"""Smoke test of benchmarks/jacobians.py on tiny sizes: a complete, well-formed table (no timing
assertions)."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import jacobians as J  # noqa: E402


def test_tiny_run_writes_a_complete_table(tmp_path, capsys):
    threads = torch.get_num_threads()
    target = tmp_path / "report.md"
    try:
        report = J.main(["--tiny", "--rounds", "1", "--reps", "1", "--output", str(target)])
    finally:
        torch.set_num_threads(threads)
    assert target.read_text() == report
    assert report in capsys.readouterr().out
    rows = [line for line in report.splitlines() if line.startswith("| ") and "ms" in line]
    assert [r.split("|")[1].strip() for r in rows] == list(J.MODELS)
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 9
        assert all(c.endswith(" ms") for c in cells[3:7])
        assert float(cells[7]) > 0 and cells[8] in ("✓", "✗")


def test_both_ways_give_the_same_jacobians():
    torch.manual_seed(0)
    for make in J.MODELS.values():
        model, x = make(True)
        J.extend(model)
        expected = J.c_passes(model, x)
        assert expected.shape == (x.shape[0], J.C, sum(p.numel() for p in model.parameters()))
        torch.testing.assert_close(J.one_backward(model, x), expected, rtol=1e-5, atol=1e-6)
