"""Packing for the preference trainers (DPO, reward): several examples per row, no padding, every pair the same weight.

Packing changes what a batch is, and this module is everything that follows from it, with or without prefix sharing:

- **Batches**: a multipack first-fit-decreasing sampler (`MultipackSampler`) fills
  rows of `packing_length` tokens with whole examples, so a micro-batch holds a variable number of pairs. Each example
  is one document of its row (the layout of `trl_prefix_sharing.layout`; with prefix sharing off, each of its
  sequences is a document of its own). A streamed dataset has no lengths to read ahead: its batches keep
  `per_device_train_batch_size` examples and are packed as they arrive.
- **Loss**: TRL averages over the pairs of a micro-batch. Under packing that would weigh pairs unequally, so the loss
  is rescaled to a sum over the pairs of the whole optimizer step (every micro-batch, every rank) divided by their
  number: each pair weighs the same across packing, gradient accumulation and ranks.
- **Metrics**: a logged metric is TRL's per-micro-batch mean; under packing they are combined weighted by the pairs
  (or completion tokens) each micro-batch averaged over. Gathers accept per-rank sizes (`distributed.py`).
- **Evaluation**: `eval_loss` is the per-pair mean over the dataset (each packed batch's mean repeated once per pair).

`PackingMixin` comes before the prefix-sharing mixin in a preference trainer's classes (`PreferenceSharingMixin`), so
its sampler, loss and metric overrides wrap the mixin's and TRL's. It reads the layout the collator builds and calls
the mixin's set-up before it builds a sampler (the kernel decides how packed rows are rounded), but nothing of the
sharing session itself.
"""

from __future__ import annotations

import weakref

import torch
from datasets import Dataset
from transformers.trainer_pt_utils import BatchRebalanceSampler
from transformers.utils import logging

from .collator import unit_lengths
from .distributed import gather_variable, variable_size_gathers
from .layout import RowPolicy
from .sampler import MultipackSampler


__all__ = ["PackedBatches", "PackingMixin", "TrainerMultipackSampler", "PromptGroupSampler", "prompt_groups"]

logger = logging.get_logger(__name__)

#: metrics that are running totals (the last value is the total), never averaged
_RUNNING_TOTALS = {"num_tokens", "num_shared_tokens"}


class TrainerMultipackSampler(MultipackSampler, BatchRebalanceSampler):
    """A `MultipackSampler` the Trainer passes as `batch_sampler` and does not re-shard (it is already rank-aware):
    transformers' `_get_dataloader` does exactly this for `BatchRebalanceSampler` instances.

    `members`: the dataset indices of each packed unit when a unit is several examples (a prompt's pairs, under
    `group_by_prompt`); the lengths are then the units', and each batch yields their examples."""

    def __init__(self, *args, members: list[list[int]] | None = None, **kwargs):
        MultipackSampler.__init__(self, *args, **kwargs)
        self.members = members

    def __iter__(self):
        for batch in super().__iter__():
            yield batch if self.members is None else [index for unit in batch for index in self.members[unit]]


class PromptGroupSampler(torch.utils.data.Sampler):
    """A sampler's order with the examples of one prompt kept together (`group_by_prompt`).

    Draws the wrapped sampler's whole order (so the random stream is stock TRL's), then orders whole prompt groups by
    where their first example falls, each group's examples in the order drawn.

    Args:
        sampler: the stock training sampler.
        groups: the prompt group of every dataset index.
    """

    def __init__(self, sampler, groups: list[int]):
        self.sampler = sampler
        self.groups = groups

    def __iter__(self):
        order = list(self.sampler)
        first: dict[int, int] = {}
        for place, index in enumerate(order):
            first.setdefault(self.groups[index], place)
        return iter(sorted(order, key=lambda index: first[self.groups[index]]))  # stable: drawn order within

    def __len__(self) -> int:
        return len(self.sampler)


