"""KFAC and KFLR give factors for every trainable parameter.

Layers without a Kronecker rule get their dense curvature block; tied weights get the Kronecker
product nearest to the sum of their uses' products (or their exact block, cross terms included).
"""

import copy

import pytest
import torch
from second_order_reference import Curvature
from torch import nn

import backpack.passes.curvature as curvature
from backpack import backpack, extend
from backpack.extensions import KFAC, KFLR

DT = torch.float64


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9, msg=msg)


def _rearranged(matrix, shape_r, shape_c):
    """Van Loan's rearrangement: R ⊗ C becomes vec(R) vec(C)ᵀ."""
    (a, _), (b, _) = shape_r, shape_c
    blocks = matrix.reshape(a, b, a, b).permute(0, 2, 1, 3)  # [i, j, k, l] = R[i, j] C[k, l]
    return blocks.reshape(a * a, b * b)


@pytest.mark.parametrize("uses", [2, 3])
def test_nearest_kronecker_is_the_best_rank_one_rearrangement(uses):
    torch.manual_seed(0)
    pairs = []
    for _ in range(uses):
        r, c = torch.randn(4, 4, dtype=DT), torch.randn(3, 3, dtype=DT)
        pairs.append([r @ r.T, c @ c.T])
    total = sum(torch.kron(r, c) for r, c in pairs)
    r, c = curvature.nearest_kronecker(pairs)
    u, s, vh = torch.linalg.svd(_rearranged(total, (4, 4), (3, 3)))
    best = s[0] * torch.outer(u[:, 0], vh[0])
    close(torch.outer(r.flatten(), c.flatten()), best)
    # positive semi-definite factors give positive semi-definite factors
    assert torch.linalg.eigvalsh(r).min() > -1e-10 and torch.linalg.eigvalsh(c).min() > -1e-10


def test_nearest_kronecker_of_two_uses_in_edge_cases_and_without_host_reads():
    """Orthogonal factors (diagonal Gram matrices, both orders of the larger use), zero factors,
    and meta tensors (any read of a value on the host fails there: a GPU would wait)."""
    r1, r2 = (
        torch.diag(torch.tensor([1.0, 0, 0], dtype=DT)),
        torch.diag(torch.tensor([0, 2.0, 0], dtype=DT)),
    )
    c1, c2 = (
        torch.diag(torch.tensor([1.0, 0], dtype=DT)),
        torch.diag(torch.tensor([0, 3.0], dtype=DT)),
    )
    for pairs, expected in (
        ([[r1, c1], [r2, c2]], torch.kron(r2, c2)),  # the larger use wins
        ([[r2, c2], [r1, c1]], torch.kron(r2, c2)),
    ):
        r, c = curvature.nearest_kronecker(pairs)
        close(torch.kron(r, c), expected)
    zero = torch.zeros(3, 3, dtype=DT), torch.zeros(2, 2, dtype=DT)
    r, c = curvature.nearest_kronecker([list(zero), list(zero)])
    assert not r.any() and not c.any()
    meta = [[torch.empty(5, 5, device="meta"), torch.empty(2, 2, device="meta")]] * 2
    r, c = curvature.nearest_kronecker(meta)
    assert r.shape == (5, 5) and c.shape == (2, 2) and r.device.type == "meta"


def test_nearest_kronecker_of_equal_input_factors_is_their_exact_sum():
    torch.manual_seed(1)
    a = torch.randn(3, 3, dtype=DT)
    a = a @ a.T
    gs = [torch.randn(2, 2, dtype=DT) for _ in range(2)]
    gs = [g @ g.T for g in gs]
    r, c = curvature.nearest_kronecker([[gs[0], a], [gs[1], a]])
    close(torch.kron(r, c), torch.kron(gs[0] + gs[1], a))


