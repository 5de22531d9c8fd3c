"""Vision-language models under the shared layout: each pair's images through the vision tower once, M-RoPE positions
gathered from stock's.

TRL's vision DPO collator (`DataCollatorForVisionPreference`) repeats every example's images for its chosen and its
rejected row: `pixel_values` holds each image twice, and the model runs the vision tower on both copies. The images
sit in the prompt, so in the shared layout (`trl_prefix_sharing.layout`) their placeholder tokens fall in the
shared prefix: the shared rows hold each image's tokens once, and need each image's features once.

Once per step (the policy and reference passes share it), `shared_vision_inputs` turns the stock batch's vision
inputs into the shared rows' ones:

- `position_ids` `[3, N, S]`: the multimodal rotary positions (M-RoPE: temporal, height, width rows) that the
  model itself computes for the *stock* rows (its own `compute_3d_position_ids`, the call its forward makes), moved
  to the shared positions through the layout's `stock_index`; a shared position reached from several stock rows must
  get the same value from each (checked).
- `pixel_values` and `image_grid_thw`: the images in the order their placeholder tokens appear in the shared rows.
  Each stock image occupies a run of placeholder tokens (the model fills them in row-major order, so image k takes the
  k-th run of `prod(grid_k) / merge**2` tokens); the stock images whose runs land on the same shared positions are
  the copies of one image (checked equal, pixel for pixel) and are kept once.
- `mm_token_type_ids`: moved to the shared positions like every per-token input.

The prefix-shared forward (`trl_prefix_sharing.forward`) then substitutes these for the stock ones
(`substitute`). Only the families in `VISION_MODEL_TYPES` are proven equal to stock TRL; others get a
clear error.
"""

from __future__ import annotations

import inspect

import torch

from .architectures import window_layout
from .layout import Layout


__all__ = [
    "VISION_MODEL_TYPES",
    "is_vision_config",
    "check_supported_vision_model",
    "VISION_INPUT_KEYS",
    "vision_inputs_in",
    "has_vision_inputs",
    "shared_vision_inputs",
    "substitute",
]

#: Vision-language families proven equal to stock TRL under prefix sharing (tests/equivalence/test_vision.py): images
#: only.
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

#: Stock batch keys that carry images and are replaced by their shared-row versions.
_VISION_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
#: Inputs of vision-language models that are not laid out yet.
_UNSUPPORTED_KEYS = (
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "token_type_ids",
    "image_sizes",
    "pixel_attention_mask",
    "image_position_ids",
    "mm_encoder_outputs",
    "rope_deltas",
    "num_images",
    "spatial_shapes",
    "num_tiles",
)
#: Every model input that carries images or videos (what a text-only layout refuses).
VISION_INPUT_KEYS = (*_VISION_KEYS, *_UNSUPPORTED_KEYS)


def is_vision_config(config) -> bool:
    """Whether a model config is a vision-language model's (it has a vision tower config)."""
    return getattr(config, "vision_config", None) is not None


def check_supported_vision_model(config) -> None:
    """Raise a clear error for a vision-language model whose layout under prefix sharing is not proven exact."""
    model_type = getattr(config, "model_type", None)
    if model_type not in VISION_MODEL_TYPES:
        raise ValueError(
            f"Prefix sharing supports the vision-language model types {', '.join(VISION_MODEL_TYPES)}; this model is "
            f"'{model_type}'. Its image features, image positions and attention are not proven to honour the shared "
            "layout, so its log-probs could differ from stock TRL. Train it with `prefix_sharing=False`."
        )
    if window_layout(config)[0] is not None:
        raise ValueError(
            f"Prefix sharing does not support sliding-window attention in vision-language models ('{model_type}' "
            "with `use_sliding_window=True`): not proven exact. Train it with `prefix_sharing=False`."
        )


def vision_inputs_in(inputs) -> list[str]:
    """The keys of a stock batch (or a forward's keyword arguments) that carry images or videos."""
    return [key for key in VISION_INPUT_KEYS if inputs.get(key) is not None]


def has_vision_inputs(inputs) -> bool:
    """Whether a stock batch carries a vision-language collator's inputs."""
    return bool(vision_inputs_in(inputs))


def _check_keys(inputs) -> None:
    present = [key for key in _UNSUPPORTED_KEYS if inputs.get(key) is not None]
    if present:
        raise ValueError(
            f"Prefix sharing lays out images only; the batch has {present} (videos or inputs of other vision "
            "families), which are not supported yet. Train with `prefix_sharing=False`."
        )


def _no_cache(method) -> dict:
    """`{<the method's cache argument>: None}`: transformers 5.24 renamed `past_key_values` to `cache` (the old name
    accepted, with a deprecation warning, until 5.40)."""
    return {"cache": None} if "cache" in inspect.signature(method).parameters else {"past_key_values": None}


def _stock_position_ids(base_model, inputs) -> torch.Tensor:
    """M-RoPE positions `[3, R, L]` of the stock rows, computed by the model's own code as its forward does."""
    input_ids = inputs["input_ids"]
    position_ids = base_model.compute_3d_position_ids(
        input_ids=input_ids,
        inputs_embeds=None,
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=None,
        attention_mask=inputs.get("attention_mask"),
        **_no_cache(base_model.compute_3d_position_ids),
        mm_token_type_ids=inputs.get("mm_token_type_ids"),
    )
    if position_ids is None:  # no image in the batch: the text model counts 0, 1, 2, ... along every row
        rows, length = input_ids.shape
        position_ids = torch.arange(length, device=input_ids.device).view(1, 1, -1).expand(3, rows, -1)
    return position_ids


