"""nn.RNN / nn.LSTM rule: every configuration against brute-force autograd, and its limits."""

import gc
import itertools

import pytest
import torch
from problems import DTYPE, reference_per_sample_grads
from second_order_reference import Curvature
from torch import nn

from backpack import backpack, extend
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.extensions import (
    GGNMP,
    BatchDiagGGNExact,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    SqrtGGNExact,
    Variance,
)
from backpack.recording import Record, live_records, tensors_in
from backpack.rules import find_rule

N, T, IN, HID = 3, 4, 3, 2


class Reader(nn.Module):
    """Runs the recurrent module and feeds every one of its outputs into a linear head.

    With `initial_state`, (h0[, c0]) is computed per sample from the first step, so the state's
    gradient path and the initial-state handling of the rule are exercised too.
    """

    def __init__(self, mode, batch_first, layers, bidirectional, bias, initial_state):
        super().__init__()
        cls = nn.LSTM if mode == "lstm" else nn.RNN
        kwargs = {} if mode == "lstm" else {"nonlinearity": mode}
        self.rnn = cls(
            IN, HID, num_layers=layers, bidirectional=bidirectional, bias=bias,
            batch_first=batch_first, **kwargs,
        )
        self.lstm, self.batch_first, self.initial_state = mode == "lstm", batch_first, initial_state
        states = layers * (2 if bidirectional else 1)
        self.init = nn.Linear(IN, states * HID)
        n_states = 2 if self.lstm else 1
        self.head = nn.Linear(T * HID * (states // layers) + n_states * states * HID, 2)

    def forward(self, x):
        args = ()
        if self.initial_state:
            first = x[:, 0] if self.batch_first else x[0]
            h0 = torch.tanh(self.init(first)).reshape(len(first), -1, HID).transpose(0, 1)
            h0 = h0.contiguous()
            args = ((h0, torch.sin(h0)),) if self.lstm else (h0,)
        out, state = self.rnn(x, *args)
        out = out if self.batch_first else out.transpose(0, 1)
        states = state if self.lstm else (state,)
        feats = [out.flatten(1)] + [s.transpose(0, 1).flatten(1) for s in states]
        return self.head(torch.cat(feats, 1))


CONFIGS = list(
    itertools.product(
        ["tanh", "relu", "lstm"], [True, False], [(1, False), (1, True), (2, False), (2, True)],
        [True, False], [False, True],
    )
)


def _config_id(c):
    mode, bf, (layers, bidir), bias, init = c
    return (
        f"{mode}-{'bf' if bf else 'tm'}-L{layers}{'-bidir' if bidir else ''}"
        f"{'' if bias else '-nobias'}{'-h0' if init else ''}"
    )


def _data(batch_first, n=N):
    x = torch.randn(n, T, IN, dtype=DTYPE)
    return x if batch_first else x.transpose(0, 1).contiguous()


def _check_against_reference(model, x, lossfunc, y, exts, check):
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    model.zero_grad()
    extend(model)
    with backpack(*exts):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        check(name, p, reference[name])


@pytest.mark.parametrize("config", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_per_sample_gradients_every_configuration(config):
    mode, batch_first, (layers, bidir), bias, init = config
    torch.manual_seed(1)
    model = Reader(mode, batch_first, layers, bidir, bias, init).to(DTYPE)
    x = _data(batch_first)
    y = torch.randn(N, 2, dtype=DTYPE)

    def check(name, p, ref):
        torch.testing.assert_close(p.grad_batch, ref, rtol=1e-7, atol=1e-10, msg=name)

    _check_against_reference(model, x, nn.MSELoss(reduction="sum"), y, [BatchGrad()], check)


@pytest.mark.parametrize("mode", ["tanh", "lstm"])
def test_subsampling_and_reductions_deep_bidirectional(mode):
    torch.manual_seed(2)
    model = Reader(mode, False, 2, True, True, True).to(DTYPE)
    x, y = _data(False, n=4), torch.randn(4, 2, dtype=DTYPE)
    sub = [3, 1, 3]

    def check(name, p, ref):
        torch.testing.assert_close(p.grad_batch, ref[sub], msg=name)
        torch.testing.assert_close(p.batch_l2, ref.flatten(1).square().sum(1), msg=name)
        torch.testing.assert_close(p.variance, ref.var(0, unbiased=False), msg=name)

    exts = [BatchGrad(subsampling=sub), BatchL2Grad(), Variance()]
    _check_against_reference(model, x, nn.MSELoss(), y, exts, check)


class CellStateOnly(nn.Module):
    """Reads only c_n of an LSTM: output and h_n receive zero gradients."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(IN, HID, batch_first=True)
        self.head = nn.Linear(HID, 2)

    def forward(self, x):
        _, (_, c_n) = self.lstm(x)
        return self.head(c_n[0])


@pytest.mark.parametrize(
    "make",
    [
        CellStateOnly,
        # h_n only, through a Sequential
        lambda: nn.Sequential(
            nn.RNN(IN, HID, batch_first=True), ReduceTuple(1), ReduceTuple(0), nn.Linear(HID, 2)
        ),
    ],
    ids=["lstm-c_n-only", "rnn-h_n-only-sequential"],
)
def test_only_final_states_used(make):
    torch.manual_seed(3)
    model = make().to(DTYPE)
    x, y = _data(True), torch.randint(0, 2, (N,))

    def check(name, p, ref):
        torch.testing.assert_close(p.grad_batch, ref, rtol=1e-7, atol=1e-10, msg=name)

    _check_against_reference(model, x, nn.CrossEntropyLoss(), y, [BatchGrad()], check)


def test_unbatched_input_is_one_sample():
    torch.manual_seed(4)
    lstm = extend(nn.LSTM(IN, HID, num_layers=2).to(DTYPE))
    x = torch.randn(T, IN, dtype=DTYPE)
    out, (h_n, c_n) = lstm(x)
    with backpack(BatchGrad()):
        (out.square().sum() + h_n.sum() + c_n.square().sum()).backward()
    for name, p in lstm.named_parameters():
        assert p.grad_batch.shape == (1, *p.shape), name
        torch.testing.assert_close(p.grad_batch[0], p.grad, msg=name)


def test_module_applied_twice_accumulates():
    """An encoder shared by two sequences: per-sample gradients sum over both calls."""

    class TwoSequences(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.RNN(IN, HID, batch_first=True)
            self.head = nn.Linear(2 * HID, 2)

        def forward(self, x):
            _, a = self.rnn(x)
            _, b = self.rnn(x.flip(1))
            return self.head(torch.cat([a[0], b[0]], 1))

    torch.manual_seed(5)
    model = TwoSequences().to(DTYPE)
    x, y = _data(True), torch.randint(0, 2, (N,))

    def check(name, p, ref):
        torch.testing.assert_close(p.grad_batch, ref, rtol=1e-7, atol=1e-10, msg=name)

    _check_against_reference(model, x, nn.CrossEntropyLoss(), y, [BatchGrad()], check)


def _record(module, x, hx=None):
    """A record of one call, made by hand, to call the rule directly."""
    out = module(x) if hx is None else module(x, hx)
    args = (x,) if hx is None else (x, hx)
    outs = tuple(t.detach() for t in tensors_in(out))
    record = Record(module, args, {}, outs, out)
    record.out_requires_grad = tuple(True for _ in outs)
    return record, out


@pytest.mark.parametrize("mode", ["relu", "lstm"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_sqrt_factor_folds_columns_into_the_batch(mode, batch_first):
    """`sqrt_factor` (V columns in one re-run) against one autograd call per column and sample."""
    torch.manual_seed(6)
    module = Reader(mode, batch_first, 2, True, True, False).rnn.to(DTYPE)
    x = _data(batch_first)
    hx = torch.randn(4, N, HID, dtype=DTYPE)
    hx = (hx, torch.randn_like(hx)) if mode == "lstm" else hx
    record, out = _record(module, x, hx)
    outs = list(tensors_in(out))
    v = 3
    factors = [torch.randn(v, *o.shape, dtype=DTYPE) for o in outs]
    names = [n for n, _ in module.named_parameters()]
    result = find_rule(module).sqrt_factor(record, factors, names, subsampling=[2, 0])

    params = list(module.parameters())
    batch_axes = [0 if batch_first else 1] + [1] * (len(outs) - 1)
    for col in range(v):
        for pos, n in enumerate([2, 0]):
            masked = []
            for f, axis in zip(factors, batch_axes):
                mask = torch.zeros(f.shape[axis + 1], dtype=DTYPE)
                mask[n] = 1
                shape = [1] * (f.dim() - 1)
                shape[axis] = -1
                masked.append(f[col] * mask.reshape(shape))
            objective = sum((o * m).sum() for o, m in zip(outs, masked))
            expected = torch.autograd.grad(objective, params, retain_graph=True)
            for name, e in zip(names, expected):
                torch.testing.assert_close(result[name][col, pos], e, msg=f"{name} {col} {n}")


SECOND_ORDER_MODELS = {
    "relu-timemajor": lambda: Reader("relu", False, 1, False, True, False),
    "lstm-2layer-bidir-h0": lambda: Reader("lstm", True, 2, True, True, True),
}


@pytest.mark.parametrize("key", list(SECOND_ORDER_MODELS))
def test_ggn_diagonals_and_square_root(key):
    """Beyond plain Sequentials: time-major outputs and final states read by the model."""
    torch.manual_seed(7)
    model = SECOND_ORDER_MODELS[key]().to(DTYPE)
    batch_first = model.batch_first
    x, y = _data(batch_first), torch.randint(0, 2, (N,))
    lossfunc = nn.CrossEntropyLoss()
    ref = Curvature(model, x, lossfunc, y, hessian=False)
    extend(model)
    extend(lossfunc)
    with backpack(DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        if p.grad is None:  # the unused initial-state layer
            continue
        expected = ref.diag(ref.ggn, name)
        torch.testing.assert_close(p.diag_ggn_exact, expected, rtol=1e-6, atol=1e-9, msg=name)
        batch = ref.diag(ref.ggn_per_sample, name)
        torch.testing.assert_close(p.diag_ggn_exact_batch, batch, rtol=1e-6, atol=1e-9, msg=name)
        sqrt_diag = p.sqrt_ggn_exact.square().sum((0, 1))
        torch.testing.assert_close(sqrt_diag, expected, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("forward_ad", [True, False], ids=["forward-ad", "reverse-only"])
@pytest.mark.parametrize("mode", ["tanh", "lstm"])
def test_ggnmp_with_final_state_outputs(mode, forward_ad, monkeypatch):
    if not forward_ad:  # as on CUDA, whose fused LSTM cell has no forward-mode derivative
        import backpack.rules.generic as generic

        def no_forward_ad(*args, **kwargs):
            raise NotImplementedError("Trying to use forward AD with ... not implemented")

        monkeypatch.setattr(generic, "jvp", no_forward_ad)
    torch.manual_seed(8)
    model = Reader(mode, True, 1, False, True, False).to(DTYPE)
    x, y = _data(True), torch.randint(0, 2, (N,))
    lossfunc = nn.CrossEntropyLoss()
    ref = Curvature(model, x, lossfunc, y, hessian=False)
    extend(model)
    extend(lossfunc)
    with backpack(GGNMP()):
        lossfunc(model(x), y).backward()
    for name, p in model.rnn.named_parameters():
        mat = torch.randn(2, *p.shape, dtype=DTYPE)
        block = ref.block(ref.ggn, f"rnn.{name}")
        expected = (mat.flatten(1) @ block.T).reshape(mat.shape)
        torch.testing.assert_close(p.ggnmp(mat), expected, msg=name)


def test_float32_classifier_sums_to_grad():
    """Single precision: no false alarm from the re-run check; per-sample grads sum to .grad."""
    torch.manual_seed(9)
    model = extend(
        nn.Sequential(nn.LSTM(5, 6, batch_first=True), ReduceTuple(0), nn.Flatten(),
                      nn.Linear(7 * 6, 3))
    )
    x, y = torch.randn(8, 7, 5), torch.randint(0, 3, (8,))
    with backpack(BatchGrad()):
        nn.CrossEntropyLoss()(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_weights_changed_after_forward_are_detected():
    torch.manual_seed(10)
    rnn = extend(nn.RNN(IN, HID, batch_first=True).to(DTYPE))
    out, h_n = rnn(_data(True))
    with torch.no_grad():
        rnn.weight_hh_l0.mul_(2)
    # both outputs reach the loss, so the rule runs before autograd's own version check
    with pytest.raises(RuntimeError, match="did not reproduce"), backpack(BatchGrad()):
        (out.sum() + h_n.sum()).backward()


def test_lstm_records_die_with_their_graph_without_garbage_collection():
    """Multi-output calls hold no reference cycle: a dropped forward is not a second use."""
    gc.disable()
    try:
        torch.manual_seed(12)
        lstm = extend(nn.LSTM(IN, HID, batch_first=True).to(DTYPE))
        x = _data(True)
        out, (h_n, c_n) = lstm(x)
        assert len(live_records(lstm)) == 1
        del out, h_n, c_n
        assert live_records(lstm) == []
        out, _ = lstm(x)
        with backpack(BatchGrad(), BatchL2Grad()):
            out[:, -1].sum().backward()  # h_n and c_n unused: processed at the end of the pass
        for p in lstm.parameters():
            assert torch.allclose(p.grad_batch.sum(0), p.grad)
            assert torch.allclose(p.batch_l2, p.grad_batch.flatten(1).square().sum(1))
        del out
        assert live_records(lstm) == []
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "case",
    ["proj_size", "packed", "dropout-train"],
)
def test_unsupported_configurations_raise(case):
    torch.manual_seed(11)
    x = _data(True)
    if case == "proj_size":
        module = nn.LSTM(IN, 3, proj_size=2, batch_first=True)
    elif case == "dropout-train":
        module = nn.LSTM(IN, HID, num_layers=2, dropout=0.5, batch_first=True)
    else:
        module = nn.RNN(IN, HID, batch_first=True)
        x = nn.utils.rnn.pack_padded_sequence(x, [4, 3, 2], batch_first=True)
    module = extend(module.to(DTYPE))
    out = module(x)[0]
    out = out.data if case == "packed" else out
    match = {"proj_size": "proj_size", "packed": "PackedSequence", "dropout-train": "dropout"}
    with pytest.raises(NotImplementedError, match=match[case]), backpack(BatchGrad()):
        out.sum().backward()


@torch.backends.cudnn.flags(enabled=False)  # cuDNN RNNs have no backward in eval mode
def test_dropout_between_layers_is_fine_in_eval_mode():
    torch.manual_seed(12)
    lstm = extend(nn.LSTM(IN, HID, num_layers=2, dropout=0.5, batch_first=True).to(DTYPE))
    lstm.eval()
    x = _data(True)
    out, _ = lstm(x)
    with backpack(BatchGrad()):
        out.square().sum().backward()
    for name, p in lstm.named_parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, msg=name)


def test_batch_axis_and_reduce_tuple():
    rule = find_rule(nn.LSTM(2, 2))
    assert rule.batch_axis(nn.LSTM(2, 2, batch_first=True)) == 0
    assert rule.batch_axis(nn.RNN(2, 2)) == 1
    pick = ReduceTuple(index=1)
    assert pick((1, 2, 3)) == 2
    assert "index=1" in repr(pick)
    assert ReduceTuple()(("a", "b")) == "a"
