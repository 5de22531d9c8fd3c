"""Tiny offline vision-language building blocks: a Qwen-style processor (word-level tokenizer with the image special
tokens, Qwen2-VL image processor), small random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models, synthetic image preference
data. Used by the tests and the vision benchmark; nothing is downloaded. Needs Pillow (the image processor's backend).

transformers constructs these processors with a video processor, which needs torchvision; the tiny processor leaves
the video side out (images only), everything else is the family's own processor class.
"""

from __future__ import annotations

import copy
import random

from . import WORDS, _tiny_text_fields, make_tokenizer


__all__ = ["VISION_FAMILIES", "make_vision_processor", "make_vision_model", "synthetic_image_pairs", "random_image"]

VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VISION_SPECIAL_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
#: Qwen's chat format (images as `<|vision_start|><|image_pad|><|vision_end|>`), spaces for the word-level tokenizer
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
PATCH_SIZE = 4  # pixels per patch side; a merged image token covers (2 * PATCH_SIZE)^2 pixels


def _processor_class(family: str):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    base = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[family]

    class ImageOnlyProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{base.__name__}"
    return ImageOnlyProcessor


def make_vision_processor(family: str = "qwen2_vl", max_pixels: int = 64 * 64):
    """The family's processor over a word-level tokenizer (`tiny.make_tokenizer` plus Qwen's image tokens) and a
    Qwen2-VL image processor with `PATCH_SIZE`-pixel patches (merged 2 x 2 into one image token)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = make_tokenizer(list(WORDS) + ["user", "assistant", "system"])
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_SPECIAL_TOKENS})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    factor = 2 * PATCH_SIZE
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=2, temporal_patch_size=2, min_pixels=factor * factor, max_pixels=max_pixels
    )
    return _processor_class(family)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=VISION_CHAT_TEMPLATE
    )


def make_vision_config(family: str, tokenizer, hidden_size: int = 32, num_layers: int = 2, vision_depth: int = 2):
    """A small config of one of `VISION_FAMILIES` (text: GQA, 4 query and 2 key/value heads; M-RoPE sections split
    the rotary half of each head 2:1:1 between time, height and width, e.g. [2, 1, 1] at `hidden_size=32`)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids(VISION_SPECIAL_TOKENS)
    quarter = hidden_size // 4 // 2 // 4  # head_dim = hidden_size / 4 heads; M-RoPE sections add up to head_dim / 2
    mrope_section = [2 * quarter, quarter, quarter]
    text = dict(
        **_tiny_text_fields(len(tokenizer), hidden_size, num_layers),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "default", "mrope_section": mrope_section, "rope_theta": 10000.0},
    )
    vision = dict(depth=vision_depth, num_heads=2, patch_size=PATCH_SIZE, spatial_merge_size=2, temporal_patch_size=2)
    tokens = dict(
        image_token_id=ids[4],
        video_token_id=ids[5],
        vision_start_token_id=ids[2],
        vision_end_token_id=ids[3],
        tie_word_embeddings=False,
    )
    if family == "qwen2_vl":
        vision.update(embed_dim=16, hidden_size=hidden_size, mlp_ratio=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    if family == "qwen2_5_vl":
        # window attention in the first block (windows of 2 x 2 merged tokens), full attention in the last
        vision.update(
            hidden_size=16,
            intermediate_size=32,
            out_hidden_size=hidden_size,
            window_size=4 * PATCH_SIZE,
            fullatt_block_indexes=[vision_depth - 1],
        )
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    if family == "qwen3_vl":
        text.update(head_dim=hidden_size // 4)
        text["rope_parameters"] = dict(text["rope_parameters"], mrope_interleaved=True)
        vision.update(
            hidden_size=16,
            intermediate_size=32,
            out_hidden_size=hidden_size,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        )
        return Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    raise ValueError(f"Unknown vision family {family!r}; choose from {VISION_FAMILIES}.")


def make_vision_model(family: str, processor, seed: int = 0, attn_implementation: str = "sdpa", **config_kwargs):
    """A randomly initialised vision-language model of `family`, fp32, for `processor`'s tokenizer."""
    import torch
    from transformers import AutoModelForImageTextToText

    config = copy.deepcopy(make_vision_config(family, processor.tokenizer, **config_kwargs))
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )


def random_image(height: int, width: int, seed: int = 0):
    """A random RGB `PIL.Image` (sides multiples of `2 * PATCH_SIZE` keep the processor from resizing)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def synthetic_image_pairs(n: int, image_sizes, prompt_len=(3, 8), completion_len=(1, 6), seed: int = 0):
    """`n` conversational image preference examples in TRL's vision format (`images`, `prompt`, `chosen`,
    `rejected`). `image_sizes`: for each example, a list of (height, width), cycled (an empty list: a text-only
    row)."""
    from datasets import Dataset

    rng = random.Random(seed)

    def words(spec):
        return " ".join(rng.choice(WORDS[:200]) for _ in range(rng.randint(*spec)))

    rows = []
    for i in range(n):
        sizes = image_sizes[i % len(image_sizes)]
        images = [random_image(h, w, seed=1000 * seed + 10 * i + k) for k, (h, w) in enumerate(sizes)]
        rows.append(
            {
                "images": images,  # TRL puts their placeholders before the first user message's text
                "prompt": [{"role": "user", "content": words(prompt_len)}],
                "chosen": [{"role": "assistant", "content": words(completion_len)}],
                "rejected": [{"role": "assistant", "content": words(completion_len)}],
            }
        )
    return Dataset.from_list(rows)
