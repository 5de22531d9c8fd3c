"""Prompt-learning PEFT under prefix sharing: the virtual tokens as one root every row shares.

PEFT's prompt tuning and P-tuning (`PromptTuningConfig`, `PromptEncoderConfig`) put `n` learned embeddings before
every row: the base model gets `inputs_embeds` `[v_1 .. v_n | row]`, the attention mask and the labels extended by `n`
columns (the labels with -100), and numbers the positions by the columns of the extended rows. Prefix tuning
(`PrefixTuningConfig`) gives every layer `n` learned keys and values before every row, as a cache, the attention mask
extended by `n` and the rows' positions offset by `n`. Either way every stock row starts with the same block, which
stock computes (or reads) once per row. Here it is one root of the trie every row shares: one copy, visible to every
token after it, every token at the position of its extended stock row. That gives stock's numbers.

- **Virtual embeddings** (prompt tuning, P-tuning, `EMBEDS`): the layout of the extended rows `[virtual keys | stock
  row]` (`rooted_rows`: the stock rows read back from the layout the trainer built, after `n` keys no token has,
  `StockRows.root`), laid out once per layout by the session, for the same kernel. Every row joins one document (the
  root is on every path). The forward lays PEFT's stock `inputs_embeds` into the shared rows by a gather: each shared
  position takes the embeddings of the first stock place that maps to it (`VirtualRows.first`), so the prompt
  encoder's gradient arrives through one copy, which equals the sum over stock's copies. The per-token outputs are
  gathered back to the extended stock rows `[B, n + L]`, as PEFT's base model returns them.
- **Virtual keys and values** (prefix tuning, `CACHE`): the shared rows as the trainer laid them out, positions offset
  by `n`; the first stock row's keys and values of the cache (every row's are the same) are read by every shared row,
  before its own keys, through `n` mask columns every query sees. A dense mask only (SDPA, eager): the varlen kernel's
  segments and FlexAttention's block mask take no keys outside the rows.

The reference pass (the adapter disabled) has no virtual tokens and runs the layout as it is. What is refused, and why,
is checked before anything trains (`support.check_prompt_learning`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .attention import MaskInputs
from .layout import Layout
from .trie import StockRows


__all__ = [
    "CACHE",
    "CACHES",
    "EMBEDS",
    "GENERATED_ROWS",
    "LAID_OUT",
    "VirtualRows",
    "VirtualTokens",
    "computed_rows",
    "peft_type",
    "peft_wrapper",
    "prompt_learning_config",
    "rooted_rows",
    "virtual_inputs",
    "with_virtual",
]

#: virtual tokens given to the base model as embeddings before every row (prompt tuning, P-tuning)
EMBEDS = "embeddings"
#: virtual tokens given to the base model as keys and values before every row, a cache (prefix tuning)
CACHE = "cache"
#: PEFT's prompt-learning methods (`PeftType` names) prefix sharing lays out, and how their virtual tokens arrive
LAID_OUT = {"PROMPT_TUNING": EMBEDS, "P_TUNING": EMBEDS, "PREFIX_TUNING": CACHE}
#: a model's cache argument under either of its names (transformers 5.24 renamed `past_key_values` to `cache`)
CACHES = ("past_key_values", "cache")
#: why the trainers that generate their rows (GRPO, RLOO, online DPO) do not lay out virtual tokens
GENERATED_ROWS = (
    "its rows are generated after left-padded prompts, and PEFT puts the virtual tokens before the padding, so their "
    "distance to a row's tokens counts that row's padding: they are no block the rows share"
)
#: the key of virtual token 0 in a rooted layout's rows (token j: this + j): below every token id and every key
#: `trie.py` gives a column without a token, so no token equals it
VIRTUAL_KEY = -(1 << 40)


def peft_wrapper(model):
    """The PEFT model among `model` and the modules under its DDP/DeepSpeed wrappers (`.module`), or None."""
    while isinstance(model, torch.nn.Module):
        if hasattr(model, "active_peft_config") and hasattr(model, "get_base_model"):
            return model
        model = model.__dict__.get("_modules", {}).get("module")
    return None


def peft_type(config) -> str:
    """The name of a PEFT config's method (`PeftType`), e.g. `"P_TUNING"`."""
    kind = getattr(config, "peft_type", None)
    return str(getattr(kind, "value", kind))


