"""The console scripts, end to end as subprocesses, on a tiny local model and dataset (offline)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


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
    assert "Prefix sharing on 16 examples" in proc.stdout + proc.stderr
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
    assert "Prefix sharing on 16 examples" in proc.stdout + proc.stderr  # the shared trainer really ran
    from peft import AutoPeftModelForSequenceClassification

    assert (out / "adapter_config.json").exists()
    model = AutoPeftModelForSequenceClassification.from_pretrained(out, num_labels=1)
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 1)


@pytest.mark.parametrize(
    "dataset,model,message",
    [
        ("./missing.jsonl", "model", "not found: no such file or directory"),
        ("bad.jsonl", "model", "needs 'chosen' and 'rejected'"),
        ("prefs.jsonl", "bloom", "can never support 'bloom': its ALiBi attention biases"),
    ],
)
def test_clear_errors_before_heavy_work(workspace, dataset, model, message):
    (workspace / "bad.jsonl").write_text(json.dumps({"prompt": "w1", "answer": "w2"}) + "\n")
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
            str(workspace / model),
            "--dataset_name",
            dataset,
            "--output_dir",
            str(workspace / "err_out"),
            "--prefix_sharing",
            "true",
            *COMMON,
        ],
        cwd=workspace,
    )
    assert proc.returncode != 0
    assert message in proc.stderr


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
    assert "Prefix sharing on 16 examples" in output
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
        assert "Prefix sharing: the first training batch computes" in proc.stdout + proc.stderr
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    "command, flags",
    [
        ("kto", ["--prefix_sharing_merge_kl", "true"]),
        ("orpo", []),
        ("cpo", ["--loss_type", "simpo", "--cpo_alpha", "0.5", "--prefix_sharing_score_padding", "false"]),
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
