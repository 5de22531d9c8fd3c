"""`"auto"` against each fixed kernel, DPO and reward as in `benchmarks.dpo` (the paper's profiles): stock TRL, sharing
with `prefix_sharing_attn_implementation="auto"` (stock's own rows or a kernel per micro-batch, by times measured on
the device), and sharing fixed to each CPU kernel (`"sdpa"`, `"varlen"`), timed epochs interleaved after a warm-up.
Writes `<name>.md` and `<name>.json` to `--out`.

    python -m benchmarks.auto --out docs/benchmarks/auto_cpu          # tiny model, ~25 minutes on 2 cores
    python -m benchmarks.auto --model smollm2 --kinds dpo --profiles HH-RLHF,TLDR,UltraFeedback --pairs 8 \
        --out docs/benchmarks/auto_smollm2                                   # SmolLM2-135M-Instruct, ~20 minutes
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import tempfile

from .data import PROFILES, single_token_words, synthetic_dataset
from .dpo import make_trainer
from .measure import rotations, train_one_epoch
from .models import add_model_options, build_model, check_model_options, quiet_setup
from .results import command_line, document, markdown_table, write_result


VARIANTS = ["stock", "sharing", "sharing-sdpa", "sharing-varlen"]


def run_profile(kind, model, tokenizer, dataset, args, tmp):
    """The four variants on one profile: throughput, the candidates each timed micro-batch ran, `"auto"`'s log."""
    trainers = {v: make_trainer(kind, v, model, tokenizer, dataset, args, tmp) for v in VARIANTS}
    tuning = trainers["sharing"].sharing_session.tuning
    for trainer in trainers.values():  # warm-up: "auto" measures here, and its close candidates take their turns
        train_one_epoch(trainer, False)
    for _ in range(4):  # "auto"'s warm-up lasts until they took them (short epochs: a few micro-batches)
        if tuning.settled and (tuning.refined is not None or not tuning.contenders):
            break
        train_one_epoch(trainers["sharing"], False)
    before = {v: (t.counter.batches, dict(t.counter.kernels)) for v, t in trainers.items()}
    for trainer in trainers.values():
        trainer.timer.epochs[1:] = []  # the timed epochs follow
    for order in rotations(VARIANTS, args.repeats):
        for variant in order:
            train_one_epoch(trainers[variant], False)
    spent = float(re.search(r"\(([\d.]+) s spent measuring\)", tuning.summary).group(1))
    result = {}
    for variant, trainer in trainers.items():  # the candidate each timed micro-batch was laid out for
        batches, kernels = before[variant]
        kernels = {"fixed" if k is None else k: n - kernels.get(k, 0) for k, n in trainer.counter.kernels.items()}
        kernels["stock TRL"] = trainer.counter.batches - batches - sum(kernels.values())  # not laid out
        kernels = {k: n for k, n in kernels.items() if n}
        result[variant] = {
            "pairs_per_s": len(dataset) / statistics.median(trainer.timer.epochs[1:]),
            "epoch_times_s": [round(t, 4) for t in trainer.timer.epochs[1:]],
            "steps_per_epoch": sum(kernels.values()) // args.repeats,
            "kernels_run": kernels,
        }
    result["auto"] = {"start_up": tuning.summary, "training_steps": tuning.refined, "measured_s": spent}
    del trainers
    gc.collect()
    return result


def table(kind, results):
    """A kind's speedups table, then what `"auto"` logged per profile."""
    rows, logged = [], []
    for profile, by_variant in results.items():
        speed = {v: by_variant[v]["pairs_per_s"] / by_variant["stock"]["pairs_per_s"] for v in VARIANTS}
        auto = by_variant["sharing"]
        step = statistics.median(auto["epoch_times_s"]) / max(auto["steps_per_epoch"], 1)
        spent = by_variant["auto"]["measured_s"]
        rows.append([profile, *(f"{speed[v]:.2f}x" for v in VARIANTS[1:])])
        rows[-1].append(f"{speed['sharing'] / max(speed['sharing-sdpa'], speed['sharing-varlen']):.2f}x")
        rows[-1].append(", ".join(f"{k} {n}" for k, n in sorted(auto["kernels_run"].items())))
        rows[-1].append(f"{spent:.2f} s, {spent / (100 * step):.1%}")
        logged.append(f"- {profile}: {by_variant['auto']['start_up']}.")
        if by_variant["auto"]["training_steps"]:
            logged.append(f"  Then: {by_variant['auto']['training_steps']}.")
    header = "profile|auto|sdpa|varlen|auto / fastest fixed|auto's micro-batches (timed epochs)|"
    header += "start-up measurement: s, share of 100 steps"
    log = 'What `"auto"` logged (start-up line; training steps\' line):'
    return document(f"## {kind.upper()}", markdown_table(header, rows), log, logged)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--kinds", default="dpo,reward")
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=8, help="timed epochs per variant, interleaved")
    parser.add_argument("--length-scale", type=float, default=0.25)
    add_model_options(parser)
    parser.add_argument("--out", default="docs/benchmarks/auto_cpu")
    parser.add_argument("--name", default="cpu")
    args = parser.parse_args()
    check_model_options(args)
    args.mode, args.gradient_checkpointing, args.extra_variants = "cpu", False, []
    command = command_line("auto")
    device, tokenizer = quiet_setup(False, args.model)
    vocabulary = single_token_words(tokenizer) if args.model != "tiny" else None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds.split(","):
            model = build_model(kind, tokenizer, args)
            results[kind] = {}
            for profile in args.profiles.split(","):
                dataset = synthetic_dataset(profile, args.pairs, args.length_scale, 0, vocabulary=vocabulary)
                results[kind][profile] = run_profile(kind, model, tokenizer, dataset, args, tmp)
                print(kind, profile, json.dumps(results[kind][profile]), flush=True)
    model_desc = "SmolLM2-135M-Instruct (trained weights)" if args.model != "tiny" else f"tiny {args.family}"
    lines = document(
        '# `"auto"` against each fixed kernel (CPU)',
        f"Device: {device}. Model: {model_desc}, fp32. {args.pairs} pairs per profile, per_device_train_batch_size "
        f"{args.batch_size}, lengths = paper medians x {args.length_scale}. A warm-up epoch per variant (more for "
        f'`"auto"`, until its close candidates took their turns), then {args.repeats} timed epochs each, interleaved '
        "in a rotating order; throughput from the median epoch, as a speedup over stock TRL from the same run.",
        f"Made by `{command}`",
        'auto = `prefix_sharing_attn_implementation="auto"` (and `prefix_sharing_join="auto"`: stock\'s own rows '
        "are a candidate); sdpa, varlen = prefix sharing fixed to that kernel. The start-up measurement's share is of "
        "a 100-step run at auto's median step.",
        *(table(kind, by_profile) for kind, by_profile in results.items()),
    )
    write_result(args.out, args.name, dict(command=command, device=device, model=model_desc, results=results), lines)


if __name__ == "__main__":
    main()
