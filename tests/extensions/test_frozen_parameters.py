"""Frozen parameters (LoRA-style: most frozen) with every extension and hessianfree product.

Frozen parameters get no quantity; the trainable ones get exactly what brute force gives for
the trainable parameters alone (exact quantities), or what they get without freezing
(Kronecker factors, whose blocks do not depend on other parameters).
"""

import pytest
import torch
from problems import per_sample_losses
from second_order_reference import Curvature
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from backpack import backpack, extend
from backpack.extensions import (
    GGNMP,
    HMP,
    KFAC,
    KFLR,
    KFRA,
    PCHMP,
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    BatchDiagHessian,
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
from backpack.hessianfree import (
    L_op,
    R_op,
    ggn_vector_product,
    ggn_vector_product_from_plist,
    hessian_vector_product,
    jacobian_vector_product,
    transposed_jacobian_vector_product,
)

DT = torch.float64
N = 4

#: which parameters stay trainable, LoRA-style (everything else is frozen)
FREEZINGS = {
    "last_layer": {"4.weight", "4.bias"},
    "middle_bias": {"2.bias"},
    "first_weight": {"0.weight"},
    "biases": {"0.bias", "2.bias", "4.bias"},
}


def build(trainable, extended=True):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3)
    ).to(DT)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    x = torch.randn(N, 3, dtype=DT)
    y = torch.randint(0, 3, (N,))
    lossfunc = nn.CrossEntropyLoss()
    if extended:
        extend(model)
        extend(lossfunc)
    return model, x, lossfunc, y


def trainable_params(model):
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def close(actual, expected, msg=""):
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=1e-10, msg=msg)


def run(trainable, *exts):
    model, x, lossfunc, y = build(trainable)
    loss = lossfunc(model(x), y)
    with backpack(*exts):
        loss.backward()
    return model, x, lossfunc, y


def assert_frozen_untouched(model, *savefields):
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
            for field in savefields:
                assert not hasattr(p, field), (name, field)


def per_sample_grads(model, x, lossfunc, y):
    params = trainable_params(model)
    terms = per_sample_losses(lossfunc, model(x), y)
    rows = [
        torch.autograd.grad(terms[n], list(params.values()), retain_graph=True) for n in range(N)
    ]
    return {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(params)}


@pytest.mark.parametrize("freezing", FREEZINGS)
def test_first_order(freezing):
    exts = (BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance(), BatchDotGrad())
    model, x, lossfunc, y = run(FREEZINGS[freezing], *exts)
    assert_frozen_untouched(model, *(e.savefield for e in exts))
    ref = per_sample_grads(*build(FREEZINGS[freezing], extended=False))
    params = trainable_params(model)
    assert set(params) == FREEZINGS[freezing]
    flat_all = torch.cat([g.flatten(1) for g in ref.values()], 1)
    for name, p in params.items():
        g = ref[name]
        close(p.grad, g.sum(0), name)
        close(p.grad_batch, g, name)
        close(p.batch_l2, (g.flatten(1) ** 2).sum(1), name)
        close(p.sum_grad_squared, (g**2).sum(0), name)
        close(p.variance, (g**2).mean(0) - g.mean(0) ** 2, name)
        close(p.batch_dot, g.flatten(1) @ g.flatten(1).T, name)
    assert flat_all.shape[0] == N


@pytest.mark.parametrize("freezing", FREEZINGS)
def test_exact_second_order(freezing):
    trainable = FREEZINGS[freezing]
    ref = Curvature(*build(trainable, extended=False))
    exts = (
        DiagGGNExact(),
        BatchDiagGGNExact(),
        SqrtGGNExact(),
        GGNMP(),
        DiagHessian(),
        BatchDiagHessian(),
        HMP(),
        PCHMP(modify="clip"),
    )
    model, *_ = run(trainable, *exts)
    assert_frozen_untouched(model, *(e.savefield for e in exts))
    for name, p in trainable_params(model).items():
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)
        sqrt = p.sqrt_ggn_exact.flatten(2)
        close(torch.einsum("vnp,vnq->pq", sqrt, sqrt), ref.block(ref.ggn, name), name)
        close(p.diag_h, ref.diag(ref.hessian, name), name)
        close(p.diag_h_batch, ref.diag(ref.hessian_per_sample, name), name)
        mat = torch.randn(2, *p.shape, dtype=DT)
        for product, matrix in ((p.ggnmp, ref.ggn), (p.hmp, ref.hessian)):
            expected = (ref.block(matrix, name) @ mat.flatten(1).T).T.reshape(mat.shape)
            close(product(mat), expected, name)
        assert p.pchmp(mat).shape == mat.shape


@pytest.mark.parametrize("freezing", FREEZINGS)
def test_monte_carlo_and_kronecker(freezing):
    """MC quantities and Kronecker factors of a trainable parameter equal those it gets when
    nothing is frozen (same seed: the same MC samples)."""
    trainable = FREEZINGS[freezing]
    everything = {k for k, _ in build(trainable, extended=False)[0].named_parameters()}

    def quantities(names):
        exts = (
            DiagGGNMC(mc_samples=3),
            BatchDiagGGNMC(mc_samples=3),
            SqrtGGNMC(mc_samples=3),
            KFAC(mc_samples=3),
            KFLR(),
            KFRA(),
        )
        torch.manual_seed(1)
        model, *_ = run(names, *exts)
        assert_frozen_untouched(model, *(e.savefield for e in exts))
        return {
            name: {e.savefield: getattr(p, e.savefield) for e in exts}
            for name, p in trainable_params(model).items()
        }

    frozen, full = quantities(trainable), quantities(everything)
    assert set(frozen) == trainable
    for name, fields in frozen.items():
        for field, value in fields.items():
            expected = full[name][field]
            if isinstance(value, (list, tuple)):
                assert len(value) == len(expected), (name, field)
                for a, b in zip(value, expected):
                    close(a, b, f"{name} {field}")
            else:
                close(value, expected, f"{name} {field}")


