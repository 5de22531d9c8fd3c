"""The training scripts behind `trl-prefix-sharing dpo|reward|grpo|rloo|online_dpo|kto|orpo|cpo|sft`: TRL's scripts
with this package's trainers and configs, plus offline-friendly dataset loading (a local JSON/JSONL/Parquet file or
directory) and early errors: a bad input (an argument, a path, a dataset) is one line naming it and the way out."""

from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path

from ..trainers import TRAINERS


_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
#: builder -> (the format's name, what a file of it holds), for the errors about a local dataset file
_FORMATS = {
    "json": ("JSON", "one JSON object per line with the columns as keys, or a JSON list of such objects"),
    "csv": ("CSV", "a header line naming the columns, then one line per example"),
    "parquet": ("Parquet", "a table with one row per example"),
}
#: a text data file at most this long is read whole to see whether it holds only whitespace
_BLANK_CHECK_BYTES = 1 << 16
#: logger -> the start of the line a `datasets` reader logs before it raises on a file it cannot parse: the error
#: is reported once, naming the file (see `_load_local`)
_READER_ERROR_LINES = {
    "datasets.packaged_modules.json.json": "Failed to load JSON from file",
    "datasets.packaged_modules.csv.csv": "Failed to read file",
    "datasets.packaged_modules.parquet.parquet": "Failed to read",
}
#: a negative number is a value, not an option
_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@functools.cache
def _parser_class():
    """`TrlParser` with argparse's errors on one line (TRL is imported on first use, after `cli/quiet.py`)."""
    from trl import TrlParser

    class CommandParser(TrlParser):
        """TRL's parser; a bad argument (an invalid choice or value, a missing value) ends the process with one line
        and status 2 instead of argparse's usage block and the error (`--help` prints the usage)."""

        def error(self, message: str):
            self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    return CommandParser


def make_parser(command: str, prog: str | None = None):
    """TRL's parser structure (`trl.scripts.dpo.make_parser`) with this package's config for `command`; its errors
    are one line naming `prog` (default `trl-prefix-sharing <command>`)."""
    from trl import DatasetMixtureConfig, ModelConfig

    import trl_prefix_sharing

    from ..trl_internals import resolve

    spec = TRAINERS[command]
    script_args = resolve(spec.script_arguments)
    config = getattr(trl_prefix_sharing, spec.config_class)  # only this command's trainer module is imported
    return _parser_class()(
        (script_args, config, ModelConfig, DatasetMixtureConfig), prog=prog or f"trl-prefix-sharing {command}"
    )


def long_options(parser) -> list[str]:
    """The first long option string of each of `parser`'s arguments (`--prefix_sharing`, not its alias
    `--prefix-sharing`): the names a misspelt option is matched against."""
    return [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.option_strings[0].startswith("--")
    ]


def unknown_arguments(tokens: list[str], known: dict) -> list[str]:
    """The options of `tokens` that are not in `known` ({option string: its argparse `nargs`}), and stray values (a
    value after a known option that takes one, or after an unknown option, is not stray)."""
    unknown, pending = [], 0  # values still taken by the last option (-1: any number, after an unknown option)
    for token in tokens:
        if token.startswith("-") and not _NUMBER.fullmatch(token):
            option = token.split("=", 1)[0]
            if option in known:
                pending = 0 if "=" in token or known[option] == 0 else 1
            else:
                unknown.append(option)
                pending = -1
        elif pending:
            pending -= pending > 0
        else:
            unknown.append(token)
    return unknown


def unrecognized(names: list[str], candidates: list[str], noun: str = "argument", where: str = "") -> str:
    """`unrecognized argument --prefix_shraing (did you mean --prefix_sharing?)` for `names`, each with the nearest
    of `candidates` if one is near; `where` follows the names (` in recipe.yaml`)."""
    described = []
    for name in names:
        match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
        described.append(f"{name} (did you mean {match[0]}?)" if match else name)
    return f"unrecognized {noun}{'s' if len(names) > 1 else ''} {', '.join(described)}{where}"


