"""`extend(model, use_converter=True)`: torch.fx conversion into a graph of modules.

For custom-forward ResNets like the seed's `MyFirstResNet` (with `torch.add`, `+`, `+=`,
`F.relu`, `torch.flatten`, `x.view`), and for torchvision architectures (ResNet blocks,
MobileNetV2/V3, EfficientNet, DenseNet, ShuffleNetV2) the tests check:

- the converted forward is bit-identical to the original one;
- the graph consists of `call_module` nodes only (plus placeholder/output; ShuffleNet's channel
  shuffle keeps `size`/`getitem`/`floordiv`/`view`/`contiguous`/`chunk`/`mean` nodes: linear
  shape operations with data-independent sizes, see `SHAPE_OPS`);
- parameter names are those of the original model;
- second-order extensions on the converted model against brute-force autograd in float64: the
  GGN (diagonal, per-sample diagonal, GGN-matrix products) from one reverse-mode backward per
  column of a per-sample factorisation of the loss Hessian, `autograd_diag_ggn_exact` at ten
  sampled indices like the seed, the Hessian diagonal at sampled indices from double backward,
  Hessian-matrix products from double backward, and KFLR/KFAC factors from their definition
  (BatchNorm parameters frozen: Kronecker factors exist for Linear and convolutions only).

The fast tests use cut-down torchvision models built from the library's own classes and
blocks; the full-size models run under `@pytest.mark.slow`.
"""

import math
import operator

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models import DenseNet, MobileNetV2, ShuffleNetV2
from torchvision.models.efficientnet import EfficientNet, MBConvConfig
from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3
from torchvision.models.resnet import BasicBlock, Bottleneck

from backpack import backpack, extend
from backpack.custom_module.branching import CatModule, MultiplyModule, SumModule
from backpack.custom_module.graph_utils import (
    BackpackTracer,
    ConversionError,
    convert_module_to_backpack,
)
from backpack.custom_module.pad import Pad
from backpack.custom_module.permute import Permute
from backpack.custom_module.reduce_tuple import ReduceTuple
from backpack.custom_module.scale_module import ScaleModule
from backpack.custom_module.slicing import Slicing
from backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagHessian,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
)
from backpack.utils.examples import autograd_diag_ggn_exact

DT = torch.float64
#: non-module nodes a converted graph may keep: shape queries and data-independent linear
#: reshapes that the converter has no module for (ShuffleNet's channel shuffle)
SHAPE_OPS = {
    ("call_method", "size"),
    ("call_function", operator.getitem),
    ("call_function", operator.floordiv),
    ("call_method", "view"),
    ("call_method", "contiguous"),
    ("call_method", "chunk"),
    ("call_method", "mean"),
}


# --- models: the seed's custom-forward ResNet, written in several styles ---------------------
class AddResNet(nn.Module):
    """`torch.add` for the skip connection, `F.relu`, `torch.flatten`."""

    def __init__(self, c_in=1, c_hid=3, side=6, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_hid, 3, padding=1)
        self.conv2 = nn.Conv2d(c_hid, c_hid, 3, padding=1)
        self.linear1 = nn.Linear(side * side * c_hid, classes)
        self.shortcut = nn.Identity() if c_in == c_hid else nn.Conv2d(c_in, c_hid, 1)

    def forward(self, x):
        residual = self.shortcut(x)
        x = self.conv2(F.relu(self.conv1(x)))
        x = torch.add(x, residual)
        x = torch.flatten(x, 1)
        return self.linear1(x)


class PlusResNet(AddResNet):
    """`x + residual`, `torch.sigmoid`, `x.view(x.size(0), -1)`."""

    def forward(self, x):
        residual = self.shortcut(x)
        x = self.conv2(torch.sigmoid(self.conv1(x)))
        x = x + residual
        x = x.view(x.size(0), -1)
        return self.linear1(x)


