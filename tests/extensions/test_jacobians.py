"""BatchJacobian and `backpack.jacobians`: per-sample Jacobians of the model output in one
backward, against brute force (one autograd backward per output entry of every sample) and
against one BatchGrad pass per output entry, in float64."""

import pytest
import torch
from problems import DEVICE, problems_with
from torch import nn

import backpack
from backpack import backpack as backpack_context
from backpack import extend
from backpack.extensions import BatchGrad, BatchJacobian, SqrtGGNExact

#: expected warnings: problems of the table whose layers have no rule use the torch.func
#: fallback (it warns once per layer class), and torch's vmap notices missing batching rules
pytestmark = [
    pytest.mark.filterwarnings("ignore:backpack has no dedicated rule for:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:There is a performance drop because we have not yet implemented the batching "
        "rule:UserWarning"
    ),
]

DTYPE = torch.float64
SECOND = problems_with("second")


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-10, msg=msg)


def brute_force(model, x):
    """`{name: [N, D, *param.shape]}`: one backward per (sample, output entry)."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    out = model(x)
    flat = out.reshape(out.shape[0], -1)
    rows = []
    for n in range(flat.shape[0]):
        row = []
        for d in range(flat.shape[1]):
            grads = torch.autograd.grad(
                flat[n, d], list(params.values()), retain_graph=True, allow_unused=True
            )
            row.append(
                [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
            )
        rows.append(row)
    return out.detach(), {
        k: torch.stack([torch.stack([entry[i] for entry in row]) for row in rows])
        for i, k in enumerate(params)
    }


@pytest.mark.parametrize("problem", SECOND, ids=[p.id for p in SECOND])
def test_batch_jacobian_on_problem_table(problem):
    model, x, lossfunc, y = problem.build()
    out, expected = brute_force(model, x)
    extend(model)
    extend(lossfunc)
    # the loss only marks where the columns start: its value and weight do not matter
    loss = -0.5 * lossfunc(model(x), y)
    with backpack_context(BatchJacobian()):
        loss.backward()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        value = getattr(p, "jac_batch", None)
        if value is None:  # a parameter the output does not reach
            assert expected[name].abs().max() == 0, name
            continue
        assert value.shape == (out.shape[0], out[0].numel(), *p.shape), name
        close(value, expected[name], name)


def batch_grad_passes(model, x):
    """`{name: [N, C, *param.shape]}` from C BatchGrad passes on `out[:, c].sum()`."""
    columns = {}
    c_total = model(x).reshape(x.shape[0], -1).shape[1]
    for c in range(c_total):
        model.zero_grad()
        with backpack_context(BatchGrad()):
            model(x).reshape(x.shape[0], -1)[:, c].sum().backward()
        for name, p in model.named_parameters():
            columns.setdefault(name, []).append(p.grad_batch)
    return {k: torch.stack(v, 1) for k, v in columns.items()}


BY_ID = {p.id: p for p in SECOND}
#: an MLP, a CNN, a transformer block (sequence output [N, T, C])
SAME_AS_PASSES = ["linear-mlp-ce-mean", "conv2d-same-even-circular", "transformer-block-ce-sum"]


@pytest.mark.parametrize("problem_id", SAME_AS_PASSES)
def test_jacobians_equal_one_batch_grad_pass_per_output(problem_id):
    model, x, _, _ = BY_ID[problem_id].build()
    extend(model)
    expected = batch_grad_passes(model, x)
    out, jac = backpack.jacobians(model, x)
    for name, p in model.named_parameters():
        assert jac[name].shape == (*out.shape, *p.shape)
        close(jac[name].reshape(out.shape[0], -1, *p.shape), expected[name], name)


@pytest.mark.parametrize("problem", SECOND, ids=[p.id for p in SECOND])
def test_flat_jacobians_on_problem_table(problem):
    """`flatten=True` fills one buffer, in place where a rule can: same numbers as brute force,
    also for a subsample (where rules fall back to a copy)."""
    model, x, _, _ = problem.build()
    out, expected = brute_force(model, x)
    flat_expected = torch.cat([e.flatten(2) for e in expected.values()], -1)
    _, flat = backpack.jacobians(model, x, flatten=True)
    assert flat.shape == (out.shape[0], *out.shape[1:], flat_expected.shape[-1])
    assert flat.is_contiguous()
    close(flat.reshape(flat_expected.shape), flat_expected)
    rows = [out.shape[0] - 1, 0]
    _, sub = backpack.jacobians(model, x, flatten=True, subsampling=rows)
    close(sub.reshape(len(rows), *flat_expected.shape[1:]), flat_expected[rows])


def mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE).to(DEVICE)


def test_jacobians_function_shapes_flatten_subsampling_and_grads_untouched():
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(6, 4, dtype=DTYPE, device=DEVICE)
    out_ref, expected = brute_force(model, x)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    out, jac = backpack.jacobians(model, x)
    close(out, out_ref)
    assert not out.requires_grad
    for name, p in model.named_parameters():
        close(jac[name], expected[name].reshape(6, 3, *p.shape), name)
        assert not hasattr(p, "jac_batch")
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[2].weight.grad is None
    _, flat = backpack.jacobians(model, x, flatten=True)
    numel = sum(p.numel() for p in model.parameters())
    assert flat.shape == (6, 3, numel)
    close(flat, torch.cat([expected[k].flatten(2) for k in expected], -1))
    _, sub = backpack.jacobians(model, x, subsampling=[4, 1])
    for name in expected:
        close(sub[name].flatten(0, 1), expected[name][[4, 1]].flatten(0, 1), name)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.unused = nn.Linear(2, 2).to(DTYPE).to(DEVICE)

    def forward(self, x):
        return self.body(x)


def test_jacobians_frozen_and_unused_parameters():
    torch.manual_seed(0)
    model = WithUnused()
    model.body[0].bias.requires_grad_(False)
    x = torch.randn(5, 4, dtype=DTYPE, device=DEVICE)
    _, expected = brute_force(model, x)
    out, jac = backpack.jacobians(model, x)
    assert "body.0.bias" not in jac
    assert jac["unused.weight"].shape == (5, 3, 2, 2) and jac["unused.weight"].abs().max() == 0
    for name in expected:
        close(jac[name].flatten(0, 1), expected[name].flatten(0, 1), name)


def test_jacobians_refusals():
    model = mlp()
    x = torch.randn(5, 4, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="does not depend on any trainable parameter"):
        with torch.no_grad():
            backpack.jacobians(model.requires_grad_(False), x)
    with pytest.raises(TypeError, match="returning a tensor"):
        backpack.jacobians(Pair(), x)
    train_bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(DTYPE).to(DEVICE)
    with pytest.raises(NotImplementedError, match="BatchJacobian"):
        backpack.jacobians(train_bn, x)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(DTYPE).to(DEVICE)

    def forward(self, x):
        return self.lin(x), self.lin(x)


def test_sequence_output_columns_per_position_and_class():
    """[N, T, C] outputs: one Jacobian row per (t, c); a token loss on flattened logits
    ([N·T, C] rows) gives the same columns in the same (t, c) order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3)).to(DTYPE).to(DEVICE)
    x = torch.randn(2, 5, 4, dtype=DTYPE, device=DEVICE)
    _, expected = brute_force(model, x)
    out, jac = backpack.jacobians(model, x)
    for name, p in model.named_parameters():
        assert jac[name].shape == (2, 5, 3, *p.shape)
        close(jac[name].reshape(2, 15, *p.shape), expected[name], name)
    lossfunc = extend(nn.CrossEntropyLoss())
    y = torch.randint(0, 3, (2 * 5,), device=DEVICE)
    with backpack_context(BatchJacobian()):
        lossfunc(model(x).reshape(-1, 3), y).backward()
    for name, p in model.named_parameters():
        close(p.jac_batch, expected[name], name)


