"""The prefix-sharing attention mask: the one definition, in FlexAttention ``mask_mod`` form.

A shared row holds one or more *documents* (one preference example each). A document is a shared prefix followed by
K >= 1 *branches* (the completions). Every token carries three ids, built by :mod:`trl_prefix_sharing.layout`:

- ``document_ids``: which document the token belongs to (``-1`` for padding, which then only sees padding),
- ``branch_ids``: ``0`` for the shared prefix, ``k >= 1`` for the k-th branch,
- ``position_ids``: the position the token has in the ordinary, unshared sequence,
- ``key_visible`` (only where a trainer scores stock's padding): False for padding that is a query but never a key.

``dpo_mask`` lets a query see a key when the key is earlier (causal), in the same document, and either in the shared
prefix or in the query's own branch. Drawn for one document ``[p p p | c c | r r r]``::

        p p p c c r r r   (keys)
    p   x . . . . . . .
    p   x x . . . . . .
    p   x x x . . . . .
    c   x x x x . . . .
    c   x x x x x . . .
    r   x x x . . x . .
    r   x x x . . x x .
    r   x x x . . x x x

Both the FlexAttention ``BlockMask`` (CUDA) and the dense boolean mask (SDPA, any device) are derived from these
functions, so there is nothing else to keep in sync.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import and_masks


__all__ = [
    "causal",
    "same_document",
    "prefix_or_same_branch",
    "sliding_window",
    "visible_key",
    "dpo_mask",
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


def prefix_or_same_branch(branch_ids: torch.Tensor):
    """A query sees the shared prefix (branch 0) and its own branch: completions never see each other."""

    def mask_mod(b, h, q_idx, kv_idx):
        kv_branch = branch_ids[b, kv_idx]
        return (kv_branch == 0) | (kv_branch == branch_ids[b, q_idx])

    return mask_mod


def sliding_window(position_ids: torch.Tensor, window: int | torch.Tensor):
    """Sliding-window attention measured in the original positions (as transformers does: ``q - kv < window``).
    ``window`` may be a 0-d tensor (on the ids' device), which compiled code does not specialise on."""

    def mask_mod(b, h, q_idx, kv_idx):
        return position_ids[b, q_idx] - position_ids[b, kv_idx] < window

    return mask_mod


def visible_key(key_visible: torch.Tensor):
    """Keys marked invisible are seen by no query: stock's padding, whose queries are scored but whose keys are
    masked."""

    def mask_mod(b, h, q_idx, kv_idx):
        return key_visible[b, kv_idx]

    return mask_mod


def dpo_mask(
    document_ids: torch.Tensor,
    branch_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    window: int | torch.Tensor | None = None,
    key_visible: torch.Tensor | None = None,
):
    """The prefix-sharing ``mask_mod``: causal, same document, prefix or own branch (and an optional sliding window,
    and invisible padding keys where the layout scores stock's padding).

    With one document per row and two branches this is the paper's
    ``!((rejected_start <= q) && (chosen_start <= kv < rejected_start))`` on top of causal attention.
    """
    mods = [causal, same_document(document_ids), prefix_or_same_branch(branch_ids)]
    if window is not None:
        if position_ids is None:
            raise ValueError("A sliding window needs `position_ids`.")
        mods.append(sliding_window(position_ids, window))
    if key_visible is not None:
        mods.append(visible_key(key_visible))
    return and_masks(*mods)


def dense_mask(mask_mod, batch_size: int, q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """Evaluate a ``mask_mod`` on the full grid: a boolean ``[batch, 1, q_len, kv_len]`` tensor, True = attend.

    This is what SDPA receives where FlexAttention cannot run (CPU backward, devices without it).
    """
    b = torch.arange(batch_size, device=device).view(-1, 1, 1)
    h = torch.zeros((), dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, -1)
    return mask_mod(b, h, q, kv).expand(batch_size, q_len, kv_len).unsqueeze(1)


_compiled_create_block_mask = None


def block_mask(mask_mod, batch_size: int, q_len: int, kv_len: int, device, compile: bool | None = None):
    """The FlexAttention ``BlockMask`` of a ``mask_mod``. ``compile`` (default: on CUDA) uses a compiled
    ``create_block_mask``, which does not materialise the dense mask; uncompiled it does (fine for small CPU
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
