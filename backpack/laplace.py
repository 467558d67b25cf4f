"""Curvature backends for laplace-torch (`pip install laplace-torch --no-deps`, see the docs).

laplace-torch fits a Laplace approximation batch by batch through a *backend*: an object with
`diag`, `kron`, `full`, `jacobians` and `gradients`. The classes here are such backends, built on
this package, selected with `Laplace(..., backend=LaplaceGGN)`:

- `LaplaceGGN`: the generalised Gauss-Newton (exact, or its Monte-Carlo estimate with
  `stochastic=True`): diagonal from `DiagGGNExact`/`DiagGGNMC`, Kronecker factors from the
  data-set layer's `KFAC` operator (type-2 or "mc"), the dense matrix from `SqrtGGNExact`/
  `SqrtGGNMC`, each in one backward pass per batch;
- `LaplaceEF`: the empirical Fisher: per-sample gradients from `BatchGrad`, the diagonal from
  `SumGradSquared`, Kronecker factors of type "empirical";
- both: Jacobians for the GLM predictive from `BatchJacobian` (one backward pass for all output
  entries, instead of one per entry).

Unlike laplace-torch's own BackPACK backend they accept dict-like batches (Hugging Face
`BatchEncoding`), models with frozen parameters (LoRA: only the adapters are trainable) and
Kronecker factors for every trainable parameter backpack has factors for (norm layers,
embeddings, transformers' `Conv1D`, attention). `EKFACLaplace` adds an eigenvalue-corrected KFAC
posterior (`Laplace(..., hessian_structure="ekfac")`), fitted with the data-set layer's `EKFAC`.

laplace-torch is imported by this module only; `import backpack` never needs it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn

from backpack.api import backpack, extend
from backpack.curvature import EKFAC, KFAC
from backpack.curvature._distributed import check_not_fully_sharded
from backpack.curvature._sweep import Sweep
from backpack.extensions import (
    BatchGrad,
    DiagGGNExact,
    DiagGGNMC,
    SqrtGGNExact,
    SqrtGGNMC,
    SumGradSquared,
)
from backpack.jacobian import jacobians as _jacobians

try:
    with warnings.catch_warnings():
        # laplace-torch imports asdfghjkl, which applies `torch.jit.script` at import time and
        # so triggers torch's deprecation notice: nothing a user of this module can change
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", FutureWarning)
        from laplace.baselaplace import ParametricLaplace
        from laplace.curvature import EFInterface, GGNInterface
        from laplace.utils import Kron
except ImportError as error:  # pragma: no cover - exercised only without laplace-torch
    raise ImportError(
        "backpack.laplace needs laplace-torch. Install it without its dependency on the "
        "original BackPACK (whose import name `backpack` would shadow this package): "
        "in this package's checkout, `pip install -e \".[laplace]\"` (its other dependencies), "
        "then `pip install --no-deps laplace-torch==0.3 curvlinops-for-pytorch==3.0.1`; see the "
        "docs page 'Laplace (laplace-torch)'."
    ) from error

__all__ = ["LaplaceGGN", "LaplaceEF", "EKFACLaplace", "HuggingFaceLogits", "laplace_factors"]


def _logits(out: Any) -> Tensor:
    """The logits of a model output: a tensor, a `ModelOutput`'s `.logits`, a tuple's first."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(
        f"backpack.laplace: the model returned {type(out).__name__}; it must return the logits "
        "(a tensor, a Hugging Face ModelOutput with `.logits`, or a tuple starting with them). "
        "Wrap it, e.g. in backpack.laplace.HuggingFaceLogits."
    )


