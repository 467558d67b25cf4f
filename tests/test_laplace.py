"""backpack.laplace: laplace-torch's workflow on backpack's backends, against brute force.

Skipped without laplace-torch (`make test` installs it without the original BackPACK).
References are float64 `torch.func` Jacobians: GGN = Σ_n J_nᵀ H_n J_n with H_n the Hessian of
laplace-torch's log-likelihood (softmax cross-entropy, or ½‖f − y‖² for regression).
"""

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

laplace = pytest.importorskip("laplace")

from backpack.laplace import (  # noqa: E402
    EKFACLaplace,
    HuggingFaceLogits,
    LaplaceEF,
    LaplaceGGN,
    laplace_factors,
)

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.filterwarnings("ignore:By default `link_approx` is `probit`:UserWarning"),
]

F64 = torch.float64


# --- references -------------------------------------------------------------------------------


def _trainable(model):
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def ref_jacobians(model, X):
    """`[N, C, P]` Jacobians of the model output and the output `[N, C]`."""
    params = _trainable(model)
    f = functional_call(model, params, (X,))
    jac = jacrev(lambda pp: functional_call(model, pp, (X,)))(params)
    J = torch.cat([j.flatten(2) for j in jac.values()], dim=2)
    return J.detach(), f.detach()


def ref_output_hessian(f, likelihood):
    if likelihood == "regression":
        return torch.eye(f.shape[1], dtype=f.dtype).expand(f.shape[0], -1, -1)
    p = torch.softmax(f, -1)
    return torch.diag_embed(p) - torch.einsum("nc,nd->ncd", p, p)


def ref_ggn(model, X, likelihood):
    J, f = ref_jacobians(model, X)
    return torch.einsum("ncp,ncd,ndq->pq", J, ref_output_hessian(f, likelihood), J)


def ref_grads(model, X, y, likelihood):
    """Per-sample gradients `[N, P]` of laplace-torch's per-sample loss (sum reduction)."""
    params = _trainable(model)

    def loss(pp, x, t):
        f = functional_call(model, pp, (x.unsqueeze(0),))
        if likelihood == "regression":
            return ((f - t.unsqueeze(0)) ** 2).sum()
        return nn.functional.cross_entropy(f, t.unsqueeze(0), reduction="sum")

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, X, y)
    return torch.cat([v.flatten(1) for v in g.values()], dim=1)


# --- problems --------------------------------------------------------------------------------


def mlp(out=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, out)).to(F64)


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * 2 * 2, 3)
    ).to(F64)


def problem(name, n=12):
    torch.manual_seed(1)
    if name == "cnn":
        X = torch.randn(n, 1, 6, 6, dtype=F64)
        return cnn(), X, torch.randint(0, 3, (n,)), "classification"
    if name == "regression":
        X = torch.randn(n, 4, dtype=F64)
        return mlp(2), X, torch.randn(n, 2, dtype=F64), "regression"
    return mlp(), torch.randn(n, 4, dtype=F64), torch.randint(0, 3, (n,)), "classification"


def loader(X, y, batch_size=5):
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(X, y), batch_size=batch_size
    )


PROBLEMS = ["mlp", "cnn", "regression"]


# --- the backends' quantities -----------------------------------------------------------------


@pytest.mark.parametrize("name", PROBLEMS)
def test_ggn_backend_diag_full_jacobians_match_brute_force(name):
    model, X, y, likelihood = problem(name)
    backend = LaplaceGGN(model, likelihood)
    ggn = ref_ggn(model, X, likelihood)
    grads = [p.grad for p in model.parameters()]

    loss, diag = backend.diag(X, y)
    torch.testing.assert_close(diag, ggn.diagonal(), rtol=1e-10, atol=1e-12)
    _, full = backend.full(X, y)
    torch.testing.assert_close(full, ggn, rtol=1e-10, atol=1e-12)
    J, f = backend.jacobians(X)
    J_ref, f_ref = ref_jacobians(model, X)
    torch.testing.assert_close(J, J_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f, f_ref)
    # laplace-torch's loss: ½ Σ ‖f − y‖² for regression, Σ cross-entropy for classification
    if likelihood == "regression":
        expected = 0.5 * ((f_ref - y) ** 2).sum()
    else:
        expected = nn.functional.cross_entropy(f_ref, y, reduction="sum")
    torch.testing.assert_close(loss, expected)
    assert [p.grad for p in model.parameters()] == grads  # .grad left alone


