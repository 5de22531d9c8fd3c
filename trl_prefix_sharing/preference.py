"""What the prefix-sharing DPO and reward trainers have in common, as a mixin placed before TRL's trainer class.

The stock collator's batch gets its shared layout from :class:`~trl_prefix_sharing.collator.PrefixSharingCollator`;
per step, the integration object (:mod:`trl_prefix_sharing.sharing`) builds its mask once, shared by the policy and
reference passes, and the models' wrapped forwards run the shared rows and hand back stock-shaped outputs. TRL's own
loss code runs unchanged. Packing (:mod:`trl_prefix_sharing.packing`) composes with it.
"""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers.utils import logging

from .packing import PackingMixin
from .sharing import PrefixSharingMixin
from .stats import sharing_stats


__all__ = ["PreferenceSharingMixin"]

logger = logging.get_logger(__name__)


class PreferenceSharingMixin(PackingMixin, PrefixSharingMixin):
    """Prefix sharing and packing for a preference trainer (DPO, reward); see the module docstring."""

    def _setup_collator(self) -> None:
        self.data_collator = self.sharing.collator(self.data_collator, share_prefix=self.prefix_sharing)
        self._setup_packing()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.sharing is not None:
            layout = self.sharing.prepare(inputs)
            if self.model.training:  # token positions the training forwards really computed, on every rank, kept on
                shared = self.accelerator.gather_for_metrics((layout["document_ids"] >= 0).sum()).sum()  # the device
                self._total_shared_tokens = self._total_shared_tokens + shared
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def _init_prefix_sharing(self, model, args, processing_class, peft_config=None) -> None:
        super()._init_prefix_sharing(model, args, processing_class, peft_config)
        self._total_shared_tokens = 0  # a device tensor once training, read when logging
        self.sharing_stats = None

    def log(self, logs, start_time=None):
        if self.sharing is not None and self.model.training and isinstance(self._total_shared_tokens, torch.Tensor):
            self._metrics["train"]["num_shared_tokens"] = [int(self._total_shared_tokens)]
        return super().log(logs, start_time)

    def train(self, *args, **kwargs):
        if self.prefix_sharing and self.sharing_stats is None and isinstance(self.train_dataset, Dataset):
            self.sharing_stats = sharing_stats(self.train_dataset, self.data_collator)
            if self.args.should_log:
                logger.warning(self.sharing_stats.summary())
        return super().train(*args, **kwargs)
