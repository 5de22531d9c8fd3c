"""Stock TRL vs pair-only prefix sharing vs the prefix trie, on data whose pairs share more than their own prompt.

    PYTHONPATH=. python scripts/benchmark_trie.py --out docs/benchmarks            # about 4 minutes, one CPU thread
    PYTHONPATH=. python scripts/benchmark_trie.py --out /tmp/trie --quick          # smoke run, under a minute

Three synthetic token datasets (token ids drawn with a seeded RNG, lengths uniform in +-20% of the stated value):

- *UltraFeedback all pairs*: 4 completions per prompt, all 6 pairs; prompt ~120 tokens, completions ~280.
- *Nectar-like*: 7 completions per prompt, all 21 pairs; prompt ~200 tokens, completions ~250.
- *multi-turn*: conversations of 3 turns with a (chosen, rejected) pair at each turn; turn t+1's prompt = turn t's
  prompt + turn t's chosen answer + a new user message (~40 tokens); first prompt ~150 tokens, completions ~150.

The pairs of one prompt (or conversation) are consecutive, as sequential sampling over data ordered by prompt gives,
and are cut into micro-batches of `--batch-size` pairs (per_device_train_batch_size), so a prompt's pairs may straddle
two micro-batches.

Measured:

1. Token positions the policy forward computes per micro-batch, summed over the dataset, from the real collators:
   TRL's `DataCollatorForPreference(pad_token_id=0)` (stock: rows x longest row, and its real tokens, the attention
   mask's ones) and `PrefixSharingCollator` around it with `across_examples=False` (pair-only sharing: each pair shares
   its own prompt) and `across_examples=True` (the trie across the micro-batch's pairs): real positions
   (`document_ids >= 0`) and padded positions (shared rows x their width).
2. CPU step time: one DPO training step (collation, policy and reference forwards, backward, optimizer step) of a tiny
   llama (`trl_prefix_sharing.testing.make_model`, fp32, SDPA), on the same micro-batches, stock `trl.DPOTrainer` vs
   ours with `prefix_sharing=True` and the collator's `across_examples` False or True. A warm-up on two micro-batches,
   then `--repeats` timed passes over every micro-batch, variants interleaved in a rotating order; the median pass.

Before timing, every variant's DPO loss on the first micro-batch of each dataset is checked against stock TRL's to 1e-5
absolute (and its policy log-probs to 1e-5 relative; fp32, identical weights), so the timings measure the same
computation.
Writes `trie_cpu.md` and `trie_cpu.json` to `--out`.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings


VARIANTS = ["stock", "pair-only", "trie"]
#: token ids of the synthetic data: above the tokenizer's special tokens, below the model's vocabulary
FIRST_ID = 8
#: (name, description, counts (full, quick), lengths)
DATASETS = {
    "UltraFeedback all pairs": dict(
        completions=4, prompt=120, completion=280, prompts=(16, 4), shape="4 completions per prompt, all 6 pairs"
    ),
    "Nectar-like": dict(
        completions=7, prompt=200, completion=250, prompts=(8, 2), shape="7 completions per prompt, all 21 pairs"
    ),
    "multi-turn": dict(
        turns=3,
        prompt=150,
        completion=150,
        user=40,
        prompts=(32, 6),
        shape="3 turns per conversation, a pair per turn",
    ),
}


def _ids(rng: random.Random, median: int, vocab: int) -> list[int]:
    n = max(1, round(median * rng.uniform(0.8, 1.2)))
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def make_dataset(name: str, n: int, vocab: int, seed: int = 0) -> list[dict]:
    """Pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`, `group`), the pairs of a prompt/conversation consecutive."""
    spec = DATASETS[name]
    rng = random.Random(f"{name}-{seed}")
    pairs = []
    for group in range(n):
        prompt = _ids(rng, spec["prompt"], vocab)
        if "completions" in spec:  # ranked completions (best first): every pair (better, worse)
            completions = [_ids(rng, spec["completion"], vocab) for _ in range(spec["completions"])]
            for i, j in itertools.combinations(range(len(completions)), 2):
                pairs.append(
                    {
                        "prompt_ids": prompt,
                        "chosen_ids": completions[i],
                        "rejected_ids": completions[j],
                        "group": group,
                    }
                )
        else:  # a conversation: the chosen answer and a new user message extend the next turn's prompt
            for _turn in range(spec["turns"]):
                chosen, rejected = _ids(rng, spec["completion"], vocab), _ids(rng, spec["completion"], vocab)
                pairs.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected, "group": group})
                prompt = prompt + chosen + _ids(rng, spec["user"], vocab)
    return pairs


def micro_batches(pairs: list[dict], size: int) -> list[list[dict]]:
    return [
        [{k: v for k, v in pair.items() if k != "group"} for pair in pairs[i : i + size]]
        for i in range(0, len(pairs), size)
    ]


def count_positions(batches: list[list[dict]]) -> dict:
    """Positions per variant, summed over the micro-batches, from TRL's collator and ours around it."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from trl_prefix_sharing import PrefixSharingCollator

    stock = DataCollatorForPreference(pad_token_id=0)
    shared = {
        "pair-only": PrefixSharingCollator(stock, pad_token_id=0, across_examples=False),
        "trie": PrefixSharingCollator(stock, pad_token_id=0, across_examples=True),
    }
    counts = {variant: {"padded": 0, "real": 0, "rows": 0, "width_max": 0, "attention": 0} for variant in VARIANTS}
    for examples in batches:
        batch = stock(examples)
        rows, width = batch["input_ids"].shape
        entry = counts["stock"]
        entry["padded"] += rows * width
        entry["real"] += int(batch["attention_mask"].sum())
        entry["rows"] += rows
        entry["width_max"] = max(entry["width_max"], width)
        entry["attention"] += rows * width * width
        for variant, collator in shared.items():
            layout = collator(examples)["prefix_sharing"]
            rows, width = layout.input_ids.shape
            entry = counts[variant]
            entry["padded"] += rows * width
            entry["real"] += int((layout.document_ids >= 0).sum())
            entry["rows"] += rows
            entry["width_max"] = max(entry["width_max"], width)
            entry["attention"] += rows * width * width
    return counts


def make_trainers(vocab: int, batch_size: int, tmp: str, hidden_size: int, layers: int) -> dict:
    """Stock `trl.DPOTrainer` and two of ours (pair-only, trie) from identical policy and reference weights."""
    import trl
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_prefix_sharing import DPOConfig, DPOTrainer
    from trl_prefix_sharing.testing import make_model, make_tokenizer

    tokenizer = make_tokenizer()
    policy = make_model("llama", vocab, seed=0, hidden_size=hidden_size, num_layers=layers)
    reference = make_model("llama", vocab, seed=1, hidden_size=hidden_size, num_layers=layers)
    # the trainers only need a dataset to be built: the timed micro-batches are token ids given to their collators
    dataset = Dataset.from_list([{"prompt": "w1 w2 w3", "chosen": " w4 w5", "rejected": " w6"}] * 8)
    common = dict(
        per_device_train_batch_size=batch_size,
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=10_000,
        save_strategy="no",
        max_length=None,
        seed=0,
        learning_rate=1e-6,
        disable_tqdm=True,
    )
    trainers = {}
    for variant in VARIANTS:
        ours = variant != "stock"
        config_class, trainer_class = (DPOConfig, DPOTrainer) if ours else (trl.DPOConfig, trl.DPOTrainer)
        extra = {"prefix_sharing": True} if ours else {}
        trainer = trainer_class(
            model=copy.deepcopy(policy),
            ref_model=copy.deepcopy(reference),
            args=config_class(output_dir=os.path.join(tmp, variant), **extra, **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
        if ours:
            trainer.data_collator.across_examples = variant == "trie"
        trainer.model.train()
        trainer.create_optimizer()
        trainers[variant] = trainer
    return trainers


def loss_and_logps(trainer, examples):
    """DPO loss and policy log-probs (chosen, rejected) of one micro-batch, no optimizer step."""
    import torch

    trainer._metrics["train"].clear()
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    return loss, torch.cat([chosen, rejected])


def verify(trainers: dict, examples: list[dict], name: str) -> dict:
    """Every variant's loss and policy log-probs equal stock TRL's (fp32, identical weights): max abs differences."""
    import torch

    stock_loss, stock_logps = loss_and_logps(trainers["stock"], examples)
    result = {}
    for variant in VARIANTS[1:]:
        loss, logps = loss_and_logps(trainers[variant], examples)
        loss_diff = abs(float(loss) - float(stock_loss))
        assert loss_diff <= 1e-5, f"{name}, {variant}: loss {float(loss)} vs stock {float(stock_loss)}"
        torch.testing.assert_close(logps, stock_logps, atol=1e-4, rtol=1e-5, msg=f"{name}, {variant}: log-probs")
        result[variant] = {"loss_abs_diff": loss_diff, "logps_max_abs_diff": float((logps - stock_logps).abs().max())}
    result["stock_loss"] = float(stock_loss)
    result["stock_logps_max_abs"] = float(stock_logps.abs().max())
    return result


def train_step(trainer, examples):
    """What `Trainer.train` does per micro-batch (no gradient accumulation): collate, loss, backward, optimizer."""
    trainer._metrics["train"].clear()
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def time_pass(trainer, batches) -> float:
    start = time.perf_counter()
    for examples in batches:
        train_step(trainer, examples)
    return time.perf_counter() - start


def run_timing(trainers: dict, batches: list[list[dict]], repeats: int) -> dict:
    """Warm-up pass each, then `repeats` passes per variant, interleaved in a rotating order."""
    for trainer in trainers.values():
        time_pass(trainer, batches[:2])
    passes = {variant: [] for variant in VARIANTS}
    for round_ in range(repeats):
        shift = round_ % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            passes[variant].append(time_pass(trainers[variant], batches))
    return {
        variant: {
            "pass_s": [round(t, 4) for t in times],
            "median_pass_s": statistics.median(times),
            "median_step_s": statistics.median(times) / len(batches),
        }
        for variant, times in passes.items()
    }


def _ratio(a, b):
    return a / b if b else float("inf")


def write_outputs(results: dict, args, command: str, environment: str) -> str:
    bs = args.batch_size
    lines = [
        "# Prefix trie vs pair-only sharing vs stock TRL (CPU)",
        "",
        "Data where a prompt's pairs share more than one prompt: all pairs of K ranked completions (UltraFeedback, "
        "Nectar), and multi-turn conversations with a pair at each turn. Pair-only sharing "
        "(`PrefixSharingCollator(across_examples=False)`) computes each pair's prompt once; the trie "
        "(`across_examples=True`, the default) computes every prefix the rows of a micro-batch share once, across "
        "pairs: a prompt shared by several pairs, a completion that is the chosen answer of one pair and the "
        "rejected answer of another, and a turn's prompt and chosen answer that begin the next turn's prompt.",
        "",
        f"Command: `{command}`",
        "",
        f"Environment: {environment}.",
        "",
        "## Data",
        "",
        "Synthetic token ids (seeded RNG), each length uniform in +-20% of the value given. The pairs of one prompt "
        f"(conversation) are consecutive, as sequential sampling over data ordered by prompt gives, and are cut into "
        f"micro-batches of {bs} pairs (`per_device_train_batch_size={bs}`), so a prompt's pairs can straddle two "
        "micro-batches, and only the pairs inside one micro-batch share.",
        "",
        "| dataset | shape | prompt | completion | prompts | pairs | micro-batches |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        spec = DATASETS[name]
        prompt = f"~{spec['prompt']}" + (
            f" (first turn; + chosen + ~{spec['user']}-token user message per turn)" if "turns" in spec else ""
        )
        lines.append(
            f"| {name} | {spec['shape']} | {prompt} | ~{spec['completion']} | {r['prompts']} | {r['pairs']} | "
            f"{r['micro_batches']} |"
        )
    lines += [
        "",
        "## Token positions the policy forward computes",
        "",
        "Summed over the dataset's micro-batches, from the real collators: TRL's `DataCollatorForPreference` (stock: "
        "*padded* = rows x longest row, what stock TRL's padded batches run; *real* = its attention mask's ones) and "
        "`PrefixSharingCollator` around it (*real* = `document_ids >= 0`; *padded* = shared rows x their width, what "
        "a dense-attention forward runs). The reference forward computes the same positions. *Dense attention "
        "entries* = rows x width^2 summed over micro-batches, the query-key scores per head and layer that SDPA with "
        "a dense mask computes (masked ones included): what a longer row costs.",
        "",
        "| dataset | stock padded | stock real | pair-only real | pair-only padded | trie real | trie padded | "
        "rows per micro-batch (stock / pair-only / trie) | widest row (stock / pair-only / trie) | dense attention "
        "entries, millions (stock / pair-only / trie) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        c = r["positions"]
        n = r["micro_batches"]
        lines.append(
            f"| {name} | {c['stock']['padded']:,} | {c['stock']['real']:,} | {c['pair-only']['real']:,} | "
            f"{c['pair-only']['padded']:,} | {c['trie']['real']:,} | {c['trie']['padded']:,} | "
            f"{c['stock']['rows'] / n:.1f} / {c['pair-only']['rows'] / n:.1f} / {c['trie']['rows'] / n:.1f} | "
            f"{c['stock']['width_max']} / {c['pair-only']['width_max']} / {c['trie']['width_max']} | "
            + " / ".join(f"{c[v]['attention'] / 1e6:.1f}" for v in VARIANTS)
            + " |"
        )
    lines += [
        "",
        "Ratios (higher = fewer positions). *Removing padding* = stock padded / stock real: what any unpadded layout "
        "saves. *Sharing* = stock real / shared real: what computing shared prefixes once saves on top. *Total* = "
        "stock padded / shared padded: the positions a padded dense forward runs.",
        "",
        "| dataset | removing padding | sharing, pair-only | sharing, trie | trie / pair-only (real) | "
        "total, pair-only | total, trie | trie / pair-only (padded) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        c = r["positions"]
        lines.append(
            f"| {name} | {_ratio(c['stock']['padded'], c['stock']['real']):.2f}x | "
            f"{_ratio(c['stock']['real'], c['pair-only']['real']):.2f}x | "
            f"{_ratio(c['stock']['real'], c['trie']['real']):.2f}x | "
            f"{_ratio(c['pair-only']['real'], c['trie']['real']):.2f}x | "
            f"{_ratio(c['stock']['padded'], c['pair-only']['padded']):.2f}x | "
            f"{_ratio(c['stock']['padded'], c['trie']['padded']):.2f}x | "
            f"{_ratio(c['pair-only']['padded'], c['trie']['padded']):.2f}x |"
        )
    lines += [
        "",
        "## CPU step time",
        "",
        f"One DPO training step per micro-batch (collation, policy and reference forwards, backward, AdamW step) of "
        f"{args.model_desc}; stock `trl.DPOTrainer` vs ours (`prefix_sharing=True`, dense boolean mask through SDPA "
        f"on CPU) with pair-only sharing and with the trie. A warm-up on two micro-batches each, then "
        f"{args.repeats} timed passes over all micro-batches, variants interleaved in a rotating order; the median "
        "pass, divided by the micro-batches. Speedup = stock time / variant time.",
        "",
        "| dataset | stock s/step | pair-only s/step | trie s/step | speedup, pair-only | speedup, trie | "
        "trie vs pair-only |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        t = {v: r["timing"][v]["median_step_s"] for v in VARIANTS}
        lines.append(
            f"| {name} | {t['stock']:.3f} | {t['pair-only']:.3f} | {t['trie']:.3f} | "
            f"{_ratio(t['stock'], t['pair-only']):.2f}x | {_ratio(t['stock'], t['trie']):.2f}x | "
            f"{_ratio(t['pair-only'], t['trie']):.2f}x |"
        )
    lines += [
        "",
        "Checked before timing, on the first micro-batch of each dataset, identical weights, fp32: the DPO loss of "
        "each variant minus stock TRL's (must be <= 1e-5), and the largest difference of the policy log-probs (each "
        "a sum over a completion's tokens; the largest of stock's, in absolute value, is given for scale).",
        "",
        "| dataset | stock loss | largest stock log-prob | pair-only: loss diff / log-prob diff | "
        "trie: loss diff / log-prob diff |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        v = r["verified"]
        lines.append(
            f"| {name} | {v['stock_loss']:.6f} | {v['stock_logps_max_abs']:.1f} | "
            f"{v['pair-only']['loss_abs_diff']:.1e} / "
            f"{v['pair-only']['logps_max_abs_diff']:.1e} | {v['trie']['loss_abs_diff']:.1e} / "
            f"{v['trie']['logps_max_abs_diff']:.1e} |"
        )
    lines += ["", "## Reading the numbers", ""] + [f"- {s}" for s in reading(results, args.model_desc)]
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "trie_cpu.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "trie_cpu.json"), "w") as f:
        json.dump(
            {
                "command": command,
                "environment": environment,
                "model": args.model_desc,
                "batch_size": bs,
                "repeats": args.repeats,
                "results": results,
            },
            f,
            indent=1,
        )
    return text


def reading(results: dict, model_desc: str) -> list[str]:
    """A few sentences on the numbers, each computed from them."""
    out = []
    for name, r in results.items():
        c, t = r["positions"], {v: r["timing"][v]["median_step_s"] for v in VARIANTS}
        pad = _ratio(c["stock"]["padded"], c["stock"]["real"])
        pair = _ratio(c["stock"]["real"], c["pair-only"]["real"])
        trie = _ratio(c["stock"]["real"], c["trie"]["real"])
        step_pair, step_trie = _ratio(t["stock"], t["pair-only"]), _ratio(t["stock"], t["trie"])
        attention = {v: c[v]["attention"] / 1e6 for v in VARIANTS}
        width = {v: c[v]["width_max"] for v in VARIANTS}
        sentence = (
            f"**{name}**: removing stock's padding alone would save {pad:.2f}x of the positions; sharing each "
            f"pair's prompt saves {pair:.2f}x of the real tokens, the trie {trie:.2f}x "
            f"({_ratio(c['pair-only']['real'], c['trie']['real']):.2f}x fewer than pair-only). Step time: "
            f"{step_pair:.2f}x (pair-only) and {step_trie:.2f}x (trie) over stock."
        )
        if step_pair < 1.03:  # within timing noise of stock, or slower
            sentence += (
                f" Pair-only sharing is {'slower than' if step_pair < 0.97 else 'no faster than'} stock here although "
                f"it computes fewer positions: a pair's row (up to {width['pair-only']} tokens) is longer than "
                f"stock's two rows (up to {width['stock']}), and dense attention costs the square of the row length "
                f"whatever the mask ({attention['pair-only']:.1f}M entries vs stock's {attention['stock']:.1f}M)."
            )
        if step_trie < 1.03 * step_pair:
            sentence += (
                f" The trie is {'slower than' if step_trie < 0.97 * step_pair else 'no faster than'} pair-only here "
                f"although it computes fewer positions: its rows are longer (up to {width['trie']} vs "
                f"{width['pair-only']} tokens; {attention['trie']:.1f}M vs {attention['pair-only']:.1f}M dense "
                "attention entries)."
            )
        elif width["trie"] > width["pair-only"]:
            sentence += (
                f" The trie's rows are longer (up to {width['trie']} vs {width['pair-only']} tokens) but fewer, so "
                f"its dense attention entries are {attention['trie']:.1f}M vs pair-only's "
                f"{attention['pair-only']:.1f}M and stock's {attention['stock']:.1f}M."
            )
        out.append(sentence)
    out.append(
        f"The timed model is {model_desc}. Its linear layers and LM head cost little per position, so attention, "
        "quadratic in the row length and computed densely on CPU, weighs more in its step time than in a model of "
        "realistic width; the position counts do not depend on the model."
    )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer prompts and repeats (smoke run)")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per micro-batch")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per variant (default 5, quick 2)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=32, help="llama width (default: make_config's, 32)")
    parser.add_argument("--layers", type=int, default=2, help="llama layers (default: make_config's, 2)")
    args = parser.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 5)
    command = "python scripts/benchmark_trie.py " + " ".join(sys.argv[1:])

    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    import datasets
    import torch
    import transformers
    import trl
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    environment = (
        f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} thread"
        f"{'s' if torch.get_num_threads() > 1 else ''}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}"
    )

    data = {name: make_dataset(name, spec["prompts"][bool(args.quick)], args.vocab) for name, spec in DATASETS.items()}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = make_trainers(args.vocab, args.batch_size, tmp, args.hidden_size, args.layers)
        model = trainers["stock"].model
        cfg = model.config
        args.model_desc = (
            f"a tiny llama ({sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters: hidden "
            f"{cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocabulary {cfg.vocab_size}; fp32) with a reference "
            "model of the same shape"
        )
        batches = {name: micro_batches(pairs, args.batch_size) for name, pairs in data.items()}
        for name, pairs in data.items():  # before any optimizer step: the weights are still identical
            results[name] = {
                "prompts": DATASETS[name]["prompts"][bool(args.quick)],
                "pairs": len(pairs),
                "micro_batches": len(batches[name]),
                "verified": verify(trainers, batches[name][0], name),
            }
            print(f"{name}: losses equal ({results[name]['verified']})", flush=True)
        for name in data:
            results[name]["positions"] = count_positions(batches[name])
            results[name]["timing"] = run_timing(trainers, batches[name], args.repeats)
            print(f"{name}: {results[name]['positions']} {results[name]['timing']}", flush=True)
    print(write_outputs(results, args, command, environment))


if __name__ == "__main__":
    main()
