"""Prefix-shared DPO computes stock TRL's numbers: families x data, loss types, reference setups, training loop."""

import pytest
import torch
from test_mixed_precision import BF16_ATOL, BF16_RTOL

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing.testing import FAMILIES, synthetic_pairs
from trl_prefix_sharing.testing.equivalence import (
    assert_same_eval_metrics,
    assert_same_step,
    assert_same_training,
    awkward_text_dataset,
    compare_step,
    conversational_dataset,
    leaky_dpo_mask,
    make_trainers,
    step,
    train_and_evaluate,
)


DATA = {
    "awkward_text": lambda: (awkward_text_dataset(), {}),
    "truncated_keep_start": lambda: (awkward_text_dataset(), {"max_length": 12}),
    "conversational_multiturn": lambda: (conversational_dataset(), {"max_length": 40}),
    "pad_to_multiple_of_8": lambda: (awkward_text_dataset(), {"pad_to_multiple_of": 8}),
}


def assert_padded_to_multiple(stock_batch, layout, multiple):
    """`pad_to_multiple_of` took effect: stock's rows are padded to a multiple wider than their longest row, and the
    shared rows' width is a multiple too."""
    width = stock_batch["input_ids"].shape[1]
    assert width % multiple == 0 and stock_batch["attention_mask"].sum(1).max() < width, width
    assert layout.input_ids.shape[1] % multiple == 0, layout.input_ids.shape


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("family", FAMILIES)
def test_step_matches_stock(tmp_path, tokenizer, family, data):
    dataset, overrides = DATA[data]()
    stock, shared = make_trainers(tmp_path, family, dataset, tokenizer, **overrides)
    stock_result, result = compare_step(stock, shared)
    layout = result["batch"]["prefix_sharing"]
    assert (layout.document_ids >= 0).sum() < result["batch"]["attention_mask"].sum()
    if "pad_to_multiple_of" in overrides:  # stock's rows padded past the longest one; the shared rows rounded alike
        assert_padded_to_multiple(stock_result["batch"], layout, overrides["pad_to_multiple_of"])


def test_truncation_keep_end_matches_stock(tmp_path, tokenizer):
    # keep_end cuts each row from the left by its own amount: rows then share no prefix, and must still be exact.
    stock, shared = make_trainers(
        tmp_path, "llama", awkward_text_dataset(), tokenizer, max_length=10, truncation_mode="keep_end"
    )
    compare_step(stock, shared)


def test_wrong_mask_fails(tmp_path, tokenizer, monkeypatch):
    """A mask that lets the rejected completion see the chosen one must break the comparison."""
    stock, shared = make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer)
    compare_step(stock, shared)  # the real mask passes

    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        compare_step(stock, shared)