class IaddResNet(AddResNet):
    """`x += residual`, `F.relu(..., inplace=True)`, `x.tanh()`, `x.reshape(x.shape[0], -1)`."""

    def forward(self, x):
        residual = self.shortcut(x)
        x = F.relu(self.conv1(x), inplace=True)
        x = self.conv2(x)
        x += residual
        x = x.tanh()
        x = x.reshape(x.shape[0], -1)
        return self.linear1(0.5 * x)


class InplaceAlias(nn.Module):
    """In-place ReLUs whose inputs are read again afterwards (they then hold the ReLU output):
    a functional one and a module called twice."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 5)
        self.lin2 = nn.Linear(5, 5)
        self.lin3 = nn.Linear(5, 5)
        self.lin4 = nn.Linear(5, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.lin1(x)
        y = F.relu(h, inplace=True)
        h = self.lin2(torch.sigmoid(h + y))  # h is relu(lin1(x)) here
        z = self.act(h)
        u = self.lin3(h + z)  # h is relu(h) here
        return self.lin4(u + self.act(u))  # u + relu(u) = 2 relu(u)


class FunctionalZoo(nn.Module):
    """Functional ops with custom-module equivalents: permute, transpose, slicing, pad, cat,
    products, scaling, an LSTM's tuple output, functional pooling and activations."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.lin = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 3, 2)
        self.head = nn.Linear(15, 3)

    def forward(self, x):  # x: [N, 3, 5]
        seq, _ = self.lstm(x.permute(0, 2, 1))  # [N, 5, 4]
        gate = torch.sigmoid(self.lin(seq))
        h = (seq * gate).transpose(1, 2)  # [N, 4, 5]
        h = F.pad(h, (1, 1), mode="replicate")  # [N, 4, 7]
        h = F.elu(self.conv(h))  # [N, 3, 6]
        h = torch.cat([h[:, :, 1:5], 2.0 * F.avg_pool1d(h, 2)], dim=2)  # [N, 3, 7]
        h = F.max_pool1d(F.softplus(h), 2, stride=1, ceil_mode=True)  # [N, 3, 7]
        return self.head(F.adaptive_avg_pool1d(h, 5).flatten(1))


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        x = self.lin(x)
        if x.sum() > 0:
            x = -x
        return x