class _Flatten(nn.Module):
    def forward(self, x):
        return x.flatten(1)


class _LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update B A x."""

    def __init__(self, d_in, d_out, rank=2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class _TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.norm = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.norm(self.embed(x))
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


ARCHITECTURES = {
    "conv": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3),
            nn.ReLU(),
            nn.Conv2d(3, 2, 2),
            _Flatten(),
            nn.LayerNorm(8),
            nn.Linear(8, 3),
        ),
        lambda: torch.randn(N, 2, 5, 5, dtype=DT),
        lambda names: {n for n in names if n.endswith("bias")},
    ),
    "lora": (
        lambda: nn.Sequential(_LoRALinear(3, 5), nn.Tanh(), _LoRALinear(5, 3)),
        lambda: torch.randn(N, 3, dtype=DT),
        lambda names: {n for n in names if "lora" in n},
    ),
    "attention": (
        _TinyTransformer,
        lambda: torch.randint(0, 7, (N, 5)),
        lambda names: {"norm.weight", "attn.in_proj_bias", "head.bias"},
    ),
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_style_architectures(arch):
    """Conv, norm, embedding and attention layers, most of their parameters frozen."""
    make_model, make_input, pick = ARCHITECTURES[arch]

    def build_arch():
        torch.manual_seed(0)
        model = make_model().to(DT)
        names = [k for k, _ in model.named_parameters()]
        keep = pick(names)
        for name, p in model.named_parameters():
            p.requires_grad_(name in keep)
        return model, make_input(), nn.CrossEntropyLoss(), torch.randint(0, 3, (N,))

    model, x, lossfunc, y = build_arch()
    with sdpa_kernel(SDPBackend.MATH):  # torch.func's double backward of attention
        ref = Curvature(model, x, lossfunc, y, hessian=False)
    grads = per_sample_grads(model, x, lossfunc, y)
    extend(model)
    extend(lossfunc)
    exts = (BatchGrad(), DiagGGNExact(), BatchDiagGGNExact(), SqrtGGNExact(), KFAC(), KFLR())
    with backpack(*exts):
        lossfunc(model(x), y).backward()
    assert_frozen_untouched(model, *(e.savefield for e in exts))
    params = trainable_params(model)
    assert params and len(params) < len(list(model.parameters()))
    for name, p in params.items():
        close(p.grad_batch, grads[name], name)
        close(p.diag_ggn_exact, ref.diag(ref.ggn, name), name)
        close(p.diag_ggn_exact_batch, ref.diag(ref.ggn_per_sample, name), name)
        sqrt = p.sqrt_ggn_exact.flatten(2)
        close(torch.einsum("vnp,vnq->pq", sqrt, sqrt), ref.block(ref.ggn, name), name)
        assert len(p.kfac) == len(p.kflr) >= 1


# --------------------------------------------------------------------------------------------
# backpack.hessianfree
# --------------------------------------------------------------------------------------------
def hessianfree_problem():
    model, x, lossfunc, y = build({"2.weight", "2.bias", "4.bias"}, extended=False)
    out = model(x)
    return model, out, lossfunc(out, y), Curvature(model, x, lossfunc, y, per_sample=False)


def test_ggn_vector_product_takes_the_trainable_parameters():
    model, out, loss, ref = hessianfree_problem()
    params = list(trainable_params(model).values())
    v = [torch.randn_like(p) for p in params]
    result = ggn_vector_product(loss, out, model, v)
    assert len(result) == len(params)
    flat_v = torch.cat([t.flatten() for t in v])
    close(torch.cat([r.flatten() for r in result]), ref.ggn @ flat_v)
    close(
        torch.cat([r.flatten() for r in ggn_vector_product_from_plist(loss, out, params, v)]),
        ref.ggn @ flat_v,
    )
    with pytest.raises(ValueError, match="trainable"):
        ggn_vector_product(loss, out, model, [torch.randn_like(p) for p in model.parameters()])


def test_hessianfree_products_on_trainable_parameters():
    model, out, loss, ref = hessianfree_problem()
    params = list(trainable_params(model).values())
    v = [torch.randn_like(p) for p in params]
    flat_v = torch.cat([t.flatten() for t in v])
    hv = hessian_vector_product(loss, params, v)
    close(torch.cat([r.flatten() for r in hv]), ref.hessian @ flat_v)
    # J v and Jᵀ w against each other: <w, J v> = <Jᵀ w, v>
    w = torch.randn_like(out)
    for rop, lop in ((R_op, L_op), (jacobian_vector_product, transposed_jacobian_vector_product)):
        (jv,) = rop(out, params, v)
        jtw = lop(out, params, w)
        close((w * jv).sum(), sum((a * b).sum() for a, b in zip(jtw, v)))


@pytest.mark.parametrize("op", ["L_op", "R_op", "hvp", "ggnvp_from_plist"])
def test_hessianfree_frozen_tensor_is_named_in_the_error(op):
    model, out, loss, _ = hessianfree_problem()
    params = list(model.parameters())
    v = [torch.randn_like(p) for p in params]
    calls = {
        "L_op": lambda: L_op(out, params, torch.randn_like(out)),
        "R_op": lambda: R_op(out, params, v),
        "hvp": lambda: hessian_vector_product(loss, params, v),
        "ggnvp_from_plist": lambda: ggn_vector_product_from_plist(loss, out, params, v),
    }
    with pytest.raises(RuntimeError, match=r"tensor 0 .* does not require grad.*frozen"):
        calls[op]()
