import pytest
import torch
from torch import nn

from backpack.utils.convert_parameters import parameter_list_to_vector, vector_to_parameter_list
from backpack.utils.kroneckers import kfac_mat_prod, kfacs_to_mat, two_kfacs_to_mat
from backpack.utils.subsampling import subsample


def _factors(dims, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(d, d, generator=gen, dtype=torch.float64, device="cpu") for d in dims]


@pytest.mark.parametrize("dims", [[3], [2, 3], [2, 1, 4], [3, 2, 2, 2]])
def test_kfacs_to_mat_matches_kron(dims):
    factors = _factors(dims)
    expected = factors[0]
    for f in factors[1:]:
        expected = torch.kron(expected, f)
    assert torch.allclose(kfacs_to_mat(factors), expected)


def test_two_kfacs_to_mat():
    a, b = _factors([2, 3])
    assert torch.allclose(two_kfacs_to_mat(a, b), torch.kron(a, b))


@pytest.mark.parametrize("dims", [[4], [2, 3], [3, 1, 2], [2, 2, 2, 3]])
def test_kfac_mat_prod_matches_dense(dims):
    factors = _factors(dims, seed=1)
    dense = kfacs_to_mat(factors)
    mat = torch.randn(dense.shape[0], 5, dtype=torch.float64, device="cpu")
    assert torch.allclose(kfac_mat_prod(factors, mat), dense @ mat)
    vec = mat[:, 0]
    result = kfac_mat_prod(factors, vec)
    assert result.shape == vec.shape
    assert torch.allclose(result, dense @ vec)


def test_kroneckers_errors():
    with pytest.raises(ValueError, match="square"):
        kfacs_to_mat([torch.randn(2, 3)])
    with pytest.raises(ValueError, match="at least one"):
        kfacs_to_mat([])
    with pytest.raises(ValueError, match="leading dimension"):
        kfac_mat_prod(_factors([2, 3]), torch.randn(5, 2, dtype=torch.float64))


def test_vector_parameter_round_trip():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Conv1d(1, 2, 3))
    params = list(model.parameters())
    vec = parameter_list_to_vector(params)
    assert vec.shape == (sum(p.numel() for p in params),)
    pieces = vector_to_parameter_list(vec, params)
    assert len(pieces) == len(params)
    for piece, param in zip(pieces, params, strict=True):
        assert piece.shape == param.shape
        assert torch.equal(piece, param)
    new = torch.arange(vec.numel(), dtype=vec.dtype)
    assert torch.equal(parameter_list_to_vector(vector_to_parameter_list(new, params)), new)


def test_vector_to_parameter_list_errors():
    params = [torch.zeros(2, 3), torch.zeros(4)]
    with pytest.raises(ValueError, match="11 entries.*10 entries"):
        vector_to_parameter_list(torch.zeros(11), params)
    with pytest.raises(ValueError, match="1d"):
        vector_to_parameter_list(torch.zeros(2, 5), params)
    with pytest.raises(TypeError):
        vector_to_parameter_list([0.0] * 10, params)
    with pytest.raises(ValueError, match="empty"):
        parameter_list_to_vector([])


def test_subsample():
    t = torch.arange(24).reshape(4, 3, 2)
    assert subsample(t) is t
    assert subsample(t, dim=1, subsampling=None) is t
    assert torch.equal(subsample(t, subsampling=[2, 0, 2]), t[[2, 0, 2]])
    assert torch.equal(subsample(t, dim=1, subsampling=[1]), t[:, [1]])
    assert torch.equal(subsample(t, dim=-1, subsampling=[1, 0]), t[..., [1, 0]])
    assert subsample(t, subsampling=[]).shape == (0, 3, 2)
