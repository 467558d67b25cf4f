"""Brute-force float64 references for every extension, independent of backpack.

`Reference` holds a float64 CPU copy of a model (with backpack's recording hooks removed), the
inputs, targets and loss function, and computes each quantity by its definition with plain
autograd and `torch.func`: per-sample gradients by one backward per sample, curvature diagonals
through forward-mode derivatives at up to `MAX_ENTRIES` entries per parameter, matrix-valued
quantities through products with `NUM_DIRECTIONS` random directions. `CHECKS` turns a stored
quantity into (result, expected) pairs. Both the tour (`python -m backpack`) and
`backpack.verify` use them.

Sample n's term of the loss is defined through the loss function itself: the loss of the batch
output with sample n's rows replaced, all other rows held fixed. This needs no knowledge of the
loss's reduction (means over classes weights, ignored targets, spatial positions all come out
right); it requires the loss to be a sum over samples, which `couples_samples` checks.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap

#: diagonals of curvature matrices are compared at this many entries per parameter at most
MAX_ENTRIES = 32
#: output entries up to which output Jacobians fall back to reverse mode (one pass per entry)
MAX_OUTPUT_ENTRIES = 4096
#: number of random directions for checking matrix-valued quantities through products
NUM_DIRECTIONS = 3
#: relative tolerance (w.r.t. the largest reference entry) per computation dtype
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}
#: entries summing more terms than this get a proportionally larger tolerance: a float32 sum of
#: 43,264 outer products (KFAC's A of a small CNN at batch 64) is off by ~1e-4 even in plain torch
SUMMANDS_PER_RTOL = 4096


class Unchecked(Exception):
    """The reference does not cover this quantity for this model (not a failure)."""


def plain_copy(model: nn.Module) -> nn.Module:
    """A float64 CPU deep copy of `model` without backpack's recording hooks."""
    from backpack.recording import _forward_hook, _save_generator

    clone = copy.deepcopy(model)
    for module in clone.modules():
        for key in [k for k, h in module._forward_hooks.items() if h is _forward_hook]:
            del module._forward_hooks[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)
        for key in [k for k, h in module._forward_pre_hooks.items() if h is _save_generator]:
            del module._forward_pre_hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)
        if "_backpack_extend" in module.__dict__:
            module._backpack_extend = False
    return clone.to(device="cpu", dtype=torch.float64)


def to_reference(x: Any) -> Any:
    """Inputs on the CPU, floating tensors in float64 (indices and other dtypes kept)."""
    if isinstance(x, Tensor):
        x = x.detach().cpu()
        return x.to(torch.float64) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(to_reference(v) for v in x)
    return x


