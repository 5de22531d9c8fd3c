"""`trl-prefix-sharing stats`: does prefix sharing pay on this dataset? Loads the tokenizer only.

Preference data (`--trainer dpo` or `reward`): tokenizes the dataset exactly as TRL's trainer would (same
preprocessing, same truncation), runs the real collator and reports the lengths of the shared prefix (the prompt plus
whatever start the completions have in common: prefix sharing computes the longest common token prefix of an
example's rows once) and of the rest of each completion, token positions per example with and without sharing and
packing, and the predicted speedup: the ideal for the linear layers (stock / shared positions, `2(p+c)/(p+2c)` for a
pair) and for attention, and the expected one: the ideal times the share of ideal that `scripts/benchmark.py
--record` measured on the benchmark profile whose shared prefix/rest ratio is nearest to this dataset's
(`trl_prefix_sharing/data/measured_speedups.json`, one entry per device kind measured).

Prompt-only data (`--trainer grpo` or `rloo`): the completions are generated during training, so their length is an
assumption (`--completion_length`, by default `--max_completion_length`). Tokenizes the prompts as TRL does
(conversational ones through the chat template with `add_generation_prompt=True`) and reports, per group of one prompt
and its `--num_generations` completions, the positions stock TRL computes, G(P + C), against the shared layout's,
P - 1 + G(C + 1) (the prompt once; each completion headed by a copy of the prompt's last token). Padding is not
counted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path


PROG = "trl-prefix-sharing stats"
MEASURED_SPEEDUPS = "measured_speedups.json"
#: TRL 1.16's defaults: `num_generations` of GRPOConfig / RLOOConfig, and their `max_completion_length`
NUM_GENERATIONS = {"grpo": 8, "rloo": 2}
MAX_COMPLETION_LENGTH = 512
#: TRL's defaults for the preference trainers (DPOConfig, RewardConfig and TrainingArguments)
MAX_LENGTH, TRUNCATION_MODE, BATCH_SIZE = 1024, "keep_start", 8
PREFERENCE_TRAINERS, GROUP_TRAINERS = ("dpo", "reward"), ("grpo", "rloo")
#: the Hub's host, when `HF_ENDPOINT` does not name another
HUB_ENDPOINT = "https://huggingface.co"
#: set to see the traceback behind an error line
TRACEBACK_VARIABLE = "TRL_PREFIX_SHARING_TRACEBACK"


class StatsError(Exception):
    """A user mistake (a path, a dataset, a flag): one line on stderr, exit status 2, no traceback."""


def measured_speedups() -> dict:
    """What `scripts/benchmark.py --record` measured: {mode: {"device", "command", kind: {profile: {...}}}}."""
    path = resources.files("trl_prefix_sharing") / "data" / MEASURED_SPEEDUPS
    return json.loads(path.read_text()) if path.is_file() else {}


def expected_speedup_lines(kind: str, ratio: float, linear_ideal: float) -> list[str]:
    """The expected speedup on a dataset of shared prefix/rest ratio `ratio`, from the nearest measured profile."""
    lines, recorded = [], measured_speedups()
    for mode, record in sorted(recorded.items()):
        profiles = record.get(kind) or {}
        if not profiles:
            continue
        name, near = min(profiles.items(), key=lambda item: abs(math.log(item[1]["p_over_c"] / max(ratio, 1e-6))))
        share = near["share_of_ideal"]
        lines.append(
            f"    {mode.upper()} ({record['device']}; {record['model']}): ~{linear_ideal * share:.2f}x "
            f"(ideal x {share:.2f}, the "
            f"share of ideal measured on the {name} profile, p/c {near['p_over_c']:.2f}: sharing "
            f"{near['sharing']:.2f}x, sharing+packing {near['sharing+packing']:.2f}x over stock)"
        )
    if not lines:
        lines.append("    no benchmark recorded for this trainer (run scripts/benchmark.py --record)")
    if "gpu" not in recorded:
        lines.append("    GPU: no benchmark recorded yet (scripts/benchmark.py --mode gpu --record on a CUDA machine)")
    return lines


def _percentiles(values, points=(10, 50, 90, 99)):
    ordered = sorted(values)
    if not ordered:
        return "-"
    return ", ".join(f"p{p} {ordered[min(len(ordered) - 1, len(ordered) * p // 100)]}" for p in points)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _cause(error: BaseException) -> str:
    """The innermost explicit cause of `error`, on one line (its type when it has no message)."""
    while error.__cause__ is not None:
        error = error.__cause__
    message = _one_line(error)
    return message.rstrip(".") if message else type(error).__name__


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _verdict(linear: float) -> str:
    return "pays" if linear >= 1.15 else "pays little" if linear >= 1.05 else "does not pay"


# --------------------------------------------------------------------------------------------------- arguments


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise StatsError(f"{message} (see `{PROG} --help`)")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value not in {"true", "false", "yes", "no", "1", "0"}:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in {"true", "yes", "1"}


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset_name", required=True, help="Hub id, or a local JSON/JSONL/Parquet/CSV file or directory"
    )
    parser.add_argument("--dataset_config", default=None)
    parser.add_argument("--dataset_train_split", default="train")
    parser.add_argument("--model_name_or_path", required=True, help="where to load the tokenizer from")
    parser.add_argument(
        "--trust_remote_code",
        type=_boolean,
        nargs="?",
        const=True,
        default=False,
        help="let the tokenizer run code from its repository, as in TRL's ModelConfig (default: false)",
    )
    parser.add_argument(
        "--trainer",
        choices=[*PREFERENCE_TRAINERS, *GROUP_TRAINERS],
        default="dpo",
        help="dpo, reward: preference data (chosen/rejected or ranked completions); grpo, rloo: prompts only, "
        "completions generated during training (default: dpo)",
    )
    parser.add_argument("--max_examples", type=_int_at_least(1), default=None, help="look at the first N rows only")
    preference = parser.add_argument_group("dpo and reward")
    preference.add_argument(
        "--max_length",
        type=_int_at_least(0),
        default=None,
        help=f"as in DPOConfig (truncates) and RewardConfig (drops longer examples); 0: none (default: {MAX_LENGTH})",
    )
    preference.add_argument(
        "--truncation_mode",
        choices=["keep_start", "keep_end"],
        default=None,
        help=f"dpo only, as in DPOConfig (default: {TRUNCATION_MODE})",
    )
    preference.add_argument(
        "--per_device_train_batch_size",
        type=_int_at_least(1),
        default=None,
        help=f"examples per micro-batch, for the padding and packing estimates (default: {BATCH_SIZE})",
    )
    group = parser.add_argument_group("grpo and rloo")
    group.add_argument(
        "--num_generations",
        type=_int_at_least(2),
        default=None,
        help="completions per prompt, as in GRPOConfig/RLOOConfig (default: TRL's, "
        + ", ".join(f"{k} {v}" for k, v in NUM_GENERATIONS.items())
        + ")",
    )
    group.add_argument(
        "--max_completion_length",
        type=_int_at_least(1),
        default=None,
        help=f"as in GRPOConfig/RLOOConfig (default: TRL's, {MAX_COMPLETION_LENGTH})",
    )
    group.add_argument(
        "--completion_length",
        type=_int_at_least(1),
        default=None,
        help="the assumed length of every generated completion, in tokens (default: --max_completion_length, "
        "the longest TRL generates; completions that stop at EOS are shorter, so pass the typical length you see)",
    )
    return parser


def parse_args(argv: list[str] | None):
    args = make_parser().parse_args(argv)
    given = lambda *names: [f"--{n}" for n in names if getattr(args, n) is not None]  # noqa: E731
    if args.trainer in GROUP_TRAINERS:
        if wrong := given("max_length", "truncation_mode", "per_device_train_batch_size"):
            raise StatsError(
                f"{', '.join(wrong)} applies to --trainer dpo or reward; with --trainer {args.trainer} the "
                "prompts are not truncated and padding is not counted; drop it"
            )
        args.num_generations = args.num_generations or NUM_GENERATIONS[args.trainer]
        args.max_completion_length = args.max_completion_length or MAX_COMPLETION_LENGTH
        if args.completion_length is None:
            args.completion_length = args.max_completion_length
        elif args.completion_length > args.max_completion_length:
            raise StatsError(
                f"--completion_length {args.completion_length} is longer than --max_completion_length "
                f"{args.max_completion_length}, where generation stops; pass at most {args.max_completion_length} "
                "or raise --max_completion_length"
            )
    else:
        if wrong := given("num_generations", "max_completion_length", "completion_length"):
            raise StatsError(
                f"{', '.join(wrong)} applies to --trainer grpo or rloo (completions generated during training); "
                f"--trainer {args.trainer} counts the dataset's own completions; drop it, or pass --trainer grpo"
            )
        if args.trainer == "reward" and args.truncation_mode is not None:
            raise StatsError(
                "--truncation_mode applies to --trainer dpo only: the reward trainer drops the examples longer "
                "than --max_length instead of truncating them; drop it"
            )
        args.max_length = MAX_LENGTH if args.max_length is None else args.max_length
        args.truncation_mode = args.truncation_mode or TRUNCATION_MODE
        args.per_device_train_batch_size = args.per_device_train_batch_size or BATCH_SIZE
    return args


# --------------------------------------------------------------------------------------------------- loading


def _is_local(name: str) -> bool:
    """Whether `name` names a local path (one that exists, or is written as a path) rather than a Hub id."""
    from .train import _LOCAL_BUILDERS

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

    from .train import _LOCAL_BUILDERS, load_script_dataset

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


def _check_columns(dataset, args) -> None:
    columns = set(dataset.column_names)
    if args.trainer in GROUP_TRAINERS:
        if "prompt" not in columns:
            hint = (
                "; for preference data pass --trainer dpo or reward"
                if {"chosen", "rejected"} <= columns or "completions" in columns
                else ""
            )
            raise StatsError(
                f"the dataset has columns {sorted(columns)}; --trainer {args.trainer} needs a 'prompt' column (text "
                f"or a list of messages), as TRL's {args.trainer.upper()}Trainer does{hint}"
            )
        if {"image", "images"} & columns:
            raise StatsError(
                f"the dataset has an image column; {PROG} counts text tokens with the tokenizer only and cannot count "
                "the tokens of images"
            )
        return
    from ..dpo_trainer import DPO_COLUMNS
    from ..reward_trainer import REWARD_COLUMNS
    from ..validation import check_dataset_columns

    try:
        check_dataset_columns(
            dataset, args.dataset_train_split, *(DPO_COLUMNS if args.trainer == "dpo" else REWARD_COLUMNS)
        )
    except ValueError as error:
        hint = ""
        if "prompt" in columns and not {"chosen", "rejected", "completions"} & columns:
            hint = "; for prompt-only data (completions generated during training) pass --trainer grpo or rloo"
        raise StatsError(f"{_one_line(error).rstrip('.')}{hint}") from None


# --------------------------------------------------------------------------------------------------- preference data
#
# The preprocessing of TRL 1.16's preference trainers, done here with TRL's public data functions and the tokenizer
# (no trainer, no model): `tests/test_stats_cli.py` compares the columns with what `DPOTrainer` and `RewardTrainer`
# produce on the same data.


def _chat_template_kwargs(example: dict) -> dict:
    """What a conversational example gives the chat template besides its messages: its `tools` (a list, or that list
    as JSON text) and its `chat_template_kwargs`."""
    tools = example.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    return {"tools": tools, **(example.get("chat_template_kwargs") or {})}


def _token_ids(tokenizer, content, **template_kwargs) -> list[int]:
    """The token ids of `content`: a list of messages rendered by the chat template, or a text (with the special
    tokens the tokenizer adds to a text of its own accord)."""
    if isinstance(content, list):
        encoded = tokenizer.apply_chat_template(content, tokenize=True, return_dict=True, **template_kwargs)
        return list(encoded["input_ids"])
    return list(tokenizer(text=content)["input_ids"])


def _common_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens `ids` and `other` have in common."""
    return len(os.path.commonprefix([ids, other]))


