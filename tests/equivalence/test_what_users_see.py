"""What a user sees of prefix sharing in every trainer: a line at the start saying what sharing saves, and
`num_shared_tokens` in every training log line; and one clear error for bad datasets given from Python."""

import logging
import re

import pytest
import torch
from datasets import Dataset

from trl_prefix_sharing.sharing import SharedPositions
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    CPU_RUN,
    awkward_text_dataset,
    make_reward_trainers,
    make_trainers,
    tie_free_text_dataset,
)


TRAINERS = ("dpo", "reward", "kto", "orpo", "cpo", "online_dpo", "grpo", "rloo")
#: trainers that log what sharing saves on the dataset at `train()`; the others (rows laid out in the step) log the
#: first training forward's positions against stock's
DATASET_LINE = ("dpo", "reward")
FIRST_FORWARD = re.compile(
    r"Prefix sharing: the first training forward computes ([\d,]+) token positions where stock TRL computes ([\d,]+) "
    r"\(([\d,]+) tokens and ([\d,]+) padding\)"
)


def _pair(kind: str, tmp_path, tokenizer, **options) -> list:
    """(stock TRL's trainer, ours with `prefix_sharing=True`) of `kind`, two training steps from identical weights."""
    if kind == "dpo":
        return make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer, max_steps=2, **options)
    if kind == "reward":
        return make_reward_trainers(tmp_path, "llama", tie_free_text_dataset(), tokenizer, max_steps=2, **options)
    if kind == "kto":
        from test_kto_equivalence import make_trainers as make_kto_trainers
        from test_kto_equivalence import unpaired_dataset

        return make_kto_trainers(tmp_path, tokenizer, unpaired_dataset(), **options)
    if kind in ("orpo", "cpo"):
        from test_orpo_cpo_equivalence import make_trainers as make_paired_trainers

        return make_paired_trainers(tmp_path, kind, tokenizer, tie_free_text_dataset(), **options)
    if kind == "online_dpo":
        from test_online_dpo_equivalence import make_trainers as make_online_trainers

        return make_online_trainers(tmp_path, "llama", tokenizer, **options)
    from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, prompt_dataset, save_model

    path = save_model(tmp_path, "llama", tokenizer)
    return [make_group_trainer(kind, ours, path, prompt_dataset(), tokenizer, tmp_path, **options) for ours in (0, 1)]


def _train(trainer) -> list[dict]:
    torch.manual_seed(0)
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def _assert_sharing_shown(kind: str, stock_logs: list[dict], logs: list[dict], text: str) -> None:
    """The start-up line in `text` and `num_shared_tokens` in every training line of `logs`, below what stock
    computes, and nothing else logged that stock does not log."""
    assert len(logs) == len(stock_logs) == 2
    for stock_line, line in zip(stock_logs, logs, strict=True):
        assert set(line) - set(stock_line) == {"num_shared_tokens"}, (kind, sorted(line))
    totals = [line["num_shared_tokens"] for line in logs]
    assert 0 < totals[0] < totals[1], totals  # a running total of the positions computed
    if kind == "kto":  # stock's `num_tokens` counts the main rows; its policy computes the KL rows too, as many
        assert totals[-1] <= 2 * stock_logs[-1]["num_tokens"], (totals, stock_logs[-1]["num_tokens"])
    elif "num_tokens" in stock_logs[-1]:  # stock counts its rows' tokens, padding not counted
        assert totals[-1] < stock_logs[-1]["num_tokens"], (totals, stock_logs[-1]["num_tokens"])
    if kind in DATASET_LINE:
        assert re.search(r"Prefix sharing on \d+ examples: [\d.]+ positions per example in stock TRL", text), text
        assert "first training forward" not in text
        return
    found = FIRST_FORWARD.findall(text)
    assert len(found) == 1, text  # once
    shared, stock, tokens, padding = (int(number.replace(",", "")) for number in found[0])
    assert stock == tokens + padding and 0 < shared <= stock
    assert shared <= totals[0]  # the first forward is part of the first step's total


@pytest.mark.parametrize("kind", TRAINERS)
def test_every_trainer_shows_what_sharing_saves(tmp_path, tokenizer, caplog, kind):
    """DPO, reward, KTO, ORPO, CPO, online DPO, GRPO and RLOO: the line at the start and `num_shared_tokens`."""
    stock, ours = _pair(kind, tmp_path, tokenizer)
    stock_logs = _train(stock)
    with caplog.at_level(logging.WARNING, logger="trl_prefix_sharing"):
        logs = _train(ours)
    _assert_sharing_shown(kind, stock_logs, logs, caplog.text)


