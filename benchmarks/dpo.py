"""Stock TRL vs prefix sharing vs packing vs both, on synthetic data shaped like the paper's six datasets.

    python -m benchmarks.dpo --mode cpu --out docs/benchmarks      # ~10 minutes on 2 cores
    python -m benchmarks.dpo --mode gpu --out docs/benchmarks      # CUDA, bf16, "auto" (varlen), ~0.5B model
    python -m benchmarks.dpo --mode cpu --extra-variants sharing-varlen,sharing+packing-varlen \
        --out docs/benchmarks/varlen_cpu   # the varlen kernel (its CPU reference) beside the dense mask, ~15 minutes
    python -m benchmarks.dpo --model smollm2 --kinds dpo --profiles HH-RLHF,TLDR,UltraFeedback --pairs 8 \
        --repeats 3 --length-scale 0.25 --out docs/benchmarks/smollm2   # a real model (below), ~15 minutes on 2 cores

Every variant trains the same model (randomly initialised, or with `--model smollm2` SmolLM2-135M-Instruct's trained
weights and tokenizer, loaded offline by `trl_prefix_sharing.testing.real_model`) on the same pairs, in one process.
After a warm-up epoch each, the variants' timed epochs are interleaved (rotating order), and throughput comes from the
median epoch: results are ratios to stock TRL from the same run, since the machine is noisy. Also reported: token
positions the model runs (padding included), activation memory (bytes autograd saves for backward), peak GPU memory
(GPU mode), packing efficiency, and the sharing speedup's share of the ideal linear-layer speedup `2(p+c)/(p+2c)`
measured on the data (stock tokens / shared tokens). Writes `<mode>.md`, `<mode>.json` and `<mode>_speedup.png` to
`--out`. The synthetic texts are random words that are each one token of the model's tokenizer (with SmolLM2's BPE
tokenizer, frequent English words, checked on every text), so the profiles' lengths are token lengths.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

from trl_prefix_sharing.testing.trainers import build_trainer

from .data import PROFILES, check_one_token_per_word, single_token_words, synthetic_dataset
from .measure import ActivationMeter, CountingCollator, Timer, rotations, train_one_epoch
from .models import add_model_options, build_model, check_model_options, describe_smollm2, quiet_setup
from .record import ROOT
from .results import command_line, write_result


VARIANTS = ["stock", "sharing", "packing", "sharing+packing"]
#: a variant named `<variant>-<kernel>` runs with that `prefix_sharing_attn_implementation` (without: `"auto"`)
KERNELS = {"varlen": "varlen", "flex": "flex_attention", "sdpa": "sdpa"}
#: sharing with SDPA's dense mask: the kernel choice, measured
SDPA_VARIANT = "sharing-sdpa"


def make_trainer(kind, variant, model, tokenizer, dataset, args, tmp):
    """Stock TRL's trainer `kind` (`"dpo"` or `"reward"`) or this package's with the variant's options, on a copy of
    `model`, instrumented: `timer`, `counter` (positions), `meter` (activation memory), packing efficiency."""
    cuda = args.mode == "gpu"
    base, _, kernel = variant.partition("-")
    ours = {} if variant == "stock" else {"prefix_sharing": "sharing" in base, "packing": "packing" in base}
    if kernel:
        ours["prefix_sharing_attn_implementation"] = KERNELS[kernel]
    trainer = build_trainer(
        kind,
        stock=variant == "stock",
        model=model,
        ref_model=model if kind == "dpo" else None,
        tokenizer=tokenizer,
        train_dataset=dataset,
        output_dir=os.path.join(tmp, f"{kind}-{variant}"),
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=1,
        learning_rate=1e-6,
        bf16=cuda,
        use_cpu=not cuda,
        max_length=None,
        gradient_checkpointing=args.gradient_checkpointing,
        dataloader_drop_last=False,
        **ours,
    )
    trainer.timer = Timer(cuda)
    trainer.add_callback(trainer.timer.callback)
    trainer.counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = trainer.counter
    trainer.meter = ActivationMeter(trainer)
    trainer.peak_memory = 0
    trainer.efficiency = None
    if ours.get("packing"):
        trainer.efficiency = trainer.packed_batches.sampler(trainer.train_dataset, shuffle=True).efficiency()
    return trainer


def run_profile(kind, model, tokenizer, dataset, args, tmp):
    """All variants on one profile, interleaved: warm-up epoch each, then `args.repeats` rounds of one epoch per
    variant in a rotating order (drift and noise hit every variant alike); throughput from the median epoch."""
    cuda = args.mode == "gpu"
    variants = VARIANTS + args.extra_variants
    trainers = {variant: make_trainer(kind, variant, model, tokenizer, dataset, args, tmp) for variant in variants}
    for trainer in trainers.values():  # warm-up (and FlexAttention compilation on CUDA): not timed
        train_one_epoch(trainer, cuda)
    counts = {v: (t.counter.positions, t.counter.tokens, t.counter.batches) for v, t in trainers.items()}
    for order in rotations(variants, args.repeats):
        for variant in order:
            train_one_epoch(trainers[variant], cuda)
    results = {}
    for variant, trainer in trainers.items():
        times = sorted(trainer.timer.epochs[1:])
        positions, tokens, batches = counts[variant]
        n = len(trainer.train_dataset)
        results[variant] = {
            "pairs_per_s": n / times[len(times) // 2],
            "epoch_times_s": [round(t, 4) for t in trainer.timer.epochs[1:]],
            "positions_per_pair": positions / n,
            "tokens_per_pair": tokens / n,
            "pairs_per_step": n / batches,
            "activation_mb": trainer.meter.peak / 2**20,
            "peak_memory_gb": trainer.peak_memory / 2**30 if cuda else None,
            "packing_efficiency": trainer.efficiency,
            "attn_implementation": getattr(getattr(trainer, "sharing_session", None), "attn_implementation", None),
        }
    del trainers
    gc.collect()
    return results


# the paper's speedups of Flex + prefix sharing over their FlexAttention baseline: (sharing alone, with packing)
PAPER = {
    "Capybara": (1.54, 1.36),
    "HH-RLHF": (1.19, 1.48),
    "MetaMath-DPO": (1.47, 1.60),
    "TLDR": (1.20, 1.38),
    "Tulu-Helpsteer": (1.56, 1.52),
    "UltraFeedback": (1.18, 1.21),
}


def summarise(results, args):
    """Per kind and profile: the ideal, each variant's speedup over stock, and the target checks."""
    rows = {}
    for kind in args.kinds:
        for profile, by_variant in results[kind].items():
            stock = by_variant["stock"]
            p, c = PROFILES[profile]
            ideal = stock["tokens_per_pair"] / by_variant["sharing"]["tokens_per_pair"]
            speed = {v: r["pairs_per_s"] / stock["pairs_per_s"] for v, r in by_variant.items()}
            if args.mode == "cpu":
                target = speed["sharing"] >= 0.9 * ideal if p >= c else speed["sharing"] >= 1.0
            else:
                target = speed["sharing"] >= PAPER[profile][0] and speed["sharing+packing"] >= PAPER[profile][1]
            # the positions each computes, padding included (what `stats` compares its expected speedup with)
            padded_ideal = stock["positions_per_pair"] / by_variant["sharing"]["positions_per_pair"]
            rows[kind, profile] = {
                "ideal": ideal,
                "padded_ideal": padded_ideal,
                "speed": speed,
                "share": speed["sharing"] / ideal,
                "target": target,
            }
    return rows