def _to_shared(values: torch.Tensor, index: torch.Tensor, base: torch.Tensor, what: str) -> torch.Tensor:
    """Scatter per-token `values` `[..., R, L]` of the stock rows to the shared rows (`base` `[..., N, S]`
    fills padding); every shared position must receive one value, whichever stock row it comes from."""
    real = index >= 0
    lead = values.shape[:-2]
    shared = base.clone().reshape(*lead, -1)
    source = values[..., real]
    shared[..., index[real]] = source.to(shared.dtype)
    if not torch.equal(shared[..., index[real]], source.to(shared.dtype)):
        raise RuntimeError(f"Prefix-sharing layout error: two stock rows give one shared position different {what}.")
    return shared.view_as(base)


def shared_vision_inputs(model, inputs, layout) -> dict[str, torch.Tensor]:
    """The shared rows' vision inputs (see the module docstring) for the stock batch `inputs` and its `layout`.

    `model`: the (unwrapped) vision-language model; its backbone computes the stock M-RoPE positions.
    """
    _check_keys(inputs)
    config = model.config
    check_supported_vision_model(config)
    base_model = getattr(model, model.base_model_prefix)
    index = layout.stock_index
    input_ids = inputs["input_ids"]
    shared_ids = layout.input_ids

    pixel_values, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
    image_token_id = config.image_token_id
    stock_tokens = (input_ids == image_token_id) & (index >= 0)
    shared_tokens = shared_ids.reshape(-1) == image_token_id
    if (pixel_values is None) != (grid is None) or (pixel_values is None and stock_tokens.any()):
        raise ValueError("The batch has image tokens, `pixel_values` or `image_grid_thw` without the others.")
    if grid is not None:
        merge = config.vision_config.spatial_merge_size
        tokens_per_image = (grid.prod(-1) // merge**2).tolist()
        patches_per_image = grid.prod(-1).tolist()
        if sum(tokens_per_image) != int(stock_tokens.sum()) or sum(patches_per_image) != pixel_values.shape[0]:
            raise ValueError(
                "Image features and image tokens do not match: the batch has "
                f"{int(stock_tokens.sum())} image tokens for {sum(tokens_per_image)} image features (stock TRL fails "
                "here too). A `max_length` that cuts into the prompt's image tokens causes it: raise `max_length` or "
                "set it to None."
            )

    stock_positions = _stock_position_ids(base_model, inputs)
    base_positions = layout.position_ids.to(stock_positions.device).unsqueeze(0).expand(3, -1, -1)
    out = {"position_ids": _to_shared(stock_positions, index, base_positions, "M-RoPE positions")}

    mm_token_type_ids = inputs.get("mm_token_type_ids")
    if mm_token_type_ids is not None:
        out["mm_token_type_ids"] = _to_shared(mm_token_type_ids, index, torch.zeros_like(shared_ids), "token types")

    if grid is None:
        return out
    # where each stock image's tokens land in the shared rows (the model fills placeholders in row-major order)
    landing = index[stock_tokens].split(tokens_per_image)
    patch_slices = pixel_values.split(patches_per_image)
    kept, seen = [], {}
    for k, positions in enumerate(landing):
        key = tuple(positions.tolist())
        if key in seen:  # another row's copy of an image already kept (the chosen and rejected rows of a pair)
            first = seen[key]
            if not (torch.equal(grid[first], grid[k]) and torch.equal(patch_slices[first], patch_slices[k])):
                raise ValueError(
                    "Two rows of a pair put different images at the same shared prompt positions; prefix sharing "
                    "needs the rows of a pair to carry the same images (as TRL's vision collator builds them)."
                )
            continue
        seen[key] = k
        kept.append(k)
    kept.sort(key=lambda k: int(landing[k][0]))
    order = torch.cat([landing[k] for k in kept]) if kept else index.new_zeros(0)
    if not torch.equal(order, torch.nonzero(shared_tokens).flatten().to(order.device)):
        raise ValueError(
            "An image's tokens are split between the shared prompt and the completions (or images overlap) in the "
            "shared layout, so its features cannot be computed once. This happens when an image ends the shared "
            "prefix; train this data with `prefix_sharing=False`."
        )
    out["pixel_values"] = torch.cat([patch_slices[k] for k in kept]) if kept else pixel_values[:0]
    out["image_grid_thw"] = grid[kept] if kept else grid[:0]
    return out


def substitute(kwargs: dict, layout: Layout) -> torch.Tensor:
    """Replace the stock vision inputs in a forward's `kwargs` by the shared rows' ones; return the shared rows'
    position ids (M-RoPE rows for a vision batch, the layout's own otherwise)."""
    vision = layout.vision
    if vision is None:
        present = vision_inputs_in(kwargs)
        if present:
            raise ValueError(
                f"Prefix sharing got vision inputs {present} without their shared layout: call the model through the "
                "trainer (it lays out the images once per step), or train with `prefix_sharing=False`."
            )
        return layout.position_ids
    _check_keys(kwargs)
    for key in _VISION_KEYS:
        kwargs.pop(key, None)
    kwargs.update({key: value for key, value in vision.items() if key != "position_ids"})
    return vision["position_ids"]
