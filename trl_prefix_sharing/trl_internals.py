"""Every private TRL (and transformers `Trainer`, accelerate) method, attribute and function this package overrides or
reads, in one place, checked against the installed versions when a trainer module is imported.

TRL's trainers have no hooks for a different batch layout, so the trainers here override a few of their methods and
read a few of their attributes. A new TRL release may rename or re-sign any of them; this module turns that into one
clear error at import, naming what changed and the supported range, instead of a silent wrong number or a traceback
deep in a training step. No TRL method body is copied: each override calls TRL's own method, and the GRPO/RLOO shuffle
is replaced by swapping the one function TRL's `_prepare_inputs` calls, for the duration of that call
(:func:`replaced_function`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from dataclasses import dataclass


__all__ = [
    "SUPPORTED_TRL",
    "Internal",
    "INTERNALS",
    "check_trl_internals",
    "import_experimental",
    "replaced_function",
]

#: the TRL versions this package is measured with (also the `trl` requirement in pyproject.toml)
SUPPORTED_TRL = ">=1.16,<1.17"


@dataclass(frozen=True)
class Internal:
    """One internal we depend on: ``owner`` (an import path, ``module:Class`` or ``module``), ``name``, how we use it
    (``"override"``, ``"read"``, ``"write"``, ``"replace"``: swapped during a call, ``"call"``), and for a method or
    function the leading parameters we pass or receive (checked against its signature)."""

    owner: str
    name: str
    use: str
    parameters: tuple[str, ...] = ()
    attribute: bool = False  # an instance attribute (checked in the source of its class: `self.name = ...`)
    holder: str = "self"  # for an attribute the class sets on another object (e.g. `model.name = ...`): its name there


_DPO = "trl.trainer.dpo_trainer:DPOTrainer"
_REWARD = "trl.trainer.reward_trainer:RewardTrainer"
_GRPO = "trl.trainer.grpo_trainer:GRPOTrainer"
_RLOO = "trl.trainer.rloo_trainer:RLOOTrainer"
_ONLINE_DPO = "trl.experimental.online_dpo.online_dpo_trainer:OnlineDPOTrainer"
_KTO = "trl.trainer.kto_trainer:KTOTrainer"
_ORPO = "trl.experimental.orpo.orpo_trainer:ORPOTrainer"
_CPO = "trl.experimental.cpo.cpo_trainer:CPOTrainer"
_TRAINER = "transformers.trainer:Trainer"
_LOGPS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep")


def _concatenated_trainer_internals(owner: str) -> tuple[Internal, ...]:
    """What `concatenated.ConcatenatedSharingMixin` uses of TRL's ORPO or CPO trainer class."""
    return (
        Internal(owner, "concatenated_forward", "override", ("self", "model", "batch")),
        Internal(owner, "concatenated_inputs", "call", ("batch", "is_encoder_decoder", "padding_value", "device")),
        Internal(owner, "is_encoder_decoder", "read", attribute=True),
        Internal(owner, "aux_loss_enabled", "read", attribute=True),
    )


def _group_trainer_internals(owner: str) -> tuple[Internal, ...]:
    """What `group_sharing.GroupSharingTrainerMixin` uses of TRL's GRPO or RLOO trainer class (``module:Class``)."""
    module = owner.partition(":")[0]
    return (
        Internal(owner, "_get_per_token_logps_and_entropies", "override", _LOGPS),
        Internal(owner, "_prepare_inputs", "override", ("self", "generation_batch")),
        Internal(owner, "compute_loss", "override", ("self", "model", "inputs")),
        Internal(owner, "log", "override", ("self", "logs", "start_time")),
        Internal(module, "shuffle_sequence_dict", "replace", ("seq_dict",)),
        Internal(owner, "_metrics", "write", attribute=True),
    )


