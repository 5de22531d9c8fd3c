"""The prefix-shared forward: run the model on shared rows, hand back outputs in the stock layout.

Two kinds of model: causal LMs under TRL's fused LM head (DPO), and sequence-classification models (reward models).

TRL's trainers call `model(input_ids, attention_mask, labels=..., fused_lm_head=True)` on the stock batch and read
per-token fields of shape `[rows, length - 1]`. `install_prefix_sharing_forward` wraps that (already fused)
forward on one model instance: when the call carries a `prefix_sharing` layout (added by
`PrefixSharingCollator`), the backbone and the LM head run on the shared rows
only, and every per-token field is gathered back to the stock positions. Everything downstream (losses, metrics,
reference passes) is TRL's own code, unchanged. Without a layout, or for a plain (non-fused) call such as generation,
the model's forward is untouched. The mask (or the varlen kernel's segments) travels as a forward argument, so
gradient checkpointing's recomputation sees it. `remove_prefix_sharing_forward` undoes the wrap.

A call with a layout but without `fused_lm_head` (a trainer that reads logits in stock, such as online DPO with
half-precision logits) runs the model's own forward on the shared rows and gathers the logits back to the stock rows
(`_shared_logits_forward`). A model that accelerate had already wrapped in mixed precision when the wrap was
installed (a reference model prepared in TRL's `__init__`) runs its shared calls inside that same autocast, with
outputs converted to float32 as accelerate's wrapper does: the shared path may call the backbone directly (TRL's fused
head does), around the wrapper that sits on `model.forward`.
"""

from __future__ import annotations

import functools
import types

import torch

from .layout import Layout, gather_to_stock, shared_labels
from .patching import is_patched, patch_of, patch_own, put_back_own
from .virtual import CACHES, virtual_inputs
from .vision import substitute as substitute_vision_inputs


__all__ = [
    "install_prefix_sharing_forward",
    "remove_prefix_sharing_forward",
    "has_prefix_sharing_forward",
    "prefix_sharing_forward",
    "unwrap_model",
    "check_layout_matches",
    "wrapped_in_mixed_precision",
    "stock_logits_dtype",
]

_ORIGINAL = "_prefix_sharing_original_forward"
_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
#: what accelerate's `prepare_model` keeps on a model whose forward it wrapped in autocast (native mixed precision)
_ACCELERATE_UNWRAPPED_FORWARD = "_original_forward"


def unwrap_model(model):
    """The transformers model under DDP/DeepSpeed (`.module`) and PEFT (`get_base_model()`) wrappers."""
    *_, model = _wrappers(model)
    return model


def _wrappers(model):
    """The model, then every module under its DDP/DeepSpeed (`.module`) and PEFT wrappers, the transformers model
    last."""
    yield model
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
        yield model
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        yield model.get_base_model()


def wrapped_in_mixed_precision(model) -> bool:
    """Whether accelerate's native mixed precision wraps the forward of `model` or of a module under it: its calls
    then run in autocast and return float32 outputs (accelerate's `convert_outputs_to_fp32`)."""
    return any(_ACCELERATE_UNWRAPPED_FORWARD in module.__dict__ for module in _wrappers(model))


def stock_logits_dtype(model) -> torch.dtype:
    """The dtype of the logits stock's `model(...)` returns, which its `log_softmax` runs in: float32 behind
    accelerate's mixed-precision wrapper (it converts the outputs), otherwise the LM head's dtype."""
    if wrapped_in_mixed_precision(model):
        return torch.float32
    weight = unwrap_model(model).get_output_embeddings().weight
    return weight.dtype if weight.is_floating_point() else torch.float32


