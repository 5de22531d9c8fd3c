"""GRPO with prefix sharing on 2 CPU processes (gloo) equals stock TRL on 2 processes: a group of generations that
straddles the processes shares what each process holds, and every logged number and the final weights are stock's."""

import json

import pytest
import torch
from test_distributed import _torchrun

from trl_prefix_sharing.testing.group_equivalence import UNCOMPARED


pytestmark = pytest.mark.long  # starts other processes: `bash scripts/test.sh --all`


def _launch(out, prefix_sharing):
    _torchrun("distributed_grpo.py", 2, "--out", out, "--prefix_sharing", prefix_sharing, timeout=300)
    return [json.loads((out / f"rank{r}-{prefix_sharing}.json").read_text()) for r in range(2)]


def test_two_process_grpo_matches_stock(tmp_path):
    stock, shared = _launch(tmp_path, 0), _launch(tmp_path, 1)
    assert all(rank["world"] == 2 for rank in stock + shared)
    for a, b in zip(stock, shared, strict=True):
        assert len(a["logs"]) == len(b["logs"]) == 2
        for log_a, log_b in zip(a["logs"], b["logs"], strict=True):
            compared = [k for k in log_a if k not in UNCOMPARED]
            assert len(compared) > 10
            for key in compared:
                assert log_b[key] == pytest.approx(log_a[key], rel=1e-4, abs=1e-5), key
        assert a["weights"].keys() == b["weights"].keys()
        for name in a["weights"]:
            torch.testing.assert_close(
                torch.tensor(b["weights"][name]), torch.tensor(a["weights"][name]), atol=1e-5, rtol=1e-4
            )
    assert shared[0]["logs"][-1]["num_shared_tokens"] < stock[0]["logs"][-1]["num_tokens"]