@pytest.mark.parametrize("kind", ["orpo", "grpo"])
def test_a_silent_trainer_fails_the_check(tmp_path, tokenizer, caplog, monkeypatch, kind):
    """The check above fails for a trainer that counts nothing: it is not satisfied by stock's own lines."""
    monkeypatch.setattr(SharedPositions, "count", lambda self, *args, **kwargs: None)
    stock, ours = _pair(kind, tmp_path, tokenizer)
    stock_logs = _train(stock)
    with caplog.at_level(logging.WARNING, logger="trl_prefix_sharing"):
        logs = _train(ours)
    with pytest.raises(AssertionError):
        _assert_sharing_shown(kind, stock_logs, logs, caplog.text)


# ------------------------------------------------------------------------------------------------ bad datasets
def _ours(kind: str, tmp_path, tokenizer, dataset, **fields):
    """Only our trainer of `kind` with `prefix_sharing=True` (stock TRL's would fail first on these datasets, with
    its own error)."""
    import trl_prefix_sharing

    if kind == "grpo":
        from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, save_model

        return make_group_trainer(kind, True, save_model(tmp_path, "llama", tokenizer), dataset, tokenizer, tmp_path)
    name = {"dpo": "DPO", "kto": "KTO", "orpo": "ORPO"}[kind]
    config = getattr(trl_prefix_sharing, f"{name}Config")(
        output_dir=str(tmp_path / "run"), prefix_sharing=True, per_device_train_batch_size=2, **CPU_RUN, **fields
    )
    reference = {"ref_model": make_model("llama", len(tokenizer), seed=1)} if kind == "dpo" else {}
    return getattr(trl_prefix_sharing, f"{name}Trainer")(
        model=make_model("llama", len(tokenizer), seed=0),
        **reference,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
    )


def test_an_empty_dataset_is_one_clear_error(tmp_path, tokenizer):
    empty = Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})
    with pytest.raises(ValueError, match=r"^The train dataset is empty \(0 rows\); give it at least one example\.$"):
        _ours("dpo", tmp_path, tokenizer, empty)


@pytest.mark.parametrize("kind", ["dpo", "kto", "orpo", "grpo"])
@pytest.mark.parametrize("column", ["promt", "prompts", "Prompt"])
def test_a_misspelt_prompt_column_is_refused(tmp_path, tokenizer, kind, column):
    """A near match of `prompt` and no `prompt`: refused before anything is trained (TRL would ignore it, and nothing
    would be shared); one line naming the column and both ways out."""
    rows = {"dpo": {"chosen": ["a b", "c"], "rejected": ["d", "e f"]}, "kto": {"completion": ["a b", "c"]}}
    rows["orpo"] = rows["dpo"]
    rows["kto"]["label"] = [True, False]
    dataset = Dataset.from_dict({column: ["x y z", "x y"], **rows.get(kind, {})})
    with pytest.raises(ValueError) as error:
        _ours(kind, tmp_path, tokenizer, dataset)
    message = str(error.value)
    assert "\n" not in message
    assert f"has no 'prompt' column but has {column!r}" in message
    assert f"rename_column({column!r}, 'prompt')" in message and f"remove_columns({column!r})" in message


def test_other_columns_like_prompt_are_not_refused(tmp_path, tokenizer):
    """`prompt_text` or `question` beside chosen/rejected is not taken for a misspelt `prompt` (an implicit prompt
    is TRL's own format)."""
    rows = {"chosen": ["x y a b", "x c"], "rejected": ["x y d", "x e f"]}
    for column in ("prompt_text", "question"):
        _ours("dpo", tmp_path / column, tokenizer, Dataset.from_dict({column: ["x y", "x"], **rows}))


def test_no_rows_left_after_trl_drops_the_long_ones(tmp_path, tokenizer):
    """Every example longer than `max_length`: TRL's preprocessing drops them all; one line says so and how out."""
    dataset = Dataset.from_dict({"prompt": ["a b c d e f g h"] * 2, "chosen": ["x"] * 2, "rejected": ["y"] * 2})
    with pytest.raises(ValueError, match=r"left none of the 2 examples of the train dataset.*`max_length` \(4\)"):
        _ours("dpo", tmp_path, tokenizer, dataset, max_length=4)


def test_an_unknown_dpo_loss_type_is_refused_at_once(tmp_path):
    """TRL's DPO trainer fails only at its first step; the config says so when it is made."""
    from trl_prefix_sharing import DPOConfig

    with pytest.raises(ValueError, match=r"^Unknown DPO `loss_type` 'nope'; TRL's DPO trainer knows sigmoid, hinge"):
        DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "nope"], **CPU_RUN)
    assert DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "sft"], **CPU_RUN).loss_type == ["sigmoid", "sft"]


def test_the_loss_types_documented_are_those_trl_computes():
    """The check's list (TRL's `loss_type` help) is exactly the loss types TRL's `_compute_loss` branches on."""
    import inspect

    import trl

    from trl_prefix_sharing.config import dpo_loss_types

    computed = set(re.findall(r'loss_type == "([a-z_]+)"', inspect.getsource(trl.DPOTrainer._compute_loss)))
    assert len(computed) >= 10 and set(dpo_loss_types()) == computed
