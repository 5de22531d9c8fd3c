"""What the prefix-sharing ORPO and CPO trainers have in common: TRL's experimental paired trainers without a
reference model, whose `concatenated_forward` runs `[prompt+chosen ; prompt+rejected]` through full logits.

With prefix sharing, `concatenated_forward` lays each pair out after one copy of its prompt (the trie of
`trl_prefix_sharing.layout`, stock's column positions) and scores every stock column with TRL's fused log-prob
head, so the `[2B, L, vocab]` logits are never materialised. Every number stock derives from the logits is derived
here from per-column values the head computes: the next-token log-probability (the log-probs and NLL terms) and the
mean logit over the vocabulary (the `logits/chosen|rejected` metrics, which stock averages over every column,
prompt and padding included). Stock computes its padding columns too (a padding query sees its row's tokens); with
`prefix_sharing_score_padding=True` the layout lays out and scores each row's padding the same way (`score_padding`),
so that those two metrics are stock's; by default it skips the padding, and they average the columns that predict a
real token (the loss, the gradients and every other metric are stock's either way). Each trainer turns those values
into the tuple its TRL class returns (`ConcatenatedSharingMixin._stock_outputs`); TRL's loss and metric code runs
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from .config import _SHARING_DOC, PrefixSharingArguments
from .forward import stock_logits_dtype
from .sharing import PrefixSharingMixin
from .trie import StockRows


__all__ = ["ConcatenatedSharingArguments", "ConcatenatedSharingMixin", "masked_mean"]

logger = logging.get_logger(__name__)


CONCATENATED_SHARING_DOC = (
    _SHARING_DOC
    + """    prefix_sharing_score_padding (`bool`, *optional*, defaults to `False`):
        Whether to also lay out and compute each row's padding, as stock does. Two logged numbers depend on it:
        `logits/chosen` and `logits/rejected`, which stock computes as the mean logit over every column of its padded
        rows, padding columns included. With `False` the padding is not computed, which saves the positions stock
        spends on it, and those two metrics are the mean logit of the columns that predict a real token, a different
        number from stock's wherever a row has padding. With `True` they are stock's, at the cost of computing each
        row's padding. The loss, the gradients and every other metric are stock's either way.
"""
)


@dataclass
class ConcatenatedSharingArguments(PrefixSharingArguments):
    """The prefix-sharing fields of the ORPO and CPO configs."""

    _liger_keeps_forward = False  # TRL's trainer leaves Liger's default (a replaced forward) as it is

    prefix_sharing_score_padding: bool = field(
        default=False,
        metadata={
            "help": "Whether to also compute each row's padding, as stock does. Only the logits/chosen and "
            "logits/rejected metrics depend on it: stock averages the logits over every column, padding included. "
            "False (default): the padding is not computed (fewer positions), and those two metrics average the "
            "columns that predict a real token. True: those two metrics are stock's, at the cost of computing each "
            "row's padding. The loss, the gradients and every other metric are stock's either way."
        },
    )


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """`values` summed where `mask` over the count of `mask` (stock's mean over non-ignored labels)."""
    if dim is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(dim) / mask.sum(dim)


class ConcatenatedSharingMixin(PrefixSharingMixin):
    """Placed before TRL's ORPO or CPO trainer class; see the module docstring."""

    #: the per-column fields of TRL's fused head this path needs (log-probs, and the mean logit for `logits/*`)
    _fuse_lm_head = ("log_probs", "mean_logits")

    def __init__(self, model=None, args=None, *more, **kwargs):
        """Exactly the arguments of the TRL trainer."""
        self._init_prefix_sharing_from((model, args, *more), kwargs)
        super().__init__(model, args, *more, **kwargs)
        self._finish_prefix_sharing_init()
        if self.prefix_sharing and not (self.args.bf16 or self.args.fp16):
            if stock_logits_dtype(self.model) != torch.float32:
                logger.warning(
                    f"{type(self).__name__}: half-precision weights without autocast (`bf16=False`, `fp16=False`). "
                    "Stock TRL then takes its log-probs from half-precision logits; with prefix sharing TRL's fused "
                    "head computes them in float32 from the same hidden states, so the logged log-probs and losses "
                    "differ from stock's at half-precision resolution (they are the more precise ones). Set "
                    "`bf16=True` (or `fp16=True`) for stock's numbers, or load float32 weights."
                )

    #: the attribute of TRL's trainer holding the pad id its `concatenated_forward` passes to `concatenated_inputs`
    _padding_attribute: str

    @property
    def _padding_value(self) -> int:
        return getattr(self, self._padding_attribute)

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
        score_padding = self.args.prefix_sharing_score_padding
        self._startup_check(input_ids, attention_mask, examples=examples)
        layout = self.sharing_session.layout(
            StockRows(input_ids, attention_mask, examples=examples, score_padding=score_padding)
        )
        if self.model.training and torch.is_grad_enabled():
            self.shared_positions.count(layout, attention_mask)
        # each column's next token (scored padding: every column, padding included, a placeholder for the last one;
        # else the columns that predict a real token)
        next_ids = (
            input_ids[:, 1:] if score_padding else input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
        )
        last = torch.full_like(input_ids[:, :1], 0 if score_padding else -100)
        shift_labels = torch.cat([next_ids, last], dim=1)
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

    @staticmethod
    def _logits_entries(outputs, num_pairs: int, last_column: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) per-column mean logits over the columns stock's `logits/*` average (ORPO: all but the
        last, CPO: all), the scored ones: every column with `prefix_sharing_score_padding`, else those that predict a
        real token. Their `.mean()` is the metric."""
        columns = slice(None) if last_column else slice(None, -1)
        means, scored = outputs.mean_logits[:, columns], outputs.label_mask[:, columns]
        return means[:num_pairs][scored[:num_pairs]], means[num_pairs:][scored[num_pairs:]]

    def _stock_outputs(self, concatenated: dict, outputs, num_pairs: int) -> tuple:
        """`(chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss)` as TRL's `concatenated_forward`
        returns them, from the fused head's per-column `log_probs` and `mean_logits` (`[2B, L]`, column t
        predicting column t + 1). The logits entries come from `_logits_entries`."""
        raise NotImplementedError
