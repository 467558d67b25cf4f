"""`backpack.verify` and `python -m backpack verify`: passes on every problem of the shared table,
fails on a broken rule and on BatchNorm in train mode, names likely causes."""

import io
import runpy
import sys
import textwrap

import pytest
import torch
from problems import ALL_PROBLEMS, DEVICE
from torch import nn

import backpack
from backpack.extensions import KFLR, BatchGrad, DiagGGNExact
from backpack.rules.linear import LinearRule
from backpack.verification import main

DTYPE = torch.float64

TAG_EXTENSIONS = {
    "first": ["first"],
    "second": [
        "DiagGGNExact",
        "BatchDiagGGNExact",
        "SqrtGGNExact",
        "GGNMP",
        "DiagGGNMC",
        "BatchJacobian",
    ],
    "hessian": ["DiagHessian", "BatchDiagHessian", "HMP", "PCHMP"],
    "kron": ["KFAC", "KFLR", "KFRA"],
}


def _extensions_for(problem):
    names = []
    for tag, exts in TAG_EXTENSIONS.items():
        if tag in problem.tags:
            names.extend(exts)
    return ",".join(names)


#: branching models on which KFRA must refuse (it once skipped the branches' parameters)
KFRA_SILENT = {
    "custom-parallel-multiply-merge",
    "custom-parallel-cat-merge",
    "custom-active-identity",
}


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch's vmap
@pytest.mark.parametrize("problem", ALL_PROBLEMS, ids=[p.id for p in ALL_PROBLEMS])
def test_verify_passes_on_the_problem_table(problem):
    model, x, lossfunc, y = problem.build()
    extensions = _extensions_for(problem)
    if not extensions:
        pytest.skip("no extension applies")
    report = backpack.verify(model, lossfunc, x, y, extensions=extensions)
    assert report.ok, str(report)
    assert report.checked, str(report)  # something was compared against the reference
    # the arguments are left alone
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("problem_id", sorted(KFRA_SILENT))
def test_verify_passes_kfra_on_branching_models(problem_id):
    """KFRA refuses branching models instead of skipping the parameters in the branches."""
    problem = next(p for p in ALL_PROBLEMS if p.id == problem_id)
    model, x, lossfunc, y = problem.build()
    report = backpack.verify(model, lossfunc, x, y, extensions="KFRA")
    assert report.ok, str(report)
    assert report.rows[0].status == "n/a" and "chain" in report.rows[0].note, str(report)


def _cnn():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3),
        nn.ReLU(),
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(12, 4),
        nn.Sigmoid(),
        nn.Linear(4, 3),
    ).to(DTYPE)
    x, y = torch.randn(6, 1, 6, 6, dtype=DTYPE), torch.randint(0, 3, (6,))
    return model, nn.CrossEntropyLoss(), x, y


def test_verify_checks_kfra_on_convolutions_and_pooling():
    """KFRA's factors of every layer of a CNN are checked (they used to be 'unchecked')."""
    model, lossfunc, x, y = _cnn()
    report = backpack.verify(model, lossfunc, x, y, extensions="KFRA")
    (row,) = report.rows
    assert row.status == "ok" and not row.partial, str(report)
    assert report.complete and report.exit_code == 0


