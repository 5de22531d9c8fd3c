"""The one integration path: what every prefix-sharing trainer does with its models and its batches.

:class:`PrefixSharing` is the integration object of one trainer. It owns the attention kernel (chosen once, in
:func:`~trl_prefix_sharing.attention.choose_attn_implementation`), the model patches (attention switched, forward
wrapped; scoped to the trainer's models and undone by :meth:`PrefixSharing.detach`), the pad id and the row rounding
of the shared rows, and, per batch, the layout's mask (built once and kept in the layout, so the policy and reference
passes share it). A trainer calls it in one line per batch:

- preference trainers (DPO, reward): ``self.sharing.prepare(inputs)`` before TRL's loss or reference pass, on the
  layout :class:`~trl_prefix_sharing.collator.PrefixSharingCollator` added to the batch;
- online trainers (GRPO, RLOO, online DPO): ``self.sharing.generated_layout(input_ids, attention_mask, prompt_length)``
  on the rows TRL generated.

:class:`PrefixSharingMixin` is what a trainer class puts before TRL's: the checks before TRL's ``__init__``, the set-up
after it, and :meth:`~PrefixSharingMixin.remove_prefix_sharing`. Packing is a separate feature
(:mod:`trl_prefix_sharing.packing`) that uses the same layout.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping

import torch
from transformers import TrainerCallback
from transformers.utils import logging

from .architectures import VISION, check_supported_model, refusal, refused_reason, window_layout
from .attention import AttentionSwitch, build_attention_mask, choose_attn_implementation, shared_row_multiple
from .collator import PrefixSharingCollator
from .config import warn_if_not_our_config
from .distributed import release_distributed_wrappers, warn_if_fewer_processes_than_asked
from .forward import (
    _is_sequence_classifier,
    has_prefix_sharing_forward,
    install_prefix_sharing_forward,
    remove_prefix_sharing_forward,
    unwrap_model,
)
from .layout import build_shared_batch, shared_group_layout
from .model_check import check_rows, distributed, run_model_check
from .patching import is_patched, keep_own, mark_patched, put_back_own
from .vision import check_supported_vision_model, has_vision_inputs, is_vision_config, shared_vision_inputs


__all__ = ["PrefixSharing", "PrefixSharingMixin", "pad_token_id"]

logger = logging.get_logger(__name__)

#: the attribute of a model that keeps its forward from before TRL's fused log-prob head was added here
_UNFUSED = "_prefix_sharing_unfused_forward"


def pad_token_id(processing_class) -> int:
    """The pad id of a tokenizer, or of a processor's tokenizer (the shared rows' padding; any id is exact there)."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else 0


def check_model_and_processor(
    trainer_name: str, model, processing_class, peft_config, trust_remote_code: bool, supports_vision: bool
) -> None:
    """The checks before TRL builds anything: processor, PEFT kind and architecture (a clear error, never a silently
    wrong number)."""
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


