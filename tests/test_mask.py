"""`dpo_mask` is the one mask definition: its picture, a brute-force reference, and FlexAttention == dense SDPA."""

import random

import pytest
import torch
import torch.nn.functional as F

from trl_prefix_sharing.layout import build_shared_batch
from trl_prefix_sharing.mask import dense_mask, dpo_mask


def _picture(mask):
    return ["".join("x" if v else "." for v in row) for row in mask.tolist()]


def test_picture_of_one_pair():
    # one document: prefix of 3 tokens, chosen branch of 2, rejected branch of 3 (as in the module docstring)
    document_ids = torch.zeros(1, 8, dtype=torch.long)
    branch_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    mask = dense_mask(dpo_mask(document_ids, branch_ids), 1, 8, 8)[0, 0]
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


def _brute_force(document_ids, branch_ids):
    n, s = document_ids.shape
    out = torch.zeros(n, 1, s, s, dtype=torch.bool)
    for b in range(n):
        for q in range(s):
            for kv in range(q + 1):
                same_doc = document_ids[b, q] == document_ids[b, kv]
                visible = branch_ids[b, kv] == 0 or branch_ids[b, kv] == branch_ids[b, q]
                out[b, 0, q, kv] = bool(same_doc and visible)
    return out


def _random_layout(rng, rows=3, docs=3):
    ids, masks, groups = [], [], []
    for _ in range(rows * docs):
        prompt = [rng.randrange(5, 50) for _ in range(rng.randrange(0, 6))]
        k = rng.choice([2, 2, 3])
        group = []
        for _ in range(k):
            completion = [rng.randrange(5, 50) for _ in range(rng.randrange(0, 5))]
            group.append(len(ids))
            ids.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
        groups.append(group)
    width = max(1, max(len(r) for r in ids))
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in ids])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    completion = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    packing = [list(range(i * docs, (i + 1) * docs)) for i in range(rows)]
    return build_shared_batch(input_ids, attention, groups, completion_mask=completion, rows=packing)


@pytest.mark.parametrize("seed", range(10))
def test_dense_mask_equals_brute_force(seed):
    layout = _random_layout(random.Random(seed))
    mask = dense_mask(
        dpo_mask(layout["document_ids"], layout["branch_ids"]),
        *layout["document_ids"].shape,
        layout["document_ids"].shape[1],
    )
    assert mask.numel() > 0
    assert torch.equal(mask, _brute_force(layout["document_ids"], layout["branch_ids"]))


def test_no_token_sees_another_completion_or_document():
    layout = _random_layout(random.Random(123), rows=2, docs=4)
    doc, branch = layout["document_ids"], layout["branch_ids"]
    mask = dense_mask(dpo_mask(doc, branch), *doc.shape, doc.shape[1])[:, 0]
    q_doc, kv_doc = doc[:, :, None], doc[:, None, :]
    q_branch, kv_branch = branch[:, :, None], branch[:, None, :]
    assert not (mask & (q_doc != kv_doc)).any()
    assert not (mask & (kv_branch != 0) & (kv_branch != q_branch)).any()
    assert mask.diagonal(dim1=1, dim2=2).all()  # every query (padding too) sees itself: no empty softmax row


def test_sliding_window_uses_original_positions():
    document_ids = torch.zeros(1, 7, dtype=torch.long)
    branch_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 3, 4]])
    mask = dense_mask(dpo_mask(document_ids, branch_ids, position_ids, window=2), 1, 7, 7)[0, 0]
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

    layout = _random_layout(random.Random(5), rows=2, docs=3)
    doc, branch = layout["document_ids"], layout["branch_ids"]
    n, s = doc.shape
    mask_mod = dpo_mask(doc, branch)
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, 2, s, 8) for _ in range(3))
    block = create_block_mask(mask_mod, n, None, s, s, device="cpu", BLOCK_SIZE=16)
    flex = flex_attention(q, k, v, block_mask=block)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mask_mod, n, s, s))
    assert flex.numel() > 0
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
