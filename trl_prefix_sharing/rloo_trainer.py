"""`RLOOTrainer`: TRL's RLOO trainer, scoring each prompt's group of generations in one shared sequence
(`args.prefix_sharing`)."""

from __future__ import annotations

import trl

from .config import RLOOConfig
from .group_sharing import GroupSharingTrainerMixin


__all__ = ["RLOOTrainer"]


class RLOOTrainer(GroupSharingTrainerMixin, trl.RLOOTrainer):
    """TRL's [`trl.RLOOTrainer`], computing each prompt once per group of generations when `args.prefix_sharing=True`.

    Takes exactly the arguments of [`trl.RLOOTrainer`]. With prefix sharing, the training forward and the old-policy
    and reference passes lay the `num_generations` completions of a prompt after one copy of it; log-probs,
    entropies, the loss (every loss type), gradients and logged metrics equal stock TRL's to float precision. The
    generation batch is shuffled by whole groups (see `trl_prefix_sharing.group_sharing`). `num_shared_tokens` counts
    the token positions the training forward really computed.
    """

    _config_class = RLOOConfig
