"""`SFTTrainer`: TRL's SFT trainer, with prefix sharing (`args.prefix_sharing`).

TRL's SFT collator pads each example into its own row, and its `compute_loss` scores every row through TRL's fused
log-prob head (`model(**inputs, fused_lm_head=True)`), then logs `entropy`, `mean_token_accuracy` and `num_tokens`
from the per-token outputs and the stock attention mask. With prefix sharing the collated batch also carries its
layout (`PrefixSharingCollator`): the rows that start alike (several completions of one prompt, as rejection sampling
and best-of-n data have; a system prompt or preamble that several examples share, by `prefix_sharing_join`) are
computed once, and the wrapped forward hands TRL's code stock-shaped outputs. Each row is an example of its own; its
prompt is its tokens before the first label it trains on (`completion_only_loss`, `assistant_only_loss`), or the
whole row when it trains on every token (plain text).
"""

from __future__ import annotations

import inspect

import torch
import trl

from .collated import CollatedSharingMixin
from .config import SFTConfig
from .packing import grouped_by_prompt
from .trie import prompt_lengths_from_completion_mask


__all__ = ["SFTTrainer", "prompt_end", "sft_examples", "sft_prompt_groups", "sft_prompt_lengths"]


def sft_examples(batch) -> torch.Tensor:
    """`[rows]`: each row of an SFT batch is an example of its own."""
    return torch.arange(batch["input_ids"].shape[0], device=batch["input_ids"].device)


def sft_prompt_lengths(batch) -> torch.Tensor:
    """`[rows]`: each row's prompt, its tokens before the first label it trains on; a row that trains on every token
    (or none) has no prompt apart from itself: its whole length."""
    attention_mask = batch["attention_mask"]
    trained = (batch["labels"] != -100) & attention_mask.bool()
    prompts = prompt_lengths_from_completion_mask(attention_mask, trained.long())
    return torch.where(prompts == 0, attention_mask.sum(dim=1), prompts)


def prompt_end(labels: list[int]) -> int:
    """Where an example's prompt ends: the place of the first label it trains on (its length if none)."""
    return next((i for i, label in enumerate(labels) if label != -100), len(labels))


def sft_prompt_groups(dataset) -> list[int]:
    """The prompt group of every example of a prepared SFT dataset (`group_by_prompt`): its tokens before the first
    label it trains on. Data that trains on every token has no prompts to group by: an error."""
    keys = [
        tuple(ids[: prompt_end(labels)]) for ids, labels in zip(dataset["input_ids"], dataset["labels"], strict=True)
    ]
    if not any(keys):
        raise ValueError(
            "`group_by_prompt=True` finds no prompts: every example trains on all its tokens. It needs prompt and "
            "completion data with `completion_only_loss=True` (the default for it), or `assistant_only_loss=True`."
        )
    ids: dict = {}
    return [ids.setdefault(key, len(ids)) for key in keys]


class SFTTrainer(CollatedSharingMixin, trl.SFTTrainer):
    """TRL's [`trl.SFTTrainer`], computing what the rows of a micro-batch share once when `args.prefix_sharing=True`.

    Takes exactly the arguments of [`trl.SFTTrainer`]. With prefix sharing, the loss (`nll` and `dft`, with
    `completion_only_loss` and `assistant_only_loss`), the gradients and every logged metric (`entropy`,
    `mean_token_accuracy`, `num_tokens`) equal stock TRL's on the same micro-batches; `num_shared_tokens` counts the
    positions really computed. PEFT's prompt tuning, P-tuning and prefix tuning too: their virtual tokens are computed
    once per micro-batch (`virtual.py`). TRL's `packing` and `padding_free` are refused with it (see `SFTConfig`).
    """

    _config_class = SFTConfig
    _examples_of = staticmethod(sft_examples)
    _prompts_of = staticmethod(sft_prompt_lengths)
    _prompt_groups_of = staticmethod(sft_prompt_groups)
    _virtual_tokens_refused = None  # prompt tuning, P-tuning and prefix tuning: `virtual.py`

    def __init__(self, model, *args, **kwargs):
        given = inspect.signature(trl.SFTTrainer.__init__).bind(self, model, *args, **kwargs).arguments
        self._formats_rows = given.get("formatting_func") is not None  # it makes each row's text: any columns go
        self._init_prefix_sharing_from((model, *args), kwargs)
        super().__init__(model, *args, **kwargs)
        self._finish_prefix_sharing_init()

    def _get_train_sampler(self, train_dataset=None):
        sampler = super()._get_train_sampler(train_dataset)
        if not getattr(self.args, "group_by_prompt", False):
            return sampler
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return grouped_by_prompt(sampler, dataset, self._prompt_groups_of)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._share_batch(inputs)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
