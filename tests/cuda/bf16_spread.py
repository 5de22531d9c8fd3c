"""Measure how far bf16 log-probs move between layouts: prefix-shared vs stock TRL, and stock vs stock with another
layout of the same rows (the honest floor: extra right padding, reversed pair order, one pair per batch). The bf16
tolerance of tests/equivalence/test_hardening.py is set from this. Run from the repository root:

    PYTHONPATH=. python tests/cuda/bf16_spread.py [--seeds 0 1 2] [--families llama qwen3] [--autocast] [--flex]

Defaults: the four families of `trl_prefix_sharing.testing.FAMILIES`, model seeds 0 1 2, bf16 weights without autocast,
SDPA. Prints, per family and model seed, the largest absolute difference of per-pair summed log-probs and of per-token
log-probs (completion tokens), and the largest sum magnitude, then the maxima over everything."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import warnings

import torch

from trl_prefix_sharing.attention import BACKENDS
from trl_prefix_sharing.testing import FAMILIES, make_model, make_tokenizer, synthetic_pairs


def per_token_logps(trainer, examples, pad_right=0):
    """Completion-token log-probs [2B, L-1] (0 elsewhere) and the mask, as TRL's reference pass computes them."""
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    if pad_right:
        pad = trainer.processing_class.pad_token_id
        for key, value in (("input_ids", pad), ("attention_mask", 0), ("completion_mask", 0)):
            batch[key] = torch.nn.functional.pad(batch[key], (0, pad_right), value=value)
    if "prefix_sharing" in batch:
        trainer._attach_attention_mask(batch)
    kwargs = {k: v for k, v in batch.items() if k not in {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        logps = trainer.model(**kwargs, labels=labels, fused_lm_head=True, use_cache=False).log_probs.float()
    mask = batch["completion_mask"][:, 1:].bool()
    width = min(logps.shape[1], mask.shape[1])
    if pad_right:
        width -= pad_right
    return logps[:, :width] * mask[:, :width], mask[:, :width]


def spread(a, b):
    (ta, ma), (tb, mb) = a, b
    assert torch.equal(ma, mb) and ma.any()
    return float((ta.sum(1) - tb.sum(1)).abs().max()), float((ta - tb).abs()[ma].max()), float(ta.sum(1).abs().max())


def reorder(result, order):
    tokens, mask = result
    n = tokens.shape[0] // 2
    rows = list(order) + [n + i for i in order]
    return tokens[rows], mask[rows]


def one_by_one(trainer, examples):
    parts = [per_token_logps(trainer, [example]) for example in examples]
    width = max(p[0].shape[1] for p in parts)
    chosen = [torch.nn.functional.pad(t[:1], (0, width - t.shape[1])) for t, _ in parts]
    rejected = [torch.nn.functional.pad(t[1:], (0, width - t.shape[1])) for t, _ in parts]
    masks = [torch.nn.functional.pad(m.float(), (0, width - m.shape[1])) for _, m in parts]
    mask = torch.cat([m[:1] for m in masks] + [m[1:] for m in masks]).bool()
    return torch.cat(chosen + rejected), mask


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--autocast", action="store_true", help="bf16=True (autocast) as well as bf16 weights")
    parser.add_argument("--flex", action="store_true", help="also the shared rows through FlexAttention")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    sys.path.insert(0, os.path.dirname(__file__))
    import datasets

    from trl_prefix_sharing.testing.equivalence import awkward_text_dataset, make_trainers

    datasets.disable_progress_bars()
    datasets.disable_caching()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    data = {"awkward": awkward_text_dataset(), "synthetic": synthetic_pairs(8, (1, 40), (1, 12), seed=5)}
    worst = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            for seed in args.seeds:
                model = make_model(family, len(tokenizer), seed=seed).to(torch.bfloat16)
                ref = make_model(family, len(tokenizer), seed=seed + 100).to(torch.bfloat16)
                for name, dataset in data.items():
                    stock, shared = make_trainers(
                        pathlib.Path(tmp), family, dataset, tokenizer, model=model, ref_model=ref, bf16=args.autocast
                    )
                    examples = list(stock.train_dataset)
                    base = per_token_logps(stock, examples)
                    n = len(examples)
                    rows = {
                        "shared": per_token_logps(shared, examples),
                        "stock+pad": per_token_logps(stock, examples, pad_right=16),
                        "stock reversed": reorder(per_token_logps(stock, examples[::-1]), list(range(n))[::-1]),
                        "stock one by one": one_by_one(stock, examples),
                    }
                    if args.flex:  # FlexAttention (CPU forward): CUDA's default for the shared rows
                        shared.sharing_session.backend = BACKENDS["flex_attention"]
                        shared.model.set_attn_implementation("flex_attention")
                        rows["shared (flex)"] = per_token_logps(shared, examples)
                    for kind, other in rows.items():
                        sums, tokens, magnitude = spread(base, other)
                        print(
                            f"{family:8s} seed {seed} {name:9s} {kind:17s} sum {sums:.5f} token {tokens:.5f} "
                            f"|sum| {magnitude:.1f}"
                        )
                        w = worst.setdefault(kind, [0.0, 0.0, 0.0])
                        worst[kind] = [max(w[0], sums), max(w[1], tokens), max(w[2], magnitude)]
    print("max over families, seeds and datasets:")
    for kind, (sums, tokens, magnitude) in worst.items():
        print(f"  {kind:17s} summed log-probs {sums:.5f}  per-token {tokens:.5f}  (largest |sum| {magnitude:.1f})")


if __name__ == "__main__":
    main()
