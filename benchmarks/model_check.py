"""What the start-up check costs next to one training step, in time and peak memory (`measure.PeakMemory`), DPO with
prefix sharing on a tiny Llama, the check forced (`prefix_sharing_model_check="always"`). It runs once, at the first
batch (a few of its examples as stock rows twice and shared rows once, without gradients); a step runs the policy's
forward and backward and the reference forward on the same batch, the median of several.

    python -m benchmarks.model_check [--hidden-size 256 --layers 8 --batch-size 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from trl_prefix_sharing.testing.trainers import build_trainer

from .measure import PeakMemory
from .models import quiet_setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per micro-batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed training steps")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    import torch

    from trl_prefix_sharing.testing import make_model, synthetic_pairs

    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    _, tokenizer = quiet_setup(cuda)
    shape = dict(hidden_size=args.hidden_size, num_layers=args.layers, initializer_range=0.2)
    policy, reference = (make_model("llama", len(tokenizer), seed=seed, **shape) for seed in (0, 1))
    config = dict(per_device_train_batch_size=args.batch_size, max_length=None, use_cpu=not cuda, bf16=False)
    config.update(prefix_sharing=True, prefix_sharing_model_check="always", output_dir=tempfile.mkdtemp())
    dataset = synthetic_pairs(64, (100, 300), (20, 60), seed=0)
    trainer = build_trainer(
        "dpo", stock=False, model=policy, ref_model=reference, tokenizer=tokenizer, train_dataset=dataset, **config
    )
    device = trainer.accelerator.device
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with PeakMemory(device) as check_memory:
        trainer._prepare_layout(batch)  # the start-up check, then the first batch laid out
    result = trainer.model_check.result
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by `train()`'s loop, which this calls a step of
    step_times, step_peaks = [], []
    for _ in range(args.repeats + 1):  # the first: warm-up
        with PeakMemory(device) as step_memory:
            start = time.perf_counter()
            trainer.training_step(trainer.model, batch)
            if cuda:
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
        step_peaks.append(step_memory.peak)
        trainer.model.zero_grad(set_to_none=True)
    step_time, step_peak = statistics.median(step_times[1:]), statistics.median(step_peaks[1:])
    stock_tokens = int(batch["attention_mask"].sum())
    parameters = sum(p.numel() for p in trainer.model.parameters())
    print(f"device: {device}; model: tiny llama, {parameters / 1e6:.1f}M parameters, fp32")
    print(f"batch: {args.batch_size} pairs, {stock_tokens} stock tokens; check: {result.rows} rows,", result.summary())
    print("| | time (s) | peak memory above start (MiB) |\n|---|---|---|")
    print(f"| start-up check (once) | {result.seconds:.3f} | {check_memory.peak / 2**20:.1f} |")
    print(f"| one training step (median of {args.repeats}) | {step_time:.3f} | {step_peak / 2**20:.1f} |")
    print(f"| ratio | {result.seconds / step_time:.2f} | {check_memory.peak / max(step_peak, 1):.2f} |")


if __name__ == "__main__":
    main()
