"""Stock TRL vs pair-only prefix sharing vs the prefix trie, on data whose pairs share more than their own prompt
(`DATASETS`): the positions the policy forward computes, from the real collators, and the CPU time of a DPO training
step, after checking each variant's loss and log-probs against stock's. Writes `trie_cpu.md` (which defines every
column) and `trie_cpu.json` to `--out`.

    python -m benchmarks.trie --out docs/benchmarks            # about 4 minutes, one CPU thread
    python -m benchmarks.trie --out /tmp/trie --quick          # smoke run, under a minute
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time

from trl_prefix_sharing.testing.trainers import build_trainer

from .measure import CountingCollator, interleave
from .models import quiet_setup
from .results import command_line, document, markdown_table, times, versions, write_result


VARIANTS = ["stock", "pair-only", "trie"]
SPEEDUPS = [("stock", "pair-only"), ("stock", "trie"), ("pair-only", "trie")]
#: the positions of the first table, and its ratios (variant, count) over (variant, count)
POSITIONS = "stock.padded stock.real pair-only.real pair-only.padded trie.real trie.padded"
RATIOS = "stock.padded/stock.real stock.real/pair-only.real stock.real/trie.real pair-only.real/trie.real "
RATIOS += "stock.padded/pair-only.padded stock.padded/trie.padded pair-only.padded/trie.padded"
#: token ids of the synthetic data: above the tokenizer's special tokens, below the model's vocabulary
FIRST_ID = 8
#: completions per prompt (all their pairs) or turns per conversation (a pair each), lengths, prompts (full, quick)
DATASETS = {
    "UltraFeedback all pairs": dict(completions=4, prompt=120, completion=280, prompts=(16, 4)),
    "Nectar-like": dict(completions=7, prompt=200, completion=250, prompts=(8, 2)),
    "multi-turn": dict(turns=3, prompt=150, completion=150, user=40, prompts=(32, 6)),
}


def make_dataset(name: str, n: int, vocab: int, seed: int = 0) -> list[dict]:
    """Pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`), the pairs of a prompt/conversation consecutive; token ids
    drawn with a seeded RNG, each length uniform in +-20% of the dataset's."""
    spec, rng, pairs = DATASETS[name], random.Random(f"{name}-{seed}"), []

    def ids(rng, median, vocab):
        return [rng.randrange(FIRST_ID, vocab) for _ in range(max(1, round(median * rng.uniform(0.8, 1.2))))]

    for _group in range(n):
        prompt = ids(rng, spec["prompt"], vocab)
        if "completions" in spec:  # ranked completions (best first): every pair (better, worse)
            completions = [ids(rng, spec["completion"], vocab) for _ in range(spec["completions"])]
            for i, j in itertools.combinations(range(len(completions)), 2):
                pairs.append({"prompt_ids": prompt, "chosen_ids": completions[i], "rejected_ids": completions[j]})
        else:  # a conversation: the chosen answer and a new user message extend the next turn's prompt
            for _turn in range(spec["turns"]):
                chosen, rejected = ids(rng, spec["completion"], vocab), ids(rng, spec["completion"], vocab)
                pairs.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
                prompt = prompt + chosen + ids(rng, spec["user"], vocab)
    return pairs


def count_positions(batches: list[list[dict]]) -> dict:
    """Positions per variant, summed over the micro-batches, from TRL's collator and ours around it."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from trl_prefix_sharing import PrefixSharingCollator

    stock = DataCollatorForPreference(pad_token_id=0)
    shared = {v: PrefixSharingCollator(stock, pad_token_id=0, across_examples=v == "trie") for v in VARIANTS[1:]}
    counters = {v: CountingCollator(collator) for v, collator in {"stock": stock, **shared}.items()}
    for examples, counter in itertools.product(batches, counters.values()):
        counter(examples)
    return {
        v: {"padded": c.positions, "real": c.tokens, "rows": c.rows, "width_max": c.widest, "attention": c.attention}
        for v, c in counters.items()
    }


def make_trainers(args, tmp: str) -> dict:
    """Stock `trl.DPOTrainer` and two of ours (pair-only, trie) from identical policy and reference weights."""
    from datasets import Dataset

    from trl_prefix_sharing.testing import make_model, make_tokenizer

    shape = dict(hidden_size=args.hidden_size, num_layers=args.layers)
    policy, reference = (make_model("llama", args.vocab, seed=seed, **shape) for seed in (0, 1))
    tokenizer = make_tokenizer()
    # the trainers only need a dataset to be built: the timed micro-batches are token ids given to their collators
    dataset = Dataset.from_list([{"prompt": "w1 w2 w3", "chosen": " w4 w5", "rejected": " w6"}] * 8)
    common = dict(model=policy, ref_model=reference, tokenizer=tokenizer, train_dataset=dataset, learning_rate=1e-6)
    common.update(per_device_train_batch_size=args.batch_size, bf16=False, use_cpu=True, max_length=None)
    trainers = {}
    for variant in VARIANTS:
        ours = {} if variant == "stock" else {"prefix_sharing": True}
        trainers[variant] = t = build_trainer("dpo", stock=not ours, output_dir=f"{tmp}/{variant}", **common, **ours)
        if ours:
            t.data_collator.across_examples = variant == "trie"
        t.model.train()
        t.create_optimizer()
    return trainers


def verify(trainers: dict, examples: list[dict], name: str) -> dict:
    """Every variant's DPO loss and policy log-probs (chosen, rejected) of one micro-batch equal stock TRL's (fp32,
    identical weights, no optimizer step): the largest differences."""
    import torch

    measured = {}
    for variant, trainer in trainers.items():
        trainer._metrics["train"].clear()
        batch = trainer._prepare_inputs(trainer.data_collator(examples))
        with torch.no_grad():
            loss = float(trainer.compute_loss(trainer.model, batch))
            measured[variant] = loss, torch.cat(trainer.compute_ref_log_probs(trainer.model, batch))
    stock_loss, stock_logps = measured["stock"]
    result = {"stock_loss": stock_loss, "stock_logps_max_abs": float(stock_logps.abs().max())}
    for variant in VARIANTS[1:]:
        loss, logps = measured[variant]
        assert abs(loss - stock_loss) <= 1e-5, f"{name}, {variant}: loss {loss} vs stock {stock_loss}"
        torch.testing.assert_close(logps, stock_logps, atol=1e-4, rtol=1e-5, msg=f"{name}, {variant}: log-probs")
        result[variant] = dict(
            loss_abs_diff=abs(loss - stock_loss), logps_max_abs_diff=float((logps - stock_logps).abs().max())
        )
    return result


def run_timing(trainers: dict, batches: list[list[dict]], repeats: int) -> dict:
    """A warm-up pass on two micro-batches each, then `repeats` timed passes per variant over all of them, interleaved
    in a rotating order; a pass does per micro-batch what `Trainer.train` does (collate, loss, backward, optimizer
    step; no gradient accumulation)."""

    def time_pass(trainer, batches) -> float:
        start = time.perf_counter()
        for examples in batches:
            trainer._metrics["train"].clear()
            trainer.compute_loss(trainer.model, trainer._prepare_inputs(trainer.data_collator(examples))).backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for trainer in trainers.values():
        time_pass(trainer, batches[:2])
    passes = interleave(lambda variant: time_pass(trainers[variant], batches), VARIANTS, repeats)
    timing = {}
    for variant, seconds in passes.items():
        median = statistics.median(seconds)
        timing[variant] = dict(
            pass_s=[round(t, 4) for t in seconds], median_pass_s=median, median_step_s=median / len(batches)
        )
    return timing


def tables(results: dict, args) -> list[str]:
    """The data, positions, ratios, step times and the check before timing, as Markdown tables."""
    data, positions, ratios, steps, checks = [], [], [], [], []
    for name, r in results.items():
        spec, c, v = DATASETS[name], r["positions"], r["verified"]
        t = {variant: r["timing"][variant]["median_step_s"] for variant in VARIANTS}
        n = spec.get("completions", 0)
        shape, prompt = f"{n} completions per prompt, all {n * (n - 1) // 2} pairs", f"~{spec['prompt']}"
        if "turns" in spec:
            shape = f"{spec['turns']} turns per conversation, a pair per turn"
            prompt += f" (first turn; + chosen + ~{spec['user']}-token user message per turn)"
        data.append([name, shape, prompt, f"~{spec['completion']}", r["prompts"], r["pairs"], r["micro_batches"]])
        each = [" / ".join(f"{c[x]['rows'] / r['micro_batches']:.1f}" for x in VARIANTS)]
        each += [" / ".join(str(c[x]["width_max"]) for x in VARIANTS)]
        each += [" / ".join(f"{c[x]['attention'] / 1e6:.1f}" for x in VARIANTS)]
        counts = (part.split(".") for part in POSITIONS.split())
        positions.append([name, *(f"{c[x][count]:,}" for x, count in counts), *each])
        pairs = [[part.split(".") for part in ratio.split("/")] for ratio in RATIOS.split()]
        ratios.append([name, *(times(c[a][x], c[b][y]) for (a, x), (b, y) in pairs)])
        steps.append([name, *(f"{t[x]:.3f}" for x in VARIANTS), *(times(t[a], t[b]) for a, b in SPEEDUPS)])
        checks.append([name, f"{v['stock_loss']:.6f}", f"{v['stock_logps_max_abs']:.1f}"])
        checks[-1] += [f"{v[x]['loss_abs_diff']:.1e} / {v[x]['logps_max_abs_diff']:.1e}" for x in VARIANTS[1:]]
    three, bs = "(stock / pair-only / trie)", args.batch_size
    return document(
        "## Data",
        "Synthetic token ids (seeded RNG), each length uniform in +-20% of the value given. The pairs of one prompt "
        f"(conversation) are consecutive, as sequential sampling over data ordered by prompt gives, cut into "
        f"micro-batches of {bs} pairs (`per_device_train_batch_size={bs}`): only the pairs inside one share.",
        markdown_table("dataset|shape|prompt|completion|prompts|pairs|micro-batches", data),
        "## Token positions the policy forward computes",
        "Summed over the micro-batches, from the real collators (the reference forward computes the same): stock "
        "TRL's `DataCollatorForPreference` (*padded* = rows x longest row; *real* = its attention mask's ones) and "
        "`PrefixSharingCollator` around it (*real* = `document_ids >= 0`; *padded* = shared rows x their width). "
        "*Dense attention entries* = rows x width^2, the scores per head and layer that SDPA with a dense mask "
        "computes (masked ones included): what a longer row costs.",
        markdown_table(
            "dataset|stock padded|stock real|pair-only real|pair-only padded|trie real|trie padded|"
            f"rows per micro-batch {three}|widest row {three}|dense attention entries, millions {three}",
            positions,
        ),
        "Ratios (higher = fewer positions): *removing padding* = stock padded / stock real, what any unpadded layout "
        "saves; *sharing* = stock real / shared real, what computing shared prefixes once saves on top; *total* = "
        "stock padded / shared padded, the positions a padded dense forward runs.",
        markdown_table(
            "dataset|removing padding|sharing, pair-only|sharing, trie|trie / pair-only (real)|total, pair-only|"
            "total, trie|trie / pair-only (padded)",
            ratios,
        ),
        "## CPU step time",
        f"One DPO training step per micro-batch (collation, policy and reference forwards, backward, AdamW step) of "
        f"{args.model_desc}; stock `trl.DPOTrainer` vs ours (`prefix_sharing=True`, SDPA's dense mask) with pair-only "
        f"sharing and with the trie. After a warm-up on two micro-batches, {args.repeats} timed passes over all of "
        "them, variants interleaved in a rotating order; the median pass / micro-batches. Speedup = stock / variant.",
        markdown_table(
            "dataset|stock s/step|pair-only s/step|trie s/step|speedup, pair-only|speedup, trie|trie vs pair-only",
            steps,
        ),
        "Checked before timing, on each dataset's first micro-batch (identical weights, fp32): each variant's DPO "
        "loss minus stock's (at most 1e-5) and the largest difference of the policy log-probs (sums over a "
        "completion; stock's largest, in absolute value, for scale).",
        markdown_table(
            "dataset|stock loss|largest stock log-prob|pair-only: loss diff / log-prob diff|trie: loss diff / "
            "log-prob diff",
            checks,
        ),
    )


def reading(results: dict, model_desc: str) -> list[str]:
    """Where a layout computes fewer positions than another but runs no faster (within 3%), and why."""
    out = []
    for name, r in results.items():
        c, t = r["positions"], {v: r["timing"][v]["median_step_s"] for v in VARIANTS}
        for v, x in (("pair-only", "stock"), ("trie", "pair-only")):
            if t[v] > t[x] / 1.03:
                out.append(
                    f"**{name}**: {v} is no faster than {x} although it computes fewer positions: its rows are up to "
                    f"{c[v]['width_max']} tokens long against {x}'s {c[x]['width_max']}, "
                    f"{c[v]['attention'] / 1e6:.1f}M dense attention entries against {c[x]['attention'] / 1e6:.1f}M."
                )
    return out + [
        "Dense attention (SDPA on the CPU) costs the square of the row length whatever the mask, so longer rows can "
        f"cost more than the positions they save. The timed model is {model_desc}; its linear layers and LM head cost "
        "little per position, so attention weighs more in its step time than in a model of realistic width. The "
        "position counts do not depend on the model."
    ]


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
    import torch

    torch.set_num_threads(args.threads)
    device, _ = quiet_setup(False)
    environment = f"{device}; " + ", ".join(f"{package} {version}" for package, version in versions().items())
    data = {name: make_dataset(name, spec["prompts"][bool(args.quick)], args.vocab) for name, spec in DATASETS.items()}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = make_trainers(args, tmp)
        model, cfg = trainers["stock"].model, trainers["stock"].model.config
        args.model_desc = (
            f"a tiny llama ({sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters: hidden "
            f"{cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocabulary {cfg.vocab_size}; fp32) with a reference "
            "model of the same shape"
        )
        for name, pairs in data.items():  # before any optimizer step: the weights are still identical
            batches = [pairs[i : i + args.batch_size] for i in range(0, len(pairs), args.batch_size)]
            results[name] = r = dict(prompts=DATASETS[name]["prompts"][bool(args.quick)], pairs=len(pairs))
            r.update(micro_batches=len(batches), batches=batches, verified=verify(trainers, batches[0], name))
        for name, r in results.items():
            batches = r.pop("batches")
            r["positions"], r["timing"] = count_positions(batches), run_timing(trainers, batches, args.repeats)
            print(name, r, flush=True)
    command = command_line("trie")
    lines = document(
        "# Prefix trie vs pair-only sharing vs stock TRL (CPU)",
        "Data where a prompt's pairs share more than one prompt. Pair-only sharing "
        "(`PrefixSharingCollator(across_examples=False)`) computes each pair's prompt once; the trie (`True`, the "
        "default) every prefix the rows of a micro-batch share, across pairs: a prompt of several pairs, a completion "
        "chosen in one pair and rejected in another, a turn that begins the next turn's prompt.",
        f"Command: `{command}`",
        f"Environment: {environment}.",
        tables(results, args),
        "## Reading the numbers",
        [f"- {sentence}" for sentence in reading(results, args.model_desc)],
    )
    info = {"model": args.model_desc, "batch_size": args.batch_size, "repeats": args.repeats}
    write_result(args.out, "trie_cpu", {"command": command, "device": environment, **info, "results": results}, lines)


if __name__ == "__main__":
    main()
