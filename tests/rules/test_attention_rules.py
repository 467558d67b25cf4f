"""The MultiheadAttention rule beyond the shared table (tests/problems/attention.py).

Here: the recomputation against the module's own outputs for every option, the fused reductions
(Gram forms and materialised) against brute-force per-sample gradients with and without the
per-call store, subsampling, probe entries, square roots and diagonals of factor columns (also in
chunks), Kronecker factors against their definitions and dense blocks against the exact GGN,
KFRA through attention, unbatched calls, frozen parameters, training-mode dropout (one case;
tests/extensions/test_attention_dropout.py has the rest), the exact-Hessian refusal, no
torch.func fallback, and the parts of the table's strict-xfail problems that do work
(attention parameters of sequence-first layers; the GGN family without GGNMP, and GGNMP with
the math SDPA kernel the engine should select).
"""

import contextlib
import warnings

import pytest
import torch
from problems import (
    ALL_PROBLEMS,
    DTYPE,
    check_first_order_without_fallback,
    first_order_reference,
    per_sample_losses,
    reference_per_sample_grads,
)
from problems.attention import causal_mask
from second_order_reference import Curvature
from torch import nn
from torch.func import functional_call, jacrev

from backpack import backpack, extend
from backpack.extensions import (
    GGNMP,
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
)
from backpack.recording import OWNS_CHILD_PARAMETERS, Record, trainable_params
from backpack.rules import attention as attention_rules
from backpack.rules import find_rule, generic
from backpack.utils.kroneckers import kfacs_to_mat

#: torch's notice that vmap loops over SDPA's CPU backward (references use torch.func)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

QUANTITIES = ["grad_batch", "batch_l2", "sum_grad_squared", "variance", "batch_dot"]


# --- rule-level cases ----------------------------------------------------------------------------


def _case(name):
    """(module kwargs, call kwargs, layout) of a named configuration."""
    n, t, s, e, h = 3, 4, 5, 6, 2
    g = torch.Generator().manual_seed(7)
    bool3d = torch.rand(n * h, t, t, generator=g) > 0.6
    bool3d[..., 0] = False
    padding = torch.rand(n, t, generator=g) > 0.5
    padding[:, 0] = False
    cases = {
        "self": ({}, {}, {}),
        "self-long": ({}, {}, {"t": 9}),
        "seq-first": ({"batch_first": False}, {}, {}),
        "bias-kv-zero-attn": ({"add_bias_kv": True, "add_zero_attn": True}, {}, {"h": 3}),
        "kdim-vdim": ({"kdim": 3, "vdim": 4}, {}, {"cross": True, "s": s}),
        "kdim-seq-first": ({"kdim": 5, "batch_first": False}, {}, {"cross": True, "s": s}),
        "cross-packed": ({}, {}, {"cross": True, "s": s}),
        "cross-packed-long": ({"add_bias_kv": True}, {}, {"cross": True, "s": 8, "t": 8}),
        "weights-per-head": ({}, {"average_attn_weights": False}, {}),
        "no-weights": ({}, {"need_weights": False}, {}),
        "float-mask": ({}, {"attn_mask": torch.randn(t, t, generator=g)}, {}),
        "bool-mask-3d": ({"add_zero_attn": True}, {"attn_mask": bool3d}, {}),
        "float-mask-3d-seq-first": (
            {"batch_first": False, "add_bias_kv": True},
            {"attn_mask": torch.randn(n * h, t, t, generator=g), "need_weights": False},
            {},
        ),
        "padding-sdpa": ({}, {"key_padding_mask": padding, "need_weights": False}, {}),
        "padding-float-weights": (
            {},
            {"key_padding_mask": torch.zeros(n, t).masked_fill(padding, float("-inf"))},
            {},
        ),
        "causal-sdpa": (
            {"add_bias_kv": True},
            {"attn_mask": causal_mask(t), "is_causal": True, "need_weights": False},
            {},
        ),
        "causal-weights": ({}, {"attn_mask": causal_mask(t, "bool"), "is_causal": True}, {}),
        "causal-padding": (
            {},
            {
                "attn_mask": causal_mask(t, "bool"),
                "is_causal": True,
                "key_padding_mask": padding,
                "need_weights": False,
            },
            {},
        ),
        "no-bias": ({"bias": False}, {}, {}),
        "unbatched": ({}, {"average_attn_weights": False}, {"unbatched": True}),
    }
    mha, call, layout = cases[name]
    layout = {"n": n, "t": t, "s": s, "e": e, "h": h, "cross": False, **layout}
    return mha, call, layout


