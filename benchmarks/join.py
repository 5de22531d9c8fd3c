"""Sharing across examples (`prefix_sharing_join`): stock TRL vs `"prompts"` vs `"always"` vs `"auto"` on data whose
examples start alike (`PROFILES`), and the cost model `"auto"` chooses by against the measured step times. Per trainer
and profile, one micro-batch (DPO: 4 pairs; GRPO: 4 prompts x 4 generations, the prompts of one length, and for
`--varied` profiles of varied lengths too; SFT: 2 prompts x 4 completions) through the trainer's own loss and backward
in each variant (`FIXED`), after warm-up steps, the variants interleaved. Writes `<name>.md` and `<name>.json` (default
`join_cpu`) to `--out`; `--merge` keeps the rows of the saved JSON this run does not rerun.

    python -m benchmarks.join --trainers dpo,grpo --out docs/benchmarks       # ~50 minutes on 2 cores
    python -m benchmarks.join --trainers grpo --out docs/benchmarks --merge   # GRPO's rows again, DPO's kept
    python -m benchmarks.join --trainers sft --name join_sft_cpu --out docs/benchmarks
    python -m benchmarks.join --render docs/benchmarks/join_cpu.json   # the markdown again, from a saved run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from trl_prefix_sharing.testing.trainers import build_trainer

from .measure import clone_batch, interleave
from .models import build_model, quiet_setup
from .results import command_line, document, markdown_table, times, write_result


#: shared tokens, question tokens, answer tokens
PROFILES = {"tool-calling": (2048, 40, 160), "rag": (1536, 30, 100), "chat-header": (32, 100, 400)}
VARIANTS = ["stock", "prompts", "always", "varlen", "auto"]
#: the variants' options: the join rules on the dense mask (SDPA), the varlen kernel (its reference on the CPU) with
#: the join chosen by the multiply-add count, and `"auto"`, which measures every candidate, stock's rows included
FIXED = {
    variant: {"prefix_sharing": True, "prefix_sharing_join": join, "prefix_sharing_attn_implementation": kernel}
    for variant, join, kernel in [("prompts", "prompts", "sdpa"), ("always", "always", "sdpa")]
    + [("varlen", "auto", "varlen"), ("auto", "auto", "auto")]
}
TRAINERS = ("dpo", "grpo", "sft")
#: trainers whose collator builds the layout (the rest build it in the step)
COLLATED = ("dpo", "sft")
#: the arguments a run's rows depend on (`--merge` refuses others); a GRPO profile's label on prompts of varied lengths
SIZES, VARIED = ("examples", "repeats", "length_scale", "hidden_size", "layers"), " (varied lengths)"


def text_data(trainer, profile, n, scale):
    """DPO: `n` pairs (the profile's shared start, a question, two answers; `rag`: questions about one document);
    SFT: 2 prompts x 4 completions (rejection sampling, best-of-n). Each question and answer within 30% of the
    profile's length; words that are each one token of the tiny tokenizer."""
    from datasets import Dataset

    from trl_prefix_sharing.testing import WORDS

    shared, question, answer = (max(1, round(x * scale)) for x in PROFILES[profile])
    rng = random.Random(f"{profile}-0" if trainer == "dpo" else f"{profile}-sft-0")

    def words(n):
        return " ".join(rng.choice(WORDS[:200]) for _ in range(n))

    def draw(median):
        return words(max(1, round(median * rng.uniform(0.7, 1.3))))

    start, rows = words(shared), []
    for _ in range(n if trainer == "dpo" else 2):
        prompt = f"{start} {draw(question)}"
        if trainer == "dpo":
            rows.append({"prompt": prompt, "chosen": " " + draw(answer), "rejected": " " + draw(answer)})
        else:
            rows += [{"prompt": prompt, "completion": " " + draw(answer)} for _ in range(4)]
    return Dataset.from_list(rows)


def generation_batch(profile, prompts, g, scale, tokenizer, seed=0, varied=False):
    """GRPO rows as its generation step returns them: `prompts` prompts (the shared start, then a question of the
    profile's length, or `varied`: each question's length drawn within 30% of it, no two alike) left-padded, `g`
    completions each right-padded and ending with EOS."""
    import torch
    from trl.trainer.utils import pad

    shared, question, answer = (max(1, round(x * scale)) for x in PROFILES[profile])
    rng = random.Random(f"{profile}-grpo-{seed}")
    low, vocab = 8, len(tokenizer)
    start, rows, completions = [rng.randrange(low, vocab) for _ in range(shared)], [], []
    span = range(low_q := round(question * 0.7), max(round(question * 1.3) + 1, low_q + prompts))  # wide enough
    for length in rng.sample(span, prompts) if varied else [question] * prompts:
        prompt = start + [rng.randrange(low, vocab) for _ in range(length)]
        for _ in range(g):
            rows.append(prompt)
            size = max(1, round(answer * rng.uniform(0.7, 1.3)))
            completions.append([rng.randrange(low, vocab) for _ in range(size - 1)] + [tokenizer.eos_token_id])

    def padded(seqs, side, mask=False):
        tensors = [torch.ones(len(s), dtype=torch.long) if mask else torch.tensor(s) for s in seqs]
        return pad(tensors, padding_value=0 if mask else tokenizer.pad_token_id, padding_side=side)

    completion_mask = padded(completions, "right", mask=True)
    return {
        "prompt_ids": padded(rows, "left"),
        "prompt_mask": padded(rows, "left", mask=True),
        "completion_ids": padded(completions, "right"),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([rng.gauss(0, 1) for _ in rows]),
        "num_items_in_batch": completion_mask.sum(),
    }


def step(trainer, inputs, collated):
    """(seconds of collation with the layout, 0 for GRPO, which builds it in the step; seconds of loss and backward;
    the batch)."""
    batch = None if collated else clone_batch(inputs)  # GRPO: a new generation batch
    start = time.perf_counter()
    if collated:
        batch = trainer._prepare_inputs(trainer.data_collator(inputs))
    host = time.perf_counter() - start if collated else 0.0
    trainer.model.train()
    trainer.compute_loss(trainer.model, batch).backward()
    trainer.model.zero_grad(set_to_none=True)
    return host, time.perf_counter() - start - host, batch


def run(trainer_name, profile, model, tokenizer, args, tmp, varied=False):
    """Every variant on one micro-batch of the profile (GRPO: `varied`, its prompts of varied lengths; warm-up, then
    interleaved timed steps): its rows, join, kernel, cost estimates and step times."""
    import torch
    from datasets import Dataset

    from trl_prefix_sharing.cost import StepCost
    from trl_prefix_sharing.tuning import SAMPLES

    collated, rows = trainer_name in COLLATED, None
    batch = {"dpo": args.examples, "sft": 8, "grpo": 16}[trainer_name]  # GRPO: `examples` prompts x 4 generations
    config = dict(model=model, ref_model=model, tokenizer=tokenizer, per_device_train_batch_size=batch, use_cpu=True)
    config.update(bf16=False, gradient_checkpointing=False)
    if collated:
        config.update(
            train_dataset=text_data(trainer_name, profile, args.examples, args.length_scale), max_length=None
        )
    else:  # the timed rows are given to the step: the dataset only builds the trainer
        rows = generation_batch(profile, args.examples, 4, args.length_scale, tokenizer, varied=varied)
        config.update(train_dataset=Dataset.from_list([{"prompt": "w1"}] * 8), num_generations=4)
    trainers = {
        v: build_trainer(
            trainer_name, stock=v == "stock", output_dir=f"{tmp}/{trainer_name}-{v}", **config, **FIXED.get(v, {})
        )
        for v in VARIANTS
    }
    inputs = {v: list(t.train_dataset) if collated else rows for v, t in trainers.items()}
    made = {}
    for variant in VARIANTS:  # warm-up: two steps; `"auto"`'s until its close candidates took their turns, one more
        tuning = trainers[variant].sharing_session.tuning if variant != "stock" else None
        for i in range(2 + (len(tuning.contenders) * SAMPLES if tuning is not None else 0)):  # bounded
            if i >= 2 and tuning.settled and tuning.refined is not None:
                break
            made[variant] = step(trainers[variant], inputs[variant], collated)[2]

    def timed(variant):
        host, model_s, made[variant] = step(trainers[variant], inputs[variant], collated)
        if variant != "stock":  # the next step of this variant does not follow this one: not timed across
            trainers[variant].sharing_session.tuning.steps.stop()
        return host, model_s

    steps = interleave(timed, VARIANTS, args.repeats)
    cost, flex = StepCost.of_model(model, dense=True), StepCost.of_model(model, dense=False)
    results = {}
    for variant in VARIANTS:
        trainer, ours = trainers[variant], variant != "stock"
        if ours:
            trainer.sharing_session.attach()
        batch = made[variant]  # the last timed step's, whose layout is reported
        if collated:
            layout, ids = batch.get("prefix_sharing"), batch["input_ids"]
        else:  # GRPO's rows; ours builds the layout in the step
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            layout = (
                trainer.sharing_session.generated_layout(ids, mask, batch["prompt_ids"].shape[1]) if ours else None
            )
        num_rows, width = (ids if layout is None else layout.input_ids).shape
        shared = layout is not None and not layout.is_stock  # `"auto"` may run stock's own rows
        pairs_seen = int(layout.visible_pairs) if shared else num_rows * width * (width + 1) // 2
        tuning, totals = trainer.sharing_session.tuning if ours else None, [h + m for h, m in steps[variant]]
        shape = (num_rows, width, pairs_seen)
        r = results[variant] = dict(rows=num_rows, width=width, positions=num_rows * width, visible_pairs=pairs_seen)
        kernel = None if layout is None else layout.kernel or trainer.sharing_session.backend.name
        r.update(join=None if layout is None else layout.join, kernel=kernel)
        # `"auto"`: what its start-up measurement timed and chose, and what its turns measured
        r.update(measured=tuning and tuning.summary, refined=tuning and tuning.refined)
        # FlexAttention (not run here): the visible pairs only; stock as a causal kernel runs it, half its rows'
        r.update(estimate=cost.estimate(*shape), estimate_flex=flex.estimate(*shape))
        r.update(host_s=statistics.median(h for h, _ in steps[variant]), step_s=statistics.median(totals))
        r["steps_s"] = [round(t, 4) for t in totals]
        if ours:
            trainer.sharing_session.detach()
    stock = results["stock"]
    for r in results.values():
        r["predicted_speedup"] = stock["estimate"] / r["estimate"]
        r["measured_speedup"] = stock["step_s"] / r["step_s"]
        r["predicted_flex_speedup"] = stock["estimate_flex"] / r["estimate_flex"]
    return results


def write(all_results, args, command, device, merged=()):
    """`<name>.json` and `<name>.md`: every variant's row, then `"auto"` against the fixed choices; `merged`: the
    commands whose rows replaced the saved ones (`--merge`)."""
    rows = [
        [trainer.upper(), profile, variant, r["join"] or "-", r["kernel"] or "-", f"{r['rows']} x {r['width']}"]
        + [f"{r['positions']:,}", f"{r['estimate'] / 1e9:.2f}", f"{r['predicted_speedup']:.2f}x", f"{r['step_s']:.3f}"]
        + [f"{r['host_s']:.3f}", f"{r['measured_speedup']:.2f}x", f"{r['predicted_flex_speedup']:.2f}x"]
        for (trainer, profile), results in all_results.items()
        for variant, r in results.items()
    ]
    fixed, auto_rows = [v for v in VARIANTS if v not in ("stock", "auto")], []

    def spread(r):  # the median step and the range of the timed steps
        return f"{r['step_s']:.3f} ({min(r['steps_s']):.3f}-{max(r['steps_s']):.3f})"

    for (trainer, profile), results in all_results.items():
        auto = results["auto"]
        same = [v for v in fixed if (results[v]["join"], results[v]["kernel"]) == (auto["join"], auto["kernel"])]
        best = min(fixed, key=lambda v: results[v]["step_s"])
        ran_as = "stock rows" if auto["kernel"] == "stock" else ", ".join(same) or f"{auto['join']}, {auto['kernel']}"
        auto_rows.append([trainer.upper(), profile, ran_as, best, times(results["stock"]["step_s"], auto["step_s"])])
        auto_rows[-1] += [times(results[best]["step_s"], auto["step_s"]), spread(auto), spread(results[best])]
    lines = document(
        "# Sharing across examples: `prefix_sharing_join` on CPU",
        f"Command: `{command}`" + "".join(f", then `{m}` (the rows it ran replaced)" for m in merged),
        f"Device: {device}; a tiny Llama ({args.hidden_size} hidden, {args.layers} layers) in float32, SDPA with the "
        f"dense mask (the CPU's kernel); per micro-batch {args.examples} DPO pairs, {args.examples} GRPO prompts x 4 "
        f"generations or 2 SFT prompts x 4 completions; median of {args.repeats} steps. GRPO's prompts: the shared "
        "start, then a question of the profile's length or (varied lengths) of a length drawn within 30% of it, no "
        "two alike, so that TRL's left padding moves the start (shared on rotary models only).",
        "Positions: rows x width (padding included). Estimate: the cost model's multiply-adds of one forward "
        "(`trl_prefix_sharing.cost.StepCost`: positions x parameters, plus rows x width^2 for a dense kernel). Host: "
        "collation with the layout (GRPO builds it in the step). Predicted, FlexAttention: its estimate for a "
        "block-sparse kernel (the visible pairs only; stock's causal rows, half of each row's pairs), not run here.",
        markdown_table(
            "trainer|profile|variant|join laid out|kernel|rows x width|positions|estimate (GMAC)|predicted|step (s)|"
            "host (s)|measured|predicted, FlexAttention",
            rows,
        ),
        '`"auto"` against the fixed choices: the one that ran the join and kernel `"auto"` ran (its last timed step), '
        "the fastest, and the ratios of step times (where the two are the same, the last ratio is the spread of one "
        "configuration timed twice in one run). Steps: the median and range of the timed steps (seconds).",
        markdown_table(
            "trainer|profile|auto ran as|fastest fixed|auto vs stock|auto vs fastest fixed|auto's steps|"
            "fastest fixed's steps",
            auto_rows,
        ),
    )
    results = {f"{trainer}/{profile}": r for (trainer, profile), r in all_results.items()}
    model = f"tiny llama ({args.hidden_size} hidden, {args.layers} layers), float32"
    data = {"command": command, "device": device, "model": model, "args": vars(args), "results": results}
    data.update({"merged": merged} if merged else {})
    write_result(args.out, args.name, data, lines, echo=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--name", default="join_cpu", help="the output files' name, without extension")
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--varied", default="tool-calling,rag", help="GRPO's profiles run on varied lengths too")
    parser.add_argument("--merge", action="store_true", help="keep the rows of <out>/<name>.json not rerun")
    parser.add_argument("--examples", type=int, default=4, help="examples (pairs, prompts) per micro-batch")
    parser.add_argument("--repeats", type=int, default=11, help="timed steps per variant (the median is reported)")
    parser.add_argument("--length-scale", type=float, default=1.0)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--render", metavar="JSON", help="write the markdown of a saved run again, and exit")
    args, saved, all_results, merged, runs = parser.parse_args(), None, {}, [], []
    if args.render or args.merge:  # the saved run's own arguments, command, device and rows
        with open(args.render or os.path.join(args.out, f"{args.name}.json")) as f:
            saved = json.load(f)
        if differ := [k for k in SIZES if not args.render and saved["args"][k] != getattr(args, k)]:
            parser.error(f"--merge: {differ} differ from the saved run's")
    trainers, profiles = args.trainers.split(","), args.profiles.split(",")
    varied = [p for p in args.varied.split(",") if p]
    for names, known in ((trainers, TRAINERS), (profiles, PROFILES), (varied, PROFILES)):
        if unknown := [n for n in names if n not in known]:
            parser.error(f"unknown {unknown}; choose from {', '.join(known)}")
    if not args.render:  # the rows to run: each trainer and profile, GRPO's `--varied` profiles twice
        device, tokenizer = quiet_setup(False)
        model = build_model("dpo", tokenizer, argparse.Namespace(mode="cpu", family="llama", **vars(args)))
        runs = [
            (t, p, v) for t in trainers for p in profiles for v in (0, 1) if not v or (t == "grpo" and p in varied)
        ]
    with tempfile.TemporaryDirectory() as tmp:
        for trainer, profile, vary in runs:
            label = profile + VARIED * vary
            all_results[trainer, label] = results = run(trainer, profile, model, tokenizer, args, tmp, vary)
            summary = (f"{v}: {r['join'] or '-'} {r['measured_speedup']:.2f}x" for v, r in results.items())
            print(trainer, label, " ".join(summary), flush=True)
    command = command_line("join")
    if saved:  # `--merge`: this run's rows replace the saved ones; `--render`: none
        order = [(t, p + VARIED * v) for t in TRAINERS for p in PROFILES for v in (0, 1)]
        all_results = {tuple(key.split("/", 1)): r for key, r in saved["results"].items()} | all_results
        all_results = dict(sorted(all_results.items(), key=lambda item: order.index(item[0])))
        merged = saved.get("merged", []) + ([] if args.render else [command])
        args = argparse.Namespace(
            **(saved["args"] if args.render else {**vars(args), "merge": False, **saved["args"]})
        )
        command, device = saved["command"], saved["device"]
    write(all_results, args, command, device, merged)


if __name__ == "__main__":
    main()
