"""Stock TRL vs prefix sharing for the online trainers (GRPO, online DPO): training-step time, its share of the ideal,
activation memory.

    python scripts/benchmark_online.py --trainer grpo --out docs/benchmarks         # CPU, ~3 minutes on 2 idle cores
    python scripts/benchmark_online.py --trainer online_dpo --out docs/benchmarks   # G = 2, under a minute
    python scripts/benchmark_online.py --model smollm2 --trainer grpo --profiles math-reasoning,qa --generations 4,8 \
        --groups-per-step 1 --micro-batches 1 --repeats 3 --out docs/benchmarks/smollm2   # a real model, ~8 minutes

For each profile (median prompt and completion lengths with prompt/completion ratios of about 0.3, 1, 4 and 16) and
group size G, prompts and their G completions get lognormal lengths around the medians, and a generation batch is built
exactly as TRL's `_generate_and_score_completions` returns it (left-padded prompts, right-padded completions, masks,
advantages, `num_items_in_batch`): random token ids of the tokenizer's vocabulary (its special tokens left out), padded
with its pad token, each completion ending with its EOS, so lengths are tokens. `--model smollm2` runs
SmolLM2-135M-Instruct's trained weights and tokenizer instead of a small random Llama (`--family/--hidden-size/
--layers`). The same micro-batches go through both trainers' training step (GRPO: TRL's
`compute_loss` and backward, `--beta > 0` adds the reference pass, as TRL computes it before the step; online DPO:
TRL's `_forward` of the policy with backward, and of the reference). Timed repeats
of the variants are interleaved (rotating order) and the median taken: ratios from one run, since the machine is
noisy. Generation (the model's own `generate` of the same lengths, which prefix sharing does not change) is timed once
per profile to report the speedup with generation included.

Positions are counted per micro-batch as the step runs it (online DPO: after TRL's left truncation to `max_length`):
stock's padded rows (rows x width) and its real tokens (online DPO: the positions stock scores, its completions'
trailing padding included, which the shared layout scores too), the shared rows (rows x width) and their real tokens.
*Padding* = stock padded / stock real: what removing stock's padding alone would save. *Sharing ideal* = stock real /
shared real: what computing each prompt once saves, `G(P+C) / (P+GC)` for equal lengths. *Ideal* = stock padded /
shared padded: the positions the two forwards run, padding and sharing together; the *share of ideal* is the step
speedup over it. *Dense attention* = stock / shared attention scores of a dense mask (rows x width^2 per layer and
head, what SDPA computes on CPU): lower than the ideal where the shared rows are longer than stock's
(completion-heavy groups). Activation memory: bytes autograd saves for backward in one step. Writes
`<trainer>_<mode>.md` and `.json`.
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
import zlib


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import add_model_options, build_model, check_model_options, describe_smollm2, quiet_setup  # noqa: E402


TITLES = {"grpo": "GRPO", "online_dpo": "Online DPO"}
STEPS = {
    "grpo": "TRL's `compute_loss` + backward (plus the reference pass when beta > 0)",
    "online_dpo": "TRL's `_forward` of the policy + backward, and of the reference (no grad)",
}
DPO_REAL = " (real: what stock scores, its completions' trailing padding included, which the shared layout scores too)"
# median (prompt, completion) tokens: reasoning (long answers), chat, QA, long-context QA
PROFILES = {"math-reasoning": (128, 384), "chat": (256, 256), "qa": (1024, 256), "long-context-qa": (2048, 128)}


def lognormal(rng, median, sigma=0.4):
    return max(1, min(3 * median, round(median * rng.lognormvariate(0, sigma))))


def first_plain_id(tokenizer):
    """The first token id above the tokenizer's special and added tokens (at least 8, the tiny tokenizer's)."""
    special = [*tokenizer.all_special_ids, *getattr(tokenizer, "added_tokens_decoder", {})]
    return max(8, max(special, default=0) + 1)


def generation_batch(profile, groups, g, scale, vocab, pad, eos, seed, device, low=8):
    """Rows of `groups` prompts x `g` generations, as TRL's generation step returns them: token ids drawn from
    `[low, vocab)` (above the special tokens), `pad` padding, each completion ending with `eos`."""
    import torch
    from trl.trainer.utils import pad as pad_tensors

    rng = random.Random(seed)
    p_median, c_median = (max(1, round(n * scale)) for n in PROFILES[profile])
    prompts, completions = [], []
    for _ in range(groups):
        prompt = [rng.randrange(low, vocab) for _ in range(lognormal(rng, p_median))]
        for _ in range(g):
            prompts.append(prompt)
            completions.append([rng.randrange(low, vocab) for _ in range(lognormal(rng, c_median) - 1)] + [eos])
    prompt_ids = pad_tensors([torch.tensor(p) for p in prompts], padding_value=pad, padding_side="left")
    prompt_mask = pad_tensors(
        [torch.ones(len(p), dtype=torch.long) for p in prompts], padding_value=0, padding_side="left"
    )
    completion_ids = pad_tensors([torch.tensor(c) for c in completions], padding_value=pad, padding_side="right")
    completion_mask = pad_tensors(
        [torch.ones(len(c), dtype=torch.long) for c in completions], padding_value=0, padding_side="right"
    )
    advantages = torch.tensor([rng.gauss(0, 1) for _ in prompts])
    return {
        "prompt_ids": prompt_ids.to(device),
        "prompt_mask": prompt_mask.to(device),
        "completion_ids": completion_ids.to(device),
        "completion_mask": completion_mask.to(device),
        "advantages": advantages.to(device),
        "num_items_in_batch": completion_mask.sum().to(device),
    }


def micro_batches(batch, rows):
    from trl.trainer.utils import split_tensor_dict

    return split_tensor_dict(batch, batch["prompt_ids"].shape[0] // rows)


def make_trainer(variant, model, tokenizer, args, tmp):
    from datasets import Dataset
    from trl.trainer.utils import add_fused_lm_head

    from trl_prefix_sharing import GRPOConfig, GRPOTrainer, OnlineDPOConfig, OnlineDPOTrainer

    common = dict(
        output_dir=os.path.join(tmp, variant),
        per_device_train_batch_size=args.rows,
        bf16=args.mode == "gpu",
        use_cpu=args.mode == "cpu",
        report_to="none",
        gradient_checkpointing=args.gradient_checkpointing,
        prefix_sharing=variant == "sharing",
    )
    prompts = Dataset.from_list([{"prompt": "w1"}] * 8)
    zero = [lambda completions, **kw: [0.0] * len(completions)]
    if args.trainer == "online_dpo":
        return OnlineDPOTrainer(
            model=copy.deepcopy(model),
            ref_model=copy.deepcopy(model).eval(),
            reward_funcs=zero,
            args=OnlineDPOConfig(**common),
            train_dataset=prompts,
            processing_class=tokenizer,
        )
    trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=zero,
        train_dataset=prompts,
        args=GRPOConfig(num_generations=args.num_generations, **common),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop, which this step does not run
    if args.beta:  # an in-memory reference model (TRL would reload one from the model's path)
        trainer.beta = args.beta
        trainer.ref_model = copy.deepcopy(model).eval()
        add_fused_lm_head(trainer.ref_model)
        if variant == "sharing":  # set up again, the reference model included
            trainer.sharing_session.detach()
            trainer.sharing_session = None
            trainer._setup_prefix_sharing()
    return trainer


def grpo_step(trainer, batch):
    import torch

    if trainer.beta:
        with torch.no_grad():
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            batch["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, ids, mask, batch["completion_ids"].shape[1]
            )[0]
    trainer.compute_loss(trainer.model, batch).backward()


def online_dpo_step(trainer, batch):
    """TRL's two `_forward` passes, and a loss over the completion log-probs (the DPO loss reads only their sums)."""
    import torch

    inputs = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])
    logps = trainer._forward(trainer.model, *inputs)
    with torch.no_grad():
        ref_logps = trainer._forward(trainer.ref_model, *inputs)
    ((logps - ref_logps) * batch["completion_mask"] * batch["advantages"][:, None]).sum().backward()


