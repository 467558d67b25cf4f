"""BatchNorm and Embedding rules beyond the shared table.

BatchNorm with batch statistics (training mode, or eval without running statistics) mixes samples:
BatchGrad warns and gives Σ_s δ ⊙ x̂ with the batch statistics, the other first-order extensions
raise. Embedding: sparse gradients, fused reductions that never build `[N, V, D]` (both Gram-matrix
algorithms), reuse of one embedding, and the tied-embedding language model with layer options.
"""

import pytest
import torch
from problems import DTYPE, Problem, first_order_reference, reference_per_sample_grads
from torch import nn

from backpack import backpack, extend
from backpack.extensions import BatchDotGrad, BatchGrad, BatchL2Grad, SumGradSquared, Variance
from backpack.recording import Record
from backpack.rules import find_rule
from backpack.rules.embedding import EmbeddingRule

QUANTITIES = ["grad_batch", "batch_l2", "sum_grad_squared", "variance", "batch_dot"]
OTHER_EXTENSIONS = [BatchL2Grad, SumGradSquared, Variance, BatchDotGrad]


def _extended_backward(model, x, lossfunc, y, *exts):
    model.zero_grad()
    extend(model)
    loss = lossfunc(model(x), y)
    with backpack(*exts):
        loss.backward()


def _check_all_quantities(problem):
    """Every first-order quantity against brute force, all extensions in one backward."""
    model, x, lossfunc, y = problem.build()
    reference = {
        k: v.to_dense() if v.is_sparse else v
        for k, v in reference_per_sample_grads(model, x, lossfunc, y).items()
    }
    exts = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad()]
    _extended_backward(model, x, lossfunc, y, *exts)
    for name, param in model.named_parameters():
        grad = param.grad.to_dense() if param.grad.is_sparse else param.grad
        torch.testing.assert_close(param.grad_batch.sum(0), grad, msg=name)
        for quantity in QUANTITIES:
            expected = first_order_reference(reference[name], quantity)
            torch.testing.assert_close(getattr(param, quantity), expected, msg=f"{name} {quantity}")
    return model


# --- BatchNorm with batch statistics ---------------------------------------------------------


def _bn_net(bn, in_shape):
    """Linear -> BN -> Tanh -> Linear (the layers after BN treat samples independently)."""
    feats = in_shape[-1]
    flat = bn.num_features * int(torch.tensor(in_shape[2:]).prod()) if len(in_shape) > 2 else None
    layers = [nn.Linear(feats, feats), bn, nn.Tanh()]
    if flat is not None:
        layers.append(nn.Flatten())
    layers.append(nn.Linear(flat or bn.num_features, 3))
    return nn.Sequential(*layers).to(DTYPE)


def _bn_case(kind, mode):
    """(model, input) with a BatchNorm that normalises with batch statistics."""
    torch.manual_seed(1)
    options = {"track_running_stats": False} if mode == "eval-untracked" else {}
    if kind == "1d-flat":
        bn, shape = nn.BatchNorm1d(4, **options), (6, 4)
    elif kind == "1d-seq":
        bn, shape = nn.BatchNorm1d(3, momentum=None, **options), (5, 3, 4)
    elif kind == "2d":
        bn, shape = nn.BatchNorm2d(2, eps=1e-2, **options), (4, 2, 3, 3)
    else:
        bn, shape = nn.BatchNorm3d(2, **options), (3, 2, 2, 3, 2)
    model = _bn_net(bn, shape)
    with torch.no_grad():
        bn.weight.normal_()
        bn.bias.normal_()
    model.train() if mode == "train" else model.eval()
    x = 3.0 * torch.randn(*shape, dtype=DTYPE) + 1.0
    return model, bn, x


BN_CASES = [(k, m) for k in ["1d-flat", "1d-seq", "2d", "3d"] for m in ["train", "eval-untracked"]]


