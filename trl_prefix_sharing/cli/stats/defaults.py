"""What `stats` reads from the table of trainers (`trainers.TRAINERS`): TRL's defaults, which its flags fall back to,
the trainers each kind of report serves, and the trainer class of each `--trainer`."""

from __future__ import annotations

from ...trainers import TRAINERS as TRAINER_SPECS
from ...trainers import trainers_with


#: TRL's defaults, from the table of trainers: `num_generations` of the trainers that generate, their longest
#: completion (`max_completion_length`; online DPO's `max_new_tokens`), each config's `max_length` (online DPO's:
#: prompt + completion, its prompt's start cut to fit)
NUM_GENERATIONS = {name: spec.num_generations for name, spec in TRAINER_SPECS.items() if spec.generates}
MAX_COMPLETION_LENGTH = TRAINER_SPECS["grpo"].max_completion_length
MAX_NEW_TOKENS = TRAINER_SPECS["online_dpo"].max_completion_length
MAX_LENGTHS = {name: spec.max_length for name, spec in TRAINER_SPECS.items() if spec.max_length}
#: TRL's defaults for the trainers with data completions (their configs and TrainingArguments)
TRUNCATION_MODE, BATCH_SIZE = "keep_start", 8
#: the length TRL's ORPO and CPO trainers take when `max_length` is None
ORPO_DEFAULT_LENGTH = 512
PREFERENCE_TRAINERS, PAIRED_TRAINERS = trainers_with("preference"), trainers_with("paired")
GROUP_TRAINERS = trainers_with("prompts")
#: the trainers whose data holds its completions, in the order of the help text
DATA_TRAINERS = trainers_with("preference", "unpaired", "paired")
CHOICES = (*DATA_TRAINERS, *trainers_with("sft"), *GROUP_TRAINERS)
#: `prefix_sharing_join`'s values (`trie.JOINS`, named here so that `--help` needs no torch) and SFTConfig's default
SFT_JOINS, SFT_JOIN = ("auto", "prompts", "always"), "auto"
#: the trainer class of each `--trainer`, as training names it in its errors
TRAINER_CLASSES = {name: spec.trainer_class for name, spec in TRAINER_SPECS.items()}
