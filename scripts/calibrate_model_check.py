"""Calibrate the start-up check's tolerance: the spread between two stock paddings of the same rows, the shared
layout's difference from stock, and the difference of three broken layouts, per compute dtype.

Models: the custom test types of ``tests/custom_models.py`` (a plain decoder, a windowed one, and the same weights
under three backbones that break the layout: positions from the row index, causal attention over the whole row, a
window counted in row positions), at three sizes and two initialisation scales (the default 0.02, nearly uniform
outputs as in the tests, and 0.2, sharper outputs closer to a trained model's; the largest size at 0.2 only), in
float32 and bfloat16. Rows: synthetic preference pairs (prompts of 20 to 200 words, answers of 4 to 40), two prompts
per check as the trainers run it, two seeds. Prints one JSON line per case and, with ``--markdown``, a table.

    PYTHONPATH=$PWD python scripts/calibrate_model_check.py --markdown docs/benchmarks/model_check.md
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch


ROOT = pathlib.Path(__file__).resolve().parents[1]
#: what follows this line in the markdown file is kept when the table is written again
TABLE_END = "<!-- end of the generated table -->"
sys.path.insert(0, str(ROOT / "tests"))


def examples(tokenizer, seed: int):
    from trl_prefix_sharing.testing import synthetic_pairs

    data = synthetic_pairs(2, (20, 200), (4, 40), seed=seed)
    out = []
    for row in data:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completions = [tokenizer(row[k], add_special_tokens=False)["input_ids"] for k in ("chosen", "rejected")]
        out.append((prompt, completions))
    return out


def measure(model, rows, tokenizer) -> dict:
    from trl_prefix_sharing.architectures import window_layout
    from trl_prefix_sharing.model_check import run_model_check
    from trl_prefix_sharing.session import PrefixSharingSession

    sharing = PrefixSharingSession([model], tokenizer, "sdpa", torch.device("cpu"), fuse_lm_head=True)
    sharing.attach()
    try:
        result = run_model_check(
            model,
            rows,
            lambda ids, mask, lengths, example_ids: sharing.layout(
                ids, mask, prompt_lengths=lengths, examples=example_ids
            ),
            "fused",
            sharing.pad_token_id,
            window=window_layout(model.config)[0],
        )
    finally:
        sharing.detach()
    if result.error:
        raise RuntimeError(result.error)
    return {"difference": result.difference, "spread": result.spread, "values": result.values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", type=pathlib.Path, help="write the table (and the command) to this file")
    args = parser.parse_args()

    import conftest  # noqa: F401  - quiet, 2 threads
    from custom_models import custom_model

    from trl_prefix_sharing.testing import make_tokenizer

    tokenizer = make_tokenizer()
    results = []
    sizes = {
        "tiny (32 wide, 2 layers)": dict(hidden_size=32, num_layers=2),
        "small (128 wide, 6 layers)": dict(hidden_size=128, num_layers=6),
        "medium (256 wide, 8 layers)": dict(hidden_size=256, num_layers=8),
    }
    cases = [("ps_plain_decoder", ("ps_row_positions", "ps_row_causal")), ("ps_windowed_decoder", ("ps_row_window",))]
    for size, shape in sizes.items():
        for init in (0.02, 0.2) if not size.startswith("medium") else (0.2,):
            for exact, broken in cases:
                for dtype in (torch.float32, torch.bfloat16):
                    for seed in range(2):
                        rows = examples(tokenizer, seed)
                        line = {"size": size, "init": init, "model": exact, "dtype": str(dtype)[6:], "seed": seed}
                        for model_type in (exact, *broken):
                            model = custom_model(model_type, len(tokenizer), initializer_range=init, **shape)
                            got = measure(model.to(dtype), rows, tokenizer)
                            if model_type == exact:
                                line.update(spread=got["spread"], shared=got["difference"], values=got["values"])
                            else:
                                line[model_type] = got["difference"]
                        print(json.dumps(line), flush=True)
                        results.append(line)
    if args.markdown:
        write_markdown(results, args.markdown)


def write_markdown(results, path: pathlib.Path) -> None:
    from trl_prefix_sharing.model_check import SPREAD_FACTOR, TOLERANCE

    groups: dict = {}
    for line in results:
        groups.setdefault((line["dtype"], line["size"], line["init"], line["model"]), []).append(line)
    broken = ("ps_row_positions", "ps_row_causal", "ps_row_window")
    lines = [
        "| dtype | model | init | stock vs stock (spread) | shared vs stock | broken layouts (smallest) | tolerance |",
        "|---|---|---|---|---|---|---|",
    ]
    for (dtype, size, init, model), group in sorted(groups.items()):
        spread = max(g["spread"] for g in group)
        shared = max(g["shared"] for g in group)
        worst = {b: min(g[b] for g in group) for b in broken if b in group[0]}
        tolerance = max(TOLERANCE[getattr(torch, dtype)], SPREAD_FACTOR * spread)
        lines.append(
            f"| {dtype} | {model}, {size} | {init} | {spread:.2g} | {shared:.2g} | "
            + ", ".join(f"{b.removeprefix('ps_')} {v:.2g}" for b, v in worst.items())
            + f" | {tolerance:.2g} |"
        )
    tail = path.read_text().partition(TABLE_END)[2] if path.exists() else "\n"
    path.write_text(
        "# Start-up check: calibration\n\nLargest per-token log-prob difference over two seeds (the largest spread "
        "and shared difference, the smallest broken difference), from\n\n"
        "    PYTHONPATH=$PWD python scripts/calibrate_model_check.py --markdown docs/benchmarks/model_check.md\n\n"
        + "\n".join(lines)
        + "\n\n"
        + TABLE_END
        + tail
    )


if __name__ == "__main__":
    main()
