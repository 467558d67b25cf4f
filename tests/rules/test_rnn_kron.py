"""Kronecker factors of RNN/LSTM/GRU weights against a brute-force definition.

Every weight is a Linear map applied at each step t: W_ih to the layer input x_t, W_hh to the
previous hidden state h_{t-1}. The reference re-implements the recurrence step by step in
Python with a zero perturbation e_t added to each step's input-side pre-activation
(W_ih x_t + b_ih) and another to its hidden-side one (W_hh h_{t-1} + b_hh), so that
J_nt = ∂(model output of sample n)/∂e_nt is the Jacobian with respect to that step's
pre-activation. With H_n the loss Hessian w.r.t. sample n's output and a_t the weight's input:

- expand: G = Σ_n Σ_t J_ntᵀ H_n J_nt,          A = 1/(N T) Σ_{n,t} a_nt a_ntᵀ;
- reduce: G = Σ_n (Σ_t J_nt)ᵀ H_n (Σ_t J_nt),   A = 1/N Σ_n ā_n ā_nᵀ, ā_n = 1/T Σ_t a_nt.

Biases get [G] of their side. KFLR's factors must equal these (float64).
"""

import pytest
import torch
from problems import per_sample_losses
from torch import nn
from torch.func import jacrev

from backpack import backpack, extend
from backpack.extensions import KFAC, KFLR

DT = torch.float64


def close(a, b, msg=""):
    torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10, msg=msg)


def _suffixes(rnn):
    dirs = 2 if rnn.bidirectional else 1
    return [
        (k, d, f"_l{k}" + ("_reverse" if d else ""))
        for k in range(rnn.num_layers)
        for d in range(dirs)
    ]


