"""Set-up every prefix-sharing trainer shares (preference and online): checks before TRL's `__init__`, and the model
patches after it (attention implementation switched, forward wrapped), scoped to the trainer's models and reversible.
"""

from __future__ import annotations

from .architectures import model_attn_implementation
from .attention import AttentionSwitch, check_supported_model, resolve_attn_implementation
from .forward import install_prefix_sharing_forward, remove_prefix_sharing_forward, unwrap_model
from .vision import check_supported_vision_model, is_vision_config, vision_attn_implementation

__all__ = ["SharingSetupMixin"]


class SharingSetupMixin:
    """Placed before TRL's trainer class. Subclasses call `_init_sharing_setup()` before TRL's `__init__` and
    `_patch_models()` once TRL has built its models."""

    def _init_sharing_setup(self) -> None:
        self._attention_switch = AttentionSwitch()
        self._attn_implementation = None

    @property
    def prefix_sharing(self) -> bool:
        return bool(getattr(self.args, "prefix_sharing", False))

    #: whether the trainer lays out images for prefix sharing (DPO: yes; reward, GRPO, RLOO, online DPO: no)
    _supports_vision = False

    def _check_model_and_processor(self, model, args, processing_class, peft_config) -> None:
        from transformers import ProcessorMixin

        if isinstance(processing_class, ProcessorMixin) and not self._supports_vision:
            raise ValueError(
                f"{type(self).__name__} with prefix sharing does not lay out images (a processor was passed): "
                "prefix sharing covers vision-language models in DPOTrainer only. Train this one with "
                "`prefix_sharing=False`."
            )
        if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
            raise ValueError(
                f"Prefix sharing does not support prompt-learning PEFT ({type(peft_config).__name__}): its virtual "
                "tokens are prepended to every row and would be shared differently. Use LoRA-style adapters or "
                "`prefix_sharing=False`."
            )
        if isinstance(model, str):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model, trust_remote_code=args.trust_remote_code)
        else:
            config = model.config
        self._check_architecture(config)

    def _check_architecture(self, config) -> None:
        """The architecture check: vision-language models (`vision.py`) or text models (`attention.py`)."""
        if is_vision_config(config):
            if not self._supports_vision:
                raise ValueError(f"{type(self).__name__} with prefix sharing does not support vision-language models "
                                 f"('{config.model_type}'). Train it with `prefix_sharing=False`.")
            check_supported_vision_model(config)
        else:
            check_supported_model(config)

    def _layout_models(self) -> list:
        models = [unwrap_model(self.model)]
        if getattr(self, "ref_model", None) is not None:
            models.append(unwrap_model(self.ref_model))
        return models

    def _patch_models(self) -> None:
        """Switch the models' attention to the one that applies the prefix-sharing mask and wrap their forwards."""
        if getattr(getattr(self.model, "active_peft_config", None), "is_prompt_learning", False):
            raise ValueError("Prefix sharing does not support prompt-learning PEFT adapters.")
        requested = resolve_attn_implementation(self.args.prefix_sharing_attn_implementation, self.accelerator.device)
        models = self._layout_models()
        for model in models:
            self._check_architecture(model.config)
        if any(is_vision_config(model.config) for model in models):
            implementations = {vision_attn_implementation(self.args.prefix_sharing_attn_implementation, requested)}
        else:  # per model class: FlexAttention where transformers supports it, else SDPA, else eager (logged)
            implementations = {model_attn_implementation(model, requested) for model in models}
        if len(implementations) > 1:  # one mask per step serves the policy and reference passes
            raise ValueError(
                f"The policy and reference models need different attention implementations under prefix sharing "
                f"({sorted(implementations)}); use a reference model of the same architecture."
            )
        self._attn_implementation = implementations.pop()
        for model in models:
            self._attention_switch.apply(model, self._attn_implementation)
            install_prefix_sharing_forward(model)

    def _unpatch_models(self) -> None:
        for model in self._layout_models():
            remove_prefix_sharing_forward(model)
        self._attention_switch.restore()
