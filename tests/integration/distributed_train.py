"""Launched by tests/integration/test_distributed.py through torch.distributed.run on CPU (gloo): one epoch of DPO or
reward training with prefix sharing and/or packing on data whose packed rows hold different numbers of pairs. Each rank
writes what it saw to --out.

`--replay_ranks N` (one process): each batch is the union of the i-th packed batches of the N ranks of a run on N
ranks, so each optimizer step sees the same pairs as there; with `--packing 0` it is an ordinary (stock-equal) batch,
whose loss is the plain mean over those pairs."""

import argparse
import json
import os
import sys
import warnings


warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_prefix_sharing import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer  # noqa: E402
from trl_prefix_sharing.packing import TrainerMultipackSampler  # noqa: E402
from trl_prefix_sharing.testing import make_config, make_model, make_tokenizer, synthetic_pairs  # noqa: E402
from trl_prefix_sharing.testing.equivalence import CPU_RUN  # noqa: E402


class CountBatches(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


class ReplayRanks(TrainerMultipackSampler):
    """One process yields, step by step, the union of the batches all `num_replicas` ranks take."""

    def __iter__(self):
        plan = self._plan()
        for i in range(len(plan[0])):
            yield [index for batches in plan for index in batches[i]]

    def __len__(self):
        return len(self._plan()[0])


def finish() -> None:
    """End the child right after its results are written: every rank passes a barrier, then exits without running
    interpreter-exit destructors. At exit, c10d/gloo teardown sometimes aborted a child ("terminate called without an
    active exception", SIGABRT) after all its work was done, failing a test for nothing of ours."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_trainer(args, tokenizer, dataset, eval_dataset=None):
    common = dict(
        output_dir=os.path.join(args.out, "run"),
        per_device_train_batch_size=args.batch_size,
        num_train_epochs=1,
        **CPU_RUN,
        prefix_sharing=bool(args.prefix_sharing),
        packing=bool(args.packing),
        learning_rate=1e-3,
        gradient_accumulation_steps=args.grad_accum,
    )
    if args.kind == "dpo" and args.model_type != "qwen2":
        from trl_prefix_sharing.testing.custom_models import (
            custom_model,  # a type outside the registry: the start-up check runs on each rank
        )

        model = custom_model(args.model_type, len(tokenizer), seed=0, initializer_range=0.2)
        ref = custom_model(args.model_type, len(tokenizer), seed=1, initializer_range=0.2)
        return DPOTrainer(
            model=model, ref_model=ref, args=DPOConfig(**common), train_dataset=dataset, processing_class=tokenizer
        )
    if args.kind == "dpo":
        model = make_model("qwen2", len(tokenizer), seed=0)
        ref = make_model("qwen2", len(tokenizer), seed=1)
        return DPOTrainer(
            model=model,
            ref_model=ref,
            args=DPOConfig(**common),
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
        )
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(
        make_config("llama", len(tokenizer), num_labels=1), attn_implementation="sdpa", dtype=torch.float32
    )
    return RewardTrainer(
        model=model,
        args=RewardConfig(**common, center_rewards_coefficient=0.01),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", choices=["dpo", "reward"], default="dpo")
    parser.add_argument("--prefix_sharing", type=int, default=1)
    parser.add_argument("--packing", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=3)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--replay_ranks", type=int, default=0)
    parser.add_argument("--evaluate", type=int, default=0, help="evaluate on a held-out set instead of training")
    parser.add_argument("--model_type", default="qwen2", help="DPO: qwen2, or a custom type of custom_models.py")
    args = parser.parse_args()
    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    dataset = synthetic_pairs(36, (1, 80), (1, 12), seed=21)
    eval_dataset = synthetic_pairs(13, (1, 60), (1, 12), seed=22) if args.evaluate else None
    trainer = make_trainer(args, tokenizer, dataset, eval_dataset)
    if args.evaluate:
        metrics = trainer.evaluate()
        with open(os.path.join(args.out, f"rank{trainer.args.process_index}.json"), "w") as f:
            json.dump({"world": trainer.args.world_size, "metrics": metrics}, f)
        finish()
    if args.replay_ranks:
        replay = ReplayRanks(
            trainer.packed_batches.unit_lengths(trainer.train_dataset),
            trainer.packed_batches.resolve_length(),
            num_replicas=args.replay_ranks,
            rank=0,
            seed=trainer.args.seed,
            shuffle=True,
        )
        trainer._get_train_sampler = lambda train_dataset=None: replay
    counter = CountBatches()
    trainer.add_callback(counter)
    loader = trainer.get_train_dataloader()
    sampler = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)
    batches = [list(b) for b in sampler] if args.packing or args.replay_ranks else []
    rank = trainer.args.process_index
    try:
        trainer.train()
    except ValueError as error:  # the start-up check's refusal, on every rank
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "error": str(error), "check": vars(trainer.model_check.result)}, f, default=str)
        finish()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": rank,
                "world": trainer.args.world_size,
                "batches": batches,
                "len": len(loader),
                "steps": counter.steps,
                "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                "pairs_per_batch": [len(b) for b in batches],
                "check": None if trainer.model_check.result is None else vars(trainer.model_check.result),
            },
            f,
            default=str,
        )
    finish()


if __name__ == "__main__":
    main()
