"""The prefix-sharing attention mask: the one definition, in FlexAttention `mask_mod` form.

The shared rows (`trl_prefix_sharing.layout`) hold a prefix trie laid out depth-first, so the tokens under a key
form one span, `[k, subtree_end[k])`. Every token carries:

- `subtree_end`: where the subtree of the token ends (padding: right after itself),
- `position_ids`: the position the token has in the ordinary, unshared sequence (for sliding windows),
- `key_visible` (only where a trainer scores stock's padding): False for padding that is a query but never a key.

`on_path` is the whole rule: a query sees a key when the key is on its path from the root, `k <= q <
subtree_end[k]`. It is causal and keeps documents (packing) and sibling subtrees apart by construction. Drawn for one
pair `[p p p | c c | r r r]` (`subtree_end` 8 8 8 5 5 8 8 8; the rejected branch starts with a copy of the last
prompt token)::

        p p p c c r r r   (keys)
    p   x . . . . . . .
    p   x x . . . . . .
    p   x x x . . . . .
    c   x x x x . . . .
    c   x x x x x . . .
    r   x x x . . x . .
    r   x x x . . x x .
    r   x x x . . x x x

Both the FlexAttention `BlockMask` (CUDA) and the dense boolean mask (SDPA, any device) are derived from these
functions, so there is nothing else to keep in sync.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import and_masks


__all__ = [
    "causal",
    "same_document",
    "on_path",
    "sliding_window",
    "visible_key",
    "prefix_sharing_mask",
    "dense_mask",
    "block_mask",
]


def causal(b, h, q_idx, kv_idx):
    """A query sees keys at or before it."""
    return q_idx >= kv_idx


def same_document(document_ids: torch.Tensor):
    """A query sees keys of its own document (packing: no token sees another example)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return document_ids[b, q_idx] == document_ids[b, kv_idx]

    return mask_mod


def on_path(subtree_end: torch.Tensor):
    """A query sees the keys on its path from the root of the trie: a key whose subtree `[k, subtree_end[k])`
    holds the query. Siblings' subtrees (other completions), other documents and later tokens are outside it."""

    # the query's own index is read from a tensor rather than compared as a number: torch 2.13's CPU FlexAttention
    # kernel generates invalid C++ for `q_idx < subtree_end[b, kv_idx]` once the row count is dynamic
    query = torch.arange(subtree_end.shape[-1], device=subtree_end.device).expand_as(subtree_end)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (query[b, q_idx] < subtree_end[b, kv_idx])

    return mask_mod


def sliding_window(position_ids: torch.Tensor, window: int | torch.Tensor):
    """Sliding-window attention measured in the original positions (as transformers does: `q - kv < window`).
    `window` may be a 0-d tensor (on the ids' device), which compiled code does not specialise on."""

    def mask_mod(b, h, q_idx, kv_idx):
        return position_ids[b, q_idx] - position_ids[b, kv_idx] < window

    return mask_mod


def visible_key(key_visible: torch.Tensor):
    """Keys marked invisible are seen by no query: stock's padding, whose queries are scored but whose keys are
    masked."""

    def mask_mod(b, h, q_idx, kv_idx):
        return key_visible[b, kv_idx]

    return mask_mod


def prefix_sharing_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    window: int | torch.Tensor | None = None,
    key_visible: torch.Tensor | None = None,
):
    """The prefix-sharing `mask_mod`: `on_path` (and an optional sliding window, and invisible padding keys
    where the layout scores stock's padding).

    With one pair per row this is the paper's `!((rejected_start <= q) && (chosen_start <= kv < rejected_start))` on
    top of causal attention; with packing, `same_document` holds as well (a key's subtree never leaves its
    document).
    """
    mods = [on_path(subtree_end)]
    if window is not None:
        if position_ids is None:
            raise ValueError("A sliding window needs `position_ids`.")
        mods.append(sliding_window(position_ids, window))
    if key_visible is not None:
        mods.append(visible_key(key_visible))
    return and_masks(*mods) if len(mods) > 1 else mods[0]


def dense_mask(mask_mod, batch_size: int, q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """Evaluate a `mask_mod` on the full grid: a boolean `[batch, 1, q_len, kv_len]` tensor, True = attend.

    This is what SDPA receives where FlexAttention cannot run (CPU backward, devices without it).
    """
    b = torch.arange(batch_size, device=device).view(-1, 1, 1)
    h = torch.zeros((), dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, -1)
    return mask_mod(b, h, q, kv).expand(batch_size, q_len, kv_len).unsqueeze(1)


_compiled_create_block_mask = None


def block_mask(mask_mod, batch_size: int, q_len: int, kv_len: int, device, compile: bool | None = None):
    """The FlexAttention `BlockMask` of a `mask_mod`. `compile` (default: on CUDA) uses a compiled
    `create_block_mask`, which does not materialise the dense mask; uncompiled it does (fine for small CPU
    checks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    global _compiled_create_block_mask
    builder = create_block_mask
    if compile is None:
        compile = torch.device(device).type == "cuda"
    if compile:
        if _compiled_create_block_mask is None:
            _compiled_create_block_mask = torch.compile(create_block_mask)
        builder = _compiled_create_block_mask
    return builder(mask_mod, batch_size, None, q_len, kv_len, device=device)
