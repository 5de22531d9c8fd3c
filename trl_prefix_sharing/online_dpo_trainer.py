"""`OnlineDPOTrainer`: TRL's experimental online DPO trainer, scoring each prompt's two completions in one shared
sequence `[prompt | completion 1 | completion 2]` (`args.prefix_sharing`).

TRL's `_forward` runs every prompt twice (rows `i` and `i + B` share it) through full logits and a `log_softmax`,
for the policy and again for the reference. With prefix sharing, `_forward` lays both completions after one copy of
the prompt (the layout of `trl_prefix_sharing.layout`, stock's column positions) and scores them with TRL's fused
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

from .config import _SHARING_DOC, PrefixSharingArguments
from .forward import stock_logits_dtype
from .sharing import PrefixSharingMixin
from .virtual import GENERATED_ROWS


__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer"]


@dataclass
class OnlineDPOConfig(_TRLOnlineDPOConfig, PrefixSharingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.OnlineDPOTrainer`]: every parameter of TRL's experimental "
        "`OnlineDPOConfig`, plus the ones below. With `prefix_sharing=False` training is exactly TRL's.\n"
        + _SHARING_DOC
    )

    _liger_keeps_forward = False  # TRL's trainer leaves Liger's default (a replaced forward) as it is

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()


class OnlineDPOTrainer(PrefixSharingMixin, _TRLOnlineDPOTrainer):
    """TRL's experimental `OnlineDPOTrainer`, computing each prompt once per pair of completions when
    `args.prefix_sharing=True`. Takes exactly its arguments; the policy and reference log-probs, the loss, gradients
    and every logged statistic equal stock TRL's to float precision. Text prompts (plain or conversational)."""

    _config_class = OnlineDPOConfig
    _fuse_lm_head = True  # stock scores full logits; the shared rows go through TRL's fused log-prob head
    _virtual_tokens_refused = GENERATED_ROWS

    def __init__(self, model, ref_model=None, reward_funcs=None, args=None, *more, **kwargs):
        """Exactly the arguments of TRL's experimental `OnlineDPOTrainer`."""
        self._init_prefix_sharing_from((model, ref_model, reward_funcs, args, *more), kwargs)
        super().__init__(model, ref_model, reward_funcs, args, *more, **kwargs)
        self._finish_prefix_sharing_init()

    # ----------------------------------------------------------------------------------------------- forward
    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        if not self.prefix_sharing:
            return super()._forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs)
        if vision_inputs is not None:
            raise ValueError(
                "Prefix sharing for online DPO is text-only; train vision prompts with `prefix_sharing=False`."
            )
        # TRL's left truncation to `max_length`
        truncate = max(prompt_ids.size(1) + completion_ids.size(1) - self.max_length, 0)
        prompt_ids, prompt_mask = prompt_ids[:, truncate:], prompt_mask[:, truncate:]
        prompt_length = prompt_ids.size(1)
        if prompt_length == 0:
            raise ValueError(
                f"`max_length` ({self.max_length}) leaves no prompt before completions of "
                f"{completion_ids.size(1)} tokens; raise `max_length` above `max_new_tokens`."
            )
        input_ids = torch.cat((prompt_ids, completion_ids), dim=1)
        attention_mask = torch.cat((prompt_mask, completion_mask), dim=1)
        # one layout for the policy and reference passes, which TRL runs on these same tensors
        source = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        self._startup_check(input_ids, attention_mask, prompt_lengths=lambda: prompt_mask.sum(dim=1))
        layout = self.sharing_session.generated_layout(
            input_ids, attention_mask, prompt_length, score_padding=True, source=source
        )
        if self.model.training and torch.is_grad_enabled():  # the policy's gradient pass
            self.shared_positions.count(layout, attention_mask)
        if stock_logits_dtype(model) != torch.float32:
            # stock's log-softmax runs in half precision: the same op on the same logits, at the completion columns
            logits = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=completion_ids.size(1) + 1,
                prefix_sharing=layout,
            ).logits[:, :-1]
            return torch.take_along_dim(logits.log_softmax(dim=-1), completion_ids.unsqueeze(-1), dim=2).squeeze(-1)
        labels = input_ids.clone()
        labels[:, :prompt_length] = -100  # every completion column, padding included, as stock scores them
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            fused_lm_head=True,
            prefix_sharing=layout,
        )
        return outputs.log_probs[:, prompt_length - 1 :]