class PrefixSharing:
    """The prefix-sharing state of one trainer; see the module docstring.

    Args:
        models: the trainer's models (policy first, then the reference model if it has its own), unwrapped.
        processing_class: the trainer's tokenizer or processor (for the pad id).
        attn_implementation: `prefix_sharing_attn_implementation` (``"auto"``, ``"flex_attention"`` or ``"sdpa"``).
        device: the device the models train on (decides ``"auto"``).
        pad_to_multiple_of: the config's `pad_to_multiple_of`: what the shared rows' width is rounded up to (under
            FlexAttention, its block size by default).
        trainer_name: for error messages.
        supports_vision: whether the trainer lays out images (DPO).
        fuse_lm_head: add TRL's fused log-prob head to the models first (for a trainer that materialises logits in
            stock, such as online DPO): the shared rows are then scored without logits over the prompt. A tuple: the
            per-token fields the head computes (its `outputs`, e.g. ``("log_probs", "mean_logits")``).
        checks: `prefix_sharing_checks` (None: where the batch is on the CPU).
        autocast: the trainer's `accelerator.autocast`: the shared calls of a model that accelerate already wrapped
            in mixed precision (a reference model prepared in TRL's `__init__`) run inside it, as stock's calls do.
        model_check: `prefix_sharing_model_check`: ``"auto"`` runs the start-up check
            (:mod:`~trl_prefix_sharing.model_check`) on a model the registry has not measured equal, ``"always"`` on
            every model.
    """

    def __init__(
        self,
        models,
        processing_class,
        attn_implementation: str,
        device,
        pad_to_multiple_of=None,
        trainer_name: str = "This trainer",
        supports_vision: bool = False,
        fuse_lm_head: bool | tuple[str, ...] = False,
        checks: bool | None = None,
        autocast=None,
        model_check: str = "auto",
    ):
        if getattr(getattr(models[0], "active_peft_config", None), "is_prompt_learning", False):
            raise ValueError("Prefix sharing does not support prompt-learning PEFT adapters.")
        reasons = [check_architecture(model.config, trainer_name, supports_vision) for model in models]
        if model_check == "always":
            if any(is_vision_config(model.config) for model in models):
                raise ValueError(
                    "`prefix_sharing_model_check='always'` runs text rows; a vision-language model is judged by its "
                    "measured registry entry. Set `prefix_sharing_model_check='auto'`."
                )
            reasons = [reason or "requested (`prefix_sharing_model_check='always'`)" for reason in reasons]
        #: the models the start-up check runs at the first batch laid out, and why (empty: none, or it has run)
        self.pending_check = [(model, reason) for model, reason in zip(models, reasons, strict=True) if reason]
        #: what the check measured (the policy's result when it checked several models)
        self.model_check_result = None
        self._checking = False
        self.models = list(models)
        self.pad_token_id = pad_token_id(processing_class)
        self.attn_implementation = choose_attn_implementation(self.models, attn_implementation, device)
        self.row_multiple = shared_row_multiple(self.attn_implementation, pad_to_multiple_of)
        self._switch = AttentionSwitch()
        self._fuse_lm_head = fuse_lm_head
        self.checks = checks
        self.autocast = autocast
        self._layouts = _LayoutCache()
        #: a trainer whose TRL code calls its models without a layout sets this: ``router(model, kwargs)`` gives the
        #: layout of a fused call's rows, a finished output, or None (see `install_prefix_sharing_forward`)
        self.router = None
        self.attached = False

    # ----------------------------------------------------------------------------------------------- models
    def attach(self) -> None:
        """Patch the models: (TRL's fused log-prob head,) the attention implementation, the shared forward. The
        trainer attaches for the length of `train()`, `evaluate()` and `predict()`, and on first use by a direct call
        of a step; idempotent."""
        if self.attached:
            return
        if self._fuse_lm_head:
            from trl.trainer.utils import add_fused_lm_head

            outputs = self._fuse_lm_head if isinstance(self._fuse_lm_head, tuple) else ("log_probs",)
            for model in self.models:
                if not is_patched(model, _UNFUSED):
                    keep_own(model, "forward", _UNFUSED)
                    add_fused_lm_head(model, outputs=outputs)
                    mark_patched(model, "forward", _UNFUSED)
        for model in self.models:
            self._switch.apply(model, self.attn_implementation)
            install_prefix_sharing_forward(model, autocast=self.autocast, route=self._route)
        self.attached = True

    def detach(self) -> None:
        """Undo the patches of `attach`: the models run on their own attention implementation and generate as
        stock. A forward that accelerate has since wrapped in its mixed precision (a model prepared for training)
        stays beneath that wrapper, passing every call without a layout through unchanged (taking it out would drop
        accelerate's wrapper too); every other patch is taken out."""
        for model in self.models:
            if remove_prefix_sharing_forward(model):
                put_back_own(model, "forward", _UNFUSED)
        self._switch.restore()
        self.attached = False

    # ----------------------------------------------------------------------------------------------- batches
    def collator(self, base_collator, share_prefix: bool = True) -> PrefixSharingCollator:
        """The stock collator, wrapped to add the shared layout of each batch (rows rounded as this trainer needs)."""
        if isinstance(base_collator, PrefixSharingCollator):
            return base_collator
        return PrefixSharingCollator(
            base_collator,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.row_multiple,
            share_prefix=share_prefix,
        )

    def prepare(self, inputs: Mapping) -> dict:
        """Complete the layout a collated batch carries (``inputs["prefix_sharing"]``) for the forward: its mask, and
        for a vision batch its images once per example. Built once per batch (cached in the layout), shared by the
        policy and reference passes. Returns the layout."""
        layout = inputs.get("prefix_sharing") if isinstance(inputs, Mapping) else None
        if layout is None:
            raise RuntimeError("Prefix sharing is on but the batch has no layout: was the data collator replaced?")
        self.attach()
        if self.pending_check:
            self.check_model(
                inputs["input_ids"],
                inputs["attention_mask"],
                prompt_lengths=PrefixSharingCollator.prompt_lengths(inputs),
                examples=PrefixSharingCollator.example_ids(inputs),
            )
        if "attention_mask" not in layout:
            self._add_mask(layout, self._checks_on(layout["input_ids"]))
        if "vision" not in layout and has_vision_inputs(inputs):  # images once per pair, M-RoPE positions
            layout["vision"] = shared_vision_inputs(self.models[0], inputs, layout)
        return layout

    def _add_mask(self, layout: dict, check: bool) -> None:
        """The layout's attention mask (for this trainer's kernel), and whether its forward checks it."""
        layout["attention_mask"] = build_attention_mask(layout, self.attn_implementation, self.models[0].config)
        layout["check"] = check

    def _route(self, model, kwargs: dict):
        return None if self.router is None or self._checking else self.router(model, kwargs)

    def _checks_on(self, tensor: torch.Tensor) -> bool:
        return self.checks if self.checks is not None else tensor.device.type == "cpu"

    def layout(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_lengths: torch.Tensor | None = None,
        examples: torch.Tensor | None = None,
        score_padding: bool = False,
    ) -> dict:
        """The layout, with its mask, of stock rows built in the training step (the trie of the rows; ``examples``,
        ``prompt_lengths`` and ``score_padding``: see `plan_layout`). On the rows' device; one host read."""
        self.attach()
        if self.pending_check:
            if prompt_lengths is None and examples is None:
                raise ValueError("The start-up check needs the prompt lengths or the examples of the rows.")
            self.check_model(input_ids, attention_mask, prompt_lengths=prompt_lengths, examples=examples)
        check = self._checks_on(input_ids)
        layout = build_shared_batch(
            input_ids,
            attention_mask,
            prompt_lengths=prompt_lengths,
            examples=examples,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.row_multiple,
            score_padding=score_padding,
            check=check,
        )
        self._add_mask(layout, check)
        return layout

    def generated_layout(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        score_padding: bool = False,
        source: tuple[torch.Tensor, ...] | None = None,
    ) -> dict:
        """The layout, with its mask, of generated rows ``[left-padded prompt | completion]`` (the trie of the rows: a
        prompt's generations, and duplicate prompts', computed once; ``score_padding``: see `plan_layout`).

        Built once per set of rows: it is kept while the tensors the rows were read from live unchanged (``source``,
        default ``input_ids`` and ``attention_mask``; views of one generation batch count as the same rows), so the
        old-policy, reference and training passes over the same rows share one layout and one mask."""
        self.attach()
        if self.pending_check:
            self.check_model(input_ids, attention_mask, prompt_lengths=attention_mask[:, :prompt_length].sum(1))
        source = (input_ids, attention_mask) if source is None else source
        key = (prompt_length, score_padding)
        layout = self._layouts.get(source, key)
        if layout is None:
            check = self._checks_on(input_ids)
            layout = shared_group_layout(
                input_ids,
                attention_mask,
                prompt_length,
                self.pad_token_id,
                self.row_multiple,
                score_padding=score_padding,
                check=check,
            )
            self._add_mask(layout, check)
            self._layouts.put(source, key, layout)
        return layout

    # ----------------------------------------------------------------------------------------------- model check
    def check_model(self, input_ids, attention_mask, prompt_lengths=None, examples=None) -> None:
        """The start-up check (:mod:`~trl_prefix_sharing.model_check`) on a few examples of these stock rows, once:
        each model that needs it (the policy, and a reference model of its own) run as stock rows and as shared
        rows, without gradients. Logs the measured difference in one line; raises, naming it, when the shared layout
        does not give the model's stock numbers."""
        pending, self.pending_check = self.pending_check, []
        examples_ = check_rows(input_ids, attention_mask, prompt_lengths=prompt_lengths, examples=examples)

        def layout_fn(ids, mask, lengths, example_ids):
            return self.layout(ids, mask, prompt_lengths=lengths, examples=example_ids)

        for model, reason in pending:
            kind = "classifier" if _is_sequence_classifier(model) else "fused"
            self._checking = True
            try:
                result = run_model_check(
                    model,
                    examples_,
                    layout_fn,
                    kind,
                    self.pad_token_id,
                    window=window_layout(model.config)[0],
                    autocast=self.autocast,
                )
            finally:
                self._checking = False
            if self.model_check_result is None:
                self.model_check_result = result
            name = f"'{model.config.get_text_config().model_type}' ({type(model).__name__})"
            if result.error is not None:
                raise ValueError(
                    f"Prefix sharing is refused for {name}: the start-up check could not run a few examples of the "
                    f"first batch as prefix-shared rows ({result.error}). Train it with `prefix_sharing=False`."
                )
            if not result.passed:
                raise ValueError(
                    f"Prefix sharing is refused for {name}: the start-up check ran a few examples of the first batch "
                    f"as stock rows and as prefix-shared rows, and they differ ({result.summary()}). The model does "
                    "not give its own numbers under the shared layout's attention mask and position ids. Train it "
                    "with `prefix_sharing=False`."
                )
            if not distributed() or torch.distributed.get_rank() == 0:
                logger.warning(f"Prefix sharing: start-up check of {name}, {reason}: equal ({result.summary()}).")