# --- cut-down torchvision models -----------------------------------------------------------
def tiny_resnet():
    """torchvision's BasicBlock (with and without downsampling) and Bottleneck, tiny widths."""
    down = nn.Sequential(nn.Conv2d(6, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
        BasicBlock(6, 6),
        BasicBlock(6, 8, stride=2, downsample=down),
        Bottleneck(8, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def tiny_mobilenet_v3():
    """MobileNetV3 (hardswish, squeeze-excitation with hardsigmoid) with three tiny blocks."""
    cfg = [
        InvertedResidualConfig(8, 3, 8, 8, True, "RE", 2, 1, 1.0),
        InvertedResidualConfig(8, 3, 16, 8, True, "HS", 1, 1, 1.0),
        InvertedResidualConfig(8, 3, 16, 12, False, "HS", 2, 1, 1.0),
    ]
    return MobileNetV3(cfg, last_channel=16, num_classes=4)


def tiny_mobilenet_v2():
    setting = [[1, 8, 1, 1], [4, 8, 2, 2]]
    return MobileNetV2(
        num_classes=4, width_mult=0.25, inverted_residual_setting=setting, round_nearest=4
    )


def tiny_efficientnet():
    """EfficientNet (SiLU, squeeze-excitation with sigmoid, stochastic depth) with 3 blocks."""
    cfg = [MBConvConfig(1, 3, 1, 8, 8, 1), MBConvConfig(4, 3, 2, 8, 12, 2)]
    return EfficientNet(cfg, dropout=0.2, num_classes=4, last_channel=16)


def tiny_densenet():
    return DenseNet(
        growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=4
    )


def tiny_shufflenet():
    return ShuffleNetV2([1, 1, 1], [4, 8, 16, 16, 16], num_classes=4)


def _ce():
    return nn.CrossEntropyLoss()


def _mse_sum():
    return nn.MSELoss(reduction="sum")


#: name -> (model builder, input shape, loss builder, DiagHessian supported or the module
#: class the exact-Hessian extensions must name in their NotImplementedError)
FAST = {
    "add-resnet": (lambda: AddResNet(), (3, 1, 6, 6), _ce, True),
    "add-resnet-identity-shortcut": (lambda: AddResNet(c_in=3), (3, 3, 6, 6), _mse_sum, True),
    "plus-resnet": (lambda: PlusResNet(), (3, 1, 6, 6), _mse_sum, True),
    "iadd-resnet": (lambda: IaddResNet(), (3, 1, 6, 6), _ce, True),
    "inplace-alias": (InplaceAlias, (4, 4), _ce, True),
    "functional-zoo": (FunctionalZoo, (3, 3, 5), _ce, "MultiplyModule"),
    "tv-resnet-blocks": (tiny_resnet, (2, 3, 12, 12), _ce, True),
    "tv-mobilenet-v3": (tiny_mobilenet_v3, (2, 3, 16, 16), _ce, "MultiplyModule"),
    "tv-mobilenet-v2": (tiny_mobilenet_v2, (2, 3, 16, 16), _mse_sum, True),
    "tv-efficientnet": (tiny_efficientnet, (2, 3, 16, 16), _ce, "MultiplyModule"),
    "tv-densenet": (tiny_densenet, (2, 3, 16, 16), _ce, True),
    "tv-shufflenet-v2": (tiny_shufflenet, (2, 3, 16, 16), _mse_sum, True),
}
#: which custom modules each fast model must contain after conversion
EXPECTED_MODULES = {
    "add-resnet": {SumModule, nn.ReLU, nn.Flatten},
    "plus-resnet": {SumModule, nn.Sigmoid, nn.Flatten},
    "iadd-resnet": {SumModule, nn.ReLU, nn.Tanh, nn.Flatten, ScaleModule},
    "inplace-alias": {SumModule, nn.ReLU, nn.Sigmoid},
    "functional-zoo": {
        Permute,
        ReduceTuple,
        MultiplyModule,
        Pad,
        Slicing,
        CatModule,
        ScaleModule,
        nn.ELU,
        nn.Softplus,
        nn.AvgPool1d,
        nn.MaxPool1d,
        nn.AdaptiveAvgPool1d,
        nn.Flatten,
    },
    "tv-resnet-blocks": {SumModule},
    "tv-mobilenet-v3": {nn.Hardswish, nn.Hardsigmoid, MultiplyModule, SumModule},
    "tv-mobilenet-v2": {nn.ReLU6, SumModule, nn.AdaptiveAvgPool2d, nn.Flatten},
    "tv-efficientnet": {nn.SiLU, nn.Sigmoid, MultiplyModule, SumModule},
    "tv-densenet": {CatModule, nn.ReLU, nn.AdaptiveAvgPool2d, nn.Flatten},
    "tv-shufflenet-v2": {CatModule, Permute},
}


def build(name, table=None):
    make_model, shape, make_loss, _ = (table or FAST)[name]
    torch.manual_seed(0)
    model = make_model().to(DT).eval()
    x = torch.randn(*shape, dtype=DT)
    lossfunc = make_loss()
    with torch.no_grad():
        out = model(x)
    if isinstance(lossfunc, nn.CrossEntropyLoss):
        y = torch.randint(0, out.shape[1], (out.shape[0],))
    else:
        y = torch.randn_like(out)
    return model, x, lossfunc, y


# --- brute-force references -------------------------------------------------------------------
def output_hessian_columns(out, lossfunc, y):
    """(sample, column) pairs with Σ c cᵀ = the loss Hessian w.r.t. the output (block diagonal
    over samples); each column is non-zero in one sample only."""
    o = out.detach()
    n, d = o.shape[0], o[0].numel()
    hess = torch.autograd.functional.hessian(lambda z: lossfunc(z, y), o).reshape(n, d, n, d)
    columns = []
    for i in range(n):
        evals, evecs = torch.linalg.eigh(hess[i, :, i, :])
        for k in range(d):
            if evals[k] > 1e-12 * max(evals.max().item(), 1.0):
                col = torch.zeros(n, d, dtype=o.dtype)
                col[i] = evecs[:, k] * evals[k].sqrt()
                columns.append((i, col.reshape(o.shape)))
    return columns


class Reference:
    """GGN quantities (all entries) and Kronecker factors of Linear/Conv2d layers by autograd."""

    @torch.backends.cudnn.flags(enabled=False)  # cuDNN RNNs have no backward in eval mode
    def __init__(self, model, x, lossfunc, y, products=True):
        self.model, self.x, self.lossfunc, self.y = model, x, lossfunc, y
        self.params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        layers = {  # layers with Kronecker factors by definition (Linear on 2-D inputs, Conv2d)
            name: m
            for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv2d)) and m.weight.requires_grad
        }
        captured = {}

        def capture(name):
            def hook(module, inputs, output):
                captured.setdefault(name, (inputs[0].detach(), output))  # first call only
                # the model goes on with a copy: an in-place op after the layer (ReLU(inplace))
                # must not overwrite the captured output
                return output.clone()

            return hook

        handles = [m.register_forward_hook(capture(name)) for name, m in layers.items()]
        out = model(x)
        for h in handles:
            h.remove()
        n = x.shape[0]
        names = list(self.params)
        targets = list(self.params.values()) + [captured[k][1] for k in layers]
        self.jt = {k: [] for k in names}  # Jᵀ c per column
        self.ggn_batch = {k: torch.zeros(n, *p.shape, dtype=DT) for k, p in self.params.items()}
        gs = {
            k: torch.zeros(captured[k][1].shape[1], captured[k][1].shape[1], dtype=DT)
            for k in layers
        }
        for i, col in output_hessian_columns(out, lossfunc, y):
            grads = torch.autograd.grad(out, targets, col, retain_graph=True, allow_unused=True)
            for k, g in zip(names, grads):
                g = torch.zeros_like(self.params[k]) if g is None else g
                if products:
                    self.jt[k].append(g)
                self.ggn_batch[k][i] += g * g
            for k, s in zip(layers, grads[len(names) :]):
                if s is not None:
                    s_sum = s[i].reshape(s.shape[1], -1).sum(1)  # factor summed over positions
                    gs[k] += torch.outer(s_sum, s_sum)
        self.ggn_diag = {k: v.sum(0) for k, v in self.ggn_batch.items()}
        self.kron = {}
        for k, m in layers.items():
            inp = captured[k][0]
            if isinstance(m, nn.Linear) and inp.dim() != 2:
                continue
            if isinstance(m, nn.Linear):
                a = inp.T @ inp / n
            else:
                assert m.padding_mode == "zeros"
                u = F.unfold(inp, m.kernel_size, m.dilation, m.padding, m.stride)
                u = u.reshape(n, m.groups, -1, u.shape[-1])
                a = torch.einsum("ngkl,ngjl->kj", u, u) / (n * m.groups)
            self.kron[f"{k}.weight" if k else "weight"] = [gs[k], a]
            if m.bias is not None and m.bias.requires_grad:
                self.kron[f"{k}.bias" if k else "bias"] = [gs[k]]

    def ggn_diag_vector(self):
        return torch.cat([self.ggn_diag[k].flatten() for k in self.params])

    def ggn_product(self, name, mat):
        jt = torch.stack(self.jt[name]).flatten(1)  # [V, P]
        return ((mat.flatten(1) @ jt.T) @ jt).reshape(mat.shape)

    def _grads(self, create_graph=True):
        loss = self.lossfunc(self.model(self.x), self.y)
        return torch.autograd.grad(loss, list(self.params.values()), create_graph=create_graph)

    def hessian_diag_at(self, entries):
        """Hessian diagonal at (parameter name, flat index) pairs, by double backward."""
        grads = dict(zip(self.params, self._grads()))
        values = []
        for name, j in entries:
            (row,) = torch.autograd.grad(
                grads[name].flatten()[j], self.params[name], retain_graph=True
            )
            values.append(row.flatten()[j])
        return torch.stack(values)

    def hessian_product(self, name, mat):
        grad = dict(zip(self.params, self._grads()))[name]
        rows = [torch.autograd.grad(grad, self.params[name], m, retain_graph=True)[0] for m in mat]
        return torch.stack(rows)


def sample_entries(params, count=10):
    """The first entry of each parameter and `count` evenly spaced flat indices (like the seed)."""
    names = list(params)
    sizes = [params[k].numel() for k in names]
    total = sum(sizes)
    flat = torch.linspace(0, total - 1, count, dtype=torch.int32).tolist()
    entries, offsets, start = [], {}, 0
    for k, s in zip(names, sizes):
        offsets[k] = start
        entries.append((k, 0))
        start += s
    for i in flat:
        k = max((k for k in names if offsets[k] <= i), key=lambda k: offsets[k])
        entries.append((k, i - offsets[k]))
    return entries


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-10, msg=msg)


