"""`trl-prefix-sharing stats --trainer sft`: the positions it prints match hand counts on tiny datasets (prompt and
completion with a shared system preamble and several completions per prompt; plain text), under each
`--prefix_sharing_join`; the flags that do not apply are one-line errors."""

import json
import re

import pytest


_SYSTEM = {"role": "system", "content": "w1 w2 w3"}


def _conversation(question, answer):
    return {
        "prompt": [_SYSTEM, {"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": answer}],
    }


#: `<|system|> w1 w2 w3 <|end|> <|user|> w4 <|end|> <|assistant|>` (9 tokens) with two completions, `w5 <|end|>` and
#: `w6 w7 <|end|>` (rows of 11 and 12); `... <|user|> w8 w9 <|end|> <|assistant|>` (10) with three, `w10 <|end|>`,
#: `w11 w12 <|end|>`, `w13 <|end|>` (rows of 12, 13, 12). Both prompts start with `<|system|> w1 w2 w3 <|end|>
#: <|user|>` (6 tokens).
_CHAT = [
    _conversation("w4", "w5"),
    _conversation("w4", "w6 w7"),
    _conversation("w8 w9", "w10"),
    _conversation("w8 w9", "w11 w12"),
    _conversation("w8 w9", "w13"),
]
#: EOS added: rows of 5, 6, 5 and 2 tokens; the first two share `w1 w2 w3`, the first and third are equal
_TEXT = [{"text": "w1 w2 w3 w4"}, {"text": "w1 w2 w3 w5 w6"}, {"text": "w1 w2 w3 w4"}, {"text": "w7"}]


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    from trl_prefix_sharing.testing import make_config

    path = tmp_path_factory.mktemp("stats_sft") / "model"
    tokenizer.save_pretrained(path)
    make_config("llama", len(tokenizer)).save_pretrained(path)
    return str(path)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _section(stdout, join):
    """The lines of `prefix_sharing_join=join`'s plan."""
    lines = stdout.splitlines()
    start = lines.index(f"  prefix_sharing_join={join}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("    ")), len(lines))
    return lines[start:end]


def _in(lines, label):
    (line,) = [line for line in lines if line.strip().startswith(label)]
    return line.split(label)[1].strip()


def _trained(stdout, kernel="SDPA"):
    """The lines of what training lays out under `kernel` (SDPA: the first block)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"    with {kernel} ("))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("      ")), len(lines))
    return lines[start:end]


def _stats(capsys, *argv):
    from trl_prefix_sharing.cli.stats import main

    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_stats_sft_prompt_completion_matches_a_hand_count(model_dir, tmp_path, capsys):
    """Stock: 11 + 12 + 12 + 13 + 12 = 60 tokens, one batch of 5 rows padded to 13: 65. `prompts`: each prompt's
    completions join, each later one after a copy of the prompt's last token: 11 + (12 - 8) = 15 and 12 + 13 + 12 -
    2 x 9 = 19; 34 tokens, 2 rows x 19 = 38 with padding. `always`: the two prompts' documents join after their
    common 6 tokens (less the copy of the sixth): 34 - 5 = 29, one row of 29."""
    data = _write_jsonl(tmp_path / "chat.jsonl", _CHAT)
    base = ["--dataset_name", data, "--model_name_or_path", model_dir, "--trainer", "sft"]
    out = _stats(capsys, *base, "--prefix_sharing_join", "prompts")
    assert "(5 examples after TRL's preprocessing; sft, max_length=1024, truncation keep_start; " in out
    assert "completion_only_loss=True)" in out
    assert "'llama', measured equal to stock TRL" in out
    assert "1 of 8 rows in the dataset's order (SFT's sampler is random" in out
    assert "p10 9, p50 10, p90 10, p99 10" in out.split("prompt tokens:")[1].splitlines()[0]
    assert "prefix_sharing_join=always:" not in out
    prompts = _section(out, "prompts")
    assert _in(prompts, "positions per example:") == "stock 12.0, shared 6.8 (tokens, no padding)"
    assert _in(prompts, "with padding, batches of 8:") == "stock 13.0, shared 7.6"
    assert _in(prompts, "rows sharing a shared row:").startswith("5 of 5")
    assert _in(prompts, "ideal speedup, linear layers:").startswith(f"{60 / 34:.2f}x")
    assert _in(prompts, "ideal with padding, batches of 8:").startswith(f"{65 / 38:.2f}x")
    assert "    CPU (CPU, 2 threads; " in out  # `benchmarks.join`'s SFT record, quoted
    assert "    GPU: no SFT benchmark recorded" in out  # and only where it is so
    assert "verdict: prefix sharing pays on this dataset." in out

    out = _stats(capsys, *base, "--prefix_sharing_join", "always")
    always = _section(out, "always")
    assert "prefix_sharing_join=prompts:" not in out
    assert _in(always, "positions per example:") == "stock 12.0, shared 5.8 (tokens, no padding)"
    assert _in(always, "with padding, batches of 8:") == "stock 13.0, shared 5.8"
    assert _in(always, "ideal with padding, batches of 8:").startswith(f"{65 / 29:.2f}x")

    out = _stats(capsys, *base)  # auto, the default: both plans, and what training keeps of them
    assert _in(_section(out, "prompts"), "positions per example:").startswith("stock 12.0, shared 6.8")
    assert _in(_section(out, "always"), "positions per example:").startswith("stock 12.0, shared 5.8")
    assert "prefix_sharing_join=auto keeps, per micro-batch, whichever plan" in out
    trained = _trained(out)
    assert _in(trained, "with SDPA (dense, the CPU's kernel):").startswith("1 of 1 micro-batches joined across")
    assert _in(trained, "tokens per example, shared:").startswith("5.8 of stock's 12.0")


def test_stats_sft_text_matches_a_hand_count(model_dir, tmp_path, capsys):
    """Batches of 2: rows of 5 and 6 sharing `w1 w2 w3`, then rows of 5 and 2. Every token is trained on, so a row's
    prompt is all of it: `prompts` joins nothing (stock: 18 tokens; 12 + 10 = 22 with padding). `always` joins the
    first two after one copy of their third token: 5 + 6 - 2 = 9, then 7 (a row of 9, two of 5): 16 and 19."""
    data = _write_jsonl(tmp_path / "text.jsonl", _TEXT)
    base = ["--dataset_name", data, "--model_name_or_path", model_dir, "--trainer", "sft"]
    base += ["--per_device_train_batch_size", "2"]
    out = _stats(capsys, *base, "--prefix_sharing_join", "prompts")
    assert (
        "(4 examples after TRL's preprocessing; sft, max_length=1024, truncation keep_start; trained on every" in out
    )
    assert "none: every row trains on all its tokens" in out
    prompts = _section(out, "prompts")
    assert _in(prompts, "positions per example:") == "stock 4.5, shared 4.5 (tokens, no padding)"
    assert _in(prompts, "with padding, batches of 2:") == "stock 5.5, shared 5.5"
    assert _in(prompts, "rows sharing a shared row:").startswith("0 of 4")
    assert "verdict: prefix sharing does not pay on this dataset." in out

    out = _stats(capsys, *base, "--prefix_sharing_join", "always")
    always = _section(out, "always")
    assert _in(always, "positions per example:") == "stock 4.5, shared 4.0 (tokens, no padding)"
    assert _in(always, "with padding, batches of 2:") == "stock 5.5, shared 4.8"
    assert _in(always, "rows sharing a shared row:").startswith("2 of 4")
    assert _in(always, "shared start of a row, computed once:").startswith("p10 0, p50 3,")
    assert _in(always, "ideal with padding, batches of 2:").startswith(f"{22 / 19:.2f}x")

    out = _stats(capsys, *base, "--max_length", "4")  # truncated: 4, 4, 4, 2 tokens
    assert "sft, max_length=4, truncation keep_start" in out
    assert _in(_section(out, "prompts"), "positions per example:").startswith("stock 3.5, shared 3.5")


def test_stats_sft_joins_are_the_layouts():
    """`--prefix_sharing_join`'s values are the layout's."""
    from trl_prefix_sharing.cli.stats.defaults import SFT_JOIN, SFT_JOINS
    from trl_prefix_sharing.config import SFTConfig
    from trl_prefix_sharing.trie import JOINS

    assert SFT_JOINS == JOINS
    assert SFTConfig.__dataclass_fields__["prefix_sharing_join"].default == SFT_JOIN


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--trainer", "grpo", "--num_generations", "4", "--per_device_train_batch_size", "6"],
            "--per_device_train_batch_size 6 is not a multiple of --num_generations 4: a micro-batch holds whole "
            "groups of a prompt's generations",
        ),
        (["--trainer", "online_dpo", "--prefix_sharing_join", "sometimes"], "invalid choice: 'sometimes'"),
        (["--trainer", "sft", "--prefix_sharing_join", "sometimes"], "invalid choice: 'sometimes'"),
        (
            ["--trainer", "sft", "--prefix_sharing_merge_kl", "true"],
            "--prefix_sharing_merge_kl applies to --trainer kto",
        ),
        (["--trainer", "sft", "--num_generations", "4"], "--num_generations applies to --trainer grpo"),
        (["--trainer", "kto", "--truncation_mode", "keep_end"], "TRL's KTO trainer always keeps the start"),
    ],
)
def test_stats_sft_flag_mistakes_are_one_line(model_dir, tmp_path, capsys, args, message):
    from trl_prefix_sharing.cli.stats import main

    data = _write_jsonl(tmp_path / "text.jsonl", _TEXT)
    assert main(["--dataset_name", data, "--model_name_or_path", model_dir, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("trl-prefix-sharing stats: error: ") and message in line


def test_stats_sft_wrong_columns_are_one_line(model_dir, tmp_path, capsys):
    from trl_prefix_sharing.cli.stats import main

    data = _write_jsonl(tmp_path / "pairs.jsonl", [{"chosen": "w1", "rejected": "w2"}])
    assert main(["--dataset_name", data, "--model_name_or_path", model_dir, "--trainer", "sft"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trl-prefix-sharing stats: error: ") and "'text', 'messages'" in line


def _train_sft(tokenizer, tmp_path, rows, batch_size, lines=None, **options) -> int:
    """A run of this package's `SFTTrainer` over `rows` in micro-batches of `batch_size` consecutive rows (one epoch):
    the `num_shared_tokens` it logs, a running total of the positions its training forwards computed (and its
    start-up line appended to `lines`, if given)."""
    from datasets import Dataset

    from trl_prefix_sharing import SFTConfig, SFTTrainer
    from trl_prefix_sharing.testing import make_model
    from trl_prefix_sharing.testing.trainers import shared_tokens_of_run

    steps = -(-len(rows) // batch_size)
    trainer = SFTTrainer(
        model=make_model("llama", len(tokenizer)),
        args=SFTConfig(
            output_dir=str(tmp_path / "run"),
            use_cpu=True,
            bf16=False,
            report_to="none",
            prefix_sharing=True,
            per_device_train_batch_size=batch_size,
            train_sampling_strategy="sequential",
            max_steps=steps,
            logging_steps=steps,
            save_strategy="no",
            **options,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    return shared_tokens_of_run(trainer, lines)


@pytest.mark.parametrize("join", ["prompts", "always", "auto"])
@pytest.mark.parametrize("rows", [_CHAT, _TEXT], ids=["prompt-completion", "text"])
def test_stats_sft_counts_what_a_training_run_logs(tokenizer, tmp_path, rows, join):
    """`stats` counts SFT data with the trainer itself (built on a tiny stand-in model): the rows it lays
    out are stock TRL's (tokens and trained labels), and the positions it counts are the `num_shared_tokens` a run of
    this package's `SFTTrainer` logs over the same micro-batches (consecutive rows, the same join rule; `auto`: the
    plan training keeps per micro-batch, by the cost model of the model trained)."""
    import trl
    from datasets import Dataset

    from trl_prefix_sharing.cli.stats.counting import _measure_sft
    from trl_prefix_sharing.cli.stats.preprocessing import sft_trainer
    from trl_prefix_sharing.cli.stats.trained import kernel_collators
    from trl_prefix_sharing.testing import make_model

    dataset, batch_size = Dataset.from_list(rows), 3  # the first micro-batch holds rows of two prompts
    prepared = sft_trainer(dataset, tokenizer, 1024, "keep_start", join)
    stock = trl.SFTTrainer(
        model=make_model("llama", len(tokenizer)),
        args=trl.SFTConfig(output_dir=str(tmp_path / "stock"), use_cpu=True, bf16=False, report_to="none"),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    assert len(prepared.train_dataset) == len(stock.train_dataset) == len(rows)
    assert prepared.train_dataset["input_ids"] == stock.train_dataset["input_ids"]
    assert prepared.train_dataset["labels"] == stock.train_dataset["labels"]
    kernels = kernel_collators(prepared.data_collator, make_model("llama", len(tokenizer)))
    counts = _measure_sft(prepared.train_dataset, prepared.data_collator, batch_size, kernels)
    counted = counts.trained["sdpa"].tokens
    if join != "auto":
        assert counted == counts.plans[join].tokens  # a fixed join rule: its plan, whatever the cost

    options = {"prefix_sharing_join": join, "prefix_sharing_attn_implementation": "sdpa"}  # the cost model's plan
    logged = _train_sft(tokenizer, tmp_path, rows, batch_size, **options)
    assert counted > 0 and logged == counted
    if join != "auto":
        other_join = {"prompts": "always", "always": "prompts"}[join]
        other = sft_trainer(dataset, tokenizer, 1024, "keep_start", other_join)
        other_count = _measure_sft(other.train_dataset, other.data_collator, batch_size).plans[other_join].tokens
        assert other_count != logged  # rows of two prompts share a start: the other join rule counts otherwise
    assert counts.stock_tokens != logged  # the comparison can fail: stock's count differs


def _system_chat(n: int) -> list[dict]:
    """`n` conversations behind one long system prompt (40 words), each with its own short user and assistant turns:
    trained on every token (`messages`), so no row has a prompt and `prefix_sharing_join="prompts"` joins nothing."""
    system = {"role": "system", "content": " ".join(f"w{i}" for i in range(20, 60))}
    return [
        {
            "messages": [
                system,
                {"role": "user", "content": f"w{100 + i}"},
                {"role": "assistant", "content": f"w{150 + i} w{200 + i}"},
            ]
        }
        for i in range(n)
    ]


def test_stats_sft_predicts_the_join_training_keeps_behind_a_system_prompt(model_dir, tokenizer, tmp_path, capsys):
    """Chat data behind one shared system prompt, trained on every token: the prompts plan joins nothing (1.00x: a
    verdict on it says "does not pay"), while training's default `prefix_sharing_join="auto"` joins every micro-batch
    after one copy of the system prompt. `stats` counts what training keeps, with the cost model of the model it is
    given, and says it pays; its positions are the `num_shared_tokens` a run with the default join logs. The kernel
    is fixed (SDPA, the one `"auto"` prefers on the CPU): `"auto"` also picks a kernel, or stock's rows, per
    micro-batch by measured time, which no count predicts (and the suite's clock, which makes SDPA win, times every
    plan alike)."""
    from trl_prefix_sharing.cli.stats.reports import _verdict

    rows, batch_size = _system_chat(12), 4
    data = _write_jsonl(tmp_path / "system_chat.jsonl", rows)
    out = _stats(
        capsys, "--dataset_name", data, "--model_name_or_path", model_dir, "--trainer", "sft",
        "--per_device_train_batch_size", str(batch_size),
    )  # fmt: skip
    prompts = _section(out, "prompts")
    assert _in(prompts, "rows sharing a shared row:").startswith("0 of 12")
    labels = ("ideal speedup, linear layers:", "ideal with padding, batches of 4:")
    old = [float(_in(prompts, label).split("x")[0]) for label in labels]
    assert _verdict(min(old)) == "does not pay"  # what the report said when its verdict took the prompts plan
    trained = _trained(out)
    assert (
        _in(trained, "with SDPA (dense, the CPU's kernel):") == "3 of 3 micro-batches joined across examples (always)"
    )
    shared, stock = _in(trained, "tokens per example, shared:").split(" of stock's ")
    assert "verdict: prefix sharing pays on this dataset." in out

    lines = []
    logged = _train_sft(tokenizer, tmp_path, rows, batch_size, lines, prefix_sharing_attn_implementation="sdpa")
    assert float(shared) == pytest.approx(logged / len(rows), abs=0.05)  # printed to one decimal
    assert float(stock.split(":")[0]) > 2 * logged / len(rows)  # the comparison can fail: stock computes far more
    # the run's start-up line and the verdict agree: its first micro-batch saves what `stats` predicts
    line = float(re.search(r"([\d.]+)x fewer tokens", lines[0]).group(1))
    predicted = float(re.search(r": ([\d.]+)x", stock).group(1))
    assert _verdict(line) == "pays" and abs(line - predicted) < 0.7, (line, predicted)
