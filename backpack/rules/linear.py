"""`nn.Linear`: y = x Wᵀ + b on inputs `[N, *, in]`; extra axes are summed per sample.

With x_n of shape `[T, in]` and output gradient d_n `[T, out]`, the per-sample gradients are
W: d_nᵀ x_n and b: Σ_t d_nt. For plain `[N, in]` inputs (T = 1) the squared norms, sums of squares
and Gram matrices factor into products of small matrices, so they never materialise `[N, out, in]`.
With T > 1 the Gram ("ghost") form costs N T² (in + out) against N T in out for materialising, and
the cheaper one is used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from backpack.recording import PRIVATE_VIEW_OUTPUTS, SHAPE_ONLY_OUTPUTS, Record
from backpack.rules.base import (
    GradOutputs,
    ModuleRule,
    Names,
    gram,
    register_rule,
    register_standard_forward,
)
from backpack.variance import centred_squares, outer_centred_squares


def _flat_input(record: Record) -> Tensor:
    """Input as `[N, T, in]` (T = 1 for 2-D inputs)."""
    return _rows(record.args[0])


def _rows(t: Tensor) -> Tensor:
    """`t` as `[N, T, features]`; a 3-D `t` as it is (a reshape is an operator call too)."""
    return t if t.dim() == 3 else t.reshape(t.shape[0], -1, t.shape[-1])


def _flat(record: Record, grad_outputs: GradOutputs) -> tuple[Tensor, Tensor]:
    """Input `[N, T, in]` and output gradient `[N, T, out]` (T = 1 for 2-D inputs)."""
    return _rows(record.args[0]), _rows(grad_outputs[0])


def _products(a: Tensor, b: Tensor) -> Tensor:
    """Per-sample Σ_t a_nt b_ntᵀ of `[N, T, p]` and `[N, T, q]`: `[N, p, q]`.

    One batched GEMM: einsum's reshuffling costs several more operator calls.
    """
    return torch.bmm(a.transpose(1, 2), b)


# the rule reads its outputs' shapes only (see `SHAPE_ONLY_OUTPUTS`)
SHAPE_ONLY_OUTPUTS.add(nn.Linear)
#: subclasses whose own forward calls `F.linear(input, self.weight, self.bias)` (timm's casts
#: weight and bias to the input's dtype under TorchScript only); checked against the installed
#: package by tests/rules/test_thirdparty_rules.py
register_standard_forward("timm.layers.linear.Linear")


@register_rule(nn.Linear)
class LinearRule(ModuleRule):
    """Per-sample gradients and fused reductions of `nn.Linear`."""

    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """`[N, out, in]` weight and `[N, out]` bias gradients."""
        x, g = _flat(record, grad_outputs)
        if subsampling is not None:
            index = torch.as_tensor(subsampling, device=x.device)
            x, g = x[index], g[index]
        result = {}
        if "weight" in names:
            result["weight"] = _products(g, x)
        if "bias" in names:
            result["bias"] = g.sum(1)
        return result

    @staticmethod
    def _ghost_is_cheaper(x: Tensor, g: Tensor) -> bool:
        t = x.shape[1]
        return t * t * (x.shape[2] + g.shape[2]) < t * x.shape[2] * g.shape[2]

    def batch_l2(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict | None:
        """‖d_nᵀ x_n‖² via Gram matrices of inputs and output gradients."""
        x, g = _flat(record, grad_outputs)
        result = {}
        if "weight" in names:
            if x.shape[1] == 1:
                result["weight"] = (g.square().sum((1, 2))) * (x.square().sum((1, 2)))
            elif self._ghost_is_cheaper(x, g):
                gram_g = torch.bmm(g, g.transpose(1, 2))
                gram_x = torch.bmm(x, x.transpose(1, 2))
                result["weight"] = (gram_g * gram_x).sum((1, 2))
            else:
                result["weight"] = _products(g, x).square().sum((1, 2))
        if "bias" in names:
            result["bias"] = g.sum(1).square().sum(1)
        return result

    def sum_grad_squared(
        self, record: Record, grad_outputs: GradOutputs, names: Names
    ) -> dict | None:
        """Σ_n (d_nᵀ x_n)² as one matrix product for 2-D inputs."""
        x, g = _flat(record, grad_outputs)
        result = {}
        if "weight" in names:
            if x.shape[1] == 1:
                result["weight"] = g[:, 0].square().T @ x[:, 0].square()
            else:
                result["weight"] = _products(g, x).square().sum(0)
        if "bias" in names:
            result["bias"] = g.sum(1).square().sum(0)
        return result

    def batch_dot(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict | None:
        """<g_n, g_m> = Σ_{t,s} (d_nt·d_ms)(x_nt·x_ms)."""
        x, g = _flat(record, grad_outputs)
        n, t = x.shape[0], x.shape[1]
        result = {}
        if "weight" in names:
            if t == 1:
                result["weight"] = (g[:, 0] @ g[:, 0].T) * (x[:, 0] @ x[:, 0].T)
            elif n * t * t * (x.shape[2] + g.shape[2]) < (t + n) * x.shape[2] * g.shape[2]:
                gg = torch.einsum("nto,mso->nmts", g, g)
                xx = torch.einsum("nti,msi->nmts", x, x)
                result["weight"] = (gg * xx).sum((2, 3))
            else:
                flat = _products(g, x).flatten(1)
                result["weight"] = flat @ flat.T
        if "bias" in names:
            b = g.sum(1)
            result["bias"] = b @ b.T
        return result

    def grad_sum_and_squares(
        self, record: Record, grad_outputs: GradOutputs, names: Names
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]] | None:
        """(Σ_n g_n, Σ_n g_n²) from one `[N, out, in]` per-sample product, for sequence inputs.

        With T > 1 positions the squares need the per-sample gradients anyway, and their sum is
        the gradient. For 2-D inputs the squares have a closed form, and autograd's gradient
        is cheaper than a second product (None).
        """
        x, g = _flat(record, grad_outputs)
        if x.shape[1] == 1:
            return None
        sums, squares = {}, {}
        if "weight" in names:
            per_sample = _products(g, x)
            sums["weight"] = per_sample.sum(0)
            squares["weight"] = per_sample.square_().sum(0)
        if "bias" in names:
            per_sample_bias = g.sum(1)
            sums["bias"], squares["bias"] = per_sample_bias.sum(0), per_sample_bias.square().sum(0)
        return sums, squares

    def grad_sum_and_centred_squares(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        grad_sums: dict[str, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(Σ_n g_n, Σ_n (g_n − ḡ)²) for `Variance`.

        2-D inputs: the weight's by `backpack.variance.outer_centred_squares` (one matrix
        product, plus dᵀx unless `grad_sums` has the weight's gradient, where nothing cancels);
        sequence inputs: from the per-sample gradients, centred in place.
        """
        x, g = _flat(record, grad_outputs)
        sums, squares = {}, {}
        if "weight" in names:
            if x.shape[1] == 1:
                given = None if grad_sums is None else grad_sums.get("weight")
                total, m2 = outer_centred_squares(g[:, 0], x[:, 0], given)
                sums["weight"], squares["weight"] = total, m2
            else:
                per_sample = _products(g, x)
                sums["weight"], squares["weight"] = centred_squares(per_sample, overwrite=True)
        if "bias" in names:
            sums["bias"], squares["bias"] = centred_squares(g.sum(1), overwrite=True)
        return sums, squares

    def uses_grad_sums(self, record: Record) -> bool:
        """For 2-D inputs autograd's gradient spares the weight's product dᵀx."""
        return record.args[0].dim() == 2 or math.prod(record.args[0].shape[1:-1]) == 1

    def grad_sum(self, record: Record, grad_outputs: GradOutputs, names: Names) -> dict | None:
        """This call's contribution to the gradient."""
        x, g = _flat(record, grad_outputs)
        result = {}
        if "weight" in names:
            result["weight"] = gram(g, x)
        if "bias" in names:
            result["bias"] = g.sum((0, 1))
        return result

    def grad_sum_entries(self, record, grad_outputs, name, index):  # noqa: D102
        x, g = _flat(record, grad_outputs)
        if name == "bias":
            return g.sum((0, 1))[index]
        rows, cols = index // x.shape[2], index % x.shape[2]
        return (g[..., rows] * x[..., cols]).sum((0, 1))

    # --- second order ---------------------------------------------------------------------
    @staticmethod
    def _flat_factor(record: Record, factors) -> Tensor:
        """Factor at the output as `[V, N, T, out]`."""
        f = factors[0]
        return f if f.dim() == 4 else f.reshape(f.shape[0], f.shape[1], -1, f.shape[-1])

    def sqrt_factor(self, record, factors, names, subsampling=None):  # noqa: D102
        x = _flat_input(record)
        f = self._flat_factor(record, factors)
        if subsampling is not None:
            index = torch.as_tensor(subsampling, device=x.device)
            x, f = x[index], f[:, index]
        result = {}
        if "weight" in names:
            if f.shape[0] == 1:  # one column (Monte-Carlo): a single batched product
                result["weight"] = _products(f[0], x).unsqueeze(0)
            else:
                result["weight"] = torch.einsum("vnto,nti->vnoi", f, x)
        if "bias" in names:
            result["bias"] = f.sum(2)
        return result

    def sqrt_factor_into(self, record, factors, names, subsampling, out):  # noqa: D102
        x = _flat_input(record)
        if x.shape[1] != 1 or subsampling is not None:
            return super().sqrt_factor_into(record, factors, names, subsampling, out)
        f = self._flat_factor(record, factors)
        shape = (f.shape[0], f.shape[1])
        result = {}
        if "weight" in names:
            # the per-sample outer products written once, straight into their destination
            dest = out.get("weight")
            wanted = (*shape, f.shape[-1], x.shape[-1])
            if dest is not None and (dest.shape != wanted or dest.dtype != torch.result_type(f, x)):
                dest = None
            result["weight"] = torch.mul(f[:, :, 0, :, None], x[None, :, 0, None, :], out=dest)
        if "bias" in names:
            dest = out.get("bias")
            if dest is not None and (dest.shape != (*shape, f.shape[-1]) or dest.dtype != f.dtype):
                dest = None
            result["bias"] = torch.sum(f, 2, out=dest)
        return result

    def diag_from_factor(self, record, factors, names, coef, per_sample):  # noqa: D102
        x = _flat_input(record)
        f = self._flat_factor(record, factors)
        if x.shape[1] != 1 and "weight" in names:
            if f.shape[0] == 1:
                return _one_column_diag(
                    x, f[0], names, None if coef is None else coef[0], per_sample
                )
            return super().diag_from_factor(record, factors, names, coef, per_sample)
        result = {}
        if "weight" in names:
            f2 = f[:, :, 0].square()
            if coef is not None:
                f2 = f2 * coef.unsqueeze(-1)
            x2 = x[:, 0].square()
            spec = "vno,ni->noi" if per_sample else "vno,ni->oi"
            result["weight"] = torch.einsum(spec, f2, x2)
        if "bias" in names:
            b2 = f.sum(2).square()
            if coef is not None:
                b2 = b2 * coef.unsqueeze(-1)
            result["bias"] = b2.sum(0) if per_sample else b2.sum((0, 1))
        return result

    def diag_from_residual(
        self, record: Record, index: int, diag: Tensor, names: Names, per_sample: bool
    ) -> dict[str, Tensor]:
        """Parameter diagonals of the curvature Σ c[n, t, o] ∇y_nto ∇y_ntoᵀ at the output.

        `diag` (c, shaped like the output) is a diagonal curvature at the output, e.g. an
        activation's residual δ ⊙ φ'' right after this layer. Each term has a single nonzero
        output entry, so no products between positions t arise: the weight gets
        Σ_t c[n, t, o] x[n, t, i]², the bias Σ_t c[n, t, o]. The same numbers hold for a dense
        output curvature that couples no two positions of a sample (`accepts_output_diag`).
        """
        x = _flat_input(record)
        c = diag.reshape(x.shape[0], -1, diag.shape[-1])
        result = {}
        if "weight" in names:
            x2 = x.square()
            if x.shape[1] == 1:
                c0, x0 = c[:, 0], x2[:, 0]
                result["weight"] = c0.unsqueeze(2) * x0.unsqueeze(1) if per_sample else c0.T @ x0
            else:
                spec = "nto,nti->noi" if per_sample else "nto,nti->oi"
                result["weight"] = torch.einsum(spec, c, x2)
        if "bias" in names:
            result["bias"] = c.sum(1) if per_sample else c.sum((0, 1))
        return result

    def factor_output_diag(
        self, record: Record, factors: Sequence[Tensor | None], coef: Tensor | None
    ) -> tuple[int, Tensor] | None:
        """Output diagonal c with `diag_from_residual(c)` == `diag_from_factor(factors, coef)`.

        For 2-D inputs c[n, o] = Σ_v coef[v, n] f[v, n, o]², so that all curvature terms of a
        call can be summed at the output before one outer product with x². None with several
        positions (the factor then couples positions).
        """
        if _flat_input(record).shape[1] != 1 or factors[0] is None:
            return None
        f2 = self._flat_factor(record, factors)[:, :, 0].square()
        if coef is not None:
            f2 = f2 * coef.unsqueeze(-1)
        return 0, f2.sum(0).reshape(record.outputs[0].shape)

    def accepts_output_diag(self, record: Record) -> bool:
        """Whether `diag_from_residual` is exact for the diagonal of a dense output curvature.

        True: with the output curvature of each sample block-diagonal over positions (any chain
        of Linear layers and elementwise modules leading to an activation keeps positions apart),
        the parameter diagonals only read its diagonal.
        """
        return True

    def residual_input_diag(self, record: Record, diag: Tensor) -> Tensor:
        """Diagonal of Jᵀ diag(c) J w.r.t. the input: (W∘W)ᵀ c at every position.

        Exact for a diagonal output curvature c; the full input curvature is then
        block-diagonal over positions (Wᵀ diag(c_nt) W), which later steps rely on.
        """
        w = record.module.weight.detach()
        return (diag @ w.square()).reshape(record.args[0].shape)

    def kron_factors_dense(
        self, record: Record, gbar: Tensor, names: Names
    ) -> dict[str, list[Tensor]]:
        """Kronecker factors for a dense curvature `gbar` over one sample's flattened output.

        Same numbers as `kron_factors` with a square root of `gbar` as factor: positions act as
        samples, so G sums the diagonal blocks of `gbar` over positions.
        """
        x = _flat_input(record)
        out = record.module.out_features
        t = gbar.shape[0] // out
        g = gbar.reshape(t, out, t, out).diagonal(dim1=0, dim2=2).sum(-1)
        return _kron_result(x, (g + g.T) / 2, names)

    def kron_output_gram(
        self, record: Record, factors: Sequence[Tensor | None], approx: str = "expand"
    ) -> Tensor:
        """The output-side Kronecker factor G of these factor columns alone (sums over columns)."""
        f = self._flat_factor(record, factors)
        if approx == "reduce" and f.shape[2] > 1:
            s = f.sum(2)  # [V, N, out]
            return gram(s)
        return gram(f)

    def kron_factors(self, record, factors, names, approx="expand"):  # noqa: D102
        # Sequence inputs [N, T, in]: "expand" lets positions act as samples (A averages over
        # N·T inputs, G sums over positions); "reduce" averages the inputs over positions and
        # sums the factor over positions before the outer products.
        x = _flat_input(record)
        g = self.kron_output_gram(record, factors, approx)
        if approx == "reduce" and x.shape[1] > 1:
            return _kron_result(x.mean(1, keepdim=True), g, names)  # inputs averaged
        return _kron_result(x, g, names)


