"""The training scripts behind `trl-prefix-sharing dpo|reward|grpo|rloo|online_dpo|kto|orpo|cpo`: TRL's scripts with
this package's trainers and configs, plus offline-friendly dataset loading (a local JSON/JSONL/Parquet file or
directory) and early errors."""

from __future__ import annotations

import os
from pathlib import Path


_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def make_parser(command: str, prog: str | None = None):
    """TRL's parser structure (`trl.scripts.dpo.make_parser`) with this package's config for `command`."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.rloo import RLOOScriptArguments

    import trl_prefix_sharing

    script_args = {
        "grpo": GRPOScriptArguments,
        "rloo": RLOOScriptArguments,
        # TRL ships no online DPO script: GRPO's script arguments name the reward the same way
        "online_dpo": GRPOScriptArguments,
    }.get(command, ScriptArguments)
    config = getattr(trl_prefix_sharing, _NAMES[command] + "Config")  # only this command's trainer module is imported
    return TrlParser((script_args, config, ModelConfig, DatasetMixtureConfig), prog=prog)


#: command -> the name of its trainer and config in this package (`<name>Trainer`, `<name>Config`)
_NAMES = {
    "dpo": "DPO",
    "reward": "Reward",
    "grpo": "GRPO",
    "rloo": "RLOO",
    "online_dpo": "OnlineDPO",
    "kto": "KTO",
    "orpo": "ORPO",
    "cpo": "CPO",
}
#: trainers that take no `quantization_config` and load no tokenizer from a model name: both are given here
_LOADED_HERE = ("online_dpo", "orpo", "cpo")


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


def load_script_dataset(script_args, dataset_args):
    """Like TRL's scripts, plus local files and directories, with a clear error for a path that does not exist."""
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        return get_dataset(dataset_args)
    name = script_args.dataset_name
    if not name:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")
    path = Path(os.path.expanduser(name))
    if path.is_file():
        builder = _LOCAL_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"Dataset file {name}: unsupported extension (use {', '.join(_LOCAL_BUILDERS)}).")
        return load_dataset(builder, data_files={script_args.dataset_train_split: str(path)})
    if path.is_dir():
        return load_dataset(str(path), name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    if name.startswith((".", "/", "~")) or path.suffix.lower() in _LOCAL_BUILDERS:
        raise FileNotFoundError(f"Dataset {name!r} not found: no such file or directory.")
    return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


def check_model_path(model_name_or_path: str | None) -> None:
    if not model_name_or_path:
        raise ValueError("`--model_name_or_path` is required.")
    if model_name_or_path.startswith((".", "/", "~")) and not Path(os.path.expanduser(model_name_or_path)).exists():
        raise FileNotFoundError(f"Model {model_name_or_path!r} not found: no such directory.")


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

    dataset = load_script_dataset(script_args, dataset_args)
    if script_args.dataset_train_split not in dataset:
        raise ValueError(f"Split {script_args.dataset_train_split!r} not in the dataset (splits: {list(dataset)}).")
    eval_dataset = None
    if training_args.eval_strategy != "no":
        if script_args.dataset_test_split not in dataset:
            raise ValueError(
                f"Split {script_args.dataset_test_split!r} not in the dataset (splits: {list(dataset)}); "
                "set `--dataset_test_split` or `--eval_strategy no`."
            )
        eval_dataset = dataset[script_args.dataset_test_split]

    trainer_cls = getattr(trl_prefix_sharing, _NAMES[command] + "Trainer")
    rewards = {"reward_funcs": load_reward_funcs(script_args)} if command in ("grpo", "rloo", "online_dpo") else {}
    loading = {"quantization_config": get_quantization_config(model_args)}  # how the trainer loads the model
    if command in _LOADED_HERE:  # no `quantization_config` argument (the model is loaded with these kwargs)
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
        train_dataset=dataset[script_args.dataset_train_split],
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
        script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
            fail_with_unknown_args=False
        )
        trainer = build_trainer(command, script_args, training_args, model_args, dataset_args)
    except SETUP_ERRORS as error:
        if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            raise
        print(f"trl-prefix-sharing {command}: error: {error}", file=sys.stderr)
        sys.exit(2)
    train(trainer, script_args, training_args)
