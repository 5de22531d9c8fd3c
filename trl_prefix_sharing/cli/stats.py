"""`trl-prefix-sharing stats`: does prefix sharing pay on this dataset? Loads the tokenizer and the model's config (no
weights), and applies training's architecture check first: a model training refuses (Mamba, an encoder, ...) is an
error naming the reason, never a verdict.

Data with its completions (`--trainer dpo`, `reward`, `kto`, `orpo` or `cpo`): the trainer itself, built on a tiny
stand-in model (`cli/prepared.py`), prepares the dataset (TRL's own preprocessing and truncation), and each example's
stock rows are laid out as training does. The report gives the lengths of the shared prefix (the prompt plus whatever
start the example's rows have in common: prefix sharing computes the longest common token prefix of an example's rows
once) and of the rest of each row, token positions per example with and without sharing, and the predicted speedup.
Two ideals: the padding-free one (stock / shared tokens, `2(p+c)/(p+2c)` for a pair) and the one with padding (stock's
padded rows / the shared rows, in batches of `--per_device_train_batch_size`: the positions each really computes).
The expected speedup is the ideal with padding times the share of it that `scripts/benchmark.py --record` measured on
the benchmark profile whose shared prefix/rest ratio is nearest to this dataset's
(`trl_prefix_sharing/data/measured_speedups.json`, one entry per device kind measured); it is never printed above the
ideal with padding, and where it is above the padding-free ideal its line says why (stock also computes its rows'
padding, which the shared rows drop). Nor is it printed below 1: where the nearest profile measured sharing slower
than stock, training's `"auto"` (the default kernel choice) measures that on its first micro-batch and runs stock's
own rows, and the line says so. The verdict takes the lowest of these.

- `dpo`, `reward`: each pair's two rows (or a ranked example's K rows), through the trainer's collator; packing too.
- `orpo`, `cpo`: TRL's experimental ORPO/CPO tokenization (`tokenize_row`: BOS added, EOS added, the completions cut to
  fit `--max_length`, never the prompt); the two rows `[prompt | chosen]`, `[prompt | rejected]`. By default
  (`--prefix_sharing_score_padding false`, as in training) the shared rows skip stock's padding; with `true` they
  also compute each stock row's padding (so that the `logits/chosen|rejected` metrics are stock's).
- `kto`: TRL's KTO tokenization; each example's main row `[prompt | completion]` and its KL row `[prompt | the previous
  example's completion]` (rotated within batches of `--per_device_train_batch_size`, as TRL does). The reference pass
  runs both after one copy of the prompt; the policy's gradient pass does so where `--prefix_sharing_merge_kl` merges
  (by default: when a batch's prompt tokens exceed twice its KL completion tokens), so a training step is reported too.

SFT data (`--trainer sft`: `text`, `messages`, or `prompt` + `completion`, text or conversational): prepared by the
SFT trainer itself, built on a tiny stand-in model (`cli/prepared.py`), so TRL's own preparation runs (EOS
added to text, the prompt masked for prompt-completion data as TRL's default `completion_only_loss` does, truncated to
`--max_length` by `--truncation_mode`). Each example is one row; its prompt
is its tokens before its first trained label. SFT's sampler is random, so the micro-batches counted are
`--per_device_train_batch_size` consecutive rows (what `train_sampling_strategy="sequential"` or `group_by_prompt`
gives), collated by TRL's collator and planned by the package's own layout (the SFT trainer's `PrefixSharingCollator`)
under `--prefix_sharing_join`: `prompts` joins rows that share a prompt (a prompt's several completions), `always` also
rows that share only a start (a system prompt, a preamble), `auto` (the default) reports both plans, between which
training chooses per micro-batch by the step's estimated cost; its verdict takes the prompts plan. No SFT benchmark is
recorded, so there is no expected speedup.

Prompt-only data (`--trainer grpo`, `rloo` or `online_dpo`): the completions are generated during training, so their
length is an assumption (`--completion_length`, by default the longest generation: `--max_completion_length`, or
`--max_new_tokens` for online DPO). Tokenizes the prompts as TRL does and reports, per group of one prompt and its
completions (`--num_generations`; online DPO: 2), the positions stock TRL computes, G(P + C), against the shared
layout's, P - 1 + G(C + 1) (the prompt once; each completion headed by a copy of the prompt's last token). Padding is
not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..trainers import TRAINERS as TRAINER_SPECS
from ..trainers import trainers_with


PROG = "trl-prefix-sharing stats"
MEASURED_SPEEDUPS = "measured_speedups.json"
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
#: the hub's host, when `HF_ENDPOINT` does not name another
HUB_ENDPOINT = "https://huggingface.co"
#: set to see the traceback behind an error line
TRACEBACK_VARIABLE = "TRL_PREFIX_SHARING_TRACEBACK"


class StatsError(Exception):
    """A user mistake (a path, a dataset, a flag): one line on stderr, exit status 2, no traceback."""


def measured_speedups() -> dict:
    """What `scripts/benchmark.py --record` measured: {mode: {"device", "command", kind: {profile: {...}}}}."""
    path = resources.files("trl_prefix_sharing") / "data" / MEASURED_SPEEDUPS
    return json.loads(path.read_text()) if path.is_file() else {}


def expected_speedups(kind: str, ratio: float, ideal: float, padded_ideal: float) -> tuple[list[str], list[float]]:
    """The expected speedup on a dataset of shared prefix/rest ratio `ratio`, from the nearest measured profile: the
    report's lines and the figures.

    `ideal` is the padding-free ideal (stock / shared tokens), `padded_ideal` the one with padding (stock's padded rows
    / the shared rows). A profile that recorded its ideal with padding gives the share of it that training reached;
    an older record only the share of the padding-free ideal, which exceeds 1 where stock computed much padding. An
    expectation is never above `padded_ideal` (capped, and said so), and one above `ideal` says why."""
    lines, values, recorded = [], [], measured_speedups()
    for mode, record in sorted(recorded.items()):
        profiles = record.get(kind) or {}
        if not profiles:
            continue
        name, near = min(profiles.items(), key=lambda item: abs(math.log(item[1]["p_over_c"] / max(ratio, 1e-6))))
        measured = (
            f"measured on the {name} profile, p/c {near['p_over_c']:.2f}: sharing {near['sharing']:.2f}x, "
            f"sharing+packing {near['sharing+packing']:.2f}x over stock"
        )
        if near.get("padded_ideal"):
            share = near["sharing"] / near["padded_ideal"]
            expected, basis = padded_ideal * share, f"the ideal with padding x {share:.2f}, the share of it {measured}"
        else:
            share = near["share_of_ideal"]
            expected, basis = ideal * share, f"the ideal x {share:.2f}, the share of ideal {measured}"
        if expected > padded_ideal:
            expected = padded_ideal
            basis += f"; capped at the ideal with padding, {padded_ideal:.2f}x, the most the positions allow"
        if expected > ideal:
            basis += (
                f"; above the padding-free ideal {ideal:.2f}x because stock also computes its rows' padding "
                "positions, which the shared rows drop"
            )
        if expected < 1.0:  # measured slower than stock: training's `"auto"` (the default) runs stock's own rows
            basis += (
                f"; below stock's ~{expected:.2f}x, so training's prefix_sharing_attn_implementation=auto measures "
                "that and runs stock's own rows (a fixed kernel would not)"
            )
            expected = 1.0
        values.append(expected)
        lines.append(f"    {mode.upper()} ({record['device']}; {record['model']}): ~{expected:.2f}x ({basis})")
    if not lines:
        lines.append(f"    no {kind.upper()} benchmark recorded")
    if kind in PREFERENCE_TRAINERS and "gpu" not in recorded:
        lines.append("    GPU: no benchmark recorded yet (scripts/benchmark.py --mode gpu --record on a CUDA machine)")
    return lines, values


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


def _verdict(speedup: float) -> str:
    return "pays" if speedup >= 1.15 else "pays little" if speedup >= 1.05 else "does not pay"


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


def _boolean_or_none(text: str) -> bool | None:
    return None if text.strip().lower() in {"none", "auto"} else _boolean(text)


_boolean_or_none.__name__ = "true, false or none"


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset_name", required=True, help="Hub id, or a local JSON/JSONL/Parquet/CSV file or directory"
    )
    parser.add_argument("--dataset_config", default=None)
    parser.add_argument("--dataset_train_split", default="train")
    parser.add_argument(
        "--model_name_or_path",
        required=True,
        help="the model: its tokenizer and its config (for the architecture check training applies), no weights",
    )
    parser.add_argument(
        "--trust_remote_code",
        type=_boolean,
        nargs="?",
        const=True,
        default=False,
        help="let the tokenizer and config run code from the model's repository, as in TRL's ModelConfig "
        "(default: false)",
    )
    parser.add_argument(
        "--trainer",
        choices=CHOICES,
        default="dpo",
        help="dpo, reward, orpo, cpo: preference data (chosen/rejected; reward: or ranked completions); kto: "
        "unpaired data (prompt/completion/label, or pairs TRL unpairs); sft: supervised data (text, messages, or "
        "prompt/completion), each example one row; grpo, rloo, online_dpo: prompts only, completions generated during "
        "training (default: dpo)",
    )
    parser.add_argument("--max_examples", type=_int_at_least(1), default=None, help="look at the first N rows only")
    data = parser.add_argument_group("dpo, reward, kto, orpo, cpo and sft")
    data.add_argument(
        "--max_length",
        type=_int_at_least(0),
        default=None,
        help="as in the trainer's config: DPO, KTO and SFT truncate, the reward trainer drops longer examples, ORPO "
        "and CPO cut the completions to fit, online DPO cuts the prompt's start; 0: none (default: TRL's, "
        + ", ".join(f"{k} {v}" for k, v in MAX_LENGTHS.items())
        + ")",
    )
    data.add_argument(
        "--truncation_mode",
        choices=["keep_start", "keep_end"],
        default=None,
        help=f"dpo and sft, as in DPOConfig and SFTConfig (default: {TRUNCATION_MODE})",
    )
    data.add_argument(
        "--per_device_train_batch_size",
        type=_int_at_least(1),
        default=None,
        help="examples per micro-batch, for the padding and packing estimates, KTO's KL rows and the rows SFT "
        f"lays out together (default: {BATCH_SIZE})",
    )
    data.add_argument(
        "--prefix_sharing_join",
        choices=SFT_JOINS,
        default=None,
        help="sft only, as in SFTConfig: join the rows of different examples that share a start (a system prompt, "
        "a preamble) into one shared row when they share a prompt (prompts), whenever they share two tokens or more "
        "(always), or whichever of the two the step's estimated cost prefers (auto; reports both; default: "
        f"{SFT_JOIN})",
    )
    data.add_argument(
        "--prefix_sharing_score_padding",
        type=_boolean,
        default=None,
        help="orpo and cpo only, as in their configs: the shared rows also compute each stock row's padding (true) "
        "or skip it (false; default: false)",
    )
    data.add_argument(
        "--prefix_sharing_merge_kl",
        type=_boolean_or_none,
        default=None,
        help="kto only, as in KTOConfig: the policy's gradient pass also runs the KL rows (true), never (false), or "
        "when a batch's prompt tokens exceed twice its KL completion tokens (none, the default)",
    )
    group = parser.add_argument_group("grpo, rloo and online_dpo")
    group.add_argument(
        "--num_generations",
        type=_int_at_least(2),
        default=None,
        help="completions per prompt, as in GRPOConfig/RLOOConfig (default: TRL's, "
        + ", ".join(f"{k} {v}" for k, v in NUM_GENERATIONS.items())
        + "; online DPO generates 2, always)",
    )
    group.add_argument(
        "--max_completion_length",
        type=_int_at_least(1),
        default=None,
        help=f"grpo and rloo, as in GRPOConfig/RLOOConfig (default: TRL's, {MAX_COMPLETION_LENGTH})",
    )
    group.add_argument(
        "--max_new_tokens",
        type=_int_at_least(1),
        default=None,
        help=f"online_dpo, as in OnlineDPOConfig (default: TRL's, {MAX_NEW_TOKENS})",
    )
    group.add_argument(
        "--completion_length",
        type=_int_at_least(1),
        default=None,
        help="the assumed length of every generated completion, in tokens (default: --max_completion_length, or "
        "--max_new_tokens for online_dpo, the longest TRL generates; completions that stop at EOS are shorter, so "
        "pass the typical length you see)",
    )
    return parser


#: the flags that apply to some trainers only
_APPLIES_TO = {
    "max_length": (*DATA_TRAINERS, "sft", "online_dpo"),
    "truncation_mode": ("dpo", "sft"),
    "per_device_train_batch_size": (*DATA_TRAINERS, "sft"),
    "prefix_sharing_join": ("sft",),
    "prefix_sharing_score_padding": PAIRED_TRAINERS,
    "prefix_sharing_merge_kl": ("kto",),
    "num_generations": GROUP_TRAINERS,
    "max_completion_length": ("grpo", "rloo"),
    "max_new_tokens": ("online_dpo",),
    "completion_length": GROUP_TRAINERS,
}
#: why a flag does not apply to a trainer, where more can be said than which trainers it applies to
_WHY_NOT = {
    ("truncation_mode", "reward"): "the reward trainer drops the examples longer than --max_length instead of "
    "truncating them",
    ("truncation_mode", "kto"): "TRL's KTO trainer always keeps the start",
    ("truncation_mode", "orpo"): "TRL's ORPO trainer cuts the completions to fit, never the prompt",
    ("truncation_mode", "cpo"): "TRL's CPO trainer cuts the completions to fit, never the prompt",
    ("truncation_mode", "online_dpo"): "TRL's online DPO trainer cuts the prompt's start to fit --max_length",
    ("max_completion_length", "online_dpo"): "OnlineDPOConfig names the completion length --max_new_tokens; pass that",
    ("max_new_tokens", "grpo"): "GRPOConfig names the completion length --max_completion_length; pass that",
    ("max_new_tokens", "rloo"): "RLOOConfig names the completion length --max_completion_length; pass that",
    ("per_device_train_batch_size", "online_dpo"): "padding is not counted for generated completions",
}


def _does_not_apply(flag: str, trainer: str) -> str:
    """The error for `--flag` given with `--trainer trainer`, which it does not apply to: one line with the way out."""
    where = _APPLIES_TO[flag]
    listed = ", ".join(where[:-1]) + f" or {where[-1]}" if len(where) > 1 else where[0]
    why = _WHY_NOT.get((flag, trainer))
    if why is None and flag == "prefix_sharing_join":
        why = (
            f"with --trainer {trainer} the report lays out each example's rows (or each prompt's group) on its own, "
            "so no rows of different examples are joined"
        )
    if why is None and trainer in ("grpo", "rloo"):
        why = f"with --trainer {trainer} the prompts are not truncated and padding is not counted"
    if why is None and trainer in DATA_TRAINERS and set(where) <= set(GROUP_TRAINERS):
        return (
            f"--{flag} applies to --trainer {listed} (completions generated during training); --trainer {trainer} "
            f"counts the dataset's own completions; drop it, or pass --trainer {where[0]}"
        )
    return f"--{flag} applies to --trainer {listed} only{f': {why}' if why else ''}; drop it"


def parse_args(argv: list[str] | None):
    args = make_parser().parse_args(argv)
    for flag, trainers in _APPLIES_TO.items():
        if getattr(args, flag) is not None and args.trainer not in trainers:
            raise StatsError(_does_not_apply(flag, args.trainer))
    if args.trainer in GROUP_TRAINERS:
        if args.trainer == "online_dpo":
            if args.num_generations not in (None, 2):
                raise StatsError(
                    f"--num_generations {args.num_generations}: TRL's online DPO trainer generates 2 completions per "
                    "prompt, always; drop --num_generations"
                )
            args.max_length = MAX_LENGTHS["online_dpo"] if args.max_length is None else args.max_length
            if not args.max_length:
                raise StatsError(
                    "--max_length 0: OnlineDPOConfig's max_length is a number of tokens (prompt + completion, the "
                    f"prompt's start cut to fit); pass one (TRL's default: {MAX_LENGTHS['online_dpo']})"
                )
            args.max_completion_length = args.max_new_tokens = args.max_new_tokens or MAX_NEW_TOKENS
            longest = "--max_new_tokens"
        else:
            args.max_completion_length = args.max_completion_length or MAX_COMPLETION_LENGTH
            longest = "--max_completion_length"
        args.num_generations = args.num_generations or NUM_GENERATIONS[args.trainer]
        if args.completion_length is None:
            args.completion_length = args.max_completion_length
        elif args.completion_length > args.max_completion_length:
            raise StatsError(
                f"--completion_length {args.completion_length} is longer than {longest} "
                f"{args.max_completion_length}, where generation stops; pass at most {args.max_completion_length} "
                f"or raise {longest}"
            )
        return args
    args.max_length = MAX_LENGTHS[args.trainer] if args.max_length is None else args.max_length
    if args.trainer in PAIRED_TRAINERS and not args.max_length:
        args.max_length = ORPO_DEFAULT_LENGTH  # TRL's ORPO and CPO trainers take 512 for `max_length=None`
    args.truncation_mode = args.truncation_mode or TRUNCATION_MODE
    args.per_device_train_batch_size = args.per_device_train_batch_size or BATCH_SIZE
    if args.prefix_sharing_score_padding is None:
        args.prefix_sharing_score_padding = False  # ConcatenatedSharingArguments' default
    if args.trainer == "sft":
        args.prefix_sharing_join = args.prefix_sharing_join or SFT_JOIN
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


def check_model(name: str, trainer: str, trust_remote_code: bool = False) -> str:
    """Training's architecture check of the model (`trl_prefix_sharing.support.check_architecture`): a model that
    training refuses is an error with training's reason. Returns the report's line on the model."""
    from ..support import check_architecture

    config = load_model_config(name, trust_remote_code)
    if isinstance(config, str):
        return (
            f"not checked: {config}; pass --model_name_or_path the model's directory or id to check it (training "
            "refuses some architectures: recurrent layers, encoders)"
        )
    try:
        reason = check_architecture(config, TRAINER_CLASSES[trainer], trainer == "dpo")
    except ValueError as error:
        raise StatsError(f"--model_name_or_path {name!r}: {_one_line(error)}") from None
    if reason is None:
        return f"'{config.model_type}', measured equal to stock TRL with prefix sharing"
    return (
        f"'{config.model_type}': {reason}; training compares stock and shared rows on its first batch and stops if "
        "they differ"
    )


def _check_columns(dataset, args) -> None:
    from ..validation import check_prompt_column

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
    from ..validation import check_dataset_columns

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


# --------------------------------------------------------------------------------------------------- preference data
#
# Prepared by the trainers themselves, each built on a tiny stand-in model (`prepared.prepared_trainer`); DPO and
# reward data are collated by the trainer's own collator too.


def _common_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens `ids` and `other` have in common."""
    return len(os.path.commonprefix([ids, other]))


