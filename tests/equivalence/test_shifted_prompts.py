"""A start that prompts of any length share (a system prompt, tool schemas) computed once per micro-batch in GRPO, RLOO
and online DPO, on models whose positions are rotary (`trie.StockRows.shift`).

TRL left-pads generated prompts and scores them without position ids, so a shorter prompt's system prompt sits at
later positions than a longer one's. With rotary positions attention reads only the distance between two positions,
which moving a row's tokens all by the same amount keeps: the shared layout moves each prompt's tokens to its
document's positions and gives stock's numbers to float32 round-off. Models with absolute positions (GPT-2) give other
numbers there: they keep sharing a start only between prompts of the same length, and a run forced through the moved
layout is stopped by the start-up check."""

import random

import pytest
from datasets import Dataset

import trl_prefix_sharing.layout as layout_module
import trl_prefix_sharing.sharing as sharing_module
from trl_prefix_sharing.architectures import shift_invariant
from trl_prefix_sharing.testing import make_config, make_model
from trl_prefix_sharing.testing.group_equivalence import assert_same_runs, make_group_trainer, save_model, train
from trl_prefix_sharing.testing.shift import copies_of_the_common_start, record_layouts, shift_check


SYSTEM = " ".join(f"w{i}" for i in range(100, 130))  # 30 words every prompt starts with