def training_step(trainer, batches, cuda, args):
    """Every micro-batch of one generation batch; (wall time, bytes autograd saved for backward at most)."""
    import torch

    step = online_dpo_step if args.trainer == "online_dpo" else grpo_step
    saved = 0
    # fresh tensors, as a new generation batch is in training: the trainer keeps a layout while the tensors it was
    # built from live, so repeats over the same tensors would skip building it
    batches = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()} for batch in batches]
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.model.train()
    for batch in batches:
        storages = {}

        def pack(tensor, storages=storages):
            if tensor.device.type != "meta":
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            step(trainer, batch)
        saved = max(saved, sum(storages.values()))
    trainer.model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, saved


def generation_time(model, batch, cuda, pad_token_id=0):
    """The model's own `generate` of the batch's completion length (identical in both trainers)."""
    import torch

    model = model.eval()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=batch["prompt_ids"],
            attention_mask=batch["prompt_mask"],
            do_sample=True,
            max_new_tokens=batch["completion_ids"].shape[1],
            min_new_tokens=batch["completion_ids"].shape[1],
            pad_token_id=pad_token_id,
        )
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def positions(batches, trainer, args):
    """Positions the two training steps run, summed over the micro-batches: stock's padded rows (rows x width) and its
    real tokens, the shared rows (rows x width, as the sharing trainer lays them out) and their real tokens."""
    import torch

    from trl_prefix_sharing.layout import build_layout
    from trl_prefix_sharing.trie import StockRows

    online_dpo = args.trainer == "online_dpo"
    counts = dict.fromkeys(
        (
            "stock_padded_positions",
            "stock_positions",
            "shared_padded_positions",
            "shared_positions",
            "stock_attention_scores",
            "shared_attention_scores",
        ),
        0,
    )
    for b in batches:
        prompt_ids, prompt_mask = b["prompt_ids"], b["prompt_mask"]
        if online_dpo:  # TRL's left truncation to `max_length`, in both variants' `_forward`
            cut = max(prompt_ids.shape[1] + b["completion_ids"].shape[1] - trainer.max_length, 0)
            prompt_ids, prompt_mask = prompt_ids[:, cut:], prompt_mask[:, cut:]
        ids = torch.cat([prompt_ids, b["completion_ids"]], dim=1)
        mask = torch.cat([prompt_mask, b["completion_mask"]], dim=1)
        # online DPO: stock scores each row from its first token to its end (trailing padding too)
        real = mask.cumsum(dim=1) > 0 if online_dpo else mask.bool()
        layout = build_layout(
            StockRows.generated(ids, mask, prompt_ids.shape[1], score_padding=online_dpo),
            pad_token_id=0,
            rows=trainer.sharing_session.rows,
        )
        counts["stock_padded_positions"] += ids.numel()
        counts["stock_positions"] += int(real.sum())
        counts["shared_padded_positions"] += layout.input_ids.numel()
        counts["shared_positions"] += int((layout.document_ids >= 0).sum())  # online DPO: stock's padding too
        # scores of a dense mask, per layer and head: rows x width^2 (SDPA with a mask on CPU computes them all)
        counts["stock_attention_scores"] += ids.shape[0] * ids.shape[1] ** 2
        counts["shared_attention_scores"] += layout.input_ids.shape[0] * layout.input_ids.shape[1] ** 2
    return counts


