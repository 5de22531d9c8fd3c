"""The start-up check judges a model on the model itself: custom model types outside the measured registry train with
prefix sharing when they honour the shared layout (and give stock TRL's numbers), and are refused before training,
with the measured difference, when they do not. The broken models (`custom_models.py`) are also the proof that the
check can fail: each differs from stock by orders of magnitude more than the tolerance."""

from __future__ import annotations

import copy

import pytest
import torch
import trl

from trl_prefix_sharing import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer
from trl_prefix_sharing.architectures import check_supported_model
from trl_prefix_sharing.model_check import MIN_PROMPT, TOLERANCE, _stretch, examples_to_check
from trl_prefix_sharing.testing import make_config
from trl_prefix_sharing.testing.custom_models import (
    BROKEN,
    EXACT,
    WINDOW,
    custom_config,
    custom_model,
    write_remote_code_model,
)
from trl_prefix_sharing.testing.equivalence import (
    CPU_RUN,
    assert_same_reward_step,
    awkward_text_dataset,
    compare_step,
    make_trainers,
    reward_args,
    reward_step,
    step,
)
from trl_prefix_sharing.testing.group_equivalence import assert_same_runs, make_group_trainer, prompt_dataset, train


#: sharper outputs than the default initialisation (0.02, nearly uniform), closer to a trained model's: a layout error
#: shows by far more than the tolerance (`docs/benchmarks/model_check.md`)
INIT = 0.2


def _dpo(tmp_path, tokenizer, model_type, **overrides):
    model = custom_model(model_type, len(tokenizer), initializer_range=INIT)
    ref = custom_model(model_type, len(tokenizer), seed=1, initializer_range=INIT)
    return make_trainers(tmp_path, None, awkward_text_dataset(), tokenizer, model=model, ref_model=ref, **overrides)


def _refusal(model_type: str) -> str:
    return (
        rf"Prefix sharing is refused for '{model_type}' \(.*\): the start-up check ran a few examples of the first "
        r"batch as stock rows and as prefix-shared rows, and they differ \(shared vs stock .*largest difference .*"
        r"\)\. .*Train it with `prefix_sharing=False`\."
    )


def test_registry_sends_unmeasured_models_to_the_check():
    """Outside the registry: checked, not refused by name. Reasons no batch can disprove, and measured differences,
    stay refusals; a registry family with a window it was not measured with is checked."""
    assert "not in the measured registry" in check_supported_model(custom_config("ps_plain_decoder", 32))
    assert check_supported_model(make_config("llama", 32)) is None
    assert "measured without a sliding window only" in check_supported_model(
        make_config("smollm3", 32, sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    )
    with pytest.raises(ValueError, match="never support 'bert': it is an encoder model"):
        check_supported_model(make_config("bert", 32))
    with pytest.raises(ValueError, match="cannot judge 'ps_plain_decoder' with the router's auxiliary loss"):
        check_supported_model(custom_config("ps_plain_decoder", 32, output_router_logits=True))


def test_check_rows_from_awkward_batches():
    """Up to two prompts, at least two distinct completions each, the longest first and never empty (identical
    generations of a group share everything, so they could not show a layout error); left padding read."""
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [0, 0, 4, 3, 3], [0, 0, 0, 0, 4]])
    mask = (ids != 0).long()
    examples = examples_to_check(ids, mask, prompt_lengths=torch.tensor([2, 2, 1, 1]))
    assert examples == [([5, 6], [[7, 8], [9]]), ([4], [[3, 3], [7, 8]])]  # the empty one replaced
    same = torch.tensor([[4, 3, 3], [4, 3, 3]])
    assert examples_to_check(same, torch.ones_like(same), prompt_lengths=torch.tensor([1, 1])) == [
        ([4], [[3, 3], [4]])
    ]
    reward = examples_to_check(ids[:2], mask[:2], examples=torch.tensor([0, 0]))
    assert reward == [([5, 6], [[7, 8], [9]])]


@pytest.mark.parametrize("model_type", EXACT)
def test_custom_type_that_honours_the_layout_trains_as_stock(tmp_path, tokenizer, model_type):
    stock, shared = _dpo(tmp_path, tokenizer, model_type)
    compare_step(stock, shared)
    result = shared.model_check.result
    assert result is not None and result.passed and result.values > 0
    assert result.difference <= result.tolerance == 1e-3  # float32's floor (the CPU spread is 0 here)
    assert shared.model_check.pending == []  # once