class TwiceLinear(nn.Module):
    """One Linear layer applied twice to the same samples."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def _data(n=5):
    torch.manual_seed(3)
    return torch.randn(n, 4, dtype=DT), torch.randint(0, 3, (n,))


def test_a_layer_applied_twice_gets_a_kronecker_pair_and_its_bias_the_exact_block():
    x, y = _data()
    torch.manual_seed(0)
    model = TwiceLinear().to(DT)
    reference = Curvature(copy.deepcopy(model), x, nn.CrossEntropyLoss(), y, hessian=False)
    extend(model)
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    with backpack(KFLR(), KFAC()):
        loss.backward()
    g, a = model.inner.weight.kflr
    assert g.shape == (4, 4) and a.shape == (4, 4)
    (bias_block,) = model.inner.bias.kflr
    close(bias_block, reference.block(reference.ggn, "inner.bias"))  # cross terms included
    assert len(model.inner.weight.kfac) == 2 and len(model.inner.bias.kfac) == 1
    assert all(hasattr(p, "kflr") and hasattr(p, "kfac") for p in model.parameters())


def test_a_layer_applied_twice_gets_the_nearest_kronecker_of_its_uses():
    """Same orientation, same samples: compare with the factors of an untied copy."""
    x, y = _data()
    torch.manual_seed(0)
    tied = TwiceLinear().to(DT)
    untied = nn.Sequential(
        copy.deepcopy(tied.inner),
        nn.Tanh(),
        copy.deepcopy(tied.inner),
        nn.Tanh(),
        copy.deepcopy(tied.head),
    )

    for model in (tied, untied):
        extend(model)
    lossfunc = extend(nn.CrossEntropyLoss())
    with backpack(KFLR()):
        lossfunc(untied(x), y).backward()
    with backpack(KFLR()):
        lossfunc(tied(x), y).backward()
    expected = curvature.nearest_kronecker([untied[0].weight.kflr, untied[2].weight.kflr])
    for actual, wanted in zip(tied.inner.weight.kflr, expected):
        close(actual, wanted)


class TiedLM(nn.Module):
    """Embedding and output layer sharing one weight (as GPT-2's `lm_head`)."""

    def __init__(self, vocab=7, dim=4, tie=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.embed(idx)))


def test_tied_embedding_and_head_factors_are_oriented_as_the_weight_is_stored():
    torch.manual_seed(0)
    idx, y = torch.randint(0, 7, (6, 3)), torch.randint(0, 7, (6 * 3,))
    tied = TiedLM().to(DT)
    untied = TiedLM(tie=False).to(DT)
    untied.load_state_dict(
        {
            "embed.weight": tied.embed.weight.detach(),
            "head.weight": tied.embed.weight.detach().clone(),
        }
    )
    lossfunc = extend(nn.CrossEntropyLoss())
    for model in (tied, untied):
        extend(model)
        with backpack(KFLR()):
            lossfunc(model(idx).reshape(-1, 7), y).backward()
    g_d, a_v = untied.embed.weight.kflr  # factors of weight.T ([D, V])
    g_v, a_d = untied.head.weight.kflr
    expected = curvature.nearest_kronecker([[a_v, g_d], [g_v, a_d]])
    r, c = tied.embed.weight.kflr
    assert r.shape == (7, 7) and c.shape == (4, 4)
    close(r, expected[0])
    close(c, expected[1])
    # the approximation is the nearest Kronecker product to the sum of both uses' products
    total = torch.kron(a_v, g_d) + torch.kron(g_v, a_d)
    u, s, vh = torch.linalg.svd(_rearranged(total, (7, 7), (4, 4)))
    close(torch.outer(r.flatten(), c.flatten()), s[0] * torch.outer(u[:, 0], vh[0]))


def test_tied_parameters_without_pairs_above_the_limit_are_refused(monkeypatch):
    x, y = _data()
    torch.manual_seed(0)
    model = extend(TwiceLinear().to(DT))
    loss = extend(nn.CrossEntropyLoss())(model(x), y)
    monkeypatch.setattr(curvature, "DENSE_BLOCK_MAX_NUMEL", 2)
    with pytest.raises(NotImplementedError, match=r"bias of 'inner'.*several times"):
        with backpack(KFLR()):
            loss.backward()


