"""Where the time of a training step goes: stock TRL vs prefix sharing, on one of the benchmark's dataset profiles.

    python scripts/profile_step.py --profiles TLDR,UltraFeedback --rounds 2 --out docs/benchmarks/profile_cpu.md
    python scripts/profile_step.py --mode gpu ...                  # CUDA, bf16, FlexAttention, ~0.5B model

Runs the trainers' own `compute_loss` + backward on fixed batches (no optimizer) and times, per step: collation
(stock collator, plus the shared layout for ours), building the mask, the policy forward (of which attention and the
log-prob head), the reference forward (DPO), and the backward. Attention and head are forward time only, inside the
forwards. Each variant runs a warm-up pass, then the variants alternate; the median step is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import types
from collections import defaultdict


sys.path.insert(0, os.path.dirname(__file__))

import benchmark  # noqa: E402  (the same data, models and trainers as the benchmark)


PARTS = ["collate", "mask", "policy forward", "  attention", "  log-prob head", "reference forward", "backward"]


class Clock:
    """Accumulates wall time per part (synchronising CUDA), for one step at a time."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.step: dict[str, float] = defaultdict(float)
        self.enabled = True

    def _sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    @contextlib.contextmanager
    def part(self, name):
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.step[name] += time.perf_counter() - start

    def wrap(self, name, fn):
        """`fn` timed as part `name`; a bound method stays bound to its object (prefix sharing's forward reads the
        model from the forward it wraps)."""

        def timed(*args, **kwargs):
            with self.part(name):
                return fn(*args, **kwargs)

        owner = getattr(fn, "__self__", None)
        if owner is None:
            return timed
        return types.MethodType(lambda _owner, *args, **kwargs: timed(*args, **kwargs), owner)


@contextlib.contextmanager
def instrumented(clock: Clock):
    """Time attention (every registered implementation), the fused log-prob head and the attention inputs (the
    session's `with_attention`: a mask, or the varlen kernel's segments)."""
    import trl.trainer.utils as trl_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from trl_prefix_sharing.session import PrefixSharingSession
    from trl_prefix_sharing.varlen import VARLEN_ATTENTION

    saved_attention = {
        name: ALL_ATTENTION_FUNCTIONS[name]
        for name in ("sdpa", "flex_attention", "eager", VARLEN_ATTENTION)
        if name in ALL_ATTENTION_FUNCTIONS
    }
    head = trl_utils._ChunkedLogProbFunction
    mask_builder = PrefixSharingSession.with_attention

    class TimedHead:
        @staticmethod
        def apply(*args):
            with clock.part("  log-prob head"):
                return head.apply(*args)

    try:
        for name, fn in saved_attention.items():
            ALL_ATTENTION_FUNCTIONS[name] = clock.wrap("  attention", fn)
        trl_utils._ChunkedLogProbFunction = TimedHead
        PrefixSharingSession.with_attention = clock.wrap("mask", mask_builder)
        yield
    finally:
        for name, fn in saved_attention.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn
        trl_utils._ChunkedLogProbFunction = head
        PrefixSharingSession.with_attention = mask_builder


def profile_trainer(trainer, clock: Clock, steps: list[list[dict]]):
    """One pass over `steps` (lists of examples): a list of {part: seconds} per step."""
    policy = trainer.model
    reference = getattr(trainer, "ref_model", None)
    policy_forward = policy.forward
    policy.forward = clock.wrap("policy forward", policy_forward)
    if reference is not None:
        reference_forward = reference.forward
        reference.forward = clock.wrap("reference forward", reference_forward)
    timings = []
    try:
        trainer.model.train()
        for examples in steps:
            clock.step = defaultdict(float)
            with clock.part("collate"):
                batch = trainer._prepare_inputs(trainer.data_collator(examples))
            loss = trainer.compute_loss(trainer.model, batch)
            with clock.part("backward"):
                loss.backward()
            trainer.model.zero_grad(set_to_none=True)
            timings.append(dict(clock.step))
    finally:  # the wraps sit on the instances (ours already wraps the forward: put back exactly what was there)
        policy.forward = policy_forward
        if reference is not None:
            reference.forward = reference_forward
    return timings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--profiles", default="TLDR,UltraFeedback")
    parser.add_argument("--kinds", default="dpo,reward")
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--length-scale", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args()
    gpu = args.mode == "gpu"
    args.batch_size = args.batch_size or (8 if gpu else 4)
    args.length_scale = args.length_scale or (1.0 if gpu else 0.25)
    args.gradient_checkpointing = False
    command = "python scripts/profile_step.py " + " ".join(sys.argv[1:])

    import tempfile

    device, tokenizer = benchmark.quiet_setup(gpu)
    clock = Clock(gpu)
    lines = [
        f"# Where the step time goes ({args.mode.upper()})",
        "",
        f"Device: {device}. Command: `{command}`",
        "",
        "Milliseconds per step (median over the steps of the timed passes); attention and the log-prob head are "
        "forward time inside the forwards. `compute_loss` + backward on fixed batches of "
        f"{args.batch_size} pairs, no optimizer step.",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp, instrumented(clock):
        for kind in args.kinds.split(","):
            model = benchmark.build_model(kind, tokenizer, args)
            for profile in args.profiles.split(","):
                dataset = benchmark.synthetic_dataset(profile, args.pairs, args.length_scale, seed=0)
                trainers = {
                    v: benchmark.make_trainer(kind, v, model, tokenizer, dataset, args, tmp)
                    for v in ("stock", "sharing")
                }
                for trainer in trainers.values():  # without the benchmark's counters and memory hooks
                    trainer.data_collator = trainer.data_collator.collator
                    del trainer.compute_loss
                rows = [trainers["stock"].train_dataset[i] for i in range(len(trainers["stock"].train_dataset))]
                steps = [rows[i : i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
                per_part = {v: defaultdict(list) for v in trainers}
                for round_ in range(args.rounds + 1):
                    for variant, trainer in trainers.items():
                        timings = profile_trainer(trainer, clock, steps)
                        if round_ == 0:
                            continue  # warm-up
                        for step in timings:
                            for part in PARTS:
                                per_part[variant][part].append(step.get(part, 0.0))
                            per_part[variant]["total"].append(
                                sum(v for k, v in step.items() if not k.startswith("  "))
                            )
                lines += [
                    f"## {kind.upper()}, {profile}",
                    "",
                    "| part | stock (ms) | sharing (ms) | sharing / stock |",
                    "|---|---|---|---|",
                ]
                for part in PARTS + ["total"]:
                    stock_ms = 1000 * statistics.median(per_part["stock"][part])
                    shared_ms = 1000 * statistics.median(per_part["sharing"][part])
                    ratio = f"{shared_ms / stock_ms:.2f}" if stock_ms > 0 else "-"
                    label = part.replace("  ", "&nbsp;&nbsp;of which ")
                    lines.append(f"| {label} | {stock_ms:.1f} | {shared_ms:.1f} | {ratio} |")
                lines.append("")
                print("\n".join(lines[-(len(PARTS) + 5) :]), flush=True)
                del trainers
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
