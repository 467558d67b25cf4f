"""Convolution-specific checks: both weight-gradient algorithms, fused paths, save-memory switch."""

import warnings

import pytest
import torch
from problems import first_order_reference, reference_per_sample_grads
from problems.conv import PROBLEMS as CONV_PROBLEMS
from torch import nn

from backpack import backpack, extend
from backpack.core.derivatives import convnd
from backpack.core.derivatives.convnd import weight_grad_sum, weight_jac_t_save_memory
from backpack.extensions import (
    KFLR,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    SumGradSquared,
    Variance,
)
from backpack.recording import Record
from backpack.rules import conv as conv_rule
from backpack.rules import find_rule
from backpack.rules.conv import _weight_entries_by_slices

D = torch.float64
QUANTITIES = {
    "grad_batch": BatchGrad,
    "batch_l2": BatchL2Grad,
    "sum_grad_squared": SumGradSquared,
    "variance": Variance,
    "batch_dot": BatchDotGrad,
}

# (module, input shape, forward kwargs)
CASES = {
    "conv1d-groups-dilation": (
        lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2), (3, 4, 11), {}
    ),
    "conv1d-same-even-reflect": (
        lambda: nn.Conv1d(2, 3, 4, padding="same", padding_mode="reflect"), (3, 2, 9), {}
    ),
    "conv2d-circular-groups": (
        lambda: nn.Conv2d(
            4, 6, (2, 3), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2,
            padding_mode="circular",
        ),
        (3, 4, 7, 8),
        {},
    ),
    "conv2d-same-even-dilated": (
        lambda: nn.Conv2d(2, 3, (2, 4), padding="same", dilation=(2, 1)), (3, 2, 6, 7), {}
    ),
    "conv2d-large-circular-pad": (
        lambda: nn.Conv2d(2, 3, 5, stride=3, padding=4, dilation=2, padding_mode="circular"),
        (3, 2, 6, 7),
        {},
    ),
    "conv2d-valid-replicate": (
        lambda: nn.Conv2d(2, 3, 3, padding="valid", padding_mode="replicate"), (3, 2, 6, 7), {}
    ),
    "conv3d-replicate-groups": (
        lambda: nn.Conv3d(
            2, 4, (2, 3, 2), stride=(1, 2, 2), padding=(1, 0, 1), groups=2,
            padding_mode="replicate",
        ),
        (2, 2, 5, 6, 5),
        {},
    ),
    "convtranspose1d-outpad-groups": (
        lambda: nn.ConvTranspose1d(4, 6, 3, stride=3, padding=1, output_padding=2, groups=2),
        (3, 4, 5),
        {},
    ),
    "convtranspose1d-outpad-beyond-stride": (
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=1, dilation=3, output_padding=2), (3, 2, 5), {}
    ),
    "convtranspose2d-output-size": (
        lambda: nn.ConvTranspose2d(
            2, 4, (3, 2), stride=(2, 3), padding=(1, 0), dilation=(2, 1), groups=2
        ),
        (3, 2, 4, 5),
        {"output_size": [9, 14]},
    ),
    "convtranspose2d-padding-beyond-kernel": (
        lambda: nn.ConvTranspose2d(2, 3, 2, padding=3, bias=False), (3, 2, 9, 9), {}
    ),
    "convtranspose3d-outpad": (
        lambda: nn.ConvTranspose3d(2, 2, (2, 3, 2), stride=2, padding=(0, 1, 1),
                                   output_padding=(1, 0, 1)),
        (2, 2, 3, 4, 3),
        {},
    ),
}


def _brute_force(module, x, grad_out, kwargs):
    """Per-sample parameter gradients of <module(x_n), grad_out_n>, one autograd call each."""
    params = [p for p in module.parameters()]
    rows = []
    for n in range(x.shape[0]):
        out = module(x[n : n + 1], **kwargs)
        rows.append(torch.autograd.grad(out, params, grad_out[n : n + 1]))
    return {
        name: torch.stack([r[i] for r in rows])
        for i, (name, _) in enumerate(module.named_parameters())
    }


def _case(name):
    make, shape, kwargs = CASES[name]
    torch.manual_seed(0)
    module = make().to(D)
    x = torch.randn(shape, dtype=D)
    with torch.no_grad():
        out = module(x, **kwargs)
    grad_out = torch.randn_like(out)
    return module, x, grad_out, kwargs


