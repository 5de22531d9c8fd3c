"""What prefix sharing supports, checked before anything trains: the model's path, the processor, the PEFT kind (which
prompt-learning methods, with which trainers and options), the architecture, dropout, and, at the start of training,
that the shared forward is still in place. Each refusal names its cause and the way out."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers.utils import logging

from .architectures import VISION, check_supported_model, refusal, refused_reason, window_layout
from .forward import has_prefix_sharing_forward
from .virtual import CACHE, LAID_OUT, VirtualTokens, peft_type
from .vision import check_supported_vision_model, is_vision_config


__all__ = [
    "active_dropout",
    "check_no_dropout",
    "check_prompt_learning",
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
    """The checks before TRL builds anything: processor, the path of a model given by name, and architecture (a clear
    error, never a silently wrong number). The PEFT kind: `check_prompt_learning`."""
    from transformers import ProcessorMixin

    if isinstance(processing_class, ProcessorMixin) and not supports_vision:
        raise ValueError(
            f"{trainer_name} with prefix sharing does not lay out images (a processor was passed): prefix sharing "
            "covers vision-language models in DPOTrainer only. Train this one with `prefix_sharing=False`."
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


#: why prefix sharing refuses a prompt-learning method it does not lay out (`PeftType` names)
_REFUSED_METHODS = {
    "MULTITASK_PROMPT_TUNING": "its virtual tokens depend on each row's task id, so the rows share no one block",
    "CPT": "its forward puts its own labels and token types around the virtual tokens, which the shared forward does "
    "not lay out",
}


def check_prompt_learning(
    trainer_name: str, config, refused: str | None, args, model_config=None
) -> VirtualTokens | None:
    """What prefix sharing lays out of a prompt-learning PEFT `config` (`virtual.prompt_learning_config`: the
    `peft_config` given, or the active adapter of a PEFT model given as `model`), or a clear error naming the cause and
    the way out: a trainer that does not lay them out (`refused`: why), a method other than prompt tuning, P-tuning
    and prefix tuning, packing, and for prefix tuning (virtual keys and values, a cache) gradient checkpointing, a
    kernel other than the dense mask and sliding windows. Before TRL builds anything, and again on the model TRL
    prepared (with its config, `model_config`: vision-language models, sliding windows). None without such a config.
    """
    if config is None:
        return None
    what = f"prompt-learning PEFT ({type(config).__name__})"
    way_out = "Use a LoRA-style adapter, or train with `prefix_sharing=False`."
    method = peft_type(config)
    if refused is not None:
        raise ValueError(f"{trainer_name} with prefix sharing does not support {what}: {refused}. {way_out}")
    if method not in LAID_OUT:
        reason = _REFUSED_METHODS.get(method, "prefix sharing lays out prompt tuning, P-tuning and prefix tuning")
        raise ValueError(f"Prefix sharing does not support {what}: {reason}. {way_out}")
    if getattr(args, "packing", False):
        raise ValueError(
            f"Packing does not support {what}: its virtual tokens open every row, so the rows of a micro-batch join "
            "one document behind them, which packed rows of a fixed length are not laid out for. Train with "
            "`packing=False`."
        )
    if model_config is not None and is_vision_config(model_config):
        raise ValueError(f"Prefix sharing does not lay out {what} on a vision-language model. {way_out}")
    if LAID_OUT[method] == CACHE:
        _check_prefix_tuning(args, model_config)
    return VirtualTokens(LAID_OUT[method], config.num_virtual_tokens)


def _check_prefix_tuning(args, model_config) -> None:
    """Prefix tuning's virtual keys and values (a cache before every row): refused with gradient checkpointing, a
    kernel other than the dense mask, and sliding windows."""
    if getattr(args, "gradient_checkpointing", False):
        raise ValueError(
            "Prefix tuning gives its virtual tokens to the model as a key/value cache, which transformers drops under "
            "gradient checkpointing (stock TRL fails on it too): set `gradient_checkpointing=False`."
        )
    kernel = getattr(args, "prefix_sharing_attn_implementation", "auto")
    if kernel not in ("auto", "sdpa"):
        raise ValueError(
            f"Prefix tuning under prefix sharing runs on the dense mask: its virtual keys and values go before every "
            f"shared row's keys, which the '{kernel}' kernel does not take. Set "
            "`prefix_sharing_attn_implementation='sdpa'` (or 'auto', which then chooses between the dense mask and "
            "stock's own rows)."
        )
    if model_config is not None and window_layout(model_config)[0] is not None:
        raise ValueError(
            "Prefix sharing does not lay out prefix tuning on a model with sliding-window attention: the window "
            "would have to reach back into the virtual keys and values, which the mask in front of the shared rows "
            "does not bound. Use prompt tuning or P-tuning, or train with `prefix_sharing=False`."
        )
