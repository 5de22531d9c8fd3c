"""Configurations: TRL's `DPOConfig` and `RewardConfig` plus the prefix-sharing and packing fields; TRL's `GRPOConfig`
and `RLOOConfig` plus the prefix-sharing fields."""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass, field

import transformers
import trl

from .attention import ATTN_IMPLEMENTATIONS
from .model_check import MODES as MODEL_CHECK_MODES
from .trie import JOINS


_SHARING_DOC = """
    > Parameters that control prefix sharing

    prefix_sharing (`bool`, *optional*, defaults to `False`):
        Put the completions of each prompt after one copy of it (`[prompt | chosen | rejected]`, or a group's
        generations `[prompt | completion 1 | ... | completion G]`), so the prompt is computed once; a mask keeps the
        completions from seeing each other and position ids make every number the one stock TRL computes on the same
        micro-batch. GRPO and RLOO keep each prompt's generations in one micro-batch (stock TRL shuffles them row by
        row): with one micro-batch per generation batch (the default) every number is stock's; with several, the
        `dapo`, `grpo` and `dr_grpo` losses and the gradients are, while `bnpo`, `top_entropy_quantile`'s threshold,
        the `entropy_coef` bonus and the logged per-micro-batch means (entropy, kl, clip ratios) are taken over other
        micro-batches. More generally, every prefix that rows of a micro-batch share is computed once (a prefix
        trie): a prompt's several pairs, its later turns and duplicate prompts, when the sampler puts them in one
        micro-batch. Text and conversational datasets; see docs/architectures.md for the supported model families.
    prefix_sharing_join (`str`, *optional*, defaults to `"auto"`):
        Which rows of a micro-batch that start alike are laid out as one sequence. `"prompts"`: rows that share at
        least a whole prompt (a prompt's pairs or generations, its later turns, duplicate prompts). `"always"`: any
        rows that share a start, whichever examples they come from, so a system prompt, tool schemas, a document or
        few-shot examples that several examples begin with are computed once. `"auto"`: per micro-batch, whichever of
        the two layouts has the lower estimated cost for the attention kernel in use (a dense kernel pays for every
        query-key pair of a longer row; FlexAttention only for the visible ones); with
        `prefix_sharing_attn_implementation="auto"` too, stock's own rows are a candidate as well, so a micro-batch
        that sharing would slow down runs as stock TRL runs it. Every mode computes stock's numbers.
        Right-padded rows (DPO, reward, KTO, ORPO, CPO, SFT) start at position 0, so any common start is shared.
        Left-padded generated rows (GRPO, RLOO, online DPO) share a start across prompts of any length on models
        whose positions are rotary (measured per model type; a shorter prompt's tokens move to the positions of the
        longer one's, which leaves every distance between them as stock has it); on models with absolute positions,
        or rotary scaling that depends on the longest position (`dynamic`, `longrope`), only between prompts of the
        same length.
    prefix_sharing_checks (`bool` or `None`, *optional*, defaults to `None`):
        Verify each shared batch against the stock rows in the forward (its tokens, padding and labels). Each check
        reads a comparison back from the device, so on an accelerator it waits for the device (a host sync per
        forward). `None`: on where the batch is on the CPU (no cost there), off elsewhere.
    prefix_sharing_model_check (`str`, *optional*, defaults to `"auto"`):
        The start-up check: at the first batch, a few of its examples run through the model as stock rows and as
        prefix-shared rows (no gradients); training goes on when their per-token log-probs (rewards for a reward model)
        agree within the tolerance of the compute dtype, with the measured difference logged in one line, and stops
        with an error naming the difference otherwise. `"auto"`: for models the measured registry does not cover
        (custom code under its own `model_type`, types from a newer transformers, a sliding window the registry did
        not measure); `"always"`: for every model.
    prefix_sharing_attn_implementation (`str`, *optional*, defaults to `"auto"`):
        The attention kernel of the shared rows. `"varlen"`: the micro-batch's unique tokens as one unpadded row, each
        branch of the prefix trie attending to the keys of its path gathered along the trie, through PyTorch's
        FlashAttention-2 varlen kernel (CUDA, Ampere or newer, bfloat16/float16; elsewhere the same segments run
        through a reference implementation, each through SDPA). `"flex_attention"`: the prefix-sharing mask as a
        block-sparse FlexAttention `BlockMask` (CUDA). `"sdpa"`: the same mask, dense, through
        `scaled_dot_product_attention` (any device). `"auto"`: measured on the device: at the first micro-batch every
        kernel that can run here (on CUDA varlen, FlexAttention and SDPA; elsewhere SDPA and varlen's reference) and,
        with `prefix_sharing_join="auto"`, stock's own rows run a timed forward and backward (on half of it, then on
        the whole unless that half already took 30% longer than another's whole), and every later micro-batch runs on
        the candidate of least predicted time (a fixed cost per forward plus a cost per multiply-add, fitted per
        candidate, corrected by the timed training steps; the candidates within 30% of the fastest train 3
        micro-batches each first); the log says what was measured and chosen. With packing, or a vision-language model,
        `"auto"` takes the first of those kernels that can run. An explicit kernel that cannot run is an error naming
        why, and is never replaced. The trainer switches the attention implementation of the models it holds for the
        length of `train()`/`evaluate()` (varlen registers `"prefix_sharing_varlen"` with transformers'
        `AttentionInterface`); saved configs never name it. Under FlexAttention the shared rows' width is rounded up to
        a multiple of 128 (its block size) unless `pad_to_multiple_of` is set (`1`: no rounding), so its compiled
        kernels see few distinct shapes; varlen's one row is never padded.
"""

