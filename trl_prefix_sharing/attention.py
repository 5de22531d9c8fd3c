"""The attention backend: which kernel runs the prefix-sharing mask (decided here, and only here), and the mask object
it receives.

The mask itself lives in `trl_prefix_sharing.mask`. Here it is turned into what the model's attention
implementation takes, through transformers' own attention functions (no custom attention name is registered, so a
saved config never names one):

- `"flex_attention"`: a FlexAttention `BlockMask` (block-sparse: fully masked blocks are skipped). CUDA only for
  training, since FlexAttention has no backward on CPU.
- `"sdpa"`: the same mask evaluated densely as a boolean `[N, 1, S, S]` tensor for
`scaled_dot_product_attention`.
- `"eager"`: the same dense mask as an additive float tensor (0 where attended, the float32 minimum elsewhere), for
  model classes that support neither (attention softcapping, sinks).

`choose_attn_implementation` decides, from the request, the device, the model classes and whether they are
vision-language models; `"auto"` is FlexAttention on CUDA and SDPA elsewhere. The switch of a model's attention
implementation is recorded and undone by `AttentionSwitch.restore`; it touches only the models given to it.
"""

from __future__ import annotations

import functools

import torch
from transformers.utils import logging

from .architectures import supported_model_types, window_layout
from .layout import Layout
from .mask import block_mask, dense_mask, prefix_sharing_mask
from .patching import patch_own, put_back_own
from .vision import VISION_MODEL_TYPES, is_vision_config


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ATTN_IMPLEMENTATIONS",
    "resolve_attn_implementation",
    "model_attn_implementation",
    "vision_attn_implementation",
    "choose_attn_implementation",
    "AttentionSwitch",
    "build_attention_mask",
    "shared_row_multiple",
]

logger = logging.get_logger(__name__)

#: Architectures measured equal to stock TRL under prefix sharing (the registry in `.architectures`).
SUPPORTED_MODEL_TYPES = supported_model_types()
ATTN_IMPLEMENTATIONS = ("auto", "flex_attention", "sdpa")
#: FlexAttention's block size (`create_block_mask`'s default): the width shared rows are rounded to under
#: FlexAttention.
FLEX_ROW_MULTIPLE = 128


def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attn_implementation(requested: str, device: torch.device) -> str:
    """`"auto"` -> FlexAttention on CUDA, SDPA elsewhere; explicit choices are checked against the device."""
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"`prefix_sharing_attn_implementation` must be one of {ATTN_IMPLEMENTATIONS}, got {requested!r}."
        )
    device = torch.device(device)
    if requested == "auto":
        return "flex_attention" if device.type == "cuda" and _flex_available() else "sdpa"
    if requested == "flex_attention":
        if not _flex_available():
            raise ValueError(
                f"FlexAttention is not available in torch {torch.__version__}. Use "
                "`prefix_sharing_attn_implementation='sdpa'` (same mask, dense) or upgrade torch."
            )
        if device.type != "cuda":
            raise ValueError(
                f"FlexAttention has no backward pass on {device.type} in torch {torch.__version__}, so it cannot "
                "train there. Use `prefix_sharing_attn_implementation='sdpa'` (or 'auto'), which applies the same "
                "mask densely through scaled_dot_product_attention."
            )
    return requested


def model_attn_implementation(model, requested: str) -> str:
    """The attention implementation this model runs the shared mask with, given the resolved request (`"sdpa"` or
    `"flex_attention"`). A model class that does not support the request (softcapping or attention sinks refuse
    SDPA, some classes refuse FlexAttention) gets the next one transformers supports for it, FlexAttention -> SDPA ->
    eager (the mask then as an additive float mask)."""
    order = ("flex_attention", "sdpa", "eager")
    supports = {
        "flex_attention": getattr(model, "_supports_flex_attn", False),
        "sdpa": getattr(model, "_supports_sdpa", False),
        "eager": True,
    }
    return next(name for name in order[order.index(requested) :] if supports[name])


def vision_attn_implementation(requested: str, resolved: str) -> str:
    """The attention for a vision-language model: SDPA with the dense mask. transformers 5.23's Qwen2-VL, Qwen2.5-VL
    and Qwen3-VL do not accept `flex_attention`, so `"auto"` (FlexAttention on CUDA) becomes SDPA for them, and an
    explicit `"flex_attention"` is an error."""
    if resolved != "flex_attention":
        return resolved
    if requested == "auto":
        return "sdpa"
    raise ValueError(
        f"The vision-language models prefix sharing supports ({', '.join(VISION_MODEL_TYPES)}) do not accept "
        "`flex_attention` in transformers; set `prefix_sharing_attn_implementation='sdpa'` (or 'auto'), which applies "
        "the same mask densely."
    )


def choose_attn_implementation(models, requested: str, device) -> str:
    """The one attention implementation the shared mask runs on for these models (policy, reference), logged.

    `requested` is `prefix_sharing_attn_implementation`; the device decides `"auto"`; vision-language models take
    SDPA; otherwise each model class takes the first of the request, SDPA and eager that it supports. One mask per step
    serves the policy and reference passes, so they must agree.
    """
    resolved = resolve_attn_implementation(requested, device)
    if any(is_vision_config(model.config) for model in models):
        choices = {vision_attn_implementation(requested, resolved)}
        reason = "vision-language models take the dense mask" if resolved == "flex_attention" else None
    else:
        choices = {model_attn_implementation(model, resolved) for model in models}
        reason = f"{type(models[0]).__name__} does not support `{resolved}` (its class declares so)"
    if len(choices) > 1:
        raise ValueError(
            f"The policy and reference models need different attention implementations under prefix sharing "
            f"({sorted(choices)}); use a reference model of the same architecture."
        )
    choice = choices.pop()
    form = {
        "flex_attention": "a block-sparse BlockMask",
        "sdpa": "a dense boolean mask",
        "eager": "a dense additive float mask",
    }[choice]
    if choice == resolved:
        how = f"'{requested}' on {torch.device(device).type}" if requested == "auto" else "as requested"
        logger.info(f"Prefix sharing: the shared mask runs on `{choice}` ({how}), as {form}.")
    else:
        logger.warning(f"Prefix sharing: the shared mask runs on `{choice}` as {form}, not `{resolved}`: {reason}.")
    return choice


