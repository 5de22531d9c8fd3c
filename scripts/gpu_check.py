"""The CUDA check in one command per part: the CUDA tests, compile counts, long-row peak memory, and the benchmark
against stock TRL. Each part writes its files to `--out`.

    python scripts/gpu_check.py --part tests --jobs 3 --out results/tests  # tests/cuda/test_cuda.py, 3 processes
    python scripts/gpu_check.py --part bench-small --out results/small   # 0.5B model: DPO, reward, GRPO
    python scripts/gpu_check.py --part bench-large --out results/large   # 3B model: DPO, reward
    python scripts/gpu_check.py --merge results/tests results/small results/large --out docs/benchmarks

`--part all` runs the three in one process (no time limit of its own); `--jobs N` runs tests/cuda/test_cuda.py in N
processes side by side on the one GPU (each takes every N-th test, the measured ones first); `--tests-k` runs part of
tests/cuda/test_cuda.py (merge the parts); `--dry-run` runs the same code on CPU with tiny models and lengths
(tests/tools/test_gpu_check.py does, so that a typo or an import error shows before a GPU is used; there `"auto"`
runs each timed call but takes the kernel it prefers, as in the test suite, since the tiny models' times are noise).
Each single part stops starting new work after `--deadline-s` (540 s by default) and writes what it measured, with the
rest listed as not run.

Files in `--out`:
- `gpu_tests.json`: device, versions, pytest's counts over tests/cuda/test_cuda.py, the compiled variants of
  `create_block_mask` and `flex_attention` over its 39-step compile schedule ("recompiles"), recompilations logged by
  `TORCH_LOGS=recompiles` per function, the long-row peak memory, and the failures' messages;
- `cuda_tests.log`: pytest's output (`-v -s`, with the recompilation reasons);
- `gpu.json`: `benchmarks.results`' schema (`command`, `device`, `model`, `results`) plus the versions, with `results`
  per model: kind -> profile -> variant; each variant also has its step time, the host time of the layout (collation)
  and of the attention inputs (mask or segments) per step, their GPU time, peak memory, compiled variants, the kernel
  it ran and the SDPA kernels its profiled epoch ran; `grpo`: GRPO per profile; `attention`: the attention-only
  microbenchmark per profile (GPU and host ms per call of one layer's forward and backward, per kernel);
- `gpu.md` and `gpu_speedup.svg`: the tables beside the paper's speedups, and the plot;
- `gpu_check.log`: this script's progress.

The benchmark parts run `benchmarks.gpu` (its docstring says how they measure).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the checkout's package and benchmarks, also when they are not installed
from benchmarks.gpu import DRY_PROFILES, LOG, Deadline, log, run_bench_part, write_bench  # noqa: E402


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
GPU_TESTS_KEYS = ("device", "torch", "cuda", "transformers", "trl", "command", "passed", "failed", "skipped")
GPU_TESTS_KEYS += ("recompiles", "peak_memory_gb")


# ------------------------------------------------------------------------------------------------- logging, files
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
    sizes = {name: os.path.getsize(os.path.join(out, name)) for name in sorted(os.listdir(out))}
    problems = [f"{len(sizes)} files (at most {MAX_FILES})"] if len(sizes) > MAX_FILES else []
    return problems + [f"{name}: {size} bytes" for name, size in sizes.items() if size > MAX_BYTES]


def environment(dry_run: bool) -> dict:
    """Device and versions."""
    import importlib.metadata as metadata
    import platform

    import torch

    def version(name):  # None where not installed
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)

    env = dict.fromkeys(("device", "gpu_memory_gb", "driver"))  # filled below, where known
    env.update(torch=torch.__version__, cuda=torch.version.cuda)
    env.update({name: version(name) for name in ("triton", "transformers", "trl", "accelerate", "peft", "datasets")})
    env.update(python=platform.python_version(), dry_run=dry_run)
    if torch.cuda.is_available() and not dry_run:
        props = torch.cuda.get_device_properties(0)
        env["device"], env["gpu_memory_gb"] = props.name, round(props.total_memory / 2**30, 1)
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        with contextlib.suppress(Exception):
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip() or None
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
        record = {"event": "report", **{key: getattr(report, key) for key in ("nodeid", "when", "outcome")}}
        properties = dict(report.user_properties)
        self._write({**record, "duration": round(report.duration, 3), "properties": properties, "message": message})


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
            options = {"cwd": ROOT, "stderr": subprocess.STDOUT, "env": {**env, SHARD_VARIABLE: f"{shard}/{jobs}"}}
            with open(part_log, "w") as out:  # each child in its own session: a stop ends its whole process group
                children.append(subprocess.Popen(command, stdout=out, start_new_session=True, **options))
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
        if r["outcome"] == "failed":
            failures.append({"test": r["nodeid"], "when": r["when"], "message": r["message"]})
        if r["outcome"] == "failed" and r["when"] != "call":
            errors += 1
            outcome.setdefault(r["nodeid"], "error")
        elif r["when"] != "teardown":
            outcome[r["nodeid"]] = r["outcome"]
    summary = {key: sum(v == key for v in outcome.values()) for key in ("passed", "failed", "skipped")}
    summary.update(errors=errors, collected=collected, not_run=max(collected - len(outcome), 0), properties=properties)
    skip_reasons = sorted({r["message"] for r in records if r.get("outcome") == "skipped" and r.get("message")})
    return summary | {"failures": failures, "skip_reasons": skip_reasons}


def logged_recompiles(log_path) -> dict[str, int]:
    """`TORCH_LOGS=recompiles` lines per function over the whole run (every test starts from nothing compiled)."""
    counts = {}
    with open(log_path, errors="replace") as f:
        for match in re.finditer(r"Recompiling function (\S+) in ", f.read()):
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return dict(sorted(counts.items()))


def not_collected(tests: dict) -> str | None:
    """Why the tests part proved nothing although no test failed: pytest collected none (an import error in the test
    module, or a `--tests-k` that matches nothing) or stopped with an error of its own (exit status 2 to 5)."""
    if tests["pytest_returncode"] not in (0, 1) and not tests["timed_out"]:
        return f"pytest exited with status {tests['pytest_returncode']} (see cuda_tests.log)"
    if not tests["collected"]:
        return "pytest collected no test (see cuda_tests.log)"
    return None


def run_tests_part(args, env, command, deadline) -> dict:
    log_path = os.path.join(args.out, "cuda_tests.log")
    pytest_args = ["-v", "-s", "-rfEs", "-p", "no:cacheprovider", "tests/cuda/test_cuda.py"]
    if args.tests_k:
        pytest_args += ["-k", args.tests_k]
    child_env = {**os.environ, "TORCH_LOGS": os.environ.get("TORCH_LOGS", "recompiles"), "PYTHONUNBUFFERED": "1"}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    timeout = deadline.left() - 20 if deadline.limited else 24 * 3600
    side_by_side = f"in {args.jobs} process(es) side by side (stopped after {timeout:.0f} s)"
    log("tests: pytest", " ".join(pytest_args), side_by_side)
    summary = run_pytest(pytest_args, log_path, timeout, env=child_env, jobs=args.jobs)
    cap_log(log_path)
    properties = summary["properties"]
    report = properties.get("compile_report", {})
    data = {
        **{key: env[key] for key in ("device", "torch", "cuda", "triton", "transformers", "trl")}, "command": command,
        **{key: summary[key] for key in ("passed", "failed", "skipped", "errors", "not_run", "collected")},
        "pytest_returncode": summary["returncode"],
        "recompiles": {name: report[name] for name in ("create_block_mask", "flex_attention") if name in report},
        "peak_memory_gb": properties.get("peak_memory_gb", {}), "compile_report": report,
        "long_row_compile_report": properties.get("long_row_compile_report", {}),
        "recompiles_logged": logged_recompiles(log_path),
        "failures": [{**f, "message": (f["message"] or "")[-1500:]} for f in summary["failures"]],
        **{key: summary[key] for key in ("skip_reasons", "timed_out", "duration_s")},
        "pytest": "python -m pytest " + shlex.join(pytest_args), "environment": env,
    }  # fmt: skip
    write_json(os.path.join(args.out, "gpu_tests.json"), data)
    log(
        f"tests: {data['passed']} passed, {data['failed']} failed, {data['skipped']} skipped, {data['errors']} errors,"
        f" {data['not_run']} not run of {data['collected']} in {data['duration_s']} s; recompiles {data['recompiles']}"
        f"; peak memory {data['peak_memory_gb']}"
    )
    if not_collected(data):
        log("tests: nothing proved:", not_collected(data))
    for failure in data["failures"]:
        log("  failed:", failure["test"], (failure["message"] or "").strip().splitlines()[-1:])
    return data


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
                for key in ("grpo", "attention"):  # model -> profile
                    for name, profiles in part.get(key, {}).items():
                        merged.setdefault(key, {}).setdefault(name, {}).update(profiles)
        path = os.path.join(directory, "gpu_tests.json")
        if os.path.exists(path):
            with open(path) as f:
                tests.append(json.load(f))
    if merged is None and not tests:
        raise SystemExit(f"No gpu.json or gpu_tests.json in {directories}.")
    os.makedirs(out, exist_ok=True)
    if merged is not None:
        measured = {f"{n} {k} {p}" for n, kinds in merged["results"].items() for k, ps in kinds.items() for p in ps}
        measured |= {f"{name} grpo {profile}" for name, profiles in merged["grpo"].items() for profile in profiles}
        merged["not_run"] = sorted({label for label in merged["not_run"] if label not in measured})
        merged.update(command=" && ".join(merged["commands"]), merged_by=command)
        write_bench(merged, out)
    if tests:
        write_json(os.path.join(out, "gpu_tests.json"), merge_tests(tests))


def merge_tests(parts) -> dict:
    """One `gpu_tests.json` from runs over parts of tests/cuda/test_cuda.py (`--tests-k`): counts summed, measurements
    and failures combined."""
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
    add = parser.add_argument
    add("--part", choices=list(PARTS), default="tests", help="tests (tests/cuda/test_cuda.py), bench-small (the 0.5B "
        "model), bench-large (the 3B model), bench (both), all (the three)")  # fmt: skip
    add("--out", required=True, help="folder for the files (created)")
    add("--dry-run", action="store_true", help="CPU, tiny models and lengths, the same code; nothing is measured")
    add("--deadline-s", type=float, default=None, help="start no new work after this many seconds (default 540 for "
        "one part, none for bench and all; 0 = none)")  # fmt: skip
    add("--merge", nargs="+", metavar="DIR", default=None, help="combine the gpu.json / gpu_tests.json of earlier "
        "parts into --out (no GPU needed)")  # fmt: skip
    add("--profiles", default=None, help=f"DPO/reward profiles (default: the paper's six; dry run: {DRY_PROFILES})")
    add("--kinds", default="dpo,reward,grpo")
    add("--skip-sdpa", action="store_true", help="leave out the variant that shares with SDPA's dense mask instead "
        "of FlexAttention (the kernel choice)")  # fmt: skip
    add("--skip-profile", action="store_true", help="leave out the profiled epoch per variant (GPU busy time per "
        "step and the top operators)")  # fmt: skip
    add("--tests-k", default=None, help="pytest -k expression: run part of tests/cuda/test_cuda.py (merge the parts' "
        "gpu_tests.json)")  # fmt: skip
    add("--jobs", type=int, default=1, help="tests: run tests/cuda/test_cuda.py in this many processes side by side "
        "on the one device (each takes every n-th test; their records and logs are combined)")  # fmt: skip
    add("--pairs", type=int, default=None, help="pairs per profile (default per model)")
    add("--repeats", type=int, default=None, help="timed epochs per variant (default per model)")
    add("--batch-size", type=int, default=None, help="pairs per step (default 8)")
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
        status |= bool(tests["failed"] or tests["errors"] or tests["not_run"] or not_collected(tests))
    if part["models"]:
        run_bench_part(args, env, command, deadline, part["models"])
    problems = check_outputs(args.out)
    sizes = (f"{n} ({os.path.getsize(os.path.join(args.out, n))} B)" for n in sorted(os.listdir(args.out)))
    log("files:", ", ".join(sizes))
    for problem in problems:
        log("output problem:", problem)
    return 2 if problems else status


if __name__ == "__main__":
    sys.exit(main())
