"""The benchmark part of the CUDA check (`python scripts/gpu_check.py --part bench-small|bench-large|bench`): stock TRL
vs prefix sharing vs packing at real sizes, on `benchmarks.dpo`'s trainers and `benchmarks.online`'s GRPO step.

Per model, kind (DPO, reward) and profile (the paper's six datasets: synthetic pairs of their median prompt and
completion lengths, lognormal spread), the variants (stock TRL with SDPA and padding, as users run it; sharing with
`"auto"`, the varlen kernel in bf16; packing; both; sharing with FlexAttention; sharing with SDPA's dense mask unless
`--skip-sdpa`) train one after another from the same weights in bf16 with TRL's default gradient checkpointing: a
warm-up epoch (compilation; activation memory), `repeats` timed epochs (throughput from the median), a profiled epoch
(unless `--skip-profile`). GRPO: TRL-shaped generation batches through TRL's `compute_loss` and backward, stock vs
sharing, median of interleaved repeats. First, one attention layer of the small model per kernel, on each profile's
DPO batch. Writes `gpu.json` (`benchmarks.results`' schema, `results` per model), `gpu.md` and `gpu_speedup.svg`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import operator
import re
import statistics
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch

from . import online
from .data import PROFILES, synthetic_dataset
from .dpo import PAPER, VARIANTS, make_trainer
from .measure import Deadline, free_memory, interleave, train_one_epoch  # noqa: F401 (Deadline: beside Budget)
from .models import quiet_setup
from .results import CELLS, document, markdown_table, write_result


#: the models of the benchmark, built from configs with random weights (no download): Qwen2.5-0.5B's and Llama 3.2
#: 3B's shapes, vocabularies and tied embeddings
SHAPE = ("family", "vocab_size", "hidden_size", "num_layers", "intermediate_size", "num_attention_heads")
SHAPE += ("num_key_value_heads", "max_position_embeddings")
MODELS = {
    "qwen2.5-0.5b": dict(zip(SHAPE, ("qwen2", 151936, 896, 24, 4864, 14, 2, 32768), strict=True)),
    "llama-3b": dict(zip(SHAPE, ("llama", 128256, 3072, 28, 8192, 24, 8, 131072), strict=True)),
}
#: the same families, tiny, for `--dry-run` (the tokenizer's own vocabulary)
DRY_MODELS = {name: dict(family=spec["family"], hidden_size=32, num_layers=2) for name, spec in MODELS.items()}
#: pairs per profile and timed epochs per variant: sized so that each bench part stays within its time budget
SIZES = {"qwen2.5-0.5b": {"pairs": 64, "repeats": 3}, "llama-3b": {"pairs": 32, "repeats": 2}}
DRY_SIZES = {"pairs": 8, "repeats": 1, "batch_size": 4, "length_scale": 0.03}
DRY_PROFILES = "HH-RLHF"  # one profile per model and kind in a dry run (each costs ~20 s on 2 CPU cores)
GRPO_MODEL = "qwen2.5-0.5b"
GRPO_PROFILES = ("math-reasoning", "qa")  # prompt/completion 0.33 and 4 (benchmarks/online.py)
#: the kernels the attention microbenchmark times on the shared rows (FlexAttention on CUDA only: no CPU backward)
ATTENTION_KERNELS = ("varlen", "flex_attention", "sdpa")
LOG = {"path": None, "start": time.monotonic()}


def log(*parts):
    """A progress line to stdout and to `LOG["path"]` (`<out>/gpu_check.log`)."""
    line = f"[gpu_check {time.monotonic() - LOG['start']:6.0f}s] " + " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG["path"]:
        with open(LOG["path"], "a") as f:
            f.write(line + "\n")


class Budget:
    """Starts a unit of work only if the deadline leaves 1.5x the longest unit so far (at least 30 s); records what
    it skipped and what failed (a failure is logged with its traceback and the run goes on)."""

    def __init__(self, deadline, data, cuda):
        self.deadline, self.data, self.cuda, self.longest = deadline, data, cuda, 0.0

    def run(self, label, function, *args):
        if self.deadline.left() < max(30.0, 1.5 * self.longest):
            self.data["not_run"].append(label)
            log("bench: no time left for", label)
            return None
        start = time.monotonic()
        try:
            return function(*args)
        except Exception as error:  # kept, reported, and the next unit runs
            self.data["errors"].append({"unit": label, "error": f"{type(error).__name__}: {error}"[:2000]})
            log(f"bench: {label} failed:\n{traceback.format_exc()[-4000:]}")
            return None
        finally:
            self.longest = max(self.longest, time.monotonic() - start)
            free_memory(self.cuda)
            if self.cuda:
                gb = torch.cuda.memory_allocated() / 2**30
                log(f"bench: {label} took {time.monotonic() - start:.0f} s; GPU memory allocated {gb:.2f} GB")


class HostClock:
    """`with clock.running():` the host time of the attention inputs (each backend's `inputs`: the mask, or the varlen
    kernel's segments, wherever the trainers build them) with their GPU time (CUDA events), and of the layouts the
    session builds in a training step (GRPO's groups; the collator's are timed by `CountingCollator`), from zero;
    after the block, `mask_gpu_s`: the GPU seconds of the masks (None without CUDA)."""

    FOUND = ["AttentionBackend.inputs", "session.build_layout"]  # what `running()` wraps

    def __init__(self, cuda):
        self.cuda = cuda

    @contextlib.contextmanager
    def running(self):
        from unittest import mock

        # the package imports its trainers lazily: load them, so that every module that holds these names has them
        import trl_prefix_sharing.session as session
        from trl_prefix_sharing import DPOTrainer, GRPOTrainer, OnlineDPOTrainer, RewardTrainer  # noqa: F401
        from trl_prefix_sharing.attention import BACKENDS

        self.seconds, self.calls, self.events = {"layout": 0.0, "mask": 0.0}, {"layout": 0, "mask": 0}, []
        with contextlib.ExitStack() as stack:  # undone in reverse order; an inherited method is deleted again
            stack.enter_context(mock.patch.object(session, "build_layout", self.wrap(session.build_layout, "layout")))
            for cls in {type(backend) for backend in BACKENDS.values()}:  # each concrete class: `super().inputs` once
                stack.enter_context(mock.patch.object(cls, "inputs", self.wrap(cls.inputs, "mask")))
            yield self
        if self.events:
            torch.cuda.synchronize()
        self.mask_gpu_s = sum(a.elapsed_time(b) for a, b in self.events) / 1000 if self.events else None

    def wrap(self, function, kind):
        def timed(*args, **kwargs):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda and kind == "mask" else []
            for event in events[:1]:
                event.record()
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[kind] += time.perf_counter() - start
            self.calls[kind] += 1
            for event in events[1:]:
                event.record()
                self.events.append(events)
            return result

        return timed


@contextlib.contextmanager
def compile_monitor():
    """A dict, filled when the block ends: torch's eager-FlexAttention warnings and dynamo's recompile-limit warnings
    within it, the compiled variants of `create_block_mask` and `flex_attention` (dynamo's cache entries, all told)."""
    import logging
    import warnings

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention import flex_attention as flex_module

    seen, limits, handler = {}, [], logging.Handler(logging.WARNING)
    handler.emit = lambda r: limits.append(bool(re.search("recompile_limit|cache_size_limit", r.getMessage())))
    logging.getLogger("torch._dynamo").addHandler(handler)
    getattr(flex_module, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield seen
        finally:
            logging.getLogger("torch._dynamo").removeHandler(handler)
            seen["eager_flex_warnings"] = sum("without torch.compile()" in str(w.message) for w in caught)
            seen["recompile_limit_warnings"] = sum(limits)
            names = ("create_block_mask", "flex_attention")
            seen["compiled_variants"] = {f: len(_debug_get_cache_entry_list(getattr(flex_module, f))) for f in names}


def model_config(name, tokenizer, dry_run):
    from trl_prefix_sharing.testing import make_config

    spec = dict((DRY_MODELS if dry_run else MODELS)[name])
    family, vocab = spec.pop("family"), spec.pop("vocab_size", None) or len(tokenizer)
    return make_config(family, vocab, **spec, **({} if dry_run else {"tie_word_embeddings": True})), family


def build_model(name, kind, tokenizer, dry_run, device):
    """Model `name` (a causal LM, or for `kind == "reward"` a one-label classifier), seeded, built on `device`: (the
    model, its description)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config, family = model_config(name, tokenizer, dry_run)
    if kind == "reward":
        config.num_labels = 1
    cls = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains (3B parameters on the CPU take a minute)
        model = cls.from_config(config, attn_implementation="sdpa", dtype=torch.float32 if dry_run else torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    size = f"{parameters / 1e6:.1f}M" if parameters >= 1e6 else f"{parameters:,}"
    return model, f"{family}, {size} parameters ({name}{' shape, tiny: dry run' if dry_run else ''})"


def bench_variant(kind, variant, model, tokenizer, dataset, settings, clock, tmp) -> dict:
    """One variant on one profile (`benchmarks.dpo`'s trainer): warm-up epoch (compilation, activation memory), then
    timed epochs (with the collator's and the attention inputs' host times), then the profiled epoch."""
    cuda = settings.mode == "gpu"
    trainer = make_trainer(kind, variant, model, tokenizer, dataset, settings, tmp)
    counter, peaks = trainer.counter, []
    with compile_monitor() as monitor:
        start = time.perf_counter()
        train_one_epoch(trainer, cuda)  # warm-up: compiles; the activation meter runs here only
        warmup_s = time.perf_counter() - start
        del trainer.compute_loss  # the meter's wrapper (its saved-tensor hooks would slow the timed epochs)
        positions, tokens, steps = counter.positions, counter.tokens, counter.batches
        counter.seconds, counter.kernels, trainer.peak_memory = 0.0, {}, 0
        with clock.running():
            for _ in range(settings.repeats):
                train_one_epoch(trainer, cuda)
                peaks.append(torch.cuda.max_memory_allocated() if cuda else None)
        collations, collate_s, kernels = counter.batches - steps, counter.seconds, dict(counter.kernels)
        profile = profile_epoch(trainer, cuda, steps) if settings.profile else None
    times = trainer.timer.epochs[1 : 1 + settings.repeats]
    n, timed_steps, median = len(trainer.train_dataset), steps * settings.repeats, sorted(times)[len(times) // 2]
    mask_gpu, masks = clock.mask_gpu_s, clock.calls["mask"]
    sharing = getattr(trainer, "sharing_session", None)  # stock TRL's trainer has none
    result = {
        "pairs_per_s": n / median, "epoch_times_s": [round(t, 4) for t in times], "positions_per_pair": positions / n,
        "tokens_per_pair": tokens / n, "pairs_per_step": n / steps, "activation_mb": trainer.meter.peak / 2**20,
        "peak_memory_gb": max(peaks) / 2**30 if cuda else None,
        "peak_memory_above_start_gb": trainer.peak_memory / 2**30 if cuda else None,
        "packing_efficiency": trainer.efficiency, "step_ms": 1000 * median / steps,
        "layout_host_ms_per_step": 1000 * collate_s / max(collations, 1),
        "mask_host_ms_per_step": 1000 * clock.seconds["mask"] / timed_steps if masks else None,
        "mask_gpu_ms_per_step": 1000 * mask_gpu / timed_steps if mask_gpu is not None else None,
        "masks_per_step": masks / timed_steps, "warmup_s": round(warmup_s, 2),
        "attn_implementation": sharing.backend.name if sharing else "sdpa",
        # `"auto"`: what it measured at start-up and chose (`trl_prefix_sharing.tuning`), and what its timed training
        # steps measured, once its close candidates took their turns; None for a fixed kernel
        "auto_measured": sharing.tuning.summary if sharing else None,
        "auto_training_steps": sharing.tuning.refined if sharing else None,
        "kernels_run": kernels,  # micro-batches per kernel that ran them (stock: none laid out)
        "profile": profile, **monitor,
    }  # fmt: skip
    del trainer, counter
    free_memory(cuda)
    return result


def profile_epoch(trainer, cuda, steps, top=8) -> dict:
    """One more epoch under torch's profiler: where a step's time goes. `gpu_busy_ms_per_step` is the kernels' time
    (their sum; overlapping streams count twice); a step much longer than that waits on the host (launches, compiled
    functions' guards, Python). The top operators by their own GPU and CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as profiler:
        train_one_epoch(trainer, cuda)
    wall, events = time.perf_counter() - start, profiler.key_averages()

    device_us, cpu_us = operator.attrgetter("self_device_time_total"), operator.attrgetter("self_cpu_time_total")

    def ranked(key):
        chosen = sorted(events, key=key, reverse=True)[:top]
        return [[event.key[:80], round(key(event) / 1000 / steps, 3)] for event in chosen if key(event) > 0]

    attention = [e for e in events if re.search(r"scaled_dot_product|flash|flex_attention|varlen", e.key)]
    return {
        "wall_ms_per_step": round(1000 * wall / steps, 2),
        "gpu_busy_ms_per_step": round(sum(device_us(e) for e in events) / 1000 / steps, 2) if cuda else None,
        # which attention operators ran (SDPA's cuDNN, efficient or flash kernel; FlexAttention; varlen)
        "attention_ops_ms_per_step": {e.key[:80]: round(device_us(e) / 1000 / steps, 3) for e in attention},
        "cpu_ops_ms_per_step": round(sum(cpu_us(e) for e in events) / 1000 / steps, 2),
        "top_gpu_ops_ms_per_step": ranked(device_us) if cuda else [], "top_cpu_ops_ms_per_step": ranked(cpu_us),
    }  # fmt: skip


def bench_attention(name, profile, tokenizer, settings, repeats=20) -> dict:
    """One attention layer of model `name`'s shape, forward and backward, on one DPO micro-batch of `profile`
    (`settings.batch_size` pairs, TRL's collator): stock's padded rows through transformers' SDPA with their causal
    and padding mask, and the shared rows of each kernel through it (varlen: one unpadded row of segments over
    gathered paths; FlexAttention: rows rounded to 128, compiled; SDPA: the dense mask). Per call: GPU ms (CUDA
    events) and host ms (the time to issue the forward and backward), medians over `repeats` after 3 warm-up calls."""
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from trl_prefix_sharing.attention import BACKENDS
    from trl_prefix_sharing.collator import PrefixSharingCollator
    from trl_prefix_sharing.varlen import varlen_attention_forward

    cuda, config = settings.mode == "gpu", model_config(name, tokenizer, dry_run=settings.mode != "gpu")[0]
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    dataset = synthetic_dataset(profile, settings.batch_size, settings.length_scale, seed=0)
    keys = ("prompt", "chosen", "rejected")
    examples = [{f"{k}_ids": tokenizer(r[k], add_special_tokens=False)["input_ids"] for k in keys} for r in dataset]
    base = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.layer_idx = True, heads // kv_heads, 0

    def timed(forward, rows, width, **kwargs):  # `forward(module, q, k, v, ...)`: transformers' attention signature
        generator, on = torch.Generator(device=device).manual_seed(0), {"device": device, "dtype": dtype}
        shapes = [(rows, h, width, head_dim) for h in (heads, kv_heads, kv_heads)] + [(rows, width, heads, head_dim)]
        *leaves, grad = [torch.randn(*shape, **on, generator=generator) for shape in shapes]
        leaves, gpu, host = [leaf.requires_grad_() for leaf in leaves], [], []
        for _ in range(repeats + 3):  # the first 3: warm-up (compilation)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
            for event in events[:1]:
                event.record()
            start = time.perf_counter()
            forward(module, *leaves, scaling=head_dim**-0.5, **kwargs)[0].backward(grad)
            host.append(1000 * (time.perf_counter() - start))
            for event in events[1:]:
                event.record()
                torch.cuda.synchronize()
                gpu.append(events[0].elapsed_time(event))
        median_gpu = statistics.median(gpu[3:]) if cuda else None
        return {"rows": rows, "width": width, "gpu_ms": median_gpu, "host_ms": statistics.median(host[3:])}

    mask = base(examples)["attention_mask"].bool().to(device)
    rows, width = mask.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    calls = {"stock": timed(sdpa_attention_forward, rows, width, attention_mask=causal & mask[:, None, None])}
    functions = {"varlen": varlen_attention_forward, "flex_attention": flex_attention_forward}
    for kernel in (kernel for kernel in ATTENTION_KERNELS if cuda or kernel != "flex_attention"):
        backend = BACKENDS[kernel]
        collator = PrefixSharingCollator(base, tokenizer.pad_token_id, rows=backend.rows(None), join="prompts")
        layout = collator(examples)["prefix_sharing"].to(device)
        inputs = backend.inputs(layout, config).model_kwargs()
        calls[kernel] = timed(functions.get(kernel, sdpa_attention_forward), *layout.input_ids.shape, **inputs)
    return {"pairs": len(examples), "head_dim": head_dim, "heads": [heads, kv_heads], "calls": calls}


def bench_grpo(profile, model, tokenizer, settings, clock, tmp, g=8) -> dict:
    """Stock vs sharing on one TRL-shaped GRPO generation batch (`benchmarks.online`'s pieces): a warm-up step each,
    then `repeats` interleaved timed steps; host time of the group layout and the mask, peak memory."""
    cuda, scale = settings.mode == "gpu", settings.length_scale
    args = SimpleNamespace(mode=settings.mode, trainer="grpo", beta=0.0, gradient_checkpointing=True)
    args.num_generations, args.rows = g, 2 * g  # 2 prompts x G per micro-batch, 2 micro-batches
    batch = online.generation_batch(profile, 4, g, scale, tokenizer, seed=0, device="cuda" if cuda else "cpu")
    batches = online.micro_batches(batch, args.rows)
    trainers = {variant: online.make_trainer(variant, model, tokenizer, args, tmp) for variant in online.VARIANTS}
    for policy in (trainer.model for trainer in trainers.values()):  # TRL's default, switched on as `train()` would
        (getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable)()
    peaks, host = {}, {variant: [] for variant in trainers}

    def timed_step(variant):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with clock.running():
            seconds = online.training_step(trainers[variant], batches, cuda, args)[0]
        if cuda:
            peaks[variant] = max(peaks.get(variant, 0), torch.cuda.max_memory_allocated() / 2**30)
        host[variant].append((clock.seconds["layout"], clock.seconds["mask"], clock.mask_gpu_s))
        return seconds

    with compile_monitor() as monitor:
        for trainer in trainers.values():  # warm-up: compiles; `"auto"` measures its kernels in the first step
            online.training_step(trainer, batches, cuda, args)
        activations = {v: online.training_step(t, batches, cuda, args)[1] for v, t in trainers.items()}
        times = interleave(timed_step, list(trainers), settings.repeats)
    counts = online.positions(batches, trainers["sharing"])  # stock's padding apart from what sharing saves
    p_median, c_median = online.PROFILES[profile]
    result = {"profile": profile, "G": g, "prompt_median": p_median * scale, "completion_median": c_median * scale}
    result.update(online.compare(batch, counts, times, activations))
    # the ideal: positions the two padded forwards run, stock's padding and what sharing saves together
    result["ideal"], result["share_of_ideal"] = result.pop("total_ideal"), result.pop("share_of_total_ideal")
    session, (layout_s, mask_s, mask_gpu) = trainers["sharing"].sharing_session, zip(*host["sharing"], strict=True)
    result.update(peak_memory_gb=peaks or None, layout_host_ms_per_step=1000 * statistics.median(layout_s))
    result["mask_host_ms_per_step"] = 1000 * statistics.median(mask_s)
    result["mask_gpu_ms_per_step"] = 1000 * statistics.median(mask_gpu) if mask_gpu[0] is not None else None
    result.update(attn_implementation=session.backend.name, auto_measured=session.tuning.summary)
    result.update(auto_training_steps=session.tuning.refined, **monitor)
    return result  # its trainers freed with this frame (`Budget` collects after each unit)


def run_bench_part(args, env, command, deadline, models) -> dict:
    """The benchmark of `models` (names of `MODELS`), per `args` (`scripts/gpu_check.py`'s options), unit by unit
    within `deadline`; `gpu.json`, `gpu.md` and `gpu_speedup.svg` written to `args.out` after each unit."""
    cuda = not args.dry_run
    # beside `"sharing"` (`"auto"`: varlen in bf16 on CUDA), the sharing variants with a fixed kernel: FlexAttention on
    # CUDA (the varlen reference in a dry run, FlexAttention having no backward on the CPU), SDPA's dense mask
    variants = VARIANTS + ["sharing-flex" if cuda else "sharing-varlen"] + ([] if args.skip_sdpa else ["sharing-sdpa"])
    _, tokenizer = quiet_setup(cuda)
    if args.dry_run:  # the tiny models' times are noise: "auto" takes its preferred kernel, the files' shape fixed
        from trl_prefix_sharing.testing import PreferredKernelTimer
        from trl_prefix_sharing.tuning import set_timer

        set_timer(PreferredKernelTimer(runs=True))  # each timed call still runs
    if cuda:  # many trainers in one process share the compiled FlexAttention; a user's run has one trainer
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    profiles = (args.profiles or (DRY_PROFILES if args.dry_run else ",".join(PROFILES))).split(",")
    kinds = args.kinds.split(",")
    if unknown := set(profiles) - set(PROFILES) | set(kinds) - {"dpo", "reward", "grpo"}:
        raise SystemExit(f"Unknown profiles or kinds: {sorted(unknown)}")
    data = {"command": command, "device": env["device"], "model": None}
    data.update({key: env[key] for key in ("torch", "cuda", "triton", "transformers", "trl")})
    data.update({key: {} for key in ("models", "settings", "results", "summary", "grpo", "attention")})
    data.update(not_run=[], errors=[], environment=env, parts=[args.part], timed_functions=HostClock.FOUND)
    clock, budget = HostClock(cuda), Budget(deadline, data, cuda)
    device, dtype, mode = ("cuda", "bfloat16", "gpu") if cuda else ("cpu", "float32", "cpu")

    def preference_profile(name, kind, model, profile, settings):
        dataset = synthetic_dataset(profile, settings.pairs, settings.length_scale, seed=0)
        by_variant = {}
        for variant in variants:
            r = by_variant[variant] = bench_variant(kind, variant, model, tokenizer, dataset, settings, clock, tmp)
            log(f"bench {name} {kind} {profile} {variant}:", CELLS.format(PROGRESS["variant"], **r))
        data["results"].setdefault(name, {}).setdefault(kind, {})[profile] = by_variant
        write_bench(data, args.out)  # after every unit: a run cut short keeps what it measured

    def attention_profile(name, profile, settings):
        r = data["attention"].setdefault(name, {})[profile] = bench_attention(name, profile, tokenizer, settings)
        log(f"bench {name} attention {profile}:", json.dumps(r["calls"]))
        write_bench(data, args.out)

    def grpo_profile(name, kind, model, profile, settings):
        r = data["grpo"].setdefault(name, {})[profile] = bench_grpo(profile, model, tokenizer, settings, clock, tmp)
        log(f"bench {name} grpo {profile}:", CELLS.format(PROGRESS["grpo"], **r))
        write_bench(data, args.out)

    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            given = {"pairs": args.pairs, "repeats": args.repeats, "batch_size": args.batch_size}
            sizes = {**SIZES[name], "batch_size": 8, "length_scale": 1.0, **(DRY_SIZES if args.dry_run else {})}
            sizes.update((key, value) for key, value in given.items() if value)
            data["settings"][name] = {**sizes, "dtype": dtype, "gradient_checkpointing": True}
            settings = SimpleNamespace(mode=mode, gradient_checkpointing=True, profile=not args.skip_profile, **sizes)
            if name == GRPO_MODEL:  # the attention microbenchmark first: seconds per profile
                for profile in profiles:
                    budget.run(f"{name} attention {profile}", attention_profile, name, profile, settings)
            for kind in sorted(kinds, key=lambda kind: kind != "grpo"):  # GRPO first: short, and worth more
                if kind == "grpo" and name != GRPO_MODEL:
                    continue
                model, data["models"][name] = build_model(name, kind, tokenizer, args.dry_run, device)
                unit = grpo_profile if kind == "grpo" else preference_profile
                for profile in GRPO_PROFILES if kind == "grpo" else profiles:
                    budget.run(f"{name} {kind} {profile}", unit, name, kind, model, profile, settings)
                del model
                gc.collect()
    write_bench(data, args.out)
    return data


def summarise(data) -> dict:
    """Per model, kind and profile: the ideal, each variant's speedup over stock, the paper's speedups over its
    FlexAttention baseline (sharing, with packing: the targets), the kernel of the fastest sharing variant without
    packing (`"sharing"` runs what `"auto"` took), and whether peak memory is below stock's."""
    summary = {}
    for name, kinds in data["results"].items():
        for kind, profiles in kinds.items():
            for profile, v in profiles.items():
                stock, paper, (p, c) = v["stock"], PAPER[profile], PROFILES[profile]
                speed = {variant: r["pairs_per_s"] / stock["pairs_per_s"] for variant, r in v.items()}
                gb = {variant: r["peak_memory_gb"] for variant, r in v.items()}  # peak memory
                fastest = max((x for x in v if x.partition("-")[0] == "sharing"), key=lambda x: speed[x], default=None)
                below = None if gb["stock"] is None else max(gb["sharing"], gb["sharing+packing"]) < gb["stock"]
                summary.setdefault(name, {}).setdefault(kind, {})[profile] = {
                    "p_over_c": p / c, "ideal": stock["tokens_per_pair"] / v["sharing"]["tokens_per_pair"],
                    "speedup": speed, "paper": list(paper),
                    "target_met": speed["sharing"] >= paper[0] and speed["sharing+packing"] >= paper[1],
                    "fastest_sharing_kernel": v[fastest].get("attn_implementation") if fastest else None,
                    "memory_below_stock": below,
                }  # fmt: skip
    return summary


def write_bench(data, out):
    """`gpu.json`, `gpu.md` and `gpu_speedup.svg` in `out`, with the summary and the models' description."""
    data["summary"] = summarise(data)
    data["model"] = "; ".join(f"{n}: {d}" for n, d in data["models"].items()) if data["models"] else None
    write_result(out, "gpu", data, render_md(data), echo=False)
    with open(f"{out}/gpu_speedup.svg", "w") as f:
        f.write(render_svg(data))


#: the progress line of a variant and of a GRPO profile (`CELLS` templates over its result)
PROGRESS = {
    "variant": "{pairs_per_s:.2f} pairs/s, step {step_ms:.1f} ms, layout {layout_host_ms_per_step:.2f} ms, mask "
    "{mask_host_ms_per_step:.2f} ms, peak {peak_memory_gb:.2f} GB, compiled {compiled_variants}, eager flex "
    "{eager_flex_warnings}, warm-up {warmup_s} s",
    "grpo": "step {speedup:.2f}x (ideal {ideal:.2f}x), layout {layout_host_ms_per_step:.2f} ms, mask "
    "{mask_host_ms_per_step:.2f} ms per step, compiled {compiled_variants}, eager flex {eager_flex_warnings}",
}
LEGEND = (
    "Stock = TRL's own trainer with SDPA and padded rows, as users run it. Speedup = pairs/s over stock's. Ideal = "
    "stock tokens / shared tokens on this data. Paper = the speedups of Wang & Hegde over their FlexAttention baseline"
    " (sharing / sharing + packing), the targets. Peak memory = `torch.cuda.max_memory_allocated` over the timed "
    "epochs (weights, optimizer state, activations). Step = GPU step time (median epoch / steps); layout = host time "
    "of the data collator per step; mask = host and GPU time of building the attention inputs per step (the mask, or "
    "the varlen kernel's segments). Sharing = `\"auto\"`, with the kernel it took; the other kernels' sharing variants"
    " beside it."
)
#: `gpu.md`'s tables: the title after the model's name, the header's cells, the template of a row's cells (`|` between
#: cells, `CELLS` fills them from the row's fields), the note under the title if any
TABLES = {
    "preference": (
        "{kind}",
        "profile|p/c|ideal|sharing (kernel)|other kernels|packing|sharing+packing|paper|target|peak memory GB (stock "
        "/ sharing / packing / both)|below stock|step ms (stock / sharing / packing / both)|layout host ms per step "
        "(same)|mask host / GPU ms per step (sharing; both)|compiled variants (mask, flex)|eager flex",
        "{profile}|{s[p_over_c]:.2f}|{s[ideal]:.2f}x|{sp[sharing]:.2f}x ({v[sharing][attn_implementation]})|{others}"
        "|{sp[packing]:.2f}x|{sp[sharing+packing]:.2f}x|{s[paper][0]:.2f}x / {s[paper][1]:.2f}x|{target}|"
        "{peak_memory_gb}|{below}|{step_ms}|{layout_host_ms_per_step}|{v[sharing][mask_host_ms_per_step]:.2f} / "
        "{v[sharing][mask_gpu_ms_per_step]:.2f}; {v[sharing+packing][mask_host_ms_per_step]:.2f} / "
        "{v[sharing+packing][mask_gpu_ms_per_step]:.2f}|{v[sharing+packing][compiled_variants][create_block_mask]}, "
        "{v[sharing+packing][compiled_variants][flex_attention]}|{eager}",
    ),
    "attention": (
        "one attention layer per kernel",
        "profile|kernel|rows x width|GPU ms per call|host ms per call",
        "{profile}|{kernel}|{rows} x {width}|{gpu_ms:.3f}|{host_ms:.3f}",
        "One DPO micro-batch per profile through one attention layer of the model's shape, forward and backward: "
        "stock's padded rows (SDPA, causal and padding mask) and the shared rows of each kernel. GPU ms = CUDA events "
        "around the call; host ms = the time to issue it (medians).",
    ),
    "grpo": (
        "GRPO (G = 8, 2 prompts x G per micro-batch, 2 micro-batches per step)",
        "profile|prompt|completion|padding|sharing ideal|ideal|step speedup|step s (stock / sharing)|peak memory GB "
        "(stock / sharing)|activation memory, sharing / stock|layout / mask host ms, mask GPU ms per step",
        "{profile}|{prompt_tokens:.0f}|{completion_tokens:.0f}|{padding:.2f}x|{sharing_ideal:.2f}x|{ideal:.2f}x|"
        "{speedup:.2f}x|{step_s[stock]:.3f} / {step_s[sharing]:.3f}|{peak[stock]:.2f} / {peak[sharing]:.2f}|"
        "{activation_ratio:.2f}|{layout_host_ms_per_step:.2f} / {mask_host_ms_per_step:.2f}, "
        "{mask_gpu_ms_per_step:.2f}",
    ),
    "step": (
        "where the step goes",
        "kind|profile|variant|kernel|speedup|step / GPU busy ms|attention operators",
        "{kind}|{profile}|{variant}|{r[attn_implementation]}|{speedup:.2f}x|{r[step_ms]:.1f} / "
        "{r[profile][gpu_busy_ms_per_step]:.1f}|{ops}",
        "Step = wall time per step (timed epochs); GPU busy = the kernels' time per step in one more, profiled epoch "
        "(`gpu.json` lists the top operators). A step much longer than its GPU time waits on the host. Attention "
        "operators: those of the profiled epoch (SDPA names its kernel: cuDNN, efficient or flash).",
    ),
}


def render_md(data) -> list[str]:
    """`gpu.md`'s lines: the settings, a table per model and kind, the attention microbenchmark, GRPO, where the step
    goes (the variants without packing that had a profiled epoch), and what was not run."""

    def section(name, table, items, kind=None):  # the title, the note, the table; nothing without rows
        title, header, template, *note = TABLES[table]
        rows = [[CELLS.format(cell, **item) for cell in template.split("|")] for item in items]
        return [f"## {name}: {title.format(kind=kind)}", *note, markdown_table(header, rows)] if rows else []

    def preference(profile, v, s):  # a DPO or reward row's fields: one profile's results `v` and summary `s`
        row, below = {"profile": profile, "v": v, "s": s, "sp": s["speedup"]}, s["memory_below_stock"]
        for key, spec in (("peak_memory_gb", ".2f"), ("step_ms", ".1f"), ("layout_host_ms_per_step", ".2f")):
            row[key] = " / ".join(CELLS.format_field(v[x][key], spec) for x in VARIANTS)  # stock's first
        others = (f"{x.removeprefix('sharing-')} {s['speedup'][x]:.2f}x" for x in v if x.startswith("sharing-"))
        row["others"], row["eager"] = "; ".join(others) or "-", sum(r["eager_flex_warnings"] for r in v.values())
        row["below"] = "-" if below is None else ("yes" if below else "**no**")
        return row | {"target": "met" if s["target_met"] else "**missed**"}

    versions = ", ".join(f"{k} {data.get(k)}" for k in ("torch", "cuda", "triton", "transformers", "trl"))
    dry = " (DRY RUN: tiny models on CPU, nothing measured)" if data["environment"].get("dry_run") else ""
    settings = [
        f"- **{name}**: {description}; {s['pairs']} pairs per profile, {s['batch_size']} pairs per step, lengths = "
        f"paper medians x {s['length_scale']}, {s['dtype']}, gradient checkpointing on, {s['repeats']} timed epochs "
        "after a warm-up epoch (median)."
        for name, description in data["models"].items()
        for s in [data["settings"][name]]
    ]
    commands = "; ".join(f"`{c}`" for c in data.get("commands", [data["command"]]))
    out = [f"# GPU benchmark: stock TRL vs prefix sharing vs packing{dry}", f"Device: {data['device']}; {versions}."]
    out += [f"Made by: {commands}", settings, LEGEND, "![speedups](gpu_speedup.svg)"]
    for name, kinds in data["results"].items():
        for kind, profiles in kinds.items():
            items = [preference(p, v, data["summary"][name][kind][p]) for p, v in profiles.items()]
            out += section(name, "preference", items, kind.upper())
    for name, profiles in data.get("attention", {}).items():
        items = [dict(c, profile=p, kernel=k) for p, result in profiles.items() for k, c in result["calls"].items()]
        out += section(name, "attention", items)
    for name, profiles in data["grpo"].items():
        peaks = {p: r["peak_memory_gb"] or dict.fromkeys(online.VARIANTS) for p, r in profiles.items()}  # CPU: none
        out += section(name, "grpo", [{**r, "profile": p, "peak": peaks[p]} for p, r in profiles.items()])
    for name, kinds in data["results"].items():
        items = [
            {"kind": kind, "profile": p, "variant": x, "r": r, "speedup": data["summary"][name][kind][p]["speedup"][x]}
            for kind, profiles in kinds.items()
            for p, v in profiles.items()
            for x, r in v.items()
            if (x == "stock" or x.startswith("sharing") and "packing" not in x) and r.get("profile")
        ]
        for item in items:  # the attention operators of the profiled epoch
            ops = item["r"]["profile"].get("attention_ops_ms_per_step", {})
            item["ops"] = ", ".join(op.removeprefix("aten::") for op in ops) or "-"
        out += section(name, "step", items)
    if data.get("not_run"):
        out.append("Not run (time limit): " + ", ".join(data["not_run"]) + ".")
    return document(*out) + [""]


def _svg(tag, text=None, **attributes) -> str:
    """An SVG element: its attributes in order (`_` in a name written `-`, a float to one decimal), `text` inside."""
    pairs = ((k.replace("_", "-"), format(v, ".1f") if isinstance(v, float) else v) for k, v in attributes.items())
    written = "".join(f' {k}="{v}"' for k, v in pairs)
    return f"<{tag}{written}/>" if text is None else f"<{tag}{written}>{text}</{tag}>"


def render_svg(data) -> str:
    """Grouped bars: speedup over stock per profile (sharing, packing, both), the paper's two targets as ticks; one
    panel per model and kind (230 px high, its plot from 20 to 190 px), 760 px wide. Plain SVG, no plotting library."""
    colours = {"sharing": "#1f77b4", "packing": "#2ca02c", "sharing+packing": "#d62728"}
    panels = [(name, kind, profiles) for name, kinds in data["results"].items() for kind, profiles in kinds.items()]
    height = 40 + max(len(panels), 1) * 230 + 20
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{height}" font-family="sans-serif" '
    out = [svg + 'font-size="11">', _svg("rect", width=760, height=height, fill="white")]
    out.append(_svg("text", f"Speedup over stock TRL (pairs/s), {data['device']}", x=10, y=18, font_size=13))
    for i, x in enumerate(VARIANTS[1:]):
        out.append(
            _svg("rect", x=420 + i * 110, y=8, width=10, height=10, fill=colours[x])
            + _svg("text", x, x=434 + i * 110, y=17)
        )
    out.append(_svg("text", "ticks: paper (sharing, +packing)", x=420, y=32))
    for index, (name, kind, profiles) in enumerate(panels):
        y0, summary = 40 + index * 230, data["summary"][name][kind]
        high = max([2.0] + [max([*s["speedup"].values(), s["paper"][0]]) for s in summary.values()])

        def y(value, bottom=y0 + 190, high=high):
            return bottom - 170 * min(value, high) / high

        out.append(_svg("text", f"{name}: {kind.upper()}", x=50, y=y0 + 12, font_size=12))
        for tick in range(0, int(high) + 1):
            out.append(
                _svg("line", x1=50, x2=750, y1=y(tick), y2=y(tick), stroke="#ddd")
                + _svg("text", f"{tick}x", x=42, y=y(tick) + 4, text_anchor="end")
            )
        out.append(_svg("line", x1=50, x2=750, y1=y(1), y2=y(1), stroke="#888"))
        group = 700 / max(len(profiles), 1)
        for j, profile in enumerate(profiles):
            x0, bar, s = 50 + j * group + group * 0.15, group * 0.7 / 3, summary[profile]
            for k, x in enumerate(VARIANTS[1:]):
                top, title = y(s["speedup"][x]), f"<title>{profile} {x}: {s['speedup'][x]:.2f}x</title>"
                box = {"x": x0 + k * bar, "y": top, "width": bar * 0.9, "height": max(y0 + 190 - top, 0.0)}
                out.append(_svg("rect", title, **box, fill=colours[x]))
            for target, k in ((s["paper"][0], 0), (s["paper"][1], 2)):
                ends = {"x1": x0 + k * bar - 2, "x2": x0 + (k + 1) * bar, "y1": y(target), "y2": y(target)}
                out.append(_svg("line", **ends, stroke="black", stroke_width=2))
            middle = x0 + group * 0.35
            out.append(
                _svg("text", profile, x=middle, y=y0 + 204, text_anchor="middle")
                + _svg("text", f"p/c {s['p_over_c']:.2f}", x=middle, y=y0 + 217, text_anchor="middle", fill="#555")
            )
    return "\n".join([*out, "</svg>"]) + "\n"
