"""`DPOTrainer`: TRL's DPO trainer, with prefix sharing when `args.prefix_sharing` is set.

The subclass overrides only what the behaviour needs: it wraps the data collator (adds the shared layout), wraps the
fused forward of the policy and reference models (runs the shared rows, returns stock-shaped per-token outputs), and
builds the attention mask once per step before TRL's own `_compute_loss` / `compute_ref_log_probs` run unchanged.
"""

from __future__ import annotations

import trl
import torch
from datasets import Dataset, IterableDataset
from transformers.trainer_pt_utils import BatchRebalanceSampler
from transformers.utils import logging

from .attention import AttentionSwitch, build_attention_mask, check_supported_model, resolve_attn_implementation
from .collator import PrefixSharingCollator, unit_lengths
from .sampler import MultipackSampler
from .distributed import variable_size_gathers
from .dpo_config import DPOConfig
from .forward import install_prefix_sharing_forward, remove_prefix_sharing_forward, unwrap_model
from .stats import sharing_stats

logger = logging.get_logger(__name__)

__all__ = ["DPOTrainer"]

_TEXT_COLUMNS = ({"chosen", "rejected"}, {"prompt_ids", "chosen_ids", "rejected_ids"})


def _check_preference_dataset(dataset, name: str) -> None:
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            _check_preference_dataset(value, f"{name}[{key!r}]")
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
    if not any(required <= columns for required in _TEXT_COLUMNS):
        raise ValueError(
            f"The {name} dataset has columns {sorted(columns)}; a preference dataset needs 'chosen' and 'rejected' "
            "(and optionally 'prompt'), text or conversational, or pre-tokenized 'prompt_ids', 'chosen_ids' and "
            "'rejected_ids'."
        )


# Metrics TRL averages over completion tokens (the rest are per-pair means, or running totals): with packing, a step
# holds a variable number of pairs and tokens, so each step's value is weighted by what it averaged over.
_TOKEN_WEIGHTED_METRICS = {"entropy": "all", "logits/chosen": "chosen", "logits/rejected": "rejected",
                           "mean_token_accuracy": "chosen"}
_RUNNING_TOTALS = {"num_tokens", "num_shared_tokens"}


class _TrainerMultipackSampler(MultipackSampler, BatchRebalanceSampler):
    """A `MultipackSampler` the Trainer passes as `batch_sampler` and does not re-shard (it is already rank-aware):
    transformers' `_get_dataloader` does exactly this for `BatchRebalanceSampler` instances."""

    def __init__(self, *args, **kwargs):
        MultipackSampler.__init__(self, *args, **kwargs)


