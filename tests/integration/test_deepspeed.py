"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU: 2 processes through `accelerate launch` (gloo), stock TRL and the prefix-shared
trainer under the same config, from the same weights on the same data, log the same losses and reach the same weights
(gathered from the partitions); the parameters (ZeRO-3) or the optimizer state (ZeRO-2) really are partitioned.
Packing under ZeRO-3 (ranks hold different numbers of pairs) equals stock TRL on one process taking each step's pairs
as one ordinary batch. KTO, ORPO and CPO: every logged number and the trained weights equal stock's under the same
launch (one per stage for the three). The child is tests/integration/deepspeed_train.py. DeepSpeed is in the `test`
extra, so CI
runs these."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import STOCK_LIKE_KINDS, _failure, _free_port, assert_run_equals_stock


pytestmark = pytest.mark.long  # starts other processes: `bash scripts/test.sh --all`


pytest.importorskip("deepspeed", reason="DeepSpeed is in the `test` extra (pip install -e '.[test]')")

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: {stage}
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
mixed_precision: 'no'
num_machines: 1
num_processes: {processes}
machine_rank: 0
use_cpu: true
"""


def _launch(out: Path, stage: int, processes: int, runs: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = out / "accelerate.yaml"
    config.write_text(CONFIG.format(stage=stage, processes=processes))
    script = Path(__file__).parent / "deepspeed_train.py"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(_free_port()),
        str(script),
        "--out",
        str(out),
        "--runs",
        runs,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, _failure(proc)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]
    for key in ranks[0]:
        assert ranks[0][key]["world"] == processes
        assert all(rank[key]["losses"] == ranks[0][key]["losses"] for rank in ranks)  # every rank logs the same
    return ranks


def _assert_same_run(out: Path, expected: str, got: str, expected_losses, got_losses) -> None:
    assert len(expected_losses) >= 2
    assert got_losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    before, after = torch.load(out / f"{expected}.pt"), torch.load(out / f"{got}.pt")
    assert before and set(before) == set(after)
    for name, weight in before.items():
        assert weight.numel() > 0
        torch.testing.assert_close(after[name], weight, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _assert_partitioned(partitioning: dict, stage: int) -> None:
    assert partitioning["stage"] == stage
    if stage == 3:  # parameters live in per-rank partitions, the module holds empty placeholders
        assert partitioning["local"] == 0 and 0 < partitioning["partition"] <= partitioning["full"] // 2 + 64
    # the optimizer's fp32 master weights are partitioned in both stages
    assert 0 < partitioning["optimizer_partition"] <= partitioning["full"] // 2 + 64


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_two_processes_equal_stock(tmp_path, stage):
    runs = "dpo,reward,dpo-packing,dpo-varlen" if stage == 3 else "dpo,reward"
    ranks = _launch(tmp_path, stage, 2, runs)
    for kind in ("dpo", "reward", "dpo-varlen") if stage == 3 else ("dpo", "reward"):  # varlen: its CPU reference
        stock, ours = ranks[0][f"{kind}/stock"], ranks[0][f"{kind}/ours"]
        _assert_same_run(tmp_path, f"{kind}-stock", f"{kind}-ours", stock["losses"], ours["losses"])
        for rank in ranks:
            _assert_partitioned(rank[f"{kind}/ours"]["partitioning"], stage)
            assert rank[f"{kind}/ours"]["check"].startswith("shared vs stock")  # the start-up check ran and passed
    if stage != 3:
        return
    # packing: the ranks hold different numbers of pairs; each step's loss is the plain mean over all of its pairs,
    # i.e. stock TRL on one process with an ordinary batch of the pairs of both ranks' packed batches
    assert ranks[0]["dpo-packing/ours"]["pairs_per_batch"] != ranks[1]["dpo-packing/ours"]["pairs_per_batch"]
    replay = _launch(tmp_path, stage, 1, "dpo-replay")[0]["dpo-replay/stock"]
    _assert_same_run(
        tmp_path, "dpo-replay-stock", "dpo-packing-ours", replay["losses"], ranks[0]["dpo-packing/ours"]["losses"]
    )


@pytest.fixture(scope="module")
def stock_like_launch(tmp_path_factory):
    """`launch(stage)`: one 2-process launch per ZeRO stage training KTO, ORPO and CPO, stock then shared, in the same
    processes (made once, shared by the tests of that stage): (its folder, what each rank wrote)."""
    launches = {}

    def launch(stage: int):
        if stage not in launches:
            out = tmp_path_factory.mktemp(f"zero{stage}")
            launches[stage] = out, _launch(out, stage, 2, ",".join(STOCK_LIKE_KINDS))
        return launches[stage]

    return launch


@pytest.mark.parametrize("kind", STOCK_LIKE_KINDS)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_kto_orpo_cpo_equal_stock(stock_like_launch, stage, kind):
    """KTO (its KL term on), ORPO and CPO (`loss_type="sigmoid"`) under ZeRO-2/3 on 2 processes: prefix sharing logs
    stock TRL's numbers on every line and reaches its weights (gathered from the partitions), with the parameters
    (ZeRO-3) or the optimizer state really partitioned."""
    out, ranks = stock_like_launch(stage)
    assert_run_equals_stock(out, ranks, kind)
    for rank in ranks:
        _assert_partitioned(rank[f"{kind}/ours"]["partitioning"], stage)
