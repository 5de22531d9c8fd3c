"""A 2-process CPU run (gloo, torchrun) of DPO with prefix sharing and packing finishes an epoch: equal batch counts
on both ranks though they hold different numbers of pairs, every example seen exactly once, same logged losses."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("prefix_sharing", [1, 0])
def test_two_process_packed_epoch(tmp_path, prefix_sharing):
    script = Path(__file__).parent / "distributed_train.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(script), "--out", str(tmp_path), "--prefix_sharing",
           str(prefix_sharing)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["len"] == ranks[1]["len"] == len(ranks[0]["batches"]) == len(ranks[1]["batches"])
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0
    assert ranks[0]["pairs_per_batch"] != ranks[1]["pairs_per_batch"]  # unequal pairs per rank, and no hang
    seen = sorted(i for r in ranks for batch in r["batches"] for i in batch)
    assert seen == list(range(37))
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == ranks[0]["steps"]
