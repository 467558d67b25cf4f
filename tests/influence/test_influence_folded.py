"""`fit(..., separate_weight_and_bias=False, kfac_positions=...)` against dense brute force.

With folded biases every `nn.Linear` and convolution is one block of `[W | b]`: KFAC's
`G ⊗ Ã`, EK-FAC's `Q diag(Qᵀ F Q) Qᵀ` with `Q = Q_G ⊗ Q_Ã` and `F` the explicit Fisher of the
training set. `kfac_positions="mean"` divides the KFAC block of each such layer by its number of
output positions T (kronfluence's covariances over all positions). The heuristic damping is
`0.1 ×` the mean eigenvalue of each (joint) block.
"""

from __future__ import annotations

import pytest
import torch
from influence_problems import PROBLEMS, Reference
from torch import Tensor

from backpack.curvature import KFAC
from backpack.influence import fit, load

pytestmark = pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching "
    "rule:UserWarning"
)

#: output positions T of the layers with Kronecker factors and biases
POSITIONS = {
    "mlp": {"0.weight": 1, "2.weight": 1},
    "cnn": {"0.weight": 9, "3.weight": 1},
    "gpt": {f"{n}.weight": 5 for n in ("q", "k", "v", "o", "up", "down", "head")},
}


def close(a, b, atol=1e-10, rtol=1e-8):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def own_order(shape: tuple, transposed: bool, folded: bool) -> list[int]:
    """Positions, in `weight.flatten()` (then `bias`), of a block's coordinates `[g, a(+1)]`."""
    numel = torch.Size(shape).numel()
    weight = torch.arange(numel).reshape(shape)
    if transposed:
        weight = weight.transpose(0, 1)
    rows = weight.shape[0]
    weight = weight.reshape(rows, -1)
    if folded:
        weight = torch.cat([weight, torch.arange(numel, numel + rows)[:, None]], dim=1)
    return weight.flatten().tolist()


def spans(ref: Reference, kfac: KFAC) -> list[tuple[object, Tensor]]:
    """`(block, index of its entries among all parameters, in the block's coordinates)`."""
    starts, start = {}, 0
    for name, n in zip(ref.names, ref.numels):
        starts[name] = start
        start += n
    out = []
    for block in kfac.blocks:
        folded = block.bias is not None
        order = own_order(block.shape, block.transposed, folded)
        offsets = [starts[block.name] + i for i in range(block.weight_numel)]
        if folded:
            offsets += [starts[block.bias] + i for i in range(block.rows)]
        out.append((block, torch.tensor([offsets[i] for i in order])))
    return out


def approximation(strategy, problem, model, ref, positions):
    exact = ref.empirical_fisher()
    kfac = KFAC(
        model,
        problem.make_loss("mean"),
        problem.train(),
        fisher_type="empirical",
        separate_weight_and_bias=False,
    )
    out = torch.zeros_like(exact)
    scale = problem.normaliser("mean") / problem.X.shape[0]  # the data-set loss's R Σ → mean
    for block, idx in spans(ref, kfac):
        if strategy == "kfac":
            fs = block.factors
            dense = torch.kron(*fs) if len(fs) == 2 else fs[0]
            t = POSITIONS[problem.name].get(block.name, 1) if positions == "mean" else 1
            out[idx[:, None], idx[None, :]] = dense * scale / t
        else:
            vectors = [torch.linalg.eigh((f + f.T) / 2)[1] for f in block.factors]
            q = torch.kron(*vectors) if len(vectors) == 2 else vectors[0]
            sub = exact[idx[:, None], idx[None, :]]
            values = (q.T @ sub @ q).diagonal()
            out[idx[:, None], idx[None, :]] = (q * values) @ q.T
    return out, [idx for _, idx in spans(ref, kfac)]