def _with_eos(example: dict, eos_token: str) -> dict:
    """A text completion ends with the EOS token, so that the model learns to stop: added where it is missing."""

    def ended(text: str) -> str:
        return text if text.endswith(eos_token) else text + eos_token

    return {"chosen": ended(example["chosen"]), "rejected": ended(example["rejected"])}


#: whether `_note_prompt_end_moved` has warned (once per process)
_prompt_end_noted: list[bool] = []


def _note_prompt_end_moved(tokenizer, moved: list[int]) -> None:
    """Warn once that some prompts end differently alone than followed by their completions (TRL's DPO trainer
    warns of it too): their last tokens, `moved`, count as completion tokens, as in training."""
    if _prompt_end_noted:
        return
    _prompt_end_noted.append(True)
    warnings.warn(
        "the tokenized prompt of some examples is not where the tokenized prompt + completion starts (the chat "
        "template renders a prompt alone differently, or tokens merge across its end); the completions start where "
        f"they differ, so the prompt's end {tokenizer.decode(moved)!r} is counted as completion, as DPO trains on it",
        UserWarning,
        stacklevel=2,
    )


def _tokenize_pair(example: dict, tokenizer) -> dict:
    """DPO's columns of one example: the prompt's tokens, and each completion's tokens after it.

    Each completion is tokenized together with its prompt, as the model reads them (conversational: rendered by the
    chat template; the prompt alone ends with the generation prompt). The prompt is the start of the tokenized prompt
    that both prompt-and-completion sequences share: a chat template may render a prompt alone differently, and a
    tokenizer may merge tokens across the prompt's end; whatever differs belongs to the completions."""
    from trl.data_utils import is_conversational

    prompt, keys = example["prompt"], ("chosen", "rejected")
    if is_conversational(example):
        kwargs = _chat_template_kwargs(example)
        prompt_ids = _token_ids(tokenizer, prompt, add_generation_prompt=True, **kwargs)
        full = [_token_ids(tokenizer, prompt + example[key], **kwargs) for key in keys]
    else:
        prompt_ids = _token_ids(tokenizer, prompt)
        full = [_token_ids(tokenizer, prompt + example[key]) for key in keys]
    start = min(_common_length(prompt_ids, ids) for ids in full)
    if start < len(prompt_ids):
        _note_prompt_end_moved(tokenizer, prompt_ids[start:])
    return {"prompt_ids": prompt_ids[:start], "chosen_ids": full[0][start:], "rejected_ids": full[1][start:]}


