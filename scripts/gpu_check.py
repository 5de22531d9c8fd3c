"""The CUDA check in one command per part: the CUDA tests, compile counts, long-row peak memory, and the benchmark
against stock TRL. Each part writes its files to `--out`.

    python scripts/gpu_check.py --part tests --jobs 3 --out results/tests  # tests/test_cuda.py, 3 processes
    python scripts/gpu_check.py --part bench-small --out results/small   # 0.5B model: DPO, reward, GRPO
    python scripts/gpu_check.py --part bench-large --out results/large   # 3B model: DPO, reward
    python scripts/gpu_check.py --merge results/tests results/small results/large --out docs/benchmarks

`--part all` runs the three in one process (no time limit of its own); `--jobs N` runs tests/test_cuda.py in N
processes side by side on the one GPU (each takes every N-th test, the measured ones first); `--tests-k` runs part of
tests/test_cuda.py (merge the parts); `--dry-run` runs the same code on CPU with tiny models and lengths
(tests/test_gpu_check.py does, so that a typo or an import error shows before a GPU is used; there `"auto"` runs each
timed call but takes the kernel it prefers, as in the test suite, since the tiny models' times are noise). Each single
part stops starting new work after `--deadline-s` (540 s by default) and writes what it measured, with the rest listed
as not run.

Files in `--out`:
- `gpu_tests.json`: device, versions, pytest's counts over tests/test_cuda.py, the compiled variants of
  `create_block_mask` and `flex_attention` over its 39-step compile schedule ("recompiles"), recompilations logged by
  `TORCH_LOGS=recompiles` per function, the long-row peak memory, and the failures' messages;
- `cuda_tests.log`: pytest's output (`-v -s`, with the recompilation reasons);
- `gpu.json`: the schema of `cpu.json` (`command`, `device`, `model`, `results`) plus the versions, with `results`
  per model: kind -> profile -> variant; each variant also has its step time, the host time of the layout (collation)
  and of the attention inputs (mask or segments) per step, their GPU time, peak memory, compiled variants, the kernel
  it ran and the SDPA kernels its profiled epoch ran; `grpo`: GRPO per profile; `attention`: the attention-only
  microbenchmark per profile (GPU and host ms per call of one layer's forward and backward, per kernel);
- `gpu.md` and `gpu_speedup.svg`: the tables beside the paper's speedups, and the plot;
- `gpu_check.log`: this script's progress.

Benchmark method: for each model, kind (DPO, reward) and profile (the paper's six datasets: synthetic pairs with their
median prompt and completion lengths, lognormal spread), the variants (stock TRL with SDPA and padding, as users
run it; prefix sharing with `"auto"`, which takes the varlen kernel in bf16; packing; both; sharing with
FlexAttention; and sharing with SDPA's dense mask, unless `--skip-sdpa`) train one after another from the same weights
in bf16 with TRL's default gradient checkpointing: one
warm-up epoch (compilation; activation memory), then `repeats` timed epochs, throughput from the median epoch, then
one profiled epoch (unless `--skip-profile`: the GPU's busy time per step and the top operators). GRPO: TRL-shaped
generation batches through TRL's `compute_loss` and backward, stock vs sharing, median of interleaved repeats. Before
the small model's trainers, the attention microbenchmark times one attention layer of its shape (forward and backward)
on each profile's DPO batch: stock's padded rows through transformers' SDPA, and the shared rows through each kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "scripts"), ROOT]  # the checkout's package, also when it is not installed

#: the models of the benchmark, built from configs with random weights (no download): Qwen2.5-0.5B's and Llama
#: 3.2 3B's shapes, vocabularies and tied embeddings
MODELS = {
    "qwen2.5-0.5b": dict(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "llama-3b": dict(
        family="llama",
        vocab_size=128256,
        hidden_size=3072,
        num_layers=28,
        intermediate_size=8192,
        num_attention_heads=24,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
}
#: the same families, tiny, for `--dry-run` (the tokenizer's own vocabulary)
DRY_MODELS = {
    "qwen2.5-0.5b": dict(family="qwen2", hidden_size=32, num_layers=2),
    "llama-3b": dict(family="llama", hidden_size=32, num_layers=2),
}
#: pairs per profile and timed epochs per variant: sized so that each bench part stays within its time budget
SIZES = {"qwen2.5-0.5b": {"pairs": 64, "repeats": 3}, "llama-3b": {"pairs": 32, "repeats": 2}}
DRY_SIZES = {"pairs": 8, "repeats": 1, "batch_size": 4, "length_scale": 0.03}
DRY_PROFILES = "HH-RLHF"  # one profile per model and kind in a dry run (each costs ~20 s on 2 CPU cores)
GRPO_MODEL = "qwen2.5-0.5b"
GRPO_PROFILES = ("math-reasoning", "qa")  # prompt/completion 0.33 and 4 (scripts/benchmark_online.py)
PARTS = {
    "tests": {"tests": True, "models": []},
    "bench-small": {"tests": False, "models": ["qwen2.5-0.5b"]},
    "bench-large": {"tests": False, "models": ["llama-3b"]},
    "bench": {"tests": False, "models": ["qwen2.5-0.5b", "llama-3b"]},
    "all": {"tests": True, "models": ["qwen2.5-0.5b", "llama-3b"]},
}
#: the tests that carry the measurements run first, so that a run cut short still has them
FIRST_TESTS = ("test_compiles_a_bounded_number_of_times", "test_long_row_step")
MAX_FILES, MAX_BYTES, MAX_LOG_BYTES = 8, 16 * 2**20, 4 * 2**20
GPU_TESTS_KEYS = (
    "device",
    "torch",
    "cuda",
    "transformers",
    "trl",
    "command",
    "passed",
    "failed",
    "skipped",
    "recompiles",
    "peak_memory_gb",
)


# ------------------------------------------------------------------------------------------------- logging, files
LOG = {"path": None, "start": time.monotonic()}


def log(*parts):
    """A progress line to stdout and to `<out>/gpu_check.log`."""
    line = f"[gpu_check {time.monotonic() - LOG['start']:6.0f}s] " + " ".join(str(p) for p in parts)
    print(line, flush=True)
    if LOG["path"]:
        with open(LOG["path"], "a") as f:
            f.write(line + "\n")


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")


def cap_log(path, limit=MAX_LOG_BYTES):
    """Keep a log under `limit` bytes: its first quarter and its end, with a note of what was cut."""
    if not os.path.exists(path) or os.path.getsize(path) <= limit:
        return
    with open(path, "rb") as f:
        data = f.read()
    head, tail = data[: limit // 4], data[-(limit * 3 // 4) :]
    with open(path, "wb") as f:
        f.write(head + f"\n\n[... {len(data) - len(head) - len(tail)} bytes cut by gpu_check ...]\n\n".encode() + tail)


def check_outputs(out) -> list[str]:
    """Problems with the output folder: too many files, or a file too large to keep."""
    names = sorted(os.listdir(out))
    problems = [f"{len(names)} files (at most {MAX_FILES})"] if len(names) > MAX_FILES else []
    problems += [
        f"{n}: {os.path.getsize(os.path.join(out, n))} bytes"
        for n in names
        if os.path.getsize(os.path.join(out, n)) > MAX_BYTES
    ]
    return problems


def environment(dry_run: bool) -> dict:
    """Device and versions."""
    import importlib.metadata as metadata
    import platform

    import torch

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    env = {
        "device": None,
        "gpu_memory_gb": None,
        "driver": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "trl": version("trl"),
        "accelerate": version("accelerate"),
        "peft": version("peft"),
        "datasets": version("datasets"),
        "python": platform.python_version(),
        "dry_run": dry_run,
    }
    if torch.cuda.is_available() and not dry_run:
        props = torch.cuda.get_device_properties(0)
        env["device"], env["gpu_memory_gb"] = props.name, round(props.total_memory / 2**30, 1)
        with contextlib.suppress(Exception):
            env["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                ).stdout.strip()
                or None
            )
    else:
        env["device"] = f"CPU, {torch.get_num_threads()} threads" + (" (dry run)" if dry_run else "")
    return env


# ------------------------------------------------------------------------------------------------- the tests part
#: `"i/n"` in a worker's environment: it runs the i-th of n parts of the collected tests (`run_pytest`'s `jobs`)
SHARD_VARIABLE = "GPU_CHECK_SHARD"


class Recorder:
    """pytest plugin (in the worker process): runs `FIRST_TESTS` first and appends every test report, with the
    properties tests record (`record_property`), to a JSON-lines file as it arrives, so that a run cut short by the
    time limit still leaves what it finished. With `SHARD_VARIABLE` set to `"i/n"` it keeps every n-th test from the
    i-th on (the measured ones first, so that each part starts with one) and deselects the rest."""

    def __init__(self, path):
        self.path = path
        self.shard, self.shards = map(int, os.environ.get(SHARD_VARIABLE, "0/1").split("/"))

    def _write(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def pytest_collection_modifyitems(self, session, config, items):
        first = [item for item in items if item.name.startswith(FIRST_TESTS)]
        ordered = first + [item for item in items if item not in first]
        items[:] = ordered[self.shard :: self.shards]
        if len(items) < len(ordered):
            config.hook.pytest_deselected(items=[item for item in ordered if item not in items])

    def pytest_collection_finish(self, session):
        self._write({"event": "collected", "count": len(session.items)})

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and report.outcome == "passed":
            return
        message = report.longreprtext[-3000:] if report.outcome == "failed" else None
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])
        self._write(
            {
                "event": "report",
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "duration": round(report.duration, 3),
                "properties": dict(report.user_properties),
                "message": message,
            }
        )


def pytest_worker(record_path, pytest_args) -> int:
    import pytest

    return int(pytest.main(pytest_args, plugins=[Recorder(record_path)]))


def run_pytest(pytest_args, log_path, timeout_s, env=None, jobs=1) -> dict:
    """pytest in `jobs` child processes side by side (each with fresh CUDA and dynamo state, the collected tests dealt
    out in turn), their output to `log_path` one part after another, all stopped after `timeout_s`; the outcome per
    test from the records the children wrote."""
    env = dict(os.environ if env is None else env)
    logs = [log_path] if jobs == 1 else [f"{log_path}.{shard}" for shard in range(jobs)]
    with tempfile.TemporaryDirectory() as tmp:
        records_paths = [os.path.join(tmp, f"records{shard}.jsonl") for shard in range(jobs)]
        start, children = time.monotonic(), []
        for shard, (records_path, part_log) in enumerate(zip(records_paths, logs, strict=True)):
            command = [sys.executable, os.path.abspath(__file__), "--pytest-worker", records_path, "--", *pytest_args]
            with open(part_log, "w") as out:
                children.append(
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**env, SHARD_VARIABLE: f"{shard}/{jobs}"},
                        start_new_session=True,
                    )
                )
        timed_out = _wait_or_stop(children, start + max(timeout_s, 1))
        records = []
        for records_path in records_paths:
            if os.path.exists(records_path):
                with open(records_path) as f:
                    records += [json.loads(line) for line in f if line.strip()]
    if jobs > 1:
        with open(log_path, "w") as out:
            for shard, part_log in enumerate(logs):
                with open(part_log, errors="replace") as f:
                    out.write(f"[gpu_check: part {shard + 1} of {jobs}]\n" + f.read() + "\n")
                os.remove(part_log)
    summary = summarise_records(records)
    returncode = max((child.returncode for child in children), key=abs)
    summary.update(returncode=returncode, timed_out=timed_out, duration_s=round(time.monotonic() - start, 1))
    if timed_out:
        with open(log_path, "a") as out:
            out.write(f"\n[gpu_check: stopped after {timeout_s:.0f} s; {summary['not_run']} tests not run]\n")
    return summary


def _wait_or_stop(children, deadline) -> bool:
    """Wait for every child until `deadline` (monotonic); stop (SIGTERM, then SIGKILL) those still running then.
    Whether any had to be stopped."""
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            break
    running = [child for child in children if child.poll() is None]
    for child in running:
        os.killpg(child.pid, signal.SIGTERM)
    for child in running:
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return bool(running)


def summarise_records(records) -> dict:
    """pytest's counts (a test is passed, failed or skipped by its call, or its setup when that did not pass; errors
    are failed set-ups and teardowns), the tests' recorded properties, and the failures' messages."""
    collected = sum(r["count"] for r in records if r.get("event") == "collected")
    outcome, properties, failures, errors = {}, {}, [], 0
    for r in (r for r in records if r.get("event") == "report"):
        properties.update(r["properties"])
        if r["outcome"] == "failed" and r["when"] != "call":
            errors += 1
            failures.append({"test": r["nodeid"], "when": r["when"], "message": r["message"]})
            outcome.setdefault(r["nodeid"], "error")
            continue
        if r["when"] == "teardown":
            continue
        outcome[r["nodeid"]] = r["outcome"]
        if r["outcome"] == "failed":
            failures.append({"test": r["nodeid"], "when": r["when"], "message": r["message"]})
    counts = {key: sum(v == key for v in outcome.values()) for key in ("passed", "failed", "skipped")}
    skip_reasons = sorted({r["message"] for r in records if r.get("outcome") == "skipped" and r.get("message")})
    return {
        **counts,
        "errors": errors,
        "collected": collected,
        "not_run": max(collected - len(outcome), 0),
        "properties": properties,
        "failures": failures,
        "skip_reasons": skip_reasons,
    }


def logged_recompiles(log_path) -> dict[str, int]:
    """`TORCH_LOGS=recompiles` lines per function over the whole run (every test starts from nothing compiled)."""
    counts = {}
    with open(log_path, errors="replace") as f:
        for match in re.finditer(r"Recompiling function (\S+) in ", f.read()):
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return dict(sorted(counts.items()))


def run_tests_part(args, env, command, deadline) -> dict:
    log_path = os.path.join(args.out, "cuda_tests.log")
    pytest_args = ["-v", "-s", "-rfEs", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    if args.tests_k:
        pytest_args += ["-k", args.tests_k]
    python_path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    child_env = {
        **os.environ,
        "TORCH_LOGS": os.environ.get("TORCH_LOGS", "recompiles"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": python_path,
    }
    timeout = deadline.left() - 20 if deadline.limited else 24 * 3600
    log(
        "tests: pytest",
        " ".join(pytest_args),
        f"in {args.jobs} process(es) side by side (stopped after {timeout:.0f} s)",
    )
    summary = run_pytest(pytest_args, log_path, timeout, env=child_env, jobs=args.jobs)
    cap_log(log_path)
    report = summary["properties"].get("compile_report", {})
    data = {
        **{key: env[key] for key in ("device", "torch", "cuda", "triton", "transformers", "trl")},
        "command": command,
        **{key: summary[key] for key in ("passed", "failed", "skipped", "errors", "not_run", "collected")},
        "recompiles": {name: report[name] for name in ("create_block_mask", "flex_attention") if name in report},
        "peak_memory_gb": summary["properties"].get("peak_memory_gb", {}),
        "compile_report": report,
        "long_row_compile_report": summary["properties"].get("long_row_compile_report", {}),
        "recompiles_logged": logged_recompiles(log_path),
        "failures": [{**f, "message": (f["message"] or "")[-1500:]} for f in summary["failures"]],
        "skip_reasons": summary["skip_reasons"],
        "timed_out": summary["timed_out"],
        "duration_s": summary["duration_s"],
        "pytest": "python -m pytest " + shlex.join(pytest_args),
        "environment": env,
    }
    write_json(os.path.join(args.out, "gpu_tests.json"), data)
    log(
        f"tests: {data['passed']} passed, {data['failed']} failed, {data['skipped']} skipped, {data['errors']} errors,"
        f" {data['not_run']} not run of {data['collected']} in {data['duration_s']} s; recompiles {data['recompiles']}"
        f"; peak memory {data['peak_memory_gb']}"
    )
    for failure in data["failures"]:
        log("  failed:", failure["test"], (failure["message"] or "").strip().splitlines()[-1:])
    return data


# ------------------------------------------------------------------------------------------------- the bench parts
class Deadline:
    def __init__(self, seconds):
        self.limited = bool(seconds)
        self.end = time.monotonic() + (seconds or 0)

    def left(self) -> float:
        return self.end - time.monotonic() if self.limited else float("inf")


class HostClock:
    """Host time of the layout (the data collator, on the host) and of the attention inputs (each backend's `inputs`:
    the mask, or the varlen kernel's segments, wherever the trainers build them) while `on`, and their GPU time (CUDA
    events)."""

    def __init__(self, cuda):
        self.cuda, self.on = cuda, False
        self.reset()

    def reset(self):
        self.collate_s = self.layout_s = self.mask_s = 0.0
        self.collate_calls = self.layout_calls = self.mask_calls = 0
        self.events = []
        self.kernels = {}  # the kernel each timed micro-batch's layout ran (`Layout.kernel`; "stock": stock's rows)

    def mask_gpu_s(self) -> float | None:
        if not self.cuda or not self.events:
            return None
        import torch

        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events) / 1000

    def wrap(self, function, kind):
        import torch

        clock = self

        def timed(*args, **kwargs):
            if not clock.on:
                return function(*args, **kwargs)
            events = None
            if clock.cuda and kind == "mask":
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            start = time.perf_counter()
            result = function(*args, **kwargs)
            elapsed = time.perf_counter() - start
            if events is not None:
                events[1].record()
                clock.events.append(events)
            setattr(clock, f"{kind}_s", getattr(clock, f"{kind}_s") + elapsed)
            setattr(clock, f"{kind}_calls", getattr(clock, f"{kind}_calls") + 1)
            return result

        timed.gpu_check_timed = True
        return timed

    @contextlib.contextmanager
    def patched(self):
        """Wrap every attention backend's `inputs` (the mask or segments of a layout) and the layouts the session
        builds in the training step (GRPO's groups)."""
        # the package imports its trainers lazily: load them, so that every module that holds these names has them
        import trl_prefix_sharing.session as session_module
        from trl_prefix_sharing import DPOTrainer, GRPOTrainer, OnlineDPOTrainer, RewardTrainer  # noqa: F401
        from trl_prefix_sharing.attention import BACKENDS

        saved, found = [], set()
        for backend in BACKENDS.values():  # each concrete class, so that a `super().inputs` is not counted twice
            cls = type(backend)
            saved.append((cls, "inputs", cls.__dict__.get("inputs")))
            cls.inputs = self.wrap(cls.inputs, "mask")
            found.add("AttentionBackend.inputs")
        # the layouts built in the training step (GRPO's groups), not the collator's (timed with the data)
        saved.append((session_module, "build_layout", session_module.build_layout))
        session_module.build_layout = self.wrap(session_module.build_layout, "layout")
        found.add("session.build_layout")
        self.found = found
        try:
            yield self
        finally:
            for owner, attribute, function in reversed(saved):
                if function is None:  # an inherited method: the class had none of its own
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, function)


