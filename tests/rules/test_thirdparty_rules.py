"""Rules for layers of Hugging Face transformers and timm, recognised by qualified class name.

- backpack never imports transformers or timm; their classes get rules when first met;
- every class named in backpack is checked here against the installed package: the curated
  copies of HF's RMS norms have the forward of `LlamaRMSNorm` / `T5LayerNorm`, the timm
  subclasses declared standard compute their parent's function;
- `Conv1D` gives Linear's numbers for the transposed weight, and its Kronecker factors are those
  of the stored `[in, out]` weight: the GGN block of `weight.flatten()` is `kron(A, G)`;
- the dense factors of the norms and LayerScale are their exact GGN blocks;
- the shared table's third-party problems run without the torch.func fallback.
"""

import ast
import importlib
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
from problems import check_first_order_without_fallback
from problems.thirdparty import PROBLEMS as THIRDPARTY
from problems.thirdparty import conv1d
from second_order_reference import Curvature
from torch import nn

from backpack import backpack, extend
from backpack.extensions import (
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from backpack.rules import find_rule
from backpack.rules.activations import is_curvature_free
from backpack.rules.base import overridden_base, qualified_name, standard_forward_names
from backpack.rules.linear import Conv1DRule
from backpack.rules.norm import LLAMA_RMS_NORMS, T5_RMS_NORMS

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

from timm.layers import LayerNorm2d, LayerScale, LayerScale2d, RmsNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

DT = torch.float64


def close(a, b, msg="", rtol=1e-7, atol=1e-10):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=msg)


def _class(name):
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)


# --- recognition --------------------------------------------------------------------------------
def test_importing_backpack_imports_no_thirdparty_package():
    code = textwrap.dedent(
        """
        import sys
        import backpack
        from backpack.rules import find_rule
        find_rule(__import__("torch").nn.Linear(2, 2))
        loaded = {m.split(".")[0] for m in sys.modules}
        assert not loaded & {"transformers", "timm", "peft"}, loaded & {"transformers", "timm"}
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_classes_get_their_rules_by_name():
    linear = find_rule(nn.Linear(2, 2))
    assert isinstance(find_rule(Conv1D(3, 2)), Conv1DRule)
    assert find_rule(timm.layers.Linear(2, 2)) is linear
    assert find_rule(timm.layers.LayerNorm(3)) is find_rule(nn.LayerNorm(3))
    assert find_rule(timm.layers.GroupNorm(4, num_groups=2)) is find_rule(nn.GroupNorm(2, 4))
    assert find_rule(timm.layers.GroupNorm1(4)) is find_rule(nn.GroupNorm(1, 4))
    assert type(find_rule(RmsNorm(3))) is type(find_rule(nn.RMSNorm(3)))
    for module in (LayerScale(3), LayerScale2d(3), LlamaRMSNorm(3), T5LayerNorm(3), LayerNorm2d(3)):
        assert find_rule(module) is not None, module
    assert qualified_name(Conv1D) == "transformers.pytorch_utils.Conv1D"
    # linear in their input: no residual curvature for the Hessian extensions
    for module in (Conv1D(3, 2), LayerScale(3), LayerScale2d(3), timm.layers.Linear(2, 2)):
        assert is_curvature_free(module), module
    assert not is_curvature_free(LlamaRMSNorm(3)) and not is_curvature_free(RmsNorm(3))


def test_subclasses_of_named_classes_follow_the_forward_rule():
    class Kept(Conv1D):
        pass

    class Scaled(Conv1D):
        def forward(self, x):
            return super().forward(2 * x)

    class ScaledLinear(timm.layers.Linear):
        def forward(self, x):
            return super().forward(2 * x)

    assert isinstance(find_rule(Kept(3, 2)), Conv1DRule)
    assert find_rule(Scaled(3, 2)) is None and overridden_base(Scaled(3, 2)) is Conv1D
    assert not is_curvature_free(Scaled(3, 2))
    # a subclass of a declared-standard class that overrides forward again gets the fallback
    assert find_rule(ScaledLinear(2, 2)) is None
    assert overridden_base(ScaledLinear(2, 2)) is nn.Linear


def _forward_ast(cls):
    """The forward's body without its docstring, as source with normalised formatting."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    fn = tree.body[0]
    fn.decorator_list = []
    fn.body = [
        b for b in fn.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))
    ]
    return ast.dump(fn)