def test_kfra_of_an_embedding_before_a_linear_layer_equals_kflr():
    """KFRA hands a rule one batch-averaged factor (a single "sample"); the embedding's rule
    used to reshape it with the batch's sample count and failed. With a constant Jacobian
    between the embedding and the loss (Flatten, Linear), KFRA's factors are KFLR's."""
    from backpack import backpack, extend
    from backpack.extensions import KFLR, KFRA

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(5, 3), torch.nn.Flatten(), torch.nn.Linear(6, 3)
    ).double()
    model = extend(model)
    x, y = torch.randint(0, 5, (8, 2)), torch.randint(0, 3, (8,))
    with backpack(KFRA(), KFLR()):
        extend(torch.nn.CrossEntropyLoss())(model(x), y).backward()
    for p in model.parameters():
        assert len(p.kfra) == len(p.kflr)
        for a, b in zip(p.kfra, p.kflr):
            torch.testing.assert_close(a, b)


def test_large_vocabularies_are_decided_by_free_memory(monkeypatch):
    """Above `KRON_VOCABULARY_ALWAYS` an embedding gets its [V, V] factor when three such
    matrices take at most `KRON_MEMORY_SHARE` of the free memory, and a clear refusal naming
    the sizes and what to do otherwise; a fixed `MAX_KRON_VOCABULARY` decides alone."""
    import backpack.rules.embedding as embedding

    torch.manual_seed(0)
    idx, y = torch.randint(0, 7, (6, 3)), torch.randint(0, 7, (6 * 3,))
    lossfunc = extend(nn.CrossEntropyLoss())

    def factors():
        torch.manual_seed(1)
        model = extend(TiedLM().to(DT))
        with backpack(KFLR()):
            lossfunc(model(idx).reshape(-1, 7), y).backward()
        return model.embed.weight.kflr

    expected = factors()
    free_memory_bytes = embedding.free_memory_bytes
    assert free_memory_bytes(torch.device("meta")) is None
    assert free_memory_bytes(torch.device("cpu")) > 0
    monkeypatch.setattr(embedding, "KRON_VOCABULARY_ALWAYS", 4)
    need = 3 * 7 * 7 * 8  # three [7, 7] float64 matrices
    monkeypatch.setattr(embedding, "free_memory_bytes", lambda device: 2 * need)
    for a, b in zip(factors(), expected):
        close(a, b)
    monkeypatch.setattr(embedding, "free_memory_bytes", lambda device: 2 * need - 1)
    with pytest.raises(NotImplementedError, match=r"Embedding\(7, 4\).*\[7, 7\].*free on cpu"):
        factors()
    monkeypatch.setattr(embedding, "MAX_KRON_VOCABULARY", 7)  # fixed: memory not asked
    for a, b in zip(factors(), expected):
        close(a, b)
    monkeypatch.setattr(embedding, "MAX_KRON_VOCABULARY", 6)
    with pytest.raises(NotImplementedError, match="MAX_KRON_VOCABULARY = 6"):
        factors()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nearest_kronecker_in_low_precision_factors(dtype):
    """Factors of float32 / bf16 models (weights or autocast): combined in their own dtype from
    float64 Gram matrices, the best rank-one rearrangement to that dtype's rounding."""
    torch.manual_seed(0)
    pairs64 = []
    for _ in range(2):
        r, c = torch.randn(5, 5, dtype=DT), torch.randn(3, 3, dtype=DT)
        pairs64.append([r @ r.T, c @ c.T])
    pairs = [[r.to(dtype), c.to(dtype)] for r, c in pairs64]
    r, c = curvature.nearest_kronecker(pairs)
    assert r.dtype == dtype and c.dtype == dtype
    total = sum(torch.kron(r.double(), c.double()) for r, c in pairs)
    u, s, vh = torch.linalg.svd(_rearranged(total, (5, 5), (3, 3)))
    best = s[0] * torch.outer(u[:, 0], vh[0])
    got = torch.outer(r.double().flatten(), c.double().flatten())
    tol = 10 * torch.finfo(dtype).eps
    assert (got - best).norm() / best.norm() < tol