@pytest.mark.parametrize("name", PROBLEMS)
def test_ef_backend_matches_per_sample_gradients(name):
    model, X, y, likelihood = problem(name)
    backend = LaplaceEF(model, likelihood)
    factor = 0.5 if likelihood == "regression" else 1.0
    G = ref_grads(model, X, y, likelihood)
    Gs, _ = backend.gradients(X, y)
    torch.testing.assert_close(Gs, G, rtol=1e-10, atol=1e-12)
    _, diag = backend.diag(X, y)
    torch.testing.assert_close(diag, factor * (G**2).sum(0), rtol=1e-10, atol=1e-12)
    _, full = backend.full(X, y)
    torch.testing.assert_close(full, factor * G.T @ G, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", PROBLEMS)
def test_kron_with_one_sample_is_the_exact_block_diagonal_on_an_mlp(name):
    """With one sample, KFLR of a Linear layer on `[N, D]` inputs is its exact GGN block."""
    if name == "cnn":
        pytest.skip("convolutions sum over positions: Kronecker factors are not exact")
    model, X, y, likelihood = problem(name, n=1)
    backend = LaplaceGGN(model, likelihood)
    _, kron = backend.kron(X, y, N=1)
    ggn = ref_ggn(model, X, likelihood)
    sizes = [p.numel() for p in model.parameters()]
    blocks = torch.block_diag(*[b for b in _blocks(ggn, sizes)])
    torch.testing.assert_close(kron.to_matrix(), blocks, rtol=1e-9, atol=1e-12)


def _blocks(matrix, sizes):
    start = 0
    for s in sizes:
        yield matrix[start : start + s, start : start + s]
        start += s


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("name", PROBLEMS)
def test_same_posterior_as_laplace_own_backpack_backend(name, structure):
    """Where laplace-torch's BackPACK backend works, both give the same fit; except for the
    convolution's Kronecker factors: laplace-torch's backend runs backpack's per-batch `KFLR`
    (the original BackPACK's convention, `A` summed over the L output positions), ours the
    published "expand" (`A` averaged over them; `G` per position)."""
    from laplace.curvature import BackPackGGN

    model, X, y, likelihood = problem(name, n=13)
    fits = []
    for backend in (LaplaceGGN, BackPackGGN):
        la = laplace.Laplace(
            copy.deepcopy(model), likelihood, subset_of_weights="all",
            hessian_structure=structure, backend=backend, prior_precision=0.7,
        )
        la.fit(loader(X, y))
        fits.append(la)
    ours, theirs = fits
    conv = name == "cnn" and structure == "kron"
    if not conv:
        lml = ours.log_marginal_likelihood()
        torch.testing.assert_close(lml, theirs.log_marginal_likelihood())
    if structure == "kron":
        for i, (a, b) in enumerate(zip(ours.H_facs.kfacs, theirs.H_facs.kfacs)):
            if conv and i == 0:  # the convolution's weight: A_ext = L A, L = 4 x 4 positions
                torch.testing.assert_close(16 * a[1], b[1], rtol=1e-10, atol=1e-12)
                continue
            if conv and i == 1:  # its bias: a G of another definition
                continue
            for fa, fb in zip(a, b):
                torch.testing.assert_close(fa, fb, rtol=1e-10, atol=1e-12)
    else:
        torch.testing.assert_close(ours.H, theirs.H, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_same_posterior_as_laplace_curvlinops_backend(name, structure, approx):
    """curvlinops' KFAC has the conventions of ours ("expand" and "reduce" on convolutions
    too: the published definitions)."""
    from laplace.curvature import CurvlinopsEF, CurvlinopsGGN

    model, X, y, likelihood = problem(name, n=13)
    kwargs = {"kfac_approx": approx}
    for ours, theirs in ((LaplaceGGN, CurvlinopsGGN), (LaplaceEF, CurvlinopsEF)):
        fits = []
        for backend in (ours, theirs):
            la = laplace.Laplace(
                copy.deepcopy(model), likelihood, subset_of_weights="all",
                hessian_structure=structure, backend=backend, asdl_fisher_kwargs=kwargs,
            )
            la.fit(loader(X, y))
            fits.append(la)
        torch.testing.assert_close(
            fits[0].log_marginal_likelihood(), fits[1].log_marginal_likelihood()
        )


# --- laplace-torch's workflow ----------------------------------------------------------------


def _workflow(la, data, X, likelihood):
    la.fit(data)
    lml = la.log_marginal_likelihood()
    assert math.isfinite(lml.item())
    la.optimize_prior_precision(method="marglik", n_steps=15)
    assert la.log_marginal_likelihood() >= lml - 1e-9
    if likelihood == "regression":
        mean, var = la(X[:4], pred_type="glm")
        assert mean.shape == (4, 2) and (var.diagonal(dim1=1, dim2=2) > 0).all()
    else:
        probs = la(X[:4], pred_type="glm", link_approx="probit")
        torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=F64))
    return la


