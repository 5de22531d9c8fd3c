"""Calibrate the start-up check's tolerance: the spread between two stock paddings of the same rows, the shared
layout's difference from stock, and the difference of three broken layouts, per compute dtype.

Models (``--models``, comma-separated):

- ``custom``: the custom test types of ``trl_prefix_sharing/testing/custom_models.py`` (a plain decoder, a windowed
one, and the same
  weights under three backbones that break the layout: positions from the row index, causal attention over the whole
  row, a window counted in row positions), at three sizes and two initialisation scales (the default 0.02, nearly
  uniform outputs as in the tests, and 0.2, sharper outputs closer to a trained model's; the largest size at 0.2
  only). Rows: synthetic preference pairs (prompts of 20 to 200 words, answers of 4 to 40).
- ``smollm2``: the trained SmolLM2-135M-Instruct (a Llama, loaded offline by
  ``trl_prefix_sharing.testing.real_model.load_smollm2``; without it installed this fails with the loader's
  ``RealModelMissing`` and its install line), and the same weights under the custom types' broken backbones
  (positions from the row index, causal attention over the whole row; it has no sliding window, so no window layout).
  Rows: English chat prompts (system and user message through its chat template) with a chosen and a rejected
  answer of 10 to 60 tokens, written below.

Each in float32 and bfloat16, two prompts per check as the trainers run it, two seeds. Prints one JSON line per case
and, with ``--markdown``, a table.

    PYTHONPATH=$PWD python scripts/calibrate_model_check.py --models custom,smollm2 \\
        --markdown docs/benchmarks/model_check.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

import torch


ROOT = pathlib.Path(__file__).resolve().parents[1]
#: what follows this line in the markdown file is kept when the table is written again
TABLE_END = "<!-- end of the generated table -->"
sys.path.insert(0, str(ROOT / "tests"))


#: the models `--models` names
MODELS = ("custom", "smollm2")
#: the real model's rows: English chat prompts, each with a chosen and a rejected answer of 10 to 60 tokens; seed `s`
#: checks prompts `2s` and `2s + 1`
CHAT_PAIRS = [
    {
        "system": "You are a helpful assistant who answers questions about science in plain words.",
        "user": "Why is the sky blue during the day but red and orange at sunset?",
        "chosen": "Sunlight is scattered by the air, and blue light scatters the most, so the sky looks blue. At "
        "sunset the light crosses much more air, most of the blue is scattered away, and the reds and oranges are "
        "left.",
        "rejected": "The sky is blue because it reflects the colour of the oceans.",
    },
    {
        "system": "You are a friendly cooking assistant. Keep your answers short and practical.",
        "user": "I have eggs, spinach, some cheese and a bit of bread. What can I make for a quick dinner?",
        "chosen": "Make a spinach and cheese omelette: wilt the spinach in a pan, pour in the beaten eggs, add the "
        "cheese and fold it. Toast the bread and serve it on the side.",
        "rejected": "You should go to the shop and buy something else, because those do not make a meal.",
    },
    {
        "system": "You are a patient tutor. Explain things step by step to a student who is learning on their own.",
        "user": "What is the difference between weather and climate? My textbook uses both words and I keep mixing "
        "them up.",
        "chosen": "Weather is what the air does on a given day: rain, sun, wind, temperature. Climate is the "
        "average of the weather over many years in one place. A cold day is weather; cold winters every year are "
        "climate.",
        "rejected": "They mean the same thing, so you can use either word.",
    },
    {
        "system": "You are an assistant who helps people write clear and polite emails at work.",
        "user": "Write a short email to my manager asking if I can move our Friday meeting to Monday morning.",
        "chosen": "Hi Sarah,\n\nWould it be possible to move our Friday meeting to Monday morning? Something has "
        "come up on Friday afternoon. Any time before noon on Monday works for me.\n\nThank you,\nTom",
        "rejected": "Friday does not work. We are meeting on Monday.",
    },
]


def examples(tokenizer, seed: int):
    from trl_prefix_sharing.testing import synthetic_pairs

    data = synthetic_pairs(2, (20, 200), (4, 40), seed=seed)
    out = []
    for row in data:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completions = [tokenizer(row[k], add_special_tokens=False)["input_ids"] for k in ("chosen", "rejected")]
        out.append((prompt, completions))
    return out


def chat_examples(tokenizer, seed: int):
    """Two of `CHAT_PAIRS` through the chat template, as TRL lays out a conversational preference pair: the prompt
    with the generation prompt, each answer the rest of the whole conversation's text."""
    out = []
    for pair in CHAT_PAIRS[2 * seed : 2 * seed + 2]:
        messages = [{"role": "system", "content": pair["system"]}, {"role": "user", "content": pair["user"]}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        completions = []
        for key in ("chosen", "rejected"):
            whole = tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": pair[key]}], tokenize=False
            )
            assert whole.startswith(prompt), (prompt, whole)
            completions.append(tokenizer(whole[len(prompt) :], add_special_tokens=False)["input_ids"])
        out.append((tokenizer(prompt, add_special_tokens=False)["input_ids"], completions))
    return out


