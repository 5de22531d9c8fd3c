"""2-process CPU runs (gloo, torchrun). With packing: an epoch finishes with equal batch counts on both ranks though
they hold different numbers of pairs, every example seen exactly once, same logged losses. With sharing: the same
losses as one process with the same global batch. KTO, ORPO and CPO: stock TRL's logged numbers and trained weights
under the same 2-process launch."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_prefix_sharing.testing.equivalence import assert_same_eval_metrics, assert_same_number


pytestmark = pytest.mark.long  # starts other processes: `bash scripts/test.sh --all`


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure(proc) -> str:
    """What a failed torchrun says: the children's error lines (anywhere in stderr) and the end of it."""
    lines = [line for line in proc.stderr.splitlines() if "what()" in line or "Error" in line or "enforce" in line]
    return "\n".join(lines[:20]) + "\n...\n" + proc.stderr[-2000:]


def _torchrun(script: str, processes: int, *args, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run `tests/<script>` on `processes` CPU processes (torch.distributed.run, gloo); fail with the children's
    errors."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    cmd += [str(Path(__file__).parent / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, _failure(proc)
    return proc


def _launch(out, processes, *args):
    out.mkdir(parents=True, exist_ok=True)
    _torchrun("distributed_train.py", processes, "--out", out, *args)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]


@pytest.mark.parametrize("prefix_sharing", [1, 0])
def test_two_process_packed_epoch(tmp_path, prefix_sharing):
    ranks = _launch(tmp_path, 2, "--prefix_sharing", prefix_sharing)
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["len"] == ranks[1]["len"] == len(ranks[0]["batches"]) == len(ranks[1]["batches"])
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0
    assert ranks[0]["pairs_per_batch"] != ranks[1]["pairs_per_batch"]  # unequal pairs per rank, and no hang
    seen = sorted(i for r in ranks for batch in r["batches"] for i in batch)
    assert seen == list(range(36))
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == ranks[0]["steps"]


@pytest.mark.parametrize("model_type", ["ps_plain_decoder", "ps_row_causal"])
def test_two_process_start_up_check_agrees(tmp_path, model_type):
    """A custom type outside the registry, two processes with packed batches of their own: both ranks run the check,
    take the largest difference of both, and reach the same verdict (trained on both, or refused on both, no hang)."""
    ranks = _launch(tmp_path, 2, "--model_type", model_type)
    checks = [r["check"] for r in ranks]
    assert checks[0]["difference"] == checks[1]["difference"] and checks[0]["values"] > 0
    assert checks[0]["spread"] == checks[1]["spread"]
    if model_type == "ps_plain_decoder":
        assert all(c["error"] is None and c["difference"] <= c["tolerance"] for c in checks)
        assert ranks[0]["steps"] == ranks[1]["steps"] > 0
    else:
        assert all("start-up check" in r["error"] and "prefix_sharing=False" in r["error"] for r in ranks)
        assert checks[0]["difference"] > 100 * checks[0]["tolerance"]


SAME_GLOBAL_BATCH = {
    # (one process, two processes): per_device_train_batch_size 4 on one rank = 2 on each of two
    "dpo-sharing": (
        ["--packing", 0, "--batch_size", 4, "--grad_accum", 1],
        ["--packing", 0, "--batch_size", 2, "--grad_accum", 1],
    ),
    # packing: one process takes the pairs of both ranks' packed batches as one ordinary batch (the plain mean)
    "dpo-sharing-packing": (["--packing", 0, "--replay_ranks", 2, "--grad_accum", 1], ["--grad_accum", 1]),
    "reward-sharing-packing": (
        ["--kind", "reward", "--packing", 0, "--replay_ranks", 2, "--grad_accum", 1],
        ["--kind", "reward", "--grad_accum", 1],
    ),
}


