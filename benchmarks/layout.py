"""The time to lay out one micro-batch: the trie builder (tensor ops) against the previous builder (Python, token by
token, kept here for the comparison), on one CPU thread, and on a GPU where one is present. A GRPO micro-batch of 4
prompts x 8 generations and a DPO one of 8 pairs with long prompts; medians of 7 runs after a warm-up.

    python -m benchmarks.layout --out docs/benchmarks          # CPU, one thread, about a minute
    python -m benchmarks.layout --device cuda --out DIR        # also on the GPU
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

import torch

from trl_prefix_sharing.layout import build_layout
from trl_prefix_sharing.trie import StockRows

from .measure import median_seconds
from .models import quiet_setup
from .results import command_line, document, markdown_table, write_result


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
    lengths, starts, ids_list, docs = lengths.tolist(), starts.tolist(), input_ids.tolist(), []
    cm_list = completion_mask.tolist() if completion_mask is not None else None
    for group in groups:
        keyed = []
        for r in group:
            columns = range(starts[r], starts[r] + lengths[r])
            keyed.append(
                [(ids_list[r][c], c, cm_list[r][c]) if cm_list is not None else (ids_list[r][c], c) for c in columns]
            )
        s = max(_common_prefix_length(keyed) - 1, 0)
        first, start0 = ids_list[group[0]], starts[group[0]]
        tokens, positions, branches = list(first[start0 : start0 + s]), list(range(start0, start0 + s)), [0] * s
        offsets, branch = {}, 0
        for key, r in zip(keyed, group, strict=True):
            twin = next((group[j] for j in range(len(offsets)) if keyed[j] == key), None)
            if twin is not None:
                offsets[r] = offsets[twin]
                continue
            n, c0, start, branch = lengths[r], starts[r], len(tokens), branch + 1
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


def grpo_batch(rng, prompts=4, generations=8, prompt_tokens=1000, completion_tokens=500):
    """Generated rows as TRL hands them to the model: prompts left-padded, completions right-padded."""
    rows = []
    for _ in range(prompts):
        prompt = [rng.randrange(10, 30000) for _ in range(prompt_tokens + rng.randrange(-100, 100))]
        for _ in range(generations):
            completion = [rng.randrange(10, 30000) for _ in range(completion_tokens + rng.randrange(-150, 150))]
            rows.append((prompt, completion))
    p, c = max(len(a) for a, _ in rows), max(len(b) for _, b in rows)
    ids = torch.tensor([[0] * (p - len(a)) + a + b + [0] * (c - len(b)) for a, b in rows])
    mask = torch.tensor([[0] * (p - len(a)) + [1] * (len(a) + len(b)) + [0] * (c - len(b)) for a, b in rows])
    return ids, mask, p


def dpo_batch(rng, pairs=8, prompt_tokens=1500, completion_tokens=300):
    """Pairs as TRL's collator pads them (right-padded), with their completion mask."""
    rows, prompts = [], []
    for _ in range(pairs):
        prompt = [rng.randrange(10, 30000) for _ in range(prompt_tokens + rng.randrange(-200, 200))]
        for _ in range(2):
            rows.append(prompt + [rng.randrange(10, 30000) for _ in range(completion_tokens + rng.randrange(-80, 80))])
            prompts.append(len(prompt))
    rows, prompts = rows[0::2] + rows[1::2], prompts[0::2] + prompts[1::2]  # TRL's order: chosen rows, then rejected
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    completion = torch.tensor(
        [[0] * p + [1] * (len(r) - p) + [0] * (width - len(r)) for r, p in zip(rows, prompts, strict=True)]
    )
    return ids, mask, completion


def run(device: torch.device) -> dict:
    """Real tokens and shared positions of each micro-batch; milliseconds of each builder on it."""
    from trl_prefix_sharing.attention import BACKENDS
    from trl_prefix_sharing.testing import make_model
    from trl_prefix_sharing.trie import prompt_lengths_from_completion_mask

    config, rng = make_model("llama", 64).config, random.Random(0)
    (g_ids, g_mask, g_prompt), (d_ids, d_mask, d_completion) = grpo_batch(rng), dpo_batch(rng)
    pairs = [[i, d_ids.shape[0] // 2 + i] for i in range(d_ids.shape[0] // 2)]
    on_device = [t.to(device) for t in (g_ids, g_mask, d_ids, d_mask, d_completion)]
    g_ids_d, g_mask_d, d_ids_d, d_mask_d, d_completion_d = on_device
    check = device.type == "cpu"  # the trainer's default: checks on the CPU only (on a GPU they are host syncs)

    def grpo_trie():
        return build_layout(StockRows.generated(g_ids_d, g_mask_d, g_prompt, check=check), pad_token_id=0)

    def dpo_trie():
        prompts = prompt_lengths_from_completion_mask(d_mask_d, d_completion_d)
        return build_layout(StockRows(d_ids_d, d_mask_d, prompt_lengths=prompts, check=check))

    timed = {
        "grpo_trie_ms": grpo_trie,
        "grpo_trie_with_mask_ms": lambda: BACKENDS["sdpa"].inputs(grpo_trie(), config),
        "dpo_trie_ms": dpo_trie,
    }
    if device.type == "cpu":
        timed["grpo_previous_ms"] = lambda: previous_group_layout(g_ids, g_mask, g_prompt)
        timed["dpo_previous_ms"] = lambda: previous_layout(d_ids, d_mask, pairs, d_completion)
    results = {"grpo_real_tokens": int(g_mask.sum()), "dpo_real_tokens": int(d_mask.sum())}
    results.update({key: 1000 * median_seconds(fn, cuda=device.type == "cuda") for key, fn in timed.items()})
    results["grpo_shared_positions"] = int((grpo_trie().document_ids >= 0).sum())
    results["dpo_shared_positions"] = int((dpo_trie().document_ids >= 0).sum())
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="write layout_<device>.md and .json here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    name, _ = quiet_setup(device.type == "cuda")
    results = run(device)
    command = command_line("layout")
    rows = []
    for kind, shape in (("grpo", "GRPO, 4 prompts x 8 generations"), ("dpo", "DPO, 8 pairs")):
        r = {key.removeprefix(f"{kind}_"): value for key, value in results.items() if key.startswith(kind)}
        rows.append([shape, f"{r['real_tokens']:,}", f"{r['shared_positions']:,}"])
        rows[-1] += [f"{r['previous_ms']:.1f}" if "previous_ms" in r else "-", f"{r['trie_ms']:.1f}"]
        rows[-1].append(f"{r['trie_with_mask_ms']:.1f}" if "trie_with_mask_ms" in r else "-")
    header = "micro-batch|real tokens|shared positions|previous builder (ms)|trie (ms)|trie + dense mask (ms)"
    lines = document(
        f"# Layout time per micro-batch ({device.type}, one CPU thread)",
        f"Command: `{command}`",
        markdown_table(header, rows),
        "*Previous builder*: one document per pair or group, laid out token by token in Python (kept in the script "
        "for this comparison). *Trie*: `build_layout` of `StockRows.generated` (GRPO, grouping included) and "
        "`build_layout` with each row's prompt length (DPO), tensor ops on the batch's device, checks included on the "
        "CPU. *Trie + dense mask*: also the dense boolean mask SDPA takes, `[rows, 1, width, width]`, which costs far "
        "more than the layout on long rows; under FlexAttention (CUDA) the mask is a BlockMask built by the compiled "
        "`create_block_mask` instead. Medians of 7 runs after a warm-up.",
    )
    if args.out:
        write_result(args.out, f"layout_{device.type}", dict(command=command, device=name, results=results), lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
