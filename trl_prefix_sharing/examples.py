"""What the rows of a preference batch are: which example each stock row belongs to, and what its prompt is.

The layout (`layout.py`) joins rows into one document when they share at least a prompt, and keeps examples apart
where it must (packing units, images); this module says what an example and a prompt are for the batches TRL's
preference collators build:

- TRL's pairwise layout: `B` chosen rows, then `B` rejected rows, so example `i` is rows `i` and `B + i`;
- ranked data (a batch with `group_sizes`, see `ranked.py`): consecutive rows of each example;
- a row's prompt: its tokens before its first completion token (`completion_mask`); a batch without one (the reward
  collator's) counts the common start of each example's rows as its prompt.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .trie import prompt_lengths_from_completion_mask


__all__ = ["example_groups", "example_ids", "prompt_lengths"]


def example_groups(batch: Mapping) -> list[list[int]]:
    """The stock row indices of each example of a collated preference batch, in example order."""
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


def example_ids(batch: Mapping) -> torch.Tensor:
    """`[rows]`: the example of each stock row, on the batch's device."""
    ids = torch.empty(batch["input_ids"].shape[0], dtype=torch.long)
    for example, rows in enumerate(example_groups(batch)):
        ids[rows] = example
    return ids.to(batch["input_ids"].device)


def prompt_lengths(batch: Mapping) -> torch.Tensor | None:
    """`[rows]`: each stock row's prompt tokens, from the batch's completion mask (None without one: the common start
    of each example's rows counts as its prompt)."""
    completion_mask = batch.get("completion_mask")
    if completion_mask is None:
        return None
    return prompt_lengths_from_completion_mask(batch["attention_mask"], completion_mask)
