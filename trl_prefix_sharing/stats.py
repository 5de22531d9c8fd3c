"""What prefix sharing saves on a dataset: positions per example, stock vs shared, measured with the real collator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["SharingStats", "sharing_stats"]


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
    """Run ``collator`` (a :class:`PrefixSharingCollator`) over up to ``max_examples`` rows and count positions, each
    example on its own (what every micro-batch saves; one that also holds other pairs of a prompt saves more)."""
    total = len(dataset)
    n = min(total, max_examples)
    stock = shared = unshared = 0
    for start in range(0, n, chunk_size):
        examples = [dataset[i] for i in range(start, min(start + chunk_size, n))]
        batch = collator.base_collator(examples)
        units = torch.tensor(collator.unit_lengths(batch))
        rows = torch.tensor([int(batch["attention_mask"][group].sum()) for group in collator.example_groups(batch)])
        stock += int(rows.sum())
        shared += int(units.sum())
        unshared += int((units == rows).sum())
    return SharingStats(
        examples=n, stock_tokens=stock, shared_tokens=shared, no_shared_prefix=unshared, total_examples=total
    )