@pytest.mark.parametrize("structure", ["diag", "full", "kron", "ekfac"])
@pytest.mark.parametrize("name", PROBLEMS)
def test_laplace_workflow_against_brute_force(name, structure):
    model, X, y, likelihood = problem(name, n=13)
    la = laplace.Laplace(
        model, likelihood, subset_of_weights="all", hessian_structure=structure,
        backend=LaplaceGGN,
    )
    _workflow(la, loader(X, y), X, likelihood)
    ggn = ref_ggn(model, X, likelihood)
    if structure == "diag":
        torch.testing.assert_close(la.H, ggn.diagonal(), rtol=1e-10, atol=1e-12)
    if structure == "full":
        torch.testing.assert_close(la.H, ggn, rtol=1e-10, atol=1e-12)
        # GLM predictive: f ~ N(f(x), J P⁻¹ Jᵀ), P = GGN + δ I
        J, _ = ref_jacobians(model, X[:3])
        P = ggn + torch.eye(ggn.shape[0], dtype=F64) * la.prior_precision
        expected = J @ torch.linalg.solve(P, J.transpose(1, 2))
        _, f_var = la._glm_predictive_distribution(X[:3])
        torch.testing.assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
    if structure == "ekfac":
        assert isinstance(la, EKFACLaplace)
        _check_ekfac(la, model, ggn)