class Reference:
    """Quantities of one problem computed in float64 on the CPU by plain autograd, no backpack.

    Args:
        model: The model (copied, never modified; backpack's hooks are removed on the copy).
        lossfunc: The loss function, called as `lossfunc(output, y)` on the whole batch.
        x: Inputs (a tensor whose first axis, or the model output's first axis, is the batch).
        y: Targets.
        seed: Seed for the choice of entries and of the random directions.

    """

    def __init__(
        self, model: nn.Module, lossfunc: Callable, x: Any, y: Any, seed: int = 0
    ) -> None:
        from backpack.extensions.secondorder import _preload_torch

        _preload_torch(products=True)  # torch's first jvp warns about torch.jit.script otherwise
        self.model = plain_copy(model)
        self.lossfunc = plain_copy(lossfunc) if isinstance(lossfunc, nn.Module) else lossfunc
        self.x = to_reference(x)
        self.y = to_reference(y)
        if isinstance(self.y, Tensor) and self.y.is_floating_point():
            self.y = self.y.to(torch.float64)
        self.seed = seed
        self.params = {k: p.detach() for k, p in self.model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            self.output = self.model(self.x)
        if not isinstance(self.output, Tensor):
            raise Unchecked("the model's output is not a tensor")
        self._cache: dict[tuple, Any] = {}

    def _cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    @property
    def batch_size(self) -> int:
        """Number of samples (the first axis of the model output)."""
        return self.output.shape[0]

    def loss(self, output: Tensor) -> Tensor:
        """The batch loss of a model output."""
        return self.lossfunc(output, self.y)

    def terms(self, output: Tensor) -> Tensor:
        """`[N]`: sample n's term of the loss as a function of `output[n]` (others held fixed).

        Entry n is the loss with sample n's rows of the reference output replaced by those of
        `output`; its derivatives w.r.t. `output[n]` are those of sample n's term.
        """
        base = self.output
        rows = [
            self.loss(torch.cat([base[:n], output[n : n + 1], base[n + 1 :]]))
            for n in range(self.batch_size)
        ]
        return torch.stack(rows)

    def couples_samples(self) -> float:
        """Relative size of the loss Hessian's cross-sample block (0 for a sum over samples).

        One Hessian-vector product with a direction on sample 0's output rows: for a loss that
        is a sum of per-sample terms, the product vanishes on every other sample's rows.
        """

        def compute() -> float:
            if self.batch_size < 2:
                return 0.0
            gen = torch.Generator("cpu").manual_seed(self.seed)
            direction = torch.zeros_like(self.output)
            direction[0] = torch.randn(self.output.shape[1:], generator=gen, dtype=torch.float64)
            out = self.output.clone().requires_grad_(True)
            (gradient,) = torch.autograd.grad(self.loss(out), out, create_graph=True)
            if not gradient.requires_grad:
                return 0.0
            (hv,) = torch.autograd.grad(gradient, out, direction, allow_unused=True)
            if hv is None:
                return 0.0
            own = hv[0].abs().max().item()
            others = hv[1:].abs().max().item()
            return others / own if own > 0 else (0.0 if others == 0 else math.inf)

        return self._cached(("coupling",), compute)

    def per_sample_grads(self) -> dict[str, Tensor]:
        """`{name: [N, *param.shape]}`: one backward per sample through the batch's forward."""

        def compute() -> dict[str, Tensor]:
            named = dict(self.model.named_parameters())
            params = [named[k] for k in self.params]
            terms = self.terms(self.model(self.x))
            rows = []
            for n in range(self.batch_size):
                grads = torch.autograd.grad(
                    terms[n], params, retain_graph=True, allow_unused=True
                )
                rows.append(
                    [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
                )
            return {k: torch.stack([row[i] for row in rows]) for i, k in enumerate(self.params)}

        return self._cached(("psg",), compute)

    # -- curvature -------------------------------------------------------------------------------

    def _forward(self, name: str, value: Tensor) -> Tensor:
        """Model output with parameter `name` replaced by `value` (all others fixed)."""
        return functional_call(self.model, {name: value}, (self.x,))

    def loss_hessians(self) -> Tensor:
        """`[N, D, D]`: Hessian of each sample's loss term w.r.t. that sample's flat output."""

        def compute() -> Tensor:
            shape = self.output.shape[1:]
            base = self.output
            hessians = []
            for n in range(self.batch_size):

                def term(row: Tensor, n: int = n) -> Tensor:
                    out = torch.cat([base[:n], row.reshape(1, *shape), base[n + 1 :]])
                    return self.loss(out)

                row = base[n].flatten()
                try:
                    hessians.append(jacrev(jacrev(term))(row))
                except Exception:  # a loss that torch.func cannot transform: plain autograd
                    hessians.append(torch.autograd.functional.hessian(term, row))
            return torch.stack(hessians)

        return self._cached(("H",), compute)

    def entries(self, name: str) -> Tensor:
        """Flat indices at which the diagonals of parameter `name` are compared (sorted)."""

        def compute() -> Tensor:
            numel = self.params[name].numel()
            if numel <= MAX_ENTRIES:
                return torch.arange(numel, device="cpu")
            gen = torch.Generator("cpu").manual_seed(self.seed + list(self.params).index(name))
            return torch.randperm(numel, generator=gen, device="cpu")[:MAX_ENTRIES].sort().values

        return self._cached(("entries", name), compute)

    def directions(self, name: str) -> Tensor:
        """`[NUM_DIRECTIONS, *param.shape]` random directions, exactly representable in float32."""

        def compute() -> Tensor:
            seed = self.seed + 1000 + list(self.params).index(name)
            gen = torch.Generator("cpu").manual_seed(seed)
            shape = (NUM_DIRECTIONS, *self.params[name].shape)
            return torch.randn(shape, generator=gen, device="cpu").to(torch.float64)

        return self._cached(("dirs", name), compute)

    def _unit_tangents(self, name: str) -> Tensor:
        param = self.params[name]
        index = self.entries(name)
        tangents = param.new_zeros(len(index), param.numel())
        tangents[torch.arange(len(index), device=param.device), index] = 1.0
        return tangents.reshape(len(index), *param.shape)

    def _output_jvps(self, name: str, tangents: Tensor) -> Tensor:
        """`[K, N, D]`: the model output's directional derivatives along each tangent."""

        def one(tangent: Tensor) -> Tensor:
            return jvp(lambda v: self._forward(name, v), (self.params[name],), (tangent,))[1]

        try:
            out = vmap(one)(tangents)
        except Exception:  # a model torch.func cannot batch (in-place ops, ...): one at a time
            out = torch.stack([one(t) for t in tangents])
        return out.reshape(tangents.shape[0], self.batch_size, -1)

    def output_jacobian(self, name: str) -> Tensor:
        """`[K, N, D]`: derivatives of the output entries w.r.t. the entries of `entries(name)`.

        Forward mode, or reverse mode (one vector-Jacobian product per output entry, up to
        `MAX_OUTPUT_ENTRIES`) where an operation has no forward-mode derivative.
        """

        def compute() -> Tensor:
            try:
                return self._output_jvps(name, self._unit_tangents(name))
            except NotImplementedError:
                if self.output.numel() > MAX_OUTPUT_ENTRIES:
                    raise
            _, pullback = vjp(lambda v: self._forward(name, v), self.params[name])
            index = self.entries(name)
            rows = []
            for j in range(self.output.numel()):
                cotangent = torch.zeros_like(self.output).flatten()
                cotangent[j] = 1.0
                rows.append(pullback(cotangent.reshape(self.output.shape))[0].flatten()[index])
            jac = torch.stack(rows, 1)  # [K, N·D]
            return jac.reshape(len(index), self.batch_size, -1)

        return self._cached(("jac", name), compute)

    def diag_ggn_batch(self, name: str) -> Tensor:
        """`[N, K]`: per-sample GGN diagonal `Jₙᵀ Hₙ Jₙ` at the entries of `entries(name)`."""

        def compute() -> Tensor:
            jac = self._output_jvps(name, self._unit_tangents(name))
            return torch.einsum("knd,nde,kne->nk", jac, self.loss_hessians(), jac)

        return self._cached(("dggn", name), compute)

    def diag_hessian_batch(self, name: str) -> Tensor:
        """`[N, K]`: per-sample Hessian diagonal (second directional derivatives, forward mode)."""

        def compute() -> Tensor:
            param = self.params[name]

            def second(tangent: Tensor) -> Tensor:
                def first(v: Tensor) -> Tensor:
                    return jvp(lambda w: self.terms(self._forward(name, w)), (v,), (tangent,))[1]

                return jvp(first, (param,), (tangent,))[1]

            tangents = self._unit_tangents(name)
            return torch.stack([second(t) for t in tangents], dim=1)

        return self._cached(("dh", name), compute)

    def ggn_products(self, name: str) -> Tensor:
        """`[K, *S]`: the GGN block of parameter `name` times each of `directions(name)`."""

        def compute() -> Tensor:
            dirs = self.directions(name)
            jv = self._output_jvps(name, dirs)  # [K, N, D]
            hjv = torch.einsum("nde,kne->knd", self.loss_hessians(), jv)
            _, pullback = vjp(lambda v: self._forward(name, v), self.params[name])
            cotangents = hjv.reshape(len(dirs), *self.output.shape)
            return torch.stack([pullback(c)[0] for c in cotangents])

        return self._cached(("ggnmp", name), compute)

    def hessian_products(self, name: str) -> Tensor:
        """`[K, *S]`: the block of the loss's Hessian for parameter `name` times `directions`."""

        def compute() -> Tensor:
            gradient = grad(lambda v: self.loss(self._forward(name, v)))
            param = self.params[name]
            return torch.stack([jvp(gradient, (param,), (m,))[1] for m in self.directions(name)])

        return self._cached(("hmp", name), compute)

    # -- Kronecker factors ---------------------------------------------------------------------

    def _kron_module(self, module_name: str) -> nn.Module:
        """The module whose Kronecker factors are checked; `Unchecked` where no reference exists."""
        module = self.model.get_submodule(module_name)
        if isinstance(module, nn.modules.conv._ConvTransposeNd):
            raise Unchecked("no reference for the factors of transposed convolutions")
        if isinstance(module, nn.modules.conv._ConvNd):
            if module.groups != 1:
                raise Unchecked("no reference for the factors of grouped convolutions")
        elif not isinstance(module, nn.Linear):
            raise Unchecked(f"no Kronecker reference for {type(module).__name__}")
        if self.calls(module_name) != 1:
            raise Unchecked(f"{module_name} is called {self.calls(module_name)} times")
        return module

    def calls(self, module_name: str) -> int:
        """How often the module is called in one forward pass."""

        def compute() -> int:
            module = self.model.get_submodule(module_name)
            count = [0]
            handle = module.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
            try:
                with torch.no_grad():
                    self.model(self.x)
            finally:
                handle.remove()
            return count[0]

        return self._cached(("calls", module_name), compute)

    def output_ggn(self, module_name: str) -> Tensor:
        """`[C, C]`: KFLR's factor G, the GGN w.r.t. a shift of the module's output channels.

        Convolutions: one shift per channel shared by all positions (the bias's GGN block).
        Linear layers on sequences `[N, *, C]`: an independent shift per position, the GGN
        blocks of all positions summed (the "expand" convention: positions act as samples).
        """

        def compute() -> Tensor:
            module = self._kron_module(module_name)
            per_position = isinstance(module, nn.Linear)
            out_shape = self._module_output_shape(module_name)
            channels = out_shape[-1] if per_position else out_shape[1]
            positions = math.prod(out_shape[1:-1]) if per_position else 1

            def shifted(delta: Tensor) -> Tensor:
                def hook(_: nn.Module, __: Any, out: Tensor) -> Tensor:
                    if per_position:
                        return out + delta.reshape(1, *out.shape[1:])
                    return out + delta.reshape(1, -1, *([1] * (out.dim() - 2)))

                handle = module.register_forward_hook(hook)
                try:
                    return self.model(self.x)
                finally:
                    handle.remove()

            size = positions * channels
            zero = torch.zeros(size, dtype=torch.float64, device="cpu")
            basis = torch.eye(size, dtype=torch.float64, device="cpu")
            jac = vmap(lambda t: jvp(shifted, (zero,), (t,))[1])(basis)  # [P*C, N, D]
            jac = jac.reshape(size, self.batch_size, -1)
            ggn = torch.einsum("cnd,nde,fne->cf", jac, self.loss_hessians(), jac)
            ggn = ggn.reshape(positions, channels, positions, channels)
            return torch.diagonal(ggn, dim1=0, dim2=2).sum(-1)

        return self._cached(("G", module_name), compute)

    def _module_io(self, module_name: str) -> tuple[Tensor, Tensor]:
        module = self.model.get_submodule(module_name)
        captured: list[Tensor] = []

        def hook(_: nn.Module, args: tuple, out: Tensor) -> None:
            captured.extend((args[0], out))

        handle = module.register_forward_hook(hook)
        try:
            with torch.no_grad():
                self.model(self.x)
        finally:
            handle.remove()
        return captured[0], captured[1]

    def _module_output_shape(self, module_name: str) -> tuple[int, ...]:
        return tuple(self._module_io(module_name)[1].shape)

    def input_moment(self, module_name: str) -> Tensor:
        """KFAC's factor A: mean over samples (and sequence positions) of input outer products.

        Linear: the outer products of the input features, averaged over samples and over the
        positions of sequence inputs. Convolutions: of the unfolded input patches, summed over
        output positions and averaged over samples.
        """

        def compute() -> Tensor:
            module = self._kron_module(module_name)
            inputs = self._module_io(module_name)[0]
            if isinstance(module, nn.Linear):
                rows = inputs.reshape(-1, inputs.shape[-1])
                self._cache[("summands", module_name)] = rows.shape[0]
                return rows.T @ rows / rows.shape[0]
            cols = _patches(module, inputs)  # [N, Cin*prod(k), L]
            self._cache[("summands", module_name)] = cols.shape[0] * cols.shape[-1]
            return torch.einsum("nil,njl->ij", cols, cols) / inputs.shape[0]

        return self._cached(("A", module_name), compute)

    def input_summands(self, module_name: str) -> int:
        """Number of outer products summed in `input_moment(module_name)`."""
        self.input_moment(module_name)
        return self._cache[("summands", module_name)]

    def kfra_unchecked(self) -> str | None:
        """Why `kfra_output_factors` cannot cover this model (None: it can), without computing.

        The reference steps through the children of a flat `Sequential` one by one, as
        backpack's KFRA steps through each module call; other models have no KFRA reference.
        """
        if not isinstance(self.model, nn.Sequential):
            return "the KFRA reference needs a Sequential model"
        for index, child in enumerate(self.model):
            if next(child.children(), None) is not None:
                return f"the KFRA reference needs a flat Sequential ({index} has submodules)"
        return None

    def kfra_output_factors(self) -> dict[str, Tensor]:
        """KFRA's factor G of every Linear and convolution layer of a `Sequential`, by recursion.

        Starting from the batch sum of the loss Hessians, each step backward through a child
        averages `Jₙᵀ Ḡ Jₙ` over the samples, with `Jₙ` the child's Jacobian at sample n (a
        dense `[D, D]` matrix over one sample's features). A layer's G is Ḡ at its output, with
        the positions of the output summed out: the diagonal position blocks for Linear layers
        on sequences (positions act as samples), all position pairs for convolutions (one
        shift per channel, as KFLR's G). Other parametrized children (norm layers, grouped or
        transposed convolutions) are steps of the recursion without a factor here.
        """

        def compute() -> dict[str, Tensor]:
            reason = self.kfra_unchecked()
            if reason is not None:
                raise Unchecked(reason)
            inputs, h = [], self.x
            with torch.no_grad():
                for child in self.model:
                    inputs.append(h)
                    h = child(h)
            gbar = self.loss_hessians().sum(0)
            factors: dict[str, Tensor] = {}
            first = min(i for i, c in enumerate(self.model) if any(True for _ in c.parameters()))
            for i in range(len(self.model) - 1, first - 1, -1):
                child = self.model[i]
                if any(True for _ in child.parameters()):
                    try:
                        self._kron_module(str(i))
                    except Unchecked:
                        pass  # its check says why
                    else:
                        factors[str(i)] = _kfra_layer_factor(child, gbar)
                if i == first:
                    break
                gbar = _kfra_step(child, inputs[i], gbar)
            return factors

        return self._cached(("kfra",), compute)


def _kfra_layer_factor(module: nn.Module, gbar: Tensor) -> Tensor:
    """G of a Linear or convolution layer from Ḡ `[D, D]` over one sample's output features."""
    if isinstance(module, nn.Linear):
        channels = module.out_features
        positions = gbar.shape[0] // channels  # output [*, C]: positions first
        blocks = gbar.reshape(positions, channels, positions, channels)
        return torch.diagonal(blocks, dim1=0, dim2=2).sum(-1)
    channels = module.out_channels  # output [C, *spatial]: channels first
    positions = gbar.shape[0] // channels
    return gbar.reshape(channels, positions, channels, positions).sum((1, 3))


def _kfra_step(module: nn.Module, inputs: Tensor, gbar: Tensor) -> Tensor:
    """(1/N) Σₙ Jₙᵀ Ḡ Jₙ for the Jacobian Jₙ of `module` at sample n (flat features)."""
    n = inputs.shape[0]
    flat = inputs.reshape(n, -1)

    def one(row: Tensor) -> Tensor:
        return module(row.reshape(1, *inputs.shape[1:])).reshape(-1)

    def per_sample(fn: Callable[[Tensor], Tensor]) -> Tensor:
        try:
            return vmap(fn)(flat)
        except RuntimeError:  # e.g. norm layers that update running statistics in train mode
            return torch.stack([fn(row) for row in flat])

    if flat.shape[1] == gbar.shape[0]:
        # a diagonal Jacobian (elementwise module): J v = d ∘ v, checked with a random v over
        # the whole batch (which also catches modules that mix the samples)
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn(inputs.shape, dtype=inputs.dtype, generator=gen)
        diag = jvp(module, (inputs,), (torch.ones_like(inputs),))[1].reshape(n, -1)
        along = jvp(module, (inputs,), (probe,))[1].reshape(n, -1)
        if torch.allclose(along, diag * probe.reshape(n, -1), rtol=1e-10, atol=0.0):
            return gbar * (diag.T @ diag) / n
    jac = per_sample(jacrev(one))  # [N, D_out, D_in]
    return torch.einsum("nod,op,npe->de", jac, gbar, jac) / n


def _patches(module: nn.modules.conv._ConvNd, inputs: Tensor) -> Tensor:
    """`[N, Cin * prod(kernel), L]`: the input patches a convolution multiplies by its weight.

    Obtained by convolving with an identity kernel, which orders each patch like the flattened
    weight `[Cin, *kernel]`.
    """
    dims = inputs.dim() - 2
    kernel = module.kernel_size
    cin = inputs.shape[1]
    size = cin * math.prod(kernel)
    eye = torch.eye(size, dtype=inputs.dtype).reshape(size, cin, *kernel)
    padding = module.padding
    if module.padding_mode != "zeros":
        inputs = F.pad(inputs, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        padding = 0
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    out = conv(inputs, eye, None, module.stride, padding, module.dilation)
    return out.reshape(out.shape[0], size, -1)


# ------------------------------------------------------------------------------------------------
# Checks: turn a stored quantity into (result, expected) pairs


@dataclass
class Pair:
    """A computed tensor and what it should equal.

    `mc=True` marks a Monte-Carlo estimate: compared with the exact value only to show how far
    it lies from it, never a failure. `summands` is the number of terms each entry sums (its
    float32 round-off grows with it, and so does the tolerance, see `SUMMANDS_PER_RTOL`).
    `bound=True` marks a one-sided check: `result >= expected` up to the tolerance.
    """

    result: Tensor
    expected: Tensor
    mc: bool = False
    summands: int = 1
    bound: bool = False


class ShapeError(Exception):
    """A quantity has the wrong shape."""


def _expect(value: Any, shape: Sequence[int]) -> Tensor:
    if not isinstance(value, Tensor):
        raise ShapeError(f"expected a tensor of shape {list(shape)}, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ShapeError(f"shape {list(value.shape)}, expected {list(shape)}")
    return value.detach().cpu().to(torch.float64)


def _entries(value: Tensor, index: Tensor, batched: bool = False) -> Tensor:
    return value.flatten(1)[:, index] if batched else value.flatten()[index]


#: a check: (reference, parameter name, stored value, parameter) -> pairs to compare
Check = Callable[[Reference, str, Any, Tensor], list[Pair]]


def first_order_check(reduce: Callable[[Tensor], Tensor]) -> Check:
    """Check of a first-order quantity: `reduce` applied to the per-sample gradients."""

    def check(ref: Reference, name: str, value: Any, param: Tensor) -> list[Pair]:
        expected = reduce(ref.per_sample_grads()[name])
        return [Pair(_expect(value, expected.shape), expected)]

    return check


def diag_ggn_check(batched: bool, mc: bool = False) -> Check:
    """Check of a GGN diagonal (or its per-sample terms) at `MAX_ENTRIES` entries."""

    def check(ref: Reference, name: str, value: Any, param: Tensor) -> list[Pair]:
        n = ref.batch_size
        value = _expect(value, (n, *param.shape) if batched else param.shape)
        expected = ref.diag_ggn_batch(name)
        expected = expected if batched else expected.sum(0)
        return [Pair(_entries(value, ref.entries(name), batched), expected, mc)]

    return check


def diag_hessian_check(batched: bool) -> Check:
    """Check of a Hessian diagonal (or its per-sample terms) at `MAX_ENTRIES` entries."""

    def check(ref: Reference, name: str, value: Any, param: Tensor) -> list[Pair]:
        value = _expect(value, (ref.batch_size, *param.shape) if batched else param.shape)
        expected = ref.diag_hessian_batch(name)
        expected = expected if batched else expected.sum(0)
        return [Pair(_entries(value, ref.entries(name), batched), expected)]

    return check


def sqrt_ggn_check(mc: bool) -> Check:
    """Check of a GGN square root `[V, N, *S]` through its products with random directions."""

    def check(ref: Reference, name: str, value: Any, param: Tensor) -> list[Pair]:
        if not isinstance(value, Tensor) or tuple(value.shape[1:]) != (
            ref.batch_size,
            *param.shape,
        ):
            shape = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ShapeError(f"shape {shape}, expected [V, {ref.batch_size}, *{list(param.shape)}]")
        flat = value.detach().flatten(2)  # [V, N, P]
        if mc:  # the GGN diagonal it implies, against the exact one
            diag = sum(flat[v].double().square().sum(0) for v in range(flat.shape[0]))
            return [Pair(diag.cpu()[ref.entries(name)], ref.diag_ggn_batch(name).sum(0), True)]
        dirs = ref.directions(name).flatten(1)
        products = torch.zeros_like(dirs)
        for v in range(flat.shape[0]):  # one column at a time keeps the float64 copy small
            column = flat[v].cpu().double()  # [N, P]
            products += (column @ dirs.T).T @ column
        return [Pair(products, ref.ggn_products(name).flatten(1))]

    return check


def jacobian_check() -> Check:
    """Check of per-sample output Jacobians `[N, D, *S]` at `MAX_ENTRIES` parameter entries."""

    def check(ref: Reference, name: str, value: Any, param: Tensor) -> list[Pair]:
        shape = (ref.batch_size, ref.output[0].numel(), *param.shape)
        value = _expect(value, shape).flatten(2)[:, :, ref.entries(name)]
        return [Pair(value.permute(2, 0, 1), ref.output_jacobian(name))]

    return check


def products_check(kind: str) -> Check:
    """Check of a product callable (`ggnmp`, `hmp`, `pchmp`) on random directions.

    `kind="pc"` (the positive-curvature Hessian) has no closed-form reference: its quadratic
    form along each direction must lie at or above the GGN's (a one-sided check), and where the
    model has no second derivatives of activations along the directions (Hessian products equal
    GGN products) it must equal them.
    """

    def check(ref: Reference, name: str, value: Any, param: Tensor) -> list[Pair]:
        if not callable(value):
            raise ShapeError(f"expected a callable, got {type(value).__name__}")
        dirs = ref.directions(name)
        result = _expect(value(dirs.to(param)), dirs.shape)
        if kind == "ggn":
            return [Pair(result, ref.ggn_products(name))]
        if kind == "hessian":
            return [Pair(result, ref.hessian_products(name))]
        ggn, hessian = ref.ggn_products(name), ref.hessian_products(name)
        scale = max(ggn.abs().max().item(), 1e-300)
        if (hessian - ggn).abs().max().item() <= 1e-12 * scale:
            return [Pair(result, ggn)]
        quad = (result * dirs).flatten(1).sum(1)
        ggn_quad = (ggn * dirs).flatten(1).sum(1)
        return [Pair(quad, ggn_quad, bound=True)]

    return check


#: layers whose parameters store one dense curvature block instead of Kronecker factors
_DENSE_BLOCK_MODULES: tuple[type, ...] = tuple(
    cls
    for cls in (
        nn.LayerNorm,
        getattr(nn, "RMSNorm", None),
        nn.GroupNorm,
        nn.modules.instancenorm._InstanceNorm,
    )
    if cls is not None
)


def _dense_block_check(
    kind: str, ref: Reference, name: str, value: Any, param: Tensor
) -> list[Pair]:
    """Layers without Kronecker structure (norms) store one dense curvature block `[D, D]`."""
    if not isinstance(value, (list, tuple)) or len(value) != 1:
        raise ShapeError("expected one dense curvature block for a layer without Kronecker factors")
    if kind == "kfra":
        raise Unchecked(f"no KFRA reference for {name}")
    dirs = ref.directions(name)
    block = _expect(value[0], (param.numel(), param.numel()))
    products = (block.to(dirs) @ dirs.flatten(1).T).T.reshape(dirs.shape)
    return [Pair(products, ref.ggn_products(name), mc=kind == "kfac")]


def kron_check(kind: str) -> Check:
    """Check of Kronecker factors: `[G, A]` for weights, `[G]` for biases.

    A is compared exactly; G exactly for KFLR and KFRA, as a Monte-Carlo estimate for KFAC.
    """

    def check(ref: Reference, name: str, value: Any, param: Tensor) -> list[Pair]:
        module_name, _, attr = name.rpartition(".")
        module = ref.model.get_submodule(module_name)
        if isinstance(module, _DENSE_BLOCK_MODULES):
            return _dense_block_check(kind, ref, name, value, param)
        if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            raise Unchecked(f"no Kronecker reference for {type(module).__name__}")
        if ref.calls(module_name) != 1:
            # e.g. MultiheadAttention's out_proj, whose parameters it uses functionally
            raise Unchecked(f"{module_name} is called {ref.calls(module_name)} times")
        is_weight = attr == "weight"
        if not isinstance(value, (list, tuple)) or len(value) != (2 if is_weight else 1):
            raise ShapeError(f"expected a list of {2 if is_weight else 1} Kronecker factors")
        if attr not in ("weight", "bias"):
            raise Unchecked(f"no Kronecker reference for parameter {attr}")
        if kind == "kfra":
            ref._kron_module(module_name)  # raises Unchecked with the reason where it has none
            factors = ref.kfra_output_factors()
            if module_name not in factors:
                raise Unchecked(f"no KFRA reference for {module_name}")
            expected_g = factors[module_name]
        else:
            expected_g = ref.output_ggn(module_name)
        pairs = [Pair(_expect(value[0], expected_g.shape), expected_g, mc=kind == "kfac")]
        if is_weight:
            expected_a = ref.input_moment(module_name)
            summands = ref.input_summands(module_name)
            pairs.append(Pair(_expect(value[1], expected_a.shape), expected_a, False, summands))
        return pairs

    return check


@dataclass(frozen=True)
class ExtensionCheck:
    """How one built-in extension is checked.

    Args:
        name: The extension's class name.
        savefield: Attribute the extension writes on each parameter.
        order: 1 for first-order, 2 for second-order extensions.
        reference: What the check compares with, in a few words.
        check: Turns the stored value of one parameter into pairs to compare.
        mc: Whether the quantity is a Monte-Carlo estimate (shown, never a failure).
        unchecked: Says, before the extension runs, why the reference cannot cover a model
            (None: it may), so that an expensive extension is not computed in vain.

    """

    name: str
    savefield: str
    order: int
    reference: str
    check: Check
    mc: bool = False
    unchecked: Callable[[Reference], str | None] | None = None


_PSG = "per-sample loop"
#: the check of every built-in extension, in the order of the documentation
CHECKS: list[ExtensionCheck] = [
    ExtensionCheck("BatchGrad", "grad_batch", 1, _PSG, first_order_check(lambda g: g)),
    ExtensionCheck(
        "BatchL2Grad",
        "batch_l2",
        1,
        _PSG,
        first_order_check(lambda g: g.flatten(1).square().sum(1)),
    ),
    ExtensionCheck(
        "SumGradSquared",
        "sum_grad_squared",
        1,
        _PSG,
        first_order_check(lambda g: g.square().sum(0)),
    ),
    ExtensionCheck(
        "Variance", "variance", 1, _PSG, first_order_check(lambda g: g.var(0, unbiased=False))
    ),
    ExtensionCheck(
        "BatchDotGrad",
        "batch_dot",
        1,
        _PSG,
        first_order_check(lambda g: g.flatten(1) @ g.flatten(1).T),
    ),
    ExtensionCheck("DiagGGNExact", "diag_ggn_exact", 2, "JᵀHJ (jvp)", diag_ggn_check(False)),
    ExtensionCheck(
        "DiagGGNMC", "diag_ggn_mc", 2, "MC: {dev} off exact", diag_ggn_check(False, True), True
    ),
    ExtensionCheck(
        "BatchDiagGGNExact", "diag_ggn_exact_batch", 2, "JₙᵀHₙJₙ (jvp)", diag_ggn_check(True)
    ),
    ExtensionCheck(
        "BatchDiagGGNMC",
        "diag_ggn_mc_batch",
        2,
        "MC: {dev} off exact",
        diag_ggn_check(True, True),
        True,
    ),
    ExtensionCheck("SqrtGGNExact", "sqrt_ggn_exact", 2, "GGN products", sqrt_ggn_check(False)),
    ExtensionCheck(
        "SqrtGGNMC", "sqrt_ggn_mc", 2, "MC: {dev} off exact", sqrt_ggn_check(True), True
    ),
    ExtensionCheck("BatchJacobian", "jac_batch", 2, "∂fₙ/∂θᵢ (jvp)", jacobian_check()),
    ExtensionCheck("KFAC", "kfac", 2, "E[xxᵀ]; G MC {dev} off", kron_check("kfac"), True),
    ExtensionCheck("KFLR", "kflr", 2, "output GGN, E[xxᵀ]", kron_check("kflr")),
    ExtensionCheck(
        "KFRA",
        "kfra",
        2,
        "recursion, E[xxᵀ]",
        kron_check("kfra"),
        unchecked=Reference.kfra_unchecked,
    ),
    ExtensionCheck(
        "DiagHessian", "diag_h", 2, "∂²ℓ/∂θᵢ² (jvp of jvp)", diag_hessian_check(False)
    ),
    ExtensionCheck(
        "BatchDiagHessian", "diag_h_batch", 2, "∂²ℓₙ/∂θᵢ² (jvp of jvp)", diag_hessian_check(True)
    ),
    ExtensionCheck("GGNMP", "ggnmp", 2, "GGN products", products_check("ggn")),
    ExtensionCheck("HMP", "hmp", 2, "Hessian products", products_check("hessian")),
    ExtensionCheck("PCHMP", "pchmp", 2, "Hessian products¹", products_check("pc")),
]


def compare(pairs: Sequence[Pair], tolerance: float) -> tuple[float | None, float | None, float]:
    """(largest relative error, relative Monte-Carlo deviation, largest error / tolerance).

    The error of an exact pair is `max |result - expected| / max |expected|`; the tolerance
    grows with the number of summands per entry (see `SUMMANDS_PER_RTOL`). Monte-Carlo pairs
    only contribute the deviation. A bound pair's error is how far `result` falls below
    `expected`, relative to `max |expected|`.
    """
    sq_diff = sq_ref = 0.0
    error: float | None = None
    worst = 0.0
    # entries that are zero by definition come out as round-off noise in the reference: measure
    # errors against at least a millionth of the largest reference entry of the quantity
    floor = 1e-6 * max(
        (p.expected.abs().max().item() for p in pairs if not p.mc and p.expected.numel()),
        default=0.0,
    )
    for pair in pairs:
        diff = pair.result.to(torch.float64) - pair.expected
        if pair.mc:
            sq_diff += diff.square().sum().item()
            sq_ref += pair.expected.square().sum().item()
            continue
        diff = (-diff).clamp(min=0) if pair.bound else diff.abs()
        scale = pair.expected.abs().max().item() if pair.expected.numel() else 0.0
        scale = max(scale, floor)
        err = diff.max().item() / (scale if scale > 0 else 1.0) if diff.numel() else 0.0
        if math.isnan(err) or not math.isfinite(pair.result.double().abs().sum().item()):
            err = math.inf
        tol = tolerance * max(1.0, pair.summands / SUMMANDS_PER_RTOL)
        error = err if error is None else max(error, err)
        worst = max(worst, err / tol)
    deviation = math.sqrt(sq_diff / sq_ref) if sq_ref > 0 else None
    return error, deviation, worst


__all__ = [
    "CHECKS",
    "MAX_ENTRIES",
    "NUM_DIRECTIONS",
    "RTOL",
    "SUMMANDS_PER_RTOL",
    "ExtensionCheck",
    "Pair",
    "Reference",
    "ShapeError",
    "Unchecked",
    "compare",
    "plain_copy",
]


def first_sentence(message: Any) -> str:
    """The message's first sentence, followed by its advice (a later clause "use ...") if any."""
    text = " ".join(str(message).split())
    first = text
    for stop in (". ", "; "):
        if stop in first:
            first = first.split(stop)[0]
    first = first.rstrip(".")
    advice = re.search(r"(?:^|[.;] )([Uu]se [^.;]*)", text[len(first) :])
    if advice is None:
        return first
    what = advice.group(1)
    return f"{first}; {what[0].lower()}{what[1:]}"
