"""The shared-row layout (a prefix trie per micro-batch): exact stock tokens, positions, labels and visibility, on
awkward rows, against a brute-force oracle built token by token in Python."""

import dataclasses
import random

import pytest
import torch

from trl_prefix_sharing.layout import (
    Layout,
    RowPolicy,
    build_layout,
    shared_labels,
    shared_positions,
)
from trl_prefix_sharing.mask import causal, dense_mask, prefix_sharing_mask, same_document
from trl_prefix_sharing.trie import StockRows, prompt_lengths_from_completion_mask


def _stock(rows, prompt_lens=None, pad=0, left=False):
    width = max(len(r) for r in rows)
    pads = [[pad] * (width - len(r)) for r in rows]
    ids = torch.tensor([p + r if left else r + p for r, p in zip(rows, pads, strict=True)])
    attn = torch.tensor(
        [[0] * len(p) + [1] * len(r) if left else [1] * len(r) + [0] * len(p) for r, p in zip(rows, pads, strict=True)]
    )
    if prompt_lens is None:
        return ids, attn, None
    cm = torch.tensor(
        [[0] * p + [1] * (len(r) - p) + [0] * (width - len(r)) for r, p in zip(rows, prompt_lens, strict=True)]
    )
    return ids, attn, cm


def reference_positions(rows) -> int:
    """The oracle: the trie of ``rows`` (lists of (token, position)) built token by token, one document. Every
    distinct prefix is laid out once, plus one copy of a node's last token for each child after its first."""
    prefixes = {tuple(row[: t + 1]) for row in rows for t in range(len(row))}
    children: dict[tuple, set] = {}
    for prefix in prefixes:
        children.setdefault(prefix[:-1], set()).add(prefix[-1])
    copies = sum(len(kids) - 1 for parent, kids in children.items() if parent)
    return len(prefixes) + copies


def check_layout(layout, ids, attn, score_padding=False):
    """Every stock token is read from a shared position that holds its token and its position, and sees exactly the
    shared positions of its own row's earlier tokens (nothing of a sibling, another document or padding)."""
    index = layout.stock_index
    real = (attn.cumsum(1) > 0) if score_padding else attn.bool()
    assert torch.equal(index >= 0, real)
    assert real.any()
    shared_ids = layout.input_ids.view(-1)
    assert torch.equal(shared_ids[index[real]], ids[real])
    columns = torch.arange(ids.shape[1]).expand_as(ids)
    assert torch.equal(layout.position_ids.view(-1)[index[real]], columns[real])
    n, s = layout.input_ids.shape
    mask = dense_mask(prefix_sharing_mask(layout.subtree_end, key_visible=layout.key_visible), n, s, s)[:, 0].reshape(
        n * s, s
    )
    visible_keys = (layout.key_visible if layout.key_visible is not None else torch.ones(n, s, dtype=torch.bool)).view(
        -1
    )
    for r in range(ids.shape[0]):
        flat = index[r][real[r]].tolist()
        for c, q in enumerate(flat):
            expected = {k % s for k in flat[: c + 1] if visible_keys[k]}
            assert all(k // s == q // s for k in flat)  # one shared row holds the whole path
            got = set(torch.nonzero(mask[q]).flatten().tolist())
            assert got == expected, (r, c, got, expected)


def test_docstring_example():
    ids, attn, cm = _stock([[10, 11, 12, 13, 20, 21], [10, 11, 12, 13, 30, 31, 32]], [4, 4])
    layout = build_layout(StockRows(ids, attn, prompt_lengths=prompt_lengths_from_completion_mask(attn, cm)))
    assert layout.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 13, 30, 31, 32]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 5, 6]]
    assert layout.subtree_end.tolist() == [[10, 10, 10, 6, 6, 6, 10, 10, 10, 10]]
    check_layout(layout, ids, attn)
    labels = ids.masked_fill(cm == 0, -100)
    assert shared_labels(layout, labels).tolist() == [[-100, -100, -100, 20, 21, -100, 30, 31, 32, -100]]


def test_completions_sharing_first_tokens_share_them():
    ids, attn, cm = _stock([[1, 2, 5, 6, 7], [1, 2, 5, 6, 9]], [2, 2])
    layout = build_layout(StockRows(ids, attn, prompt_lengths=prompt_lengths_from_completion_mask(attn, cm)))
    assert layout.input_ids.tolist() == [[1, 2, 5, 6, 7, 6, 9]]
    check_layout(layout, ids, attn)


