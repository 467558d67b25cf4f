"""The tour `python -m backpack`: runs in-process, checks every extension, fails loudly."""

import io
import runpy
import sys

import pytest
import torch

from backpack import tour


@pytest.fixture(autouse=True)
def _one_thread():
    """Timing runs oversubscribe the CPU when several test workers each use all cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _run(argv):
    stream = io.StringIO()
    code = tour.main(argv, stream=stream)
    return code, stream.getvalue()


def test_tour_passes_and_lists_everything():
    code, text = _run(["--batch-size", "8", "--repeats", "1"])
    assert code == 0, text
    assert "all checks passed" in text
    lines = text.splitlines()
    params = [name for name, _ in tour.MODELS[0].make_model().named_parameters()]
    assert params == ["1.weight", "1.bias", "3.weight", "3.bias"]
    for ext in tour.EXTENSIONS:
        for param in params:
            rows = [ln.split() for ln in lines if ln.split()[:2] == [param, ext.name]]
            assert len(rows) == 1, (param, ext.name)
            assert " ok" in " " + " ".join(rows[0])
    # shapes follow the batch size: grad_batch of the first weight is [8, 64, 784]
    assert any(ln.split()[:2] == ["1.weight", "BatchGrad"] and "[8, 64, 784]" in ln for ln in lines)
    assert "batch 8" in text


def test_tour_in_float64_is_tight():
    code, text = _run(["--batch-size", "4", "--repeats", "1", "--dtype", "float64", "--seed", "3"])
    assert code == 0, text
    assert "float64" in text


def test_reference_matches_its_definition():
    """The tour's brute-force reference sums to the full-batch gradient (mean reduction)."""
    torch.manual_seed(0)
    model = tour.mlp().double()
    x = torch.randn(5, 784, dtype=torch.float64)
    y = torch.randint(0, 10, (5,))
    ref = tour.Reference(model, torch.nn.CrossEntropyLoss(), x, y)
    psg = ref.per_sample_grads()
    torch.nn.CrossEntropyLoss()(model(x), y).backward()
    for name, p in model.named_parameters():
        assert psg[name].shape == (5, *p.shape)
        torch.testing.assert_close(psg[name].sum(0), p.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(
            tour._ref_variance(ref, name), psg[name].var(0, unbiased=False), rtol=1e-12, atol=0
        )


def test_tour_fails_with_exit_code_1_on_a_wrong_quantity(monkeypatch):
    wrong = tour.TourExtension(
        "BatchL2Grad",
        tour.BatchL2Grad,
        "batch_l2",
        lambda ref, name: 1.5 * tour._ref_batch_l2(ref, name),
    )
    monkeypatch.setattr(tour, "EXTENSIONS", [wrong])
    code, text = _run(["--batch-size", "4", "--repeats", "1"])
    assert code == 1
    assert "FAIL" in text and "all checks passed" not in text


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as info:
        tour.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--batch-size", "--seed", "--device", "--repeats", "--threads"):
        assert option in out


def test_module_entry_point_help(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m backpack", "--help"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("backpack", run_name="__main__")
    assert info.value.code == 0
    assert "--batch-size" in capsys.readouterr().out
