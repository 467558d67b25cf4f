"""Dropout in training mode inside `nn.MultiheadAttention` and the transformer layers.

The attention rule recovers the masks the forward drew by replaying the random generator from
its state before the call (`Record.rng`). References hold the masks fixed the same way a user
can: every forward of the reference (an unextended copy) starts from the same seed, so it draws
the very masks of the extended forward. Per-sample gradients are one autograd backward per
sample's loss term through that batch forward; GGN blocks come from the Jacobian of that
forward's output, one autograd backward per output entry (not `torch.func`: under its
transforms `nn.Dropout` draws other masks from the same seed). Also: the forward's output and
the RNG stream are those of the unextended model, `.grad` is plain autograd's bit for bit, the
masks are the forward's (read off the per-head weights output, and the same draws through SDPA's
kernel), and masks that do not reproduce the output are refused, never used.

Not in the shared problem table: its tests run several forwards of one model and compare with
references that need no reseeding (`backpack.verify` runs the model under `vmap`, where random
operations are refused).
"""

import copy

import pytest
import torch
from problems import DTYPE, first_order_reference, per_sample_losses, reference_per_sample_grads
from problems.attention import (
    Attention,
    DecoderModel,
    EncoderModel,
    TinyTransformer,
    _bool_mask_3d,
    _padding,
    causal_mask,
)
from second_order_reference import Curvature
from torch import nn
from torch.func import jacrev

from backpack import backpack, extend
from backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDotGrad,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
    Variance,
)
from backpack.recording import Record, live_records
from backpack.rules import attention as attention_rules
from backpack.rules import find_rule

#: torch's notice that vmap loops over SDPA's CPU backward (references use torch.func)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

#: every forward of a test starts from this seed
SEED = 11
P = 0.3
LOSSES = {
    "ce-mean": lambda: nn.CrossEntropyLoss(),
    "ce-sum": lambda: nn.CrossEntropyLoss(reduction="sum"),
    "mse-mean": lambda: nn.MSELoss(),
    "mse-sum": lambda: nn.MSELoss(reduction="sum"),
}


def _attention(**kwargs):
    if kwargs.get("use_weights"):
        kwargs.setdefault("keys", 3)  # the weights' width: the sequence length
    return lambda ce: Attention(ce=ce, dropout=P, **kwargs)


#: id -> (model builder taking `ce`, loss); inputs `[4, 3, 5]`
CASES = {
    "self-averaged-weights-ce-mean": (_attention(), "ce-mean"),
    "self-no-weights-seq-first-mse-sum": (
        _attention(batch_first=False, call={"need_weights": False}),
        "mse-sum",
    ),
    "per-head-weights-used-bias-kv-ce-sum": (
        _attention(use_weights=True, add_bias_kv=True, call={"average_attn_weights": False}),
        "ce-sum",
    ),
    "averaged-weights-used-zero-attn-seq-first-mse-mean": (
        _attention(use_weights=True, batch_first=False, add_zero_attn=True),
        "mse-mean",
    ),
    "padding-no-weights-ce-mean": (
        _attention(masks={"key_padding_mask": _padding(4, 3)}, call={"need_weights": False}),
        "ce-mean",
    ),
    "float-masks-weights-ce-sum": (
        _attention(
            masks={"attn_mask": torch.randn(3, 3), "key_padding_mask": _padding(4, 3, 5, "float")}
        ),
        "ce-sum",
    ),
    "bool-mask-3d-seq-first-mse-sum": (
        _attention(batch_first=False, masks={"attn_mask": _bool_mask_3d(4, 2, 3, 3)}),
        "mse-sum",
    ),
    "causal-sdpa-bias-kv-ce-mean": (
        _attention(
            masks={"attn_mask": causal_mask(3)},
            call={"is_causal": True, "need_weights": False},
            add_bias_kv=True,
        ),
        "ce-mean",
    ),
    "cross-kdim-vdim-no-weights-mse-mean": (
        _attention(cross=True, keys=2, kdim=3, vdim=4, call={"need_weights": False}),
        "mse-mean",
    ),
    "cross-packed-seq-first-ce-sum": (
        _attention(cross=True, keys=2, batch_first=False),
        "ce-sum",
    ),
    "encoder-post-norm-ce-mean": (
        lambda ce: EncoderModel(ce=ce, dropout=P),
        "ce-mean",
    ),
    "encoder-pre-norm-seq-first-mse-sum": (
        lambda ce: EncoderModel(ce=ce, dropout=P, batch_first=False, norm_first=True),
        "mse-sum",
    ),
    "decoder-pre-norm-ce-sum": (
        lambda ce: DecoderModel(ce=ce, dropout=P, norm_first=True),
        "ce-sum",
    ),
    "decoder-post-norm-seq-first-mse-mean": (
        lambda ce: DecoderModel(ce=ce, dropout=P, batch_first=False),
        "mse-mean",
    ),
    "transformer-ce-mean": (lambda ce: TinyTransformer(ce=ce, dropout=P), "ce-mean"),
}
FIRST = ["grad_batch", "batch_l2", "sum_grad_squared", "variance", "batch_dot"]


