"""Example data and brute-force curvature references for tests and demos.

The data helpers work fully offline. If a copy of MNIST is already on disk (and torchvision
is installed) it is used; nothing is ever downloaded. Otherwise the package falls back to
1797 real handwritten digits shipped in ``backpack/utils/data/digits.bin.gz`` (UCI optical
recognition digits, CC BY 4.0, see ``DIGITS_LICENSE.txt``), upsampled from 8x8 to MNIST's
28x28 layout.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module
from torch.utils.data import DataLoader, Dataset, TensorDataset

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

DIGITS_FILE = Path(__file__).resolve().parent / "data" / "digits.bin.gz"
NUM_DIGITS = 1797
_DIGIT_SIDE = 8
_DIGIT_MAX = 16.0
_BOX_SIDE = 20  # MNIST digits are centred in a 20x20 box ...
_IMAGE_SIDE = 28  # ... inside a 28x28 frame.

_MNIST_ROOT_ENV = "BACKPACK_MNIST_ROOT"
_DEFAULT_MNIST_ROOT = Path("~/.cache/backpack/mnist")

# decoded, normalised embedded digits: ([1797, 1, 28, 28] float32, [1797] int64)
_DIGITS_CACHE: tuple[Tensor, Tensor] | None = None
# per MNIST root: (uint8 images [N, 28, 28], int64 labels [N]), or None if unavailable
_MNIST_CACHE: dict[str, tuple[Tensor, Tensor] | None] = {}


def _normalise(images01: Tensor) -> Tensor:
    """Apply MNIST's standardisation to images with values in ``[0, 1]``."""
    return (images01 - MNIST_MEAN) / MNIST_STD


def _read_digit_bytes() -> tuple[Tensor, Tensor]:
    """Decode the embedded file into uint8 images ``[N, 8, 8]`` and uint8 labels ``[N]``."""
    with gzip.open(DIGITS_FILE, "rb") as handle:
        raw = bytearray(handle.read())
    pixels = NUM_DIGITS * _DIGIT_SIDE * _DIGIT_SIDE
    if len(raw) != pixels + NUM_DIGITS:
        raise RuntimeError(
            f"Corrupt digits file {DIGITS_FILE}: expected {pixels + NUM_DIGITS} bytes, "
            f"got {len(raw)}."
        )
    data = torch.frombuffer(raw, dtype=torch.uint8)
    images = data[:pixels].reshape(NUM_DIGITS, _DIGIT_SIDE, _DIGIT_SIDE).clone()
    labels = data[pixels:].clone()
    return images, labels


def load_digits_dataset() -> tuple[Tensor, Tensor]:
    """Return all embedded handwritten digits in MNIST format.

    Each 8x8 image (values ``0..16``) is scaled to ``[0, 1]``, bilinearly resized to
    20x20, zero-padded by 4 pixels on every side to 28x28 and standardised with MNIST's
    mean and standard deviation. The result is cached; callers get fresh copies.

    Returns:
        Images of shape ``[1797, 1, 28, 28]`` (float32) and labels ``[1797]`` (int64).

    """
    global _DIGITS_CACHE
    if _DIGITS_CACHE is None:
        images, labels = _read_digit_bytes()
        small = images.to(torch.float32).div_(_DIGIT_MAX).unsqueeze(1)
        box = F.interpolate(
            small, size=(_BOX_SIDE, _BOX_SIDE), mode="bilinear", align_corners=False
        )
        pad = (_IMAGE_SIDE - _BOX_SIDE) // 2
        framed = F.pad(box, (pad, pad, pad, pad), value=0.0)
        _DIGITS_CACHE = (_normalise(framed).contiguous(), labels.to(torch.int64))
    x, y = _DIGITS_CACHE
    return x.clone(), y.clone()


def _mnist_root() -> Path:
    """Directory in which an existing torchvision MNIST copy is looked for."""
    root = os.environ.get(_MNIST_ROOT_ENV)
    return Path(root).expanduser() if root else _DEFAULT_MNIST_ROOT.expanduser()