@pytest.mark.parametrize("kind,mode", BN_CASES, ids=[f"{k}-{m}" for k, m in BN_CASES])
def test_batchnorm_batch_statistics_grad_batch(kind, mode):
    model, bn, x = _bn_case(kind, mode)
    lossfunc = nn.CrossEntropyLoss()
    y = torch.randint(0, 3, (x.shape[0],))
    reference = reference_per_sample_grads(model, x, lossfunc, y)

    # δ at the BN output and x̂ with the (biased) batch statistics, computed independently
    captured = {}
    handle = bn.register_forward_hook(lambda m, i, o: captured.update(x=i[0], y=o))
    model.zero_grad()
    out = model(x)
    captured["y"].retain_grad()
    lossfunc(out, y).backward()
    handle.remove()
    delta, bn_in = captured["y"].grad, captured["x"].detach()
    normalised = nn.functional.batch_norm(bn_in, None, None, training=True, eps=bn.eps)
    dims = [d for d in range(delta.dim()) if d > 1]
    expected = {
        "weight": (delta * normalised).sum(dims) if dims else delta * normalised,
        "bias": delta.sum(dims) if dims else delta,
    }

    extend(model)
    model.zero_grad()
    loss = lossfunc(model(x), y)
    with pytest.warns(UserWarning, match="mixes samples"), backpack(BatchGrad()):
        loss.backward()
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(bn, name).grad_batch, expected[name])
    names = dict(model.named_parameters())
    for name, param in names.items():
        torch.testing.assert_close(param.grad_batch.sum(0), param.grad, msg=name)
    # layers after BN treat samples independently, so BN's and the head's values are exact
    last = [k for k in names if k.startswith(str(len(model) - 1))]
    for name in ["1.weight", "1.bias", *last]:
        torch.testing.assert_close(names[name].grad_batch, reference[name], msg=name)
    # the layer before BN is coupled through the statistics: per-sample values differ
    assert not torch.allclose(names["0.weight"].grad_batch, reference["0.weight"])


def test_batchnorm_train_subsampling_uses_full_batch_statistics():
    model, bn, x = _bn_case("2d", "train")
    lossfunc, y = nn.CrossEntropyLoss(), torch.randint(0, 3, (x.shape[0],))
    extend(model)
    loss = lossfunc(model(x), y)
    with pytest.warns(UserWarning, match="mixes samples"), backpack(BatchGrad(), retain_graph=True):
        loss.backward(retain_graph=True)
    full = {k: getattr(bn, k).grad_batch.clone() for k in ("weight", "bias")}
    with (
        pytest.warns(UserWarning, match="mixes samples"),
        backpack(BatchGrad(subsampling=[3, 1, 3])),
    ):
        loss.backward()
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(bn, name).grad_batch, full[name][[3, 1, 3]])


@pytest.mark.parametrize("mode", ["train", "eval-untracked"])
@pytest.mark.parametrize("ext", OTHER_EXTENSIONS, ids=lambda e: e.__name__)
def test_batchnorm_batch_statistics_other_extensions_raise(ext, mode):
    model, _, x = _bn_case("1d-seq", mode)
    extend(model)
    loss = nn.CrossEntropyLoss()(model(x), torch.randint(0, 3, (x.shape[0],)))
    with pytest.raises(NotImplementedError, match="samples are mixed"), backpack(ext()):
        loss.backward()


def test_batchnorm_frozen_weight_and_fused_grad_sum():
    """Eval mode, γ frozen: β alone gets quantities; fused grad_sum = Σ_n per-sample grads."""
    model = _bn_net(nn.BatchNorm2d(2), (4, 2, 3, 3)).eval()
    bn = model[1]
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    bn.weight.requires_grad_(False)
    x, y = torch.randn(4, 2, 3, 3, dtype=DTYPE), torch.randint(0, 3, (4,))
    lossfunc = nn.CrossEntropyLoss()
    reference = reference_per_sample_grads(model, x, lossfunc, y)
    _extended_backward(model, x, lossfunc, y, Variance(), BatchL2Grad())
    assert not hasattr(bn.weight, "variance")
    expected = first_order_reference(reference["1.bias"], "variance")
    torch.testing.assert_close(bn.bias.variance, expected)
    record = Record(bn, (model[0](x).detach(),), {}, (), None)
    delta = torch.randn(4, 2, 3, 3, dtype=DTYPE)
    rule = find_rule(bn)
    fused = rule.grad_sum(record, (delta,), ["weight", "bias"])
    psg = rule.per_sample_grads(record, (delta,), ["weight", "bias"])
    for name in ("weight", "bias"):
        torch.testing.assert_close(fused[name], psg[name].sum(0))


# --- Embedding ---------------------------------------------------------------------------------


def test_embedding_max_norm_renormalises_rows():
    """The max_norm problem is non-trivial: the forward really rescales looked-up rows."""
    torch.manual_seed(0)
    emb = nn.Embedding(7, 4, max_norm=1.0).to(DTYPE)
    before = emb.weight.detach().norm(dim=1).clone()
    assert (before > 1.0).any()
    idx = torch.arange(7).reshape(1, 7)
    emb(idx)
    assert (emb.weight.detach().norm(dim=1) <= 1.0 + 1e-12).all()