def check_layout_matches(layout: Layout, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
    """Refuse a layout that does not hold exactly the stock batch's tokens (e.g. a collator that changed the batch).
    The shapes always; the tokens and the padding when the layout asks for checks (`layout.check`, see
    `prefix_sharing_checks`: comparing them reads back from the device). Without `input_ids` (PEFT's virtual
    embeddings, which carry the tokens as embeddings), the shape and the padding of `attention_mask`."""
    index = layout.stock_index
    stock = input_ids if input_ids is not None else attention_mask
    if stock is None or index.shape != stock.shape:
        raise RuntimeError(
            "Prefix-sharing layout does not match the stock batch (its shape differs). The layout must be built "
            "by PrefixSharingCollator from the same batch; a custom data collator has to emit right-padded "
            "`input_ids`/`attention_mask` and let PrefixSharingCollator wrap it."
        )
    if not layout.check:
        return
    real = index >= 0
    if attention_mask is not None:  # the stock tokens, and the padding after them where the layout scores it
        attention_mask = attention_mask.cumsum(dim=1) > 0 if layout.key_visible is not None else attention_mask.bool()
    if attention_mask is not None and not torch.equal(real, attention_mask):
        raise RuntimeError(
            "Prefix-sharing layout does not match the stock batch (shape or padding differ). The layout must be built "
            "by PrefixSharingCollator from the same batch; a custom data collator has to emit right-padded "
            "`input_ids`/`attention_mask` and let PrefixSharingCollator wrap it."
        )
    if input_ids is not None and not torch.equal(layout.input_ids.reshape(-1)[index[real]], input_ids[real]):
        raise RuntimeError("Prefix-sharing layout does not hold the stock batch's tokens.")


def _take_stock_inputs(kwargs: dict, layout: Layout, replaced: tuple[str, ...]):
    """The start of every shared call: the layout the call runs (for PEFT's call with its virtual tokens,
    `layout.virtual`'s rows: `virtual.virtual_inputs`), the inputs the layout replaces refused (`replaced`), the
    stock `input_ids` and `attention_mask` taken out of `kwargs` and the layout checked against them. Returns that
    layout, the stock attention mask of its rows, and the model inputs of the shared rows: their tokens (or
    embeddings, and a cache), what the attention backend adds (its mask, or the varlen kernel's segments) and their
    position ids (a vision batch's inputs in `kwargs` swapped for the shared rows': images once per pair, M-RoPE
    rows)."""
    layout, inputs, virtual_columns = virtual_inputs(kwargs, layout)
    for name in replaced:
        if kwargs.get(name) is not None:
            raise ValueError(f"Prefix sharing builds its own inputs; `{name}` cannot be passed alongside the layout.")
    if layout.attention is None:
        raise RuntimeError(
            "The prefix-sharing attention inputs were not built for this batch. Call the model through the trainer "
            "(it builds them once per step, shared by the policy and reference passes)."
        )
    inputs.update(layout.attention.model_kwargs(), position_ids=substitute_vision_inputs(kwargs, layout))
    input_ids = kwargs.pop("input_ids", None)
    stock_attention_mask = kwargs.pop("attention_mask", None)
    if stock_attention_mask is not None:
        stock_attention_mask = stock_attention_mask[:, virtual_columns:]  # prefix tuning's keys: not in the layout
    check_layout_matches(layout, input_ids, stock_attention_mask)
    kwargs.pop("use_cache", None)  # the shared calls never cache
    return layout, stock_attention_mask, inputs


def _shared_forward(original_forward, kwargs: dict, layout: Layout):
    from trl.trainer.utils import FusedCausalLMOutput

    # stock `shift_labels` (a label for every column, the last included) or `labels` (shifted here, as stock shifts)
    shift_labels = kwargs.pop("shift_labels", None)
    labels = kwargs.pop("labels", None)
    layout, stock_attention_mask, inputs = _take_stock_inputs(
        kwargs, layout, ("inputs_embeds", "position_ids", *CACHES)
    )
    if (labels is None) == (shift_labels is None):
        raise ValueError("The prefix-shared fused forward needs `labels` or `shift_labels` (one of them).")
    shifted = shift_labels is not None
    stock_labels = shift_labels if shifted else labels
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)

    model = original_forward.__self__
    text_config = model.config.get_text_config()
    # MoE: the load-balancing loss is computed over the stock tokens with the stock 2-D mask, from the router logits
    # gathered to the stock positions; the fused head (which would use the shared rows and the 4-D mask) is not asked
    moe = hasattr(text_config, "output_router_logits")
    wanted = kwargs.pop("output_router_logits", getattr(text_config, "output_router_logits", False))
    router_logits = [] if wanted else None
    hooks = [] if router_logits is None else _capture_router_logits(model.base_model, router_logits)
    try:
        outputs = original_forward(
            **inputs,
            shift_labels=shared_labels(layout, stock_labels, check=layout.check, shifted=shifted),
            **({"output_router_logits": False} if moe else {}),
            **kwargs,
        )
    finally:
        for hook in hooks:
            hook.remove()

    index = layout.stock_index if shifted else layout.stock_index[:, :-1]
    valid = (index >= 0) & ((shift_labels if shifted else labels[:, 1:]) != -100)
    fields = {}
    for name in _PER_TOKEN_FIELDS:
        value = getattr(outputs, name)
        fill = False if name == "is_top1" else 0
        fields[name] = None if value is None else gather_to_stock(value, index, valid, fill)
    denominator = valid.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / denominator  # the stock definition, over the stock positions
    aux_loss = outputs.aux_loss
    if router_logits is not None:
        aux_loss = _stock_aux_loss(router_logits[0], layout, stock_attention_mask, text_config)
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    return FusedCausalLMOutput(loss=loss, label_mask=valid, aux_loss=aux_loss, **fields)


