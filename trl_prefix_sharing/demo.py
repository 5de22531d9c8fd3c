"""Train stock TRL and prefix-shared DPO side by side on the shipped demo dataset, offline, on CPU.

    python -m trl_prefix_sharing.demo [--steps 12] [--family llama]

Prints both runs' losses step by step, the token positions each computed, and the wall time of each.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import tempfile
import time
import warnings


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
    import datasets
    import torch
    import trl
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging

    from trl_prefix_sharing import DPOConfig, DPOTrainer
    from trl_prefix_sharing.tiny import load_demo_dataset, make_model, make_tokenizer

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)

    dataset = load_demo_dataset()
    words = sorted({w for row in dataset for key in ("prompt", "chosen", "rejected")
                    for w in re.findall(r"[^\W\d_]+|\d+", row[key])})
    tokenizer = make_tokenizer(words)
    model = make_model(args.family, len(tokenizer), seed=0, hidden_size=args.hidden_size, num_layers=args.layers)
    params = sum(p.numel() for p in model.parameters())
    print(f"Demo: {len(dataset)} preference pairs, {args.family} model with {params / 1e6:.1f}M parameters "
          f"(random init, built from config), CPU, fp32, {args.steps} steps of {args.batch_size} pairs.")

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("stock TRL", "prefix sharing"):
            common = dict(output_dir=os.path.join(tmp, name.replace(" ", "_")), per_device_train_batch_size=args.batch_size,
                          max_steps=args.steps, learning_rate=5e-5, logging_steps=1, bf16=False, use_cpu=True,
                          report_to="none", save_strategy="no", seed=0)
            if name == "stock TRL":
                trainer_cls, config = trl.DPOTrainer, trl.DPOConfig(**common)
            else:
                trainer_cls, config = DPOTrainer, DPOConfig(prefix_sharing=True, **common)
            trainer = trainer_cls(model=copy.deepcopy(model), ref_model=copy.deepcopy(model), args=config,
                                  train_dataset=dataset, processing_class=tokenizer)
            trainer.remove_callback(PrinterCallback)
            trainer.remove_callback(ProgressCallback)
            start = time.perf_counter()
            trainer.train()
            elapsed = time.perf_counter() - start
            logs = [log for log in trainer.state.log_history if "loss" in log]
            results[name] = {"logs": logs, "time": elapsed, "trainer": trainer}

    stock, shared = results["stock TRL"], results["prefix sharing"]
    print(f"\n{'step':>4}  {'stock TRL loss':>15}  {'prefix-shared loss':>19}  {'|difference|':>12}")
    worst = 0.0
    for a, b in zip(stock["logs"], shared["logs"]):
        diff = abs(a["loss"] - b["loss"])
        worst = max(worst, diff)
        print(f"{a['step']:>4}  {a['loss']:>15.6f}  {b['loss']:>19.6f}  {diff:>12.2e}")
    stock_tokens = int(stock["logs"][-1]["num_tokens"])
    shared_tokens = int(shared["logs"][-1]["num_shared_tokens"])
    print(f"\nlargest loss difference: {worst:.2e} (float32 round-off; the numbers are the same)")
    print(f"token positions computed by the policy: stock {stock_tokens:,}, prefix sharing {shared_tokens:,} "
          f"({stock_tokens / shared_tokens:.2f}x fewer)")
    print(f"training time: stock {stock['time']:.1f}s, prefix sharing {shared['time']:.1f}s "
          f"({stock['time'] / shared['time']:.2f}x faster; this machine is noisy, see docs/benchmarks for ratios)")
    print(shared["trainer"].sharing_stats.summary())
    if worst > 1e-4:
        raise SystemExit("The prefix-shared losses differ from stock TRL's: please report this as a bug.")


if __name__ == "__main__":
    main()