_PACKING_DOC = """
    group_by_prompt (`bool`, *optional*, defaults to `False`):
        Keep the pairs of one prompt (all pairs of several ranked completions, several sampled answers) in the same
        micro-batch, so that prefix sharing computes the prompt once for all of them. The training sampler draws
        exactly what stock TRL's draws (the same random stream), then moves each prompt's pairs up to where its first
        pair falls. What changes: which pairs share a micro-batch (and so what a per-micro-batch loss or metric
        averages over). What does not: the pairs each epoch sees, every per-pair number. Pairs are grouped by their
        `prompt_ids` (DPO), or by the `prompt` column where a reward dataset has one, else by the common start of
        the chosen and rejected tokens. With `packing`, the packing unit is a prompt's pairs together (their trie).
    packing (`bool`, *optional*, defaults to `False`):
        Pack several examples into one row with a multipack first-fit-decreasing sampler, removing padding. Each
        example is one document of the row (no token sees another example). Works with and without
        `prefix_sharing` (without it, the sequences of an example are separate documents). A packed step holds a
        variable number of pairs; the loss is normalised so that every pair weighs the same across packing,
        gradient accumulation and ranks, as in stock TRL. What differs by design: which pairs share a micro-batch, so
        batch-level loss types (`aot`, `aot_unpaired`, the token mean of `sft`) and batch extremes (`min_reward`,
        `max_reward`) see other batches than stock's.
    packing_length (`int` or `None`, *optional*, defaults to `None`):
        Tokens per packed row. `None`: `per_device_train_batch_size` times the longest packing unit of the dataset,
        rounded up to a multiple of 128 (a streamed dataset, whose lengths cannot be read ahead: times the bound on a
        unit, 2 x `max_length`). Rows are padded to exactly this length so FlexAttention shapes stay fixed.
"""

_FIELDS_DOC = _SHARING_DOC + _PACKING_DOC


