"""Data-parallel training on `torch.distributed`: backpack quantities of the global batch.

Every rank runs the same model on its own shard of the global batch (DDP or any other
data-parallel loop). Inside `with backpack(...)`, the engine computes each rank's local
quantities; at the end of the backward pass `PassSync.finish_pass` turns them into quantities of
the global batch, as one process would compute them on the concatenation of all shards with the
same loss reduction:

- the loss's reduction factor R becomes the global one. A rank's `mean` loss divides by its
  local normaliser ν_r (CrossEntropy: the (weighted) number of non-ignored targets; MSE, BCE:
  the number of entries); the global batch divides by N = Σ_r ν_r. Each quantity is rescaled by
  ρ_r = ν_r / N to the power with which it depends on R: 1 for gradients, curvature and
  Kronecker output factors, 2 for squared gradients, 1/2 for square-root factors. `sum`: ρ = 1.
- quantities that sum over samples (`sum_grad_squared`, diagonals, Kronecker factors) are
  all-reduced; `variance` is assembled from every rank's centred sum of squares
  Σ(g − ḡ_r)², Σg and sample count, plus the spread of the ranks' means around the global one
  (a second all-reduce, see `PassSync._between_ranks`); Kronecker input factors (means over
  samples) are weighted by the ranks' sample counts.
- per-sample quantities stay local (this rank's rows), scaled as rows of the global batch.
- matrix products (`ggnmp`, `hmp`, `pchmp`) become `GlobalProduct`s: calling one is a
  collective (every rank must call it, with the same matrix).

Communication goes through torch.distributed only, on a process group of backpack's own
(created once per process, collectively, when the first synchronising context is entered) so
that its collectives never interleave with DDP's. Per backward pass there is one all-reduce
(two with `Variance`): a
small header (every rank's error flag, a signature of what it reduces, its loss normaliser) in
front of a flat buffer per device and dtype holding every summed quantity at the scale of
`reduction="sum"`, divided by the global normaliser afterwards. The buffer has the shape the
ranks agreed on in the previous pass with the same extensions; the first pass (or one whose
quantities changed) sends the header first and the data in a second all-reduce. The header is
an error agreement: a rank whose backward fails inside backpack still sends it, flagged, so the
other ranks raise instead of waiting. A rank that never reaches its backward (an error
elsewhere) makes the others raise after `TIMEOUT_S` seconds, the group's timeout.
"""

from __future__ import annotations

import math
import os
import weakref
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.extensions.secondorder import SecondOrderBackpropExtension
from backpack.passes.state import BackwardState, register_sync_factory
from backpack.recording import Record, describe, trainable_params
from backpack.rules.losses import find_loss_rule, is_loss

#: Seconds a rank waits in backpack's collectives for the other ranks before it raises (the
#: timeout of backpack's process group). Read when the group is created; the environment
#: variable `BACKPACK_SYNC_TIMEOUT` sets the default.
TIMEOUT_S: float = float(os.environ.get("BACKPACK_SYNC_TIMEOUT", "300"))

# how a quantity is made global: (kind, power of the reduction factor it scales with)
_FIRST_ORDER = {
    "grad_batch": ("rows", 1.0),
    "batch_l2": ("rows", 2.0),
    "batch_dot": ("rows", 2.0),
    "sum_grad_squared": ("sum", 2.0),
    "variance": ("variance", 2.0),
}
_SECOND_ORDER = {
    "diag": ("sum", 1.0),
    "batch_diag": ("rows", 1.0),
    "sqrt": ("rows", 0.5),
    "jacobian": ("rows", 0.0),  # Jacobians of the output do not depend on the loss
    "kron": ("kron", 1.0),
    "mp": ("mp", 1.0),
}

#: losses whose `mean` divides by the number of entries of the input
_ELEMENTWISE = (
    nn.MSELoss,
    nn.L1Loss,
    nn.SmoothL1Loss,
    nn.HuberLoss,
    nn.BCELoss,
    nn.BCEWithLogitsLoss,
    nn.SoftMarginLoss,
)


