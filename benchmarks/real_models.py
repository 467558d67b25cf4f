"""Per-sample gradients on models people train: backpack's `BatchGrad` against `torch.func`.

`python -m benchmarks.real_models [--models ...] [--rounds R] [--threads T] [--out FILE]`

Hugging Face GPT-2 and Llama (tiny configs, random weights, nothing downloaded), timm's
resnet10t (BatchNorm in eval mode) and a ViT with LayerScale. Each row is the median time of a
forward + backward over the median plain step, measured interleaved in one process:

- `BatchGrad`: the extended model inside `backpack(BatchGrad())` (per-sample gradients of every
  trainable parameter, and `.grad`);
- `torch.func`: `vmap(grad(loss of functional_call(model, params, one sample)))` on the plain
  model (per-sample gradients only, no `.grad`).

Needs `transformers` and `timm` (test-only dependencies of this project).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Logits(nn.Module):
    """A Hugging Face model returning its logits (not a ModelOutput)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


def _lm_data(vocab: int, n: int, t: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, t + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _image_data(n: int, classes: int = 10) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def gpt2(n: int = 16, t: int = 64) -> tuple[nn.Module, Tensor, Tensor, str]:
    """GPT-2: 2 layers, width 128, 4 heads, vocabulary 512, tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512,
        n_positions=t,
        n_embd=128,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Logits(GPT2LMHeadModel(config).eval()), *_lm_data(512, n, t), "lm"


def llama(n: int = 16, t: int = 64) -> tuple[nn.Module, Tensor, Tensor, str]:
    """Llama: 2 layers, width 128, 4 heads (2 key-value heads), SwiGLU 256, vocabulary 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=t,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return Logits(LlamaForCausalLM(config).eval()), *_lm_data(512, n, t), "lm"


def resnet10t(n: int = 16) -> tuple[nn.Module, Tensor, Tensor, str]:
    """timm resnet10t on 3x32x32, 10 classes, BatchNorm in eval mode."""
    import timm

    torch.manual_seed(0)
    return timm.create_model("resnet10t", num_classes=10).eval(), *_image_data(n), "ce"


def vit(n: int = 16) -> tuple[nn.Module, Tensor, Tensor, str]:
    """timm ViT with LayerScale: 32x32 images, patches 4x4, width 128, depth 2, 4 heads."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        img_size=32,
        patch_size=4,
        embed_dim=128,
        depth=2,
        num_heads=4,
        init_values=1e-2,
        num_classes=10,
    )
    return model.eval(), *_image_data(n), "ce"


MODELS: dict[str, Callable[[], tuple[nn.Module, Tensor, Tensor, str]]] = {
    "gpt2": gpt2,
    "llama": llama,
    "resnet10t": resnet10t,
    "vit": vit,
}


def _loss(kind: str) -> Callable[[Tensor, Tensor], Tensor]:
    if kind == "lm":
        return lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return nn.functional.cross_entropy


def _timed(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(name: str, rounds: int) -> dict[str, float]:
    """Median ratios to a plain step of `BatchGrad` and `torch.func` on model `name`."""
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    model, x, y, kind = MODELS[name]()
    loss = _loss(kind)
    plain = copy.deepcopy(model)
    extended = extend(copy.deepcopy(model))
    lossfunc = extend(nn.CrossEntropyLoss())
    params = {k: p.detach() for k, p in plain.named_parameters() if p.requires_grad}

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        loss(plain(x), y).backward()

    def backpack_step() -> None:
        extended.zero_grad(set_to_none=True)
        with backpack(BatchGrad()):
            out = extended(x)
            if kind == "lm":  # token loss on [N·T, V] logits; the samples stay the N sequences
                lossfunc(out.flatten(0, 1), y.flatten()).backward()
            else:
                lossfunc(out, y).backward()

    def sample_loss(p: dict, xi: Tensor, yi: Tensor) -> Tensor:
        return loss(functional_call(plain, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))

    def func_step() -> None:
        per_sample(params, x, y)

    steps = {"plain": plain_step, "BatchGrad": backpack_step, "torch.func": func_step}
    times: dict[str, list[float]] = {k: [] for k in steps}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.func's "performance drop" notices
        for step in steps.values():  # warm-up
            step()
        for _ in range(rounds):
            for key, step in steps.items():
                times[key].append(_timed(step))
    base = statistics.median(times["plain"])
    return {k: statistics.median(v) / base for k, v in times.items() if k != "plain"} | {
        "plain_ms": 1e3 * base
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Measure every model and print (and optionally write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        f"Per-sample gradients, {args.threads} CPU threads, median of {args.rounds} interleaved "
        "rounds, as ratios to a plain forward + backward of the same model.",
        "",
        "| model | plain step (ms) | BatchGrad | torch.func | BatchGrad / torch.func |",
        "|---|---|---|---|---|",
    ]
    results = {}
    for name in args.models:
        r = results[name] = measure(name, args.rounds)
        lines.append(
            f"| {name} | {r['plain_ms']:.1f} | {r['BatchGrad']:.2f} | {r['torch.func']:.2f} | "
            f"{r['BatchGrad'] / r['torch.func']:.2f} |"
        )
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
