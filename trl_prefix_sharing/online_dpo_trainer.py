"""`OnlineDPOTrainer`: TRL's experimental online DPO trainer, scoring each prompt's two completions in one shared
sequence `[prompt | completion 1 | completion 2]` (`args.prefix_sharing`).

TRL's `_forward` runs every prompt twice (rows `i` and `i + B` share it) through full logits and a `log_softmax`,
for the policy and again for the reference. With prefix sharing, `_forward` lays both completions after one copy of
the prompt (the layout of :mod:`trl_prefix_sharing.layout`, stock's column positions) and scores them with TRL's fused
log-prob head (`add_fused_lm_head`), so no logits are materialised over the prompt. TRL's loss and statistics code runs
unchanged. Stock also scores the padding after each completion (its `objective/kl` and `objective/entropy` sum those
log-probs too); the layout scores the same padding positions the way stock computes them (a padding query sees its
row's tokens, no key sees padding), so those statistics are stock's as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from trl.experimental.online_dpo import OnlineDPOConfig as _TRLOnlineDPOConfig
from trl.experimental.online_dpo import OnlineDPOTrainer as _TRLOnlineDPOTrainer

from .attention import build_attention_mask, shared_row_multiple
from .config import _SHARING_DOC, PrefixSharingArguments
from .forward import unwrap_model
from .group_sharing import shared_group_layout
from .trainer_setup import SharingSetupMixin

__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer"]

_UNFUSED = "_prefix_sharing_unfused_forward"


@dataclass
class OnlineDPOConfig(_TRLOnlineDPOConfig, PrefixSharingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.OnlineDPOTrainer`]: every parameter of TRL's experimental "
        "`OnlineDPOConfig`, plus the ones below. With `prefix_sharing=False` training is exactly TRL's.\n"
        + _SHARING_DOC
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()


class OnlineDPOTrainer(SharingSetupMixin, _TRLOnlineDPOTrainer):
    """TRL's experimental `OnlineDPOTrainer`, computing each prompt once per pair of completions when
    `args.prefix_sharing=True`. Takes exactly its arguments; the policy and reference log-probs, the loss, gradients
    and every logged statistic equal stock TRL's to float precision. Text prompts (plain or conversational)."""

    def __init__(self, *args, **kwargs):
        self._init_sharing_setup()
        super().__init__(*args, **kwargs)
        if self.prefix_sharing:
            if not isinstance(self.args, OnlineDPOConfig):
                raise TypeError("`prefix_sharing` needs `trl_prefix_sharing.OnlineDPOConfig` as `args`.")
            self._check_model_and_processor(self.model, self.args, self.processing_class, None)
            self._pad_token_id = self._tokenizer.pad_token_id
            self._patch_models()
            self._row_multiple = shared_row_multiple(self._attn_implementation,
                                                     getattr(self.args, "pad_to_multiple_of", None))

    # ----------------------------------------------------------------------------------------------- set-up
    def _patch_models(self) -> None:
        """TRL's fused log-prob head on the policy and reference (kept off the prompt), then the shared forward."""
        from trl.trainer.utils import add_fused_lm_head

        for model in self._layout_models():
            if _UNFUSED not in model.__dict__:
                model.__dict__[_UNFUSED] = model.__dict__.get("forward")  # None: the class's own forward
                add_fused_lm_head(model)
        super()._patch_models()

    def _unpatch_models(self) -> None:
        super()._unpatch_models()
        for model in self._layout_models():
            if _UNFUSED in model.__dict__:
                unfused = model.__dict__.pop(_UNFUSED)
                if unfused is None:
                    del model.__dict__["forward"]
                else:
                    model.forward = unfused

    def remove_prefix_sharing(self) -> None:
        """Undo the model patches; the trainer then trains as stock TRL."""
        self._unpatch_models()
        self.args.prefix_sharing = False

    # ----------------------------------------------------------------------------------------------- forward
    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        if not self.prefix_sharing:
            return super()._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs)
        if vision_inputs is not None:
            raise ValueError("Prefix sharing for online DPO is text-only; train vision prompts with "
                             "`prefix_sharing=False`.")
        # TRL's left truncation to `max_length`
        truncate = max(prompt_ids.size(1) + completion_ids.size(1) - self.max_length, 0)
        prompt_ids, prompt_mask = prompt_ids[:, truncate:], prompt_mask[:, truncate:]
        prompt_length = prompt_ids.size(1)
        if prompt_length == 0:
            raise ValueError(f"`max_length` ({self.max_length}) leaves no prompt before completions of "
                             f"{completion_ids.size(1)} tokens; raise `max_length` above `max_new_tokens`.")
        input_ids = torch.cat((prompt_ids, completion_ids), dim=1)
        attention_mask = torch.cat((prompt_mask, completion_mask), dim=1)
        layout = shared_group_layout(input_ids, attention_mask, prompt_length, self._pad_token_id,
                                     self._row_multiple, score_padding=True)
        layout["attention_mask"] = build_attention_mask(layout, self._attn_implementation,
                                                        unwrap_model(self.model).config)
        labels = input_ids.clone()
        labels[:, :prompt_length] = -100  # every completion column, padding included, as stock scores them
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True,
                        prefix_sharing=layout)
        return outputs.log_probs[:, prompt_length - 1 :]
