"""Train stock TRL and prefix-shared DPO side by side on the shipped demo dataset, offline, on CPU.

    python scripts/demo.py [--steps 12] [--family llama]     (or: bash scripts/demo.sh, which sets up .venv first)

Prints both runs' losses step by step, the token positions each computed, and their speed. The two runs take turns,
one optimizer step each in alternating order (stock, shared, shared, stock, ...), each step timed while the other run
waits, and the speed is the median step time: a busy machine slows both alike instead of whichever ran second.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import tempfile
import threading
import time
import warnings


class TakeTurns:
    """Several `trainer.train()` runs, each in its own thread, doing their optimizer steps in turn: step i of every
    run, in an order that rotates with i. A run holds its turn from fetching a batch to the end of its step (timed),
    then waits for its next turn; no two runs compute at once. An error in one run releases the others."""

    def __init__(self, names: list[str], steps: int):
        # each run's turns: its steps, then one more to finish (its last step ends by waiting for a turn)
        self.order = [names[i % len(names) :] + names[: i % len(names)] for i in range(steps + 1)]
        self.schedule = [name for turn in self.order for name in turn]
        self.position = 0
        self.failed = False
        self.condition = threading.Condition()
        self.step_times = {name: [] for name in names}

    def wait(self, name: str) -> None:
        with self.condition:
            self.condition.wait_for(
                lambda: self.failed or self.position >= len(self.schedule) or self.schedule[self.position] == name
            )
            if self.failed:
                raise RuntimeError("another run failed")

    def done(self, name: str, failed: bool = False) -> None:
        with self.condition:
            self.failed = self.failed or failed
            if not failed and self.position < len(self.schedule) and self.schedule[self.position] == name:
                self.position += 1
            self.condition.notify_all()

    def callback(self, name: str):
        from transformers import TrainerCallback

        turns = self

        class Turn(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                turns.wait(name)
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                turns.step_times[name].append(time.perf_counter() - self.start)
                turns.done(name)
                turns.wait(name)
                self.start = time.perf_counter()

            def on_train_end(self, args, state, control, **kwargs):
                turns.done(name)

        return Turn()

    def run(self, trainers: dict) -> None:
        errors = []  # the first is the cause: the other runs fail only once it released them

        def train(name, trainer):
            try:
                trainer.train()
            except BaseException as error:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(error)
                self.done(name, failed=True)

        threads = [threading.Thread(target=train, args=item) for item in trainers.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)

    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    from trl_prefix_sharing.cli.quiet import quiet_unused_backends

    quiet_unused_backends()  # before TRL is imported: no bitsandbytes or DeepSpeed here
    import datasets
    import torch
    import trl
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging

    from trl_prefix_sharing import DPOConfig, DPOTrainer
    from trl_prefix_sharing.preference import logger as sharing_logger
    from trl_prefix_sharing.testing import load_demo_dataset, make_model, make_tokenizer

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    sharing_logger.setLevel("ERROR")  # its start-up summary is printed below, once
    torch.manual_seed(0)

    dataset = load_demo_dataset()
    words = sorted(
        {
            w
            for row in dataset
            for key in ("prompt", "chosen", "rejected")
            for w in re.findall(r"[^\W\d_]+|\d+", row[key])
        }
    )
    tokenizer = make_tokenizer(words)
    model = make_model(args.family, len(tokenizer), seed=0, hidden_size=args.hidden_size, num_layers=args.layers)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"Demo: {len(dataset)} preference pairs, {args.family} model with {params / 1e6:.1f}M parameters "
        f"(random init, built from config), CPU, fp32, {args.steps} steps of {args.batch_size} pairs."
    )

    names = ["stock TRL", "prefix sharing"]
    turns = TakeTurns(names, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name in names:
            common = dict(
                output_dir=os.path.join(tmp, name.replace(" ", "_")),
                per_device_train_batch_size=args.batch_size,
                max_steps=args.steps,
                learning_rate=5e-5,
                logging_steps=1,
                bf16=False,
                use_cpu=True,
                report_to="none",
                save_strategy="no",
                seed=0,
            )
            if name == "stock TRL":
                trainer_cls, config = trl.DPOTrainer, trl.DPOConfig(**common)
            else:
                trainer_cls, config = DPOTrainer, DPOConfig(prefix_sharing=True, **common)
            trainer = trainer_cls(
                model=copy.deepcopy(model),
                ref_model=copy.deepcopy(model),
                args=config,
                train_dataset=dataset,
                processing_class=tokenizer,
            )
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
            trainer.add_callback(turns.callback(name))
            trainers[name] = trainer
        turns.run(trainers)
    results = {
        name: {
            "logs": [log for log in trainer.state.log_history if "loss" in log],
            "trainer": trainer,
            "step": statistics.median(turns.step_times[name][1:] or turns.step_times[name]),
        }
        for name, trainer in trainers.items()
    }

    stock, shared = results["stock TRL"], results["prefix sharing"]
    print(shared["trainer"].sharing_stats.summary())
    print(f"\n{'step':>4}  {'stock TRL loss':>15}  {'prefix-shared loss':>19}  {'|difference|':>12}")
    worst = 0.0
    for a, b in zip(stock["logs"], shared["logs"], strict=True):
        diff = abs(a["loss"] - b["loss"])
        worst = max(worst, diff)
        print(f"{a['step']:>4}  {a['loss']:>15.6f}  {b['loss']:>19.6f}  {diff:>12.2e}")
    stock_tokens = int(stock["logs"][-1]["num_tokens"])
    shared_tokens = int(shared["logs"][-1]["num_shared_tokens"])
    print(f"\nlargest loss difference: {worst:.2e} (float32 round-off; the numbers are the same)")
    print(
        f"token positions computed by the policy: stock {stock_tokens:,}, prefix sharing {shared_tokens:,} "
        f"({stock_tokens / shared_tokens:.2f}x fewer)"
    )
    print(
        f"median step time (the runs take turns, step by step, first step left out): stock {stock['step']:.2f}s, "
        f"prefix sharing {shared['step']:.2f}s ({stock['step'] / shared['step']:.2f}x faster; a tiny model on CPU, "
        "see docs/benchmarks for measured ratios)"
    )
    if worst > 1e-4:
        raise SystemExit("The prefix-shared losses differ from stock TRL's: please report this as a bug.")


if __name__ == "__main__":
    main()