class DPOTrainer(trl.DPOTrainer):
    """TRL's [`trl.DPOTrainer`], computing each prompt once when `args.prefix_sharing=True`.

    Takes exactly the arguments of [`trl.DPOTrainer`]. With prefix sharing, the policy and reference log-probs, the
    loss (all loss types and their combinations), the gradients and every logged metric equal stock TRL's to float
    precision; the model computes `len(prompt) + len(chosen) + len(rejected) + 1` positions per pair instead of
    `2 * len(prompt) + len(chosen) + len(rejected)`. `num_tokens` is logged as in stock TRL (tokens of the stock rows);
    `num_shared_tokens` counts the positions really computed.

    With `args.packing=True`, a multipack sampler fills rows of `packing_length` tokens with whole examples; the loss
    is rescaled so that every pair weighs the same whatever the packing, across gradient accumulation and ranks, and
    logged metrics are weighted by the pairs (or completion tokens) each step averaged over.
    """

    def __init__(
        self,
        model,
        ref_model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
    ):
        self._prefix_sharing_ready = False
        self._attention_switch = AttentionSwitch()
        self._sharing_logged = False
        self._total_shared_tokens = 0
        self._pairs_in_window = None
        self._unit_lengths_cache = {}
        self._metric_weights = {"train": {}, "eval": {}}
        if args is not None and (getattr(args, "prefix_sharing", False) or getattr(args, "packing", False)):
            self._check_before_init(model, args, train_dataset, eval_dataset, processing_class, peft_config)
        super().__init__(
            model=model,
            ref_model=ref_model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self._setup_prefix_sharing()

    # ----------------------------------------------------------------------------------------------- set-up
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
    def _check_before_init(model, args, train_dataset, eval_dataset, processing_class, peft_config) -> None:
        if not isinstance(args, DPOConfig):
            raise TypeError("`prefix_sharing`/`packing` need `trl_prefix_sharing.DPOConfig` as `args`.")
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
        _check_preference_dataset(train_dataset, "train")
        _check_preference_dataset(eval_dataset, "eval")

    def _setup_prefix_sharing(self) -> None:
        """Wrap the collator and the models' forwards, switch attention. Idempotent: also called by the precompute
        pass, which TRL runs from inside `__init__`."""
        if self._prefix_sharing_ready or not self._uses_layout:
            return
        policy = unwrap_model(self.model)
        if getattr(getattr(self.model, "active_peft_config", None), "is_prompt_learning", False):
            raise ValueError("Prefix sharing does not support prompt-learning PEFT adapters.")
        self._attn_implementation = resolve_attn_implementation(
            self.args.prefix_sharing_attn_implementation, self.accelerator.device
        )
        models = [policy] + ([unwrap_model(self.ref_model)] if self.ref_model is not None else [])
        for model in models:
            check_supported_model(model.config)
            self._attention_switch.apply(model, self._attn_implementation)
            install_prefix_sharing_forward(model)
        if not isinstance(self.data_collator, PrefixSharingCollator):
            self.data_collator = PrefixSharingCollator(
                self.data_collator,
                pad_token_id=self._tokenizer.pad_token_id,
                pad_to_multiple_of=self.args.pad_to_multiple_of,
                share_prefix=self.prefix_sharing,
            )
        if self.packing:
            self.data_collator.packing_length = self._resolve_packing_length()
        self._prefix_sharing_ready = True

    def _unit_lengths(self, dataset) -> list[int]:
        key = getattr(dataset, "_fingerprint", None) or id(dataset)
        if key not in self._unit_lengths_cache:
            self._unit_lengths_cache[key] = unit_lengths(dataset, self.data_collator)
        return self._unit_lengths_cache[key]

    def _resolve_packing_length(self) -> int:
        """`packing_length`, or `per_device_train_batch_size` x the longest unit (train and eval), rounded to 128."""
        if self.args.packing_length is not None:
            return self.args.packing_length
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
        return -(-self.args.per_device_train_batch_size * longest // 128) * 128

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
        if self.packing and isinstance(train_dataset if train_dataset is not None else self.train_dataset, Dataset):
            return self._multipack_sampler(train_dataset if train_dataset is not None else self.train_dataset, True)
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        if self.packing and isinstance(eval_dataset, Dataset):
            return self._multipack_sampler(eval_dataset, False)
        return super()._get_eval_sampler(eval_dataset)

    def remove_prefix_sharing(self) -> None:
        """Undo the patches on the models (forward wrap and attention switch); the trainer then cannot train with
        prefix sharing any more."""
        for model in [unwrap_model(self.model)] + ([unwrap_model(self.ref_model)] if self.ref_model is not None else []):
            remove_prefix_sharing_forward(model)
        self._attention_switch.restore()
        if isinstance(self.data_collator, PrefixSharingCollator):
            self.data_collator = self.data_collator.base_collator
        self._prefix_sharing_ready = False
        self.args.prefix_sharing = False
        self.args.packing = False

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

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self._setup_prefix_sharing()
        if not self.packing:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        packed_collator, self.data_collator = self.data_collator, self.data_collator.unpacked()
        try:  # fixed-size batches (TRL's DataLoader), so unpacked rows: one document per row
            return super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            self.data_collator = packed_collator

    def compute_ref_log_probs(self, model, inputs):
        self._attach_attention_mask(inputs)
        return super().compute_ref_log_probs(model, inputs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.packing:
            # pairs in this optimizer step over every micro-batch and every rank: each pair's share of the gradient
            pairs = torch.tensor(sum(b["input_ids"].shape[0] // 2 for b in batch_samples), device=device)
            self._pairs_in_window = int(self.accelerator.gather(pairs).sum().item())
        return batch_samples, num_items_in_batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._attach_attention_mask(inputs)
        mode = "train" if self.model.training else "eval"
        if self._uses_layout and mode == "train":
            shared = (inputs["prefix_sharing"]["document_ids"] >= 0).sum()
            self._total_shared_tokens += int(self.accelerator.gather_for_metrics(shared).sum().item())
            self._metrics["train"]["num_shared_tokens"] = [self._total_shared_tokens]
        if self.packing:
            before = {key: len(values) for key, values in self._metrics[mode].items()}
        if not self.packing:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        with variable_size_gathers(self.accelerator):  # ranks hold different numbers of pairs
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
        self._record_metric_weights(mode, inputs, before)
        if mode == "train" and self._pairs_in_window:
            # TRL averages over the pairs of this micro-batch; make it a sum over the pairs of the whole step (every
            # micro-batch of every rank), undoing the Trainer's division by the accumulation steps and DDP's mean.
            pairs = inputs["input_ids"].shape[0] // 2
            scale = pairs * self.current_gradient_accumulation_steps * self.accelerator.num_processes
            scale /= self._pairs_in_window
            result = (result[0] * scale, result[1]) if return_outputs else result * scale
        return result

    def _record_metric_weights(self, mode, inputs, before) -> None:
        mask = inputs["completion_mask"][:, 1:]
        pairs = mask.shape[0] // 2
        counts = torch.stack([torch.tensor(pairs, device=mask.device), mask.sum(), mask[:pairs].sum(),
                              mask[pairs:].sum()])
        pairs, all_tokens, chosen, rejected = self.accelerator.gather_for_metrics(counts.unsqueeze(0)).sum(0).tolist()
        weight_of = {"all": all_tokens, "chosen": chosen, "rejected": rejected}
        weights = self._metric_weights[mode]
        for key, values in self._metrics[mode].items():
            if key in _RUNNING_TOTALS or len(values) == before.get(key, 0):
                continue
            weights.setdefault(key, []).append(weight_of.get(_TOKEN_WEIGHTED_METRICS.get(key), pairs))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self.packing and loss is not None:
            # `evaluation_loop` weighs every batch by the fixed `eval_batch_size`; a packed batch holds a variable number
            # of pairs, so repeat its mean once per pair: `eval_loss` is then the per-pair mean over the dataset.
            loss = loss.reshape(1).repeat(inputs["input_ids"].shape[0] // 2)
        return loss, logits, labels

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
