"""What counts as a sample: several losses, several forwards, siamese calls, flattened losses.

Every quantity is compared with brute force (`SampleCurvature`: per-sample gradients and GGNs of
the backward's per-sample terms by their definitions) in float64.
"""

import functools

import pytest
import torch
from problems import assert_same_grad
from problems.samples import SCENARIOS
from second_order_reference import SampleCurvature
from torch import nn

from backpack import backpack, extend
from backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDiagHessian,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)

ids = [s.id for s in SCENARIOS]
HESSIAN = [s for s in SCENARIOS if "hessian" in s.tags]


def scenario_id(scenario):
    return scenario.id


@functools.cache
def reference(scenario_id):
    scenario = next(s for s in SCENARIOS if s.id == scenario_id)
    model, losses, data = scenario.build()
    return SampleCurvature(
        model,
        lambda call: scenario.outputs(call, data),
        lambda outs: scenario.terms(outs, losses, data),
    )


def run(scenario, *exts, backward=True):
    model, losses, data = scenario.build()
    plain = {k: g.detach().clone() for k, g in _plain_grads(scenario).items()}
    extend(model)
    for lossfunc in losses.values():
        extend(lossfunc)
    loss = scenario.loss(model, losses, data)
    if backward:
        with backpack(*exts):
            loss.backward()
    return model, plain, loss


def _plain_grads(scenario):
    model, losses, data = scenario.build()
    scenario.loss(model, losses, data).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9, msg=msg)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=ids)
def test_first_order(scenario):
    ref = reference(scenario.id)
    subsampling = [0, 2, 2]
    model, plain, _ = run(
        scenario,
        BatchL2Grad(),
        SumGradSquared(),
        Variance(),
        BatchDotGrad(),
        BatchGrad(subsampling=subsampling),
    )
    for name, p in model.named_parameters():
        psg = ref.per_sample_grads(name)
        close(p.grad_batch, psg[subsampling], name)
        close(p.batch_l2, psg.flatten(1).square().sum(1), name)
        close(p.sum_grad_squared, psg.square().sum(0), name)
        close(p.variance, psg.var(0, unbiased=False), name)
        close(p.batch_dot, psg.flatten(1) @ psg.flatten(1).T, name)
        assert_same_grad(p.grad, plain[name])
    model, _, _ = run(scenario, BatchGrad())
    for name, p in model.named_parameters():
        close(p.grad_batch, ref.per_sample_grads(name), name)
        # rows sum to .grad whatever the sample layout
        close(p.grad_batch.sum(0), p.grad, name)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=ids)
def test_ggn_family(scenario):
    ref = reference(scenario.id)
    exts = [DiagGGNExact(), BatchDiagGGNExact(), GGNMP()]
    if not scenario.signed:
        exts.append(SqrtGGNExact())
    model, plain, _ = run(scenario, *exts)
    n = ref.grads.shape[0]
    for name, p in model.named_parameters():
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)
        mat = torch.randn(3, *p.shape, dtype=p.dtype, device=p.device)
        expected = (ref.block(ref.ggn, name) @ mat.flatten(1).T).T.reshape(mat.shape)
        close(p.ggnmp(mat), expected, name)
        if not scenario.signed:
            sqrt = p.sqrt_ggn_exact
            assert sqrt.shape[1] == n and sqrt.shape[2:] == p.shape
            flat = sqrt.flatten(2)
            close(torch.einsum("vnp,vnq->npq", flat, flat), ref.block(ref.ggn_per_sample, name))
        assert_same_grad(p.grad, plain[name])


@pytest.mark.parametrize("scenario", HESSIAN, ids=scenario_id)
def test_hessian_family(scenario):
    ref = reference(scenario.id)
    model, _, _ = run(scenario, DiagHessian(), HMP())
    for name, p in model.named_parameters():
        close(p.diag_h, ref.diag(ref.hessian, name), name)
        mat = torch.randn(2, *p.shape, dtype=p.dtype, device=p.device)
        expected = (ref.block(ref.hessian, name) @ mat.flatten(1).T).T.reshape(mat.shape)
        close(p.hmp(mat), expected, name)