def _tokenize_scored(example: dict, tokenizer) -> dict:
    """The reward trainer's columns of one example: each completion tokenized as one sequence with the prompt, if
    the example has one (conversational: rendered by the chat template, no generation prompt)."""
    from trl.data_utils import is_conversational

    prompt = example.get("prompt")
    sequences = {key: example[key] if prompt is None else prompt + example[key] for key in ("chosen", "rejected")}
    if is_conversational({**example, **sequences}):
        kwargs = _chat_template_kwargs(example)
        return {f"{key}_ids": _token_ids(tokenizer, ids, **kwargs) for key, ids in sequences.items()}
    return {f"{key}_ids": _token_ids(tokenizer, text) for key, text in sequences.items()}


def dpo_dataset(dataset, tokenizer, max_length: int | None, truncation_mode: str):
    """`dataset` as TRL's `DPOTrainer` prepares it: `prompt_ids`, `chosen_ids` and `rejected_ids` per example.

    Without a `prompt` column, the prompt is the start that `chosen` and `rejected` share (`trl.extract_prompt`).
    Text completions (the first example tells) end with the EOS token. With `max_length` and `keep_start`
    truncation, the examples whose prompt alone fills `max_length` are dropped: truncation would leave them no
    completion token. The truncation itself is the collator's."""
    from trl.data_utils import extract_prompt, is_conversational

    if "prompt" not in dataset.column_names:
        dataset = dataset.map(extract_prompt, desc="Extracting prompt from train dataset")
    if not is_conversational(dataset[0]):
        eos = {"eos_token": tokenizer.eos_token}
        dataset = dataset.map(_with_eos, fn_kwargs=eos, desc="Adding EOS to train dataset")
    dataset = dataset.map(_tokenize_pair, fn_kwargs={"tokenizer": tokenizer}, desc="Tokenizing train dataset")
    if max_length is not None and truncation_mode == "keep_start":
        dataset = dataset.filter(
            lambda prompt_ids: len(prompt_ids) < max_length,
            input_columns="prompt_ids",
            desc="Dropping fully truncated examples from train dataset",
        )
    return dataset


