"""LayerNorm, RMSNorm, GroupNorm and InstanceNorm rules beyond the shared table.

The table (tests/problems/norm.py) checks every quantity against brute force. Here: the fused
reductions against the materialised per-sample gradients at rule level (with and without the
per-record cache), subsampling without the cache, probe entries, one contraction per call for
all first-order extensions together, the dense Kronecker factors (KFLR, KFAC, KFRA) against
their definitions, unbatched InstanceNorm, frozen parameters, and the exact-Hessian extensions'
refusal.
"""

import warnings

import pytest
import torch
from problems import (
    DTYPE,
    check_first_order_without_fallback,
    first_order_reference,
    problems_with,
    reference_per_sample_grads,
)
from second_order_reference import Curvature
from torch import nn
from torch.func import functional_call, jacrev

from backpack import backpack, extend
from backpack.extensions import (
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagHessian,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from backpack.recording import Record
from backpack.rules import find_rule
from backpack.rules import norm as norm_rules
from backpack.utils.kroneckers import kfacs_to_mat

NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)


def _cases():
    """(module, input shape) covering every layer and option."""
    return [
        (nn.LayerNorm(4), (5, 4)),
        (nn.LayerNorm(4, bias=False), (5, 3, 4)),
        (nn.LayerNorm((2, 3)), (5, 4, 2, 3)),
        (nn.RMSNorm(4), (5, 3, 4)),
        (nn.RMSNorm((2, 3), eps=1e-2), (5, 2, 3)),
        (nn.GroupNorm(2, 4), (5, 4, 3)),
        (nn.GroupNorm(2, 4), (5, 4)),
        (nn.GroupNorm(3, 6), (5, 6, 2, 3)),
        (nn.InstanceNorm1d(3, affine=True), (5, 3, 4)),
        (nn.InstanceNorm2d(3, affine=True, track_running_stats=True).eval(), (5, 3, 2, 2)),
        (nn.InstanceNorm3d(2, affine=True, track_running_stats=True), (5, 2, 2, 2, 2)),
    ]


CASES = _cases()
CASE_IDS = [f"{m.__class__.__name__}-{'x'.join(map(str, s))}-{i}" for i, (m, s) in enumerate(CASES)]


def _record(index):
    """A fresh record of case `index` with random parameters, statistics and output gradient."""
    torch.manual_seed(index)
    module, shape = _cases()[index]
    module = module.to(DTYPE)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
        if getattr(module, "running_mean", None) is not None:
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    x = torch.randn(*shape, dtype=DTYPE)
    y = module(x)
    record = Record(module, (x,), {}, (y,), y)
    record.out_requires_grad = (True,)
    names = [n for n, _ in module.named_parameters()]
    return module, record, (torch.randn_like(y),), names


def _reference(module, record, grads, names):
    """Per-sample gradients by one autograd call per sample (also for tracked statistics)."""
    x, g = record.args[0], grads[0]
    params = [getattr(module, n) for n in names]
    y = module(x)
    rows = [
        torch.autograd.grad((y[i] * g[i]).sum(), params, retain_graph=True) for i in range(len(x))
    ]
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}