def _build(case):
    """Float64 model in training mode (unextended), input, loss and targets."""
    make, loss = CASES[case]
    torch.manual_seed(0)
    model = make(loss.startswith("ce")).to(DTYPE).train()
    x = torch.randn(4, 3, 5, dtype=DTYPE)
    lossfunc = LOSSES[loss]()
    torch.manual_seed(SEED)
    with torch.no_grad():
        out = model(x)
    if loss.startswith("ce"):
        y = torch.randint(0, out.shape[1], (out.shape[0], out.shape[2]))
    else:
        y = torch.randn_like(out)
    return model, x, lossfunc, y


def _reseeded(model):
    """An unextended copy whose every forward (functional calls too) starts from `SEED`."""
    copy_ = copy.deepcopy(model)

    def reseed(*_):
        torch.manual_seed(SEED)

    copy_.register_forward_pre_hook(reseed)
    return copy_


class FixedMaskCurvature:
    """GGN (full and per sample) of one forward of `model`, its masks held fixed.

    J by plain autograd through that forward; the loss Hessian w.r.t. the output (no dropout
    there) by `torch.func`. Blocks and diagonals as `Curvature`'s.
    """

    def __init__(self, model, x, lossfunc, y):
        named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        self.names = [k for k, _ in named]
        params = [p for _, p in named]
        out = model(x)
        n = out.shape[0]
        rows = []
        for entry in out.flatten():
            grads = torch.autograd.grad(entry, params, retain_graph=True, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
            rows.append(torch.cat([g.flatten() for g in grads]))
        jac = torch.stack(rows).reshape(n, -1, rows[0].numel())  # [N, D, P]
        o = out.detach()
        d = jac.shape[1]

        def total(flat):
            return per_sample_losses(lossfunc, flat.reshape(o.shape), y).sum()

        hess = jacrev(jacrev(total))(o.flatten()).reshape(n, d, n, d)
        blocks = torch.stack([hess[i, :, i, :] for i in range(n)])
        self.ggn_per_sample = torch.einsum("ndp,nde,neq->npq", jac, blocks, jac)
        self.ggn = self.ggn_per_sample.sum(0)
        self._offsets, i = {}, 0
        for k, p in named:
            self._offsets[k] = (i, i + p.numel(), p.shape)
            i += p.numel()

    block = Curvature.block
    diag = Curvature.diag


def _plain_grads(plain, x, lossfunc, y):
    plain.zero_grad()
    out = plain(x)
    lossfunc(out, y).backward()
    return out.detach(), {k: p.grad.clone() for k, p in plain.named_parameters()}


def _run(case, *extensions, second=False):
    """The extended model after one backward, checked against the unextended one on the way.

    The forward (from `SEED`) gives the unextended model's output bit for bit and leaves the
    generator where that one leaves it; the backward draws nothing (first-order and exact
    extensions) and leaves `.grad` as plain autograd's.
    """
    model, x, lossfunc, y = _build(case)
    plain = _reseeded(model)
    expected_out, expected_grads = _plain_grads(plain, x, lossfunc, y)
    torch.manual_seed(SEED)
    copy.deepcopy(model)(x)  # the generator after an unextended forward
    after_forward = torch.get_rng_state()
    extend(model)
    if second:
        extend(lossfunc)
    torch.manual_seed(SEED)
    out = model(x)
    assert torch.equal(out, expected_out)
    assert torch.equal(torch.get_rng_state(), after_forward)
    with backpack(*extensions):
        lossfunc(out, y).backward()
    if not any(isinstance(e, (DiagGGNMC, BatchDiagGGNMC, SqrtGGNMC, KFAC)) for e in extensions):
        assert torch.equal(torch.get_rng_state(), after_forward)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected_grads[name]), name
    return model, plain, x, lossfunc, y


