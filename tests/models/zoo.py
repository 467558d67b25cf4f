"""Tiny Hugging Face `transformers`, `timm` and `peft` models, built offline with random weights.

Every entry builds its model from a config object in code (no download, no hub access), in
eval mode (no dropout, BatchNorm on its running statistics), deterministically from
`torch.manual_seed`. Models return `ModelOutput`s or tuples; `Logits` wraps them so the
extended model returns a plain logits tensor. Language models return token logits `[N, T, V]`
and are trained as people train them: cross-entropy on the flattened `[N·T, V]` logits with
targets `[N·T]` (the samples stay the N sequences).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no hints about padding masks

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

VOCAB = 11
SEQ = 5
N = 4
CLASSES = 3


class Logits(nn.Module):
    """`model(**inputs(x)).logits`: a plain tensor out of a `ModelOutput`-returning model."""

    def __init__(self, model: nn.Module, inputs: Callable[[Tensor], dict[str, Tensor]]):
        super().__init__()
        self.model = model
        self.inputs = inputs

    def forward(self, x: Tensor) -> Tensor:
        return self.model(**self.inputs(x)).logits


def _ids(x: Tensor) -> dict[str, Tensor]:
    return {"input_ids": x}


def _pixels(x: Tensor) -> dict[str, Tensor]:
    return {"pixel_values": x}


def _encoder_decoder(x: Tensor) -> dict[str, Tensor]:
    """`x` `[N, 2, T]`: the encoder's and the decoder's token ids."""
    return {"input_ids": x[:, 0], "decoder_input_ids": x[:, 1]}


@dataclass
class Entry:
    """One model of the zoo: builder, input, targets, and how the loss sees its logits."""

    id: str
    make_model: Callable[[], nn.Module]
    make_input: Callable[[], Tensor]
    #: targets `[N, T]` for token logits `[N, T, V]`, else `[N]`
    token_loss: bool = False
    dtype: torch.dtype = torch.float64
    #: relative tolerance against the float64 references
    rtol: float = 1e-7
    #: quantity -> reason: checks known to fail today (strict xfail)
    xfail: dict[str, str] = field(default_factory=dict)

    def build(self, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
        """Fresh model (eval mode, float64 unless `dtype` says otherwise), input and targets."""
        torch.manual_seed(seed)
        model = self.make_model().to(torch.float64).eval()
        if self.dtype != torch.float64:
            # round the weights to `dtype` (the float64 truth then uses the rounded weights)
            model = model.to(self.dtype)
        x = self.make_input()
        if x.is_floating_point():
            x = x.to(self.dtype)
        with torch.no_grad():
            out = model(x)
        classes = out.shape[-1]
        shape = out.shape[:2] if self.token_loss else out.shape[:1]
        y = torch.randint(0, classes, shape)
        return model, x, y


def token_ids(*shape: int) -> Callable[[], Tensor]:
    return lambda: torch.randint(0, VOCAB, shape)


def images(size: int) -> Callable[[], Tensor]:
    return lambda: torch.randn(N, 3, size, size, dtype=torch.float64)


# --- transformers ----------------------------------------------------------------------------


def _special_tokens() -> dict[str, Any]:
    return {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=8, n_layer=1, n_head=2, n_inner=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        **_special_tokens(),
    )
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, type_vocab_size=2, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )
    return transformers.BertForSequenceClassification(config)


def llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
        tie_word_embeddings=False, **_special_tokens(),
    )
    model = transformers.LlamaForCausalLM(config)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features < attn.q_proj.out_features  # grouped-query attention
    return model


def hf_vit() -> nn.Module:
    import transformers

    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(config)


def t5() -> nn.Module:
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1,
        num_heads=2, relative_attention_num_buckets=4, relative_attention_max_distance=8,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config)


def lora(make_base: Callable[[], nn.Module], targets: list[str], **kwargs: Any) -> nn.Module:
    """peft LoRA (r=4) on `targets` of a base model; B random (not zero) so A gets gradients."""
    import peft

    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
        **kwargs,
    )
    return peft.get_peft_model(make_base(), config)


# --- timm -----------------------------------------------------------------------------------


def resnet10t() -> nn.Module:
    import timm

    return timm.create_model(
        "resnet10t", pretrained=False, num_classes=CLASSES, stem_width=4, channels=(4, 8, 8, 8)
    )


def timm_vit() -> nn.Module:
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=CLASSES, img_size=8, patch_size=4,
        embed_dim=8, depth=1, num_heads=2, mlp_ratio=2.0, init_values=1e-5,
    )


def convnext_atto() -> nn.Module:
    import timm

    return timm.create_model(
        "convnext_atto", pretrained=False, num_classes=CLASSES, dims=(4, 8, 8, 8),
        depths=(1, 1, 1, 1),
    )


def mobilenetv3_small() -> nn.Module:
    """timm's MobileNetV3 with the blocks of `mobilenetv3_small_*` (depthwise-separable and
    inverted-residual blocks, squeeze-excite with hard-sigmoid gates, hard-swish), few channels.
    """
    from timm.layers import get_act_layer
    from timm.models.mobilenetv3 import (
        MobileNetV3,
        SqueezeExcite,
        decode_arch_def,
        round_channels,
    )

    arch = [
        ["ds_r1_k3_s2_e1_c8_se0.25_nre"],
        ["ir_r1_k3_s2_e4.5_c8_nre"],
        ["ir_r1_k5_s2_e4_c8_se0.25"],
        ["cn_r1_k1_s1_c16"],
    ]
    se_layer = partial(
        SqueezeExcite, gate_layer="hard_sigmoid", force_act_layer=nn.ReLU,
        rd_round_fn=round_channels,
    )
    return MobileNetV3(
        block_args=decode_arch_def(arch), num_classes=CLASSES, stem_size=8, fix_stem=True,
        num_features=16, act_layer=get_act_layer("hard_swish"), se_layer=se_layer,
        round_chs_fn=partial(round_channels, multiplier=1.0),
    )


def efficientnet_b0() -> nn.Module:
    """`efficientnet_b0`'s architecture with every stage one block deep and 1/10 the channels."""
    from timm.models.efficientnet import _gen_efficientnet

    return _gen_efficientnet(
        "efficientnet_b0", channel_multiplier=0.1, depth_multiplier=0.1, num_classes=CLASSES
    )