def test_check_puts_every_module_mode_back(tmp_path, tokenizer):
    """Eval mode during the check, then each module's own mode again (a module kept in eval stays there)."""
    stock, shared = _dpo(tmp_path, tokenizer, "ps_plain_decoder")
    shared.model.train()
    frozen = shared.model.model.layers[0]
    frozen.eval()
    modes = {name: module.training for name, module in shared.model.named_modules()}
    batch = shared._prepare_inputs(shared.data_collator(list(shared.train_dataset)))
    shared._prepare_layout(batch)
    assert shared.model_check.result.passed
    assert {name: module.training for name, module in shared.model.named_modules()} == modes
    assert not frozen.training and shared.model.training


@pytest.mark.parametrize("model_type", BROKEN)
def test_model_that_breaks_the_layout_is_refused_before_training(tmp_path, tokenizer, model_type):
    stock, shared = _dpo(tmp_path, tokenizer, model_type)
    examples = list(stock.train_dataset)
    step(stock, examples)  # stock TRL trains it
    before = {n: p.detach().clone() for n, p in shared.model.named_parameters()}
    with pytest.raises(ValueError, match=_refusal(model_type)):
        step(shared, examples)
    result = shared.model_check.result
    assert result.values > 0 and result.difference > 100 * result.tolerance  # a wide margin
    for name, value in shared.model.named_parameters():
        assert torch.equal(value, before[name])


def test_short_prompts_are_stretched():
    """One-token prompts cannot show a position or window error (the last prompt token starts every branch again):
    the check repeats the prompt tokens to `MIN_PROMPT` tokens, and to a window's length."""
    rows = examples_to_check(*(torch.tensor([[9, 5, 6, 0], [9, 7, 0, 0]]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])))
    ((prompt, completions),) = _stretch(rows, WINDOW, 4096)
    assert prompt == [9] * MIN_PROMPT and completions == [[5, 6], [7]]
    ((prompt, _),) = _stretch(rows, 3 * MIN_PROMPT, 4096)
    assert prompt == [9] * 3 * MIN_PROMPT
    ((prompt, _),) = _stretch(rows, 3 * MIN_PROMPT, MIN_PROMPT + 4)  # not past the model's positions
    assert len(prompt) == MIN_PROMPT + 2


def test_the_calibration_script_measures_the_check(tokenizer, load_script):
    """`scripts/calibrate_model_check.py` (docs/benchmarks/model_check.md) runs the start-up check as the trainers
    build it: the shared layout of a plain decoder within the tolerance, a broken backbone far outside it."""
    calibrate = load_script("calibrate_model_check")
    rows = calibrate.examples(tokenizer, seed=0)
    shape = dict(hidden_size=32, num_layers=2, initializer_range=INIT)
    exact = calibrate.measure(custom_model("ps_plain_decoder", len(tokenizer), **shape), rows, tokenizer)
    broken = calibrate.measure(custom_model("ps_row_causal", len(tokenizer), **shape), rows, tokenizer)
    assert exact["values"] > 0 and broken["values"] > 0
    tolerance = TOLERANCE[torch.float32]
    assert exact["difference"] < tolerance < 10 * tolerance < broken["difference"]


def test_always_checks_measured_models_too(tmp_path, tokenizer):
    stock, shared = make_trainers(
        tmp_path,
        "llama",
        awkward_text_dataset(),
        tokenizer,
        ours={"prefix_sharing": True, "prefix_sharing_model_check": "always"},
    )
    compare_step(stock, shared)
    assert shared.model_check.result.passed
    with pytest.raises(ValueError, match="prefix_sharing_model_check"):
        DPOConfig(output_dir=str(tmp_path), **CPU_RUN, prefix_sharing=True, prefix_sharing_model_check="never")