def any_length_prompts(n=8, seed=0) -> Dataset:
    """Prompts behind one system prompt, then a user turn of 1 to 8 words: no two prompts of the same length (so
    stock puts the system prompt at other positions in every prompt's rows)."""
    rng = random.Random(seed)
    lengths = list(range(1, n + 1))
    rng.shuffle(lengths)
    return Dataset.from_list(
        [{"prompt": SYSTEM + " " + " ".join(f"w{rng.randrange(60)}" for _ in range(k))} for k in lengths]
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("models")
    dirs = {family: save_model(directory, family, tokenizer) for family in ("llama", "qwen2", "qwen3", "mistral")}
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return {**dirs, "gpt2": save_model(directory, "gpt2", tokenizer, **no_dropout)}


@pytest.mark.parametrize(
    "kind,family", [("grpo", "llama"), ("grpo", "qwen2"), ("rloo", "qwen3"), ("rloo", "mistral"), ("grpo", "mistral")]
)
def test_a_system_prompt_is_computed_once_per_micro_batch_whatever_the_prompt_lengths(
    tmp_path, tokenizer, model_dirs, monkeypatch, kind, family
):
    """Every logged number and the trained weights equal stock TRL's, and the shared rows hold the system prompt once
    per micro-batch (`"always"`), where `"prompts"` holds it once per prompt."""
    dataset = any_length_prompts()
    stock = train(make_group_trainer(kind, False, model_dirs[family], dataset, tokenizer, tmp_path, beta=0.1))
    copies = {}
    for join in ("always", "prompts"):
        seen = record_layouts(monkeypatch)
        trainer = make_group_trainer(
            kind, True, model_dirs[family], dataset, tokenizer, tmp_path, beta=0.1, prefix_sharing_join=join
        )
        assert trainer.sharing_session.shift == (join == "always")
        assert_same_runs(stock, train(trainer))
        copies[join] = {copies_of_the_common_start(*entry) for entry in seen}
        assert seen and trainer.model_check.result is not None if join == "always" else seen
    assert copies["always"] == {1.0}, copies
    assert min(copies["prompts"]) >= 2, copies  # the 8-row micro-batches hold two prompts of other lengths


def test_the_varlen_kernel_moves_positions_too(tmp_path, tokenizer, model_dirs, monkeypatch):
    """The varlen kernel (its reference on the CPU: the same stream, gather and segments) lays every document in one
    unpadded row; with the moved positions it gives stock's numbers and holds the system prompt once."""
    dataset = any_length_prompts()
    stock = train(make_group_trainer("grpo", False, model_dirs["qwen2"], dataset, tokenizer, tmp_path))
    seen = record_layouts(monkeypatch)
    ours = {"prefix_sharing_join": "always", "prefix_sharing_attn_implementation": "varlen"}
    trainer = make_group_trainer("grpo", ours, model_dirs["qwen2"], dataset, tokenizer, tmp_path)
    assert trainer.sharing_session.shift
    assert_same_runs(stock, train(trainer))
    assert seen and {copies_of_the_common_start(*entry) for entry in seen} == {1.0}
    assert all(entry[2].segments is not None for entry in seen)


def test_online_dpo_shares_a_system_prompt_across_prompt_lengths(tmp_path, tokenizer, monkeypatch):
    from test_online_dpo_equivalence import make_trainers

    from trl_prefix_sharing.testing.group_equivalence import train as train_group

    seen = record_layouts(monkeypatch)
    stock, shared = make_trainers(
        tmp_path, "llama", tokenizer, dataset=any_length_prompts(), ours={"prefix_sharing_join": "always"}
    )
    assert shared.sharing_session.shift
    assert_same_runs(train_group(stock), train_group(shared))
    assert seen and {copies_of_the_common_start(*entry) for entry in seen} == {1.0}


def test_absolute_positions_keep_sharing_between_prompts_of_one_length(tmp_path, tokenizer, model_dirs, monkeypatch):
    """GPT-2 (learned absolute positions) is not shift-invariant: with `"always"` it still equals stock and shares a
    start only between prompts of the same length (here: none)."""
    assert "gpt2" in shift_invariant(make_config("gpt2", len(tokenizer)))
    dataset = any_length_prompts()
    stock = train(make_group_trainer("grpo", False, model_dirs["gpt2"], dataset, tokenizer, tmp_path))
    seen = record_layouts(monkeypatch)
    trainer = make_group_trainer(
        "grpo", True, model_dirs["gpt2"], dataset, tokenizer, tmp_path, prefix_sharing_join="always"
    )
    assert not trainer.sharing_session.shift
    assert_same_runs(stock, train(trainer))
    assert seen and min(copies_of_the_common_start(*entry) for entry in seen) >= 2


def test_moved_positions_change_an_absolute_model_and_the_start_up_check_stops_it(
    tmp_path, tokenizer, model_dirs, monkeypatch
):
    """The rule is needed: through the moved layout GPT-2's log-probs differ from stock's far beyond the tolerance
    (a rotary model's by round-off), and a GPT-2 run forced to move positions is stopped by the start-up check."""
    rotary, absolute = (shift_check(make_model(family, len(tokenizer)), tokenizer) for family in ("llama", "gpt2"))
    assert rotary.values > 0 and rotary.passed and rotary.difference < 1e-5, rotary.summary()
    assert not absolute.passed and absolute.difference > 0.05, absolute.summary()

    monkeypatch.setattr(sharing_module, "moves_positions", lambda join, configs: True)
    trainer = make_group_trainer(
        "grpo", True, model_dirs["gpt2"], any_length_prompts(), tokenizer, tmp_path, prefix_sharing_join="always"
    )
    assert trainer.sharing_session.shift
    with pytest.raises(ValueError, match="start-up check .* differ"):
        train(trainer)


def test_a_layout_that_shares_the_start_but_keeps_stock_columns_differs(tmp_path, tokenizer, model_dirs, monkeypatch):
    """The tests can fail: a layout that shares the start of prompts of unequal lengths but keeps each token's stock
    column as its position (so a row reads the shared start from other distances than in its own row) gives other
    log-probs, and a GRPO run on it other numbers than stock's."""
    right = shift_check(make_model("llama", len(tokenizer)), tokenizer)
    dataset = any_length_prompts()
    stock = train(make_group_trainer("grpo", False, model_dirs["llama"], dataset, tokenizer, tmp_path))

    monkeypatch.setattr(layout_module, "_positions", lambda plan, columns, depth: columns.expand_as(depth))
    wrong = shift_check(make_model("llama", len(tokenizer)), tokenizer)
    assert right.difference < 1e-5 < 1e-4 < wrong.difference, (right.summary(), wrong.summary())
    trainer = make_group_trainer(
        "grpo", True, model_dirs["llama"], dataset, tokenizer, tmp_path, prefix_sharing_join="always"
    )
    with pytest.raises(AssertionError):
        assert_same_runs(stock, train(trainer))


@pytest.mark.parametrize(
    "rope,invariant",
    [
        ({"rope_type": "default", "rope_theta": 10000.0}, True),
        ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, True),
        ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, False),
        (
            {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 64,
            },
            False,
        ),
    ],
    ids=lambda value: value["rope_type"] if isinstance(value, dict) else str(value),
)
def test_rotary_scalings_that_read_the_longest_position_are_not_shift_invariant(tokenizer, rope, invariant):
    config = make_config("llama", len(tokenizer), rope_parameters=rope)
    reason = shift_invariant(config)
    assert (reason is None) == invariant, reason
    if not invariant:
        assert rope["rope_type"] in reason
