"""`trl-prefix-sharing stats` counts what training lays out, and quotes what the benchmarks recorded: DPO pairs behind
one shared system prompt, counted in micro-batches as training's collator lays them out (`num_shared_tokens` of a
real run), and the package's record of the benchmarks, derived from `docs/benchmarks` (it cannot go stale)."""

import json
import re
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """The tokenizer and the config of the model the training runs below train (`make_model("llama", ...)`), so that
    `stats` chooses by the same cost model."""
    from trl_prefix_sharing.testing import make_config

    path = tmp_path_factory.mktemp("stats_trained") / "model"
    tokenizer.save_pretrained(path)
    make_config("llama", len(tokenizer)).save_pretrained(path)
    return str(path)


def _system_pairs(n: int) -> list[dict]:
    """`n` pairs of different prompts behind one long system prompt (40 words), each with its own short question and
    answers: each pair shares its prompt, and different pairs share the system prompt."""
    system = {"role": "system", "content": " ".join(f"w{i}" for i in range(20, 60))}
    return [
        {
            "prompt": [system, {"role": "user", "content": f"w{100 + i}"}],
            "chosen": [{"role": "assistant", "content": f"w{150 + i} w{200 + i}"}],
            "rejected": [{"role": "assistant", "content": f"w{250 + i}"}],
        }
        for i in range(n)
    ]


def _trained_line(out: str, label: str) -> str:
    """The first line of what training lays out (SDPA's block) that starts with `label`, after it."""
    line = next(line for line in out.splitlines() if line.strip().startswith(label))
    return line.split(label)[1].strip()


def test_stats_dpo_counts_what_training_lays_out_behind_a_system_prompt(model_dir, tokenizer, tmp_path, capsys):
    """Pairs of different prompts behind one system prompt: each example on its own shares only its prompt, while
    training lays out each micro-batch's pairs together, after one copy of the system prompt (`always`, which the
    cost model keeps). The positions `stats` counts as training lays them out are the `num_shared_tokens` of a real
    run over the same consecutive micro-batches, the verdict weighs them, and they are far below the per-example
    count (so the comparison can fail)."""
    from trl_prefix_sharing.cli.stats import main
    from trl_prefix_sharing.cli.stats.reports import _verdict

    rows, batch_size = _system_pairs(12), 4
    data = tmp_path / "system_pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--dataset_name", str(data), "--model_name_or_path", model_dir, "--trainer", "dpo"]
    assert main([*argv, "--per_device_train_batch_size", str(batch_size)]) == 0
    out = capsys.readouterr().out
    joins = _trained_line(out, "with SDPA (dense, the CPU's kernel):")
    assert joins == "3 of 3 micro-batches joined across examples (always)"
    shared, stock = _trained_line(out, "tokens per example, shared:").split(" of stock's ")
    per_example = _trained_line(out, "positions per example:")  # each example on its own
    assert "prefix_sharing_join=auto keeps, per micro-batch" in out
    assert "verdict: prefix sharing pays on this dataset." in out

    lines = []
    logged = _train_dpo(tokenizer, tmp_path, rows, batch_size, lines)
    assert float(shared) == pytest.approx(logged / len(rows), abs=0.05)  # printed to one decimal
    # the run's start-up line and the verdict agree: its first micro-batch saves what `stats` predicts
    line = float(re.search(r"([\d.]+)x fewer tokens", lines[0]).group(1))
    predicted = float(re.search(r": ([\d.]+)x", stock).group(1))
    assert _verdict(line) == "pays" and abs(line - predicted) < 0.7, (line, predicted)
    alone = float(per_example.split("shared ")[1].split(" ")[0])
    assert alone > 1.5 * logged / len(rows)  # each example alone computes the system prompt again
    assert float(stock.split(":")[0]) == float(per_example.split("stock ")[1].split(",")[0])

    # `--prefix_sharing_join prompts`: only a prompt's own pairs join, each micro-batch computes the system prompt
    # once per pair, and the report counts that
    assert main([*argv, "--per_device_train_batch_size", str(batch_size), "--prefix_sharing_join", "prompts"]) == 0
    prompts = capsys.readouterr().out
    assert _trained_line(prompts, "with SDPA (dense, the CPU's kernel):").startswith("0 of 3 micro-batches")
    assert float(_trained_line(prompts, "tokens per example, shared:").split(" of ")[0]) == alone


