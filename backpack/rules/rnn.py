"""`nn.RNN` (tanh / relu), `nn.LSTM` and `nn.GRU`: per-sample gradients through the recurrence.

In every layer and direction the step t computes the pre-activation
z_t = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh (for LSTM the four stacked gates i, f, g, o), where
x_t is the layer input and h_{t-1} the previous hidden state (the initial state at t = 0).
With δ_t = ∂L/∂z_t of sample n, that sample's gradients are

    W_ih: Σ_t δ_t x_tᵀ,    W_hh: Σ_t δ_t h_{t-1}ᵀ,    b_ih = b_hh: Σ_t δ_t.

The δ_t come from one batched re-run of the recorded call. The input projections
u_t = W_ih x_t + b_ih + b_hh of all steps are computed with one matrix product per layer and
direction and fed to torch's fused recurrence with an identity input weight (so z_t = u_t + W_hh
h_{t-1}, and ∂L/∂u_t = δ_t). One `torch.autograd.grad` of Σ (recomputed outputs · recorded output
gradients) with respect to every u then yields δ for all steps, layers, directions and samples,
and the parameter gradients are einsums over the time axis. The recurrence itself runs in torch's
kernels (cuDNN on GPU), not in a Python loop.

GRU (gates r, z, n) adds its hidden projection inside the reset gate for n:
n_t = tanh(W_in x_t + b_in + r_t ⊙ (W_hn h_{t-1} + b_hn)). So u_t = W_ih x_t + b_ih only, b_hh
stays in the fused recurrence, δ_t = ∂L/∂u_t gives W_ih and b_ih, and the hidden side gets
ε_t = (δ_r, δ_z, r_t ⊙ δ_n): W_hh: Σ_t ε_t h_{t-1}ᵀ, b_hh: Σ_t ε_t, with r_t recomputed from
u_t and h_{t-1}.

Output gradients cover everything the call returned: the sequence output and the final states
h_n (and c_n), so models that read the last hidden state, or pass an initial state, are handled.
Since sequences are independent, V sets of output cotangents (the columns of a second-order
factor) are folded into the batch and served by the same single re-run of V·N sequences.

Kronecker factors (KFAC, KFLR, KFRA) come from the same re-run: every weight is a Linear map
applied at each step, whose input (x_t or h_{t-1}) and backpropagated factor at the step's
pre-activation (δ_t or ε_t) enter the factors as for `nn.Linear` on sequences, steps playing the
role of positions (`RNNRule.kron_factors`).

No fused `batch_l2` / `sum_grad_squared` / `batch_dot`: each would need its own re-run, which
costs more than reducing the `[N, *shape]` per-sample gradients of one re-run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import _VF, Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from backpack.recording import Record, call_params, tensors_in
from backpack.rules.base import GradOutputs, ModuleRule, Names, gram, register_rule

_RECURRENCES: dict[str, Callable[..., Any]] = {
    "LSTM": _VF.lstm,
    "GRU": _VF.gru,
    "RNN_TANH": _VF.rnn_tanh,
    "RNN_RELU": _VF.rnn_relu,
}
#: stacked gates per hidden unit
_GATES = {"LSTM": 4, "GRU": 3}


#: key in `Record.extra` under which the summed gradients of a call are kept for its parameters
_GRAD_SUM_KEY = "rnn_grad_sum"


def _initial_state(record: Record) -> Any:
    """Return the `hx` argument of the recorded call (None for the default zero state)."""
    if len(record.args) > 1:
        return record.args[1]
    return record.kwargs.get("hx")


def _check_supported(record: Record) -> None:
    """Raise a clear error for configurations this rule cannot handle."""
    module = record.module
    name = module.__class__.__name__
    if not record.args:
        raise NotImplementedError(f"{name}: the input was not passed positionally.")
    if isinstance(record.args[0], PackedSequence):
        raise NotImplementedError(
            f"{name} with a PackedSequence input is not supported by backpack's per-sample "
            "rules. Pad the sequences to a tensor (torch.nn.utils.rnn.pad_packed_sequence) "
            "before the module instead."
        )
    if getattr(module, "proj_size", 0) > 0:
        raise NotImplementedError(
            f"{name} with proj_size > 0 (projected hidden states) is not supported by "
            "backpack's per-sample rules."
        )
    if module.mode not in _RECURRENCES:
        raise NotImplementedError(f"{name} with mode {module.mode!r} is not supported.")
    if record.training and module.dropout > 0 and module.num_layers > 1:
        raise NotImplementedError(
            f"{name} applied dropout={module.dropout} between its layers in training mode; "
            "the random masks cannot be recovered for per-sample gradients. Call "
            "model.eval() or use dropout=0."
        )


def _align_columns(record: Record, columns: Sequence[Tensor | None]) -> list[Tensor]:
    """Cotangents `[V, *out.shape]` of (output, h_n[, c_n]) in depth-first order.

    `columns` follows `record.outputs` (the outputs that require grad); missing ones are zeros.
    """
    given = iter(columns)
    v = next((c.shape[0] for c in columns if c is not None), 1)
    result = []
    for needs_grad, out in zip(
        record.out_requires_grad, tensors_in(record.output_structure), strict=True
    ):
        c = next(given, None) if needs_grad else None
        result.append(out.new_zeros(v, *out.shape) if c is None else c)
    return result


def _check_recomputed(module: nn.Module, recomputed: Tensor, recorded: Tensor, what: str) -> None:
    """Sanity check: the re-run must reproduce what the forward pass returned.

    The tolerance only catches real mismatches (changed weights, wrong state): float32 on GPU
    may run with TF32, and a forward under autocast recorded a 16-bit output.
    """
    tol = {torch.float64: 1e-6, torch.float32: 1e-2}.get(recorded.dtype, 5e-2)
    recomputed = recomputed.to(recorded.dtype)
    if not torch.allclose(recomputed, recorded, rtol=tol, atol=tol):
        err = (recomputed - recorded).abs().max().item()
        raise RuntimeError(
            f"Re-running {module.__class__.__name__} ({module}) for per-sample gradients did not "
            f"reproduce its recorded {what} (max abs difference {err:.3g}). Were its parameters "
            "modified in place between the forward and the backward pass?"
        )


def _rerun(
    module: nn.Module,
    x: Tensor,
    hx: Any,
    grads: list[Tensor],
    recorded_h_n: Tensor,
) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """Recompute the recurrence batched over samples and backpropagate to all pre-activations.

    Args:
        module: The `nn.RNN` / `nn.LSTM`.
        x: Time-major input `[T, N, in]`.
        hx: None, the initial hidden state `[L*D, N, H]`, or `(h0, c0)` for LSTM.
        grads: Time-major gradient of the output `[T, N, D*H]`, then of h_n (and c_n).
        recorded_h_n: The recorded final hidden state `[L*D, n, H]`, for the sanity check
            (compared with the first n sequences of the re-run).

    Returns:
        For each parameter suffix ("_l0", "_l0_reverse", ...): δ, the layer input, the
        previous hidden states and ε (the gradient at W_hh h_{t-1} + b_hh: δ but for GRU), all
        time-major `[T, N, *]` in the order in which that direction processes the sequence.

    """
    is_lstm, is_gru = module.mode == "LSTM", module.mode == "GRU"
    recurrence = _RECURRENCES[module.mode]
    layers, dirs = module.num_layers, 2 if module.bidirectional else 1
    hidden, n = module.hidden_size, x.shape[1]
    gates = _GATES.get(module.mode, 1) * hidden
    eye = torch.eye(gates, dtype=x.dtype, device=x.device)
    if hx is None:
        h0 = x.new_zeros(layers * dirs, n, hidden)
        c0 = h0 if is_lstm else None
    elif is_lstm:
        h0, c0 = hx
    else:
        h0, c0 = hx, None

    leaves, finals_h, finals_c = [], [], []
    with torch.enable_grad(), warnings.catch_warnings():
        # cuDNN warns that the weights are not one contiguous chunk; irrelevant for one call
        warnings.filterwarnings("ignore", message=".*contiguous chunk of memory.*")
        layer_in = x
        for k in range(layers):
            outs = []
            for d in range(dirs):
                suffix = f"_l{k}" + ("_reverse" if d else "")
                w_ih = getattr(module, f"weight_ih{suffix}").detach()
                w_hh = getattr(module, f"weight_hh{suffix}").detach()
                bias = b_hh = None
                if module.bias:
                    bias = getattr(module, f"bias_ih{suffix}").detach()
                    b_hh = getattr(module, f"bias_hh{suffix}").detach()
                    if not is_gru:  # both biases add to the pre-activation
                        bias, b_hh = bias + b_hh, None
                seq = layer_in.flip(0) if d else layer_in
                u = nn.functional.linear(seq, w_ih, bias)
                if not u.requires_grad:
                    u.requires_grad_()
                idx = k * dirs + d
                state_h = h0[idx : idx + 1]
                state = (state_h, c0[idx : idx + 1]) if is_lstm else state_h
                weights = [eye, w_hh] if b_hh is None else [eye, w_hh, torch.zeros_like(b_hh), b_hh]
                res = recurrence(
                    u, state, weights, b_hh is not None, 1, 0.0, True, False, False
                )
                out = res[0]
                finals_h.append(res[1])
                if is_lstm:
                    finals_c.append(res[2])
                h_prev = torch.cat([state_h, out[:-1].detach()], 0)
                reset = None
                if is_gru:  # r_t = σ(u_r + W_hr h_{t-1} + b_hr)
                    pre = u[..., :hidden].detach() + h_prev @ w_hh[:hidden].T
                    reset = torch.sigmoid(pre if b_hh is None else pre + b_hh[:hidden])
                leaves.append((suffix, u, seq.detach(), h_prev, reset))
                outs.append(out.flip(0) if d else out)
            layer_in = torch.cat(outs, -1) if dirs > 1 else outs[0]
        recomputed = [layer_in, torch.cat(finals_h, 0)]
        if is_lstm:
            recomputed.append(torch.cat(finals_c, 0))
        # one backward of Σ (recomputed outputs · recorded output gradients) to every u
        grads = [g.to(r.dtype) for g, r in zip(grads, recomputed, strict=True)]
        deltas = torch.autograd.grad(
            recomputed, [leaf[1] for leaf in leaves], grads, allow_unused=True
        )
    # the final states depend on every layer, direction and step: one cheap comparison
    n = recorded_h_n.shape[1]  # the first n sequences of the re-run are the recorded ones
    _check_recomputed(module, recomputed[1][:, :n].detach(), recorded_h_n, "final state h_n")
    result = {}
    for (suffix, u, seq, h_prev, reset), delta in zip(leaves, deltas, strict=True):
        delta = torch.zeros_like(u) if delta is None else delta
        hidden_delta = delta
        if reset is not None:  # GRU: the n gate's hidden projection is scaled by r_t
            gated = reset * delta[..., 2 * hidden :]
            hidden_delta = torch.cat([delta[..., : 2 * hidden], gated], -1)
        result[suffix] = (delta, seq, h_prev, hidden_delta)
    return result


@register_rule(nn.RNN, nn.LSTM, nn.GRU)
class RNNRule(ModuleRule):
    """Per-sample gradients of `nn.RNN` (tanh, relu), `nn.LSTM` and `nn.GRU`.

    Any number of layers, both directions, with or without bias, `batch_first` either way,
    unbatched `[T, in]` inputs and user-provided initial states. Not supported (clear
    `NotImplementedError`): `PackedSequence` inputs, LSTM `proj_size > 0`, and dropout between
    layers in training mode.
    """

    def batch_axis(self, module: nn.Module) -> int:
        """Return the sample axis: 0 with `batch_first=True`, else 1."""
        return 0 if module.batch_first else 1

    def output_batch_axes(self, record: Record) -> list[int]:
        """Sample axis of (output, h_n[, c_n]): like the input for output, 1 for final states."""
        if record.args[0].dim() == 2:
            raise NotImplementedError(
                "Curvature matrix products need batched RNN inputs; got an unbatched [T, in] call."
            )
        axes = [self.batch_axis(record.module)] + [1] * (len(record.outputs) - 1)
        return axes[: len(record.outputs)]

    def batch_size(self, record: Record) -> int:
        """Return the number of sequences in the call (1 for an unbatched `[T, in]` input)."""
        _check_supported(record)
        x = record.args[0]
        if x.dim() == 2:
            return 1
        return x.shape[self.batch_axis(record.module)]

    def per_sample_grads(
        self,
        record: Record,
        grad_outputs: GradOutputs,
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """`[N, *param.shape]` gradients of every requested weight and bias."""
        columns = [None if g is None else g.unsqueeze(0) for g in grad_outputs]
        result = _column_grads(record, columns, names, subsampling)
        return {name: value[0] for name, value in result.items()}

    def sqrt_factor(
        self,
        record: Record,
        factors: Sequence[Tensor | None],
        names: Names,
        subsampling: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """Jᵀ f for all V factor columns `[V, N, *param.shape]` (one re-run of V·N sequences)."""
        return _column_grads(record, factors, names, subsampling)

    def kron_factors(
        self,
        record: Record,
        factors: Sequence[Tensor | None],
        names: Names,
        approx: str = "expand",
    ) -> dict[str, list[Tensor]]:
        """Kronecker factors of every weight: `[G, A]`, and `[G]` for the biases.

        Each weight is a Linear map applied at every step t of every layer and direction:
        W_ih to the layer input x_t, W_hh to the previous hidden state h_{t-1} (the initial
        state at t = 0). The re-run that gives the square roots also gives, for each factor
        column v, sample n and step t, the column backpropagated to that step's
        pre-activation: s = δ_t for W_ih and b_ih, and for W_hh and b_hh the gradient at
        W_hh h_{t-1} + b_hh (δ_t again, except for GRU, whose n gate part is r_t ⊙ δ_n).
        These are exact per-step factors. With a_t the weight's input and T steps:

        - "expand" (steps act as samples, as for Linear on sequences):
          G = Σ_{v,n,t} s sᵀ, A = 1/(N T) Σ_{n,t} a aᵀ;
        - "reduce": G = Σ_{v,n} (Σ_t s)(Σ_t s)ᵀ, A = 1/N Σ_n ā āᵀ with ā = 1/T Σ_t a_t.

        A factor with one sample for a batch of N (KFRA's batch-averaged curvature) is shared
        by every sample, and G averages over them.
        """
        scale = 1.0
        if record.args[0].dim() == 3:
            n = self.batch_size(record)
            shared = []
            for f, axis in zip(factors, self.output_batch_axes(record)):
                if f is not None and n != 1 and f.shape[axis + 1] == 1:
                    f = f.expand(*f.shape[: axis + 1], n, *f.shape[axis + 2 :])
                    scale = 1.0 / n
                shared.append(f)
            factors = shared
        return _column_kron(record, factors, names, approx, scale)

    def grad_sum_entries(
        self, record: Record, grad_outputs: GradOutputs, name: str, index: Tensor
    ) -> Tensor:
        """Entries of this call's gradient; one re-run serves all parameters of the call.

        (No fused `grad_sum`: the engine would call it next to `per_sample_grads`, which already
        holds the sums, and each costs a re-run.)
        """
        cached = record.extra.get(_GRAD_SUM_KEY)
        if cached is None or cached[0] is not grad_outputs:
            names = list(call_params(record))
            columns = [None if g is None else g.unsqueeze(0) for g in grad_outputs]
            sums = _column_grads(record, columns, names, None, summed=True)
            # keeping grad_outputs referenced makes the identity test above reliable
            cached = record.extra[_GRAD_SUM_KEY] = (grad_outputs, sums)
        return cached[1][name].flatten()[index]


def _column_grads(
    record: Record,
    columns: Sequence[Tensor | None],
    names: Names,
    subsampling: Sequence[int] | None,
    summed: bool = False,
) -> dict[str, Tensor]:
    """Per-sample parameter gradients `[V, N', *shape]` for V sets of output cotangents.

    Samples are independent, so the V columns are folded into the batch: one re-run of V·N'
    sequences (N' = len(subsampling) if given) yields all of them. With `summed`, return the
    sums over columns and samples instead (`[*shape]`).
    """
    steps, v, n = _rerun_columns(record, columns, subsampling)
    result = {}
    for suffix, (delta, seq, h_prev, hidden_delta) in steps.items():
        for name, d, other in (
            (f"weight_ih{suffix}", delta, seq),
            (f"weight_hh{suffix}", hidden_delta, h_prev),
        ):
            if name in names:
                result[name] = gram(d, other) if summed else torch.einsum("tbg,tbi->bgi", d, other)
        for name, d in ((f"bias_ih{suffix}", delta), (f"bias_hh{suffix}", hidden_delta)):
            if name in names:
                result[name] = d.sum((0, 1)) if summed else d.sum(0)
    if summed:
        return result
    return {name: value.reshape(v, n, *value.shape[1:]) for name, value in result.items()}


def _column_kron(
    record: Record, columns: Sequence[Tensor | None], names: Names, approx: str, scale: float
) -> dict[str, list[Tensor]]:
    """Kronecker factors from the factor columns at the outputs (see `RNNRule.kron_factors`)."""
    steps, v, n = _rerun_columns(record, columns, None)
    result: dict[str, list[Tensor]] = {}
    for suffix, (delta, seq, h_prev, hidden_delta) in steps.items():
        for side, d, inputs in (("ih", delta, seq), ("hh", hidden_delta, h_prev)):
            weight, bias = f"weight_{side}{suffix}", f"bias_{side}{suffix}"
            if weight not in names and bias not in names:
                continue
            t = d.shape[0]
            reduce = approx == "reduce" and t > 1
            # "reduce": each (column, sample) summed over steps first; "expand": steps act as
            # samples
            g = gram(d.sum(0)) if reduce else gram(d)
            if scale != 1.0:
                g = g * scale
            if weight in names:
                a = inputs[:, :n]  # the V copies of a sequence share their inputs
                result[weight] = [g, gram(a.mean(0)) / n if reduce else gram(a) / (n * t)]
            if bias in names:
                result[bias] = [g]
    return result


def _rerun_columns(
    record: Record, columns: Sequence[Tensor | None], subsampling: Sequence[int] | None
) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor, Tensor]], int, int]:
    """`_rerun` for V sets of output cotangents folded into the batch: (steps, V, N').

    Sequence v·N' + n of the re-run is sample n with cotangent column v.
    """
    _check_supported(record)
    module = record.module
    x = record.args[0]
    hx = _initial_state(record)
    cots = _align_columns(record, columns)
    v = cots[0].shape[0]
    h_n = list(tensors_in(record.output_structure))[1]

    # time-major with an explicit batch axis 1: x, h_n, hx `[T or L*D, N, *]`; cotangents get a
    # leading column axis, `[V, T or L*D, N, *]`
    if x.dim() == 2:
        x, h_n = x.unsqueeze(1), h_n.unsqueeze(1)
        cots = [c.unsqueeze(2) for c in cots]
        if hx is not None:
            hx = tuple(h.unsqueeze(1) for h in hx) if isinstance(hx, tuple) else hx.unsqueeze(1)
    elif module.batch_first:
        x = x.transpose(0, 1)
        cots[0] = cots[0].transpose(1, 2)

    if subsampling is not None:
        # samples are independent: re-run only the requested ones
        index = torch.as_tensor(list(subsampling), dtype=torch.long, device=x.device)
        x, h_n = x.index_select(1, index), h_n.index_select(1, index)
        cots = [c.index_select(2, index) for c in cots]
        if hx is not None:
            hx = (
                tuple(h.index_select(1, index) for h in hx)
                if isinstance(hx, tuple)
                else hx.index_select(1, index)
            )
    n = x.shape[1]

    def fold(c: Tensor) -> Tensor:
        """`[V, A, N, *]` -> `[A, V*N, *]`, sequence v*N + n."""
        return c.transpose(0, 1).reshape(c.shape[1], v * n, *c.shape[3:])

    def repeat(t: Tensor) -> Tensor:
        return t if v == 1 else t.repeat(1, v, *([1] * (t.dim() - 2)))

    grads = [fold(c) for c in cots]
    x = repeat(x)
    if hx is not None:
        hx = tuple(repeat(h) for h in hx) if isinstance(hx, tuple) else repeat(hx)
    return _rerun(module, x, hx, grads, h_n), v, n
