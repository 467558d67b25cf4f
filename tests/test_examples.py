"""Run every script in examples/ with small settings; each asserts its own result.

The scripts compare backpack's quantities with independent brute-force computations (loops over
samples, autograd Hessians, dense Kronecker solves) and raise AssertionError on disagreement.
"""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"backpack_examples_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = {
    "example_first_order": ["--batch-size", "6", "--hidden", "5"],
    "example_diag_ggn_resnet": ["--batch-size", "3", "--channels", "2", "--entries", "4"],
    "example_per_sample_clipping": ["--batch-size", "6", "--hidden", "5", "--steps", "2"],
    "example_kfac_optimizer": ["--batch-size", "8", "--hidden", "4"],
    "example_diag_laplace": ["--batch-size", "16", "--hidden", "4", "--train-steps", "3"],
    "example_gradient_snr": ["--batch-size", "5", "--channels", "2"],
    "example_influence_digits": [
        "--train",
        "40",
        "--test",
        "2",
        "--hidden",
        "4",
        "--train-steps",
        "5",
        "--batch-size",
        "16",
    ],
    "example_influence_gpt": [
        "--context",
        "20",
        "--stride",
        "30",
        "--dim",
        "4",
        "--train-steps",
        "3",
        "--batch-size",
        "4",
    ],
    "example_laplace_digits": [
        "--train-size",
        "32",
        "--batch-size",
        "16",
        "--channels",
        "2",
        "--train-steps",
        "2",
        "--track-every",
        "2",
        "--probes",
        "2",
        "--lanczos-steps",
        "8",
        "--no-figure",
    ],
    # relaunches itself with torchrun --nproc_per_node=2 (gloo on the CPU)
    "example_distributed": ["--steps", "2", "--batch-size", "4", "--hidden", "4"],
    "example_gpt_dp_clipping": [
        "--batch-size",
        "4",
        "--context",
        "8",
        "--dim",
        "8",
        "--blocks",
        "1",
        "--steps",
        "2",
    ],
    "example_lora_gpt2": ["--batch-size", "3", "--context", "6", "--dim", "16", "--layers", "1"],
    "example_laplace_backend": [
        "--train-size", "32", "--test-size", "16", "--batch-size", "16", "--channels", "2",
        "--steps", "3", "--snippets", "9", "--context", "5", "--dim", "8", "--rank", "2",
    ],
    "example_gpt_curvature": [
        "--batch-size",
        "4",
        "--context",
        "8",
        "--dim",
        "8",
        "--blocks",
        "1",
        "--steps",
        "2",
        "--lrs",
        "0.1",
    ],
}


#: examples that need an optional package (skipped without it)
NEEDS = {"example_laplace_backend": "laplace"}


def test_every_example_is_covered():
    scripts = {p.stem for p in EXAMPLES.glob("example_*.py")}
    assert scripts == set(SMALL)


# example_lora_gpt2: torch's vmap notices for the fused attention kernel, transformers' own
# deprecation notice
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", sorted(SMALL))
def test_example_runs_and_checks_itself(name, capsys):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    result = load(name).main(SMALL[name])
    assert result is not None
    assert capsys.readouterr().out.strip()


def test_first_order_reduction_sum():
    results = load("example_first_order").main(
        ["--batch-size", "4", "--hidden", "3", "--reduction", "sum"]
    )
    assert results["0.weight"]["grad_batch"].shape == (4, 3, 784)


def test_clipping_bounds_every_sample():
    module = load("example_per_sample_clipping")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    # a clipping threshold far below the norms: every clipped gradient has norm max_norm
    sums, norms = module.loop_clipped_gradient_sum(model, X, y, max_norm=1e-3)
    assert (norms > 1e-3).all()
    total = torch.cat([s.flatten() for s in sums]).norm()
    assert total <= 5 * 1e-3 * (1 + 1e-4)


def test_laplace_variances_are_bounded_by_the_prior():
    result = load("example_diag_laplace").main(
        SMALL["example_diag_laplace"] + ["--prior-precision", "4", "--no-tuning"]
    )
    assert result["prior_precision"] == 4
    for variance in result["variances"].values():
        assert (variance > 0).all() and (variance <= 1 / 4 + 1e-7).all()
    assert math.isfinite(result["laplace"]["nll"])


def test_laplace_tunes_the_prior_on_validation_digits_and_says_so(capsys):
    result = load("example_diag_laplace").main(SMALL["example_diag_laplace"])
    out = capsys.readouterr().out
    tau = result["prior_precision"]
    assert any(math.isclose(tau, 10.0 ** (k / 2)) for k in range(-2, 13))
    assert "validation digits" in out and f"-> τ={tau:.3g}: validation NLL" in out
    assert isinstance(result["laplace_effect"], bool)
    for variance in result["variances"].values():
        assert (variance <= 1 / tau + 1e-7).all()
    # the comparison with MAP is explained either way
    assert "-> " in out and "test NLL" in out
    # the posterior of the training prior comes first, then the tuned one
    assert out.index("posterior at the training prior") < out.index("posterior at the tuned")


def test_laplace_posterior_of_the_training_prior_shrinks_where_the_data_dominate(capsys):
    """The default MAP network: the data pin down many parameters (it used to show none)."""
    result = load("example_diag_laplace").main(["--train-steps", "200"])
    out = capsys.readouterr().out
    assert result["shrunk_at_training_prior"] > 0.2, out
    assert "the data shrink" in out
    if result["prior_precision"] > 0.5:  # tuned far above the GGN: the script says why
        assert "why the tuned τ outweighs every GGN entry" in out


@pytest.mark.slow
def test_laplace_default_settings_show_a_laplace_effect(capsys):
    """The default run tunes τ inside its grid (not onto MAP) and checks that itself."""
    result = load("example_diag_laplace").main([])
    assert result["laplace_effect"]
    assert result["laplace"]["nll"] < result["map"]["nll"]
    assert "the largest τ won" not in capsys.readouterr().out


def test_gpt_dp_clipping_lowers_the_loss():
    # the default model and settings, fewer steps: private training still learns the text
    result = load("example_gpt_dp_clipping").main(["--steps", "25"])
    assert result["after"] < result["before"] - 0.2


def test_gpt_curvature_compares_three_methods(capsys):
    result = load("example_gpt_curvature").main(
        ["--batch-size", "4", "--context", "8", "--dim", "8", "--blocks", "1", "--steps", "3",
         "--lrs", "0.1", "1000"]
    )
    assert set(result["results"]) == {"sgd", "diag", "kfac"}
    out = capsys.readouterr().out
    assert "lowest loss:" in out and "KFAC step of an Embedding" in out
    # a learning rate that diverges says so, not "inf"
    assert "lr 1000: diverged" in out and "(diverged:" in out
    assert "a Embedding" not in out and "inf" not in out


def test_laplace_digits_writes_its_figure_or_explains(tmp_path, capsys):
    figure = tmp_path / "laplace.png"
    args = SMALL["example_laplace_digits"][:-1] + ["--figure", str(figure)]
    result = load("example_laplace_digits").main(args)
    out = capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in out
    else:
        assert figure.stat().st_size > 0 and f"figure saved to {figure}" in out
    assert [step for step, _ in result["sharpness"]] == [0, 2]
    assert set(result["laplace"]) == {"map", "diag", "kfac"}
