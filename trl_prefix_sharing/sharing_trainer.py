"""What the prefix-sharing DPO and reward trainers have in common, as a mixin placed before TRL's trainer class.

It wraps the data collator (adds the shared layout) and the models' forwards (run the shared rows, return outputs in
the stock layout), switches attention, builds the mask once per step, and with packing: the multipack sampler, the
pair-normalised loss, metric weighting and gathers that accept per-rank sizes. TRL's own loss code runs unchanged.
"""

from __future__ import annotations

import torch
from datasets import Dataset, IterableDataset
from transformers.trainer_pt_utils import BatchRebalanceSampler
from transformers.utils import logging

from .architectures import model_attn_implementation
from .attention import AttentionSwitch, build_attention_mask, check_supported_model, resolve_attn_implementation
from .collator import PrefixSharingCollator, unit_lengths
from .distributed import gather_variable, variable_size_gathers
from .forward import install_prefix_sharing_forward, remove_prefix_sharing_forward, unwrap_model
from .sampler import MultipackSampler
from .stats import sharing_stats
from .validation import validate_preference_rows

logger = logging.get_logger(__name__)

_RUNNING_TOTALS = {"num_tokens", "num_shared_tokens"}


class _TrainerMultipackSampler(MultipackSampler, BatchRebalanceSampler):
    """A `MultipackSampler` the Trainer passes as `batch_sampler` and does not re-shard (it is already rank-aware):
    transformers' `_get_dataloader` does exactly this for `BatchRebalanceSampler` instances."""

    def __init__(self, *args, **kwargs):
        MultipackSampler.__init__(self, *args, **kwargs)


