"""CUDA only (skipped elsewhere): training steps through FlexAttention with the BlockMask, the default on CUDA, equal
stock TRL's (FlexAttention has no backward on CPU, so this is where its gradients are checked). Run on a GPU machine:
`pytest tests/test_cuda.py`."""

import pytest
import torch
from equivalence import awkward_text_dataset, compare_step, make_trainers

from trl_prefix_sharing.tiny import FAMILIES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention backward)")


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_flex_attention_training_step_matches_stock(tmp_path, tokenizer, family, packing):
    torch.backends.cuda.matmul.allow_tf32 = False
    stock, shared = make_trainers(tmp_path, family, awkward_text_dataset(), tokenizer, use_cpu=False,
                                  ours={"prefix_sharing": True, "packing": packing})
    assert shared._attn_implementation == "flex_attention"
    _, result = compare_step(stock, shared, atol=1e-4, rtol=1e-4)
    assert type(result["batch"]["prefix_sharing"]["attention_mask"]).__name__ == "BlockMask"