@dataclass
class PrefixSharingArguments:
    """The prefix-sharing fields this package adds to TRL's configs (documented in each config's docstring)."""

    prefix_sharing: bool = field(
        default=False,
        metadata={
            "help": "Compute each prompt once: put a prompt and its completions ([prompt | chosen | rejected], or a "
            "group's generations) in one sequence with a mask that keeps the completions apart. Log-probs, losses, "
            "gradients and every logged number equal stock TRL's on the same micro-batches. GRPO/RLOO keep a prompt's "
            "generations in one micro-batch: with several micro-batches per generation batch, per-micro-batch "
            "quantities (bnpo, top_entropy_quantile, entropy_coef, logged entropy/kl/clip ratios) are taken over "
            "other micro-batches than stock's."
        },
    )
    prefix_sharing_join: str = field(
        default="auto",
        metadata={
            "help": "Which rows that start alike share one sequence: 'prompts' (rows sharing a whole prompt), "
            "'always' (any common start, e.g. a system prompt or tool schemas across examples) or 'auto' (per "
            "micro-batch, the layout with the lower estimated cost; with an 'auto' kernel too, stock's own rows "
            "are a candidate). Every mode computes stock's numbers.",
            "choices": list(JOINS),
        },
    )
    prefix_sharing_attn_implementation: str = field(
        default="auto",
        metadata={
            "help": "Attention kernel of the shared rows: 'varlen' (one unpadded row, each trie branch attending to "
            "its path's gathered keys; FlashAttention-2 varlen on CUDA in bf16/fp16, a reference elsewhere), "
            "'flex_attention' (block-sparse mask, CUDA), 'sdpa' (dense mask, any device) or 'auto' (per "
            "micro-batch, the kernel, or stock's own rows, of least time measured at start-up on this device).",
            "choices": list(ATTN_IMPLEMENTATIONS),
        },
    )

    prefix_sharing_model_check: str = field(
        default="auto",
        metadata={
            "help": "Run a few examples of the first batch through the model as stock and as shared rows and stop "
            "with an error if they differ: 'auto' for models outside the measured registry, 'always' for every model.",
            "choices": list(MODEL_CHECK_MODES),
        },
    )
    prefix_sharing_checks: bool | None = field(
        default=None,
        metadata={
            "help": "Verify each shared batch against the stock rows in the forward (a host sync per forward on an "
            "accelerator). None: on where the batch is on the CPU, off elsewhere."
        },
    )

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if issubclass(cls, transformers.TrainingArguments):
            # TRL's config comes first in every config's bases, so a method defined on this mixin would be shadowed
            cls.get_process_log_level = _get_process_log_level_for_our_trainers

    @property
    def _asks_for_layout(self) -> bool:
        """Whether this config asks for something only this package's trainers do."""
        return bool(self.prefix_sharing or getattr(self, "packing", False) or getattr(self, "group_by_prompt", False))

    #: whether TRL's trainer keeps Liger's forward-replacing fused loss off (`use_liger_kernel` then applies layer
    #: kernels only, which compose with the shared forward; checked again at the start of training)
    _liger_keeps_forward = True

    def _check_prefix_sharing_arguments(self) -> None:
        if self._asks_for_layout:
            refusal = refused_option(self)
            if refusal is not None:
                raise ValueError(refusal)
        if self.prefix_sharing_model_check not in MODEL_CHECK_MODES:
            raise ValueError(
                f"`prefix_sharing_model_check` must be one of {MODEL_CHECK_MODES}, got "
                f"{self.prefix_sharing_model_check!r}."
            )
        if self.prefix_sharing_join not in JOINS:
            raise ValueError(f"`prefix_sharing_join` must be one of {JOINS}, got {self.prefix_sharing_join!r}.")
        if self.prefix_sharing_attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"`prefix_sharing_attn_implementation` must be one of {ATTN_IMPLEMENTATIONS}, got "
                f"{self.prefix_sharing_attn_implementation!r}."
            )


def refused_option(args) -> str | None:
    """Why an option of this config cannot be combined with prefix sharing or packing (None: it can), with the way
    out: every option of TRL's configs that changes the forward, the batch or the loss's inputs is either proven
    against stock (docs/options.md) or refused here, before anything is built."""
    what = "`prefix_sharing`/`packing`" if isinstance(args, PackingArguments) else "`prefix_sharing`"
    parallelism = getattr(args, "parallelism_config", None)
    if parallelism is not None and (
        getattr(parallelism, "cp_enabled", False) or getattr(parallelism, "sp_enabled", False)
    ):
        return (
            f"{what} cannot be combined with context or sequence parallelism (`parallelism_config` with `cp_size` or "
            "`sp_size` > 1): it splits each row across ranks and replaces custom attention masks with causal "
            "attention, so the prefix-sharing mask would be dropped. Set `cp_size=1` and `sp_size=1`, or turn "
            f"{what} off."
        )
    if parallelism is not None and getattr(parallelism, "tp_enabled", False):
        return (
            f"{what} has not been measured with tensor parallelism (`parallelism_config` with `tp_size` > 1). Set "
            f"`tp_size=1` (data parallelism, DeepSpeed and FSDP are supported), or turn {what} off."
        )
    if getattr(args, "use_liger_kernel", False) and not args._liger_keeps_forward:
        return (
            f"{what} cannot be combined with `use_liger_kernel=True` in this trainer: transformers applies Liger's "
            "kernels at the start of `train()`, and Liger's fused cross-entropy replaces the model's forward, which "
            f"the shared layout runs through. Set `use_liger_kernel=False`, or turn {what} off."
        )
    if getattr(args, "neftune_noise_alpha", None) is not None:
        return (
            f"{what} cannot be combined with `neftune_noise_alpha`: NEFTune adds noise to the embeddings of the rows "
            "the model runs, scaled by their length, and the shared rows hold other positions and lengths than "
            f"stock's, so no step would be stock's. Set `neftune_noise_alpha=None`, or turn {what} off."
        )
    if getattr(args, "torch_compile", False):
        return (
            f"{what} cannot be combined with `torch_compile=True` (the whole model compiled): the shared layout is "
            "built around the model's forward, and FlexAttention's mask and kernel are compiled on their own. Set "
            "`torch_compile=False`."
        )
    return None


