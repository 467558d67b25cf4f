"""Fused second-order convolution rules (square roots, diagonals, Kronecker factors).

Every path (unfolding, folding into one grouped weight backward), chunk layout (one chunk, chunks
of samples, chunks of factor columns) and option (groups, transposed, string/mode padding,
`output_size`, subsampling, signed coefficients, per-sample) is checked against brute-force
autograd: one vector-Jacobian product per (factor column, sample) pair.
"""

import pytest
import torch
from problems import problems_with
from problems.conv import PROBLEMS as CONV_PROBLEMS
from torch import nn
from torch.func import functional_call, jacrev

from backpack import backpack, extend
from backpack.core.derivatives import convnd
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions import (
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
)
from backpack.recording import Record
from backpack.rules import conv as conv_rule
from backpack.rules import find_rule

D = torch.float64
V = 4

# (module, input shape, forward kwargs)
CASES = {
    "conv1d-groups-dilation": (
        lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2),
        (3, 4, 11),
        {},
    ),
    "conv2d-same-even-circular": (
        lambda: nn.Conv2d(2, 3, (2, 3), padding="same", dilation=(1, 2), padding_mode="circular"),
        (3, 2, 5, 6),
        {},
    ),
    "conv2d-reflect-groups": (
        lambda: nn.Conv2d(4, 4, 3, stride=(2, 1), padding=(1, 2), groups=2, padding_mode="reflect"),
        (3, 4, 6, 5),
        {},
    ),
    "conv2d-nobias": (lambda: nn.Conv2d(3, 5, 3, bias=False), (3, 3, 6, 6), {}),
    "conv3d-dilated-groups": (
        lambda: nn.Conv3d(
            2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1), groups=2
        ),
        (3, 2, 4, 6, 4),
        {},
    ),
    "convtranspose1d-outpad-groups": (
        lambda: nn.ConvTranspose1d(4, 6, 3, stride=3, padding=1, output_padding=2, groups=2),
        (3, 4, 5),
        {},
    ),
    "convtranspose2d-output-size": (
        lambda: nn.ConvTranspose2d(
            2, 4, (3, 2), stride=(2, 3), padding=(1, 0), dilation=(2, 1), groups=2
        ),
        (3, 2, 4, 5),
        {"output_size": [9, 14]},
    ),
    "convtranspose2d-ungrouped": (
        lambda: nn.ConvTranspose2d(3, 2, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        (3, 3, 4, 3),
        {},
    ),
    "convtranspose3d-outpad": (
        lambda: nn.ConvTranspose3d(
            2, 2, (2, 3, 2), stride=2, padding=(0, 1, 1), output_padding=(1, 0, 1)
        ),
        (3, 2, 3, 4, 3),
        {},
    ),
}


def _case(name, seed=0):
    make, shape, kwargs = CASES[name]
    torch.manual_seed(seed)
    module = make().to(D)
    x = torch.randn(shape, dtype=D)
    with torch.no_grad():
        out = module(x, **kwargs)
    factor = torch.randn(V, *out.shape, dtype=D)
    record = Record(module, (x,), kwargs, (out,), out)
    return module, x, kwargs, factor, record


def _pair_reference(module, x, kwargs, factor):
    """`{name: [V, N, *param.shape]}`: one autograd call per (column, sample) pair."""
    names = [n for n, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]
    result = {
        n: torch.zeros(factor.shape[0], x.shape[0], *p.shape, dtype=D)
        for n, p in zip(names, params)
    }
    for n in range(x.shape[0]):
        out = module(x[n : n + 1], **kwargs)
        for v in range(factor.shape[0]):
            grads = torch.autograd.grad(out, params, factor[v, n : n + 1], retain_graph=True)
            for name, g in zip(names, grads):
                result[name][v, n] = g
    return result


def _input_factor_reference(module, x, kwargs):
    """Batch mean of Σ_l u_l u_lᵀ, u_l = ∂ out[n, o, l] / ∂ W'[o] (W' = weight or weight.T)."""
    weight = module.weight.detach()
    groups = module.groups
    transposed = convnd.is_transposed(module)
    c_out = weight.shape[1] * groups if transposed else weight.shape[0]
    per_group = c_out // groups

    def out_of(w):
        return functional_call(module, {"weight": w}, (x,), kwargs)

    jac = jacrev(out_of)(weight)  # [N, C_out, *out, *weight.shape]
    n = x.shape[0]
    total = 0
    for g in range(groups):
        o = g * per_group
        rows = jac[:, o].reshape(n, -1, *weight.shape)  # [N, L, *weight.shape]
        if transposed:
            cin = weight.shape[0] // groups
            u = rows[:, :, g * cin : (g + 1) * cin, o - g * per_group]
        else:
            u = rows[:, :, o]
        u = u.reshape(n * u.shape[1], -1)  # [N L, K']
        total = total + u.T @ u
    return total / (n * groups)