def _shared_logits_forward(original_forward, kwargs: dict, layout: Layout):
    """The model's own (unfused) forward on the shared rows; its logits gathered back to the stock rows, for the last
    `logits_to_keep` stock columns (all of them when 0), as the stock call would return them. Only the logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    layout, _, inputs = _take_stock_inputs(
        kwargs, layout, ("inputs_embeds", "position_ids", "labels", "shift_labels", *CACHES)
    )
    keep = kwargs.pop("logits_to_keep", 0)
    kwargs.pop("fused_lm_head", None)
    if not isinstance(keep, int):
        raise ValueError("The prefix-shared forward keeps the last `logits_to_keep` stock columns: give an int.")
    if hasattr(original_forward.__self__.config.get_text_config(), "output_router_logits"):
        kwargs["output_router_logits"] = False  # MoE: the auxiliary loss is not returned here (it needs stock's rows)
    logits = original_forward(**inputs, use_cache=False, **kwargs).logits
    index = layout.stock_index[:, -keep:]
    return CausalLMOutputWithPast(logits=gather_to_stock(logits, index, index >= 0))


def _capture_router_logits(backbone, captured: list) -> list:
    """Scoped hooks on the backbone: it returns its router logits (appended to `captured`) for this call."""

    def request(module, args, kwargs):
        return args, {**kwargs, "output_router_logits": True}

    def capture(module, args, kwargs, output):
        captured.append(output.router_logits)

    return [
        backbone.register_forward_pre_hook(request, with_kwargs=True),
        backbone.register_forward_hook(capture, with_kwargs=True),
    ]


def _stock_aux_loss(router_logits, layout: Layout, stock_attention_mask, text_config):
    """The load-balancing loss TRL's fused head computes on the stock batch: per layer, the shared rows' router logits
    gathered to the stock positions (a prompt token counts once per stock row, as in stock), the stock 2-D mask."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    if stock_attention_mask is None:
        raise ValueError("The router's auxiliary loss under prefix sharing needs the stock `attention_mask`.")
    index = layout.stock_index.reshape(-1).clamp(min=0)  # padding: any row, the stock mask drops it
    gathered = tuple(layer.reshape(-1, layer.shape[-1])[index] for layer in router_logits)
    return load_balancing_loss_func(
        gathered, text_config.num_experts, text_config.num_experts_per_tok, stock_attention_mask
    )


def _shared_classification_forward(model, kwargs: dict, layout: Layout):
    """Sequence classification (reward models): the backbone on the shared rows, the score head read where stock
    transformers reads it, i.e. at the rightmost token of each stock row that is not `pad_token_id`."""
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    input_ids = kwargs.get("input_ids")
    layout, _, inputs = _take_stock_inputs(kwargs, layout, ("inputs_embeds", "position_ids", "labels", *CACHES))
    kwargs.pop("margin", None)  # TRL's reward trainer hands the whole batch to the model
    hidden = getattr(model, model.base_model_prefix)(**inputs, use_cache=False, **kwargs).last_hidden_state
    pad_token_id = model.config.get_text_config().pad_token_id
    if pad_token_id is None:
        raise ValueError("Sequence classification needs `pad_token_id` in the model config to find the last token.")
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    last = (positions * (input_ids != pad_token_id)).argmax(-1)  # transformers' pooling rule, on the stock rows
    flat = layout.stock_index[torch.arange(input_ids.shape[0], device=input_ids.device), last]
    pooled = hidden.reshape(-1, hidden.shape[-1])[flat]
    return SequenceClassifierOutputWithPast(logits=model.score(pooled))


def _is_sequence_classifier(model) -> bool:
    if not type(model).__name__.endswith("ForSequenceClassification"):
        return False
    if not isinstance(getattr(model, "score", None), torch.nn.Module) or not hasattr(model, model.base_model_prefix):
        raise ValueError(
            f"{type(model).__name__} has no `score` head or no `{model.base_model_prefix}` backbone, which the "
            "prefix-shared reward forward reads. Train it with `prefix_sharing=False`."
        )
    return True