def test_identical_and_nested_rows():
    ids, attn, _ = _stock([[1, 2, 3], [1, 2, 3], [4, 5], [4, 5, 6]])
    layout = build_layout(StockRows(ids, attn))
    assert torch.equal(layout.stock_index[0], layout.stock_index[1])  # identical rows: stored once, read twice
    # a row that ends where another goes on reads that row's path: no copy
    assert (layout.document_ids >= 0).sum() == 3 + 3
    check_layout(layout, ids, attn)


def test_no_common_prefix_is_two_documents():
    ids, attn, _ = _stock([[1, 2, 3], [4, 5]])
    layout = build_layout(StockRows(ids, attn))
    assert layout.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    check_layout(layout, ids, attn)


def test_prompt_token_and_completion_token_share_a_position():
    # multi-turn: turn 1's chosen answer [3, 4] is a completion in row 0 and part of the prompt in row 1
    rows = [[1, 2, 3, 4], [1, 2, 7, 8], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 9]]
    ids, attn, cm = _stock(rows, [2, 2, 5, 5])
    layout = build_layout(StockRows(ids, attn, prompt_lengths=prompt_lengths_from_completion_mask(attn, cm)))
    assert layout.input_ids.shape == (1, 4 + 3 + 2 + 2)  # one document: [1 2 3 4 5 6 | 5 9 | 2 7 8] and a copy
    assert torch.equal(layout.stock_index[0, :4], layout.stock_index[2, :4])
    check_layout(layout, ids, attn)
    labels = ids.masked_fill(cm == 0, -100)
    shared = shared_labels(layout, labels)  # row 0 scores 3 and 4 where rows 2 and 3 score nothing
    assert shared.view(-1)[layout.stock_index[0, 1]] == 3


def test_documents_join_on_whole_prompts_only():
    # two pairs whose prompts share a 2-token header only: two documents; with the prompt rule off, one
    rows = [[1, 2, 3, 4, 10], [1, 2, 3, 4, 11], [1, 2, 5, 6, 12], [1, 2, 5, 6, 13]]
    ids, attn, cm = _stock(rows, [4, 4, 4, 4])
    layout = build_layout(StockRows(ids, attn, prompt_lengths=prompt_lengths_from_completion_mask(attn, cm)))
    assert layout.input_ids.shape[0] == 2
    check_layout(layout, ids, attn)
    merged = build_layout(StockRows(ids, attn))
    assert merged.input_ids.shape[0] == 1
    check_layout(merged, ids, attn)


def test_examples_kept_apart_and_unshared_rows():
    rows = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [1, 2, 5]]
    ids, attn, _ = _stock(rows)
    examples = torch.tensor([0, 0, 1, 1])
    apart = build_layout(StockRows(ids, attn, examples=examples, across_examples=False))
    assert apart.input_ids.shape[0] == 2
    assert not torch.equal(apart.stock_index[0], apart.stock_index[2])
    check_layout(apart, ids, attn)
    unshared = build_layout(StockRows(ids, attn, examples=torch.tensor([0, 1, 0, 2]), share=False))
    assert torch.equal(unshared.stock_index[0], unshared.stock_index[2])  # identical rows of one example
    assert (unshared.document_ids >= 0).sum() == 9
    check_layout(unshared, ids, attn)


def test_packing_rows():
    rows = [[1, 2, 3, 7], [1, 2, 3, 8, 8], [1, 2, 3, 9], [4, 5, 6], [4, 5, 7]]
    ids, attn, cm = _stock(rows, [3, 3, 3, 2, 2])
    layout = build_layout(
        StockRows(ids, attn, prompt_lengths=prompt_lengths_from_completion_mask(attn, cm)),
        rows=RowPolicy(pack=True, length=16, one_row=True),
    )
    assert layout.input_ids.shape == (1, 16)
    # document 0: [1 2 3 7 | 3 8 8 | 3 9]; document 1: [4 5 6 | 5 7]
    assert layout.document_ids.tolist()[0] == [0] * 9 + [1] * 5 + [-1] * 2
    check_layout(layout, ids, attn)