@pytest.mark.parametrize("scenario", HESSIAN, ids=scenario_id)
def test_per_sample_hessian_diagonal_sums_to_the_diagonal(scenario):
    model, _, _ = run(scenario, DiagHessian(), BatchDiagHessian())
    for name, p in model.named_parameters():
        close(p.diag_h_batch.sum(0), p.diag_h, name)


def _scenario(prefix):
    return [s for s in SCENARIOS if s.id.startswith(prefix)]


@pytest.mark.parametrize(
    "scenario", _scenario("multitask") + _scenario("two-forwards"), ids=scenario_id
)
def test_kflr_output_factor_adds_up_losses_and_forwards(scenario):
    """For Linear layers on `[N, D]` inputs G is the bias's GGN block; A averages all inputs."""
    ref = reference(scenario.id)
    model, _, _ = run(scenario, KFLR())
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        prefix = f"{name}." if name else ""
        g, a = module.weight.kflr
        close(g, ref.block(ref.ggn, prefix + "bias"), name)
        close(module.bias.kflr[0], g, name)
        assert a.shape == (module.in_features, module.in_features)
    if scenario.id.startswith("two-forwards"):
        _, _, data = scenario.build()
        x = torch.cat([data["x1"], data["x2"]])
        close(model[0].weight.kflr[1], x.T @ x / x.shape[0])


@pytest.mark.parametrize("scenario", _scenario("flattened-ce"), ids=scenario_id)
def test_flattened_loss_kronecker_factors_match_the_unflattened_layout(scenario):
    """KFLR of `logits.view(-1, C)` equals KFLR of the same logits as `[N, C, T]`."""
    model, losses, data = scenario.build()
    extend(model)
    ce = extend(losses["ce"])
    results = []
    for flat in (True, False):
        out = model(data["x"])
        loss = scenario.loss(model, losses, data) if flat else ce(out.permute(0, 2, 1), data["y"])
        torch.manual_seed(3)
        with backpack(KFLR(), KFAC(mc_samples=2), SqrtGGNMC(mc_samples=2)):
            loss.backward()
        results.append({k: (p.kflr, p.kfac, p.sqrt_ggn_mc) for k, p in model.named_parameters()})
    for name, (kflr, kfac, sqrt_mc) in results[0].items():
        for got, expected in zip(kflr, results[1][name][0]):
            close(got, expected, name)
        # sampled columns are shared by a sample's positions, as for [N, C, T] logits
        n, _ = data["y"].shape
        assert sqrt_mc.shape[:2] == (2, n)
        if "batch-major" in scenario.id:  # the same rows in the same order: the same draws
            close(sqrt_mc, results[1][name][2], name)
            for got, expected in zip(kfac, results[1][name][1]):
                close(got, expected, name)


def test_negative_weight_refuses_square_roots_only():
    scenario = next(s for s in SCENARIOS if s.signed)
    with pytest.raises(NotImplementedError, match="negative weight.*no real square root"):
        run(scenario, SqrtGGNExact())
    with pytest.raises(NotImplementedError, match="negative weight"):
        run(scenario, SqrtGGNMC())
    # Kronecker factors subtract that loss's output factor
    model, _, _ = run(scenario, KFLR())
    ref = reference(scenario.id)
    close(model.cls.weight.kflr[0], ref.block(ref.ggn, "cls.bias"))
    close(model.reg.weight.kflr[0], ref.block(ref.ggn, "reg.bias"))