def test_every_layer_has_a_dedicated_rule():
    for module, _ in CASES:
        rule = find_rule(module)
        assert isinstance(rule, norm_rules._PerSampleNormRule), module


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASE_IDS)
@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached"])
def test_fused_reductions_and_entries(index, cached):
    """Each fused method on a fresh record and on one whose per-sample gradients are cached."""
    module, _, grads, names = _record(index)
    rule = find_rule(module)
    psg = _reference(module, _record(index)[1], grads, names)

    def record():
        r = _record(index)[1]
        if cached:
            rule.per_sample_grads(r, grads, names)
        return r

    for quantity in ["batch_l2", "sum_grad_squared", "batch_dot"]:
        values = getattr(rule, quantity)(record(), grads, names)
        for name in names:
            expected = first_order_reference(psg[name], quantity)
            torch.testing.assert_close(values[name], expected, msg=f"{name} {quantity}")
    total = rule.grad_sum(record(), grads, names)
    for name in names:
        torch.testing.assert_close(total[name], psg[name].sum(0), msg=name)
        numel = psg[name][0].numel()
        index_ = torch.tensor([numel - 1, 0, numel // 2])
        entries = rule.grad_sum_entries(record(), grads, name, index_)
        torch.testing.assert_close(entries, psg[name].sum(0).flatten()[index_], msg=name)
    sub = rule.per_sample_grads(record(), grads, names, subsampling=[4, 0, 4])
    for name in names:
        torch.testing.assert_close(sub[name], psg[name][[4, 0, 4]], msg=name)


@pytest.mark.parametrize("index", range(len(CASES)), ids=CASE_IDS)
def test_sqrt_and_diag_from_factor(index):
    """Jᵀ f per column equals the per-sample gradient with f as output gradient; diagonals."""
    module, record, _, names = _record(index)
    rule = find_rule(module)
    factor = torch.randn(3, *record.outputs[0].shape, dtype=DTYPE)
    sqrt = rule.sqrt_factor(record, [factor], names)
    coef = torch.rand(3, factor.shape[1], dtype=DTYPE)
    for name in names:
        columns = torch.stack([_reference(module, record, (f,), [name])[name] for f in factor])
        torch.testing.assert_close(sqrt[name], columns, msg=name)
        weights = coef.reshape(*coef.shape, *[1] * (columns.dim() - 2))
        for per_sample in (False, True):
            diag = rule.diag_from_factor(record, [factor], [name], coef, per_sample)[name]
            expected = (columns.square() * weights).sum(0)
            expected = expected if per_sample else expected.sum(0)
            torch.testing.assert_close(diag, expected, msg=name)
    sub = rule.sqrt_factor(record, [factor], names, subsampling=[2, 2, 0])
    for name in names:
        torch.testing.assert_close(sub[name], sqrt[name][:, [2, 2, 0]], msg=name)
    none = rule.sqrt_factor(record, [None], names)
    assert all(v.abs().max() == 0 for v in none.values())


def _norm_problems(tag):
    """Problems of the table with a normalisation layer of this file."""
    return [
        p for p in problems_with(tag) if any(isinstance(m, NORMS) for m in p.build()[0].modules())
    ]


NORM_FIRST = _norm_problems("first")
NORM_KRON = _norm_problems("kron")


def test_table_has_the_norm_problems():
    assert len(NORM_FIRST) >= 20


@pytest.mark.parametrize("problem", NORM_FIRST, ids=[p.id for p in NORM_FIRST])
def test_one_contraction_per_call_and_no_generic_fallback(problem, monkeypatch):
    """All first-order extensions at once: x̂ is computed once per norm call, never torch.func."""
    calls = []
    for cls in {type(find_rule(m)) for m in problem.build()[0].modules() if isinstance(m, NORMS)}:
        original = cls.normalised

        def counting(self, record, x, original=original):
            # views of a call (moved sample axis) are short-lived: count the call itself
            calls.append(id(record.origin or record))
            return original(self, record, x)

        monkeypatch.setattr(cls, "normalised", counting)

    model = check_first_order_without_fallback(problem, monkeypatch)
    layers = sum(
        isinstance(m, NORMS) and any(True for _ in m.parameters()) for m in model.modules()
    )
    assert len(calls) == len(set(calls)) == layers


def _norm_params(model):
    return [
        (f"{mn}.{pn}" if mn else pn, p)
        for mn, m in model.named_modules()
        if isinstance(m, NORMS)
        for pn, p in m.named_parameters(recurse=False)
    ]


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("problem", NORM_KRON, ids=[p.id for p in NORM_KRON])
def test_kflr_and_kfac_are_dense_curvature_blocks(problem):
    """KFLR: the exact GGN block; KFAC: Σ (Jᵀ f)(Jᵀ f)ᵀ of the same MC factor as SqrtGGNMC."""
    model, x, lossfunc, y = problem.build()
    ref = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    extend(model)
    extend(lossfunc)
    torch.manual_seed(5)
    with backpack(KFLR(), KFAC(mc_samples=3)):
        lossfunc(model(x), y).backward()
    kfac = {n: p.kfac for n, p in _norm_params(model)}
    torch.manual_seed(5)
    with backpack(SqrtGGNMC(mc_samples=3)):
        lossfunc(model(x), y).backward()
    for name, p in _norm_params(model):
        assert len(p.kflr) == 1 and p.kflr[0].shape == (p.numel(), p.numel())
        torch.testing.assert_close(kfacs_to_mat(p.kflr), ref.block(ref.ggn, name), msg=name)
        sqrt = p.sqrt_ggn_mc.flatten(2)
        torch.testing.assert_close(
            kfacs_to_mat(kfac[name]), torch.einsum("vnp,vnq->pq", sqrt, sqrt), msg=name
        )


# --- KFRA --------------------------------------------------------------------------------------


def _kfra_reference(model, x, lossfunc, y):
    """KFRA by its definition on a chain: Ḡ ← (1/N) Σ_n J_nᵀ Ḡ J_n, dense per-sample Jacobians.

    Returns the dense factor of every normalisation parameter and G of every Linear weight
    (for 2-D Linear inputs).
    """
    n = x.shape[0]
    acts = [x]
    for m in model:
        acts.append(m(acts[-1]).detach())
    out = acts[-1]

    def loss_of(o):
        return lossfunc(o.reshape(out.shape), y)

    gbar = jacrev(jacrev(loss_of))(out.flatten()).reshape(n, out[0].numel(), n, -1)
    gbar = sum(gbar[i, :, i] for i in range(n))
    found = {}
    for i in reversed(range(len(model))):
        m, a = model[i], acts[i]
        if isinstance(m, NORMS):
            for name, p in m.named_parameters():

                def f(value, sample, m=m, name=name):
                    return functional_call(m, {name: value}, (sample,)).flatten()

                jac = [jacrev(f)(p.detach(), a[j : j + 1]).flatten(1) for j in range(n)]
                found[(i, name)] = sum(j.T @ gbar @ j for j in jac) / n
        if isinstance(m, nn.Linear):
            found[(i, "G")] = gbar
        jac = [jacrev(lambda s, m=m: m(s).flatten())(a[j : j + 1]).flatten(1) for j in range(n)]
        gbar = sum(j.T @ gbar @ j for j in jac) / n
    return found


KFRA_MODELS = {
    "layernorm-flat": (
        lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)),
        (6, 4),
    ),
    "layernorm-seq": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Flatten(), nn.Linear(8, 3)),
        (5, 2, 3),
    ),
    "rmsnorm-groupnorm": (
        lambda: nn.Sequential(
            nn.Linear(4, 4), nn.RMSNorm(4), nn.Linear(4, 4), nn.GroupNorm(2, 4), nn.Linear(4, 3)
        ),
        (5, 4),
    ),
    "instancenorm": (
        lambda: nn.Sequential(
            nn.InstanceNorm1d(2, affine=True), nn.Flatten(), nn.Sigmoid(), nn.Linear(6, 3)
        ),
        (4, 2, 3),
    ),
}