def test_left_padded_generations_and_scored_padding():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [2, 3, 4], [2, 3, 4]]  # left-padded prompts of different lengths
    ids, attn, _ = _stock(rows, left=True)
    layout = build_layout(StockRows.generated(ids, attn, 3), pad_token_id=0)
    check_layout(layout, ids, attn)
    assert torch.equal(layout.stock_index[2], layout.stock_index[3])
    # online DPO scores the padding after a completion: [prompt | completion | pad]
    ids = torch.tensor([[0, 1, 2, 7, 0], [0, 1, 2, 8, 9], [0, 1, 2, 7, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    layout = build_layout(StockRows.generated(ids, attn, 3, score_padding=True), pad_token_id=0)
    check_layout(layout, ids, attn, score_padding=True)
    assert torch.equal(layout.stock_index[0], layout.stock_index[2])


def _random_rows(rng, n_rows, vocab=4):
    """Rows that share prefixes at random depths (small vocabulary: many collisions, nested and identical rows)."""
    rows = []
    for _ in range(n_rows):
        if rows and rng.random() < 0.7:
            base = rng.choice(rows)
            row = base[: rng.randrange(0, len(base) + 1)]
        else:
            row = []
        row = row + [rng.randrange(1, vocab + 1) for _ in range(rng.randrange(0 if row else 1, 6))]
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", range(40))
def test_trie_matches_brute_force_oracle(seed):
    rng = random.Random(seed)
    rows = _random_rows(rng, rng.randrange(1, 9))
    left = seed % 2 == 1
    ids, attn, _ = _stock(rows, left=left)
    layout = build_layout(StockRows(ids, attn))  # any shared token joins: one trie where the rows share a first token
    check_layout(layout, ids, attn)
    width = ids.shape[1]
    keyed = [[(t, (width - len(r) if left else 0) + c) for c, t in enumerate(r)] for r in rows]
    by_first: dict = {}
    for row in keyed:
        by_first.setdefault(row[0], []).append(row)
    assert (layout.document_ids >= 0).sum() == sum(reference_positions(group) for group in by_first.values())


def test_wrong_mask_fails_the_visibility_check():
    """A mask that lets a sibling subtree see another (causal within the document) must fail `check_layout`."""
    ids, attn, cm = _stock([[1, 2, 3, 4], [1, 2, 3, 5, 6]], [2, 2])
    layout = build_layout(StockRows(ids, attn))
    n, s = layout.input_ids.shape
    leaky = dataclasses.replace(
        layout, subtree_end=torch.full_like(layout.subtree_end, s)
    )  # every key visible to every later query
    with pytest.raises(AssertionError):
        check_layout(leaky, ids, attn)
    mask = dense_mask(causal, n, s, s) & dense_mask(same_document(layout.document_ids), n, s, s)
    assert not torch.equal(mask, dense_mask(prefix_sharing_mask(layout.subtree_end), n, s, s))


def test_shared_positions_and_label_check():
    ids, attn, cm = _stock([[1, 2, 3, 4], [1, 2, 3, 5]], [2, 2])
    layout = build_layout(StockRows(ids, attn))
    assert shared_positions(layout).sum() == 2  # tokens 1 and 2; the copies of 3 are read by one row each
    labels = ids.masked_fill(cm == 0, -100)
    broken = dataclasses.replace(layout, stock_index=layout.stock_index.clone())
    broken.stock_index[1, 3] = broken.stock_index[0, 3]  # two rows' different next tokens at one position
    broken.stock_index[1, 2] = broken.stock_index[0, 2]
    with pytest.raises(RuntimeError, match="two different labels"):
        shared_labels(broken, labels)


def test_holes_in_the_attention_mask_are_refused():
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="one run"):
        build_layout(StockRows(ids, torch.tensor([[1, 0, 1]])))


def test_a_layout_travels_with_its_batch():
    """The `Layout` in a batch moves with it: accelerate's `send_to_device` calls its `to`, which moves every tensor
    (and a mask or vision inputs added later), and a `DataLoader` pins it."""
    from accelerate.utils import send_to_device

    ids, attn, cm = _stock([[1, 2, 3, 4], [1, 2, 3, 5, 6]], [2, 2])
    layout = build_layout(
        StockRows(ids, attn, prompt_lengths=prompt_lengths_from_completion_mask(attn, cm), check=False)
    )
    layout.vision = {"pixel_values": torch.ones(2, 3)}
    moved = send_to_device({"input_ids": ids, "prefix_sharing": layout}, "meta")["prefix_sharing"]
    assert isinstance(moved, Layout) and moved is not layout and moved.check is False
    tensors = [getattr(moved, f.name) for f in dataclasses.fields(moved)] + [moved.vision["pixel_values"]]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    assert len(tensors) == 6 and all(t.device.type == "meta" for t in tensors)
    assert layout.input_ids.device.type == "cpu"  # the original is left as it was
    assert moved.num_positions.device.type == "meta"
    assert int(layout.num_positions) == int((layout.document_ids >= 0).sum()) == 7
