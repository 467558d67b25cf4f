import gzip

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from backpack.utils import examples
from backpack.utils.examples import (
    DIGITS_FILE,
    MNIST_MEAN,
    MNIST_STD,
    autograd_diag_ggn_exact,
    get_mnist_dataloader,
    load_digits_dataset,
    load_one_batch_mnist,
)


@pytest.fixture(autouse=True)
def _no_real_mnist(monkeypatch, tmp_path):
    """Force the embedded digits, whatever is on this machine."""
    monkeypatch.setenv("BACKPACK_MNIST_ROOT", str(tmp_path / "no-mnist-here"))


def test_digits_file_layout():
    raw = gzip.decompress(DIGITS_FILE.read_bytes())
    assert len(raw) == 1797 * 64 + 1797
    assert max(raw[: 1797 * 64]) == 16
    assert set(raw[1797 * 64 :]) == set(range(10))


def test_digits_dataset_shapes_and_normalisation():
    x, y = load_digits_dataset()
    assert x.shape == (1797, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (1797,) and y.dtype == torch.int64
    assert torch.equal(torch.unique(y), torch.arange(10, device=y.device))
    # 4-pixel zero border like MNIST, i.e. the normalised value of 0
    background = -MNIST_MEAN / MNIST_STD
    assert torch.allclose(x[..., :4, :], torch.full_like(x[..., :4, :], background))
    assert torch.allclose(x[..., :, -4:], torch.full_like(x[..., :, -4:], background))
    pixels01 = x * MNIST_STD + MNIST_MEAN
    assert pixels01.min() >= -1e-6 and pixels01.max() <= 1 + 1e-6
    # statistics are close to MNIST's, hence close to standard after normalisation
    assert abs(x.mean().item()) < 0.2
    assert 0.7 < x.std().item() < 1.2
    # returned tensors are copies: mutating them does not corrupt the cache
    x.zero_()
    assert load_digits_dataset()[0].abs().sum() > 0


def test_load_one_batch_shapes():
    x, y = load_one_batch_mnist(batch_size=32)
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (32,) and y.dtype == torch.int64
    x_flat, y_flat = load_one_batch_mnist(batch_size=5, flat=True)
    assert x_flat.shape == (5, 784) and y_flat.shape == (5,)


def test_load_one_batch_deterministic_under_seed():
    torch.manual_seed(3)
    x1, y1 = load_one_batch_mnist(batch_size=16)
    torch.manual_seed(3)
    x2, y2 = load_one_batch_mnist(batch_size=16)
    x3, _ = load_one_batch_mnist(batch_size=16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)


def test_load_one_batch_no_shuffle_gives_first_samples():
    x_all, y_all = load_digits_dataset()
    x, y = load_one_batch_mnist(batch_size=10, shuffle=False)
    assert torch.equal(x.cpu(), x_all[:10]) and torch.equal(y.cpu(), y_all[:10])
    x_flat, _ = load_one_batch_mnist(batch_size=10, shuffle=False, flat=True)
    assert torch.equal(x_flat.cpu(), x_all[:10].flatten(start_dim=1))


def test_load_one_batch_invalid_size():
    with pytest.raises(ValueError, match="batch_size"):
        load_one_batch_mnist(batch_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        load_one_batch_mnist(batch_size=10_000)


def test_missing_mnist_root_is_not_downloaded(tmp_path):
    assert examples._try_load_mnist() is None
    assert not (tmp_path / "no-mnist-here").exists()


def test_dataloader_covers_digits():
    loader = get_mnist_dataloader(batch_size=500, shuffle=False)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [500, 500, 500, 297]
    x_all, y_all = load_digits_dataset()
    assert torch.equal(torch.cat([b[0] for b in batches]), x_all)
    assert torch.equal(torch.cat([b[1] for b in batches]), y_all)


def _reference_diag_ggn(x, y, model, loss_function):
    names = [n for n, p in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    shapes = [p.shape for p in params]
    sizes = [p.numel() for p in params]
    theta = torch.cat([p.reshape(-1) for p in params])

    def output_of(vec):
        chunks = torch.split(vec, sizes)
        state = {n: c.reshape(s) for n, c, s in zip(names, chunks, shapes, strict=True)}
        return functional_call(model, state, (x,)).reshape(-1)

    out = output_of(theta).detach()
    out_shape = model(x).shape

    def loss_of(flat_out):
        return loss_function(flat_out.reshape(out_shape), y)

    jac = jacrev(output_of)(theta)  # [M, P]
    hess = jacrev(jacrev(loss_of))(out)  # [M, M], reverse-over-reverse
    return torch.diagonal(jac.T @ hess @ jac)


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss_cls", [nn.MSELoss, nn.CrossEntropyLoss])
def test_autograd_diag_ggn_exact_matches_reference(loss_cls, reduction):
    model = _tiny_model()
    loss_function = loss_cls(reduction=reduction)
    x = torch.randn(5, 3, dtype=torch.float64)
    if loss_cls is nn.MSELoss:
        y = torch.randn(5, 2, dtype=torch.float64)
    else:
        y = torch.randint(0, 2, (5,))

    diag = autograd_diag_ggn_exact(x, y, model, loss_function)
    expected = _reference_diag_ggn(x, y, model, loss_function)
    num_params = sum(p.numel() for p in model.parameters())
    assert diag.shape == (num_params,)
    assert torch.allclose(diag, expected, atol=1e-12, rtol=1e-10)
    assert (diag >= -1e-12).all()

    idx = [7, 0, 25, 7, num_params - 1]
    sub = autograd_diag_ggn_exact(x, y, model, loss_function, idx=idx)
    assert sub.shape == (len(idx),)
    assert torch.allclose(sub, expected[idx], atol=1e-12, rtol=1e-10)
    sub_t = autograd_diag_ggn_exact(x, y, model, loss_function, idx=torch.tensor(idx))
    assert torch.allclose(sub_t, sub)


def test_autograd_diag_ggn_exact_skips_frozen_parameters():
    model = _tiny_model()
    model[0].weight.requires_grad_(False)
    x = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    loss_function = nn.MSELoss()
    diag = autograd_diag_ggn_exact(x, y, model, loss_function)
    assert diag.shape == (4 + 8 + 2,)
    model[0].weight.requires_grad_(True)
    full = autograd_diag_ggn_exact(x, y, model, loss_function)
    assert torch.allclose(diag, full[12:])


def test_autograd_diag_ggn_exact_bad_index():
    model = _tiny_model()
    x = torch.randn(2, 3, dtype=torch.float64)
    y = torch.randn(2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="Indices"):
        autograd_diag_ggn_exact(x, y, model, nn.MSELoss(), idx=[100])
