"""Prefix sharing for TRL's DPO, reward, GRPO, RLOO, online DPO, KTO, ORPO, CPO and SFT trainers: compute each prompt
once, get stock TRL's numbers."""

from __future__ import annotations

import importlib

from .trainers import TRAINERS


__version__ = "0.1.0"

#: public name -> the module that defines it. Imported on first use, so that the command line (and the demo script)
#: can set up logging (see `cli/quiet.py`) before TRL, transformers and PEFT are imported. The offline test builders
#: are in `trl_prefix_sharing.testing`, which this package does not import.
_EXPORTS = {
    **{spec.config_class: spec.config_module for spec in TRAINERS.values()},
    **{spec.trainer_class: spec.module for spec in TRAINERS.values()},
    "MultipackSampler": ".sampler",
    "PrefixSharingCollator": ".collator",
    "PrefixSharingSession": ".session",
    "Layout": ".layout",
    "RowPolicy": ".layout",
    "SUPPORTED_MODEL_TYPES": ".attention",
    "build_layout": ".layout",
    "StockRows": ".trie",
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