def test_stats_dpo_counts_exactly_what_training_lays_out(tokenizer, tmp_path):
    """The count behind the printed figure, to the position: `trained.measure_trained` over the trainer's own
    collator (built by `stats` on its stand-in model), with the trained model's cost model, gives the run's
    `num_shared_tokens`."""
    import datasets

    from trl_prefix_sharing.cli.stats.arguments import parse_args
    from trl_prefix_sharing.cli.stats.preprocessing import _prepared_preferences
    from trl_prefix_sharing.cli.stats.trained import measure_trained
    from trl_prefix_sharing.testing import make_model

    rows, batch_size = _system_pairs(6), 4  # a full micro-batch, then one of two pairs
    args = parse_args(["--dataset_name", "-", "--model_name_or_path", "-", "--trainer", "dpo"])
    dataset, collator = _prepared_preferences(datasets.Dataset.from_list(rows), tokenizer, args)
    trained = measure_trained(dataset, collator, make_model("llama", len(tokenizer)), batch_size)
    assert trained["sdpa"].batches == 2 and trained["sdpa"].joins["always"] == 2
    assert trained["sdpa"].tokens == _train_dpo(tokenizer, tmp_path, rows, batch_size)


def _train(name: str, tokenizer, tmp_path, rows, batch_size: int, lines=None, **config) -> tuple[int, int]:
    """A run of this package's trainer `name` (DPO, ORPO, CPO or KTO; with a reference where it takes one) over `rows`
    in micro-batches of `batch_size` consecutive examples (one epoch, the default `prefix_sharing_join="auto"`, SDPA
    fixed: the plan is the cost model's, as `stats` counts it; `"auto"` would also pick a kernel, or stock's rows, by
    measured time): the `num_shared_tokens` it logs last (a running total of the positions its policy's training
    forwards computed), and the examples it trained on (KTO unpairs each pair into two); its start-up line appended
    to `lines`, if given."""
    import datasets

    from trl_prefix_sharing.testing import make_model
    from trl_prefix_sharing.testing.trainers import build_trainer, shared_tokens_of_run

    examples = 2 * len(rows) if name == "kto" else len(rows)
    steps = -(-examples // batch_size)
    trainer = build_trainer(
        name,
        stock=False,
        model=make_model("llama", len(tokenizer)),
        ref_model=make_model("llama", len(tokenizer)),
        tokenizer=tokenizer,
        train_dataset=datasets.Dataset.from_list(rows),
        output_dir=str(tmp_path / "run"),
        copy_models=False,
        use_cpu=True,
        bf16=False,
        prefix_sharing=True,
        prefix_sharing_attn_implementation="sdpa",
        per_device_train_batch_size=batch_size,
        train_sampling_strategy="sequential",
        max_steps=steps,
        logging_steps=steps,
        **config,
    )
    return shared_tokens_of_run(trainer, lines), examples


def _train_dpo(tokenizer, tmp_path, rows, batch_size: int, lines=None) -> int:
    return _train("dpo", tokenizer, tmp_path, rows, batch_size, lines)[0]


def _stats(capsys, model_dir, data, trainer: str, *flags) -> str:
    from trl_prefix_sharing.cli.stats import main

    argv = ["--dataset_name", str(data), "--model_name_or_path", model_dir, "--trainer", trainer, *flags]
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_stats_paired_counts_what_training_lays_out_behind_a_system_prompt(
    kind, model_dir, tokenizer, tmp_path, capsys
):
    """ORPO and CPO lay out the 2B rows of a micro-batch together in their step (`concatenated_forward`): pairs of
    different prompts behind one system prompt share it there, though each example on its own shares only its prompt.
    The positions `stats` counts as training lays them out are the `num_shared_tokens` of a real run over the same
    consecutive micro-batches (printed, and to the position by `trained.measure_paired` over the trainer `stats`
    builds), the verdict weighs them, and they are far below the per-example count; `--prefix_sharing_join prompts`
    joins no micro-batch."""
    import datasets

    from trl_prefix_sharing.cli.stats.preprocessing import paired_trainer
    from trl_prefix_sharing.cli.stats.trained import measure_paired
    from trl_prefix_sharing.testing import make_model

    rows, batch_size = _system_pairs(12), 4
    data = tmp_path / "system_pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = _stats(capsys, model_dir, data, kind, "--per_device_train_batch_size", str(batch_size))
    assert _trained_line(out, "with SDPA (dense, the CPU's kernel):") == (
        "3 of 3 micro-batches joined across examples (always)"
    )
    shared, stock = _trained_line(out, "tokens per example, shared:").split(" of stock's ")
    per_example = _trained_line(out, "positions per example:")  # each example on its own
    assert "verdict: prefix sharing pays on this dataset." in out

    logged, examples = _train(kind, tokenizer, tmp_path, rows, batch_size)
    assert shared == f"{logged / examples:.1f}"  # printed to one decimal
    assert float(stock.split(":")[0]) == float(per_example.split("stock ")[1].split(",")[0])
    assert float(per_example.split("shared ")[1].split(" ")[0]) > 1.5 * logged / examples
    trainer = paired_trainer(datasets.Dataset.from_list(rows), tokenizer, kind, 1024)
    trained = measure_paired(trainer, make_model("llama", len(tokenizer)), batch_size)
    assert trained["sdpa"].tokens == logged and trained["sdpa"].joins["always"] == 3

    prompts = _stats(
        capsys, model_dir, data, kind, "--per_device_train_batch_size", "4", "--prefix_sharing_join", "prompts"
    )
    assert _trained_line(prompts, "with SDPA (dense, the CPU's kernel):").startswith("0 of 3 micro-batches")


def test_stats_orpo_counts_scored_padding_as_training_does(tokenizer, tmp_path):
    """With `prefix_sharing_score_padding=True` the shared rows also compute each stock row's padding: what
    `trained.measure_paired` counts is still the run's `num_shared_tokens` (three micro-batches of 2, of rows of
    different lengths)."""
    import datasets

    from trl_prefix_sharing.cli.stats.preprocessing import paired_trainer
    from trl_prefix_sharing.cli.stats.trained import measure_paired
    from trl_prefix_sharing.testing import make_model

    rows = [
        {**row, "chosen": [{"role": "assistant", "content": " ".join(["w7"] * (1 + i % 3))}]}
        for i, row in enumerate(_system_pairs(6))
    ]
    logged, _ = _train("orpo", tokenizer, tmp_path, rows, 2, prefix_sharing_score_padding=True)
    trainer = paired_trainer(datasets.Dataset.from_list(rows), tokenizer, "orpo", 1024, score_padding=True)
    scored = measure_paired(trainer, make_model("llama", len(tokenizer)), 2)["sdpa"]
    assert scored.tokens == logged
    trainer = paired_trainer(datasets.Dataset.from_list(rows), tokenizer, "orpo", 1024)
    assert measure_paired(trainer, make_model("llama", len(tokenizer)), 2)["sdpa"].tokens < logged


@pytest.mark.parametrize("merge_kl", [None, False], ids=["merged", "apart"])
def test_stats_kto_counts_what_training_lays_out_behind_a_system_prompt(
    merge_kl, model_dir, tokenizer, tmp_path, capsys
):
    """KTO lays out each micro-batch's main and KL rows together in the policy's pass (merged, as its rule does on
    these long prompts), or the main rows and the KL rows one layout each (`prefix_sharing_merge_kl=False`): either
    way different prompts share the system prompt. What `stats` counts of the policy's pass is the run's
    `num_shared_tokens` (printed, and to the position by `trained.measure_kto`), and the verdict weighs a training
    step as training lays it out."""
    import datasets

    from trl_prefix_sharing.cli.stats.preprocessing import kto_trainer
    from trl_prefix_sharing.cli.stats.trained import measure_kto
    from trl_prefix_sharing.testing import make_model

    rows, batch_size = _system_pairs(6), 4  # unpaired: 12 examples, three micro-batches
    data = tmp_path / "system_pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--per_device_train_batch_size", str(batch_size)]
    flags += [] if merge_kl is None else ["--prefix_sharing_merge_kl", str(merge_kl).lower()]
    out = _stats(capsys, model_dir, data, "kto", *flags)
    merged = 3 if merge_kl is None else 0
    joins = _trained_line(out, "with SDPA (dense, the CPU's kernel):")
    assert f"the policy's main and KL rows in one layout in {merged} of 3 micro-batches" in joins
    shared = _trained_line(out, "tokens per example, shared:").split(" of stock's ")[0]
    assert "a training step, shared:" in out and "of the ideals of a training step as training lays it out" in out
    assert "verdict: prefix sharing pays on this dataset." in out

    logged, examples = _train("kto", tokenizer, tmp_path, rows, batch_size, prefix_sharing_merge_kl=merge_kl)
    assert shared == f"{logged / examples:.1f}"
    alone = _trained_line(out, "positions per example, main and KL rows:")  # each example on its own
    assert float(alone.split("shared ")[1].split(" ")[0]) > 1.2 * logged / examples
    trainer = kto_trainer(datasets.Dataset.from_list(rows), tokenizer, 1024, batch_size, merge_kl=merge_kl)
    trained = measure_kto(trainer, make_model("llama", len(tokenizer)), batch_size)["sdpa"]
    assert trained.tokens == logged and trained.merged == merged and trained.examples == examples


