"""Stock TRL vs prefix sharing for the online trainers (GRPO, online DPO): training-step time, its share of the ideal,
activation memory.

    python -m benchmarks.online --trainer grpo --out docs/benchmarks         # CPU, ~3 minutes on 2 idle cores
    python -m benchmarks.online --trainer online_dpo --out docs/benchmarks   # G = 2, under a minute
    python -m benchmarks.online --model smollm2 --trainer grpo --profiles math-reasoning,qa --generations 4,8 \
        --groups-per-step 1 --micro-batches 1 --repeats 3 --out docs/benchmarks/smollm2   # a real model, ~8 minutes

For each profile (median prompt and completion lengths with prompt/completion ratios of about 0.3, 1, 4 and 16) and
group size G, prompts and their G completions get lognormal lengths around the medians, and a generation batch is built
exactly as TRL's `_generate_and_score_completions` returns it (left-padded prompts, right-padded completions, masks,
advantages, `num_items_in_batch`): random token ids of the tokenizer's vocabulary (its special tokens left out), padded
with its pad token, each completion ending with its EOS, so lengths are tokens. `--model smollm2` runs
SmolLM2-135M-Instruct's trained weights and tokenizer instead of a small random Llama
(`--family/--hidden-size/--layers`). The same micro-batches go through the training step (`STEPS`) of stock TRL's
trainer and of this package's with prefix sharing, both from the same weights; timed repeats are interleaved (rotating
order) and the median taken: ratios from one run, since the machine is noisy. Generation (the model's own `generate` of
the same lengths, which prefix sharing does not change) is timed once per profile for the speedup with generation
included.

Positions are counted per micro-batch as the step runs it (online DPO: after TRL's left truncation to `max_length`;
`positions`); activation memory is the bytes autograd saves for backward in one step, the second (`"auto"` measures its
kernels in the first, passes that are not the step's). Writes `<trainer>_<mode>.md`, which says what each column means,
and `<trainer>_<mode>.json` (`benchmarks.results`' schema, with the settings and versions).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import random
import statistics
import tempfile
import time
import zlib

from trl_prefix_sharing.testing.trainers import build_trainer

from .data import lognormal
from .measure import SavedTensors, clone_batch, interleave
from .models import add_model_options, build_model, check_model_options, describe_smollm2, quiet_setup
from .results import command_line, document, markdown_table, versions, write_result


TITLES = {"grpo": "GRPO", "online_dpo": "Online DPO"}
STEPS = {
    "grpo": "TRL's `compute_loss` + backward (plus the reference pass when beta > 0)",
    "online_dpo": "TRL's `_forward` of the policy + backward, and of the reference (no grad)",
}
DPO_REAL = " (real: what stock scores, its completions' trailing padding included, which the shared layout scores too)"
# median (prompt, completion) tokens: reasoning (long answers), chat, QA, long-context QA
PROFILES = {"math-reasoning": (128, 384), "chat": (256, 256), "qa": (1024, 256), "long-context-qa": (2048, 128)}
VARIANTS = ("stock", "sharing")


def first_plain_id(tokenizer):
    """The first token id above the tokenizer's special and added tokens (at least 8, the tiny tokenizer's)."""
    special = [*tokenizer.all_special_ids, *getattr(tokenizer, "added_tokens_decoder", {})]
    return max(8, max(special, default=0) + 1)


def generation_batch(profile, groups, g, scale, tokenizer, seed, device):
    """Rows of `groups` prompts x `g` generations, as TRL's generation step returns them: token ids of `tokenizer`'s
    vocabulary above its special tokens, its pad token as padding, each completion ending with its EOS."""
    import torch
    from trl.trainer.utils import pad as pad_tensors

    low, vocab, pad, eos = first_plain_id(tokenizer), len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id
    rng = random.Random(seed)
    p_median, c_median = (max(1, round(n * scale)) for n in PROFILES[profile])
    prompts, completions = [], []
    for _ in range(groups):
        prompt = [rng.randrange(low, vocab) for _ in range(lognormal(rng, p_median))]
        for _ in range(g):
            prompts.append(prompt)
            completions.append([rng.randrange(low, vocab) for _ in range(lognormal(rng, c_median) - 1)] + [eos])

    def padded(rows, value, side):
        return pad_tensors([torch.tensor(row) for row in rows], padding_value=value, padding_side=side).to(device)

    prompt_mask = padded([[1] * len(p) for p in prompts], 0, "left")
    completion_mask = padded([[1] * len(c) for c in completions], 0, "right")
    batch = {"prompt_ids": padded(prompts, pad, "left"), "prompt_mask": prompt_mask}
    batch.update(completion_ids=padded(completions, pad, "right"), completion_mask=completion_mask)
    advantages = torch.tensor([rng.gauss(0, 1) for _ in prompts]).to(device)
    return {**batch, "advantages": advantages, "num_items_in_batch": completion_mask.sum()}


def micro_batches(batch, rows):
    from trl.trainer.utils import split_tensor_dict

    return split_tensor_dict(batch, batch["prompt_ids"].shape[0] // rows)


def make_trainer(variant, model, tokenizer, args, tmp):
    """Stock TRL's trainer (`variant="stock"`) or this package's with prefix sharing, on a copy of `model`; GRPO with
    `args.beta > 0` gets an in-memory reference model (TRL would reload one from the model's path)."""
    from datasets import Dataset
    from trl.trainer.utils import add_fused_lm_head

    online_dpo, stock = args.trainer == "online_dpo", variant == "stock"
    options = {"ref_model": model} if online_dpo else {"num_generations": args.num_generations}
    options.update({} if stock else {"prefix_sharing": True}, gradient_checkpointing=args.gradient_checkpointing)
    options.update(per_device_train_batch_size=args.rows, bf16=args.mode == "gpu", use_cpu=args.mode == "cpu")
    options.update(output_dir=f"{tmp}/{variant}", train_dataset=Dataset.from_list([{"prompt": "w1"}] * 8))
    trainer = build_trainer(args.trainer, stock=stock, model=model, tokenizer=tokenizer, **options)
    if args.beta and not online_dpo:
        trainer.beta = args.beta
        trainer.ref_model = copy.deepcopy(model).eval()
        add_fused_lm_head(trainer.ref_model)
        if not stock:  # set up again, the reference model included
            trainer.sharing_session.detach()
            trainer.sharing_session = None
            trainer._setup_prefix_sharing()
    return trainer


def grpo_step(trainer, batch):
    """TRL's `compute_loss` + backward, after the reference pass TRL runs before the step when `beta > 0`."""
    import torch

    if trainer.beta:
        ids, mask = (torch.cat([batch[f"prompt_{k}"], batch[f"completion_{k}"]], dim=1) for k in ("ids", "mask"))
        width = batch["completion_ids"].shape[1]  # the logits TRL keeps: the completions'
        with torch.no_grad():
            logps = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, width)[0]
        batch["ref_per_token_logps"] = logps
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
    """Every micro-batch of one generation batch (fresh tensors, as a new generation batch is in training); (wall
    time, bytes autograd saved for backward at most)."""
    import torch

    step = online_dpo_step if args.trainer == "online_dpo" else grpo_step
    batches, saved = [clone_batch(batch) for batch in batches], 0
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    trainer.model.train()
    for batch in batches:
        with SavedTensors() as tensors:
            step(trainer, batch)
        saved = max(saved, tensors.bytes)
    trainer.model.zero_grad(set_to_none=True)
    synchronize()
    return time.perf_counter() - start, saved


