"""`ORPOTrainer`: TRL's experimental ORPO trainer, computing each prompt once per pair (`args.prefix_sharing`); see
`trl_prefix_sharing.concatenated`."""

from __future__ import annotations

from dataclasses import dataclass

from .concatenated import CONCATENATED_SHARING_DOC, ConcatenatedSharingArguments, ConcatenatedSharingMixin, masked_mean
from .trl_internals import import_experimental


_orpo = import_experimental("orpo", "ORPOTrainer")

__all__ = ["ORPOConfig", "ORPOTrainer"]


@dataclass
class ORPOConfig(_orpo.ORPOConfig, ConcatenatedSharingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.ORPOTrainer`]: every parameter of TRL's experimental "
        "`ORPOConfig`, plus the ones below. With `prefix_sharing=False` training is exactly TRL's.\n"
        + CONCATENATED_SHARING_DOC
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()


class ORPOTrainer(ConcatenatedSharingMixin, _orpo.ORPOTrainer):
    """TRL's experimental `ORPOTrainer`, computing each prompt once per pair when `args.prefix_sharing=True`. Takes
    exactly its arguments; the loss, its NLL term (over prompt and chosen tokens), the gradients and every logged
    metric equal stock TRL's to float precision, without materialising the logits."""

    _config_class = ORPOConfig

    _padding_attribute = "padding_value"

    def _stock_outputs(self, concatenated, outputs, num_pairs):
        log_probs = outputs.log_probs[:, :-1]  # stock's shifted logits: columns 0 .. L-2
        # the NLL over every real token of the chosen rows, prompt included (stock's labels: the attended tokens)
        nll_mask = concatenated["concatenated_attention_mask"][:num_pairs, 1:] == 1
        nll_loss = -masked_mean(log_probs[:num_pairs], nll_mask)
        completion = concatenated["concatenated_labels"][:, 1:] != -100
        logps = masked_mean(log_probs, completion, dim=-1)  # length-averaged
        chosen_logits, rejected_logits = self._logits_entries(
            outputs, num_pairs, last_column=False
        )  # `logits[:, :-1]`
        return logps[:num_pairs], logps[num_pairs:], chosen_logits, rejected_logits, nll_loss
