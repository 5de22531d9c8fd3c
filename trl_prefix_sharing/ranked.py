"""Ranked reward data: one prompt with K >= 2 completions, best first (InstructGPT-style rankings).

Dataset format (text or conversational, like TRL's preference formats)::

    {"prompt": "...", "completions": ["best", "second", ..., "worst"]}
    {"prompt": [{"role": "user", ...}], "completions": [[{"role": "assistant", ...}], ...]}

K may differ between examples. Each completion is tokenized exactly as TRL's reward trainer tokenizes a `chosen`
(prompt + completion, EOS appended to text completions). A batch holds the K rows of each example consecutively, with
`group_sizes`; with prefix sharing the K completions follow one copy of the prompt in one row. The loss is TRL's
pairwise loss over all K(K-1)/2 pairs (a ranked above b) from that single forward, averaged over pairs: the same as
stock TRL's `RewardTrainer` on the expanded pairs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from trl.data_utils import _tokenize, is_conversational


__all__ = ["is_ranked_dataset", "tokenize_ranked", "RankedCollator", "ranked_pairs", "expand_ranked_to_pairs"]


def is_ranked_dataset(columns) -> bool:
    return "completions" in set(columns) or "completion_ids" in set(columns)


def tokenize_ranked(example: dict, processing_class) -> dict:
    """`completion_ids`: the token ids of prompt + completion k, for each k (TRL's reward tokenization)."""
    completions = example["completions"]
    if not isinstance(completions, list) or len(completions) < 2:
        raise ValueError(f"A ranked example needs a list of at least 2 completions, got {completions!r}.")
    prompt = example.get("prompt")
    ids = []
    for completion in completions:
        if is_conversational({"prompt": prompt} if prompt is not None else {"completion": completion}):
            messages = (prompt or []) + completion
            ids.append(_tokenize(processing_class, messages)["input_ids"])
        else:
            if not isinstance(completion, str):
                raise ValueError(f"Ranked completions must be strings or message lists, got {type(completion)}.")
            eos = processing_class.eos_token
            text = (prompt or "") + (completion if completion.endswith(eos) else completion + eos)
            ids.append(_tokenize(processing_class, text)["input_ids"])
    return {"completion_ids": ids}


class RankedCollator:
    """Pad the K rows of each ranked example (consecutive, best first) and record `group_sizes`."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [list(ids) for example in examples for ids in example["completion_ids"]]
        width = max(len(r) for r in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, : len(r)] = 1
        sizes = torch.tensor([len(example["completion_ids"]) for example in examples], dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "group_sizes": sizes}


def ranked_pairs(group_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (better, worse) of every pair within each group of consecutive rows (best first)."""
    better, worse, start = [], [], 0
    for size in group_sizes.tolist():
        for a in range(size):
            for b in range(a + 1, size):
                better.append(start + a)
                worse.append(start + b)
        start += size
    device = group_sizes.device
    return torch.tensor(better, device=device, dtype=torch.long), torch.tensor(worse, device=device, dtype=torch.long)


def ranked_loss(rewards: torch.Tensor, group_sizes: torch.Tensor, center_rewards_coefficient: float | None):
    """TRL's pairwise loss over every ranked pair, averaged over pairs; returns (loss, chosen, rejected rewards)."""
    better, worse = ranked_pairs(group_sizes)
    chosen, rejected = rewards[better], rewards[worse]
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
    return loss, chosen, rejected


def expand_ranked_to_pairs(dataset):
    """The pairwise dataset stock TRL would train on: every (better, worse) pair of every ranked example."""
    from datasets import Dataset

    rows = []
    for example in dataset:
        completions = example["completions"]
        for a in range(len(completions)):
            for b in range(a + 1, len(completions)):
                row = {"chosen": completions[a], "rejected": completions[b]}
                if "prompt" in example:
                    row["prompt"] = example["prompt"]
                rows.append(row)
    return Dataset.from_list(rows)
