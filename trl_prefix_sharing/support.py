"""What prefix sharing supports, checked before anything trains: the model's path, the processor, the PEFT kind, the
architecture, dropout, and, at the start of training, that the shared forward is still in place. Each refusal names
its cause and the way out."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.utils import logging

from .architectures import VISION, check_supported_model, refusal, refused_reason
from .forward import has_prefix_sharing_forward
from .vision import check_supported_vision_model, is_vision_config


__all__ = [
    "active_dropout",
    "check_no_dropout",
    "check_adapter",
    "check_architecture",
    "check_forward_in_place",
    "check_local_model_path",
    "check_model_and_processor",
    "is_local_model_path",
]

logger = logging.get_logger(__name__)


def check_model_and_processor(
    trainer_name: str, model, processing_class, peft_config, trust_remote_code: bool, supports_vision: bool
) -> None:
    """The checks before TRL builds anything: processor, PEFT kind, the path of a model given by name, and
    architecture (a clear error, never a silently wrong number)."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin) and not supports_vision:
        raise ValueError(
            f"{trainer_name} with prefix sharing does not lay out images (a processor was passed): prefix sharing "
            "covers vision-language models in DPOTrainer only. Train this one with `prefix_sharing=False`."
        )
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        raise ValueError(
            f"Prefix sharing does not support prompt-learning PEFT ({type(peft_config).__name__}): its virtual "
            "tokens are prepended to every row and would be shared differently. Use LoRA-style adapters or "
            "`prefix_sharing=False`."
        )
    if isinstance(model, str):
        from transformers import AutoConfig

        check_local_model_path(model)
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    else:
        config = model.config
    reason = check_architecture(config, trainer_name, supports_vision)
    if reason is not None:
        logger.info(
            f"Prefix sharing: {reason}, so the start-up check will judge the model at its first batch (a few examples "
            "as stock rows and as prefix-shared rows) and stop with an error if they differ. Train it with "
            "`prefix_sharing=False` to turn prefix sharing off."
        )
    elif getattr(config, "auto_map", None) and not is_vision_config(config):
        logger.info(
            f"Prefix sharing: this model runs custom code (`auto_map`) but declares the measured model type "
            f"'{config.model_type}', so it is trusted as that type. Set `prefix_sharing_model_check=\"always\"` to "
            "have the start-up check judge it at its first batch."
        )


def is_local_model_path(name: str) -> bool:
    """Whether the model name `name` can only be a local path, never a Hub model id: it starts like a path (`/`,
    `./`, `../`, `~`), or it is no valid Hub id (`name` or `namespace/name`, of letters, digits, `-`, `_` and `.`:
    `huggingface_hub`'s own rule, checked without the network)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_local_model_path(name: str) -> None:
    """An error for a model named by a local path that does not exist (`is_local_model_path`), which transformers
    would take for a Hub id and refuse at length; a Hub id is left to transformers (the trainers and the command line
    share this rule)."""
    if is_local_model_path(name) and not Path(name).expanduser().exists():
        raise FileNotFoundError(
            f"Model {name!r} not found: no such directory; pass a local model directory or a Hub model id."
        )


def check_architecture(config, trainer_name: str, supports_vision: bool) -> str | None:
    """The architecture check: vision-language models (`vision.py`) or text models (`architectures.py`). Raises for a
    refused one; returns why the start-up check must judge the model itself (None: the registry measured it equal)."""
    if is_vision_config(config):
        reason = refused_reason(config)  # one no layout of images can change comes first (recurrent layers, ...)
        if reason is not None and reason != VISION:
            raise ValueError(refusal(config.model_type, reason))
        if not supports_vision:
            raise ValueError(
                f"{trainer_name} with prefix sharing does not lay out images, so it does not support the "
                f"vision-language model '{config.model_type}' (DPOTrainer does, for Qwen2-VL, Qwen2.5-VL and "
                "Qwen3-VL). Train it with `prefix_sharing=False`."
            )
        check_supported_vision_model(config)
        return None
    return check_supported_model(config)


def check_forward_in_place(models, use_liger_kernel: bool = False) -> None:
    """At the start of training: refuse to train where something replaced the shared forward of one of `models` after
    it was installed (it would stop sharing prefixes without a word, or fail at its first layout)."""
    for model in models:
        if not has_prefix_sharing_forward(model):
            cause = (
                "`use_liger_kernel=True`: transformers applies Liger's kernels at the start of `train()`, and its "
                "patch of this model replaced the forward"
                if use_liger_kernel
                else "something patched the model's forward after the trainer was built"
            )
            raise RuntimeError(
                f"Prefix sharing's forward of {type(model).__name__} is no longer in place ({cause}), so training "
                "would not share prefixes. Drop that patch, or train with `prefix_sharing=False`."
            )


def active_dropout(model) -> str | None:
    """Where `model` still drops out in training (a `Dropout` module, or an attention module's dropout rate), or
    None. Dropout draws a random mask per position of the rows the model runs, and the shared rows have other
    positions than stock's, so no training step with it could be stock's."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return f"`{name}` (p={module.p})"
        if "Attention" in type(module).__name__:
            for attribute in ("attention_dropout", "dropout"):
                rate = getattr(module, attribute, None)
                if isinstance(rate, float) and rate > 0:
                    return f"`{name}.{attribute}` ({rate})"
    return None


def check_no_dropout(model) -> None:
    """Refuse a model that still drops out in training (`active_dropout`), naming where and the way out."""
    where = active_dropout(model)
    if where is not None:
        raise ValueError(
            f"Prefix sharing cannot give stock's numbers with dropout active in the model ({where}): dropout "
            "draws a random mask per position of the rows the model runs, and the shared rows have other "
            "positions than stock's. Set `disable_dropout=True` in the config (and an attention dropout of 0 in "
            "the model config), or train with `prefix_sharing=False`."
        )


def check_adapter(model) -> None:
    """Refuse a model that already carries a prompt-learning PEFT adapter (its virtual tokens are prepended to every
    row, so they would be shared differently)."""
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        raise ValueError("Prefix sharing does not support prompt-learning PEFT adapters.")