def manual_rnn(rnn, x, perturb, record=None):
    """The batch-first recurrence of `rnn` step by step, with perturbations of pre-activations.

    `perturb[suffix]` is (e_in, e_h), each `[N, T, gates]`; `record[suffix]` receives the
    inputs of W_ih and W_hh (`[N, T, in]`, `[N, T, H]`).
    """
    n, t_len = x.shape[:2]
    hidden = rnn.hidden_size
    layer_in = x
    for k in range(rnn.num_layers):
        outs = []
        for _, d, sfx in [s for s in _suffixes(rnn) if s[0] == k]:
            w_ih, w_hh = getattr(rnn, f"weight_ih{sfx}"), getattr(rnn, f"weight_hh{sfx}")
            if rnn.bias:
                b_ih, b_hh = getattr(rnn, f"bias_ih{sfx}"), getattr(rnn, f"bias_hh{sfx}")
            else:
                b_ih = b_hh = torch.zeros(w_ih.shape[0], dtype=x.dtype)
            e_in, e_h = perturb[sfx]
            seq = layer_in.flip(1) if d else layer_in
            h = torch.zeros(n, hidden, dtype=x.dtype)
            c = torch.zeros(n, hidden, dtype=x.dtype)
            hs, prevs = [], []
            for t in range(t_len):
                prevs.append(h)
                gi = seq[:, t] @ w_ih.T + b_ih + e_in[:, t]
                gh = h @ w_hh.T + b_hh + e_h[:, t]
                if rnn.mode == "RNN_TANH":
                    h = torch.tanh(gi + gh)
                elif rnn.mode == "LSTM":
                    i, f, g, o = (gi + gh).chunk(4, 1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                else:  # GRU
                    ir, iz, in_ = gi.chunk(3, 1)
                    hr, hz, hn = gh.chunk(3, 1)
                    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
                    h = (1 - z) * torch.tanh(in_ + r * hn) + z * h
                hs.append(h)
            if record is not None:
                record[sfx] = (seq.detach(), torch.stack(prevs, 1).detach())
            out = torch.stack(hs, 1)
            outs.append(out.flip(1) if d else out)
        layer_in = torch.cat(outs, -1)
    return layer_in


class Net(nn.Module):
    def __init__(self, rnn, t_len, classes=3):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(t_len * rnn.hidden_size * (2 if rnn.bidirectional else 1), classes)

    def forward(self, x):
        return self.head(self.rnn(x)[0].flatten(1))


def reference(model, x, lossfunc, y, approx):
    rnn = model.rnn
    n, t_len = x.shape[:2]
    gates = {"RNN_TANH": 1, "LSTM": 4, "GRU": 3}[rnn.mode] * rnn.hidden_size
    sfxs = [s for _, _, s in _suffixes(rnn)]
    zeros = {s: (torch.zeros(n, t_len, gates, dtype=DT),) * 2 for s in sfxs}
    inputs = {}
    with torch.no_grad():
        out = model.head(manual_rnn(rnn, x, zeros, inputs).flatten(1))
        torch.testing.assert_close(out, model(x))  # the re-implementation is the module

    def output(flat):
        perturb = {s: (flat[i][0], flat[i][1]) for i, s in enumerate(sfxs)}
        return model.head(manual_rnn(rnn, x, perturb).flatten(1))

    leaves = [torch.stack(zeros[s]) for s in sfxs]  # [2, N, T, G] per suffix
    jac = jacrev(output)(leaves)  # per suffix [N, C, 2, N, T, G]
    out = out.detach()
    hess = jacrev(jacrev(lambda o: per_sample_losses(lossfunc, o, y).sum()))(out)
    blocks = torch.stack([hess[i, :, i, :] for i in range(n)])  # [N, C, C]
    result = {}
    for i, sfx in enumerate(sfxs):
        j = torch.stack([jac[i][m, :, :, m] for m in range(n)])  # [N, C, 2, T, G]
        for side, s_idx, a in (("ih", 0, inputs[sfx][0]), ("hh", 1, inputs[sfx][1])):
            js = j[:, :, s_idx]  # [N, C, T, G]
            if approx == "reduce":
                js = js.sum(2, keepdim=True)
                mean = a.mean(1)
                a_factor = mean.T @ mean / n
            else:
                rows = a.reshape(-1, a.shape[-1])
                a_factor = rows.T @ rows / rows.shape[0]
            g = torch.einsum("nctg,ncd,ndth->gh", js, blocks, js)
            result[f"weight_{side}{sfx}"] = [g, a_factor]
            result[f"bias_{side}{sfx}"] = [g]
    return result


CASES = {
    "rnn-tanh": lambda: nn.RNN(3, 4, batch_first=True),
    "lstm": lambda: nn.LSTM(3, 2, batch_first=True),
    "gru": lambda: nn.GRU(3, 2, batch_first=True),
    "lstm-2layer-bidir-nobias": lambda: nn.LSTM(
        2, 2, num_layers=2, bidirectional=True, batch_first=True, bias=False
    ),
    "gru-2layer-bidir": lambda: nn.GRU(2, 2, num_layers=2, bidirectional=True, batch_first=True),
}


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", list(CASES))
def test_kflr_of_recurrent_weights_matches_brute_force(case, reduction, approx):
    torch.manual_seed(0)
    rnn = CASES[case]()
    t_len = 3
    model = Net(rnn, t_len).to(DT)
    x = torch.randn(4, t_len, rnn.input_size, dtype=DT)
    if reduction == "mean":
        lossfunc, y = nn.CrossEntropyLoss(), torch.randint(0, 3, (4,))
    else:
        lossfunc, y = nn.MSELoss(reduction="sum"), torch.randn(4, 3, dtype=DT)
    expected = reference(model, x, lossfunc, y, approx)
    extend(model)
    extend(lossfunc)
    with backpack(KFLR(kfac_approx=approx), KFAC(mc_samples=2, kfac_approx=approx)):
        lossfunc(model(x), y).backward()
    for name, p in model.rnn.named_parameters():
        assert len(p.kflr) == len(expected[name]) == len(p.kfac), name
        for actual, exp in zip(p.kflr, expected[name]):
            close(actual, exp, f"{case} {name}")
        if len(p.kfac) == 2:  # A does not depend on the loss
            close(p.kfac[1], p.kflr[1], name)
        close(p.kfac[0], p.kfac[0].T, name)


def test_time_major_gives_the_factors_of_batch_first():
    torch.manual_seed(0)
    first = nn.GRU(3, 2, batch_first=True).to(DT)
    major = nn.GRU(3, 2).to(DT)
    major.load_state_dict(first.state_dict())
    x, y = torch.randn(4, 3, 3, dtype=DT), torch.randint(0, 3, (4,))
    head = nn.Linear(6, 3).to(DT)
    results = []
    for rnn, inputs in ((first, x), (major, x.transpose(0, 1))):
        model = extend(nn.ModuleDict({"rnn": rnn, "head": head}))
        lossfunc = extend(nn.CrossEntropyLoss())
        out = model["rnn"](inputs)[0]
        out = out if rnn.batch_first else out.transpose(0, 1)
        with backpack(KFLR()):
            lossfunc(model["head"](out.flatten(1)), y).backward()
        results.append({k: [f.clone() for f in p.kflr] for k, p in rnn.named_parameters()})
    for name in results[0]:
        for a, b in zip(results[0][name], results[1][name]):
            close(a, b, name)


def test_a_factor_of_one_sample_is_shared_by_the_batch():
    """KFRA's batch-averaged curvature: one factor for all N samples; G averages over them."""
    from backpack.recording import Record
    from backpack.rules import find_rule

    torch.manual_seed(0)
    rnn = nn.LSTM(3, 2, batch_first=True).to(DT)
    x = torch.randn(4, 3, 3, dtype=DT)
    out, (h_n, c_n) = rnn(x)
    outs = tuple(t.detach() for t in (out, h_n, c_n))
    record = Record(rnn, (x,), {}, outs, (outs[0], (outs[1], outs[2])))
    record.out_requires_grad = (True, True, True)
    rule = find_rule(rnn)
    names = [n for n, _ in rnn.named_parameters()]
    one = torch.randn(2, 1, 3, 2, dtype=DT)  # [V, 1, T, H] at the sequence output
    shared = rule.kron_factors(record, [one, None, None], names)
    full = rule.kron_factors(record, [one.expand(2, 4, 3, 2), None, None], names)
    for name in names:
        close(shared[name][0], full[name][0] / 4, name)
        for a, b in zip(shared[name][1:], full[name][1:]):
            close(a, b, name)
