"""Stock TRL vs prefix sharing vs packing vs both, on synthetic data shaped like the paper's six datasets.

    python scripts/benchmark.py --mode cpu --out docs/benchmarks      # ~10 minutes on 2 cores
    python scripts/benchmark.py --mode gpu --out docs/benchmarks      # CUDA, bf16, "auto" (varlen), ~0.5B model
    python scripts/benchmark.py --mode cpu --extra-variants sharing-varlen,sharing+packing-varlen \
        --out docs/benchmarks/varlen_cpu   # the varlen kernel (its CPU reference) beside the dense mask, ~15 minutes
    python scripts/benchmark.py --model smollm2 --kinds dpo --profiles HH-RLHF,TLDR,UltraFeedback --pairs 8 \
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
import copy
import gc
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
import warnings


# median prompt / completion tokens of the paper's datasets
PROFILES = {
    "Capybara": (712, 448),
    "HH-RLHF": (127, 59),
    "MetaMath-DPO": (694, 178),
    "TLDR": (382, 34),
    "Tulu-Helpsteer": (669, 106),
    "UltraFeedback": (121, 288),
}
VARIANTS = ["stock", "sharing", "packing", "sharing+packing"]
#: a variant named `<variant>-<kernel>` runs with that `prefix_sharing_attn_implementation` (without: `"auto"`)
KERNELS = {"varlen": "varlen", "flex": "flex_attention", "sdpa": "sdpa"}
#: sharing with SDPA's dense mask: the kernel choice, measured
SDPA_VARIANT = "sharing-sdpa"


def synthetic_dataset(profile, n, scale, seed, sigma=0.5, vocabulary=None):
    """`n` pairs of random words, lengths lognormal around the profile's medians x `scale`. `vocabulary`: the words
    to draw from (default the tiny tokenizer's first 200; `single_token_words` for another tokenizer), each one token,
    so that a length in words is a length in tokens."""
    from datasets import Dataset

    from trl_prefix_sharing.testing import WORDS

    p_med, c_med = PROFILES[profile]
    rng = random.Random(f"{profile}-{seed}")
    vocabulary = vocabulary or WORDS[:200]

    def words(median):
        k = max(1, int(round(median * scale * math.exp(rng.gauss(0, sigma)))))
        return " ".join(rng.choice(vocabulary) for _ in range(k))

    return Dataset.from_list(
        [{"prompt": words(p_med), "chosen": " " + words(c_med), "rejected": " " + words(c_med)} for _ in range(n)]
    )


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
            self.positions += layout.input_ids.numel()
            self.tokens += int((layout.document_ids >= 0).sum())
        return batch


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward during one loss computation (the activation memory of a
    step, device-independent and deterministic), max over steps. Wraps `trainer.compute_loss` on the instance. The
    step in which `"auto"` times its candidates (`trl_prefix_sharing.tuning`) is left out: those passes are not the
    step's, and their saved tensors are freed before it runs."""

    def __init__(self, trainer):
        import torch

        self.peak = 0
        original = trainer.compute_loss
        tuning = getattr(getattr(trainer, "sharing_session", None), "tuning", None)

        def compute_loss(*args, **kwargs):
            if tuning is not None and tuning.pending:
                return original(*args, **kwargs)
            storages = {}

            def pack(tensor):
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                result = original(*args, **kwargs)
            self.peak = max(self.peak, sum(storages.values()))
            return result

        trainer.compute_loss = compute_loss


def make_trainer(kind, variant, model, tokenizer, dataset, args, tmp):
    import trl
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_prefix_sharing import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    cuda = args.mode == "gpu"
    common = dict(
        output_dir=os.path.join(tmp, f"{kind}-{variant}"),
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=1,
        learning_rate=1e-6,
        logging_steps=10_000,
        save_strategy="no",
        report_to="none",
        bf16=cuda,
        use_cpu=not cuda,
        seed=0,
        max_length=None,
        gradient_checkpointing=args.gradient_checkpointing,
        disable_tqdm=True,
        dataloader_drop_last=False,
    )
    base, _, kernel = variant.partition("-")
    ours = {"prefix_sharing": "sharing" in base, "packing": "packing" in base}
    if kernel:
        ours["prefix_sharing_attn_implementation"] = KERNELS[kernel]
    if kind == "dpo":
        if variant == "stock":
            trainer = trl.DPOTrainer(
                model=copy.deepcopy(model),
                ref_model=copy.deepcopy(model),
                args=trl.DPOConfig(**common),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
        else:
            trainer = DPOTrainer(
                model=copy.deepcopy(model),
                ref_model=copy.deepcopy(model),
                args=DPOConfig(**ours, **common),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
    else:
        if variant == "stock":
            trainer = trl.RewardTrainer(
                model=copy.deepcopy(model),
                args=trl.RewardConfig(**common),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
        else:
            trainer = RewardTrainer(
                model=copy.deepcopy(model),
                args=RewardConfig(**ours, **common),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    trainer.timer = Timer(cuda)
    trainer.add_callback(trainer.timer.callback)
    trainer.counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = trainer.counter
    trainer.meter = ActivationMeter(trainer)
    trainer.peak_memory = 0
    trainer.efficiency = None
    if ours["packing"]:
        trainer.efficiency = trainer._multipack_sampler(trainer.train_dataset, shuffle=True).efficiency()
    return trainer


def train_one_epoch(trainer, cuda):
    """One epoch (`trainer.train()` again); the optimizer is dropped afterwards so that the variants' optimizer
    states do not pile up in memory."""
    import torch

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    trainer.train()
    if cuda:
        trainer.peak_memory = max(trainer.peak_memory, torch.cuda.max_memory_allocated() - base)
    trainer.optimizer = trainer.lr_scheduler = None
    gc.collect()


def run_profile(kind, model, tokenizer, dataset, args, tmp):
    """All variants on one profile, interleaved: warm-up epoch each, then `args.repeats` rounds of one epoch per
    variant in a rotating order (drift and noise hit every variant alike); throughput from the median epoch."""
    cuda = args.mode == "gpu"
    variants = VARIANTS + args.extra_variants
    trainers = {variant: make_trainer(kind, variant, model, tokenizer, dataset, args, tmp) for variant in variants}
    for trainer in trainers.values():  # warm-up (and FlexAttention compilation on CUDA): not timed
        train_one_epoch(trainer, cuda)
    counts = {v: (t.counter.positions, t.counter.tokens, t.counter.batches) for v, t in trainers.items()}
    for round_ in range(args.repeats):
        for variant in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
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


def build_model(kind, tokenizer, args):
    """The benchmark's model: a causal LM, or for `kind == "reward"` a sequence classifier with a one-label score
    head; the tiny random model built from a config (on GPU a ~0.5B one), or with `--model smollm2`
    SmolLM2-135M-Instruct's weights (a reward model gets a fresh score head). Seeded; bf16 on CUDA, fp32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from trl_prefix_sharing.testing import make_config

    gpu = args.mode == "gpu"
    cls = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    common = dict(attn_implementation="sdpa", dtype=torch.bfloat16 if gpu else torch.float32)
    torch.manual_seed(0)  # the tiny model's weights, SmolLM2's score head
    if getattr(args, "model", "tiny") == "smollm2":
        model = cls.from_pretrained(smollm2_dir(), **({"num_labels": 1} if kind == "reward" else {}), **common)
    else:
        if gpu:  # ~0.5B parameters, Qwen2.5-0.5B-like shape, built from config (no download)
            sizes = dict(
                hidden_size=896, num_layers=24, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2
            )
            vocab = 32000
        else:
            sizes = dict(hidden_size=args.hidden_size, num_layers=args.layers)
            vocab = len(tokenizer)
        config = make_config(args.family, vocab, **sizes)
        if kind == "reward":
            config.num_labels = 1
        model = cls.from_config(config, **common)
    return model.cuda() if gpu else model


# --- `--model smollm2`: SmolLM2-135M-Instruct, a real model, offline (shared with benchmark_paired/_online.py) ---

MODELS = ("tiny", "smollm2")
#: the tiny model's size options and their defaults; `--model smollm2` refuses them
TINY_OPTIONS = {"family": "llama", "hidden_size": 256, "layers": 4}


def add_model_options(parser):
    """`--model`, and the tiny model's `--family/--hidden-size/--layers` (default None: `check_model_options`
    fills in the defaults, after telling whether they were given)."""
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="tiny: a small random Llama from a config, with a word-level tokenizer (default); smollm2: "
        "SmolLM2-135M-Instruct's trained weights and tokenizer (134.5M parameters, offline: "
        "trl_prefix_sharing.testing.real_model)",
    )
    parser.add_argument("--family", default=None, help="tiny model only (default llama)")
    parser.add_argument("--hidden-size", type=int, default=None, help="tiny model only (default 256)")
    parser.add_argument("--layers", type=int, default=None, help="tiny model only (default 4)")


def check_model_options(args):
    """Refuse the tiny model's size options with `--model smollm2` (one line), then fill in their defaults."""
    given = [f"--{name.replace('_', '-')}" for name in TINY_OPTIONS if getattr(args, name) is not None]
    if args.model != "tiny" and given:
        raise SystemExit(
            f"error: {', '.join(given)} size the tiny model; --model {args.model} has its own size (leave them out)"
        )
    for name, default in TINY_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def smollm2_dir():
    """SmolLM2-135M-Instruct's model directory, or exit with the loader's one-line message when a package is
    missing."""
    from trl_prefix_sharing.testing.real_model import RealModelMissing, smollm2_path

    try:
        return smollm2_path()
    except RealModelMissing as error:
        raise SystemExit(f"error: {error}") from None


def describe_smollm2(model):
    """SmolLM2-135M-Instruct's shape, from the loaded model: `SmolLM2-135M-Instruct (llama, hidden 576, ...)`."""
    config = model.config
    parameters = sum(p.numel() for p in model.parameters()) / 1e6  # the tied embedding counted once
    return (
        f"SmolLM2-135M-Instruct (trained weights, {config.model_type}, hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads} query / {config.num_key_value_heads} "
        f"key-value heads, vocab {config.vocab_size}, {parameters:.1f}M parameters)"
    )


def single_token_words(tokenizer, n=200):
    """The first `n` lowercase words (by token id, so frequent ones first) that `tokenizer` encodes as one token both
    alone and after a space: text of them joined by spaces has one token per word, so a synthetic length in words is
    a length in tokens. Checked on the joined words."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        word = text[1:]
        if not (text.startswith(" ") and len(word) >= 3 and word.isascii() and word.isalpha() and word.islower()):
            continue
        if all(len(tokenizer(x, add_special_tokens=False)["input_ids"]) == 1 for x in (word, " " + word)):
            words.append(word)
            if len(words) == n:
                break
    joined = " ".join(words + words[::-1])
    if len(words) < n or len(tokenizer(joined, add_special_tokens=False)["input_ids"]) != 2 * n:
        raise SystemExit(f"error: the tokenizer has no {n} words of one token each")
    return words


def count_tokens(tokenizer, text):
    """Tokens of `text` alone (BOS and EOS aside)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_one_token_per_word(tokenizer, texts):
    """Every text has as many tokens as words: the profiles' lengths, in words, are real tokens."""
    for text in texts:
        if count_tokens(tokenizer, text) != len(text.split()):
            raise SystemExit(f"error: {text[:60]!r}... is not one token per word with this tokenizer")


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


def record_in_package(rows, results, args, command):
    """Store the measured speedups where `trl-prefix-sharing stats` reads them (one entry per mode)."""
    path = os.path.join(os.path.dirname(__file__), "..", "trl_prefix_sharing", "data", "measured_speedups.json")
    recorded = json.load(open(path)) if os.path.exists(path) else {}
    entry = {"device": args.device_name, "model": args.model_desc, "command": command}
    for kind in args.kinds:
        entry[kind] = {
            profile: {
                "p_over_c": PROFILES[profile][0] / PROFILES[profile][1],
                "ideal": round(rows[kind, profile]["ideal"], 3),
                "padded_ideal": round(rows[kind, profile]["padded_ideal"], 3),
                "share_of_ideal": round(rows[kind, profile]["share"], 3),
                **{v: round(x, 3) for v, x in rows[kind, profile]["speed"].items() if v != "stock"},
            }
            for profile in results[kind]
        }
    recorded[args.mode] = entry
    with open(path, "w") as f:
        json.dump(recorded, f, indent=1, sort_keys=True)
        f.write("\n")


def write_outputs(results, args, command):
    os.makedirs(args.out, exist_ok=True)
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
    path = os.path.join(args.out, f"{args.mode}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"{args.mode}.json"), "w") as f:
        json.dump({"command": command, "device": device, "model": args.model_desc, "results": results}, f, indent=1)
    print("\n".join(lines))
    if args.record:
        record_in_package(rows, results, args, command)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot written.")
        return
    from plot_benchmarks import plot_speedup

    # the same drawing as `python scripts/plot_benchmarks.py <out>/<mode>.json` makes from the recorded JSON
    data = {"device": device, "model": args.model_desc, "results": results}
    plot_speedup(data, os.path.join(args.out, f"{args.mode}_speedup.png"), PROFILES)


def quiet_setup(gpu: bool, model: str = "tiny"):
    """Silence progress bars and warnings, check CUDA: (device name, the tokenizer: the tiny word-level one, or with
    `model="smollm2"` SmolLM2-135M-Instruct's)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    from trl_prefix_sharing.testing import make_tokenizer

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--mode gpu needs CUDA.")
    if model == "smollm2":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    else:
        tokenizer = make_tokenizer()
    return torch.cuda.get_device_name() if gpu else f"CPU, {torch.get_num_threads()} threads", tokenizer


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
        help="also store the speedups in trl_prefix_sharing/data/measured_speedups.json (for `stats`; tiny model "
        "only)",
    )
    args = parser.parse_args()
    check_model_options(args)
    if args.record and args.model != "tiny":
        raise SystemExit(
            f"error: --record stores the tiny model's speedups (what `stats` quotes); not with --model {args.model}"
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
    command = shlex.join(["python", "scripts/benchmark.py", *sys.argv[1:]])

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