def check_config_file(argv: list[str]) -> None:
    """A clear error for the YAML recipe of `--config` that TRL cannot read: a missing value or file, invalid YAML
    (TRL would raise an `IndexError` or a YAML traceback), or YAML that is not a mapping."""
    if "--config" not in argv:
        return
    index = argv.index("--config") + 1
    if index == len(argv) or argv[index].startswith("--"):
        raise ValueError("`--config` needs the path of a YAML recipe.")
    import yaml

    name = argv[index]
    try:
        with open(os.path.expanduser(name)) as file:
            config = yaml.safe_load(file)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"Config file {name!r} not found: no such file; check the path given to --config."
        ) from None
    except yaml.YAMLError as error:
        problem = " ".join(str(error).split())
        raise ValueError(f"Config file {name!r} is not valid YAML ({problem}); correct it there.") from None
    if not isinstance(config, dict):
        found = "is empty" if config is None else f"holds a {type(config).__name__}"
        raise ValueError(
            f"Config file {name!r} {found}; it needs a YAML mapping of argument names to values "
            "(`learning_rate: 5.0e-7`)."
        )


def load_reward_funcs(script_args) -> list:
    """TRL's `trl grpo`/`trl rloo` rule (online DPO too): a reward model path, then named reward functions or dotted
    import paths."""
    import importlib
    import sys

    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }
    reward_funcs = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    for name in script_args.reward_funcs or []:
        if name in registry:
            reward_funcs.append(registry[name])
        elif "." in name:
            module_path, function = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            reward_funcs.append(getattr(importlib.import_module(module_path), function))
        else:
            raise ValueError(
                f"Could not load reward function {name!r}. Expected one of {list(registry)} or a "
                "dotted import path (e.g. 'my_lib.rewards.custom_reward')."
            )
    if not reward_funcs:
        raise ValueError(
            "GRPO, RLOO and online DPO need a reward: `--reward_funcs` and/or `--reward_model_name_or_path`."
        )
    return reward_funcs


def _check_data_file(path: Path, name: str) -> None:
    """An error for a local data file with an unsupported extension, or with no content (0 bytes, or only whitespace
    in a text format): `datasets` would fail on it with a bare `StopIteration` or an error naming no file."""
    builder = _LOCAL_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"Dataset file {name}: unsupported extension (use {', '.join(_LOCAL_BUILDERS)}).")
    size = path.stat().st_size
    blank = size == 0 or (builder != "parquet" and size <= _BLANK_CHECK_BYTES and not path.read_bytes().strip())
    if blank:
        raise ValueError(f"Dataset file {name} is empty; it needs at least one example: {_FORMATS[builder][1]}.")


def local_dataset(name: str) -> Path | None:
    """The local file or directory `--dataset_name` names (None for a Hub id), checked: a missing path, an
    unsupported extension and an empty data file (in a directory too) are errors naming it."""
    path = Path(os.path.expanduser(name))
    if path.is_file():
        _check_data_file(path, name)
        return path
    if path.is_dir():
        for folder, subfolders, files in os.walk(path):
            subfolders[:] = sorted(sub for sub in subfolders if not sub.startswith("."))
            for file in sorted(files):
                if Path(file).suffix.lower() in _LOCAL_BUILDERS:
                    _check_data_file(Path(folder, file), str(Path(name) / Path(folder, file).relative_to(path)))
        return path
    if name.startswith((".", "/", "~")) or path.suffix.lower() in _LOCAL_BUILDERS:
        raise FileNotFoundError(
            f"Dataset {name!r} not found: no such file or directory; pass a local JSON, JSONL, Parquet or CSV file "
            "or a dataset directory, or a Hub dataset name."
        )
    return None


