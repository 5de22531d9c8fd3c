"""Packing efficiency of MultipackSampler on synthetic datasets shaped like the paper's six (median prompt and
completion lengths, lognormal spread), with and without prefix sharing. Writes a markdown table.

    python scripts/packing_efficiency.py --out docs/benchmarks/packing_efficiency.md
"""

import argparse
import math
import random

from benchmark import PROFILES  # median prompt / completion tokens of the paper's datasets

from trl_prefix_sharing import MultipackSampler


def draw(rng, median, sigma=0.6):
    return max(1, int(round(median * math.exp(rng.gauss(0, sigma)))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--max-length", type=int, default=2048, help="max_length (keep_start truncation)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [
        f"Packing efficiency (used / available tokens of the rows yielded), {args.examples:,} synthetic examples per "
        f"profile, packing_length = {args.batch_size} x longest unit rounded up to 128, {args.ranks} ranks.",
        "",
        "| profile | median p / c | unit: shared (tokens) | efficiency, shared | unit: unshared "
        "| efficiency, unshared | padded batches (stock, no packing) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (p, c) in PROFILES.items():
        rng = random.Random(name)
        shared, unshared, stock_padding = [], [], []
        batch = []
        for _ in range(args.examples):
            prompt, chosen, rejected = draw(rng, p), draw(rng, c), draw(rng, c)
            prompt = min(prompt, args.max_length - 1)
            chosen, rejected = min(chosen, args.max_length - prompt), min(rejected, args.max_length - prompt)
            shared.append(prompt + chosen + rejected + 1)
            unshared.append(2 * prompt + chosen + rejected)
            batch.append((prompt + chosen, prompt + rejected))
            if len(batch) == args.batch_size:  # stock TRL: 2B rows padded to the longest row of the batch
                longest = max(max(pair) for pair in batch)
                stock_padding.append(sum(a + b for a, b in batch) / (2 * len(batch) * longest))
                batch = []
        row = [name, f"{p} / {c}"]
        for lengths in (shared, unshared):
            length = -(-args.batch_size * max(lengths) // 128) * 128
            sampler = MultipackSampler(lengths, length, num_replicas=args.ranks, rank=0)
            efficiency = (
                sum(
                    MultipackSampler(lengths, length, num_replicas=args.ranks, rank=r).efficiency()
                    for r in range(args.ranks)
                )
                / args.ranks
            )
            row += [f"median {sorted(lengths)[len(lengths) // 2]}, row {length}", f"{100 * efficiency:.1f}%"]
            del sampler
        row.append(f"{100 * sum(stock_padding) / len(stock_padding):.1f}%")
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        f"Command: `python scripts/packing_efficiency.py --examples {args.examples} --batch-size "
        f"{args.batch_size} --max-length {args.max_length} --ranks {args.ranks}`",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