def _use_path(monkeypatch, path):
    """Force the unfolding or the folding path (folding also for grouped convolutions)."""
    if path == "fold":
        monkeypatch.setattr(convnd, "_SAVE_MEMORY", True)
    else:
        monkeypatch.setattr(convnd, "_VMAP_MIN_POSITIONS", 10**9)


# chunks: all pairs at once; two samples with all columns; one sample with two columns; one pair
BUDGETS = ["whole", "two-samples", "two-columns", "one-pair"]


def _set_budget(monkeypatch, kind, module, x, factor):
    fold = convnd.prefer_fold(module, x, factor.shape[3:])
    per_pair, per_sample = conv_rule._pair_sizes(module, x, factor, fold)
    budget = {
        "whole": 1 << 24,
        "two-samples": 2 * (V * per_pair + per_sample),
        "two-columns": 2 * per_pair + per_sample,
        "one-pair": 1,
    }[kind]
    monkeypatch.setitem(conv_rule._PAIR_CHUNK, "cpu", budget)


def _close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12, msg=msg)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("path", ["unfold", "fold"])
@pytest.mark.parametrize("name", list(CASES))
def test_sqrt_and_diag_match_autograd(name, path, budget, monkeypatch):
    module, x, kwargs, factor, record = _case(name)
    expected = _pair_reference(module, x, kwargs, factor)
    rule = find_rule(module)
    assert isinstance(rule, conv_rule.ConvRule)
    names = list(expected)
    _use_path(monkeypatch, path)
    _set_budget(monkeypatch, budget, module, x, factor)
    signs = torch.randn(V, x.shape[0], dtype=D)  # real coefficients of either sign
    subsampling = [2, 0, 2]
    with torch.no_grad():
        sqrt = rule.sqrt_factor(record, [factor], names)
        sub = rule.sqrt_factor(record, [factor], names, subsampling)
        diags = {
            (signed, per_sample): rule.diag_from_factor(
                record, [factor], names, signs if signed else None, per_sample
            )
            for signed in (False, True)
            for per_sample in (False, True)
        }
    for pname, ref in expected.items():
        _close(sqrt[pname], ref, pname)
        _close(sub[pname], ref[:, subsampling], pname)
        for (signed, per_sample), value in diags.items():
            sq = ref.square()
            if signed:
                sq = sq * signs.reshape(*signs.shape, *([1] * (sq.dim() - 2)))
            reference = sq.sum(0) if per_sample else sq.sum((0, 1))
            _close(value[pname], reference, f"{pname} signed={signed} per_sample={per_sample}")


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("name", [n for n in CASES if n != "convtranspose2d-output-size"])
def test_kron_factors_match_autograd(name, chunked, monkeypatch):
    module, x, kwargs, factor, record = _case(name)
    rule = find_rule(module)
    names = [n for n, _ in module.named_parameters()]
    if chunked:
        # one sample per chunk, and the block-triangular Gram product even for tiny factors
        monkeypatch.setattr(conv_rule, "_CHUNK_BUDGET", 1)
        monkeypatch.setattr(conv_rule, "_GRAM_MIN_ROWS", 1)
        monkeypatch.setattr(conv_rule, "_GRAM_BLOCKS", 3)
    if convnd.is_transposed(module) and module.groups != 1:
        with pytest.raises(NotImplementedError, match="grouped transposed"):
            rule.kron_factors(record, [factor], names)
        return
    with torch.no_grad():
        kron = rule.kron_factors(record, [factor], names)
    s = factor.flatten(3).sum(-1).flatten(0, 1)  # [V N, C_out]
    g = s.T @ s
    _close(kron["weight"][0], g)
    _close(kron["weight"][1], _input_factor_reference(module, x, kwargs))
    if "bias" in names:
        assert len(kron["bias"]) == 1
        _close(kron["bias"][0], g)


def test_block_triangular_gram_matches_full_product(monkeypatch):
    torch.manual_seed(0)
    for rows, blocks in [(5, 2), (7, 3), (300, 4), (130, 7)]:
        monkeypatch.setattr(conv_rule, "_GRAM_BLOCKS", blocks)
        monkeypatch.setattr(conv_rule, "_GRAM_MIN_ROWS", 1 if rows < 10 else 128)
        u = torch.randn(2, rows, 11, dtype=D)
        acc = conv_rule._add_upper_gram(u[:, :, :5], None)
        acc = conv_rule._add_upper_gram(u[:, :, 5:], acc)
        _close(conv_rule._symmetrize_upper(acc.sum(0)), torch.einsum("gkm,gjm->kj", u, u))