def reward_dataset(dataset, tokenizer, max_length: int | None):
    """`dataset` as this package's `RewardTrainer` prepares it: TRL's `chosen_ids` and `rejected_ids` per pair (text
    completions ending with the EOS token, the first example tells), or `completion_ids` per ranked example
    (`trl_prefix_sharing.ranked.tokenize_ranked`). Columns already tokenized are kept (TRL's older names
    `chosen_input_ids`, `rejected_input_ids` renamed). With `max_length`, the examples with a longer sequence are
    dropped, whole."""
    from trl.data_utils import is_conversational

    from ..ranked import is_ranked_dataset, tokenize_ranked

    columns = set(dataset.column_names)
    if is_ranked_dataset(columns):
        if "completion_ids" not in columns:
            kwargs = {"processing_class": tokenizer}
            dataset = dataset.map(tokenize_ranked, fn_kwargs=kwargs, desc="Tokenizing ranked train dataset")
        fits = lambda completion_ids: all(len(ids) <= max_length for ids in completion_ids)  # noqa: E731
        id_columns = ["completion_ids"]
    else:
        if not {"chosen_ids", "rejected_ids"} <= columns:
            if {"chosen_input_ids", "rejected_input_ids"} <= columns:
                renamed = {"chosen_input_ids": "chosen_ids", "rejected_input_ids": "rejected_ids"}
                dataset = dataset.rename_columns(renamed)
            else:
                if not is_conversational(dataset[0]):
                    eos = {"eos_token": tokenizer.eos_token}
                    dataset = dataset.map(_with_eos, fn_kwargs=eos, desc="Adding EOS to train dataset")
                kwargs = {"tokenizer": tokenizer}
                dataset = dataset.map(_tokenize_scored, fn_kwargs=kwargs, desc="Tokenizing train dataset")
        fits = lambda chosen, rejected: len(chosen) <= max_length and len(rejected) <= max_length  # noqa: E731
        id_columns = ["chosen_ids", "rejected_ids"]
    if max_length is not None:
        dataset = dataset.filter(fits, input_columns=id_columns, desc=f"Filtering train >{max_length} tokens")
    return dataset


