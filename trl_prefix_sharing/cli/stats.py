"""`trl-prefix-sharing stats`: does prefix sharing pay on this dataset? Loads the tokenizer only.

Tokenizes the dataset exactly as TRL's trainer would (same preprocessing, same truncation), runs the real collator and
reports the prompt/completion length distribution, token positions per example with and without sharing and
packing, and the predicted speedup: the ideal `2(p+c)/(p+2c)` for the linear layers (measured on this dataset as
stock / shared positions) and for attention, and the expected one: the ideal times the share of ideal that
`scripts/benchmark.py --record` measured on the benchmark profile whose prompt/completion ratio is nearest to this
dataset's (`trl_prefix_sharing/data/measured_speedups.json`, one entry per device kind measured).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from importlib import resources


MEASURED_SPEEDUPS = "measured_speedups.json"


def measured_speedups() -> dict:
    """What `scripts/benchmark.py --record` measured: {mode: {"device", "command", kind: {profile: {...}}}}."""
    path = resources.files("trl_prefix_sharing") / "data" / MEASURED_SPEEDUPS
    return json.loads(path.read_text()) if path.is_file() else {}


def expected_speedup_lines(kind: str, ratio: float, linear_ideal: float) -> list[str]:
    """The expected speedup on a dataset of prompt/completion ratio `ratio`, from the nearest measured profile."""
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


def _attention_cost(prefix: int, branches: list[int]) -> int:
    """Query-key pairs a causal mask allows: the shared layout vs separate rows (each of prefix + branch)."""
    cost = prefix * (prefix + 1) // 2
    for b in branches:
        cost += b * prefix + b * (b + 1) // 2
    return cost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trl-prefix-sharing stats", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dataset_name", required=True, help="hub id, or a local JSON/JSONL/Parquet file or directory"
    )
    parser.add_argument("--dataset_config", default=None)
    parser.add_argument("--dataset_train_split", default="train")
    parser.add_argument("--model_name_or_path", required=True, help="where to load the tokenizer from")
    parser.add_argument("--trainer", choices=["dpo", "reward"], default="dpo")
    parser.add_argument("--max_length", type=int, default=1024, help="as in DPOConfig/RewardConfig (0: none)")
    parser.add_argument("--truncation_mode", default="keep_start", choices=["keep_start", "keep_end"])
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--max_examples", type=int, default=None, help="look at the first N examples only")
    args = parser.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from ..collator import PrefixSharingCollator
    from ..config import DPOConfig, RewardConfig
    from ..dpo_trainer import DPO_COLUMNS
    from ..layout import shared_positions
    from ..reward_trainer import REWARD_COLUMNS
    from ..sampler import MultipackSampler
    from ..validation import check_dataset_columns
    from .train import load_script_dataset

    class _Script:
        dataset_name, dataset_config = args.dataset_name, args.dataset_config
        dataset_train_split, dataset_streaming = args.dataset_train_split, False

    class _Mixture:
        datasets = None

    dataset = load_script_dataset(_Script, _Mixture)
    if args.dataset_train_split not in dataset:
        raise SystemExit(f"Split {args.dataset_train_split!r} not in the dataset (splits: {list(dataset)}).")
    dataset = dataset[args.dataset_train_split]
    check_dataset_columns(
        dataset, args.dataset_train_split, *(DPO_COLUMNS if args.trainer == "dpo" else REWARD_COLUMNS)
    )
    if args.max_examples:
        dataset = dataset.select(range(min(args.max_examples, len(dataset))))
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    max_length = args.max_length or None

    with tempfile.TemporaryDirectory() as tmp:
        common = dict(output_dir=tmp, max_length=max_length, use_cpu=True, bf16=False, report_to="none")
        if args.trainer == "dpo":
            import trl
            from trl.trainer.dpo_trainer import DataCollatorForPreference

            config = DPOConfig(truncation_mode=args.truncation_mode, **common)
            preparer = object.__new__(trl.DPOTrainer)  # TRL's own preprocessing, without a model
            preparer._tokenizer = tokenizer
            dataset = preparer._prepare_dataset(dataset, tokenizer, config, "train")
            base = DataCollatorForPreference(
                pad_token_id=tokenizer.pad_token_id, max_length=max_length, truncation_mode=args.truncation_mode
            )
        else:
            from trl.trainer.reward_trainer import DataCollatorForPreference

            from ..ranked import RankedCollator, is_ranked_dataset
            from ..reward_trainer import RewardTrainer

            config = RewardConfig(**common)
            ranked = is_ranked_dataset(dataset.column_names)
            dataset = object.__new__(RewardTrainer)._prepare_dataset(dataset, tokenizer, config, "train")
            base = (
                RankedCollator(tokenizer.pad_token_id)
                if ranked
                else DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
            )
    # each example on its own: what every micro-batch saves (one that holds several pairs of a prompt saves more)
    collator = PrefixSharingCollator(base, pad_token_id=tokenizer.pad_token_id, across_examples=False)

    prompt_lens, completion_lens, shared_units, unshared_units = [], [], [], []
    stock_tokens = shared_tokens = stock_attention = shared_attention = no_prefix = 0
    stock_padded = shared_padded = 0  # positions of batches of `per_device_train_batch_size`, padding included
    batch_size = args.per_device_train_batch_size
    chunk = 256 // batch_size * batch_size or batch_size
    for start in tqdm(range(0, len(dataset), chunk), desc="Measuring", disable=len(dataset) <= 4 * chunk):
        examples = [dataset[i] for i in range(start, min(start + chunk, len(dataset)))]
        batch = collator(examples)
        layout = batch["prefix_sharing"]
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        per_doc = (layout["document_ids"] >= 0).sum(dim=1).tolist()
        prefix = shared_positions(layout).sum(dim=1).tolist()  # positions every row of the example reads
        groups = collator.example_groups(batch)
        for first in range(0, len(groups), batch_size):  # consecutive examples stand in for a shuffled batch
            rows = [r for group in groups[first : first + batch_size] for r in group]
            stock_padded += len(rows) * max(lengths[r] for r in rows)
            docs = per_doc[first : first + batch_size]
            shared_padded += len(docs) * max(docs)
        for group, doc_len, p in zip(groups, per_doc, prefix, strict=True):
            rows = [lengths[r] for r in group]
            shared_p = p + 1 if p else 0  # the prefix plus the copy of its last token heading each branch
            prompt_lens.append(shared_p)
            completion_lens.extend(n - shared_p for n in rows)
            stock_tokens += sum(rows)
            shared_tokens += doc_len
            shared_units.append(doc_len)
            unshared_units.append(sum(rows))
            stock_attention += sum(n * (n + 1) // 2 for n in rows)
            shared_attention += _attention_cost(p, [n - p for n in rows])
            no_prefix += p == 0
    n = len(prompt_lens)
    if n == 0:
        raise SystemExit("No examples left after preprocessing (all dropped by max_length?).")
    linear = stock_tokens / max(shared_tokens, 1)
    attention = stock_attention / max(shared_attention, 1)

    def packing(units):
        """Row length (the trainer's default `packing_length`), efficiency, positions per example."""
        length = -(-batch_size * max(units) // 128) * 128
        sampler = MultipackSampler(units, length)
        return length, sampler.efficiency(), len(sampler) * length / n

    shared_len, shared_eff, shared_packed = packing(shared_units)
    unshared_len, unshared_eff, unshared_packed = packing(unshared_units)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    ratio = median(prompt_lens) / max(median(completion_lens), 1)
    print(
        f"Dataset {args.dataset_name} ({n:,} examples after TRL's preprocessing, {args.trainer}, "
        f"max_length={max_length}, {args.truncation_mode})"
    )
    print(f"  shared prefix (prompt) tokens:  {_percentiles(prompt_lens)}")
    print(f"  completion tokens:              {_percentiles(completion_lens)}")
    print(
        f"  positions per example:          stock {stock_tokens / n:.1f}, shared {shared_tokens / n:.1f} "
        f"(tokens, no padding)"
    )
    print(
        f"  {f'with padding, batches of {batch_size}:':<32}stock {stock_padded / n:.1f}, "
        f"shared {shared_padded / n:.1f}; packed rows: unshared {unshared_packed:.1f}, shared {shared_packed:.1f}"
    )
    print(f"  examples with no shared prefix: {no_prefix:,}")
    print(f"  packing (rows of {shared_len} tokens, shared):   {100 * shared_eff:.1f}% of row tokens used")
    print(f"  packing (rows of {unshared_len} tokens, unshared): {100 * unshared_eff:.1f}% of row tokens used")
    print(f"  ideal speedup, linear layers 2(p+c)/(p+2c): {linear:.2f}x; attention: {attention:.2f}x")
    print(f"  expected training speedup from sharing (median prompt/completion {ratio:.2f}):")
    for line in expected_speedup_lines(args.trainer, ratio, linear):
        print(line)
    verdict = "pays" if linear >= 1.15 else "pays little" if linear >= 1.05 else "does not pay"
    print(f"  verdict: prefix sharing {verdict} on this dataset.")
    return 0
