"""What an extension costs at real size, counted on any machine, predicted for a named GPU.

`python -m benchmarks.cost_model [--models resnet18 gpt2 vit_b_16] [--rows ...] [--card h100]
[--out FILE] [--tiny]`

For each model at the size people train it (ResNet-18 on 64 x 3x224x224 with BatchNorm in eval
mode, GPT-2 small on 4 x 512 tokens, a timm ViT-B/16 on 64 x 3x224x224) and each row (a plain
step, the hooks alone, one extension), one training step (forward + backward) is counted at
torch's dispatcher:

- **on the meta device at full size**, with the rules choosing their implementations as on a
  GPU (`backpack.core.device.planning_for("cuda")`): every aten call, split into views (no
  kernel), allocations, host-device synchronisations and kernel launches; the FLOPs of matrix
  products and convolutions (by the precision they run in by default: TF32 for cuDNN's
  convolutions, full float32 for matrix products unless `torch.set_float32_matmul_precision`
  says otherwise) and of everything else; the bytes each kernel reads and writes; the peak of
  the memory the step allocates. Meta tensors carry shapes only, so this takes seconds, and a
  synchronisation (a tensor's value read on the host) in the step shows: it is counted.
- **on the CPU, for the host time**: the same architecture with every width shrunk (same
  modules, calls and hooks; the arithmetic negligible), timed on one thread. This is the
  Python (hooks, rules) and dispatch work a GPU waits for.

The prediction for a card (`CARDS`: published peak FLOPs per precision and memory bandwidth)
is a roofline with two calibrated constants: each kernel takes the longer of its FLOPs at the
achieved share of the precision's peak and its bytes at the achieved share of the bandwidth,
plus a minimum per launch; the host runs ahead of the card, so a step takes the longer of the
card's time and the host's, and every synchronisation adds the host's latency. The achieved
shares come from the plain steps measured on an H100 (`results-cuda-h100.md`), the host's
speed relative to this machine's from its rows "hooks only" (see `CALIBRATION`).

The **floor** of a row is the fewest FLOPs and bytes any algorithm needs for its quantity on
top of the plain step (`floors`): per layer the cheaper of per-sample gradients and the ghost
Gram for BatchL2Grad, one backpropagated Monte-Carlo column for DiagGGNMC and KFAC, the input's
(unfolded) Gram for KFAC "expand", and so on; its predicted time uses the same roofline.

Counts are exact at full size (nothing is scaled); the host time is that of the narrow twin
(it does not depend on the widths, except where a rule splits work into chunks by size).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from benchmarks.gpu_models import Logits, torch_func_step
from benchmarks.report import finish

aten = torch.ops.aten

#: published dense peaks (FLOP/s) per precision and memory bandwidth (bytes/s)
CARDS: dict[str, dict[str, float]] = {
    "h100": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "bandwidth": 3.35e12},
    "h200": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "bandwidth": 4.8e12},
    "a100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "bandwidth": 2.04e12},
    "rtx-a6000": {"fp32": 38.7e12, "tf32": 77.4e12, "bf16": 154.8e12, "bandwidth": 0.768e12},
}
CARD_NAMES = {
    "h100": "NVIDIA H100 SXM 80GB",
    "h200": "NVIDIA H200 141GB",
    "a100": "NVIDIA A100 80GB",
    "rtx-a6000": "NVIDIA RTX A6000",
}

#: measured on one H100 (`results-cuda-h100.md`, torch 2.11): plain step times (s) and the
#: ratios of every row, the reference the prediction is checked against
H100_MEASURED: dict[str, dict[str, float]] = {
    "resnet18": {
        "plain": 16.9e-3,
        "hooks only": 1.20,
        "BatchGrad": 2.44,
        "BatchL2Grad": 5.21,
        "Variance": 8.43,
        "DiagGGNMC": 6.86,
        "KFAC": 5.33,
        "torch.func": 3.62,
    },
    "gpt2": {
        "plain": 55.6e-3,
        "hooks only": 1.10,
        "BatchGrad": 1.61,
        "BatchL2Grad": 2.18,
        "Variance": 2.43,
        "DiagGGNMC": 5.14,
        "torch.func": 1.58,
    },
}


@dataclass
class Calibration:
    """The cost model's constants (see the module docstring for how they were fitted)."""

    #: achieved share of the peak FLOP rate of float32 matrix products (cuBLAS, no TF32)
    fp32: float = 0.61
    #: ... of TF32 / bf16 tensor-core products (cuDNN's convolutions at these channel counts
    #: reach a much smaller share of the peak than large GEMMs do)
    tensor_cores: float = 0.11
    #: achieved share of the memory bandwidth (every kernel)
    memory: float = 0.6
    #: the card's time of a kernel that does (almost) nothing (s)
    launch: float = 2.5e-6
    #: host time per operator call on the GPU machine, beyond what the CPU twin shows (s)
    per_call: float = 4e-6
    #: host time of the GPU machine per second of this machine's CPU-twin time
    host_speed: float = 1.6
    #: what a host-device synchronisation costs the step (s): the card drains, then waits
    sync: float = 50e-6


