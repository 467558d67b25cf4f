"""The data-set operators' Kronecker conventions against brute force (float64, torch.func).

- Convolutions under `kfac_approx="expand"` follow the published definition: output positions
  act as samples, `G = Σ_{n,l} (∂f_n/∂z_nl)ᵀ H_n (∂f_n/∂z_nl)` (the GGN w.r.t. the layer's
  output z, its diagonal blocks per position summed) and `A = 1/(N L) Σ_{n,l} u uᵀ` over the
  unfolded input patches u. The per-batch extensions keep the original BackPACK's scale:
  `A_ext = L · A` and `G_ext` sums whole per-sample blocks (every pair of positions).
- `separate_weight_and_bias=False`: the block of `[W | b]` is `G ⊗ Ã`, `Ã` the same mean over
  the inputs with a constant 1 appended; one sample at one position gives the exact GGN block
  of `[W | b]`, cross terms included. EK-FAC keeps `Q = Q_G ⊗ Q_Ã` with `diag(Qᵀ C Q)` of the
  brute-force GGN `C`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from curvature_problems import PROBLEMS, Problem, Reference
from torch import Tensor, nn
from torch.func import hessian, jacrev

from backpack.curvature import EKFAC, KFAC, accumulate
from backpack.extensions import KFLR


def close(a, b, atol=1e-12, rtol=1e-9):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def output_ggn(head: nn.Module, tail: nn.Module, lossfunc, X: Tensor, y: Tensor) -> Tensor:
    """The GGN of the loss w.r.t. the output z = head(X) of a layer: `[N, *z, N, *z]`."""
    z = head(X).detach()
    f = tail(z)
    J = jacrev(tail)(z).reshape(f.numel(), z.numel())
    H = hessian(lambda o: lossfunc(o.reshape(f.shape), y))(f.flatten())
    return (J.T @ H @ J).reshape(*z.shape, *z.shape)


def position_blocks(ggn: Tensor, channels_last: bool) -> tuple[Tensor, Tensor]:
    """`(Σ_{n,l} G[n,:,l; n,:,l], Σ_n Σ_{l,l'} G[n,:,l; n,:,l'])` of an output GGN.

    The output is `[N, C, *grid]` (convolutions) or `[N, *positions, C]` (`channels_last`).
    """
    n, half = ggn.shape[0], ggn.dim() // 2
    c = ggn.shape[half - 1] if channels_last else ggn.shape[1]
    positions = ggn[0].numel() // (n * c * c)
    positions = int(round(positions ** 0.5))
    if channels_last:
        g = ggn.reshape(n, positions, c, n, positions, c)  # [N, L, C, N, L, C]
    else:
        g = ggn.reshape(n, c, positions, n, c, positions).permute(0, 2, 1, 3, 5, 4)
    samples = torch.stack([g[i, :, :, i] for i in range(n)])  # [N, L, C, L, C]
    per_position = torch.einsum("nlalb->ab", samples)
    return per_position, samples.sum((0, 1, 3))


def patches(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """`[N, L, C_in·K]`: the unfolded input of a 2-D convolution (zero padding)."""
    u = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    return u.transpose(1, 2)


def joint_dense(g: Tensor, a: Tensor, rows: int, cols: int) -> Tensor:
    """`G ⊗ Ã` of `[W | b]` in the order `W.flatten(), b` (W `[rows, cols]`)."""
    own = torch.kron(g, a)  # on the row-major flattening of [rows, cols + 1]
    order = []
    for o in range(rows):
        order += [o * cols + j for j in range(cols)] + [rows * cols + o]
    idx = torch.tensor(order)
    out = torch.empty_like(own)
    out[idx[:, None], idx[None, :]] = own
    return out


def with_one(u: Tensor) -> Tensor:
    return torch.cat([u, u.new_ones(*u.shape[:-1], 1)], dim=-1)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.act = nn.Tanh()
        self.lin = nn.Linear(3 * 3 * 3, 4)

    def forward(self, x):
        return self.lin(self.act(self.conv(x)).flatten(1))


def cnn_problem():
    torch.manual_seed(0)
    model = CNN().double()
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(7, 2, 5, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (7,), generator=gen)
    return model, X, y


def block_of(dense: Tensor, names, numels, *wanted) -> Tensor:
    starts, start = {}, 0
    for name, n in zip(names, numels):
        starts[name] = (start, start + n)
        start += n
    idx = torch.cat([torch.arange(*starts[w]) for w in wanted])
    return dense[idx[:, None], idx[None, :]]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fold", [False, True])
def test_convolution_expand_is_the_published_definition(reduction, fold):
    model, X, y = cnn_problem()
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    data = [(X[:4], y[:4]), (X[4:], y[4:])]
    op = KFAC(model, lossfunc, data, separate_weight_and_bias=not fold)
    tail = nn.Sequential(model.act, nn.Flatten(), model.lin)
    ggn = output_ggn(model.conv, tail, lossfunc, X, y)
    G, G_ext = position_blocks(ggn, channels_last=False)
    u = patches(model.conv, X)  # [N, L, D]
    n, positions, d = u.shape
    A = torch.einsum("nli,nlj->ij", u, u) / (n * positions)
    dense = op.to_dense()
    names, numels = op.names, op.numels
    if fold:
        u1 = with_one(u)
        A1 = torch.einsum("nli,nlj->ij", u1, u1) / (n * positions)
        expected = joint_dense(G, A1, 3, d)
        close(block_of(dense, names, numels, "conv.weight", "conv.bias"), expected)
        close(op.factors["conv.weight"][1], A1)
        assert "conv.bias" not in op.factors
    else:
        close(block_of(dense, names, numels, "conv.weight"), torch.kron(G, A))
        close(block_of(dense, names, numels, "conv.bias"), G)
    # the per-batch extension keeps the original BackPACK's scale (docs: where they differ)
    result = accumulate(model, lossfunc, data, KFLR(), write=False)
    G_kflr, A_kflr = result["kflr"]["conv.weight"]
    close(A_kflr, positions * A)
    close(G_kflr, G_ext)


class SequenceModel(nn.Module):
    """Linear on `[N, T, in]` (weight shared over T positions), then a head on the flattening."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.act = nn.Tanh()
        self.head = nn.Linear(2 * 4, 3)

    def forward(self, x):
        return self.head(self.act(self.lin(x)).flatten(1))


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_linear_on_sequences_with_its_bias_folded(approx):
    torch.manual_seed(0)
    model = SequenceModel().double()
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(6, 4, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    lossfunc = nn.CrossEntropyLoss()
    op = KFAC(
        model,
        lossfunc,
        [(X[:3], y[:3]), (X[3:], y[3:])],
        kfac_approx=approx,
        separate_weight_and_bias=False,
    )
    tail = nn.Sequential(model.act, nn.Flatten(), model.head)
    ggn = output_ggn(model.lin, tail, lossfunc, X, y)
    G, G_reduce = position_blocks(ggn, channels_last=True)
    x1 = with_one(X)
    if approx == "expand":
        A1 = torch.einsum("nti,ntj->ij", x1, x1) / (6 * 4)
    else:
        G = G_reduce
        mean = x1.mean(1)
        A1 = mean.T @ mean / 6
    dense = op.to_dense()
    close(block_of(dense, op.names, op.numels, "lin.weight", "lin.bias"), joint_dense(G, A1, 2, 3))
    # the head sees one position per sample: its joint block as well
    h = model.act(model.lin(X)).flatten(1)
    head_ggn = output_ggn(model.head, nn.Identity(), lossfunc, h, y)
    Gh = torch.stack([head_ggn[i, :, i] for i in range(6)]).sum(0)
    h1 = with_one(h)
    expected = joint_dense(Gh, h1.T @ h1 / 6, 3, 8)
    close(block_of(dense, op.names, op.numels, "head.weight", "head.bias"), expected)


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
def test_one_sample_folded_blocks_are_the_exact_blocks(fisher):
    """One sample at one position: `G ⊗ Ã` is the exact block of `[W | b]`, cross terms too."""
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    one = Problem("one", problem.make_model, problem.make_loss, problem.X[:1], problem.Y[:1])
    lossfunc = problem.make_loss("mean")
    op = KFAC(model, lossfunc, one.batches([1]), fisher_type=fisher, separate_weight_and_bias=False)
    assert [b.names for b in op.blocks] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    ref = Reference(one, model, "mean")
    exact = ref.ggn() if fisher == "type-2" else ref.empirical_fisher()
    expected = torch.zeros_like(exact)
    expected[:25, :25] = exact[:25, :25]  # 0.weight (5 x 4) and 0.bias (5): one block
    expected[25:, 25:] = exact[25:, 25:]  # 2.weight (3 x 5) and 2.bias (3)
    close(op.to_dense(), expected)


def _basis(block) -> Tensor:
    vectors = [torch.linalg.eigh((f + f.T) / 2)[1] for f in block.factors]
    return torch.kron(*vectors) if len(vectors) == 2 else vectors[0]


def _closed_forms(op, dense: Tensor) -> None:
    P = dense.shape[0]
    V = torch.randn(P, 3, dtype=dense.dtype, generator=torch.Generator().manual_seed(3))
    close(op @ V, dense @ V)
    close(op.diagonal(), dense.diagonal())
    close(op.trace(), dense.trace())
    close(op.eigenvalues(), torch.linalg.eigvalsh(dense), atol=1e-10)
    damped = dense + 0.1 * torch.eye(P, dtype=dense.dtype)
    close(op.inverse(0.1) @ V, torch.linalg.solve(damped, V), atol=1e-9)
    close(op.logdet(0.1), torch.logdet(damped), atol=1e-9)


@pytest.mark.parametrize("name", ["mlp_ce", "cnn_ce", "token_ce"])
def test_folded_ekfac_is_the_ggn_diagonal_in_the_folded_eigenbasis(name):
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    ekfac = EKFAC(model, lossfunc, problem.batches([4, 4, 3]), separate_weight_and_bias=False)
    kfac = ekfac.kfac
    folded = [b for b in kfac.blocks if b.bias is not None]
    assert folded  # every problem has a layer with a bias
    C = Reference(problem, model, "mean").ggn()
    expected = torch.zeros_like(C)
    starts, start = {}, 0
    for pname, n in zip(kfac.names, kfac.numels):
        starts[pname] = start
        start += n
    for block in kfac.blocks:
        own = block.index()
        local = torch.arange(block.numel) if own is None else own
        offsets = torch.cat(
            [torch.arange(n) + starts[p] for p, n in zip(block.names, block.numels)]
        )
        idx = offsets[local]  # the block's coordinates among all parameters
        q = _basis(block)
        sub = C[idx[:, None], idx[None, :]]
        values = (q.T @ sub @ q).diagonal()
        expected[idx[:, None], idx[None, :]] = (q * values) @ q.T
    close(ekfac.to_dense(), expected, atol=1e-11, rtol=1e-8)
    close(ekfac.trace(), C.trace(), atol=1e-11, rtol=1e-8)
    _closed_forms(ekfac, expected)
    _closed_forms(kfac, kfac.to_dense())
