"""The collator: TRL's own preference collator, plus the prefix-shared layout of the same batch."""

from __future__ import annotations

from typing import Any

from .layout import build_shared_batch

__all__ = ["PrefixSharingCollator"]


class PrefixSharingCollator:
    """Wrap a stock TRL preference collator (DPO or reward) and add ``batch["prefix_sharing"]``.

    The stock collator builds the ``[2B, L]`` batch exactly as TRL does (truncation included), chosen rows first and
    rejected rows second; the layout is derived from those very tensors, so the same tokens are scored. The stock
    tensors stay in the batch: TRL's loss code reads their shapes and masks.

    Args:
        base_collator: the stock collator (e.g. ``trl.trainer.dpo_trainer.DataCollatorForPreference``).
        pad_token_id: token used to pad the shared rows.
        pad_to_multiple_of: round the shared row length up to a multiple of this (fewer FlexAttention recompiles).
    """

    def __init__(self, base_collator, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.base_collator = base_collator
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base_collator(examples)
        num_rows = batch["input_ids"].shape[0]
        if num_rows % 2:
            raise ValueError(f"A preference batch has chosen and rejected rows; got an odd number ({num_rows}).")
        half = num_rows // 2
        batch["prefix_sharing"] = build_shared_batch(
            batch["input_ids"],
            batch["attention_mask"],
            groups=[[i, half + i] for i in range(half)],
            completion_mask=batch.get("completion_mask"),
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        return batch