def test_verify_kfra_fails_on_wrong_convolution_factors(monkeypatch):
    from backpack.rules.conv import ConvRule

    original = ConvRule.kron_factors

    def broken(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        return {k: [1.01 * v[0], *v[1:]] for k, v in result.items()}

    monkeypatch.setattr(ConvRule, "kron_factors", broken)
    model, lossfunc, x, y = _cnn()
    report = backpack.verify(model, lossfunc, x, y, extensions="KFRA")
    assert report.rows[0].status == "FAIL", str(report)
    assert report.rows[0].error == pytest.approx(0.01, rel=1e-6)


class _FunctionalChain(nn.Module):
    """A chain KFRA accepts, but not a Sequential: no KFRA reference."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def test_verify_skips_kfra_it_cannot_check_without_computing_it(monkeypatch):
    from backpack import kfra

    computed = []
    for name in ("_matrix_sqrt", "_module_step", "_sandwich"):
        original = getattr(kfra, name)
        monkeypatch.setattr(
            kfra, name, lambda *a, _f=original, _n=name, **k: computed.append(_n) or _f(*a, **k)
        )
    torch.manual_seed(0)
    model = _FunctionalChain().to(DTYPE)
    x, y = torch.randn(6, 4, dtype=DTYPE), torch.randint(0, 2, (6,))
    report = backpack.verify(model, nn.CrossEntropyLoss(), x, y, extensions="BatchGrad,KFRA")
    row = report.rows[1]
    assert row.status == "unchecked", str(report)
    assert row.note == "skipped (not computed): the KFRA reference needs a Sequential model"
    assert computed == []  # no dense matrix was formed
    assert report.summary().startswith("INCOMPLETE") and report.exit_code == 3
    # outside verify, the same model gets its factors
    backpack.extend(model)
    with backpack.backpack(backpack.extensions.KFRA()):
        nn.CrossEntropyLoss()(model(x), y).backward()
    assert computed and model.first.weight.kfra[0].shape == (3, 3)


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DTYPE)
    x = torch.randn(12, 5, dtype=DTYPE)
    y = torch.randint(0, 3, (12,))
    return model.to(DEVICE), nn.CrossEntropyLoss(), x.to(DEVICE), y.to(DEVICE)


def test_verify_all_extensions_on_an_mlp_and_the_table():
    model, lossfunc, x, y = _mlp()
    report = backpack.verify(model, lossfunc, x, y)
    assert report.ok, str(report)
    assert report.samples == 8
    statuses = {row.extension: row.status for row in report.rows}
    assert len(statuses) == 20
    assert statuses["DiagGGNMC"] == statuses["SqrtGGNMC"] == "MC"
    assert statuses["BatchJacobian"] == "ok"
    assert statuses["KFLR"] == statuses["DiagHessian"] == statuses["PCHMP"] == "ok"
    text = str(report)
    assert text.splitlines()[1].split()[:4] == ["extension", "attribute", "status", "rel"]
    assert "OK: all 17 checked quantities match float64 autograd (3 Monte-Carlo)" in text
    # an unextended loss module is recognised: nothing to warn about
    assert "not extended" not in text and not report.notes and not report.causes
    assert report.complete and text.splitlines()[-1].startswith("OK: all 17")


def test_verify_fails_on_a_broken_rule(monkeypatch):
    original = LinearRule.per_sample_grads

    def broken(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        return {k: 1.001 * v for k, v in result.items()} if isinstance(result, dict) else result

    monkeypatch.setattr(LinearRule, "per_sample_grads", broken)
    model, lossfunc, x, y = _mlp()
    report = backpack.verify(model, lossfunc, x, y, extensions="BatchGrad")
    assert not report.ok
    (row,) = report.rows
    assert row.status == "FAIL" and row.error == pytest.approx(1e-3, rel=1e-3)
    assert str(report).rstrip().endswith("FAIL: 1 of 1 checked quantity wrong")


def test_verify_fails_on_a_broken_curvature_rule(monkeypatch):
    original = LinearRule.kron_factors

    def broken(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        return {k: [2 * v[0], *v[1:]] for k, v in result.items()}

    monkeypatch.setattr(LinearRule, "kron_factors", broken)
    model, lossfunc, x, y = _mlp()
    report = backpack.verify(model, lossfunc, x, y, extensions=[DiagGGNExact(), "KFLR"])
    assert [r.status for r in report.rows] == ["ok", "FAIL"], str(report)
    assert report.rows[1].error == pytest.approx(1.0)


def test_verify_fails_on_batchnorm_in_train_mode_and_says_why():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    report = backpack.verify(model, nn.CrossEntropyLoss(), x, y, extensions="first,DiagGGNExact")
    assert not report.ok
    rows = {r.extension: r for r in report.rows}
    assert rows["BatchGrad"].status == "FAIL"
    assert rows["DiagGGNExact"].status == "n/a"
    assert any("BatchNorm in train mode ('1')" in c for c in report.causes)
    assert "Likely causes:" in str(report)
    # the same model in eval mode passes
    assert backpack.verify(model.eval(), nn.CrossEntropyLoss(), x, y).ok


def test_verify_names_dropout_and_other_stochastic_layers():
    class Noise(nn.Module):
        def forward(self, x):
            return x + 0.1 * torch.randn_like(x)

    torch.manual_seed(0)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    dropout = nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.5), nn.Linear(4, 3))
    report = backpack.verify(dropout, nn.CrossEntropyLoss(), x, y, extensions="BatchGrad")
    assert not report.ok
    assert any("Dropout in train mode ('1')" in c for c in report.causes)
    noisy = nn.Sequential(nn.Linear(5, 4), Noise(), nn.Linear(4, 3))
    report = backpack.verify(noisy, nn.CrossEntropyLoss(), x, y, extensions="BatchGrad")
    assert any("stochastic" in c for c in report.causes)


def test_verify_names_parameters_outside_extended_modules():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    report = backpack.verify(Scaled(), nn.CrossEntropyLoss(), x, y, extensions="BatchGrad")
    assert any("scale" in c and "functional" in c for c in report.causes), report.causes


def test_verify_loss_that_is_not_a_module_and_unusual_reduction():
    model, _, x, y = _mlp()

    def lossfunc(out, target):
        return nn.functional.cross_entropy(out, target)

    report = backpack.verify(model, lossfunc, x, y, extensions="BatchGrad,DiagGGNExact")
    rows = {r.extension: r.status for r in report.rows}
    assert rows["BatchGrad"] == "ok"
    # functional cross-entropy is recognised from the graph
    assert rows["DiagGGNExact"] in ("ok", "n/a")
    report = backpack.verify(
        model, nn.CrossEntropyLoss(reduction="none"), x, y, extensions="BatchGrad"
    )
    assert not report.ok
    assert any("Unusual reduction 'none'" in c for c in report.causes)


def test_verify_coupled_loss_is_named():
    model, _, x, y = _mlp()

    def coupled(out, target):  # the batch mean's softmax: not a sum over samples
        return nn.functional.cross_entropy(out.mean(0, keepdim=True).expand_as(out), target)

    report = backpack.verify(model, coupled, x, y, extensions="BatchGrad")
    assert any("couples the samples" in c for c in report.causes)


def test_verify_arguments():
    model, lossfunc, x, y = _mlp()
    report = backpack.verify(model, lossfunc, x, y, extensions=[BatchGrad(), KFLR()], samples=3)
    assert report.samples == 3 and [r.extension for r in report.rows] == ["BatchGrad", "KFLR"]
    assert report.ok
    report = backpack.verify(model, lossfunc, x, y, extensions="BatchL2Grad", samples=1)
    assert report.summary().startswith("OK: the checked quantity matches")
    float32 = backpack.verify(model.float(), lossfunc, x.float(), y, dtype=torch.float32)
    assert float32.ok and float32.rows[0].tolerance == 1e-4
    with pytest.raises(ValueError, match="class BatchGrad instead"):
        backpack.verify(model, lossfunc, x, y, extensions=[BatchGrad])
    with pytest.raises(ValueError, match="unknown extension 'nope'"):
        backpack.verify(model, lossfunc, x, y, extensions="nope")
    with pytest.raises(ValueError, match="samples must be positive"):
        backpack.verify(model, lossfunc, x, y, samples=0)


FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn

    def good():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        return model, nn.CrossEntropyLoss(), torch.randn(6, 4), torch.randint(0, 2, (6,))

    def batchnorm_train():
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
        return model, nn.CrossEntropyLoss(), torch.randn(6, 4), torch.randint(0, 2, (6,))

    def embedding():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(6, 2))
        return model, nn.CrossEntropyLoss(), torch.randint(0, 5, (6, 2)), torch.randint(0, 2, (6,))

    class TwoBranches(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.a(x) + self.b(x)

    def branching():
        return TwoBranches(), nn.MSELoss(), torch.randn(6, 4), torch.randn(6, 3)
    """
)