# --- the zoo ---------------------------------------------------------------------------------

#: every quantity the tests check (`grad`: `.grad` equals plain autograd's)
QUANTITIES = [
    "grad",
    "grad_batch",
    "batch_l2",
    "sum_grad_squared",
    "variance",
    "batch_dot",
    "diag_ggn_exact",
    "diag_ggn_exact_batch",
]
FIRST_ORDER = QUANTITIES[:6]

#: Llama's RMSNorm (and rotary embedding) compute in float32 whatever the model's dtype: GGN
#: diagonals built from loss-Hessian factors and references built from Jacobian rows round
#: differently there (measured up to 6e-8; 3e-16 with a float64 RMSNorm)
LLAMA_RTOL = 1e-5

GPT2_LORA = ["c_attn"]
LLAMA_LORA = ["q_proj", "v_proj"]

ZOO: list[Entry] = [
    Entry("gpt2", lambda: Logits(gpt2(), _ids), token_ids(N, SEQ), token_loss=True),
    Entry("bert", lambda: Logits(bert(), _ids), token_ids(N, SEQ)),
    Entry(
        "llama-gqa",
        lambda: Logits(llama(), _ids),
        token_ids(N, SEQ),
        token_loss=True,
        rtol=LLAMA_RTOL,
    ),
    Entry("hf-vit", lambda: Logits(hf_vit(), _pixels), images(8)),
    Entry(
        "t5",
        lambda: Logits(t5(), _encoder_decoder),
        token_ids(N, 2, SEQ),
        token_loss=True,
    ),
    Entry(
        "gpt2-lora",
        lambda: Logits(lora(gpt2, GPT2_LORA, fan_in_fan_out=True), _ids),
        token_ids(N, SEQ),
        token_loss=True,
    ),
    Entry(
        "llama-lora",
        lambda: Logits(lora(llama, LLAMA_LORA), _ids),
        token_ids(N, SEQ),
        token_loss=True,
        rtol=LLAMA_RTOL,
    ),
    Entry("timm-resnet10t", resnet10t, images(16)),
    Entry("timm-vit-layerscale", timm_vit, images(8)),
    Entry("timm-convnext-atto", convnext_atto, images(32)),
    Entry("timm-mobilenetv3-small", mobilenetv3_small, images(32)),
    Entry("timm-efficientnet-b0", efficientnet_b0, images(32)),
]

#: GPT-2 with bfloat16 weights, checked against float64 on the same (rounded) weights
GPT2_BF16 = Entry(
    "gpt2-bf16",
    lambda: Logits(gpt2(), _ids),
    token_ids(N, SEQ),
    token_loss=True,
    dtype=torch.bfloat16,
)


def by_id(entry_id: str) -> Entry:
    return next(e for e in [*ZOO, GPT2_BF16] if e.id == entry_id)
