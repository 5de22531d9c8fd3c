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

Each micro-batch of `--per_device_train_batch_size` consecutive examples is then counted as training lays it out
(`trained.py`): DPO and reward through the trainer's own collator; ORPO and CPO their chosen and rejected rows as
the trainer's collator and TRL's `concatenated_inputs` build them in the step, KTO its main and KL rows (the
policy's pass over both in one layout where `--prefix_sharing_merge_kl` merges them, else one layout each), laid out
as the trainer's step lays them out. All under `--prefix_sharing_join` (as in the configs: `prompts` joins the rows of
a prompt, `always` also rows of different prompts that share a start, such as a system prompt; `auto`, the default,
keeps per micro-batch the plan of lower estimated cost), by training's `build_layout` with the cost model of the model
given (its config, built without weights) under SDPA, the kernel `auto` takes on the CPU, and under varlen, CUDA's
first choice. The report prints how many micro-batches (KTO: layouts) were joined across examples and the positions
(those a run logs as `num_shared_tokens`; KTO also a training step's), and the verdict weighs them. With
`prefix_sharing_attn_implementation="auto"` training may also run another kernel, or stock's own rows, where it
measures them faster: that choice is made by measured time, which no count can predict.

The expected speedup is the ideal with padding as training lays it out with SDPA (KTO: that of a training step)
times the share of it that the recorded benchmark reached on the profile whose shared prefix/rest ratio is nearest to
this dataset's, one line per device recorded (`trl_prefix_sharing/data/measured_speedups.json`, derived from
`docs/benchmarks` by `python -m benchmarks.record`); a device with no record says so. It is never printed above the
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
  (by default: when a batch's prompt tokens exceed twice its KL completion tokens), so a training step is reported too,
  each example on its own and as training lays it out (the latter's ideal is the one the expected speedup scales).

SFT data (`--trainer sft`: `text`, `messages`, or `prompt` + `completion`, text or conversational): prepared by the
SFT trainer itself, built on a tiny stand-in model (`cli/prepared.py`), so TRL's own preparation runs (EOS
added to text, the prompt masked for prompt-completion data as TRL's default `completion_only_loss` does, truncated to
`--max_length` by `--truncation_mode`). Each example is one row; its prompt
is its tokens before its first trained label. SFT's sampler is random, so the micro-batches counted are
`--per_device_train_batch_size` consecutive rows (what `train_sampling_strategy="sequential"` or `group_by_prompt`
gives), collated by TRL's collator and planned by the package's own layout (the SFT trainer's `PrefixSharingCollator`)
under `--prefix_sharing_join`: `prompts` joins rows that share a prompt (a prompt's several completions), `always` also
rows that share only a start (a system prompt, a preamble), `auto` (the default) reports both plans and, as for DPO,
the one training keeps per micro-batch by the cost model of the model given, from which its verdict is taken (with
`prompts` or `always`, from that plan). The expected speedup scales that plan's ideal with padding by the share of it
the recorded SFT benchmark reached on the profile of nearest ideal with padding.

Prompt-only data (`--trainer grpo`, `rloo` or `online_dpo`): the completions are generated during training, so their
length is an assumption (`--completion_length`, by default the longest generation: `--max_completion_length`, or
`--max_new_tokens` for online DPO). Tokenizes the prompts as TRL does (online DPO: their start cut to fit
`--max_length`) and reports, first per group of one prompt and its completions (`--num_generations`; online DPO: 2)
on its own, the positions stock TRL computes, G(P + C), against the shared layout's, P - 1 + G(C + 1) (the prompt
once; each completion headed by a copy of the prompt's last token), padding not counted. Then micro-batches of
consecutive prompts as training lays them out (`groups.py`, `trained.GeneratedLayouts`): GRPO and RLOO
`--per_device_train_batch_size` rows, whole groups of a prompt's G generations (one micro-batch per generation batch,
as TRL's default `steps_per_generation` gives; the last prompts, fewer than a micro-batch, are dropped as TRL's
sampler drops them), online DPO `--per_device_train_batch_size` prompts and their 2 completions each. Each micro-batch
holds the rows TRL scores, `[prompt left-padded to the micro-batch's longest | completion]`, every completion
`--completion_length` tokens of its own (completions share nothing beyond their prompt; sampled ones that start
alike share more in training), laid out by training's `build_layout` under `--prefix_sharing_join` with the cost
model of the model given, under SDPA and varlen, as for the data above. Left padding puts a start that prompts of
other lengths share (a system prompt, tool schemas) at other positions in their rows: training shares it across
prompts of any length (`always`, or `auto` where it keeps that plan) only on models measured shift-invariant, which
it moves to common positions, and otherwise only between prompts of one length; the report says which, and why. It
prints the positions per prompt, those a run logs as `num_shared_tokens`, and the verdict weighs them. What the
recorded benchmark of the trainer measured on the profile of nearest prompt/completion ratio (and the same group size,
where recorded) is quoted as it was measured: the scoring step, and with generation.
"""

from __future__ import annotations

import os
import sys

from .arguments import parse_args
from .defaults import GROUP_TRAINERS
from .errors import PROG, StatsError, _one_line
from .groups import group_report
from .loading import _check_columns, check_model, go_offline_if_unreachable, load_split, load_tokenizer
from .reports import preference_report, sft_report


__all__ = ["main", "run"]

#: set to see the traceback behind an error line
TRACEBACK_VARIABLE = "TRL_PREFIX_SHARING_TRACEBACK"


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    offline = go_offline_if_unreachable(args.model_name_or_path, args.dataset_name)
    tokenizer = load_tokenizer(args.model_name_or_path, offline, args.trust_remote_code)
    args.model_note, args.model_config = check_model(args.model_name_or_path, args.trainer, args.trust_remote_code)
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
