"""Stock TRL vs prefix sharing vs packing vs both, on synthetic data shaped like the paper's six datasets.

    python scripts/benchmark.py --mode cpu --out docs/benchmarks      # a few minutes on 2 cores
    python scripts/benchmark.py --mode gpu --out docs/benchmarks      # CUDA, bf16, FlexAttention, ~0.5B model

Every variant trains the same randomly initialised model on the same pairs, in one process, interleaved per profile.
Throughput is pairs per second over the last of several epochs over a fixed set of pairs (the first epochs warm up);
results are reported as ratios to stock TRL, since the machine is noisy. Also reported: token positions the model
runs (padding included) and real tokens, peak GPU memory (GPU mode), packing efficiency, and the sharing speedup's
share of the ideal linear-layer speedup `2(p+c)/(p+2c)` measured on the data (stock tokens / shared tokens).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
import warnings

# median prompt / completion tokens of the paper's datasets (issue 6)
PROFILES = {
    "Capybara": (712, 448), "HH-RLHF": (127, 59), "MetaMath-DPO": (694, 178), "TLDR": (382, 34),
    "Tulu-Helpsteer": (669, 106), "UltraFeedback": (121, 288),
}
VARIANTS = ["stock", "sharing", "packing", "sharing+packing"]


def synthetic_dataset(profile, n, scale, seed, sigma=0.5):
    from datasets import Dataset

    from trl_prefix_sharing.tiny import WORDS

    p_med, c_med = PROFILES[profile]
    rng = random.Random(f"{profile}-{seed}")

    def words(median):
        k = max(1, int(round(median * scale * math.exp(rng.gauss(0, sigma)))))
        return " ".join(rng.choice(WORDS[:200]) for _ in range(k))

    return Dataset.from_list([{"prompt": words(p_med), "chosen": " " + words(c_med), "rejected": " " + words(c_med)}
                              for _ in range(n)])


class Timer:
    """Trainer callback: wall time of each epoch (synchronised on CUDA)."""

    def __init__(self, cuda):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_epoch_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer.start = time.perf_counter()

            def on_epoch_end(self, args, state, control, **kwargs):
                timer._sync()
                timer.epochs.append(time.perf_counter() - timer.start)

        self.cuda = cuda
        self.epochs = []
        self.callback = _Callback()

    def _sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()


class CountingCollator:
    """Counts the positions the model runs (padding included) and the real tokens of each batch."""

    def __init__(self, collator):
        self.collator = collator
        self.positions = self.tokens = self.batches = 0

    def __getattr__(self, name):
        return getattr(self.collator, name)

    def __call__(self, examples):
        batch = self.collator(examples)
        layout = batch.get("prefix_sharing")
        self.batches += 1
        if layout is None:
            self.positions += batch["input_ids"].numel()
            self.tokens += int(batch["attention_mask"].sum())
        else:
            self.positions += layout["input_ids"].numel()
            self.tokens += int((layout["document_ids"] >= 0).sum())
        return batch


def run_variant(kind, variant, model, tokenizer, dataset, args, tmp):
    import torch
    import trl
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_prefix_sharing import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    cuda = args.mode == "gpu"
    common = dict(output_dir=os.path.join(tmp, f"{kind}-{variant}"), per_device_train_batch_size=args.batch_size,
                  num_train_epochs=args.epochs, learning_rate=1e-6, logging_steps=10_000, save_strategy="no",
                  report_to="none", bf16=cuda, use_cpu=not cuda, seed=0, max_length=None,
                  gradient_checkpointing=args.gradient_checkpointing, disable_tqdm=True, dataloader_drop_last=False)
    ours = {"prefix_sharing": "sharing" in variant, "packing": "packing" in variant}
    if kind == "dpo":
        if variant == "stock":
            trainer = trl.DPOTrainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(model),
                                     args=trl.DPOConfig(**common), train_dataset=dataset, processing_class=tokenizer)
        else:
            trainer = DPOTrainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(model),
                                 args=DPOConfig(**ours, **common), train_dataset=dataset, processing_class=tokenizer)
    else:
        if variant == "stock":
            trainer = trl.RewardTrainer(model=copy.deepcopy(model), args=trl.RewardConfig(**common),
                                        train_dataset=dataset, processing_class=tokenizer)
        else:
            trainer = RewardTrainer(model=copy.deepcopy(model), args=RewardConfig(**ours, **common),
                                    train_dataset=dataset, processing_class=tokenizer)
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    timer = Timer(cuda)
    trainer.add_callback(timer.callback)
    counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    efficiency = None
    if ours["packing"]:
        efficiency = trainer._multipack_sampler(trainer.train_dataset, shuffle=True).efficiency()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    epoch_time = min(timer.epochs[1:] or timer.epochs)
    result = {
        "pairs_per_s": len(trainer.train_dataset) / epoch_time,
        "positions_per_pair": counter.positions / args.epochs / len(trainer.train_dataset),
        "tokens_per_pair": counter.tokens / args.epochs / len(trainer.train_dataset),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "packing_efficiency": efficiency,
    }
    del trainer
    gc.collect()
    return result


def build_model(kind, tokenizer, args):
    import torch

    from trl_prefix_sharing.tiny import make_config

    if args.mode == "cpu":
        sizes = dict(hidden_size=args.hidden_size, num_layers=args.layers)
        vocab = len(tokenizer)
    else:  # ~0.5B parameters, Qwen2.5-0.5B-like shape, built from config (no download)
        sizes = dict(hidden_size=896, num_layers=24, intermediate_size=4864, num_attention_heads=14,
                     num_key_value_heads=2)
        vocab = 32000
    config = make_config(args.family, vocab, **sizes)
    if kind == "reward":
        config.num_labels = 1
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.mode == "gpu" else torch.float32
    model = cls.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if args.mode == "gpu":
        model = model.cuda()
    return model


def write_outputs(results, args, command):
    os.makedirs(args.out, exist_ok=True)
    device = args.device_name
    lines = [f"# Benchmark: stock TRL vs prefix sharing vs packing ({args.mode.upper()})", "",
             f"Device: {device}. Model: {args.model_desc}. {args.pairs} pairs per profile, per_device_train_batch_size "
             f"{args.batch_size}, {args.epochs} epochs (the fastest epoch after the first is timed), lengths = paper "
             f"medians x {args.length_scale} with lognormal spread (sigma 0.5).", "",
             f"Command: `{command}`", "",
             "Speedup = pairs/s of the variant / pairs/s of stock TRL in the same run. Ideal = stock tokens / shared "
             "tokens on this data (the linear-layer ideal `2(p+c)/(p+2c)`). Positions = token positions the model "
             "runs per pair, padding included.", ""]
    for kind in args.kinds:
        lines += [f"## {kind.upper()}", "",
                  "| profile | p/c | ideal | sharing | share of ideal | packing | sharing+packing | positions per pair "
                  "(stock / sharing / packing / both) | packing efficiency (packing / both) | peak memory GB "
                  "(stock / sharing / packing / both) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for profile, by_variant in results[kind].items():
            stock = by_variant["stock"]
            ideal = stock["tokens_per_pair"] / by_variant["sharing"]["tokens_per_pair"]
            speed = {v: r["pairs_per_s"] / stock["pairs_per_s"] for v, r in by_variant.items()}
            p, c = PROFILES[profile]
            positions = " / ".join(f"{by_variant[v]['positions_per_pair']:.0f}" for v in VARIANTS if v in by_variant)
            eff = " / ".join(f"{100 * by_variant[v]['packing_efficiency']:.1f}%" for v in ("packing", "sharing+packing")
                             if v in by_variant and by_variant[v]["packing_efficiency"] is not None)
            mem = " / ".join("-" if by_variant[v]["peak_memory_gb"] is None else f"{by_variant[v]['peak_memory_gb']:.2f}"
                             for v in VARIANTS if v in by_variant)
            lines.append(
                f"| {profile} | {p / c:.2f} | {ideal:.2f}x | {speed['sharing']:.2f}x | {speed['sharing'] / ideal:.2f} | "
                f"{speed.get('packing', float('nan')):.2f}x | {speed.get('sharing+packing', float('nan')):.2f}x | "
                f"{positions} | {eff or '-'} | {mem} |")
        lines.append("")
    path = os.path.join(args.out, f"{args.mode}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"{args.mode}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot written.")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ratios = [10 ** (x / 50) for x in range(-50, 76)]
    ax.plot(ratios, [2 * (r + 1) / (r + 2) for r in ratios], "k--", label="ideal 2(p+c)/(p+2c)")
    markers = {"sharing": "o", "sharing+packing": "s", "packing": "^"}
    for kind in args.kinds:
        for variant, marker in markers.items():
            xs, ys = [], []
            for profile, by_variant in results[kind].items():
                p, c = PROFILES[profile]
                xs.append(p / c)
                ys.append(by_variant[variant]["pairs_per_s"] / by_variant["stock"]["pairs_per_s"])
            ax.scatter(xs, ys, marker=marker, label=f"{kind} {variant}")
    for profile, (p, c) in PROFILES.items():
        ax.annotate(profile, (p / c, 1.0), fontsize=7, rotation=90, va="bottom", alpha=0.6)
    ax.set_xscale("log")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("median prompt / completion length")
    ax.set_ylabel("speedup over stock TRL (pairs/s)")
    ax.set_title(f"{args.mode.upper()}: {device}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{args.mode}_speedup.png"), dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--kinds", default="dpo,reward")
    parser.add_argument("--pairs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--length-scale", type=float, default=None)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--out", default="docs/benchmarks")
    args = parser.parse_args()
    gpu = args.mode == "gpu"
    args.pairs = args.pairs or (256 if gpu else 24)
    args.batch_size = args.batch_size or (8 if gpu else 4)
    args.length_scale = args.length_scale or (1.0 if gpu else 0.25)
    args.kinds = args.kinds.split(",")
    command = "python scripts/benchmark.py " + " ".join(sys.argv[1:])

    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    from trl_prefix_sharing.tiny import make_tokenizer

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--mode gpu needs CUDA.")
    args.device_name = torch.cuda.get_device_name() if gpu else f"CPU, {torch.get_num_threads()} threads"
    tokenizer = make_tokenizer()
    results = {kind: {} for kind in args.kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            model = build_model(kind, tokenizer, args)
            args.model_desc = (f"{args.family}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
                               f"{'bf16, FlexAttention (prefix sharing) vs SDPA (stock)' if gpu else 'fp32, SDPA'}")
            for profile in args.profiles.split(","):
                dataset = synthetic_dataset(profile, args.pairs, args.length_scale, seed=0)
                by_variant = {}
                for variant in VARIANTS:
                    by_variant[variant] = run_variant(kind, variant, model, tokenizer, dataset, args, tmp)
                    print(f"{kind} {profile} {variant}: {by_variant[variant]}", flush=True)
                results[kind][profile] = by_variant
    write_outputs(results, args, command)


if __name__ == "__main__":
    main()