@pytest.mark.parametrize("path", ["unfold", "fold"])
def test_unbatched_call_is_one_sample(path, monkeypatch):
    _use_path(monkeypatch, path)
    module, x, kwargs, factor, _ = _case("conv2d-same-even-circular")
    rule = find_rule(module)
    names = ["weight", "bias"]
    x1, f1 = x[0], factor[:, 0]
    with torch.no_grad():
        out1 = module(x1)
        record1 = Record(module, (x1,), {}, (out1,), out1)
        record = Record(module, (x[:1],), {}, (out1.unsqueeze(0),), out1)
        batched = factor[:, :1]
        assert rule.batch_size(record1) == 1
        for per_sample in (False, True):
            for pname, value in rule.diag_from_factor(
                record1, [f1], names, None, per_sample
            ).items():
                ref = rule.diag_from_factor(record, [batched], names, None, per_sample)[pname]
                _close(value, ref)
        sqrt1, sqrt = (
            rule.sqrt_factor(record1, [f1], names),
            rule.sqrt_factor(record, [batched], names),
        )
        kron1, kron = (
            rule.kron_factors(record1, [f1], names),
            rule.kron_factors(record, [batched], names),
        )
    for pname in names:
        _close(sqrt1[pname], sqrt[pname])
        for a, b in zip(kron1[pname], kron[pname]):
            _close(a, b)


def test_missing_factor_gives_zeros():
    module, x, kwargs, factor, record = _case("conv1d-groups-dilation")
    rule = find_rule(module)
    names = ["weight", "bias"]
    total = rule.diag_from_factor(record, [None], names, None, False)
    batch = rule.diag_from_factor(record, [None], names, None, True)
    kron = rule.kron_factors(record, [None], names)
    for pname, p in module.named_parameters():
        _close(total[pname], torch.zeros_like(p))
        _close(batch[pname], torch.zeros(x.shape[0], *p.shape, dtype=D))
        _close(kron[pname][0], torch.zeros(6, 6, dtype=D))
    _close(kron["weight"][1], rule.kron_factors(record, [factor], names)["weight"][1])


@pytest.mark.cpu_only  # the fold path is chosen on the CPU only (measured there)
def test_fold_path_on_large_grid_matches_unfold(monkeypatch):
    """A grid above the fold threshold takes the fold path by default; both paths agree."""
    torch.manual_seed(0)
    module = nn.Conv2d(16, 3, 3, padding=1).to(D)
    x = torch.randn(2, 16, 24, 24, dtype=D)
    assert convnd.prefer_fold(module, x, x.shape[2:])
    thin = nn.Conv2d(2, 3, 3, padding=1).to(D)  # few unfolded rows: unfolding is cheaper
    assert not convnd.prefer_fold(thin, torch.randn(2, 2, 24, 24, dtype=D), x.shape[2:])
    with torch.no_grad():
        out = module(x)
        factor = torch.randn(3, *out.shape, dtype=D)
        record = Record(module, (x,), {}, (out,), out)
        rule = find_rule(module)
        folded = rule.diag_from_factor(record, [factor], ["weight"], None, True)["weight"]
        monkeypatch.setattr(convnd, "_VMAP_MIN_POSITIONS", 10**9)
        assert not convnd.prefer_fold(module, x, x.shape[2:])
        unfolded = rule.diag_from_factor(record, [factor], ["weight"], None, True)["weight"]
    _close(folded, unfolded)


SECOND_CONV = [p for p in CONV_PROBLEMS if p in problems_with("second")]
SECOND_ORDER = [DiagGGNExact, BatchDiagGGNExact, SqrtGGNExact, DiagGGNMC, BatchDiagGGNMC]


def _second_order(problem, kron):
    model, x, lossfunc, y = problem.build()
    extend(model)
    extend(lossfunc)
    exts = [e() for e in SECOND_ORDER] + ([KFAC(), KFLR()] if kron else [])
    torch.manual_seed(1)
    loss = lossfunc(model(x), y)
    with backpack(*exts):
        loss.backward()
    fields = [e.savefield for e in exts]
    return {
        (name, field): getattr(p, field)
        for name, p in model.named_parameters()
        for field in fields
        if hasattr(p, field)
    }


@pytest.mark.parametrize("problem", SECOND_CONV, ids=[p.id for p in SECOND_CONV])
def test_engine_results_do_not_depend_on_path_or_chunks(problem, monkeypatch):
    kron = "kron" in problem.tags
    default = _second_order(problem, kron)
    monkeypatch.setitem(conv_rule._PAIR_CHUNK, "cpu", 1)
    monkeypatch.setattr(conv_rule, "_CHUNK_BUDGET", 1)
    monkeypatch.setattr(conv_rule, "_GRAM_MIN_ROWS", 1)
    with weight_jac_t_save_memory(True):
        folded = _second_order(problem, kron)
    assert folded.keys() == default.keys()
    for key, value in default.items():
        if isinstance(value, list):
            for a, b in zip(folded[key], value, strict=True):
                _close(a, b, str(key))
        else:
            _close(folded[key], value, str(key))


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_entries_match_autograd(name):
    module, x, kwargs, factor, record = _case(name)
    grad_out = factor[0]
    expected = _pair_reference(module, x, kwargs, factor[:1])
    rule = find_rule(module)
    for pname, ref in expected.items():
        total = ref[0].sum(0).flatten()
        every = torch.arange(total.numel())
        some = torch.tensor([total.numel() - 1, 0, total.numel() // 2, total.numel() // 2])
        with torch.no_grad():
            for index in (every, some):
                value = rule.grad_sum_entries(record, (grad_out,), pname, index)
                _close(value, total[index], pname)
