"""Layers of Hugging Face transformers and timm, and tiny models built from them.

transformers and timm are test-only dependencies: a problem needing one is left out of the table
when the package is not installed (and the package is imported only when a problem is built).
Models are tiny, with random weights, built from configs (nothing is downloaded).

- `Conv1D` (GPT-2's layer, `y = x @ W + b` with W stored `[in, out]`): on `[N, in]` and on
  sequences, and a tiny GPT-2;
- timm's `Linear` (a subclass overriding forward benignly), `LayerScale`/`LayerScale2d`,
  `LayerNorm`/`GroupNorm` subclasses and `RmsNorm`, and a ViT block;
- Hugging Face RMS norms (`LlamaRMSNorm`, `T5LayerNorm`, which take the mean square in float32
  even for float64 inputs), and a tiny Llama.

Tags as for the norm layers: norms are nonlinear in their input, so models containing one get no
"hessian" tag; `bias_block_is_G` is False where a Linear-like layer acts on sequences.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from backpack.custom_module.permute import Permute
from problems import Problem, randn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_TIMM = importlib.util.find_spec("timm") is not None

ALL = {"first", "second", "hessian", "kron"}
NO_HESSIAN = {"first", "second", "kron"}
SEQ = {"bias_block_is_G": False}


def conv1d(nx: int, nf: int) -> nn.Module:
    """A Hugging Face `Conv1D` with `nx` inputs and `nf` outputs, random weight and bias."""
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(nf, nx)
    with torch.no_grad():
        layer.weight.normal_(0, 0.7)
        layer.bias.normal_()
    return layer


def randomise(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def _seq_ce_target(out):
    return torch.randint(0, out.shape[1], (out.shape[0], out.shape[2]))


class LogitsOf(nn.Module):
    """A Hugging Face causal LM returning its logits as `[N, V, T]` (for CrossEntropyLoss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(idx).logits.transpose(1, 2)


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=7,
        n_positions=8,
        n_embd=6,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    return LogitsOf(randomise_norms(GPT2LMHeadModel(config).eval()))


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=7,
        hidden_size=8,
        intermediate_size=5,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    return LogitsOf(randomise_norms(LlamaForCausalLM(config).eval()))


def randomise_norms(model: nn.Module) -> nn.Module:
    """Random γ (and β) of every norm layer, so that none is the identity map."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name:
                p.normal_()
    return model


def llama_norm(dim: int, eps: float = 1e-6) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return randomise(LlamaRMSNorm(dim, eps=eps))


def t5_norm(dim: int, eps: float = 1e-6) -> nn.Module:
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return randomise(T5LayerNorm(dim, eps=eps))


def conv1d_mlp():
    return nn.Sequential(conv1d(4, 5), nn.Tanh(), conv1d(5, 3))


def conv1d_seq():
    """Conv1D on `[N, T, 4]`, GELU, Conv1D; logits `[N, C, T]`."""
    return nn.Sequential(conv1d(4, 5), nn.GELU(), conv1d(5, 3), Permute(0, 2, 1))


class Conv1DResidual(nn.Module):
    """A GPT-2 style MLP block with a residual addition and a functional activation."""

    def __init__(self):
        super().__init__()
        self.embed = conv1d(3, 4)
        self.up = conv1d(4, 6)
        self.down = conv1d(6, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h)


def timm_linear_net():
    from timm.layers import Linear

    return nn.Sequential(Linear(4, 5), nn.Sigmoid(), Linear(5, 3))


def layer_scale_net():
    """timm Linear -> LayerScale -> Tanh -> Linear on `[N, T, 4]` (sequence)."""
    from timm.layers import LayerScale, Linear

    return nn.Sequential(
        Linear(4, 5), randomise(LayerScale(5)), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 5, 3)
    )


def layer_scale_2d_net():
    from timm.layers import LayerScale2d

    return nn.Sequential(
        nn.Conv2d(2, 3, 2),
        randomise(LayerScale2d(3)),
        nn.ELU(),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3, 2),
    )


def timm_norms_net():
    """timm's LayerNorm, GroupNorm, GroupNorm1 (benign subclasses) and RmsNorm on `[N, 4]`."""
    from timm.layers import GroupNorm, GroupNorm1, LayerNorm, RmsNorm

    return nn.Sequential(
        nn.Linear(5, 4),
        randomise(LayerNorm(4)),
        nn.Tanh(),
        nn.Linear(4, 4),
        randomise(GroupNorm(4, num_groups=2)),
        nn.Tanh(),
        randomise(GroupNorm1(4)),
        nn.Linear(4, 4),
        randomise(RmsNorm(4)),
        nn.Sigmoid(),
        nn.Linear(4, 3),
    )


def layer_norm_2d_net():
    """Conv2d -> timm LayerNorm2d (channels of each position) -> Tanh -> Linear."""
    from timm.layers import LayerNorm2d

    return nn.Sequential(
        nn.Conv2d(2, 3, 2),
        randomise(LayerNorm2d(3)),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 3 * 2, 2),
    )


