"""Curvature of a small GPT: diagonal-GGN and KFAC preconditioners from one backward pass.

A second-order method rescales the gradient by an approximation of the curvature. Two cheap
ones for a transformer:

- the **diagonal of the GGN** (`DiagGGNMC`, a Monte-Carlo estimate of the Fisher diagonal, or
  `DiagGGNExact`): the step is `g / (diag + λ)`, elementwise;
- **KFAC**: for a `Linear` weight the curvature block is approximated by `G ⊗ A`, and the step
  `(G + √λ I)⁻¹ ∇W (A + √λ I)⁻¹` never forms the product. In a GPT, every `Linear` layer and the
  attention projections (`in_proj_weight` as one `[3E, E]` layer, `out_proj`) get `[G, A]`;
  with `[N, T, D]` inputs the factors follow the "expand" convention (positions count like
  samples, `A = 1/(N T) Σ x xᵀ`). The learned position embedding gets factors for
  `weight.T` (a `Linear` layer on one-hot positions). LayerNorm parameters get one dense block
  `[G]`. The token embedding tied to the head is used twice; its factors `[R, C]` belong to
  the weight as stored (`[vocab, vocab]`, `[dim, dim]`): the Kronecker product nearest to the
  sum of both uses' products.

The script trains the character-level GPT of `example_gpt_dp_clipping.py` from the same
initialisation with plain SGD, the diagonal preconditioner and KFAC, each for a few steps at a
few learning rates, and prints the loss on the whole text for each. It checks

- `DiagGGNExact` against the GGN diagonal computed with autograd (a few entries),
- KFAC's input factor `A` of an MLP layer against the layer's recorded inputs,
- one KFAC direction against a solve with the dense matrix `kfacs_to_mat([G + √λ I, A + √λ I])`.

Which method wins on this tiny problem is whatever the printout says; the example shows how to
get and apply the quantities, not a benchmark of optimisers.

    python examples/example_gpt_curvature.py --steps 20 --damping 1e-3
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack import backpack, extend
from backpack.extensions import KFAC, DiagGGNExact, DiagGGNMC
from backpack.utils.examples import autograd_diag_ggn_exact
from backpack.utils.kroneckers import kfacs_to_mat

TEXT = (
    "the lighthouse keeper wrote the same line in his log every evening: the sea was calm, "
    "the lamp was lit, and the boats came home. on stormy nights he wrote it twice, as if the "
    "words could hold the water back. the children of the harbour learned to read from his "
    "log, one calm sea after another, until they could spell every wave by heart. when the "
    "keeper grew old, the children kept the lamp, and they kept the log, and every evening "
    "they wrote the same line in it: the sea was calm, the lamp was lit, and the boats came "
    "home."
)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, both residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token indices `[N, T]` -> next-token logits `[N, T, vocab]`."""

    def __init__(self, vocab: int, context: int, dim: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embedding
        for emb in (self.tok, self.pos):  # small embeddings: logits start near uniform
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)  # no peeking ahead
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))  # broadcast over N
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