CALIBRATION = Calibration()

# ------------------------------------------------------------------------------------------------
# Counting at the dispatcher

#: ops that launch no kernel although they are not views
_NO_KERNEL = {
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "aten::_unsafe_view",
    "aten::empty",
    "aten::empty_like",
    "aten::new_empty",
    "aten::empty_strided",
    "aten::new_empty_strided",
    "aten::resize_",
    "aten::set_",
    "aten::_reshape_alias",
    "aten::sym_size",
    "aten::sym_stride",
    "aten::sym_numel",
    "aten::sym_storage_offset",
    "aten::is_same_size",
    "aten::_has_compatible_shallow_copy_type",
}
_ALLOCATIONS = {
    "aten::empty",
    "aten::empty_like",
    "aten::new_empty",
    "aten::empty_strided",
    "aten::new_empty_strided",
}
_SYNCS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal"}
#: in-place or out= variants counted with the formula of their functional form
_FLOP_ALIASES = {
    "addmm_": aten.addmm,
    "baddbmm_": aten.baddbmm,
    "addbmm": None,
    "addbmm_": None,
}
_CONVOLUTIONS = {"convolution", "_convolution", "convolution_backward", "cudnn_convolution"}


def _unique_tensors(obj: Any, found: dict[int, Tensor]) -> None:
    if isinstance(obj, Tensor):
        found.setdefault(id(obj), obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _unique_tensors(o, found)
    elif isinstance(obj, dict):
        for o in obj.values():
            _unique_tensors(o, found)


def _touched_bytes(t: Tensor) -> int:
    """Bytes a kernel reads or writes of `t`: broadcast (stride-0) axes count once."""
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def _conv_backward_flops(args: tuple) -> int:
    """FLOPs of `convolution_backward`: each of the input and weight gradients costs the
    forward's (torch's own formula ignores groups in the weight gradient)."""
    grad_out, x, w, transposed, mask = args[0], args[1], args[2], args[7], args[10]
    grid = (x if transposed else grad_out).shape[2:]
    forward = 2 * x.shape[0] * math.prod(w.shape) * math.prod(grid)
    return forward * (int(mask[0]) + int(mask[1]))


def _addbmm_flops(args: tuple) -> int:
    b1, b2 = args[1], args[2]
    return 2 * b1.shape[0] * b1.shape[1] * b1.shape[2] * b2.shape[2]


@dataclass
class Counts:
    """What one step asked of the dispatcher."""

    calls: int = 0
    views: int = 0
    allocations: int = 0
    kernels: int = 0
    syncs: int = 0
    #: FLOPs of matrix products / convolutions, by the precision they run in by default
    flops: Counter = field(default_factory=Counter)
    #: elementwise and reduction FLOPs (one per output element; bandwidth decides their time)
    other_flops: int = 0
    bytes: int = 0
    #: roofline time of every kernel on the card, filled by `Model.card_time`
    kernel_list: list[tuple[str, int, int]] = field(default_factory=list)
    peak_bytes: int = 0
    ops: Counter = field(default_factory=Counter)


class _Counter(TorchDispatchMode):
    """Counts every aten call (see `Counts`) and tracks the live bytes the step allocated."""

    def __init__(self, matmul_tf32: bool, conv_tf32: bool) -> None:
        super().__init__()
        self.counts = Counts()
        self.matmul = "tf32" if matmul_tf32 else "fp32"
        self.conv = "tf32" if conv_tf32 else "fp32"
        self._live = 0
        self._storages: dict[int, list] = {}

    def _track(self, out: Any) -> None:
        found: dict[int, Tensor] = {}
        _unique_tensors(out, found)
        for t in found.values():
            try:
                key = t.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):  # pragma: no cover - sparse etc.
                continue
            entry = self._storages.get(key)
            if entry is None:
                nbytes = t.untyped_storage().nbytes()
                entry = self._storages[key] = [0, nbytes]
                self._live += nbytes
                self.counts.peak_bytes = max(self.counts.peak_bytes, self._live)
            entry[0] += 1
            weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self._live -= entry[1]
            del self._storages[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counts
        name = func.name()
        c.calls += 1
        c.ops[name] += 1
        if name in _SYNCS:
            c.syncs += 1
            c.kernels += 1
        elif func.is_view or name in _NO_KERNEL:
            if name in _ALLOCATIONS:
                c.allocations += 1
            else:
                c.views += 1
        else:
            c.kernels += 1
            inputs: dict[int, Tensor] = {}
            _unique_tensors((args, kwargs), inputs)
            outputs: dict[int, Tensor] = {}
            _unique_tensors(out, outputs)
            nbytes = sum(_touched_bytes(t) for t in inputs.values())
            nbytes += sum(_touched_bytes(t) for k, t in outputs.items() if k not in inputs)
            packet = func.overloadpacket
            short = name.split("::")[-1]
            formula = flop_registry.get(packet)
            if short == "convolution_backward":
                formula = lambda *a, out_val=None, **k: _conv_backward_flops(a)  # noqa: E731
            if formula is None and short in _FLOP_ALIASES:
                alias = _FLOP_ALIASES[short]
                formula = None if alias is None else flop_registry.get(alias)
                if alias is None:
                    flops = _addbmm_flops(args)
                    c.flops[self.matmul] += flops
                    c.kernel_list.append((self.matmul, flops, nbytes))
                    c.bytes += nbytes
                    self._track(out)
                    return out
            if formula is not None:
                try:
                    flops = int(formula(*args, **kwargs, out_val=out))
                except Exception:  # noqa: BLE001 - an unusual signature: count its bytes only
                    flops = 0
                base = short.rstrip("_")
                matmul = "tf32" if torch.backends.cuda.matmul.allow_tf32 else self.matmul
                precision = self.conv if base in _CONVOLUTIONS else matmul
                if any(t.dtype in (torch.bfloat16, torch.float16) for t in inputs.values()):
                    precision = "bf16"
                c.flops[precision] += flops
                c.kernel_list.append((precision, flops, nbytes))
            else:
                elements = sum(t.numel() for t in outputs.values())
                c.other_flops += elements
                c.kernel_list.append(("other", elements, nbytes))
            c.bytes += nbytes
        self._track(out)
        return out


# ------------------------------------------------------------------------------------------------
# Models


def _narrow_resnet(model: nn.Module, factor: int) -> nn.Module:
    """The same ResNet with every channel count divided by `factor` (the RGB input kept)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Conv2d):
                c_in = child.in_channels if child.in_channels == 3 else child.in_channels // factor
                new = nn.Conv2d(
                    c_in,
                    child.out_channels // factor,
                    child.kernel_size,
                    child.stride,
                    child.padding,
                    bias=child.bias is not None,
                )
            elif isinstance(child, nn.BatchNorm2d):
                new = nn.BatchNorm2d(child.num_features // factor)
            elif isinstance(child, nn.Linear):
                new = nn.Linear(child.in_features // factor, 10)
            else:
                continue
            setattr(module, child_name, new)
    return model.eval()


def resnet18(scale: str) -> tuple[nn.Module, Tensor, Tensor]:
    """torchvision's ResNet-18, BatchNorm in eval mode (`scale`: "full", "twin", "tiny")."""
    from torchvision.models import resnet18 as build

    if scale == "full":
        n, size, classes = 64, 224, 1000
        model = build(num_classes=classes).eval()
    else:
        n, size, classes = 1, 32, 10
        model = _narrow_resnet(build(num_classes=classes), 16)
    x = torch.randn(n, 3, size, size)
    return model, x, torch.randint(0, classes, (n,))


def gpt2(scale: str) -> tuple[nn.Module, Tensor, Tensor]:
    """Hugging Face GPT-2 small (124M parameters, random weights) on 4 x 512 tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if scale == "full":
        n, t, config = 4, 512, GPT2Config()
    else:  # the same twelve blocks, narrow
        n, t = 1, 8
        config = GPT2Config(vocab_size=64, n_positions=16, n_embd=24, n_head=12)
    config.attn_pdrop = config.embd_pdrop = config.resid_pdrop = 0.0
    config.bos_token_id = config.eos_token_id = 0
    model = Logits(GPT2LMHeadModel(config).eval())
    tokens = torch.randint(0, config.vocab_size, (n, t + 1))
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].flatten().contiguous()


def vit_b_16(scale: str) -> tuple[nn.Module, Tensor, Tensor]:
    """timm's ViT-B/16 (86M parameters, random weights) on 64 x 3x224x224, 1000 classes."""
    from timm.models.vision_transformer import VisionTransformer

    if scale == "full":
        n, size, classes = 64, 224, 1000
        model = VisionTransformer(img_size=224, patch_size=16, embed_dim=768, depth=12,
                                  num_heads=12, num_classes=classes)
    else:
        n, size, classes = 1, 32, 10
        model = VisionTransformer(img_size=32, patch_size=16, embed_dim=24, depth=12,
                                  num_heads=12, num_classes=classes)
    x = torch.randn(n, 3, size, size)
    return model.eval(), x, torch.randint(0, classes, (n,))


MODELS: dict[str, Callable[[str], tuple[nn.Module, Tensor, Tensor]]] = {
    "resnet18": resnet18,
    "gpt2": gpt2,
    "vit_b_16": vit_b_16,
}

ROWS = (
    "plain",
    "hooks only",
    "BatchGrad",
    "BatchL2Grad",
    "SumGradSquared",
    "Variance",
    "DiagGGNMC",
    "KFAC",
    "torch.func",
)


# ------------------------------------------------------------------------------------------------
# Steps


def _clear(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None
        for key in [k for k in p.__dict__ if not k.startswith("_")]:
            delattr(p, key)


def _steady(model: nn.Module) -> None:
    """Mark every parameter and module as past the checks of their first passes.

    backpack checks, by reading values on the host, that the extended calls cover a
    parameter's gradient (and that broadcast rows add up) on the first four passes that meet
    it and every 16th after (`backpack.passes.coverage.due_for_check`); a training loop's
    typical step does not, and neither does the counted one.
    """
    from backpack.passes.coverage import assume_checked

    for obj in [*model.parameters(), *model.modules()]:
        assume_checked(obj)


#: parameters a row freezes, by model class name: KFAC refuses ViT-B/16's position embedding
#: (no Kronecker rule; its dense block would be 151,296² entries), so its row counts the rest
FROZEN_FOR_ROW: dict[tuple[str, str], tuple[str, ...]] = {
    ("VisionTransformer", "KFAC"): ("pos_embed",),
}


def make_step(row: str, model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], None]:
    """One training step of `row` on `model` (extended in place unless the row is plain)."""
    from backpack import backpack, extend
    from backpack import extensions as E

    for name in FROZEN_FOR_ROW.get((type(model).__name__, row), ()):
        model.get_parameter(name).requires_grad_(False)

    if row == "plain":
        lossfunc = nn.CrossEntropyLoss()

        def plain() -> None:
            lossfunc(model(x), y).backward()

        return plain
    if row == "torch.func":
        return torch_func_step(model, x, y)
    extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    make = (lambda: []) if row == "hooks only" else (lambda: [getattr(E, row)()])

    def step() -> None:
        with backpack(*make()):
            lossfunc(model(x), y).backward()

    return step


@contextlib.contextmanager
def _planned(device_type: str) -> Any:
    from backpack.core.device import planning_for

    with planning_for(device_type), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def count_row(name: str, row: str) -> Counts | str:
    """The full-size step of `row` on model `name`, counted on the meta device.

    Row "forward" is the plain forward alone (without gradients: the work a data-gradient
    backward of one column roughly repeats).
    """
    with torch.device("meta"):
        model, x, y = MODELS[name]("full")
    with _planned("cuda"):
        if row == "forward":

            def step() -> None:
                with torch.no_grad():
                    model(x)

        else:
            step = make_step(row, model, x, y)
        try:
            _steady(model)
            step()  # first call: class lookups, caches
            _clear(model)
            counter = _Counter(
                torch.get_float32_matmul_precision() != "highest",
                torch.backends.cudnn.allow_tf32,
            )
            from backpack.core import device

            reads = device.META_READS[0]
            with counter:
                step()
            counter.counts.syncs += device.META_READS[0] - reads
        except Exception as err:  # noqa: BLE001 - the row's result
            return f"{type(err).__name__}: {str(err).splitlines()[0][:150]}"
    return counter.counts


def host_seconds(name: str, row: str, repeats: int = 7) -> float:
    """Median wall time of the narrow twin's step of `row` on this machine's CPU (1 thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model, x, y = MODELS[name]("twin")
        with _planned("cuda"):
            step = make_step(row, model, x, y)
            times = []
            _steady(model)
            for i in range(repeats + 2):
                _clear(model)
                start = time.perf_counter()
                step()
                if i >= 2:
                    times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# Floors


@dataclass
class Layer:
    """A parametrized call as the floors see it: per sample, a `[T, I] -> [T, O]` product."""

    kind: str
    n: int
    t: int
    i: int
    o: int
    params: int
    #: elements of the call's output per sample (backpropagating a column reads and writes it)
    out_elements: int


def survey(name: str) -> list[Layer]:
    """The parametrized leaf calls of one full-size forward (meta device)."""
    with torch.device("meta"):
        model, x, y = MODELS[name]("full")
    layers: list[Layer] = []
    n = x.shape[0]

    def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        inp = args[0]
        params = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        out_el = out.numel() // n
        if isinstance(module, nn.Conv2d):
            k = math.prod(module.kernel_size)
            t = math.prod(out.shape[2:])
            layers.append(Layer("conv", n, t, module.in_channels // module.groups * k,
                                module.out_channels, params, out_el))
        elif isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            i, o = inp.shape[-1], out.shape[-1]
            layers.append(Layer("linear", n, inp.numel() // (n * i), i, o, params, out_el))
        elif isinstance(module, nn.Embedding):
            layers.append(Layer("embedding", n, inp.numel() // n, module.num_embeddings,
                                module.embedding_dim, params, out_el))
        elif params:
            c = sum(p.numel() for p in module.parameters(recurse=False)) // 2 or 1
            layers.append(Layer("norm", n, out.numel() // (n * c), c, c, params, out_el))

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return layers


def _ghost(layer: Layer) -> tuple[float, float]:
    """FLOPs and bytes of per-sample squared norms by the Gram of inputs and of gradients."""
    n, t, i, o = layer.n, layer.t, layer.i, layer.o
    return 2.0 * n * t * t * (i + o) + 2 * n * t * t, 4.0 * n * (t * (i + o) + t * t)


def _per_sample(layer: Layer) -> tuple[float, float]:
    """FLOPs and bytes of per-sample weight gradients, squared and summed as they are formed."""
    n, t, i, o = layer.n, layer.t, layer.i, layer.o
    return 2.0 * n * t * i * o + 2 * n * i * o, 4.0 * n * t * (i + o)


#: a floor's extra work: (precision, FLOPs, bytes) per layer, like one kernel each
Work = list[tuple[str, float, float]]


def floors(layers: list[Layer], card: dict, cal: Calibration) -> dict[str, tuple[Work, bool]]:
    """Per row: the extra work over the plain step that any algorithm needs, and whether the
    row also backpropagates one Monte-Carlo column (a data-gradient backward: about the
    forward's work; see `floor_seconds`).

    Products of convolutions run in the precision of cuDNN's convolutions, those of linear
    layers in that of float32 matrix products (as `products_like_convolutions` arranges).
    """
    conv = "tf32" if torch.backends.cudnn.allow_tf32 else "fp32"
    matmul = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    result: dict[str, Work] = {row: [] for row in ROWS if row != "plain"}

    def add(row: str, precision: str, flops: float, nbytes: float) -> None:
        result[row].append((precision, flops, nbytes))

    for layer in layers:
        n, t, i, o, p = layer.n, layer.t, layer.i, layer.o, layer.params
        if layer.kind in ("linear", "conv"):
            prec = conv if layer.kind == "conv" else matmul
            # per-sample gradients are formed by the product that gives .grad anyway (their
            # sum): the floor writes them and sums them
            add("BatchGrad", "other", n * p, 8.0 * n * p)
            ghost, per_sample = _ghost(layer), _per_sample(layer)
            cheaper = min(
                (ghost, per_sample), key=lambda fb: _roofline(card, cal, prec, fb[0], fb[1])
            )
            add("BatchL2Grad", prec, *cheaper)
            if t == 1:  # Σ_n (g_n x_nᵀ)² = (g²)ᵀ(x²): one product of the squared factors
                squares = (2.0 * n * i * o + 2 * n * (i + o), 4.0 * n * (i + o) + 4 * i * o)
            else:
                squares = per_sample
            add("SumGradSquared", prec, *squares)
            add("Variance", prec, squares[0] + 3 * p, squares[1] + 8 * p)
            add("DiagGGNMC", prec, *squares)
            # KFAC "expand": the symmetric input Gram over all positions; the output Gram of
            # the column (summed over positions first for convolutions, the original's
            # convention)
            g_rows = n if layer.kind == "conv" else n * t
            add("KFAC", prec, n * t * i * i + g_rows * o * o, 4.0 * (n * t * i + i * i + o * o))
        elif layer.kind == "embedding":  # T looked-up rows of width O per sample
            add("BatchGrad", "other", n * p, 8.0 * n * p)
            add("BatchL2Grad", matmul, 2.0 * n * t * t * (1 + o), 4.0 * n * t * o)
            for row in ("SumGradSquared", "Variance", "DiagGGNMC"):
                add(row, "other", 2.0 * n * t * o, 4.0 * n * t * o + 4 * p)
            add("KFAC", matmul, n * t * o * o, 4.0 * (n * t * o + i + o * o))
        else:  # normalisation: per-sample sums over positions of g x̂ and g
            work, moved = 4.0 * n * t * i, 8.0 * n * t * i
            add("BatchGrad", "other", work + n * p, moved + 8.0 * n * p)
            for row in ("BatchL2Grad", "SumGradSquared", "Variance", "DiagGGNMC"):
                add(row, "other", work + 2 * n * p, moved)
    result["torch.func"] = result["BatchGrad"]
    column = {"DiagGGNMC", "KFAC"}
    return {row: (work, row in column) for row, work in result.items()}


# ------------------------------------------------------------------------------------------------
# The roofline


def _roofline(card: dict, cal: Calibration, precision: str, flops: float, nbytes: float) -> float:
    """Seconds of one kernel (or a sum of kernels' totals) on `card`."""
    peak = card.get(precision, card["fp32"])
    if precision == "other":
        compute = 0.0
    elif precision == "fp32":
        compute = flops / (card["fp32"] * cal.fp32)
    else:
        compute = flops / (peak * cal.tensor_cores)
    return max(compute, nbytes / (card["bandwidth"] * cal.memory))


def card_seconds(counts: Counts, card: dict, cal: Calibration) -> float:
    """The card's time of a counted step: every kernel on the roofline, plus launches."""
    total = sum(_roofline(card, cal, p, f, b) for p, f, b in counts.kernel_list)
    return total + counts.kernels * cal.launch


def predict(counts: Counts, host: float, card: dict, cal: Calibration) -> float:
    """Seconds of the step: the card's time or the host's, whichever is longer, plus syncs."""
    host_total = host * cal.host_speed + counts.calls * cal.per_call
    return max(card_seconds(counts, card, cal), host_total) + counts.syncs * cal.sync


def floor_seconds(
    plain: Counts,
    forward: Counts,
    floor: tuple[Work, bool],
    card: dict,
    cal: Calibration,
    plain_host: float,
) -> float:
    """Predicted time of a row's floor: the plain step plus the extra work, each layer's as one
    kernel, plus one more data-gradient backward (the forward's kernels) where the row
    backpropagates a column; the host's time is the plain step's."""
    work, column = floor
    gpu = card_seconds(plain, card, cal) + sum(_roofline(card, cal, *w) for w in work)
    if column:
        gpu += card_seconds(forward, card, cal)
    host = plain_host * cal.host_speed + plain.calls * cal.per_call
    return max(gpu, host)


def _bisect(f: Callable[[float], float], target: float, lo: float = 1e-3, hi: float = 1.0) -> float:
    """The x in [lo, hi] with f(x) = target, f decreasing in x (geometric bisection)."""
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def calibrate(card_name: str = "h100") -> Calibration:
    """Fit the constants to the H100 rows: tensor-core and float32 shares from the plain steps
    of ResNet-18 (convolutions: TF32) and GPT-2 (float32 products), the host's speed from
    ResNet-18's "hooks only" row (host-bound there: the card's work is the plain step's)."""
    card = CARDS[card_name]
    cal = copy.copy(CALIBRATION)
    counts = {name: count_row(name, "plain") for name in ("resnet18", "gpt2")}
    for name, c in counts.items():
        assert isinstance(c, Counts), (name, c)

    def with_cal(**changes: float) -> Calibration:
        changed = copy.copy(cal)
        for key, value in changes.items():
            setattr(changed, key, value)
        return changed

    resnet, gpt = counts["resnet18"], counts["gpt2"]
    for _ in range(3):  # the two shares barely interact; a few rounds settle them
        cal.tensor_cores = _bisect(
            lambda e: card_seconds(resnet, card, with_cal(tensor_cores=e)),
            H100_MEASURED["resnet18"]["plain"],
        )
        cal.fp32 = _bisect(
            lambda e: card_seconds(gpt, card, with_cal(fp32=e)), H100_MEASURED["gpt2"]["plain"]
        )
    hooks = count_row("resnet18", "hooks only")
    assert isinstance(hooks, Counts), hooks
    measured = H100_MEASURED["resnet18"]["hooks only"] * H100_MEASURED["resnet18"]["plain"]
    twin = host_seconds("resnet18", "hooks only")
    cal.host_speed = max(0.0, (measured - hooks.calls * cal.per_call) / twin)
    return cal


# ------------------------------------------------------------------------------------------------
# Report


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "—"


def run(models: list[str], rows: list[str], card_name: str, host: bool) -> list[str]:
    """Count, time and predict every row of every model; the report's markdown lines."""
    card, cal = CARDS[card_name], CALIBRATION
    lines = [
        "# What an extension costs at real size (`python -m benchmarks.cost_model`)",
        "",
        f"torch {torch.__version__}; counted on the meta device with the GPU's implementation "
        f"choices; predicted for {CARD_NAMES[card_name]} ({card['fp32'] / 1e12:.0f} / "
        f"{card['tf32'] / 1e12:.0f} TFLOP/s FP32 / TF32, {card['bandwidth'] / 1e12:.2f} TB/s); "
        f"float32 matrix products in precision '{torch.get_float32_matmul_precision()}', "
        f"cuDNN TF32 {'on' if torch.backends.cudnn.allow_tf32 else 'off'}.",
        "",
    ]
    for name in models:
        counted = {row: count_row(name, row) for row in rows}
        plain = counted.get("plain")
        if not isinstance(plain, Counts):
            raise RuntimeError(f"the plain step of {name} failed: {plain}")
        hosts = {row: host_seconds(name, row) if host else 0.0 for row in rows
                 if isinstance(counted[row], Counts)}
        forward = count_row(name, "forward")
        assert isinstance(forward, Counts), forward
        floor_work = floors(survey(name), card, cal)
        measured = H100_MEASURED.get(name, {}) if card_name == "h100" else {}
        p_plain = predict(plain, hosts.get("plain", 0.0), card, cal)
        lines += [
            f"## {name}",
            "",
            "| row | aten calls | kernels | views | syncs | matmul/conv GFLOP (fp32 / tf32) "
            "| other GFLOP | GB moved | peak GB | host ms (CPU twin) | predicted | floor "
            "| predicted / floor | measured (H100) |",
            "|---|" + "---|" * 14,
        ]
        verdicts: list[str] = []
        for row in rows:
            c = counted[row]
            if not isinstance(c, Counts):
                lines.append(f"| {row} | failed: {c} |" + " |" * 13)
                continue
            pred = predict(c, hosts.get(row, 0.0), card, cal)
            verdicts += _verdicts(row, c, plain, pred / p_plain, counted)
            fl = None
            if row in floor_work or row == "plain":
                fl = floor_seconds(
                    plain, forward, floor_work.get(row, ([], False)), card, cal,
                    hosts.get("plain", 0.0),
                )
            meas = measured.get(row)
            meas_cell = "—" if meas is None else (
                f"{1e3 * meas:.1f} ms" if row == "plain" else f"{meas:.2f}x"
            )
            lines.append(
                f"| {row} | {c.calls} ({_ratio(c.calls, plain.calls)}) | {c.kernels} | {c.views} "
                f"| {c.syncs} | {c.flops['fp32'] / 1e9:.0f} / {c.flops['tf32'] / 1e9:.0f} "
                f"| {c.other_flops / 1e9:.1f} | {c.bytes / 1e9:.1f} | {c.peak_bytes / 1e9:.2f} "
                f"| {1e3 * hosts.get(row, 0.0):.1f} "
                f"| {1e3 * pred:.1f} ms" + ("" if row == "plain" else f" ({_ratio(pred, p_plain)})")
                + " | " + ("—" if fl is None else f"{1e3 * fl:.1f} ms")
                + " | " + ("—" if fl is None else _ratio(pred, fl))
                + f" | {meas_cell} |"
            )
        if verdicts:
            lines += ["", "Targets of the GPU issue on this model:", "", *verdicts]
        lines.append("")
    return lines


#: targets of the GPU issue (ratios to the plain step): predicted time, peak memory, aten calls
TIME_TARGETS = {"hooks only": 1.05, "BatchL2Grad": 1.3, "DiagGGNMC": 2.0, "KFAC": 1.5}
MEMORY_TARGETS = {"BatchL2Grad": 1.1}
CALL_TARGETS = {"hooks only": 1.05}
CALL_TARGET_DEFAULT = 2.0


def _verdicts(row: str, c: Counts, plain: Counts, time_ratio: float, counted: dict) -> list[str]:
    """Markdown list items: each target of `row`, met (✓) or not (✗)."""
    if row in ("plain", "torch.func"):
        return []
    mark = lambda ok: "✓" if ok else "✗"  # noqa: E731
    calls = c.calls / plain.calls
    limit = CALL_TARGETS.get(row, CALL_TARGET_DEFAULT)
    items = [f"- {row}: aten calls {calls:.2f}x (≤ {limit}x {mark(calls <= limit)})"]
    if row in TIME_TARGETS:
        items[-1] += f", time {time_ratio:.2f}x (≤ {TIME_TARGETS[row]}x "
        items[-1] += f"{mark(time_ratio <= TIME_TARGETS[row])})"
    if row in MEMORY_TARGETS:
        memory = c.peak_bytes / plain.peak_bytes
        items[-1] += f", memory {memory:.2f}x (≤ {MEMORY_TARGETS[row]}x "
        items[-1] += f"{mark(memory <= MEMORY_TARGETS[row])})"
    reference = counted.get("torch.func")
    if row == "BatchGrad" and isinstance(reference, Counts):
        items[-1] += f", calls vs torch.func {c.calls / reference.calls:.2f}x"
    return items


def main(argv: list[str] | None = None) -> int:
    """Command line: count, predict and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", default=list(ROWS))
    parser.add_argument("--card", default="h100", choices=list(CARDS))
    parser.add_argument("--no-host", action="store_true", help="skip the CPU-twin timing")
    parser.add_argument("--out", default=None, help="write the markdown here")
    parser.add_argument(
        "--calibrate", action="store_true", help="fit the constants to the H100 rows and print them"
    )
    args = parser.parse_args(argv)
    if args.calibrate:
        print(calibrate())
        return 0
    return finish(run(args.models, args.rows, args.card, not args.no_host), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
