"""What prefix sharing saves on a dataset: where keeping a prompt's examples in one micro-batch would share more
(`grouping_gain`, measured with the trainer's own collator), and the positions of GRPO/RLOO groups of generated
completions of an assumed length (`group_stats`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["GroupStats", "GroupingGain", "causal_pairs", "group_stats", "grouping_gain"]

#: `grouping_gain` reports a grouping only where it computes at least this many times fewer tokens than the sampling
GROUPING_MATTERS = 1.1


@dataclass
class GroupingGain:
    """Stock tokens / shared tokens in micro-batches of a dataset's first `examples` examples, drawn at random as the
    stock sampler draws them (`sampled`) and with each prompt's examples kept together (`grouped`,
    `group_by_prompt=True`)."""

    examples: int
    sampled: float
    grouped: float

    def hint(self) -> str:
        """The start-up line's ending, or nothing where grouping would not share noticeably more."""
        if self.grouped < GROUPING_MATTERS * self.sampled:
            return ""
        return (
            f" With group_by_prompt=True a prompt's examples would share micro-batches: {self.grouped:.2f}x fewer "
            f"tokens than stock on the first {self.examples:,} examples, against {self.sampled:.2f}x as sampled now."
        )


def _tokens(collator, dataset, order: list[int], batch_size: int) -> tuple[int, int]:
    """Stock and shared tokens of the micro-batches of `batch_size` consecutive examples of `order`, each laid out as
    `collator` lays it out in training (`PrefixSharingCollator.layout`: the join its cost model keeps)."""
    stock = shared = 0
    for first in range(0, len(order), batch_size):
        batch = collator.base_collator([dataset[i] for i in order[first : first + batch_size]])
        stock += int(batch["attention_mask"].sum())
        shared += int(collator.layout(batch).num_positions)
    return stock, shared


def grouping_gain(dataset, collator, groups: list[int], batch_size: int, shuffled: bool = True) -> GroupingGain:
    """`GroupingGain` of `dataset` laid out by `collator` (a `PrefixSharingCollator`) in micro-batches of `batch_size`:
    `groups[i]` is the prompt group of example i. The sampler's order is the dataset's, or with `shuffled` a random
    one drawn from its own generator (the training run's random stream is left as it is)."""
    from .packing import PromptGroupSampler

    n = len(dataset)
    drawn = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist() if shuffled else list(range(n))
    grouped = list(PromptGroupSampler(drawn, groups))
    (stock, sampled), (_, together) = (_tokens(collator, dataset, order, batch_size) for order in (drawn, grouped))
    return GroupingGain(examples=n, sampled=stock / max(sampled, 1), grouped=stock / max(together, 1))


def causal_pairs(prefix: int, branches: list[int]) -> int:
    """Query-key pairs a causal mask allows in a shared layout: `prefix` positions every branch reads, then each
    branch of `branches[i]` positions (a stock row of `prefix + b` tokens is `causal_pairs(0, [prefix + b])`)."""
    cost = prefix * (prefix + 1) // 2
    for b in branches:
        cost += b * prefix + b * (b + 1) // 2
    return cost


@dataclass
class GroupStats:
    """Token positions of GRPO/RLOO groups, padding not counted: one prompt of P tokens and G completions of C tokens.

    Stock TRL scores each completion in its own row: G(P + C) positions. The shared layout holds the prompt once and
    heads each completion's branch with a copy of the prompt's last token (same token, same position):
    P - 1 + G(C + 1) positions; G*C when the prompt has no tokens (nothing to share). Completions that start alike
    would share more; generated completions are not known in advance, so that is not counted."""

    groups: int
    num_generations: int
    completion_length: int
    stock_tokens: int
    shared_tokens: int
    stock_attention: int
    shared_attention: int
    empty_prompts: int

    @property
    def stock_per_group(self) -> float:
        return self.stock_tokens / max(self.groups, 1)

    @property
    def shared_per_group(self) -> float:
        return self.shared_tokens / max(self.groups, 1)

    @property
    def linear_speedup(self) -> float:
        """Stock / shared positions: the ideal speedup of the layers whose cost is linear in the positions."""
        return self.stock_tokens / max(self.shared_tokens, 1)

    @property
    def attention_speedup(self) -> float:
        """Stock / shared query-key pairs of the causal attention."""
        return self.stock_attention / max(self.shared_attention, 1)


def group_stats(prompt_lengths: list[int], completion_length: int, num_generations: int) -> GroupStats:
    """`GroupStats` of one group per prompt length, every completion `completion_length` tokens long."""
    g, c = num_generations, completion_length
    stock = shared = stock_attention = shared_attention = empty = 0
    for p in prompt_lengths:
        stock += g * (p + c)
        stock_attention += g * causal_pairs(0, [p + c])
        if p:
            shared += p - 1 + g * (c + 1)
            shared_attention += causal_pairs(p - 1, [c + 1] * g)
        else:
            shared += g * c
            shared_attention += g * causal_pairs(0, [c])
            empty += 1
    return GroupStats(
        groups=len(prompt_lengths),
        num_generations=g,
        completion_length=c,
        stock_tokens=stock,
        shared_tokens=shared,
        stock_attention=stock_attention,
        shared_attention=shared_attention,
        empty_prompts=empty,
    )
