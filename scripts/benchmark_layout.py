"""Time the shared layout of one micro-batch: the trie builder (tensor ops) against the previous builder (Python,
token by token), on one CPU thread, and on a GPU where one is present.

    python scripts/benchmark_layout.py --out docs/benchmarks          # CPU, one thread, about a minute
    python scripts/benchmark_layout.py --device cuda --out DIR        # also on the GPU

Two micro-batches, shaped like real training:

- GRPO: 32 generated rows, 4 prompts x 8 generations, prompts of ~1000 tokens (left-padded), completions of ~500
  (right-padded), ~45k real tokens. Timed: the whole layout of the rows TRL hands the model (grouping included),
  `build_layout` of `StockRows.generated`, and the same with its attention mask (dense, as SDPA takes it).
- DPO: 8 pairs, prompts of ~1500 tokens, completions of ~300, right-padded as TRL's collator builds them. Timed: the
  layout the collator adds, `build_layout` with each row's prompt length.

"Previous" is the builder this package used before the trie (one document per pair or group, built by walking every
token in Python), kept in this script for the comparison. Medians of 7 runs after a warm-up, milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence

import torch


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from trl_prefix_sharing.layout import build_layout
from trl_prefix_sharing.trie import StockRows


# ----------------------------------------------------------------------------------------------- previous builder
def _common_prefix_length(rows: Sequence[Sequence]) -> int:
    if not rows:
        return 0
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows[1:]):
            return i
    return n


def previous_layout(input_ids, attention_mask, groups, completion_mask=None, pad_token_id=0):
    """The previous builder: one document per group of stock rows, laid out token by token in Python."""
    lengths = attention_mask.sum(dim=1)
    starts = torch.where(lengths > 0, attention_mask.int().argmax(dim=1), torch.zeros_like(lengths))
    lengths, starts = lengths.tolist(), starts.tolist()
    ids_list = input_ids.tolist()
    cm_list = completion_mask.tolist() if completion_mask is not None else None
    docs = []
    for group in groups:
        keyed = []
        for r in group:
            columns = range(starts[r], starts[r] + lengths[r])
            keyed.append(
                [(ids_list[r][c], c, cm_list[r][c]) if cm_list is not None else (ids_list[r][c], c) for c in columns]
            )
        m = _common_prefix_length(keyed)
        s = max(m - 1, 0)
        first, start0 = ids_list[group[0]], starts[group[0]]
        tokens, positions, branches = list(first[start0 : start0 + s]), list(range(start0, start0 + s)), [0] * s
        offsets, branch = {}, 0
        for key, r in zip(keyed, group, strict=True):
            twin = next((group[j] for j in range(len(offsets)) if keyed[j] == key), None)
            if twin is not None:
                offsets[r] = offsets[twin]
                continue
            n, c0 = lengths[r], starts[r]
            start = len(tokens)
            branch += 1
            tokens.extend(ids_list[r][c0 + s : c0 + n])
            positions.extend(range(c0 + s, c0 + n))
            branches.extend([branch] * (n - s))
            offsets[r] = list(range(min(s, n))) + list(range(start, start + max(n - s, 0)))
        docs.append((tokens, positions, branches, offsets))
    width = max(len(d[0]) for d in docs)
    out_ids = torch.full((len(docs), width), pad_token_id, dtype=torch.long)
    out_pos = torch.zeros((len(docs), width), dtype=torch.long)
    out_branch = torch.zeros((len(docs), width), dtype=torch.long)
    stock_index = torch.full(tuple(input_ids.shape), -1, dtype=torch.long)
    for i, (tokens, positions, branches, offsets) in enumerate(docs):
        n = len(tokens)
        out_ids[i, :n] = torch.tensor(tokens)
        out_pos[i, :n] = torch.tensor(positions)
        out_branch[i, :n] = torch.tensor(branches)
        for r, offs in offsets.items():
            if offs:
                stock_index[r, starts[r] : starts[r] + len(offs)] = i * width + torch.tensor(offs)
    return {"input_ids": out_ids, "position_ids": out_pos, "branch_ids": out_branch, "stock_index": stock_index}


def previous_group_layout(input_ids, attention_mask, prompt_length):
    keys = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length]], dim=1).tolist()
    groups: dict = {}
    for row, key in enumerate(keys):
        groups.setdefault(tuple(key), []).append(row)
    completion_mask = attention_mask.clone()
    completion_mask[:, :prompt_length] = 0
    return previous_layout(input_ids, attention_mask, list(groups.values()), completion_mask)


# ----------------------------------------------------------------------------------------------- batches
def grpo_batch(rng, prompts=4, generations=8, prompt_tokens=1000, completion_tokens=500):
    rows = []
    for _ in range(prompts):
        prompt = [rng.randrange(10, 30000) for _ in range(prompt_tokens + rng.randrange(-100, 100))]
        for _ in range(generations):
            completion = [rng.randrange(10, 30000) for _ in range(completion_tokens + rng.randrange(-150, 150))]
            rows.append((prompt, completion))
    p = max(len(a) for a, _ in rows)
    c = max(len(b) for _, b in rows)
    ids = torch.tensor([[0] * (p - len(a)) + a + b + [0] * (c - len(b)) for a, b in rows])
    mask = torch.tensor([[0] * (p - len(a)) + [1] * (len(a) + len(b)) + [0] * (c - len(b)) for a, b in rows])
    return ids, mask, p


def dpo_batch(rng, pairs=8, prompt_tokens=1500, completion_tokens=300):
    rows, prompts = [], []
    for _ in range(pairs):
        prompt = [rng.randrange(10, 30000) for _ in range(prompt_tokens + rng.randrange(-200, 200))]
        for _ in range(2):
            rows.append(prompt + [rng.randrange(10, 30000) for _ in range(completion_tokens + rng.randrange(-80, 80))])
            prompts.append(len(prompt))
    rows = rows[0::2] + rows[1::2]  # TRL's order: chosen rows, then rejected rows
    prompts = prompts[0::2] + prompts[1::2]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    completion = torch.tensor(
        [[0] * p + [1] * (len(r) - p) + [0] * (width - len(r)) for r, p in zip(rows, prompts, strict=True)]
    )
    return ids, mask, completion


def median_ms(fn, device, repeats=7) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def run(device: torch.device) -> dict:
    from trl_prefix_sharing.attention import BACKENDS
    from trl_prefix_sharing.testing import make_model
    from trl_prefix_sharing.trie import prompt_lengths_from_completion_mask

    config = make_model("llama", 64).config
    rng = random.Random(0)
    g_ids, g_mask, g_prompt = grpo_batch(rng)
    d_ids, d_mask, d_completion = dpo_batch(rng)
    half = d_ids.shape[0] // 2
    pairs = [[i, half + i] for i in range(half)]
    results = {"grpo_real_tokens": int(g_mask.sum()), "dpo_real_tokens": int(d_mask.sum())}
    on = [t.to(device) for t in (g_ids, g_mask, d_ids, d_mask, d_completion)]
    g_ids_d, g_mask_d, d_ids_d, d_mask_d, d_completion_d = on
    check = device.type == "cpu"  # the trainer's default: checks on the CPU only (on a GPU they are host syncs)

    def grpo_trie():
        return build_layout(StockRows.generated(g_ids_d, g_mask_d, g_prompt, check=check), pad_token_id=0)

    def grpo_trie_mask():
        layout = grpo_trie()
        return BACKENDS["sdpa"].inputs(layout, config)

    def dpo_trie():
        prompts = prompt_lengths_from_completion_mask(d_mask_d, d_completion_d)
        return build_layout(StockRows(d_ids_d, d_mask_d, prompt_lengths=prompts, check=check))

    results["grpo_trie_ms"] = median_ms(grpo_trie, device)
    results["grpo_trie_with_mask_ms"] = median_ms(grpo_trie_mask, device)
    results["dpo_trie_ms"] = median_ms(dpo_trie, device)
    if device.type == "cpu":
        results["grpo_previous_ms"] = median_ms(lambda: previous_group_layout(g_ids, g_mask, g_prompt), device)
        results["dpo_previous_ms"] = median_ms(lambda: previous_layout(d_ids, d_mask, pairs, d_completion), device)
    grpo, dpo = grpo_trie(), dpo_trie()
    results["grpo_shared_positions"] = int((grpo.document_ids >= 0).sum())
    results["dpo_shared_positions"] = int((dpo.document_ids >= 0).sum())
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="write layout_<device>.md and .json here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    results = run(device)
    lines = [
        f"# Layout time per micro-batch ({device.type}, one CPU thread)",
        "",
        f"Command: `python scripts/benchmark_layout.py --device {device.type} --out docs/benchmarks`",
        "",
        "| micro-batch | real tokens | shared positions | previous builder (ms) | trie (ms) | trie + dense mask "
        "(ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    previous = results.get("grpo_previous_ms")
    lines.append(
        f"| GRPO, 4 prompts x 8 generations | {results['grpo_real_tokens']:,} | "
        f"{results['grpo_shared_positions']:,} | "
        f"{f'{previous:.1f}' if previous is not None else '-'} | {results['grpo_trie_ms']:.1f} | "
        f"{results['grpo_trie_with_mask_ms']:.1f} |"
    )
    previous = results.get("dpo_previous_ms")
    lines.append(
        f"| DPO, 8 pairs | {results['dpo_real_tokens']:,} | {results['dpo_shared_positions']:,} | "
        f"{f'{previous:.1f}' if previous is not None else '-'} | {results['dpo_trie_ms']:.1f} | - |"
    )
    lines += [
        "",
        "*Previous builder*: one document per pair or group, laid out token by token in Python (kept in the script "
        "for this comparison). *Trie*: `build_layout` of `StockRows.generated` (GRPO, grouping included) and "
        "`build_layout` with each row's prompt length (DPO), tensor ops on the batch's device, checks included on the "
        "CPU. *Trie + dense mask*: also the dense boolean mask SDPA takes, `[rows, 1, width, width]`, which costs far "
        "more than the layout on long rows; under FlexAttention (CUDA) the mask is a BlockMask built by the compiled "
        "`create_block_mask` instead. Medians of 7 runs after a warm-up.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    print(json.dumps(results, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"layout_{device.type}.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, f"layout_{device.type}.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