@pytest.mark.parametrize(
    "options",
    [{}, {"padding_idx": 1}, {"max_norm": 0.8}],  # torch: no sparse + scale_grad_by_freq
    ids=["plain", "padding", "max-norm"],
)
def test_embedding_sparse_grad(options):
    """sparse=True: `.grad` is sparse, every quantity dense and exact."""

    def make():
        return nn.Sequential(
            nn.Embedding(6, 3, sparse=True, **options), nn.Flatten(), nn.Linear(12, 2)
        )

    def make_input():
        x = torch.randint(0, 6, (5, 4))
        x[:, 0] = 1
        return x

    model = _check_all_quantities(Problem("sparse", make, make_input))
    assert model[0].weight.grad.is_sparse
    assert model[0].weight.grad_batch.layout == torch.strided


class TiedPaddedLM(nn.Module):
    """Tied embedding with padding and frequency scaling, and the embedding used twice."""

    def __init__(self, vocab=7, dim=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0, scale_grad_by_freq=True)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.emb(x) + 0.5 * self.emb(x.flip(1)[:, :2]).sum(1, keepdim=True))
        return self.head(h).transpose(1, 2)


def test_tied_embedding_with_options_and_two_calls():
    def make_input():
        x = torch.randint(0, 7, (4, 5))
        x[:, -1] = 0
        return x

    _check_all_quantities(Problem("tied-padded", TiedPaddedLM, make_input))


def test_embedding_int32_indices():
    problem = Problem(
        "int32",
        lambda: nn.Sequential(nn.Embedding(5, 3), nn.Flatten(), nn.Linear(9, 2)),
        lambda: torch.randint(0, 5, (4, 3), dtype=torch.int32),
    )
    _check_all_quantities(problem)


def test_embedding_fused_reductions_never_materialise(monkeypatch):
    """Large vocabulary: the reductions run without per-sample gradients `[N, V, D]`."""
    problem = Problem(
        "large-vocab",
        lambda: nn.Sequential(
            nn.Embedding(5000, 3, padding_idx=7, scale_grad_by_freq=True),
            nn.Flatten(),
            nn.Linear(9, 2),
        ),
        lambda: torch.tensor([[7, 3, 3], [4999, 3, 0], [12, 12, 7], [0, 1, 2]]),
    )
    model, x, lossfunc, y = problem.build()
    reference = reference_per_sample_grads(model, x, lossfunc, y)["0.weight"]

    def forbidden(*args, **kwargs):
        raise AssertionError("per-sample gradients were materialised")

    monkeypatch.setattr(EmbeddingRule, "per_sample_grads", forbidden)
    _extended_backward(
        model, x, lossfunc, y, BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad()
    )
    weight = model[0].weight
    for quantity in ["batch_l2", "sum_grad_squared", "variance", "batch_dot"]:
        expected = first_order_reference(reference, quantity)
        torch.testing.assert_close(getattr(weight, quantity), expected, msg=quantity)


@pytest.mark.parametrize("vocab,tokens", [(3, 6), (400, 2)], ids=["ghost", "compact-dense"])
@pytest.mark.parametrize("options", [{}, {"padding_idx": 2, "scale_grad_by_freq": True}])
def test_embedding_rule_batch_dot_branches(vocab, tokens, options):
    """Both Gram algorithms (chosen by cost) agree with the materialised per-sample gradients."""
    torch.manual_seed(3)
    emb = nn.Embedding(vocab, 4, **options).to(DTYPE)
    idx = torch.randint(0, 3, (5, tokens))  # rows 0..2 only: few distinct rows in use
    idx[0, 0] = 2
    record = Record(emb, (idx,), {}, (), None)
    delta = (torch.randn(5, tokens, 4, dtype=DTYPE),)
    rule = find_rule(emb)
    psg = rule.per_sample_grads(record, delta, ["weight"])["weight"]
    torch.testing.assert_close(
        rule.batch_dot(record, delta, ["weight"])["weight"], first_order_reference(psg, "batch_dot")
    )
    torch.testing.assert_close(
        rule.batch_l2(record, delta, ["weight"])["weight"], first_order_reference(psg, "batch_l2")
    )
    torch.testing.assert_close(
        rule.sum_grad_squared(record, delta, ["weight"])["weight"],
        first_order_reference(psg, "sum_grad_squared"),
    )
    torch.testing.assert_close(rule.grad_sum(record, delta, ["weight"])["weight"], psg.sum(0))
    sub = rule.per_sample_grads(record, delta, ["weight"], subsampling=[4, 0, 4])["weight"]
    torch.testing.assert_close(sub, psg[[4, 0, 4]])
    if "padding_idx" in options:
        assert psg[:, 2].abs().max() == 0
