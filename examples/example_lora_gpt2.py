"""Per-sample gradient norms and KFAC factors of a LoRA-adapted Hugging Face GPT-2.

Fine-tuning with LoRA trains two small matrices per adapted layer (`lora_A`, `lora_B`) while the
pretrained weights stay frozen. One backward pass inside `with backpack(BatchL2Grad(), KFAC())`
gives, for every trainable LoRA matrix,

- `batch_l2`: each sequence's squared gradient norm (for DP-style per-sample clipping, or to
  spot the sequences that dominate a step), and
- `kfac`: its Kronecker factors `[G, A]` (for a KFAC preconditioner or a Laplace
  approximation of the adapter).

The model is built from a tiny `GPT2Config` with random weights (nothing is downloaded) and
trained on characters of a short text. The script checks the per-sample norms against
`torch.func` per-sample gradients of the same model, and KFAC's input factor `A` of one
`lora_A` against the inputs that layer received.

Needs `transformers` and `peft` (`pip install transformers peft`).

    python examples/example_lora_gpt2.py --batch-size 8 --context 32
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from backpack import backpack, extend
from backpack.extensions import KFAC, BatchL2Grad

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach out for weights or configs

TEXT = (
    "A small model reads a short text one character at a time and learns which character "
    "comes next. Its pretrained weights stay frozen; two thin matrices per attention layer "
    "carry everything the fine-tuning changes, and those are the only parameters that get "
    "gradients, per-sample norms and curvature in this example."
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank r")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


class NextCharacter(nn.Module):
    """The adapted GPT-2, returning its logits `[N, T, vocab]` (not a ModelOutput)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


def build(args: argparse.Namespace, vocab: int) -> nn.Module:
    """A tiny GPT-2 with LoRA adapters on its attention and projection layers."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=args.context,
        n_embd=args.dim,
        n_layer=args.layers,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    lora = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=["c_attn", "c_proj"],
        lora_dropout=0.0, fan_in_fan_out=True,  # GPT-2's Conv1D stores weights as [in, out]
    )
    with warnings.catch_warnings():
        # peft calls transformers' deprecated `is_gradient_checkpointing`: theirs to update
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        model = get_peft_model(GPT2LMHeadModel(config), lora)
    # peft starts lora_B at zero (then lora_A gets no gradient); as after some fine-tuning:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return NextCharacter(model).eval()  # eval: no dropout, so samples are independent


def per_sample_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-character cross-entropy of each sequence, `[N]`."""
    flat = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return flat.view(targets.shape).mean(1)


def torch_func_norms(model: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
    """Squared per-sequence gradient norms of the trainable parameters, with torch.func."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss(p: dict, i: Tensor, t: Tensor) -> Tensor:
        return per_sample_losses(functional_call(model, p, (i[None],)), t[None]).sum()

    with warnings.catch_warnings():
        # torch's vmap runs the fused attention kernel sample by sample (and says so): only the
        # reference is slower, its numbers are the same
        warnings.filterwarnings("ignore", "There is a performance drop")
        grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, idx, targets)
    n = idx.shape[0]  # the batch loss is the mean over sequences
    return sum((g / n).flatten(1).square().sum(1) for g in grads.values())


def main(argv: list[str] | None = None) -> dict:
    """Run the example; returns the per-sample norms and the factors' shapes."""
    args = parse_args(argv)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=gen)
    idx = torch.stack([data[s : s + args.context] for s in starts])
    targets = torch.stack([data[s + 1 : s + args.context + 1] for s in starts])

    model = extend(build(args, len(chars)))
    lossfunc = extend(nn.CrossEntropyLoss())  # mean over all N·T characters
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    print(f"GPT-2 with LoRA r={args.rank}: {len(trainable)} trainable matrices "
          f"({sum(p.numel() for p in trainable.values())} entries), {frozen} frozen")

    inputs: list[Tensor] = []
    first_a = next(m for n, m in model.named_modules() if n.endswith("lora_A.default"))
    handle = first_a.register_forward_hook(lambda m, inp, out: inputs.append(inp[0].detach()))
    with backpack(BatchL2Grad(), KFAC()):
        lossfunc(model(idx).flatten(0, 1), targets.flatten()).backward()
    handle.remove()

    # 1. per-sequence gradient norms (the whole adapter): what DP clipping would bound
    norms = sum(p.batch_l2 for p in trainable.values())
    expected = torch_func_norms(model, idx, targets)
    torch.testing.assert_close(norms, expected, rtol=1e-4, atol=1e-12)
    print("per-sequence gradient norms of the adapter:",
          " ".join(f"{v:.3g}" for v in norms.sqrt().tolist()))
    print("  match torch.func per-sample gradients")

    # 2. KFAC factors of every LoRA matrix; A of the first lora_A from its recorded inputs
    for name, p in list(trainable.items())[:4]:
        shapes = " x ".join(str(tuple(f.shape)) for f in p.kfac)
        print(f"  {name.replace('model.base_model.model.', '')}: kfac {shapes}")
    x = inputs[0].flatten(0, 1)  # [N·T, dim]: positions count as samples ("expand")
    _, a = first_a.weight.kfac
    torch.testing.assert_close(a, x.T @ x / len(x), rtol=1e-4, atol=1e-8)
    print("KFAC input factor of the first lora_A matches its inputs")
    assert all(hasattr(p, "kfac") and hasattr(p, "batch_l2") for p in trainable.values())
    return {"norms": norms, "factors": {n: [f.shape for f in p.kfac] for n, p in trainable.items()}}


if __name__ == "__main__":
    main()
