"""Sharing what examples share (`prefix_sharing_join`): a system prompt, tool schemas or a document that several
examples of a micro-batch start with is computed once with `"always"`; `"prompts"` joins only rows that share a whole
prompt; `"auto"` takes whichever layout the step's cost model (`cost.StepCost`) finds cheaper for the kernel. Every
mode computes stock TRL's numbers; a mask that lets one example see another fails."""

import random

import pytest
import torch
from datasets import Dataset

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing import DPOConfig
from trl_prefix_sharing.cost import StepCost
from trl_prefix_sharing.layout import RowPolicy, build_layout, gather_to_stock
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    assert_same_loss_metrics_grads,
    assert_same_reward_step,
    assert_same_step,
    compare_step,
    leaky_dpo_mask,
    make_reward_trainers,
    make_trainers,
    positions,
    reward_step,
    step,
)
from trl_prefix_sharing.testing.group_equivalence import assert_same_runs, make_group_trainer, save_model, train
from trl_prefix_sharing.trie import JOINS, StockRows, plan_layout, plan_layouts


SYSTEM = " ".join(f"w{i}" for i in range(100, 124))  # 24 words every example starts with


def _words(rng, n):
    return " ".join(f"w{rng.randrange(60)}" for _ in range(n))


def system_prompt_pairs(n=8, seed=0, conversational=False) -> Dataset:
    """Pairs whose prompts all start with one system prompt, then a question of 0-6 words; a duplicate example, and
    a pair with identical completions."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question = _words(rng, i % 7)
        chosen, rejected = _words(rng, rng.randrange(1, 5)), _words(rng, rng.randrange(1, 5))
        if i == 5:
            rejected = chosen
        if conversational:
            prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question or "w1"}]
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            rows.append({"prompt": f"{SYSTEM} {question}".strip(), "chosen": " " + chosen, "rejected": " " + rejected})
    rows[3] = dict(rows[1])
    return Dataset.from_list(rows)


# ----------------------------------------------------------------------------------------------- the layout
def stock_rows(prefix=24, tails=(3, 5, 2, 4), seed=0):
    """Right-padded stock rows that share their first `prefix` tokens, then differ (one row per tail)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(5, 100, (prefix,), generator=gen)
    rows = [torch.cat([shared, torch.randint(100, 200, (t,), generator=gen)]) for t in tails]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return ids, mask


def test_always_joins_a_common_start_that_prompts_does_not():
    ids, mask = stock_rows()
    prompts = torch.tensor([26, 28, 25, 27])  # each row's prompt holds more than the common start
    by_prompts, always = plan_layouts(StockRows(ids, mask, prompt_lengths=prompts), joins=("prompts", "always"))
    assert int(by_prompts.num_documents) == 4 and int(always.num_documents) == 1
    assert int(always.visible_pairs) < int(by_prompts.visible_pairs)
    for join, documents in (("prompts", 4), ("always", 1)):
        layout = build_layout(StockRows(ids, mask, prompt_lengths=prompts), join=join)
        assert layout.join == join and layout.input_ids.shape[0] == documents
        valid = layout.stock_index >= 0
        assert valid.sum() == mask.sum() > 0
        # every stock token is read from a place holding that token at that position
        assert torch.equal(gather_to_stock(layout.input_ids, layout.stock_index, valid)[valid], ids[mask.bool()])
        columns = torch.arange(ids.shape[1]).expand_as(ids)
        assert torch.equal(gather_to_stock(layout.position_ids, layout.stock_index, valid)[valid], columns[valid])
    assert (
        build_layout(StockRows(ids, mask, prompt_lengths=prompts), join="always").num_positions
        == 24 + 3 + 5 + 2 + 4 + 3
    )


def test_one_common_token_does_not_join():
    """Joining on one common token saves nothing (it is copied to start each branch): `"always"` needs two."""
    ids, mask = stock_rows(prefix=1)
    assert int(plan_layout(StockRows(ids, mask, prompt_lengths=torch.full((4,), 3)), join="always").num_documents) == 4
    ids, mask = stock_rows(prefix=2)
    assert int(plan_layout(StockRows(ids, mask, prompt_lengths=torch.full((4,), 3)), join="always").num_documents) == 1