def shared_row_multiple(attn_implementation: str, pad_to_multiple_of: int | None) -> int | None:
    """What the shared rows' width is rounded up to: the user's `pad_to_multiple_of`, else, under FlexAttention,
    its block size (128). The compiled `create_block_mask` and FlexAttention are specialised to shapes; a width per
    batch can only compile again (or, where dynamic shapes fail, past `torch._dynamo.config.recompile_limit` fall back
    to eager FlexAttention, which materialises the full score matrix). Block multiples leave a few widths, add no
    attention blocks (a partial block is computed whole) and at most 127 padding tokens per row to the linear layers.
    `pad_to_multiple_of=1` turns it off."""
    if pad_to_multiple_of is not None:
        return pad_to_multiple_of
    return FLEX_ROW_MULTIPLE if attn_implementation == "flex_attention" else None


#: the generation methods `AttentionSwitch` runs on the model's own attention (`generate_batch`: transformers'
#: continuous batching, TRL's `use_transformers_continuous_batching`)
GENERATION_METHODS = ("generate", "generate_batch")


def _own_key(name: str) -> str:
    """Where a model's own generation method (an instance attribute, or None for the class's) is kept while its
    wrapper is installed."""
    return f"_prefix_sharing_own_{name}"


class AttentionSwitch:
    """Set the attention implementation of given models, remembering the old one so it can be put back.

    Generation runs on the model's own implementation, as in stock TRL: `generate` and `generate_batch` (GRPO, RLOO
    and online DPO sample with them) switch back for the call. Sampling follows the logits' last bits, so generating
    through the shared mask's implementation (FlexAttention under bf16 on CUDA) would draw other completions than
    stock TRL from the same seed; it would also compile FlexAttention for every decoding length.
    """

    def __init__(self):
        self._saved: list[tuple[object, object]] = []

    def apply(self, model, attn_implementation: str) -> None:
        if any(m is model for m, _ in self._saved):
            return
        current = model.config._attn_implementation
        self._saved.append((model, current))
        if current != attn_implementation:
            model.set_attn_implementation(attn_implementation)
            if current is not None:
                for name in GENERATION_METHODS:
                    if callable(getattr(model, name, None)):
                        _generate_with(model, name, current)

    def restore(self) -> None:
        for model, old in reversed(self._saved):
            for name in GENERATION_METHODS:
                put_back_own(model, name, _own_key(name))
            if old is not None and model.config._attn_implementation != old:
                model.set_attn_implementation(old)
        self._saved.clear()


def _generate_with(model, name: str, attn_implementation: str) -> None:
    """Wrap this model instance's generation method `name` to run on `attn_implementation`, switching back
    afterwards."""
    generate = getattr(model, name)

    @functools.wraps(generate)
    def generate_as_stock(*args, **kwargs):
        shared = model.config._attn_implementation
        model.set_attn_implementation(attn_implementation)
        try:
            return generate(*args, **kwargs)
        finally:
            model.set_attn_implementation(shared)

    patch_own(model, name, _own_key(name), generate_as_stock)


@torch.no_grad()
def build_attention_mask(layout: Layout, attn_implementation: str, config):
    """The mask object for one shared batch: a `BlockMask`, a dense boolean tensor or an additive float one, or a
    per-layer-type dict when the model mixes full and sliding-window layers (Qwen2/Qwen3 with `use_sliding_window`,
    Gemma 2/3, Cohere 2, GPT-OSS, ...). Built without autograd (a mask has no gradient), so the compiled
    `create_block_mask` sees one grad mode in training and evaluation steps alike (dynamo compiles a variant per grad
    mode)."""
    subtree_end, position_ids = layout.subtree_end, layout.position_ids
    n, s = subtree_end.shape
    device = subtree_end.device

    def make(window):
        mask_mod = prefix_sharing_mask(subtree_end, position_ids, window, layout.key_visible)
        if attn_implementation == "flex_attention":
            return block_mask(mask_mod, n, s, s, device=device)
        if attn_implementation == "sdpa":
            return dense_mask(mask_mod, n, s, s, device=device)
        if attn_implementation == "eager":  # eager attention adds the mask to the scores
            allowed = dense_mask(mask_mod, n, s, s, device=device)
            return torch.zeros(allowed.shape, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(torch.float32).min
            )
        raise ValueError(f"No prefix-sharing mask for attention implementation {attn_implementation!r}.")

    window, mixed = window_layout(config)
    if attn_implementation == "flex_attention" and window is not None:
        # One mask_mod structure for every batch and layer type, the window a tensor (full layers: one that never
        # bites): compiled code is specialised to a mask_mod's structure and Python numbers, not to tensor values, so
        # full and sliding layers, short and long batches share compiled variants (else each doubles them).
        sliding = make(torch.tensor(window, device=device))
        if not mixed:
            return sliding
        return {
            "full_attention": make(torch.tensor(torch.iinfo(torch.long).max, device=device)),
            "sliding_attention": sliding,
        }
    full = make(None) if window is None or mixed else None
    if window is None:
        return full
    sliding = make(window)
    return {"full_attention": full, "sliding_attention": sliding} if mixed else sliding
