"""The collator: TRL's own preference collator, plus the prefix-shared layout of the same batch."""

from __future__ import annotations

import copy
from typing import Any

import torch

from .examples import example_ids, prompt_lengths
from .layout import RowPolicy, build_layout
from .trie import LayoutPlan, StockRows, plan_layouts
from .vision import has_vision_inputs


__all__ = ["PrefixSharingCollator", "unit_lengths"]


class PrefixSharingCollator:
    """Wrap a stock preference collator (TRL's DPO or reward collator) and add the batch's `Layout` under
    `batch["prefix_sharing"]`.

    The stock collator builds the batch exactly as TRL does (truncation included); the layout is derived from those
    very tensors, so the same tokens are scored, and the stock tensors stay in the batch for TRL's loss code. Every
    prefix the batch's rows share is computed once (the trie of `layout.py`), whichever examples they come from; what
    an example and its prompt are is read from the batch (`examples.py`).

    Args:
        base_collator: the stock collator (e.g. `trl.trainer.dpo_trainer.DataCollatorForPreference`).
        pad_token_id: token used to pad the shared rows.
        rows: where the layout puts its documents (`RowPolicy`; default one per row): unpacked rows rounded up to
            the session's multiple, or packed rows (set by packing).
        share_prefix: compute shared prefixes once. False: each stock row is its own document (for packing without
            sharing, the paper's Algorithm 2), except identical rows of an example.
        across_examples: share between examples (a prompt's several pairs, later turns, duplicate prompts). False:
            within each example only. A batch with images shares within examples only (the tokens of an image do not
            tell which image it is).
        join: how rows that start alike join one document (`trie.JOINS`).
        cost: the step's cost model (`cost.StepCost`), by which `join="auto"` chooses.
        tuning: the session's candidates and measured costs (`tuning.Tuning`), where `"auto"` chooses the kernel
            or stock's own rows per batch (`rows` and `cost` are then unused), else None.
        examples_of, prompts_of: `f(batch)`: the example of each stock row, and each row's prompt tokens (None: the
            common start of each example's rows). Default: a preference batch's (`examples.py`); SFT's rows are
            examples of their own, their prompts the tokens before the first trained label (`sft_trainer.py`).
    """

    def __init__(
        self,
        base_collator,
        pad_token_id: int,
        rows: RowPolicy | None = None,
        share_prefix: bool = True,
        across_examples: bool = True,
        join: str = "prompts",
        cost=None,
        examples_of=example_ids,
        prompts_of=prompt_lengths,
        tuning=None,
    ):
        self.base_collator = base_collator
        self.pad_token_id = pad_token_id
        self.rows = rows or RowPolicy()
        self.share_prefix = share_prefix
        self.across_examples = across_examples
        self.join = join
        self.cost = cost
        self.tuning = tuning
        self.examples_of, self.prompts_of = examples_of, prompts_of

    def plans(self, batch) -> list[LayoutPlan]:
        """The tries of this batch's rows, one per join rule the layout chooses from (see `plan_layouts`)."""
        across = self.across_examples and not has_vision_inputs(batch)
        return self._plans(batch, self.examples_of(batch), across, (self.join,))

    def _plans(self, batch, examples: torch.Tensor, across: bool, joins=("prompts",)) -> list[LayoutPlan]:
        """The tries of this batch's rows, `examples` being the example (or packing unit) of each row."""
        return plan_layouts(
            StockRows(
                batch["input_ids"],
                batch["attention_mask"],
                prompt_lengths=self.prompts_of(batch),
                examples=examples,
                across_examples=across,
                share=self.share_prefix,
            ),
            joins=joins,
        )

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base_collator(examples)
        batch["prefix_sharing"] = self.layout(batch)
        return batch

    def layout(self, batch, plans: list[LayoutPlan] | None = None):
        """The `Layout` of a collated `batch`, chosen from `plans` (default: this batch's, `plans`) by the collator's
        rows, cost model and tuning."""
        return build_layout(
            StockRows(batch["input_ids"], batch["attention_mask"]),
            rows=self.rows,
            pad_token_id=self.pad_token_id,
            plan=self.plans(batch) if plans is None else plans,
            cost=self.cost,
            tuning=self.tuning,
        )

    def unit_lengths(self, batch, units: torch.Tensor | None = None) -> list[int]:
        """Tokens each packing unit of `batch` occupies in a packed row: each example alone (its trie, or its
        unshared rows), or with `units` (the unit of each example) the trie of each unit's examples together."""
        unit_ids = self.examples_of(batch)
        if units is not None:
            unit_ids = units.to(unit_ids.device)[unit_ids]
        (plan,) = self._plans(batch, unit_ids, across=False)
        return plan.tokens_per(unit_ids, int(unit_ids.max()) + 1).tolist()

    def unpacked(self, rows: RowPolicy | None = None) -> PrefixSharingCollator:
        """This collator with unpacked `rows` (default one document per row), for fixed-size batches (e.g. TRL's
        precomputation of the reference log-probs under packing)."""
        clone = copy.copy(self)
        clone.rows, clone.tuning = rows or RowPolicy(), None
        return clone


def unit_lengths(dataset, collator: PrefixSharingCollator, chunk_size: int = 256, groups=None) -> list[int]:
    """Tokens each packing unit occupies in a packed row, measured by running `collator`'s own base collator and
    layout, so truncation and sharing are exactly what training will see. Units: each example (its trie, or its rows'
    documents when not shared; a packed batch that holds several examples of one prompt shares between them, so it
    only gets shorter), or each group of dataset indices in `groups` (a prompt's examples: their trie)."""
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