class _LayoutCache:
    """Layouts keyed by the tensors they were built from: the same storage, offset, shape and strides, unchanged
    (tensor version counters), while that storage lives (a weak reference to its base tensor; dropped with it)."""

    def __init__(self):
        self._entries: dict = {}

    @staticmethod
    def _key(tensors, extra) -> tuple:
        bases = [t._base if t._base is not None else t for t in tensors]
        return (
            tuple(
                (id(b), t.storage_offset(), tuple(t.shape), t.stride(), t._version)
                for t, b in zip(tensors, bases, strict=True)
            ),
            extra,
        ), bases

    def get(self, tensors, extra):
        key, bases = self._key(tensors, extra)
        entry = self._entries.get(key)
        if entry is None or any(ref() is not base for ref, base in zip(entry[0], bases, strict=True)):
            return None
        return entry[1]

    def put(self, tensors, extra, layout) -> None:
        key, bases = self._key(tensors, extra)
        self._entries[key] = ([weakref.ref(b) for b in bases], layout)
        for base in bases:
            weakref.finalize(base, self._entries.pop, key, None)


class _ForwardInPlace(TrainerCallback):
    """At the start of training (after transformers applied its kernel options to the model): the shared forward is
    still in place."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer.sharing is not None:
            check_forward_in_place(trainer.sharing.models, getattr(args, "use_liger_kernel", False))


class PrefixSharingMixin:
    """Placed before TRL's trainer class (and before :class:`~trl_prefix_sharing.packing.PackingMixin`). A trainer
    calls `_init_prefix_sharing(...)` before TRL's `__init__` and `_setup_prefix_sharing()` after it; the integration
    object is then `self.sharing` (None while the trainer runs as stock TRL)."""

    #: the config class with the prefix-sharing fields (set by each trainer)
    _config_class: type
    #: read by the configs: a trainer without it (a stock TRL class) given `prefix_sharing=True` is an error
    _reads_prefix_sharing_config = True
    #: whether the trainer lays out images for prefix sharing (DPO: yes; reward, GRPO, RLOO, online DPO: no)
    _supports_vision = False
    #: whether the models get TRL's fused log-prob head from this package (trainers that score full logits in stock)
    _fuse_lm_head = False

    def _init_prefix_sharing(self, model, args, processing_class, peft_config=None) -> None:
        """Before TRL's `__init__`: read the options and check what can be checked (the config class, the model and
        the processor)."""
        self.sharing = None
        self._sharing_scope_depth = 0  # nested `train()`/`evaluate()`/`predict()` calls (see `_prefix_sharing_scope`)
        warn_if_not_our_config(args, self._config_class, type(self).__name__)
        warn_if_fewer_processes_than_asked()
        self._prefix_sharing = bool(getattr(args, "prefix_sharing", False))
        self._init_packing(args)
        if self._uses_layout:
            if not isinstance(args, self._config_class):
                raise TypeError(
                    f"`prefix_sharing`/`packing` need `trl_prefix_sharing.{self._config_class.__name__}` as `args`."
                )
            check_model_and_processor(
                type(self).__name__,
                model,
                processing_class,
                peft_config,
                getattr(args, "trust_remote_code", False),
                self._supports_vision,
            )

    def _init_packing(self, args) -> None:
        """Packing's options (see `PackingMixin`); trainers without packing have none."""
        self._packing = False

    @property
    def prefix_sharing(self) -> bool:
        """Whether this trainer shares prefixes (the config's `prefix_sharing`, until `remove_prefix_sharing()`)."""
        return getattr(self, "_prefix_sharing", False)

    @property
    def packing(self) -> bool:
        return getattr(self, "_packing", False)

    @property
    def _uses_layout(self) -> bool:
        """Prefix sharing and packing both run the model on the shared layout."""
        return self.prefix_sharing or self.packing

    def _layout_models(self) -> list:
        models = [unwrap_model(self.model)]
        if getattr(self, "ref_model", None) is not None:
            models.append(unwrap_model(self.ref_model))
        return models

    def _setup_prefix_sharing(self) -> None:
        """After TRL's `__init__` (or from inside it, on first use): the integration object, the model patches and,
        for preference trainers, the collator. Idempotent."""
        if self.sharing is not None or not self._uses_layout:
            return
        where = active_dropout(unwrap_model(self.model))
        if where is not None:
            raise ValueError(
                f"Prefix sharing cannot give stock's numbers with dropout active in the model ({where}): dropout "
                "draws a random mask per position of the rows the model runs, and the shared rows have other "
                "positions than stock's. Set `disable_dropout=True` in the config (and an attention dropout of 0 in "
                "the model config), or train with `prefix_sharing=False`."
            )
        self.sharing = PrefixSharing(
            self._layout_models(),
            self.processing_class,
            self.args.prefix_sharing_attn_implementation,
            self.accelerator.device,
            pad_to_multiple_of=getattr(self.args, "pad_to_multiple_of", None),
            trainer_name=type(self).__name__,
            supports_vision=self._supports_vision,
            fuse_lm_head=self._fuse_lm_head,
            checks=getattr(self.args, "prefix_sharing_checks", None),
            autocast=self.accelerator.autocast,
            model_check=getattr(self.args, "prefix_sharing_model_check", "auto"),
        )
        self._setup_collator()
        self.add_callback(_ForwardInPlace(self))

    def _finish_prefix_sharing_init(self) -> None:
        """The end of the trainer's `__init__`: the integration object set up, the models left as TRL leaves them (the
        patches are attached by `train()`, `evaluate()` and `predict()` for their length)."""
        self._setup_prefix_sharing()
        if self.sharing is not None:
            self.sharing.detach()

    @contextlib.contextmanager
    def _prefix_sharing_scope(self):
        """The models patched for the block (nested blocks: the outermost one), as TRL left them afterwards."""
        depth = self._sharing_scope_depth
        self._sharing_scope_depth = depth + 1
        try:
            if self.sharing is not None:
                self.sharing.attach()
            yield
        finally:
            self._sharing_scope_depth = depth
            if depth == 0 and self.sharing is not None:
                self.sharing.detach()

    def train(self, *args, **kwargs):
        with self._prefix_sharing_scope():
            return super().train(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with self._prefix_sharing_scope():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self._prefix_sharing_scope():
            return super().predict(*args, **kwargs)

    def _setup_collator(self) -> None:
        """Preference trainers wrap their collator (see `PreferenceSharingMixin`); online trainers lay out in the
        forward."""

    def remove_prefix_sharing(self) -> None:
        """Undo the model patches (and the collator wrap): the trainer then trains as stock TRL. The config is left as
        it was given."""
        if self.sharing is not None:
            self.sharing.detach()
            self.sharing = None
        if isinstance(getattr(self, "data_collator", None), PrefixSharingCollator):
            self.data_collator = self.data_collator.base_collator
        self._prefix_sharing = False
        self._packing = False

    def end(self) -> None:
        """Finish the trackers and destroy the process group, as transformers' `Trainer.end()` (TRL's scripts call it
        last, after training, evaluation and saving). The distributed model wrapper is freed first, while every rank
        still holds the group: freed after the group was gone, its teardown could block forever on CPUs."""
        release_distributed_wrappers(self)
        super().end()