def run(profile, g, model, tokenizer, args, tmp):
    args.num_generations, args.rows = g, args.groups_per_step * g
    cuda = args.mode == "gpu"
    device = "cuda" if cuda else "cpu"
    batch = generation_batch(
        profile,
        args.groups_per_step * args.micro_batches,
        g,
        args.length_scale,
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        seed=zlib.crc32(f"{profile}/{g}".encode()),
        device=device,
        low=first_plain_id(tokenizer),
    )
    batches = micro_batches(batch, args.rows)
    trainers = {variant: make_trainer(variant, model, tokenizer, args, tmp) for variant in ("stock", "sharing")}
    activations = {variant: training_step(trainer, batches, cuda, args)[1] for variant, trainer in trainers.items()}
    times = {variant: [] for variant in trainers}
    order = list(trainers)
    for repeat in range(args.repeats):
        for variant in order[repeat % 2 :] + order[: repeat % 2]:
            times[variant].append(training_step(trainers[variant], batches, cuda, args)[0])
    counts = positions(batches, trainers["sharing"], args)
    step = {variant: statistics.median(t) for variant, t in times.items()}
    generate = generation_time(copy.deepcopy(model), batch, cuda, tokenizer.pad_token_id)
    ideal = counts["stock_padded_positions"] / counts["shared_padded_positions"]
    speedup = step["stock"] / step["sharing"]
    prompt_tokens = int(batch["prompt_mask"].sum()) / batch["prompt_mask"].shape[0]
    completion_tokens = int(batch["completion_mask"].sum()) / batch["completion_mask"].shape[0]
    return {
        "profile": profile,
        "G": g,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "p_over_c": prompt_tokens / completion_tokens,
        **counts,
        "padding": counts["stock_padded_positions"] / counts["stock_positions"],
        "sharing_ideal": counts["stock_positions"] / counts["shared_positions"],
        "total_ideal": ideal,
        "dense_attention_ratio": counts["stock_attention_scores"] / counts["shared_attention_scores"],
        "step_s": step,
        "step_times_s": times,
        "speedup": speedup,
        "share_of_total_ideal": speedup / ideal,
        "generation_s": generate,
        "speedup_with_generation": (generate + step["stock"]) / (generate + step["sharing"]),
        "activation_bytes": activations,
        "activation_ratio": activations["sharing"] / activations["stock"],
    }