def prompt_learning_config(model, peft_config=None):
    """The prompt-learning PEFT config the policy trains with: `peft_config` (TRL wraps the model in it), or the active
    adapter's of a PEFT model given as `model` (under its DDP/DeepSpeed wrappers too); None for any other kind
    (LoRA-style adapters) or none."""
    for config in (peft_config, getattr(peft_wrapper(model), "active_peft_config", None)):
        if config is not None and getattr(config, "is_prompt_learning", False):
            return config
    return None


def rooted_rows(layout: Layout, count: int) -> StockRows:
    """The stock rows `[virtual keys | stock row]`: `layout`'s stock rows (read back from its shared rows) after
    `count` virtual keys every row shares, the root of one trie (`StockRows.root`). Laid out, their positions are the
    columns of the extended rows, as PEFT's base model numbers them."""
    index = layout.stock_index
    real = index >= 0
    num_rows = index.shape[0]
    ids = torch.where(real, layout.input_ids.reshape(-1)[index.clamp(min=0)], 0)  # padding: any id, masked
    keys = (VIRTUAL_KEY + torch.arange(count, device=index.device)).expand(num_rows, count)
    ones = torch.ones((num_rows, count), dtype=torch.long, device=index.device)
    return StockRows(
        torch.cat([keys, ids], dim=1), torch.cat([ones, real.long()], dim=1), root=count, check=layout.check
    )


def _first_places(layout: Layout) -> torch.Tensor:
    """`[N * S]`: for every position of the shared rows, the first stock place (flat, into `[R * L]`) that maps to it;
    place 0 for the shared rows' padding (any stock embedding: a padding position reads nothing else)."""
    index = layout.stock_index.reshape(-1)
    size = layout.input_ids.numel()
    places = torch.arange(index.numel(), device=index.device)
    target = torch.where(index >= 0, index, size)  # stock padding: one slot past the shared rows, dropped
    first = torch.zeros(size + 1, dtype=torch.long, device=index.device)
    return first.scatter_reduce_(0, target, places, reduce="amin", include_self=False)[:size]


def _prefixed(attention, count: int) -> MaskInputs:
    """The dense mask of `attention` with `count` key columns before the rows' own, which every query sees (prefix
    tuning's keys and values)."""
    mask = getattr(attention, "mask", None)
    if not isinstance(attention, MaskInputs) or not isinstance(mask, torch.Tensor):
        raise ValueError(
            "Prefix tuning under prefix sharing needs the dense mask (`prefix_sharing_attn_implementation='sdpa'`): "
            "its virtual keys and values go before every shared row's keys, which the varlen kernel's segments, "
            "FlexAttention's block mask and masks per layer type do not take."
        )
    front = (torch.ones if mask.dtype == torch.bool else torch.zeros)(
        (*mask.shape[:-1], count), dtype=mask.dtype, device=mask.device
    )
    return MaskInputs(torch.cat([front, mask], dim=-1))


@dataclass
class VirtualRows:
    """A layout's rows with the policy's virtual tokens before them (`Layout.virtual`), as its shared forward runs
    them: `layout` (the rooted rows for `EMBEDS`, the rows with the virtual keys' mask columns and offset positions
    for `CACHE`), and for `EMBEDS` the stock place each shared position reads its embeddings from (`first`)."""

    kind: str
    count: int
    layout: Layout
    first: torch.Tensor | None = None

    def to(self, device, non_blocking: bool = False) -> VirtualRows:
        first = None if self.first is None else self.first.to(device, non_blocking=non_blocking)
        return replace(self, layout=self.layout.to(device, non_blocking), first=first)