def _record(module, x, out, kwargs):
    return Record(module, (x,), kwargs, (out,), out)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths:UserWarning")
@pytest.mark.parametrize("name", list(CASES))
def test_both_weight_gradient_algorithms_match_autograd(name, monkeypatch):
    module, x, grad_out, kwargs = _case(name)
    expected = _brute_force(module, x, grad_out, kwargs)
    with torch.no_grad():
        a, b = convnd.weight_grad_factors(module, x, grad_out)
        unfolded = convnd.per_sample_weight_grads_from_factors(module, a, b)
        batched = convnd.per_sample_weight_grads_vmap(module, x, grad_out)
        summed = convnd.weight_grad_sum(module, x, grad_out)
        # chunks of two samples, then of one
        per_sample = convnd.unfolded_elements_per_sample(module, x, grad_out)
        chunked = []
        for budget in (2 * per_sample, 1):
            monkeypatch.setitem(convnd._UNFOLD_CHUNK, "cpu", budget)
            chunked.append(convnd.per_sample_weight_grads_unfold(module, x, grad_out))
    for value in chunked:
        torch.testing.assert_close(value, expected["weight"])
    torch.testing.assert_close(unfolded, expected["weight"])
    torch.testing.assert_close(batched, expected["weight"])
    torch.testing.assert_close(summed, expected["weight"].sum(0))


@pytest.mark.parametrize("save_memory", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_rule_quantities_match_autograd(name, save_memory, monkeypatch):
    # a tiny chunk budget makes the save-memory reductions run over several chunks
    monkeypatch.setattr(conv_rule, "_CHUNK_BUDGET", 64)
    module, x, grad_out, kwargs = _case(name)
    expected = _brute_force(module, x, grad_out, kwargs)
    rule = find_rule(module)
    assert isinstance(rule, conv_rule.ConvRule)
    record = _record(module, x, module(x, **kwargs).detach(), kwargs)
    names = [n for n, _ in module.named_parameters()]
    with torch.no_grad(), weight_jac_t_save_memory(save_memory):
        psg = rule.per_sample_grads(record, (grad_out,), names)
        sub = rule.per_sample_grads(record, (grad_out,), names, subsampling=[1, 0, 1])
        fused = {
            "batch_l2": rule.batch_l2(record, (grad_out,), names),
            "sum_grad_squared": rule.sum_grad_squared(record, (grad_out,), names),
            "batch_dot": rule.batch_dot(record, (grad_out,), names),
        }
        gsum = rule.grad_sum(record, (grad_out,), names)
    for pname in names:
        torch.testing.assert_close(psg[pname], expected[pname])
        torch.testing.assert_close(sub[pname], expected[pname][[1, 0, 1]])
        torch.testing.assert_close(gsum[pname], expected[pname].sum(0))
        for quantity, value in fused.items():
            if value is not None:
                reference = first_order_reference(expected[pname], quantity)
                torch.testing.assert_close(value[pname], reference, msg=f"{pname} {quantity}")
    if save_memory:
        assert fused["batch_l2"] is not None and fused["sum_grad_squared"] is not None


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Conv2d(6, 8, 3, stride=2), (4, 6, 3, 3)),
        (lambda: nn.Conv1d(6, 8, 3, groups=2, bias=False), (3, 6, 4)),
        (lambda: nn.ConvTranspose2d(8, 6, 3, stride=2), (4, 8, 2, 1)),
        (lambda: nn.Conv3d(4, 6, 2, padding="same", padding_mode="circular"), (3, 4, 1, 1, 2)),
    ],
)
@pytest.mark.parametrize("save_memory", [False, True])
def test_ghost_norms_are_used_on_small_outputs(make, shape, save_memory):
    torch.manual_seed(0)
    module = make().to(D)
    x = torch.randn(shape, dtype=D)
    with torch.no_grad():
        out = module(x)
    grad_out = torch.randn_like(out)
    expected = _brute_force(module, x, grad_out, {})
    record = _record(module, x, out, {})
    rule = find_rule(module)
    names = [n for n, _ in module.named_parameters()]
    with torch.no_grad(), weight_jac_t_save_memory(save_memory):
        l2 = rule.batch_l2(record, (grad_out,), names)
        dot = rule.batch_dot(record, (grad_out,), names)
    assert l2 is not None and dot is not None
    for pname in names:
        torch.testing.assert_close(l2[pname], first_order_reference(expected[pname], "batch_l2"))
        torch.testing.assert_close(dot[pname], first_order_reference(expected[pname], "batch_dot"))