#: trainer -> the internals its module depends on ("common": every trainer module)
INTERNALS: dict[str, tuple[Internal, ...]] = {
    "common": (
        Internal("trl.trainer.utils", "add_fused_lm_head", "call", ("model",)),
        Internal("trl.trainer.utils", "FusedCausalLMOutput", "call"),
        # accelerate's mark of a model whose forward `prepare_model` wrapped in mixed precision (`forward.py`)
        Internal("accelerate.accelerator:Accelerator", "_original_forward", "read", attribute=True, holder="model"),
        # `PrefixSharingMixin.end` frees the distributed wrapper before transformers destroys the process group
        Internal(_TRAINER, "end", "override", ("self",)),
        Internal(_TRAINER, "model_wrapped", "write", attribute=True),
    ),
    "dpo": (
        Internal(_DPO, "_precompute_ref_logps", "override", ("self", "dataset", "name", "batch_size")),
        Internal(_DPO, "compute_ref_log_probs", "override", ("self", "model", "inputs")),
        Internal(_DPO, "loss_types", "read", attribute=True),
        Internal(_DPO, "_metrics", "write", attribute=True),
    ),
    "reward": (
        Internal(
            _REWARD, "_prepare_dataset", "override", ("self", "dataset", "processing_class", "args", "dataset_name")
        ),
        Internal(_REWARD, "_metrics", "write", attribute=True),
        Internal(_REWARD, "_total_train_tokens", "write", attribute=True),
        Internal(_REWARD, "_tp_size", "read", attribute=True),
        Internal("trl.data_utils", "_tokenize", "call", ("processing_class",)),
        Internal(_TRAINER, "_set_signature_columns_if_needed", "override", ("self",)),
    ),
    "packing": (  # transformers' Trainer, overridden for the multipack sampler and pair-weighted metrics
        Internal(_TRAINER, "_get_train_sampler", "override", ("self", "train_dataset")),
        Internal(_TRAINER, "_get_eval_sampler", "override", ("self", "eval_dataset")),
        Internal(_TRAINER, "get_batch_samples", "override", ("self", "epoch_iterator", "num_batches", "device")),
        Internal(_TRAINER, "evaluation_loop", "override"),
        Internal(_TRAINER, "prediction_step", "override", ("self", "model", "inputs", "prediction_loss_only")),
        Internal(_TRAINER, "gather_function", "write", attribute=True),
        Internal(_TRAINER, "current_gradient_accumulation_steps", "read", attribute=True),
    ),
    "grpo": _group_trainer_internals(_GRPO),
    "rloo": _group_trainer_internals(_RLOO),
    "online_dpo": (
        Internal(
            _ONLINE_DPO,
            "_forward",
            "override",
            ("self", "model", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "vision_inputs"),
        ),
        Internal(_ONLINE_DPO, "max_length", "read", attribute=True),
    ),
    "kto": (
        Internal(_KTO, "_compute_kl_logps", "override", ("self", "model", "batch")),
        Internal(_KTO, "compute_ref_log_probs", "override", ("self", "model", "inputs")),
        Internal(_KTO, "compute_loss", "override", ("self", "model", "inputs")),
        Internal(_KTO, "calculate_KL", "read", attribute=True),
        Internal(_KTO, "_is_vision_dataset", "read", attribute=True),
    ),
    "orpo": (*_concatenated_trainer_internals(_ORPO), Internal(_ORPO, "padding_value", "read", attribute=True)),
    "cpo": (*_concatenated_trainer_internals(_CPO), Internal(_CPO, "pad_token_id", "read", attribute=True)),
}


def _resolve(owner: str):
    module_name, _, qualname = owner.partition(":")
    target = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        target = getattr(target, part)
    return target


@functools.cache
def _class_source(owner: type) -> str:
    """A class's source, read once (transformers' `Trainer` is thousands of lines, and several internals name it)."""
    return inspect.getsource(owner)


def _problem(internal: Internal) -> str | None:
    """What no longer matches for one internal (None: it matches)."""
    try:
        owner = _resolve(internal.owner)
    except (ImportError, AttributeError) as error:
        return f"{internal.owner} cannot be imported ({error})"
    if internal.attribute:
        source = _class_source(owner) if inspect.isclass(owner) else ""
        assignment = rf"\b{internal.holder}\.{internal.name}\s*(\[[^]]*\]\s*)?[+]?="
        if hasattr(owner, internal.name) or re.search(assignment, source):
            return None
        return f"{internal.owner} no longer sets `{internal.holder}.{internal.name}`"
    target = getattr(owner, internal.name, None)
    if target is None:
        return f"{internal.owner} has no `{internal.name}`"
    if internal.parameters:
        try:
            names = tuple(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            return None  # not introspectable (a C function): nothing to compare
        if names[: len(internal.parameters)] != internal.parameters:
            return (
                f"{internal.owner}.{internal.name} takes ({', '.join(names)}), not "
                f"({', '.join(internal.parameters)}, ...)"
            )
    return None


@functools.cache
def check_trl_internals(*trainers: str) -> None:
    """Check the internals of these trainers (keys of :data:`INTERNALS`, "common" always) against the installed TRL
    and transformers; one error listing every mismatch."""
    import transformers
    import trl

    problems = [
        problem
        for key in ("common", *trainers)
        for internal in INTERNALS[key]
        if (problem := _problem(internal)) is not None
    ]
    if problems:
        raise ImportError(
            f"trl_prefix_sharing supports trl{SUPPORTED_TRL} (installed: trl {trl.__version__}, transformers "
            f"{transformers.__version__}); the TRL internals it builds on have changed:\n- "
            + "\n- ".join(problems)
            + f"\nInstall a supported TRL (`pip install 'trl{SUPPORTED_TRL}'`) or use TRL's trainers without prefix "
            "sharing."
        )


def import_experimental(name: str, trainer: str):
    """``trl.experimental.<name>``, or an error that says what is missing and the way out: TRL removes experimental
    trainers without a deprecation cycle, and only the module of that trainer fails to import, not this package."""
    try:
        return importlib.import_module(f"trl.experimental.{name}")
    except ImportError as error:
        import trl

        raise ImportError(
            f"trl_prefix_sharing.{trainer} builds on TRL's experimental `trl.experimental.{name}`, which the "
            f"installed trl {trl.__version__} does not provide ({error}). It is supported with trl{SUPPORTED_TRL}: "
            f"install it (`pip install 'trl{SUPPORTED_TRL}'`), or train with a TRL trainer without prefix sharing. "
            "The other trainers of this package are unaffected."
        ) from error


@contextlib.contextmanager
def replaced_function(module_name: str, name: str, replacement):
    """Within the block, ``module_name.name`` is ``replacement`` (for the code of that module that calls it by name);
    restored on exit, whatever happens. Scoped to one call of a TRL method: nothing else sees it afterwards."""
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield original
    finally:
        setattr(module, name, original)