def _preprocess(trainer: str, prepare, dataset, tokenizer, *limits):
    """`prepare(dataset, tokenizer, *limits)`, the preprocessing of TRL's `trainer`; a dataset it cannot take (a
    column it lacks, a message or text the chat template or tokenizer refuses) is one error line."""
    from ..validation import NoRowsLeft

    try:
        return prepare(dataset, tokenizer, *limits)
    except NoRowsLeft as error:  # the trainer's own check, after TRL's preprocessing
        raise StatsError(_one_line(error)) from None
    except (ValueError, KeyError) as error:  # the checks of the data and the tokenizer's; a column it reads
        cause = f"it reads a column {error} that the dataset lacks" if isinstance(error, KeyError) else _cause(error)
        raise StatsError(f"TRL's {trainer} preprocessing cannot take this dataset ({cause})") from None


@contextlib.contextmanager
def _quiet_preprocessing(dataset):
    """No progress bars while a dataset that takes seconds is prepared."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    if len(dataset) <= 4096:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars:
            datasets.enable_progress_bars()


def _prepared_preferences(dataset, tokenizer, args):
    """The dataset as `--trainer` (dpo or reward) prepares it, and the trainer's collator of its examples before
    prefix sharing (TRL's, or the ranked collator): the trainer itself, built on a tiny stand-in model
    (`prepared.prepared_trainer`)."""
    from .prepared import prepared_trainer

    options = {"max_length": args.max_length or None}
    if args.trainer == "dpo":
        options["truncation_mode"] = args.truncation_mode
    with _quiet_preprocessing(dataset):
        trainer = _preprocess(
            TRAINER_CLASSES[args.trainer],
            lambda data, tokens: prepared_trainer(args.trainer, data, tokens, **options),
            dataset,
            tokenizer,
        )
    return trainer.train_dataset, trainer.data_collator.base_collator


# --------------------------------------------------------------------------------------------------- KTO, ORPO, CPO
#
# Prepared by the trainers themselves (TRL's KTO `_prepare_dataset`, ORPO/CPO `tokenize_row`); the rows each
# micro-batch holds are laid out here as TRL's collators build them (`kto_rows`, `paired_rows`):
# `tests/test_stats_trainers.py` compares them with what TRL's trainers collate.


def kto_dataset(dataset, tokenizer, max_length: int | None, batch_size: int):
    """`dataset` as the KTO trainer prepares it (TRL's `_prepare_dataset`, run by this package's trainer on a tiny
    stand-in model: `prepared.prepared_trainer`): `prompt_ids`, `completion_ids` and `KL_completion_ids` per example.
    Pairs are unpaired, text completions end with EOS, the examples whose prompt alone fills `max_length` are dropped,
    and the KL completions are rotated within each batch of `batch_size` consecutive examples (TRL's default loss,
    `"kto"`, computes the KL rows)."""
    from .prepared import prepared_trainer

    options = {"max_length": max_length, "per_device_train_batch_size": batch_size}
    return prepared_trainer("kto", dataset, tokenizer, **options).train_dataset


def paired_dataset(dataset, tokenizer, trainer: str, max_length: int):
    """`dataset` as the ORPO or CPO trainer (`trainer`) prepares it: TRL's `maybe_extract_prompt`,
    `maybe_apply_chat_template` and `tokenize_row` (BOS heading the prompt, EOS ending each completion, a row longer
    than `max_length` losing the end of its completion, never the prompt), run by the trainer itself, built on a tiny
    stand-in model (`prepared.prepared_trainer`): `prompt_input_ids`, `chosen_input_ids`, `chosen_labels`,
    `rejected_input_ids` and `rejected_labels` per example. Nothing is dropped."""
    from .prepared import prepared_trainer

    # `remove_unused_columns=False`: what TRL's collator for these trainers needs (it sets it itself, with a warning)
    options = {"max_length": max_length, "remove_unused_columns": False}
    return prepared_trainer(trainer, dataset, tokenizer, **options).train_dataset


def kto_rows(batch: list[dict], max_length: int | None) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The stock rows of one KTO micro-batch as TRL's collator builds them (each cut to `max_length`): the main rows
    `prompt + completion`, the KL rows `prompt + KL completion`, and each example's prompt tokens in them."""
    cut = slice(None, max_length)
    main = [(example["prompt_ids"] + example["completion_ids"])[cut] for example in batch]
    kl = [(example["prompt_ids"] + example["KL_completion_ids"])[cut] for example in batch]
    prompts = [len(example["prompt_ids"][cut]) for example in batch]
    return main, kl, prompts


def paired_rows(batch: list[dict]) -> tuple[list[list[int]], list[int]]:
    """The stock rows of one ORPO/CPO micro-batch (`concatenated_inputs`: the chosen rows, then the rejected rows),
    and each example's prompt tokens in them (its chosen row's label mask)."""
    rows = [example["chosen_input_ids"] for example in batch] + [example["rejected_input_ids"] for example in batch]
    prompts = [example["chosen_labels"].count(-100) for example in batch]
    return rows, prompts


@dataclass
class _PreferenceCounts:
    """What the report on data with its completions counts: lengths per example (or per row: `rest_lens`) and
    totals. "Padded": in micro-batches of `per_device_train_batch_size` consecutive examples, padding included."""

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
    stock_padded: int = 0  # stock's rows, padded
    shared_padded: int = 0  # the shared rows as trained (ORPO/CPO: with `prefix_sharing_score_padding` as given)
    other_padded: int = 0  # ORPO/CPO: the shared rows with the other `prefix_sharing_score_padding`
    step_stock: int = 0  # KTO: positions of the training steps, a pass with gradients weighted 3 (its backward)
    step_shared: int = 0
    batches: int = 0
    merged: int = 0  # KTO: batches whose policy gradient pass runs the KL rows too


def _dpo_prompt_lengths(batch, lengths: list[int]) -> list[int] | None:
    """DPO: the prompt of each row is what precedes its completion mask (after truncation). None for the reward
    trainer, which tokenizes prompt and completion as one text."""
    if "completion_mask" not in batch:
        return None
    completion = batch["completion_mask"].bool()
    return [int(completion[r].int().argmax()) if completion[r].any() else lengths[r] for r in range(len(lengths))]


def _count_examples(
    counts: _PreferenceCounts, per_doc: list[int], prefix: list[int], lengths, groups, prompts
) -> None:
    """Add examples laid out each on its own (one document per example, in example order) to `counts`: `per_doc[e]`
    the positions of example e's document, `prefix[e]` those more than one of its rows read (its shared prefix),
    `lengths[r]` the tokens of stock row r, `groups[e]` the stock rows of example e, `prompts[r]` the prompt tokens
    of row r (None: not known apart)."""
    from ..savings import causal_pairs

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


def _count_batch(counts: _PreferenceCounts, batch, batch_size: int) -> None:
    """Add one collated chunk of DPO or reward examples (with its layout) to `counts`."""
    from ..examples import example_groups
    from ..layout import shared_positions

    layout = batch["prefix_sharing"]
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    per_doc = (layout.document_ids >= 0).sum(dim=1).tolist()
    groups = example_groups(batch)
    for first in range(0, len(groups), batch_size):  # consecutive examples stand in for a shuffled batch
        rows = [r for group in groups[first : first + batch_size] for r in group]
        counts.stock_padded += len(rows) * max(lengths[r] for r in rows)
        docs = per_doc[first : first + batch_size]
        counts.shared_padded += len(docs) * max(docs)
    prefix = shared_positions(layout).sum(dim=1).tolist()  # positions every row of the example reads
    _count_examples(counts, per_doc, prefix, lengths, groups, _dpo_prompt_lengths(batch, lengths))


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


def plan_rows(rows: list[list[int]], examples: list[int], pad_token_id: int, score_padding: bool = False):
    """What the layout training builds makes of one micro-batch's stock rows (right-padded to the longest with
    `pad_token_id`), each example on its own (`examples[r]`: the example of row r, numbered from 0 in order): per
    example, the positions of its shared row and its shared prefix (the positions more than one of its rows read).
    From the layout's plan (`plan_layout`), without assembling the shared rows."""
    import torch

    from ..trie import StockRows, plan_layout

    width = max(map(len, rows))
    input_ids = torch.tensor([row + [pad_token_id] * (width - len(row)) for row in rows])
    attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    plan = plan_layout(
        StockRows(
            input_ids,
            attention_mask,
            examples=torch.tensor(examples),
            across_examples=False,
            score_padding=score_padding,
        )
    )
    documents = int(plan.num_documents)
    # a document's first row reads nothing before it (`first_new` 0); each later row reads `first_new` positions
    prefix = torch.zeros(documents, dtype=torch.long).scatter_reduce(0, plan.document, plan.first_new, "amax")
    return plan.document_lengths[:documents].tolist(), prefix.tolist()


def _batches(dataset, batch_size: int, what: str):
    """The examples of `dataset` in micro-batches of `batch_size` consecutive examples (a list of dicts each)."""
    from tqdm.auto import tqdm

    chunk = max(256 // batch_size, 1) * batch_size
    for start in tqdm(range(0, len(dataset), chunk), desc=what, disable=len(dataset) <= 4 * chunk):
        rows = dataset[start : start + chunk]
        examples = [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)]
        for first in range(0, len(examples), batch_size):
            yield examples[first : first + batch_size]


def _measure_paired(dataset, pad_token_id: int, batch_size: int, score_padding: bool) -> _PreferenceCounts:
    """ORPO/CPO: each micro-batch's chosen and rejected rows laid out as training lays them out (both rows of an
    example after one copy of their common start; with `score_padding`, each row's padding computed too), counted
    with and without the padding scored."""
    counts = _PreferenceCounts()
    columns = ["chosen_input_ids", "rejected_input_ids", "chosen_labels"]
    for batch in _batches(dataset.select_columns(columns), batch_size, "Measuring"):
        rows, prompts = paired_rows(batch)
        n = len(batch)
        examples = list(range(n)) * 2
        lengths = [len(row) for row in rows]
        per_doc, prefix = plan_rows(rows, examples, pad_token_id)
        _count_examples(counts, per_doc, prefix, lengths, [[e, n + e] for e in range(n)], prompts + prompts)
        unscored = n * max(per_doc)  # the shared rows: one per example, as wide as the longest
        scored = n * max(plan_rows(rows, examples, pad_token_id, score_padding=True)[0])
        counts.stock_padded += len(rows) * max(lengths)
        counts.shared_padded += scored if score_padding else unscored
        counts.other_padded += unscored if score_padding else scored
    return counts


def _measure_kto(dataset, pad_token_id: int, args) -> _PreferenceCounts:
    """KTO: each micro-batch's main and KL rows as the reference pass lays them out (an example's two rows after one
    copy of their prompt), and its training step: the policy's gradient pass (weighted 3) merged with the KL rows
    where `--prefix_sharing_merge_kl` says (else the main rows, then the KL rows in a pass without gradients, where
    different prompts share nothing), the reference pass over both."""
    from ..kto_trainer import MERGE_PROMPT_RATIO

    counts = _PreferenceCounts()
    columns = ["prompt_ids", "completion_ids", "KL_completion_ids"]
    max_length = args.max_length or None
    for batch in _batches(dataset.select_columns(columns), args.per_device_train_batch_size, "Measuring"):
        main, kl, prompts = kto_rows(batch, max_length)
        n = len(batch)
        lengths = [len(row) for row in main + kl]
        per_doc, prefix = plan_rows(main + kl, list(range(n)) * 2, pad_token_id)
        _count_examples(counts, per_doc, prefix, lengths, [[e, n + e] for e in range(n)], prompts + prompts)
        main_padded, kl_padded = n * max(lengths[:n]), n * max(lengths[n:])
        shared = n * max(per_doc)  # the merged shared rows: one per example, as wide as the longest
        counts.stock_padded += main_padded + kl_padded
        counts.shared_padded += shared
        merge = args.prefix_sharing_merge_kl
        if merge is None:  # the trainer's rule: the batch's prompt tokens against its KL completion tokens
            merge = sum(prompts) > MERGE_PROMPT_RATIO * (sum(lengths[n:]) - sum(prompts))
        counts.batches += 1
        counts.merged += merge
        counts.step_stock += 3 * main_padded + kl_padded + main_padded + kl_padded
        counts.step_shared += shared + (3 * shared if merge else 3 * main_padded + kl_padded)
    return counts


def _packing(units: list[int], batch_size: int, n: int) -> tuple[int, float, float]:
    """Row length (the trainer's default `packing_length`), efficiency, positions per example."""
    from ..sampler import MultipackSampler

    length = -(-batch_size * max(units) // 128) * 128
    sampler = MultipackSampler(units, length)
    return length, sampler.efficiency(), len(sampler) * length / n


_WIDTH = 42


def _line(label: str, text: str) -> None:
    print(f"  {label:<{_WIDTH}}{text}")


def _limits(args) -> str:
    """How the trainer limits the examples' length, for the report's first line."""
    max_length = args.max_length or None
    if args.trainer == "dpo":
        return f"max_length={max_length}, truncation {args.truncation_mode}"
    if args.trainer == "reward":
        return f"max_length={max_length}" + (": longer examples dropped" if max_length else "")
    if args.trainer == "kto":
        return (
            f"max_length={max_length}, truncation keep_start; each KL row: the example's prompt and the completion "
            f"of the example before it in its batch of {args.per_device_train_batch_size}"
        )
    return f"max_length={max_length}: completions cut to fit, never the prompt; BOS and EOS added as TRL does"


def _print_lengths(args, counts: _PreferenceCounts) -> None:
    """The report's lengths and positions per example."""
    n, batch_size = len(counts.shared_lens), args.per_device_train_batch_size
    rows = "main and KL rows" if args.trainer == "kto" else "completions"
    if counts.prompt_lens:
        _line("prompt tokens:", _percentiles(counts.prompt_lens))
    _line(
        "shared prefix tokens, computed once:",
        f"{_percentiles(counts.shared_lens)} (the prompt + the common start of the {rows})",
    )
    if counts.common_lens:
        _line(f"common start of the {rows}:", f"{_percentiles(counts.common_lens)} (in the shared prefix)")
    _line("each completion after the shared prefix:", f"{_percentiles(counts.rest_lens)} (tokens, not shared)")
    per = "positions per example, main and KL rows:" if args.trainer == "kto" else "positions per example:"
    _line(per, f"stock {counts.stock_tokens / n:.1f}, shared {counts.shared_tokens / n:.1f} (tokens, no padding)")
    padded = f"stock {counts.stock_padded / n:.1f}, shared {counts.shared_padded / n:.1f}"
    if args.trainer in PREFERENCE_TRAINERS:
        _, _, shared_packed = _packing(counts.shared_units, batch_size, n)
        _, _, unshared_packed = _packing(counts.unshared_units, batch_size, n)
        padded += f"; packed rows: unshared {unshared_packed:.1f}, shared {shared_packed:.1f}"
    elif args.trainer in PAIRED_TRAINERS and args.prefix_sharing_score_padding:
        padded += " (each stock row's padding computed too, as with prefix_sharing_score_padding=True)"
    _line(f"with padding, batches of {batch_size}:", padded)
    _line("examples with no shared prefix:", f"{counts.no_prefix:,}")
    if args.trainer in PREFERENCE_TRAINERS:
        for name, units in (("shared", counts.shared_units), ("unshared", counts.unshared_units)):
            length, efficiency, _ = _packing(units, batch_size, n)
            _line(f"packing, {name} rows of {length} tokens:", f"{100 * efficiency:.1f}% of row tokens used")


def _print_speedups(args, counts: _PreferenceCounts) -> list[float]:
    """The report's ideal speedups; returns the ones the verdict weighs (what training can deliver)."""
    ideal = counts.stock_tokens / max(counts.shared_tokens, 1)
    padded = counts.stock_padded / max(counts.shared_padded, 1)
    batch_size = args.per_device_train_batch_size
    formula = (
        "(2p+c+c')/(p+c+c') for an example, p the shared prefix, c and c' the rest of its main and KL completions"
        if args.trainer == "kto"
        else "2(p+c)/(p+2c) for a pair, p the shared prefix, c the rest of a completion"
    )
    _line("ideal speedup, linear layers:", f"{ideal:.2f}x (stock / shared tokens, padding not counted; {formula})")
    computed = "stock's padded rows / the shared rows: the positions each computes"
    if args.trainer in PAIRED_TRAINERS:
        computed += (
            "; the shared rows compute each stock row's padding too, prefix_sharing_score_padding=True"
            if args.prefix_sharing_score_padding
            else "; the shared rows skip stock's padding, prefix_sharing_score_padding=False"
        )
    _line(f"ideal with padding, batches of {batch_size}:", f"{padded:.2f}x ({computed})")
    if args.trainer in PAIRED_TRAINERS:
        other = not args.prefix_sharing_score_padding
        what = (
            "each stock row's padding computed too, so that the logits/chosen and logits/rejected metrics are stock's"
            if other
            else "the padding not computed; only the logits/chosen and logits/rejected metrics change"
        )
        _line(
            f"  prefix_sharing_score_padding={other}:",
            f"{counts.stock_padded / max(counts.other_padded, 1):.2f}x ({what})",
        )
    attention = counts.stock_attention / max(counts.shared_attention, 1)
    _line("ideal speedup, attention:", f"{attention:.2f}x (stock / shared query-key pairs, padding not counted)")
    if args.trainer != "kto":
        return [ideal, padded]
    step = counts.step_stock / max(counts.step_shared, 1)
    rule = {
        None: "when a batch's prompt tokens exceed twice its KL completion tokens",
        True: "prefix_sharing_merge_kl=True",
        False: "prefix_sharing_merge_kl=False",
    }[args.prefix_sharing_merge_kl]
    _line(
        "policy's gradient pass with the KL rows:",
        f"{counts.merged} of {counts.batches:,} batches ({rule}); the others run the main rows and the KL "
        "rows apart, where different prompts share nothing",
    )
    _line(
        "ideal speedup of a training step:",
        f"{step:.2f}x (with padding: the policy's main and KL passes and the reference's, a pass with gradients "
        "weighted 3 for its backward)",
    )
    return [ideal, padded, step]


def _print_preference_report(args, counts: _PreferenceCounts) -> None:
    n = len(counts.shared_lens)
    examples = _count(n, "example")
    print(f"Dataset {args.dataset_name} ({examples} after TRL's preprocessing; {args.trainer}, {_limits(args)})")
    _line("model:", args.model_note)
    _print_lengths(args, counts)
    figures = _print_speedups(args, counts)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    ratio = median(counts.shared_lens) / max(median(counts.rest_lens), 1)
    print(f"  expected training speedup from sharing (median shared prefix / rest of a completion {ratio:.2f}):")
    lines, expected = expected_speedups(args.trainer, ratio, figures[0], figures[1])
    for line in lines:
        print(line)
    print(f"  verdict: prefix sharing {_verdict(min(figures + expected))} on this dataset.")


def preference_report(dataset, tokenizer, args) -> None:
    """The report on data with its completions (`--trainer dpo`, `reward`, `kto`, `orpo` or `cpo`): prepared as the
    trainer prepares it, its stock rows laid out as training lays them out."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pad, batch_size, max_length = tokenizer.pad_token_id, args.per_device_train_batch_size, args.max_length or None
    if args.trainer in PREFERENCE_TRAINERS:
        dataset, base = _prepared_preferences(dataset, tokenizer, args)
        counts = _measure_preferences(dataset, base, pad, batch_size)
    elif args.trainer == "kto":
        with _quiet_preprocessing(dataset):
            dataset = _preprocess("KTOTrainer", kto_dataset, dataset, tokenizer, max_length, batch_size)
        counts = _measure_kto(dataset, pad, args) if len(dataset) else _PreferenceCounts()
    else:
        with _quiet_preprocessing(dataset):
            dataset = _preprocess(
                TRAINER_CLASSES[args.trainer], paired_dataset, dataset, tokenizer, args.trainer, args.max_length
            )
        counts = _measure_paired(dataset, pad, batch_size, args.prefix_sharing_score_padding)
    if not counts.shared_lens:
        limit = f"longer than --max_length {max_length}" if max_length else "empty after tokenization"
        raise StatsError(f"no examples left after TRL's preprocessing: all were {limit}; raise --max_length")
    _print_preference_report(args, counts)


# --------------------------------------------------------------------------------------------------- SFT
#
# This package's SFT trainer, built on a tiny stand-in model (`prepared.prepared_trainer`): TRL's own SFT
# preparation, and the trainer's own collator (TRL's, wrapped in `PrefixSharingCollator` with the SFT trainer's
# examples and prompts), so the counts are what training lays out (`test_stats_sft_counts_what_a_training_run_logs`).


def sft_trainer(dataset, tokenizer, max_length: int | None, truncation_mode: str, join: str = SFT_JOIN):
    """This package's `SFTTrainer` built on a tiny stand-in model (`prepared.prepared_trainer`): its
    `train_dataset` is `dataset` as TRL prepares it (`input_ids` and `labels` per example, -100 on the tokens it does
    not train on: `text` tokenized as it is, `messages` through the chat template, `prompt` + `completion` with the
    prompt masked by TRL's default `completion_only_loss`; EOS added to text; truncated to `max_length` by
    `truncation_mode`, the examples left with no trained token dropped), and its `data_collator` lays out each
    micro-batch as training does, under the join rule `join`. No packing, no shuffling, no `assistant_only_loss`."""
    from .prepared import prepared_trainer

    return prepared_trainer(
        "sft", dataset, tokenizer, max_length=max_length, truncation_mode=truncation_mode, prefix_sharing_join=join
    )


@dataclass
class _SFTPlanCounts:
    """What one join rule lays out over the whole dataset: per row, the start it shares with another row of its
    shared row and the rest; totals."""

    shared_lens: list[int] = field(default_factory=list)
    rest_lens: list[int] = field(default_factory=list)
    joined: int = 0  # rows laid out in one shared row with another
    tokens: int = 0
    padded: int = 0  # the shared rows, each batch's as wide as its widest
    pairs: int = 0  # query-key pairs the mask lets through


@dataclass
class _SFTCounts:
    rows: int = 0
    batches: int = 0
    prompt_lens: list[int] = field(default_factory=list)  # the rows that have a prompt (a start not trained on)
    row_lens: list[int] = field(default_factory=list)
    stock_tokens: int = 0
    stock_padded: int = 0
    stock_pairs: int = 0
    plans: dict = field(default_factory=dict)  # join rule -> _SFTPlanCounts


def _count_sft_plan(counts: _SFTPlanCounts, plan, rows: list[list[int]]) -> None:
    """Add one micro-batch's plan (`trie.LayoutPlan`) of the stock `rows` to `counts`."""
    from collections import Counter

    order, document = plan.order.tolist(), plan.document.tolist()
    documents = int(plan.num_documents)
    lengths = plan.document_lengths[:documents].tolist()
    counts.tokens += sum(lengths)
    counts.padded += documents * max(lengths)
    counts.pairs += int(plan.visible_pairs)
    # in depth-first order a row shares the most with its neighbours; only those of its own shared row count
    common = [0] * (len(order) + 1)
    for i in range(1, len(order)):
        if document[i] == document[i - 1]:
            common[i] = _common_length(rows[order[i - 1]], rows[order[i]])
    sizes = Counter(document)
    for i, r in enumerate(order):
        shared = max(common[i], common[i + 1])
        counts.shared_lens.append(shared)
        counts.rest_lens.append(len(rows[r]) - shared)
        counts.joined += sizes[document[i]] > 1


def _measure_sft(dataset, collator, batch_size: int) -> _SFTCounts:
    """Each micro-batch of `batch_size` consecutive examples collated and planned by the SFT trainer's own collator
    (`PrefixSharingCollator.plans`): per join rule (`auto`: both plans it chooses from), the positions of the shared
    rows."""
    from ..sft_trainer import prompt_end

    base = collator.base_collator
    counts = _SFTCounts()
    for examples in _batches(dataset.select_columns(["input_ids", "labels"]), batch_size, "Measuring"):
        batch = base(examples)
        rows = [example["input_ids"] for example in examples]
        lengths = [len(row) for row in rows]
        ends = [prompt_end(example["labels"]) for example in examples]
        counts.prompt_lens.extend(end for end, n in zip(ends, lengths, strict=True) if 0 < end < n)
        counts.rows += len(rows)
        counts.batches += 1
        counts.row_lens.extend(lengths)
        counts.stock_tokens += sum(lengths)
        counts.stock_padded += len(rows) * max(lengths)
        counts.stock_pairs += sum(n * (n + 1) // 2 for n in lengths)
        for plan in collator.plans(batch):
            _count_sft_plan(counts.plans.setdefault(plan.join, _SFTPlanCounts()), plan, rows)
    return counts


def _sft_plan_figures(args, counts: _SFTCounts, plan: _SFTPlanCounts) -> list[float]:
    """The lines of one join rule's plan; returns its ideals (padding-free, with padding)."""
    n, batch_size = counts.rows, args.per_device_train_batch_size
    indent = lambda label, text: print(f"    {label:<{_WIDTH - 2}}{text}")  # noqa: E731
    ideal = counts.stock_tokens / max(plan.tokens, 1)
    padded = counts.stock_padded / max(plan.padded, 1)
    indent(
        "shared start of a row, computed once:",
        f"{_percentiles(plan.shared_lens)} (the tokens it has in common with another row of its shared row)",
    )
    indent("each row after its shared start:", f"{_percentiles(plan.rest_lens)} (tokens, not shared)")
    indent("rows sharing a shared row:", f"{plan.joined:,} of {n:,} (the others are laid out alone, as in stock)")
    indent(
        "positions per example:",
        f"stock {counts.stock_tokens / n:.1f}, shared {plan.tokens / n:.1f} (tokens, no padding)",
    )
    indent(
        f"with padding, batches of {batch_size}:", f"stock {counts.stock_padded / n:.1f}, shared {plan.padded / n:.1f}"
    )
    indent("ideal speedup, linear layers:", f"{ideal:.2f}x (stock / shared tokens, padding not counted)")
    indent(
        f"ideal with padding, batches of {batch_size}:",
        f"{padded:.2f}x (stock's padded rows / the shared rows: the positions each computes)",
    )
    attention = counts.stock_pairs / max(plan.pairs, 1)
    indent("ideal speedup, attention:", f"{attention:.2f}x (stock / shared query-key pairs, padding not counted)")
    return [ideal, padded]


def _print_sft_report(args, counts: _SFTCounts, completion_only_loss: bool) -> None:
    n, batch_size = counts.rows, args.per_device_train_batch_size
    max_length = args.max_length or None
    loss = "completion_only_loss=True" if completion_only_loss else "trained on every token"
    print(
        f"Dataset {args.dataset_name} ({_count(n, 'example')} after TRL's preprocessing; sft, "
        f"max_length={max_length}, truncation {args.truncation_mode}; {loss})"
    )
    _line("model:", args.model_note)
    _line(
        "micro-batches:",
        f"{counts.batches:,} of {batch_size} rows in the dataset's order (SFT's sampler is random: "
        'these are the batches train_sampling_strategy="sequential" or group_by_prompt gives)',
    )
    if counts.prompt_lens:
        _line("prompt tokens:", f"{_percentiles(counts.prompt_lens)} (a row's tokens before its first trained label)")
    else:
        _line(
            "prompt tokens:",
            "none: every row trains on all its tokens, so prefix_sharing_join=prompts joins only rows that repeat or "
            "extend another",
        )
    _line("row tokens:", _percentiles(counts.row_lens))
    figures = {}
    for join, plan in counts.plans.items():
        print(f"  prefix_sharing_join={join}:")
        figures[join] = _sft_plan_figures(args, counts, plan)
    if args.prefix_sharing_join == "auto":
        print(
            "  prefix_sharing_join=auto keeps, per micro-batch, whichever plan the step's estimated cost prefers (a "
            "dense kernel pays rows x width^2 for attention, FlexAttention the visible pairs): its positions lie "
            "between the two; the verdict takes the prompts plan"
        )
    _line("expected training speedup:", "no SFT benchmark recorded")
    verdict = figures["prompts" if args.prefix_sharing_join == "auto" else args.prefix_sharing_join]
    print(f"  verdict: prefix sharing {_verdict(min(verdict))} on this dataset.")


def sft_report(dataset, tokenizer, args) -> None:
    """The report on SFT data (`--trainer sft`): prepared as TRL's SFT trainer prepares it, each micro-batch's rows
    laid out as training lays them out."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    first = dataset[0]
    completion_only_loss = "prompt" in first and "completion" in first
    with _quiet_preprocessing(dataset):
        trainer = _preprocess(
            "SFTTrainer",
            sft_trainer,
            dataset,
            tokenizer,
            args.max_length or None,
            args.truncation_mode,
            args.prefix_sharing_join,
        )
    counts = _measure_sft(trainer.train_dataset, trainer.data_collator, args.per_device_train_batch_size)
    _print_sft_report(args, counts, completion_only_loss)


# ------------------------------------------------------------------------------------------ GRPO, RLOO, online DPO


def _check_prompts(prompts: list, start: int) -> None:
    for offset, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list)) or (
            isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m for m in prompt)
        ):
            raise StatsError(
                f"row {start + offset}: 'prompt' is {_one_line(repr(prompt))[:80]}; expected text or a list of "
                "messages (dicts with 'role' and 'content'); fix or drop the row"
            )


def _encode_prompts(prompts: list, chat: list[bool], tokenizer, online: bool) -> list[list[int]]:
    """The token ids of `prompts` as the trainer tokenizes them: GRPO/RLOO (`_tokenize_prompts`) conversational ones
    through the chat template with the generation prompt, text as it is; online DPO (`_generate`) each rendered by
    `maybe_apply_chat_template` and tokenized without special tokens."""
    if online:
        from trl.data_utils import maybe_apply_chat_template

        texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
        return tokenizer(text=texts, add_special_tokens=False)["input_ids"]
    encoded = plain = iter(())
    if any(chat):
        messages = [p for p, c in zip(prompts, chat, strict=True) if c]
        encoded = iter(
            tokenizer.apply_chat_template(
                conversation=messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
    if not all(chat):
        plain = iter(tokenizer(text=[p for p, c in zip(prompts, chat, strict=True) if not c])["input_ids"])
    return [next(encoded) if c else next(plain) for c in chat]


def prompt_lengths(dataset, tokenizer, chunk: int = 256, online: bool = False) -> tuple[list[int], bool]:
    """Token counts of the prompts as TRL's GRPO/RLOO trainers tokenize them (`_tokenize_prompts`): conversational
    ones through the chat template with `add_generation_prompt=True`, text as it is; with `online`, as its online DPO
    trainer does (the chat template applied as text, no special tokens added). Also: whether any was
    conversational."""
    from tqdm.auto import tqdm
    from trl.data_utils import is_conversational

    lengths, conversational = [], False
    for start in tqdm(range(0, len(dataset), chunk), desc="Tokenizing prompts", disable=len(dataset) <= 16 * chunk):
        prompts = dataset[start : start + chunk]["prompt"]
        _check_prompts(prompts, start)
        chat = [is_conversational({"prompt": p}) for p in prompts]
        conversational |= any(chat)
        try:
            lengths.extend(map(len, _encode_prompts(prompts, chat, tokenizer, online)))
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
    return lengths, conversational


def _completion_source(args) -> str:
    """Where the assumed completion length comes from, for the report."""
    online = args.trainer == "online_dpo"
    flag, default, config = (
        ("--max_new_tokens", MAX_NEW_TOKENS, "OnlineDPOConfig")
        if online
        else ("--max_completion_length", MAX_COMPLETION_LENGTH, f"{args.trainer.upper()}Config")
    )
    if args.completion_length != args.max_completion_length:
        return "--completion_length"
    return (
        flag
        + ("" if args.max_completion_length != default else f", TRL's {config} default")
        + ": completions that stop at EOS are shorter; pass their typical length with --completion_length"
    )


def group_report(dataset, tokenizer, args) -> None:
    from ..savings import group_stats

    online = args.trainer == "online_dpo"
    if online:  # the rendering of its prompts re-derived here is still TRL's (the fingerprint of its `_generate`)
        from trl.import_utils import TRLExperimentalWarning

        from ..trl_internals import check_trl_internals

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TRLExperimentalWarning)  # TRL's notice on importing the trainer
            check_trl_internals("stats")
    lengths, conversational = prompt_lengths(dataset, tokenizer, online=online)
    g, c = args.num_generations, args.completion_length
    truncated = keep = 0
    if online:  # TRL cuts the prompts' start so that prompt + completion fit `max_length`
        keep = max(args.max_length - c, 0)
        truncated = sum(p > keep for p in lengths)
        lengths = [min(p, keep) for p in lengths]
    stats = group_stats(lengths, c, g)
    if online:
        tokenized = (
            "chat template as text, no special tokens added"
            if conversational
            else "plain text, no special tokens added"
        )
        what = f"online_dpo, {g} completions per prompt, max_length={args.max_length}"
    else:
        tokenized = "chat template, add_generation_prompt=True" if conversational else "plain text, no chat template"
        what = f"{args.trainer}, num_generations={g}"
    print(f"Dataset {args.dataset_name} ({_count(len(lengths), 'prompt')}; {what})")
    _line("model:", args.model_note)
    _line("assumed completion length:", f"{c} tokens each ({_completion_source(args)})")
    _line("prompt tokens:", f"{_percentiles(lengths)} ({tokenized})")
    if truncated:
        _line(
            "prompts cut to fit --max_length:",
            f"{truncated:,} (their start dropped, as TRL does: {keep} prompt tokens are left beside the completion)",
        )
    print(f"  positions per group (a prompt and its {g} completions; padding not counted):")
    print(f"    {'stock, G(P+C):':<{_WIDTH - 2}}{stats.stock_per_group:,.1f} ({g} rows of prompt + completion)")
    print(
        f"    {'shared, P-1+G(C+1):':<{_WIDTH - 2}}{stats.shared_per_group:,.1f} (the prompt once; each completion "
        "headed by a copy of the prompt's last token)"
    )
    if stats.empty_prompts:
        _line("prompts with no tokens:", f"{stats.empty_prompts:,} (nothing to share)")
    _line(
        "ideal speedup, linear layers:",
        f"{stats.linear_speedup:.2f}x (stock / shared positions), of the passes that score the completions",
    )
    _line("ideal speedup, attention:", f"{stats.attention_speedup:.2f}x (stock / shared query-key pairs)")
    if online:
        print(
            "  the scoring passes: the policy's forward and backward and the reference's log-probs; generation and "
            "the reward model or judge are not sped up, and often take most of a step"
        )
    else:
        print(
            "  the scoring passes: training forward and backward, old-policy and reference log-probs; generation is "
            "not sped up, and often takes most of a step"
        )
    name = "online DPO" if online else args.trainer.upper()
    _line("expected training speedup:", f"no {name} benchmark recorded")
    print(f"  verdict: prefix sharing {_verdict(stats.linear_speedup)} on the scoring passes on this dataset.")


# --------------------------------------------------------------------------------------------------- main


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    offline = go_offline_if_unreachable(args.model_name_or_path, args.dataset_name)
    tokenizer = load_tokenizer(args.model_name_or_path, offline, args.trust_remote_code)
    args.model_note = check_model(args.model_name_or_path, args.trainer, args.trust_remote_code)
    dataset = load_split(args, offline)
    if args.max_examples:
        dataset = dataset.select(range(min(args.max_examples, len(dataset))))
    _check_columns(dataset, args)
    report = group_report if args.trainer in GROUP_TRAINERS else sft_report if args.trainer == "sft" else None
    (report or preference_report)(dataset, tokenizer, args)
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
