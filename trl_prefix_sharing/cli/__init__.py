"""The `trl-prefix-sharing` command line: TRL's `trl dpo|reward|grpo|rloo|kto|sft` workflow (and online DPO, ORPO and
CPO) with this package's trainers.

    trl-prefix-sharing dpo --model_name_or_path ... --dataset_name ... --prefix_sharing true --packing true
    trl-prefix-sharing reward --config recipe.yaml
    trl-prefix-sharing grpo --model_name_or_path ... --dataset_name ... --reward_funcs ... --prefix_sharing true
    trl-prefix-sharing stats --dataset_name ... --model_name_or_path ...
    python -m trl_prefix_sharing dpo ...

`dpo`, `reward`, `grpo`, `rloo`, `online_dpo`, `kto`, `orpo`, `cpo` and `sft` take TRL's arguments (the same
`TrlParser` over the script arguments, the config, `ModelConfig` and `DatasetMixtureConfig`, YAML `--config` files,
PEFT/quantization flags) plus this package's fields, and are launched through `accelerate launch` exactly as TRL
launches its scripts (`--accelerate_config zero3`, `--num_processes`, ...).
"""

from __future__ import annotations

import sys

from ..trainers import TRAINERS


__all__ = ["main"]


def _usage() -> str:
    lines = [f"usage: trl-prefix-sharing {{{','.join([*TRAINERS, 'stats'])}}} [args]", ""]
    for name, spec in TRAINERS.items():
        lines.append(f"  {name + ' ' * max(1, 8 - len(name))} {spec.summary}")
    lines += [
        "  stats    does prefix sharing pay on this dataset? for each trainer above (loads the tokenizer and the "
        "model's config, no weights)",
        "",
        "Run `trl-prefix-sharing COMMAND --help` for a command's arguments.",
    ]
    return "\n".join(lines)


USAGE = _usage()

#: the commands that train, each launched through `accelerate launch` (`cli/<command>.py`)
TRAINING_COMMANDS = tuple(TRAINERS)


def launch(command: str, argv: list[str]) -> int:
    """Parse like TRL's `TrainingCommand`: split accelerate's arguments from the script's, then `accelerate launch`.

    This process only parses and launches: it neither quantizes nor runs DeepSpeed, so their start-up lines are
    dropped here, and TRL's notice about its experimental modules (ORPO, CPO, online DPO) is left to the launched
    script, which prints it (and any deprecation notice of the arguments) once. A bad input found here (an argument
    neither TRL's nor accelerate's, an invalid value, an unreadable `--config` recipe, a missing model or dataset
    path, a local dataset that is empty, unreadable or without the trainer's columns: see `train.check_inputs`) is
    one line and status 2, and no process is started. When the script fails it has printed its error; its exit
    status is returned without the launcher's own traceback on top, with one process or several."""
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
    from .train import SETUP_ERRORS, check_config_file, check_inputs, make_parser

    check_trl_internals("cli")  # TRL's argument splitting

    prog = f"trl-prefix-sharing {command}"
    launch_parser = launch_command_parser()
    launch_parser.error = lambda message: launch_parser.exit(  # one line, not accelerate's usage block
        2, f"{prog}: error: {message}; see accelerate launch --help\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TRLExperimentalWarning)
        warnings.simplefilter("ignore", FutureWarning)  # the script parses the same arguments and warns once
        try:
            check_config_file(argv)
            parser = make_parser(command, prog=prog)
            *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
                argv, return_remaining_strings=True, separate_remaining_strings=True
            )
            check_launch_arguments(parser, launch_parser, argv, config_remaining, cli_remaining)
            launch_args = resolve_accelerate_config_argument(config_remaining + cli_remaining)
            check_inputs(command, *parsed)
        except SETUP_ERRORS as error:  # an unreadable YAML recipe, a bad value: the message, not a traceback
            print(f"{prog}: error: {error}", file=sys.stderr)
            return 2
    script_args = _subtract_subsequence(argv, cli_remaining)
    script = resources.files("trl_prefix_sharing.cli").joinpath(f"{command}.py")
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError:  # a torch without `torch.distributed`: one process only
        ChildFailedError = subprocess.CalledProcessError
    try:
        launch_command(launch_parser.parse_args(launch_args + [str(script)] + script_args))
    except subprocess.CalledProcessError as failed:  # the script printed why
        return failed.returncode
    except ChildFailedError as failed:  # one of several processes (`--multi_gpu`, FSDP, ...) failed; it printed why
        return failed.get_first_failure()[1].exitcode
    return 0


def check_launch_arguments(parser, launch_parser, argv, config_remaining, cli_remaining) -> None:
    """An error naming the arguments (and `--config` recipe keys) that neither TRL's parser nor accelerate's launch
    parser knows, each with the nearest known option: TRL hands its unknown arguments to accelerate, whose error
    would come after its whole usage."""
    from .train import long_options, unknown_arguments, unrecognized

    known = {option: action.nargs for option, action in launch_parser._option_string_actions.items()}
    known["--accelerate_config"] = None  # TRL's, for accelerate (`resolve_accelerate_config_argument`)
    candidates = long_options(parser) + long_options(launch_parser) + ["--accelerate_config", "--config"]
    problems = []
    unknown = unknown_arguments(cli_remaining, known)
    if unknown:
        problems.append(unrecognized(unknown, candidates))
    keys = [key[2:] for key in config_remaining[::2] if key not in known]  # TRL gives them as `--key value`
    if keys:
        recipe = f" in {argv[argv.index('--config') + 1]}"
        problems.append(unrecognized(keys, [option[2:] for option in candidates], noun="key", where=recipe))
    if problems:
        raise ValueError(f"{'; '.join(problems)}; see {parser.prog} --help")


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
    import difflib

    match = difflib.get_close_matches(command, [*TRAINING_COMMANDS, "stats"], n=1)
    hint = f" (did you mean {match[0]}?)" if match else ""
    print(
        f"trl-prefix-sharing: error: unknown command {command!r}{hint}; see trl-prefix-sharing --help", file=sys.stderr
    )
    return 2