@dataclass(frozen=True)
class VirtualTokens:
    """PEFT's `count` virtual tokens before every row of the policy, given as embeddings (`EMBEDS`) or as keys and
    values (`CACHE`); a session's (`PrefixSharingSession.virtual`)."""

    kind: str
    count: int

    def lay_out(self, layout: Layout, lay_out_rows) -> VirtualRows:
        """`layout`'s rows with the virtual tokens before them (`VirtualRows`). `layout` has its attention inputs;
        `lay_out_rows(stock)`: the session's layout of stock rows for `layout`'s kernel, with its attention inputs
        (one layout build)."""
        if self.kind == CACHE:
            positions = layout.position_ids + self.count
            prefixed = replace(layout, position_ids=positions, attention=_prefixed(layout.attention, self.count))
            return VirtualRows(self.kind, self.count, prefixed)
        rooted = lay_out_rows(rooted_rows(layout, self.count))
        return VirtualRows(self.kind, self.count, rooted, _first_places(rooted))


def with_virtual(session, layout: Layout) -> Layout:
    """`layout` (prepared by `session`, a `PrefixSharingSession`) with its rows behind the policy's virtual tokens
    (`Layout.virtual`, once per layout, for its kernel: `PrefixSharingSession.layout_like`) where the session's policy
    has a prompt-learning adapter; stock rows run as they are. Returns the layout."""
    if session.virtual is not None and layout.virtual is None and not layout.is_stock:
        layout.virtual = session.virtual.lay_out(layout, functools.partial(session.layout_like, layout))
    return layout


def computed_rows(layout: Layout, attention_mask: torch.Tensor) -> tuple[Layout, torch.Tensor]:
    """What a forward of the policy computes for `layout`, and the attention mask of the stock rows it stands for:
    with virtual embeddings, the rooted rows, and the stock rows with their virtual tokens (as stock computes them);
    else `layout` and `attention_mask` (prefix tuning's keys and values are no positions, in stock either)."""
    virtual = layout.virtual
    if virtual is None or virtual.kind != EMBEDS:
        return layout, attention_mask
    return virtual.layout, torch.nn.functional.pad(attention_mask, (virtual.count, 0), value=1)


def _shared_cache(cache, count: int, num_rows: int):
    """A cache holding, for each of `num_rows` shared rows, the virtual keys and values of the stock `cache` (its first
    row's: every row's are the same), so every shared row reads one copy."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", ())
    if type(cache) is not DynamicCache or any(type(layer) is not DynamicLayer for layer in layers):
        raise ValueError(
            f"Prefix sharing lays out prefix tuning's keys and values from a `DynamicCache` of full-attention layers; "
            f"this model's cache is a {type(cache).__name__}. Train it with `prefix_sharing=False`."
        )
    if cache.get_seq_length() != count:
        raise ValueError(f"The prefix-tuning cache holds {cache.get_seq_length()} positions, not {count}.")
    return DynamicCache(
        [
            (layer.keys[:1].expand(num_rows, -1, -1, -1), layer.values[:1].expand(num_rows, -1, -1, -1))
            for layer in layers
        ]
    )


def virtual_inputs(kwargs: dict, layout: Layout) -> tuple[Layout, dict, int]:
    """The layout a shared call runs and its model inputs: for PEFT's call of the base model with the virtual tokens
    its layout was laid out for (`inputs_embeds` `n` columns wider than the stock rows, or a cache of `n` positions),
    `layout.virtual`'s rows and their inputs (the shared embeddings, or the shared cache), taken out of `kwargs`;
    else `layout` and its token ids (any other `inputs_embeds` or cache is left in `kwargs` for the caller to refuse).
    Also the columns PEFT put before the stock attention mask that the layout does not hold (the cache's)."""
    virtual = layout.virtual
    embeds = kwargs.get("inputs_embeds")
    if virtual is not None and virtual.kind == EMBEDS and embeds is not None and kwargs.get("input_ids") is None:
        if embeds.shape[1] == layout.stock_index.shape[1] + virtual.count:
            del kwargs["inputs_embeds"]
            rooted = virtual.layout
            shared = embeds.reshape(-1, embeds.shape[-1])[virtual.first]
            return rooted, {"inputs_embeds": shared.view(*rooted.input_ids.shape, -1)}, 0
    name = next((name for name in CACHES if kwargs.get(name) is not None), None)
    if virtual is not None and virtual.kind == CACHE and name is not None and embeds is None:
        cache = _shared_cache(kwargs.pop(name), virtual.count, layout.input_ids.shape[0])
        return virtual.layout, {"input_ids": layout.input_ids, name: cache}, virtual.count
    return layout, {"input_ids": layout.input_ids}, 0