def test_sqrt_columns_of_every_loss_concatenated():
    scenario = next(s for s in SCENARIOS if s.id == "multitask-mean-0.3-2.0")
    model, _, _ = run(scenario, SqrtGGNExact(), SqrtGGNMC(mc_samples=3))
    # CE has 3 columns, MSE 2; the heads get zero columns for the loss they do not reach
    for p in model.parameters():
        assert p.sqrt_ggn_exact.shape[:2] == (5, 6)
        assert p.sqrt_ggn_mc.shape[:2] == (6, 6)
    assert model.cls.weight.sqrt_ggn_exact[3:].abs().max() == 0
    assert model.reg.weight.sqrt_ggn_exact[:3].abs().max() == 0
    assert model.trunk[0].weight.sqrt_ggn_exact[3:].abs().max() > 0


def test_two_forwards_rows_follow_the_loss_calls():
    """Row n < N1 holds the first batch's sample n; rows of the same samples in one call add."""
    scenario = next(s for s in SCENARIOS if s.id == "two-forwards-mean-3-3")
    model, _, _ = run(scenario, BatchGrad())
    ref = reference(scenario.id)
    grad_batch = model[0].weight.grad_batch
    assert grad_batch.shape[0] == 6
    close(grad_batch, ref.per_sample_grads("0.weight"))
    # the old behaviour (rows of both batches summed) is not what we store
    assert not torch.allclose(grad_batch[:3], grad_batch[:3] + grad_batch[3:])