def non_module_ops(gm):
    return {
        (n.op, n.target)
        for n in gm.graph.nodes
        if n.op not in ("placeholder", "output", "call_module")
    }


def convert(model):
    names = list(dict(model.named_parameters()))
    gm = extend(model, use_converter=True)
    assert isinstance(gm, torch.fx.GraphModule)
    assert list(dict(gm.named_parameters())) == names
    return gm


# --- the tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FAST))
def test_conversion_structure(name):
    model, x, _, _ = build(name)
    with torch.no_grad():
        expected = model(x)
    gm = convert(model)
    with torch.no_grad():
        assert torch.equal(gm(x), expected)
    allowed = SHAPE_OPS if name == "tv-shufflenet-v2" else set()
    assert non_module_ops(gm) <= allowed, non_module_ops(gm)
    found = {type(m) for m in gm.modules()}
    assert EXPECTED_MODULES.get(name, set()) <= found, EXPECTED_MODULES[name] - found
    if name == "functional-zoo":  # `seq, _ = self.lstm(...)`: only the used element is kept
        assert sum(isinstance(m, ReduceTuple) for m in gm.modules()) == 1
    # each parameter-free module is called at most once (reused ReLUs are duplicated)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    for target in set(targets):
        if next(gm.get_submodule(target).parameters(), None) is None:
            assert targets.count(target) == 1, target