@pytest.mark.parametrize("setting", list(SAME_GLOBAL_BATCH))
def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path, setting):
    """Ranks hold different numbers of pairs under packing; the pair-normalised loss makes every optimizer step the
    plain mean over all of its pairs (not the mean of the ranks' means), so two ranks train exactly like one process
    with an ordinary batch of the same pairs."""
    one_args, two_args = SAME_GLOBAL_BATCH[setting]
    single = _launch(tmp_path / "one", 1, *one_args)
    double = _launch(tmp_path / "two", 2, *two_args)
    assert single[0]["steps"] == double[0]["steps"] == double[1]["steps"] == len(single[0]["losses"]) > 2
    if "packing" in setting:
        assert double[0]["pairs_per_batch"] != double[1]["pairs_per_batch"]
        assert single[0]["batches"] == [a + b for a, b in zip(double[0]["batches"], double[1]["batches"], strict=True)]
    for one, two in zip(single[0]["losses"], double[0]["losses"], strict=True):
        assert two == pytest.approx(one, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("kind,checkpointing", [("dpo", 1), ("reward", 0)])
def test_fsdp2_sharded_forward_matches_unsharded_stock(kind, checkpointing):
    proc = _torchrun("fsdp_check.py", 2, "--kind", kind, "--checkpointing", checkpointing)
    assert proc.stdout.count("gradients equal under FSDP2") == 2


@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_packed_evaluation_on_two_processes_equals_one(tmp_path, kind):
    """Packed eval batches hold different numbers of pairs on each rank: the evaluation loop's gathers accept that
    (they used to fail with a gloo size mismatch), and every metric that is a per-pair mean equals one process's."""
    single = _launch(tmp_path / "one", 1, "--kind", kind, "--evaluate", 1)[0]["metrics"]
    double = [rank["metrics"] for rank in _launch(tmp_path / "two", 2, "--kind", kind, "--evaluate", 1)]
    assert_same_eval_metrics(double[0], double[1], rel=0, abs=0)  # both ranks log the same
    assert_same_eval_metrics(single, double[0], rel=1e-5, abs=1e-7)


#: logged values that are wall-clock timings (they differ between runs and ranks), not numbers of the training
TIMINGS = ("runtime", "per_second", "step_time")
#: the trainers `tests/integration/deepspeed_train.py` trains like TRL's own classes in one launch, stock and shared
STOCK_LIKE_KINDS = ("kto", "orpo", "cpo")
#: the runs of the DDP launch: those, and DPO on the varlen kernel (its CPU reference)
DDP_RUNS = (*STOCK_LIKE_KINDS, "dpo-varlen")


def _numbers(log: dict) -> dict:
    return {key: value for key, value in log.items() if not any(word in key for word in TIMINGS)}


def assert_run_equals_stock(out: Path, ranks: list[dict], kind: str, min_per_line: int = 8) -> None:
    """Run `<kind>/ours` of `tests/integration/deepspeed_train.py` (prefix sharing, start-up check on) logged every
    number of every line that `<kind>/stock` logged under the same launch (timings aside: the loss, every metric,
    `grad_norm`),
    the same on every rank, and reached stock's trained weights (rank 0's `<kind>-<label>.pt`)."""
    stock, ours = f"{kind}/stock", f"{kind}/ours"
    for rank in ranks:
        assert rank[ours]["world"] == len(ranks)
        assert [_numbers(log) for log in rank[ours]["logs"]] == [_numbers(log) for log in ranks[0][ours]["logs"]]
    expected, got = ranks[0][stock]["logs"], ranks[0][ours]["logs"]
    assert len(expected) == len(got) >= 2
    for step, (line, got_line) in enumerate(zip(expected, got, strict=True), start=1):
        numbers = _numbers(line)
        # ours logs every key stock logs, and the positions it computed (gathered: the same on every rank)
        assert set(got_line) - set(line) == {"num_shared_tokens"} and len(numbers) >= min_per_line, (
            sorted(line),
            sorted(got_line),
        )
        for key, value in numbers.items():
            assert_same_number(got_line[key], value, f"step {step}, {key}", atol=1e-6, rtol=1e-5)
    before, after = torch.load(out / f"{kind}-stock.pt"), torch.load(out / f"{kind}-ours.pt")
    assert before and set(before) == set(after)
    for name, weight in before.items():
        assert weight.numel() > 0
        torch.testing.assert_close(after[name], weight, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    if kind == "kto":  # its `kl` term (a batch mean gathered across ranks, clamped at 0) compared where it is not 0
        assert max(line["kl"] for line in expected) > 0
    for rank in ranks:  # the start-up check ran on every rank (the policy under the launch's wrapper) and passed
        assert (rank[ours]["check"] or "").startswith("shared vs stock"), rank[ours]["check"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One 2-process DDP launch (`tests/integration/deepspeed_train.py` without DeepSpeed) training KTO, ORPO, CPO and
    DPO on the
    varlen kernel, stock then shared, in the same processes: (its folder, what each rank wrote)."""
    out = tmp_path_factory.mktemp("ddp")
    _torchrun("deepspeed_train.py", 2, "--out", out, "--runs", ",".join(DDP_RUNS), timeout=420)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind", DDP_RUNS)
def test_two_processes_equal_stock_in_the_same_launch(ddp_runs, kind):
    """KTO (its KL term on: a batch statistic gathered across ranks), ORPO and CPO (`loss_type="sigmoid"`), and DPO on
    the varlen kernel, under 2-process DDP (gloo): stock TRL and prefix sharing, trained one after the other in the
    same processes from the same weights on the same batches, log the same numbers and reach the same weights."""
    assert_run_equals_stock(*ddp_runs, kind)