def _preprocess(trainer: str, prepare, dataset, tokenizer, *limits):
    """`prepare(dataset, tokenizer, *limits)`, the preprocessing of TRL's `trainer`; a dataset it cannot take (a
    column it lacks, a message or text the chat template or tokenizer refuses) is one error line."""
    try:
        return prepare(dataset, tokenizer, *limits)
    except (ValueError, KeyError) as error:  # the checks of the data and the tokenizer's; a column it reads
        cause = f"it reads a column {error} that the dataset lacks" if isinstance(error, KeyError) else _cause(error)
        raise StatsError(f"TRL's {trainer} preprocessing cannot take this dataset ({cause})") from None


def _prepared_preferences(dataset, tokenizer, args):
    """The dataset as `--trainer` prepares it, and TRL's collator of its examples (before prefix sharing)."""
    import datasets

    max_length = args.max_length or None
    bars = datasets.is_progress_bar_enabled()
    if len(dataset) <= 4096:
        datasets.disable_progress_bars()  # preprocessing takes seconds: no bars
    try:
        if args.trainer == "dpo":
            from trl.trainer.dpo_trainer import DataCollatorForPreference

            dataset = _preprocess("DPOTrainer", dpo_dataset, dataset, tokenizer, max_length, args.truncation_mode)
            base = DataCollatorForPreference(
                pad_token_id=tokenizer.pad_token_id, max_length=max_length, truncation_mode=args.truncation_mode
            )
        else:
            from trl.trainer.reward_trainer import DataCollatorForPreference

            from ..ranked import RankedCollator, is_ranked_dataset

            ranked = is_ranked_dataset(dataset.column_names)
            dataset = _preprocess("RewardTrainer", reward_dataset, dataset, tokenizer, max_length)
            base = (
                RankedCollator(tokenizer.pad_token_id)
                if ranked
                else DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
            )
    finally:
        if bars:
            datasets.enable_progress_bars()
    return dataset, base


@dataclass
class _PreferenceCounts:
    """What `_measure_preferences` counts: lengths per example (or per completion: `rest_lens`) and totals."""

    prompt_lens: list[int] = field(default_factory=list)
    common_lens: list[int] = field(default_factory=list)
    shared_lens: list[int] = field(default_factory=list)
    rest_lens: list[int] = field(default_factory=list)
    shared_units: list[int] = field(default_factory=list)
    unshared_units: list[int] = field(default_factory=list)
    stock_tokens: int = 0
    shared_tokens: int = 0
    stock_attention: int = 0
    shared_attention: int = 0
    no_prefix: int = 0
    stock_padded: int = 0  # positions of batches of `per_device_train_batch_size`, padding included
    shared_padded: int = 0


