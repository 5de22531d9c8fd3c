"""Sharing across the pairs of a micro-batch (the prefix trie): several pairs of one prompt, a pair at every turn of a
conversation, duplicate prompts. Every number equals stock TRL's on the same micro-batch, with fewer positions than
sharing each pair's prompt alone; a mask that lets one subtree see another fails; `group_by_prompt` keeps a prompt's
pairs together without changing the random stream."""

import itertools
import random

import pytest
import torch
from datasets import Dataset

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing.layout import RowPolicy
from trl_prefix_sharing.testing.equivalence import (
    assert_grouped_by_prompt,
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


def _words(rng, n):
    return " ".join(f"w{rng.randrange(150)}" for _ in range(n))


def all_pairs_dataset(prompts=3, seed=0) -> Dataset:
    """Every pair (better, worse) of K = 3-5 ranked completions per prompt, a prompt's pairs next to each other."""
    rng = random.Random(seed)
    rows = []
    for _ in range(prompts):
        prompt = _words(rng, rng.randrange(8, 20))
        completions = [" " + _words(rng, rng.randrange(1, 6)) for _ in range(rng.choice([3, 4, 5]))]
        for better, worse in itertools.combinations(completions, 2):
            rows.append({"prompt": prompt, "chosen": better, "rejected": worse})
    return Dataset.from_list(rows)


def multi_turn_dataset(conversations=2, turns=3, seed=1) -> Dataset:
    """A (chosen, rejected) pair at every turn; turn t+1's prompt holds turn t's prompt and chosen answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(conversations):
        messages = [{"role": "user", "content": _words(rng, rng.randrange(5, 12))}]
        for _ in range(turns):
            chosen, rejected = _words(rng, rng.randrange(2, 6)), _words(rng, rng.randrange(1, 6))
            rows.append(
                {
                    "prompt": list(messages),
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
            messages += [{"role": "assistant", "content": chosen}, {"role": "user", "content": _words(rng, 4)}]
    return Dataset.from_list(rows)


def duplicates_dataset() -> Dataset:
    """Duplicate prompts in different pairs, an identical pair twice, and a one-word prompt."""
    rows = [
        {"prompt": "w1 w2 w3 w4 w5", "chosen": " w6 w7", "rejected": " w8"},
        {"prompt": "w1 w2 w3 w4 w5", "chosen": " w9", "rejected": " w6 w7"},
        {"prompt": "w1 w2 w3 w4 w5", "chosen": " w6 w7", "rejected": " w8"},
        {"prompt": "w1", "chosen": " w2 w3", "rejected": " w4"},
        {"prompt": "w20 w21 w22", "chosen": " w23", "rejected": " w23"},
    ]
    return Dataset.from_list(rows)


DATASETS = {"all_pairs": all_pairs_dataset, "multi_turn": multi_turn_dataset, "duplicates": duplicates_dataset}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("data", list(DATASETS))
def test_dpo_trie_matches_stock(tmp_path, tokenizer, family, data):
    stock, shared = make_trainers(tmp_path, family, DATASETS[data](), tokenizer)
    examples = list(stock.train_dataset)
    expected, got = step(stock, examples), step(shared, examples)
    assert_same_step(expected, got)
    trie = positions(got["batch"])
    shared.data_collator.across_examples = False  # each pair's prompt alone
    pair_only = positions(shared.data_collator(examples))
    assert trie < pair_only < int(expected["batch"]["attention_mask"].sum())


@pytest.mark.parametrize("data", ["all_pairs", "multi_turn"])
def test_reward_trie_matches_stock(tmp_path, tokenizer, data):
    stock, shared = make_reward_trainers(tmp_path, "llama", DATASETS[data](), tokenizer)
    examples = list(stock.train_dataset)
    expected, got = reward_step(stock, examples), reward_step(shared, examples)
    assert_same_reward_step(expected, got, compare_rewards=True)
    shared.data_collator.across_examples = False
    assert positions(got["batch"]) < positions(shared.data_collator(examples))


@pytest.mark.parametrize("kernel", ["sdpa", "varlen"])
def test_trie_with_packing_and_precomputed_reference(tmp_path, tokenizer, kernel):
    """The trie packed, and the reference precomputed through the session's unpacked rows (varlen: its one row)."""
    stock, shared = make_trainers(
        tmp_path,
        "llama",
        all_pairs_dataset(),
        tokenizer,
        ref_model=None,
        precompute_ref_log_probs=True,
        ours={"prefix_sharing": True, "packing": True, "prefix_sharing_attn_implementation": kernel},
    )
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(
            torch.tensor(shared.train_dataset[column]), torch.tensor(stock.train_dataset[column]), atol=1e-5, rtol=1e-5
        )
    for trainer in (stock, shared):  # away from the reference (see test_dpo_equivalence)
        torch.manual_seed(7)
        for param in trainer.model.parameters():
            param.data.add_(torch.randn_like(param), alpha=0.02)
    if kernel == "sdpa":  # all pairs in one packed row (varlen's row is always one)
        shared.data_collator.rows = RowPolicy(pack=True, length=shared.packed_batches.length, one_row=True)
    examples = list(stock.train_dataset)
    assert_same_step(step(stock, examples), step(shared, examples))


def test_a_mask_that_lets_a_subtree_see_another_fails(tmp_path, tokenizer, monkeypatch):
    stock, shared = make_trainers(tmp_path, "llama", all_pairs_dataset(), tokenizer)
    compare_step(stock, shared)  # the real mask passes
    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        compare_step(stock, shared)


def test_group_by_prompt_keeps_pairs_together_and_the_random_stream(tmp_path, tokenizer):
    from trl_prefix_sharing.packing import prompt_groups

    data = all_pairs_dataset(prompts=5, seed=3)
    stock, shared = make_trainers(
        tmp_path, "llama", data, tokenizer, ours={"prefix_sharing": True, "group_by_prompt": True}
    )
    groups = prompt_groups(shared.train_dataset)
    assert len(set(groups)) == 5
    assert_grouped_by_prompt(stock, shared, groups)


def test_group_by_prompt_with_packing_packs_a_prompts_pairs_as_one_unit(tmp_path, tokenizer):
    data = all_pairs_dataset(prompts=6, seed=4)
    stock, shared = make_trainers(
        tmp_path, "llama", data, tokenizer, ours={"prefix_sharing": True, "packing": True, "group_by_prompt": True}
    )
    groups = shared.packed_batches.groups(shared.train_dataset)
    assert len(groups) == 6 and sorted(i for g in groups for i in g) == list(range(len(data)))
    lengths = shared.packed_batches.unit_lengths(shared.train_dataset, grouped=True)
    alone = shared.packed_batches.unit_lengths(shared.train_dataset)
    assert all(lengths[u] < sum(alone[i] for i in g) for u, g in enumerate(groups))  # a prompt's trie is shorter
    batches = list(shared._get_train_sampler())
    assert sorted(i for b in batches for i in b) == list(range(len(data)))
    for batch in batches:  # whole prompts per batch, and the packed row holds them
        assert all(set(g) <= set(batch) or not set(g) & set(batch) for g in groups)
        examples = [shared.train_dataset[i] for i in batch]
        layout = shared.data_collator(examples)["prefix_sharing"]
        assert (layout.document_ids >= 0).sum() <= shared.packed_batches.length
        assert_same_step(step(stock, [stock.train_dataset[i] for i in batch]), step(shared, examples))