TEXT_CHARS = sorted(set(TEXT))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--context", type=int, default=32, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per method and rate")
    parser.add_argument(
        "--lrs", type=float, nargs="+", default=[0.03, 0.1, 0.3], help="learning rates tried"
    )
    parser.add_argument("--damping", type=float, default=0.1, help="λ")
    parser.add_argument("--mc-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def windows(data: Tensor, starts: Tensor, context: int) -> tuple[Tensor, Tensor]:
    """Inputs `[N, T]` and next-character targets `[N, T]` starting at `starts`."""
    offsets = torch.arange(context + 1)
    chunk = data[starts[:, None] + offsets]
    return chunk[:, :-1], chunk[:, 1:]


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of `[N, T, V]` logits; as a function it needs no `extend`.

    The logits go in as `[N, V, T]`. Flattened logits (`logits.flatten(0, 1)`, targets
    `targets.flatten()`) give the same loss and the same exact curvature, but Monte-Carlo
    extensions then draw one column per position (`mc_samples · T` columns, T times the work);
    with `[N, V, T]` all positions share the `mc_samples` columns.
    """
    return F.cross_entropy(logits.transpose(1, 2), targets)


@torch.no_grad()
def text_loss(model: nn.Module, data: Tensor, context: int) -> float:
    """Mean next-character loss over windows of the whole text (a fixed evaluation set)."""
    idx, targets = windows(data, torch.arange(0, len(data) - context - 1, 4), context)
    return token_loss(model(idx), targets).item()


def kfac_direction(module: nn.Module, param: Tensor, damping: float, tied: bool = False) -> Tensor:
    """Apply the inverse of the damped Kronecker factors in `param.kfac` to `param.grad`."""
    factors = [f + damping**0.5 * torch.eye(f.shape[0]) for f in param.kfac]
    grad = param.grad
    if len(factors) == 1:  # a bias, or one dense block (LayerNorm)
        return torch.linalg.solve(factors[0], grad.flatten()).view_as(grad)
    G, A = factors
    # an embedding's own factors are those of weight.T ([dim, dim], [rows, rows]); a tied
    # weight's are those of the weight as stored
    transposed = isinstance(module, nn.Embedding) and not tied
    matrix = grad.T if transposed else grad.flatten(1)
    step = torch.linalg.solve(A, torch.linalg.solve(G, matrix).T).T  # G⁻¹ ∇ A⁻¹, A symmetric
    return (step.T if transposed else step).reshape(grad.shape)


def named_parameters(model: nn.Module):
    """(module, parameter, tied) triples, each parameter once (a tied one with its first user)."""
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    seen = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield module, p, users[id(p)] > 1


def directions(model: nn.Module, method: str, damping: float) -> list[Tensor]:
    """The update direction of every parameter, from the quantities of the last backward."""
    result = []
    for module, p, tied in named_parameters(model):
        if method == "sgd":
            result.append(p.grad)
        elif method == "kfac":
            result.append(kfac_direction(module, p, damping, tied))
        else:
            result.append(p.grad / (p.diag_ggn_mc + damping))
    return result


def train(model: nn.Module, method: str, lr: float, data: Tensor, args) -> float:
    """`args.steps` preconditioned steps on random windows; returns the loss on the text."""
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches for every method
    extensions = {"sgd": [], "diag": [DiagGGNMC(args.mc_samples)]}
    extensions["kfac"] = [KFAC(args.mc_samples)]
    params = [p for _, p, _ in named_parameters(model)]
    for _ in range(args.steps):
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=gen)
        idx, targets = windows(data, starts, args.context)
        model.zero_grad()
        loss = token_loss(model(idx), targets)
        if not loss < 3 * math.log(len(TEXT_CHARS)):  # diverged (or NaN): rate too large
            return float("inf")
        with backpack(*extensions[method]):
            loss.backward()
        steps = directions(model, method, args.damping)
        with torch.no_grad():
            for p, step in zip(params, steps):
                p -= lr * step
    return text_loss(model, data, args.context)


def check_close(what: str, actual: Tensor, expected: Tensor, rtol: float = 1e-4) -> None:
    error = (actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
    if not error < rtol:
        raise AssertionError(f"{what}: relative error {error:.2e}")
    print(f"  {what}: ok (relative error {error:.1e})")


def run_checks(make_model, data: Tensor, args) -> None:
    """backpack's quantities against independent computations, on one small batch."""
    print("checks:")
    model = make_model()
    idx, targets = windows(data, torch.tensor([0, 250]), 6)
    # 1. the GGN diagonal (the tied embedding's entry is that of the shared parameter)
    with backpack(DiagGGNExact()):
        token_loss(model(idx), targets).backward()
    diag = torch.cat([p.diag_ggn_exact.flatten() for p in model.parameters()])
    entries = torch.randperm(diag.numel(), generator=torch.Generator().manual_seed(0))[:8]
    entries = torch.cat([entries, torch.tensor([0, 1])])  # two entries of the tied embedding
    expected = autograd_diag_ggn_exact(idx, targets, model, token_loss, idx=entries)
    check_close("DiagGGNExact, 10 entries, against autograd", diag[entries], expected)
    # 2. KFAC's input factor of the first MLP layer: the mean of x xᵀ over samples and positions
    layer, inputs = model.blocks[0].mlp[0], []
    handle = layer.register_forward_hook(lambda module, inp, out: inputs.append(inp[0].detach()))
    model.zero_grad()
    with backpack(KFAC(args.mc_samples)):
        token_loss(model(idx), targets).backward()
    handle.remove()
    x = inputs[0].flatten(0, 1)  # [N T, dim]
    check_close("KFAC input factor A of blocks.0.mlp.0", layer.weight.kfac[1], x.T @ x / len(x))
    r, c = model.head.weight.kfac  # the tied weight: factors of the [vocab, dim] weight
    if (r.shape, c.shape) != ((model.head.weight.shape[0],) * 2, (model.head.weight.shape[1],) * 2):
        raise AssertionError("the tied weight's factors are not oriented as it is stored")
    # 3. KFAC directions against dense Kronecker solves (Linear weight; embedding weight.T)
    root = args.damping**0.5
    for module, transposed in ((layer, False), (model.pos, True)):
        p = module.weight
        dense = kfacs_to_mat([f + root * torch.eye(f.shape[0]) for f in p.kfac])
        grad = p.grad.T if transposed else p.grad
        solved = torch.linalg.solve(dense, grad.flatten()).view_as(grad)
        solved = solved.T if transposed else solved
        name = type(module).__name__
        article = "an" if name[0].lower() in "aeiou" else "a"
        check_close(
            f"KFAC step of {article} {name} against a dense solve",
            kfac_direction(module, p, args.damping),
            solved,
            rtol=1e-3,
        )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])

    def make_model() -> nn.Module:  # the same initialisation for every run
        torch.manual_seed(args.seed)
        model = GPT(len(chars), args.context, args.dim, args.heads, args.blocks)
        return extend(model)

    run_checks(make_model, data, args)
    start = text_loss(make_model(), data, args.context)
    print(f"loss on the whole text at initialisation: {start:.3f}")
    print(f"after {args.steps} steps of {args.batch_size} sequences (damping λ={args.damping:g}):")
    results: dict[str, dict[float, float]] = {}
    for method in ("sgd", "diag", "kfac"):
        results[method] = {lr: train(make_model(), method, lr, data, args) for lr in args.lrs}
        cells = ", ".join(
            f"lr {lr:g}: " + (f"{loss:.3f}" if math.isfinite(loss) else "diverged")
            for lr, loss in results[method].items()
        )
        print(f"  {method:5s} {cells}")
    if any(not math.isfinite(v) for r in results.values() for v in r.values()):
        print(
            "  (diverged: the loss of a batch exceeded 3x that of uniform guessing, so training "
            "stopped; that learning rate is too large for the method)"
        )
    best = {m: min(r.values()) for m, r in results.items()}
    winner = min(best, key=best.get)
    print(
        f"lowest loss: {winner} ({best[winner]:.3f}); each method's best: "
        + ", ".join(f"{m} {v:.3f}" for m, v in best.items())
    )
    return {"start": start, "results": results}


if __name__ == "__main__":
    main()