class HuggingFaceLogits(nn.Module):
    """A Hugging Face model as laplace-torch needs it: dict batch in, `[N, C]` logits out.

    Calls `model(**{key: batch[key] for key in keys})` (the keys present in the batch, so the
    labels are not passed and the model computes no loss of its own) and returns `.logits`. For
    logits with a position axis (`[N, T, C]`, a causal language model) it returns those of each
    sequence's last token that the attention mask keeps (`position="last"`) or of a fixed
    `position` (an int).

    Args:
        model: The Hugging Face (or peft) model.
        keys: The batch keys passed to the model.
        position: "last" (default), or the index of the position whose logits are returned.
    """

    def __init__(
        self,
        model: nn.Module,
        keys: tuple[str, ...] = ("input_ids", "attention_mask"),
        position: int | str = "last",
    ) -> None:
        super().__init__()
        self.model = model
        self.keys = tuple(keys)
        self.position = position

    def forward(self, batch: Mapping[str, Any]) -> Tensor:  # noqa: D102
        inputs = {key: batch[key] for key in self.keys if key in batch}
        logits = _logits(self.model(**inputs))
        if logits.dim() != 3:
            return logits
        if self.position != "last":
            return logits[:, int(self.position)]
        mask = inputs.get("attention_mask")
        if mask is None:
            return logits[:, -1]
        last = (mask.long().cumsum(1).argmax(1)).to(logits.device)
        return logits[torch.arange(logits.shape[0], device=logits.device), last]


def _seed() -> int:
    """A seed for the data-set layer's sampled labels, from torch's global generator.

    `torch.manual_seed` then reproduces the draws, as for laplace-torch's own Monte-Carlo.
    """
    return int(torch.randint(0, 2**62, ()).item())


class _Flat(nn.Module):
    """The model with its logits as the loss needs them (`[N·…, C]` for classification)."""

    def __init__(self, model: nn.Module, classification: bool) -> None:
        super().__init__()
        self.model = model
        self.classification = classification

    def forward(self, X: Any) -> Tensor:  # noqa: D102
        f = _logits(self.model(X))
        return f.reshape(-1, f.shape[-1]) if self.classification else f


def laplace_factors(
    param: Tensor, factors: list[Tensor], transposed: bool, name: str = "parameter"
) -> list[Tensor]:
    """One parameter's backpack Kronecker factors in the layout of laplace-torch's `Kron`.

    laplace-torch expects, per parameter in order: one dense `[P, P]` block for a 1-D
    parameter, and for a 2-D to 4-D one `[S_0, S_0]` and `[S_rest, S_rest]` with `S_0` the first
    axis and `S_rest` the product of the others, acting on `param.flatten()` as
    `kron(F_0, F_1)`. backpack gives `[G, A]` (of `param`, or of `param.transpose(0, 1)` for
    embeddings and transformers' `Conv1D`: `transposed`) or one dense `[B]`.

    Raises:
        ValueError: Where laplace-torch's layout cannot hold the factors (a transposed
            convolution's weight; a dense block of a parameter with more than one entry on
            both sides of its first axis; more than 4 axes).
    """
    if param.dim() == 0 or param.dim() > 4:
        raise ValueError(
            f"backpack.laplace: {name} has {param.dim()} axes; laplace-torch's Kron holds 1-D to "
            "4-D parameters only. Use hessian_structure='diag' or 'full'."
        )
    if len(factors) == 2:
        G, A = factors
        if param.dim() == 1:
            return [torch.kron(G, A)]
        if not transposed:
            return [G, A]
        if param.dim() == 2:
            return [A, G]  # kron(A, G) is the block of the weight as stored
        raise ValueError(
            f"backpack.laplace: {name} {tuple(param.shape)} has Kronecker factors of its "
            "transpose(0, 1) (a transposed convolution), which laplace-torch's Kron cannot "
            "hold. Use hessian_structure='diag', 'full' or 'ekfac'."
        )
    (B,) = factors
    if param.dim() == 1:
        return [B]
    first, rest = param.shape[0], param.numel() // param.shape[0]
    one = B.new_ones(1, 1)
    if rest == 1:
        return [B, one]
    if first == 1:
        return [one, B]
    raise ValueError(
        f"backpack.laplace: {name} {tuple(param.shape)} has a dense curvature block (no "
        "Kronecker rule for its layer), which laplace-torch's Kron cannot hold for a parameter "
        "with several entries on both sides of its first axis. Use hessian_structure='diag', "
        "'full' or 'ekfac'."
    )