@pytest.mark.parametrize("name", list(FAST))
@torch.backends.cudnn.flags(enabled=False)  # the zoo's RNN runs in eval mode: no cuDNN backward
def test_ggn_family_matches_autograd(name):
    model, x, lossfunc, y = build(name)
    ref = Reference(model, x, lossfunc, y)
    gm = convert(model)
    lossfunc = extend(lossfunc)
    with backpack(DiagGGNExact(), BatchDiagGGNExact(), DiagGGNMC(mc_samples=2), GGNMP()):
        lossfunc(gm(x), y).backward()
    for k, p in gm.named_parameters():
        close(p.diag_ggn_exact, ref.ggn_diag[k], k)
        close(p.diag_ggn_exact_batch, ref.ggn_batch[k], k)
        assert p.diag_ggn_mc.shape == p.shape
        assert (p.diag_ggn_mc >= 0).all()
        mat = torch.randn(2, *p.shape, dtype=DT)
        close(p.ggnmp(mat), ref.ggn_product(k, mat), k)
    # the seed's check: autograd_diag_ggn_exact at ten evenly spaced indices
    vector = torch.cat([p.diag_ggn_exact.flatten() for p in gm.parameters()])
    idx = torch.linspace(0, vector.numel() - 1, 10, dtype=torch.int32)
    expected = autograd_diag_ggn_exact(x, y, gm, lossfunc, idx=idx)
    close(vector[idx.long()], expected)
    close(ref.ggn_diag_vector(), vector)


