"""The table of trainers: every fact about a TRL trainer this package serves, in one place (`TRAINERS`).

The trainers, the command line (`trl-prefix-sharing <name>`, `stats`), the guard of TRL's internals, the package's
exports and the tests read this table; a new trainer is one entry here, then its module. The guard runs for every
entry by construction: a class that puts `PrefixSharingMixin` before a TRL trainer class is checked against its
entry's internals when the class is created (`guard_trainer_class`), and a TRL trainer class with no entry is an
error there.

This module imports nothing heavy (no torch, no TRL): the command line's `--help` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


__all__ = ["Columns", "TRAINERS", "TrainerSpec", "guard_trainer_class", "spec_of_class", "trainers_with"]


@dataclass(frozen=True)
class Columns:
    """The dataset columns a trainer reads, checked before TRL's preprocessing."""

    accepted: tuple[frozenset[str], ...] = field(metadata={"help": "Column sets, one of which must be present."})
    needs: str = field(metadata={"help": "What a dataset needs, in words: the end of the error."})

    def accept(self, columns) -> bool:
        """Whether a dataset with `columns` holds one of the accepted sets in full."""
        return any(required <= set(columns) for required in self.accepted)

    def with_text_field(self, name: str) -> Columns:
        """These columns with plain text read from the column `name` instead of `text` (SFT's `dataset_text_field`);
        the same columns where no accepted set holds `text`."""
        if name == "text" or not any("text" in required for required in self.accepted):
            return self
        accepted = tuple(
            frozenset(name if column == "text" else column for column in required) for required in self.accepted
        )
        return Columns(accepted, self.needs.replace("'text'", repr(name)))


@dataclass(frozen=True)
class TrainerSpec:
    """One trainer of this package: what it builds on in TRL and how the tools around it treat it.

    Args:
        name (`str`):
            The command (`trl-prefix-sharing <name>`), the `stats --trainer` value and the key of `TRAINERS`.
        title (`str`):
            The class names: `<title>Trainer` and `<title>Config`, in TRL and in this package.
        trl_trainer (`str`):
            TRL's trainer class, `module:Class` (its definition, not a re-export).
        module (`str`):
            This package's module defining `<title>Trainer`.
        config_module (`str`):
            This package's module defining `<title>Config`.
        guards (`tuple[str, ...]`):
            The keys of `trl_internals.INTERNALS` its module depends on (`"common"` is always checked).
        data (`str`):
            What a dataset row holds: `"preference"` (chosen and rejected, or a ranked list), `"unpaired"` (KTO),
            `"paired"` (ORPO, CPO: chosen and rejected, tokenized by the trainer), `"sft"` (one sequence per row), or
            `"prompts"` (completions generated during training).
        columns (`Columns`):
            The columns its dataset needs.
        summary (`str`):
            Its line in the command line's usage.
        script_arguments (`str`):
            The `module:Class` of TRL's script arguments its command parses.
        model_head (`str`):
            The head of the model it trains: `"causal_lm"`, or `"sequence_classification"` (a reward model).
        loads_tokenizer (`bool`):
            Whether the command line loads the tokenizer and passes the quantization config in `model_init_kwargs`
            (trainers that take no `quantization_config` and load no tokenizer from a model name).
        max_length (`int` or `None`):
            TRL's default `max_length` of its config (`None`: it has none).
        num_generations (`int` or `None`):
            TRL's default number of completions generated per prompt (`None`: data holds its completions).
        max_completion_length (`int` or `None`):
            TRL's default longest generated completion.
        completion_length_flag (`str` or `None`):
            The config field naming that length (`max_completion_length`, or online DPO's `max_new_tokens`).
    """

    name: str
    title: str
    trl_trainer: str
    module: str
    config_module: str
    guards: tuple[str, ...]
    data: str
    columns: Columns
    summary: str
    script_arguments: str = "trl:ScriptArguments"
    model_head: str = "causal_lm"
    loads_tokenizer: bool = False
    max_length: int | None = 1024
    num_generations: int | None = None
    max_completion_length: int | None = None
    completion_length_flag: str | None = None

    @property
    def trainer_class(self) -> str:
        """This package's trainer class name (`DPOTrainer`)."""
        return f"{self.title}Trainer"

    @property
    def config_class(self) -> str:
        return f"{self.title}Config"

    @property
    def experimental(self) -> bool:
        """Whether TRL ships the trainer in `trl.experimental` (removable without a deprecation cycle)."""
        return self.trl_trainer.startswith("trl.experimental.")

    @property
    def generates(self) -> bool:
        """Whether its completions are generated during training (GRPO, RLOO, online DPO)."""
        return self.data == "prompts"