def generation_time(model, batch, cuda, pad_token_id=0):
    """The model's own `generate` of the batch's completion length (identical in both trainers)."""
    import torch

    model = model.eval()
    length = batch["completion_ids"].shape[1]
    options = dict(do_sample=True, max_new_tokens=length, min_new_tokens=length, pad_token_id=pad_token_id)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], **options)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def positions(batches, trainer, online_dpo=False):
    """Positions the two training steps run, summed over the micro-batches: stock's padded rows (rows x width) and its
    real tokens, the shared rows (rows x width, as the sharing trainer lays them out) and their real tokens; and the
    scores of a dense mask, per layer and head (rows x width^2: SDPA with a mask on CPU computes them all)."""
    import torch

    from trl_prefix_sharing.layout import build_layout
    from trl_prefix_sharing.trie import StockRows

    keys = ("padded_positions", "positions", "attention_scores")
    counts = {f"{side}_{key}": 0 for key in keys for side in ("stock", "shared")}
    for b in batches:
        prompt_ids, prompt_mask = b["prompt_ids"], b["prompt_mask"]
        if online_dpo:  # TRL's left truncation to `max_length`, in both variants' `_forward`
            cut = max(prompt_ids.shape[1] + b["completion_ids"].shape[1] - trainer.max_length, 0)
            prompt_ids, prompt_mask = prompt_ids[:, cut:], prompt_mask[:, cut:]
        ids = torch.cat([prompt_ids, b["completion_ids"]], dim=1)
        mask = torch.cat([prompt_mask, b["completion_mask"]], dim=1)
        # online DPO: stock scores each row from its first token to its end (trailing padding too)
        real = mask.cumsum(dim=1) > 0 if online_dpo else mask.bool()
        rows = StockRows.generated(ids, mask, prompt_ids.shape[1], score_padding=online_dpo)
        layout = build_layout(rows, pad_token_id=0, rows=trainer.sharing_session.rows)
        counts["stock_padded_positions"] += ids.numel()
        counts["stock_positions"] += int(real.sum())
        counts["shared_padded_positions"] += layout.input_ids.numel()
        counts["shared_positions"] += int((layout.document_ids >= 0).sum())  # online DPO: stock's padding too
        counts["stock_attention_scores"] += ids.shape[0] * ids.shape[1] ** 2
        counts["shared_attention_scores"] += layout.input_ids.shape[0] * layout.input_ids.shape[1] ** 2
    return counts