CASES = [
    "self",
    "self-long",
    "seq-first",
    "bias-kv-zero-attn",
    "kdim-vdim",
    "kdim-seq-first",
    "cross-packed",
    "cross-packed-long",
    "weights-per-head",
    "no-weights",
    "float-mask",
    "bool-mask-3d",
    "float-mask-3d-seq-first",
    "padding-sdpa",
    "padding-float-weights",
    "causal-sdpa",
    "causal-weights",
    "causal-padding",
    "no-bias",
    "unbatched",
]


def _inputs(module, layout):
    n, t, s, e = layout["n"], layout["t"], layout["s"], layout["e"]
    unbatched = layout.get("unbatched", False)

    def shaped(length, width):
        if unbatched:
            return torch.randn(length, width, dtype=DTYPE)
        if module.batch_first:
            return torch.randn(n, length, width, dtype=DTYPE)
        return torch.randn(length, n, width, dtype=DTYPE)

    query = shaped(t, e)
    if not layout["cross"]:
        return query, query, query
    key = shaped(s, module.kdim)
    value = key if module.kdim == module.vdim else shaped(s, module.vdim)
    return query, key, value


def _make(name, seed=0):
    """Module, its inputs and call options, its record, random output gradients."""
    mha_kwargs, call, layout = _case(name)
    torch.manual_seed(seed)
    module = nn.MultiheadAttention(layout["e"], layout["h"], **mha_kwargs).to(DTYPE)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.7)
    inputs = _inputs(module, layout)
    call = {
        k: v.to(DTYPE) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in call.items()
    }
    return module, inputs, call, layout


def _record(module, inputs, call):
    out = module(*inputs, **call)
    tensors = tuple(t.detach() for t in out if t is not None)
    structure = tuple(None if t is None else t.detach() for t in out)
    record = Record(module, tuple(inputs), dict(call), tensors, structure)
    record.out_requires_grad = tuple(True for _ in tensors)
    return record


def _batch_axes(module, layout):
    if layout.get("unbatched"):
        return None
    return [0 if module.batch_first else 1, 0]


def _brute_force(module, inputs, call, grads, layout, names):
    """Per-sample gradients by one autograd call per sample of Σ out · grad."""
    out = [t for t in module(*inputs, **call) if t is not None]
    params = [module.get_parameter(n) for n in names]
    axes = _batch_axes(module, layout)
    count = 1 if axes is None else layout["n"]
    rows = []
    for i in range(count):
        total = 0
        for j, (o, g) in enumerate(zip(out, grads)):
            if axes is None:
                total = total + (o * g).sum()
            else:
                total = total + (o.select(axes[j], i) * g.select(axes[j], i)).sum()
        rows.append(torch.autograd.grad(total, params, retain_graph=True, allow_unused=True))
    return {
        n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
        for k, (n, p) in enumerate(zip(names, params))
    }


def _names(module):
    return [n for n, _ in module.named_parameters()]


def test_rule_owns_out_proj():
    module = nn.MultiheadAttention(4, 2, add_bias_kv=True)
    assert nn.MultiheadAttention in OWNS_CHILD_PARAMETERS
    assert isinstance(find_rule(module), attention_rules.MultiheadAttentionRule)
    assert set(trainable_params(module)) == {
        "in_proj_weight",
        "in_proj_bias",
        "bias_k",
        "bias_v",
        "out_proj.weight",
        "out_proj.bias",
    }


