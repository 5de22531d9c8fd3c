"""`DPOTrainer`: TRL's DPO trainer, with prefix sharing (`args.prefix_sharing`) and packing (`args.packing`)."""

from __future__ import annotations

import trl
from datasets import Dataset
from transformers import ProcessorMixin
from transformers.utils import logging

from .collated import PreferenceSharingMixin
from .config import DPOConfig
from .trainers import TRAINERS
from .validation import check_dataset_columns


__all__ = ["DPOTrainer"]


logger = logging.get_logger(__name__)

#: loss types computed over the whole batch rather than per pair (not pair-normalisable under packing)
BATCH_LEVEL_LOSS_TYPES = {"aot", "aot_unpaired", "sft"}


class DPOTrainer(PreferenceSharingMixin, trl.DPOTrainer):
    """TRL's [`trl.DPOTrainer`], computing each prompt once when `args.prefix_sharing=True`.

    Takes exactly the arguments of [`trl.DPOTrainer`]. With prefix sharing, the policy and reference log-probs, the
    loss (all loss types and their combinations), the gradients and every logged metric equal stock TRL's to float
    precision; the model computes `len(prompt) + len(chosen) + len(rejected) + 1` positions per pair instead of
    `2 * len(prompt) + len(chosen) + len(rejected)`. `num_tokens` is logged as in stock TRL (tokens of the stock rows);
    `num_shared_tokens` counts the positions really computed. PEFT's prompt tuning, P-tuning and prefix tuning too:
    their virtual tokens are computed once per micro-batch (`virtual.py`).

    With `args.packing=True`, a multipack sampler fills rows of `packing_length` tokens with whole examples; the loss
    is rescaled so that every pair weighs the same whatever the packing, across gradient accumulation and ranks, and
    logged metrics are weighted by the pairs (or completion tokens) each step averaged over.
    """

    _config_class = DPOConfig
    _supports_vision = True  # TRL's vision collator: images laid out by `trl_prefix_sharing.vision`
    _virtual_tokens_refused = None  # prompt tuning, P-tuning and prefix tuning: `virtual.py`
    _token_weighted_metrics = {
        "entropy": "all",
        "logits/chosen": "chosen",
        "logits/rejected": "rejected",
        "mean_token_accuracy": "chosen",
    }

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
        self._init_prefix_sharing(
            model, args, processing_class, peft_config, datasets={"train": train_dataset, "eval": eval_dataset}
        )
        if self._uses_layout:
            images = processing_class is None or isinstance(processing_class, ProcessorMixin)  # TRL's vision path
            check_dataset_columns(train_dataset, "train", TRAINERS["dpo"].columns, allow_images=images)
            check_dataset_columns(eval_dataset, "eval", TRAINERS["dpo"].columns, allow_images=images)
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
        self._finish_prefix_sharing_init()
        batch_level = sorted(set(self.loss_types) & BATCH_LEVEL_LOSS_TYPES)
        if self.packing and batch_level:
            logger.warning(
                f"Loss types {batch_level} look at the whole batch (a rank over the batch, or a mean over its "
                "tokens): with packing, their batch is the packed micro-batch, whose number of pairs varies, so they "
                "differ from a stock run with a fixed batch size. The per-pair loss types are exact; or train with "
                "packing=False."
            )

    def _precompute_ref_logps(self, dataset, name, batch_size):
        if not isinstance(dataset, Dataset):
            return super()._precompute_ref_logps(dataset, name, batch_size)  # TRL's own error for streams
        self._setup_prefix_sharing()  # TRL runs this from inside `__init__`
        if not self.packing:
            return super()._precompute_ref_logps(dataset, name, batch_size)
        packed_collator, self.data_collator = (
            self.data_collator,
            self.data_collator.unpacked(self.sharing_session.rows),
        )
        try:  # fixed-size batches (TRL's DataLoader), so the session's unpacked rows
            return super()._precompute_ref_logps(dataset, name, batch_size)
        finally:
            self.data_collator = packed_collator

    def compute_ref_log_probs(self, model, inputs):
        if self.sharing_session is not None:
            self._prepare_layout(inputs)
        return super().compute_ref_log_probs(model, inputs)