def _dpo_prompt_lengths(batch, lengths: list[int]) -> list[int] | None:
    """DPO: the prompt of each row is what precedes its completion mask (after truncation). None for the reward
    trainer, which tokenizes prompt and completion as one text."""
    if "completion_mask" not in batch:
        return None
    completion = batch["completion_mask"].bool()
    return [int(completion[r].int().argmax()) if completion[r].any() else lengths[r] for r in range(len(lengths))]


def _count_batch(counts: _PreferenceCounts, batch, batch_size: int) -> None:
    """Add one collated chunk of examples to `counts`."""
    from ..examples import example_groups
    from ..layout import shared_positions
    from ..stats import causal_pairs

    layout = batch["prefix_sharing"]
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    prompts = _dpo_prompt_lengths(batch, lengths)
    per_doc = (layout.document_ids >= 0).sum(dim=1).tolist()
    prefix = shared_positions(layout).sum(dim=1).tolist()  # positions every row of the example reads
    groups = example_groups(batch)
    for first in range(0, len(groups), batch_size):  # consecutive examples stand in for a shuffled batch
        rows = [r for group in groups[first : first + batch_size] for r in group]
        counts.stock_padded += len(rows) * max(lengths[r] for r in rows)
        docs = per_doc[first : first + batch_size]
        counts.shared_padded += len(docs) * max(docs)
    for group, doc_len, p in zip(groups, per_doc, prefix, strict=True):
        rows = [lengths[r] for r in group]
        shared_p = p + 1 if p else 0  # the prefix plus the copy of its last token heading each branch
        counts.shared_lens.append(shared_p)
        counts.rest_lens.extend(n - shared_p for n in rows)
        if prompts is not None:
            prompt = prompts[group[0]]
            counts.prompt_lens.append(prompt)
            counts.common_lens.append(max(shared_p - prompt, 0))
        counts.stock_tokens += sum(rows)
        counts.shared_tokens += doc_len
        counts.shared_units.append(doc_len)
        counts.unshared_units.append(sum(rows))
        counts.stock_attention += sum(causal_pairs(0, [n]) for n in rows)
        counts.shared_attention += causal_pairs(p, [n - p for n in rows])
        counts.no_prefix += p == 0


def _measure_preferences(dataset, base, pad_token_id: int, batch_size: int) -> _PreferenceCounts:
    """Collate the prepared examples with prefix sharing, each example on its own (what every micro-batch saves; one
    that holds several pairs of a prompt saves more), and count."""
    from tqdm.auto import tqdm

    from ..collator import PrefixSharingCollator

    collator = PrefixSharingCollator(base, pad_token_id=pad_token_id, across_examples=False)
    counts = _PreferenceCounts()
    chunk = 256 // batch_size * batch_size or batch_size
    for start in tqdm(range(0, len(dataset), chunk), desc="Measuring", disable=len(dataset) <= 4 * chunk):
        examples = [dataset[i] for i in range(start, min(start + chunk, len(dataset)))]
        _count_batch(counts, collator(examples), batch_size)
    return counts


