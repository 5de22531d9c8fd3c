"""`CPOTrainer`: TRL's experimental CPO trainer (CPO, SimPO with `loss_type="simpo"`, CPO-SimPO, AlphaPO), computing
each prompt once per pair (`args.prefix_sharing`); see `trl_prefix_sharing.concatenated`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .concatenated import CONCATENATED_SHARING_DOC, ConcatenatedSharingArguments, ConcatenatedSharingMixin, masked_mean
from .trl_internals import import_experimental


_cpo = import_experimental("cpo", "CPOTrainer")

__all__ = ["CPOConfig", "CPOTrainer"]


#: loss types whose log-probs TRL length-averages (the others sum them)
AVERAGED_LOSS_TYPES = ("ipo", "simpo")


@dataclass
class CPOConfig(_cpo.CPOConfig, ConcatenatedSharingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.CPOTrainer`]: every parameter of TRL's experimental "
        "`CPOConfig`, plus the ones below. With `prefix_sharing=False` training is exactly TRL's.\n"
        + CONCATENATED_SHARING_DOC
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()


class CPOTrainer(ConcatenatedSharingMixin, _cpo.CPOTrainer):
    """TRL's experimental `CPOTrainer` (every `loss_type`: CPO's sigmoid, hinge and IPO, SimPO, CPO-SimPO with
    `cpo_alpha`, AlphaPO), computing each prompt once per pair when `args.prefix_sharing=True`. Takes exactly its
    arguments; the loss, the gradients and every logged metric equal stock TRL's to float precision, without
    materialising the logits."""

    _config_class = CPOConfig

    _padding_attribute = "pad_token_id"

    def _stock_outputs(self, concatenated, outputs, num_pairs):
        log_probs = outputs.log_probs[:, :-1]  # stock's shifted logits: columns 0 .. L-2
        completion = concatenated["concatenated_labels"][:, 1:] != -100
        if self.cpo_alpha == 0:
            nll_loss = torch.tensor(0.0).to(self.accelerator.device)
        else:  # the NLL over the chosen completions
            nll_loss = -masked_mean(log_probs[:num_pairs], completion[:num_pairs])
        if self.loss_type in AVERAGED_LOSS_TYPES:
            logps = masked_mean(log_probs, completion, dim=-1)
        else:
            logps = (log_probs * completion).sum(-1)
        chosen_logits, rejected_logits = self._logits_entries(outputs, num_pairs, last_column=True)  # unshifted
        return logps[:num_pairs], logps[num_pairs:], chosen_logits, rejected_logits, nll_loss