def _check_ekfac(la, model, ggn, sizes=None):
    """Λ* = diag(Qᵀ GGN_l Q) per block; the posterior's closed forms = the dense matrix's.

    `sizes`: the blocks' sizes (default: one block per parameter)."""
    if sizes is None:
        sizes = [p.numel() for p in model.parameters()]
    dense = []
    for block, ggn_block in zip(la.H, _blocks(ggn, sizes)):
        basis = block.dense(torch.ones_like(block.values))  # Q Qᵀ = I in the parameter's order
        torch.testing.assert_close(basis, torch.eye(block.numel, dtype=F64), atol=1e-10, rtol=0)
        Q = torch.stack([block.from_own(block.unrotate(e.reshape(1, *block.values.shape)))[0]
                         for e in torch.eye(block.numel, dtype=F64)], dim=1)
        torch.testing.assert_close(
            block.values.flatten(), (Q.T @ ggn_block @ Q).diagonal(), rtol=1e-8, atol=1e-10
        )
        dense.append(Q @ torch.diag(block.values.flatten()) @ Q.T)
    H = torch.block_diag(*dense)
    delta = la.prior_precision_diag
    P = H + torch.diag(delta)
    torch.testing.assert_close(la.posterior_precision, P, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(la.log_det_posterior_precision, torch.logdet(P))
    v = torch.randn(P.shape[0], dtype=F64)
    torch.testing.assert_close(la.square_norm(la.mean + v), v @ P @ v)
    J = torch.randn(2, 3, P.shape[0], dtype=F64)
    expected = J @ torch.linalg.solve(P, J.transpose(1, 2))
    torch.testing.assert_close(la.functional_variance(J), expected, rtol=1e-8, atol=1e-12)
    cov = la.functional_covariance(J)
    torch.testing.assert_close(cov, J.flatten(0, 1) @ torch.linalg.solve(P, J.flatten(0, 1).T))
    torch.manual_seed(0)
    samples = la.sample(4000) - la.mean
    empirical = samples.T @ samples / 4000
    torch.testing.assert_close(empirical, torch.linalg.inv(P), rtol=0, atol=0.15)


@pytest.mark.parametrize("backend", [LaplaceGGN, LaplaceEF])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_ekfac_with_folded_biases_against_brute_force(name, backend):
    """`separate_weight_and_bias=False`: one eigenbasis per layer, of `[W | b]`."""
    model, X, y, likelihood = problem(name, n=13)
    la = laplace.Laplace(
        model, likelihood, subset_of_weights="all", hessian_structure="ekfac",
        backend=backend, backend_kwargs={"separate_weight_and_bias": False},
    )
    _workflow(la, loader(X, y), X, likelihood)
    assert [b.bias is not None for b in la.H] == [True, True]
    if backend is LaplaceGGN:
        reference = ref_ggn(model, X, likelihood)
    else:
        G = ref_grads(model, X, y, likelihood)
        reference = G.T @ G
    sizes = [p.numel() for p in model.parameters()]
    _check_ekfac(la, model, reference, [sizes[0] + sizes[1], sizes[2] + sizes[3]])
    with pytest.raises(ValueError, match="different prior precisions"):
        la.prior_precision = torch.tensor([1.0, 2.0, 1.0, 1.0], dtype=F64)
        _ = la.log_det_posterior_precision
    kron = laplace.Laplace(
        model, likelihood, hessian_structure="kron", backend=backend,
        backend_kwargs={"separate_weight_and_bias": False},
    )
    with pytest.raises(ValueError, match="one block per parameter"):
        kron.fit(loader(X, y))


@pytest.mark.parametrize("structure", ["diag", "full", "kron"])
def test_ef_and_stochastic_backends_in_the_workflow(structure):
    model, X, y, likelihood = problem("cnn", n=13)
    for backend, kwargs in ((LaplaceEF, {}), (LaplaceGGN, {"stochastic": True, "num_samples": 2})):
        la = laplace.Laplace(
            copy.deepcopy(model), likelihood, subset_of_weights="all",
            hessian_structure=structure, backend=backend, backend_kwargs=kwargs,
        )
        _workflow(la, loader(X, y), X, likelihood)


def test_mc_diag_is_unbiased_for_the_ggn_diagonal():
    model, X, y, likelihood = problem("mlp", n=6)
    backend = LaplaceGGN(model, likelihood, stochastic=True, num_samples=4000)
    torch.manual_seed(0)
    _, diag = backend.diag(X, y)
    expected = ref_ggn(model, X, likelihood).diagonal()
    torch.testing.assert_close(diag, expected, rtol=0.1, atol=0.02)


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_last_layer_laplace(structure):
    model, X, y, likelihood = problem("mlp", n=13)
    la = laplace.Laplace(
        copy.deepcopy(model), likelihood, subset_of_weights="last_layer",
        hessian_structure=structure, backend=LaplaceGGN,
    )
    _workflow(la, loader(X, y), X, likelihood)
    assert la.model.last_layer is la.model.model[2]
    ggn = ref_ggn(model, X, likelihood)[-18:, -18:]  # the last Linear's 15 + 3 entries
    if structure == "diag":
        torch.testing.assert_close(la.H, ggn.diagonal(), rtol=1e-10, atol=1e-12)
    if structure == "full":
        torch.testing.assert_close(la.H, ggn, rtol=1e-10, atol=1e-12)
    # the other parameters are trainable again, their .grad untouched
    assert all(p.requires_grad and p.grad is None for p in la.model.parameters())


def test_subnetwork_diag_and_full():
    model, X, y, likelihood = problem("mlp", n=13)
    index = torch.tensor([0, 3, 40, 42])
    sub = LaplaceGGN(model, likelihood, subnetwork_indices=index)
    ggn = ref_ggn(model, X, likelihood)
    torch.testing.assert_close(sub.diag(X, y)[1], ggn.diagonal()[index])
    torch.testing.assert_close(sub.full(X, y)[1], ggn[index][:, index])
    with pytest.raises(ValueError, match="subnetwork"):
        sub.kron(X, y, N=13)


def test_hugging_face_logits_picks_the_last_unpadded_token():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )
    lm = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([1, 2])}
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(HuggingFaceLogits(lm)(batch), logits[[0, 1], [2, 3]])
        torch.testing.assert_close(HuggingFaceLogits(lm, position=0)(batch), logits[:, 0])


# --- Kronecker layout -------------------------------------------------------------------------


class _Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.norm(self.emb(x))[:, 0])


def test_kron_layout_of_embeddings_and_norms_is_exact_for_one_sample():
    """Embedding (factors of weight.T), LayerNorm (dense blocks): laplace's layout, exactly."""
    torch.manual_seed(0)
    model = _Tokens().to(F64)
    X, y = torch.tensor([[5]]), torch.tensor([1])
    _, kron = LaplaceGGN(model, "classification").kron(X, y, N=1)
    shapes = [[tuple(f.shape) for f in F] for F in kron.kfacs]
    assert shapes == [[(7, 7), (4, 4)], [(4, 4)], [(4, 4)], [(3, 3), (4, 4)], [(3, 3)]]
    ggn = ref_ggn(model, X, "classification")
    sizes = [p.numel() for p in model.parameters()]
    torch.testing.assert_close(
        kron.to_matrix(), torch.block_diag(*_blocks(ggn, sizes)), rtol=1e-9, atol=1e-12
    )


