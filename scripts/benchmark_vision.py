"""Vision-language DPO: stock TRL vs prefix sharing on image preference data (one image per prompt, 256-1024 image
tokens, a short question, short answers), tiny Qwen2-VL built from a config, CPU.

    python scripts/benchmark_vision.py      # prints the Markdown table of docs/benchmarks/vision.md

For each profile (image tokens per image), both trainers get the same randomly initialised policy and reference and
the same batches. Reported per step (one batch of `--batch-size` pairs): the positions the language model runs
(padding included), the image patches the policy's vision tower runs, and the time of a training step (policy forward
+ backward, reference forward: `Trainer.training_step`), the median of `--steps` timed steps per variant after a
warm-up step, the two variants interleaved. Time is the process's CPU time on `--threads` torch threads (default 1),
which a shared, busy machine disturbs far less than wall time; wall time is printed too.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings


# image tokens per image -> image side in pixels (one merged token covers 8 x 8 pixels of the tiny processor)
PROFILES = {256: 128, 576: 192, 1024: 256}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="256,576,1024", help="image tokens per image, comma-separated")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vision-depth", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()

    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    import datasets
    import torch
    import trl

    from trl_prefix_sharing import DPOConfig, DPOTrainer
    from trl_prefix_sharing.testing.vision import make_vision_model, make_vision_processor, synthetic_image_pairs

    datasets.disable_progress_bars()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    tmp = tempfile.mkdtemp()
    for tokens in (int(t) for t in args.profiles.split(",")):
        side = PROFILES[tokens]
        processor = make_vision_processor("qwen2_vl", max_pixels=side * side)
        dataset = synthetic_image_pairs(
            args.batch_size * (args.steps + 1),
            [[(side, side)]],
            prompt_len=(12, 20),
            completion_len=(16, 32),
            seed=tokens,
        )
        model = make_vision_model(
            "qwen2_vl", processor, hidden_size=args.hidden_size, num_layers=args.layers, vision_depth=args.vision_depth
        )
        common = dict(
            output_dir=os.path.join(tmp, str(tokens)),
            per_device_train_batch_size=args.batch_size,
            bf16=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            max_length=None,
            seed=0,
            gradient_checkpointing=False,
            disable_tqdm=True,
        )
        trainers = {
            "stock": trl.DPOTrainer(
                model=copy.deepcopy(model),
                ref_model=copy.deepcopy(model),
                args=trl.DPOConfig(**common),
                train_dataset=dataset,
                processing_class=processor,
            ),
            "sharing": DPOTrainer(
                model=copy.deepcopy(model),
                ref_model=copy.deepcopy(model),
                args=DPOConfig(prefix_sharing=True, **common),
                train_dataset=dataset,
                processing_class=processor,
            ),
        }
        batches = [
            [dataset[i] for i in range(b * args.batch_size, (b + 1) * args.batch_size)] for b in range(args.steps + 1)
        ]
        for trainer in trainers.values():
            trainer.current_gradient_accumulation_steps = 1  # set by `train()`, read by `training_step`
        patches = {}
        for name, trainer in trainers.items():

            def hook(module, inputs, output, name=name, patches=patches):
                patches[name] = inputs[0].shape[0]

            trainer.model.model.visual.register_forward_hook(hook)
        times = {name: [] for name in trainers}
        walls = {name: [] for name in trainers}
        counts = {}
        for b, examples in enumerate(batches):
            order = list(trainers) if b % 2 == 0 else list(reversed(trainers))
            for name in order:
                trainer = trainers[name]
                trainer.model.train()
                batch = trainer.data_collator([dict(example) for example in examples])
                layout = batch.get("prefix_sharing")
                start, start_wall = time.process_time(), time.perf_counter()
                trainer.training_step(trainer.model, batch)
                elapsed, wall = time.process_time() - start, time.perf_counter() - start_wall
                trainer.model.zero_grad(set_to_none=True)
                if b == 0:  # warm-up; count the work of one batch (patches: the policy's tower, one forward)
                    counts[name] = {
                        "positions": (layout if layout is not None else batch)["input_ids"].numel(),
                        "patches": patches[name],
                    }
                else:
                    times[name].append(elapsed)
                    walls[name].append(wall)
        stock_t, shared_t = (statistics.median(times[name]) for name in ("stock", "sharing"))
        stock_w, shared_w = (statistics.median(walls[name]) for name in ("stock", "sharing"))
        row = {
            "tokens": tokens,
            "side": side,
            "stock_positions": counts["stock"]["positions"],
            "shared_positions": counts["sharing"]["positions"],
            "stock_patches": counts["stock"]["patches"],
            "shared_patches": counts["sharing"]["patches"],
            "stock_s": stock_t,
            "shared_s": shared_t,
            "stock_wall_s": stock_w,
            "shared_wall_s": shared_w,
        }
        rows.append(row)
        print(row, file=sys.stderr)

    lines = [
        "| image tokens | image (px) | LM positions / step, stock | shared | ratio | tower patches / forward, stock "
        "| shared | step CPU time stock (s) | shared (s) | speedup | wall-time speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['side']}x{r['side']} | {r['stock_positions']} | {r['shared_positions']} | "
            f"{r['stock_positions'] / r['shared_positions']:.2f}x | {r['stock_patches']} | {r['shared_patches']} | "
            f"{r['stock_s']:.3f} | {r['shared_s']:.3f} | {r['stock_s'] / r['shared_s']:.2f}x | "
            f"{r['stock_wall_s'] / r['shared_wall_s']:.2f}x |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