def compare(batch, counts, times, activations):
    """A comparison's figures from one generation batch: mean prompt and completion tokens, the position `counts` and
    their ratios (padding, sharing ideal, total ideal, dense attention), the median step times (`times`: variant ->
    timed steps) and the speedup, and the activation memory (`activations`: variant -> bytes)."""
    step = {variant: statistics.median(t) for variant, t in times.items()}
    prompt, completion = (int(batch[key].sum()) / batch[key].shape[0] for key in ("prompt_mask", "completion_mask"))
    entry = {"prompt_tokens": prompt, "completion_tokens": completion, "p_over_c": prompt / completion, **counts}
    entry["padding"] = counts["stock_padded_positions"] / counts["stock_positions"]
    entry["sharing_ideal"] = counts["stock_positions"] / counts["shared_positions"]
    entry["total_ideal"] = ideal = counts["stock_padded_positions"] / counts["shared_padded_positions"]
    entry["dense_attention_ratio"] = counts["stock_attention_scores"] / counts["shared_attention_scores"]
    speedup = step["stock"] / step["sharing"]
    entry.update(step_s=step, step_times_s=times, speedup=speedup, share_of_total_ideal=speedup / ideal)
    entry.update(activation_bytes=activations, activation_ratio=activations["sharing"] / activations["stock"])
    return entry


