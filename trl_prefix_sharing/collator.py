"""The collator: TRL's own preference collator, plus the prefix-shared layout of the same batch."""

from __future__ import annotations

import copy
from typing import Any

from .layout import build_shared_batch


__all__ = ["PrefixSharingCollator", "unit_lengths"]


class PrefixSharingCollator:
    """Wrap a stock preference collator (TRL's DPO or reward collator) and add ``batch["prefix_sharing"]``.

    The stock collator builds the batch exactly as TRL does (truncation included); the layout is derived from those
    very tensors, so the same tokens are scored, and the stock tensors stay in the batch for TRL's loss code. Which
    stock rows belong to one example: TRL's pairwise layout (``B`` chosen rows, then ``B`` rejected rows), or, when the
    batch has ``group_sizes`` (ranked data, :mod:`trl_prefix_sharing.ranked`), consecutive rows of each example.

    Args:
        base_collator: the stock collator (e.g. ``trl.trainer.dpo_trainer.DataCollatorForPreference``).
        pad_token_id: token used to pad the shared rows.
        pad_to_multiple_of: round the shared row length up to a multiple of this (fewer FlexAttention recompiles).
        share_prefix: one document per example (prompt computed once). False: each stock row is its own document
            (for packing without sharing, the paper's Algorithm 2).
        packing_length: pack the whole batch into one row of exactly this many tokens (the packing sampler guarantees
            the batch fits). None: one document per row.
        packing_row_length: with packing, split the batch into several rows of this many tokens each (documents placed
            by first-fit decreasing) instead of one row of `packing_length`; `"batch"`: rows as long as the batch's
            longest document. For dense attention, whose cost grows with the square of the row length whatever the
            mask (so never more than the stock rows' padding); FlexAttention skips masked blocks and takes one row.
    """

    def __init__(
        self,
        base_collator,
        pad_token_id: int,
        pad_to_multiple_of: int | None = None,
        share_prefix: bool = True,
        packing_length: int | None = None,
        packing_row_length: int | str | None = None,
    ):
        self.base_collator = base_collator
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.share_prefix = share_prefix
        self.packing_length = packing_length
        self.packing_row_length = packing_row_length

    @staticmethod
    def example_groups(batch) -> list[list[int]]:
        """Stock row indices of each example, in example order."""
        num_rows = batch["input_ids"].shape[0]
        if "group_sizes" in batch:
            groups, start = [], 0
            for size in batch["group_sizes"].tolist():
                groups.append(list(range(start, start + size)))
                start += size
            if start != num_rows:
                raise ValueError(f"`group_sizes` add up to {start}, the batch has {num_rows} rows.")
            return groups
        if num_rows % 2:
            raise ValueError(f"A preference batch has chosen and rejected rows; got an odd number ({num_rows}).")
        half = num_rows // 2
        return [[i, half + i] for i in range(half)]

    def documents(self, batch) -> list[list[int]]:
        """Stock rows of each document: an example's rows (shared), or one row each (unshared, but identical rows of
        an example stay one document so that they get bitwise identical results, as in the stock rows)."""
        groups = self.example_groups(batch)
        if self.share_prefix:
            return groups
        keys = [
            (tuple(batch["input_ids"][r].tolist()), tuple(batch["attention_mask"][r].tolist()))
            for r in range(batch["input_ids"].shape[0])
        ]
        documents = []
        for group in groups:
            classes: dict = {}
            for row in group:
                classes.setdefault(keys[row], []).append(row)
            documents.extend(classes.values())
        return documents

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base_collator(examples)
        documents = self.documents(batch)
        rows, row_length = None, None
        if self.packing_length is not None:
            rows, row_length = [list(range(len(documents)))], self.packing_length
            if self.packing_row_length is not None:
                rows, row_length = self._rows(batch, documents)
        batch["prefix_sharing"] = build_shared_batch(
            batch["input_ids"],
            batch["attention_mask"],
            groups=documents,
            completion_mask=batch.get("completion_mask"),
            rows=rows,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=None if rows is not None else self.pad_to_multiple_of,
            row_length=row_length,
        )
        return batch

    def _rows(self, batch, documents) -> tuple[list[list[int]], int]:
        """Documents into rows of `packing_row_length` by first-fit decreasing (their lengths from a dry layout)."""
        from .sampler import first_fit_decreasing

        lengths = self.unpacked().document_lengths(batch, documents)
        row_length = max(lengths) if self.packing_row_length == "batch" else self.packing_row_length
        order = sorted(range(len(documents)), key=lambda d: -lengths[d])
        return first_fit_decreasing(order, lengths, row_length), row_length

    def document_lengths(self, batch, documents) -> list[int]:
        layout = build_shared_batch(
            batch["input_ids"], batch["attention_mask"], groups=documents, completion_mask=batch.get("completion_mask")
        )
        return (layout["document_ids"] >= 0).sum(dim=1).tolist()

    def unpacked(self) -> PrefixSharingCollator:
        """This collator with one document per row (used to measure each example's packing unit)."""
        clone = copy.copy(self)
        clone.packing_length = None
        clone.packing_row_length = None
        clone.pad_to_multiple_of = None
        return clone


def unit_lengths(dataset, collator: PrefixSharingCollator, chunk_size: int = 256) -> list[int]:
    """Tokens each example occupies in a packed row (its document, or its rows' documents when not shared),
    measured by running ``collator`` itself, so truncation and sharing are exactly what training will see."""
    unpacked = collator.unpacked()
    lengths: list[int] = []
    for start in range(0, len(dataset), chunk_size):
        batch = unpacked([dataset[i] for i in range(start, min(start + chunk_size, len(dataset)))])
        per_document = (batch["prefix_sharing"]["document_ids"] >= 0).sum(dim=1).tolist()
        if unpacked.share_prefix:
            lengths.extend(per_document)
        else:
            first_row = {doc[0]: n for doc, n in zip(unpacked.documents(batch), per_document, strict=True)}
            lengths.extend(sum(first_row.get(r, 0) for r in group) for group in unpacked.example_groups(batch))
    return lengths
