"""Prefix-shared reward training computes stock TRL's rewards, losses, metrics and gradients; ranked K-way data."""

import pytest
import torch
from datasets import Dataset
from test_dpo_equivalence import assert_padded_to_multiple

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing.layout import RowPolicy
from trl_prefix_sharing.ranked import expand_ranked_to_pairs
from trl_prefix_sharing.testing import FAMILIES, synthetic_pairs
from trl_prefix_sharing.testing.equivalence import (
    assert_same_eval_metrics,
    assert_same_reward_step,
    awkward_text_dataset,
    conversational_dataset,
    leaky_dpo_mask,
    make_reward_model,
    make_reward_trainers,
    reward_step,
    tie_free_text_dataset,
    tied_pairs,
)


def _with_margin(dataset):
    return dataset.add_column("margin", [0.1 * i - 0.2 for i in range(len(dataset))])


def _empty_prompts():
    """Rows with no common prefix at all (empty prompt, completions differing from their first token), and rows
    over max_length, which the reward trainer drops whole, like stock TRL."""
    rows = [
        {"prompt": "", "chosen": "w2 w3", "rejected": "w4"},
        {"prompt": "", "chosen": "w5", "rejected": "w6 w7 w8"},
    ]
    return Dataset.from_list(rows + [dict(row) for row in awkward_text_dataset()])


DATA = {
    "awkward_text": lambda: (awkward_text_dataset(), {}),
    "no_common_prefix_and_max_length": lambda: (_empty_prompts(), {"max_length": 30}),
    "margin_and_centering": lambda: (_with_margin(awkward_text_dataset()), {"center_rewards_coefficient": 0.05}),
    "conversational_multiturn": lambda: (conversational_dataset(), {}),
    "pad_to_multiple_of_8": lambda: (awkward_text_dataset(), {"pad_to_multiple_of": 8}),
}


def _compare(stock, shared, n=None):
    examples = list(stock.train_dataset)[: n or len(stock.train_dataset)]
    stock_result = reward_step(stock, examples)
    shared_result = reward_step(shared, examples)
    assert "prefix_sharing" in shared_result["batch"]
    assert_same_reward_step(stock_result, shared_result)
    return stock_result, shared_result


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("family", FAMILIES)
def test_reward_step_matches_stock(tmp_path, tokenizer, family, data):
    dataset, overrides = DATA[data]()
    stock, shared = make_reward_trainers(tmp_path, family, dataset, tokenizer, **overrides)
    stock_result, result = _compare(stock, shared)
    layout = result["batch"]["prefix_sharing"]
    assert (layout.document_ids >= 0).sum() < result["batch"]["attention_mask"].sum()
    if "pad_to_multiple_of" in overrides:
        assert_padded_to_multiple(stock_result["batch"], layout, overrides["pad_to_multiple_of"])


@pytest.mark.parametrize("family", FAMILIES)
def test_reward_accuracy_equals_stock_exactly_without_ties(tmp_path, tokenizer, family):
    """No identical completions: the accuracy is stock's, compared with `==` (assert_same_reward_step)."""
    stock, shared = make_reward_trainers(tmp_path, family, tie_free_text_dataset(), tokenizer)
    stock_result, shared_result = _compare(stock, shared)
    assert not tied_pairs(stock_result["batch"]).any()
    accuracy = float(stock_result["metrics"]["accuracy"])
    assert 0 < accuracy < 1  # pairs won and lost: one flipped pair would change it by 1/8
    assert float(shared_result["metrics"]["accuracy"]) == accuracy


def test_reward_tie_is_not_won_in_the_shared_row(tmp_path, tokenizer):
    """Identical completions (awkward_text_dataset's third pair): stock's two rows agree up to round-off and may count
    as won; the shared row gives both completions the same positions, so bitwise equal rewards, never won. The
    accuracy is stock's over the other pairs, exactly."""
    stock, shared = make_reward_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer)
    stock_result, shared_result = _compare(stock, shared)
    ties = tied_pairs(stock_result["batch"])
    assert ties.tolist() == [i == 2 for i in range(8)]
    rewards, shared_rewards = stock_result["rewards"], shared_result["rewards"]
    torch.testing.assert_close(rewards[:8][ties], rewards[8:][ties], atol=1e-6, rtol=0)
    assert torch.equal(shared_rewards[:8][ties], shared_rewards[8:][ties])
    wins = (rewards[:8] > rewards[8:]).reshape(8)
    assert float(stock_result["metrics"]["accuracy"]) == wins.float().mean().item()
    assert float(shared_result["metrics"]["accuracy"]) == (wins & ~ties).float().mean().item()


def test_reward_wrong_mask_fails(tmp_path, tokenizer, monkeypatch):
    stock, shared = make_reward_trainers(tmp_path, "qwen2", awkward_text_dataset(), tokenizer)
    _compare(stock, shared)

    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        _compare(stock, shared)


