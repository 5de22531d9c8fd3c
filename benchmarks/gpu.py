"""The benchmark part of the CUDA check (`python scripts/gpu_check.py --part bench-small|bench-large|bench`): stock TRL
vs prefix sharing vs packing at real sizes, on `benchmarks.dpo`'s trainers and `benchmarks.online`'s GRPO step.

For each model, kind (DPO, reward) and profile (the paper's six datasets: synthetic pairs with their median prompt and
completion lengths, lognormal spread), the variants (stock TRL with SDPA and padding, as users run it; prefix sharing
with `"auto"`, which takes the varlen kernel in bf16; packing; both; sharing with FlexAttention; and sharing with
SDPA's dense mask, unless `--skip-sdpa`) train one after another from the same weights in bf16 with TRL's default
gradient checkpointing: one warm-up epoch (compilation; activation memory), then `repeats` timed epochs, throughput
from the median epoch, then one profiled epoch (unless `--skip-profile`: the GPU's busy time per step and the top
operators). GRPO: TRL-shaped generation batches through TRL's `compute_loss` and backward, stock vs sharing, median of
interleaved repeats. Before the small model's trainers, the attention microbenchmark times one attention layer of its
shape (forward and backward) on each profile's DPO batch: stock's padded rows through transformers' SDPA, and the
shared rows through each kernel. Writes `gpu.json` (`benchmarks.results`' schema, `results` per model), `gpu.md` and
`gpu_speedup.svg`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import statistics
import tempfile
import time
from types import SimpleNamespace

from .data import PROFILES
from .measure import interleave, train_one_epoch
from .results import markdown_table, write_result


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


class Deadline:
    def __init__(self, seconds):
        self.limited = bool(seconds)
        self.end = time.monotonic() + (seconds or 0)

    def left(self) -> float:
        return self.end - time.monotonic() if self.limited else float("inf")


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
            import traceback

            self.data["errors"].append({"unit": label, "error": f"{type(error).__name__}: {error}"[:2000]})
            log(f"bench: {label} failed:\n{traceback.format_exc()[-4000:]}")
            return None
        finally:
            self.longest = max(self.longest, time.monotonic() - start)
            gc.collect()
            if self.cuda:
                import torch

                torch.cuda.empty_cache()
                log(
                    f"bench: {label} took {time.monotonic() - start:.0f} s; GPU memory allocated "
                    f"{torch.cuda.memory_allocated() / 2**30:.2f} GB"
                )


class HostClock:
    """While `on`: the host time of the attention inputs (each backend's `inputs`: the mask, or the varlen kernel's
    segments, wherever the trainers build them) with their GPU time (CUDA events), and of the layouts the session
    builds in a training step (GRPO's groups; the collator's are timed by `CountingCollator`)."""

    def __init__(self, cuda):
        self.cuda, self.on = cuda, False
        self.reset()

    def reset(self):
        self.seconds, self.calls, self.events = {"layout": 0.0, "mask": 0.0}, {"layout": 0, "mask": 0}, []

    @contextlib.contextmanager
    def running(self):
        """On within the block, from zero."""
        self.reset()
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    def mask_gpu_s(self) -> float | None:
        if not self.cuda or not self.events:
            return None
        import torch

        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events) / 1000

    def wrap(self, function, kind):
        import torch

        def timed(*args, **kwargs):
            if not self.on:
                return function(*args, **kwargs)
            events = None
            if self.cuda and kind == "mask":
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[kind] += time.perf_counter() - start
            self.calls[kind] += 1
            if events is not None:
                events[1].record()
                self.events.append(events)
            return result

        return timed

    @contextlib.contextmanager
    def patched(self):
        """Wrap every attention backend's `inputs` and the session's `build_layout` (`found`: what was wrapped)."""
        # the package imports its trainers lazily: load them, so that every module that holds these names has them
        import trl_prefix_sharing.session as session_module
        from trl_prefix_sharing import DPOTrainer, GRPOTrainer, OnlineDPOTrainer, RewardTrainer  # noqa: F401
        from trl_prefix_sharing.attention import BACKENDS

        saved = [(session_module, "build_layout", session_module.build_layout)]
        session_module.build_layout = self.wrap(session_module.build_layout, "layout")
        for cls in {type(backend) for backend in BACKENDS.values()}:  # each concrete class: `super().inputs` once
            saved.append((cls, "inputs", cls.__dict__.get("inputs")))
            cls.inputs = self.wrap(cls.inputs, "mask")
        self.found = {"AttentionBackend.inputs", "session.build_layout"}
        try:
            yield self
        finally:
            for owner, attribute, function in reversed(saved):
                if function is None:  # an inherited method: the class had none of its own
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, function)


def compiled_variants() -> dict[str, int]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention import flex_attention as flex_module

    return {
        name: len(_debug_get_cache_entry_list(getattr(flex_module, name)))
        for name in ("create_block_mask", "flex_attention")
    }


@contextlib.contextmanager
def compile_monitor():
    """Counts torch's eager-FlexAttention warnings and dynamo's recompile-limit warnings within the block."""
    import logging
    import warnings

    from torch.nn.attention import flex_attention as flex_module

    seen = {"eager_flex_warnings": 0, "recompile_limit_warnings": 0}

    class Handler(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            seen["recompile_limit_warnings"] += "recompile_limit" in message or "cache_size_limit" in message

    handler = Handler(level=logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    getattr(flex_module, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield seen
        finally:
            seen["eager_flex_warnings"] = sum("without torch.compile()" in str(w.message) for w in caught)
            logging.getLogger("torch._dynamo").removeHandler(handler)


def model_config(name, tokenizer, dry_run):
    from trl_prefix_sharing.testing import make_config

    spec = dict((DRY_MODELS if dry_run else MODELS)[name])
    family, vocab = spec.pop("family"), spec.pop("vocab_size", None) or len(tokenizer)
    return make_config(family, vocab, **spec, **({} if dry_run else {"tie_word_embeddings": True})), family


def build_model(name, kind, tokenizer, dry_run, device):
    """Model `name` (a causal LM, or for `kind == "reward"` a one-label classifier), seeded, built on `device`: (the
    model, its description)."""
    import torch
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
    import torch

    from .dpo import make_trainer

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
    mask_gpu, masks = clock.mask_gpu_s(), clock.calls["mask"]
    sharing = getattr(trainer, "sharing_session", None)  # stock TRL's trainer has none
    result = {
        "pairs_per_s": n / median,
        "epoch_times_s": [round(t, 4) for t in times],
        "positions_per_pair": positions / n,
        "tokens_per_pair": tokens / n,
        "pairs_per_step": n / steps,
        "activation_mb": trainer.meter.peak / 2**20,
        "peak_memory_gb": max(peaks) / 2**30 if cuda else None,
        "peak_memory_above_start_gb": trainer.peak_memory / 2**30 if cuda else None,
        "packing_efficiency": trainer.efficiency,
        "step_ms": 1000 * median / steps,
        "layout_host_ms_per_step": 1000 * collate_s / max(collations, 1),
        "mask_host_ms_per_step": 1000 * clock.seconds["mask"] / timed_steps if masks else None,
        "mask_gpu_ms_per_step": 1000 * mask_gpu / timed_steps if mask_gpu is not None else None,
        "masks_per_step": masks / timed_steps,
        "warmup_s": round(warmup_s, 2),
        "attn_implementation": sharing.backend.name if sharing else "sdpa",
        # `"auto"`: what it measured at start-up and chose (`trl_prefix_sharing.tuning`), None for a fixed kernel
        "auto_measured": sharing.tuning.summary if sharing else None,
        # and what its timed training steps measured, once its close candidates took their turns (else None)
        "auto_training_steps": sharing.tuning.refined if sharing else None,
        "kernels_run": kernels,  # micro-batches per kernel that ran them (stock: none laid out)
        "compiled_variants": compiled_variants(),
        "profile": profile,
        **monitor,
    }
    del trainer, counter
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def profile_epoch(trainer, cuda, steps, top=8) -> dict:
    """One more epoch under torch's profiler: where a step's time goes. `gpu_busy_ms_per_step` is the kernels' time
    (their sum; overlapping streams count twice); a step much longer than that waits on the host (launches, compiled
    functions' guards, Python). The top operators by their own GPU and CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        train_one_epoch(trainer, cuda)
    wall = time.perf_counter() - start
    events = profiler.key_averages()

    def device_us(event):
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0

    def ranked(key):
        chosen = sorted(events, key=key, reverse=True)[:top]
        return [[event.key[:80], round(key(event) / 1000 / steps, 3)] for event in chosen if key(event) > 0]

    attention = [e for e in events if re.search(r"scaled_dot_product|flash|flex_attention|varlen", e.key)]
    return {
        "wall_ms_per_step": round(1000 * wall / steps, 2),
        "gpu_busy_ms_per_step": round(sum(device_us(e) for e in events) / 1000 / steps, 2) if cuda else None,
        # which attention operators ran (SDPA's cuDNN, efficient or flash kernel; FlexAttention; varlen)
        "attention_ops_ms_per_step": {e.key[:80]: round(device_us(e) / 1000 / steps, 3) for e in attention},
        "cpu_ops_ms_per_step": round(sum(e.self_cpu_time_total for e in events) / 1000 / steps, 2),
        "top_gpu_ops_ms_per_step": ranked(device_us) if cuda else [],
        "top_cpu_ops_ms_per_step": ranked(lambda e: e.self_cpu_time_total),
    }


def kernel_variants(cuda: bool, skip_sdpa: bool) -> list[str]:
    """The sharing variants with a fixed kernel, beside `"sharing"` (`"auto"`: varlen in bf16 on CUDA):
    FlexAttention on CUDA (the varlen reference in a dry run, FlexAttention having no backward on the CPU), and SDPA's
    dense mask unless `skip_sdpa`."""
    return ["sharing-flex" if cuda else "sharing-varlen"] + ([] if skip_sdpa else ["sharing-sdpa"])


def bench_attention(name, profile, tokenizer, settings, dry_run, repeats=20) -> dict:
    """One attention layer of model `name`'s shape, forward and backward, on one DPO micro-batch of `profile`
    (`settings.batch_size` pairs, TRL's collator): stock's padded rows through transformers' SDPA with their causal
    and padding mask, and the shared rows of each kernel through it (varlen: one unpadded row of segments over
    gathered paths; FlexAttention: rows rounded to 128, compiled; SDPA: the dense mask). Per call: GPU ms (CUDA
    events) and host ms (the time to issue the forward and backward), medians over `repeats` after a warm-up."""
    import torch
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from trl_prefix_sharing.attention import BACKENDS
    from trl_prefix_sharing.collator import PrefixSharingCollator
    from trl_prefix_sharing.varlen import varlen_attention_forward

    from .data import synthetic_dataset

    cuda = not dry_run
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    config, _ = model_config(name, tokenizer, dry_run)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    dataset = synthetic_dataset(profile, settings.batch_size, settings.length_scale, seed=0)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    examples = [{f"{key}_ids": ids(r[key]) for key in ("prompt", "chosen", "rejected")} for r in dataset]
    base = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.layer_idx = True, heads // kv_heads, 0
    scale = head_dim**-0.5

    def timed(call, rows, width):
        generator = torch.Generator(device=device).manual_seed(0)
        shapes = ((rows, heads, width, head_dim), (rows, kv_heads, width, head_dim), (rows, kv_heads, width, head_dim))
        leaves = [torch.randn(*shape, device=device, dtype=dtype, generator=generator) for shape in shapes]
        leaves = [leaf.requires_grad_() for leaf in leaves]
        grad = torch.randn(rows, width, heads, head_dim, device=device, dtype=dtype, generator=generator)
        gpu, host = [], []
        for repeat in range(repeats + 3):  # 3 warm-up calls (compilation)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
            if events:
                events[0].record()
            start = time.perf_counter()
            out, _ = call(*leaves)
            out.backward(grad)
            issued = time.perf_counter() - start
            if events:
                events[1].record()
                torch.cuda.synchronize()
            if repeat >= 3:
                host.append(1000 * issued)
                gpu.append(events[0].elapsed_time(events[1]) if events else None)
        median_gpu = statistics.median(gpu) if cuda else None
        return {"rows": rows, "width": width, "gpu_ms": median_gpu, "host_ms": statistics.median(host)}

    mask = base(examples)["attention_mask"].bool().to(device)
    rows, width = mask.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    stock_mask = causal[None, None] & mask[:, None, None, :]
    calls = {
        "stock": timed(lambda q, k, v: sdpa_attention_forward(module, q, k, v, stock_mask, scaling=scale), rows, width)
    }
    functions = {"varlen": varlen_attention_forward, "flex_attention": flex_attention_forward}
    for kernel in ATTENTION_KERNELS:
        if kernel == "flex_attention" and not cuda:
            continue
        backend = BACKENDS[kernel]
        collator = PrefixSharingCollator(base, tokenizer.pad_token_id, rows=backend.rows(None), join="prompts")
        layout = collator(examples)["prefix_sharing"].to(device)
        inputs = backend.inputs(layout, config).model_kwargs()
        function = functions.get(kernel, sdpa_attention_forward)
        calls[kernel] = timed(
            lambda q, k, v, f=function, i=inputs: f(module, q, k, v, scaling=scale, **i), *layout.input_ids.shape
        )
    return {"pairs": len(examples), "head_dim": head_dim, "heads": [heads, kv_heads], "calls": calls}


def bench_grpo(profile, model, tokenizer, settings, clock, tmp, g=8) -> dict:
    """Stock vs sharing on one TRL-shaped GRPO generation batch (`benchmarks.online`'s pieces): a warm-up step each,
    then `repeats` interleaved timed steps; host time of the group layout and the mask, peak memory."""
    import torch

    from . import online

    cuda = settings.mode == "gpu"
    args = SimpleNamespace(mode=settings.mode, trainer="grpo", beta=0.0, gradient_checkpointing=True)
    args.num_generations, args.rows = g, 2 * g  # 2 prompts x G per micro-batch, 2 micro-batches
    scale = settings.length_scale
    batch = online.generation_batch(profile, 4, g, scale, tokenizer, seed=0, device="cuda" if cuda else "cpu")
    batches = online.micro_batches(batch, args.rows)
    trainers = {variant: online.make_trainer(variant, model, tokenizer, args, tmp) for variant in online.VARIANTS}
    for trainer in trainers.values():  # TRL's default, switched on as `train()` would (this step does not run it)
        if hasattr(trainer.model, "activation_checkpointing_enable"):
            trainer.model.activation_checkpointing_enable()
        else:
            trainer.model.gradient_checkpointing_enable()
    peaks, host = {}, {variant: [] for variant in trainers}

    def timed_step(variant):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with clock.running():
            seconds = online.training_step(trainers[variant], batches, cuda, args)[0]
        if cuda:
            peaks[variant] = max(peaks.get(variant, 0), torch.cuda.max_memory_allocated() / 2**30)
        host[variant].append((clock.seconds["layout"], clock.seconds["mask"], clock.mask_gpu_s()))
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
    session, sharing_host = trainers["sharing"].sharing_session, host["sharing"]
    mask_gpu = [h[2] for h in sharing_host]
    result.update(
        peak_memory_gb=peaks or None,
        layout_host_ms_per_step=1000 * statistics.median(h[0] for h in sharing_host),
        mask_host_ms_per_step=1000 * statistics.median(h[1] for h in sharing_host),
        mask_gpu_ms_per_step=1000 * statistics.median(mask_gpu) if mask_gpu[0] is not None else None,
        attn_implementation=session.backend.name,
        auto_measured=session.tuning.summary,
        auto_training_steps=session.tuning.refined,
        compiled_variants=compiled_variants(),
        **monitor,
    )
    trainers.clear()
    del session
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def run_bench_part(args, env, command, deadline, models) -> dict:
    """The benchmark of `models` (names of `MODELS`), per `args` (`scripts/gpu_check.py`'s options), unit by unit
    within `deadline`; `gpu.json`, `gpu.md` and `gpu_speedup.svg` written to `args.out` after each unit."""
    import torch

    from .data import synthetic_dataset
    from .dpo import VARIANTS
    from .models import quiet_setup

    cuda = not args.dry_run
    variants = VARIANTS + kernel_variants(cuda, args.skip_sdpa)
    _, tokenizer = quiet_setup(cuda)
    if args.dry_run:  # the tiny models' times are noise: "auto" takes its preferred kernel, the files' shape fixed
        from trl_prefix_sharing.testing import PreferredKernelTimer
        from trl_prefix_sharing.tuning import set_timer

        set_timer(PreferredKernelTimer(runs=True))  # each timed call still runs
    if cuda:  # many trainers in one process share the compiled FlexAttention; a user's run has one trainer
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, limit, max(getattr(config, limit), 64))
    profiles = (args.profiles or (DRY_PROFILES if args.dry_run else ",".join(PROFILES))).split(",")
    kinds = args.kinds.split(",")
    unknown = set(profiles) - set(PROFILES) | set(kinds) - {"dpo", "reward", "grpo"}
    if unknown:
        raise SystemExit(f"Unknown profiles or kinds: {sorted(unknown)}")
    data = {"command": command, "device": env["device"], "model": None}
    data.update({key: env[key] for key in ("torch", "cuda", "triton", "transformers", "trl")})
    data.update({key: {} for key in ("models", "settings", "results", "summary", "grpo", "attention")})
    data.update(not_run=[], errors=[], environment=env, parts=[args.part])
    clock, budget = HostClock(cuda), Budget(deadline, data, cuda)
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")

    def preference_profile(name, kind, model, profile, settings):
        dataset = synthetic_dataset(profile, settings.pairs, settings.length_scale, seed=0)
        by_variant = {}
        for variant in variants:
            r = by_variant[variant] = bench_variant(kind, variant, model, tokenizer, dataset, settings, clock, tmp)
            log(
                f"bench {name} {kind} {profile} {variant}: {r['pairs_per_s']:.2f} pairs/s, step {r['step_ms']:.1f} "
                f"ms, layout {r['layout_host_ms_per_step']:.2f} ms, mask {_fmt(r['mask_host_ms_per_step'], '.2f')} "
                f"ms, peak {_fmt(r['peak_memory_gb'], '.2f')} GB, compiled {r['compiled_variants']}, eager flex "
                f"{r['eager_flex_warnings']}, warm-up {r['warmup_s']} s"
            )
        data["results"].setdefault(name, {}).setdefault(kind, {})[profile] = by_variant
        write_bench(data, args.out)  # after every profile: a run cut short keeps what it measured

    def attention_profile(name, profile, settings):
        result = bench_attention(name, profile, tokenizer, settings, args.dry_run)
        data["attention"].setdefault(name, {})[profile] = result
        log(f"bench {name} attention {profile}: " + json.dumps(result["calls"]))
        write_bench(data, args.out)

    def grpo_profile(name, kind, model, profile, settings):
        result = bench_grpo(profile, model, tokenizer, settings, clock, tmp)
        data["grpo"].setdefault(name, {})[profile] = result
        log(
            f"bench {name} grpo {profile}: step {result['speedup']:.2f}x (ideal {result['ideal']:.2f}x), layout "
            f"{result['layout_host_ms_per_step']:.2f} ms, mask {result['mask_host_ms_per_step']:.2f} ms per step, "
            f"compiled {result['compiled_variants']}, eager flex {result['eager_flex_warnings']}"
        )
        write_bench(data, args.out)

    with tempfile.TemporaryDirectory() as tmp, clock.patched():
        data["timed_functions"] = sorted(clock.found)
        for name in models:
            sizes = {**SIZES[name], "batch_size": 8, "length_scale": 1.0, **(DRY_SIZES if args.dry_run else {})}
            given = {"pairs": args.pairs, "repeats": args.repeats, "batch_size": args.batch_size}
            sizes.update({key: value for key, value in given.items() if value})
            data["settings"][name] = {**sizes, "dtype": dtype, "gradient_checkpointing": True}
            mode = "gpu" if cuda else "cpu"
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
    from .dpo import PAPER

    summary = {}
    for name, kinds in data["results"].items():
        for kind, profiles in kinds.items():
            for profile, v in profiles.items():
                stock, paper = v["stock"], PAPER[profile]
                speed = {variant: r["pairs_per_s"] / stock["pairs_per_s"] for variant, r in v.items()}
                p, c = PROFILES[profile]
                memory = {variant: r["peak_memory_gb"] for variant, r in v.items()}
                sharing = [x for x in v if x == "sharing" or x.startswith("sharing-")]
                fastest = max(sharing, key=lambda x: v[x]["pairs_per_s"]) if sharing else None
                summary.setdefault(name, {}).setdefault(kind, {})[profile] = {
                    "p_over_c": p / c,
                    "ideal": stock["tokens_per_pair"] / v["sharing"]["tokens_per_pair"],
                    "speedup": speed,
                    "paper": list(paper),
                    "target_met": speed["sharing"] >= paper[0] and speed["sharing+packing"] >= paper[1],
                    "fastest_sharing_kernel": v[fastest].get("attn_implementation") if fastest else None,
                    "memory_below_stock": None
                    if memory["stock"] is None
                    else all(memory[variant] < memory["stock"] for variant in ("sharing", "sharing+packing")),
                }
    return summary


