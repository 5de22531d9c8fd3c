"""Launched by tests/test_distributed.py as 2 CPU processes (gloo): DPO with prefix sharing and packing for one
epoch on data whose packed rows hold different numbers of pairs. Each rank writes what it saw to --out."""

import argparse
import json
import os
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_prefix_sharing import DPOConfig, DPOTrainer  # noqa: E402
from trl_prefix_sharing.tiny import make_model, make_tokenizer, synthetic_pairs  # noqa: E402


class CountBatches(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefix_sharing", type=int, default=1)
    parser.add_argument("--packing", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=3)
    parser.add_argument("--grad_accum", type=int, default=2)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    dataset = synthetic_pairs(36, (1, 80), (1, 12), seed=21)
    model = make_model("qwen2", len(tokenizer), seed=0)
    ref = make_model("qwen2", len(tokenizer), seed=1)
    config = DPOConfig(output_dir=os.path.join(args.out, "run"), per_device_train_batch_size=args.batch_size,
                       num_train_epochs=1, bf16=False, use_cpu=True, report_to="none", logging_steps=1,
                       save_strategy="no", seed=0, prefix_sharing=bool(args.prefix_sharing),
                       packing=bool(args.packing), learning_rate=1e-3, gradient_accumulation_steps=args.grad_accum)
    trainer = DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=dataset, processing_class=tokenizer)
    counter = CountBatches()
    trainer.add_callback(counter)
    loader = trainer.get_train_dataloader()
    sampler = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)
    batches = [list(b) for b in sampler] if args.packing else []
    trainer.train()
    rank = trainer.args.process_index
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": trainer.args.world_size, "batches": batches, "len": len(loader),
                   "steps": counter.steps, "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                   "pairs_per_batch": [len(b) for b in batches]}, f)


if __name__ == "__main__":
    main()