@pytest.mark.parametrize("case", list(CASES))
def test_first_order_quantities_are_exact(case):
    extensions = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad()]
    model, plain, x, lossfunc, y = _run(case, *extensions)
    reference = reference_per_sample_grads(plain, x, lossfunc, y)
    for name, p in model.named_parameters():
        for quantity in FIRST:
            expected = first_order_reference(reference[name], quantity)
            torch.testing.assert_close(
                getattr(p, quantity), expected, rtol=1e-7, atol=1e-10, msg=f"{name} {quantity}"
            )
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad, msg=name)


@pytest.mark.parametrize("case", ["self-averaged-weights-ce-mean", "encoder-post-norm-ce-mean"])
def test_subsampling(case):
    model, plain, x, lossfunc, y = _run(case, BatchGrad(subsampling=[2, 0, 2]))
    reference = reference_per_sample_grads(plain, x, lossfunc, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, reference[name][[2, 0, 2]], msg=name)


def _close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9, msg=msg)


@pytest.mark.parametrize("case", list(CASES))
def test_ggn_family_holds_the_masks_fixed(case):
    extensions = [DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), GGNMP()]
    model, plain, x, lossfunc, y = _run(case, *extensions, second=True)
    ref = FixedMaskCurvature(plain, x, lossfunc, y)
    for name, p in model.named_parameters():
        _close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        _close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)
        sqrt = p.sqrt_ggn_exact.flatten(2)
        _close(torch.einsum("vnp,vnq->pq", sqrt, sqrt), ref.block(ref.ggn, name), name)
        mat = torch.randn(3, *p.shape, dtype=p.dtype)
        expected = (ref.block(ref.ggn, name) @ mat.flatten(1).T).T.reshape(mat.shape)
        _close(p.ggnmp(mat), expected, name)


@pytest.mark.parametrize(
    "case",
    [
        "self-averaged-weights-ce-mean",
        "per-head-weights-used-bias-kv-ce-sum",
        "cross-packed-seq-first-ce-sum",
        "encoder-pre-norm-seq-first-mse-sum",
        "decoder-pre-norm-ce-sum",
    ],
)
def test_kronecker_factors(case):
    """KFLR "reduce": a bias's G and a dense factor are exact GGN blocks; KFAC shares A."""
    model, plain, x, lossfunc, y = _run(
        case, KFLR(kfac_approx="reduce"), KFAC(mc_samples=2, kfac_approx="reduce"), second=True
    )
    ref = FixedMaskCurvature(plain, x, lossfunc, y)
    exact_blocks = 0
    for name, p in model.named_parameters():
        if not hasattr(p, "kflr"):
            continue  # the packed in_proj_weight of cross-attention beyond MAX_DENSE_NUMEL
        assert [f.shape for f in p.kfac] == [f.shape for f in p.kflr], name
        if len(p.kflr) == 1:  # a bias, or a dense block
            _close(p.kflr[0], ref.block(ref.ggn, name).reshape(p.kflr[0].shape), name)
            exact_blocks += 1
        else:
            _close(p.kfac[1], p.kflr[1], name)
    assert exact_blocks >= 4


