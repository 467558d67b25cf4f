"""The EKFAC operator: KFAC's eigenbasis, eigenvalues refitted to the curvature, closed forms."""

from __future__ import annotations

import copy

import pytest
import torch
from curvature_problems import PROBLEMS, Problem, Reference
from test_curvature_kfac import SIZES, Mixed, block_diagonal
from torch import nn

from backpack.curvature import EKFAC, KFAC

#: parameters whose Kronecker factors belong to their transpose
TRANSPOSED = {"emb.weight", "up.weight"}


def close(a, b, atol=1e-11):
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-9)


def basis(factors, shape, transposed):
    """KFAC's eigenbasis of one block, dense, rows in the parameter's flattening."""
    vectors = [torch.linalg.eigh((f + f.T) / 2)[1] for f in factors]
    q = torch.kron(vectors[0], vectors[1]) if len(vectors) == 2 else vectors[0]
    if transposed:
        idx = torch.arange(q.shape[0]).reshape(shape).transpose(0, 1).flatten()
        placed = torch.empty_like(q)
        placed[idx] = q
        q = placed
    return q


def brute_force(kfac, ref, curvature):
    """Per block `Q diag(qᵀ C q) Qᵀ` of the explicit curvature `C`."""
    out = torch.zeros_like(curvature)
    start = 0
    for name, shape, numel in zip(ref.names, ref.shapes, ref.numels):
        q = basis(kfac.factors[name], shape, name in TRANSPOSED)
        block = curvature[start : start + numel, start : start + numel]
        out[start : start + numel, start : start + numel] = (q * (q.T @ block @ q).diagonal()) @ q.T
        start += numel
    return out


def explicit(ref, fisher):
    return ref.ggn() if fisher == "type-2" else ref.empirical_fisher()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
@pytest.mark.parametrize("name", ["mlp_ce", "mlp_mse", "cnn_ce", "token_ce"])
def test_ekfac_matches_brute_force(name, fisher, reduction):
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss(reduction)
    op = EKFAC(model, lossfunc, problem.batches(SIZES), fisher_type=fisher)
    kfac = KFAC(model, lossfunc, problem.batches(SIZES), fisher_type=fisher)
    ref = Reference(problem, model, reduction)
    curvature = explicit(ref, fisher)
    dense = brute_force(kfac, ref, curvature)
    close(op.to_dense(), dense)
    P = op.shape[0]
    V = torch.randn(P, 3, dtype=torch.float64)
    close(op @ V, dense @ V)
    close(op @ V[:, 0], dense @ V[:, 0])
    close(op.diagonal(), dense.diagonal())
    # the corrected eigenvalues keep the trace of every block of the curvature
    close(op.trace(), curvature.trace())
    close(op.eigenvalues(), torch.linalg.eigvalsh(dense), atol=1e-10)
    damping = 0.1
    damped = dense + damping * torch.eye(P, dtype=torch.float64)
    inverse = op.inverse(damping)
    close(inverse.to_dense(), torch.linalg.inv(damped), atol=1e-9)
    close(inverse @ V, torch.linalg.solve(damped, V), atol=1e-9)
    close(op.logdet(damping), torch.logdet(damped), atol=1e-9)
    close(inverse.logdet(), -torch.logdet(damped), atol=1e-9)
    # one damping per block
    per_block = {n: 0.01 * (i + 1) for i, n in enumerate(op.names)}
    lam = torch.cat(
        [torch.full((k,), per_block[n], dtype=torch.float64) for n, k in zip(op.names, op.numels)]
    )
    damped = dense + torch.diag(lam)
    close(op.inverse(per_block) @ V, torch.linalg.solve(damped, V), atol=1e-9)
    close(op.logdet(per_block), torch.logdet(damped), atol=1e-9)


