"""Sharing across examples (`prefix_sharing_join`): stock TRL vs `"prompts"` vs `"always"` vs `"auto"` on data whose
examples start alike, and the cost model `"auto"` chooses by against the measured step times.

    python scripts/benchmark_join.py --trainers dpo,grpo --out docs/benchmarks       # ~30 minutes on 2 cores
    python scripts/benchmark_join.py --trainers sft --name join_sft_cpu --out docs/benchmarks
    python scripts/benchmark_join.py --render docs/benchmarks/join_cpu.json   # the markdown again, from a saved run

Profiles (token lengths; every word of the synthetic texts is one token of the tiny tokenizer):

- `tool-calling`: one 2,048-token system prompt with tool schemas, then per example a 40-token question and answers of
  160 tokens (a 200-token turn);
- `rag`: one 1,536-token document, 4 questions about it (30 tokens), answers of 100 tokens;
- `chat-header`: only a 32-token header in common (a chat template and a short system prompt), 100-token questions,
  400-token answers: joining saves little and makes one long row, which a dense kernel pays for.

Per trainer and profile, one micro-batch (DPO: 4 pairs; GRPO: 4 prompts x 4 generations, the prompts of one length,
since GRPO scores left-padded rows whose positions count the padding, so only prompts of one padded length put a
shared start at the same positions; SFT: 2 prompts x 4 completions, as rejection-sampling and best-of-n data have).
Variants: stock TRL; the fixed choices `"prompts"` and `"always"` on the dense mask (SDPA), and `"varlen"` (the varlen
kernel, its reference on the CPU, with the join its multiply-add count prefers); and `"auto"` for both options, which
measures every candidate (the kernels that can run, and stock's own rows) in its first step and then runs each
micro-batch on the one of least predicted time (`trl_prefix_sharing.tuning`; its close candidates take their turns
in its warm-up steps, which last until they have). Each variant runs the trainer's own loss and backward on the same
micro-batch (DPO and SFT: collation with the layout, then the trainer's passes, DPO's reference pass included; GRPO:
the training forward on the generated rows, layout included), two warm-up steps first (`"auto"`: until its turns are
done), then the variants' timed steps interleaved; the median is reported, with the range. Also reported: the
positions each runs (its rows x width, padding included), the join `"auto"` chose, and the cost model's estimate
(`trl_prefix_sharing.cost.StepCost`, multiply-adds of one forward) with the speedup it predicts next to the measured
one, and a table of `"auto"` against the fixed choices (which one it ran as, the fastest, the ratios). Writes
`<name>.md` and `<name>.json` (default `join_cpu`) to `--out`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import warnings


#: shared tokens, question tokens, answer tokens
PROFILES = {"tool-calling": (2048, 40, 160), "rag": (1536, 30, 100), "chat-header": (32, 100, 400)}
VARIANTS = ["stock", "prompts", "always", "varlen", "auto"]
#: the fixed choices' options: the join rules on the dense mask (SDPA), and the varlen kernel (its reference on the
#: CPU) with the join chosen by the multiply-add count; `"auto"` measures every candidate, stock's rows included
FIXED = {
    "prompts": {"prefix_sharing_join": "prompts", "prefix_sharing_attn_implementation": "sdpa"},
    "always": {"prefix_sharing_join": "always", "prefix_sharing_attn_implementation": "sdpa"},
    "varlen": {"prefix_sharing_join": "auto", "prefix_sharing_attn_implementation": "varlen"},
    "auto": {"prefix_sharing_join": "auto", "prefix_sharing_attn_implementation": "auto"},
}
TRAINERS = ("dpo", "grpo", "sft")
#: trainers whose collator builds the layout (the rest build it in the step)
COLLATED = ("dpo", "sft")


def lengths(profile, scale):
    return [max(1, round(n * scale)) for n in PROFILES[profile]]


def words(rng, vocabulary, n):
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def texts(profile, scale, stream):
    """The profile's shared start, then functions that draw a question and an answer of the profile's lengths (each
    within 30% of it), from the random stream named `stream`."""
    from trl_prefix_sharing.testing import WORDS

    shared, question, answer = lengths(profile, scale)
    rng = random.Random(stream)
    vocabulary = WORDS[:200]

    def draw(median):
        return words(rng, vocabulary, max(1, round(median * rng.uniform(0.7, 1.3))))

    return words(rng, vocabulary, shared), lambda: draw(question), lambda: draw(answer)


def pairs(profile, n, scale, seed=0):
    """`n` DPO pairs: the profile's shared start, a question, two answers (`rag`: questions about one document)."""
    from datasets import Dataset

    start, ask, answer = texts(profile, scale, f"{profile}-{seed}")
    return Dataset.from_list(
        [{"prompt": f"{start} {ask()}", "chosen": " " + answer(), "rejected": " " + answer()} for _ in range(n)]
    )


