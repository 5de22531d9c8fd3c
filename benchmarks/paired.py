"""Stock TRL vs prefix sharing for KTO, ORPO and CPO-SimPO: training-step time, positions the model computes,
activation memory, and for KTO whether merging the policy's KL rows into its gradient pass pays.

    python -m benchmarks.paired --out docs/benchmarks      # CPU, about 5 minutes on 2 cores
    python -m benchmarks.paired --model smollm2 --profiles 256/128,1024/128 --batches 1 --repeats 3 \
        --length-scale 0.125 --out docs/benchmarks/smollm2      # a real model (below), ~10 minutes on 2 cores

For each length profile (median prompt / completion tokens with prompt/completion ratios from 0.5 to 8, scaled by
`--length-scale`), prompts and completions get lognormal lengths around the medians (its quantiles, shuffled, so that
the few examples of a step are centred on them; random words that are each one token of the model's tokenizer, and
the tables count the tokens with the tokenizer). `--model smollm2` runs SmolLM2-135M-Instruct's trained weights and
tokenizer instead of a small random Llama (`--family/--hidden-size/--layers`). ORPO and CPO-SimPO (`loss_type="simpo"`,
`cpo_alpha=0.5`) train on the pairs (prompt, chosen, rejected); KTO (`loss_type="kto"`, with a reference model) on the
same prompts with one completion each (chosen and rejected alternately, so each batch mixes desirable and undesirable
examples; TRL builds the KL rows by rotating the completions within each batch). Stock TRL (`trl.KTOTrainer`,
`trl.experimental.orpo.ORPOTrainer`, `trl.experimental.cpo.CPOTrainer`) and the prefix-sharing trainers start from
identical weights (KTO: shared with `prefix_sharing_merge_kl=True` and with `False`).

One training step = the trainer's `compute_loss` + backward on each of `--batches` collated batches of 4 examples, the
same batches for every variant (KTO: in the dataset's sequential order, TRL's KL rotation chunks). Each variant first
runs one step untimed and uncounted (`"auto"` measures its kernels in its first step, passes that are not the step's);
the next step is counted and each batch's shared loss checked against stock's. Timed repeats of the variants are
interleaved: each round times every variant once, in a rotating order, and a time ratio is the median over the rounds
of that round's ratio (a slow spell of this noisy machine then hits both sides of a ratio alike).

Positions are counted by a forward pre-hook on the backbones (policy and reference), every call of the step: rows x
width, the real tokens the rows hold (stock: the attention mask; shared: the layout's tokens, each example's prompt
once) and, since a pass with gradients also runs backward, weighted 3 for a gradient pass and 1 for a pass without
(forward + backward is about three forwards). *Padding* = stock positions / stock tokens; *sharing ideal* = stock
tokens / shared tokens (ORPO/CPO: `(2P + Cc + Cr) / (P + Cc + Cr)` per pair; the KTO reference pass: `(2P + C + C') /
(P + C + C')`); *shared padding* = shared positions / shared tokens (ORPO/CPO lay out and score stock's padding too,
as stock does); *ideal* = stock positions / shared positions = padding x sharing ideal / shared padding; *share of
ideal* = step speedup / ideal. Activation memory: bytes autograd saves for backward, the largest batch of a step.
Writes `paired_cpu.md` and `paired_cpu.json`.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
import time
import zlib

from trl_prefix_sharing.testing.trainers import build_trainer

from .data import check_one_token_per_word, count_tokens, lognormal_lengths, single_token_words
from .measure import ActivationMeter, clone_batch, interleave
from .models import add_model_options, build_model, check_model_options, describe_smollm2, quiet_setup
from .results import command_line, markdown_table, versions, write_result


# median (prompt, completion) tokens: prompt/completion 0.5 to 8
PROFILES = {name: (int(name.split("/")[0]), 128) for name in ("64/128", "128/128", "256/128", "512/128", "1024/128")}
TRAINERS = ("kto", "orpo", "cpo")
TITLES = {"kto": "KTO", "orpo": "ORPO", "cpo": "CPO-SimPO"}
MERGE, SCORE = "prefix_sharing_merge_kl", "prefix_sharing_score_padding"
#: each trainer's variants beside stock TRL's own trainer: this package's options (ORPO/CPO: "shared" computes stock's
#: padding too, "unscored padding" is the default)
VARIANTS = {"kto": {"merged": {MERGE: True}, "apart": {MERGE: False}}}
VARIANTS["orpo"] = VARIANTS["cpo"] = {"shared": {SCORE: True}, "unscored padding": {SCORE: False}}
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
    return [
        {"prompt": r["prompt"], "completion": r["chosen"] if i % 2 == 0 else r["rejected"], "label": i % 2 == 0}
        for i, r in enumerate(rows)
    ]


def make_trainers(kind, model, ref_model, tokenizer, rows, args, tmp):
    """{variant: trainer} from deep copies of the same weights, each with the same collated batches
    (`trainer.bench_batches`: the first `args.batches` as TRL's sequential sampler draws them)."""
    from datasets import Dataset

    dataset = Dataset.from_list(unpaired(rows) if kind == "kto" else rows)
    trainers = {}
    for variant, options in {"stock": None, **VARIANTS[kind]}.items():
        trainer = trainers[variant] = build_trainer(
            kind,
            stock=options is None,
            model=model,
            ref_model=ref_model if kind == "kto" else None,
            tokenizer=tokenizer,
            train_dataset=dataset,
            output_dir=f"{tmp}/{kind}-{variant}",
            per_device_train_batch_size=BATCH_SIZE,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=args.gradient_checkpointing,
            max_length=MAX_LENGTH,
            **LOSSES[kind],
            **({} if options is None else {"prefix_sharing": True, **options}),
        )
        chunks = [range(b * BATCH_SIZE, (b + 1) * BATCH_SIZE) for b in range(args.batches)]
        collate = trainer.data_collator
        trainer.bench_batches = [
            trainer._prepare_inputs(collate([trainer.train_dataset[i] for i in c])) for c in chunks
        ]
    return trainers


def training_step(trainer):
    """`compute_loss` + backward on every batch of `trainer.bench_batches`: (wall time, the losses)."""
    batches = [clone_batch(batch) for batch in trainer.bench_batches]
    start = time.perf_counter()
    trainer.model.train()
    losses = []
    for batch in batches:
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        losses.append(loss.detach())
    trainer.model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, losses


class PositionCounter:
    """Forward pre-hooks on the backbones (`model.model`) of the policy and reference: per pass kind (policy or
    reference), the calls, positions (rows x width), real tokens and dense attention scores (rows x width^2), plain
    and weighted (a gradient pass x `GRAD_WEIGHT`). Shared calls are recognised by their `input_ids`, the rows of a
    layout the trainer built (`trainer.sharing_session.layout`, wrapped while counting)."""

    KEYS = ("calls", "positions", "tokens", "laid", "scores")

    def __init__(self, trainer):
        self.layouts = []
        passes = ("policy", "reference")
        self.counts = {f"{w}{pass_}_{key}": 0 for w in ("", "w_") for pass_ in passes for key in self.KEYS}
        models = {"policy": trainer.model, "reference": getattr(trainer, "ref_model", None)}
        self.handles = [
            model.model.register_forward_pre_hook(self._hook(pass_), with_kwargs=True)
            for pass_, model in models.items()
            if model is not None
        ]
        self.sharing_session = getattr(trainer, "sharing_session", None)
        if self.sharing_session is not None:
            original = self.sharing_session.layout

            def layout(*a, **k):
                self.layouts.append(original(*a, **k))
                return self.layouts[-1]

            self.sharing_session.layout = layout

    def _hook(self, pass_):
        import torch

        def hook(module, args, kwargs):
            ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
            layout = next((lay for lay in self.layouts if lay.input_ids is ids), None)
            if layout is None:  # stock rows: their 2-D attention mask
                tokens = laid = int(kwargs["attention_mask"].sum())
            else:  # the layout's tokens (each prompt once), and with stock's scored padding
                placed = layout.document_ids >= 0
                laid = int(placed.sum())
                tokens = int((placed & layout.key_visible).sum()) if layout.key_visible is not None else laid
            values = {"calls": 1, "positions": ids.numel(), "tokens": tokens, "laid": laid}
            values["scores"] = ids.shape[0] * ids.shape[1] ** 2
            weight = GRAD_WEIGHT if torch.is_grad_enabled() else 1
            for key, value in values.items():
                self.counts[f"{pass_}_{key}"] += value
                self.counts[f"w_{pass_}_{key}"] += weight * value

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()
        if self.sharing_session is not None:
            del self.sharing_session.layout  # the instance attribute: the method again
        self.layouts.clear()

    def total(self, key, weighted=True):
        w = "w_" if weighted else ""
        return self.counts[f"{w}policy_{key}"] + self.counts[f"{w}reference_{key}"]


def first_step(trainer):
    """The untimed first step: positions, activation memory and losses."""
    counter = PositionCounter(trainer)
    meter = ActivationMeter(trainer)
    try:
        _, losses = training_step(trainer)
    finally:
        del trainer.compute_loss  # the meter's wrapper (an instance attribute): the method again
        counter.remove()
    return counter, meter.peak, losses


def round_ratio(slow, fast):
    """The median over the timing rounds of `slow / fast` in the same round."""
    return statistics.median(a / b for a, b in zip(slow, fast, strict=True))


def merge_rule(batch):
    """The KTO auto rule's inputs of one batch: prompt tokens and KL completion tokens."""
    prompt = int((batch["attention_mask"].bool() & (batch["completion_mask"] == 0)).sum())
    return prompt, int(batch["KL_completion_mask"].sum())


def compare(stock, shared, speedup):
    """One variant against stock (their `PositionCounter`s) and its step speedup: positions, calls and the ratios."""
    ideal = stock.total("positions") / shared.total("positions")
    pair = (("stock", stock), ("shared", shared))
    return {
        "positions_per_step": {key: c.total("positions", False) for key, c in pair},
        "calls_per_step": {key: c.total("calls", False) for key, c in pair},
        "padding": stock.total("positions") / stock.total("tokens"),
        "sharing_ideal": stock.total("tokens") / shared.total("tokens"),
        "shared_padding": shared.total("positions") / shared.total("tokens"),
        "ideal": ideal,
        "dense_attention_ratio": stock.total("scores") / shared.total("scores"),
        "speedup": speedup,
        "share_of_ideal": speedup / ideal,
    }


def run(kind, profile, model, ref_model, tokenizer, args, tmp):
    """One trainer on one profile: the first step of each variant (counts, activation memory, losses checked against
    stock's), then `args.repeats` interleaved timed steps."""
    import torch

    rows = pairs(profile, args.batches * BATCH_SIZE, args.length_scale, vocabulary=args.vocabulary)
    if args.vocabulary is not None:
        check_one_token_per_word(tokenizer, [text for row in rows for text in row.values()])
    trainers = make_trainers(kind, model, ref_model, tokenizer, rows, args, tmp)
    for trainer in trainers.values():  # not counted: `"auto"` measures its kernels in the first step
        training_step(trainer)
    first = {variant: first_step(trainer) for variant, trainer in trainers.items()}
    for variant in list(trainers)[1:]:
        for b, (got, expected) in enumerate(zip(first[variant][2], first["stock"][2], strict=True)):
            where = f"{kind} {profile} {variant} batch {b}"
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
    times = interleave(lambda variant: training_step(trainers[variant])[0], list(trainers), args.repeats)
    # the texts' tokens with the model's tokenizer (BOS and EOS aside)
    prompt_tokens = [count_tokens(tokenizer, r["prompt"]) for r in rows]
    texts = unpaired(rows) if kind == "kto" else [{"completion": r[k]} for r in rows for k in ("chosen", "rejected")]
    completion_tokens = [count_tokens(tokenizer, text["completion"]) for text in texts]
    result = {
        "trainer": kind,
        "profile": profile,
        "prompt_tokens": statistics.mean(prompt_tokens),
        "completion_tokens": statistics.mean(completion_tokens),
        "losses": [float(x) for x in first["stock"][2]],
        "step_s": {variant: statistics.median(t) for variant, t in times.items()},
        "step_times_s": times,
        "activation_bytes": {variant: first[variant][1] for variant in trainers},
        "counts": {variant: first[variant][0].counts for variant in trainers},
        "variants": {},
    }
    result["p_over_c"] = result["prompt_tokens"] / result["completion_tokens"]
    stock = first["stock"][0]
    for variant in list(trainers)[1:]:
        shared = first[variant][0]
        entry = result["variants"][variant] = compare(stock, shared, round_ratio(times["stock"], times[variant]))
        entry["activation_ratio"] = first[variant][1] / first["stock"][1]
        if kind == "kto":  # the reference pass alone: stock's main and KL rows vs the merged trie
            entry["reference_sharing_ideal"] = stock.counts["reference_tokens"] / shared.counts["reference_tokens"]
    if kind == "kto":
        rule = [merge_rule(b) for b in trainers["merged"].bench_batches]
        result["batch_prompt_over_kl_completion"] = [p / c for p, c in rule]
        result["auto_merges"] = sum(p > 2 * c for p, c in rule)
        result["merged_over_apart"] = round_ratio(times["apart"], times["merged"])
        merged, apart = first["merged"][0], first["apart"][0]
        result["merged_over_apart_ideal"] = apart.total("positions") / merged.total("positions")
        result["merged_over_apart_activation"] = first["merged"][1] / first["apart"][1]
    return result


def merge_verdict(kto_results, band=0.03):
    """Whether the measurements support the auto rule's threshold (`MERGE_PROMPT_RATIO`), one paragraph. The rule
    decides per batch, so a profile is below the threshold when all its batches are, above when all are, and straddles
    it otherwise; merged vs apart (step time apart / merged) within `band` of 1 counts as even (this machine's noise).
    """
    from trl_prefix_sharing.kto_trainer import MERGE_PROMPT_RATIO as rule

    groups = {"below": [], "above": [], "straddle": []}
    for r in kto_results:
        ratios = r["batch_prompt_over_kl_completion"]
        side = "below" if max(ratios) <= rule else "above" if min(ratios) > rule else "straddle"
        groups[side].append((r["profile"], r["merged_over_apart"]))

    def outcome(y):
        return "costs" if y < 1 - band else "pays" if y > 1 + band else "even"

    def describe(entries):
        ys = [y for _, y in entries]
        where = ", ".join(name for name, _ in entries)
        low, high = f"{min(ys):.2f}", f"{max(ys):.2f}"
        span = f"{low}x" if low == high else f"{low}-{high}x"
        return f"merged vs apart {span} ({where})"

    parts = []
    if groups["below"]:
        parts.append(f"with every batch below the auto rule's threshold of {rule:g}, {describe(groups['below'])}")
    if groups["above"]:
        parts.append(f"with every batch above it, {describe(groups['above'])}")
    if groups["straddle"]:
        parts.append(f"with batches on both sides, {describe(groups['straddle'])}")
    below = [outcome(y) for _, y in groups["below"]]
    above = [outcome(y) for _, y in groups["above"]]
    if "pays" in below:
        judgement = "merging already pays below the threshold: on this machine a lower one would be faster"
    elif "costs" in above:
        judgement = "merging still costs above the threshold: on this machine a higher one would be faster"
    elif "costs" in below or "pays" in above:
        judgement = (
            f"the measurement supports the threshold: merging costs or is even (within {band:.0%}) below it, and pays "
            "or is even above it"
        )
    else:
        judgement = f"merging is within {band:.0%} of apart everywhere: these measurements do not place a threshold"
    return f"Measured here, {'; '.join(parts)}. So {judgement}."


def notes(results):
    """Bullet points on what the main table shows, from its numbers."""

    def span(entries, key):
        low, high = min(v[key] for _, v in entries), max(v[key] for _, v in entries)
        return f"{low:.2f}x" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}x"

    lines = []
    paired = [(r, r["variants"]["shared"]) for r in results if r["trainer"] != "kto"]
    unscored = [(r, r["variants"]["unscored padding"]) for r in results if "unscored padding" in r["variants"]]
    if paired:
        lines.append(
            "- **ORPO/CPO: stock's padding is computed too.** The shared layout scores every column stock scores, "
            f"each row's padding included (shared padding {span(paired, 'shared_padding')}), so the ideal is "
            f"{span(paired, 'ideal')} where computing each prompt once would give {span(paired, 'sharing_ideal')} "
            "without stock's padding. A shared row (the prompt, then both rows' completions and their padding) is "
            "longer than stock's rows, so a dense mask computes more attention scores than stock "
            f"(stock / shared {span(paired, 'dense_attention_ratio')}); FlexAttention on CUDA skips the masked blocks."
        )
    if unscored:
        lines.append(
            "- **ORPO/CPO with `prefix_sharing_score_padding=False`:** the padding is not computed (shared padding "
            f"{span(unscored, 'shared_padding')}), so the ideal rises to {span(unscored, 'ideal')} and the step to "
            f"{span(unscored, 'speedup')}; only the `logits/chosen|rejected` metrics change (they then average the "
            "columns that predict a real token), the loss checked equal to stock's before timing."
        )
    slower = [(r, v) for r, v in paired + unscored if v["speedup"] < 1]
    slower += [(r, v) for r in results if r["trainer"] == "kto" for v in r["variants"].values() if v["speedup"] < 1]
    if slower:
        listed = ", ".join(f"{TITLES[r['trainer']]} {r['profile']} {v['speedup']:.2f}x" for r, v in slower)
        lines.append(
            f"- **Below 1:** {listed}. There the dense attention of the longer shared rows costs more than the "
            "positions save; building the layout and its mask for every batch adds to it."
        )
    kto = [(r, r["variants"][name]) for r in results if r["trainer"] == "kto" for name in ("apart", "merged")]
    if kto:
        apart = [(r, v) for r, v in kto if v is r["variants"]["apart"]]
        merged = [(r, v) for r, v in kto if v is r["variants"]["merged"]]
        lines.append(
            "- **KTO.** Different prompts share nothing within the main rows or within the KL rows, so apart the "
            "policy's two passes run stock's rows unchanged (the same positions, and stock's activation memory: "
            f"{span(apart, 'activation_ratio')}); the gain is the reference pass, main and KL rows as one trie "
            f"(reference sharing ideal {span(apart, 'reference_sharing_ideal')}). Merged, the KL rows are saved for "
            f"backward too: {span(merged, 'activation_ratio')} of stock's activation memory."
        )
    return lines