def test_mixed_layouts_and_scipy():
    """Transposed factors (embedding, transposed convolution) and `to_scipy`."""
    pytest.importorskip("scipy")
    torch.manual_seed(0)
    model = Mixed().double()
    X = torch.randint(0, 3, (7, 1))
    y = torch.randint(0, 3, (7,))
    data = [(X[:4], y[:4]), (X[4:], y[4:])]
    lossfunc = nn.CrossEntropyLoss()
    op = EKFAC(model, lossfunc, data)
    kfac = KFAC(model, lossfunc, data)
    problem = Problem("mixed", Mixed, lambda r: nn.CrossEntropyLoss(reduction=r), X, y)
    ref = Reference(problem, model, "mean")
    dense = brute_force(kfac, ref, ref.ggn())
    close(op.to_dense(), dense)
    v = torch.randn(op.shape[0], dtype=torch.float64)
    close(torch.as_tensor(op.to_scipy() @ v.numpy()), dense @ v)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_sample_ekfac_is_kfac(reduction):
    """Where KFAC's block is the curvature's block, the correction changes nothing."""
    torch.manual_seed(0)
    model = Mixed().double()
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    data = [(torch.tensor([[2]]), torch.tensor([1]))]
    close(EKFAC(model, lossfunc, data).to_dense(), KFAC(model, lossfunc, data).to_dense())
    problem = Problem("one", Mixed, lambda r: nn.CrossEntropyLoss(reduction=r), *data[0])
    ref = Reference(problem, model, reduction)
    close(EKFAC(model, lossfunc, data).to_dense(), block_diagonal(ref.ggn(), ref.numels))


def test_mc_is_seeded_and_unbiased():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    data = problem.batches(SIZES)
    state = torch.random.get_rng_state()
    a = EKFAC(model, lossfunc, data, fisher_type="mc", seed=2).to_dense()
    assert torch.equal(state, torch.random.get_rng_state())
    assert torch.equal(a, EKFAC(model, lossfunc, data, fisher_type="mc", seed=2).to_dense())
    exact = EKFAC(model, lossfunc, data).to_dense()
    many = EKFAC(model, lossfunc, data, fisher_type="mc", mc_samples=3000).to_dense()
    assert (many - exact).abs().max() / exact.abs().max() < 0.05


def test_ekfac_errors():
    problem = PROBLEMS["mlp_ce"]
    model = problem.model()
    op = EKFAC(model, problem.make_loss("mean"), problem.batches(SIZES))
    with pytest.raises(ValueError, match="non-negative"):
        op.inverse(-1.0)
    with pytest.raises(ValueError, match="no value"):
        op.inverse({"0.weight": 0.1})
    with pytest.raises(ValueError, match="fisher_type"):
        EKFAC(model, problem.make_loss("mean"), problem.batches(SIZES), fisher_type="true")


class FunctionalHead(nn.Module):
    """The head's weight is also read outside the head's call (detached, so the gradients come
    from the call only): rotating the weight through the call's hooks would change the
    function."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h) + 0.5 * h @ self.head.weight.detach().T


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
def test_linear_weights_take_the_eigenbasis_diagonal_unless_used_outside_their_call(
    fisher, monkeypatch
):
    """Linear weights get their corrected eigenvalues as a diagonal in their eigenbasis (no
    per-sample rows, the same lent-rule sweep as convolutions); a weight also used outside its
    module's call takes the rows, the other layers still the sweep."""
    import backpack.curvature.ekfac as ekfac_module

    swept = []
    original = ekfac_module.eigen_rules
    monkeypatch.setattr(
        ekfac_module, "eigen_rules", lambda targets: swept.append(set(targets)) or original(targets)
    )
    torch.manual_seed(0)
    X, y = torch.randn(7, 3, dtype=torch.float64), torch.randint(0, 3, (7,))
    data = [(X[:4], y[:4]), (X[4:], y[4:])]
    for make in (FunctionalHead, Mixed):
        torch.manual_seed(1)
        model = make().double()
        inputs = (torch.randint(0, 3, (7, 1)), y) if make is Mixed else (X, y)
        batches = [(inputs[0][:4], y[:4]), (inputs[0][4:], y[4:])] if make is Mixed else data
        swept.clear()
        op = EKFAC(model, nn.CrossEntropyLoss(), batches, fisher_type=fisher)
        expected = {model.body} if make is FunctionalHead else {model.up, model.conv, model.lin}
        assert swept == [expected]
        problem = Problem("p", make, lambda r: nn.CrossEntropyLoss(reduction=r), *inputs)
        ref = Reference(problem, model, "mean")
        kfac = KFAC(model, nn.CrossEntropyLoss(), batches, fisher_type=fisher)
        close(op.to_dense(), brute_force(kfac, ref, explicit(ref, fisher)))