def expected_scores(strategy, problem, model, damping, positions="sum"):
    ref = Reference(problem, model)
    M, blocks = approximation(strategy, problem, model, ref, positions)
    lam = torch.empty(M.shape[0], dtype=M.dtype)
    for idx in blocks:
        sub = M[idx[:, None], idx[None, :]]
        lam[idx] = 0.1 * sub.trace() / idx.numel() if damping is None else damping
    inverse = torch.linalg.inv(M + torch.diag(lam))
    Gq, Gt = ref.query_grads(), ref.train_grads()
    return Gq @ inverse @ Gt.T, ((Gt @ inverse) * Gt).sum(1)


@pytest.mark.parametrize("damping", [None, 0.05])
@pytest.mark.parametrize("strategy", ["kfac", "ekfac"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_folded_biases_match_brute_force(name, strategy, damping):
    problem = PROBLEMS[name]
    model = problem.model()
    influence = fit(
        model,
        problem.make_loss("mean"),
        problem.train(),
        strategy,
        damping,
        fisher="empirical",
        separate_weight_and_bias=False,
    )
    assert any(b.bias is not None for b in influence.blocks)
    scores, self_scores = expected_scores(strategy, problem, model, damping)
    close(influence.scores(problem.query(), problem.train(size=3)), scores)
    close(influence.self_scores(problem.train(size=5)), self_scores)


@pytest.mark.parametrize("damping", [None, 0.05])
@pytest.mark.parametrize("name", ["cnn", "gpt"])
def test_kfac_positions_mean_divides_each_layer_by_its_positions(name, damping):
    problem = PROBLEMS[name]
    model = problem.model()
    influence = fit(
        model,
        problem.make_loss("mean"),
        problem.train(),
        "kfac",
        damping,
        fisher="empirical",
        separate_weight_and_bias=False,
        kfac_positions="mean",
    )
    scores, _ = expected_scores("kfac", problem, model, damping, positions="mean")
    close(influence.scores(problem.query(), problem.train()), scores)


def test_damping_per_block_and_roundtrip(tmp_path):
    problem = PROBLEMS["cnn"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    train = problem.train()
    names = ["0.weight", "3.weight"]  # the blocks' names: the weights, biases folded in
    damping = {"0.weight": 0.05, "3.weight": 0.2}
    influence = fit(
        model, lossfunc, train, "ekfac", damping, fisher="empirical", separate_weight_and_bias=False
    )
    assert [b.name for b in influence.blocks] == names
    assert influence.damping == damping
    path = tmp_path / "fit.pt"
    influence.save(path)
    loaded = load(path, model, lossfunc)
    close(loaded.scores(problem.query(), train), influence.scores(problem.query(), train))
    with pytest.raises(ValueError, match="no value for the blocks"):
        fit(model, lossfunc, train, "kfac", {"0.weight": 0.1}, separate_weight_and_bias=False)


@pytest.mark.parametrize("damping", [None, 0.05])
def test_diagonal_with_folded_biases_damps_per_layer(damping):
    """"diagonal": the same `diag F`, the heuristic λ a mean over the weight and its bias."""
    problem = PROBLEMS["mlp"]
    model = problem.model()
    influence = fit(
        model,
        problem.make_loss("mean"),
        problem.train(),
        "diagonal",
        damping,
        fisher="empirical",
        separate_weight_and_bias=False,
    )
    assert [b.names for b in influence.blocks] == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    ref = Reference(problem, model)
    diag = ref.empirical_fisher().diagonal()
    lam = torch.empty_like(diag)
    for a, b in ((0, 25), (25, 43)):  # [0.weight (5 x 4), 0.bias], [2.weight (3 x 5), 2.bias]
        lam[a:b] = 0.1 * diag[a:b].mean() if damping is None else damping
    Gq, Gt = ref.query_grads(), ref.train_grads()
    close(influence.scores(problem.query(), problem.train()), (Gq / (diag + lam)) @ Gt.T)
    close(influence.self_scores(problem.train()), (Gt * Gt / (diag + lam)).sum(1))
