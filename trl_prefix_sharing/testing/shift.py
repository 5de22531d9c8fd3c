"""Whether a model gives stock TRL's numbers when a left-padded prompt's tokens move to other positions
(`trie.StockRows.shift`): the start-up check's shifted run (`model_check.run_model_check(shifted=True)`) on a tiny
model, what `scripts/sweep_architectures.py --shift` records per model type and the tests read."""

from __future__ import annotations

import torch

from ..attention import BACKENDS
from ..model_check import ModelCheckResult, check_layout_fn, run_model_check
from ..session import PrefixSharingSession


__all__ = ["shift_check"]


def shift_check(model, tokenizer, seed: int = 1) -> ModelCheckResult:
    """Two prompts that start alike (12 tokens, and those 12 followed by 6 more), two completions each, left-padded as
    TRL generates them and scored without position ids, against the layout that shares their start (SDPA, float32,
    no gradients; eager attention for a model that has no SDPA): the largest per-token log-prob difference and the
    tolerance of the start-up check."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(5, len(tokenizer), (n,), generator=generator).tolist()

    examples = [(tokens(12), [tokens(5), tokens(3)]), (tokens(6), [tokens(4), tokens(2)])]
    backend = BACKENDS["eager" if model.config._attn_implementation == "eager" else "sdpa"]
    session = PrefixSharingSession([model], tokenizer, backend, fuse_lm_head=True)
    session.attach()
    try:
        layout_fn = check_layout_fn(session, shifted=True)
        return run_model_check(model, examples, layout_fn, "fused", session.pad_token_id, shifted=True)
    finally:
        session.detach()