def test_reward_peft_lora_matches_stock(tmp_path, tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    stock, shared = make_reward_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer, peft_config=lora)
    for trainer in (stock, shared):
        torch.manual_seed(3)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.05)
    _compare(stock, shared)


def test_reward_training_and_evaluation_match_stock(tmp_path, tokenizer):
    train = synthetic_pairs(12, (1, 40), (1, 8), seed=30)
    evaluation = synthetic_pairs(8, (1, 40), (1, 8), seed=31)
    shapes = {}

    def compute_metrics(prediction):
        shapes.setdefault("calls", []).append(tuple(prediction.predictions.shape))
        return {"mean_prediction": float(prediction.predictions.mean())}

    stock, shared = make_reward_trainers(
        tmp_path, "mistral", train, tokenizer, eval_dataset=evaluation, max_steps=3, learning_rate=1e-3
    )
    for trainer in (stock, shared):
        trainer.compute_metrics = compute_metrics
    stock.train()
    shared.train()
    stock_logs = [log for log in stock.state.log_history if "loss" in log]
    shared_logs = [log for log in shared.state.log_history if "loss" in log]
    assert len(stock_logs) == len(shared_logs) == 3
    for expected, actual in zip(stock_logs, shared_logs, strict=True):
        for key, value in expected.items():
            assert actual[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    stock_eval, shared_eval = stock.evaluate(), shared.evaluate()
    assert shapes["calls"][0] == shapes["calls"][1]  # compute_metrics receives the same shapes
    for key, value in stock_eval.items():
        if "runtime" not in key and "per_second" not in key:
            assert shared_eval[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_reward_computes_fewer_positions_on_long_prompts(tmp_path, tokenizer):
    _, shared = make_reward_trainers(tmp_path, "llama", synthetic_pairs(8, (150, 250), (5, 20), seed=32), tokenizer)
    batch = shared.data_collator([shared.train_dataset[i] for i in range(8)])
    assert int((batch["prefix_sharing"].document_ids >= 0).sum()) < 0.6 * int(batch["attention_mask"].sum())


def test_reward_packing_matches_stock(tmp_path, tokenizer):
    dataset = _with_margin(awkward_text_dataset())
    stock, packed = make_reward_trainers(
        tmp_path, "qwen3", dataset, tokenizer, ours={"prefix_sharing": True, "packing": True, "packing_length": 512}
    )
    examples = list(stock.train_dataset)
    stock_result = reward_step(stock, examples)
    packed_result = reward_step(packed, examples, pairs_in_window=len(examples))  # several dense rows
    assert packed_result["batch"]["prefix_sharing"].input_ids.shape[0] > 1
    assert_same_reward_step(stock_result, packed_result)
    packed.data_collator.rows = RowPolicy(
        pack=True, length=packed.packed_batches.length, one_row=True
    )  # one row, as with FlexAttention
    packed._total_train_tokens = 0  # `num_tokens` is a running total
    packed_result = reward_step(packed, examples, pairs_in_window=len(examples))
    assert packed_result["batch"]["prefix_sharing"].input_ids.shape == (1, 512)
    assert_same_reward_step(stock_result, packed_result)


# ------------------------------------------------------------------------------------------------- ranked data
def ranked_dataset(conversational=False):
    rows = [
        {"prompt": "w1 w2 w3 w4 w5 w6", "completions": [" w7 w8", " w9", " w10 w11 w12", " w13"]},
        {"prompt": "what is the sum ?", "completions": [" 7", " 8", " 9"]},
        {
            "prompt": " ".join(f"w{i}" for i in range(60, 100)),
            "completions": [" yes", " no", " yes yes", " no no", " w1"],
        },
        {"prompt": "w20", "completions": [" w21", " w21 w22"]},
    ]
    if conversational:
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "completions": [[{"role": "assistant", "content": c.strip()}] for c in r["completions"]],
            }
            for r in rows
        ]
    return Dataset.from_list(rows)


@pytest.mark.parametrize("prefix_sharing", [True, False])
@pytest.mark.parametrize("conversational", [False, True])
def test_ranked_loss_equals_stock_on_expanded_pairs(tmp_path, tokenizer, prefix_sharing, conversational):
    ranked = ranked_dataset(conversational)
    pairs = expand_ranked_to_pairs(ranked)
    assert len(pairs) == 6 + 3 + 10 + 1
    stock, ours = make_reward_trainers(
        tmp_path,
        "llama",
        ranked,
        tokenizer,
        stock_dataset=pairs,
        ours={"prefix_sharing": prefix_sharing},
        center_rewards_coefficient=0.1,
    )
    stock_result = reward_step(stock, list(stock.train_dataset))
    ours_result = reward_step(ours, list(ours.train_dataset))
    assert ours_result["rewards"].shape == (4 + 3 + 5 + 2, 1)
    assert_same_reward_step(stock_result, ours_result, compare_rewards=False)