def install_prefix_sharing_forward(model, autocast=None, route=None, switch=None) -> None:
    """Wrap `model.forward` to accept a `prefix_sharing` layout: for a causal LM, the forward TRL's
    `add_fused_lm_head` patched (used with `fused_lm_head=True`; without it, the logits of the model's own forward,
    see `_shared_logits_forward`); for a sequence classifier, its own forward.

    `autocast`: the autocast of accelerate's mixed precision (a callable returning a context manager, e.g.
    `accelerator.autocast`). If accelerate already wrapped this model's forward in it, the shared calls run inside
    it and return float32 outputs, as the wrapped forward does (they may call the backbone around the wrapper).
    `route`: for a trainer whose TRL code calls the model without a layout (KTO): `route(model, kwargs)` is asked
    about every fused call (`fused_lm_head=True`) that has none, and returns the layout of the stock rows the call
    holds, or a finished output, or None (the call runs as stock).
    `switch`: `switch(model, layout)` before every call with a layout: the attention implementation the layout was
    laid out for (a session that chooses the kernel per micro-batch). A layout of stock's own rows
    (`Layout.is_stock`) runs the model's own forward on the call as it is.
    Scoped to this model instance and idempotent; undone by `remove_prefix_sharing_forward`.
    """
    if is_patched(model, _ORIGINAL):
        return  # installed (and perhaps wrapped since by accelerate's mixed precision, around it)
    original_forward = model.forward
    if _ACCELERATE_UNWRAPPED_FORWARD not in model.__dict__:
        autocast = None  # not wrapped yet: accelerate's wrapper will sit around this one
    classifier = _is_sequence_classifier(model)

    def shared(self, kwargs, layout):
        if classifier:
            return _shared_classification_forward(self, kwargs, layout)
        if kwargs.get("fused_lm_head", False):
            return _shared_forward(original_forward, kwargs, layout)
        return _shared_logits_forward(original_forward, kwargs, layout)

    @functools.wraps(type(model).forward)
    def forward(self, *args, prefix_sharing=None, **kwargs):
        if prefix_sharing is None and route is not None and not args and kwargs.get("fused_lm_head", False):
            from transformers.utils import ModelOutput

            prefix_sharing = route(self, kwargs)
            if isinstance(prefix_sharing, ModelOutput):
                return prefix_sharing  # an output the route already computed (rows computed with other rows)
        if prefix_sharing is None:
            return original_forward(*args, **kwargs)
        if switch is not None:
            switch(self, prefix_sharing)
        if prefix_sharing.is_stock:
            return original_forward(*args, **kwargs)
        if args:
            raise TypeError("The prefix-shared forward takes keyword arguments only.")
        if autocast is None:
            return shared(self, kwargs, prefix_sharing)
        from accelerate.utils import convert_to_fp32

        with autocast():
            return convert_to_fp32(shared(self, kwargs, prefix_sharing))

    patch_own(model, "forward", _ORIGINAL, types.MethodType(forward, model))


def remove_prefix_sharing_forward(model) -> bool:
    """Put back the forward that `install_prefix_sharing_forward` wrapped. Where accelerate has since wrapped the
    shared forward in its mixed precision (a model prepared for training), taking it out would drop that wrapper too:
    it stays beneath it, passing every call without a layout through unchanged, and False is returned."""
    return put_back_own(model, "forward", _ORIGINAL)


def has_prefix_sharing_forward(model) -> bool:
    """Whether a call of `model` reaches the shared forward: it is `model.forward`, or the forward that accelerate's
    mixed-precision wrapper on `model.forward` calls. False when something replaced it (e.g. a kernel library's
    patch of the model's forward at the start of training)."""
    ours = patch_of(model, _ORIGINAL)
    if ours is None:
        return False
    return model.__dict__.get("forward") is ours or model.__dict__.get(_ACCELERATE_UNWRAPPED_FORWARD) is ours


def prefix_sharing_forward(model):
    """The shared forward installed on `model`, beneath any wrapper put around it since. For a call made from inside
    the model's own forward (KTO's merged pass), which already runs inside that wrapper: accelerate's wrapper holds
    one `torch.autocast` object, and re-entering it leaves autocast on after the outer call exits."""
    ours = patch_of(model, _ORIGINAL)
    if ours is None:
        raise RuntimeError("Prefix sharing's forward is not installed on this model.")
    return ours
