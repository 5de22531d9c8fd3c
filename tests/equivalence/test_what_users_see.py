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


TRAINERS = ("dpo", "reward", "sft", "kto", "orpo", "cpo", "online_dpo", "grpo", "rloo")
#: the start-up line every trainer logs after its first training forward (`sharing.startup_line`)
STARTUP_LINE = re.compile(
    r"Prefix sharing: the first training micro-batch(?: \([^)]*\))? computes ([\d,]+) tokens \(([\d,]+) positions "
    r"with its padding\) where stock TRL computes ([\d,]+) tokens \(([\d,]+) positions with its padding\): "
    r"([\d.]+)x fewer tokens, ([\d.]+)x fewer positions; (.*?)\.(?: With group_by_prompt=True .*)?$",
    re.MULTILINE,
)


def startup_line(text: str) -> tuple:
    """The start-up line's numbers in `text` (shared tokens and positions, stock tokens and positions, the two
    factors) and what ran; asserting it was logged once."""
    found = STARTUP_LINE.findall(text)
    assert len(found) == 1, text  # once
    *numbers, ran = found[0]
    shared, shared_padded, stock, stock_padded = (int(number.replace(",", "")) for number in numbers[:4])
    return shared, shared_padded, stock, stock_padded, float(numbers[4]), float(numbers[5]), ran


def _sft_pair(tmp_path, tokenizer, dataset=None, ours=None, **options) -> list:
    """(stock TRL's SFT trainer, ours with the fields `ours`, default `prefix_sharing=True`); `options`: both's."""
    from trl_prefix_sharing.testing.trainers import build_trainer

    dataset = (dataset if dataset is not None else _prompt_completions(2, system=10)).remove_columns("rejected")
    fields = {**CPU_RUN, "per_device_train_batch_size": 4, "max_steps": 2, **options}
    model = make_model("llama", len(tokenizer), seed=0)
    return [
        build_trainer(
            "sft",
            stock=stock,
            model=model,
            tokenizer=tokenizer,
            train_dataset=dataset,
            quiet=False,
            output_dir=str(tmp_path / f"sft{int(stock)}"),
            **({} if stock else ours or {"prefix_sharing": True}),
            **fields,
        )
        for stock in (True, False)
    ]


def _prompt_completions(per_prompt: int, prompts: int = 8, system: int = 0, seed: int = 0) -> Dataset:
    """Prompt-completion data with a `rejected` completion too (SFT reads the first two columns, DPO the three):
    `prompts` prompts of 12-20 words (after a `system`-word start all of them share), each with `per_prompt`
    examples of 3-6-word completions."""
    import random

    from trl_prefix_sharing.testing import WORDS

    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS[:200]) for _ in range(n))  # noqa: E731
    start = words(system)
    rows = []
    for _ in range(prompts):
        prompt = (start + " " + words(rng.randint(12, 20))).strip()
        for _ in range(per_prompt):
            rows.append({"prompt": prompt, "completion": " " + words(rng.randint(3, 6)), "rejected": " " + words(4)})
    return Dataset.from_list(rows)


def _as_pairs(dataset: Dataset) -> Dataset:
    return dataset.rename_column("completion", "chosen")


def _pair(kind: str, tmp_path, tokenizer, **options) -> list:
    """(stock TRL's trainer, ours with `prefix_sharing=True`) of `kind`, two training steps from identical weights."""
    if kind == "dpo":
        return make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer, max_steps=2, **options)
    if kind == "reward":
        return make_reward_trainers(tmp_path, "llama", tie_free_text_dataset(), tokenizer, max_steps=2, **options)
    if kind == "sft":
        return _sft_pair(tmp_path, tokenizer, **options)
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
    shared, shared_padded, stock, stock_padded, fewer, fewer_positions, ran = startup_line(text)
    assert 0 < shared <= shared_padded and 0 < stock <= stock_padded, text  # (a one-token prompt can cost more)
    assert fewer == pytest.approx(stock / shared, abs=0.005) and fewer_positions == pytest.approx(
        stock_padded / shared_padded, abs=0.005
    )
    assert shared <= totals[0]  # the first forward is part of the first step's total
    chosen = r'(, (join|kernel|join and kernel) chosen by "auto")?'
    assert re.fullmatch(r'join "(prompts|always)" and kernel "\w+"' + chosen, ran), ran


@pytest.mark.parametrize("kind", TRAINERS)
def test_every_trainer_shows_what_sharing_saves(tmp_path, tokenizer, caplog, kind):
    """DPO, reward, KTO, ORPO, CPO, online DPO, GRPO and RLOO: the line at the start and `num_shared_tokens`."""
    stock, ours = _pair(kind, tmp_path, tokenizer)
    stock_logs = _train(stock)
    with caplog.at_level(logging.WARNING, logger="trl_prefix_sharing"):
        logs = _train(ours)
    _assert_sharing_shown(kind, stock_logs, logs, caplog.text)


def test_the_dpo_line_reports_what_a_run_behind_a_shared_system_prompt_computes(tmp_path, tokenizer, caplog):
    """Pairs of different prompts behind one long shared start: the line counts what the micro-batch computes after
    the join (the start once for all its pairs), as the run's own totals do, not each example alone (about 1.9x here:
    a pair's prompt once for its two completions)."""
    dataset = _as_pairs(_prompt_completions(1, prompts=16, system=60))
    ours = {"prefix_sharing": True, "prefix_sharing_attn_implementation": "sdpa"}
    _, trainer = make_trainers(tmp_path, "llama", dataset, tokenizer, ours=ours, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="trl_prefix_sharing"):
        logs = _train(trainer)
    *_, fewer, _, ran = startup_line(caplog.text)
    run = logs[-1]["num_tokens"] / logs[-1]["num_shared_tokens"]
    assert abs(fewer - run) < 0.7 and fewer > 3, (fewer, run)
    assert ran == 'join "always" and kernel "sdpa", join chosen by "auto"'


@pytest.mark.parametrize("kind", ["dpo", "sft"])
def test_the_line_names_the_grouping_that_would_share_more(tmp_path, tokenizer, caplog, kind):
    """Four examples per prompt, spread over micro-batches by the random sampler: the line names `group_by_prompt`
    with the factor it gives, which a run with it computes (each micro-batch then holds one prompt's four examples,
    whatever the order); with it, the line names nothing."""
    data = _prompt_completions(4, prompts=6)
    steps = len(data) // 4
    lines = []
    for grouped in (False, True):
        ours = {"prefix_sharing": True, "prefix_sharing_attn_implementation": "sdpa", "group_by_prompt": grouped}
        if kind == "dpo":
            trainer = make_trainers(tmp_path, "llama", _as_pairs(data), tokenizer, ours=ours, max_steps=steps)[1]
        else:
            trainer = _sft_pair(tmp_path, tokenizer, data, ours, max_steps=steps)[1]
        logs = _train(trainer)
        lines.append(trainer.shared_positions.line)
    pattern = r"With group_by_prompt=True .*: ([\d.]+)x fewer tokens than stock on the first 24 examples, against "
    hint = re.search(pattern + r"([\d.]+)x as sampled now\.$", lines[0])
    assert hint, lines[0]
    grouped, sampled = float(hint.group(1)), float(hint.group(2))
    assert grouped == pytest.approx(logs[-1]["num_tokens"] / logs[-1]["num_shared_tokens"], abs=0.006)
    assert grouped > 1.1 * sampled and "group_by_prompt" not in lines[1]


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
