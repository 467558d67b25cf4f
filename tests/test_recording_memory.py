"""What records keep alive between the forward and the backward pass.

Conv and Linear records keep shape-only stand-ins of their outputs, and ReLU-like records keep
their output in place of their input, so the pre-activation between them is freed after the
forward as without backpack. User code that reads `module.input0`/`module.output` (extension
hooks, custom module extensions) still sees the true values.
"""

import pytest
import torch
from torch import nn

from backpack import backpack, extend, recording
from backpack.extensions import KFAC, BatchGrad, DiagGGNExact, DiagHessian
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
from backpack.recording import records_at, walk_nodes

DTYPE = torch.float64


def cnn(activation=nn.ReLU):
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        activation(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(12, 5),
        activation(),
        nn.Linear(5, 3),
    ).to(DTYPE)


def reachable_records(tensor):
    """Every record reachable backward from `tensor`."""
    stack, found = [tensor.grad_fn], []
    for node in walk_nodes(stack):
        found += [r for r, _, _ in records_at(node)]
        stack.extend(n for n, _ in node.next_functions)
    return found


def recorded_tensors(loss):
    """Every tensor held by a record reachable from `loss`."""
    return [
        t
        for record in reachable_records(loss)
        for t in (*record.args, *record.outputs)
        if isinstance(t, torch.Tensor)
    ]


def test_pre_activations_are_not_kept():
    torch.manual_seed(0)
    model = extend(cnn())
    pre = {}
    model[0].register_forward_hook(lambda m, i, o: pre.__setitem__("conv", o.data_ptr()))
    model[4].register_forward_hook(lambda m, i, o: pre.__setitem__("linear", o.data_ptr()))
    x, y = torch.randn(4, 2, 4, 4, dtype=DTYPE), torch.tensor([0, 1, 2, 0])
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    full = {
        t.data_ptr()
        for t in recorded_tensors(loss)
        if any(s != 0 for s in t.stride())  # stand-ins are expanded scalars
    }
    assert len(full) >= 4  # inputs of the layers and of the loss
    assert pre["conv"] not in full
    assert pre["linear"] not in full
    with backpack(BatchGrad()):
        loss.backward()
    for p in model.parameters():
        assert p.grad_batch.shape[0] == 4


def test_stand_ins_are_shape_only_nan():
    torch.manual_seed(0)
    model = extend(cnn())
    x = torch.randn(4, 2, 4, 4, dtype=DTYPE)
    out = model(x)
    records = reachable_records(out)
    conv = next(r for r in records if isinstance(r.module, nn.Conv2d))
    relu = next(r for r in records if r.module is model[1])
    assert conv.shape_only and conv.outputs[0].shape == (4, 3, 4, 4)
    assert conv.outputs[0].dtype == DTYPE and torch.isnan(conv.outputs[0]).all()
    # the ReLU keeps its output, and recomputes its true input from the convolution
    expected_input = model[0](x)
    torch.testing.assert_close(relu.args[0], torch.relu(expected_input))
    torch.testing.assert_close(relu.input_values(), expected_input)
    torch.testing.assert_close(conv.output_values(), expected_input)


@pytest.mark.parametrize("activation", [nn.ReLU, nn.ReLU6, nn.Tanh])
def test_extension_hook_sees_true_inputs_and_outputs(activation):
    torch.manual_seed(0)
    model = extend(cnn(activation))
    plain = cnn(activation)
    plain.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 2, 4, 4, dtype=DTYPE) * 3, torch.tensor([0, 1, 2, 0])
    expected = {}

    def capture(module, inputs, output):
        expected[id(module)] = (inputs[0].detach().clone(), output.detach().clone())

    for m in plain:
        m.register_forward_hook(capture)
    plain(x)
    pairs = dict(zip(map(id, model), map(id, plain)))
    seen = {}

    def hook(module):
        if id(module) in pairs:
            seen[pairs[id(module)]] = (module.input0.clone(), module.output.clone())

    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with backpack(BatchGrad(), extension_hook=hook):
        loss.backward()
    checked = 0
    for key, (inp, out) in seen.items():
        if key in expected:
            torch.testing.assert_close(inp, expected[key][0])
            torch.testing.assert_close(out, expected[key][1])
            checked += 1
    assert checked >= 5  # both convolutions/linears and the activations


