"""Vision-language DPO: stock TRL vs prefix sharing on image preference data (one image of 256-1024 tokens per
prompt, short questions and answers), a tiny Qwen2-VL from a config, CPU, the same weights and batches: per step of
`--batch-size` pairs, the language model's positions (padding included), the policy's vision-tower patches, and the
median `Trainer.training_step` of `--repeats` after a warm-up, the variants interleaved, in CPU time on `--threads`
torch threads (which a busy machine disturbs far less than wall time, reported too).

    python -m benchmarks.vision --repeats 6      # prints the Markdown table of docs/benchmarks/vision.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

from trl_prefix_sharing.testing.trainers import build_trainer

from .measure import rotations
from .models import quiet_setup
from .results import markdown_table, times


# image tokens per image -> image side in pixels (one merged token covers 8 x 8 pixels of the tiny processor)
PROFILES = {256: 128, 576: 192, 1024: 256}
VARIANTS = ["stock", "sharing"]


def run_profile(tokens, args, tmp):
    """Both trainers on one profile: positions and patches of the warm-up batch, median CPU and wall step times."""
    from trl_prefix_sharing.testing.vision import make_vision_model, make_vision_processor, synthetic_image_pairs

    side = PROFILES[tokens]
    processor = make_vision_processor("qwen2_vl", max_pixels=side * side)
    n, lengths = args.batch_size * (args.repeats + 1), dict(prompt_len=(12, 20), completion_len=(16, 32))
    dataset = synthetic_image_pairs(n, [[(side, side)]], seed=tokens, **lengths)
    model = make_vision_model(
        "qwen2_vl", processor, hidden_size=args.hidden_size, num_layers=args.layers, vision_depth=args.vision_depth
    )
    config = dict(model=model, ref_model=model, tokenizer=processor, train_dataset=dataset, max_length=None)
    config.update(per_device_train_batch_size=args.batch_size, bf16=False, use_cpu=True, gradient_checkpointing=False)
    trainers, patches = {}, {}
    for variant in VARIANTS:
        ours = {} if variant == "stock" else {"prefix_sharing": True}
        output_dir = os.path.join(tmp, f"{tokens}-{variant}")
        trainers[variant] = trainer = build_trainer("dpo", stock=not ours, output_dir=output_dir, **config, **ours)
        trainer.current_gradient_accumulation_steps = 1  # set by `train()`, read by `training_step`

        def hook(module, inputs, output, variant=variant):  # the patches of the policy's tower, one forward
            patches[variant] = inputs[0].shape[0]

        trainer.model.model.visual.register_forward_hook(hook)
    cpu, wall, counts = defaultdict(list), defaultdict(list), {}
    for b, order in enumerate(rotations(VARIANTS, args.repeats + 1)):
        examples = [dataset[i] for i in range(b * args.batch_size, (b + 1) * args.batch_size)]
        for variant in order:
            trainer = trainers[variant]
            trainer.model.train()
            batch = trainer.data_collator([dict(example) for example in examples])
            layout = batch.get("prefix_sharing")
            start, start_wall = time.process_time(), time.perf_counter()
            trainer.training_step(trainer.model, batch)
            elapsed, elapsed_wall = time.process_time() - start, time.perf_counter() - start_wall
            trainer.model.zero_grad(set_to_none=True)
            if b == 0:  # warm-up: count the work of one batch
                ids = batch["input_ids"] if layout is None else layout.input_ids
                counts[variant] = {"positions": ids.numel(), "patches": patches[variant]}
            else:
                cpu[variant].append(elapsed)
                wall[variant].append(elapsed_wall)
    row = {"tokens": tokens, "side": side}
    for variant, key in (("stock", "stock"), ("sharing", "shared")):
        row.update({f"{key}_positions": counts[variant]["positions"], f"{key}_patches": counts[variant]["patches"]})
        row.update({f"{key}_s": statistics.median(cpu[variant]), f"{key}_wall_s": statistics.median(wall[variant])})
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="256,576,1024", help="image tokens per image, comma-separated")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant, interleaved")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vision-depth", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    quiet_setup(False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in (int(t) for t in args.profiles.split(",")):
            rows.append(run_profile(tokens, args, tmp))
            print(rows[-1], file=sys.stderr)
    header = "image tokens|image (px)|LM positions / step, stock|shared|ratio|tower patches / forward, stock|shared|"
    header += "step CPU time stock (s)|shared (s)|speedup|wall-time speedup"
    cells = [
        [r["tokens"], f"{r['side']}x{r['side']}", r["stock_positions"], r["shared_positions"]]
        + [times(r["stock_positions"], r["shared_positions"]), r["stock_patches"], r["shared_patches"]]
        + [f"{r['stock_s']:.3f}", f"{r['shared_s']:.3f}", times(r["stock_s"], r["shared_s"])]
        + [times(r["stock_wall_s"], r["shared_wall_s"])]
        for r in rows
    ]
    print("\n".join(markdown_table(header, cells)))


if __name__ == "__main__":
    main()
