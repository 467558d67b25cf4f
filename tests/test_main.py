"""The tour `python -m backpack`: runs in-process, checks every extension, fails loudly."""

import importlib.util
import io
import runpy
import sys

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from backpack import tour

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
TINY = ["--batch-size", "4", "--repeats", "1", "--train-steps", "2"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Timing runs oversubscribe the CPU when several test workers each use all cores."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _run(argv, stream=None):
    stream = io.StringIO() if stream is None else stream
    code = tour.main(argv, stream=stream)
    return code, stream.getvalue() if isinstance(stream, io.StringIO) else None


def _rows(text, model):
    """{extension: its line} from one model's table (continuation lines left out)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"── {model}:"))
    header = next(i for i in range(start, len(lines)) if lines[i].split()[:1] == ["extension"])
    rows = {}
    for line in lines[header + 1 :]:
        if not line.strip():
            break
        if not line.startswith("   "):
            rows[line.split()[0]] = line
    return rows


@pytest.mark.parametrize("model", [m.name for m in tour.MODELS])
def test_tour_passes_lists_every_extension_and_draws(model, tmp_path):
    png = tmp_path / "tour.png"
    argv = [*TINY, "--model", model, "--output", str(png)]
    code, text = _run(argv if HAS_MATPLOTLIB else [*argv, "--no-plot"])
    assert code == 0, text
    assert text.rstrip().splitlines()[-1].startswith("OK: all ")
    rows = _rows(text, model)
    assert set(rows) == {ext.name for ext in tour.EXTENSIONS}
    for name, line in rows.items():
        assert "FAIL" not in line, line
        if name == "KFRA" and model != "mlp":  # refused, with the reason
            assert "n/a: KFRA needs" in line
        else:
            assert line.split()[1] == next(e.savefield for e in tour.EXTENSIONS if e.name == name)
            assert line.rstrip().endswith("x"), line  # timed
    # shapes follow the batch size
    first = {"mlp": "[4, 64, 784]", "cnn": "[4, 8, 1, 3, 3]", "resnet": "[4, 4, 1, 3, 3]"}[model]
    assert first in rows["BatchGrad"]
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"Figure: {png}" in text
    else:
        assert not png.exists()


def test_tour_selects_extensions_and_checks_in_float64():
    code, text = _run([*TINY, "--model", "mlp", "--extensions", "first,KFLR", "--no-plot"])
    assert code == 0, text
    rows = list(_rows(text, "mlp"))
    assert rows == [
        "BatchGrad",
        "BatchL2Grad",
        "SumGradSquared",
        "Variance",
        "BatchDotGrad",
        "KFLR",
    ]
    code, text = _run(
        [*TINY, "--model", "cnn", "--extensions", "second", "--dtype", "float64", "--no-plot"]
    )
    assert code == 0, text
    errors = [_number(ln.split()[-2]) for ln in _rows(text, "cnn").values() if "n/a" not in ln]
    errors = [e for e in errors if e is not None]
    assert len(errors) == 11 and max(errors) < 1e-9  # 15, less 3 MC-only rows and KFRA (n/a)


def _number(token):
    try:
        return float(token)
    except ValueError:
        return None


def test_select_extensions():
    assert [e.name for e in tour.select_extensions("variance, batchgrad")] == [
        "BatchGrad",
        "Variance",
    ]
    assert len(tour.select_extensions("all")) == len(tour.EXTENSIONS) == 20
    assert {e.order for e in tour.select_extensions("second")} == {2}
    with pytest.raises(ValueError, match="unknown extension 'nope'"):
        tour.select_extensions("first,nope")
    with pytest.raises(SystemExit) as info:
        tour.main(["--extensions", "nope"])
    assert info.value.code == 2


def test_tour_fails_with_exit_code_1_on_a_wrong_quantity(monkeypatch):
    good = next(e for e in tour.EXTENSIONS if e.name == "DiagGGNExact")

    def wrong(ref, name, value, param):
        pairs = good.check(ref, name, value, param)
        return [tour.Pair(1.01 * p.result, p.expected) for p in pairs]

    monkeypatch.setattr(
        tour, "EXTENSIONS", [tour.TourExtension("DiagGGNExact", *_fields(good)[1:-1], wrong)]
    )
    code, text = _run([*TINY, "--model", "resnet", "--no-plot"])
    assert code == 1
    assert "FAIL" in text and "FAILED: resnet DiagGGNExact: rel err 1.0e-02" in text
    assert text.rstrip().splitlines()[-1].startswith("FAIL: 1 of 1 checked quantity is wrong")


def test_tour_reports_a_broken_check_as_failure_and_goes_on(monkeypatch):
    def broken(ref, name, value, param):
        raise RuntimeError("boom")

    ext = tour.EXTENSIONS[1]
    monkeypatch.setattr(
        tour, "EXTENSIONS", [tour.TourExtension(*_fields(ext)[:-1], broken), tour.EXTENSIONS[0]]
    )
    code, text = _run([*TINY, "--model", "mlp", "--no-plot"])
    assert code == 1
    assert "FAILED: mlp BatchL2Grad: check of 1.weight: RuntimeError: boom" in text
    assert "BatchGrad" in _rows(text, "mlp")


def _fields(ext):
    return (ext.name, ext.make, ext.savefield, ext.order, ext.reference, ext.check)


def test_tour_without_matplotlib_explains_how_to_get_the_figure(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    png = tmp_path / "tour.png"
    argv = [*TINY, "--model", "mlp", "--extensions", "BatchL2Grad", "--output", str(png)]
    code, text = _run(argv)
    assert code == 0, text
    assert "Get it with: pip install matplotlib" in text
    # the distribution is not on PyPI: a hint naming it could not work
    assert "backpack-torch[" not in text
    assert not png.exists()


def test_tour_output_is_plain_ascii_where_the_terminal_needs_it():
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    argv = [*TINY, "--model", "cnn", "--extensions", "KFLR,KFRA", "--no-plot", "--threads", "2"]
    code, _ = _run(argv, stream)
    assert torch.get_num_threads() == 1  # restored
    stream.flush()
    text = raw.getvalue().decode("ascii")
    assert code == 0, text
    assert "8x8 (x) 9x9" in text and "E[xx^T]" in text and "n/a: KFRA needs" in text


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        tour.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--model {mlp,cnn,resnet,all}",
        "--extensions",
        "--batch-size",
        "--device",
        "--output",
        "--repeats",
        "--seed",
        "--no-plot",
        "--train-steps",
        "--threads",
    ):
        assert option in out
    assert "KFRA" in out  # the list of extension names


def test_module_entry_point_help(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m backpack", "--help"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("backpack", run_name="__main__")
    assert info.value.code == 0
    assert "--batch-size" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# The tour's references against dense autograd matrices on a tiny model


class _Tiny(nn.Module):
    """Curved activation (tanh), so Hessian and GGN differ."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.cpu_only  # the tour's references live on the CPU
def test_reference_matches_dense_matrices():
    torch.manual_seed(0)
    model = _Tiny().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (5,))
    lossfunc = nn.CrossEntropyLoss()
    ref = tour.Reference(model, lossfunc, x, y)
    names = list(ref.params)
    sizes = [ref.params[k].numel() for k in names]
    flat = torch.cat([ref.params[k].flatten() for k in names])

    def unflat(vec):
        return {
            k: v.reshape(ref.params[k].shape) for k, v in zip(names, vec.split(sizes), strict=True)
        }

    def out(vec, xs=x):
        return functional_call(model, unflat(vec), (xs,))

    hess = hessian(lambda v: lossfunc(out(v), y))(flat)
    jac = jacrev(out)(flat)  # [N, C, P]
    probs = out(flat).softmax(1)
    h_out = (torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]) / 5
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, h_out, jac)
    per_sample_hess = [
        hessian(lambda v, n=n: lossfunc(out(v, x[n : n + 1]), y[n : n + 1]) / 5)(flat)
        for n in range(5)
    ]
    offset = 0
    for name, size in zip(names, sizes, strict=True):
        block = slice(offset, offset + size)
        offset += size
        idx = ref.entries(name)
        psg = ref.per_sample_grads()[name]
        torch.testing.assert_close(
            psg.sum(0),
            torch.func.grad(lambda v: lossfunc(out(v), y))(flat)[block].reshape(psg.shape[1:]),
        )
        torch.testing.assert_close(ref.diag_ggn_batch(name).sum(0), ggn[block, block].diag()[idx])
        torch.testing.assert_close(
            ref.diag_hessian_batch(name),
            torch.stack([h[block, block].diag()[idx] for h in per_sample_hess]),
        )
        dirs = ref.directions(name).flatten(1)
        torch.testing.assert_close(ref.ggn_products(name).flatten(1), dirs @ ggn[block, block].T)
        torch.testing.assert_close(
            ref.hessian_products(name).flatten(1), dirs @ hess[block, block].T
        )
    # KFLR's G is the bias block of the GGN, A the mean input outer product
    for module, inputs in (("a", x), ("b", torch.tanh(model.a(x)).detach())):
        bias = names.index(f"{module}.bias")
        start = sum(sizes[:bias])
        g_bias = ggn[start : start + sizes[bias], start : start + sizes[bias]]
        torch.testing.assert_close(ref.output_ggn(module), g_bias)
        torch.testing.assert_close(ref.input_moment(module), inputs.T @ inputs / 5)