class ViTBlock(nn.Module):
    """A timm transformer block with LayerScale (attention and MLP) on `[N, T, D]`."""

    def __init__(self, d=4, classes=3):
        super().__init__()
        from timm.models.vision_transformer import Block

        self.block = Block(d, num_heads=2, mlp_ratio=1.5, init_values=0.5)
        randomise_norms(self.block)
        with torch.no_grad():
            self.block.ls1.gamma.normal_()
            self.block.ls2.gamma.normal_()
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.block(x))


def norm_first_seq(norm: nn.Module, d: int = 4, hidden: int = 5, classes: int = 3):
    """norm -> Linear -> GELU -> Linear on `[N, T, d]`, logits `[N, C, T]`.

    Hugging Face's RMS norms take the mean square in float32 even for float64 inputs, so a
    gradient passing back through one is rounded to float32: parameters *before* such a norm
    have float32-accurate curvature only, in the reference too. With the norm on the input,
    every quantity is a float64 one.
    """
    return nn.Sequential(
        norm, nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, classes), Permute(0, 2, 1)
    )


def norm_first_flat(norm: nn.Module, d: int = 5):
    return nn.Sequential(norm, nn.Linear(d, 4), nn.Tanh(), nn.Linear(4, 3))


TRANSFORMERS_PROBLEMS = [
    Problem("hf-conv1d-mlp-ce-mean", conv1d_mlp, randn(7, 4), tags=ALL),
    Problem(
        "hf-conv1d-mlp-mse-sum",
        conv1d_mlp,
        randn(5, 4),
        lambda: nn.MSELoss(reduction="sum"),
        tags=ALL,
    ),
    Problem(
        "hf-conv1d-seq-ce-sum",
        conv1d_seq,
        randn(4, 3, 4),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        make_target=_seq_ce_target,
        tags=ALL,
        options=SEQ,
    ),
    Problem(
        "hf-conv1d-residual-mse-mean",
        Conv1DResidual,
        randn(4, 3, 3),
        lambda: nn.MSELoss(),
        tags={"first", "second", "kron"},
        options=SEQ,
    ),
    Problem(
        "hf-gpt2-tiny-ce-mean",
        tiny_gpt2,
        lambda: torch.randint(0, 7, (3, 4)),
        make_target=_seq_ce_target,
        tags=NO_HESSIAN,
        options=SEQ,
    ),
    Problem(
        "hf-llama-rmsnorm-seq-ce-sum",
        lambda: norm_first_seq(llama_norm(4, eps=1e-2)),
        randn(4, 3, 4),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        make_target=_seq_ce_target,
        tags=NO_HESSIAN,
        options=SEQ,
    ),
    Problem(
        "hf-llama-rmsnorm-flat-ce-mean",
        lambda: norm_first_flat(llama_norm(5)),
        randn(6, 5),
        tags=NO_HESSIAN,
    ),
    Problem(
        "hf-t5-layernorm-flat-mse-mean",
        lambda: norm_first_flat(t5_norm(5, eps=1e-3)),
        randn(6, 5),
        lambda: nn.MSELoss(),
        tags=NO_HESSIAN,
    ),
    Problem(
        "hf-t5-layernorm-seq-mse-sum",
        lambda: norm_first_seq(t5_norm(4)),
        randn(3, 4, 4),
        lambda: nn.MSELoss(reduction="sum"),
        make_target=lambda out: torch.randn_like(out),
        tags=NO_HESSIAN,
        options=SEQ,
    ),
    Problem(
        "hf-llama-tiny-ce-sum",
        tiny_llama,
        lambda: torch.randint(0, 7, (3, 4)),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
        make_target=_seq_ce_target,
        tags={"first"},  # curvature: float32-accurate (see `norm_first_seq`), tested apart
        options=SEQ,
    ),
]

TIMM_PROBLEMS = [
    Problem("timm-linear-ce-sum", timm_linear_net, randn(6, 4),
            lambda: nn.CrossEntropyLoss(reduction="sum"), tags=ALL),
    Problem("timm-linear-mse-mean", timm_linear_net, randn(5, 4), lambda: nn.MSELoss(), tags=ALL),
    Problem("timm-layerscale-seq-ce-mean", layer_scale_net, randn(5, 3, 4), tags=ALL, options=SEQ),
    Problem(
        "timm-layerscale2d-mse-sum",
        layer_scale_2d_net,
        randn(4, 2, 4, 4),
        lambda: nn.MSELoss(reduction="sum"),
        tags=ALL,
    ),
    Problem(
        "timm-norms-ce-mean",
        timm_norms_net,
        randn(6, 5),
        tags=NO_HESSIAN,
    ),
    Problem("timm-layernorm2d-ce-sum", layer_norm_2d_net, randn(4, 2, 4, 3),
            lambda: nn.CrossEntropyLoss(reduction="sum"), tags=NO_HESSIAN),
    Problem(
        "timm-vit-block-mse-sum",
        ViTBlock,
        randn(3, 4, 4),
        lambda: nn.MSELoss(reduction="sum"),
        tags=NO_HESSIAN,
        options=SEQ,
    ),
]

PROBLEMS = (TRANSFORMERS_PROBLEMS if HAS_TRANSFORMERS else []) + (
    TIMM_PROBLEMS if HAS_TIMM else []
)