def write_bench(data, out):
    """`gpu.json`, `gpu.md` and `gpu_speedup.svg` in `out`, with the summary and the models' description."""
    data["summary"] = summarise(data)
    data["model"] = "; ".join(f"{n}: {d}" for n, d in data["models"].items()) if data["models"] else None
    write_result(out, "gpu", data, render_md(data), echo=False)
    with open(f"{out}/gpu_speedup.svg", "w") as f:
        f.write(render_svg(data))


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def render_md(data) -> list[str]:
    """`gpu.md`'s lines: the settings, a table per model and kind, the attention microbenchmark, GRPO, where the step
    goes, and what was not run."""
    from .dpo import VARIANTS

    versions = ", ".join(f"{k} {data.get(k)}" for k in ("torch", "cuda", "triton", "transformers", "trl"))
    dry = " (DRY RUN: tiny models on CPU, nothing measured)" if data["environment"].get("dry_run") else ""
    lines = [
        f"# GPU benchmark: stock TRL vs prefix sharing vs packing{dry}",
        "",
        f"Device: {data['device']}; {versions}.",
        "",
        "Made by: " + "; ".join(f"`{c}`" for c in data.get("commands", [data["command"]])),
        "",
    ]
    for name, description in data["models"].items():
        s = data["settings"][name]
        lines.append(
            f"- **{name}**: {description}; {s['pairs']} pairs per profile, {s['batch_size']} pairs per step, "
            f"lengths = paper medians x {s['length_scale']}, {s['dtype']}, gradient checkpointing on, "
            f"{s['repeats']} timed epochs after a warm-up epoch (median)."
        )
    lines += [
        "",
        "Stock = TRL's own trainer with SDPA and padded rows, as users run it. Speedup = pairs/s over "
        "stock's. Ideal = stock tokens / shared tokens on this data. Paper = the speedups of Wang & Hegde over "
        "their FlexAttention baseline (sharing / sharing + packing), the targets. Peak memory = "
        "`torch.cuda.max_memory_allocated` over the timed epochs (weights, optimizer state, activations). "
        "Step = GPU step time (median epoch / steps); layout = host time of the data collator per step; "
        "mask = host and GPU time of building the attention inputs per step (the mask, or the varlen kernel's "
        'segments). Sharing = `"auto"`, with the kernel it took; the other kernels\' sharing variants beside it.',
        "",
        "![speedups](gpu_speedup.svg)",
        "",
    ]
    header = (
        "profile|p/c|ideal|sharing (kernel)|other kernels|packing|sharing+packing|paper|target|peak memory GB (stock "
        "/ sharing / packing / both)|below stock|step ms (stock / sharing / packing / both)|layout host ms per step "
        "(same)|mask host / GPU ms per step (sharing; both)|compiled variants (mask, flex)|eager flex"
    ).split("|")
    for name, kinds in data["results"].items():
        for kind, profiles in kinds.items():
            rows = []
            for profile, v in profiles.items():
                s = data["summary"][name][kind][profile]
                sp, below, compiled = s["speedup"], s["memory_below_stock"], v["sharing+packing"]["compiled_variants"]

                def each(key, spec, v=v):
                    return " / ".join(_fmt(v[x][key], spec) for x in VARIANTS)

                masks = "; ".join(
                    f"{_fmt(v[x]['mask_host_ms_per_step'], '.2f')} / {_fmt(v[x]['mask_gpu_ms_per_step'], '.2f')}"
                    for x in ("sharing", "sharing+packing")
                )
                others = "; ".join(f"{x.split('-', 1)[1]} {sp[x]:.2f}x" for x in v if x.startswith("sharing-"))
                rows.append(
                    [profile, f"{s['p_over_c']:.2f}", f"{s['ideal']:.2f}x"]
                    + [f"{sp['sharing']:.2f}x ({v['sharing'].get('attn_implementation')})", others or "-"]
                    + [f"{sp['packing']:.2f}x", f"{sp['sharing+packing']:.2f}x"]
                    + [f"{s['paper'][0]:.2f}x / {s['paper'][1]:.2f}x", "met" if s["target_met"] else "**missed**"]
                    + [each("peak_memory_gb", ".2f"), "-" if below is None else ("yes" if below else "**no**")]
                    + [each("step_ms", ".1f"), each("layout_host_ms_per_step", ".2f"), masks]
                    + [f"{compiled['create_block_mask']}, {compiled['flex_attention']}"]
                    + [str(sum(v[x]["eager_flex_warnings"] for x in v))]
                )
            lines += [f"## {name}: {kind.upper()}", "", *markdown_table(header, rows), ""]
    lines += render_attention_md(data)
    header = (
        "profile|prompt|completion|padding|sharing ideal|ideal|step speedup|step s (stock / sharing)|peak memory GB "
        "(stock / sharing)|activation memory, sharing / stock|layout / mask host ms, mask GPU ms per step"
    ).split("|")
    for name, profiles in data["grpo"].items():
        rows = []
        for profile, r in profiles.items():
            peak = r["peak_memory_gb"] or {}
            rows.append(
                [profile, f"{r['prompt_tokens']:.0f}", f"{r['completion_tokens']:.0f}"]
                + [f"{r[key]:.2f}x" for key in ("padding", "sharing_ideal", "ideal", "speedup")]
                + [f"{r['step_s']['stock']:.3f} / {r['step_s']['sharing']:.3f}"]
                + [f"{_fmt(peak.get('stock'), '.2f')} / {_fmt(peak.get('sharing'), '.2f')}"]
                + [
                    f"{r['activation_ratio']:.2f}",
                    f"{r['layout_host_ms_per_step']:.2f} / "
                    f"{r['mask_host_ms_per_step']:.2f}, {_fmt(r['mask_gpu_ms_per_step'], '.2f')}",
                ]
            )
        title = f"## {name}: GRPO (G = 8, 2 prompts x G per micro-batch, 2 micro-batches per step)"
        lines += [title, "", *markdown_table(header, rows), ""]
    lines += render_step_md(data)
    if data.get("not_run"):
        lines += ["Not run (time limit): " + ", ".join(data["not_run"]) + ".", ""]
    return lines


