"""What the prefix-sharing DPO and reward trainers have in common, as a mixin placed before TRL's trainer class.

It wraps the data collator (adds the shared layout) and the models' forwards (run the shared rows, return outputs in
the stock layout), switches attention, builds the mask once per step, and with packing: the multipack sampler, the
pair-normalised loss, metric weighting and gathers that accept per-rank sizes. TRL's own loss code runs unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from datasets import Dataset, IterableDataset
from transformers.trainer_pt_utils import BatchRebalanceSampler
from transformers.utils import logging

from .attention import build_attention_mask, shared_row_multiple
from .collator import PrefixSharingCollator, unit_lengths
from .distributed import gather_variable, variable_size_gathers
from .forward import unwrap_model
from .sampler import MultipackSampler
from .stats import sharing_stats
from .trainer_setup import SharingSetupMixin
from .validation import validate_preference_rows
from .vision import VISION_MODEL_TYPES, has_vision_inputs, shared_vision_inputs

logger = logging.get_logger(__name__)

_RUNNING_TOTALS = {"num_tokens", "num_shared_tokens"}


class _TrainerMultipackSampler(MultipackSampler, BatchRebalanceSampler):
    """A `MultipackSampler` the Trainer passes as `batch_sampler` and does not re-shard (it is already rank-aware):
    transformers' `_get_dataloader` does exactly this for `BatchRebalanceSampler` instances."""

    def __init__(self, *args, **kwargs):
        MultipackSampler.__init__(self, *args, **kwargs)