@pytest.mark.parametrize("name", [*LLAMA_RMS_NORMS, *T5_RMS_NORMS])
def test_named_hf_norms_compute_what_their_rule_assumes(name):
    """Each curated copy has its reference's forward, parameter and epsilon attribute."""
    cls = _class(name)
    reference = LlamaRMSNorm if name in LLAMA_RMS_NORMS else T5LayerNorm
    assert _forward_ast(cls) == _forward_ast(reference), name
    module = cls(5, eps=1e-3)
    assert [n for n, _ in module.named_parameters()] == ["weight"]
    assert module.weight.shape == (5,) and module.variance_epsilon == 1e-3
    assert not list(module.children())


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("name", standard_forward_names())
def test_declared_standard_timm_classes_compute_their_parents_function(name, fast):
    from timm.layers import set_fast_norm

    cls = _class(name)
    parent = next(c for c in cls.__mro__[1:] if c.__module__.startswith("torch.nn"))
    set_fast_norm(fast)
    try:
        args = {"Linear": (4, 3), "LayerNorm": (4,), "GroupNorm": (4, 2), "GroupNorm1": (4,)}
        module = cls(*args[cls.__name__]).to(DT)
    finally:
        set_fast_norm(False)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    x = torch.randn(3, 4, 5, dtype=DT) if "GroupNorm" in name else torch.randn(3, 5, 4, dtype=DT)
    torch.testing.assert_close(module(x), parent.forward(module, x), rtol=0, atol=0)


# --- Conv1D ---------------------------------------------------------------------------------------
def _twins(seq: bool):
    """A Conv1D network and the same network with nn.Linear (weight transposed)."""
    torch.manual_seed(0)
    a, b = conv1d(4, 5), conv1d(5, 3)
    convs = nn.Sequential(a, nn.Tanh(), b).to(DT)
    linears = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    with torch.no_grad():
        for conv, lin in ((a, linears[0]), (b, linears[2])):
            lin.weight.copy_(conv.weight.T)
            lin.bias.copy_(conv.bias)
    x = torch.randn(4, 3, 4, dtype=DT) if seq else torch.randn(6, 4, dtype=DT)
    return convs, linears, x


FIELDS = {
    "grad_batch": 1,
    "batch_l2": None,
    "sum_grad_squared": 0,
    "variance": 0,
    "batch_dot": None,
    "diag_ggn_exact": 0,
    "diag_ggn_exact_batch": 1,
    "sqrt_ggn_exact": 2,
    "diag_h": 0,
}


