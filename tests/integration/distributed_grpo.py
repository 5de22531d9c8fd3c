"""Launched by tests/integration/test_grpo_distributed.py through torch.distributed.run on CPU (gloo): GRPO, stock or
prefix-shared, on 2 processes with 6 rows each and groups of 4 generations, so one group straddles the two processes.
Each rank writes its logs and final weights to --out."""

import argparse
import json
import os
import sys
import warnings


warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import datasets  # noqa: E402
import torch  # noqa: E402
from distributed_train import finish  # noqa: E402

from trl_prefix_sharing import tuning  # noqa: E402
from trl_prefix_sharing.testing import PreferredKernelTimer, make_tokenizer  # noqa: E402
from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, prompt_dataset, save_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefix_sharing", type=int, required=True)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    from pathlib import Path

    model = str(Path(args.out) / "llama")
    if int(os.environ.get("RANK", 0)) == 0 and not os.path.exists(model):
        save_model(Path(args.out), "llama", tokenizer)
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()
    trainer = make_group_trainer(
        "grpo",
        bool(args.prefix_sharing),
        model,
        prompt_dataset(12),
        tokenizer,
        Path(args.out),
        per_device_train_batch_size=6,
        max_steps=2,
        beta=0.1,
    )
    tuning.set_timer(PreferredKernelTimer(runs=True))  # measured in two processes; the positions compared: shared
    torch.manual_seed(0)
    trainer.train()
    rank = trainer.args.process_index
    logs = [
        {k: v for k, v in log.items() if isinstance(v, (int, float))}
        for log in trainer.state.log_history
        if "loss" in log
    ]
    weights = {n: p.detach().flatten()[:64].tolist() for n, p in trainer.model.named_parameters()}
    with open(os.path.join(args.out, f"rank{rank}-{args.prefix_sharing}.json"), "w") as f:
        json.dump({"world": trainer.args.world_size, "logs": logs, "weights": weights}, f)
    finish()


if __name__ == "__main__":
    main()