@pytest.mark.cpu_only  # the tour's references live on the CPU
def test_kfra_reference_follows_the_recursion():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Sigmoid(), nn.Linear(4, 2)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (6,))
    ref = tour.Reference(model, nn.CrossEntropyLoss(), x, y)
    factors = ref.kfra_output_factors()
    probs = model(x).detach().softmax(1)
    gbar = (torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]).sum(0) / 6
    s = torch.sigmoid(model[0](x)).detach()
    d = s * (1 - s)
    w = model[2].weight.detach()
    g0 = sum(torch.diag(d[n]) @ w.T @ gbar @ w @ torch.diag(d[n]) for n in range(6)) / 6
    torch.testing.assert_close(factors["2"], gbar)
    torch.testing.assert_close(factors["0"], g0)


# ------------------------------------------------------------------------------------------------
# Command-line rough edges


def test_unknown_extension_is_named_as_typed(capsys):
    with pytest.raises(SystemExit) as info:
        tour.main(["--extensions", "BatchGrad,Foo"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown extension 'Foo'" in err and "'foo'" not in err


def test_batch_size_one_says_why(capsys):
    with pytest.raises(SystemExit) as info:
        tour.main(["--batch-size", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size must be at least 2, got 1: with one sample" in err


def test_output_in_a_missing_folder_is_refused_and_not_created(tmp_path, capsys):
    target = tmp_path / "nonexistent" / "dir" / "x.png"
    with pytest.raises(SystemExit) as info:
        tour.main([*TINY, "--output", str(target)])
    assert info.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nonexistent").exists()
    # --no-plot does not care where the figure would have gone
    code, _ = _run([*TINY, "--model", "mlp", "--extensions", "BatchL2Grad", "--no-plot",
                    "--output", str(target)])
    assert code == 0
    assert not (tmp_path / "nonexistent").exists()


def test_one_checked_quantity_in_the_singular():
    code, text = _run([*TINY, "--model", "mlp", "--extensions", "BatchL2Grad", "--no-plot"])
    assert code == 0
    assert text.rstrip().splitlines()[-1].startswith("OK: the checked quantity matches")


def test_help_mentions_verify(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m backpack", "--help"])
    with pytest.raises(SystemExit):
        runpy.run_module("backpack", run_name="__main__")
    text = capsys.readouterr().out
    out = " ".join(text.split())
    assert "python -m backpack verify MODULE:FACTORY" in out
    # the usage line names both commands
    usage = text[: text.index("\n\n")]
    assert usage.startswith("usage: python -m backpack [-h]")
    assert "\n       python -m backpack verify [-h] [options] FACTORY" in usage


def test_not_applicable_rows_keep_their_advice():
    argv = [*TINY, "--model", "cnn,resnet", "--extensions", "KFRA", "--no-plot"]
    argv[argv.index("cnn,resnet")] = "cnn"
    code, text = _run(argv)
    assert code == 0, text
    row = text[text.index("n/a: KFRA needs") :]
    row = " ".join(row[: row.index("\n\n")].split())
    assert "use KFLR or KFAC" in row and "…" not in row and "..." not in row


def test_first_sentence_keeps_the_advice():
    message = (
        "KFRA needs the model to be a chain of modules; the graph branches into Conv2d. "
        "Use KFLR or KFAC for branching models."
    )
    assert tour._first_sentence(message) == (
        "KFRA needs the model to be a chain of modules; use KFLR or KFAC for branching models"
    )
    assert tour._first_sentence("X cannot handle Y. Supported are Z.") == "X cannot handle Y"


def test_a_run_that_checked_nothing_does_not_say_ok(monkeypatch):
    backward = tour._backward

    def refuse(model, lossfunc, x, y, exts):
        if exts:
            raise NotImplementedError("not for this model. Use another one.")
        return backward(model, lossfunc, x, y, exts)

    monkeypatch.setattr(tour, "_backward", refuse)
    code, text = _run([*TINY, "--model", "mlp", "--extensions", "BatchL2Grad", "--no-plot"])
    last = text.rstrip().splitlines()[-1]
    assert code == 0
    assert last.startswith("NOTHING CHECKED") and "OK" not in last