@pytest.mark.parametrize("seq", [False, True], ids=["flat", "sequence"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_conv1d_gives_linear_numbers_for_the_transposed_weight(seq, reduction):
    convs, linears, x = _twins(seq)
    y = torch.randn(*x.shape[:-1], 3, dtype=DT)
    results = []
    for model in (convs, linears):
        extend(model)
        lossfunc = extend(nn.MSELoss(reduction=reduction))
        exts = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad()]
        with backpack(*exts):
            lossfunc(model(x), y).backward()
        params = dict(model.named_parameters())
        first = {k: {f: getattr(p, f) for f in list(FIELDS)[:5]} for k, p in params.items()}
        exts = [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), DiagHessian(), KFLR()]
        with backpack(*exts):
            lossfunc(model(x), y).backward()
        for k, p in model.named_parameters():
            first[k].update({f: getattr(p, f) for f in list(FIELDS)[5:]})
            first[k]["kflr"] = p.kflr
            first[k]["grad"] = p.grad
        if not seq:  # KFRA's recursion, through Conv1D's Jacobians
            with backpack(KFRA()):
                lossfunc(model(x), y).backward()
            for k, p in model.named_parameters():
                first[k]["kfra"] = p.kfra
        results.append(first)
    conv_results, linear_results = results
    for (k, conv), lin in zip(conv_results.items(), linear_results.values()):
        weight = k.endswith("weight")
        assert conv["grad_batch"].shape[1:] == (convs.get_parameter(k).shape)
        for field, axis in FIELDS.items():
            expected = lin[field]
            if weight and axis is not None:
                expected = expected.transpose(axis, axis + 1)
            close(conv[field], expected, f"{k} {field}")
        for key in ("kflr", "kfra") if "kfra" in conv else ("kflr",):
            for a, b in zip(conv[key], lin[key]):
                close(a, b, f"{k} {key}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_conv1d_kronecker_factors_belong_to_the_stored_weight(reduction):
    """With one sample KFLR is exact: kron(A, G) is the GGN block of `weight.flatten()` ([in,
    out] row-major), kron(G, A) that of `weight.T.flatten()`."""
    torch.manual_seed(0)
    model = nn.Sequential(conv1d(3, 4), nn.Tanh(), conv1d(4, 2)).to(DT)
    x = torch.randn(1, 3, dtype=DT)
    lossfunc, y = nn.CrossEntropyLoss(reduction=reduction), torch.tensor([1])
    ref = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    extend(model)
    with backpack(KFLR()):
        extend(lossfunc)(model(x), y).backward()
    for i in (0, 2):
        weight = model[i].weight
        g, a = weight.kflr
        nx, nf = weight.shape
        assert g.shape == (nf, nf) and a.shape == (nx, nx)
        block = ref.block(ref.ggn, f"{i}.weight")
        close(torch.kron(a, g), block, f"{i}")
        assert not torch.allclose(torch.kron(g, a), block)
        transposed = block.reshape(nx, nf, nx, nf).permute(1, 0, 3, 2).reshape(nx * nf, -1)
        close(torch.kron(g, a), transposed, f"{i}")
        close(model[i].bias.kflr[0], ref.block(ref.ggn, f"{i}.bias"))


# --- norms and LayerScale: dense factors, refusals ----------------------------------------------
DENSE = (LayerScale, LayerScale2d, LlamaRMSNorm, T5LayerNorm, RmsNorm, LayerNorm2d)


@pytest.mark.parametrize("problem", THIRDPARTY, ids=lambda p: p.id)
def test_thirdparty_problems_need_no_fallback(problem, monkeypatch):
    check_first_order_without_fallback(problem, monkeypatch)


KRON_DENSE = [
    p for p in THIRDPARTY if "kron" in p.tags and any(
        isinstance(m, DENSE) for m in p.build()[0].modules()
    )
]


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("problem", KRON_DENSE, ids=lambda p: p.id)
def test_dense_factors_are_the_exact_ggn_blocks(problem):
    model, x, lossfunc, y = problem.build()
    ref = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    extend(model)
    with backpack(KFLR()):
        extend(lossfunc)(model(x), y).backward()
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, DENSE):
            for pname, p in module.named_parameters():
                full = f"{name}.{pname}"
                assert len(p.kflr) == 1
                close(p.kflr[0], ref.block(ref.ggn, full), full)
                checked += 1
    assert checked


def test_inplace_layer_scale_is_refused_clearly():
    model = extend(nn.Sequential(nn.Linear(3, 4), LayerScale(4, inplace=True), nn.Linear(4, 2)))
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    with pytest.raises(NotImplementedError, match="inplace=False"):
        with backpack(BatchGrad()):
            nn.functional.cross_entropy(model(x), y).backward()


def test_hessian_extensions_refuse_rms_norms():
    model = extend(nn.Sequential(nn.Linear(3, 4), LlamaRMSNorm(4), nn.Linear(4, 2)).to(DT))
    x, y = torch.randn(5, 3, dtype=DT), torch.randint(0, 2, (5,))
    lossfunc = extend(nn.CrossEntropyLoss())
    with pytest.raises(NotImplementedError):
        with backpack(DiagHessian()):
            lossfunc(model(x), y).backward()


def test_tiny_llama_curvature_is_float32_accurate():
    """Gradients through HF's RMS norms are rounded to float32 (their forward casts), so the
    curvature of parameters before a norm agrees with the float64 reference to float32."""
    problem = next(p for p in THIRDPARTY if p.id == "hf-llama-tiny-ce-sum")
    model, x, lossfunc, y = problem.build()
    ref = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    extend(model)
    with backpack(DiagGGNExact(), KFAC(), KFLR()):
        extend(lossfunc)(model(x), y).backward()
    for name, p in model.named_parameters():
        scale = ref.diag(ref.ggn, name).abs().max()
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name, rtol=1e-5, atol=1e-6 * scale)
        assert len(p.kflr) == (2 if p.dim() == 2 and "norm" not in name else 1), name
        assert [f.shape for f in p.kfac] == [f.shape for f in p.kflr], name
