"""The reports `stats` prints, one per kind of data: data with its completions (`preference_report`: DPO, reward,
KTO, ORPO, CPO) and SFT data (`sft_report`); prompt-only data, whose completions are generated during training, has its
own (`groups.group_report`: GRPO, RLOO, online DPO), from this module's pieces. Each prepares the dataset, counts its
positions and prints the lengths, the ideal speedups, the expected one where a benchmark is recorded, and the
verdict."""

from __future__ import annotations

import os

from ...trainers import TRAINERS as TRAINER_SPECS
from .counting import (
    _measure_kto,
    _measure_paired,
    _measure_preferences,
    _measure_sft,
    _packing,
    _PreferenceCounts,
    _SFTCounts,
    _SFTPlanCounts,
)
from .defaults import PAIRED_TRAINERS, PREFERENCE_TRAINERS, TRAINER_CLASSES
from .errors import StatsError
from .preprocessing import (
    _prepared_preferences,
    _preprocess,
    _quiet_preprocessing,
    kto_trainer,
    paired_trainer,
    sft_trainer,
)
from .speedups import expected_speedups
from .trained import (
    TrainedCounts,
    cost_model,
    kernel_collators,
    measure_kto,
    measure_paired,
    measure_trained,
    print_trained,
)


def _percentiles(values, points=(10, 50, 90, 99)):
    ordered = sorted(values)
    if not ordered:
        return "-"
    return ", ".join(f"p{p} {ordered[min(len(ordered) - 1, len(ordered) * p // 100)]}" for p in points)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _verdict(speedup: float) -> str:
    return "pays" if speedup >= 1.15 else "pays little" if speedup >= 1.05 else "does not pay"


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
    """The report's ideal speedups, each example on its own; returns them."""
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
        "rows apart, where different prompts share nothing when each example is laid out on its own",
    )
    _line(
        "ideal speedup of a training step:",
        f"{step:.2f}x (with padding: the policy's main and KL passes and the reference's, a pass with gradients "
        "weighted 3 for its backward)",
    )
    return [ideal, padded, step]


def _print_trained(
    args, trained: dict[str, TrainedCounts], note: str | None, batches: str = "", lines=(), unit: str = "example"
) -> list[float]:
    """The report's lines on what training lays out (DPO, reward, KTO, ORPO, CPO; SFT with `auto`; GRPO, RLOO and
    online DPO); returns their ideals (KTO: those of a training step). `batches`: what a micro-batch holds (default:
    `--per_device_train_batch_size` consecutive examples); `lines`: `(label, text)` lines before the kernels' blocks;
    `unit`: what the counts are per."""
    join = args.prefix_sharing_join
    batches = batches or f"{args.per_device_train_batch_size} consecutive examples"
    how = (
        "prefix_sharing_join=auto keeps, per micro-batch, whichever plan the step's estimated cost for this model "
        "prefers: a dense kernel pays rows x width^2 for attention, varlen and FlexAttention the visible pairs"
        if join == "auto"
        else f"prefix_sharing_join={join}"
    )
    print(f"  as training lays it out, in micro-batches of {batches}; {how}:")
    if note:
        print(f"    ({note})")
    for label, text in lines:
        _line(f"  {label}", text)
    kto = "the policy's pass over the main and KL rows: " if args.trainer == "kto" else ""
    print_trained(trained, _WIDTH, kto, unit)
    return [figure for counts in trained.values() for figure in counts.figures]


def _print_preference_report(args, counts: _PreferenceCounts, trained: dict, note: str | None) -> None:
    """The report: each example on its own (`counts`), then as training lays it out (`trained`), whose ideals (KTO:
    those of a training step) the expected speedup scales and the verdict weighs."""
    n = len(counts.shared_lens)
    examples = _count(n, "example")
    print(f"Dataset {args.dataset_name} ({examples} after TRL's preprocessing; {args.trainer}, {_limits(args)})")
    _line("model:", args.model_note)
    _print_lengths(args, counts)
    _print_speedups(args, counts)
    figures = _print_trained(args, trained, note)
    step = "of a training step " if args.trainer == "kto" else ""
    basis, scaled = f"of the ideals {step}as training lays it out with SDPA; ", tuple(trained["sdpa"].figures)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    ratio = median(counts.shared_lens) / max(median(counts.rest_lens), 1)
    print(
        f"  expected training speedup from sharing ({basis}median shared prefix / rest of a completion {ratio:.2f}):"
    )
    lines, expected = expected_speedups(args.trainer, ratio, *scaled)
    for line in lines:
        print(line)
    print(f"  verdict: prefix sharing {_verdict(min(figures + expected))} on this dataset.")


