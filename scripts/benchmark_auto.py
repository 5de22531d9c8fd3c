"""`"auto"` against each fixed choice, on the DPO and reward profiles of `scripts/benchmark.py`.

    python scripts/benchmark_auto.py --out docs/benchmarks/auto_cpu          # tiny model, ~25 minutes on 2 cores
    python scripts/benchmark_auto.py --model smollm2 --kinds dpo --profiles HH-RLHF,TLDR,UltraFeedback --pairs 8 \
        --out docs/benchmarks/auto_smollm2                                   # SmolLM2-135M-Instruct, ~20 minutes

Four variants train the same model on the same pairs, in one process: stock TRL, prefix sharing with
`prefix_sharing_attn_implementation="auto"` (which chooses per micro-batch between stock's own rows and each kernel
that can run, by times measured on the device and refined by the training steps), and prefix sharing fixed to each
kernel that runs on the CPU (`"sdpa"`, `"varlen"`). After a warm-up epoch each (in which `"auto"` measures its
candidates at the first micro-batch and its close candidates take their turns; more epochs for `"auto"` until they
have, where epochs are short), the timed epochs are interleaved in a
rotating order and throughput comes from the median epoch, as a ratio to stock's from the same run (the machine is
noisy). Reported per profile: each variant's speedup over stock, `"auto"`'s over the fastest fixed kernel, which
candidate `"auto"` ran for the timed micro-batches, its start-up and training-step lines, and what its start-up
measurement cost (seconds, and as a share of a 100-step run at its own median step). Writes `<name>.md` and
`<name>.json` to `--out`.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import shlex
import statistics
import sys
import tempfile


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark as bench  # noqa: E402


VARIANTS = ["stock", "sharing", "sharing-sdpa", "sharing-varlen"]
LABELS = {"stock": "stock", "sharing": "auto", "sharing-sdpa": "sdpa", "sharing-varlen": "varlen"}


class KernelCounter:
    """Counts the candidate each collated micro-batch was laid out for (`Layout.kernel`; a fixed kernel's layouts
    name none)."""

    def __init__(self, collator):
        self.collator, self.kernels = collator, collections.Counter()

    def __getattr__(self, name):
        return getattr(self.collator, name)

    def __call__(self, examples):
        batch = self.collator(examples)
        layout = batch.get("prefix_sharing")
        self.kernels["stock TRL" if layout is None else layout.kernel or "fixed"] += 1
        return batch


def run_profile(kind, model, tokenizer, dataset, args, tmp):
    trainers = {v: bench.make_trainer(kind, v, model, tokenizer, dataset, args, tmp) for v in VARIANTS}
    for trainer in trainers.values():
        trainer.kernels = KernelCounter(trainer.data_collator)
        trainer.data_collator = trainer.kernels
    tuning = trainers["sharing"].sharing_session.tuning
    for trainer in trainers.values():  # warm-up: "auto" measures here, and its close candidates take their turns
        bench.train_one_epoch(trainer, False)
    for _ in range(4):  # "auto"'s warm-up lasts until they took them (short epochs: a few micro-batches)
        if tuning.settled and (tuning.refined is not None or not tuning.contenders):
            break
        bench.train_one_epoch(trainers["sharing"], False)
    for trainer in trainers.values():
        trainer.kernels.kernels.clear()
        trainer.timer.epochs[1:] = []  # the timed epochs follow
    for round_ in range(args.repeats):
        for variant in VARIANTS[round_ % len(VARIANTS) :] + VARIANTS[: round_ % len(VARIANTS)]:
            bench.train_one_epoch(trainers[variant], False)
    spent = float(re.search(r"\(([\d.]+) s spent measuring\)", tuning.summary).group(1))
    result = {
        variant: {
            "pairs_per_s": len(dataset) / statistics.median(trainer.timer.epochs[1:]),
            "epoch_times_s": [round(t, 4) for t in trainer.timer.epochs[1:]],
            "steps_per_epoch": sum(trainer.kernels.kernels.values()) // args.repeats,
            "kernels_run": dict(trainer.kernels.kernels),
        }
        for variant, trainer in trainers.items()
    }
    result["auto"] = {"start_up": tuning.summary, "training_steps": tuning.refined, "measured_s": spent}
    del trainers
    gc.collect()
    return result


def table(kind, results, repeats):
    lines = [
        f"## {kind.upper()}",
        "",
        "| profile | auto | sdpa | varlen | auto / fastest fixed | auto's micro-batches (timed epochs) | start-up "
        "measurement: s, share of 100 steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for profile, by_variant in results.items():
        stock = by_variant["stock"]["pairs_per_s"]
        speed = {v: by_variant[v]["pairs_per_s"] / stock for v in VARIANTS}
        fastest = max(speed["sharing-sdpa"], speed["sharing-varlen"])
        auto = by_variant["sharing"]
        step = statistics.median(auto["epoch_times_s"]) / max(auto["steps_per_epoch"], 1)
        kernels = ", ".join(f"{k} {n}" for k, n in sorted(auto["kernels_run"].items()))
        spent = by_variant["auto"]["measured_s"]
        lines.append(
            f"| {profile} | {speed['sharing']:.2f}x | {speed['sharing-sdpa']:.2f}x | {speed['sharing-varlen']:.2f}x "
            f"| {speed['sharing'] / fastest:.2f}x | {kernels} | {spent:.2f} s, {spent / (100 * step):.1%} |"
        )
    lines += ["", 'What `"auto"` logged (start-up line; training steps\' line):', ""]
    for profile, by_variant in results.items():
        lines.append(f"- {profile}: {by_variant['auto']['start_up']}.")
        if by_variant["auto"]["training_steps"]:
            lines.append(f"  Then: {by_variant['auto']['training_steps']}.")
    return lines + [""]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default=",".join(bench.PROFILES))
    parser.add_argument("--kinds", default="dpo,reward")
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=8, help="timed epochs per variant, interleaved")
    parser.add_argument("--length-scale", type=float, default=0.25)
    bench.add_model_options(parser)
    parser.add_argument("--out", default="docs/benchmarks/auto_cpu")
    parser.add_argument("--name", default="cpu")
    args = parser.parse_args()
    bench.check_model_options(args)
    args.mode, args.gradient_checkpointing, args.extra_variants = "cpu", False, []
    command = shlex.join(["python", "scripts/benchmark_auto.py", *sys.argv[1:]])
    device, tokenizer = bench.quiet_setup(False, args.model)
    vocabulary = bench.single_token_words(tokenizer) if args.model != "tiny" else None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            model = bench.build_model(kind, tokenizer, args)
            results[kind] = {}
            for profile in args.profiles.split(","):
                dataset = bench.synthetic_dataset(profile, args.pairs, args.length_scale, 0, vocabulary=vocabulary)
                results[kind][profile] = run_profile(kind, model, tokenizer, dataset, args, tmp)
                print(kind, profile, json.dumps(results[kind][profile]), flush=True)
    model_desc = "SmolLM2-135M-Instruct (trained weights)" if args.model != "tiny" else f"tiny {args.family}"
    lines = [
        '# `"auto"` against each fixed kernel (CPU)',
        "",
        f"Device: {device}. Model: {model_desc}, fp32. {args.pairs} pairs per profile, per_device_train_batch_size "
        f"{args.batch_size}, lengths = paper medians x {args.length_scale}. One warm-up epoch per variant (where "
        f'`"auto"` measures and its close candidates take their turns; more for `"auto"` until they have), then '
        f"{args.repeats} timed epochs each, "
        "interleaved in a rotating order; throughput from the median epoch, as a speedup over stock TRL from the same "
        "run.",
        "",
        f"Made by `{command}`",
        "",
        'auto = `prefix_sharing_attn_implementation="auto"` (and `prefix_sharing_join="auto"`: stock\'s own rows '
        "are a candidate); sdpa, varlen = prefix sharing fixed to that kernel. The start-up measurement's share is of "
        "a 100-step run at auto's median step.",
        "",
    ]
    for kind, by_profile in results.items():
        lines += table(kind, by_profile, args.repeats)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"command": command, "device": device, "model": model_desc, "results": results}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