class LinearOutputExt(FirstOrderModuleExtension):
    """Reads the true output of a Linear layer (a shape-only record) and its ReLU input."""

    def __init__(self):
        super().__init__(params=["weight"])
        self.outputs = []

    def weight(self, ext, module, g_inp, g_out, bpQuantities):  # noqa: D102, N803
        self.outputs.append(module.output.clone())
        return torch.einsum("no,ni->noi", g_out[0], module.input0)


def test_custom_module_extension_reads_linear_output():
    torch.manual_seed(0)
    model = extend(cnn())
    x, y = torch.randn(4, 2, 4, 4, dtype=DTYPE), torch.tensor([0, 1, 2, 0])
    ext = BatchGrad()
    reader = LinearOutputExt()
    ext.set_module_extension(nn.Linear, reader)
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with backpack(ext):
        loss.backward()
    assert len(reader.outputs) == 2
    hidden = model[:5](x)
    torch.testing.assert_close(reader.outputs[1], hidden)  # backward meets the head first
    torch.testing.assert_close(reader.outputs[0], model(x))
    assert (hidden < 0).any()  # the true pre-activation, not the ReLU's output


@pytest.mark.parametrize("ext_cls", [DiagGGNExact, DiagHessian, KFAC])
def test_second_order_unchanged_by_relu_stand_ins(ext_cls):
    """ReLU/Hardtanh records hold outputs: curvature equals the Tanh-free reference run."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 2, 4, 4, dtype=DTYPE) * 3, torch.tensor([0, 1, 2, 0])
    results = []
    for keep_inputs in (False, True):
        torch.manual_seed(1)
        model = extend(cnn(lambda: nn.Hardtanh(-0.5, 0.7)))
        if keep_inputs:  # a subclass is not in the idempotent registry: inputs are kept
            for i in (1, 5):
                sub = type("KeepInput", (nn.Hardtanh,), {})(-0.5, 0.7)
                model[i] = extend(sub)
        loss = extend(nn.CrossEntropyLoss())(model(x), y)
        torch.manual_seed(2)
        with backpack(ext_cls()):
            loss.backward()
        field = ext_cls().savefield
        results.append([getattr(p, field) for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        if isinstance(a, list):
            for fa, fb in zip(a, b, strict=True):
                torch.testing.assert_close(fa, fb)
        else:
            torch.testing.assert_close(a, b)


def test_small_outputs_are_kept(monkeypatch):
    monkeypatch.setattr(recording, "SHAPE_ONLY_MIN_ELEMENTS", 49)
    model = extend(cnn())
    out = model(torch.randn(4, 2, 4, 4, dtype=DTYPE))
    by_module = {id(r.module): r for r in reachable_records(out)}
    assert by_module[id(model[0])].shape_only  # [4, 3, 4, 4]: 192 elements
    assert not by_module[id(model[4])].shape_only  # [4, 5]: 20 elements
    assert not torch.isnan(by_module[id(model[4])].outputs[0]).any()


def _records_of(model):
    return [r for m in model.modules() for r in recording._records(m)]


def test_plain_backward_frees_records_as_it_passes():
    """A backward without backpack that does not retain the graph drops what records hold."""
    torch.manual_seed(0)
    model = extend(cnn())
    x, y = torch.randn(4, 2, 4, 4, dtype=DTYPE), torch.tensor([0, 1, 2, 0])
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    records = _records_of(model)
    assert records and not any(r.freed for r in records)
    loss.backward()
    assert all(r.freed and r.args == () and r.outputs == () for r in records)


def test_plain_backward_keeping_the_graph_keeps_records():
    """backward(retain_graph=True) without backpack leaves the records for a later context."""
    torch.manual_seed(0)
    model = extend(cnn())
    x, y = torch.randn(4, 2, 4, 4, dtype=DTYPE), torch.tensor([0, 1, 2, 0])
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    loss.backward(retain_graph=True)
    assert not any(r.freed for r in _records_of(model))
    model.zero_grad()
    with backpack(BatchGrad()):
        loss.backward()
    expected = torch.stack(
        [
            torch.autograd.grad(
                nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]) / len(x),
                model[0].weight,
            )[0]
            for i in range(len(x))
        ]
    )
    torch.testing.assert_close(model[0].weight.grad_batch, expected)


class _TwoOutputs(nn.Module):
    """Two outputs made by two different autograd nodes."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3, dtype=DTYPE))

    def forward(self, x):
        return x @ self.weight, x.tanh() * self.weight.sum()


