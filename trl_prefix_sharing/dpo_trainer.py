"""`DPOTrainer`: TRL's DPO trainer, with prefix sharing when `args.prefix_sharing` is set.

The subclass overrides only what the behaviour needs: it wraps the data collator (adds the shared layout), wraps the
fused forward of the policy and reference models (runs the shared rows, returns stock-shaped per-token outputs), and
builds the attention mask once per step before TRL's own `_compute_loss` / `compute_ref_log_probs` run unchanged.
"""

from __future__ import annotations

import trl
from datasets import Dataset, IterableDataset
from transformers.utils import logging

from .attention import AttentionSwitch, build_attention_mask, check_supported_model, resolve_attn_implementation
from .collator import PrefixSharingCollator
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


class DPOTrainer(trl.DPOTrainer):
    """TRL's [`trl.DPOTrainer`], computing each prompt once when `args.prefix_sharing=True`.

    Takes exactly the arguments of [`trl.DPOTrainer`]. With prefix sharing, the policy and reference log-probs, the
    loss (all loss types and their combinations), the gradients and every logged metric equal stock TRL's to float
    precision; the model computes `len(prompt) + len(chosen) + len(rejected) + 1` positions per pair instead of
    `2 * len(prompt) + len(chosen) + len(rejected)`. `num_tokens` is logged as in stock TRL (tokens of the stock rows);
    `num_shared_tokens` counts the positions really computed.
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
        if args is not None and getattr(args, "prefix_sharing", False):
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

    @staticmethod
    def _check_before_init(model, args, train_dataset, eval_dataset, processing_class, peft_config) -> None:
        if not isinstance(args, DPOConfig):
            raise TypeError("`prefix_sharing` needs `trl_prefix_sharing.DPOConfig` as `args`.")
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
        if self._prefix_sharing_ready or not self.prefix_sharing:
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
            )
        self._prefix_sharing_ready = True

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

    # ----------------------------------------------------------------------------------------------- per step
    def _attach_attention_mask(self, inputs) -> None:
        layout = inputs.get("prefix_sharing") if isinstance(inputs, dict) else None
        if layout is None:
            if self.prefix_sharing:
                raise RuntimeError("Prefix sharing is on but the batch has no layout: was the data collator replaced?")
            return
        if "attention_mask" not in layout:
            layout["attention_mask"] = build_attention_mask(
                layout, self._attn_implementation, unwrap_model(self.model).config
            )

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self._setup_prefix_sharing()
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def compute_ref_log_probs(self, model, inputs):
        self._attach_attention_mask(inputs)
        return super().compute_ref_log_probs(model, inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._attach_attention_mask(inputs)
        if self.prefix_sharing and self.model.training:
            shared = (inputs["prefix_sharing"]["document_ids"] >= 0).sum()
            self._total_shared_tokens += int(self.accelerator.gather_for_metrics(shared).sum().item())
            self._metrics["train"]["num_shared_tokens"] = [self._total_shared_tokens]
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def train(self, *args, **kwargs):
        if self.prefix_sharing and not self._sharing_logged and isinstance(self.train_dataset, Dataset):
            stats = sharing_stats(self.train_dataset, self.data_collator)
            if self.args.should_log:
                logger.warning(stats.summary())
            self.sharing_stats = stats
            self._sharing_logged = True
        return super().train(*args, **kwargs)