def test_auto_takes_the_cheaper_plan_for_the_kernel():
    ids, mask = stock_rows(prefix=4, tails=(40, 40, 40, 40))  # a short common start, long branches
    prompts = torch.full((4,), 6)
    linear_heavy = StepCost(position=1e5, pair=1.0, dense=True)
    attention_heavy = StepCost(position=1.0, pair=1000.0, dense=True)
    sparse = StepCost(position=1.0, pair=1000.0, dense=False)
    # dense, attention-heavy: one row of 4 + 4 x 41 tokens costs more than four rows of 44: apart
    assert (
        build_layout(StockRows(ids, mask, prompt_lengths=prompts), join="auto", cost=attention_heavy).join == "prompts"
    )
    # dense, linear-heavy: the positions saved win
    assert build_layout(StockRows(ids, mask, prompt_lengths=prompts), join="auto", cost=linear_heavy).join == "always"
    # block-sparse: joining only removes pairs
    assert build_layout(StockRows(ids, mask, prompt_lengths=prompts), join="auto", cost=sparse).join == "always"
    with pytest.raises(ValueError, match="cost model"):
        build_layout(StockRows(ids, mask, prompt_lengths=prompts), join="auto")


def test_auto_keeps_to_plans_that_fit_a_fixed_packed_row():
    ids, mask = stock_rows(prefix=20, tails=(10, 10, 10))
    prompts = torch.full((3,), 25)
    rows = RowPolicy(pack=True, length=30)  # each row's document fits; all three joined (50 tokens) do not
    sparse = StepCost(position=1.0, pair=1.0, dense=False)
    assert (
        build_layout(StockRows(ids, mask, prompt_lengths=prompts), rows=rows, join="auto", cost=sparse).join
        == "prompts"
    )
    with pytest.raises(ValueError, match="prefix_sharing_join='auto'"):
        build_layout(StockRows(ids, mask, prompt_lengths=prompts), rows=rows, join="always")


def test_the_cost_estimate_and_the_model_it_is_read_from(tokenizer):
    cost = StepCost(position=3.0, pair=2.0, dense=True)
    assert cost.estimate(2, 10, visible_pairs=7) == 3.0 * 20 + 2.0 * 200
    assert StepCost(position=3.0, pair=2.0, dense=False).estimate(2, 10, visible_pairs=7) == 3.0 * 20 + 2.0 * 7
    model = make_model("llama", len(tokenizer))
    config = model.config
    embeddings = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    untied = not config.tie_word_embeddings
    expected_position = 2.0 * (total - embeddings - (head if untied else 0) + head)
    of_model = StepCost.of_model(model, dense=True)
    assert of_model.position == expected_position and of_model.dense
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert of_model.pair == 2.0 * config.num_hidden_layers * config.num_attention_heads * head_dim
    assert not StepCost.of_model(model, dense=False).dense


def test_unknown_join_is_refused(tmp_path):
    with pytest.raises(ValueError, match="prefix_sharing_join"):
        DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing_join="sometimes")
    ids, mask = stock_rows()
    with pytest.raises(ValueError, match="one plan"):
        plan_layout(StockRows(ids, mask), join="auto")
    assert JOINS == ("auto", "prompts", "always")
    assert DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).prefix_sharing_join == "auto"


# ----------------------------------------------------------------------------------------------- the trainers
@pytest.mark.parametrize("conversational", [False, True], ids=["text", "conversational"])
@pytest.mark.parametrize("join", JOINS)
def test_dpo_equals_stock_in_every_join(tmp_path, tokenizer, join, conversational):
    dataset = system_prompt_pairs(conversational=conversational)
    stock, shared = make_trainers(
        tmp_path, "llama", dataset, tokenizer, ours={"prefix_sharing": True, "prefix_sharing_join": join}
    )
    examples = list(stock.train_dataset)
    got = step(shared, examples)
    assert_same_step(step(stock, examples), got)
    if join == "always":
        layout = got["batch"]["prefix_sharing"]
        assert layout.join == "always" and layout.input_ids.shape[0] == 1
        shared.data_collator.join = "prompts"
        assert positions(got["batch"]) < positions(shared.data_collator(examples))
    if join == "auto":  # a 24-word system prompt before short pairs: joined on the CPU's dense kernel too
        assert got["batch"]["prefix_sharing"].join == "always"