_PAIRS = Columns(
    (frozenset({"chosen", "rejected"}),),
    "a preference dataset needs 'chosen' and 'rejected' (and optionally 'prompt'), text or conversational.",
)
_PROMPTS = Columns(
    (frozenset({"prompt"}),), "it needs a 'prompt' column, text or conversational (the completions are generated)."
)

#: name -> its entry, in the order of the command line's usage
TRAINERS: dict[str, TrainerSpec] = {
    spec.name: spec
    for spec in (
        TrainerSpec(
            name="dpo",
            title="DPO",
            trl_trainer="trl.trainer.dpo_trainer:DPOTrainer",
            module=".dpo_trainer",
            config_module=".config",
            guards=("dpo", "packing"),
            data="preference",
            columns=Columns(
                (frozenset({"chosen", "rejected"}), frozenset({"prompt_ids", "chosen_ids", "rejected_ids"})),
                "a preference dataset needs 'chosen' and 'rejected' (and optionally 'prompt'), text or "
                "conversational, or pre-tokenized 'prompt_ids', 'chosen_ids' and 'rejected_ids'.",
            ),
            summary=(
                "DPO training (TRL's `trl dpo` arguments + prefix_sharing, packing, ...), launched with accelerate"
            ),
        ),
        TrainerSpec(
            name="reward",
            title="Reward",
            trl_trainer="trl.trainer.reward_trainer:RewardTrainer",
            module=".reward_trainer",
            config_module=".config",
            guards=("reward", "packing"),
            data="preference",
            columns=Columns(
                (
                    frozenset({"chosen", "rejected"}),
                    frozenset({"chosen_ids", "rejected_ids"}),
                    frozenset({"chosen_input_ids", "rejected_input_ids"}),
                    frozenset({"completions"}),
                    frozenset({"completion_ids"}),
                ),
                "a reward dataset needs 'chosen' and 'rejected' (optionally 'prompt' and 'margin'), or pre-tokenized "
                "'chosen_ids' and 'rejected_ids' (or TRL's older names 'chosen_input_ids' and 'rejected_input_ids'), "
                "or a ranked list 'completions' (best first).",
            ),
            summary="reward-model training (TRL's `trl reward` arguments + the same), launched with accelerate",
            model_head="sequence_classification",
        ),
        TrainerSpec(
            name="grpo",
            title="GRPO",
            trl_trainer="trl.trainer.grpo_trainer:GRPOTrainer",
            module=".grpo_trainer",
            config_module=".config",
            guards=("grpo",),
            data="prompts",
            columns=_PROMPTS,
            summary="GRPO training (TRL's `trl grpo` arguments, reward functions included, + prefix_sharing)",
            script_arguments="trl.scripts.grpo:GRPOScriptArguments",
            max_length=None,
            num_generations=8,
            max_completion_length=512,
            completion_length_flag="max_completion_length",
        ),
        TrainerSpec(
            name="rloo",
            title="RLOO",
            trl_trainer="trl.trainer.rloo_trainer:RLOOTrainer",
            module=".rloo_trainer",
            config_module=".config",
            guards=("rloo",),
            data="prompts",
            columns=_PROMPTS,
            summary="RLOO training (TRL's `trl rloo` arguments + prefix_sharing)",
            script_arguments="trl.scripts.rloo:RLOOScriptArguments",
            max_length=None,
            num_generations=2,
            max_completion_length=512,
            completion_length_flag="max_completion_length",
        ),
        TrainerSpec(
            name="online_dpo",
            title="OnlineDPO",
            trl_trainer="trl.experimental.online_dpo.online_dpo_trainer:OnlineDPOTrainer",
            module=".online_dpo_trainer",
            config_module=".online_dpo_trainer",
            guards=("online_dpo",),
            data="prompts",
            columns=_PROMPTS,
            summary="online DPO (TRL's experimental OnlineDPOConfig, rewards named as for grpo, + prefix_sharing)",
            # TRL ships no online DPO script: GRPO's script arguments name the reward the same way
            script_arguments="trl.scripts.grpo:GRPOScriptArguments",
            loads_tokenizer=True,
            max_length=512,  # prompt + completion, the prompt's start cut to fit
            num_generations=2,  # always: a pair per prompt
            max_completion_length=64,
            completion_length_flag="max_new_tokens",
        ),
        TrainerSpec(
            name="kto",
            title="KTO",
            trl_trainer="trl.trainer.kto_trainer:KTOTrainer",
            module=".kto_trainer",
            config_module=".kto_trainer",
            guards=("kto",),
            data="unpaired",
            columns=Columns(
                (frozenset({"prompt", "completion", "label"}), frozenset({"chosen", "rejected"})),
                "a KTO dataset needs 'prompt', 'completion' and 'label' (unpaired), or 'chosen' and 'rejected' (and "
                "optionally 'prompt': preference pairs, which TRL unpairs), text or conversational.",
            ),
            summary="KTO training (TRL's `trl kto` arguments + prefix_sharing)",
        ),
        TrainerSpec(
            name="orpo",
            title="ORPO",
            trl_trainer="trl.experimental.orpo.orpo_trainer:ORPOTrainer",
            module=".orpo_trainer",
            config_module=".orpo_trainer",
            guards=("orpo",),
            data="paired",
            columns=_PAIRS,
            summary="ORPO (TRL's experimental ORPOConfig + prefix_sharing)",
            loads_tokenizer=True,
        ),
        TrainerSpec(
            name="cpo",
            title="CPO",
            trl_trainer="trl.experimental.cpo.cpo_trainer:CPOTrainer",
            module=".cpo_trainer",
            config_module=".cpo_trainer",
            guards=("cpo",),
            data="paired",
            columns=_PAIRS,
            summary="CPO, SimPO, AlphaPO (TRL's experimental CPOConfig + prefix_sharing)",
            loads_tokenizer=True,
        ),
        TrainerSpec(
            name="sft",
            title="SFT",
            trl_trainer="trl.trainer.sft_trainer:SFTTrainer",
            module=".sft_trainer",
            config_module=".config",
            guards=("sft",),
            data="sft",
            columns=Columns(
                (
                    frozenset({"text"}),
                    frozenset({"messages"}),
                    frozenset({"conversations"}),
                    frozenset({"prompt", "completion"}),
                    frozenset({"input_ids"}),
                ),
                "an SFT dataset needs 'text', 'messages' (or ShareGPT's 'conversations'), or 'prompt' and "
                "'completion', text or conversational, or pre-tokenized 'input_ids'; 'text' is the config's "
                "`dataset_text_field`.",
            ),
            summary="SFT (TRL's `trl sft` arguments + prefix_sharing)",
        ),
    )
}


