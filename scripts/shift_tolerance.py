"""How far moved positions take a real model from stock TRL's numbers: SmolLM2-135M-Instruct (rotary positions),
float32, two prompts that share a long start (a system prompt) and differ in length, left-padded as GRPO generates
them.

Prints, as JSON, per shared-start length: the largest per-token log-prob difference between stock's rows (scored
without position ids, so the shorter prompt's tokens sit at later positions) and the shared layout that moves them
(`StockRows.shift`), next to stock's own difference when the same rows get more left padding (what a batch with a
longer prompt does to them in stock TRL) and the start-up check's float32 tolerance.

    PYTHONPATH=$PWD python scripts/shift_tolerance.py     # ~5 minutes on 2 cores
"""

from __future__ import annotations

import json

import torch


def stock_log_probs(model, input_ids, attention_mask):
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return out.log_probs.float()


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_prefix_sharing.attention import BACKENDS
    from trl_prefix_sharing.model_check import TOLERANCE, _tensors, check_layout_fn, run_model_check, unequal_prompts
    from trl_prefix_sharing.session import PrefixSharingSession
    from trl_prefix_sharing.testing.real_model import smollm2_path

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    generator = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(100, len(tokenizer), (n,), generator=generator).tolist()

    results = []
    for start, tail in ((256, 16), (1024, 64)):
        examples = [(tokens(start), [tokens(24), tokens(12)]), (tokens(tail), [tokens(20), tokens(8)])]
        session = PrefixSharingSession([model], tokenizer, BACKENDS["sdpa"], fuse_lm_head=True)
        session.attach()
        try:
            layout_fn = check_layout_fn(session, shifted=True)
            result = run_model_check(model, examples, layout_fn, "fused", session.pad_token_id, shifted=True)
            # stock's own numbers when the rows get `tail` more columns of left padding
            ids, mask, _, _ = _tensors(unequal_prompts(examples), session.pad_token_id, "cpu", left=True)
            with torch.no_grad():
                base = stock_log_probs(model, ids, mask)
                pad = torch.nn.functional.pad
                moved = stock_log_probs(model, pad(ids, (tail, 0), value=session.pad_token_id), pad(mask, (tail, 0)))
            valid = (mask[:, 1:] * mask[:, :-1]).bool()
            stock_moved = (moved[:, tail:] - base).abs().masked_fill(~valid, 0).amax().item()
        finally:
            session.detach()
        results.append(
            {
                "shared_start": start,
                "longer_prompt_by": tail,
                "shared_vs_stock": result.difference,
                "stock_vs_stock_padded_more": stock_moved,
                "kernel_spread": result.spread,
                "tolerance": TOLERANCE[torch.float32],
                "values": result.values,
            }
        )
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
