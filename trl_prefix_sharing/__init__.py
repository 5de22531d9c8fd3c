"""Prefix sharing for TRL's DPO, reward, GRPO, RLOO and online DPO trainers: compute each prompt once, get stock TRL's numbers."""

from .attention import SUPPORTED_MODEL_TYPES
from .collator import PrefixSharingCollator
from .config import DPOConfig, GRPOConfig, RewardConfig, RLOOConfig
from .dpo_trainer import DPOTrainer
from .grpo_trainer import GRPOTrainer
from .layout import build_shared_batch
from .mask import dense_mask, dpo_mask
from .online_dpo_trainer import OnlineDPOConfig, OnlineDPOTrainer
from .reward_trainer import RewardTrainer
from .rloo_trainer import RLOOTrainer
from .sampler import MultipackSampler

__version__ = "0.1.0"

__all__ = [
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "RewardConfig",
    "RewardTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "OnlineDPOConfig",
    "OnlineDPOTrainer",
    "MultipackSampler",
    "PrefixSharingCollator",
    "SUPPORTED_MODEL_TYPES",
    "build_shared_batch",
    "dense_mask",
    "dpo_mask",
]
