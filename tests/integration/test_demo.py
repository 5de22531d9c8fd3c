"""The demo: stock TRL and prefix sharing take turns step by step (so a busy machine slows both alike), its output
prints the start-up summary once, and no start-up line from libraries it does not use (bitsandbytes, DeepSpeed)."""

import itertools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trl_prefix_sharing.cli.quiet import STARTUP_LINES
from trl_prefix_sharing.testing import synthetic_pairs
from trl_prefix_sharing.testing.equivalence import make_trainers


DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"
sys.path.insert(0, str(DEMO.parent))
from demo import TakeTurns  # noqa: E402


pytestmark = pytest.mark.long  # starts other processes: `bash scripts/test.sh --all`


def run_demo(tmp_path, *args, timeout=240):
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = proc.stdout + proc.stderr
    assert "median step time (the runs take turns" in output and "x faster" in output
    for _, line in STARTUP_LINES.values():
        assert line not in output
    return output


def largest_difference(output) -> float:
    return float(re.search(r"largest loss difference: (\S+)", output).group(1))


def test_demo_output(tmp_path):
    output = run_demo(tmp_path, "--quick", "--steps", "3", "--hidden-size", "32", "--layers", "1")
    assert output.count("Prefix sharing: the first training micro-batch computes") == 1
    assert largest_difference(output) < 1e-4
    assert "training: 100%" in output  # the progress bar, on although the environment turns library bars off


def test_demo_on_the_real_model(tmp_path):
    """The README's main command: SmolLM2-135M-Instruct on the chat data, each step one question's three pairs."""
    from trl_prefix_sharing.testing.real_model import RealModelMissing, smollm2_path

    try:
        smollm2_path()  # converted here once, outside the demo's time limit
    except RealModelMissing as error:
        pytest.skip(str(error))
    output = run_demo(tmp_path, "--steps", "2", timeout=600)
    assert "SmolLM2-135M-Instruct (134.5M parameters)" in output
    assert output.count("Prefix sharing: the first training micro-batch computes") == 1
    assert largest_difference(output) < 1e-4
    fewer = float(re.search(r"token positions computed by the policy: .*\((\S+)x fewer\)", output).group(1))
    assert fewer > 3  # a 221-token system prompt and question computed once for six answers


def test_tiny_model_options_need_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(DEMO), "--layers", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--layers choose the tiny model of --quick" in proc.stderr


def test_runs_take_turns_step_by_step(tmp_path, tokenizer):
    """No two runs compute at once, and the order rotates: step i of every run before step i + 1 of any."""
    from transformers import TrainerCallback

    stock, shared = make_trainers(
        tmp_path,
        "llama",
        synthetic_pairs(12, (5, 30), (1, 6), seed=3),
        tokenizer,
        max_steps=3,
        per_device_train_batch_size=2,
    )
    events = []

    class Record(TrainerCallback):
        def __init__(self, name):
            self.name = name

        def on_step_begin(self, args, state, control, **kwargs):
            events.append((self.name, "begin", time.perf_counter()))
            time.sleep(0.05)  # a run that overlapped another would show it here

        def on_step_end(self, args, state, control, **kwargs):
            events.append((self.name, "end", time.perf_counter()))

    turns = TakeTurns(["stock", "shared"], steps=3)
    trainers = {"stock": stock, "shared": shared}
    for name, trainer in trainers.items():
        trainer.add_callback(Record(name))  # before the turn callback: its on_step_end runs inside the turn
        trainer.add_callback(turns.callback(name))
    turns.run(trainers)
    names = [name for name, kind, _ in events if kind == "begin"]
    assert names == ["stock", "shared", "shared", "stock", "stock", "shared"]
    for (name, kind, _), (next_name, next_kind, _) in itertools.pairwise(events):
        assert kind != next_kind and (kind == "end" or name == next_name)  # begin/end pairs never interleave
    assert all(len(times) == 3 and min(times) > 0 for times in turns.step_times.values())


def test_a_failing_run_releases_the_other(tmp_path, tokenizer):
    stock, shared = make_trainers(
        tmp_path,
        "llama",
        synthetic_pairs(8, (5, 30), (1, 6), seed=3),
        tokenizer,
        max_steps=2,
        per_device_train_batch_size=2,
    )
    turns = TakeTurns(["stock", "shared"], steps=2)

    def broken(*args, **kwargs):
        raise KeyError("broken on purpose")

    shared.compute_loss = broken
    for name, trainer in (("stock", stock), ("shared", shared)):
        trainer.add_callback(turns.callback(name))
    with pytest.raises(KeyError, match="broken on purpose"):
        turns.run({"stock": stock, "shared": shared})


def test_each_run_draws_from_its_own_random_stream(tmp_path, tokenizer):
    """Sampled generation (GRPO) draws from the process-wide generators, which the runs' threads share: each run
    draws what it would draw alone, as if the other did not exist."""
    from transformers import TrainerCallback

    def draws(runs):
        trainers = {}
        drawn = {}
        for name in runs:
            stock, _ = make_trainers(
                tmp_path,
                "llama",
                synthetic_pairs(6, (5, 10), (1, 3), seed=3),
                tokenizer,
                max_steps=3,
                per_device_train_batch_size=2,
            )
            drawn[name] = []

            class Draw(TrainerCallback):
                def on_step_begin(self, args, state, control, name=name, **kwargs):
                    drawn[name].append(torch.rand(1).item())

            stock.add_callback(Draw())
            trainers[name] = stock
        turns = TakeTurns(list(runs), steps=3)
        for name, trainer in trainers.items():
            trainer.add_callback(turns.callback(name))
        turns.run(trainers)
        return drawn

    alone = draws(["a"])["a"]
    together = draws(["a", "b"])
    assert len(alone) == 3 and together["a"] == alone and together["b"] == alone
