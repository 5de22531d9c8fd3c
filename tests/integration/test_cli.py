"""The console scripts, end to end as subprocesses, on a tiny local model and dataset (offline)."""

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from trl_prefix_sharing.cli.quiet import STARTUP_LINES


pytestmark = pytest.mark.long  # starts other processes: `bash scripts/test.sh --all`


COMMON = [
    "--bf16",
    "false",
    "--use_cpu",
    "true",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--logging_steps",
    "1",
    "--max_steps",
    "2",
    "--per_device_train_batch_size",
    "4",
]


def _run(args, cwd, timeout=300):
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _console_script():
    path = Path(sys.executable).parent / "trl-prefix-sharing"
    return [str(path)] if path.exists() else [sys.executable, "-m", "trl_prefix_sharing"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tokenizer):
    from trl_prefix_sharing.testing import make_model, synthetic_pairs

    root = tmp_path_factory.mktemp("cli")
    make_model("llama", len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    with open(root / "prefs.jsonl", "w") as f:
        for row in synthetic_pairs(16, (10, 50), (1, 8), seed=40):
            f.write(json.dumps(row) + "\n")
    data_dir = root / "prefs_dir"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text((root / "prefs.jsonl").read_text())
    return root


def test_dpo_with_sharing_and_packing(workspace):
    out = workspace / "dpo_out"
    proc = _run(
        _console_script()
        + [
            "dpo",
            "--model_name_or_path",
            str(workspace / "model"),
            "--dataset_name",
            str(workspace / "prefs.jsonl"),
            "--output_dir",
            str(out),
            "--prefix_sharing",
            "true",
            "--packing",
            "true",
            *COMMON,
        ],
        cwd=workspace,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Prefix sharing: the first training micro-batch computes" in proc.stdout + proc.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((out / "config.json").read_text())
    assert not any("attn" in key for key in config) and "prefix" not in json.dumps(config)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("w1 w2 w3", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()


def test_reward_with_yaml_recipe_and_lora(workspace):
    out = workspace / "reward_out"
    recipe = workspace / "reward.yaml"
    recipe.write_text(
        f"model_name_or_path: {workspace / 'model'}\n"
        f"dataset_name: {workspace / 'prefs_dir'}\n"
        f"output_dir: {out}\n"
        "prefix_sharing: true\n"
        "use_peft: true\n"
        "lora_r: 4\n"
        "lora_alpha: 8\n"
        "lora_task_type: SEQ_CLS\n"
        "lora_target_modules: [q_proj, v_proj]\n"
    )
    proc = _run(
        [sys.executable, "-m", "trl_prefix_sharing", "reward", "--config", str(recipe), *COMMON], cwd=workspace
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the shared trainer really ran
    assert "Prefix sharing: the first training micro-batch computes" in proc.stdout + proc.stderr
    from peft import AutoPeftModelForSequenceClassification

    assert (out / "adapter_config.json").exists()
    model = AutoPeftModelForSequenceClassification.from_pretrained(out, num_labels=1)
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 1)


def test_unsupported_model_before_heavy_work(workspace):
    if not (workspace / "bloom").exists():
        from transformers import BloomConfig, BloomForCausalLM

        BloomForCausalLM(BloomConfig(vocab_size=400, hidden_size=16, n_layer=1, n_head=2)).save_pretrained(
            workspace / "bloom"
        )
    proc = _run(
        _console_script()
        + [
            "dpo",
            "--model_name_or_path",
            str(workspace / "bloom"),
            "--dataset_name",
            "prefs.jsonl",
            "--output_dir",
            str(workspace / "err_out"),
            "--prefix_sharing",
            "true",
            *COMMON,
        ],
        cwd=workspace,
    )
    assert proc.returncode == 2
    assert "can never support 'bloom': its ALiBi attention biases" in proc.stderr


#: the files the rows of the "Bad inputs" table in docs/cli.md name, as the table describes them
BAD_FILES = {
    "empty.jsonl": "",
    "blank.jsonl": "  \n\n \t\n",
    "invalid.jsonl": "{not json\n",
    "header.csv": "prompt,chosen,rejected\n",
    "answer.jsonl": json.dumps({"prompt": "w1 w2", "answer": "w3"}) + "\n",
    "text.jsonl": json.dumps({"text": "w1 w2 w3"}) + "\n",
    "promt.jsonl": json.dumps({"promt": "w1 w2", "chosen": "w3", "rejected": "w4"}) + "\n",
    "typo.yaml": "prefix_shraing: true\n",
    "broken.yaml": "learning_rate: [1.0e-6\n",
}
#: what every row's command gets before the row's own arguments (docs/cli.md says so above the table)
BAD_INPUT_BASE = [
    "--model_name_or_path",
    "model",
    "--dataset_name",
    "prefs.jsonl",
    "--output_dir",
    "out",
    "--bf16",
    "false",
    "--use_cpu",
    "true",
]


def bad_input_rows() -> list[tuple[str, str, int, str]]:
    """(the command line after `trl-prefix-sharing`, the message, the exit status, where it is found) of each row of
    the table under "## Bad inputs" in docs/cli.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    section = text.split("\n## Bad inputs\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if not line.startswith("| `") or len(cells) != 5:
            continue
        command, _, message, status, found = cells
        rows.append((_code(command), _code(message), int(status), found))
    return rows


def _code(cell: str) -> str:
    """The text of a Markdown code span: the cell without the backticks around it (one on each side, or two around a
    text that holds one)."""
    ticks = "``" if cell.startswith("``") else "`"
    assert cell.startswith(ticks) and cell.endswith(ticks), cell
    return cell[len(ticks) : -len(ticks)].strip()


#: the start of the lines a launched training process prints on every run, bad input or not: accelerate's notice of
#: the launch values it defaulted (three kinds of line), and the start-up lines `cli/quiet.py` drops in the launcher
HARMLESS = (
    "The following values were not passed to `accelerate launch`",
    "\t`--",
    "To avoid this warning pass in values",
    *(prefix for _, prefix in STARTUP_LINES.values()),
)
#: and transformers' notice that TRL's configs set the deprecated `gradient_checkpointing` (with its source line)
DEPRECATED_FIELD = "FutureWarning: `gradient_checkpointing` is deprecated"


def _without_harmless(lines: list[str]) -> list[str]:
    kept, after_warning = [], False
    for line in lines:
        if not line.startswith(HARMLESS) and DEPRECATED_FIELD not in line and not after_warning:
            kept.append(line)
        after_warning = DEPRECATED_FIELD in line
    return kept


BAD_INPUT_ROWS = bad_input_rows()


def test_bad_inputs_table_is_read():
    assert len(BAD_INPUT_ROWS) >= 15
    assert {found for *_, found in BAD_INPUT_ROWS} == {"before launch", "training process"}


@pytest.fixture(scope="module")
def bad_input_runs(request, workspace):
    """The runs of the table's rows that this session tests ({command: its future}), a few at a time: most of a run
    is the launcher importing TRL and torch, on one core."""
    for name, content in BAD_FILES.items():
        (workspace / name).write_text(content)

    def run(command):
        name, *args = shlex.split(command)
        return _run(_console_script() + [name, *BAD_INPUT_BASE, *args], cwd=workspace, timeout=300)

    selected = [
        item.callspec.params["command"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_bad_input_is_one_line"
    ]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        yield {command: pool.submit(run, command) for command in selected}


@pytest.mark.parametrize("command, message, status, found", BAD_INPUT_ROWS, ids=[row[0] for row in BAD_INPUT_ROWS])
def test_bad_input_is_one_line(bad_input_runs, command, message, status, found):
    """Every row of the "Bad inputs" table of docs/cli.md, run: exit status 2 and one line on stderr holding the
    documented message (`...` in it stands for a part left out). A bad input found before launch starts no process,
    and nothing else is printed; one found in the training process follows the start-up lines that process prints
    on every run (`HARMLESS`, `DEPRECATED_FIELD`)."""
    proc = bad_input_runs[command].result()
    lines = proc.stderr.splitlines()
    if found == "training process":
        lines = _without_harmless(lines)
    assert proc.returncode == status == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    position = 0
    for part in (part.strip() for part in message.split("...")):  # in order
        found_at = lines[0].find(part, position)
        assert found_at >= 0, f"{part!r} not in {lines[0][position:]!r}"
        position = found_at + len(part)


def test_command_help_prints_the_usage(workspace):
    """A bad argument is one line; `--help` still prints the whole usage."""
    proc = _run(_console_script() + ["dpo", "--help"], cwd=workspace)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: trl-prefix-sharing dpo [-h]")
    assert "--prefix_sharing" in proc.stdout and "--lr_scheduler_type" in proc.stdout


def test_dpo_parquet_dataset_on_two_processes(workspace):
    """Accelerate's launch flags pass through (`--multi_gpu --num_processes 2` starts two processes; with
    `--use_cpu true` they train on CPU over gloo), and a local Parquet dataset directory loads offline."""
    from datasets import load_dataset

    parquet = workspace / "prefs_parquet"
    load_dataset("json", data_files=str(workspace / "prefs.jsonl"))["train"].to_parquet(str(parquet / "train.parquet"))
    proc = _run(
        _console_script()
        + [
            "dpo",
            "--model_name_or_path",
            str(workspace / "model"),
            "--dataset_name",
            str(parquet),
            "--output_dir",
            str(workspace / "mp_out"),
            "--prefix_sharing",
            "true",
            "--packing",
            "true",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--log_level",
            "info",
            *COMMON,
        ],
        cwd=workspace,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    output = proc.stdout + proc.stderr
    assert "Prefix sharing: the first training micro-batch computes" in output
    assert "Total train batch size (w. parallel, distributed & accumulation) = 8" in output  # 2 processes x 4


LENGTHS = {
    "grpo": ["--num_generations", "4", "--max_completion_length", "6"],
    "rloo": ["--num_generations", "4", "--max_completion_length", "6"],
    "online_dpo": ["--max_new_tokens", "6"],
}


@pytest.mark.parametrize("command", ["grpo", "rloo", "online_dpo"])
def test_online_trainers_with_sharing(workspace, command):
    """`trl-prefix-sharing grpo|rloo|online_dpo` with TRL's flags: a local prompt file, a reward function by dotted
    path."""
    (workspace / "my_rewards.py").write_text(
        "def length(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n"
    )
    with open(workspace / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": " ".join(f"w{j}" for j in range(i, 3 * i + 2))}) + "\n")
    out = workspace / f"{command}_out"
    proc = _run(
        _console_script()
        + [
            command,
            "--model_name_or_path",
            str(workspace / "model"),
            "--dataset_name",
            str(workspace / "prompts.jsonl"),
            "--output_dir",
            str(out),
            "--reward_funcs",
            "my_rewards.length",
            "--prefix_sharing",
            "true",
            *LENGTHS[command],
            *COMMON,
        ],
        cwd=workspace,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    if command != "online_dpo":
        assert "Prefix sharing: the first training micro-batch (groups of" in proc.stdout + proc.stderr
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    "command, flags",
    [
        ("kto", ["--prefix_sharing_merge_kl", "true"]),
        ("orpo", []),
        ("cpo", ["--loss_type", "simpo", "--cpo_alpha", "0.5", "--prefix_sharing_score_padding", "true"]),
    ],
)
def test_kto_orpo_cpo_with_sharing(workspace, command, flags):
    """`trl-prefix-sharing kto|orpo|cpo` with TRL's flags on the local preference file (KTO unpairs it, as `trl kto`
    does), this package's fields too."""
    out = workspace / f"{command}_out"
    proc = _run(
        _console_script()
        + [
            command,
            "--model_name_or_path",
            str(workspace / "model"),
            "--dataset_name",
            str(workspace / "prefs.jsonl"),
            "--output_dir",
            str(out),
            "--prefix_sharing",
            "true",
            *flags,
            *COMMON,
        ],
        cwd=workspace,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "model.safetensors").exists()
    assert "kto" in _run(_console_script() + ["--help"], cwd=workspace).stdout


def test_sft_with_sharing(workspace):
    """`trl-prefix-sharing sft` with TRL's flags on prompt-completion data, four completions per prompt, the join rule
    too."""
    import random

    rng = random.Random(5)
    data = workspace / "sft.jsonl"
    with open(data, "w") as f:
        for p in range(4):
            prompt = " ".join(f"w{rng.randrange(100)}" for _ in range(20 + p))
            for _ in range(4):
                completion = " " + " ".join(f"w{rng.randrange(100)}" for _ in range(rng.randrange(1, 6)))
                f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    out = workspace / "sft_out"
    proc = _run(
        _console_script()
        + [
            "sft",
            "--model_name_or_path",
            str(workspace / "model"),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(out),
            "--prefix_sharing",
            "true",
            "--prefix_sharing_join",
            "always",
            "--train_sampling_strategy",
            "sequential",
            *COMMON,
        ],
        cwd=workspace,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "model.safetensors").exists()
    assert "sft" in _run(_console_script() + ["--help"], cwd=workspace).stdout
