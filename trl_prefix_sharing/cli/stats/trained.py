"""What training lays out (DPO, reward, SFT): each micro-batch of `--per_device_train_batch_size` consecutive examples
collated by the trainer's own collator (`PrefixSharingCollator`, under `--prefix_sharing_join`) and laid out by
training's `layout.build_layout`, which under `prefix_sharing_join="auto"` keeps, per micro-batch, the plan (`prompts`
or `always`) of least estimated cost: the cost model of the model given (`cost.StepCost`, read from the model built
from its config on the meta device, no weights) under a kernel's rows and cost (`KERNELS`). The positions counted are
those a training run logs as `num_shared_tokens` (`tests/tools/test_stats_sft.py`, `tests/tools/test_stats_cli.py`)."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field


#: the kernels the counts lay out for, with what the report says of each: SDPA, which `"auto"` takes on the CPU and
#: whose dense cost (every query-key pair of a row) makes joining rows dearest, and varlen, which `"auto"` tries first
#: on CUDA (one unpadded row, the visible pairs only; FlexAttention too pays for those only)
KERNELS = {
    "sdpa": "with SDPA (dense, the CPU's kernel):",
    "varlen": "with varlen (CUDA's first kernel):",
}


def cost_model(config, tokenizer, head: str, trust_remote_code: bool = False):
    """The model training's cost model is read from (`cost.StepCost.of_model`): the model of `config` built on the
    meta device (no weights, no memory), with the `head` the trainer trains (`TrainerSpec.model_head`). Where there is
    no config (a `str` saying why) or it cannot be built, a one-layer stand-in (`prepared.stand_in_model`) and a note
    saying so; else the note is None."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..prepared import stand_in_model

    why = config if isinstance(config, str) else "no config was read" if config is None else None
    if why is None:
        auto = AutoModelForSequenceClassification if head == "sequence_classification" else AutoModelForCausalLM
        try:
            with torch.device("meta"):
                return auto.from_config(config, trust_remote_code=trust_remote_code), None
        except Exception as error:  # a config transformers reads but cannot build a model of: say so, count on
            why = f"its model could not be built from its config ({type(error).__name__})"
    note = f"the plans are chosen by the cost of a one-layer stand-in model, not the model's: {why}"
    return stand_in_model(tokenizer, head), note


def kernel_collators(collator, model) -> dict:
    """`collator` (the trainer's `PrefixSharingCollator`) as training runs it under each kernel of `KERNELS`: that
    kernel's rows and `model`'s cost model under it, no measured choice (`tuning`)."""
    from ...attention import BACKENDS

    collators = {}
    for name in KERNELS:
        clone = copy.copy(collator)
        clone.rows, clone.cost, clone.tuning = BACKENDS[name].rows(None), BACKENDS[name].cost(model), None
        collators[name] = clone
    return collators


def lay_out(collator, batch, plans=None):
    """The layout `collator` adds to the collated `batch` (what `PrefixSharingCollator.__call__` builds), from its
    `plans` (default: the collator's plans of the batch); returns the layout and the plans it chose from."""
    from ...layout import build_layout
    from ...trie import StockRows

    plans = collator.plans(batch) if plans is None else plans
    layout = build_layout(
        StockRows(batch["input_ids"], batch["attention_mask"]),
        rows=collator.rows,
        pad_token_id=collator.pad_token_id,
        plan=plans,
        cost=collator.cost,
        tuning=collator.tuning,
    )
    return layout, plans


@dataclass
class TrainedCounts:
    """What training lays out under one kernel: micro-batches per join rule, and positions, stock and shared. SFT also
    keeps the chosen plans' lengths (`plan`, a `counting._SFTPlanCounts`)."""

    joins: Counter = field(default_factory=Counter)  # join rule -> micro-batches laid out by it
    batches: int = 0
    examples: int = 0
    stock_tokens: int = 0
    stock_padded: int = 0  # stock's rows: each micro-batch's rows x its width
    tokens: int = 0  # the positions the shared rows hold: what training logs as `num_shared_tokens`
    padded: int = 0  # the shared rows, padding included: rows x width
    plan: object = None

    def add(self, batch, layout, examples: int) -> None:
        """Add one micro-batch of `examples` examples: its stock rows (`batch`) and its `layout`."""
        self.joins[layout.join] += 1
        self.batches += 1
        self.examples += examples
        self.stock_tokens += int(batch["attention_mask"].sum())
        self.stock_padded += batch["input_ids"].numel()
        self.tokens += int(layout.num_positions)
        self.padded += layout.input_ids.numel()

    @property
    def figures(self) -> list[float]:
        """The ideals: stock / shared tokens, and with padding."""
        return [self.stock_tokens / max(self.tokens, 1), self.stock_padded / max(self.padded, 1)]


def measure_trained(dataset, collator, model, batch_size: int) -> dict[str, TrainedCounts]:
    """DPO or reward: each micro-batch of `batch_size` consecutive prepared examples collated by the trainer's
    `collator` and laid out as training does, under each kernel of `KERNELS` (`model`: whose cost model chooses)."""
    from .counting import _batches

    collators = kernel_collators(collator, model)
    counts = {name: TrainedCounts() for name in collators}
    for examples in _batches(dataset, batch_size, "Laying out"):
        batch = collator.base_collator(examples)
        plans = collator.plans(batch)
        for name, kernel in collators.items():
            counts[name].add(batch, lay_out(kernel, batch, plans)[0], len(examples))
    return counts


def _joins(counts: TrainedCounts) -> str:
    """How many micro-batches each join rule laid out."""
    joined = counts.joins["always"]
    text = f"{joined:,} of {counts.batches:,} micro-batches joined across examples (always)"
    return text + (f", {counts.joins['prompts']:,} by prompts" if joined < counts.batches else "")


def print_trained(trained: dict[str, TrainedCounts], width: int) -> None:
    """The report's lines on what training lays out, one block per kernel."""
    for name, counts in trained.items():
        n = max(counts.examples, 1)
        ideal, padded = counts.figures
        print(f"    {KERNELS[name]:<{width - 2}}{_joins(counts)}")
        print(
            f"      {'tokens per example, shared:':<{width - 4}}{counts.tokens / n:.1f} of stock's "
            f"{counts.stock_tokens / n:.1f}: {ideal:.2f}x (what training logs as num_shared_tokens)"
        )
        print(
            f"      {'with padding, shared:':<{width - 4}}{counts.padded / n:.1f} of stock's "
            f"{counts.stock_padded / n:.1f}: {padded:.2f}x (the positions each computes)"
        )
