"""The shared-row layout: exact stock tokens, positions and labels, on awkward rows."""

import torch

from trl_prefix_sharing.layout import build_shared_batch, common_prefix_length, shared_labels


def _stock(rows, prompt_lens, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    cm = torch.tensor(
        [[0] * p + [1] * (len(r) - p) + [0] * (width - len(r)) for r, p in zip(rows, prompt_lens, strict=True)]
    )
    return ids, attn, cm


def _roundtrip(layout, ids, attn):
    index = layout["stock_index"]
    real = attn.bool()
    assert torch.equal(index >= 0, real)
    assert torch.equal(layout["input_ids"].view(-1)[index[real]], ids[real])
    flat_pos = layout["position_ids"].view(-1)[index.clamp(min=0)]
    expected_pos = torch.arange(ids.shape[1]).expand_as(ids)
    assert torch.equal(flat_pos[real], expected_pos[real])


def test_docstring_example():
    ids, attn, cm = _stock([[10, 11, 12, 13, 20, 21], [10, 11, 12, 13, 30, 31, 32]], [4, 4])
    layout = build_shared_batch(ids, attn, [[0, 1]], completion_mask=cm)
    assert layout["input_ids"].tolist() == [[10, 11, 12, 13, 20, 21, 13, 30, 31, 32]]
    assert layout["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 5, 6]]
    assert layout["branch_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 2, 2]]
    _roundtrip(layout, ids, attn)
    labels = ids.masked_fill(cm == 0, -100)
    assert shared_labels(layout, labels).tolist() == [[-100, -100, -100, 20, 21, -100, 30, 31, 32, -100]]


def test_completions_sharing_first_tokens_share_them():
    ids, attn, cm = _stock([[1, 2, 5, 6, 7], [1, 2, 5, 6, 9]], [2, 2])
    layout = build_shared_batch(ids, attn, [[0, 1]], completion_mask=cm)
    assert layout["input_ids"].tolist() == [[1, 2, 5, 6, 7, 6, 9]]
    _roundtrip(layout, ids, attn)


def test_identical_and_nested_rows():
    ids, attn, cm = _stock([[1, 2, 3], [1, 2, 3], [4, 5], [4, 5, 6]], [1, 1, 1, 1])
    layout = build_shared_batch(ids, attn, [[0, 1], [2, 3]], completion_mask=cm)
    assert layout["input_ids"].tolist()[0][:3] == [1, 2, 3]  # identical rows: stored once, read twice
    assert torch.equal(layout["stock_index"][0], layout["stock_index"][1])
    assert layout["input_ids"].tolist()[1][:4] == [4, 5, 5, 6]
    _roundtrip(layout, ids, attn)


def test_no_common_prefix_is_two_separate_sequences():
    ids, attn, cm = _stock([[1, 2, 3], [4, 5]], [0, 0])
    layout = build_shared_batch(ids, attn, [[0, 1]], completion_mask=cm)
    assert layout["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert layout["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert layout["branch_ids"].tolist() == [[1, 1, 1, 2, 2]]
    _roundtrip(layout, ids, attn)


def test_prompt_and_completion_never_merged():
    # the same token is prompt in one row and completion in the other: sharing stops there
    ids, attn, cm = _stock([[1, 2, 3, 4], [1, 2, 3, 5]], [3, 2])
    layout = build_shared_batch(ids, attn, [[0, 1]], completion_mask=cm)
    assert layout["branch_ids"].tolist()[0].count(0) == 1
    _roundtrip(layout, ids, attn)


def test_k_way_groups_and_packing_rows():
    rows = [[1, 2, 3, 7], [1, 2, 3, 8, 8], [1, 2, 3, 9], [4, 5, 6], [4, 5, 7]]
    ids, attn, cm = _stock(rows, [3, 3, 3, 2, 2])
    layout = build_shared_batch(
        ids, attn, [[0, 1, 2], [3, 4]], completion_mask=cm, rows=[[0, 1]], pad_to_multiple_of=16
    )
    assert layout["input_ids"].shape == (1, 16)
    # document 0: prefix [1, 2] + branches [3, 7], [3, 8, 8], [3, 9]; document 1: prefix [4] + [5, 6], [5, 7]
    assert layout["document_ids"].tolist()[0] == [0] * 9 + [1] * 5 + [-1] * 2
    assert layout["branch_ids"].tolist()[0][:14] == [0, 0, 1, 1, 2, 2, 2, 3, 3, 0, 1, 1, 2, 2]
    _roundtrip(layout, ids, attn)


def test_common_prefix_length():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[], [1]]) == 0
    assert common_prefix_length([]) == 0
