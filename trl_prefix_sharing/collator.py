"""The collator: TRL's own preference collator, plus the prefix-shared layout of the same batch."""

from __future__ import annotations

import copy
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
        share_prefix: one document per pair (prompt computed once). False: the chosen and rejected rows are separate
            documents (for packing without sharing, the paper's Algorithm 2).
        packing_length: pack the whole batch into one row of exactly this many tokens (the packing sampler guarantees
            the batch fits). None: one document per row.
    """

    def __init__(self, base_collator, pad_token_id: int, pad_to_multiple_of: int | None = None,
                 share_prefix: bool = True, packing_length: int | None = None):
        self.base_collator = base_collator
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.share_prefix = share_prefix
        self.packing_length = packing_length

    def groups(self, num_pairs: int) -> list[list[int]]:
        if self.share_prefix:
            return [[i, num_pairs + i] for i in range(num_pairs)]
        return [[i] for i in range(num_pairs)] + [[num_pairs + i] for i in range(num_pairs)]

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base_collator(examples)
        num_rows = batch["input_ids"].shape[0]
        if num_rows % 2:
            raise ValueError(f"A preference batch has chosen and rejected rows; got an odd number ({num_rows}).")
        groups = self.groups(num_rows // 2)
        packed = self.packing_length is not None
        batch["prefix_sharing"] = build_shared_batch(
            batch["input_ids"],
            batch["attention_mask"],
            groups=groups,
            completion_mask=batch.get("completion_mask"),
            rows=[list(range(len(groups)))] if packed else None,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=None if packed else self.pad_to_multiple_of,
            row_length=self.packing_length,
        )
        return batch

    def unpacked(self) -> "PrefixSharingCollator":
        """This collator with one document per row (used to measure each example's packing unit)."""
        clone = copy.copy(self)
        clone.packing_length = None
        clone.pad_to_multiple_of = None
        return clone


def unit_lengths(dataset, collator: PrefixSharingCollator, chunk_size: int = 256) -> list[int]:
    """Tokens each example occupies in a packed row (its document: the shared layout, or both rows unshared),
    measured by running ``collator`` itself, so truncation and sharing are exactly what training will see."""
    unpacked = collator.unpacked()
    lengths: list[int] = []
    for start in range(0, len(dataset), chunk_size):
        examples = [dataset[i] for i in range(start, min(start + chunk_size, len(dataset)))]
        batch = unpacked(examples)
        documents = batch["prefix_sharing"]["document_ids"] >= 0
        per_row = documents.sum(dim=1).tolist()
        if unpacked.share_prefix:
            lengths.extend(per_row)
        else:  # rows: chosen documents, then rejected documents
            half = len(examples)
            lengths.extend(a + b for a, b in zip(per_row[:half], per_row[half:]))
    return lengths