@pytest.mark.parametrize("key", list(KFRA_MODELS))
def test_kfra_dense_factors_match_the_recursion(key):
    make, shape = KFRA_MODELS[key]
    torch.manual_seed(2)
    model = make().to(DTYPE)
    with torch.no_grad():
        for m in model:
            if isinstance(m, NORMS):
                for p in m.parameters():
                    p.normal_()
    x = torch.randn(*shape, dtype=DTYPE)
    y = torch.randint(0, 3, (shape[0],))
    lossfunc = nn.CrossEntropyLoss()
    expected = _kfra_reference(model, x, lossfunc, y)
    extend(model)
    with backpack(KFRA()):
        extend(lossfunc)(model(x), y).backward()
    for (i, name), value in expected.items():
        if name == "G":
            if model[i].weight.kfra[1].shape[0] == model[i].in_features and key != "layernorm-seq":
                torch.testing.assert_close(model[i].weight.kfra[0], value, msg=f"{i} G")
            continue
        factors = getattr(model[i], name).kfra
        assert len(factors) == 1
        torch.testing.assert_close(factors[0], value, msg=f"{i} {name}")


# --- exact Hessian: refused --------------------------------------------------------------------

HESSIAN_MODELS = {
    "layernorm-first": lambda: nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 3)),
    "layernorm-between": lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 3)),
    "rmsnorm": lambda: nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4), nn.Linear(4, 3)),
    "groupnorm": lambda: nn.Sequential(nn.Linear(4, 4), nn.GroupNorm(2, 4), nn.Linear(4, 3)),
    "layernorm-no-affine": lambda: nn.Sequential(
        nn.Linear(4, 4), nn.LayerNorm(4, elementwise_affine=False), nn.Linear(4, 3)
    ),
}