def sft_rows(profile, prompts, per_prompt, scale, seed=0):
    """SFT data with `per_prompt` completions of each of `prompts` prompts (rejection sampling, best-of-n)."""
    from datasets import Dataset

    start, ask, answer = texts(profile, scale, f"{profile}-sft-{seed}")
    rows = []
    for _ in range(prompts):
        prompt = f"{start} {ask()}"
        rows += [{"prompt": prompt, "completion": " " + answer()} for _ in range(per_prompt)]
    return Dataset.from_list(rows)


def generation_batch(profile, prompts, g, scale, tokenizer, seed=0):
    """GRPO rows as its generation step returns them: `prompts` prompts of one length (the shared start, then a
    question) left-padded, `g` completions each right-padded and ending with EOS."""
    import torch
    from trl.trainer.utils import pad

    shared, question, answer = lengths(profile, scale)
    rng = random.Random(f"{profile}-grpo-{seed}")
    low, vocab = 8, len(tokenizer)
    start = [rng.randrange(low, vocab) for _ in range(shared)]
    rows, completions = [], []
    for _ in range(prompts):
        prompt = start + [rng.randrange(low, vocab) for _ in range(question)]
        for _ in range(g):
            rows.append(prompt)
            size = max(1, round(answer * rng.uniform(0.7, 1.3)))
            completions.append([rng.randrange(low, vocab) for _ in range(size - 1)] + [tokenizer.eos_token_id])
    ones = [torch.ones(len(r), dtype=torch.long) for r in rows]
    c_ones = [torch.ones(len(c), dtype=torch.long) for c in completions]
    pad_id = tokenizer.pad_token_id
    completion_mask = pad(c_ones, padding_value=0, padding_side="right")
    return {
        "prompt_ids": pad([torch.tensor(r) for r in rows], padding_value=pad_id, padding_side="left"),
        "prompt_mask": pad(ones, padding_value=0, padding_side="left"),
        "completion_ids": pad([torch.tensor(c) for c in completions], padding_value=pad_id, padding_side="right"),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([rng.gauss(0, 1) for _ in rows]),
        "num_items_in_batch": completion_mask.sum(),
    }