def preference_report(dataset, tokenizer, args) -> None:
    """The report on data with its completions (`--trainer dpo`, `reward`, `kto`, `orpo` or `cpo`): prepared as the
    trainer prepares it, its stock rows laid out as training lays them out, each example on its own, then in
    micro-batches as training lays them out (`trained.py`: DPO and reward by the trainer's collator, KTO, ORPO and CPO
    as the trainer's step lays out the rows it builds)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pad, batch_size, max_length = tokenizer.pad_token_id, args.per_device_train_batch_size, args.max_length or None
    if args.trainer in PREFERENCE_TRAINERS:
        dataset, collator = _prepared_preferences(dataset, tokenizer, args)
        counts = _measure_preferences(dataset, collator.base_collator, pad, batch_size)
        measure = lambda model: measure_trained(dataset, collator, model, batch_size)  # noqa: E731
    elif args.trainer == "kto":
        with _quiet_preprocessing(dataset):
            trainer = _preprocess(
                "KTOTrainer",
                kto_trainer,
                dataset,
                tokenizer,
                max_length,
                batch_size,
                args.prefix_sharing_join,
                args.prefix_sharing_merge_kl,
            )
        counts = _measure_kto(trainer.train_dataset, pad, args) if len(trainer.train_dataset) else _PreferenceCounts()
        measure = lambda model: measure_kto(trainer, model, batch_size)  # noqa: E731
    else:
        with _quiet_preprocessing(dataset):
            trainer = _preprocess(
                TRAINER_CLASSES[args.trainer],
                paired_trainer,
                dataset,
                tokenizer,
                args.trainer,
                args.max_length,
                args.prefix_sharing_score_padding,
                args.prefix_sharing_join,
            )
        counts = _measure_paired(trainer.train_dataset, pad, batch_size, args.prefix_sharing_score_padding)
        measure = lambda model: measure_paired(trainer, model, batch_size)  # noqa: E731
    if not counts.shared_lens:
        limit = f"longer than --max_length {max_length}" if max_length else "empty after tokenization"
        raise StatsError(f"no examples left after TRL's preprocessing: all were {limit}; raise --max_length")
    head = TRAINER_SPECS[args.trainer].model_head
    model, note = cost_model(args.model_config, tokenizer, head, args.trust_remote_code)
    _print_preference_report(args, counts, measure(model), note)


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


def _print_sft_report(args, counts: _SFTCounts, completion_only_loss: bool, note: str | None) -> None:
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
    if args.prefix_sharing_join == "auto":  # the verdict weighs the plans training keeps
        verdict = _print_trained(args, counts.trained, note)
        scaled = counts.trained["sdpa"].figures
        basis = "as training lays it out with SDPA"
    else:
        verdict = scaled = figures[args.prefix_sharing_join]
        basis = f"of prefix_sharing_join={args.prefix_sharing_join}"
    print(
        f"  expected training speedup from sharing (the ideal with padding {basis}, times the share of it measured "
        "on the profile of nearest ideal with padding):"
    )
    lines, expected = expected_speedups("sft", 0.0, *scaled, by="padded_ideal")
    for line in lines:
        print(line)
    print(f"  verdict: prefix sharing {_verdict(min(verdict + expected))} on this dataset.")


def sft_report(dataset, tokenizer, args) -> None:
    """The report on SFT data (`--trainer sft`): prepared as TRL's SFT trainer prepares it, each micro-batch's rows
    laid out as training lays them out (under `auto`, by the cost model of the model given: `trained.py`)."""
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
    model, note = cost_model(args.model_config, tokenizer, "causal_lm", args.trust_remote_code)
    kernels = kernel_collators(trainer.data_collator, model)
    counts = _measure_sft(trainer.train_dataset, trainer.data_collator, args.per_device_train_batch_size, kernels)
    _print_sft_report(args, counts, completion_only_loss, note)