def test_a_mask_that_lets_one_example_see_another_fails(tmp_path, tokenizer, monkeypatch):
    dataset = system_prompt_pairs()
    stock, shared = make_trainers(
        tmp_path, "llama", dataset, tokenizer, ours={"prefix_sharing": True, "prefix_sharing_join": "always"}
    )
    compare_step(stock, shared)  # the real mask passes
    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        compare_step(stock, shared)


def test_dpo_packing_with_always_equals_stock(tmp_path, tokenizer):
    dataset = system_prompt_pairs()
    stock, shared = make_trainers(
        tmp_path,
        "llama",
        dataset,
        tokenizer,
        ours={"prefix_sharing": True, "packing": True, "prefix_sharing_join": "always"},
    )
    examples = list(stock.train_dataset)
    got = step(shared, examples)
    assert_same_step(step(stock, examples), got)
    assert got["batch"]["prefix_sharing"].join == "always"


def test_reward_equals_stock_with_always(tmp_path, tokenizer):
    dataset = system_prompt_pairs()
    stock, shared = make_reward_trainers(
        tmp_path, "llama", dataset, tokenizer, ours={"prefix_sharing": True, "prefix_sharing_join": "always"}
    )
    examples = list(stock.train_dataset)
    got = reward_step(shared, examples)
    assert_same_reward_step(reward_step(stock, examples), got, compare_rewards=True)
    assert got["batch"]["prefix_sharing"].input_ids.shape[0] == 1


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "apart"])
def test_kto_equals_stock_with_always(tmp_path, tokenizer, merge):
    from test_kto_equivalence import assert_same_step as assert_same_kto_step
    from test_kto_equivalence import kto_step
    from test_kto_equivalence import make_trainers as make_kto_trainers

    rows = [
        {"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
        for i, r in enumerate(system_prompt_pairs())
    ]
    stock, shared = make_kto_trainers(
        tmp_path,
        tokenizer,
        Dataset.from_list(rows),
        ours={"prefix_sharing_merge_kl": merge, "prefix_sharing_join": "always"},
    )
    examples = [shared.train_dataset[i] for i in range(4)]
    assert_same_kto_step(kto_step(stock, examples), kto_step(shared, examples))


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_orpo_cpo_equal_stock_with_always(tmp_path, tokenizer, kind):
    from test_orpo_cpo_equivalence import loss_and_grads
    from test_orpo_cpo_equivalence import make_trainers as make_concatenated_trainers

    dataset = system_prompt_pairs()
    ours = {"prefix_sharing_join": "always", "prefix_sharing_score_padding": True}
    stock, shared = make_concatenated_trainers(tmp_path, kind, tokenizer, dataset, ours=ours)
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    assert_same_loss_metrics_grads(loss_and_grads(stock, examples), loss_and_grads(shared, examples), min_metrics=9)


def equal_length_prompts(n=8) -> Dataset:
    """GRPO prompts: one system prompt, then a question of 3 words (the same left padding, so stock puts the system
    prompt at the same positions in every row), and two prompts of other lengths."""
    rng = random.Random(3)
    lengths = [3, 3, 3, 3, 3, 3, 1, 5][:n]
    return Dataset.from_list([{"prompt": f"{SYSTEM} {_words(rng, k)}"} for k in lengths])


def test_grpo_equals_stock_with_always_and_shares_the_system_prompt(tmp_path, tokenizer):
    path = save_model(tmp_path, "llama", tokenizer)
    dataset = equal_length_prompts()
    stock = train(make_group_trainer("grpo", False, path, dataset, tokenizer, tmp_path))
    runs = {}
    for join in ("prompts", "always"):
        trainer = make_group_trainer("grpo", True, path, dataset, tokenizer, tmp_path, prefix_sharing_join=join)
        runs[join] = train(trainer)
        assert_same_runs(stock, runs[join])
    shared_tokens = {join: runs[join][0][-1]["num_shared_tokens"] for join in runs}
    assert shared_tokens["always"] < shared_tokens["prompts"], shared_tokens