def render_step_md(data) -> list[str]:
    """Where a step goes, per profile and variant without packing: the step time beside the GPU's busy time (a
    profiled epoch), and the attention operators it ran (which of SDPA's kernels: cuDNN, efficient, flash)."""
    lines = []
    for name, kinds in data["results"].items():
        rows = []
        for kind, profiles in kinds.items():
            for profile, v in profiles.items():
                speed = data["summary"][name][kind][profile]["speedup"]
                for x in (x for x in v if x == "stock" or x.startswith("sharing") and "packing" not in x):
                    prof = v[x].get("profile")
                    if prof:
                        ops = ", ".join(op.removeprefix("aten::") for op in prof.get("attention_ops_ms_per_step", {}))
                        busy = f"{v[x]['step_ms']:.1f} / {_fmt(prof['gpu_busy_ms_per_step'], '.1f')}"
                        rows.append(
                            [kind, profile, x, v[x].get("attn_implementation"), f"{speed[x]:.2f}x", busy, ops or "-"]
                        )
        if rows:
            lines += [
                f"## {name}: where the step goes",
                "",
                "Step = wall time per step (timed epochs); GPU busy = the kernels' time per step in one more, "
                "profiled epoch (`gpu.json` lists the top operators). A step much longer than its GPU time waits on "
                "the host. Attention operators: those of the profiled epoch (SDPA names its kernel: cuDNN, "
                "efficient or flash).",
                "",
                *markdown_table(
                    ["kind", "profile", "variant", "kernel", "speedup", "step / GPU busy ms", "attention operators"],
                    rows,
                ),
                "",
            ]
    return lines