def test_laplace_factors_refuses_what_laplace_cannot_hold():
    G, A = torch.eye(3), torch.eye(2)
    with pytest.raises(ValueError, match="transposed convolution"):
        laplace_factors(torch.zeros(2, 3, 1, 1), [G, A], True, "up.weight")
    with pytest.raises(ValueError, match="dense curvature block"):
        laplace_factors(torch.zeros(2, 3), [torch.eye(6)], False, "w")
    assert [f.shape for f in laplace_factors(torch.zeros(1, 1, 3), [torch.eye(3)], False)] == [
        (1, 1), (3, 3)
    ]
    with pytest.raises(ValueError, match="5 axes"):
        laplace_factors(torch.zeros(1, 1, 1, 1, 1), [torch.eye(1)], False)


# --- a LoRA GPT-2 on dict batches -------------------------------------------------------------

VOCAB, CLASSES = 13, 3


def lora_gpt2(layers=1, dim=8):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=dim, n_layer=layers, n_head=2, n_inner=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, num_labels=CLASSES,
    )
    base = transformers.GPT2ForSequenceClassification(config)
    lora = peft.LoraConfig(
        r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
        init_lora_weights=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base, lora)
    return HuggingFaceLogits(model).to(F64).eval()


def token_batches(n=10, T=5, batch_size=4):
    torch.manual_seed(2)
    ids = torch.randint(1, VOCAB, (n, T))
    mask = torch.ones(n, T, dtype=torch.long)
    mask[::3, -2:] = 0  # some padded sequences
    ids[mask == 0] = 0
    labels = torch.randint(0, CLASSES, (n,))
    rows = [{"input_ids": i, "attention_mask": m, "labels": t} for i, m, t in
            zip(ids, mask, labels)]
    return torch.utils.data.DataLoader(rows, batch_size=batch_size), ids, mask, labels


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("structure", ["diag", "kron", "full", "ekfac"])
def test_lora_gpt2_on_dict_batches(structure):
    model = lora_gpt2()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    data, ids, mask, labels = token_batches()
    la = laplace.Laplace(
        model, "classification", subset_of_weights="all", hessian_structure=structure,
        backend=LaplaceGGN,
    )
    la.fit(data)
    assert math.isfinite(la.log_marginal_likelihood().item())
    la.optimize_prior_precision(method="marglik", n_steps=5)
    batch = next(iter(data))
    probs = la(batch, pred_type="glm", link_approx="probit")
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=F64))
    inputs = {"input_ids": ids, "attention_mask": mask}
    if structure in ("diag", "full"):
        ggn = ref_ggn(model, inputs, "classification")
        expected = ggn.diagonal() if structure == "diag" else ggn
        torch.testing.assert_close(la.H, expected, rtol=1e-8, atol=1e-12)
        J, f = la.backend.jacobians(inputs)
        J_ref, f_ref = ref_jacobians(model, inputs)
        torch.testing.assert_close(J, J_ref, rtol=1e-8, atol=1e-12)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_full_gpt2_kron_is_exact_for_one_token():
    """Every GPT-2 parameter gets factors in laplace's layout (Conv1D `[in, out]` weights, the
    square `c_proj` included, embeddings, LayerNorms); exact for one sample of one token."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=4, n_embd=4, n_layer=1, n_head=2, n_inner=6,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, num_labels=CLASSES,
    )
    model = HuggingFaceLogits(transformers.GPT2ForSequenceClassification(config)).to(F64).eval()
    X = {"input_ids": torch.tensor([[5]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}
    _, kron = LaplaceGGN(model, "classification").kron(X, torch.tensor([2]), N=1)
    params = list(model.parameters())
    assert len(kron.kfacs) == len(params)
    ggn = ref_ggn(model, X, "classification")
    sizes = [p.numel() for p in params]
    torch.testing.assert_close(
        kron.to_matrix(), torch.block_diag(*_blocks(ggn, sizes)), rtol=1e-8, atol=1e-12
    )


def test_laplace_own_backpack_backend_refuses_what_ours_takes():
    """The reason for this module: laplace-torch refuses its BackPACK backend on these."""
    from laplace.curvature import BackPackGGN

    model = lora_gpt2()
    with pytest.raises(ValueError, match="grad are switched off"):
        laplace.Laplace(model, "classification", subset_of_weights="all",
                        hessian_structure="diag", backend=BackPackGGN)