def test_monte_carlo_extensions_run():
    extensions = [DiagGGNMC(mc_samples=2), BatchDiagGGNMC(mc_samples=2), SqrtGGNMC(mc_samples=2)]
    model, *_ = _run("encoder-post-norm-ce-mean", *extensions, second=True)
    for name, p in model.named_parameters():
        assert p.diag_ggn_mc.shape == p.shape, name
        assert p.diag_ggn_mc_batch.shape == (4, *p.shape), name
        assert p.sqrt_ggn_mc.shape == (2, 4, *p.shape), name
        assert torch.isfinite(p.diag_ggn_mc).all(), name


# --- the masks ---------------------------------------------------------------------------------


def _masks_of(module):
    """The dropout multipliers the rule recovers for the module's live record."""
    (record,) = live_records(module)
    find_rule(module)._forward(record)
    return record.extra[attention_rules._MASKS]


def _one_call(**call):
    torch.manual_seed(0)
    module = extend(nn.MultiheadAttention(6, 2, dropout=P, batch_first=True).to(DTYPE))
    x = torch.randn(5, 4, 6, dtype=DTYPE, requires_grad=True)
    torch.manual_seed(SEED)
    return module, module(x, x, x, **call)


def test_masks_are_those_of_the_per_head_weights():
    module, (_, weights) = _one_call(average_attn_weights=False)
    masks = _masks_of(module)
    assert torch.equal(masks != 0, weights != 0)  # no weight is 0 without a mask
    assert set(masks.unique().tolist()) == {0.0, 1 / (1 - P)}


def test_sdpa_draws_the_masks_of_the_weights_path():
    """Without weights the math kernel of SDPA drops `[N, H, L, S]`: the same draws."""
    module, (y, _) = _one_call(need_weights=False)
    masks = _masks_of(module)
    _, (_, weights) = _one_call(average_attn_weights=False)
    assert torch.equal(masks != 0, weights != 0)
    (record,) = live_records(module)
    fwd = find_rule(module)._forward(record)
    torch.testing.assert_close(fwd.output(), y, rtol=1e-13, atol=1e-14)


def test_masks_that_do_not_reproduce_the_output_are_refused(monkeypatch):
    original = attention_rules._replayed_dropout

    def shifted(rng, shape, dtype, p):  # another mask: the draws of the next call
        masks = original(rng, shape, dtype, p)
        return masks.roll(1, -1)

    monkeypatch.setattr(attention_rules, "_replayed_dropout", shifted)
    module, (y, _) = _one_call(need_weights=False)
    with pytest.raises(NotImplementedError, match="do not reproduce the call's output"):
        with backpack(BatchGrad()):
            y.sum().backward()


def test_masks_without_saved_state_read_off_per_head_weights_or_refused():
    torch.manual_seed(0)
    module = nn.MultiheadAttention(6, 2, dropout=P, batch_first=True).to(DTYPE)
    x = torch.randn(3, 4, 6, dtype=DTYPE)
    rule = find_rule(module)
    names = [n for n, _ in module.named_parameters()]
    for call in ({"average_attn_weights": False}, {"need_weights": False}):
        out = module(x, x, x, **call)
        tensors = tuple(t.detach() for t in out if t is not None)
        record = Record(module, (x, x, x), call, tensors, tuple(out))
        record.out_requires_grad = tuple(True for _ in tensors)
        grads = tuple(torch.ones_like(t) for t in tensors)
        if call.get("need_weights", True):
            rule.per_sample_grads(record, grads, names)
            assert torch.equal(record.extra[attention_rules._MASKS] != 0, out[1] != 0)
        else:
            with pytest.raises(NotImplementedError, match="no state of the random generator"):
                rule.per_sample_grads(record, grads, names)


def test_replay_leaves_the_generator_alone():
    module, (y, _) = _one_call(need_weights=False)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    _masks_of(module)
    assert torch.equal(torch.get_rng_state(), before)


def test_eval_mode_saves_no_state():
    torch.manual_seed(0)
    module = extend(nn.MultiheadAttention(6, 2, dropout=P, batch_first=True).eval())
    x = torch.randn(3, 4, 6, requires_grad=True)
    out = module(x, x, x)  # noqa: F841 (its graph holds the record)
    (record,) = live_records(module)
    assert record.rng is None