def render_attention_md(data) -> list[str]:
    """The attention microbenchmark: per model and profile, one layer's forward and backward per kernel."""
    lines = []
    for name, profiles in data.get("attention", {}).items():
        rows = [
            [
                profile,
                kernel,
                f"{call['rows']} x {call['width']}",
                _fmt(call["gpu_ms"], ".3f"),
                f"{call['host_ms']:.3f}",
            ]
            for profile, result in profiles.items()
            for kernel, call in result["calls"].items()
        ]
        lines += [
            f"## {name}: one attention layer per kernel",
            "",
            "One DPO micro-batch per profile through one attention layer of the model's shape, forward and backward: "
            "stock's padded rows (SDPA, causal and padding mask) and the shared rows of each kernel. GPU ms = CUDA "
            "events around the call; host ms = the time to issue it (medians).",
            "",
            *markdown_table(["profile", "kernel", "rows x width", "GPU ms per call", "host ms per call"], rows),
            "",
        ]
    return lines


def render_svg(data) -> str:
    """Grouped bars: speedup over stock per profile (sharing, packing, both), the paper's two targets as ticks; one
    panel per model and kind. Plain SVG, no plotting library needed."""
    from .dpo import VARIANTS

    colours = {"sharing": "#1f77b4", "packing": "#2ca02c", "sharing+packing": "#d62728"}
    panels = [(name, kind, profiles) for name, kinds in data["results"].items() for kind, profiles in kinds.items()]
    width, panel_h, top = 760, 230, 40
    height = top + max(len(panels), 1) * panel_h + 20
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="18" font-size="13">Speedup over stock TRL (pairs/s), {data["device"]}</text>',
    ]
    for i, variant in enumerate(VARIANTS[1:]):
        out.append(
            f'<rect x="{420 + i * 110}" y="8" width="10" height="10" fill="{colours[variant]}"/>'
            f'<text x="{434 + i * 110}" y="17">{variant}</text>'
        )
    out.append('<text x="420" y="32">ticks: paper (sharing, +packing)</text>')
    for index, (name, kind, profiles) in enumerate(panels):
        y0 = top + index * panel_h
        plot_top, plot_bottom, left = y0 + 20, y0 + panel_h - 40, 50
        summary = data["summary"][name][kind]
        high = max(
            [2.0] + [max(s["speedup"].values()) for s in summary.values()] + [s["paper"][0] for s in summary.values()]
        )

        def y(value, plot_top=plot_top, plot_bottom=plot_bottom, high=high):
            return plot_bottom - (plot_bottom - plot_top) * min(value, high) / high

        out.append(f'<text x="{left}" y="{y0 + 12}" font-size="12">{name}: {kind.upper()}</text>')
        for tick in range(0, int(high) + 1):
            out.append(
                f'<line x1="{left}" x2="{width - 10}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>'
                f'<text x="{left - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick}x</text>'
            )
        out.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(1):.1f}" y2="{y(1):.1f}" stroke="#888"/>')
        group = (width - 10 - left) / max(len(profiles), 1)
        for j, profile in enumerate(profiles):
            x0 = left + j * group + group * 0.15
            bar = group * 0.7 / 3
            s = summary[profile]
            for k, variant in enumerate(VARIANTS[1:]):
                value = s["speedup"][variant]
                out.append(
                    f'<rect x="{x0 + k * bar:.1f}" y="{y(value):.1f}" width="{bar * 0.9:.1f}" '
                    f'height="{max(plot_bottom - y(value), 0):.1f}" fill="{colours[variant]}">'
                    f"<title>{profile} {variant}: {value:.2f}x</title></rect>"
                )
            for target, k in ((s["paper"][0], 0), (s["paper"][1], 2)):
                out.append(
                    f'<line x1="{x0 + k * bar - 2:.1f}" x2="{x0 + (k + 1) * bar:.1f}" y1="{y(target):.1f}" '
                    f'y2="{y(target):.1f}" stroke="black" stroke-width="2"/>'
                )
            out.append(
                f'<text x="{x0 + group * 0.35:.1f}" y="{plot_bottom + 14}" text-anchor="middle">{profile}'
                f'</text><text x="{x0 + group * 0.35:.1f}" y="{plot_bottom + 27}" text-anchor="middle" '
                f'fill="#555">p/c {s["p_over_c"]:.2f}</text>'
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"