class _BackpackBackend:
    """What `LaplaceGGN` and `LaplaceEF` share: batches, parameter selection, Jacobians."""

    model: nn.Module
    likelihood: str
    params: list[nn.Parameter]
    lossfunc: Any
    factor: float
    subnetwork_indices: Tensor | None
    last_layer: bool
    dict_key_x: str
    kfac_approx: str
    separate_weight_and_bias: bool

    def _setup(self) -> None:
        classification = self.likelihood != "regression"
        self.lossfunc = extend(self.lossfunc)
        self._flat = extend(_Flat(self.model, classification))

    def _num_samples(self, X: Any) -> int:
        if isinstance(X, Tensor):
            return X.shape[0]
        if isinstance(X, MutableMapping) or isinstance(X, Mapping):
            return X[self.dict_key_x].shape[0]
        raise TypeError(
            f"backpack.laplace: a batch input must be a tensor or a dict-like, got {type(X)}."
        )

    def _target(self, y: Tensor) -> Tensor:
        return y.reshape(-1) if self.likelihood != "regression" else y

    @contextlib.contextmanager
    def _only_selected(self) -> Iterator[None]:
        """Freeze every trainable parameter laplace does not ask for (last-layer Laplace)."""
        chosen = {id(p) for p in self.params}
        frozen = [
            p for p in self.model.parameters() if p.requires_grad and id(p) not in chosen
        ]
        grads = [(p, p.grad) for p in self.params]
        for p in frozen:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in frozen:
                p.requires_grad_(True)
            for p, g in grads:
                p.grad = g

    def _select(self, flat: Tensor) -> Tensor:
        if self.subnetwork_indices is None:
            return flat
        return flat[..., self.subnetwork_indices]

    def _backward(self, X: Any, y: Tensor, extension: Any) -> tuple[Tensor, list[Tensor]]:
        """The summed loss of the batch and each selected parameter's quantity."""
        with self._only_selected(), torch.enable_grad():
            f = self._flat(X)
            loss = self.lossfunc(f, self._target(y))
            with backpack(extension):
                loss.backward()
            values = [p.__dict__.pop(extension.savefield) for p in self.params]
        return loss.detach(), values

    def jacobians(
        self, x: Any, enable_backprop: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Jacobians `Js` `[N, C, P]` and outputs `f` `[N, C]` in one backward (`BatchJacobian`).

        With `enable_backprop=True` (gradients through the Jacobians) laplace-torch's
        `torch.func` Jacobians are used instead.
        """
        if enable_backprop:
            return super().jacobians(x, enable_backprop=True)  # type: ignore[misc]
        with self._only_selected():  # trainable: exactly `self.params`, in their order
            f, J = _jacobians(_Logits(self.model), x, flatten=True)
        if f.dim() == 1:
            f, J = f.unsqueeze(-1), J.unsqueeze(1)
        return self._select(J), f

    def _names(self) -> list[str]:
        chosen = {id(p): None for p in self.params}
        names = []
        for name, p in self.model.named_parameters():
            if id(p) in chosen and chosen[id(p)] is None:
                chosen[id(p)] = name
                names.append(name)
        return names

    def gradients(self, x: Any, y: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample gradients `[N, P]` of the summed loss, and the loss (`BatchGrad`)."""
        loss, values = self._backward(x, y, BatchGrad())
        Gs = torch.cat([v.flatten(1) for v in values], dim=1)
        return self._select(Gs), loss

    def _kfac(
        self, X: Any, y: Tensor, N: int, fisher_type: str, mc_samples: int, approx: str | None
    ) -> Kron:
        """laplace-torch's `Kron` of one batch from the data-set layer's `KFAC` operator.

        `A` (a mean over the batch's samples) is scaled by `M / N` so that laplace-torch's sum
        over the batches averages it over the data set, as its own backends do. `approx`
        overrides `kfac_approx` (laplace-torch passes `asdl_fisher_kwargs` to `kron`).
        """
        if self.subnetwork_indices is not None:
            raise ValueError("backpack.laplace: Kronecker factors of a subnetwork are undefined.")
        if not self.separate_weight_and_bias:
            raise ValueError(
                "backpack.laplace: laplace-torch's Kron holds one block per parameter, so a bias "
                "cannot be folded into its weight's factors there: use "
                "separate_weight_and_bias=True with hessian_structure='kron', or "
                "hessian_structure='ekfac' (which folds them)."
            )
        # the factors of an FSDP2 model stay on their owner ranks; laplace-torch's Kron needs
        # every layer's on every rank
        check_not_fully_sharded(self._flat, "backpack.laplace")
        M = self._num_samples(X)
        seed = _seed() if fisher_type == "mc" else 0
        with self._only_selected():
            op = KFAC(
                self._flat,
                self.lossfunc,
                [(X, self._target(y))],
                fisher_type=fisher_type,
                kfac_approx=approx or self.kfac_approx,
                mc_samples=mc_samples,
                seed=seed,
                num_samples=self._num_samples,
            )
            blocks = {b.name: b for b in op.blocks}
            kfacs = []
            for name, p in zip(self._names(), self.params):
                block = blocks[f"model.{name}"]
                factors = list(block.factors)
                if len(factors) == 2:
                    factors[1] = factors[1] * (M / N)
                kfacs.append(laplace_factors(p, factors, block.transposed, name))
        return Kron(kfacs)

    def _loss(self, X: Any, y: Tensor) -> Tensor:
        with torch.no_grad():
            return self.lossfunc(self._flat(X), self._target(y))


class _Logits(nn.Module):
    """The model with its output reduced to the logits tensor (for `jacobians`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, X: Any) -> Tensor:  # noqa: D102
        return _logits(self.model(X))


class LaplaceGGN(_BackpackBackend, GGNInterface):
    """laplace-torch backend: the GGN (Fisher) from backpack, one backward pass per batch.

    Select it with `Laplace(model, likelihood, backend=LaplaceGGN)`; options through
    `backend_kwargs` (`stochastic`, `num_samples`, `kfac_approx`).

    Args:
        model: The model; it may take a dict-like batch and have frozen parameters.
        likelihood: "classification" or "regression".
        last_layer: Only the last layer's parameters (laplace-torch's last-layer Laplace).
        subnetwork_indices: Entries of the flattened parameters to keep ("diag", "full").
        dict_key_x: The batch key whose first axis counts the samples of a dict batch.
        dict_key_y: The batch key of the targets.
        stochastic: The Monte-Carlo GGN (sampled labels; `DiagGGNMC`, `SqrtGGNMC`, KFAC "mc")
            instead of the exact one.
        num_samples: Sampled labels per sample for `stochastic=True`.
        kfac_approx: "expand" or "reduce", the Kronecker convention for weights shared over
            positions (sequences, convolutions; the published definitions, as curvlinops'); see
            the docs' "Transformers" page.
        separate_weight_and_bias: False folds each layer's bias into its weight's Kronecker
            factors (`KFAC`'s option): for `EKFACLaplace` only, laplace-torch's `Kron`
            (`hessian_structure="kron"`) holds one block per parameter.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        stochastic: bool = False,
        num_samples: int = 1,
        kfac_approx: str = "expand",
        separate_weight_and_bias: bool = True,
    ) -> None:
        GGNInterface.__init__(
            self,
            model,
            likelihood,
            last_layer,
            subnetwork_indices,
            dict_key_x,
            dict_key_y,
            stochastic=stochastic,
            num_samples=num_samples,
        )
        self.kfac_approx = kfac_approx
        self.separate_weight_and_bias = separate_weight_and_bias
        self._setup()

    def diag(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The batch's `factor · loss` and `factor ·` the GGN diagonal (`DiagGGNExact`/`MC`)."""
        ext = DiagGGNMC(mc_samples=self.num_samples) if self.stochastic else DiagGGNExact()
        loss, values = self._backward(x, y, ext)
        diag = torch.cat([v.flatten() for v in values])
        return self.factor * loss, self.factor * self._select(diag)

    def full(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The batch's `factor · loss` and `factor · GGN` `[P, P]` (`SqrtGGNExact`/`SqrtGGNMC`)."""
        ext = SqrtGGNMC(mc_samples=self.num_samples) if self.stochastic else SqrtGGNExact()
        loss, values = self._backward(x, y, ext)
        rows = torch.cat([v.flatten(2) for v in values], dim=2).flatten(0, 1)
        rows = self._select(rows)
        return self.factor * loss, self.factor * (rows.T @ rows)

    def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Kron]:
        """The batch's `factor · loss` and `factor · Kron`: KFAC of type-2 (KFLR) or "mc"."""
        fisher = "mc" if self.stochastic else "type-2"
        kron = self._kfac(x, y, N, fisher, self.num_samples, kwargs.get("kfac_approx"))
        return self.factor * self._loss(x, y), kron * self.factor


class LaplaceEF(_BackpackBackend, EFInterface):
    """laplace-torch backend: the empirical Fisher from backpack, one backward pass per batch.

    Per-sample gradients from `BatchGrad`, the diagonal from `SumGradSquared`, Kronecker
    factors of type "empirical" (the gradients of the samples' own losses backpropagated as one
    column). Arguments as `LaplaceGGN`'s, without the sampling options.
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        last_layer: bool = False,
        subnetwork_indices: torch.LongTensor | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        kfac_approx: str = "expand",
        separate_weight_and_bias: bool = True,
    ) -> None:
        EFInterface.__init__(
            self, model, likelihood, last_layer, subnetwork_indices, dict_key_x, dict_key_y
        )
        self.kfac_approx = kfac_approx
        self.separate_weight_and_bias = separate_weight_and_bias
        self._setup()

    def diag(self, x: Any, y: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """The batch's `factor · loss` and `factor · Σ_n g_n²` (`SumGradSquared`)."""
        loss, values = self._backward(x, y, SumGradSquared())
        diag = torch.cat([v.flatten() for v in values])
        return self.factor * loss, self.factor * self._select(diag)

    def kron(self, x: Any, y: Tensor, N: int, **kwargs: Any) -> tuple[Tensor, Kron]:
        """The batch's `factor · loss` and `factor · Kron` of the empirical Fisher."""
        kron = self._kfac(x, y, N, "empirical", 1, kwargs.get("kfac_approx"))
        return self.factor * self._loss(x, y), kron * self.factor


class _Pairs:
    """A re-iterable view of a laplace-torch loader as `(X, y)` batches on the model's device."""

    def __init__(self, loader: Any, dict_key_y: str, device: torch.device) -> None:
        self.loader, self.dict_key_y, self.device = loader, dict_key_y, device

    def __iter__(self) -> Iterator[tuple[Any, Tensor]]:
        for data in self.loader:
            if isinstance(data, Mapping):
                yield data, data[self.dict_key_y].to(self.device)
            else:
                X, y = data
                yield X.to(self.device), y.to(self.device)


class EKFACLaplace(ParametricLaplace):
    """Laplace approximation with an eigenvalue-corrected KFAC (EK-FAC) curvature.

    `Laplace(model, likelihood, subset_of_weights="all", hessian_structure="ekfac",
    backend=LaplaceGGN)` selects it (laplace-torch finds every `ParametricLaplace` subclass by
    the structure name it declares, once this module is imported). Per parameter the curvature is
    `H_l = Q_l diag(Λ*_l) Q_lᵀ` with KFAC's eigenbasis `Q_l = Q_G ⊗ Q_A` (or a dense factor's)
    and the corrected eigenvalues `Λ*` (the curvature's own diagonal in that basis), fitted by
    the data-set layer's `EKFAC` over the whole loader (two sweeps, exact data-set factors
    rather than laplace-torch's per-batch sums). The posterior precision
    `h H_l + δ_l I` (h = 1/(σ²T), δ_l the prior precision of parameter l) keeps the eigenbasis,
    so its log-determinant, inverse, samples and the GLM predictive's variances are closed forms.

    The backend must be `LaplaceGGN` (type-2, or "mc" with `stochastic=True`) or `LaplaceEF`
    ("empirical"); its `kfac_approx` and `separate_weight_and_bias` (`backend_kwargs`) choose the
    Kronecker convention and whether a layer's bias is folded into its weight's block. The prior
    precision is a scalar or one value per parameter tensor (`prior_structure="layerwise"`;
    with folded biases, equal for a layer's weight and bias); a diagonal prior has no closed
    form in the eigenbasis.
    """

    _key = ("all", "ekfac")

    def __init__(self, model: nn.Module, likelihood: str, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("backend") is None:
            kwargs["backend"] = LaplaceGGN
        super().__init__(model, likelihood, *args, **kwargs)
        if not issubclass(self._backend_cls, (LaplaceGGN, LaplaceEF)):
            raise ValueError(
                "EKFACLaplace needs backend=backpack.laplace.LaplaceGGN or LaplaceEF, got "
                f"{self._backend_cls.__name__}."
            )

    def _init_H(self) -> None:
        self.H: list | None = None

    def _check_H_init(self) -> None:
        if self.H is None:
            raise AttributeError("Laplace not fitted. Run fit() first.")

    def fit(self, train_loader: Any, override: bool = True, progress_bar: bool = False) -> None:
        """Fit EK-FAC over `train_loader` (tensor or dict-like batches) at the model's weights.

        Raises:
            ValueError: For `override=False` (EK-FAC eigenbases of two data sets do not add up).
        """
        if not override:
            raise ValueError("EKFACLaplace.fit refits from scratch: override=False is unsupported.")
        from torch.nn.utils import parameters_to_vector

        backend = self.backend
        self.model.eval()
        self.mean = parameters_to_vector(self.params).detach()
        data = _Pairs(train_loader, self.dict_key_y, self._device)
        with torch.no_grad():
            X, y = next(iter(data))
            out = _logits(self.model(X))
        self.n_outputs = out.shape[-1]
        self.model.output_size = self.n_outputs
        if isinstance(backend, LaplaceEF):
            fisher, mc = "empirical", 1
        else:
            fisher = "mc" if backend.stochastic else "type-2"
            mc = backend.num_samples
        seed = _seed() if fisher == "mc" else 0
        sweep = Sweep(
            backend._flat,
            backend.lossfunc,
            data,
            progress=progress_bar,
            num_samples=backend._num_samples,
            what="EKFACLaplace",
        )
        with backend._only_selected():
            op = EKFAC._from_sweep(
                sweep,
                fisher_type=fisher,
                kfac_approx=backend.kfac_approx,
                mc_samples=mc,
                seed=seed,
                separate_weight_and_bias=backend.separate_weight_and_bias,
            )
        names = backend._names()
        position = {f"model.{name}": i for i, name in enumerate(names)}
        numels = [p.numel() for p in backend.params]
        starts = [sum(numels[:i]) for i in range(len(numels))]
        self.H = []
        #: per block: the indices of its parameters (laplace-torch's order), and of its entries
        self._members: list[list[int]] = []
        self._index: list[Tensor] = []
        for block in sorted(op.blocks, key=lambda b: position[b.name]):
            block.values = block.values * backend.factor
            members = [position[n] for n in block.names]
            self.H.append(block)
            self._members.append(members)
            self._index.append(
                torch.cat([torch.arange(numels[i]) + starts[i] for i in members]).to(self._device)
            )
        self.loss = sum(backend.factor * backend._loss(X, y) for X, y in data)
        self.n_data = len(train_loader.dataset)

    def _deltas(self) -> list[Tensor]:
        """The prior precision of every block (of its parameters, equal for a folded bias)."""
        prior = self.prior_precision
        if len(prior) == 1:
            return [prior[0]] * len(self.H)
        if len(prior) != self.n_layers:
            raise ValueError(
                "EKFACLaplace: the prior precision must be a scalar or one value per parameter "
                "tensor (prior_structure='scalar' or 'layerwise')."
            )
        out = []
        for block, members in zip(self.H, self._members):
            values = prior[members]
            if len(members) > 1 and not bool((values == values[0]).all()):
                raise ValueError(
                    f"EKFACLaplace: {block.name} and its folded bias have different prior "
                    "precisions; with separate_weight_and_bias=False a layer's weight and bias "
                    "need one (the posterior keeps the block's eigenbasis)."
                )
            out.append(values[0])
        return out

    @ParametricLaplace.prior_precision.setter
    def prior_precision(self, prior_precision: float | Tensor) -> None:  # noqa: D102
        super(EKFACLaplace, type(self)).prior_precision.fset(self, prior_precision)
        if len(self.prior_precision) not in (1, self.n_layers):
            raise ValueError("Prior precision for EK-FAC either scalar or per-layer.")

    def _eigenvalues(self) -> list[Tensor]:
        """The posterior precision's eigenvalues `h Λ*_l + δ_l`, per parameter."""
        self._check_H_init()
        h = self._H_factor
        return [h * b.values + d for b, d in zip(self.H, self._deltas())]

    def _split(self, V: Tensor) -> list[Tensor]:
        """`[K, P]` → per block `[K, numel]` (its parameters' entries, weight first)."""
        return [V[:, idx.to(V.device)] for idx in self._index]

    def _rotated(self, V: Tensor) -> list[Tensor]:
        """`Q_lᵀ v` of each row of `V` `[K, P]`, per parameter `[K, *values.shape]`."""
        return [b.rotate(b.to_own(v)) for b, v in zip(self.H, self._split(V))]

    @property
    def posterior_precision(self) -> Tensor:
        """The dense `[P, P]` posterior precision (small models only)."""
        dense = [b.dense(e) for b, e in zip(self.H, self._eigenvalues())]
        size = sum(int(idx.numel()) for idx in self._index)
        out = dense[0].new_zeros(size, size)
        for idx, d in zip(self._index, dense):
            out[idx[:, None], idx[None, :]] = d
        return out

    @property
    def log_det_posterior_precision(self) -> Tensor:  # noqa: D102
        return sum(e.log().sum() for e in self._eigenvalues())

    def square_norm(self, value: Tensor) -> Tensor:  # noqa: D102
        delta = (value - self.mean).reshape(1, -1)
        return sum(
            (w.square() * e).sum() for w, e in zip(self._rotated(delta), self._eigenvalues())
        )

    def functional_variance(self, Js: Tensor) -> Tensor:
        """`J P⁻¹ Jᵀ` per sample: `[B, K, K]` for `Js` `[B, K, P]`."""
        B, K, P = Js.shape
        rows = self._rotated(Js.reshape(B * K, P))
        total = Js.new_zeros(B, K, K)
        for w, e in zip(rows, self._eigenvalues()):
            w = w.reshape(B, K, -1)
            total = total + torch.einsum("bkx,bjx->bkj", w / e.reshape(1, 1, -1), w)
        return total

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """`J P⁻¹ Jᵀ` over all rows: `[B·K, B·K]` for `Js` `[B, K, P]`."""
        B, K, P = Js.shape
        rows = self._rotated(Js.reshape(B * K, P))
        total = Js.new_zeros(B * K, B * K)
        for w, e in zip(rows, self._eigenvalues()):
            w = w.reshape(B * K, -1)
            total = total + (w / e.reshape(1, -1)) @ w.T
        return total

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Draws `θ ~ N(mean, P⁻¹)`, `[n_samples, P]`."""
        draws = self.mean.new_zeros(n_samples, self.mean.numel())
        for b, e, idx in zip(self.H, self._eigenvalues(), self._index):
            z = torch.randn(
                n_samples, *e.shape, device=e.device, dtype=e.dtype, generator=generator
            )
            draws[:, idx] = b.from_own(b.unrotate(z / e.sqrt()))
        return self.mean.reshape(1, -1) + draws