@pytest.mark.parametrize("name", list(FAST))
def test_hessian_family_matches_autograd(name):
    model, x, lossfunc, y = build(name)
    supported = FAST[name][3]
    gm = convert(model)
    lossfunc = extend(lossfunc)
    if supported is not True:
        for ext in (DiagHessian(), HMP()):
            with pytest.raises(NotImplementedError, match=supported):
                with backpack(ext):
                    lossfunc(gm(x), y).backward()
        return
    ref = Reference(gm, x, lossfunc, y)
    with backpack(DiagHessian(), BatchDiagHessian(), HMP()):
        lossfunc(gm(x), y).backward()
    params = dict(gm.named_parameters())
    entries = sample_entries(params)
    actual = torch.stack([params[k].diag_h.flatten()[j] for k, j in entries])
    close(actual, ref.hessian_diag_at(entries))
    for k, p in params.items():
        close(p.diag_h_batch.sum(0), p.diag_h, k)
    for k in list(params)[:: max(1, len(params) // 4)]:  # a few Hessian blocks
        mat = torch.randn(2, *params[k].shape, dtype=DT)
        close(params[k].hmp(mat), ref.hessian_product(k, mat), k)


@pytest.mark.parametrize("name", [k for k in FAST if k not in ("functional-zoo",)])
def test_kflr_kfac_match_definition(name):
    """Kronecker factors of every Linear/Conv2d (BatchNorm frozen: it has no such factors)."""
    model, x, lossfunc, y = build(name)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.requires_grad_(False)
    ref = Reference(model, x, lossfunc, y)
    gm = convert(model)
    lossfunc = extend(lossfunc)
    with backpack(KFLR(), KFAC(mc_samples=3)):
        lossfunc(gm(x), y).backward()
    for k, p in gm.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "kflr")
            continue
        assert len(p.kflr) == len(ref.kron[k]) == len(p.kfac)
        for actual, expected in zip(p.kflr, ref.kron[k]):
            close(actual, expected, k)
        if len(p.kfac) == 2:  # A does not depend on the loss: KFAC's equals KFLR's
            close(p.kfac[1], p.kflr[1], k)
        close(p.kfac[0], p.kfac[0].T, k)


def test_kflr_through_lstm_gives_every_parameter_factors():
    """The LSTM's weights get Kronecker factors (one Linear map per step), not dense blocks."""
    model, x, lossfunc, y = build("functional-zoo")
    gm = convert(model)
    lossfunc = extend(lossfunc)
    with backpack(KFLR()):
        lossfunc(gm(x), y).backward()
    for module in gm.modules():
        for p in module.parameters(recurse=False):
            assert all(f.shape[0] == f.shape[1] for f in p.kflr)
            assert math.prod(f.shape[0] for f in p.kflr) == p.numel()
    lstm = [m for m in gm.modules() if isinstance(m, nn.LSTM)]
    assert lstm
    for name, p in lstm[0].named_parameters():
        assert len(p.kflr) == (2 if name.startswith("weight") else 1), name


def test_inplace_reads_after_conversion_see_the_result():
    """`y = F.relu(h, inplace=True); h + y` is 2 relu(h); the converted graph reads the ReLU."""
    model, x, _, _ = build("inplace-alias")
    gm = convert(model)
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    relu, act0, act1 = nodes["relu0"], nodes["act0"], nodes["act1"]
    assert nodes["sum_module0"].args == (relu, relu)
    assert nodes["sum_module1"].args == (act0, act0)
    assert nodes["sum_module2"].args == (act1, act1)
    with torch.no_grad():
        h = model.lin2(torch.sigmoid(2 * torch.relu(model.lin1(x))))
        u = model.lin3(2 * torch.relu(h))
        torch.testing.assert_close(gm(x), model.lin4(2 * torch.relu(u)))


def test_integer_scaling_of_non_module_values_stays_functional():
    class IntScale(nn.Module):
        def forward(self, x, idx):
            return x * 0.5 + (idx * 2).to(x.dtype)

    gm = convert_module_to_backpack(IntScale())
    kinds = {type(m) for m in gm.modules()}
    assert ScaleModule in kinds and SumModule in kinds
    x, idx = torch.randn(3, dtype=DT), torch.tensor([1, 2, 3])
    assert torch.equal(gm(x, idx), IntScale()(x, idx))
    assert (("call_function", operator.mul)) in non_module_ops(gm)  # idx * 2 stays an int op


def test_data_dependent_control_flow_raises_conversion_error():
    with pytest.raises(ConversionError) as info:
        extend(DataDependent(), use_converter=True)
    message = str(info.value)
    assert "if x.sum() > 0:" in message and "test_converter.py" in message
    assert "DataDependent" in message and "torch.where" in message
    assert "use_converter=True" in message
    assert isinstance(info.value, RuntimeError)


def test_print_tabular_and_debug(capsys):
    model, _, _, _ = build("add-resnet")
    gm = convert_module_to_backpack(model, debug=True)
    printed = capsys.readouterr().out
    assert "[backpack converter]" in printed and "sum_module0" in printed
    BackpackTracer().trace(gm).print_tabular()
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["opcode", "name", "target", "args", "kwargs"]
    rows = [line.split()[:3] for line in table[2:]]
    assert rows == [
        ["placeholder", "x", "x"],
        ["call_module", "shortcut", "shortcut"],
        ["call_module", "conv1", "conv1"],
        ["call_module", "relu0", "relu0"],
        ["call_module", "conv2", "conv2"],
        ["call_module", "sum_module0", "sum_module0"],
        ["call_module", "flatten0", "flatten0"],
        ["call_module", "linear1", "linear1"],
        ["output", "output", "output"],
    ]


def test_tracer_keeps_custom_modules_as_leaves():
    from backpack.custom_module.branching import Parallel

    model = nn.Sequential(
        nn.Linear(3, 4), Parallel(nn.Identity(), nn.Sequential(ScaleModule(2.0), nn.Tanh()))
    )
    graph = BackpackTracer().trace(model)
    kinds = [
        type(model.get_submodule(n.target)).__name__ for n in graph.nodes if n.op == "call_module"
    ]
    assert kinds == ["Linear", "Identity", "ScaleModule", "Tanh", "SumModule"]


def test_converted_model_supports_first_order():
    from backpack.extensions import BatchGrad

    model, x, lossfunc, y = build("tv-efficientnet")
    gm = convert(model)
    lossfunc = extend(nn.CrossEntropyLoss(reduction="sum"))
    with backpack(BatchGrad()):
        lossfunc(gm(x), y).backward()
    for k, p in gm.named_parameters():
        grads = []
        for n in range(x.shape[0]):
            (g,) = torch.autograd.grad(lossfunc(gm(x[[n]]), y[[n]]), p)
            grads.append(g)
        close(p.grad_batch, torch.stack(grads), k)


# --- full-size torchvision models (slow) ---------------------------------------------------
FULL = {
    "resnet18": (
        lambda: torchvision.models.resnet18(num_classes=5),
        (2, 3, 32, 32),
        _mse_sum,
        True,
    ),
    "mobilenet_v3_small": (
        lambda: torchvision.models.mobilenet_v3_small(num_classes=4),
        (2, 3, 32, 32),
        _ce,
        "MultiplyModule",
    ),
    "mobilenet_v2": (
        lambda: torchvision.models.mobilenet_v2(num_classes=4),
        (2, 3, 32, 32),
        _ce,
        True,
    ),
    "efficientnet_b0": (
        lambda: torchvision.models.efficientnet_b0(num_classes=4),
        (2, 3, 32, 32),
        _ce,
        "MultiplyModule",
    ),
    "densenet121": (
        lambda: torchvision.models.densenet121(num_classes=4),
        (2, 3, 32, 32),
        _ce,
        True,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FULL))
def test_full_torchvision_model(name):
    model, x, lossfunc, y = build(name, FULL)
    with torch.no_grad():
        expected = model(x)
    gm = convert(model)
    with torch.no_grad():
        assert torch.equal(gm(x), expected)
    assert non_module_ops(gm) == set()
    ref = Reference(gm, x, lossfunc, y, products=False)
    lossfunc = extend(lossfunc)
    with backpack(DiagGGNExact()):
        lossfunc(gm(x), y).backward()
    params = dict(gm.named_parameters())
    entries = sample_entries(params)
    actual = torch.stack([params[k].diag_ggn_exact.flatten()[j] for k, j in entries])
    close(actual, torch.stack([ref.ggn_diag[k].flatten()[j] for k, j in entries]))
    supported = FULL[name][3]
    if supported is not True:
        with pytest.raises(NotImplementedError, match=supported):
            with backpack(DiagHessian()):
                lossfunc(gm(x), y).backward()
        return
    with backpack(DiagHessian()):
        lossfunc(gm(x), y).backward()
    actual = torch.stack([params[k].diag_h.flatten()[j] for k, j in entries[-10:]])
    close(actual, ref.hessian_diag_at(entries[-10:]))


@pytest.mark.parametrize(
    "name", ["resnet18", "mobilenet_v3_small", "mobilenet_v2", "efficientnet_b0"]
)
def test_full_torchvision_model_conversion(name):
    """Full-size models convert into modules only, with the same function and parameter names."""
    torch.manual_seed(0)
    model = FULL[name][0]().eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
    gm = convert(model)
    assert non_module_ops(gm) == set()
    with torch.no_grad():
        assert torch.equal(gm(x), expected)


class StochasticResidual(nn.Module):
    """A residual branch behind torchvision's StochasticDepth (as in EfficientNet's blocks)."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.drop = torchvision.ops.StochasticDepth(0.5, "row")
        self.lin2 = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin2(x + self.drop(torch.tanh(self.lin1(x))))


def test_stochastic_depth_stays_a_module():
    torch.manual_seed(0)
    model = StochasticResidual().to(DT).eval()
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    gm = convert(model)
    assert isinstance(gm.get_submodule("drop"), torchvision.ops.StochasticDepth)
    assert non_module_ops(gm) == set()
    # training mode still drops rows at random, exactly like the original
    model.train(), gm.train()
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        assert torch.equal(gm(x), expected)
        assert not torch.equal(gm(x), gm.eval()(x))
    # in eval mode it is the identity: the exact Hessian passes through it
    gm.eval()
    lossfunc = extend(nn.CrossEntropyLoss())
    ref = Reference(gm, x, lossfunc, y)
    with backpack(DiagHessian()):
        lossfunc(gm(x), y).backward()
    params = dict(gm.named_parameters())
    entries = [(k, j) for k, p in params.items() for j in range(p.numel())]
    actual = torch.stack([params[k].diag_h.flatten()[j] for k, j in entries])
    close(actual, ref.hessian_diag_at(entries))


def test_converting_a_model_of_custom_modules_keeps_it():
    """The seed's Parallel/SumModule ResNet converts to itself: same graph, same names."""
    from backpack.custom_module.branching import Parallel

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.ReLU(),
        Parallel(nn.Identity(), nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())),
        nn.Flatten(),
        nn.Linear(32, 3),
    ).to(DT)
    x = torch.randn(2, 1, 4, 4, dtype=DT)
    gm = convert(model)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets == ["0", "1", "2.branch.0", "2.branch.1.0", "2.branch.1.1", "2.merge", "3", "4"]
    assert torch.equal(gm(x), model(x))


def test_size_arithmetic_stays_functional():
    class Reshaper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 2)

        def forward(self, x):  # x: [N, 2, 3]
            features = x.size(1) * x.shape[2] + (x.size(2) - x.size(2))
            return self.lin(x.reshape(x.size(0), features)) * 2.0

    model = Reshaper().to(DT)
    gm = convert(model)
    kinds = [type(m) for m in gm.modules()]
    assert SumModule not in kinds and MultiplyModule not in kinds
    assert kinds.count(ScaleModule) == 1  # only the tensor scaling became a module
    x = torch.randn(3, 2, 3, dtype=DT)
    assert torch.equal(gm(x), model(x))