def _packing(units: list[int], batch_size: int, n: int) -> tuple[int, float, float]:
    """Row length (the trainer's default `packing_length`), efficiency, positions per example."""
    from ..sampler import MultipackSampler

    length = -(-batch_size * max(units) // 128) * 128
    sampler = MultipackSampler(units, length)
    return length, sampler.efficiency(), len(sampler) * length / n


def _print_preference_report(args, counts: _PreferenceCounts) -> None:
    max_length, batch_size = args.max_length or None, args.per_device_train_batch_size
    n = len(counts.shared_lens)
    linear = counts.stock_tokens / max(counts.shared_tokens, 1)
    attention = counts.stock_attention / max(counts.shared_attention, 1)
    shared_len, shared_eff, shared_packed = _packing(counts.shared_units, batch_size, n)
    unshared_len, unshared_eff, unshared_packed = _packing(counts.unshared_units, batch_size, n)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    ratio = median(counts.shared_lens) / max(median(counts.rest_lens), 1)
    if args.trainer == "dpo":
        limits = f"max_length={max_length}, truncation {args.truncation_mode}"
    else:
        limits = f"max_length={max_length}" + (": longer examples dropped" if max_length else "")
    width = 42
    print(f"Dataset {args.dataset_name} ({_count(n, 'example')} after TRL's preprocessing; {args.trainer}, {limits})")
    if counts.prompt_lens:
        print(f"  {'prompt tokens:':<{width}}{_percentiles(counts.prompt_lens)}")
    print(
        f"  {'shared prefix tokens, computed once:':<{width}}{_percentiles(counts.shared_lens)} "
        "(the prompt + the common start of the completions)"
    )
    if counts.common_lens:
        print(
            f"  {'common start of the completions:':<{width}}{_percentiles(counts.common_lens)} (in the shared prefix)"
        )
    print(
        f"  {'each completion after the shared prefix:':<{width}}{_percentiles(counts.rest_lens)} (tokens, not shared)"
    )
    print(
        f"  {'positions per example:':<{width}}stock {counts.stock_tokens / n:.1f}, "
        f"shared {counts.shared_tokens / n:.1f} (tokens, no padding)"
    )
    print(
        f"  {f'with padding, batches of {batch_size}:':<{width}}stock {counts.stock_padded / n:.1f}, "
        f"shared {counts.shared_padded / n:.1f}; packed rows: unshared {unshared_packed:.1f}, "
        f"shared {shared_packed:.1f}"
    )
    print(f"  {'examples with no shared prefix:':<{width}}{counts.no_prefix:,}")
    print(f"  {f'packing, shared rows of {shared_len} tokens:':<{width}}{100 * shared_eff:.1f}% of row tokens used")
    print(
        f"  {f'packing, unshared rows of {unshared_len} tokens:':<{width}}{100 * unshared_eff:.1f}% of row tokens used"
    )
    print(
        f"  {'ideal speedup, linear layers:':<{width}}{linear:.2f}x (stock / shared positions; 2(p+c)/(p+2c) for a "
        "pair, p the shared prefix, c the rest of a completion)"
    )
    print(f"  {'ideal speedup, attention:':<{width}}{attention:.2f}x (stock / shared query-key pairs)")
    print(f"  expected training speedup from sharing (median shared prefix / rest of a completion {ratio:.2f}):")
    for line in expected_speedup_lines(args.trainer, ratio, linear):
        print(line)
    print(f"  verdict: prefix sharing {_verdict(linear)} on this dataset.")


def preference_report(dataset, tokenizer, args) -> None:
    """The report on preference data (`--trainer dpo` or `reward`): prepared and collated as the trainer would."""
    from ..trl_internals import check_trl_internals

    check_trl_internals("stats")  # the preprocessing re-derived here is still TRL's (fingerprints of its methods)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    dataset, base = _prepared_preferences(dataset, tokenizer, args)
    counts = _measure_preferences(dataset, base, tokenizer.pad_token_id, args.per_device_train_batch_size)
    if not counts.shared_lens:
        max_length = args.max_length or None
        limit = f"longer than --max_length {max_length}" if max_length else "empty after tokenization"
        raise StatsError(f"no examples left after TRL's preprocessing: all were {limit}; raise --max_length")
    _print_preference_report(args, counts)


# --------------------------------------------------------------------------------------------------- GRPO, RLOO


def prompt_lengths(dataset, tokenizer, chunk: int = 256) -> tuple[list[int], bool]:
    """Token counts of the prompts as TRL's GRPO/RLOO trainers tokenize them (`_tokenize_prompts`): conversational
    ones through the chat template with `add_generation_prompt=True`, text as it is. Also: whether any was
    conversational."""
    from tqdm.auto import tqdm
    from trl.data_utils import is_conversational

    lengths, conversational = [], False
    for start in tqdm(range(0, len(dataset), chunk), desc="Tokenizing prompts", disable=len(dataset) <= 16 * chunk):
        prompts = dataset[start : start + chunk]["prompt"]
        for offset, prompt in enumerate(prompts):
            if not isinstance(prompt, (str, list)) or (
                isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m for m in prompt)
            ):
                raise StatsError(
                    f"row {start + offset}: 'prompt' is {_one_line(repr(prompt))[:80]}; expected text or a list of "
                    "messages (dicts with 'role' and 'content'); fix or drop the row"
                )
        chat = [is_conversational({"prompt": p}) for p in prompts]
        try:
            if any(chat):
                conversational = True
                messages = [p for p, c in zip(prompts, chat, strict=True) if c]
                encoded = iter(
                    tokenizer.apply_chat_template(
                        conversation=messages, add_generation_prompt=True, tokenize=True, return_dict=True
                    )["input_ids"]
                )
            if not all(chat):
                texts = [p for p, c in zip(prompts, chat, strict=True) if not c]
                plain = iter(tokenizer(text=texts)["input_ids"])
        except Exception as error:  # the tokenizer on the user's prompts: a template or a text it cannot take
            what, way_out = (
                ("the chat template", "conversational prompts need a tokenizer whose chat template takes them")
                if any(chat)
                else ("the tokenizer", "check the prompts' text")
            )
            raise StatsError(
                f"{what} of --model_name_or_path cannot take the prompts of rows {start}-{start + len(prompts) - 1} "
                f"({_cause(error)}); {way_out}"
            ) from None
        lengths.extend(len(next(encoded) if c else next(plain)) for c in chat)
    return lengths, conversational