@pytest.mark.parametrize("ext", [DiagHessian, BatchDiagHessian, HMP, PCHMP])
@pytest.mark.parametrize("key", list(HESSIAN_MODELS))
def test_exact_hessian_extensions_refuse_norm_layers(key, ext):
    """Nonlinear in their input: no silent GGN-only numbers, a clear error naming the layer."""
    model = extend(HESSIAN_MODELS[key]().to(DTYPE))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(5, 4, dtype=DTYPE), torch.randint(0, 3, (5,))
    name = next(m for m in model if isinstance(m, NORMS)).__class__.__name__
    with pytest.raises(NotImplementedError, match=name), backpack(ext()):
        lossfunc(model(x), y).backward()


# --- other cases -------------------------------------------------------------------------------


def test_unbatched_instance_norm_is_one_sample():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.InstanceNorm1d(3, affine=True), nn.Tanh()).to(DTYPE))
    with torch.no_grad():
        model[0].weight.normal_()
    x = torch.randn(3, 5, dtype=DTYPE)
    with backpack(BatchGrad(), BatchL2Grad(), SumGradSquared()):
        model(x).square().sum().backward()
    for p in model[0].parameters():
        assert p.grad_batch.shape == (1, 3)
        torch.testing.assert_close(p.grad_batch[0], p.grad)
        torch.testing.assert_close(p.batch_l2, p.grad.square().sum()[None])
        torch.testing.assert_close(p.sum_grad_squared, p.grad.square())
    record = Record(model[0], (x,), {}, (model[0](x),), None)
    factor = torch.randn(2, 3, 5, dtype=DTYPE)
    sqrt = find_rule(model[0]).sqrt_factor(record, [factor], ["weight"])["weight"]
    assert sqrt.shape == (2, 1, 3)


def test_frozen_weight_and_first_with_second_order():
    """γ frozen: β alone gets quantities; first- and second-order extensions in one backward."""
    problem = next(p for p in NORM_FIRST if p.id == "transformer-block-ce-mean")
    model, x, lossfunc, y = problem.build()
    model[1].weight.requires_grad_(False)
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    ref = Curvature(model, x, lossfunc, y, hessian=False, per_sample=False)
    extend(model)
    extend(lossfunc)
    with backpack(BatchL2Grad(), Variance(), DiagGGNExact()):
        lossfunc(model(x), y).backward()
    assert not hasattr(model[1].weight, "batch_l2")
    bias = model[1].bias
    torch.testing.assert_close(
        bias.batch_l2, first_order_reference(reference["1.bias"], "batch_l2")
    )
    torch.testing.assert_close(
        bias.variance, first_order_reference(reference["1.bias"], "variance")
    )
    torch.testing.assert_close(bias.diag_ggn_exact, ref.diag(ref.ggn, "1.bias"))


# --- engine behaviour around these rules ------------------------------------------------------


def test_no_coverage_warning_for_bias_cancelled_by_instance_norm():
    torch.manual_seed(0)
    model = extend(
        nn.Sequential(
            nn.Conv1d(2, 3, 2), nn.InstanceNorm1d(3, affine=True), nn.Flatten(), nn.Linear(15, 2)
        )
    )
    x, y = torch.randn(8, 2, 6), torch.randint(0, 2, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            with backpack(BatchL2Grad()):
                nn.CrossEntropyLoss()(model(x), y).backward()


def test_ggnmp_leaves_running_statistics_alone():
    from backpack.extensions import GGNMP

    torch.manual_seed(0)
    norm = nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    model = extend(nn.Sequential(nn.Conv1d(2, 3, 2), norm, nn.Flatten(), nn.Linear(15, 2)))
    loss = extend(nn.CrossEntropyLoss())(model(torch.randn(4, 2, 6)), torch.randint(0, 2, (4,)))
    before = norm.running_mean.clone()
    with warnings.catch_warnings(), backpack(GGNMP()):
        warnings.simplefilter("ignore")  # the coverage false positive of the test above
        loss.backward()
    norm.weight.ggnmp(torch.randn(2, 3))
    torch.testing.assert_close(norm.running_mean, before, rtol=0, atol=0)