def check_dataset_columns(dataset, name: str, accepted: tuple[set[str], ...], describe: str,
                          allow_images: bool = False) -> None:
    """Clear errors for vision datasets (unless `allow_images`) and missing columns, before TRL's preprocessing."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            check_dataset_columns(value, f"{name}[{key!r}]", accepted, describe, allow_images)
        return
    if isinstance(dataset, Dataset):
        columns = set(dataset.column_names)
    elif isinstance(dataset, IterableDataset):
        columns = set(next(iter(dataset)).keys())
    else:
        return  # TRL raises its own error for other types
    if ("image" in columns or "images" in columns) and not allow_images:
        raise ValueError(
            f"The {name} dataset has an image column: prefix sharing lays out images for DPO with a vision-language "
            f"model ({', '.join(VISION_MODEL_TYPES)}) and its processor as `processing_class`; TRL 1.16's "
            "RewardTrainer has no image support. Otherwise train it with `prefix_sharing=False`."
        )
    if not any(required <= columns for required in accepted):
        raise ValueError(f"The {name} dataset has columns {sorted(columns)}; {describe}")
    validate_preference_rows(dataset, name)


class PrefixSharingTrainerMixin(SharingSetupMixin):
    """Shared machinery; see the module docstring. Subclasses call `_init_prefix_sharing_state()` before TRL's
    `__init__` and `_setup_prefix_sharing()` after it."""

    #: metric -> which completion tokens it averages over ("all", "chosen", "rejected"); others are per-pair means
    _token_weighted_metrics: dict[str, str] = {}

    def _init_prefix_sharing_state(self) -> None:
        self._init_sharing_setup()
        self._prefix_sharing_ready = False
        self._sharing_logged = False
        self._total_shared_tokens = 0
        self._pairs_in_window = None
        self._unit_lengths_cache = {}
        self._metric_weights = {"train": {}, "eval": {}}
        self.sharing_stats = None

    # ----------------------------------------------------------------------------------------------- options
    @property
    def packing(self) -> bool:
        return bool(getattr(self.args, "packing", False))

    @property
    def _uses_layout(self) -> bool:
        """Prefix sharing and packing both run the model on rows built by `PrefixSharingCollator`."""
        return self.prefix_sharing or self.packing

    # ----------------------------------------------------------------------------------------------- set-up
    def _setup_prefix_sharing(self) -> None:
        """Wrap the collator and the models' forwards, switch attention. Idempotent."""
        if self._prefix_sharing_ready or not self._uses_layout:
            return
        self._patch_models()
        if not isinstance(self.data_collator, PrefixSharingCollator):
            self.data_collator = PrefixSharingCollator(
                self.data_collator,
                pad_token_id=self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id")
                else self.processing_class.tokenizer.pad_token_id,
                pad_to_multiple_of=shared_row_multiple(self._attn_implementation, self.args.pad_to_multiple_of),
                share_prefix=self.prefix_sharing,
            )
        if self.packing:
            self.data_collator.packing_length = self._resolve_packing_length()
            if self._attn_implementation != "flex_attention":
                # dense attention costs the square of the row length whatever the mask: several rows per batch, as
                # long as its longest document (never more attention than stock's padded rows), not one long row
                self.data_collator.packing_row_length = "batch"
            elif self._streams():
                # a stream has no sampler to make a batch fit one row: the collator packs what arrives into as many
                # rows of `packing_length` as it needs (first-fit decreasing); a map-style batch still takes one
                self.data_collator.packing_row_length = self.data_collator.packing_length
        self._prefix_sharing_ready = True

    def remove_prefix_sharing(self) -> None:
        """Undo the patches on the models (forward wrap and attention switch) and the collator wrap; the trainer then
        trains as stock TRL."""
        self._unpatch_models()
        if isinstance(self.data_collator, PrefixSharingCollator):
            self.data_collator = self.data_collator.base_collator
        self._prefix_sharing_ready = False
        self.args.prefix_sharing = False
        self.args.packing = False

    # ----------------------------------------------------------------------------------------------- packing
    def _unit_lengths(self, dataset) -> list[int]:
        key = getattr(dataset, "_fingerprint", None) or id(dataset)
        if key not in self._unit_lengths_cache:
            self._unit_lengths_cache[key] = unit_lengths(dataset, self.data_collator)
        return self._unit_lengths_cache[key]

    def _datasets(self) -> list:
        """The train and eval datasets."""
        datasets = [self.train_dataset]
        if isinstance(self.eval_dataset, dict):
            datasets += list(self.eval_dataset.values())
        else:
            datasets.append(self.eval_dataset)
        return [dataset for dataset in datasets if dataset is not None]

    def _streams(self) -> bool:
        """Whether a train or eval dataset is streamed (no lengths to read ahead, no sampler)."""
        return any(not isinstance(dataset, Dataset) for dataset in self._datasets())

    def _longest_unit(self) -> int:
        """The longest packing unit of the train and eval datasets: measured on map-style datasets; for a stream, the
        bound every example obeys (each of its stock rows holds at most `max_length` tokens, as TRL truncates or
        drops longer ones, and a shared unit is never longer than its rows together)."""
        longest = 1
        for dataset in self._datasets():
            if isinstance(dataset, Dataset):
                longest = max([longest, *self._unit_lengths(dataset)])
                continue
            if self.args.max_length is None:
                raise ValueError(
                    "`packing=True` on a streamed dataset needs a bound on its examples' length: set `max_length` "
                    "(the packed rows then default to `per_device_train_batch_size` x 2 x `max_length` tokens) or "
                    "`packing_length`."
                )
            longest = max(longest, self._rows_per_example * self.args.max_length)
        return longest

    #: stock rows per example (a preference pair); a stream's packing unit is at most this many rows of `max_length`
    _rows_per_example = 2

    def _resolve_packing_length(self) -> int:
        """`packing_length`, or `per_device_train_batch_size` x the longest unit (train and eval), rounded to 128."""
        if self.args.packing_length is not None:
            return self.args.packing_length
        return -(-self.args.per_device_train_batch_size * self._longest_unit() // 128) * 128

    def _multipack_sampler(self, dataset, shuffle: bool):
        self._setup_prefix_sharing()
        return _TrainerMultipackSampler(
            self._unit_lengths(dataset),
            self.data_collator.packing_length,
            num_replicas=self.args.world_size,
            rank=self.args.process_index,
            seed=self.args.seed,
            drop_last=self.args.dataloader_drop_last,
            shuffle=shuffle,
        )

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.packing and isinstance(dataset, Dataset):
            return self._multipack_sampler(dataset, shuffle=True)
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        if self.packing and isinstance(eval_dataset, Dataset):
            return self._multipack_sampler(eval_dataset, shuffle=False)
        return super()._get_eval_sampler(eval_dataset)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.packing:
            # pairs in this optimizer step over every micro-batch and every rank: each pair's share of the gradient
            pairs = torch.tensor(sum(self._pairs_in(b) for b in batch_samples), device=device)
            self._pairs_in_window = int(self.accelerator.gather(pairs).sum().item())
        return batch_samples, num_items_in_batch

    def _pairs_in(self, batch) -> int:
        """Examples TRL's loss averages over in this batch."""
        return batch["input_ids"].shape[0] // 2

    # ----------------------------------------------------------------------------------------------- per step
    def _attach_attention_mask(self, inputs) -> None:
        layout = inputs.get("prefix_sharing") if isinstance(inputs, Mapping) else None
        if layout is None:
            if self._uses_layout:
                raise RuntimeError("Prefix sharing is on but the batch has no layout: was the data collator replaced?")
            return
        if "attention_mask" not in layout:
            layout["attention_mask"] = build_attention_mask(
                layout, self._attn_implementation, unwrap_model(self.model).config
            )
        if "vision" not in layout and has_vision_inputs(inputs):  # images once per pair, M-RoPE positions
            layout["vision"] = shared_vision_inputs(unwrap_model(self.model), inputs, layout)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._attach_attention_mask(inputs)
        mode = "train" if self.model.training else "eval"
        if self._uses_layout and mode == "train":
            shared = (inputs["prefix_sharing"]["document_ids"] >= 0).sum()
            self._total_shared_tokens += int(self.accelerator.gather_for_metrics(shared).sum().item())
            self._metrics["train"]["num_shared_tokens"] = [self._total_shared_tokens]
        if not self.packing:
            return self._base_compute_loss(model, inputs, return_outputs, num_items_in_batch)
        before = {key: len(values) for key, values in self._metrics[mode].items()}
        pairs = self._pairs_in(inputs)
        with variable_size_gathers(self.accelerator):  # ranks hold different numbers of pairs
            result = self._base_compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._record_metric_weights(mode, inputs, pairs, before)
        if mode == "train" and self._pairs_in_window:
            # TRL averages over the pairs of this micro-batch; make it a sum over the pairs of the whole step (every
            # micro-batch of every rank), undoing the Trainer's division by the accumulation steps and DDP's mean.
            scale = pairs * self.current_gradient_accumulation_steps * self.accelerator.num_processes
            scale /= self._pairs_in_window
            result = (result[0] * scale, result[1]) if return_outputs else result * scale
        return result

    def _base_compute_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The loss the subclass's TRL trainer computes (overridable, e.g. for ranked reward batches)."""
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def _record_metric_weights(self, mode, inputs, pairs, before) -> None:
        mask = inputs.get("completion_mask")
        device = inputs["input_ids"].device
        if mask is not None:
            mask = mask[:, 1:]
            rows = mask.shape[0] // 2
            tokens = [mask.sum(), mask[:rows].sum(), mask[rows:].sum()]
        else:
            tokens = [torch.tensor(0, device=device)] * 3
        counts = torch.stack([torch.tensor(pairs, device=device), *[t.to(device) for t in tokens]])
        pairs, all_tokens, chosen, rejected = self.accelerator.gather_for_metrics(counts.unsqueeze(0)).sum(0).tolist()
        weight_of = {"all": all_tokens, "chosen": chosen, "rejected": rejected}
        weights = self._metric_weights[mode]
        for key, values in self._metrics[mode].items():
            if key in _RUNNING_TOTALS or len(values) == before.get(key, 0):
                continue
            weights.setdefault(key, []).append(weight_of.get(self._token_weighted_metrics.get(key), pairs))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self.packing and loss is not None:
            # `evaluation_loop` weighs every batch by the fixed `eval_batch_size`; a packed batch holds a variable number
            # of pairs, so repeat its mean once per pair: `eval_loss` is then the per-pair mean over the dataset.
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

    def log(self, logs, start_time=None):
        mode = "train" if self.model.training else "eval"
        if self.packing:
            for key, weights in self._metric_weights[mode].items():
                values = self._metrics[mode].get(key, [])
                if values and len(values) == len(weights):
                    total = sum(weights)
                    mean = sum(v * w for v, w in zip(values, weights)) / total if total else 0.0
                    self._metrics[mode][key] = [mean]
            self._metric_weights[mode] = {}
        return super().log(logs, start_time)

    def train(self, *args, **kwargs):
        if self._uses_layout and not self._sharing_logged and isinstance(self.train_dataset, Dataset):
            stats = sharing_stats(self.train_dataset, self.data_collator.unpacked()) if self.prefix_sharing else None
            message = stats.summary() if stats is not None else ""
            if self.packing:
                sampler = self._multipack_sampler(self.train_dataset, shuffle=True)
                message += (f" Packing: rows of {self.data_collator.packing_length} tokens, {len(sampler)} per epoch "
                            f"on this rank, {100 * sampler.efficiency():.1f}% of their tokens used.")
            if self.args.should_log:
                logger.warning(message.strip())
            self.sharing_stats = stats
            self._sharing_logged = True
        elif self.packing and not self._sharing_logged and self.args.should_log:
            logger.warning(f"Packing a streamed dataset: each batch of {self.args.per_device_train_batch_size} examples "
                           "as it arrives (no lengths to read ahead, so no multipack sampler), in rows of at most "
                           f"{self.data_collator.packing_length} tokens.")
            self._sharing_logged = True
        return super().train(*args, **kwargs)