def _try_load_mnist() -> tuple[Tensor, Tensor] | None:
    """Load MNIST's training set from disk if present; never downloads.

    Returns:
        uint8 images ``[60000, 28, 28]`` and int64 labels, or ``None`` if unavailable.

    """
    root = _mnist_root()
    key = str(root)
    if key in _MNIST_CACHE:
        return _MNIST_CACHE[key]
    result: tuple[Tensor, Tensor] | None = None
    # torchvision keeps its files in ``<root>/MNIST/raw``; skip the import if that is absent.
    if (root / "MNIST" / "raw").is_dir():
        try:
            from torchvision.datasets import MNIST

            dataset = MNIST(str(root), train=True, download=False)
            result = (dataset.data.to(torch.uint8), dataset.targets.to(torch.int64))
        except Exception:  # any failure means "not available"
            result = None
    _MNIST_CACHE[key] = result
    return result


def _uint8_to_input(images: Tensor) -> Tensor:
    """Convert uint8 ``[B, 28, 28]`` MNIST images into normalised ``[B, 1, 28, 28]``."""
    return _normalise(images.to(torch.float32).div_(255.0)).unsqueeze(1)


def _source() -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
    """Pick MNIST from disk if possible, else the embedded digits.

    Returns:
        Stored images, labels and a function turning a slice of the stored images into
        normalised float32 ``[B, 1, 28, 28]`` inputs.

    """
    mnist = _try_load_mnist()
    if mnist is not None:
        return mnist[0], mnist[1], _uint8_to_input
    load_digits_dataset()  # fills the cache
    assert _DIGITS_CACHE is not None
    return _DIGITS_CACHE[0], _DIGITS_CACHE[1], lambda batch: batch.clone()


def load_one_batch_mnist(
    batch_size: int = 64, shuffle: bool = True, flat: bool = False
) -> tuple[Tensor, Tensor]:
    """Return one batch of MNIST-like handwritten digits.

    Real MNIST (training split) is used when torchvision is installed and the data already
    lies in ``$BACKPACK_MNIST_ROOT`` (default ``~/.cache/backpack/mnist``); otherwise the
    embedded digits are used (see `load_digits_dataset`).

    Args:
        batch_size: Number of samples.
        shuffle: If ``True``, draw the samples with ``torch.randperm`` from torch's global
            random generator (reproducible via ``torch.manual_seed``); otherwise return the
            first ``batch_size`` samples.
        flat: If ``True``, return inputs of shape ``[N, 784]`` instead of ``[N, 1, 28, 28]``.

    Returns:
        Normalised float32 inputs and int64 labels of shape ``[N]``, on torch's default device
        (the CPU unless ``torch.set_default_device`` changed it).

    Raises:
        ValueError: If ``batch_size`` is not in ``1..len(dataset)``.

    """
    images, labels, convert = _source()
    num_samples = labels.shape[0]
    if not 1 <= batch_size <= num_samples:
        raise ValueError(f"batch_size must be in [1, {num_samples}], got {batch_size}.")
    if shuffle:
        index = torch.randperm(num_samples, device=labels.device)[:batch_size]
    else:
        index = torch.arange(batch_size, device=labels.device)
    x = convert(images[index])
    y = labels[index].clone()
    if flat:
        x = x.reshape(batch_size, -1)
    device = torch.get_default_device()
    return x.to(device), y.to(device)


class _NormalisedMNIST(Dataset):
    """Map-style dataset converting stored uint8 MNIST images on access."""

    def __init__(self, images: Tensor, labels: Tensor):
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return _uint8_to_input(self.images[index : index + 1])[0], self.labels[index]


