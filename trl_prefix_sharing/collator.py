"""The collator: TRL's own preference collator, plus the prefix-shared layout of the same batch."""

from __future__ import annotations

import copy
from typing import Any

import torch

from .layout import LayoutPlan, build_shared_batch, plan_layout, prompt_lengths_from_completion_mask
from .vision import has_vision_inputs


__all__ = ["PrefixSharingCollator", "unit_lengths"]


class PrefixSharingCollator:
    """Wrap a stock preference collator (TRL's DPO or reward collator) and add ``batch["prefix_sharing"]``.

    The stock collator builds the batch exactly as TRL does (truncation included); the layout is derived from those
    very tensors, so the same tokens are scored, and the stock tensors stay in the batch for TRL's loss code. Every
    prefix the batch's rows share is computed once (the trie of :mod:`trl_prefix_sharing.layout`), whichever examples
    they come from. Which stock rows belong to one example (for what counts as its prompt, and for packing's units):
    TRL's pairwise layout (``B`` chosen rows, then ``B`` rejected rows), or, when the batch has ``group_sizes`` (ranked
    data, :mod:`trl_prefix_sharing.ranked`), consecutive rows of each example.

    Args:
        base_collator: the stock collator (e.g. ``trl.trainer.dpo_trainer.DataCollatorForPreference``).
        pad_token_id: token used to pad the shared rows.
        pad_to_multiple_of: round the shared row length up to a multiple of this (fewer FlexAttention recompiles).
        share_prefix: compute shared prefixes once. False: each stock row is its own document (for packing without
            sharing, the paper's Algorithm 2), except identical rows of an example.
        across_examples: share between examples (a prompt's several pairs, later turns, duplicate prompts). False:
            within each example only. A batch with images shares within examples only (the tokens of an image do not
            tell which image it is).
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
        across_examples: bool = True,
        packing_length: int | None = None,
        packing_row_length: int | str | None = None,
    ):
        self.base_collator = base_collator
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.share_prefix = share_prefix
        self.across_examples = across_examples
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

    @classmethod
    def example_ids(cls, batch) -> torch.Tensor:
        """``[rows]``: the example of each stock row."""
        ids = torch.empty(batch["input_ids"].shape[0], dtype=torch.long)
        for example, rows in enumerate(cls.example_groups(batch)):
            ids[rows] = example
        return ids.to(batch["input_ids"].device)

    @staticmethod
    def prompt_lengths(batch) -> torch.Tensor | None:
        """``[rows]``: each stock row's prompt tokens, from the batch's completion mask (None without one: the common
        start of each example's rows counts as its prompt)."""
        completion_mask = batch.get("completion_mask")
        if completion_mask is None:
            return None
        return prompt_lengths_from_completion_mask(batch["attention_mask"], completion_mask)

    def plan(self, batch) -> LayoutPlan:
        """The trie of this batch's rows (see :func:`~trl_prefix_sharing.layout.plan_layout`)."""
        across = self.across_examples and not has_vision_inputs(batch)
        return self._plan(batch, self.example_ids(batch), across)

    def _plan(self, batch, examples: torch.Tensor, across: bool) -> LayoutPlan:
        """The trie of this batch's rows, ``examples`` being the example (or packing unit) of each row."""
        return plan_layout(
            batch["input_ids"],
            batch["attention_mask"],
            prompt_lengths=self.prompt_lengths(batch),
            examples=examples,
            across_examples=across,
            share=self.share_prefix,
        )

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base_collator(examples)
        rows, row_length = None, None
        if self.packing_length is not None:
            rows, row_length = (lambda lengths: [list(range(len(lengths)))]), self.packing_length
            if self.packing_row_length is not None:
                rows, row_length = self._rows, self.packing_row_length
        if row_length == "batch":
            row_length = None  # rows as long as the longest document
        batch["prefix_sharing"] = build_shared_batch(
            batch["input_ids"],
            batch["attention_mask"],
            rows=rows,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=None if rows is not None else self.pad_to_multiple_of,
            row_length=row_length,
            plan=self.plan(batch),
        )
        return batch

    def _rows(self, lengths: list[int]) -> list[list[int]]:
        """Documents into rows of `packing_row_length` (or the longest document) by first-fit decreasing."""
        from .sampler import first_fit_decreasing

        row_length = max(lengths) if self.packing_row_length == "batch" else self.packing_row_length
        order = sorted(range(len(lengths)), key=lambda d: -lengths[d])
        return first_fit_decreasing(order, lengths, row_length)

    def unit_lengths(self, batch, units: torch.Tensor | None = None) -> list[int]:
        """Tokens each packing unit of ``batch`` occupies in a packed row: each example alone (its trie, or its
        unshared rows), or with ``units`` (the unit of each example) the trie of each unit's examples together."""
        unit_ids = self.example_ids(batch)
        if units is not None:
            unit_ids = units.to(unit_ids.device)[unit_ids]
        return self._plan(batch, unit_ids, across=False).tokens_per(unit_ids, int(unit_ids.max()) + 1).tolist()

    def unpacked(self) -> PrefixSharingCollator:
        """This collator with one document per row (fixed-size batches, e.g. TRL's precomputation of the reference
        log-probs under packing)."""
        clone = copy.copy(self)
        clone.packing_length = None
        clone.packing_row_length = None
        clone.pad_to_multiple_of = None
        return clone


def unit_lengths(dataset, collator: PrefixSharingCollator, chunk_size: int = 256, groups=None) -> list[int]:
    """Tokens each packing unit occupies in a packed row, measured by running ``collator``'s own base collator and
    layout, so truncation and sharing are exactly what training will see. Units: each example (its trie, or its rows'
    documents when not shared; a packed batch that holds several examples of one prompt shares between them, so it
    only gets shorter), or each group of dataset indices in ``groups`` (a prompt's examples: their trie)."""
    if groups is None:
        groups = [[i] for i in range(len(dataset))]
    lengths: list[int] = []
    start = 0
    while start < len(groups):
        chunk, size = [], 0
        while start < len(groups) and (not chunk or size + len(groups[start]) <= chunk_size):
            chunk.append(groups[start])
            size += len(groups[start])
            start += 1
        batch = collator.base_collator([dataset[i] for group in chunk for i in group])
        units = torch.tensor([u for u, group in enumerate(chunk) for _ in group])
        lengths.extend(collator.unit_lengths(batch, units))
    return lengths
