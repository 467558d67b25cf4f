"""Differentially private training of a small GPT with ghost clipping.

DP-SGD clips every sample's gradient to a norm of at most C, sums the clipped gradients, adds
Gaussian noise with standard deviation sigma * C and divides by the batch size. For a language
model, a sample is one sequence: its loss is the mean of its token losses, and its gradient
collects every position.

Materialising the per-sample gradients (`BatchGrad`) costs N copies of the model. Ghost
clipping needs only their norms, which `BatchL2Grad` computes without forming them (for a
`Linear` layer on `[N, T, D]` inputs from the Gram matrices of its inputs and output gradients
when that is cheaper). With the norms, the clipped sum is the gradient of a reweighted loss:

    Σ_n c_n ∇l_n = ∇ Σ_n c_n l_n,     c_n = min(1, C / ‖∇l_n‖),

so a second, plain backward pass of `Σ_n c_n l_n` (with the weights c_n treated as constants)
leaves the clipped sum in `.grad`. One forward and two backward passes per step, and no
`[N, *param]` tensor.

The model is a character-level GPT: token and learned position embeddings, pre-norm blocks with
causal `nn.MultiheadAttention` and a GELU MLP, a final LayerNorm and a head tied to the token
embedding. It trains on a short text embedded below (written for this example). The first step
is checked against a loop over sequences with plain autograd; the script then reports the loss
on the whole text before and after training. (Privacy accounting, i.e. turning sigma, the
sampling rate and the number of steps into an (epsilon, delta) guarantee, is out of scope.)

    python examples/example_gpt_dp_clipping.py --steps 60 --max-norm 1.0 --noise-multiplier 0.5
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backpack import backpack, extend
from backpack.extensions import BatchL2Grad

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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--context", type=int, default=32, help="characters per sequence")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--max-norm", type=float, default=1.0, help="clipping threshold C")
    parser.add_argument("--noise-multiplier", type=float, default=0.5, help="sigma")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam step size")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def sequence_losses(model: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
    """`[N]`: each sequence's mean next-token cross-entropy."""
    logits = model(idx)  # [N, T, V]
    tokens = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return tokens.view_as(targets).mean(1)


def ghost_clipped_sum(
    model: nn.Module, idx: Tensor, targets: Tensor, max_norm: float
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Σ_n c_n ∇l_n (left in `.grad`, also returned), the norms ‖∇l_n‖ and the losses l_n."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    losses = sequence_losses(model, idx, targets)
    # 1st backward: the per-sequence gradient norms (of every parameter, summed over them)
    with backpack(BatchL2Grad()):
        losses.sum().backward(retain_graph=True)
    norms = torch.stack([p.batch_l2 for p in params]).sum(0).sqrt()
    weights = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    # 2nd backward, plain: the gradient of the reweighted loss is the clipped sum
    model.zero_grad()
    (weights.detach() * losses).sum().backward()
    return [p.grad.clone() for p in params], norms, losses.detach()


def loop_clipped_sum(
    model: nn.Module, idx: Tensor, targets: Tensor, max_norm: float
) -> tuple[list[Tensor], Tensor]:
    """The same, one sequence at a time with plain autograd."""
    params = [p for p in model.parameters() if p.requires_grad]
    sums = [torch.zeros_like(p) for p in params]
    norms = []
    for n in range(idx.shape[0]):
        loss = sequence_losses(model, idx[n : n + 1], targets[n : n + 1]).sum()
        grads = torch.autograd.grad(loss, params)
        norm = torch.cat([g.flatten() for g in grads]).norm()
        norms.append(norm)
        for s, g in zip(sums, grads):
            s += min(1.0, max_norm / (norm.item() + 1e-6)) * g
    return sums, torch.stack(norms)


def windows(data: Tensor, starts: Tensor, context: int) -> tuple[Tensor, Tensor]:
    """Inputs `[N, T]` and next-character targets `[N, T]` starting at `starts`."""
    offsets = torch.arange(context + 1)
    chunk = data[starts[:, None] + offsets]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def text_loss(model: nn.Module, data: Tensor, context: int) -> float:
    """Mean next-character loss over every window of the text (a fixed evaluation set)."""
    idx, targets = windows(data, torch.arange(0, len(data) - context - 1, 4), context)
    return sequence_losses(model, idx, targets).mean().item()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    model = GPT(len(chars), args.context, args.dim, args.heads, args.blocks)
    model = extend(model)  # the loss needs no extend: first-order extensions do without
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)  # batches and noise
    n = args.batch_size
    params = [p for p in model.parameters() if p.requires_grad]
    print(
        f"GPT with {sum(p.numel() for p in params)} parameters, vocabulary {len(chars)}, "
        f"{len(TEXT)} characters of text; clipping at C={args.max_norm:g}, "
        f"sigma={args.noise_multiplier:g}"
    )

    before = text_loss(model, data, args.context)
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.context - 1, (n,), generator=gen)
        idx, targets = windows(data, starts, args.context)
        sums, norms, losses = ghost_clipped_sum(model, idx, targets, args.max_norm)

        if step == 0:  # independent check of the norms and the clipped sum
            ref_sums, ref_norms = loop_clipped_sum(model, idx, targets, args.max_norm)
            if not torch.allclose(norms, ref_norms, rtol=1e-4, atol=1e-6):
                raise AssertionError("per-sequence gradient norms differ from the loop")
            for s, r in zip(sums, ref_sums):
                error = (s - r).abs().max() / r.abs().max().clamp_min(1e-12)
                if not error < 1e-4:
                    raise AssertionError(f"clipped gradient sum differs (relative {error:.1e})")
            clipped = (norms > args.max_norm).float().mean().item()
            print(
                f"step 0: norms and clipped sum match a loop over {n} sequences; "
                f"{100 * clipped:.0f}% of the sequences were clipped"
            )

        std = args.noise_multiplier * args.max_norm
        with torch.no_grad():  # the privatised mean gradient replaces .grad
            for p, s in zip(params, sums):
                p.grad = (s + std * torch.randn(p.shape, generator=gen)) / n
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(
                f"step {step:3d}: batch loss {losses.mean().item():.3f}, "
                f"median norm {norms.median().item():.3f}"
            )

    after = text_loss(model, data, args.context)
    frequencies = torch.bincount(data).float() / len(data)
    unigram = -(frequencies * frequencies.log()).sum().item()
    print(
        f"loss on the whole text: {before:.3f} before, {after:.3f} after {args.steps} private "
        f"steps (uniform guessing {torch.tensor(float(len(chars))).log().item():.3f}, "
        f"character frequencies alone {unigram:.3f})"
    )
    return {"before": before, "after": after, "unigram": unigram, "norms": norms}


if __name__ == "__main__":
    main()