def write(results, args, device, command, model_desc):
    import torch
    import transformers
    import trl

    os.makedirs(args.out, exist_ok=True)
    meta = {
        "device": device,
        "command": command,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "model": model_desc,
        "length_scale": args.length_scale,
        "beta": args.beta,
        "groups_per_micro_batch": args.groups_per_step,
        "micro_batches": args.micro_batches,
        "repeats": args.repeats,
    }
    name = f"{args.trainer}_{args.mode}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    lines = [
        f"# {TITLES[args.trainer]}: stock TRL vs prefix sharing ({args.mode.upper()})",
        "",
        f"Made by `{command}` ({device}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}; {meta['model']}; lengths x {args.length_scale}; {args.groups_per_step} prompts x G "
        f"generations per micro-batch, {args.micro_batches} micro-batches per step; beta={args.beta}; median of "
        f"{args.repeats} interleaved repeats).",
        "",
        f"Training step = {STEPS[args.trainer]}, over every micro-batch of one generation batch. Positions are "
        "counted per micro-batch as the step runs it: stock's rows are padded (left-padded prompts, right-padded "
        "completions, rows x width), the shared rows too (rows x width). *Padding* = stock padded / stock real "
        f"positions{DPO_REAL if args.trainer == 'online_dpo' else ''}: what removing stock's padding alone would "
        "save. *Sharing ideal* = stock real / shared real positions: what computing each prompt once saves, "
        "`G(P+C)/(P+GC)` for equal lengths. *Ideal* = stock padded / shared padded positions: what the two padded "
        "forwards run, padding and sharing together; *share of ideal* = step speedup / ideal. *Dense attention* = "
        "stock / shared attention scores of a dense mask (rows x width² per layer and head; SDPA on CPU computes them "
        "all), which the positions leave out: lower than the ideal where the shared rows are longer than stock's "
        "(completion-heavy groups). Generation (the same in both) is timed once with the model's `generate`.",
        "",
        "| profile | G | prompt | completion | p/c | padding | sharing ideal | ideal | dense attention | step speedup "
        "| share of ideal | with generation | activation memory, sharing / stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['profile']} | {r['G']} | {r['prompt_tokens']:.0f} | {r['completion_tokens']:.0f} | "
            f"{r['p_over_c']:.2f} | {r['padding']:.2f}x | {r['sharing_ideal']:.2f}x | {r['total_ideal']:.2f}x | "
            f"{r['dense_attention_ratio']:.2f}x | {r['speedup']:.2f}x | {r['share_of_total_ideal']:.2f} | "
            f"{r['speedup_with_generation']:.2f}x | {r['activation_ratio']:.2f} |"
        )
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--trainer", choices=["grpo", "online_dpo"], default="grpo")
    parser.add_argument("--profiles", default=None, help="default: all for grpo; ratios 0.3, 1 and 4 for online DPO")
    parser.add_argument("--generations", default=None, help="group sizes G (default 4,8; online DPO: 2)")
    parser.add_argument("--groups-per-step", type=int, default=2, help="prompts per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per generation batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--length-scale", type=float, default=None, help="default 0.25 on CPU, 1 on GPU")
    parser.add_argument("--beta", type=float, default=0.0, help="> 0 adds the reference pass (TRL's default is 0)")
    add_model_options(parser)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--out", default="docs/benchmarks")
    args = parser.parse_args()
    check_model_options(args)
    args.length_scale = args.length_scale or (0.25 if args.mode == "cpu" else 1.0)
    online_dpo = args.trainer == "online_dpo"
    args.profiles = args.profiles or ("math-reasoning,chat,qa" if online_dpo else ",".join(PROFILES))
    args.generations = "2" if online_dpo else (args.generations or "4,8")
    command = shlex.join(["python", "scripts/benchmark_online.py", *sys.argv[1:]])
    device, tokenizer = quiet_setup(args.mode == "gpu", args.model)
    model = build_model("grpo", tokenizer, args)
    if args.model == "tiny":
        model_desc = f"{args.family}, hidden {args.hidden_size}, {args.layers} layers"
    else:
        model_desc = f"{describe_smollm2(model)}, {'bf16' if args.mode == 'gpu' else 'fp32'}, SDPA"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for profile in args.profiles.split(","):
            for g in map(int, args.generations.split(",")):
                result = run(profile, g, model, tokenizer, args, tmp)
                print(
                    f"{profile} G={g}: padding {result['padding']:.2f}x, sharing {result['sharing_ideal']:.2f}x, "
                    f"ideal {result['total_ideal']:.2f}x, step {result['speedup']:.2f}x "
                    f"({result['share_of_total_ideal']:.2f} of ideal), activations x{result['activation_ratio']:.2f}",
                    flush=True,
                )
                results.append(result)
    write(results, args, device, command, model_desc)


if __name__ == "__main__":
    main()
