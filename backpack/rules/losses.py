"""Loss functions: symmetric factorisations of the loss Hessian w.r.t. the model output.

For a loss L = R Σ_n l_n(f_n) (R = 1 for `reduction="sum"`, 1/normaliser for "mean"), a factor
S of shape `[V, N, *f.shape[1:]]` satisfies Σ_v S[v, n] S[v, n]ᵀ = ∇²(R l_n). The exact factor has
one column per output entry; the Monte-Carlo factor has `mc_samples` columns: gradients of the
negative log-likelihood at labels drawn from the model's predictive distribution, divided by
sqrt(mc_samples), whose outer products equal the Hessian in expectation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack.recording import _IS_LOSS_CLASS, LOSS_CLASSES, Record
from backpack.rules.base import gram

_LOSS_RULES: dict[type[nn.Module], LossRule] = {}


def _eye_columns(
    shape: tuple[int, ...], n: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """`[D, N, *shape]` with column d the d-th unit vector (D = prod(shape)) for every sample."""
    d = math.prod(shape)
    eye = torch.eye(d, dtype=dtype, device=device).reshape(d, 1, *shape)
    return eye.expand(d, n, *shape)


def identity_columns(out: Tensor) -> Tensor:
    """`[D, N, *out.shape[1:]]` unit columns at a loss input `out`: where Jacobians start.

    Backpropagated like a Hessian factor, column d becomes, at every sample, the gradient of
    output entry d of that sample (`BatchJacobian`); no loss Hessian enters.
    """
    return _eye_columns(tuple(out.shape[1:]), out.shape[0], out.dtype, out.device)


class LossRule:
    """Hessian factors of one loss type. `record.args = (output, target)`."""

    def check(self, module: nn.Module, extension: str) -> None:
        """Raise for configurations whose Hessian this rule cannot factorise."""

    def reduction_factor(self, record: Record) -> float:
        """R, the factor between the loss and the sum of per-sample terms."""
        raise NotImplementedError

    def sqrt_hessian(self, record: Record, reduced: bool = False) -> Tensor:
        """Exact factor `[V, N, *out]` of the Hessian of R·l_n (R included).

        With `reduced`, the factor may have fewer columns than output entries where the Hessian
        is rank-deficient (its square root as a matrix is then not the original's shape).
        """
        raise NotImplementedError

    def sqrt_hessian_sampled(self, record: Record, mc_samples: int) -> Tensor:
        """Monte-Carlo factor `[mc_samples, N, *out]` (R included)."""
        raise NotImplementedError

    def sum_hessian(self, record: Record) -> Tensor:
        """Σ_n ∇²(R l_n) as a dense `[D, D]` matrix over the flattened per-sample output."""
        s = self.sqrt_hessian(record, reduced=True)
        return gram(s.reshape(s.shape[0], s.shape[1], -1))


def register_loss_rule(*module_classes: type[nn.Module]):  # noqa: ANN201
    """Class decorator registering a loss rule."""

    def decorator(rule_cls: type[LossRule]) -> type[LossRule]:
        for cls in module_classes:
            _LOSS_RULES[cls] = rule_cls()
            LOSS_CLASSES.add(cls)  # calls of these define the samples of a backward
        _IS_LOSS.clear()
        _IS_LOSS_CLASS.clear()
        return rule_cls

    return decorator


#: class -> is_loss answer, cleared whenever a loss rule is registered
_IS_LOSS: dict[type, bool] = {}


def find_loss_rule(module: nn.Module) -> LossRule | None:
    """The loss rule for `module`'s class or a base class."""
    for cls in type(module).__mro__:
        if cls in _LOSS_RULES:
            return _LOSS_RULES[cls]
    return None


def is_loss(module: nn.Module) -> bool:
    """Whether `module` is a loss function (its output ends the graph backpack differentiates)."""
    cls = type(module)
    known = _IS_LOSS.get(cls)
    if known is None:
        known = _IS_LOSS[cls] = issubclass(cls, nn.modules.loss._Loss) or (
            find_loss_rule(module) is not None
        )
    return known


def _check_reduction(module: nn.Module, extension: str) -> None:
    if module.reduction not in ("mean", "sum"):
        raise NotImplementedError(
            f"{extension} needs {module.__class__.__name__} with reduction 'mean' or 'sum', "
            f"got reduction={module.reduction!r}."
        )


@register_loss_rule(nn.MSELoss)
class MSELossRule(LossRule):
    """l_n = ‖f_n − y_n‖²: Hessian 2R·I, Gaussian predictive distribution N(f, I/2)."""

    def check(self, module: nn.Module, extension: str) -> None:  # noqa: D102
        _check_reduction(module, extension)

    def reduction_factor(self, record: Record) -> float:  # noqa: D102
        out = record.args[0]
        return 1.0 if record.module.reduction == "sum" else 1.0 / max(out.numel(), 1)

    def sqrt_hessian(self, record: Record, reduced: bool = False) -> Tensor:  # noqa: D102
        out = record.args[0]
        scale = math.sqrt(2 * self.reduction_factor(record))
        return _eye_columns(tuple(out.shape[1:]), out.shape[0], out.dtype, out.device) * scale

    def sqrt_hessian_sampled(self, record: Record, mc_samples: int) -> Tensor:  # noqa: D102
        out = record.args[0]
        noise = torch.randn(mc_samples, *out.shape, dtype=out.dtype, device=out.device)
        return noise * math.sqrt(2 * self.reduction_factor(record) / mc_samples)


@register_loss_rule(nn.CrossEntropyLoss)
class CrossEntropyLossRule(LossRule):
    """Softmax cross-entropy over axis 1; extra axes `[N, C, d1, ...]` are independent terms.

    Hessian per term: diag(p) − p pᵀ = A Aᵀ with A = diag(√p) − p √pᵀ. Class weights scale a
    sample's term by w[y_n]; label smoothing leaves the Hessian unchanged; ignored targets
    contribute nothing.

    A √p = 0, so the Hessian has rank C − 1 and C − 1 columns suffice: with the reflection
    Q = I − 2 w wᵀ/‖w‖², w = √p + e_k (Q e_k = −√p), A Q e_k = 0 and the other columns of A Q,
    a_j − a_k √p_j / (1 + √p_k), carry the whole Hessian (A Q Qᵀ Aᵀ = A Aᵀ). Every column
    propagated through the network costs a backward pass, so this saves one in C.
    """

    def check(self, module: nn.Module, extension: str) -> None:  # noqa: D102
        _check_reduction(module, extension)

    def _weights(self, record: Record) -> tuple[Tensor, Tensor | float]:
        """Per-term Hessian weights `[N, *d]` and R.

        R is a 0-dim tensor for "mean": its value is not read on the host (a GPU would stall).
        """
        module = record.module
        out, target = record.args[0], record.args[1]
        if target.dtype.is_floating_point:
            raise NotImplementedError(
                "Second-order extensions need class-index targets for CrossEntropyLoss, "
                "got class probabilities."
            )
        keep = target != module.ignore_index
        if module.weight is None:
            # label smoothing mixes terms that all have the Hessian diag(p) - p pᵀ
            weight = keep.to(out.dtype)
            normaliser = weight.sum()
        else:
            class_weight = module.weight.to(out.dtype)
            w_target = class_weight[target.clamp(0, out.shape[1] - 1)] * keep
            eps = module.label_smoothing
            weight = (1 - eps) * w_target + eps * class_weight.mean() * keep
            normaliser = w_target.sum()
        if module.reduction == "sum":
            return weight, 1.0
        # every target ignored (or no sample): no term, no curvature (autograd's gradient is 0)
        r = torch.where(normaliser > 0, normaliser.reciprocal(), torch.zeros_like(normaliser))
        return weight, r

    def reduction_factor(self, record: Record) -> float:  # noqa: D102
        return float(self._weights(record)[1])

    def sqrt_hessian(self, record: Record, reduced: bool = False) -> Tensor:  # noqa: D102
        out = record.args[0]
        weight, r = self._weights(record)
        probs = F.softmax(out, dim=1)  # [N, C, *d]
        sqrt_p = probs.sqrt()
        n, c, spatial = out.shape[0], out.shape[1], tuple(out.shape[2:])
        # A[v, n, c, pos] = √p_v (δ_vc − p_c) at the same position; other positions are zero
        eye = torch.eye(c, dtype=out.dtype, device=out.device)
        shape = (1,) * len(spatial)
        sqrt_p_v = sqrt_p.movedim(1, 0).unsqueeze(2)  # [C(v), N, 1, *d]
        a = sqrt_p_v * (eye.reshape(c, 1, c, *shape) - probs.unsqueeze(0))  # [C(v), N, C, *d]
        if reduced and c > 1:
            # reflect away the null direction √p (k = the last class; 1 + √p_k ≥ 1)
            a = a[:-1] - a[-1:] * (sqrt_p_v[:-1] / (1 + sqrt_p_v[-1:]))
            c_v = c - 1
        else:
            c_v = c
        a = a * (weight * r).sqrt().unsqueeze(0).unsqueeze(2)
        if not spatial:
            return a
        d = math.prod(spatial)
        pos_eye = torch.eye(d, dtype=out.dtype, device=out.device).reshape(d, *spatial)
        # columns (v, position): [V, D, N, C, *d] -> [V*D, N, C, *d]
        full = a.unsqueeze(1) * pos_eye.reshape(1, d, 1, 1, *spatial)
        return full.reshape(c_v * d, n, c, *spatial)

    def sqrt_hessian_sampled(self, record: Record, mc_samples: int) -> Tensor:  # noqa: D102
        out = record.args[0]
        weight, r = self._weights(record)
        probs = F.softmax(out, dim=1)
        c = out.shape[1]
        flat = probs.movedim(1, -1).reshape(-1, c)
        labels = torch.multinomial(flat, mc_samples, replacement=True)  # [N*d, M]
        onehot = F.one_hot(labels.T, c).to(out.dtype)  # [M, N*d, C]
        onehot = onehot.reshape(mc_samples, *probs.movedim(1, -1).shape).movedim(-1, 2)
        grads = probs.unsqueeze(0) - onehot  # gradient of -log softmax at the sampled label
        return grads * ((weight * r).sqrt().unsqueeze(1) / math.sqrt(mc_samples)).unsqueeze(0)


@register_loss_rule(nn.BCEWithLogitsLoss)
class BCEWithLogitsLossRule(LossRule):
    """Elementwise logistic loss: Hessian σ(f)(1 − σ(f)) per entry, Bernoulli predictive."""

    def check(self, module: nn.Module, extension: str) -> None:  # noqa: D102
        _check_reduction(module, extension)
        if module.weight is not None or module.pos_weight is not None:
            raise NotImplementedError(
                f"{extension} does not support BCEWithLogitsLoss with weight or pos_weight."
            )

    def reduction_factor(self, record: Record) -> float:  # noqa: D102
        out = record.args[0]
        return 1.0 if record.module.reduction == "sum" else 1.0 / max(out.numel(), 1)

    def sqrt_hessian(self, record: Record, reduced: bool = False) -> Tensor:  # noqa: D102
        out = record.args[0]
        sig = torch.sigmoid(out)
        diag = (sig * (1 - sig) * self.reduction_factor(record)).sqrt()
        eye = _eye_columns(tuple(out.shape[1:]), out.shape[0], out.dtype, out.device)
        return eye * diag.unsqueeze(0)

    def sqrt_hessian_sampled(self, record: Record, mc_samples: int) -> Tensor:  # noqa: D102
        out = record.args[0]
        sig = torch.sigmoid(out)
        labels = torch.bernoulli(sig.unsqueeze(0).expand(mc_samples, *out.shape))
        return (sig.unsqueeze(0) - labels) * math.sqrt(self.reduction_factor(record) / mc_samples)