FIRST = [p for p in CONV_PROBLEMS if "first" in p.tags]


@pytest.mark.parametrize("problem", FIRST, ids=[p.id for p in FIRST])
def test_save_memory_gives_the_same_numbers(problem):
    model, x, lossfunc, y = problem.build()
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    extend(model)
    results = []
    for save_memory in (False, True):
        loss = lossfunc(model(x), y)
        with weight_jac_t_save_memory(save_memory), backpack(*(e() for e in QUANTITIES.values())):
            loss.backward()
        results.append({
            (name, q): getattr(p, q).clone() for name, p in model.named_parameters()
            for q in QUANTITIES
        })
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, msg=str(key))
        expected = first_order_reference(reference[key[0]], key[1])
        torch.testing.assert_close(value, expected, msg=str(key))


def test_save_memory_context_nests_and_restores():
    assert not convnd.save_memory_enabled()
    with weight_jac_t_save_memory():
        assert convnd.save_memory_enabled()
        with weight_jac_t_save_memory(save_memory=False):
            assert not convnd.save_memory_enabled()
        assert convnd.save_memory_enabled()
    assert not convnd.save_memory_enabled()
    with pytest.raises(ValueError), weight_jac_t_save_memory(True):
        raise ValueError
    assert not convnd.save_memory_enabled()


def test_unbatched_input_is_one_sample():
    torch.manual_seed(0)
    conv = extend(nn.Conv2d(2, 3, 3, padding=1).to(D))
    x = torch.randn(2, 4, 5, dtype=D)
    with backpack(BatchGrad(), BatchL2Grad()):
        conv(x).square().sum().backward()
    for p in conv.parameters():
        assert p.grad_batch.shape == (1, *p.shape)
        torch.testing.assert_close(p.grad_batch[0], p.grad)
        torch.testing.assert_close(p.batch_l2, p.grad.square().sum().reshape(1))


