"""What prefix sharing saves on a dataset: positions per example, stock vs shared, measured with the real collator
(preference data), or counted for GRPO/RLOO groups of generated completions of an assumed length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .examples import example_groups


__all__ = ["GroupStats", "SharingStats", "causal_pairs", "group_stats", "sharing_stats"]


@dataclass
class SharingStats:
    examples: int
    stock_tokens: int
    shared_tokens: int
    no_shared_prefix: int
    total_examples: int

    @property
    def stock_per_example(self) -> float:
        return self.stock_tokens / max(self.examples, 1)

    @property
    def shared_per_example(self) -> float:
        return self.shared_tokens / max(self.examples, 1)

    @property
    def saved_fraction(self) -> float:
        return 1.0 - self.shared_tokens / max(self.stock_tokens, 1)

    def summary(self) -> str:
        sampled = (
            "" if self.examples == self.total_examples else f" (first {self.examples:,} of {self.total_examples:,})"
        )
        text = (
            f"Prefix sharing on {self.examples:,} examples{sampled}: {self.stock_per_example:.1f} positions per "
            f"example in stock TRL, {self.shared_per_example:.1f} shared ({100 * self.saved_fraction:.1f}% fewer, "
            f"{self.stock_tokens / max(self.shared_tokens, 1):.2f}x fewer token positions)."
        )
        if self.no_shared_prefix:
            text += (
                f" {self.no_shared_prefix:,} examples share no prefix (empty or truncated prompt) and gain nothing."
            )
        return text


def sharing_stats(dataset, collator, max_examples: int = 10_000, chunk_size: int = 256) -> SharingStats:
    """Run `collator` (a `PrefixSharingCollator`) over up to `max_examples` rows and count positions, each
    example on its own (what every micro-batch saves; one that also holds other pairs of a prompt saves more)."""
    total = len(dataset)
    n = min(total, max_examples)
    stock = shared = unshared = 0
    for start in range(0, n, chunk_size):
        examples = [dataset[i] for i in range(start, min(start + chunk_size, n))]
        batch = collator.base_collator(examples)
        units = torch.tensor(collator.unit_lengths(batch))
        rows = torch.tensor([int(batch["attention_mask"][group].sum()) for group in example_groups(batch)])
        stock += int(rows.sum())
        shared += int(units.sum())
        unshared += int((units == rows).sum())
    return SharingStats(
        examples=n, stock_tokens=stock, shared_tokens=shared, no_shared_prefix=unshared, total_examples=total
    )


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
