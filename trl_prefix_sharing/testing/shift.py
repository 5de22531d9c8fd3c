"""Whether a model gives stock TRL's numbers when a left-padded prompt's tokens move to other positions
(`trie.StockRows.shift`): the start-up check's shifted run (`model_check.run_model_check(shifted=True)`) on a tiny
model, what `scripts/sweep_architectures.py --shift` records per model type and the tests read; and how many copies of
the start that a micro-batch's prompts share the shared rows of a run hold (`record_layouts`,
`copies_of_the_common_start`)."""

from __future__ import annotations

import torch

from ..attention import BACKENDS
from ..model_check import ModelCheckResult, check_layout_fn, run_model_check
from ..session import PrefixSharingSession


__all__ = ["copies_of_the_common_start", "record_layouts", "shift_check"]


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


def record_layouts(monkeypatch) -> list:
    """Every generated layout a session builds, with its stock rows: `(input_ids, attention_mask, layout)`."""
    seen = []
    original = PrefixSharingSession.generated_layout

    def generated_layout(self, input_ids, attention_mask, *args, **kwargs):
        layout = original(self, input_ids, attention_mask, *args, **kwargs)
        seen.append((input_ids, attention_mask, layout))
        return layout

    monkeypatch.setattr(PrefixSharingSession, "generated_layout", generated_layout)
    return seen


def copies_of_the_common_start(input_ids, attention_mask, layout) -> float:
    """How many times the shared rows hold the start every stock row has in common (its tokens counted from each row's
    first token, wherever its left padding puts it; its last token left out): 1 when computed once for the whole
    micro-batch."""
    starts = attention_mask.int().argmax(dim=1)
    width = input_ids.shape[1]
    columns = (starts[:, None] + torch.arange(width)).clamp(max=width - 1)
    aligned = torch.where(torch.arange(width) < (width - starts)[:, None], input_ids.gather(1, columns), -1)
    common = int((aligned == aligned[:1]).all(dim=0).int().cumprod(0).sum())
    assert common >= 2, common  # a start to share
    common -= 1  # its last token starts every branch again (see `layout.py`)
    places = layout.stock_index.gather(1, columns[:, :common])
    assert (places >= 0).all()
    return places.unique().numel() / common