@pytest.mark.parametrize("name", ["cnn_ce", "token_ce"])
def test_ekfac_reduce_matches_brute_force(name):
    """kfac_approx="reduce": another eigenbasis, the same correction (dense blocks included)."""
    problem = PROBLEMS[name]
    model = problem.model()
    lossfunc = problem.make_loss("mean")
    op = EKFAC(model, lossfunc, problem.batches(SIZES), kfac_approx="reduce")
    kfac = KFAC(model, lossfunc, problem.batches(SIZES), kfac_approx="reduce")
    ref = Reference(problem, model, "mean")
    close(op.to_dense(), brute_force(kfac, ref, ref.ggn()))


def test_bfloat16_weights_keep_float32_eigenvalues():
    """16-bit weights: float32 factors and eigenvalues (the rows path), close to a float32 fit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    X, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    data = [(X[:4], y[:4]), (X[4:], y[4:])]
    reference = EKFAC(model, nn.CrossEntropyLoss(), data)
    half = copy.deepcopy(model).to(torch.bfloat16)
    op = EKFAC(half, nn.CrossEntropyLoss(), [(x.to(torch.bfloat16), t) for x, t in data])
    for a, b in zip(op.blocks, reference.blocks):
        assert a.values.dtype == torch.float32
        torch.testing.assert_close(a.values, b.values, rtol=0.1, atol=0.02 * b.values.max())


@pytest.mark.parametrize("fisher", ["type-2", "mc", "empirical"])
@pytest.mark.parametrize("name", ["mlp_ce", "cnn_ce"])
def test_rotated_fit_leaves_the_model_as_it_was(fisher, name):
    """The rotated-weight sweep swaps weights (and convolutions' classes) and freezes
    parameters for a while: afterwards the same classes and parameter objects, trainable, with
    their `.grad` untouched."""
    problem = PROBLEMS[name]
    model = problem.model()
    params = list(model.parameters())
    classes = [type(m) for m in model.modules()]
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    EKFAC(model, problem.make_loss("mean"), problem.batches(SIZES), fisher_type=fisher)
    assert list(model.parameters()) == params
    assert [type(m) for m in model.modules()] == classes
    assert not any("_backpack_lent_state" in m.__dict__ for m in model.modules())
    for p in params:
        assert p.requires_grad and torch.equal(p.grad, torch.full_like(p, 3.0))
        assert not hasattr(p, "diag_ggn_exact") and not hasattr(p, "sum_grad_squared")


class TwoConvs(nn.Module):
    """Two convolutions of one kind (grouped, padded, 1d, 3d, transposed), averaged over positions.

    No Linear layer: its rotated diagonal would share the "mc" draws of the sweep that the
    convolutions take now, and the rows path draws again (another sample of the same Fisher).
    """

    LAYERS = {
        "groups": lambda: (
            nn.Conv2d(4, 6, 3, groups=2, padding=1, stride=2),
            nn.Conv2d(6, 3, 2, groups=3, bias=False, dilation=2),
        ),
        "padding": lambda: (
            nn.Conv2d(4, 5, 3, padding="same", padding_mode="reflect"),
            nn.Conv2d(5, 3, (2, 3), stride=(2, 1), padding=1, padding_mode="circular"),
        ),
        "1d": lambda: (nn.Conv1d(4, 5, 3, padding=2), nn.Conv1d(5, 3, 2, stride=2)),
        "3d": lambda: (nn.Conv3d(4, 5, 2), nn.Conv3d(5, 3, (1, 2, 2), padding=1)),
        "transposed": lambda: (
            nn.ConvTranspose2d(4, 5, 3, stride=2, padding=1, output_padding=1),
            nn.ConvTranspose2d(5, 3, 2, bias=False),
        ),
    }
    INPUTS = {"1d": (4, 9), "3d": (4, 4, 5, 3)}

    def __init__(self, kind):
        super().__init__()
        self.a, self.b = self.LAYERS[kind]()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).flatten(2).mean(2)


def conv_data(kind, n=5):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2 * n, *TwoConvs.INPUTS.get(kind, (4, 6, 7)), generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (2 * n,), generator=g)
    return [(X[:n], y[:n]), (X[n:], y[n:])]


def rows_path(monkeypatch, build):
    """`build()` with every convolution block on the rows path (the reference)."""
    import backpack.curvature.ekfac as ekfac_module

    with monkeypatch.context() as m:
        m.setattr(ekfac_module, "_eigen_targets", lambda *args: {})
        return build()


@pytest.mark.parametrize("fisher", ["type-2", "mc", "empirical"])
@pytest.mark.parametrize("kind", list(TwoConvs.LAYERS))
def test_conv_eigenvalues_without_rows_match_the_rows(kind, fisher, monkeypatch):
    """Convolutions' corrected eigenvalues from rotated factors (each way of rotating, both
    factor conventions) equal the rotated rows' (float64), and need no rows sweep."""
    import backpack.curvature._eigen as conv_eigen
    import backpack.curvature.ekfac as ekfac_module

    torch.manual_seed(0)
    model = TwoConvs(kind).double()
    data = conv_data(kind)
    lossfunc = nn.CrossEntropyLoss()
    chosen = conv_eigen.plan
    sides = ["after"] if kind == "groups" else ["before", "after"]
    ways = [{"g": g, "a": a, "native": False} for g in sides for a in ("before", "after")]
    ways.append({"g": "after", "a": "before", "native": False, "cache": False})
    if kind == "transposed":
        ways.append({"g": "after", "a": "after", "native": True})
    for approx in ("expand", "reduce"):

        def build(approx=approx):
            return EKFAC(model, lossfunc, data, fisher, approx, mc_samples=2, seed=3)

        reference = rows_path(monkeypatch, build)
        for way in ways:
            with monkeypatch.context() as m:
                m.setattr(conv_eigen, "plan", lambda *args, way=way: {**chosen(*args), **way})
                m.setattr(ekfac_module, "row_batches", None)  # no rows sweep is left
                op = build()
            for a, b in zip(op.blocks, reference.blocks):
                close(a.values, b.values, atol=1e-14)


