"""Where the time of a training step goes: stock TRL vs prefix sharing, on the benchmark's dataset profiles. The
trainers' own `compute_loss` + backward on fixed batches (no optimizer), timed per part: collation (and the layout),
the mask, the policy forward (of which attention and the log-prob head), the reference forward, the backward. A
warm-up pass, then `--repeats` passes per variant, alternating; the median step. Writes `profile_<mode>.md` and
`.json` to `--out`.

    python -m benchmarks.profile_step --profiles TLDR,UltraFeedback --repeats 2 --out docs/benchmarks
    python -m benchmarks.profile_step --mode gpu ...                  # CUDA, bf16, FlexAttention, ~0.5B model
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import types
from collections import defaultdict

import torch

from .data import single_token_words, synthetic_dataset
from .dpo import make_trainer
from .measure import rotations
from .models import add_model_options, build_model, check_model_options, quiet_setup
from .results import command_line, document, markdown_table, write_result


PARTS_HEADER = "part|stock (ms)|sharing (ms)|sharing / stock"
PARTS = ["collate", "mask", "policy forward", "  attention", "  log-prob head", "reference forward", "backward"]


class Clock:
    """Accumulates wall time per part (synchronising CUDA) into `step`, for one step at a time."""

    def __init__(self, cuda: bool):
        self.cuda, self.step = cuda, defaultdict(float)

    @contextlib.contextmanager
    def part(self, name):
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.step[name] += time.perf_counter() - start

    def wrap(self, name, fn):
        """`fn` timed as part `name`; a bound method stays bound to its object (prefix sharing's forward reads the
        model from the forward it wraps)."""

        def timed(*args, **kwargs):
            with self.part(name):
                return fn(*args, **kwargs)

        owner = getattr(fn, "__self__", None)
        return timed if owner is None else types.MethodType(lambda _owner, *a, **k: timed(*a, **k), owner)


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


def time_parts(kind, model, tokenizer, dataset, args, clock, tmp):
    """{variant: {part: median milliseconds per step}} of stock and sharing on one dataset."""
    trainers = {v: make_trainer(kind, v, model, tokenizer, dataset, args, tmp) for v in ("stock", "sharing")}
    for trainer in trainers.values():  # without the benchmark's counters and memory hooks; the forwards timed
        trainer.data_collator = trainer.data_collator.collator
        del trainer.compute_loss
        trainer.model.forward = clock.wrap(
            "policy forward", trainer.model.forward
        )  # ours wraps it already: this wraps that
        if getattr(trainer, "ref_model", None) is not None:
            trainer.ref_model.forward = clock.wrap("reference forward", trainer.ref_model.forward)
    rows = list(trainers["stock"].train_dataset)
    per_part = {v: defaultdict(list) for v in trainers}
    for round_, order in enumerate(rotations(trainers, args.repeats + 1)):
        for variant in order:
            trainer = trainers[variant]
            trainer.model.train()
            for i in range(0, len(rows), args.batch_size):
                clock.step = defaultdict(float)
                with clock.part("collate"):
                    batch = trainer._prepare_inputs(trainer.data_collator(rows[i : i + args.batch_size]))
                loss = trainer.compute_loss(trainer.model, batch)
                with clock.part("backward"):
                    loss.backward()
                trainer.model.zero_grad(set_to_none=True)
                clock.step["total"] = sum(t for k, t in clock.step.items() if not k.startswith("  "))
                for part in [*PARTS, "total"] if round_ else ():  # the first round: warm-up
                    per_part[variant][part].append(clock.step.get(part, 0.0))
    return {v: {part: 1000 * statistics.median(ts) for part, ts in parts.items()} for v, parts in per_part.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--profiles", default="TLDR,UltraFeedback")
    parser.add_argument("--kinds", default="dpo,reward")
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--length-scale", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per variant, alternating")
    add_model_options(parser)
    parser.add_argument("--out", default=None, help="write profile_<mode>.md and .json here")
    args = parser.parse_args()
    check_model_options(args)
    gpu = args.mode == "gpu"
    args.batch_size = args.batch_size or (8 if gpu else 4)
    args.length_scale = args.length_scale or (1.0 if gpu else 0.25)
    args.gradient_checkpointing = False
    command = command_line("profile_step")
    device, tokenizer = quiet_setup(gpu, args.model)
    vocabulary = single_token_words(tokenizer) if args.model != "tiny" else None
    clock = Clock(gpu)
    lines = document(
        f"# Where the step time goes ({args.mode.upper()})",
        f"Device: {device}. Command: `{command}`",
        "Milliseconds per step (median over the steps of the timed passes); attention and the log-prob head are "
        "forward time inside the forwards. `compute_loss` + backward on fixed batches of "
        f"{args.batch_size} pairs, no optimizer step.",
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp, instrumented(clock):
        for kind in args.kinds.split(","):
            model = build_model(kind, tokenizer, args)
            for profile in args.profiles.split(","):
                dataset = synthetic_dataset(profile, args.pairs, args.length_scale, seed=0, vocabulary=vocabulary)
                results[f"{kind}/{profile}"] = ms = time_parts(kind, model, tokenizer, dataset, args, clock, tmp)
                rows = []
                for part in [*PARTS, "total"]:
                    stock, shared = ms["stock"][part], ms["sharing"][part]
                    ratio = f"{shared / stock:.2f}" if stock else "-"
                    rows.append([part.replace("  ", "&nbsp;&nbsp;of which "), f"{stock:.1f}", f"{shared:.1f}", ratio])
                table = document(f"## {kind.upper()}, {profile}", markdown_table(PARTS_HEADER, rows))
                lines = document(lines, table)
                print("\n".join(table), flush=True)
    if args.out:
        data = {"command": command, "device": device, "model": args.model, "args": vars(args), "results": results}
        write_result(args.out, f"profile_{args.mode}", data, lines, echo=False)


if __name__ == "__main__":
    main()