def write(results, args, data):
    if args.vocab < 10_000:
        vocabulary_note = (
            f"this vocabulary is small, {args.vocab} tokens; with a real one, tens of thousands, the logits dominate "
            "stock's memory"
        )
    else:
        vocabulary_note = f"a real vocabulary, {args.vocab} tokens: the logits dominate stock's memory"
    lines = [
        "# KTO, ORPO and CPO-SimPO: stock TRL vs prefix sharing (CPU)",
        "",
        f"Made by `{data['command']}` ({data['device']}; torch {data['torch']}, transformers {data['transformers']}, "
        f"trl {data['trl']}; {data['model']}; median prompt/completion tokens of each profile x {args.length_scale}, "
        f"lognormal quantiles around them; {args.batches} batches of {BATCH_SIZE} examples per step; gradient "
        f"checkpointing {'on' if args.gradient_checkpointing else 'off'}; {args.repeats} interleaved rounds, "
        f"time ratios the median of the rounds' ratios; {data['elapsed_s'] / 60:.1f} minutes).",
        "",
        "Training step = the trainer's `compute_loss` + backward on each batch, the same collated batches for stock "
        "TRL and prefix sharing (KTO: in the dataset's order, as TRL's sequential sampler draws them). Before timing, "
        "each batch's loss with prefix sharing is checked against stock's (atol 1e-4). ORPO: default `beta`; "
        'CPO-SimPO: `loss_type="simpo"`, `cpo_alpha=0.5`; KTO: `loss_type="kto"` with a reference model (the '
        "policy's weights with small noise, so that the log-prob differences, the `kl` term and the loss check are "
        "not trivial), the policy's KL rows merged into its gradient pass (`prefix_sharing_merge_kl=True`) or in a "
        "separate pass without gradients (`False`).",
        "",
        "*Prompt*, *completion*: mean tokens per example, counted with the model's tokenizer (BOS and EOS aside; "
        "the synthetic words are each one token of it), *p/c* their "
        "ratio. Positions: rows x width of every backbone call of a step (policy and reference), counted by a forward "
        "pre-hook. Since a pass with gradients also runs backward, the ratios weight it 3 and a pass without "
        "gradients 1 (plain positions per step are given too). *Padding* = stock positions / the real tokens of "
        "stock's rows: what removing stock's padding alone would save. *Sharing ideal* = stock tokens / shared "
        "tokens (each example's prompt once): ORPO/CPO `(2P + Cc + Cr) / (P + Cc + Cr)` per pair; KTO's reference "
        "pass `(2P + C + C') / (P + C + C')` (main and KL rows), in the *reference* column. *Shared padding* = shared "
        "positions / shared tokens: ORPO/CPO lay out and score each row's padding as stock does (its `logits/*` "
        "metrics average over it), plus the shared rows' own padding. *Ideal* = stock positions / shared positions "
        "= padding x sharing ideal / shared padding; *share of ideal* = step speedup / ideal. *Dense attention* = "
        "stock / shared attention scores (rows x width² per layer and head, weighted the same way; SDPA with a mask "
        "on CPU computes them all): lower than the ideal where the shared rows are longer than stock's.",
        "",
        "Activation memory: bytes autograd saves for backward, the largest batch of a step, shared / stock. ORPO and "
        "CPO: stock materialises the `[2B, L, vocab]` logits (and their log-softmax) and saves them for backward, "
        "while the shared path scores the columns with TRL's fused log-prob head and never does, so their memory "
        f"column mixes the positions saved and the logits avoided ({vocabulary_note}). KTO: stock uses the fused "
        "head too, so its column is the positions alone.",
        "",
    ]
    header = (
        "trainer|profile|prompt|completion|p/c|padding|sharing ideal|shared padding|ideal|dense attention|step speedup"
        "|share of ideal|positions per step (stock / shared)|backbone calls (stock / shared)"
        "|activation memory, shared / stock"
    ).split("|")
    rows = []
    for r in results:
        for variant, v in r["variants"].items():
            name = TITLES[r["trainer"]] + (f" ({variant} KL)" if r["trainer"] == "kto" else "")
            if variant == "unscored padding":
                name += " (`prefix_sharing_score_padding=False`, the default)"
            elif r["trainer"] in ("orpo", "cpo"):
                name += " (`prefix_sharing_score_padding=True`)"
            sharing, positions, calls = f"{v['sharing_ideal']:.2f}x", v["positions_per_step"], v["calls_per_step"]
            if r["trainer"] == "kto":
                sharing += f" (reference {v['reference_sharing_ideal']:.2f}x)"
            rows.append(
                [name, r["profile"], f"{r['prompt_tokens']:.0f}", f"{r['completion_tokens']:.0f}"]
                + [f"{r['p_over_c']:.2f}", f"{v['padding']:.2f}x", sharing, f"{v['shared_padding']:.2f}x"]
                + [f"{v[key]:.2f}x" for key in ("ideal", "dense_attention_ratio", "speedup")]
                + [f"{v['share_of_ideal']:.2f}", f"{positions['stock']} / {positions['shared']}"]
                + [f"{calls['stock']} / {calls['shared']}", f"{v['activation_ratio']:.2f}"]
            )
    lines += [*markdown_table(header, rows), "", *notes(results)]
    kto = [r for r in results if r["trainer"] == "kto"]
    if kto:
        lines += [
            "",
            "## KTO: merging the policy's KL rows",
            "",
            "Merged: the policy's gradient pass also computes the KL rows after the same prompts (one pass over "
            "`P + C + C'` tokens, the KL completions going through backward too); apart: the main rows with "
            "gradients and the KL rows in a pass without (`P + C` and `P + C'`). Counting a backward as two "
            "forwards, merging saves a forward over the prompts and costs a backward over the KL completions, so it "
            "pays when `P > 2C'`: the auto rule (`prefix_sharing_merge_kl=None`) merges a batch when its prompt "
            "tokens exceed twice its KL completion tokens. *Batch p/c* = each batch's prompt tokens / KL completion "
            "tokens, as the rule reads them; *merged vs apart* = step time apart / merged (above 1: merging pays); "
            "its *ideal* = weighted positions apart / merged.",
            "",
        ]
        header = "profile|batch p/c|auto rule merges|speedup merged|speedup apart|merged vs apart|ideal"
        rows = [
            [r["profile"], " / ".join(f"{x:.2f}" for x in r["batch_prompt_over_kl_completion"])]
            + [f"{r['auto_merges']} of {len(r['batch_prompt_over_kl_completion'])} batches"]
            + [f"{r['variants'][v]['speedup']:.2f}x" for v in ("merged", "apart")]
            + [f"{r['merged_over_apart']:.2f}x", f"{r['merged_over_apart_ideal']:.2f}x"]
            + [f"{r['merged_over_apart_activation']:.2f}"]
            for r in kto
        ]
        lines += markdown_table([*header.split("|"), "activation memory, merged / apart"], rows)
        lines += ["", merge_verdict(kto)]
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
    args.mode = "cpu"  # for `build_model`
    command = command_line("paired")
    started = time.perf_counter()
    device, tokenizer = quiet_setup(False, args.model)
    args.vocabulary = single_token_words(tokenizer) if args.model != "tiny" else None
    import torch

    model = build_model("paired", tokenizer, args)
    ref_model = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in ref_model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    args.vocab = len(tokenizer)
    if args.model == "tiny":
        model_desc = (
            f"{args.family}, hidden {args.hidden_size}, {args.layers} layers, vocab {args.vocab}, "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, fp32, SDPA"
        )
    else:
        model_desc = f"{describe_smollm2(model)}, fp32, SDPA"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.trainers.split(","):
            for profile in args.profiles.split(","):
                result = run(kind, profile, model, ref_model, tokenizer, args, tmp)
                results.append(result)
                for variant, v in result["variants"].items():
                    print(
                        f"{kind} {profile} {variant}: p/c {result['p_over_c']:.2f}, ideal {v['ideal']:.2f}x, step "
                        f"{v['speedup']:.2f}x ({v['share_of_ideal']:.2f} of ideal), activations "
                        f"x{v['activation_ratio']:.2f} [{time.perf_counter() - started:.0f} s]",
                        flush=True,
                    )
    settings = {"length_scale": args.length_scale, "batch_size": BATCH_SIZE, "batches_per_step": args.batches}
    settings.update(repeats=args.repeats, gradient_checkpointing=args.gradient_checkpointing)
    settings["elapsed_s"] = round(time.perf_counter() - started, 1)
    write(
        results,
        args,
        {"command": command, "device": device, "model": model_desc, **versions(), **settings, "results": results},
    )


if __name__ == "__main__":
    main()
