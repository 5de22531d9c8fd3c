"""Packing efficiency of `MultipackSampler` on synthetic lengths shaped like the paper's six datasets (median prompt
and completion lengths, lognormal spread), with and without prefix sharing, beside stock TRL's padded batches.

    python -m benchmarks.packing_efficiency --out docs/benchmarks      # writes packing_efficiency.md and .json
"""

from __future__ import annotations

import argparse
import math
import random

from trl_prefix_sharing import MultipackSampler

from .data import PROFILES
from .results import command_line, document, markdown_table, write_result


def measure(profile, args):
    """One profile: per unit (a pair's shared row, or its two unshared rows) the median length, the packing length
    and the efficiency averaged over the ranks; and stock TRL's padded batches' share of real tokens. Lengths are
    lognormal around the profile's medians (sigma 0.6, unbounded above)."""
    (p, c), rng = PROFILES[profile], random.Random(profile)
    shared, unshared, stock, batch = [], [], [], []

    def draw(rng, median, sigma=0.6):
        return max(1, int(round(median * math.exp(rng.gauss(0, sigma)))))

    for _ in range(args.examples):
        prompt, chosen, rejected = draw(rng, p), draw(rng, c), draw(rng, c)
        prompt = min(prompt, args.max_length - 1)
        chosen, rejected = min(chosen, args.max_length - prompt), min(rejected, args.max_length - prompt)
        shared.append(prompt + chosen + rejected + 1)
        unshared.append(2 * prompt + chosen + rejected)
        batch.append((prompt + chosen, prompt + rejected))
        if len(batch) == args.batch_size:  # stock TRL: 2B rows padded to the longest row of the batch
            longest = max(max(pair) for pair in batch)
            stock.append(sum(a + b for a, b in batch) / (2 * len(batch) * longest))
            batch = []
    result = {"stock_padded_efficiency": sum(stock) / len(stock)}
    for unit, lengths in (("shared", shared), ("unshared", unshared)):
        length = -(-args.batch_size * max(lengths) // 128) * 128
        samplers = [MultipackSampler(lengths, length, num_replicas=args.ranks, rank=r) for r in range(args.ranks)]
        efficiency = sum(sampler.efficiency() for sampler in samplers) / args.ranks
        result[unit] = dict(median=sorted(lengths)[len(lengths) // 2], packing_length=length, efficiency=efficiency)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--max-length", type=int, default=2048, help="max_length (keep_start truncation)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--out", default=None, help="write packing_efficiency.md and .json here")
    args = parser.parse_args()
    results = {profile: measure(profile, args) for profile in PROFILES}
    rows = []
    for profile, r in results.items():
        rows.append([profile, "{} / {}".format(*PROFILES[profile])])
        for unit in (r["shared"], r["unshared"]):
            rows[-1] += [f"median {unit['median']}, row {unit['packing_length']}", f"{100 * unit['efficiency']:.1f}%"]
        rows[-1].append(f"{100 * r['stock_padded_efficiency']:.1f}%")
    header = "profile|median p / c|unit: shared (tokens)|efficiency, shared|unit: unshared|efficiency, unshared|"
    header += "padded batches (stock, no packing)"
    command = command_line("packing_efficiency")
    lines = document(
        f"Packing efficiency (used / available tokens of the rows yielded), {args.examples:,} synthetic examples per "
        f"profile, packing_length = {args.batch_size} x longest unit rounded up to 128, {args.ranks} ranks.",
        markdown_table(header, rows),
        f"Command: `{command}`",
    )
    if args.out:
        data = {"command": command, "device": "none (lengths only)", "args": vars(args), "results": results}
        write_result(args.out, "packing_efficiency", data, lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