def test_frozen_weight_only_bias():
    torch.manual_seed(0)
    conv = extend(nn.ConvTranspose1d(2, 3, 3, stride=2).to(D))
    conv.weight.requires_grad_(False)
    x = torch.randn(4, 2, 5, dtype=D)
    with backpack(BatchGrad(), BatchL2Grad()):
        conv(x).sin().sum().backward()
    assert not hasattr(conv.weight, "grad_batch")
    torch.testing.assert_close(conv.bias.grad_batch.sum(0), conv.bias.grad)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize(
    "stride, dilation, padding, groups, kernel, size",
    [
        (1, 1, 0, 1, 3, 9),
        (2, 1, 1, 1, 3, 9),
        (2, 2, 2, 2, 3, 8),
        (1, 1, "same", 1, 4, 9),  # asymmetric padding
        (3, 2, 1, 2, 3, 10),
        (1, 2, "valid", 1, 2, 7),
        (3, 1, 5, 1, 2, 4),  # some kernel offsets only ever meet padding
    ],
)
def test_probed_weight_gradient_entries_from_strided_views(
    dims, stride, dilation, padding, groups, kernel, size
):
    """The coverage probes' few weight-gradient entries equal the full weight gradient's."""
    torch.manual_seed(dims)
    conv_cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    conv = conv_cls(4, 6, kernel, stride, padding, dilation, groups).to(torch.float64)
    x = torch.randn(3, 4, *([size] * dims), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "same" with an even kernel pads a copy
        out = conv(x)
    g = torch.randn_like(out)
    full = weight_grad_sum(conv, x, g).flatten()
    for index in (
        torch.linspace(0, full.numel() - 1, 8).long(),
        torch.randint(0, full.numel(), (16,)),
    ):
        torch.testing.assert_close(_weight_entries_by_slices(conv, x, g, index), full[index])


def test_conv_probes_share_the_kernel_centre_and_still_detect_outside_uses():
    """The rule's probes sit at one kernel offset; a regulariser on the weight is still seen."""
    torch.manual_seed(5)
    conv = nn.Conv2d(3, 10, 3, padding=1).to(torch.float64)
    index = find_rule(conv).probe_index("weight", conv.weight)
    coords = torch.unravel_index(index, conv.weight.shape)
    assert len(index) == 8 and len(set(index.tolist())) == 8
    assert set(coords[2].tolist()) == {1} and set(coords[3].tolist()) == {1}
    model = extend(nn.Sequential(conv, nn.Flatten(), nn.Linear(160, 2)).to(torch.float64))
    x, y = torch.randn(4, 3, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    loss = nn.CrossEntropyLoss()(model(x), y) + 0.1 * conv.weight.square().sum()
    with pytest.warns(UserWarning, match="outside extended modules"), backpack(Variance()):
        loss.backward()


@pytest.mark.parametrize(
    "channels, kernel, padding, dilation, height, width",
    [
        (3, 3, 1, 1, 7, 9),
        (4, 3, 0, 1, 8, 8),
        (2, 5, 2, 1, 6, 7),
        (3, 3, 2, 2, 9, 9),
        (2, 4, "same", 1, 7, 7),  # asymmetric padding
        (3, (3, 2), (1, 0), (1, 2), 8, 9),
        (2, 3, 4, 1, 5, 5),  # padding wider than the kernel reaches
        (2, 1, 0, 1, 4, 4),
        (3, 3, 1, 1, 6, 6),  # even transform sizes (a Nyquist frequency on both axes)
        (2, (2, 4), (0, 3), (2, 1), 5, 8),
        (2, 3, 1, 1, 1, 7),  # one input row
    ],
)
def test_input_gram_by_correlation_equals_unfolded_gram(
    channels, kernel, padding, dilation, height, width
):
    """KFAC's Σ u uᵀ from channel correlations minus skipped borders equals the unfolded one."""
    torch.manual_seed(7)
    conv = nn.Conv2d(channels, 5, kernel, padding=padding, dilation=dilation).to(torch.float64)
    x = torch.randn(3, channels, height, width, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out_size = conv(x).shape[2:]
    u = convnd.unfold_channels_first(conv, x, out_size)
    u = u.reshape(channels * conv.weight[0, 0].numel(), -1)
    torch.testing.assert_close(convnd.input_gram_by_correlation(conv, x, out_size), u @ u.T)
    # float32: rounding of the transforms stays at the level of the direct float32 sum
    u32 = u.float()
    direct = u32 @ u32.T
    by_dft = convnd.input_gram_by_correlation(conv.float(), x.float(), out_size)
    exact = (u @ u.T).float()
    scale = exact.abs().max()
    assert (by_dft - exact).abs().max() <= max(4 * (direct - exact).abs().max(), 1e-6 * scale)


@pytest.mark.cpu_only  # the correlation path is chosen on the CPU only (measured there)
def test_kfac_on_a_large_grid_takes_the_correlation_path_with_the_same_numbers(monkeypatch):
    torch.manual_seed(8)
    conv = nn.Conv2d(16, 4, 3, padding=1).to(torch.float64)
    linear = nn.Linear(4 * 32 * 32, 3).to(torch.float64)
    x = torch.randn(16, 16, 32, 32, dtype=torch.float64)
    assert convnd.correlation_applies(conv, x, (32, 32))
    assert not convnd.correlation_applies(nn.Conv2d(16, 4, 3, stride=2), x, (16, 16))
    assert not convnd.correlation_applies(nn.Conv2d(16, 4, 1), x, (32, 32))  # nothing to share
    assert not convnd.correlation_applies(conv, x[:2], (32, 32))  # little work
    assert convnd.correlation_applies(conv, torch.cat([x] * 4)[:, :, :8, :8], (8, 8))
    assert not convnd.correlation_applies(conv, x[:, :, :4, :4], (4, 4))  # mostly border
    valid = nn.Conv2d(16, 4, 3)  # each offset skips two lines per axis: wide grids only
    assert convnd.correlation_applies(valid, x, (30, 30))
    assert not convnd.correlation_applies(valid, torch.cat([x] * 4)[:, :, :16, :16], (14, 14))

    def kfac_factors():
        model = extend(nn.Sequential(conv, nn.Flatten(), linear))
        loss = extend(nn.MSELoss())(model(x), torch.zeros(16, 3, dtype=torch.float64))
        with backpack(KFLR()):
            loss.backward()
        return conv.weight.kflr

    by_correlation = kfac_factors()
    monkeypatch.setattr(convnd, "_CORRELATION_MIN_ROWS", 10**9)
    unfolded = kfac_factors()
    for a, b in zip(by_correlation, unfolded, strict=True):
        torch.testing.assert_close(a, b)