def grouped_by_prompt(sampler, dataset, groups_of):
    """The training `sampler` with each prompt's examples kept together (`group_by_prompt`): `groups_of(dataset)` is
    the prompt group of every example. A stream has no prompts to group: an error."""
    if sampler is None:
        return None
    if not isinstance(dataset, Dataset):
        raise ValueError("`group_by_prompt=True` needs a map-style dataset (a stream has no prompts to group).")
    return PromptGroupSampler(sampler, groups_of(dataset))


def prompt_groups(dataset) -> list[int]:
    """The prompt group of every example: its `prompt_ids` (DPO), its `prompt` (a reward dataset that keeps one), else
    the common start of its `chosen_ids` and `rejected_ids`, or of its `completion_ids` (ranked)."""
    columns = set(dataset.column_names)
    if "prompt_ids" in columns:
        keys = [tuple(ids) for ids in dataset["prompt_ids"]]
    elif "prompt" in columns:
        keys = [repr(prompt) for prompt in dataset["prompt"]]
    elif {"chosen_ids", "rejected_ids"} <= columns:
        keys = [_common_start(c, r) for c, r in zip(dataset["chosen_ids"], dataset["rejected_ids"], strict=True)]
    elif "completion_ids" in columns:
        keys = [_common_start(*rows) for rows in dataset["completion_ids"]]
    else:
        raise ValueError(
            f"`group_by_prompt=True` finds no prompt in the dataset's columns {sorted(columns)}: it needs "
            "`prompt_ids`, `prompt`, `chosen_ids`/`rejected_ids` or `completion_ids`."
        )
    ids: dict = {}
    return [ids.setdefault(key, len(ids)) for key in keys]


def _common_start(*rows) -> tuple:
    n = min(len(row) for row in rows)
    end = next((i for i in range(n) if any(row[i] != rows[0][i] for row in rows[1:])), n)
    return tuple(rows[0][:end])