def group_report(dataset, tokenizer, args) -> None:
    from ..stats import group_stats

    lengths, conversational = prompt_lengths(dataset, tokenizer)
    g, c = args.num_generations, args.completion_length
    stats = group_stats(lengths, c, g)
    config = f"{args.trainer.upper()}Config"
    if c == args.max_completion_length:
        source = (
            "--max_completion_length"
            + ("" if args.max_completion_length != MAX_COMPLETION_LENGTH else f", TRL's {config} default")
            + ": completions that stop at EOS are shorter; pass their typical length with --completion_length"
        )
    else:
        source = "--completion_length"
    tokenized = "chat template, add_generation_prompt=True" if conversational else "plain text, no chat template"
    width = 42
    print(f"Dataset {args.dataset_name} ({_count(len(lengths), 'prompt')}; {args.trainer}, num_generations={g})")
    print(f"  {'assumed completion length:':<{width}}{c} tokens each ({source})")
    print(f"  {'prompt tokens:':<{width}}{_percentiles(lengths)} ({tokenized})")
    print(f"  positions per group (a prompt and its {g} completions; padding not counted):")
    print(f"    {'stock, G(P+C):':<{width - 2}}{stats.stock_per_group:,.1f} ({g} rows of prompt + completion)")
    print(
        f"    {'shared, P-1+G(C+1):':<{width - 2}}{stats.shared_per_group:,.1f} (the prompt once; each completion "
        "headed by a copy of the prompt's last token)"
    )
    if stats.empty_prompts:
        print(f"  {'prompts with no tokens:':<{width}}{stats.empty_prompts:,} (nothing to share)")
    print(
        f"  {'ideal speedup, linear layers:':<{width}}{stats.linear_speedup:.2f}x (stock / shared positions), of "
        "the passes that score the completions"
    )
    print(f"  {'ideal speedup, attention:':<{width}}{stats.attention_speedup:.2f}x (stock / shared query-key pairs)")
    print(
        "  the scoring passes: training forward and backward, old-policy and reference log-probs; generation is not "
        "sped up, and often takes most of a step"
    )
    print(f"  {'expected training speedup:':<{width}}no {args.trainer.upper()} benchmark recorded")
    print(f"  verdict: prefix sharing {_verdict(stats.linear_speedup)} on the scoring passes on this dataset.")


# --------------------------------------------------------------------------------------------------- main


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    offline = go_offline_if_unreachable(args.model_name_or_path, args.dataset_name)
    tokenizer = load_tokenizer(args.model_name_or_path, offline, args.trust_remote_code)
    dataset = load_split(args, offline)
    if args.max_examples:
        dataset = dataset.select(range(min(args.max_examples, len(dataset))))
    _check_columns(dataset, args)
    (group_report if args.trainer in GROUP_TRAINERS else preference_report)(dataset, tokenizer, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run `stats`; a user mistake ends in one line on stderr and exit status 2 (`TRL_PREFIX_SHARING_TRACEBACK=1`
    shows the traceback, as for the training commands)."""
    try:
        return run(argv)
    except (StatsError, ValueError, FileNotFoundError) as error:  # bad data reaches TRL's checks as ValueError
        if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            raise
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return 2