def test_the_package_record_is_what_the_benchmarks_recorded():
    """`trl_prefix_sharing/data/measured_speedups.json` (what `stats` quotes) is exactly what `benchmarks.record`
    derives from the records of `docs/benchmarks`: rerun `python -m benchmarks.record` after a benchmark is recorded
    again. Each record `stats` reads is there: DPO and reward on the CPU and on a GPU, SFT, GRPO, online DPO, KTO, ORPO
    and CPO."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.record import PACKAGE_FILE, measured_speedups
    finally:
        sys.path.remove(str(ROOT))
    from trl_prefix_sharing.cli.stats import speedups

    derived = measured_speedups()
    assert json.loads(Path(PACKAGE_FILE).read_text()) == derived
    assert speedups.measured_speedups() == derived  # the package's data is the file
    kinds = {
        (record["mode"], kind) for record in derived.values() for kind in record if isinstance(record[kind], dict)
    }
    expected = {"dpo", "reward", "sft", "grpo", "online_dpo", "kto", "orpo", "cpo"}
    assert {kind for _, kind in kinds} == expected
    assert {("gpu", "dpo"), ("gpu", "reward")} <= kinds
    gpu = next(record for record in derived.values() if record["mode"] == "gpu")
    assert gpu["device"] == json.loads((ROOT / "docs" / "benchmarks" / "gpu.json").read_text())["device"]
    assert gpu["reward"]["HH-RLHF"]["sharing"] < 1.0  # a record slower than stock, as measured


def test_stats_says_no_record_only_where_there_is_none(monkeypatch):
    """A device or trainer with no record is said so only when it is true: SFT has a CPU record and no GPU one; RLOO
    none; DPO both."""
    from trl_prefix_sharing.cli.stats import speedups

    lines, _ = speedups.expected_speedups("dpo", 2.0, 1.5, 1.6)
    assert [line.split(" (")[0].strip() for line in lines] == ["CPU", "GPU"]
    assert not any("no DPO benchmark" in line for line in lines)
    lines, values = speedups.expected_speedups("sft", 0.0, 3.0, 3.0, by="padded_ideal")
    assert lines[-1] == "    GPU: no SFT benchmark recorded" and len(values) == 1
    assert "measured on the rag profile, ideal with padding 5.41x" in lines[0]  # the nearest by its ideal
    assert speedups.measured_group_speedups("rloo", 1.0, 2) == ["    no RLOO benchmark recorded"]
    (grpo, gpu) = speedups.measured_group_speedups("grpo", 1.0, 4)
    assert "measured on the chat, G=4 profile" in grpo and gpu == "    GPU: no GRPO benchmark recorded"
    (online, _) = speedups.measured_group_speedups("online_dpo", 0.3, 2)
    assert "math-reasoning, G=2" in online and "runs stock's own rows" in online  # measured 0.92x