def test_reward_models_are_checked_on_their_rewards(tmp_path, tokenizer):
    dataset = awkward_text_dataset()
    results = {}
    for model_type in ("ps_plain_decoder", "ps_row_causal"):
        model = custom_model(model_type, len(tokenizer), classifier=True, initializer_range=INIT)
        stock = trl.RewardTrainer(
            model=copy.deepcopy(model),
            args=reward_args(tmp_path, None),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        shared = RewardTrainer(
            model=copy.deepcopy(model),
            args=reward_args(tmp_path, {"prefix_sharing": True}),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        examples = list(stock.train_dataset)
        expected = reward_step(stock, examples)
        if model_type == "ps_plain_decoder":
            assert_same_reward_step(expected, reward_step(shared, examples))
        else:
            with pytest.raises(ValueError, match=_refusal(model_type)):
                reward_step(shared, examples)
        results[model_type] = shared.model_check.result
    assert results["ps_plain_decoder"].passed and results["ps_plain_decoder"].compared == "rewards"
    assert results["ps_row_causal"].difference > 100 * results["ps_row_causal"].tolerance


@pytest.mark.parametrize("model_type", ["ps_plain_decoder", "ps_row_positions"])
def test_grpo_checks_the_first_generated_group(tmp_path, tokenizer, model_type):
    model = custom_model(model_type, len(tokenizer), initializer_range=INIT)  # an instance: TRL reads `auto_map`
    dataset = prompt_dataset()  # from a path's config, which a type registered in code has not
    if model_type == "ps_plain_decoder":
        stock = train(make_group_trainer("grpo", False, copy.deepcopy(model), dataset, tokenizer, tmp_path))
        trainer = make_group_trainer("grpo", True, copy.deepcopy(model), dataset, tokenizer, tmp_path)
        assert_same_runs(stock, train(trainer))
        assert trainer.model_check.result.passed and trainer.model_check.result.rows >= 4
    else:
        trainer = make_group_trainer("grpo", True, model, dataset, tokenizer, tmp_path)
        with pytest.raises(ValueError, match=_refusal(model_type)):
            train(trainer)
        assert trainer.state.global_step == 0


def test_check_under_lora(tmp_path, tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = custom_model("ps_plain_decoder", len(tokenizer), initializer_range=INIT)
    stock, shared = make_trainers(
        tmp_path, None, awkward_text_dataset(), tokenizer, model=model, ref_model=None, peft_config=lora
    )
    compare_step(stock, shared)
    assert shared.model_check.result.passed


@pytest.mark.parametrize("trainer", ["dpo", "reward"])
def test_trl_trust_remote_code_with_prefix_sharing(tmp_path, tokenizer, trainer):
    """TRL's own `test_trust_remote_code` (DPO and reward), with prefix sharing on, on a local custom-code checkpoint
    under its own model type ("remote", like TRL's `tiny-RemoteForCausalLM`): refused by transformers without
    `trust_remote_code`, trained with it, after the start-up check, with stock's numbers."""
    model_id = str(write_remote_code_model(tmp_path / "remote", len(tokenizer)))
    dataset = awkward_text_dataset()
    trainer_cls, config_cls, stock_cls, stock_config = {
        "dpo": (DPOTrainer, DPOConfig, trl.DPOTrainer, trl.DPOConfig),
        "reward": (RewardTrainer, RewardConfig, trl.RewardTrainer, trl.RewardConfig),
    }[trainer]
    common = dict(**CPU_RUN, per_device_train_batch_size=4, max_length=None)
    with pytest.raises(ValueError, match="custom code"):
        trainer_cls(
            model=model_id,
            args=config_cls(output_dir=str(tmp_path / "a"), prefix_sharing=True, **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    shared = trainer_cls(
        model=model_id,
        args=config_cls(output_dir=str(tmp_path / "b"), prefix_sharing=True, trust_remote_code=True, **common),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    assert type(shared.model).__name__ == (
        "RemoteForCausalLM" if trainer == "dpo" else "RemoteForSequenceClassification"
    )
    stock = stock_cls(
        model=model_id,
        args=stock_config(output_dir=str(tmp_path / "c"), trust_remote_code=True, **common),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    examples = list(stock.train_dataset)
    if trainer == "dpo":
        compare_step(stock, shared)
    else:
        assert_same_reward_step(reward_step(stock, examples), reward_step(shared, examples))
    assert shared.model_check.result.passed


def _other_trainer_step(name, tmp_path, tokenizer, model_type, monkeypatch):
    """(stock result, a callable running ours) for one batch of KTO, ORPO, CPO or online DPO on a custom type."""
    import test_kto_equivalence as kto
    import test_online_dpo_equivalence as online
    import test_orpo_cpo_equivalence as orpo

    module = {"kto": kto, "orpo": orpo, "cpo": orpo, "online_dpo": online}[name]

    def make(family, vocab_size, seed=0, **overrides):
        return custom_model(family, vocab_size, seed=seed, initializer_range=INIT, **overrides)

    monkeypatch.setattr(module, "make_model", make)
    if name == "kto":
        stock, shared = kto.make_trainers(tmp_path, tokenizer, kto.unpaired_dataset(), family=model_type)
        examples = [shared.train_dataset[i] for i in range(4)]
        return kto.kto_step(stock, examples), lambda: kto.kto_step(shared, examples), shared, kto.assert_same_step
    if name == "online_dpo":
        stock, shared = online.make_trainers(tmp_path, model_type, tokenizer)
        batch = online.crafted_batch(tokenizer)
        return (
            online.forward_and_grads(stock, *batch),
            lambda: online.forward_and_grads(shared, *batch),
            shared,
            lambda a, b: torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=1e-5),
        )
    stock, shared = orpo.make_trainers(tmp_path, name, tokenizer, awkward_text_dataset(), family=model_type)
    examples = [shared.train_dataset[i] for i in range(len(shared.train_dataset))]
    return (
        orpo.loss_and_grads(stock, examples),
        lambda: orpo.loss_and_grads(shared, examples),
        shared,
        orpo.assert_same_batch,
    )


@pytest.mark.parametrize("model_type", ["ps_plain_decoder", "ps_row_causal"])
@pytest.mark.parametrize("name", ["kto", "orpo", "cpo", "online_dpo"])
def test_every_trainer_runs_the_check(tmp_path, tokenizer, monkeypatch, name, model_type):
    """KTO (rows laid out in the step), ORPO and CPO (concatenated rows), online DPO (generated rows): a custom type
    that honours the layout gives stock's numbers after the check; one that does not is refused at its first batch."""
    expected, ours, shared, assert_same = _other_trainer_step(name, tmp_path, tokenizer, model_type, monkeypatch)
    if model_type == "ps_plain_decoder":
        assert_same(expected, ours())
        assert shared.model_check.result.passed
    else:
        with pytest.raises(ValueError, match=_refusal(model_type)):
            ours()
        assert shared.model_check.result.difference > 100 * shared.model_check.result.tolerance


def test_shared_rows_that_cannot_run_are_refused_with_the_cause(tmp_path, tokenizer):
    stock, shared = _dpo(tmp_path, tokenizer, "ps_plain_decoder")

    def failing_layout(*args, **kwargs):
        raise RuntimeError("no kernel for this mask")

    shared.sharing_session.layout = failing_layout
    with pytest.raises(
        ValueError, match=r"could not run .* \(RuntimeError: no kernel for this mask\)\. Train it with"
    ):
        step(shared, list(shared.train_dataset))
    assert shared.model_check.result.error == "RuntimeError: no kernel for this mask"


def test_the_check_rows_are_read_only_while_the_check_is_pending(tmp_path, tokenizer, monkeypatch):
    """The start-up check's inputs (each row's example and prompt) are worked out for the first batch only: the steps
    after it pay nothing for them."""
    stock, shared = _dpo(tmp_path, tokenizer, "ps_plain_decoder")
    calls = []
    for name, attribute in (("example_ids", "_examples_of"), ("prompt_lengths", "_prompts_of")):
        real = getattr(shared, attribute)
        counted = staticmethod(lambda batch, real=real, name=name: calls.append(name) or real(batch))
        monkeypatch.setattr(type(shared), attribute, counted)
    batch = shared._prepare_inputs(shared.data_collator(list(shared.train_dataset)))
    shared._prepare_layout(batch)
    assert shared.model_check.result.passed and sorted(calls) == ["example_ids", "prompt_lengths"]
    calls.clear()
    batch = shared._prepare_inputs(shared.data_collator(list(shared.train_dataset)))
    shared._prepare_layout(batch)
    assert calls == []
