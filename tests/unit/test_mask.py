"""`prefix_sharing_mask` is the one mask definition: its picture, a brute-force reference built from the rows' paths,
and FlexAttention == dense SDPA."""

import random

import pytest
import torch
import torch.nn.functional as F

from trl_prefix_sharing.layout import RowPolicy, build_layout
from trl_prefix_sharing.mask import dense_mask, on_path, prefix_sharing_mask
from trl_prefix_sharing.trie import StockRows, plan_layout, prompt_lengths_from_completion_mask


def _picture(mask):
    return ["".join("x" if v else "." for v in row) for row in mask.tolist()]


def test_picture_of_one_pair():
    # one pair: prompt of 3 tokens, chosen branch of 2, rejected branch of 3 (as in the module docstring)
    subtree_end = torch.tensor([[8, 8, 8, 5, 5, 8, 8, 8]])
    mask = dense_mask(on_path(subtree_end), 1, 8, 8)[0, 0]
    assert _picture(mask) == [
        "x.......",
        "xx......",
        "xxx.....",
        "xxxx....",
        "xxxxx...",
        "xxx..x..",
        "xxx..xx.",
        "xxx..xxx",
    ]


def _random_layout(rng, rows=3, docs=3):
    """Packed rows of documents; each document a prompt with 2-3 completions that may share their first tokens."""
    ids, masks = [], []
    for _ in range(rows * docs):
        prompt = [rng.randrange(5, 50) for _ in range(rng.randrange(1, 6))]
        for _ in range(rng.choice([2, 2, 3])):
            completion = [rng.randrange(5, 8) for _ in range(rng.randrange(0, 5))]
            ids.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
    width = max(len(r) for r in ids)
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in ids])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    completion = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    prompts = prompt_lengths_from_completion_mask(attention, completion)

    def packing(lengths):
        per_row = -(-len(lengths) // rows)
        return [list(range(i, min(i + per_row, len(lengths)))) for i in range(0, len(lengths), per_row)]

    plan = plan_layout(StockRows(input_ids, attention, prompt_lengths=prompts))
    placement = tuple(map(tuple, packing([0] * int(plan.num_documents))))
    return build_layout(
        StockRows(input_ids, attention), rows=RowPolicy(pack=True, placement=placement), plan=plan
    ), attention


def _brute_force(layout, attention):
    """Query q sees key k when a stock row reads both and reads k at or before q (the row's own path)."""
    n, s = layout.input_ids.shape
    out = torch.zeros(n * s, n * s, dtype=torch.bool)
    index = layout.stock_index
    for r in range(index.shape[0]):
        path = index[r][attention[r].bool()].tolist()
        for c, q in enumerate(path):
            out[q, path[: c + 1]] = True
    padding = (layout.document_ids.view(-1) < 0).nonzero().flatten()
    out[padding, padding] = True  # padding sees itself only
    rows = [out[b * s : (b + 1) * s, b * s : (b + 1) * s] for b in range(n)]
    return torch.stack(rows).unsqueeze(1)


@pytest.mark.parametrize("seed", range(10))
def test_dense_mask_equals_brute_force(seed):
    layout, attention = _random_layout(random.Random(seed))
    n, s = layout.input_ids.shape
    mask = dense_mask(prefix_sharing_mask(layout.subtree_end), n, s, s)
    assert mask.numel() > 0 and n > 1
    assert torch.equal(mask, _brute_force(layout, attention))


def test_sliding_window_uses_original_positions():
    subtree_end = torch.tensor([[7, 7, 7, 5, 5, 7, 7]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 3, 4]])
    mask = dense_mask(prefix_sharing_mask(subtree_end, position_ids, window=2), 1, 7, 7)[0, 0]
    assert _picture(mask) == [
        "x......",
        "xx.....",
        ".xx....",
        "..xx...",
        "...xx..",
        "..x..x.",
        ".....xx",
    ]


def test_flex_attention_forward_equals_dense_sdpa():
    """The BlockMask and the dense mask come from the same mask_mod and give the same attention (CPU forward)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    layout, _ = _random_layout(random.Random(5), rows=2, docs=3)
    n, s = layout.input_ids.shape
    mask_mod = prefix_sharing_mask(layout.subtree_end)
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 2, s, 8) for _ in range(3))
    block = create_block_mask(mask_mod, n, None, s, s, device="cpu", BLOCK_SIZE=16)
    flex = flex_attention(q, k, v, block_mask=block)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mask_mod, n, s, s))
    assert flex.numel() > 0
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