def test_plain_backward_through_one_output_node_keeps_the_record():
    """Another output node of the call may still be backpropagated later: keep the record."""
    torch.manual_seed(0)
    module = extend(_TwoOutputs())
    x = torch.randn(2, 3, dtype=DTYPE, requires_grad=True)
    first, second = module(x)
    (record,) = recording._records(module)
    first.sum().backward()
    assert not record.freed
    assert record.args[0] is x


def test_records_leave_the_registry_with_their_graph():
    """Each module's live records are those of graphs that exist, with the inputs' edges."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(DTYPE))
    x = torch.randn(5, 3, dtype=DTYPE)
    outs = [model(x) for _ in range(3)]
    assert [len(recording._records(m)) for m in model] == [3, 3, 3]
    first, _, last = (recording._records(m)[0] for m in model)
    assert first.input_edges == (None,)  # the data needs no gradient
    (edge,) = last.input_edges
    assert isinstance(edge, torch.autograd.graph.GradientEdge)
    assert (edge.node.name(), edge.output_nr) == ("ReluBackward0", 0)
    del first, _, last, edge, outs[1]
    assert [len(recording._records(m)) for m in model] == [2, 2, 2]
    outs.clear()
    assert all(len(recording._LIVE_RECORDS[id(m)]) == 0 for m in model)


@pytest.mark.parametrize("width", [5, 300])  # the producer's output kept, or shape-only
def test_identity_calls_keep_no_values_and_hooks_still_see_them(width):
    """`nn.Identity` and eval-mode dropout pass their input on: their records keep stand-ins
    (the value would otherwise live through the whole step), read from the producer's record,
    which waits for them before it is freed."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, width), nn.Identity(), nn.Dropout(0.3), nn.Tanh(), nn.Linear(width, 3)
    )
    model = extend(model.to(DTYPE).eval())
    x, y = torch.randn(300, 4, dtype=DTYPE), torch.randint(0, 3, (300,))
    out = model(x)
    identities = [r for m in model[1:3] for r in recording.live_records(m)]
    assert len(identities) == 2
    assert all(r.shape_only and r.args[0].stride() == (0, 0) for r in identities)
    seen = []

    def hook(module):
        if isinstance(module, (nn.Identity, nn.Dropout)):
            seen.append((module.input0.clone(), module.output.clone()))

    with backpack(BatchGrad(), extension_hook=hook):
        extend(nn.CrossEntropyLoss())(out, y).backward()
    with torch.no_grad():
        expected = model[0](x)
    assert len(seen) == 2
    for inp, outp in seen:
        torch.testing.assert_close(inp, expected)
        torch.testing.assert_close(outp, expected)
    # nothing outlives the backward: the producer waited for the identities, then went too
    assert all(r.freed for r in identities)
    assert all(r.freed for r in recording.live_records(model[0]))


def test_identity_after_an_unrecorded_operation_refuses_to_show_values():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 4), nn.Identity()).to(DTYPE))
    inner = model[1]

    class Twice(nn.Module):
        def forward(self, x):
            return inner(model[0](x) * 2)  # the identity's input comes from `* 2`

    x, y = torch.randn(3, 4, dtype=DTYPE), torch.tensor([0, 1, 2])

    def hook(module):
        if module is inner:
            module.input0  # noqa: B018

    with pytest.raises(RuntimeError, match="passed through are not kept"):
        with backpack(BatchGrad(), extension_hook=hook):
            extend(nn.CrossEntropyLoss())(Twice()(x), y).backward()