def _load_local(name: str, builder: str | None, load):
    """`load()` a local dataset, its reading errors turned into one line naming `name` (and the format of a file of
    `builder`); the line `datasets` logs before raising is left out, its content being in the error."""
    from datasets.exceptions import DatasetGenerationError

    from .quiet import lines_dropped

    what = f"Dataset file {name}" if builder else f"Dataset directory {name}"
    read_as = f" as {_FORMATS[builder][0]}" if builder else ""
    holds = f"; it needs {_FORMATS[builder][1]}" if builder else ""
    try:
        with lines_dropped(_READER_ERROR_LINES):
            return load()
    except DatasetGenerationError as error:  # a row the reader cannot parse: the reader's error is the cause
        raise ValueError(f"{what} cannot be read{read_as} ({error.__cause__ or error}){holds}.") from error
    except ValueError as error:
        if "corresponds to no data" in str(error):  # `datasets`' words for a split with no rows
            raise ValueError(f"{what} holds no examples{holds}.") from error
        raise ValueError(f"{what} cannot be read{read_as} ({error}){holds}.") from error


def load_script_dataset(script_args, dataset_args):
    """Like TRL's scripts, plus local files and directories, with a clear error for a path that does not exist, an
    empty or unreadable file."""
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        return get_dataset(dataset_args)
    name = script_args.dataset_name
    if not name:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")
    path = local_dataset(name)
    if path is None:
        return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    if path.is_file():
        builder = _LOCAL_BUILDERS[path.suffix.lower()]
        return _load_local(
            name, builder, lambda: load_dataset(builder, data_files={script_args.dataset_train_split: str(path)})
        )
    return _load_local(
        name,
        None,
        lambda: load_dataset(str(path), name=script_args.dataset_config, streaming=script_args.dataset_streaming),
    )


def check_split(command: str, dataset, name: str, split: str) -> None:
    """An error for a split with no rows or without the columns `command` reads, before TRL's preprocessing (where
    they end in a bare `StopIteration` or `KeyError`, or, for RLOO, a run of no steps), prefix sharing or not."""
    from datasets import Dataset, IterableDataset

    where = f"{name} (split {split!r})"
    if isinstance(dataset, Dataset):
        if len(dataset) == 0:
            raise ValueError(f"{where} has no rows; give it at least one example.")
        columns = set(dataset.column_names)
    elif isinstance(dataset, IterableDataset):
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"{where} yields no rows; give it at least one example.")
        columns = set(first)
    else:
        return
    needed = TRAINERS[command].columns
    if not needed.accept(columns):
        raise ValueError(f"{where} has columns {sorted(columns)}; {needed.needs}")


def load_splits(command: str, script_args, training_args, dataset_args):
    """The train split and the eval split (None unless `eval_strategy` evaluates) of the dataset, checked
    (`check_split`)."""
    dataset = load_script_dataset(script_args, dataset_args)
    name = "The dataset mixture" if dataset_args.datasets else f"Dataset {script_args.dataset_name}"
    if script_args.dataset_train_split not in dataset:
        raise ValueError(f"Split {script_args.dataset_train_split!r} not in the dataset (splits: {list(dataset)}).")
    train_dataset = dataset[script_args.dataset_train_split]
    check_split(command, train_dataset, name, script_args.dataset_train_split)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        if script_args.dataset_test_split not in dataset:
            raise ValueError(
                f"Split {script_args.dataset_test_split!r} not in the dataset (splits: {list(dataset)}); "
                "set `--dataset_test_split` or `--eval_strategy no`."
            )
        eval_dataset = dataset[script_args.dataset_test_split]
        check_split(command, eval_dataset, name, script_args.dataset_test_split)
    return train_dataset, eval_dataset


