"""The command line of `stats`: its flags (`--help` prints them after the package's docstring), the check that each
flag given applies to `--trainer`, and TRL's defaults (`defaults.py`) for the flags not given."""

from __future__ import annotations

import argparse

from .defaults import (
    BATCH_SIZE,
    CHOICES,
    DATA_TRAINERS,
    GROUP_TRAINERS,
    MAX_COMPLETION_LENGTH,
    MAX_LENGTHS,
    MAX_NEW_TOKENS,
    NUM_GENERATIONS,
    ORPO_DEFAULT_LENGTH,
    PAIRED_TRAINERS,
    SFT_JOIN,
    SFT_JOINS,
    TRUNCATION_MODE,
)
from .errors import PROG, StatsError


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
    from . import __doc__ as description  # the command's help: the package's docstring

    parser = _Parser(prog=PROG, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dataset_name", required=True, help="Hub id, or a local JSON/JSONL/Parquet/CSV file or directory"
    )
    parser.add_argument("--dataset_config", default=None)
    parser.add_argument("--dataset_train_split", default="train")
    parser.add_argument(
        "--model_name_or_path",
        required=True,
        help="the model: its tokenizer and its config, no weights: for the architecture check training applies, "
        "the cost model by which prefix_sharing_join=auto chooses a layout, and (grpo, rloo, online_dpo) whether "
        "the model is measured shift-invariant, so that prompts of any length share their start",
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
    layout = parser.add_argument_group("every trainer: the micro-batches training lays out")
    layout.add_argument(
        "--per_device_train_batch_size",
        type=_int_at_least(1),
        default=None,
        help="as in the trainer's config: the rows training lays out together, and the padding and packing estimates "
        "and KTO's KL rows; dpo, reward, kto, orpo, cpo and sft: examples per micro-batch; grpo and rloo: rows per "
        "micro-batch, a multiple of --num_generations (its prompts x their generations, one micro-batch per "
        "generation batch as TRL's default steps_per_generation gives); online_dpo: prompts per micro-batch, 2 "
        f"completions each (default: TRL's, {BATCH_SIZE})",
    )
    layout.add_argument(
        "--prefix_sharing_join",
        choices=SFT_JOINS,
        default=None,
        help="as in the trainer's config: which rows of a micro-batch join one shared row: rows that share a prompt "
        "(prompts: a prompt's several pairs, completions or generations), rows that share any start of two tokens "
        "or more, whichever examples they come from (always: a system prompt, a preamble, tool schemas), or per "
        "micro-batch the plan of the two whose estimated cost for the model is lower (auto; the report counts what "
        "it keeps). grpo, rloo and online_dpo left-pad their prompts: always shares a start between prompts of any "
        "length where the model is measured shift-invariant (the report says whether it is), else between prompts "
        f"of one length only (default: {SFT_JOIN})",
    )
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
        help="the assumed length of every generated completion, in tokens, each laid out with tokens of its own "
        "(completions share nothing beyond their prompt) (default: --max_completion_length, or --max_new_tokens for "
        "online_dpo, the longest TRL generates; completions that stop at EOS are shorter, so pass the typical length "
        "you see)",
    )
    return parser


#: the flags that apply to some trainers only
_APPLIES_TO = {
    "max_length": (*DATA_TRAINERS, "sft", "online_dpo"),
    "truncation_mode": ("dpo", "sft"),
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
}


def _does_not_apply(flag: str, trainer: str) -> str:
    """The error for `--flag` given with `--trainer trainer`, which it does not apply to: one line with the way out."""
    where = _APPLIES_TO[flag]
    listed = ", ".join(where[:-1]) + f" or {where[-1]}" if len(where) > 1 else where[0]
    why = _WHY_NOT.get((flag, trainer))
    if why is None and trainer in ("grpo", "rloo"):
        why = f"with --trainer {trainer} the prompts are not truncated"
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
        args.per_device_train_batch_size = args.per_device_train_batch_size or BATCH_SIZE
        args.prefix_sharing_join = args.prefix_sharing_join or SFT_JOIN
        if args.trainer != "online_dpo" and args.per_device_train_batch_size % args.num_generations:
            raise StatsError(
                f"--per_device_train_batch_size {args.per_device_train_batch_size} is not a multiple of "
                f"--num_generations {args.num_generations}: a micro-batch holds whole groups of a prompt's "
                f"generations (TRL requires its generation batch, per_device_train_batch_size x steps_per_generation, "
                "to be a multiple of num_generations; the report counts one micro-batch per generation batch, its "
                f"default); pass a multiple of {args.num_generations}"
            )
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
    args.prefix_sharing_join = args.prefix_sharing_join or SFT_JOIN
    return args