def test_with_sqrt_ggn_in_the_same_pass_and_several_losses():
    torch.manual_seed(0)
    model = extend(mlp())
    x = torch.randn(6, 4, dtype=DTYPE, device=DEVICE)
    y = torch.randint(0, 3, (6,), device=DEVICE)
    ce, mse = extend(nn.CrossEntropyLoss()), extend(nn.MSELoss())
    _, expected = brute_force(model, x)
    with backpack_context(SqrtGGNExact()):
        ce(model(x), y).backward()
    sqrt = {n: p.sqrt_ggn_exact.clone() for n, p in model.named_parameters()}
    # together in one pass: both as when alone
    with backpack_context(SqrtGGNExact(), BatchJacobian()):
        ce(model(x), y).backward()
    for name, p in model.named_parameters():
        close(p.sqrt_ggn_exact, sqrt[name], name)
        close(p.jac_batch, expected[name], name)
    # two losses: one block of columns each, in call order (here: the same output twice)
    out = model(x)
    with backpack_context(BatchJacobian()):
        (
            ce(out, y) + 3.0 * mse(out[:, :2], torch.zeros(6, 2, dtype=DTYPE, device=DEVICE))
        ).backward()
    for name, p in model.named_parameters():
        assert p.jac_batch.shape == (6, 5, *p.shape)
        close(p.jac_batch[:, :3], expected[name], name)
        close(p.jac_batch[:, 3:], expected[name][:, :2], name)