class TimedCollator:
    """The trainer's data collator, timed on the host (stock: TRL's padding; ours: the shared layout)."""

    def __init__(self, collator, clock):
        self.collator, self.clock = collator, clock

    def __getattr__(self, name):
        return getattr(self.collator, name)

    def __call__(self, examples):
        if not self.clock.on:
            return self.collator(examples)
        start = time.perf_counter()
        batch = self.collator(examples)
        self.clock.collate_s += time.perf_counter() - start
        self.clock.collate_calls += 1
        layout = batch.get("prefix_sharing") if isinstance(batch, dict) else None
        if layout is not None:
            self.clock.kernels[layout.kernel] = self.clock.kernels.get(layout.kernel, 0) + 1
        return batch


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


def build_model(name, kind, tokenizer, dry_run, device):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from trl_prefix_sharing.testing import make_config

    spec = dict((DRY_MODELS if dry_run else MODELS)[name])
    family, vocab = spec.pop("family"), spec.pop("vocab_size", None) or len(tokenizer)
    config = make_config(family, vocab, **spec)
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
    """One variant on one profile: warm-up epoch (compilation, activation memory), then timed epochs."""
    import torch
    from benchmark import make_trainer

    cuda = settings.mode == "gpu"
    trainer = make_trainer(kind, variant, model, tokenizer, dataset, settings, tmp)
    trainer.data_collator = TimedCollator(trainer.data_collator, clock)
    with compile_monitor() as monitor:
        start = time.perf_counter()
        epoch(trainer, cuda)  # warm-up: compiles; the activation meter runs here only
        warmup_s = time.perf_counter() - start
        del trainer.compute_loss  # the meter's wrapper (its saved-tensor hooks would slow the timed epochs)
        positions, tokens, steps = trainer.counter.positions, trainer.counter.tokens, trainer.counter.batches
        peak = base = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        clock.reset()
        clock.on = True
        try:
            for _ in range(settings.repeats):
                epoch(trainer, cuda)
        finally:
            clock.on = False
        if cuda:
            peak = torch.cuda.max_memory_allocated()
        profile = profile_epoch(trainer, cuda, steps) if settings.profile else None
    times = trainer.timer.epochs[1 : 1 + settings.repeats]
    n, timed_steps = len(trainer.train_dataset), steps * settings.repeats
    median = sorted(times)[len(times) // 2]
    mask_gpu = clock.mask_gpu_s()
    sharing = getattr(trainer, "sharing_session", None)  # stock TRL's trainer has none
    result = {
        "pairs_per_s": n / median,
        "epoch_times_s": [round(t, 4) for t in times],
        "positions_per_pair": positions / n,
        "tokens_per_pair": tokens / n,
        "pairs_per_step": n / steps,
        "activation_mb": trainer.meter.peak / 2**20,
        "peak_memory_gb": peak / 2**30 if peak is not None else None,
        "peak_memory_above_start_gb": (peak - base) / 2**30 if peak is not None else None,
        "packing_efficiency": trainer.efficiency,
        "step_ms": 1000 * median / steps,
        "layout_host_ms_per_step": 1000 * clock.collate_s / max(clock.collate_calls, 1),
        "mask_host_ms_per_step": 1000 * clock.mask_s / timed_steps if clock.mask_calls else None,
        "mask_gpu_ms_per_step": 1000 * mask_gpu / timed_steps if mask_gpu is not None else None,
        "masks_per_step": clock.mask_calls / timed_steps if clock.mask_calls else 0,
        "warmup_s": round(warmup_s, 2),
        "attn_implementation": sharing.backend.name if sharing else "sdpa",
        # `"auto"`: what it measured at start-up and chose (`trl_prefix_sharing.tuning`), None for a fixed kernel
        "auto_measured": sharing.tuning.summary if sharing else None,
        # and what its timed training steps measured, once its close candidates took their turns (else None)
        "auto_training_steps": sharing.tuning.refined if sharing else None,
        "kernels_run": dict(clock.kernels),  # micro-batches per kernel that ran them (stock: none laid out)
        "compiled_variants": compiled_variants(),
        "profile": profile,
        **monitor,
    }
    del trainer
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
        epoch(trainer, cuda)
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


def epoch(trainer, cuda):
    """One epoch (`trainer.train()` again: the same seeded order, so the warm-up saw every shape); the optimizer is
    dropped afterwards."""
    trainer.train()
    trainer.optimizer = trainer.lr_scheduler = None
    gc.collect()


def kernel_variants(cuda: bool, skip_sdpa: bool) -> list[str]:
    """The sharing variants with a fixed kernel, beside `"sharing"` (`"auto"`: varlen in bf16 on CUDA):
    FlexAttention on CUDA (the varlen reference in a dry run, FlexAttention having no backward on the CPU), and SDPA's
    dense mask unless `skip_sdpa`."""
    return ["sharing-flex" if cuda else "sharing-varlen"] + ([] if skip_sdpa else ["sharing-sdpa"])


#: the kernels the attention microbenchmark times on the shared rows (FlexAttention on CUDA only: no CPU backward)
ATTENTION_KERNELS = ("varlen", "flex_attention", "sdpa")


def bench_attention(name, profile, tokenizer, settings, dry_run, repeats=20) -> dict:
    """One attention layer of model `name`'s shape, forward and backward, on one DPO micro-batch of `profile`
    (`settings.batch_size` pairs, TRL's collator): stock's padded rows through transformers' SDPA with their causal
    and padding mask, and the shared rows of each kernel through it (varlen: one unpadded row of segments over
    gathered paths; FlexAttention: rows rounded to 128, compiled; SDPA: the dense mask). Per call: GPU ms (CUDA
    events) and host ms (the time to issue the forward and backward), medians over `repeats` after a warm-up."""
    import torch
    from benchmark import synthetic_dataset
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from trl_prefix_sharing.attention import BACKENDS
    from trl_prefix_sharing.collator import PrefixSharingCollator
    from trl_prefix_sharing.testing import make_config
    from trl_prefix_sharing.varlen import varlen_attention_forward

    cuda = not dry_run
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    spec = dict((DRY_MODELS if dry_run else MODELS)[name])
    config = make_config(spec.pop("family"), spec.pop("vocab_size", None) or len(tokenizer), **spec)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    dataset = synthetic_dataset(profile, settings.batch_size, settings.length_scale, seed=0)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    examples = [
        {"prompt_ids": ids(r["prompt"]), "chosen_ids": ids(r["chosen"]), "rejected_ids": ids(r["rejected"])}
        for r in dataset
    ]
    base = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    stock = base(examples)
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
        return {
            "rows": rows,
            "width": width,
            "gpu_ms": statistics.median(gpu) if cuda else None,
            "host_ms": statistics.median(host),
        }

    mask = stock["attention_mask"].bool().to(device)
    rows, width = mask.shape
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    stock_mask = causal[None, None] & mask[:, None, None, :]
    calls = {
        "stock": timed(lambda q, k, v: sdpa_attention_forward(module, q, k, v, stock_mask, scaling=scale), rows, width)
    }
    for kernel in ATTENTION_KERNELS:
        if kernel == "flex_attention" and not cuda:
            continue
        backend = BACKENDS[kernel]
        collator = PrefixSharingCollator(base, tokenizer.pad_token_id, rows=backend.rows(None), join="prompts")
        layout = collator(examples)["prefix_sharing"].to(device)
        inputs = backend.inputs(layout, config).model_kwargs()
        n, s = layout.input_ids.shape
        if kernel == "varlen":
            function = varlen_attention_forward
        else:
            function = flex_attention_forward if kernel == "flex_attention" else sdpa_attention_forward
        calls[kernel] = timed(lambda q, k, v, f=function, i=inputs: f(module, q, k, v, scaling=scale, **i), n, s)
    return {"pairs": len(examples), "head_dim": head_dim, "heads": [heads, kv_heads], "calls": calls}


def bench_grpo(profile, model, tokenizer, settings, clock, tmp, g=8) -> dict:
    """Stock vs sharing on one TRL-shaped GRPO generation batch (scripts/benchmark_online.py's pieces): a warm-up step
    each, then `repeats` interleaved timed steps; host time of the group layout and the mask, peak memory."""
    import torch
    from benchmark_online import PROFILES, generation_batch, make_trainer, micro_batches, positions, training_step

    cuda = settings.mode == "gpu"
    args = SimpleNamespace(
        mode=settings.mode,
        trainer="grpo",
        groups_per_step=2,
        micro_batches=2,
        beta=0.0,
        gradient_checkpointing=True,
        num_generations=g,
        rows=2 * g,
    )
    batch = generation_batch(
        profile,
        args.groups_per_step * args.micro_batches,
        g,
        settings.length_scale,
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        seed=0,
        device="cuda" if cuda else "cpu",
    )
    batches = micro_batches(batch, args.rows)
    trainers = {variant: make_trainer(variant, model, tokenizer, args, tmp) for variant in ("stock", "sharing")}
    for trainer in trainers.values():  # TRL's default, switched on as `train()` would (this step does not run it)
        if hasattr(trainer.model, "activation_checkpointing_enable"):
            trainer.model.activation_checkpointing_enable()
        else:
            trainer.model.gradient_checkpointing_enable()
    result = {
        "profile": profile,
        "G": g,
        "prompt_median": PROFILES[profile][0] * settings.length_scale,
        "completion_median": PROFILES[profile][1] * settings.length_scale,
    }
    with compile_monitor() as monitor:
        activations = {v: training_step(t, batches, cuda, args)[1] for v, t in trainers.items()}  # warm-up
        times, peaks, host = {v: [] for v in trainers}, {}, {}
        for repeat in range(settings.repeats):
            for variant in list(trainers)[repeat % 2 :] + list(trainers)[: repeat % 2]:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                clock.reset()
                clock.on = True
                try:
                    times[variant].append(training_step(trainers[variant], batches, cuda, args)[0])
                finally:
                    clock.on = False
                if cuda:
                    peaks[variant] = max(peaks.get(variant, 0), torch.cuda.max_memory_allocated() / 2**30)
                mask_gpu = clock.mask_gpu_s()
                host.setdefault(variant, []).append((clock.layout_s, clock.mask_s, mask_gpu))
    counts = positions(batches, trainers["sharing"], args)  # stock's padding apart from what sharing saves
    step = {variant: statistics.median(t) for variant, t in times.items()}
    sharing_host = host["sharing"]
    result.update(
        {
            "prompt_tokens": int(batch["prompt_mask"].sum()) / batch["prompt_mask"].shape[0],
            "completion_tokens": int(batch["completion_mask"].sum()) / batch["completion_mask"].shape[0],
            **counts,
            "padding": counts["stock_padded_positions"] / counts["stock_positions"],
            "sharing_ideal": counts["stock_positions"] / counts["shared_positions"],
            # positions the two padded forwards run: stock's padding and what sharing saves, together
            "ideal": counts["stock_padded_positions"] / counts["shared_padded_positions"],
            "step_s": step,
            "step_times_s": times,
            "speedup": step["stock"] / step["sharing"],
            "activation_bytes": activations,
            "activation_ratio": activations["sharing"] / activations["stock"],
            "peak_memory_gb": peaks or None,
            "layout_host_ms_per_step": 1000 * statistics.median(h[0] for h in sharing_host),
            "mask_host_ms_per_step": 1000 * statistics.median(h[1] for h in sharing_host),
            "mask_gpu_ms_per_step": (
                1000 * statistics.median(h[2] for h in sharing_host) if sharing_host[0][2] is not None else None
            ),
            "attn_implementation": trainers["sharing"].sharing_session.backend.name,
            "auto_measured": trainers["sharing"].sharing_session.tuning.summary,
            "auto_training_steps": trainers["sharing"].sharing_session.tuning.refined,
            "compiled_variants": compiled_variants(),
            **monitor,
        }
    )
    result["share_of_ideal"] = result["speedup"] / result["ideal"]
    del trainers
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


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


def run_bench_part(args, env, command, deadline, models) -> dict:
    import torch
    from benchmark import PROFILES, VARIANTS, quiet_setup, synthetic_dataset

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
    data = {
        "command": command,
        **{k: env[k] for k in ("device", "torch", "cuda", "triton", "transformers", "trl")},
        "model": None,
        "models": {},
        "settings": {},
        "results": {},
        "summary": {},
        "grpo": {},
        "attention": {},
        "not_run": [],
        "errors": [],
        "environment": env,
        "parts": [args.part],
    }
    clock, budget = HostClock(cuda), Budget(deadline, data, cuda)
    device = "cuda" if cuda else "cpu"

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
        data["attention"].setdefault(name, {})[profile] = result = bench_attention(
            name, profile, tokenizer, settings, args.dry_run
        )
        log(f"bench {name} attention {profile}: " + json.dumps(result["calls"]))
        write_bench(data, args.out)

    def grpo_profile(name, model, profile, settings):
        result = data["grpo"].setdefault(name, {})[profile] = bench_grpo(
            profile, model, tokenizer, settings, clock, tmp
        )
        log(
            f"bench {name} grpo {profile}: step {result['speedup']:.2f}x (ideal {result['ideal']:.2f}x), layout "
            f"{result['layout_host_ms_per_step']:.2f} ms, mask {result['mask_host_ms_per_step']:.2f} ms per step, "
            f"compiled {result['compiled_variants']}, eager flex {result['eager_flex_warnings']}"
        )
        write_bench(data, args.out)

    with tempfile.TemporaryDirectory() as tmp, clock.patched():
        data["timed_functions"] = sorted(clock.found)
        for name in models:
            sizes = {**SIZES[name], "batch_size": 8, "length_scale": 1.0}
            if args.dry_run:
                sizes.update(DRY_SIZES)
            sizes.update(
                {
                    key: value
                    for key, value in (
                        ("pairs", args.pairs),
                        ("repeats", args.repeats),
                        ("batch_size", args.batch_size),
                    )
                    if value
                }
            )
            settings = SimpleNamespace(
                mode="gpu" if cuda else "cpu", gradient_checkpointing=True, profile=not args.skip_profile, **sizes
            )
            data["settings"][name] = {
                **sizes,
                "dtype": "bfloat16" if cuda else "float32",
                "gradient_checkpointing": True,
            }
            if name == GRPO_MODEL:  # the attention microbenchmark first: seconds per profile
                for profile in profiles:
                    budget.run(f"{name} attention {profile}", attention_profile, name, profile, settings)
            if name == GRPO_MODEL and "grpo" in kinds:  # first: short, and a single GRPO figure is worth more
                model, data["models"][name] = build_model(name, "grpo", tokenizer, args.dry_run, device)
                for profile in GRPO_PROFILES:
                    budget.run(f"{name} grpo {profile}", grpo_profile, name, model, profile, settings)
                del model
            for kind in (kind for kind in kinds if kind != "grpo"):
                model, data["models"][name] = build_model(name, kind, tokenizer, args.dry_run, device)
                for profile in profiles:
                    budget.run(f"{name} {kind} {profile}", preference_profile, name, kind, model, profile, settings)
                del model
                gc.collect()
    write_bench(data, args.out)
    return data


# ------------------------------------------------------------------------------------------------- reports
def summarise(data) -> dict:
    """Per model, kind and profile: the ideal, each variant's speedup over stock, the paper's speedups over its
    FlexAttention baseline (sharing, with packing: the targets), and whether peak memory is below stock's."""
    from benchmark import PAPER as targets
    from benchmark import PROFILES

    summary = {}
    for name, kinds in data["results"].items():
        for kind, profiles in kinds.items():
            for profile, v in profiles.items():
                stock = v["stock"]
                speed = {variant: r["pairs_per_s"] / stock["pairs_per_s"] for variant, r in v.items()}
                p, c = PROFILES[profile]
                memory = {variant: r["peak_memory_gb"] for variant, r in v.items()}
                summary.setdefault(name, {}).setdefault(kind, {})[profile] = {
                    "p_over_c": p / c,
                    "ideal": stock["tokens_per_pair"] / v["sharing"]["tokens_per_pair"],
                    "speedup": speed,
                    "paper": list(targets[profile]),
                    "target_met": speed["sharing"] >= targets[profile][0]
                    and speed["sharing+packing"] >= targets[profile][1],
                    "fastest_sharing_kernel": _fastest_sharing_kernel(v),
                    "memory_below_stock": None
                    if memory["stock"] is None
                    else all(memory[variant] < memory["stock"] for variant in ("sharing", "sharing+packing")),
                }
    return summary


def _fastest_sharing_kernel(by_variant: dict) -> str | None:
    """The kernel the fastest of the sharing variants ran (`"sharing"` runs what `"auto"` took), without packing."""
    sharing = [x for x in by_variant if x == "sharing" or x.startswith("sharing-")]
    if not sharing:
        return None
    return by_variant[max(sharing, key=lambda x: by_variant[x]["pairs_per_s"])].get("attn_implementation")


def write_bench(data, out):
    data["summary"] = summarise(data)
    names = list(data["models"])
    data["model"] = "; ".join(f"{n}: {d}" for n, d in data["models"].items()) if names else None
    write_json(os.path.join(out, "gpu.json"), data)
    with open(os.path.join(out, "gpu.md"), "w") as f:
        f.write(render_md(data))
    with open(os.path.join(out, "gpu_speedup.svg"), "w") as f:
        f.write(render_svg(data))


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def render_md(data) -> str:
    from benchmark import VARIANTS

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
    for name, kinds in data["results"].items():
        for kind, profiles in kinds.items():
            lines += [
                f"## {name}: {kind.upper()}",
                "",
                "| profile | p/c | ideal | sharing (kernel) | other kernels | packing | sharing+packing | paper | "
                "target | peak memory GB (stock / sharing / packing / both) | below stock | step ms (stock / sharing "
                "/ packing / both) | layout host ms per step (same) | mask host / GPU ms per step (sharing; both) | "
                "compiled variants (mask, flex) | eager flex |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for profile, v in profiles.items():
                s = data["summary"][name][kind][profile]
                sp = s["speedup"]

                def each(key, spec, variants=VARIANTS, v=v):
                    return " / ".join(_fmt(v[x][key], spec) for x in variants)

                masks = "; ".join(
                    f"{_fmt(v[x]['mask_host_ms_per_step'], '.2f')} / {_fmt(v[x]['mask_gpu_ms_per_step'], '.2f')}"
                    for x in ("sharing", "sharing+packing")
                )
                compiled = v["sharing+packing"]["compiled_variants"]
                others = "; ".join(f"{x.split('-', 1)[1]} {sp[x]:.2f}x" for x in v if x.startswith("sharing-"))
                lines.append(
                    f"| {profile} | {s['p_over_c']:.2f} | {s['ideal']:.2f}x | {sp['sharing']:.2f}x "
                    f"({v['sharing'].get('attn_implementation')}) | {others or '-'} | "
                    f"{sp['packing']:.2f}x | {sp['sharing+packing']:.2f}x | "
                    f"{s['paper'][0]:.2f}x / {s['paper'][1]:.2f}x | {'met' if s['target_met'] else '**missed**'} | "
                    f"{each('peak_memory_gb', '.2f')} | "
                    f"{'-' if s['memory_below_stock'] is None else ('yes' if s['memory_below_stock'] else '**no**')} "
                    f"| {each('step_ms', '.1f')} | {each('layout_host_ms_per_step', '.2f')} | {masks} | "
                    f"{compiled['create_block_mask']}, {compiled['flex_attention']} | "
                    f"{sum(v[x]['eager_flex_warnings'] for x in v)} |"
                )
            lines.append("")
    lines += render_attention_md(data)
    for name, profiles in data["grpo"].items():
        lines += [
            f"## {name}: GRPO (G = 8, 2 prompts x G per micro-batch, 2 micro-batches per step)",
            "",
            "| profile | prompt | completion | padding | sharing ideal | ideal | step speedup | step s (stock / "
            "sharing) | peak memory GB (stock / sharing) | activation memory, sharing / stock | layout / mask host "
            "ms, mask GPU ms per step |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for profile, r in profiles.items():
            peak = r["peak_memory_gb"] or {}
            lines.append(
                f"| {profile} | {r['prompt_tokens']:.0f} | {r['completion_tokens']:.0f} | {r['padding']:.2f}x | "
                f"{r['sharing_ideal']:.2f}x | {r['ideal']:.2f}x | "
                f"{r['speedup']:.2f}x | {r['step_s']['stock']:.3f} / {r['step_s']['sharing']:.3f} | "
                f"{_fmt(peak.get('stock'), '.2f')} / {_fmt(peak.get('sharing'), '.2f')} | "
                f"{r['activation_ratio']:.2f} | {r['layout_host_ms_per_step']:.2f} / {r['mask_host_ms_per_step']:.2f},"
                f" {_fmt(r['mask_gpu_ms_per_step'], '.2f')} |"
            )
        lines.append("")
    lines += render_step_md(data)
    if data.get("not_run"):
        lines += ["Not run (time limit): " + ", ".join(data["not_run"]) + ".", ""]
    return "\n".join(lines)


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
                    if not prof:
                        continue
                    ops = ", ".join(op.removeprefix("aten::") for op in prof.get("attention_ops_ms_per_step", {}))
                    rows.append(
                        f"| {kind} | {profile} | {x} | {v[x].get('attn_implementation')} | {speed[x]:.2f}x | "
                        f"{v[x]['step_ms']:.1f} / {_fmt(prof['gpu_busy_ms_per_step'], '.1f')} | {ops or '-'} |"
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
                "| kind | profile | variant | kernel | speedup | step / GPU busy ms | attention operators |",
                "|---|---|---|---|---|---|---|",
                *rows,
                "",
            ]
    return lines


def render_attention_md(data) -> list[str]:
    """The attention microbenchmark: per model and profile, one layer's forward and backward per kernel."""
    lines = []
    for name, profiles in data.get("attention", {}).items():
        lines += [
            f"## {name}: one attention layer per kernel",
            "",
            "One DPO micro-batch per profile through one attention layer of the model's shape, forward and backward: "
            "stock's padded rows (SDPA, causal and padding mask) and the shared rows of each kernel. GPU ms = CUDA "
            "events around the call; host ms = the time to issue it (medians).",
            "",
            "| profile | kernel | rows x width | GPU ms per call | host ms per call |",
            "|---|---|---|---|---|",
        ]
        for profile, result in profiles.items():
            for kernel, call in result["calls"].items():
                lines.append(
                    f"| {profile} | {kernel} | {call['rows']} x {call['width']} | {_fmt(call['gpu_ms'], '.3f')} | "
                    f"{call['host_ms']:.3f} |"
                )
        lines.append("")
    return lines


def render_svg(data) -> str:
    """Grouped bars: speedup over stock per profile (sharing, packing, both), the paper's two targets as ticks; one
    panel per model and kind. Plain SVG, no plotting library needed."""
    from benchmark import VARIANTS

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


def merge(directories, out, command) -> None:
    """Combine the parts' `gpu.json` and `gpu_tests.json` (run on separate machines or calls) into one of each, and
    write `gpu.md` and `gpu_speedup.svg` from the combined results. Needs neither a GPU nor torch's CUDA."""
    merged, tests = None, []
    for directory in directories:
        path = os.path.join(directory, "gpu.json")
        if os.path.exists(path):
            with open(path) as f:
                part = json.load(f)
            if merged is None:
                merged = {**part, "commands": [part["command"]]}
            else:
                if (part["device"], part["torch"]) != (merged["device"], merged["torch"]):
                    raise SystemExit(
                        f"{path}: device/torch {part['device']}, {part['torch']} differ from "
                        f"{merged['device']}, {merged['torch']}: merge only parts from one machine."
                    )
                merged["commands"].append(part["command"])
                merged["parts"] += part.get("parts", [])
                merged["not_run"] += part.get("not_run", [])
                for key in ("models", "settings"):
                    merged[key].update(part[key])
                for name, kinds in part["results"].items():  # model -> kind -> profile
                    for kind, profiles in kinds.items():
                        merged["results"].setdefault(name, {}).setdefault(kind, {}).update(profiles)
                for name, profiles in part["grpo"].items():
                    merged["grpo"].setdefault(name, {}).update(profiles)
                for name, profiles in part.get("attention", {}).items():
                    merged.setdefault("attention", {}).setdefault(name, {}).update(profiles)
        path = os.path.join(directory, "gpu_tests.json")
        if os.path.exists(path):
            with open(path) as f:
                tests.append(json.load(f))
    if merged is None and not tests:
        raise SystemExit(f"No gpu.json or gpu_tests.json in {directories}.")
    os.makedirs(out, exist_ok=True)
    if merged is not None:
        measured = {
            f"{name} {kind} {profile}"
            for name, kinds in merged["results"].items()
            for kind, profiles in kinds.items()
            for profile in profiles
        } | {f"{name} grpo {profile}" for name, profiles in merged["grpo"].items() for profile in profiles}
        merged["not_run"] = sorted({label for label in merged["not_run"] if label not in measured})
        merged["command"] = " && ".join(merged["commands"])
        merged["merged_by"] = command
        write_bench(merged, out)
    if tests:
        write_json(os.path.join(out, "gpu_tests.json"), merge_tests(tests))


def merge_tests(parts) -> dict:
    """One `gpu_tests.json` from runs over parts of tests/test_cuda.py (`--tests-k`): counts summed, measurements and
    failures combined."""
    merged = copy.deepcopy(parts[0])
    for part in parts[1:]:
        if (part["device"], part["torch"]) != (merged["device"], merged["torch"]):
            raise SystemExit("gpu_tests.json from different machines: merge only parts from one machine.")
        for key in ("passed", "failed", "skipped", "errors", "not_run", "collected"):
            merged[key] += part[key]
        for key in ("recompiles", "peak_memory_gb", "compile_report", "long_row_compile_report"):
            merged[key].update(part[key])
        for key, count in part["recompiles_logged"].items():
            merged["recompiles_logged"][key] = merged["recompiles_logged"].get(key, 0) + count
        merged["failures"] += part["failures"]
        merged["command"] += " && " + part["command"]
        merged["timed_out"] = merged["timed_out"] or part["timed_out"]
    return merged


# ------------------------------------------------------------------------------------------------- main
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pytest-worker"]:
        return pytest_worker(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--part",
        choices=list(PARTS),
        default="tests",
        help="tests (tests/test_cuda.py), bench-small (the 0.5B model), bench-large (the 3B model), bench (both), "
        "all (the three)",
    )
    parser.add_argument("--out", required=True, help="folder for the files (created)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny models and lengths, the same code; nothing is measured",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no new work after this many seconds (default 540 for one part, none for bench and all; 0 = none)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        default=None,
        help="combine the gpu.json / gpu_tests.json of earlier parts into --out (no GPU needed)",
    )
    parser.add_argument(
        "--profiles", default=None, help=f"DPO/reward profiles (default: the paper's six; dry run: {DRY_PROFILES})"
    )
    parser.add_argument("--kinds", default="dpo,reward,grpo")
    parser.add_argument(
        "--skip-sdpa",
        action="store_true",
        help="leave out the variant that shares with SDPA's dense mask instead of FlexAttention (the kernel choice)",
    )
    parser.add_argument(
        "--skip-profile",
        action="store_true",
        help="leave out the profiled epoch per variant (GPU busy time per step and the top operators)",
    )
    parser.add_argument(
        "--tests-k",
        default=None,
        help="pytest -k expression: run part of tests/test_cuda.py (merge the parts' gpu_tests.json)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="tests: run tests/test_cuda.py in this many processes side by side on the one device (each takes every "
        "n-th test; their records and logs are combined)",
    )
    parser.add_argument("--pairs", type=int, default=None, help="pairs per profile (default per model)")
    parser.add_argument("--repeats", type=int, default=None, help="timed epochs per variant (default per model)")
    parser.add_argument("--batch-size", type=int, default=None, help="pairs per step (default 8)")
    args = parser.parse_args(argv)
    command = "python scripts/gpu_check.py " + shlex.join(argv)
    if args.merge:
        merge(args.merge, args.out, command)
        return 0
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: give 1 or more processes.")
    if args.deadline_s is None:
        args.deadline_s = 0 if args.part in ("bench", "all") else 540
    deadline = Deadline(args.deadline_s)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run this on a GPU machine, or use --dry-run (CPU, tiny sizes).")
    os.makedirs(args.out, exist_ok=True)
    LOG["path"] = os.path.join(args.out, "gpu_check.log")
    part = PARTS[args.part]
    env = environment(args.dry_run)
    log("environment:", json.dumps(env))
    status = 0
    if part["tests"]:
        tests = run_tests_part(args, env, command, deadline)
        status |= bool(tests["failed"] or tests["errors"] or tests["not_run"])
    if part["models"]:
        run_bench_part(args, env, command, deadline, part["models"])
    problems = check_outputs(args.out)
    log(
        "files:",
        ", ".join(f"{n} ({os.path.getsize(os.path.join(args.out, n))} B)" for n in sorted(os.listdir(args.out))),
    )
    for problem in problems:
        log("output problem:", problem)
    return 2 if problems else status


if __name__ == "__main__":
    sys.exit(main())
