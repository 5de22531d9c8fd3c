"""Online DPO with prefix sharing computes stock TRL's numbers: `_forward` log-probs at every completion column
(padding included, which stock's `objective/kl` and `objective/entropy` sum) and their gradients, and whole training
runs (same samples, every logged statistic, final weights)."""

import copy

import pytest
import torch
from test_grpo_equivalence import crafted_batch
from trl.experimental.online_dpo import OnlineDPOConfig as StockConfig
from trl.experimental.online_dpo import OnlineDPOTrainer as StockTrainer

import trl_prefix_sharing.attention as attention_module
import trl_prefix_sharing.mask as mask_module
from trl_prefix_sharing import OnlineDPOConfig, OnlineDPOTrainer
from trl_prefix_sharing.testing import FAMILIES, make_model
from trl_prefix_sharing.testing.equivalence import CPU_RUN, leaky_dpo_mask
from trl_prefix_sharing.testing.group_equivalence import (
    UNCOMPARED,
    assert_same_runs,
    prompt_dataset,
    reward_digits,
    reward_length,
    spy_generation_attention,
)


def make_trainers(
    tmp_path,
    family,
    tokenizer,
    dataset=None,
    peft_config=None,
    config_kwargs=None,
    models=None,
    ours=None,
    **overrides,
):
    """(stock, prefix-shared) trainers on deep copies of one policy and reference: new ones of `family`, or `models`
    (policy, reference); `ours`: fields only our config has."""
    config_kwargs = config_kwargs or {}
    if models is not None:
        model, ref = models
    else:
        model = make_model(family, len(tokenizer), seed=0, **config_kwargs)
        ref = None if peft_config is not None else make_model(family, len(tokenizer), seed=1, **config_kwargs)
    kwargs = dict(
        per_device_train_batch_size=4,
        max_new_tokens=6,
        **CPU_RUN,
        max_steps=2,
        learning_rate=1e-3,
    )
    kwargs.update(overrides)
    trainers = []
    for cls, config, options in (
        (StockTrainer, StockConfig, {}),
        (OnlineDPOTrainer, OnlineDPOConfig, {"prefix_sharing": True, **(ours or {})}),
    ):
        trainers.append(
            cls(
                model=copy.deepcopy(model),
                ref_model=copy.deepcopy(ref),
                reward_funcs=[reward_length, reward_digits],
                args=config(output_dir=str(tmp_path / f"run{len(trainers)}"), **options, **kwargs),
                train_dataset=dataset if dataset is not None else prompt_dataset(),
                processing_class=tokenizer,
                peft_config=copy.deepcopy(peft_config),
            )
        )
    return trainers


def forward_and_grads(trainer, input_ids, attention_mask, keep):
    """`_forward` log-probs of every completion column (as stock returns them) and gradients of a weighted sum."""
    trainer.model.zero_grad(set_to_none=True)
    logps = trainer._forward(
        trainer.model, input_ids[:, :-keep], attention_mask[:, :-keep], input_ids[:, -keep:], attention_mask[:, -keep:]
    )
    (logps * torch.linspace(-1, 1, logps.numel(), device=logps.device).view_as(logps)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return logps.detach(), grads


def test_forward_scores_every_column_as_stock(tmp_path, tokenizer):
    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    for family in FAMILIES:
        stock, shared = make_trainers(tmp_path / family, family, tokenizer)
        (expected, expected_grads), (got, grads) = (
            forward_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared)
        )
        padding = attention_mask[:, -keep:] == 0
        assert expected.shape == got.shape and padding.any() and (~padding).any() and expected_grads
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # padding columns included
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(got[0], got[3])  # identical completions of one prompt: bitwise equal


@pytest.mark.parametrize("wrong", ["leaky_branches", "visible_padding_keys"])
def test_wrong_mask_fails(tmp_path, tokenizer, monkeypatch, wrong):
    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    # "prompts": a join that moves no positions, so no start-up check stops the wrong mask before the comparison
    stock, shared = make_trainers(tmp_path, "llama", tokenizer, ours={"prefix_sharing_join": "prompts"})
    expected = forward_and_grads(stock, input_ids, attention_mask, keep)[0]
    if wrong == "leaky_branches":
        monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    else:  # padding keys visible: only the padding columns (objective/kl, objective/entropy) go wrong
        monkeypatch.setattr(mask_module, "visible_key", lambda key_visible: lambda b, h, q, kv: kv >= 0)
    got = forward_and_grads(shared, input_ids, attention_mask, keep)[0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def train(trainer):
    torch.manual_seed(0)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return logs, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"conversational": True, "gradient_accumulation_steps": 2, "max_steps": 1},
        # stock TRL 1.16 indexes a `beta` list with the float epoch: one step only
        {"loss_type": "ipo", "beta": [0.2, 0.1], "max_steps": 1},
        {"lora": True},
    ],
    ids=["text", "conversational-accumulation", "ipo-beta-schedule", "lora"],
)
def test_training_matches_stock(tmp_path, tokenizer, setting):
    setting = dict(setting)
    dataset = prompt_dataset(conversational=setting.pop("conversational", False))
    peft_config = None
    if setting.pop("lora", False):
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        setting["learning_rate"] = 1e-2
    stock, shared = (train(t) for t in make_trainers(tmp_path, "qwen2", tokenizer, dataset, peft_config, **setting))
    assert len(stock[0]) == len(shared[0]) > 0
    compared = 0
    for a, b in zip(stock[0], shared[0], strict=True):
        for key, value in a.items():
            if key not in UNCOMPARED and isinstance(value, (int, float)):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
                compared += 1
    assert compared >= 15 * len(stock[0])
    for name, value in stock[1].items():
        torch.testing.assert_close(shared[1][name], value, atol=1e-5, rtol=1e-4)


def test_remove_prefix_sharing_restores_the_models(tmp_path, tokenizer):
    _, shared = make_trainers(tmp_path, "llama", tokenizer)
    assert "forward" not in shared.model.__dict__  # patched only within `train()`, `evaluate()`, `predict()`
    shared.sharing_session.attach()
    assert "forward" in shared.model.__dict__
    shared.remove_prefix_sharing()
    assert "forward" not in shared.model.__dict__ and "forward" not in shared.ref_model.__dict__


def test_generation_runs_on_the_models_own_attention(tmp_path, tokenizer, monkeypatch):
    """Policy and reference loaded with eager attention: the shared passes run on SDPA, generation on eager as in
    stock TRL, and the runs are equal (see the GRPO test of the same name)."""
    from transformers import Qwen3ForCausalLM

    seen = spy_generation_attention(monkeypatch, Qwen3ForCausalLM)
    stock, shared = make_trainers(tmp_path, "qwen3", tokenizer, config_kwargs={"attn_implementation": "eager"})
    runs = []
    for trainer in (stock, shared):
        seen.clear()
        runs.append(train(trainer))
        assert len(seen) == 2 and set(seen) == {"eager"}, seen
    assert shared.sharing_session.backend.name == "sdpa"
    assert shared.model.config._attn_implementation == "eager"  # as TRL left it, after `train()`
    assert_same_runs(*runs)
    shared.remove_prefix_sharing()
    assert shared.model.config._attn_implementation == "eager" and "generate" not in shared.model.__dict__