def run(profile, g, model, tokenizer, args, tmp):
    """One profile and group size: a step each (activation memory), `args.repeats` interleaved timed steps, then
    generation timed once."""
    args.num_generations, args.rows = g, args.groups_per_step * g
    cuda = args.mode == "gpu"
    groups, seed = args.groups_per_step * args.micro_batches, zlib.crc32(f"{profile}/{g}".encode())
    batch = generation_batch(profile, groups, g, args.length_scale, tokenizer, seed, "cuda" if cuda else "cpu")
    batches = micro_batches(batch, args.rows)
    trainers = {variant: make_trainer(variant, model, tokenizer, args, tmp) for variant in VARIANTS}
    for trainer in trainers.values():  # not measured: `"auto"` measures its kernels in the first step
        training_step(trainer, batches, cuda, args)
    activations = {variant: training_step(trainer, batches, cuda, args)[1] for variant, trainer in trainers.items()}
    times = interleave(lambda v: training_step(trainers[v], batches, cuda, args)[0], VARIANTS, args.repeats)
    counts = positions(batches, trainers["sharing"], args.trainer == "online_dpo")
    result = {"profile": profile, "G": g, **compare(batch, counts, times, activations)}
    step = result["step_s"]
    generate = result["generation_s"] = generation_time(copy.deepcopy(model), batch, cuda, tokenizer.pad_token_id)
    result["speedup_with_generation"] = (generate + step["stock"]) / (generate + step["sharing"])
    return result


def write(results, args, data):
    """Write `<trainer>_<mode>.md` (the settings, what the columns mean, the table) and `<trainer>_<mode>.json`."""
    header = "profile|G|prompt|completion|p/c|padding|sharing ideal|ideal|dense attention|step speedup|share of ideal"
    header += "|with generation|activation memory, sharing / stock"
    rows = [
        [r["profile"], r["G"], f"{r['prompt_tokens']:.0f}", f"{r['completion_tokens']:.0f}", f"{r['p_over_c']:.2f}"]
        + [f"{r[key]:.2f}x" for key in ("padding", "sharing_ideal", "total_ideal", "dense_attention_ratio", "speedup")]
        + [f"{r['share_of_total_ideal']:.2f}", f"{r['speedup_with_generation']:.2f}x", f"{r['activation_ratio']:.2f}"]
        for r in results
    ]
    lines = document(
        f"# {TITLES[args.trainer]}: stock TRL vs prefix sharing ({args.mode.upper()})",
        f"Made by `{data['command']}` ({data['device']}; torch {data['torch']}, transformers {data['transformers']}, "
        f"trl {data['trl']}; {data['model']}; lengths x {args.length_scale}; {args.groups_per_step} prompts x G "
        f"generations per micro-batch, {args.micro_batches} micro-batches per step; beta={args.beta}; median of "
        f"{args.repeats} interleaved repeats).",
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
        markdown_table(header, rows),
    )
    write_result(args.out, f"{args.trainer}_{args.mode}", data, lines)


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
    command = command_line("online")
    device, tokenizer = quiet_setup(args.mode == "gpu", args.model)
    model = build_model("grpo", tokenizer, args)
    if args.model == "tiny":
        model_desc = f"{args.family}, hidden {args.hidden_size}, {args.layers} layers"
    else:
        model_desc = f"{describe_smollm2(model)}, {'bf16' if args.mode == 'gpu' else 'fp32'}, SDPA"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for profile, g in itertools.product(args.profiles.split(","), map(int, args.generations.split(","))):
            results.append(r := run(profile, g, model, tokenizer, args, tmp))
            ideal = f"padding {r['padding']:.2f}x, sharing {r['sharing_ideal']:.2f}x, ideal {r['total_ideal']:.2f}x"
            step = f"step {r['speedup']:.2f}x ({r['share_of_total_ideal']:.2f} of ideal)"
            print(f"{profile} G={g}: {ideal}, {step}, activations x{r['activation_ratio']:.2f}", flush=True)
    data = {"command": command, "device": device, "model": model_desc, **versions(), "length_scale": args.length_scale}
    data.update(beta=args.beta, groups_per_micro_batch=args.groups_per_step, micro_batches=args.micro_batches)
    write(results, args, {**data, "repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main()