def test_command_line(tmp_path, monkeypatch):
    (tmp_path / "my_problems.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = io.StringIO()
    assert main(["my_problems:good", "--extensions", "first,KFLR"], stream=out) == 0
    assert "OK: all 6 checked quantities" in out.getvalue()
    out = io.StringIO()
    assert main([f"{tmp_path / 'my_problems.py'}:batchnorm_train"], stream=out) == 1
    assert "BatchNorm in train mode" in out.getvalue()
    with pytest.raises(SystemExit) as info:
        main(["my_problems"])  # no function
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["my_problems:good", "--extensions", "Foo"])
    assert info.value.code == 2
    # INCOMPLETE has an exit status of its own: no Kronecker reference for the embedding
    out = io.StringIO()
    assert main(["my_problems:embedding", "--extensions", "BatchGrad,KFLR"], stream=out) == 3
    assert "INCOMPLETE" in out.getvalue()
    out = io.StringIO()  # NOTHING CHECKED: KFRA refuses the branching model
    assert main(["my_problems:branching", "--extensions", "KFRA"], stream=out) == 3
    assert "NOTHING CHECKED" in out.getvalue()


def test_command_line_help_lists_the_exit_statuses(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "exit status:" in text
    for line in ("0  OK:", "1  FAIL:", "2  bad arguments", "3  INCOMPLETE:"):
        assert line in text, line


def test_module_entry_point_dispatches_verify(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_problems2.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["python -m backpack", "verify", "my_problems2:good", "--extensions", "BatchGrad"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as info:
        runpy.run_module("backpack", run_name="__main__")
    assert info.value.code == 0
    assert "OK: the checked quantity matches" in capsys.readouterr().out


class _TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(self.embed(x)).mean(1))


def test_verify_checks_the_ggn_family_on_attention_models():
    """References run attention with the math kernel (the fused CPU kernels have no
    forward-mode derivative); what stays unchecked is said in the last line."""
    torch.manual_seed(0)
    model = _TinyTransformer().to(DTYPE).eval()
    x, y = torch.randint(0, 7, (6, 5)), torch.randint(0, 3, (6,))
    extensions = "DiagGGNExact,BatchDiagGGNExact,SqrtGGNExact,GGNMP,KFLR"
    report = backpack.verify(model, nn.CrossEntropyLoss(), x, y, extensions=extensions)
    rows = {r.extension: r for r in report.rows}
    for name in ("DiagGGNExact", "BatchDiagGGNExact", "SqrtGGNExact", "GGNMP"):
        assert rows[name].status == "ok", str(report)
    # no Kronecker reference for Embedding and MultiheadAttention: KFLR is checked in part
    assert rows["KFLR"].status == "ok" and rows["KFLR"].partial
    assert report.ok and not report.complete
    text = str(report)
    last = " ".join(text[text.rindex("INCOMPLETE") :].split())
    assert "NOT CHECKED: KFLR (some parameters)" in last
    assert not any(line.startswith("OK") for line in text.splitlines())
    assert "…" not in text.split("KFLR", 1)[1]  # the reasons are never cut


def test_verify_never_says_ok_when_a_quantity_is_unchecked(monkeypatch):
    from backpack import reference

    def broken(*args, **kwargs):
        raise RuntimeError("derivative not implemented. It is a long story; use a math kernel.")

    monkeypatch.setattr(reference.Reference, "diag_ggn_batch", broken)
    model, lossfunc, x, y = _mlp()
    report = backpack.verify(model, lossfunc, x, y, extensions="BatchGrad,DiagGGNExact")
    rows = {r.extension: r for r in report.rows}
    assert rows["DiagGGNExact"].status == "unchecked", str(report)
    assert "use a math kernel" in rows["DiagGGNExact"].note  # the advice is kept
    summary = report.summary()
    assert summary.startswith("INCOMPLETE") and "NOT CHECKED: DiagGGNExact" in summary


def test_verify_summary_when_nothing_was_checked():
    report = verify_report_with_rows([("KFRA", "n/a")])
    assert report.summary().startswith("NOTHING CHECKED")
    report = verify_report_with_rows([("BatchGrad", "ok"), ("KFAC", "unchecked")])
    assert report.summary().startswith("INCOMPLETE: 1 checked quantity matches")


def verify_report_with_rows(rows):
    from backpack.verification import VerifyRow

    return backpack.VerifyReport(rows=[VerifyRow(name, "x", status=st) for name, st in rows])


class _TupleOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x):
        out = self.linear(x)
        return out, out.detach()


def test_verify_refuses_tuple_outputs_clearly(tmp_path, monkeypatch):
    _, _, x, y = _mlp()
    model = _TupleOutput().to(DTYPE).to(DEVICE)
    with pytest.raises(ValueError, match=r"returns a tuple\. Wrap it"):
        backpack.verify(model, lambda out, t: nn.functional.cross_entropy(out[0], t), x, y)
    (tmp_path / "tuple_problems.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class Pair(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.linear = nn.Linear(4, 2)

                def forward(self, x):
                    return self.linear(x), x

            def make():
                return Pair(), nn.CrossEntropyLoss(), torch.randn(6, 4), torch.randint(0, 2, (6,))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = io.StringIO()
    assert main(["tuple_problems:make", "--extensions", "BatchGrad"], stream=out) == 2
    assert "returns a tuple" in out.getvalue()


def test_verify_function_loss_is_named_only_when_refused():
    model, _, x, y = _mlp()
    report = backpack.verify(
        model, nn.functional.cross_entropy, x, y, extensions="BatchGrad,DiagGGNExact"
    )
    assert report.ok and not report.causes, str(report)

    def custom(out, target):  # no loss backpack knows: second order refuses
        return (out.log_softmax(1).gather(1, target[:, None]) ** 2).mean()

    report = backpack.verify(model, custom, x, y, extensions="BatchGrad,DiagGGNExact")
    statuses = {r.extension: r.status for r in report.rows}
    assert statuses["BatchGrad"] == "ok"
    assert statuses["DiagGGNExact"] in ("n/a", "FAIL")
    assert any("F.cross_entropy" in c and "custom" in c for c in report.causes), report
