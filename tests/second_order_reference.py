"""Brute-force curvature references: GGN and Hessian blocks from torch.func in float64."""

from __future__ import annotations

import torch
from problems import per_sample_losses
from torch.func import functional_call, jacrev


def _flatten_params(model):
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    shapes = [params[k].shape for k in names]
    flat = torch.cat([params[k].detach().flatten() for k in names])

    def unflatten(vec):
        out, i = {}, 0
        for k, s in zip(names, shapes):
            out[k] = vec[i : i + s.numel()].reshape(s)
            i += s.numel()
        return out

    return names, shapes, flat, unflatten


class Curvature:
    """GGN and Hessian (full and per-sample) of a problem, split into parameter blocks."""

    # cuDNN's RNN kernels support neither torch.func transforms nor backward in eval mode
    @torch.backends.cudnn.flags(enabled=False)
    def __init__(self, model, x, lossfunc, y, hessian: bool = True, per_sample: bool = True):
        self.names, self.shapes, flat, unflatten = _flatten_params(model)

        def f(vec):  # a fresh input: a model may modify its input in place
            inputs = x.clone() if isinstance(x, torch.Tensor) else x
            return functional_call(model, unflatten(vec), (inputs,))

        out = f(flat).detach()
        n = out.shape[0]
        jac = jacrev(f)(flat).reshape(n, -1, flat.numel())  # [N, D, P]

        def terms(o):
            return per_sample_losses(lossfunc, o.reshape(out.shape), y)

        # Hessian of each sample's term w.r.t. that sample's output: [N, D, D]
        hess_out = jacrev(jacrev(lambda o: terms(o).sum()))(out.flatten())
        d = jac.shape[1]
        hess_out = hess_out.reshape(n, d, n, d)
        blocks = torch.stack([hess_out[i, :, i, :] for i in range(n)])
        self.ggn_per_sample = torch.einsum("ndp,nde,neq->npq", jac, blocks, jac)
        self.ggn = self.ggn_per_sample.sum(0)
        if hessian:
            self.hessian = jacrev(jacrev(lambda v: lossfunc(f(v), y)))(flat)
            if per_sample:
                self.hessian_per_sample = torch.stack(
                    [jacrev(jacrev(lambda v, i=i: terms(f(v))[i]))(flat) for i in range(n)]
                )
        self._offsets = {}
        i = 0
        for k, s in zip(self.names, self.shapes):
            self._offsets[k] = (i, i + s.numel(), s)
            i += s.numel()

    def block(self, mat, name):
        start, stop, _ = self._offsets[name]
        return mat[..., start:stop, start:stop]

    def diag(self, mat, name):
        start, stop, shape = self._offsets[name]
        return mat.diagonal(dim1=-2, dim2=-1)[..., start:stop].reshape(*mat.shape[:-2], *shape)


class SampleCurvature:
    """Per-sample gradients, GGN and Hessian of a backward with any number of losses/forwards.

    `outputs(call)` runs the model (through `call`, a functional version of it) and returns the
    tensors the losses take; `terms(outputs)` returns the backward's per-sample terms `[N]`
    (weights and reduction factors included) whose sum is the differentiated loss. The GGN of
    sample n is Σ_outputs Jᵀ (∇² term_n w.r.t. that output) J, its definition.
    """

    @torch.backends.cudnn.flags(enabled=False)
    def __init__(self, model, outputs, terms):
        self.names, self.shapes, flat, unflatten = _flatten_params(model)

        def f(vec):
            return outputs(lambda *a, **k: functional_call(model, unflatten(vec), a, k))

        outs = tuple(o.detach() for o in f(flat))
        jacs = [
            jacrev(lambda v, i=i: f(v)[i])(flat).reshape(-1, flat.numel())
            for i in range(len(outs))
        ]
        n_total = terms(outs).shape[0]
        per_sample = []
        for n in range(n_total):
            ggn = 0
            for i, out in enumerate(outs):

                def term(o, i=i, n=n, out=out):
                    replaced = list(outs)
                    replaced[i] = o.reshape(out.shape)
                    return terms(tuple(replaced))[n]

                hess = jacrev(jacrev(term))(out.flatten())
                ggn = ggn + jacs[i].T @ hess @ jacs[i]
            per_sample.append(ggn)
        self.ggn_per_sample = torch.stack(per_sample)
        self.ggn = self.ggn_per_sample.sum(0)
        self.hessian = jacrev(jacrev(lambda v: terms(f(v)).sum()))(flat)
        self.grads = jacrev(lambda v: terms(f(v)))(flat)  # [N, P]
        self._offsets = {}
        i = 0
        for k, s in zip(self.names, self.shapes):
            self._offsets[k] = (i, i + s.numel(), s)
            i += s.numel()

    block = Curvature.block
    diag = Curvature.diag

    def per_sample_grads(self, name):
        start, stop, shape = self._offsets[name]
        return self.grads[:, start:stop].reshape(-1, *shape)