def measure(model, rows, tokenizer) -> dict:
    from trl_prefix_sharing.architectures import window_layout
    from trl_prefix_sharing.attention import BACKENDS
    from trl_prefix_sharing.model_check import check_layout_fn, run_model_check
    from trl_prefix_sharing.session import PrefixSharingSession

    sharing = PrefixSharingSession([model], tokenizer, BACKENDS["sdpa"], fuse_lm_head=True)
    sharing.attach()
    try:
        result = run_model_check(
            model,
            rows,
            check_layout_fn(sharing),
            "fused",
            sharing.pad_token_id,
            window=window_layout(model.config)[0],
        )
    finally:
        sharing.detach()
    if result.error:
        raise RuntimeError(result.error)
    return {"difference": result.difference, "spread": result.spread, "values": result.values}


@contextlib.contextmanager
def backbone(model, cls):
    """`model` (a causal LM) with its backbone's forward taken from `cls` (the same weights): a broken layout of
    `trl_prefix_sharing/testing/custom_models.py` on a model loaded from a checkpoint."""
    base = model.get_decoder()
    own = type(base)
    base.__class__ = cls
    try:
        yield model
    finally:
        base.__class__ = own


def run_custom() -> list[dict]:
    from trl_prefix_sharing.testing import make_tokenizer
    from trl_prefix_sharing.testing.custom_models import custom_model

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
    return results


def run_smollm2(check_only: bool = False) -> list[dict]:
    """SmolLM2-135M-Instruct as it is, and under the custom types' broken backbones (positions from the row index,
    causal attention over the whole row: `ps_row_positions` and `ps_row_causal`). It has no sliding window, so the
    window counted in row positions (`ps_row_window`) does not apply. `check_only`: only find the model (raises the
    loader's `RealModelMissing` where it is not installed)."""
    from trl_prefix_sharing.testing.custom_models import _RowCausal, _RowPositions
    from trl_prefix_sharing.testing.real_model import load_smollm2, smollm2_path

    if check_only:
        smollm2_path()
        return []
    broken = {"ps_row_positions": _RowPositions, "ps_row_causal": _RowCausal}
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model, tokenizer = load_smollm2(dtype=dtype, attn_implementation="sdpa")
        config = model.config
        assert getattr(config, "sliding_window", None) is None, "a sliding window: measure a window layout too"
        size = f"trained, {config.hidden_size} wide, {config.num_hidden_layers} layers"
        for seed in range(2):
            rows = chat_examples(tokenizer, seed)
            line = {"size": size, "init": "trained", "model": "SmolLM2-135M-Instruct", "dtype": str(dtype)[6:]}
            line["seed"] = seed
            got = measure(model, rows, tokenizer)
            line.update(spread=got["spread"], shared=got["difference"], values=got["values"])
            for name, cls in broken.items():
                with backbone(model, cls):
                    line[name] = measure(model, rows, tokenizer)["difference"]
            print(json.dumps(line), flush=True)
            results.append(line)
        del model
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default="custom",
        help=f"comma-separated, of {', '.join(MODELS)} (default: custom; smollm2 needs the real model installed)",
    )
    parser.add_argument("--markdown", type=pathlib.Path, help="write the table (and the command) to this file")
    args = parser.parse_args()
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        parser.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")

    import conftest  # noqa: F401  - quiet, 2 threads

    if "smollm2" in models:
        run_smollm2(check_only=True)  # before anything runs: the loader's own error where it is not installed
    results = []
    for name in models:
        results += run_custom() if name == "custom" else run_smollm2()
    if args.markdown:
        write_markdown(results, args.markdown, models)


def write_markdown(results, path: pathlib.Path, models) -> None:
    from trl_prefix_sharing.model_check import SPREAD_FACTOR, TOLERANCE

    groups: dict = {}
    for line in results:
        groups.setdefault((line["dtype"], line["size"], line["init"], line["model"]), []).append(line)
    broken = ("ps_row_positions", "ps_row_causal", "ps_row_window")
    lines = [
        "| dtype | model | init | stock vs stock (spread) | shared vs stock | broken layouts (smallest) | tolerance |",
        "|---|---|---|---|---|---|---|",
    ]

    def order(key):  # by dtype, the real model first, then as before
        dtype, size, init, model = key
        return dtype, init != "trained", size, str(init), model

    for (dtype, size, init, model), group in sorted(groups.items(), key=lambda item: order(item[0])):
        spread = max(g["spread"] for g in group)
        shared = max(g["shared"] for g in group)
        worst = {b: min(g[b] for g in group) for b in broken if b in group[0]}
        tolerance = max(TOLERANCE[getattr(torch, dtype)], SPREAD_FACTOR * spread)
        trained = init == "trained"  # the real model: its size in brackets; it has no window layout
        label = f"{model} ({size})" if trained else f"{model}, {size}"
        measured = [f"{b.removeprefix('ps_')} {v:.2g}" for b, v in worst.items()]
        if trained:
            measured.append("row_window n/a (no sliding window)")
        lines.append(
            f"| {dtype} | {label} | {init} | {spread:.2g} | {shared:.2g} | {', '.join(measured)} | {tolerance:.2g} |"
        )
    tail = path.read_text().partition(TABLE_END)[2] if path.exists() else "\n"
    command = "PYTHONPATH=$PWD python scripts/calibrate_model_check.py"
    if list(models) != ["custom"]:
        command += f" --models {','.join(models)}"
    path.write_text(
        "# Start-up check: calibration\n\nLargest per-token log-prob difference over two seeds (the largest spread "
        "and shared difference, the smallest broken difference), from\n\n"
        f"    {command} --markdown docs/benchmarks/model_check.md\n\n" + "\n".join(lines) + "\n\n" + TABLE_END + tail
    )


if __name__ == "__main__":
    main()
