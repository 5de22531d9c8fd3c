"""Prefix sharing for TRL's DPO, reward, GRPO, RLOO, online DPO, KTO, ORPO, CPO and SFT trainers: compute each prompt
once, get stock TRL's numbers."""

from __future__ import annotations

import importlib


__version__ = "0.1.0"

#: public name -> the module that defines it. Imported on first use, so that the command line (and the demo script)
#: can set up logging (see `cli/quiet.py`) before TRL, transformers and PEFT are imported. The offline test builders
#: are in `trl_prefix_sharing.testing`, which this package does not import.
_EXPORTS = {
    "DPOConfig": ".config",
    "DPOTrainer": ".dpo_trainer",
    "GRPOConfig": ".config",
    "GRPOTrainer": ".grpo_trainer",
    "RewardConfig": ".config",
    "RewardTrainer": ".reward_trainer",
    "RLOOConfig": ".config",
    "RLOOTrainer": ".rloo_trainer",
    "OnlineDPOConfig": ".online_dpo_trainer",
    "OnlineDPOTrainer": ".online_dpo_trainer",
    "KTOConfig": ".kto_trainer",
    "KTOTrainer": ".kto_trainer",
    "ORPOConfig": ".orpo_trainer",
    "ORPOTrainer": ".orpo_trainer",
    "CPOConfig": ".cpo_trainer",
    "CPOTrainer": ".cpo_trainer",
    "SFTConfig": ".config",
    "SFTTrainer": ".sft_trainer",
    "MultipackSampler": ".sampler",
    "PrefixSharingCollator": ".collator",
    "PrefixSharingSession": ".session",
    "Layout": ".layout",
    "RowPolicy": ".layout",
    "SUPPORTED_MODEL_TYPES": ".attention",
    "build_layout": ".layout",
    "dense_mask": ".mask",
    "prefix_sharing_mask": ".mask",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