def _get_process_log_level_for_our_trainers(self) -> int:
    """`TrainingArguments.get_process_log_level`, which `transformers.Trainer.__init__` calls first thing with its
    `args`: the one point where a config learns which trainer it was handed to. A stock trainer (TRL's own class) given
    this package's config with `prefix_sharing` or `packing` on would silently train without them: an error instead."""
    trainer = sys._getframe(1).f_locals.get("self")
    if (
        isinstance(trainer, transformers.Trainer)
        and not getattr(trainer, "_reads_prefix_sharing_config", False)
        and self._asks_for_layout
    ):
        ours = type(self).__name__.removesuffix("Config") + "Trainer"
        raise TypeError(
            f"{type(trainer).__module__}.{type(trainer).__name__} was given trl_prefix_sharing.{type(self).__name__} "
            "with prefix_sharing (or packing) on, but it is not this package's trainer and would ignore them, "
            f"training exactly as stock TRL. Use `from trl_prefix_sharing import {ours}` (or set prefix_sharing=False "
            "and packing=False)."
        )
    return transformers.TrainingArguments.get_process_log_level(self)


def warn_if_not_our_config(args, config_class: type, trainer_name: str) -> None:
    """This package's trainer given TRL's own config (or none: TRL then builds its own) trains exactly as stock TRL:
    say so, since the user imported this trainer to share prefixes."""
    if isinstance(args, PrefixSharingArguments):
        return
    given = "no `args`" if args is None else f"{type(args).__module__}.{type(args).__name__}"
    warnings.warn(
        f"trl_prefix_sharing.{trainer_name} was given {given}, which has no `prefix_sharing` field: it trains exactly "
        f"as stock TRL, sharing nothing. For prefix sharing pass "
        f"`trl_prefix_sharing.{config_class.__name__}(..., prefix_sharing=True)`.",
        UserWarning,
        stacklevel=stacklevel_outside_package(),
    )


def stacklevel_outside_package() -> int:
    """The `stacklevel` that makes a warning issued by the caller point at the first frame outside this package (the
    user's line that built the trainer)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("trl_prefix_sharing."):
        frame, level = frame.f_back, level + 1
    return level


@dataclass
class PackingArguments:
    """The packing fields this package adds to the preference trainers' configs (DPO and reward models), apart from
    prefix sharing's: packing runs on the same layout with or without it."""

    packing: bool = field(
        default=False,
        metadata={
            "help": "Pack several examples per row with a multipack first-fit-decreasing sampler (no padding). Every "
            "pair keeps its stock weight in the loss, but micro-batches hold other pairs than stock's: batch-level "
            "loss types (aot, aot_unpaired, sft's token mean) and batch extremes (min/max_reward) see other batches."
        },
    )
    packing_length: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per packed row. Default: per_device_train_batch_size x the longest packing unit (streamed "
            "data: 2 x max_length), rounded up to a multiple of 128."
        },
    )

    group_by_prompt: bool = field(
        default=False,
        metadata={
            "help": "Keep the pairs of one prompt in the same micro-batch, so prefix sharing computes their prompt "
            "once: the stock sampler's random order (the same random draws), with each prompt's pairs moved up to "
            "where its first pair falls. Changes which pairs share a micro-batch, not which pairs an epoch sees. With "
            "packing, a prompt's pairs are packed as one unit."
        },
    )

    def _check_packing_arguments(self) -> None:
        if (getattr(self, "prefix_sharing", False) or self.packing) and getattr(self, "padding_free", False):
            raise ValueError(
                "`prefix_sharing`/`packing` cannot be combined with `padding_free=True`: both rewrite the batch "
                "layout, and TRL 1.16 has padding-free DPO disabled anyway. Set `padding_free=False`."
            )
        if self.packing_length is not None and self.packing_length <= 0:
            raise ValueError(f"`packing_length` must be positive, got {self.packing_length}.")