class SharedConv(nn.Module):
    """One convolution called twice per forward: its gradient sums both calls (rows path)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 2, padding=1)
        self.other = nn.Conv2d(2, 1, 2)
        self.head = nn.Linear(1, 3)

    def forward(self, x):
        h = self.conv(torch.tanh(self.conv(x)))
        return self.head(self.other(h).flatten(2).mean(2))


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
def test_conv_called_twice_takes_the_rows(fisher, monkeypatch):
    torch.manual_seed(0)
    model = SharedConv().double()
    X, y = torch.randn(7, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    data = [(X[:4], y[:4]), (X[4:], y[4:])]
    op = EKFAC(model, nn.CrossEntropyLoss(), data, fisher_type=fisher)
    kfac = KFAC(model, nn.CrossEntropyLoss(), data, fisher_type=fisher)
    problem = Problem("shared", SharedConv, lambda r: nn.CrossEntropyLoss(reduction=r), X, y)
    ref = Reference(problem, model, "mean")
    close(op.to_dense(), brute_force(kfac, ref, explicit(ref, fisher)))
    reference = rows_path(monkeypatch, lambda: EKFAC(model, nn.CrossEntropyLoss(), data, fisher))
    for a, b in zip(op.blocks, reference.blocks):
        close(a.values, b.values, atol=1e-14)
