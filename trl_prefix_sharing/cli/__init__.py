"""The `trl-prefix-sharing` command line: TRL's `trl dpo|reward|grpo|rloo|kto` workflow (and online DPO, ORPO and
CPO) with this package's trainers.

    trl-prefix-sharing dpo --model_name_or_path ... --dataset_name ... --prefix_sharing true --packing true
    trl-prefix-sharing reward --config recipe.yaml
    trl-prefix-sharing grpo --model_name_or_path ... --dataset_name ... --reward_funcs ... --prefix_sharing true
    trl-prefix-sharing stats --dataset_name ... --model_name_or_path ...
    python -m trl_prefix_sharing dpo ...

`dpo`, `reward`, `grpo`, `rloo`, `online_dpo`, `kto`, `orpo` and `cpo` take TRL's arguments (the same `TrlParser`
over the script arguments, the config, `ModelConfig` and `DatasetMixtureConfig`, YAML `--config` files,
PEFT/quantization flags) plus this package's fields, and are launched through `accelerate launch` exactly as TRL
launches its scripts (`--accelerate_config zero3`, `--num_processes`, ...).
"""

from __future__ import annotations

import sys


__all__ = ["main"]

USAGE = """usage: trl-prefix-sharing {dpo,reward,grpo,rloo,online_dpo,kto,orpo,cpo,stats} [args]

  dpo      DPO training (TRL's `trl dpo` arguments + prefix_sharing, packing, ...), launched with accelerate
  reward   reward-model training (TRL's `trl reward` arguments + the same), launched with accelerate
  grpo     GRPO training (TRL's `trl grpo` arguments, reward functions included, + prefix_sharing)
  rloo     RLOO training (TRL's `trl rloo` arguments + prefix_sharing)
  online_dpo  online DPO (TRL's experimental OnlineDPOConfig, rewards named as for grpo, + prefix_sharing)
  kto      KTO training (TRL's `trl kto` arguments + prefix_sharing)
  orpo     ORPO (TRL's experimental ORPOConfig + prefix_sharing)
  cpo      CPO, SimPO, AlphaPO (TRL's experimental CPOConfig + prefix_sharing)
  stats    does prefix sharing pay on this dataset? DPO, reward, GRPO, RLOO (loads the tokenizer only)

Run `trl-prefix-sharing COMMAND --help` for a command's arguments."""


#: the commands that train, each launched through `accelerate launch` (`cli/<command>.py`)
TRAINING_COMMANDS = ("dpo", "reward", "grpo", "rloo", "online_dpo", "kto", "orpo", "cpo")


def launch(command: str, argv: list[str]) -> int:
    """Parse like TRL's `TrainingCommand`: split accelerate's arguments from the script's, then `accelerate launch`.

    This process only parses and launches: it neither quantizes nor runs DeepSpeed, so their start-up lines are
    dropped here, and TRL's notice about its experimental modules (ORPO, CPO, online DPO) is left to the launched
    script, which prints it (and any deprecation notice of the arguments) once. When the script fails it has printed
    its error; its exit status is returned without the launcher's own traceback on top."""
    import subprocess
    import warnings
    from importlib import resources

    from .quiet import quiet_unused_backends

    quiet_unused_backends()
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument
    from trl.cli.commands.training import _subtract_subsequence
    from trl.import_utils import TRLExperimentalWarning

    from ..trl_internals import check_trl_internals
    from .train import SETUP_ERRORS, make_parser

    check_trl_internals("cli")  # TRL's argument splitting

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TRLExperimentalWarning)
        warnings.simplefilter("ignore", FutureWarning)  # the script parses the same arguments and warns once
        try:
            parser = make_parser(command, prog=f"trl-prefix-sharing {command}")
            *_, config_remaining, cli_remaining = parser.parse_args_and_config(
                argv, return_remaining_strings=True, separate_remaining_strings=True
            )
            launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
        except SETUP_ERRORS as error:  # an unreadable YAML recipe, a bad value: the message, not a traceback
            print(f"trl-prefix-sharing {command}: error: {error}", file=sys.stderr)
            return 2
    script_args = _subtract_subsequence(argv, cli_remaining)
    script = resources.files("trl_prefix_sharing.cli").joinpath(f"{command}.py")
    try:
        launch_command(launch_command_parser().parse_args(launch_args + [str(script)] + script_args))
    except subprocess.CalledProcessError as failed:  # the script printed why
        return failed.returncode
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in TRAINING_COMMANDS:
        return launch(command, rest)
    if command == "stats":
        from .quiet import quiet_unused_backends

        quiet_unused_backends()  # it neither quantizes nor runs DeepSpeed: no start-up lines from those
        from .stats import main as stats_main

        return stats_main(rest)  # a user mistake: one line `trl-prefix-sharing stats: error: ...`, status 2
    print(f"trl-prefix-sharing: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