LOSS_SETTINGS = {
    **{
        name: {"loss_types": [name]}
        for name in [
            "sigmoid",
            "hinge",
            "ipo",
            "nca_pair",
            "bco_pair",
            "sppo_hard",
            "aot",
            "aot_unpaired",
            "apo_zero",
            "apo_down",
            "discopop",
            "sft",
            "sigmoid_norm",
        ]
    },
    "exo_pair": {"loss_types": ["exo_pair"], "label_smoothing": 1e-3},
    "robust": {"loss_types": ["robust"], "label_smoothing": 0.1},
    "aot_smoothed": {"loss_types": ["aot"], "label_smoothing": 0.1},
    "weighted_combo": {"loss_types": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "ld_alpha": {"ld_alpha": 0.5},
    "use_weighting": {"use_weighting": True},
    "forward_kl": {"f_divergence_type": "forward_kl"},
    "js_divergence": {"f_divergence_type": "js_divergence"},
    "alpha_divergence": {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5},
}


@pytest.fixture(scope="module")
def loss_trainers(tmp_path_factory, tokenizer):
    # `use_weighting=True` at init makes the fused head compute every per-token field; the loss settings are then
    # switched on the trainers' attributes (TRL copies them from the config at init).
    dataset = synthetic_pairs(8, (1, 40), (1, 8), seed=3)
    return make_trainers(tmp_path_factory.mktemp("loss"), "qwen2", dataset, tokenizer, use_weighting=True)


@pytest.mark.parametrize("setting", list(LOSS_SETTINGS))
def test_loss_types_match_stock(loss_trainers, setting):
    defaults = {
        "loss_types": ["sigmoid"],
        "loss_weights": None,
        "label_smoothing": 0.0,
        "ld_alpha": None,
        "use_weighting": False,
        "f_divergence_type": "reverse_kl",
        "f_alpha_divergence_coef": 1.0,
    }
    values = {**defaults, **LOSS_SETTINGS[setting]}
    values["loss_weights"] = values["loss_weights"] or [1.0] * len(values["loss_types"])
    for trainer in loss_trainers:
        for key, value in values.items():
            setattr(trainer, key, value)
    # a few optimizer-free steps away from the reference, so that losses are not at their symmetric starting point
    compare_step(*loss_trainers)


@pytest.mark.parametrize("packing", [False, True])
def test_precompute_ref_log_probs_matches_stock(tmp_path, tokenizer, packing):
    dataset = synthetic_pairs(10, (1, 30), (1, 6), seed=4)
    stock, shared = make_trainers(
        tmp_path,
        "qwen3",
        dataset,
        tokenizer,
        ref_model=None,
        precompute_ref_log_probs=True,
        precompute_ref_batch_size=3,
        ours={"prefix_sharing": True, "packing": packing},
    )
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        expected = torch.tensor(stock.train_dataset[column])
        assert expected.numel() == 10
        torch.testing.assert_close(torch.tensor(shared.train_dataset[column]), expected, atol=1e-5, rtol=1e-5)
    # move the policy away from the reference: at the reference, every reward is 0 up to round-off, and
    # `rewards/accuracies` would count round-off (which differs with the batch a row is computed in, in stock too)
    for trainer in (stock, shared):
        torch.manual_seed(7)
        for param in trainer.model.parameters():
            param.data.add_(torch.randn_like(param), alpha=0.02)
    compare_step(stock, shared)


def test_reference_reloaded_from_model_path(tmp_path, tokenizer):
    from trl_prefix_sharing.testing import make_model

    path = tmp_path / "policy"
    make_model("mistral", len(tokenizer), seed=5).save_pretrained(path)
    tokenizer.save_pretrained(path)
    stock, shared = make_trainers(
        tmp_path, "mistral", awkward_text_dataset(), tokenizer, model=str(path), ref_model=None
    )
    assert shared.ref_model is not None
    compare_step(stock, shared)


def test_peft_lora_matches_stock(tmp_path, tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    stock, shared = make_trainers(
        tmp_path, "llama", awkward_text_dataset(), tokenizer, ref_model=None, peft_config=lora
    )
    # move the adapters away from zero so the policy differs from the reference (adapters disabled)
    for trainer in (stock, shared):
        torch.manual_seed(7)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.05)
    stock_result, shared_result = compare_step(stock, shared)
    assert all("lora" in name for name in shared_result["grads"])


@pytest.mark.parametrize("gradient_checkpointing", [True, False])
def test_training_and_evaluation_match_stock(tmp_path, tokenizer, gradient_checkpointing):
    train = synthetic_pairs(12, (1, 40), (1, 8), seed=6)
    evaluation = synthetic_pairs(7, (1, 40), (1, 8), seed=7)
    stock, shared = make_trainers(
        tmp_path,
        "llama",
        train,
        tokenizer,
        eval_dataset=evaluation,
        max_steps=3,
        learning_rate=1e-2,
        gradient_checkpointing=gradient_checkpointing,
        loss_type=["sigmoid", "sft"],
    )
    stock.train()
    shared.train()
    stock_logs = [log for log in stock.state.log_history if "loss" in log]
    shared_logs = [log for log in shared.state.log_history if "loss" in log]
    assert len(stock_logs) == len(shared_logs) == 3
    for expected, actual in zip(stock_logs, shared_logs, strict=True):
        for key, value in expected.items():
            assert actual[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
        assert actual["num_shared_tokens"] < actual["num_tokens"]
    for name, param in stock.model.named_parameters():
        torch.testing.assert_close(dict(shared.model.named_parameters())[name], param, atol=1e-5, rtol=1e-4)
    stock_eval, shared_eval = stock.evaluate(), shared.evaluate()
    assert "eval_loss" in stock_eval
    for key, value in stock_eval.items():
        if "runtime" in key or "per_second" in key:
            continue
        assert shared_eval[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def count_grad_free_training_forwards(model) -> dict:
    """Calls of the first decoder layer's MLP in training mode with gradients off: the first forward of a reentrant
    activation checkpoint (a non-reentrant one, its recomputation and a plain training forward run with gradients on;
    transformers checkpoints the layer's `forward`, inside its hooks, so the hook is on a submodule)."""
    counts = {"calls": 0}

    def hook(module, args):
        counts["calls"] += module.training and not torch.is_grad_enabled()

    model.model.layers[0].mlp.register_forward_pre_hook(hook)
    return counts


#: options of a short training run, each with a check that it took effect (in `test_training_options_match_stock`)
TRAINING_OPTIONS = {
    "reentrant_checkpointing": {
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": True},
    },
    "sync_ref_model": {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
}


@pytest.mark.parametrize("option", list(TRAINING_OPTIONS))
def test_training_options_match_stock(tmp_path, tokenizer, option):
    """Two training steps and an evaluation with `option` log stock's numbers and train stock's weights.
    `reentrant_checkpointing`: the policy's layers run in reentrant checkpoints in the shared passes too.
    `sync_ref_model`: the reference is mixed from the policy after every step, so the second step and the evaluation
    score against new reference weights, the same in both runs."""
    data = synthetic_pairs(8, (1, 12), (1, 4), seed=6)
    stock, shared = make_trainers(
        tmp_path,
        "llama",
        data,
        tokenizer,
        eval_dataset=data,
        max_steps=2,
        learning_rate=1e-2,
        **TRAINING_OPTIONS[option],
    )
    initial_reference = {name: param.detach().clone() for name, param in stock.ref_model.named_parameters()}
    counts = [count_grad_free_training_forwards(trainer.model) for trainer in (stock, shared)]
    results = [train_and_evaluate(trainer) for trainer in (stock, shared)]
    assert_same_training(*results, ours_only=("num_shared_tokens",))
    if option == "reentrant_checkpointing":
        assert counts[0]["calls"] > 0 and counts[1]["calls"] > 0, counts
    synced = dict(shared.ref_model.named_parameters())
    for name, param in stock.ref_model.named_parameters():
        torch.testing.assert_close(synced[name], param, atol=1e-5, rtol=1e-4)
    moved = any(not torch.equal(param, initial_reference[name]) for name, param in stock.ref_model.named_parameters())
    assert moved == (option == "sync_ref_model")


def test_bf16_full_eval_matches_stock_to_bf16_round_off(tmp_path, tokenizer):
    """`bf16_full_eval=True`: the evaluation casts the policy to bf16, without autocast (the reference stays as TRL
    prepared it); the evaluation metrics equal stock's to bf16 round-off (the tolerances of `test_mixed_precision`)."""
    data = synthetic_pairs(8, (1, 40), (1, 8), seed=6)
    stock, shared = make_trainers(tmp_path, "llama", data, tokenizer, eval_dataset=data, bf16_full_eval=True)
    stock_eval, shared_eval = stock.evaluate(), shared.evaluate()
    assert stock.model.dtype == shared.model.dtype == torch.bfloat16
    assert_same_eval_metrics(stock_eval, shared_eval, rel=BF16_RTOL, abs=BF16_ATOL)


def test_prefix_sharing_off_is_stock(tmp_path, tokenizer):
    from trl_prefix_sharing import DPOTrainer
    from trl_prefix_sharing.testing import make_model

    model, ref = make_model("qwen2", len(tokenizer)), make_model("qwen2", len(tokenizer), seed=1)
    stock, trainer = make_trainers(
        tmp_path,
        "qwen2",
        awkward_text_dataset(),
        tokenizer,
        model=model,
        ref_model=ref,
        ours={"prefix_sharing": False},
    )
    assert isinstance(trainer, DPOTrainer) and type(trainer.data_collator) is type(stock.data_collator)
    examples = [trainer.train_dataset[i] for i in range(4)]
    assert "prefix_sharing" not in trainer.data_collator(examples)
    stock_result, result = step(stock, examples), step(trainer, examples)
    assert_same_step(stock_result, result, atol=0, rtol=0)  # bitwise: nothing of ours runs


def test_policy_computes_fewer_positions_on_long_prompts(tmp_path, tokenizer):
    dataset = synthetic_pairs(16, (150, 250), (5, 20), seed=8)
    stock, shared = make_trainers(tmp_path, "llama", dataset, tokenizer)
    examples = [shared.train_dataset[i] for i in range(8)]
    batch = shared.data_collator(examples)
    stock_positions = int(batch["attention_mask"].sum())
    shared_positions = int((batch["prefix_sharing"].document_ids >= 0).sum())
    assert shared_positions < 0.6 * stock_positions
    # and the padded tensors the model really runs on are smaller too
    assert batch["prefix_sharing"].input_ids.numel() < 0.6 * batch["input_ids"].numel()
