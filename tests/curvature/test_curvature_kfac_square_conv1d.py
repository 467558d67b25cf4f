"""`KFAC` operator: a square `Conv1D` weight (`[in, out]`, in == out) is oriented by its rule.

Both axes of a square weight match the factors' sizes; the factors of transformers' `Conv1D`
belong to `weight.T` (its rule's `KRON_TRANSPOSED`), as for an embedding. With one sample, the
Kronecker block of a linear map on `[N, D]` inputs is its exact GGN block.
"""

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from backpack.curvature import KFAC

pytestmark = pytest.mark.cpu_only


def test_square_conv1d_block_is_exact_for_one_sample():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    model = nn.Sequential(
        pytorch_utils.Conv1D(4, 4), nn.Tanh(), pytorch_utils.Conv1D(3, 4)
    ).double()
    X, y = torch.randn(1, 4, dtype=torch.float64), torch.tensor([1])
    op = KFAC(model, nn.CrossEntropyLoss(reduction="sum"), [(X, y)])
    params = {n: p.detach() for n, p in model.named_parameters()}
    jac = jacrev(lambda pp: functional_call(model, pp, (X,)))(params)
    J = torch.cat([j.flatten(2) for j in jac.values()], dim=2)[0]
    p = torch.softmax(model(X), -1)[0].detach()
    ggn = J.T @ (torch.diag(p) - torch.outer(p, p)) @ J
    blocks, start = [], 0
    for q in params.values():
        blocks.append(ggn[start : start + q.numel(), start : start + q.numel()])
        start += q.numel()
    torch.testing.assert_close(op.to_dense(), torch.block_diag(*blocks), rtol=1e-9, atol=1e-12)