def test_several_calls_of_one_module_keep_their_own_masks():
    """A module called twice in one forward draws two masks; each call's record has its own."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(6, 2, dropout=P, batch_first=True).to(DTYPE)
    head = nn.Linear(6, 3).to(DTYPE)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = attn, head

        def forward(self, x):
            h = self.attn(x, x, x, need_weights=False)[0]
            y, w = self.attn(h, h, h)  # the weights path, its output used too
            return self.head(y + w.mean(-1, keepdim=True)).transpose(1, 2)

    model = Twice().train()
    x = torch.randn(4, 3, 6, dtype=DTYPE)
    y = torch.randint(0, 3, (4, 3))
    lossfunc = nn.CrossEntropyLoss()
    plain = _reseeded(model)
    reference = reference_per_sample_grads(plain, x, lossfunc, y)
    ref = FixedMaskCurvature(plain, x, lossfunc, y)
    extend(model)
    extend(lossfunc)
    torch.manual_seed(SEED)
    with backpack(BatchGrad(), DiagGGNExact(), GGNMP()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad_batch, reference[name], msg=name)
        _close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        mat = torch.randn(2, *p.shape, dtype=p.dtype)
        expected = (ref.block(ref.ggn, name) @ mat.flatten(1).T).T.reshape(mat.shape)
        _close(p.ggnmp(mat), expected, name)


class _AttentionOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, dropout=P, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0]).transpose(1, 2)


@pytest.mark.parametrize("ext", [DiagHessian, HMP])
def test_hessian_extensions_refuse_attention_naming_it(ext):
    """Attention has no second-derivative rule, with or without dropout: a clear refusal."""
    model = extend(_AttentionOnly().to(DTYPE).train())
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(4, 3, 6, dtype=DTYPE), torch.randint(0, 3, (4, 3))
    with pytest.raises(NotImplementedError, match=rf"{ext.__name__} cannot handle 'attn'"):
        with backpack(ext()):
            lossfunc(model(x), y).backward()


def test_per_sample_losses_of_the_reference_sum_to_the_loss():
    """Sanity of the reference: the reseeded copy's terms sum to the extended model's loss."""
    model, x, lossfunc, y = _build("encoder-post-norm-ce-mean")
    plain = _reseeded(model)
    extend(model)
    torch.manual_seed(SEED)
    loss = lossfunc(model(x), y)
    terms = per_sample_losses(lossfunc, plain(x), y)
    torch.testing.assert_close(terms.sum(), loss, rtol=1e-14, atol=0)


def test_kfra_through_attention_with_dropout():
    """KFRA (attention as first module): out_proj's G is Σ_t Ḡ_tt whatever the masks; A of x."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(4, 2, dropout=P, batch_first=True).to(DTYPE)
    head = nn.Linear(12, 3).to(DTYPE)

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.flat, self.head = attn, nn.Flatten(), head

        def forward(self, x):
            return self.head(self.flat(self.attn(x, x, x, need_weights=False)[0]))

    model = First().train()
    x, y = torch.randn(5, 3, 4, dtype=DTYPE), torch.randint(0, 3, (5,))
    lossfunc = nn.CrossEntropyLoss()
    torch.manual_seed(SEED)
    with torch.no_grad():
        out = model(x)
    hess = jacrev(jacrev(lambda o: lossfunc(o.reshape(out.shape), y)))(out.flatten())
    hess = hess.reshape(5, 3, 5, 3)
    w = head.weight.detach()
    gbar = (w.T @ sum(hess[i, :, i] for i in range(5)) @ w).reshape(3, 4, 3, 4)
    extend(model)
    extend(lossfunc)
    torch.manual_seed(SEED)
    with backpack(KFRA()):
        lossfunc(model(x), y).backward()
    _close(attn.out_proj.weight.kfra[0], sum(gbar[t, :, t, :] for t in range(3)))
    g, a = attn.in_proj_weight.kfra
    assert g.shape == (12, 12) and torch.isfinite(g).all()
    _close(a, torch.einsum("nti,ntj->ij", x, x) / 15)