def check_inputs(command: str, script_args, training_args, model_args, dataset_args) -> None:
    """What the launcher checks before it starts a process: the model path, and the dataset when it is local (a file
    or a directory, not streamed), loaded and checked as the script loads it (`datasets` caches it: the script's
    load is a cache hit). A Hub dataset, a mixture or a stream is left to the script."""
    check_model_path(model_args.model_name_or_path)
    name = script_args.dataset_name
    if dataset_args.datasets or script_args.dataset_streaming or (name and local_dataset(name) is None):
        return
    load_splits(command, script_args, training_args, dataset_args)


def check_model_path(model_name_or_path: str | None) -> None:
    """A model is required; a local path that does not exist is an error (the trainers' rule,
    `support.check_local_model_path`)."""
    if not model_name_or_path:
        raise ValueError("`--model_name_or_path` is required.")
    from ..support import check_local_model_path  # imports torch: on first use, not with `--help`

    check_local_model_path(model_name_or_path)


#: errors raised while setting up (arguments, paths, dataset, model, trainer): printed as one line, not a traceback
SETUP_ERRORS = (ValueError, TypeError, OSError, ImportError, NotImplementedError)
#: set to see the traceback of a set-up error
TRACEBACK_VARIABLE = "TRL_PREFIX_SHARING_TRACEBACK"


def build_trainer(command: str, script_args, training_args, model_args, dataset_args):
    """Load the dataset and build the trainer (the model is loaded by the trainer), as TRL's scripts do."""
    from trl import get_peft_config, get_quantization_config

    import trl_prefix_sharing

    check_model_path(model_args.model_name_or_path)
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs
    train_dataset, eval_dataset = load_splits(command, script_args, training_args, dataset_args)

    spec = TRAINERS[command]
    trainer_cls = getattr(trl_prefix_sharing, spec.trainer_class)
    rewards = {"reward_funcs": load_reward_funcs(script_args)} if spec.generates else {}
    loading = {"quantization_config": get_quantization_config(model_args)}  # how the trainer loads the model
    if spec.loads_tokenizer:  # no `quantization_config` argument (the model is loaded with these kwargs)
        from transformers import AutoTokenizer  # and a tokenizer given explicitly

        quantization_config = loading.pop("quantization_config")
        if quantization_config is not None:
            training_args.model_init_kwargs["quantization_config"] = quantization_config
        loading["processing_class"] = AutoTokenizer.from_pretrained(
            model_args.model_name_or_path,
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
        )
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        **rewards,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        **loading,
        peft_config=get_peft_config(model_args),
    )
    if command == "dpo" and script_args.ignore_bias_buffers:
        import torch

        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]
    return trainer


def train(trainer, script_args, training_args) -> None:
    """Train, save and release, as TRL's scripts do (`trainer.end()` last: see `PrefixSharingMixin.end`)."""
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()


def run_script(command: str) -> None:
    """Entry point of the launched scripts (`cli/<command>.py`). A set-up error (a bad argument, path, dataset, model
    or option) ends the process with one line naming it and status 2, no traceback (`TRL_PREFIX_SHARING_TRACEBACK=1`
    shows it); errors while training keep theirs."""
    import sys

    try:
        parser = make_parser(command)
        check_config_file(sys.argv[1:])
        # the recipe's keys that are not TRL's are accelerate's (`num_processes: 2`): the launcher took them
        *parsed, _, cli_remaining = parser.parse_args_and_config(
            return_remaining_strings=True, separate_remaining_strings=True
        )
        if cli_remaining:  # run on its own (`python -m trl_prefix_sharing.cli.dpo`): the launcher passes none
            unknown = unrecognized(unknown_arguments(cli_remaining, {}), long_options(parser))
            raise ValueError(f"{unknown}; see {parser.prog} --help")
        script_args, training_args, model_args, dataset_args = parsed
        trainer = build_trainer(command, script_args, training_args, model_args, dataset_args)
    except SETUP_ERRORS as error:
        if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            raise
        print(f"trl-prefix-sharing {command}: error: {error}", file=sys.stderr)
        sys.exit(2)
    train(trainer, script_args, training_args)