def check_dataset_columns(dataset, name: str, accepted: tuple[set[str], ...], describe: str) -> None:
    """Clear errors for vision datasets and missing columns, before TRL's preprocessing."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            check_dataset_columns(value, f"{name}[{key!r}]", accepted, describe)
        return
    if isinstance(dataset, Dataset):
        columns = set(dataset.column_names)
    elif isinstance(dataset, IterableDataset):
        columns = set(next(iter(dataset)).keys())
    else:
        return  # TRL raises its own error for other types
    if "image" in columns or "images" in columns:
        raise ValueError(
            f"Prefix sharing does not support vision datasets ({name} has an image column): image tokens are expanded "
            "inside the model, so the shared layout cannot be built from token ids. Train it with "
            "`prefix_sharing=False`."
        )
    if not any(required <= columns for required in accepted):
        raise ValueError(f"The {name} dataset has columns {sorted(columns)}; {describe}")
    validate_preference_rows(dataset, name)


class PrefixSharingTrainerMixin:
    """Shared machinery; see the module docstring. Subclasses call `_init_prefix_sharing_state()` before TRL's
    `__init__` and `_setup_prefix_sharing()` after it."""

    #: metric -> which completion tokens it averages over ("all", "chosen", "rejected"); others are per-pair means
    _token_weighted_metrics: dict[str, str] = {}

    def _init_prefix_sharing_state(self) -> None:
        self._prefix_sharing_ready = False
        self._attention_switch = AttentionSwitch()
        self._sharing_logged = False
        self._total_shared_tokens = 0
        self._pairs_in_window = None
        self._unit_lengths_cache = {}
        self._metric_weights = {"train": {}, "eval": {}}
        self.sharing_stats = None

    # ----------------------------------------------------------------------------------------------- options
    @property
    def prefix_sharing(self) -> bool:
        return bool(getattr(self.args, "prefix_sharing", False))

    @property
    def packing(self) -> bool:
        return bool(getattr(self.args, "packing", False))

    @property
    def _uses_layout(self) -> bool:
        """Prefix sharing and packing both run the model on rows built by `PrefixSharingCollator`."""
        return self.prefix_sharing or self.packing

    @staticmethod
    def _check_model_and_processor(model, args, processing_class, peft_config) -> None:
        from transformers import ProcessorMixin

        if isinstance(processing_class, ProcessorMixin):
            raise ValueError(
                "Prefix sharing does not support vision-language models (a processor was passed). Train them with "
                "`prefix_sharing=False`."
            )
        if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
            raise ValueError(
                f"Prefix sharing does not support prompt-learning PEFT ({type(peft_config).__name__}): its virtual "
                "tokens are prepended to every row and would be shared differently. Use LoRA-style adapters or "
                "`prefix_sharing=False`."
            )
        if isinstance(model, str):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model, trust_remote_code=args.trust_remote_code)
        else:
            config = model.config
        check_supported_model(config)

    # ----------------------------------------------------------------------------------------------- set-up
    def _layout_models(self) -> list:
        models = [unwrap_model(self.model)]
        if getattr(self, "ref_model", None) is not None:
            models.append(unwrap_model(self.ref_model))
        return models

    def _setup_prefix_sharing(self) -> None:
        """Wrap the collator and the models' forwards, switch attention. Idempotent."""
        if self._prefix_sharing_ready or not self._uses_layout:
            return
        if getattr(getattr(self.model, "active_peft_config", None), "is_prompt_learning", False):
            raise ValueError("Prefix sharing does not support prompt-learning PEFT adapters.")
        requested = resolve_attn_implementation(self.args.prefix_sharing_attn_implementation, self.accelerator.device)
        models = self._layout_models()
        for model in models:
            check_supported_model(model.config)
        # one mask per step serves the policy and reference passes: both must take the same kind
        implementations = {model_attn_implementation(model, requested) for model in models}
        if len(implementations) > 1:
            raise ValueError(
                f"The policy and reference models need different attention implementations under prefix sharing "
                f"({sorted(implementations)}); use a reference model of the same architecture."
            )
        self._attn_implementation = implementations.pop()
        for model in models:
            self._attention_switch.apply(model, self._attn_implementation)
            install_prefix_sharing_forward(model)
        if not isinstance(self.data_collator, PrefixSharingCollator):
            self.data_collator = PrefixSharingCollator(
                self.data_collator,
                pad_token_id=self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id")
                else self.processing_class.tokenizer.pad_token_id,
                pad_to_multiple_of=self.args.pad_to_multiple_of,
                share_prefix=self.prefix_sharing,
            )
        if self.packing:
            self.data_collator.packing_length = self._resolve_packing_length()
            if self._attn_implementation != "flex_attention":
                # dense attention costs the square of the row length whatever the mask: several rows per batch, as
                # long as its longest document (never more attention than stock's padded rows), not one long row
                self.data_collator.packing_row_length = "batch"
        self._prefix_sharing_ready = True

    def remove_prefix_sharing(self) -> None:
        """Undo the patches on the models (forward wrap and attention switch) and the collator wrap; the trainer then
        trains as stock TRL."""
        for model in self._layout_models():
            remove_prefix_sharing_forward(model)
        self._attention_switch.restore()
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

    def _longest_unit(self) -> int:
        """The longest packing unit of the train and eval datasets."""
        datasets = [self.train_dataset]
        if isinstance(self.eval_dataset, dict):
            datasets += list(self.eval_dataset.values())
        elif self.eval_dataset is not None:
            datasets.append(self.eval_dataset)
        longest = 1
        for dataset in datasets:
            if not isinstance(dataset, Dataset):
                raise ValueError("`packing=True` needs map-style datasets (the sampler needs every example's length).")
            longest = max([longest, *self._unit_lengths(dataset)])
        return longest

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
        layout = inputs.get("prefix_sharing") if isinstance(inputs, dict) else None
        if layout is None:
            if self._uses_layout:
                raise RuntimeError("Prefix sharing is on but the batch has no layout: was the data collator replaced?")
            return
        if "attention_mask" not in layout:
            layout["attention_mask"] = build_attention_mask(
                layout, self._attn_implementation, unwrap_model(self.model).config
            )

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
        if not (self.packing and self.accelerator.num_processes > 1):
            return super().evaluation_loop(*args, **kwargs)
        # packed eval batches hold different numbers of pairs on each rank: the loop's gathers of per-pair losses (and
        # logits) need per-rank sizes, or the collective fails (gloo) or hangs
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
        return super().train(*args, **kwargs)
