"""FlexAttention through a model with shared rows several blocks long (CPU, forward): whole blocks of the
prefix-sharing mask are skipped, not only masked, and the result still equals stock TRL's.

The other model-level FlexAttention tests (tests/unit/test_compile.py) use rows under 128 tokens, a single partial
block, where block sparsity cannot show. Here a rejected completion's queries span whole blocks whose keys are all in
the chosen completion (and, packed, in other documents): the BlockMask must leave those blocks out, keep every block
the dense mask touches, and the forward (compiled FlexAttention, as on CUDA) must give stock TRL's loss and metrics.
"""

import pytest
import torch
from datasets import Dataset
from test_compile import force_flex_attention, forward

from trl_prefix_sharing.mask import dense_mask, prefix_sharing_mask
from trl_prefix_sharing.testing.equivalence import assert_same_number, make_trainers


BLOCK = 128  # FlexAttention's block size (`create_block_mask`'s default, the trainer's row multiple)


def long_pairs():
    """Prompts of 60-100 words and completions of 280-300: a shared row of 620-700 tokens, 5-6 blocks. The chosen
    completion covers at least two whole blocks, which the rejected completion's later query blocks never see."""
    rows = []
    for i, (prompt, chosen, rejected) in enumerate([(100, 299, 290), (60, 280, 300), (80, 290, 281), (90, 300, 285)]):
        words = [f"w{(i * 37 + j) % 200}" for j in range(prompt + chosen + rejected)]
        rows.append(
            {
                "prompt": " ".join(words[:prompt]),
                "chosen": " " + " ".join(words[prompt : prompt + chosen]),
                "rejected": " " + " ".join(words[prompt + chosen :]),
            }
        )
    return Dataset.from_list(rows)


def block_counts(block_mask, layout):
    """Blocks the BlockMask computes and its full blocks; blocks the dense mask touches and fills; causal blocks."""
    subtree_end = layout.subtree_end
    n, s = subtree_end.shape
    k = s // BLOCK
    dense = dense_mask(prefix_sharing_mask(subtree_end, layout.position_ids, None, layout.key_visible), n, s, s)
    blocks = dense.view(n, k, BLOCK, k, BLOCK).transpose(2, 3).reshape(n, k, k, BLOCK * BLOCK)
    full_kv = block_mask.full_kv_num_blocks
    computed = int(block_mask.kv_num_blocks.sum()) + (int(full_kv.sum()) if full_kv is not None else 0)
    full = int(full_kv.sum()) if full_kv is not None else 0
    return computed, full, int(blocks.any(-1).sum()), int(blocks.all(-1).sum()), n * k * (k + 1) // 2


@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
def test_whole_blocks_are_skipped_and_the_forward_equals_stock(tmp_path, tokenizer, monkeypatch, packing):
    # the trainer's CUDA set-up on CPU (FlexAttention is refused there only for lack of a backward); the BlockMask
    # is built uncompiled on CPU, transformers' FlexAttention runs compiled as everywhere
    force_flex_attention(monkeypatch)
    ours = {"prefix_sharing": True, "packing": packing, **({"packing_length": 4 * 768} if packing else {})}
    stock, shared = make_trainers(tmp_path, "llama", long_pairs(), tokenizer, ours=ours)
    examples = list(shared.train_dataset)
    stock_loss, stock_metrics, stock_batch = forward(stock, list(stock.train_dataset), "train")
    loss, metrics, batch = forward(shared, examples, "train")
    layout = batch["prefix_sharing"]
    block_mask = layout.attention.mask
    assert type(block_mask).__name__ == "BlockMask" and block_mask.BLOCK_SIZE == (BLOCK, BLOCK)
    rows, width = layout.input_ids.shape
    assert width % BLOCK == 0 and width >= 5 * BLOCK and rows == (1 if packing else 4), (rows, width)
    assert stock_batch["input_ids"].shape[1] > 2 * BLOCK  # stock's rows are several blocks long too

    computed, full, touched, full_dense, causal = block_counts(block_mask, layout)
    assert computed == touched and full == full_dense  # exactly the blocks the mask needs, none dropped
    # skipped beyond causal: per pair, at least the 2 whole chosen blocks x the rejected query blocks after them
    assert computed <= causal - 2 * 4, (computed, causal)
    if packing:  # one row of four documents: blocks across documents are skipped as well
        assert computed <= causal // 2, (computed, causal)

    torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
    assert {"logps/chosen", "logps/rejected", "rewards/margins"} <= set(stock_metrics)
    for key, value in stock_metrics.items():
        assert_same_number(metrics[key], value, f"metric {key}", atol=1e-5, rtol=1e-5)