class PackedBatches:
    """Packing's batches for one trainer: each example's packing unit (or each prompt group's, `group_by_prompt`), the
    packed rows' length (`length`, resolved when the trainer wraps its collator), and the multipack sampler over
    them. Lengths are read once per dataset."""

    #: stock rows per example (a preference pair); a stream's packing unit is at most this many rows of `max_length`
    rows_per_example = 2

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)
        self._cache = {}
        self.length = None  # tokens per packed row, resolved when the collator is wrapped

    def unit_lengths(self, dataset, grouped: bool = False) -> list[int]:
        """Each example's packing unit; `grouped`: each prompt group's (`group_by_prompt`), in `groups` order."""
        key = (getattr(dataset, "_fingerprint", None) or id(dataset), grouped)
        if key not in self._cache:
            groups = self.groups(dataset) if grouped else None
            self._cache[key] = unit_lengths(dataset, self._trainer().data_collator, groups=groups)
        return self._cache[key]

    def groups(self, dataset) -> list[list[int]]:
        """The dataset indices of each prompt (`group_by_prompt`), in order of first appearance; read once."""
        key = (getattr(dataset, "_fingerprint", None) or id(dataset), "groups")
        if key not in self._cache:
            members: dict[int, list[int]] = {}
            for index, group in enumerate(prompt_groups(dataset)):
                members.setdefault(group, []).append(index)
            self._cache[key] = list(members.values())
        return self._cache[key]

    def datasets(self) -> list:
        """The trainer's train and eval datasets."""
        trainer = self._trainer()
        datasets = [trainer.train_dataset]
        if isinstance(trainer.eval_dataset, dict):
            datasets += list(trainer.eval_dataset.values())
        else:
            datasets.append(trainer.eval_dataset)
        return [dataset for dataset in datasets if dataset is not None]

    def streams(self) -> bool:
        """Whether a train or eval dataset is streamed (no lengths to read ahead, no sampler)."""
        return any(not isinstance(dataset, Dataset) for dataset in self.datasets())

    def longest_unit(self) -> int:
        """The longest packing unit of the train and eval datasets: measured on map-style datasets; for a stream, the
        bound every example obeys (each of its stock rows holds at most `max_length` tokens, as TRL truncates or
        drops longer ones, and a shared unit is never longer than its rows together)."""
        trainer = self._trainer()
        longest = 1
        for dataset in self.datasets():
            if isinstance(dataset, Dataset):
                grouped = bool(getattr(trainer.args, "group_by_prompt", False)) and dataset is trainer.train_dataset
                longest = max([longest, *self.unit_lengths(dataset, grouped)])
                continue
            if trainer.args.max_length is None:
                raise ValueError(
                    "`packing=True` on a streamed dataset needs a bound on its examples' length: set `max_length` "
                    "(the packed rows then default to `per_device_train_batch_size` x 2 x `max_length` tokens) or "
                    "`packing_length`."
                )
            longest = max(longest, self.rows_per_example * trainer.args.max_length)
        return longest

    def resolve_length(self) -> int:
        """`packing_length`, or `per_device_train_batch_size` x the longest unit (train and eval), rounded to 128."""
        args = self._trainer().args
        if args.packing_length is not None:
            return args.packing_length
        return -(-args.per_device_train_batch_size * self.longest_unit() // 128) * 128

    def sampler(self, dataset, shuffle: bool, grouped: bool = False) -> TrainerMultipackSampler:
        """The multipack sampler of `dataset`; `grouped`: the packing unit is a prompt's examples together (their
        trie), not one example."""
        trainer = self._trainer()
        trainer._setup_prefix_sharing()  # the collator wrapped: `length` resolved
        args = trainer.args
        return TrainerMultipackSampler(
            self.unit_lengths(dataset, grouped=grouped),
            self.length,
            num_replicas=args.world_size,
            rank=args.process_index,
            seed=args.seed,
            drop_last=args.dataloader_drop_last,
            shuffle=shuffle,
            members=self.groups(dataset) if grouped else None,
        )


def _record_metric_weights(trainer, mode, inputs, pairs, before) -> None:
    """Record what each metric TRL just logged averaged over in this micro-batch (pairs, or completion tokens), for
    the weighted mean of `PackingMixin.log`."""
    mask = inputs.get("completion_mask")
    device = inputs["input_ids"].device
    if mask is not None:
        mask = mask[:, 1:]
        rows = mask.shape[0] // 2
        tokens = [mask.sum(), mask[:rows].sum(), mask[rows:].sum()]
    else:
        tokens = [torch.tensor(0, device=device)] * 3
    counts = torch.stack([torch.tensor(pairs, device=device), *[t.to(device) for t in tokens]])
    pairs, all_tokens, chosen, rejected = trainer.accelerator.gather_for_metrics(counts.unsqueeze(0)).sum(0).tolist()
    weight_of = {"all": all_tokens, "chosen": chosen, "rejected": rejected}
    weights = trainer._metric_weights[mode]
    for key, values in trainer._metrics[mode].items():
        if key in _RUNNING_TOTALS or len(values) == before.get(key, 0):
            continue
        weights.setdefault(key, []).append(weight_of.get(trainer._token_weighted_metrics.get(key), pairs))


class PackingMixin:
    """Packing; see the module docstring: its batches (`packed_batches`, a `PackedBatches`), and the sampler, loss,
    metrics and evaluation that follow from a variable number of pairs per micro-batch."""

    def _init_packing(self, args) -> None:
        self._packing = bool(getattr(args, "packing", False))
        self._pairs_in_window = None
        self._metric_weights = {"train": {}, "eval": {}}
        self._packing_logged = False
        self.packed_batches = PackedBatches(self)

    def _packed_rows(self, backend) -> RowPolicy:
        """The row policy of packed batches under the session's attention `backend` (`backend.packed_rows`), handed to
        the collator once it is wrapped (the rows' length is measured with it)."""
        batches = self.packed_batches
        batches.length = batches.resolve_length()
        return backend.packed_rows(batches.length, batches.streams())

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        grouped = bool(getattr(self.args, "group_by_prompt", False))
        if self.packing and isinstance(dataset, Dataset):
            return self.packed_batches.sampler(dataset, shuffle=True, grouped=grouped)
        sampler = super()._get_train_sampler(train_dataset)
        return grouped_by_prompt(sampler, dataset, self._prompt_groups_of) if grouped else sampler

    def _get_eval_sampler(self, eval_dataset):
        if self.packing and isinstance(eval_dataset, Dataset):
            return self.packed_batches.sampler(eval_dataset, shuffle=False)
        return super()._get_eval_sampler(eval_dataset)

    def _pairs_in(self, batch) -> int:
        """Examples TRL's loss averages over in this batch."""
        return batch["input_ids"].shape[0] // 2

    def train(self, *args, **kwargs):
        if self.packing and not self._packing_logged and self.args.should_log:
            batches = self.packed_batches
            if isinstance(self.train_dataset, Dataset):
                sampler = batches.sampler(self.train_dataset, shuffle=True)
                logger.warning(
                    f"Packing: rows of {batches.length} tokens, {len(sampler)} per epoch "
                    f"on this rank, {100 * sampler.efficiency():.1f}% of their tokens used."
                )
            else:
                logger.warning(
                    f"Packing a streamed dataset: each batch of {self.args.per_device_train_batch_size} "
                    "examples as it arrives (no lengths to read ahead, so no multipack sampler), in rows of "
                    f"at most {batches.length} tokens."
                )
        self._packing_logged = True
        return super().train(*args, **kwargs)

    #: metric -> which completion tokens it averages over ("all", "chosen", "rejected"); others are per-pair means
    _token_weighted_metrics: dict[str, str] = {}

    # ----------------------------------------------------------------------------------------------- loss
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.packing:
            # pairs in this optimizer step over every micro-batch and every rank: each pair's share of the gradient
            pairs = torch.tensor(sum(self._pairs_in(b) for b in batch_samples), device=device)
            self._pairs_in_window = int(self.accelerator.gather(pairs).sum().item())
        return batch_samples, num_items_in_batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.packing:
            return self._base_compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        before = {key: len(values) for key, values in self._metrics[mode].items()}
        pairs = self._pairs_in(inputs)
        with variable_size_gathers(self.accelerator):  # ranks hold different numbers of pairs
            result = self._base_compute_loss(model, inputs, return_outputs, num_items_in_batch)
        _record_metric_weights(self, mode, inputs, pairs, before)
        if mode == "train" and self._pairs_in_window:
            # TRL averages over the pairs of this micro-batch; make it a sum over the pairs of the whole step (every
            # micro-batch of every rank), undoing the Trainer's division by the accumulation steps and DDP's mean.
            scale = pairs * self.current_gradient_accumulation_steps * self.accelerator.num_processes
            scale /= self._pairs_in_window
            result = (result[0] * scale, result[1]) if return_outputs else result * scale
        return result

    def _base_compute_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The loss the subclass's TRL trainer computes (overridable, e.g. for ranked reward batches)."""
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def log(self, logs, start_time=None):
        mode = "train" if self.model.training else "eval"
        if self.packing:
            for key, weights in self._metric_weights[mode].items():
                values = self._metrics[mode].get(key, [])
                if values and len(values) == len(weights):
                    total = sum(weights)
                    mean = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0
                    self._metrics[mode][key] = [mean]
            self._metric_weights[mode] = {}
        return super().log(logs, start_time)

    # ----------------------------------------------------------------------------------------------- evaluation
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self.packing and loss is not None:
            # `evaluation_loop` weighs every batch by the fixed `eval_batch_size`; a packed batch holds a variable
            # number of pairs, so repeat its mean once per pair: `eval_loss` is then the per-pair mean over the
            # dataset.
            loss = loss.reshape(1).repeat(self._pairs_in(inputs))
        return loss, logits, labels

    def evaluation_loop(self, *args, **kwargs):
        if not self.packing:
            return super().evaluation_loop(*args, **kwargs)
        # packed eval batches hold different numbers of pairs on each rank: the loop's gathers of per-pair losses (and
        # logits) need per-rank sizes, or the collective fails (gloo) or hangs. And no `gather_for_metrics`: on the
        # last batch of a stream it keeps as many values as the batch has stock rows, which cuts a packed batch's
        # per-pair losses short (a packed batch never repeats an example, so there is nothing to cut)
        gather_function = self.gather_function
        self.gather_function = lambda data: gather_variable(self.accelerator.gather, data)
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = gather_function