def build_model(tokenizer, args):
    import torch
    from transformers import AutoModelForCausalLM

    from trl_prefix_sharing.testing import make_config

    torch.manual_seed(0)
    config = make_config("llama", len(tokenizer), hidden_size=args.hidden_size, num_layers=args.layers)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def make_trainer(trainer, variant, model, tokenizer, dataset, batch, tmp):
    import trl

    import trl_prefix_sharing as ours

    common = dict(
        output_dir=os.path.join(tmp, f"{trainer}-{variant}"),
        per_device_train_batch_size=batch,
        bf16=False,
        use_cpu=True,
        report_to="none",
        gradient_checkpointing=False,
    )
    if variant != "stock":
        common.update(prefix_sharing=True, **FIXED[variant])
    if trainer == "sft":
        config, cls = (trl.SFTConfig, trl.SFTTrainer) if variant == "stock" else (ours.SFTConfig, ours.SFTTrainer)
        return cls(
            model=copy.deepcopy(model),
            args=config(max_length=None, **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    if trainer == "dpo":
        config, cls = (trl.DPOConfig, trl.DPOTrainer) if variant == "stock" else (ours.DPOConfig, ours.DPOTrainer)
        return cls(
            model=copy.deepcopy(model),
            ref_model=copy.deepcopy(model).eval(),
            args=config(max_length=None, **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    from datasets import Dataset

    config, cls = (trl.GRPOConfig, trl.GRPOTrainer) if variant == "stock" else (ours.GRPOConfig, ours.GRPOTrainer)
    made = cls(
        model=copy.deepcopy(model),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        train_dataset=Dataset.from_list([{"prompt": "w1"}] * 8),
        args=config(num_generations=4, **common),
        processing_class=tokenizer,
    )
    made.current_gradient_accumulation_steps = 1  # set by the Trainer's loop, which this step does not run
    return made


def collated_step(trainer, examples):
    """(seconds of collation with the layout, seconds of loss and backward, the collated batch)."""
    start = time.perf_counter()
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    host = time.perf_counter() - start
    trainer.model.train()
    trainer.compute_loss(trainer.model, batch).backward()
    trainer.model.zero_grad(set_to_none=True)
    return host, time.perf_counter() - start - host, batch


def grpo_step(trainer, batch):
    """(0: the layout is built inside the step, seconds of the training forward and backward, the rows)."""
    import torch

    fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # a new generation batch
    start = time.perf_counter()
    trainer.model.train()
    trainer.compute_loss(trainer.model, fresh).backward()
    trainer.model.zero_grad(set_to_none=True)
    return 0.0, time.perf_counter() - start, fresh


def layout_of(trainer_name, trainer, variant, made):
    """The shared layout of a variant's micro-batch (None for stock) and its rows' (number, width)."""
    import torch

    if variant == "stock":
        if trainer_name in COLLATED:
            return None, tuple(made["input_ids"].shape)
        ids = torch.cat([made["prompt_ids"], made["completion_ids"]], dim=1)
        return None, tuple(ids.shape)
    if trainer_name in COLLATED:
        layout = made["prefix_sharing"]
    else:
        ids = torch.cat([made["prompt_ids"], made["completion_ids"]], dim=1)
        mask = torch.cat([made["prompt_mask"], made["completion_mask"]], dim=1)
        layout = trainer.sharing_session.generated_layout(ids, mask, made["prompt_ids"].shape[1])
    return layout, tuple(layout.input_ids.shape)


def run(trainer_name, profile, model, tokenizer, args, tmp):
    from trl_prefix_sharing.cost import StepCost
    from trl_prefix_sharing.tuning import SAMPLES

    cost, flex = StepCost.of_model(model, dense=True), StepCost.of_model(model, dense=False)
    dataset, rows, batch = None, None, 16  # GRPO: `examples` prompts x 4 generations
    if trainer_name == "dpo":
        dataset, batch = pairs(profile, args.examples, args.length_scale), args.examples
    elif trainer_name == "sft":  # 2 prompts x 4 completions per micro-batch
        dataset, batch = sft_rows(profile, 2, 4, args.length_scale), 8
    else:
        rows = generation_batch(profile, args.examples, 4, args.length_scale, tokenizer)
    trainers, inputs = {}, {}
    for variant in VARIANTS:
        trainers[variant] = made = make_trainer(trainer_name, variant, model, tokenizer, dataset, batch, tmp)
        inputs[variant] = list(made.train_dataset) if trainer_name in COLLATED else rows
    step = collated_step if trainer_name in COLLATED else grpo_step
    host = {v: [] for v in VARIANTS}
    model_time = {v: [] for v in VARIANTS}
    made = {}
    for variant in VARIANTS:  # warm-up: two steps; `"auto"`'s until its close candidates took their turns, one more
        tuning = trainers[variant].sharing_session.tuning if variant != "stock" else None
        for i in range(2 + (len(tuning.contenders) * SAMPLES if tuning is not None else 0)):  # bounded
            if i >= 2 and tuning.settled and tuning.refined is not None:
                break
            made[variant] = step(trainers[variant], inputs[variant])[2]
    for repeat in range(args.repeats):
        order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
        for variant in order:
            h, m, made[variant] = step(trainers[variant], inputs[variant])  # the last step's layout is reported
            if variant != "stock":  # the next step of this variant does not follow this one: not timed across
                trainers[variant].sharing_session.tuning.steps.stop()
            host[variant].append(h)
            model_time[variant].append(m)
    results = {}
    for variant in VARIANTS:
        trainer = trainers[variant]
        if variant != "stock":
            trainer.sharing_session.attach()
        layout, (num_rows, width) = layout_of(trainer_name, trainer, variant, made[variant])
        shared = layout is not None and not layout.is_stock  # `"auto"` may run stock's own rows
        pairs_seen = int(layout.visible_pairs) if shared else num_rows * width * (width + 1) // 2
        results[variant] = {
            "rows": num_rows,
            "width": width,
            "positions": num_rows * width,
            "join": layout.join if layout is not None else None,
            "kernel": (layout.kernel or trainer.sharing_session.backend.name) if layout is not None else None,
            # `"auto"`: what its start-up measurement timed and chose (`trl_prefix_sharing.tuning`)
            "measured": trainer.sharing_session.tuning.summary if variant != "stock" else None,
            "refined": trainer.sharing_session.tuning.refined
            if variant != "stock"
            else None,  # what its turns measured
            "visible_pairs": pairs_seen,
            "estimate": cost.estimate(num_rows, width, pairs_seen),
            # FlexAttention (not run here): the visible pairs only; stock as a causal kernel runs it, half its rows'
            "estimate_flex": flex.estimate(num_rows, width, pairs_seen),
            "host_s": statistics.median(host[variant]),
            "step_s": statistics.median(host[variant][i] + model_time[variant][i] for i in range(args.repeats)),
            "steps_s": [round(host[variant][i] + model_time[variant][i], 4) for i in range(args.repeats)],
        }
        if variant != "stock":
            trainer.sharing_session.detach()
    stock = results["stock"]
    for variant in VARIANTS:
        r = results[variant]
        r["predicted_speedup"] = stock["estimate"] / r["estimate"]
        r["measured_speedup"] = stock["step_s"] / r["step_s"]
        r["predicted_flex_speedup"] = stock["estimate_flex"] / r["estimate_flex"]
    return results


def write(all_results, args, command, device):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        results = {f"{trainer}/{profile}": r for (trainer, profile), r in all_results.items()}
        json.dump({"command": command, "device": device, "args": vars(args), "results": results}, f, indent=1)
    lines = [
        "# Sharing across examples: `prefix_sharing_join` on CPU",
        "",
        f"Command: `{command}`",
        "",
        f"Device: {device}; a tiny Llama ({args.hidden_size} hidden, {args.layers} layers) in float32, SDPA with the "
        f"dense mask (the CPU's kernel); per micro-batch {args.examples} DPO pairs, {args.examples} GRPO prompts x 4 "
        f"generations or 2 SFT prompts x 4 completions; median of {args.repeats} steps.",
        "",
        "Positions: the shared rows x width each variant runs (padding included). Estimate: the cost model's "
        "multiply-adds of one forward (`trl_prefix_sharing.cost.StepCost`: positions x parameters, plus rows x "
        "width^2 pairs for a dense kernel). Host: collation with the layout (DPO; GRPO builds it in the step). "
        "Predicted, FlexAttention: the same model's estimate for a block-sparse kernel (the visible pairs only; stock "
        "as a causal kernel runs it, half of each row's pairs), not measured here: a GPU run measures it.",
        "",
        "| trainer | profile | variant | join laid out | kernel | rows x width | positions | estimate (GMAC) | "
        "predicted | step (s) | host (s) | measured | predicted, FlexAttention |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (trainer, profile), results in all_results.items():
        for variant in VARIANTS:
            r = results[variant]
            lines.append(
                f"| {trainer.upper()} | {profile} | {variant} | {r['join'] or '-'} | {r['kernel'] or '-'} | "
                f"{r['rows']} x {r['width']} | "
                f"{r['positions']:,} | {r['estimate'] / 1e9:.2f} | {r['predicted_speedup']:.2f}x | "
                f"{r['step_s']:.3f} | {r['host_s']:.3f} | {r['measured_speedup']:.2f}x | "
                f"{r['predicted_flex_speedup']:.2f}x |"
            )
    lines += ["", *auto_summary(all_results)]
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def auto_summary(all_results) -> list[str]:
    """`"auto"` beside the fixed choices: the fixed variant that ran the same join and kernel as its last timed step,
    the fastest fixed variant, and its step time against stock's and that one's."""
    fixed = [v for v in VARIANTS if v not in ("stock", "auto")]
    lines = [
        '`"auto"` against the fixed choices: the fixed variant that ran the join and kernel `"auto"` ran (its last '
        "timed step), the fastest fixed variant, and the ratios of step times. Where the two are the same variant, "
        "the last ratio is the spread of one configuration timed twice in the same run. Steps: the median and range "
        "of each one's timed steps (seconds).",
        "",
        "| trainer | profile | auto ran as | fastest fixed | auto vs stock | auto vs fastest fixed | auto's steps | "
        "fastest fixed's steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (trainer, profile), results in all_results.items():
        auto = results["auto"]
        same = [v for v in fixed if (results[v]["join"], results[v]["kernel"]) == (auto["join"], auto["kernel"])]
        best = min(fixed, key=lambda v: results[v]["step_s"])
        ran_as = "stock rows" if auto["kernel"] == "stock" else ", ".join(same) or f"{auto['join']}, {auto['kernel']}"
        lines.append(
            f"| {trainer.upper()} | {profile} | {ran_as} | {best} | "
            f"{results['stock']['step_s'] / auto['step_s']:.2f}x | {results[best]['step_s'] / auto['step_s']:.2f}x | "
            f"{_spread(auto)} | {_spread(results[best])} |"
        )
    return lines


def _spread(result) -> str:
    """A variant's median step and the range of its timed steps (runs saved before the steps were kept: the median)."""
    steps = result.get("steps_s")
    if not steps:
        return f"{result['step_s']:.3f}"
    return f"{result['step_s']:.3f} ({min(steps):.3f}-{max(steps):.3f})"


def render(path):
    """Write the markdown of a saved run again, from its JSON (`--render`)."""
    with open(path) as f:
        saved = json.load(f)
    args = argparse.Namespace(**saved["args"])
    results = {tuple(key.split("/", 1)): value for key, value in saved["results"].items()}
    write(results, args, saved["command"], saved["device"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--name", default="join_cpu", help="the output files' name, without extension")
    parser.add_argument("--trainers", default=",".join(TRAINERS))
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--examples", type=int, default=4, help="examples (pairs, prompts) per micro-batch")
    parser.add_argument("--repeats", type=int, default=11, help="timed steps per variant (the median is reported)")
    parser.add_argument("--length-scale", type=float, default=1.0)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--render", metavar="JSON", help="write the markdown of a saved run again, and exit")
    args = parser.parse_args()
    if args.render:
        return render(args.render)
    trainers = args.trainers.split(",")
    profiles = args.profiles.split(",")
    for name, known in ((trainers, TRAINERS), (profiles, PROFILES)):
        unknown = [n for n in name if n not in known]
        if unknown:
            parser.error(f"unknown {unknown}; choose from {', '.join(known)}")
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging as hf_logging

    from trl_prefix_sharing.testing import make_tokenizer

    hf_logging.set_verbosity_error()
    tokenizer = make_tokenizer()
    model = build_model(tokenizer, args)
    device = f"CPU, {torch.get_num_threads()} threads"
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    all_results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for trainer in trainers:
            for profile in profiles:
                results = run(trainer, profile, model, tokenizer, args, tmp)
                all_results[(trainer, profile)] = results
                print(
                    trainer,
                    profile,
                    " ".join(
                        f"{v}: {r['join'] or '-'} {r['measured_speedup']:.2f}x ({r['predicted_speedup']:.2f}x)"
                        for v, r in results.items()
                    ),
                    flush=True,
                )
    write(all_results, args, command, device)


if __name__ == "__main__":
    main()
