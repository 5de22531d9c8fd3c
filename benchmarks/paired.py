"""Stock TRL vs prefix sharing for KTO, ORPO and CPO-SimPO: training-step time, positions the model computes,
activation memory, and for KTO whether merging the policy's KL rows into its gradient pass pays.

    python -m benchmarks.paired --out docs/benchmarks      # CPU, about 5 minutes on 2 cores
    python -m benchmarks.paired --model smollm2 --profiles 256/128,1024/128 --batches 1 --repeats 3 \
        --length-scale 0.125 --out docs/benchmarks/smollm2      # a real model (below), ~10 minutes on 2 cores

For each length profile (median prompt / completion tokens, prompt/completion 0.5 to 8, x `--length-scale`), prompts
and completions get lognormal lengths around the medians (its quantiles, shuffled, so that the few examples of a step
are centred on them), in random words that are each one token of the model's tokenizer (`--model smollm2`:
SmolLM2-135M-Instruct's trained weights and tokenizer; default a small random Llama,
`--family/--hidden-size/--layers`). ORPO and CPO-SimPO train on the pairs; KTO on the same prompts with the chosen and
rejected completions alternately (TRL builds the KL rows by rotating the completions within each batch). Stock TRL's
trainers and this package's variants (`VARIANTS`) start from the same weights and run the same batches: a step untimed
and uncounted (`"auto"` measures its kernels in it), a step counted (positions, activation memory; losses checked
against stock's), then timed steps interleaved in rounds (each variant once per round, in a rotating order, so that a
slow spell of this noisy machine hits both sides of a ratio alike; a time ratio is the median of the rounds' ratios).
Writes `paired_cpu.md`, which says what each column means and how it is counted, and `paired_cpu.json`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import random
import statistics
import tempfile
import time
import zlib

from trl_prefix_sharing.testing.trainers import build_trainer

from .data import check_one_token_per_word, count_tokens, lognormal_lengths, single_token_words
from .measure import ActivationMeter, clone_batch, interleave
from .models import add_model_options, build_model, check_model_options, describe_smollm2, quiet_setup
from .results import command_line, document, markdown_table, versions, write_result


# median (prompt, completion) tokens: prompt/completion 0.5 to 8
PROFILES = {name: (int(name.split("/")[0]), 128) for name in ("64/128", "128/128", "256/128", "512/128", "1024/128")}
TRAINERS = ("kto", "orpo", "cpo")
TITLES = {"kto": "KTO", "orpo": "ORPO", "cpo": "CPO-SimPO"}
MERGE, SCORE = "prefix_sharing_merge_kl", "prefix_sharing_score_padding"
#: each trainer's variants beside stock TRL's own trainer: this package's options (ORPO/CPO: "shared" computes stock's
#: padding too, "unscored padding" is the default)
VARIANTS = {"kto": {"merged": {MERGE: True}, "apart": {MERGE: False}}}
VARIANTS["orpo"] = VARIANTS["cpo"] = {"shared": {SCORE: True}, "unscored padding": {SCORE: False}}
#: the variants as the main table names them
LABELS = {"merged": "merged KL", "apart": "apart KL", "shared": f"`{SCORE}=True`"}
LABELS["unscored padding"] = f"`{SCORE}=False`, the default"
LOSSES = {"kto": {"loss_type": "kto"}, "orpo": {}, "cpo": {"loss_type": "simpo", "cpo_alpha": 0.5}}
BATCH_SIZE = 4
MAX_LENGTH = 8192  # above every row: no truncation
GRAD_WEIGHT = 3  # a gradient pass (forward + backward) counted as three forwards


def pairs(profile, n, scale, seed=0, vocabulary=None):
    """`n` (prompt, chosen, rejected) texts with lognormal lengths around the profile's medians x `scale`, in words of
    `vocabulary` (default the tiny tokenizer's first 200), each one token of the model's tokenizer."""
    from trl_prefix_sharing.testing import WORDS

    rng = random.Random(zlib.crc32(f"{profile}/{seed}".encode()))
    p_median, c_median = (max(1, round(x * scale)) for x in PROFILES[profile])
    lengths = zip(*(lognormal_lengths(rng, m, n) for m in (p_median, c_median, c_median)), strict=True)
    vocabulary = vocabulary or WORDS[:200]

    def words(k):
        return " ".join(rng.choice(vocabulary) for _ in range(k))

    return [{"prompt": words(p), "chosen": " " + words(c), "rejected": " " + words(r)} for p, c, r in lengths]


def unpaired(rows):
    """KTO's data: each prompt once, with its chosen (desirable) or rejected (undesirable) completion alternately."""
    side = ("chosen", "rejected")
    return [{"prompt": r["prompt"], "completion": r[side[i % 2]], "label": i % 2 == 0} for i, r in enumerate(rows)]


def make_trainers(kind, model, ref_model, tokenizer, rows, args, tmp):
    """{variant: trainer} from deep copies of the same weights, each with the same collated batches
    (`trainer.bench_batches`: the first `args.batches` as TRL's sequential sampler draws them)."""
    from datasets import Dataset

    dataset = Dataset.from_list(unpaired(rows) if kind == "kto" else rows)
    common = dict(model=model, ref_model=ref_model if kind == "kto" else None, tokenizer=tokenizer, **LOSSES[kind])
    common.update(train_dataset=dataset, per_device_train_batch_size=BATCH_SIZE, use_cpu=True, bf16=False)
    common.update(gradient_checkpointing=args.gradient_checkpointing, max_length=MAX_LENGTH)
    trainers = {}
    for variant, options in {"stock": None, **VARIANTS[kind]}.items():
        ours = {} if options is None else {"prefix_sharing": True, **options}
        common["output_dir"] = f"{tmp}/{kind}-{variant}"
        trainer = trainers[variant] = build_trainer(kind, stock=options is None, **common, **ours)
        examples = [trainer.train_dataset[i] for i in range(args.batches * BATCH_SIZE)]
        chunks = [examples[i : i + BATCH_SIZE] for i in range(0, len(examples), BATCH_SIZE)]
        trainer.bench_batches = [trainer._prepare_inputs(trainer.data_collator(chunk)) for chunk in chunks]
    return trainers


def training_step(trainer):
    """`compute_loss` + backward on every batch of `trainer.bench_batches`: (wall time, the losses)."""
    batches = [clone_batch(batch) for batch in trainer.bench_batches]
    start, losses = time.perf_counter(), []
    trainer.model.train()
    for batch in batches:
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        losses.append(loss.detach())
    trainer.model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, losses


def counted_step(trainer):
    """A step counted, untimed: (counts, activation memory, losses). The counts come from forward pre-hooks on the
    backbones (`model.model`) of the policy and reference: per pass (policy or reference), the calls, positions (rows
    x width), real tokens, laid-out tokens (shared: with stock's padding where the layout scores it) and dense
    attention scores (rows x width^2), plain and weighted (`w_...`: a gradient pass x `GRAD_WEIGHT`). Shared calls are
    recognised by their `input_ids`, the rows of a layout the trainer built (`trainer.sharing_session.layout`, wrapped
    for the step)."""
    import torch

    keys = ("calls", "positions", "tokens", "laid", "scores")
    counts = {f"{w}{p}_{k}": 0 for w in ("", "w_") for p in ("policy", "reference") for k in keys}
    layouts, session = [], getattr(trainer, "sharing_session", None)

    def hook(pass_, module, args, kwargs):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        layout = next((lay for lay in layouts if lay.input_ids is ids), None)
        if layout is None:  # stock rows: their 2-D attention mask
            tokens = laid = int(kwargs["attention_mask"].sum())
        else:  # the layout's tokens (each prompt once), and with stock's scored padding
            placed = layout.document_ids >= 0
            laid = int(placed.sum())
            tokens = laid if layout.key_visible is None else int((placed & layout.key_visible).sum())
        values = {"calls": 1, "positions": ids.numel(), "tokens": tokens, "laid": laid}
        values["scores"] = ids.shape[0] * ids.shape[1] ** 2
        weight = GRAD_WEIGHT if torch.is_grad_enabled() else 1
        for key, value in values.items():
            counts[f"{pass_}_{key}"] += value
            counts[f"w_{pass_}_{key}"] += weight * value

    models = {"policy": trainer.model, "reference": getattr(trainer, "ref_model", None)}
    hooks = {p: functools.partial(hook, p) for p, model in models.items() if model is not None}
    handles = [models[p].model.register_forward_pre_hook(h, with_kwargs=True) for p, h in hooks.items()]
    if session is not None:  # record the layouts the trainer builds, to recognise their rows
        layout = session.layout
        session.layout = lambda *a, **k: layouts.append(layout(*a, **k)) or layouts[-1]
    meter = ActivationMeter(trainer)
    try:
        losses = training_step(trainer)[1]
    finally:
        del trainer.compute_loss  # the meter's wrapper (an instance attribute): the method again
        for handle in handles:
            handle.remove()
        if session is not None:
            del session.layout  # the instance attribute: the method again
    return counts, meter.peak, losses


def total(counts, key, weighted=True):
    """A count of `counted_step`'s over both passes, weighted or plain."""
    w = "w_" if weighted else ""
    return counts[f"{w}policy_{key}"] + counts[f"{w}reference_{key}"]


def round_ratio(slow, fast):
    """The median over the timing rounds of `slow / fast` in the same round."""
    return statistics.median(a / b for a, b in zip(slow, fast, strict=True))


def compare(stock, shared, speedup):
    """One variant against stock (their `counted_step` counts) and its step speedup: positions, calls and ratios."""
    entry = {}
    for key in ("positions", "calls"):
        entry[f"{key}_per_step"] = {"stock": total(stock, key, False), "shared": total(shared, key, False)}
    positions, tokens, scores = ((total(stock, key), total(shared, key)) for key in ("positions", "tokens", "scores"))
    entry.update(padding=positions[0] / tokens[0], sharing_ideal=tokens[0] / tokens[1])
    entry.update(shared_padding=positions[1] / tokens[1], ideal=positions[0] / positions[1])
    entry.update(dense_attention_ratio=scores[0] / scores[1], speedup=speedup, share_of_ideal=speedup / entry["ideal"])
    return entry


def run(kind, profile, model, ref_model, tokenizer, args, tmp):
    """One trainer on one profile: every variant's counted step (losses checked against stock's), then timed rounds."""
    import torch

    rows = pairs(profile, args.batches * BATCH_SIZE, args.length_scale, vocabulary=args.vocabulary)
    if args.vocabulary is not None:
        check_one_token_per_word(tokenizer, [text for row in rows for text in row.values()])
    trainers = make_trainers(kind, model, ref_model, tokenizer, rows, args, tmp)
    for trainer in trainers.values():  # not counted: `"auto"` measures its kernels in the first step
        training_step(trainer)
    first = {variant: counted_step(trainer) for variant, trainer in trainers.items()}
    counts, activations, losses = ({variant: f[i] for variant, f in first.items()} for i in range(3))
    for variant in VARIANTS[kind]:
        for b, (got, expected) in enumerate(zip(losses[variant], losses["stock"], strict=True)):
            where = f"{kind} {profile} {variant} batch {b}"
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
    times = interleave(lambda variant: training_step(trainers[variant])[0], list(trainers), args.repeats)
    # the texts' tokens with the model's tokenizer (BOS and EOS aside)
    prompt = statistics.mean([count_tokens(tokenizer, r["prompt"]) for r in rows])
    texts = unpaired(rows) if kind == "kto" else [{"completion": r[k]} for r in rows for k in ("chosen", "rejected")]
    completion = statistics.mean([count_tokens(tokenizer, text["completion"]) for text in texts])
    result = {"trainer": kind, "profile": profile, "prompt_tokens": prompt, "completion_tokens": completion}
    step_s = {variant: statistics.median(t) for variant, t in times.items()}
    result.update(losses=[float(x) for x in losses["stock"]], step_s=step_s, step_times_s=times)
    result.update(activation_bytes=activations, counts=counts, variants={})
    result["p_over_c"] = prompt / completion
    for variant in VARIANTS[kind]:
        stock, shared = counts["stock"], counts[variant]
        entry = result["variants"][variant] = compare(stock, shared, round_ratio(times["stock"], times[variant]))
        entry["activation_ratio"] = activations[variant] / activations["stock"]
        if kind == "kto":  # the reference pass alone: stock's main and KL rows vs the merged trie
            entry["reference_sharing_ideal"] = stock["reference_tokens"] / shared["reference_tokens"]
    if kind == "kto":
        batches = trainers["merged"].bench_batches  # the auto rule's inputs: prompt and KL completion tokens per batch
        rule = [(b["attention_mask"].bool() & (b["completion_mask"] == 0), b["KL_completion_mask"]) for b in batches]
        rule = [(int(p.sum()), int(c.sum())) for p, c in rule]
        result["batch_prompt_over_kl_completion"] = [p / c for p, c in rule]
        result["auto_merges"] = sum(p > 2 * c for p, c in rule)
        result["merged_over_apart"] = round_ratio(times["apart"], times["merged"])
        result["merged_over_apart_ideal"] = total(counts["apart"], "positions") / total(counts["merged"], "positions")
        result["merged_over_apart_activation"] = activations["merged"] / activations["apart"]
    return result


def span(values):
    """The range of `values` as the tables write ratios, `"0.93-0.95x"`, or one value where both ends round alike."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def merge_verdict(kto_results, band=0.03):
    """Whether the measurements support the auto rule's threshold (`MERGE_PROMPT_RATIO`), one paragraph. A profile
    is below the threshold when all its batches are (the rule decides per batch), above when all are, and straddles it
    otherwise; merged vs apart (step time apart / merged) within `band` of 1 is even (this machine's noise)."""
    from trl_prefix_sharing.kto_trainer import MERGE_PROMPT_RATIO as rule

    below = f"with every batch below the auto rule's threshold of {rule:g}"
    leads = {"below": below, "above": "with every batch above it", "straddle": "with batches on both sides"}
    groups = {side: [] for side in leads}  # side: [(profile, merged vs apart)]
    for r in kto_results:
        ratios = r["batch_prompt_over_kl_completion"]
        side = "below" if max(ratios) <= rule else "above" if min(ratios) > rule else "straddle"
        groups[side].append((r["profile"], r["merged_over_apart"]))
    parts = [
        f"{leads[side]}, merged vs apart {span([y for _, y in g])} ({', '.join(p for p, _ in g)})"
        for side, g in groups.items()
        if g
    ]
    below, above = (
        {"costs" if y < 1 - band else "pays" if y > 1 + band else "even" for _, y in groups[side]}
        for side in ("below", "above")
    )
    judgements = {  # judgement: whether it holds; the first that holds is the verdict
        "merging already pays below the threshold: on this machine a lower one would be faster": "pays" in below,
        "merging still costs above the threshold: on this machine a higher one would be faster": "costs" in above,
        f"the measurement supports the threshold: merging costs or is even (within {band:.0%}) below it, and pays or "
        "is even above it": "costs" in below or "pays" in above,
        f"merging is within {band:.0%} of apart everywhere: these measurements do not place a threshold": True,
    }
    return f"Measured here, {'; '.join(parts)}. So {next(text for text, holds in judgements.items() if holds)}."


def notes(results):
    """Bullet points on what the main table shows, from its numbers."""

    def entries(variant):
        return [(r, r["variants"][variant]) for r in results if variant in r["variants"]]

    def s(entries, key):
        return span([v[key] for _, v in entries])

    lines, paired, unscored = [], entries("shared"), entries("unscored padding")  # ORPO/CPO: both variants or neither
    if paired:
        lines += [
            "- **ORPO/CPO: stock's padding is computed too.** The shared layout scores every column stock scores, "
            f"each row's padding included (shared padding {s(paired, 'shared_padding')}), so the ideal is "
            f"{s(paired, 'ideal')} where computing each prompt once would give {s(paired, 'sharing_ideal')} "
            "without stock's padding. A shared row (the prompt, then both rows' completions and their padding) is "
            "longer than stock's rows, so a dense mask computes more attention scores than stock "
            f"(stock / shared {s(paired, 'dense_attention_ratio')}); FlexAttention on CUDA skips the masked blocks.",
            "- **ORPO/CPO with `prefix_sharing_score_padding=False`:** the padding is not computed (shared padding "
            f"{s(unscored, 'shared_padding')}), so the ideal rises to {s(unscored, 'ideal')} and the step to "
            f"{s(unscored, 'speedup')}; only the `logits/chosen|rejected` metrics change (they then average the "
            "columns that predict a real token), the loss checked equal to stock's before timing.",
        ]
    kto = [(r, v) for r in results if r["trainer"] == "kto" for v in r["variants"].values()]
    if slower := [(r, v) for r, v in paired + unscored + kto if v["speedup"] < 1]:
        listed = ", ".join(f"{TITLES[r['trainer']]} {r['profile']} {v['speedup']:.2f}x" for r, v in slower)
        lines.append(
            f"- **Below 1:** {listed}. There the dense attention of the longer shared rows costs more "
            "than the positions save; building the layout and its mask for every batch adds to it."
        )
    if kto:
        apart, merged = entries("apart"), entries("merged")
        lines.append(
            "- **KTO.** Different prompts share nothing within the main rows or within the KL rows, so apart the "
            "policy's two passes run stock's rows unchanged (the same positions, and stock's activation memory: "
            f"{s(apart, 'activation_ratio')}); the gain is the reference pass, main and KL rows as one trie "
            f"(reference sharing ideal {s(apart, 'reference_sharing_ideal')}). Merged, the KL rows are saved for "
            f"backward too: {s(merged, 'activation_ratio')} of stock's activation memory."
        )
    return lines


def tables(results):
    """The main table (a row per trainer, profile and variant) and KTO's on merging its KL rows (a row per profile)."""
    main, kto = [], []
    for r in results:
        for variant, v in r["variants"].items():
            reference = f" (reference {v['reference_sharing_ideal']:.2f}x)" if r["trainer"] == "kto" else ""
            main.append(
                [f"{TITLES[r['trainer']]} ({LABELS[variant]})", r["profile"], f"{r['prompt_tokens']:.0f}"]
                + [f"{r['completion_tokens']:.0f}", f"{r['p_over_c']:.2f}", f"{v['padding']:.2f}x"]
                + [f"{v['sharing_ideal']:.2f}x{reference}"]
                + [f"{v[k]:.2f}x" for k in ("shared_padding", "ideal", "dense_attention_ratio", "speedup")]
                + [f"{v['share_of_ideal']:.2f}"]
                + [f"{v[k]['stock']} / {v[k]['shared']}" for k in ("positions_per_step", "calls_per_step")]
                + [f"{v['activation_ratio']:.2f}"]
            )
        if r["trainer"] == "kto":
            ratios = r["batch_prompt_over_kl_completion"]
            kto.append(
                [r["profile"], " / ".join(f"{y:.2f}" for y in ratios), f"{r['auto_merges']} of {len(ratios)} batches"]
                + [f"{r['variants'][v]['speedup']:.2f}x" for v in ("merged", "apart")]
                + [f"{r[k]:.2f}x" for k in ("merged_over_apart", "merged_over_apart_ideal")]
                + [f"{r['merged_over_apart_activation']:.2f}"]
            )
    header = "trainer|profile|prompt|completion|p/c|padding|sharing ideal|shared padding|ideal|dense attention"
    header += "|step speedup|share of ideal|positions per step (stock / shared)|backbone calls (stock / shared)"
    header += "|activation memory, shared / stock"
    kto_header = "profile|batch p/c|auto rule merges|speedup merged|speedup apart|merged vs apart|ideal"
    kto_header += "|activation memory, merged / apart"
    return markdown_table(header, main), markdown_table(kto_header, kto) if kto else None


def write(results, args, data):
    """Write `paired_cpu.md` (the settings, what the columns mean, the tables, notes) and `paired_cpu.json`."""
    small = f"this vocabulary is small, {args.vocab} tokens; with a real one, tens of thousands,"
    vocabulary = small if args.vocab < 10_000 else f"a real vocabulary, {args.vocab} tokens:"
    kto = [r for r in results if r["trainer"] == "kto"]
    main, kto_table = tables(results)
    merging = kto and [
        "## KTO: merging the policy's KL rows",
        "Merged: the policy's gradient pass also computes the KL rows after the same prompts (one pass over "
        "`P + C + C'` tokens, the KL completions going through backward too); apart: the main rows with gradients and "
        "the KL rows in a pass without (`P + C` and `P + C'`). Counting a backward as two forwards, merging saves a "
        "forward over the prompts and costs a backward over the KL completions, so it pays when `P > 2C'`: the auto "
        "rule (`prefix_sharing_merge_kl=None`) merges a batch when its prompt tokens exceed twice its KL completion "
        "tokens. *Batch p/c* = each batch's prompt tokens / KL completion tokens, as the rule reads them; *merged vs "
        "apart* = step time apart / merged (above 1: merging pays); its *ideal* = weighted positions apart / merged.",
        kto_table,
        merge_verdict(kto),
    ]
    lines = document(
        "# KTO, ORPO and CPO-SimPO: stock TRL vs prefix sharing (CPU)",
        f"Made by `{data['command']}` ({data['device']}; torch {data['torch']}, transformers {data['transformers']}, "
        f"trl {data['trl']}; {data['model']}; median prompt/completion tokens of each profile x {args.length_scale}, "
        f"lognormal quantiles around them; {args.batches} batches of {BATCH_SIZE} examples per step; gradient "
        f"checkpointing {'on' if args.gradient_checkpointing else 'off'}; {args.repeats} interleaved rounds, "
        f"time ratios the median of the rounds' ratios; {data['elapsed_s'] / 60:.1f} minutes).",
        "Training step = the trainer's `compute_loss` + backward on each batch, the same collated batches for stock "
        "TRL and prefix sharing (KTO: in the dataset's order, as TRL's sequential sampler draws them). Before timing, "
        "each batch's loss with prefix sharing is checked against stock's (atol 1e-4). ORPO: default `beta`; "
        'CPO-SimPO: `loss_type="simpo"`, `cpo_alpha=0.5`; KTO: `loss_type="kto"` with a reference model (the '
        "policy's weights with small noise, so that the log-prob differences, the `kl` term and the loss check are "
        "not trivial), the policy's KL rows merged into its gradient pass (`prefix_sharing_merge_kl=True`) or in a "
        "separate pass without gradients (`False`).",
        "*Prompt*, *completion*: mean tokens per example, counted with the model's tokenizer (BOS and EOS aside; the "
        "synthetic words are each one token of it), *p/c* their ratio. Positions: rows x width of every backbone call "
        "of a step (policy and reference), counted by a forward pre-hook. Since a pass with gradients also runs "
        "backward, the ratios weight it 3 and a pass without gradients 1 (plain positions per step are given too). "
        "*Padding* = stock positions / the real tokens of stock's rows: what removing stock's padding alone would "
        "save. *Sharing ideal* = stock tokens / shared tokens (each example's prompt once): ORPO/CPO "
        "`(2P + Cc + Cr) / (P + Cc + Cr)` per pair; KTO's reference pass `(2P + C + C') / (P + C + C')` (main and KL "
        "rows), in the *reference* column. *Shared padding* = shared positions / shared tokens: ORPO/CPO lay out and "
        "score each row's padding as stock does (its `logits/*` metrics average over it), plus the shared rows' own "
        "padding. *Ideal* = stock positions / shared positions = padding x sharing ideal / shared padding; *share of "
        "ideal* = step speedup / ideal. *Dense attention* = stock / shared attention scores (rows x width² per layer "
        "and head, weighted the same way; SDPA with a mask on CPU computes them all): lower than the ideal where the "
        "shared rows are longer than stock's.",
        "Activation memory: bytes autograd saves for backward, the largest batch of a step, shared / stock. ORPO and "
        "CPO: stock materialises the `[2B, L, vocab]` logits (and their log-softmax) and saves them for backward, "
        "while the shared path scores the columns with TRL's fused log-prob head and never does, so their memory "
        f"column mixes the positions saved and the logits avoided ({vocabulary} the logits dominate stock's memory). "
        "KTO: stock uses the fused head too, so its column is the positions alone.",
        main,
        notes(results),
        *(merging or ()),
    )
    write_result(args.out, "paired_cpu", data, lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="kto, orpo, cpo (comma-separated)")
    parser.add_argument("--profiles", default=",".join(PROFILES), help=f"of {', '.join(PROFILES)}")
    parser.add_argument("--batches", type=int, default=2, help="batches of 4 examples per training step")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant, interleaved")
    parser.add_argument("--length-scale", type=float, default=0.25)
    add_model_options(parser)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--out", default="docs/benchmarks")
    args = parser.parse_args()
    check_model_options(args)
    args.mode, command, started = "cpu", command_line("paired"), time.perf_counter()  # mode: for `build_model`
    device, tokenizer = quiet_setup(False, args.model)
    args.vocab, args.vocabulary = len(tokenizer), single_token_words(tokenizer) if args.model != "tiny" else None
    import torch

    model = build_model("paired", tokenizer, args)
    ref_model = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in ref_model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    if args.model == "tiny":
        size = f"vocab {args.vocab}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters"
        model_desc = f"{args.family}, hidden {args.hidden_size}, {args.layers} layers, {size}"
    else:
        model_desc = describe_smollm2(model)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.trainers.split(","):
            for profile in args.profiles.split(","):
                results.append(r := run(kind, profile, model, ref_model, tokenizer, args, tmp))
                for variant, v in r["variants"].items():
                    figures = f"ideal {v['ideal']:.2f}x, step {v['speedup']:.2f}x ({v['share_of_ideal']:.2f} of ideal)"
                    figures += f", activations x{v['activation_ratio']:.2f} [{time.perf_counter() - started:.0f} s]"
                    print(f"{kind} {profile} {variant}: p/c {r['p_over_c']:.2f}, {figures}", flush=True)
    data = {"command": command, "device": device, "model": f"{model_desc}, fp32, SDPA", **versions()}
    data.update(length_scale=args.length_scale, batch_size=BATCH_SIZE, batches_per_step=args.batches)
    data.update(repeats=args.repeats, gradient_checkpointing=args.gradient_checkpointing)
    write(results, args, {**data, "elapsed_s": round(time.perf_counter() - started, 1), "results": results})


if __name__ == "__main__":
    main()
