"""What the prefix-sharing ORPO and CPO trainers have in common: TRL's experimental paired trainers without a
reference model, whose `concatenated_forward` runs `[prompt+chosen ; prompt+rejected]` through full logits.

With prefix sharing, `concatenated_forward` lays each pair out after one copy of its prompt (the trie of
:mod:`trl_prefix_sharing.layout`, stock's column positions) and scores every stock column with TRL's fused log-prob
head, so the ``[2B, L, vocab]`` logits are never materialised. Every number stock derives from the logits is derived
here from per-column values the head computes: the next-token log-probability (the log-probs and NLL terms) and the
mean logit over the vocabulary (the ``logits/chosen|rejected`` metrics, which stock averages over every column,
prompt and padding included). Stock computes its padding columns too (a padding query sees its row's tokens), so the
layout lays out and scores each row's padding the same way (``score_padding``). Each trainer turns those values into
the tuple its TRL class returns (:meth:`ConcatenatedSharingMixin._stock_outputs`); TRL's loss and metric code runs
unchanged.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .forward import stock_logits_dtype
from .sharing import PrefixSharingMixin


__all__ = ["ConcatenatedSharingMixin", "masked_mean"]

logger = logging.get_logger(__name__)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """``values`` summed where ``mask`` over the count of ``mask`` (stock's mean over non-ignored labels)."""
    if dim is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(dim) / mask.sum(dim)


class ConcatenatedSharingMixin(PrefixSharingMixin):
    """Placed before TRL's ORPO or CPO trainer class; see the module docstring."""

    #: the per-column fields of TRL's fused head this path needs (log-probs, and the mean logit for `logits/*`)
    _fuse_lm_head = ("log_probs", "mean_logits")

    def __init__(self, model=None, args=None, *more, **kwargs):
        """Exactly the arguments of the TRL trainer."""
        processing_class = kwargs.get("processing_class", more[3] if len(more) > 3 else None)
        self._init_prefix_sharing(model, args, processing_class, kwargs.get("peft_config"))
        super().__init__(model, args, *more, **kwargs)
        self._setup_prefix_sharing()
        if self.prefix_sharing and not (self.args.bf16 or self.args.fp16):
            if stock_logits_dtype(self.model) != torch.float32:
                logger.warning(
                    f"{type(self).__name__}: half-precision weights without autocast (`bf16=False`, `fp16=False`). "
                    "Stock TRL then takes its log-probs from half-precision logits; with prefix sharing TRL's fused "
                    "head computes them in float32 from the same hidden states, so the logged log-probs and losses "
                    "differ from stock's at half-precision resolution (they are the more precise ones). Set "
                    "`bf16=True` (or `fp16=True`) for stock's numbers, or load float32 weights."
                )

    @property
    def _padding_value(self) -> int:
        """The pad id TRL's `concatenated_forward` passes to `concatenated_inputs`."""
        raise NotImplementedError

    def concatenated_forward(self, model, batch):
        if not self.prefix_sharing:
            return super().concatenated_forward(model, batch)
        if self.is_encoder_decoder:
            raise ValueError(f"Prefix sharing in {type(self).__name__} covers decoder-only models.")
        concatenated = self.concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=self._padding_value, device=self.accelerator.device
        )
        input_ids = concatenated["concatenated_input_ids"]
        attention_mask = concatenated["concatenated_attention_mask"]
        num_pairs = batch["chosen_labels"].shape[0]
        examples = torch.arange(num_pairs, device=input_ids.device).repeat(2)  # row i and row B + i: pair i
        layout = self.sharing.layout(input_ids, attention_mask, examples=examples, score_padding=True)
        # every column scored, padding included: its next token, and a placeholder for the last column
        shift_labels = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
        extra = {"output_router_logits": True} if self.aux_loss_enabled else {}
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            shift_labels=shift_labels,
            fused_lm_head=True,
            prefix_sharing=layout,
            use_cache=False,
            **extra,
        )
        result = self._stock_outputs(concatenated, outputs, num_pairs)
        return (*result, outputs.aux_loss) if self.aux_loss_enabled else result

    def _stock_outputs(self, concatenated: dict, outputs, num_pairs: int) -> tuple:
        """``(chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss)`` as TRL's `concatenated_forward`
        returns them, from the fused head's per-column ``log_probs`` and ``mean_logits`` (``[2B, L]``, column t
        predicting column t + 1). The logits entries are the per-column mean logits over the columns stock's logits
        cover: their mean is stock's mean of the logits."""
        raise NotImplementedError