def get_mnist_dataloader(batch_size: int = 64, shuffle: bool = True) -> DataLoader:
    """Return a data loader over MNIST's training set (if on disk) or the embedded digits.

    Args:
        batch_size: Samples per batch.
        shuffle: Whether to reshuffle every epoch (uses torch's global random generator).

    Returns:
        Loader yielding normalised float32 ``[B, 1, 28, 28]`` inputs and int64 labels.

    """
    mnist = _try_load_mnist()
    dataset: Dataset
    if mnist is not None:
        dataset = _NormalisedMNIST(*mnist)
    else:
        dataset = TensorDataset(*load_digits_dataset())
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def _batched_grad(
    output: Tensor, inputs: Sequence[Tensor], retain_graph: bool
) -> list[Tensor | None]:
    """Gradients of every entry of a flat ``output`` w.r.t. ``inputs`` (one row per entry)."""
    basis = torch.eye(output.numel(), dtype=output.dtype, device=output.device)
    try:
        return list(
            torch.autograd.grad(
                output,
                inputs,
                grad_outputs=basis,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=True,
            )
        )
    except RuntimeError:
        # some operations do not support vmap; fall back to one backward pass per entry
        rows = [
            torch.autograd.grad(
                output, inputs, grad_outputs=e, retain_graph=True, allow_unused=True
            )
            for e in basis
        ]
        result: list[Tensor | None] = []
        for j, inp in enumerate(inputs):
            grads = [row[j] for row in rows]
            if all(g is None for g in grads):
                result.append(None)
            else:
                result.append(
                    torch.stack([torch.zeros_like(inp) if g is None else g for g in grads])
                )
        return result


def autograd_diag_ggn_exact(
    x: Tensor,
    y: Tensor,
    model: Module,
    loss_function: Module | Callable[[Tensor, Tensor], Tensor],
    idx: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Compute the exact diagonal of the generalised Gauss-Newton matrix with autograd.

    For ``f = model(x)`` and ``L = loss_function(f, y)`` the GGN is ``J^T H J`` with ``J``
    the Jacobian of the flattened output w.r.t. the flattened, concatenated trainable
    parameters (order of ``model.parameters()``) and ``H`` the Hessian of ``L`` w.r.t. the
    flattened output. Intended as a reference for small problems only: the full
    Jacobian (output size x number of parameters) is materialised.

    Args:
        x: Input batch.
        y: Targets passed to ``loss_function``.
        model: Network; its parameters with ``requires_grad=True`` are used.
        loss_function: Callable mapping ``(output, y)`` to a scalar loss.
        idx: Flat parameter indices to evaluate (in the order given). ``None`` means all.

    Returns:
        GGN diagonal entries, shape ``[P]`` or ``[len(idx)]``.

    Raises:
        ValueError: If the model has no trainable parameters, the loss is not a scalar,
            or an index is out of range.

    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The model has no parameters with requires_grad=True.")
    num_params = sum(p.numel() for p in params)

    if idx is None:
        index = torch.arange(num_params, device=params[0].device)
    else:
        index = torch.as_tensor(idx, dtype=torch.long, device=params[0].device).reshape(-1)
        if index.numel() > 0 and (index.min() < 0 or index.max() >= num_params):
            raise ValueError(f"Indices must lie in [0, {num_params}), got {index.tolist()}.")

    with torch.enable_grad():
        output = model(x)
        flat_output = output.reshape(-1)

        # Hessian of the loss w.r.t. the (detached) network output
        out = output.detach().requires_grad_(True)
        loss = loss_function(out, y)
        if loss.numel() != 1:
            raise ValueError(f"The loss must be a scalar, got shape {tuple(loss.shape)}.")
        (grad_out,) = torch.autograd.grad(loss, out, create_graph=True)
        grad_out = grad_out.reshape(-1)
        if grad_out.requires_grad:
            (hess,) = _batched_grad(grad_out, [out], retain_graph=True)
        else:  # loss is (locally) linear in the output
            hess = None
        num_out = flat_output.numel()
        if hess is None:
            hess = torch.zeros(num_out, num_out, dtype=out.dtype, device=out.device)
        hess = hess.reshape(num_out, num_out)

        # Jacobian of the flattened output w.r.t. all parameters: [num_out, num_params]
        jac_blocks = _batched_grad(flat_output, params, retain_graph=False)
        jac = torch.cat(
            [
                torch.zeros(num_out, p.numel(), dtype=flat_output.dtype, device=p.device)
                if block is None
                else block.reshape(num_out, -1)
                for block, p in zip(jac_blocks, params, strict=True)
            ],
            dim=1,
        )

    jac_sel = jac[:, index]
    return torch.einsum("mi,mn,ni->i", jac_sel, hess, jac_sel).detach()