def write_outputs(results, args, command):
    device = args.device_name
    rows = summarise(results, args)
    gpu = args.mode == "gpu"
    tokens = ""
    if getattr(args, "model", "tiny") != "tiny":  # words of one token each (checked on every text)
        tokens = " in real tokens (random words that are each one token of its tokenizer)"
    lines = [
        f"# Benchmark: stock TRL vs prefix sharing vs packing ({args.mode.upper()})",
        "",
        f"Device: {device}. Model: {args.model_desc}. {args.pairs} pairs per profile, per_device_train_batch_size "
        f"{args.batch_size}, lengths = paper medians x {args.length_scale} with lognormal spread (sigma 0.5){tokens}, "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}. Each variant trains one warm-up "
        f"epoch, then {args.repeats} timed epochs interleaved with the other variants (rotating order); "
        "throughput is from the median epoch.",
        "",
        f"Made by `{command}`",
        "",
        "Speedup = pairs/s of the variant / pairs/s of stock TRL in the same run. Ideal = the linear-layer ideal "
        "`2(p+c)/(p+2c)` measured on this data (stock tokens / shared tokens, padding excluded); stock also pads "
        "its rows, so a measured speedup can exceed it. Positions = token positions the model runs per pair, "
        "padding included. Activation memory = bytes autograd saves for backward in one step (max over steps); a "
        "packed step holds more pairs than `per_device_train_batch_size` (its row budget is that many times the "
        "longest example), so the pairs per step are given too.",
        "",
    ]
    if gpu:
        lines += [
            "What to compare: the speedups with the paper's over its FlexAttention baseline (sharing / "
            "sharing+packing, in the 'paper' column), and peak memory with stock's.",
            "",
        ]
    else:
        lines += [
            "What to expect: sharing at least 0.9 of the ideal where prompt >= completion, and no slowdown on "
            "UltraFeedback (completions longer than prompts).",
            "",
        ]
    for kind in args.kinds:
        header = (
            "| profile | p/c | ideal | sharing | share of ideal | packing | sharing+packing | "
            + ("paper (sharing / +packing) | " if gpu else "")
            + "target | positions per pair (stock / sharing / packing / both) | packing efficiency "
            "(packing / both) | pairs per step (stock / sharing / packing / both) | activation MB per step "
            "(stock / sharing / packing / both) |"
            + (" peak GPU memory GB (stock / sharing / packing / both) |" if gpu else "")
            + (" other kernels: speedup (positions per pair, activation MB) |" if args.extra_variants else "")
        )
        lines += [f"## {kind.upper()}", "", header, "|" + "---|" * (header.count(" | ") + 1)]
        for profile, by_variant in results[kind].items():
            row = rows[kind, profile]
            speed = row["speed"]
            p, c = PROFILES[profile]

            def each(key, fmt, variants=VARIANTS, by_variant=by_variant):
                return " / ".join(
                    "-" if by_variant[v][key] is None else fmt.format(by_variant[v][key])
                    for v in variants
                    if v in by_variant
                )

            cells = [
                profile,
                f"{p / c:.2f}",
                f"{row['ideal']:.2f}x",
                f"{speed['sharing']:.2f}x",
                f"{row['share']:.2f}",
                f"{speed['packing']:.2f}x",
                f"{speed['sharing+packing']:.2f}x",
            ]
            if gpu:
                cells.append(f"{PAPER[profile][0]:.2f}x / {PAPER[profile][1]:.2f}x")
            cells += [
                "met" if row["target"] else "**missed**",
                each("positions_per_pair", "{:.0f}"),
                each("packing_efficiency", "{:.1%}", ("packing", "sharing+packing")),
                each("pairs_per_step", "{:.1f}"),
                each("activation_mb", "{:.1f}"),
            ]
            if gpu:
                cells.append(each("peak_memory_gb", "{:.2f}"))
            if args.extra_variants:
                cells.append(
                    "; ".join(
                        f"{v} {speed[v]:.2f}x ({by_variant[v]['positions_per_pair']:.0f}, "
                        f"{by_variant[v]['activation_mb']:.1f})"
                        for v in args.extra_variants
                    )
                )
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    data = {"command": command, "device": device, "model": args.model_desc, "results": results}
    write_result(args.out, args.mode, data, lines)
    if args.record:  # what `stats` quotes, derived again from every record of docs/benchmarks (this one included)
        from .record import write

        write()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot written.")
        return
    from .plot import plot_speedup

    # the same drawing as `python -m benchmarks.plot <out>/<mode>.json` makes from the recorded JSON
    plot_speedup(data, os.path.join(args.out, f"{args.mode}_speedup.png"), PROFILES)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--kinds", default="dpo,reward")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=4, help="timed epochs per variant, interleaved")
    parser.add_argument("--length-scale", type=float, default=None)
    add_model_options(parser)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--extra-variants",
        default="",
        help="more variants, comma-separated, each `<variant>-<kernel>` with a kernel of "
        f"{sorted(KERNELS)} (e.g. sharing-varlen,sharing+packing-varlen): timed with the others, in their own column",
    )
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument(
        "--record",
        action="store_true",
        help="also derive trl_prefix_sharing/data/measured_speedups.json (what `stats` quotes) again from "
        "docs/benchmarks, this run's record included (`python -m benchmarks.record`; tiny model, --out "
        "docs/benchmarks only)",
    )
    args = parser.parse_args()
    check_model_options(args)
    if args.record and args.model != "tiny":
        raise SystemExit(
            f"error: --record stores the tiny model's speedups (what `stats` quotes); not with --model {args.model}"
        )
    if args.record and os.path.abspath(args.out) != os.path.abspath(os.path.join(ROOT, "docs", "benchmarks")):
        raise SystemExit(
            "error: --record derives what `stats` quotes from docs/benchmarks; pass --out docs/benchmarks (or run "
            "`python -m benchmarks.record` once the record is there)"
        )
    gpu = args.mode == "gpu"
    args.pairs = args.pairs or (256 if gpu else 32)
    args.batch_size = args.batch_size or (8 if gpu else 4)
    args.length_scale = args.length_scale or (1.0 if gpu else 0.25)
    args.kinds = args.kinds.split(",")
    args.extra_variants = [v for v in args.extra_variants.split(",") if v]
    for variant in args.extra_variants:
        base, _, kernel = variant.partition("-")
        if base not in VARIANTS[1:] or kernel not in KERNELS:
            raise SystemExit(f"error: --extra-variants takes <variant>-<kernel>: {VARIANTS[1:]} x {sorted(KERNELS)}")
    command = command_line("dpo")

    args.device_name, tokenizer = quiet_setup(gpu, args.model)
    vocabulary = single_token_words(tokenizer) if args.model != "tiny" else None
    results = {kind: {} for kind in args.kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            model = build_model(kind, tokenizer, args)
            numerics = "bf16, prefix sharing on the kernel `auto` takes vs SDPA (stock)" if gpu else "fp32, SDPA"
            if args.model == "tiny":
                args.model_desc = (
                    f"{args.family}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {numerics}"
                )
            else:
                reward = "; reward: its backbone with a fresh 1-label score head" if "reward" in args.kinds else ""
                args.model_desc = f"{describe_smollm2(model)}, {numerics}{reward}"
            for profile in args.profiles.split(","):
                dataset = synthetic_dataset(profile, args.pairs, args.length_scale, seed=0, vocabulary=vocabulary)
                if vocabulary is not None:
                    check_one_token_per_word(tokenizer, [t for row in dataset for t in row.values()])
                results[kind][profile] = run_profile(kind, model, tokenizer, dataset, args, tmp)
                for variant, result in results[kind][profile].items():
                    print(f"{kind} {profile} {variant}: {result}", flush=True)
    write_outputs(results, args, command)


if __name__ == "__main__":
    main()
