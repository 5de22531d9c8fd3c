"""What `stats` loads, as the training commands load it: the tokenizer, the model's config (no weights) with
training's architecture check, and the dataset's split, checked for the columns `--trainer` needs. When a Hub id is
given and the Hub cannot be reached, offline mode is set at once (`go_offline_if_unreachable`)."""

from __future__ import annotations

import os
from pathlib import Path

from ...trainers import TRAINERS as TRAINER_SPECS
from .defaults import GROUP_TRAINERS, TRAINER_CLASSES
from .errors import PROG, StatsError, _cause, _one_line


#: the hub's host, when `HF_ENDPOINT` does not name another
HUB_ENDPOINT = "https://huggingface.co"


def _is_local(name: str) -> bool:
    """Whether `name` names a local path (one that exists, or is written as a path) rather than a Hub id."""
    from ..train import _LOCAL_BUILDERS

    path = Path(name).expanduser()
    return path.exists() or name.startswith((".", "/", "~")) or path.suffix.lower() in _LOCAL_BUILDERS


def _offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in {"1", "ON", "YES", "TRUE"}


def _hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (a connection to its host, `timeout` seconds at most), or
    None. Behind a proxy it cannot tell: None."""
    import socket
    import threading
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    outcome = []

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as error:
            outcome.append(f"{host}: {error.strerror or _one_line(error) or type(error).__name__}")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout + 1)
    return outcome[0] if outcome else f"{host}: no answer in {timeout:.0f} seconds"


def go_offline_if_unreachable(*names: str) -> str | None:
    """When a name is a Hub id and the Hub cannot be reached, set offline mode (before transformers and datasets are
    imported) so that a cached copy loads at once and a missing one fails at once, instead of minutes of retries.
    Returns why it is offline (None: online, or only local paths)."""
    if _offline():
        return "offline mode is set (HF_HUB_OFFLINE)"
    if all(_is_local(name) for name in names):
        return None
    reason = _hub_unreachable()
    if reason is not None:
        os.environ["HF_HUB_OFFLINE"] = "1"
        reason = f"the Hub cannot be reached ({reason})"
    return reason


def load_tokenizer(name: str, offline: str | None, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    way_out = "pass --model_name_or_path a model directory (as written by save_pretrained) or a Hub model id"
    if _is_local(name) and not path.exists():
        raise StatsError(f"cannot load a tokenizer from {name!r}: no such directory; {way_out}")
    if path.is_file():
        raise StatsError(f"cannot load a tokenizer from {name!r}: it is a file, not a directory; {way_out}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as error:  # any failure to load what the user named is about that name
        if path.is_dir():
            raise StatsError(
                f"cannot load a tokenizer from the directory {name!r} ({_cause(error)}); pass the directory a "
                "model and its tokenizer were saved to (tokenizer.json or tokenizer_config.json)"
            ) from None
        if offline:
            raise StatsError(
                f"cannot load a tokenizer for {name!r}: no such local directory, and the Hub model is not in the "
                f"local Hugging Face cache while {offline}; check the path, or download the model once with a "
                "connection"
            ) from None
        raise StatsError(
            f"cannot load a tokenizer for {name!r} from the Hugging Face Hub ({_cause(error)}); check the model id "
            "(a gated model needs `hf auth login`) or pass a local model directory"
        ) from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise StatsError(
                f"the tokenizer of {name!r} has neither a pad token nor an EOS token; TRL needs one to pad: set "
                "one and save the tokenizer again"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_split(args, offline: str | None):
    """The `--dataset_train_split` split of `--dataset_name`, loaded as the training commands load it."""
    import datasets

    from ..train import _LOCAL_BUILDERS, load_script_dataset

    name, split = args.dataset_name, args.dataset_train_split
    path = Path(name).expanduser()
    way_out = f"pass --dataset_name a local {'/'.join(_LOCAL_BUILDERS)} file, a directory of them, or a Hub dataset id"
    if args.dataset_config:
        way_out += f", and check --dataset_config {args.dataset_config!r}"
    if _is_local(name) and not path.exists():
        raise StatsError(f"cannot load the dataset {name!r}: no such file or directory; {way_out}")
    if path.is_file() and path.stat().st_size == 0:
        raise StatsError(f"the dataset file {name!r} is empty; {way_out}")

    class _Script:
        dataset_name, dataset_config = name, args.dataset_config
        dataset_train_split, dataset_streaming = split, False

    class _Mixture:
        datasets = None

    bars, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    if path.exists():
        datasets.disable_progress_bars()  # a local file loads at once: no bar
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a failure is reported below, once
    try:
        dataset = load_script_dataset(_Script, _Mixture)
    except Exception as error:  # any failure to load what the user named is about that name
        if path.exists():
            raise StatsError(f"cannot read the dataset {name!r} ({_cause(error)}); {way_out}") from None
        if offline and not isinstance(error, ValueError):
            raise StatsError(
                f"cannot load the dataset {name!r}: no such local file or directory, and the Hub dataset is not in "
                f"the local Hugging Face cache while {offline}; check the path, or download the dataset once with "
                "a connection"
            ) from None
        raise StatsError(
            f"cannot load the dataset {name!r} ({_cause(error)}); check the dataset id and --dataset_config, or "
            "pass a local file or directory"
        ) from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    if split not in dataset:
        raise StatsError(
            f"the dataset {name!r} has no split {split!r} (its splits: {', '.join(map(repr, dataset))}); pass "
            "--dataset_train_split with one of them"
        )
    dataset = dataset[split]
    if len(dataset) == 0:
        raise StatsError(f"the {split!r} split of the dataset {name!r} has no rows")
    return dataset


def load_model_config(name: str, trust_remote_code: bool = False):
    """The config of `--model_name_or_path` (no weights), loaded as the tokenizer was (a local directory, the Hub, or
    the local cache when offline); where there is none to load (a directory holding a tokenizer only, a Hub model
    whose config is not in the cache while offline), a `str` saying why."""
    from transformers import AutoConfig

    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        return f"{name!r} holds no config.json (a tokenizer only)"
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except OSError as error:  # no config file where the tokenizer was found (or not in the cache, offline)
        return f"no config of {name!r} could be read ({_cause(error)})"
    except Exception as error:  # a config transformers cannot take: training could not load the model either
        way_out = (
            "pass --trust_remote_code true if you trust the model's code"
            if "trust_remote_code" in str(error)
            else "check that the config.json is a transformers model config"
        )
        raise StatsError(f"cannot read the model config of {name!r} ({_cause(error)}); {way_out}") from None


def check_model(name: str, trainer: str, trust_remote_code: bool = False):
    """Training's architecture check of the model (`trl_prefix_sharing.support.check_architecture`): a model that
    training refuses is an error with training's reason. Returns the report's line on the model, and its config (a
    `str` saying why there is none: see `load_model_config`), whose cost model chooses what training lays out."""
    from ...support import check_architecture

    config = load_model_config(name, trust_remote_code)
    if isinstance(config, str):
        return (
            f"not checked: {config}; pass --model_name_or_path the model's directory or id to check it (training "
            "refuses some architectures: recurrent layers, encoders)"
        ), config
    try:
        reason = check_architecture(config, TRAINER_CLASSES[trainer], trainer == "dpo")
    except ValueError as error:
        raise StatsError(f"--model_name_or_path {name!r}: {_one_line(error)}") from None
    if reason is None:
        return f"'{config.model_type}', measured equal to stock TRL with prefix sharing", config
    return (
        f"'{config.model_type}': {reason}; training compares stock and shared rows on its first batch and stops if "
        "they differ"
    ), config


def _check_columns(dataset, args) -> None:
    from ...validation import check_prompt_column

    columns = set(dataset.column_names)
    try:  # a misspelt prompt column would be ignored and nothing shared
        check_prompt_column(dataset, repr(args.dataset_name))
    except ValueError as error:
        raise StatsError(_one_line(error)) from None
    if args.trainer in GROUP_TRAINERS:
        if "prompt" not in columns:
            hint = (
                "; for preference data pass --trainer dpo, reward, orpo or cpo"
                if {"chosen", "rejected"} <= columns or "completions" in columns
                else "; for unpaired data pass --trainer kto"
                if "completion" in columns
                else ""
            )
            raise StatsError(
                f"the dataset has columns {sorted(columns)}; --trainer {args.trainer} needs a 'prompt' column (text "
                f"or a list of messages), as TRL's {TRAINER_CLASSES[args.trainer]} does{hint}"
            )
        if {"image", "images"} & columns:
            raise StatsError(
                f"the dataset has an image column; {PROG} counts text tokens with the tokenizer only and cannot count "
                "the tokens of images"
            )
        return
    if args.trainer == "sft" and {"image", "images"} & columns:
        raise StatsError(
            f"the dataset has an image column; {PROG} counts text tokens with the tokenizer only and cannot count "
            "the tokens of images"
        )
    from ...validation import check_dataset_columns

    try:
        check_dataset_columns(dataset, args.dataset_train_split, TRAINER_SPECS[args.trainer].columns)
    except ValueError as error:
        hint = ""
        if "prompt" in columns and not {"chosen", "rejected", "completions", "completion"} & columns:
            hint = (
                "; for prompt-only data (completions generated during training) pass --trainer grpo, rloo or "
                "online_dpo"
            )
        elif {"prompt", "completion", "label"} <= columns:
            hint = "; for unpaired data (prompt, completion, label) pass --trainer kto"
        raise StatsError(f"{_one_line(error).rstrip('.')}{hint}") from None