@dataclass
class DPOConfig(trl.DPOConfig, PrefixSharingArguments, PackingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.DPOTrainer`]: every parameter of [`trl.DPOConfig`], plus the "
        "ones below. With `prefix_sharing=False` and `packing=False` training is exactly TRL's.\n" + _FIELDS_DOC
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()
        self._check_packing_arguments()
        check_dpo_loss_types(self.loss_type)


def dpo_loss_types() -> list[str]:
    """The loss types TRL's `DPOConfig` documents (its `loss_type` field's help), in its order."""
    help_text = trl.DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    return re.findall(r"`'([a-z_]+)'`", help_text)


def check_dpo_loss_types(loss_types) -> None:
    """An error at once for a `loss_type` TRL's DPO trainer does not know (TRL itself fails at the first step)."""
    known = dpo_loss_types()
    unknown = [name for name in loss_types if name not in known]
    if known and unknown:
        raise ValueError(f"Unknown DPO `loss_type` {unknown[0]!r}; TRL's DPO trainer knows {', '.join(known)}.")


@dataclass
class RewardConfig(trl.RewardConfig, PrefixSharingArguments, PackingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.RewardTrainer`]: every parameter of [`trl.RewardConfig`], plus "
        "the ones below. With `prefix_sharing=False` and `packing=False` training is exactly TRL's.\n" + _FIELDS_DOC
    )

    _liger_keeps_forward = False  # TRL's reward trainer leaves Liger's default (a replaced forward) as it is

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()
        self._check_packing_arguments()


@dataclass
class GRPOConfig(trl.GRPOConfig, PrefixSharingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.GRPOTrainer`]: every parameter of [`trl.GRPOConfig`], plus the "
        "ones below. With `prefix_sharing=False` training is exactly TRL's. With it, each prompt's generations are "
        "scored in one sequence `[prompt | completion 1 | ... | completion G]`, in the training forward and in the "
        "old-policy and reference passes.\n" + _SHARING_DOC
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()


@dataclass
class RLOOConfig(trl.RLOOConfig, PrefixSharingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.RLOOTrainer`]: every parameter of [`trl.RLOOConfig`], plus the "
        "ones below. With `prefix_sharing=False` training is exactly TRL's. With it, each prompt's generations are "
        "scored in one sequence `[prompt | completion 1 | ... | completion G]`.\n" + _SHARING_DOC
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()


@dataclass
class SFTConfig(trl.SFTConfig, PrefixSharingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.SFTTrainer`]: every parameter of [`trl.SFTConfig`], plus the "
        "ones below. With `prefix_sharing=False` training is exactly TRL's. With it, the rows of a micro-batch that "
        "start alike (a prompt's several completions, a system prompt or preamble shared by several examples, as "
        "`prefix_sharing_join` says) are computed once; a row's prompt is its tokens before its first trained label. "
        "TRL's own `packing` and `padding_free` lay rows out their own way and are refused with it.\n"
        + _SHARING_DOC
        + """    group_by_prompt (`bool`, *optional*, defaults to `False`):
        Keep the examples of one prompt (several completions of it) in the same micro-batch, so that prefix sharing
        computes the prompt once. The training sampler draws exactly what stock TRL's draws (the same random stream),
        then moves each prompt's examples up to where its first example falls. What changes: which examples share a
        micro-batch. What does not: the examples each epoch sees, every per-token number. A prompt is an example's
        tokens before the first label it trains on.
"""
    )

    _liger_keeps_forward = False  # Liger's fused loss replaces the forward the shared rows run through

    group_by_prompt: bool = field(
        default=False,
        metadata={
            "help": "Keep the examples of one prompt (its several completions) in the same micro-batch, so prefix "
            "sharing computes the prompt once: the stock sampler's random order (the same random draws), with each "
            "prompt's examples moved up to where its first falls. A prompt is an example's tokens before the first "
            "label it trains on."
        },
    )

    @property
    def _asks_for_layout(self) -> bool:
        return bool(self.prefix_sharing or self.group_by_prompt)  # `packing` here is TRL's own SFT packing

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()
        if self.prefix_sharing and (self.packing or self.padding_free):
            option = "packing" if self.packing else "padding_free"
            raise ValueError(
                f"`prefix_sharing` cannot be combined with SFT's `{option}=True`: it concatenates examples into one "
                "row with restarting position ids, a layout of its own, while prefix sharing lays out the rows itself "
                "(a shared start computed once, no padding between a prompt's completions). Set "
                f"`{option}=False`, or turn `prefix_sharing` off."
            )