def test_ranked_rewards_equal_k_separate_forwards(tmp_path, tokenizer):
    _, ours = make_reward_trainers(
        tmp_path, "qwen2", ranked_dataset(), tokenizer, stock_dataset=expand_ranked_to_pairs(ranked_dataset())
    )
    examples = list(ours.train_dataset)
    result = reward_step(ours, examples)
    assert result["batch"]["prefix_sharing"].input_ids.shape[0] == len(examples)  # one row per prompt
    model = ours.model
    model.eval()
    separate = []
    with torch.no_grad():
        for example in examples:
            for ids in example["completion_ids"]:
                separate.append(model(input_ids=torch.tensor([ids])).logits[0])
    torch.testing.assert_close(result["rewards"], torch.stack(separate), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["sdpa", "varlen"])
def test_ranked_packing_and_training(tmp_path, tokenizer, kernel):
    """K ranked completions packed (the varlen kernel: one row exactly as long as the batch's documents, packing a
    token budget), equal to stock on the expanded pairs, and a short training run."""
    ranked = ranked_dataset()
    stock, ours = make_reward_trainers(
        tmp_path,
        "mistral",
        ranked,
        tokenizer,
        stock_dataset=expand_ranked_to_pairs(ranked),
        ours={
            "prefix_sharing": True,
            "packing": True,
            "packing_length": 256,
            "prefix_sharing_attn_implementation": kernel,
        },
    )
    assert ours.data_collator.rows.stream == (kernel == "varlen")
    stock_result = reward_step(stock, list(stock.train_dataset))
    ours_result = reward_step(ours, list(ours.train_dataset), pairs_in_window=20)
    assert_same_reward_step(stock_result, ours_result, compare_rewards=False)
    ours.args.max_steps = 2
    ours.train()
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in ours.state.log_history if "loss" in log)


def test_ranked_needs_two_completions(tmp_path, tokenizer):
    from trl_prefix_sharing import RewardTrainer
    from trl_prefix_sharing.testing.equivalence import reward_args

    with pytest.raises(ValueError, match="at least 2 completions"):
        RewardTrainer(
            model=make_reward_model("llama", tokenizer),
            args=reward_args(tmp_path, {"prefix_sharing": True}),
            train_dataset=Dataset.from_list([{"prompt": "w1", "completions": [" w2"]}]),
            processing_class=tokenizer,
        )


def test_ranked_and_pairwise_datasets_cannot_be_mixed(tmp_path, tokenizer):
    from trl_prefix_sharing import RewardTrainer
    from trl_prefix_sharing.testing.equivalence import reward_args

    ranked = Dataset.from_list([{"prompt": "w1", "completions": [" w2", " w3", " w4"]}])
    pairwise = Dataset.from_list([{"prompt": "w1", "chosen": " w2", "rejected": " w3"}])
    with pytest.raises(ValueError, match="train dataset is ranked and the eval dataset is not"):
        RewardTrainer(
            model=make_reward_model("llama", tokenizer),
            args=reward_args(tmp_path, {"prefix_sharing": True}),
            train_dataset=ranked,
            eval_dataset=pairwise,
            processing_class=tokenizer,
        )


def test_pairs_without_a_common_prefix_are_counted(tmp_path, tokenizer):
    from trl_prefix_sharing.collator import unit_lengths

    stock, shared = make_reward_trainers(tmp_path, "llama", _empty_prompts(), tokenizer, max_length=30)
    assert len(shared.train_dataset) == len(stock.train_dataset) < len(_empty_prompts())  # over-long rows dropped
    collator = shared.data_collator.unpacked()
    units = unit_lengths(shared.train_dataset, collator)
    rows = [int(collator.base_collator([example])["attention_mask"].sum()) for example in shared.train_dataset]
    # the two empty prompts, and "w1": a one-token common prefix saves nothing (that token heads each branch)
    assert len(units) == len(rows) > 3 and sum(unit == row for unit, row in zip(units, rows, strict=True)) == 3


def test_reward_evaluate_with_packing_equals_stock_per_pair_means(tmp_path, tokenizer):
    train = synthetic_pairs(8, (1, 30), (1, 6), seed=12)
    evaluation = synthetic_pairs(11, (1, 40), (1, 8), seed=13)
    # stock evaluates all 11 pairs in one batch: its metrics are the per-pair means of the dataset
    stock, packed = make_reward_trainers(
        tmp_path,
        "llama",
        train,
        tokenizer,
        eval_dataset=evaluation,
        per_device_eval_batch_size=16,
        ours={"prefix_sharing": True, "packing": True, "packing_length": 128},
    )
    assert len(packed.get_eval_dataloader()) > 2  # several packed batches with different numbers of pairs
    assert_same_eval_metrics(stock.evaluate(), packed.evaluate())
