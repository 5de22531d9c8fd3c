"""The report on prompt-only data (`--trainer grpo`, `rloo` or `online_dpo`), whose completions are generated during
training: the prompts tokenized as the trainer tokenizes them, each prompt's group counted on its own (`group_stats`),
then micro-batches of consecutive prompts laid out as training lays out the rows it generates
(`trained.GeneratedLayouts`), each completion of an assumed length."""

from __future__ import annotations

import os
import warnings

from ...trainers import TRAINERS as TRAINER_SPECS
from .defaults import MAX_COMPLETION_LENGTH, MAX_NEW_TOKENS
from .preprocessing import tokenized_prompts
from .reports import _WIDTH, _count, _line, _percentiles, _print_trained, _verdict
from .speedups import measured_group_speedups
from .trained import GeneratedLayouts, cost_model, generated_shift


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


def _rows(prompts: list[list[int]], generations: int, online: bool) -> list[list[int]]:
    """The rows TRL generates for a micro-batch of `prompts`: GRPO/RLOO each prompt `generations` times in a row (its
    sampler repeats each index), online DPO all the prompts, then all again (rows i and B + i are prompt i's pair)."""
    return prompts + prompts if online else [ids for ids in prompts for _ in range(generations)]


def _laid_out(dataset, tokenizer, args, layouts: GeneratedLayouts):
    """Tokenize the prompts (online DPO: cut to fit `--max_length` as TRL cuts them) and lay out each micro-batch of
    consecutive prompts (`layouts.add`). Returns the prompts' lengths, how many were cut, whether any was
    conversational, and the prompts at the end left out of the counts (GRPO/RLOO: fewer than a micro-batch, which
    TRL's sampler drops, unless the dataset holds no whole micro-batch: then those are counted, and the number is
    negative)."""
    online, generations = args.trainer == "online_dpo", args.num_generations
    per_batch = args.per_device_train_batch_size // (1 if online else generations)
    keep = max(args.max_length - args.completion_length, 0) if online else None
    lengths, truncated, conversational, batch = [], 0, False, []
    for ids, chat in tokenized_prompts(dataset, tokenizer, online=online):
        conversational |= chat
        if keep is not None and len(ids) > keep:  # TRL cuts the prompts' start to fit `max_length`
            ids, truncated = ids[len(ids) - keep :], truncated + 1
        lengths.append(len(ids))
        batch.append(ids)
        if len(batch) == per_batch:
            layouts.add(_rows(batch, generations, online), len(batch))
            batch = []
    left = len(batch)
    if batch and (online or not layouts.counts["sdpa"].batches):  # online DPO's dataloader keeps a last one
        layouts.add(_rows(batch, generations, online), len(batch))
        left = 0 if online else -left
    return lengths, truncated, conversational, left


def _trained_lines(args, shift_text: str, left: int) -> list[tuple[str, str]]:
    """The lines on what the micro-batches counted hold, before the kernels' blocks."""
    sampler = (
        "the trainer's sampler draws them at random; consecutive prompts stand in for its draws"
        if args.trainer == "online_dpo"
        else "TRL's sampler draws them at random (shuffle_dataset=True): these are the micro-batches "
        "shuffle_dataset=False gives"
    )
    lines = [
        ("prompts:", f"in the dataset's order; {sampler}"),
        (
            "completions:",
            f"{args.completion_length} tokens each, of its own: completions share nothing beyond their prompt "
            "(sampled ones that start alike share more in training)",
        ),
        ("positions of a shared start:", shift_text),
    ]
    if left > 0:
        lines.append(
            ("prompts not counted:", f"the last {left:,}, fewer than a micro-batch: TRL's sampler drops them")
        )
    elif left < 0:
        lines.append(
            (
                "prompts counted:",
                f"all {-left:,}, as one micro-batch: fewer than a whole one, so a training run would draw none (TRL's "
                "sampler drops a micro-batch that is not full); pass a smaller --per_device_train_batch_size",
            )
        )
    return lines


def group_report(dataset, tokenizer, args) -> None:
    """The report on prompt-only data: each prompt's group on its own, then micro-batches as training lays them out
    under `--prefix_sharing_join` (`trained.GeneratedLayouts`), whose ideals the verdict weighs."""
    from ...savings import group_stats

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    online = args.trainer == "online_dpo"
    if online:  # the rendering of its prompts re-derived here is still TRL's (the fingerprint of its `_generate`)
        from trl.import_utils import TRLExperimentalWarning

        from ...trl_internals import check_trl_internals

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TRLExperimentalWarning)  # TRL's notice on importing the trainer
            check_trl_internals("stats")
    g, c = args.num_generations, args.completion_length
    shift, shift_text = generated_shift(args.prefix_sharing_join, args.model_config)
    head = TRAINER_SPECS[args.trainer].model_head
    model, note = cost_model(args.model_config, tokenizer, head, args.trust_remote_code)
    layouts = GeneratedLayouts(model, tokenizer.pad_token_id, args.prefix_sharing_join, c, shift, online)
    lengths, truncated, conversational, left = _laid_out(dataset, tokenizer, args, layouts)
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
        keep = max(args.max_length - c, 0)
        _line(
            "prompts cut to fit --max_length:",
            f"{truncated:,} (their start dropped, as TRL does: {keep} prompt tokens are left beside the completion)",
        )
    print(f"  positions per group, each on its own (a prompt and its {g} completions; padding not counted):")
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
    per_batch = args.per_device_train_batch_size // (1 if online else g)
    kind = "completions" if online else "generations"
    batches = f"{per_batch * g} rows ({_count(per_batch, 'prompt')} x {g} {kind})"
    figures = _print_trained(args, layouts.counts, note, batches, _trained_lines(args, shift_text, left), "prompt")
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
    median = sorted(lengths)[len(lengths) // 2]
    print(f"  measured in the benchmarks (the nearest profile, median prompt / completion {median / c:.2f}):")
    for line in measured_group_speedups(args.trainer, median / c, g):
        print(line)
    print(f"  verdict: prefix sharing {_verdict(min(figures))} on the scoring passes on this dataset.")