def _kind(ext: BackpropExtension) -> tuple[str, float] | None:
    if isinstance(ext, FirstOrderBackpropExtension):
        return _FIRST_ORDER.get(ext.quantity)
    if isinstance(ext, SecondOrderBackpropExtension):
        return _SECOND_ORDER.get(ext.output)
    return None  # a user-defined extension: its quantities stay as computed (local)


def is_initialized() -> bool:
    """Whether torch.distributed runs with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def make_sync(sync: Any, extensions: Sequence[BackpropExtension]) -> PassSync | None:
    """The synchronisation of one `backpack(...)` context, or None when quantities stay local.

    `sync`: None (default) synchronises when torch.distributed is initialised with more than
    one process; False never; True always (and raises if torch.distributed is not initialised);
    a `DistributedDataParallel` module: like None, but only in backward passes in which that
    module synchronises its gradients (not inside its `no_sync()`).
    """
    follow = None
    if sync is False:
        return None
    if isinstance(sync, nn.parallel.DistributedDataParallel):
        follow, sync = sync, None
    elif sync is not None and sync is not True:
        raise TypeError(
            "backpack(..., sync=...) takes None (synchronise when torch.distributed is "
            "initialised), True, False, or a DistributedDataParallel model (synchronise when "
            f"it synchronises its gradients), got {sync!r}."
        )
    ready = dist.is_available() and dist.is_initialized()
    if sync is True and not ready:
        raise RuntimeError(
            "backpack(..., sync=True) needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first (e.g. run the script with torchrun)."
        )
    if not ready or dist.get_world_size() < 2 or not extensions:
        return None
    for ext in extensions:
        if isinstance(ext, SecondOrderBackpropExtension) and ext.factor == "sum":
            raise NotImplementedError(
                f"{ext.__class__.__name__} cannot be synchronised across ranks: its recursion "
                "averages every layer's Jacobian sandwich over the batch, so the global factors "
                "are not a combination of the ranks' local ones. Use KFLR or KFAC (global "
                "factors under torch.distributed), or backpack(..., sync=False) for this rank's "
                "local factors."
            )
    if _uses_fully_shard():
        raise NotImplementedError(
            "backpack cannot make quantities global for models sharded with FSDP "
            "(torch.distributed.fsdp.fully_shard): their parameters are gathered only during "
            "forward and backward, so backpack's quantities would land on FSDP's temporary "
            "unsharded parameters instead of model.parameters(). For data-set quantities use "
            "backpack.curvature.accumulate(model, lossfunc, data, extensions): it gives every "
            "rank its shard of the gradient, SumGradSquared, Variance and the diagonals "
            "(DiagGGNExact, DiagGGNMC, DiagHessian). For per-batch quantities inside "
            "backpack(...), wrap the model in DistributedDataParallel instead."
        )
    return PassSync(extensions, follow)


def _uses_fully_shard() -> bool:
    """Whether this process has a live module sharded by FSDP2 (`fully_shard`)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # pragma: no cover - older torch
        return False
    for ref in list(_module_state_mapping.values()):
        state = ref() if callable(ref) else ref
        if state is not None and "FSDP" in type(state).__name__:
            return True
    return False


# --- backpack's process group ------------------------------------------------------------------
_GROUP: list[tuple[Any, float, Any]] = []
#: set after a collective failed: the ranks are out of step, later passes refuse to communicate
_BROKEN: list[str] = []


def _group() -> Any:
    """Backpack's own process group (collective on first use: every rank must get here)."""
    world = dist.group.WORLD
    if _GROUP and _GROUP[0][0] is world and _GROUP[0][1] == TIMEOUT_S:
        return _GROUP[0][2]
    group = dist.new_group(timeout=timedelta(seconds=TIMEOUT_S))
    _GROUP[:] = [(world, TIMEOUT_S, group)]
    _BROKEN.clear()
    _LAYOUTS.clear()
    return group


