"""What the start-up check costs next to one training step: time and peak memory, DPO with prefix sharing.

The check runs once, at the first batch: a few examples of it (two prompts, two to four completions each) as stock
rows twice and as shared rows once, without gradients. A training step runs the whole micro-batch forward and
backward through the policy (and the reference forward). Both are measured on the same batch, the step as the median
of several; memory is the peak above the memory held before each (CUDA: allocated tensors; CPU: resident set size,
sampled every millisecond).

    PYTHONPATH=$PWD python scripts/benchmark_model_check.py [--hidden 256 --layers 8 --batch 8]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import torch


ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


class PeakMemory:
    """The peak memory above the level at entry (CUDA: allocated bytes; CPU: resident set size, sampled)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    @staticmethod
    def _rss() -> int:
        return int(pathlib.Path("/proc/self/statm").read_text().split()[1]) * 4096

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base, self._top, self._stop = self._rss(), 0, threading.Event()

            def sample():
                while not self._stop.is_set():
                    self._top = max(self._top, self._rss())
                    time.sleep(0.001)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._top, self._rss()) - self.base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="pairs per micro-batch")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import conftest  # noqa: F401  - quiet, 2 threads
    from custom_models import custom_model
    from equivalence import CPU_RUN

    from trl_prefix_sharing import DPOConfig, DPOTrainer
    from trl_prefix_sharing.testing import make_tokenizer, synthetic_pairs

    tokenizer = make_tokenizer()
    dataset = synthetic_pairs(64, (100, 300), (20, 60), seed=0)
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, initializer_range=0.2)
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.batch,
        max_length=None,
        prefix_sharing=True,
        **{**CPU_RUN, "use_cpu": not torch.cuda.is_available(), "bf16": False},
    )
    trainer = DPOTrainer(
        model=custom_model("ps_plain_decoder", len(tokenizer), **shape),
        ref_model=custom_model("ps_plain_decoder", len(tokenizer), seed=1, **shape),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    device = trainer.accelerator.device
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    parameters = sum(p.numel() for p in trainer.model.parameters())
    with PeakMemory(device) as check_memory:
        trainer._prepare_layout(batch)  # the start-up check, then the first batch laid out
    result = trainer.model_check.result
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by `train()`'s loop, which this calls a step of
    step_times, step_peaks = [], []
    for _ in range(args.steps + 1):
        with PeakMemory(device) as step_memory:
            start = time.perf_counter()
            trainer.training_step(trainer.model, batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
        step_peaks.append(step_memory.peak)
        trainer.model.zero_grad(set_to_none=True)
    step_time, step_peak = statistics.median(step_times[1:]), statistics.median(step_peaks[1:])
    stock_tokens = int(batch["attention_mask"].sum())
    print(f"device: {device}; model: custom plain decoder, {parameters / 1e6:.1f}M parameters, fp32")
    print(f"batch: {args.batch} pairs, {stock_tokens} stock tokens; check: {result.rows} rows, {result.summary()}")
    print("| | time (s) | peak memory above start (MiB) |")
    print("|---|---|---|")
    print(f"| start-up check (once) | {result.seconds:.3f} | {check_memory.peak / 2**20:.1f} |")
    print(f"| one training step (median of {args.steps}) | {step_time:.3f} | {step_peak / 2**20:.1f} |")
    print(f"| ratio | {result.seconds / step_time:.2f} | {check_memory.peak / max(step_peak, 1):.2f} |")


if __name__ == "__main__":
    main()