@pytest.mark.parametrize("name", CASES)
def test_recomputation_matches_the_module(name):
    """y = o W_oᵀ + b_o and the weights output from the rule's recomputation."""
    module, inputs, call, layout = _make(name)
    record = _record(module, inputs, call)
    rule = find_rule(module)
    fwd = rule._forward(record)
    y = torch.nn.functional.linear(fwd.o, module.out_proj.weight, module.out_proj.bias)
    expected = record.outputs[0]
    if layout.get("unbatched"):
        expected = expected.unsqueeze(0)
    elif not module.batch_first:
        expected = expected.transpose(0, 1)
    torch.testing.assert_close(y, expected)
    if len(record.outputs) > 1:
        weights = fwd.pd.mean(1) if call.get("average_attn_weights", True) else fwd.pd
        expected = record.outputs[1]
        torch.testing.assert_close(
            weights, expected.unsqueeze(0) if layout.get("unbatched") else expected
        )


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("stored", [False, True], ids=["fused", "stored"])
def test_first_order_quantities(name, stored):
    """Every reduction, fused (Gram forms where cheaper) or from stored per-sample gradients."""
    module, inputs, call, layout = _make(name)
    rule = find_rule(module)
    names = _names(module)
    grads = tuple(torch.randn_like(t) for t in _record(module, inputs, call).outputs)
    psg = _brute_force(module, inputs, call, grads, layout, names)

    def record():
        r = _record(module, inputs, call)
        if stored:
            rule.per_sample_grads(r, grads, names)
        return r

    values = rule.per_sample_grads(record(), grads, names)
    for n in names:
        torch.testing.assert_close(values[n], psg[n], msg=n)
    for quantity in ["batch_l2", "sum_grad_squared", "batch_dot"]:
        values = getattr(rule, quantity)(record(), grads, names)
        for n in names:
            expected = first_order_reference(psg[n], quantity)
            torch.testing.assert_close(values[n], expected, msg=f"{n} {quantity}")
    total = rule.grad_sum(record(), grads, names)
    for n in names:
        torch.testing.assert_close(total[n], psg[n].sum(0), msg=n)
        numel = psg[n][0].numel()
        index = torch.tensor([numel - 1, 0, numel // 2, numel // 3])
        entries = rule.grad_sum_entries(record(), grads, n, index)
        torch.testing.assert_close(entries, psg[n].sum(0).flatten()[index], msg=n)
    if not layout.get("unbatched"):
        sub = rule.per_sample_grads(record(), grads, names, subsampling=[2, 0, 2])
        for n in names:
            torch.testing.assert_close(sub[n], psg[n][[2, 0, 2]], msg=n)


def test_both_gram_and_materialised_forms_are_exercised():
    """The long cases take the materialised form, the short ones the Gram form."""
    short = torch.zeros(3, 4, 6), torch.zeros(3, 4, 18)
    long = torch.zeros(3, 9, 6), torch.zeros(3, 9, 18)
    assert attention_rules._ghost_is_cheaper(*short)
    assert not attention_rules._ghost_is_cheaper(*long)


@pytest.mark.parametrize("name", CASES)
def test_sqrt_and_diag_from_factor(name, monkeypatch):
    """Jᵀ f per column is the per-sample gradient with f as output gradient; chunked too."""
    module, inputs, call, layout = _make(name)
    rule = find_rule(module)
    names = _names(module)
    record = _record(module, inputs, call)
    factors = [torch.randn(4, *t.shape, dtype=DTYPE) for t in record.outputs]
    columns = {n: [] for n in names}
    for v in range(4):
        psg = _brute_force(module, inputs, call, [f[v] for f in factors], layout, names)
        for n in names:
            columns[n].append(psg[n])
    columns = {n: torch.stack(c) for n, c in columns.items()}
    coef = torch.rand(4, columns[names[0]].shape[1], dtype=DTYPE)
    for chunk in (None, 1):
        if chunk is not None:  # one column per chunk
            monkeypatch.setattr(attention_rules, "_CHUNK_ELEMENTS", 1)
        record = _record(module, inputs, call)
        sqrt = rule.sqrt_factor(record, factors, names)
        for n in names:
            torch.testing.assert_close(sqrt[n], columns[n], msg=n)
            weights = coef.reshape(*coef.shape, *[1] * (columns[n].dim() - 2))
            for per_sample in (False, True):
                diag = rule.diag_from_factor(record, factors, [n], coef, per_sample)[n]
                expected = (columns[n].square() * weights).sum(0)
                torch.testing.assert_close(diag, expected if per_sample else expected.sum(0))
    if not layout.get("unbatched"):
        sub = rule.sqrt_factor(_record(module, inputs, call), factors, names, subsampling=[1, 1, 0])
        for n in names:
            torch.testing.assert_close(sub[n], columns[n][:, [1, 1, 0]], msg=n)
    # a factor at the weights output only, or none at all
    record = _record(module, inputs, call)
    if len(factors) > 1:
        only = rule.sqrt_factor(record, [None, factors[1]], names)
        for v in range(4):
            zero = torch.zeros_like(factors[0][v])
            psg = _brute_force(module, inputs, call, [zero, factors[1][v]], layout, names)
            for n in names:
                torch.testing.assert_close(only[n][v], psg[n], msg=n)
    none = rule.sqrt_factor(record, [None] * len(factors), names)
    assert all(float(v.abs().max()) == 0 for v in none.values())


@pytest.mark.parametrize("name", [c for c in CASES if c != "unbatched"])
def test_kron_factors_follow_their_definitions(name):
    """[G, A] of Linear-like weights, [G] of their biases, dense exact blocks elsewhere."""
    module, inputs, call, layout = _make(name)
    rule = find_rule(module)
    names = _names(module)
    record = _record(module, inputs, call)
    factors = [torch.randn(3, *t.shape, dtype=DTYPE) for t in record.outputs]
    kron = rule.kron_factors(record, factors, names)
    sqrt = rule.sqrt_factor(record, factors, names)
    fwd = rule._forward(record)
    f = factors[0] if module.batch_first else factors[0].transpose(1, 2)
    self_attention = not layout["cross"]
    for n in names:
        kind = attention_rules._kron_kind(n, self_attention)
        if kind == "dense":
            flat = sqrt[n].flatten(2)
            assert len(kron[n]) == 1
            torch.testing.assert_close(kron[n][0], torch.einsum("vnp,vnq->pq", flat, flat))
            continue
        if kind == "out":
            s = f
            x = fwd.o
        else:
            g = fwd.backward(f, factors[1] if len(factors) > 1 else None)
            s = g["qkv"] if kind == "qkv" else g[kind]
            x = {"qkv": fwd.xq, "q": fwd.xq, "k": fwd.xk, "v": fwd.xv}[kind]
        big_g = torch.einsum("vnto,vntp->op", s, s)
        torch.testing.assert_close(kron[n][0], big_g, msg=n)
        if n.endswith("weight"):
            a = torch.einsum("nti,ntj->ij", x, x) / (x.shape[0] * x.shape[1])
            torch.testing.assert_close(kron[n][1], a, msg=n)
            # the Kronecker product of [G, A] sums the per-position blocks of the weight
            assert kfacs_to_mat(kron[n]).shape == (module.get_parameter(n).numel(),) * 2
        else:
            assert len(kron[n]) == 1


def test_dense_kronecker_factor_size_is_guarded(monkeypatch):
    module, inputs, call, _ = _make("cross-packed")
    record = _record(module, inputs, call)
    monkeypatch.setattr(attention_rules, "MAX_DENSE_NUMEL", 50)
    factors = [torch.randn(2, *t.shape, dtype=DTYPE) for t in record.outputs]
    with pytest.raises(NotImplementedError, match="in_proj_weight has no Kronecker structure"):
        find_rule(module).kron_factors(record, factors, ["in_proj_weight"])


def test_unbatched_call_is_one_sample():
    module, inputs, call, layout = _make("unbatched")
    record = _record(module, inputs, call)
    rule = find_rule(module)
    assert rule.batch_size(record) == 1
    grads = tuple(torch.ones_like(t) for t in record.outputs)
    psg = rule.per_sample_grads(record, grads, _names(module))
    assert all(v.shape[0] == 1 for v in psg.values())
    with pytest.raises(NotImplementedError, match="unbatched"):
        rule.output_batch_axes(record)


# --- table problems ------------------------------------------------------------------------------


def _attention_problems(tag):
    found = []
    for p in ALL_PROBLEMS:
        if tag not in p.tags or not any(
            isinstance(m, nn.MultiheadAttention) for m in p.build()[0].modules()
        ):
            continue
        found.append(p)
    return found


ATTENTION_FIRST = _attention_problems("first")
ATTENTION_SECOND = _attention_problems("second")
ATTENTION_KRON = _attention_problems("kron")


def _xfailed(problem, test):
    xfail = problem.options.get("xfail")
    return bool(xfail.get(test)) if isinstance(xfail, dict) else bool(xfail)


def test_table_has_the_attention_problems():
    assert len(ATTENTION_FIRST) >= 20
    ids = {p.id for p in ATTENTION_FIRST}
    for needed in ("encoder", "decoder", "tiny-transformer", "gpt"):
        assert any(needed in i for i in ids), needed


FIRST_OK = [p for p in ATTENTION_FIRST if not _xfailed(p, "test_quantity_matches_autograd")]


@pytest.mark.parametrize("problem", FIRST_OK, ids=[p.id for p in FIRST_OK])
def test_no_generic_fallback_and_no_warning(problem, monkeypatch):
    """All first-order extensions at once: the rule serves every parameter, out_proj included."""
    check_first_order_without_fallback(problem, monkeypatch)


def _attention_params(model):
    return [
        (f"{mn}.{pn}", p)
        for mn, m in model.named_modules()
        if isinstance(m, nn.MultiheadAttention)
        for pn, p in m.named_parameters()
    ]


#: (once xfailed by the table for their Linear/LayerNorm layers; checked here either way)
SEQ_FIRST = [p for p in ATTENTION_FIRST if "seq-first" in p.id]


@pytest.mark.parametrize("problem", SEQ_FIRST, ids=[p.id for p in SEQ_FIRST])
def test_attention_parameters_of_sequence_first_layers(problem):
    """The table xfails these for the layers' Linear/LayerNorm; attention itself is exact."""
    model, x, lossfunc, y = problem.build()
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    ref = Curvature(model, x, lossfunc, y, hessian=False)
    extend(model)
    extend(lossfunc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's vmap fallback notice for SDPA's backward
        with backpack(BatchGrad(), BatchL2Grad(), DiagGGNExact(), BatchDiagGGNExact()):
            lossfunc(model(x), y).backward()
    params = _attention_params(model)
    assert len(params) >= 4
    for name, p in params:
        torch.testing.assert_close(p.grad_batch, reference[name], msg=name)
        torch.testing.assert_close(
            p.batch_l2, first_order_reference(reference[name], "batch_l2"), msg=name
        )
        torch.testing.assert_close(p.diag_ggn_exact, ref.diag(ref.ggn, name), msg=name)
        torch.testing.assert_close(
            p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), msg=name
        )


#: problems whose attention runs through scaled_dot_product_attention's fused kernels
SDPA = [p for p in ATTENTION_SECOND if "sdpa" in p.id or p.id.startswith(("encoder", "gpt"))]


def test_parametrisations_are_not_empty():
    """The lists below select problems by id: an empty one would skip its test silently."""
    assert SEQ_FIRST and SDPA


@contextlib.contextmanager
def _math_sdpa(module):
    """The engine change proposed for generic.transformable: the differentiable SDPA kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with _ORIGINAL_TRANSFORMABLE(module), sdpa_kernel([SDPBackend.MATH]):
        yield


_ORIGINAL_TRANSFORMABLE = generic.transformable


@pytest.mark.parametrize("problem", SDPA, ids=[p.id for p in SDPA])
def test_ggn_family_on_sdpa_problems(problem, monkeypatch):
    """Diagonals and square roots are exact; GGNMP too once the math SDPA kernel is used."""
    model, x, lossfunc, y = problem.build()
    ref = Curvature(model, x, lossfunc, y, hessian=False)
    extend(model)
    extend(lossfunc)
    monkeypatch.setattr(generic, "transformable", _math_sdpa)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's vmap fallback notice for SDPA's backward
        with backpack(DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), GGNMP()):
            lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.diag_ggn_exact, ref.diag(ref.ggn, name), msg=name)
        torch.testing.assert_close(
            p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), msg=name
        )
        sqrt = p.sqrt_ggn_exact.flatten(2)
        torch.testing.assert_close(
            torch.einsum("vnp,vnq->pq", sqrt, sqrt), ref.block(ref.ggn, name), msg=name
        )
        mat = torch.randn(2, *p.shape, dtype=p.dtype, device=p.device)
        expected = (ref.block(ref.ggn, name) @ mat.flatten(1).T).T.reshape(mat.shape)
        torch.testing.assert_close(p.ggnmp(mat), expected, msg=name)


def _is_dense(name, module, problem):
    """Whether a parameter's Kronecker factor is a dense block (no Kronecker structure)."""
    if name in ("bias_k", "bias_v"):
        return True
    if name == "in_proj_bias" and module.in_proj_weight is None:
        return True
    cross = "cross" in problem.id or module.__dict__.get("_backpack_path", "").endswith(
        "multihead_attn"
    )
    return name in ("in_proj_weight", "in_proj_bias") and cross


KRON = [p for p in ATTENTION_KRON if not _xfailed(p, "test_ggn_family") or p in SDPA]


@pytest.mark.parametrize("problem", KRON, ids=[p.id for p in KRON])
def test_kflr_dense_blocks_are_exact_and_kfac_matches_sqrt_mc(problem):
    """Dense attention factors: the exact GGN block (KFLR), Σ (Jᵀf)(Jᵀf)ᵀ of SqrtGGNMC (KFAC)."""
    model, x, lossfunc, y = problem.build()
    ref = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    extend(model)
    extend(lossfunc)
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's vmap fallback notice for SDPA's backward
        with backpack(KFLR(), KFAC(mc_samples=3)):
            lossfunc(model(x), y).backward()
        kfac = {n: p.kfac for n, p in _attention_params(model)}
        torch.manual_seed(5)
        with backpack(SqrtGGNMC(mc_samples=3)):
            lossfunc(model(x), y).backward()
    modules = dict(model.named_modules())
    for name, p in _attention_params(model):
        owner = modules[name.rsplit(".", 2 if ".out_proj." in name else 1)[0]]
        if not _is_dense(name.rsplit(".", 1)[1], owner, problem):
            assert len(p.kflr) == (2 if name.endswith("weight") else 1)
            continue
        assert len(p.kflr) == 1
        torch.testing.assert_close(kfacs_to_mat(p.kflr), ref.block(ref.ggn, name), msg=name)
        sqrt = p.sqrt_ggn_mc.flatten(2)
        torch.testing.assert_close(
            kfacs_to_mat(kfac[name]), torch.einsum("vnp,vnq->pq", sqrt, sqrt), msg=name
        )


def test_some_problems_have_dense_kronecker_factors():
    dense = [p for p in KRON if "cross" in p.id or "bias-kv" in p.id or "decoder" in p.id]
    assert len(dense) >= 4


# --- dropout -------------------------------------------------------------------------------------


class _DropoutAttention(nn.Module):
    def __init__(self, **call):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.attn = nn.MultiheadAttention(6, 2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(6, 3)
        self.call = call

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.attn(h, h, h, **self.call)[0]).transpose(1, 2)


def test_dropout_masks_recovered_in_training():
    """Exact per-sample gradients of the forward's own masks (held by its autograd graph)."""
    torch.manual_seed(0)
    model = _DropoutAttention(average_attn_weights=False).to(DTYPE).train()
    x, y = torch.randn(4, 5, 5, dtype=DTYPE), torch.randint(0, 3, (4, 5))
    lossfunc = nn.CrossEntropyLoss()
    extend(model)
    out = model(x)
    terms = per_sample_losses(lossfunc, out, y)
    params = dict(model.named_parameters())
    rows = [
        torch.autograd.grad(terms[i], list(params.values()), retain_graph=True) for i in range(4)
    ]
    with backpack(BatchGrad(), BatchL2Grad()):
        lossfunc(out, y).backward()
    for k, (name, p) in enumerate(params.items()):
        expected = torch.stack([r[k] for r in rows])
        torch.testing.assert_close(p.grad_batch, expected, msg=name)
        torch.testing.assert_close(p.batch_l2, expected.flatten(1).square().sum(1), msg=name)


# --- other cases ---------------------------------------------------------------------------------


def test_exact_hessian_extensions_refuse_attention():
    torch.manual_seed(0)
    model = extend(_DropoutAttention(need_weights=False).eval())
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(4, 5, 5), torch.randint(0, 3, (4, 5))
    with pytest.raises(NotImplementedError), backpack(DiagHessian()):
        lossfunc(model(x), y).backward()


def test_frozen_projection_only_out_proj_and_bias_train():
    """in_proj_weight frozen: the remaining parameters get exact quantities."""
    problem = next(p for p in ALL_PROBLEMS if p.id == "mha-self-ce-mean")
    model, x, lossfunc, y = problem.build()
    model.attn.in_proj_weight.requires_grad_(False)
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    extend(model)
    with backpack(BatchGrad(), BatchL2Grad()):
        lossfunc(model(x), y).backward()
    assert not hasattr(model.attn.in_proj_weight, "grad_batch")
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad_batch, reference[name], msg=name)


class _FirstAttention(nn.Module):
    """MultiheadAttention on the input (no gradient before it) -> Flatten -> Linear."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True)
        self.flat = nn.Flatten()
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.flat(self.attn(x, x, x, need_weights=False)[0]))


def test_kfra_through_attention_as_first_module():
    """KFRA's batch-averaged Ḡ at the attention output: G = Σ_t Ḡ_tt, dense (1/N) Σ J_nᵀ Ḡ J_n."""
    torch.manual_seed(0)
    model = _FirstAttention().to(DTYPE)
    with torch.no_grad():
        for p in model.attn.parameters():
            p.normal_(0, 0.7)
    x, y = torch.randn(5, 3, 4, dtype=DTYPE), torch.randint(0, 3, (5,))
    lossfunc = nn.CrossEntropyLoss()
    n = x.shape[0]
    with torch.no_grad():
        h = model.attn(x, x, x, need_weights=False)[0]
        out = model.head(model.flat(h))

    def loss_of(o):
        return lossfunc(o.reshape(out.shape), y)

    hess = jacrev(jacrev(loss_of))(out.flatten()).reshape(n, 3, n, 3)
    w = model.head.weight.detach()
    gbar = w.T @ sum(hess[i, :, i] for i in range(n)) @ w  # [12, 12] over (t, e)
    extend(model)
    extend(lossfunc)
    with backpack(KFRA()):
        lossfunc(model(x), y).backward()
    g4 = gbar.reshape(3, 4, 3, 4)
    expected_g = sum(g4[t, :, t, :] for t in range(3))
    torch.testing.assert_close(model.attn.out_proj.weight.kfra[0], expected_g)
    assert model.attn.in_proj_weight.kfra[0].shape == (12, 12)
    # dense bias_k block: the batch average of J_nᵀ Ḡ J_n
    attn = model.attn
    jac = []
    for i in range(n):

        def f(bias_k, i=i):
            return functional_call(
                attn, {"bias_k": bias_k}, (x[i : i + 1],) * 3, {"need_weights": False}
            )[0].flatten()

        jac.append(jacrev(f)(attn.bias_k.detach()).flatten(1))
    expected_dense = sum(j.T @ gbar @ j for j in jac) / n
    assert len(attn.bias_k.kfra) == 1
    torch.testing.assert_close(attn.bias_k.kfra[0], expected_dense)


def test_gpt_with_learned_positions_all_but_the_position_embedding():
    """The table xfails this problem for `pos.weight` (an engine limitation); the rest is exact."""
    problem = next(p for p in ALL_PROBLEMS if p.id == "gpt-learned-positions-ce-mean")
    model, x, lossfunc, y = problem.build()
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    ref = Curvature(model, x, lossfunc, y, hessian=False)
    extend(model)
    extend(lossfunc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine may warn about the position embedding
        with backpack(BatchGrad(), BatchL2Grad(), BatchDiagGGNExact()):
            lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        if name == "pos.weight":
            continue
        torch.testing.assert_close(p.grad_batch, reference[name], msg=name)
        torch.testing.assert_close(
            p.batch_l2, first_order_reference(reference[name], "batch_l2"), msg=name
        )
        torch.testing.assert_close(
            p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), msg=name
        )