def _forget_group() -> None:
    """Drop backpack's process group (the next synchronising context creates a new one)."""
    _GROUP.clear()
    _BROKEN.clear()
    _LAYOUTS.clear()


def _header_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _communicate(
    what: str, tensors: list[Tensor], group: Any, missing: str = "reach the end of its backward"
) -> None:
    """All-reduce (sum) `tensors` in place on `group`; a failure becomes a clear error."""
    if _BROKEN:
        raise RuntimeError(
            f"backpack cannot {what}: an earlier synchronisation failed ({_BROKEN[0]}), so "
            "the ranks are out of step. Restart the job."
        )
    try:
        works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()
    except Exception as err:
        _BROKEN[:] = [f"{type(err).__name__}: {err}".splitlines()[0][:200]]
        raise RuntimeError(
            f"backpack could not {what} across {dist.get_world_size(group)} ranks within "
            f"{TIMEOUT_S:g} s (backpack.distributed.TIMEOUT_S): a rank did not {missing} "
            "(it raised outside backpack, stopped, or runs different code). Every rank must run "
            "the same backward passes inside backpack(...) and call global matrix products "
            "together."
        ) from err


# --- the loss normaliser -----------------------------------------------------------------------
def loss_normaliser(record: Record) -> float | None:
    """ν of one loss call: `mean` divides by it; None for `reduction="sum"` (no division)."""
    module = record.module
    reduction = getattr(module, "reduction", None)
    if reduction == "sum":
        return None
    args = list(record.args) + list(record.kwargs.values())
    out = args[0] if args else None
    if reduction == "mean" and isinstance(out, Tensor):
        if isinstance(module, (nn.CrossEntropyLoss, nn.NLLLoss)) and len(args) > 1:
            target = args[1]
            if target.dtype.is_floating_point:  # class probabilities: every position counts
                return float(out.numel() // max(out.shape[1], 1)) if out.dim() > 1 else 1.0
            keep = target != module.ignore_index
            if module.weight is None:
                return float(keep.sum())
            classes = out.shape[1] if out.dim() > 1 else out.shape[0]
            weight = module.weight.to(out.dtype)[target.clamp(0, classes - 1)]
            return float((weight * keep).sum())
        if isinstance(module, _ELEMENTWISE) or (
            isinstance(module, nn.KLDivLoss) and reduction == "mean"
        ):
            return float(out.numel())
        rule = find_loss_rule(module)
        if rule is not None:
            factor = rule.reduction_factor(record)
            return 1.0 / factor if factor else 0.0
    if isinstance(module, nn.KLDivLoss) and reduction == "batchmean" and isinstance(out, Tensor):
        return float(out.shape[0]) if out.dim() else 1.0
    raise NotImplementedError(
        f"backpack cannot make quantities of {describe(module)} global across ranks: it "
        f"does not know how reduction={reduction!r} normalises this loss. Use reduction='mean' "
        "or 'sum' with a torch loss (CrossEntropyLoss, NLLLoss, MSELoss, BCEWithLogitsLoss, "
        "...), or backpack(..., sync=False) for this rank's local quantities."
    )


# --- matrix products ---------------------------------------------------------------------------
class GlobalProduct:
    """A curvature matrix product of the global batch: `f(M)` is a collective call.

    Every rank must call it for the same parameters in the same order, with the same `M`
    (backpack does not check that the matrices agree). `local(M)` is this rank's term alone
    (no communication): the products of the ranks' samples, scaled as part of the global batch,
    whose sum over ranks is `f(M)`.
    """

    def __init__(self, product: Callable[[Tensor], Tensor], scale: float, group: Any) -> None:
        self._product = product
        self.scale = scale
        self._group = group

    def __deepcopy__(self, memo: dict) -> GlobalProduct:
        return self  # like a function: copies of a model share it (it holds a process group)

    def local(self, mat: Tensor) -> Tensor:
        """This rank's term of the product (no communication)."""
        result = self._product(mat)
        return result if self.scale == 1.0 else result * self.scale

    def __call__(self, mat: Tensor) -> Tensor:
        """The product with the global batch's curvature (collective: every rank calls it)."""
        with torch.no_grad():
            result = self.local(mat).detach().clone()
            _communicate(
                "multiply by the global curvature", [result], self._group, "call this product"
            )
        return result


# --- one context's synchronisation -------------------------------------------------------------
def _ref(value: Any) -> Any:
    """A reference to an attribute's value that keeps tensors collectable."""
    if value is None:
        return None
    try:
        return weakref.ref(value)
    except TypeError:  # lists of Kronecker factors
        return lambda value=value: value


class _Bucket:
    """Tensors of one device and dtype, flattened into one buffer for one all-reduce."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.parts: list[tuple[Tensor, float]] = []
        self.numel = 0
        self.flat: Tensor | None = None
        #: where the parts start in `flat` (after the header and scalars in the first bucket)
        self.start = 0

    def add(self, tensor: Tensor, scale: float) -> tuple[int, int]:
        start = self.numel
        self.parts.append((tensor, scale))
        self.numel += tensor.numel()
        return start, self.numel

    def fill(self, head: int, scalars: list[float]) -> Tensor:
        """The flat buffer: `head` zeros (the header's place), the scalars, then the parts."""
        self.start = head + len(scalars)
        flat = torch.empty(self.start + self.numel, dtype=self.dtype, device=self.device)
        flat[:head].zero_()
        if scalars:
            flat[head : self.start].copy_(torch.tensor(scalars, dtype=torch.float64))
        offset = self.start
        for tensor, scale in self.parts:
            n = tensor.numel()
            target = flat[offset : offset + n].view(tensor.shape)
            if tensor.dtype == self.dtype:
                torch.mul(tensor, scale, out=target)
            else:
                target.copy_(tensor)
                if scale != 1.0:
                    target.mul_(scale)
            offset += n
        self.flat = flat
        return flat

    def view(self, span: tuple[int, int], shape: torch.Size) -> Tensor:
        return self.flat[self.start + span[0] : self.start + span[1]].view(shape)


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class _Plan:
    """What one rank contributes to a pass's all-reduce, and how it turns into quantities."""

    def __init__(self) -> None:
        self.buckets: dict[tuple[str, str, int], _Bucket] = {}
        self.scalars: list[float] = []
        #: (param, field, kind, value, bucket, spans, power) per quantity
        self.jobs: list[tuple[Any, ...]] = []
        self.losses: list[float | None] = []
        self.signature = 0
        #: this rank's normaliser of the first loss (1 for reduction="sum")
        self.nu = 1.0
        #: position of the per-rank loss normalisers among the scalars (several losses)
        self.check: int | None = None

    def bucket_of(self, t: Tensor) -> _Bucket:
        dtype = _reduce_dtype(t.dtype)
        key = (t.device.type, str(dtype), t.device.index or 0)
        if key not in self.buckets:
            self.buckets[key] = _Bucket(t.device, dtype)
        return self.buckets[key]

    def scalar(self, value: float) -> int:
        self.scalars.append(float(value))
        return len(self.scalars) - 1

    def order(self) -> list[_Bucket]:
        return [self.buckets[k] for k in sorted(self.buckets)]

    def shape(self, head: int) -> tuple[tuple[torch.device, torch.dtype, int], ...]:
        """The buffers of the first all-reduce (header and scalars in the first one)."""
        sizes = [(b.device, b.dtype, b.numel) for b in self.order()]
        if sizes:
            device, dtype, numel = sizes[0]
            sizes[0] = (device, dtype, numel + head + len(self.scalars))
        return tuple(sizes)

    def fill(self, head: int) -> list[Tensor]:
        return [b.fill(head, self.scalars if i == 0 else []) for i, b in enumerate(self.order())]


#: (group, quantities) -> buffers of the last all-reduce every rank agreed on: the next pass
#: sends its header and data in buffers of that shape at once (one collective) when it matches
_LAYOUTS: dict[tuple[int, tuple[str, ...]], tuple[tuple[torch.device, torch.dtype, int], ...]]
_LAYOUTS = {}


class PassSync:
    """Makes the quantities of one `backpack(...)` context global at the end of each pass."""

    def __init__(self, extensions: Sequence[BackpropExtension], follow: Any) -> None:
        self.kinds = [(e.savefield, *k) for e in extensions if (k := _kind(e)) is not None]
        self.fields = [f for f, _, _ in self.kinds]
        self.follow = follow
        #: whether calls must report their sample counts (Kronecker means, variances)
        self.counts = any(kind in ("kron", "variance") for _, kind, _ in self.kinds)
        self.group = _group()
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        #: which agreed buffer shape the passes of this context reuse (see `_LAYOUTS`)
        self.key = (id(self.group), tuple(self.fields))
        self._pass: int | None = None
        self._start(None)

    # --- per pass --------------------------------------------------------------------------
    def _start(self, pass_id: int | None) -> None:
        self._pass = pass_id
        follow = self.follow
        self.active = follow is None or bool(getattr(follow, "require_backward_grad_sync", True))
        self.exchanged = False
        #: id(param) -> [param, {field: reference to the value before the pass}, sample count]
        self.params: dict[int, list[Any]] = {}
        #: loss position -> normaliser (None: reduction="sum")
        self.losses: dict[int, float | None] = {}
        #: (id(param), field) -> (Σ (g − ḡ)², Σ g, number of samples) of a local variance
        self.variances: dict[tuple[int, str], tuple[Tensor, Tensor, int]] = {}

    def _begin(self, state: BackwardState) -> None:
        if self._pass != state.passes:
            self._start(state.passes)

    def on_call(self, state: BackwardState, record: Record) -> None:
        """A module call of the pass: remember its parameters, or a loss's normaliser."""
        self._begin(state)
        if not self.active:
            return
        module = record.module
        if is_loss(module):
            self.losses[state.layout.loss_position(record)] = loss_normaliser(record)
            return
        params = trainable_params(module)
        if not params:
            return
        n = state.batch_size(record) if self.counts else 0
        for p in params.values():
            entry = self.params.get(id(p))
            if entry is None:
                before = {f: _ref(getattr(p, f, None)) for f in self.fields}
                self.params[id(p)] = [p, before, n]
            elif state.layout.several_groups:
                entry[2] += n  # calls on different samples
            else:
                entry[2] = n  # calls on the same samples

    def stash_variance(self, param: Tensor, field: str, m2: Tensor, gsum: Tensor, n: int) -> None:
        """The local sums behind a variance (before scaling): Σ (g − ḡ)², Σ g, sample count."""
        self.variances[(id(param), field)] = (m2, gsum, n)

    def abort_pass(self, state: BackwardState) -> None:
        """This rank's pass failed: tell the other ranks (once), so that they raise too."""
        self._begin(state)
        if not self.active or self.exchanged or _BROKEN:
            return
        try:
            self._first_round(None, [1.0, 0.0, 0.0, 1.0])
        except Exception:  # noqa: BLE001 - the pass's own error is the one to raise
            pass

    def finish_pass(self, state: BackwardState) -> None:
        """All-reduce the pass's quantities and store their global values.

        The first all-reduce carries every rank's header (error flag, signature, loss
        normaliser, whether its data is in this message) in buffers of the shape the ranks
        agreed on in the previous pass with the same quantities; when every rank's data fits
        that shape (the usual case), it is the only one. Otherwise the data follows in a second.
        """
        self._begin(state)
        if not self.active or self.exchanged:
            return
        try:
            plan = self._plan()
        except BaseException:
            self.abort_pass(state)
            raise
        head = 4 * self.world
        cached = _LAYOUTS.get(self.key)
        carries = bool(cached) and cached == plan.shape(head)
        flats, rows = self._first_round(
            plan if carries else None, [0.0, plan.signature, plan.nu, 0.0 if carries else 1.0]
        )
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:
            raise RuntimeError(
                f"backpack: the backward pass failed on rank(s) {failed} (see their error), so "
                "the quantities of this pass could not be made global; this rank's are left "
                "incomplete."
            )
        if len({row[1] for row in rows}) > 1:
            raise RuntimeError(
                "backpack: the ranks computed different quantities in this backward pass "
                "(different models, extensions, loss functions or reductions, or parameters "
                "that got quantities on some ranks only), so they cannot be combined. Every "
                "rank must run the same model and backward; use backpack(..., sync=False) for "
                "local quantities."
            )
        if any(row[3] for row in rows):  # some rank's data is not in the first message
            head = 0
            flats = plan.fill(head) if plan.buckets else []
            if flats:
                _communicate("all-reduce the pass's quantities", flats, self.group)
        _LAYOUTS[self.key] = plan.shape(4 * self.world)
        mean = bool(plan.losses) and plan.losses[0] is not None
        total = sum(row[2] for row in rows) if mean else 1.0
        self._store(plan, flats, head, total)

    # --- the collectives ---------------------------------------------------------------------
    def _first_round(
        self, plan: _Plan | None, header: list[float]
    ) -> tuple[list[Tensor], list[list[float]]]:
        """The header of every rank, in the buffers of the agreed shape (with `plan`'s data)."""
        self.exchanged = True
        head = 4 * self.world
        cached = _LAYOUTS.get(self.key)
        if plan is not None:
            flats = plan.fill(head)
        elif cached:
            flats = [torch.zeros(n, dtype=dtype, device=device) for device, dtype, n in cached]
        else:
            device = _header_device(self.group)
            flats = [torch.zeros(head, dtype=torch.float64, device=device)]
        mine = torch.tensor(header, dtype=torch.float64).to(flats[0].dtype)
        flats[0][4 * self.rank : 4 * self.rank + 4].copy_(mine)
        _communicate("synchronise the backward pass", flats, self.group)
        return flats, flats[0][:head].view(self.world, 4).tolist()

    def _plan(self) -> _Plan:
        """What this rank reduces: fresh quantities of the pass, loss normalisers, signature."""
        plan = _Plan()
        losses = plan.losses = [self.losses[k] for k in sorted(self.losses)]
        entries = []
        for p, before, count in self.params.values():
            for field, kind, power in self.kinds:
                value = getattr(p, field, None)
                old = before[field]
                if value is None or (old is not None and old() is value):
                    continue  # nothing computed in this pass
                entries.append((p, field, kind, power, value, count))
        if entries and not losses:
            raise RuntimeError(
                "backpack needs to know the loss function to make quantities global across "
                "ranks: its reduction ('mean' over how many samples) decides their scale. Use "
                "lossfunc = backpack.extend(torch.nn.CrossEntropyLoss()) (or another torch "
                "loss), or backpack(..., sync=False) for this rank's local quantities."
            )
        signature: list[Any] = [("loss", nu is None) for nu in losses]
        # sums are sent at the scale of reduction="sum" (times ν^power), divided by the global
        # normaliser's power once it is known: the header and the data travel together
        nu = plan.nu = losses[0] if losses and losses[0] is not None else 1.0
        with torch.no_grad():
            for p, field, kind, power, value, count in entries:
                scale = nu**power
                if kind == "sum":
                    value = value.detach()
                    bucket = plan.bucket_of(value)
                    spans: Any = bucket.add(value, scale)
                    signature.append((field, tuple(value.shape), str(value.dtype)))
                elif kind == "variance":
                    m2, gsum, n = self.variances.get((id(p), field), (None, None, count))
                    if m2 is None:
                        if count:
                            raise RuntimeError(
                                f"backpack cannot make the variance of a parameter of shape "
                                f"{tuple(p.shape)} global: its local sums were not recorded "
                                "(computed by a custom module extension?). Use "
                                "backpack(..., sync=False)."
                            )
                        m2 = gsum = torch.zeros_like(value)
                    bucket = plan.bucket_of(value)
                    spans = (
                        bucket.add(m2.detach(), scale),
                        bucket.add(gsum.detach(), nu),
                        plan.scalar(n),
                    )
                    signature.append((field, tuple(value.shape), str(value.dtype)))
                elif kind == "kron":
                    value = [f.detach() for f in value]
                    bucket = plan.bucket_of(value[0])
                    factor_spans = [bucket.add(value[0], scale)]
                    factor_spans += [bucket.add(f, float(count)) for f in value[1:]]
                    spans = (factor_spans, plan.scalar(count))
                    signature.append((field, tuple((tuple(f.shape), str(f.dtype)) for f in value)))
                else:
                    bucket, spans = None, None
                    if kind == "mp":
                        signature.append((field,))
                plan.jobs.append((p, field, kind, value, bucket, spans, power))
            if len(losses) > 1:
                # every rank's normaliser of every loss: their ratios must agree (`_check_ratios`)
                plan.check = len(plan.scalars)
                for j in range(self.world * len(losses)):
                    rank, k = divmod(j, len(losses))
                    mine = 1.0 if losses[k] is None else losses[k]
                    plan.scalars.append(mine if rank == self.rank else 0.0)
                if not plan.buckets:
                    plan.buckets[("", "", 0)] = _Bucket(_header_device(self.group), torch.float64)
        # < 2^24: exact in the float32 header
        plan.signature = float((zlib.crc32(repr(signature).encode()) & 0xFFFFFF) + 1)
        return plan

    def _store(self, plan: _Plan, flats: list[Tensor], head: int, total: float) -> None:
        """Turn the reduced buffers into global quantities; scale the local rows."""
        scalars = flats[0][head : head + len(plan.scalars)].tolist() if plan.scalars else []
        if plan.check is not None:
            self._check_ratios(plan.losses, scalars[plan.check :])
        rho = plan.nu / total if total else 0.0
        if self.world > 1:
            self._between_ranks(plan, scalars)
        with torch.no_grad():
            for p, field, kind, value, bucket, spans, power in plan.jobs:
                if kind in ("sum", "variance", "kron"):
                    result = self._finish(kind, value, bucket, spans, scalars, total, power)
                    setattr(p, field, result)
        scaled: dict[int, Any] = {}  # a tensor stored twice is scaled once
        for p, field, kind, value, _, _, power in plan.jobs:
            if kind == "mp":
                setattr(p, field, GlobalProduct(value, rho**power, self.group))
            elif kind == "rows":
                if id(value) not in scaled:
                    scaled[id(value)] = _scale_rows(value, rho**power)
                setattr(p, field, scaled[id(value)])

    def _between_ranks(self, plan: _Plan, scalars: list[float]) -> None:
        """Add the ranks' spread Σ_r n_r (μ_r − μ)² to each variance's reduced Σ_r M2_r.

        The centred sums M2_r of the ranks add up to the global one only once each rank's mean
        μ_r is moved to the global mean μ, which the first all-reduce has just made known: a
        second all-reduce of n_r (μ_r − μ)² (in the sums' scale of `reduction="sum"`), whose
        terms are nonnegative, where Σ_r ν² Σg_r² − (Σg)²/N would cancel.
        """
        jobs = [job for job in plan.jobs if job[2] == "variance"]
        if not jobs:
            return
        spread = _Plan()
        places = []
        with torch.no_grad():
            for p, field, _, value, bucket, (m2_span, sum_span, count), _ in jobs:
                samples = scalars[count]
                _, gsum, n = self.variances.get((id(p), field), (None, None, 0))
                grand = bucket.view(sum_span, value.shape)
                if gsum is None or not n or not samples:
                    local = torch.zeros_like(grand)
                else:
                    mine = gsum.detach().to(grand.dtype) * (plan.nu / n)
                    local = mine.sub_(grand / samples).square_().mul_(n)
                target = spread.bucket_of(local)
                places.append((bucket, m2_span, value.shape, target, target.add(local, 1.0)))
            flats = spread.fill(0)
            _communicate("all-reduce the spread of the ranks' variances", flats, self.group)
            for bucket, m2_span, shape, target, span in places:
                bucket.view(m2_span, shape).add_(target.view(span, shape))

    def _check_ratios(self, losses: list[float | None], slots: list[float]) -> None:
        """Refuse several losses whose local-to-global reduction ratios differ on some rank."""
        count = len(losses)
        totals = [sum(slots[r * count + k] for r in range(self.world)) for k in range(count)]
        for k in range(1, count):
            for r in range(self.world):
                mine, first = slots[r * count + k], slots[r * count]
                ratio_k = 1.0 if losses[k] is None else (mine / totals[k] if totals[k] else 0.0)
                ratio_0 = 1.0 if losses[0] is None else (first / totals[0] if totals[0] else 0.0)
                if not math.isclose(ratio_k, ratio_0, rel_tol=1e-5, abs_tol=1e-12):
                    raise NotImplementedError(
                        "backpack cannot make the quantities of this backward pass global: "
                        f"it has {count} extended losses whose share of the global batch "
                        f"differs on rank {r} (loss 0: {ratio_0:.6g}, loss {k}: {ratio_k:.6g}; "
                        "e.g. a different number of ignored targets, or 'mean' next to 'sum'), "
                        "so no single rescaling is exact. Use one loss, reduction='sum', or "
                        "backpack(..., sync=False)."
                    )

    def _finish(
        self,
        kind: str,
        value: Any,
        bucket: _Bucket,
        spans: Any,
        scalars: list[float],
        total: float,
        power: float,
    ) -> Any:
        """The global value of one summed quantity, from the reduced buffer.

        Ranks sent sums at the scale of reduction="sum" (times their normaliser to `power`);
        `total` is the global normaliser (1 for "sum").
        """
        divide = total**power if total else 1.0
        if kind == "sum":
            result = bucket.view(spans, value.shape)
            if divide != 1.0:
                result.div_(divide)
            return _as(result, value)
        if kind == "variance":  # Σ_r M2_r plus the ranks' spread (`_between_ranks`)
            m2_span, _, count = spans
            samples = scalars[count]
            m2 = bucket.view(m2_span, value.shape)
            if samples:
                m2.div_(divide * samples)
            else:
                m2.zero_()
            return _as(m2, value)
        factor_spans, count = spans  # "kron": [G (a sum), A... (means over samples)]
        samples = scalars[count]
        first = bucket.view(factor_spans[0], value[0].shape)
        if divide != 1.0:
            first.div_(divide)
        result = [_as(first, value[0])]
        for span, factor in zip(factor_spans[1:], value[1:]):
            mean = bucket.view(span, factor.shape)
            if samples:
                mean.div_(samples)
            result.append(_as(mean, factor))
        return result


def _as(result: Tensor, like: Tensor) -> Tensor:
    return result if result.dtype == like.dtype else result.to(like.dtype)


def _scale_rows(value: Tensor, scale: float) -> Tensor:
    """Per-sample rows, local, scaled as rows of the global batch."""
    if scale == 1.0:
        return value
    if value.requires_grad:
        return value * scale  # keeps its graph (create_graph=True)
    # in place: rules compute fresh tensors (no alias of autograd's gradients), and a copy
    # of large per-sample tensors costs page faults on the CPU
    return value.mul_(scale)


register_sync_factory(make_sync)