def test_previous_graph_and_unused_forward_are_ignored():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).to(torch.float64))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    previous = lossfunc(model(x), y)
    previous.backward()  # its graph is still referenced
    unused = model(torch.randn(7, 4, dtype=torch.float64))  # never reaches a loss
    model.zero_grad()
    loss = lossfunc(model(x), y)
    with backpack(KFAC(), KFLR(), KFRA(), BatchGrad(), DiagHessian(), SqrtGGNExact()):
        loss.backward()
    fresh = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).to(torch.float64)
    fresh.load_state_dict(model.state_dict())
    extend(fresh)
    with backpack(KFLR(), BatchGrad(), DiagHessian(), SqrtGGNExact()):
        lossfunc(fresh(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert p.grad_batch.shape[0] == 5
        close(p.grad_batch, q.grad_batch, name)
        close(p.diag_h, q.diag_h, name)
        close(p.sqrt_ggn_exact, q.sqrt_ggn_exact, name)
        for a, b in zip(p.kflr, q.kflr):
            close(a, b, name)
    assert unused.shape == (7, 2) and previous.requires_grad


def test_call_reaching_no_extended_loss_among_several_sample_sets_is_refused():
    model = extend(nn.Sequential(nn.Linear(4, 3)).to(torch.float64))
    lossfunc = extend(nn.CrossEntropyLoss())
    x1, x2, x3 = (torch.randn(n, 4, dtype=torch.float64) for n in (2, 3, 4))
    loss = (
        lossfunc(model(x1), torch.zeros(2, dtype=torch.long))
        + lossfunc(model(x2), torch.zeros(3, dtype=torch.long))
        + model(x3).square().sum()  # a third forward that reaches no extended loss
    )
    with pytest.raises(RuntimeError, match="reaches none of the extended loss functions"):
        with backpack(BatchGrad()):
            loss.backward()


def test_several_calls_with_different_sizes_without_extended_loss_are_refused():
    model = extend(nn.Linear(4, 3).to(torch.float64))
    x1, x2 = torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    loss = model(x1).square().sum() + model(x2).square().sum()
    with pytest.raises(RuntimeError, match="different numbers of samples.*Extend the loss"):
        with backpack(BatchGrad()):
            loss.backward()


class _ScaledByPositions(nn.Module):
    """Token features scaled (not shifted) by a position embedding looked up without a sample
    axis: `emb(arange(T))` is broadcast over the samples by a product."""

    def __init__(self, through_matmul: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.pos = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 2)
        self.through_matmul = through_matmul

    def forward(self, x):
        h = self.inp(x)  # [N, T, 4]
        p = self.pos(torch.arange(x.shape[1], device=x.device))  # [T, 4]: no sample axis
        if self.through_matmul:
            h = h + (h @ p.T) @ p  # [N, T, T] then [N, T, 4]: p broadcast by matmul
        else:
            h = h * p
        return self.out(torch.tanh(h)).flatten(1)


@pytest.mark.parametrize("through_matmul", [False, True], ids=["product", "matmul"])
@pytest.mark.parametrize("extension", [BatchGrad, DiagGGNExact], ids=lambda e: e.__name__)
def test_sample_free_lookup_broadcast_by_a_product_is_refused(through_matmul, extension):
    """With T == N the leading axis of the lookup would pass for the samples: refused, not
    silently wrong (through matmul the lookup is an operand of a matrix product over merged
    sample and position rows: refused by the sample-count check)."""
    torch.manual_seed(0)
    model = extend(_ScaledByPositions(through_matmul).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    x = torch.randn(5, 5, 3, dtype=torch.float64)  # N == T == 5
    y = torch.randint(0, 10, (5,))
    expected = (RuntimeError, NotImplementedError) if through_matmul else NotImplementedError
    with pytest.raises(expected, match="no sample axis|samples along its batch axis"):
        with backpack(extension()):
            lossfunc(model(x), y).backward()
    # the same model with the position embedding frozen is fine
    model.pos.weight.requires_grad_(False)
    model.zero_grad()
    with backpack(BatchGrad()):
        lossfunc(model(x), y).backward()
    assert model.inp.weight.grad_batch.shape == (5, 4, 3)



def test_model_owned_parameters_meet_the_samples_without_torch_func(recwarn):
    """A class token (expanded) and a position embedding (added) owned by the model itself: their
    per-sample gradients come from where they are broadcast, even with dropout in training mode
    (the forward's own masks; the torch.func fallback would have to refuse)."""
    from problems import reference_per_sample_grads
    from problems.containers import TokensWithClassToken

    torch.manual_seed(0)
    model = TokensWithClassToken().double()
    model.mlp.insert(2, nn.Dropout(0.3))
    model.train()
    lossfunc = nn.CrossEntropyLoss()
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    torch.manual_seed(1)
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    extend(model), extend(lossfunc)
    torch.manual_seed(1)  # the same dropout masks
    with backpack(BatchGrad(), Variance()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, reference[name], msg=name)
        torch.testing.assert_close(p.variance, reference[name].var(0, unbiased=False), msg=name)
        torch.testing.assert_close(p.grad, reference[name].sum(0), msg=name)
    assert not [w for w in recwarn if "no dedicated rule" in str(w.message)]


@pytest.mark.parametrize("setting", ["bf16 weights", "autocast"])
def test_model_owned_parameters_in_mixed_precision_are_float32_and_close(setting):
    """Site shares of a bf16 model (or under bf16 autocast) are stored in float32, like every
    rule's, within bfloat16's error of the float64 per-sample gradients."""
    from problems import reference_per_sample_grads
    from problems.containers import TokensWithClassToken

    torch.manual_seed(0)
    exact = TokensWithClassToken().double()
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    reference = reference_per_sample_grads(exact, x, nn.CrossEntropyLoss(), y)
    model = extend(TokensWithClassToken())
    model.load_state_dict(exact.state_dict())
    xs = x.float()
    if setting == "bf16 weights":
        model, xs = model.bfloat16(), x.bfloat16()
    lossfunc = extend(nn.CrossEntropyLoss())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast"):
        loss = lossfunc(model(xs), y)
    with backpack(BatchGrad()):
        loss.backward()
    for name in ("cls_token", "pos_embed"):
        value = getattr(model, name).grad_batch
        assert value.dtype == torch.float32, name
        error = (value.double() - reference[name]).norm() / reference[name].norm()
        assert error < 0.05, (name, float(error))