def _kron_result(x: Tensor, g: Tensor, names: Names) -> dict[str, list[Tensor]]:
    """Kronecker factors `[G, A]` (weight) and `[G]` (bias) from G and the input `[N, T, in]`.

    Positions act as samples in A (the "expand" convention).
    """
    result: dict[str, list[Tensor]] = {}
    if "weight" in names:
        result["weight"] = [g, gram(x) / (x.shape[0] * x.shape[1])]
    if "bias" in names:
        result["bias"] = [g]
    return result


@register_rule("transformers.pytorch_utils.Conv1D")
class Conv1DRule(LinearRule):
    """Hugging Face's `Conv1D` (GPT-2, OpenAI GPT): y = x W + b with W stored as `[in, out]`.

    It is `nn.Linear` with the transposed weight, so every quantity is Linear's for `Wᵀ`,
    returned in the stored layout: per-sample gradients x_nᵀ d_n `[N, in, out]`, diagonals and
    square roots `[..., in, out]`. Norms and Gram matrices do not depend on the layout.

    Kronecker factors keep the library's order, the output-side factor first: `[G, A]` with G
    `[out, out]` and A `[in, in]`, the factors of the weight as stored. With W flattened
    row-major (`weight.flatten()`, entry (i, o) at i·out + o) the curvature block is
    `kron(A, G)` (for `nn.Linear`, whose weight is `[out, in]`, it is `kron(G, A)`); as for
    `nn.Embedding`, `kron(G, A)` is the block of `weight.T`. Recognised by its qualified name,
    so backpack never imports transformers.
    """

    #: `kron_factors` gives the factors of `weight.T` (see the class docstring)
    KRON_TRANSPOSED = frozenset({"weight"})

    def on_class_resolved(self, cls: type) -> None:  # noqa: D102
        SHAPE_ONLY_OUTPUTS.add(cls)  # reads its outputs' shapes only, as Linear's rule
        # its output is a view of `addmm`'s, which no node of the call saves: recording
        # re-wraps it without the copy a view of a saved tensor needs
        PRIVATE_VIEW_OUTPUTS.add(cls)

    def per_sample_grads(self, record, grad_outputs, names, subsampling=None):  # noqa: D102
        x, g = _flat(record, grad_outputs)
        if subsampling is not None:
            index = torch.as_tensor(subsampling, device=x.device)
            x, g = x[index], g[index]
        result = {}
        if "weight" in names:
            result["weight"] = _products(x, g)
        if "bias" in names:
            result["bias"] = g.sum(1)
        return result

    def sum_grad_squared(self, record, grad_outputs, names):  # noqa: D102
        return _transposed(super().sum_grad_squared(record, grad_outputs, names))

    def grad_sum_and_squares(self, record, grad_outputs, names):  # noqa: D102
        result = super().grad_sum_and_squares(record, grad_outputs, names)
        if result is None:
            return None
        return _transposed(result[0]), _transposed(result[1])

    def grad_sum_and_centred_squares(self, record, grad_outputs, names, grad_sums=None):
        """(Σ_n g_n, Σ_n (g_n − ḡ)²) for `Variance`: Linear's with x and d swapped.

        The per-sample products x_n d_nᵀ are `[in, out]`, the stored layout.
        """
        x, g = _flat(record, grad_outputs)
        sums, squares = {}, {}
        if "weight" in names:
            if x.shape[1] == 1:
                given = None if grad_sums is None else grad_sums.get("weight")
                sums["weight"], squares["weight"] = outer_centred_squares(x[:, 0], g[:, 0], given)
            else:
                per_sample = _products(x, g)
                sums["weight"], squares["weight"] = centred_squares(per_sample, overwrite=True)
        if "bias" in names:
            sums["bias"], squares["bias"] = centred_squares(g.sum(1), overwrite=True)
        return sums, squares

    def grad_sum(self, record, grad_outputs, names):  # noqa: D102
        return _transposed(super().grad_sum(record, grad_outputs, names))

    def grad_sum_entries(self, record, grad_outputs, name, index):  # noqa: D102
        if name == "weight":  # stored entry (i, o) is entry (o, i) of Linear's [out, in]
            out = record.module.weight.shape[1]
            index = (index % out) * record.module.weight.shape[0] + index // out
        return super().grad_sum_entries(record, grad_outputs, name, index)

    def sqrt_factor(self, record, factors, names, subsampling=None):  # noqa: D102
        return _transposed(super().sqrt_factor(record, factors, names, subsampling))

    def sqrt_factor_into(self, record, factors, names, subsampling, out):  # noqa: D102
        if _flat_input(record).shape[1] != 1 or subsampling is not None:
            # computed in the stored layout, then copied
            return ModuleRule.sqrt_factor_into(self, record, factors, names, subsampling, out)
        # Linear's in-place products, written into the destinations' `[out, in]` transposes
        swapped = {
            k: v.transpose(-1, -2) if k == "weight" and v is not None else v for k, v in out.items()
        }
        return _transposed(super().sqrt_factor_into(record, factors, names, subsampling, swapped))

    def diag_from_factor(self, record, factors, names, coef, per_sample):  # noqa: D102
        several = next(f for f in factors if f is not None).shape[0] != 1
        if _flat_input(record).shape[1] != 1 and "weight" in names and several:
            # squares of this rule's own square root, already in the stored layout
            return ModuleRule.diag_from_factor(self, record, factors, names, coef, per_sample)
        return _transposed(super().diag_from_factor(record, factors, names, coef, per_sample))

    def diag_from_residual(self, record, index, diag, names, per_sample):  # noqa: D102
        return _transposed(super().diag_from_residual(record, index, diag, names, per_sample))

    def residual_input_diag(self, record: Record, diag: Tensor) -> Tensor:
        """Diagonal of Jᵀ diag(c) J w.r.t. the input: (W∘W) c at every position."""
        w = record.module.weight.detach()
        return (diag @ w.square().T).reshape(record.args[0].shape)

    def kron_factors_dense(self, record, gbar, names):  # noqa: D102
        x = _flat_input(record)
        out = record.module.weight.shape[1]
        t = gbar.shape[0] // out
        g = gbar.reshape(t, out, t, out).diagonal(dim1=0, dim2=2).sum(-1)
        return _kron_result(x, (g + g.T) / 2, names)


def _one_column_diag(
    x: Tensor, f: Tensor, names: Names, coef: Tensor | None, per_sample: bool
) -> dict[str, Tensor]:
    """Diagonals from one factor column `f` `[N, T, out]` over positions: Σ_n (Σ_t f xᵀ)².

    Each sample's product is squared in place: no second `[N, out, in]` buffer, and fewer
    operator calls than squaring the general square root.
    """
    result = {}
    if "weight" in names:
        squares = _products(f, x).square_()
        if coef is not None:
            squares.mul_(coef.reshape(-1, 1, 1))
        result["weight"] = squares if per_sample else squares.sum(0)
    if "bias" in names:
        squares = f.sum(1).square_()
        if coef is not None:
            squares.mul_(coef.unsqueeze(-1))
        result["bias"] = squares if per_sample else squares.sum(0)
    return result


def _transposed(result: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    """Linear's results for `Conv1D`: the weight's last two axes `[out, in]` swapped."""
    if result is None:
        return None
    return {k: v.transpose(-1, -2) if k == "weight" else v for k, v in result.items()}