def trainers_with(*data: str) -> tuple[str, ...]:
    """The names of the trainers whose `data` is one of these, in the table's order."""
    return tuple(name for name, spec in TRAINERS.items() if spec.data in data)


def spec_of_class(cls: type) -> TrainerSpec | None:
    """The entry of the TRL trainer class `cls` derives from (None: it derives from none of the table's)."""
    by_class = {spec.trl_trainer: spec for spec in TRAINERS.values()}
    for base in cls.__mro__:
        spec = by_class.get(f"{base.__module__}:{base.__qualname__}")
        if spec is not None:
            return spec
    return None


def guard_trainer_class(cls: type) -> None:
    """At the creation of a class that puts the prefix-sharing mixin before a TRL trainer class: TRL's internals its
    entry lists checked against the installed TRL (`trl_internals.check_trl_internals`, once per entry). A mixin
    without a trainer class below it is left alone; a TRL trainer class the table does not list is an error."""
    from transformers import Trainer

    if not issubclass(cls, Trainer):
        return
    spec = spec_of_class(cls)
    if spec is None:
        below = next(base for base in cls.__mro__ if base.__module__.partition(".")[0] in ("trl", "transformers"))
        raise TypeError(
            f"{cls.__qualname__} puts prefix sharing before {below.__qualname__}, which "
            "`trl_prefix_sharing.trainers.TRAINERS` does not list: prefix sharing serves the TRL trainers listed "
            f"there ({', '.join(spec.trl_trainer.rpartition(':')[2] for spec in TRAINERS.values())})."
        )
    from .trl_internals import check_trl_internals

    check_trl_internals(*spec.guards)