def test_any_extended_loss_starts_the_columns():
    """No loss Hessian is needed: a loss without second-order support works too."""
    torch.manual_seed(0)
    model = extend(mlp())
    x = torch.randn(4, 4, dtype=DTYPE, device=DEVICE)
    _, expected = brute_force(model, x)
    lossfunc = extend(nn.L1Loss())
    with backpack_context(BatchJacobian(), BatchGrad()):
        lossfunc(model(x), torch.zeros(4, 3, dtype=DTYPE, device=DEVICE)).backward()
    for name, p in model.named_parameters():
        close(p.jac_batch, expected[name], name)
        assert p.grad_batch.shape == (4, *p.shape)
    with pytest.raises(NotImplementedError, match="SqrtGGNExact does not support"):
        with backpack_context(BatchJacobian(), SqrtGGNExact()):
            lossfunc(model(x), torch.zeros(4, 3, dtype=DTYPE, device=DEVICE)).backward()


def test_too_many_columns_refused_clearly(monkeypatch):
    from backpack import secondorder

    monkeypatch.setattr(secondorder, "EXACT_FACTOR_MAX_ELEMENTS", 10)
    model = mlp()
    with pytest.raises(NotImplementedError, match="BatchJacobian needs unit columns"):
        backpack.jacobians(model, torch.randn(4, 4, dtype=DTYPE, device=DEVICE))


def test_repr_and_savefield():
    assert repr(BatchJacobian()) == "BatchJacobian()"
    assert BatchJacobian().savefield == "jac_batch"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_accumulate_concatenates_the_batches_rows(reduction):
    from backpack.curvature import accumulate

    torch.manual_seed(0)
    model = mlp()
    xs = [torch.randn(n, 4, dtype=DTYPE, device=DEVICE) for n in (3, 5)]
    batches = [(x, torch.randint(0, 3, (x.shape[0],), device=DEVICE)) for x in xs]
    _, expected = brute_force(model, torch.cat(xs))
    accumulate(model, nn.CrossEntropyLoss(reduction=reduction), batches, BatchJacobian())
    for name, p in model.named_parameters():
        close(p.jac_batch, expected[name], name)


def test_flat_jacobians_of_bfloat16_weights_and_autocast_are_float32():
    """16-bit layers: the one buffer is float32 (the rules' promoted results written in place),
    close to the float32 model's Jacobians."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DEVICE)
    x = torch.randn(6, 4, device=DEVICE)
    _, expected = backpack.jacobians(copy.deepcopy(model), x, flatten=True)
    half = copy.deepcopy(model).to(torch.bfloat16)
    _, flat = backpack.jacobians(half, x.to(torch.bfloat16), flatten=True)
    with torch.autocast(DEVICE.type, torch.bfloat16):
        _, autocast = backpack.jacobians(copy.deepcopy(model), x, flatten=True)
    for got in (flat, autocast):
        assert got.dtype == torch.float32 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.02)
