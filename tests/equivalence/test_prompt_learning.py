"""Prompt-learning PEFT (prompt tuning, P-tuning, prefix tuning) with prefix sharing: the virtual tokens PEFT puts
before every row are one root every row shares (`trl_prefix_sharing/virtual.py`), computed once per micro-batch.

TRL's own tests of prompt learning in SFT (`test_prompt_tuning`, `test_prompt_tuning_peft_model`,
`test_train_with_peft_config_prompt_tuning`), ported to a tiny Qwen2 built from its config and a local
language-modeling dataset, with sharing on; SFT and DPO against stock TRL's own classes on the same micro-batches
(per-token log-probs, loss, every metric, the prompt encoder's gradients), with variants that must differ (the virtual
tokens hidden from later rows, the tokens' positions not offset); what stays refused, before the first step."""

import copy
import random

import pytest
import torch
import trl
from datasets import Dataset
from peft import (
    MultitaskPromptTuningConfig,
    PrefixTuningConfig,
    PromptEncoderConfig,
    PromptTuningConfig,
    TaskType,
    get_peft_model,
)

import trl_prefix_sharing.virtual as virtual_module
from trl_prefix_sharing import DPOTrainer, KTOTrainer, SFTConfig, SFTTrainer
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    CPU_RUN,
    assert_same_loss_metrics_grads,
    assert_same_step,
    awkward_text_dataset,
    backward_grads,
    dpo_args,
    make_trainers,
    step,
)
from trl_prefix_sharing.trie import StockRows, plan_layout


N_VIRTUAL = 4
KINDS = ("prompt_tuning", "prompt_encoder", "prefix_tuning")


def peft_config(kind: str, num_virtual_tokens: int = N_VIRTUAL, hidden_size: int = 32):
    """A PEFT config of `kind`, as TRL's tests build them."""
    if kind == "prompt_tuning":
        return PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=num_virtual_tokens)
    if kind == "prefix_tuning":
        return PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=num_virtual_tokens)
    return PromptEncoderConfig(
        task_type=TaskType.CAUSAL_LM, num_virtual_tokens=num_virtual_tokens, encoder_hidden_size=hidden_size
    )


def language_modeling_dataset(n=16, seed=0) -> Dataset:
    """Plain text of unequal lengths, most rows after one shared start (what TRL's `standard_language_modeling`
    zen data is: a `text` column)."""
    rng = random.Random(seed)
    start = "the answer of w1 and w2"
    rows = []
    for i in range(n):
        words = " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randrange(2, 12)))
        rows.append({"text": f"{start} {words}" if i % 3 else words})
    return Dataset.from_list(rows)


def completions_dataset() -> Dataset:
    """Prompt and completion rows: one prompt of several completions (one repeated), a one-word prompt, unequal
    lengths."""
    prompt = "w1 w2 w3 w4 w5 w6"
    rows = [
        {"prompt": prompt, "completion": " w7 w8"},
        {"prompt": prompt, "completion": " w9"},
        {"prompt": prompt, "completion": " w7 w8"},
        {"prompt": "w10", "completion": " w11 w12 w13 w14 w15"},
        {"prompt": "w16 w17 w18", "completion": " w19 w20 w21"},
        {"prompt": prompt, "completion": " w22 w23 w24"},
    ]
    return Dataset.from_list(rows)


# ----------------------------------------------------------------------------------------------- TRL's tests, ported
def _base_names(model) -> set:
    return {name for name, _ in model.get_base_model().named_parameters()}


def _assert_trained_only_the_adapter(trainer, previous: dict) -> None:
    """TRL's assertions: the PEFT parameters changed, the base model's did not."""
    assert previous
    for name, param in previous.items():
        new_param = trainer.model.get_parameter(name)
        if "base_model" in name:  # the base model's parameters are the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {name} has changed.")
        elif "prompt_encoder" in name:  # the PEFT parameters changed
            assert not torch.equal(param, new_param), f"Parameter {name} has not changed."
        else:
            raise ValueError(f"Unexpected parameter {name} in model: {trainer.model}")


def _train(trainer) -> dict:
    previous = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert logged and all(log["num_shared_tokens"] > 0 for log in logged)  # prefix sharing ran
    _assert_trained_only_the_adapter(trainer, previous)
    return logged[-1]


def _sft_config(tmp_path, **overrides):
    return SFTConfig(output_dir=str(tmp_path), prefix_sharing=True, **{**CPU_RUN, "logging_steps": 2, **overrides})


def test_prompt_tuning(tmp_path, tokenizer):
    """TRL's `test_prompt_tuning`: SFT with P-tuning (`PromptEncoderConfig`) given as `peft_config`."""
    trainer = SFTTrainer(
        model=make_model("qwen2", len(tokenizer)),
        args=_sft_config(tmp_path),
        train_dataset=language_modeling_dataset(),
        processing_class=tokenizer,
        peft_config=PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8),
    )
    assert trainer.sharing_session.virtual == virtual_module.VirtualTokens(virtual_module.EMBEDS, 8)
    assert _train(trainer)["mean_token_accuracy"] is not None


def test_prompt_tuning_peft_model(tmp_path, tokenizer):
    """TRL's `test_prompt_tuning_peft_model`: a `get_peft_model(model, PromptEncoderConfig(...))` given as `model`
    (the virtual tokens are read from the PEFT wrapper's active config)."""
    model = get_peft_model(
        make_model("qwen2", len(tokenizer)), PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8)
    )
    trainer = SFTTrainer(
        model=model, args=_sft_config(tmp_path), train_dataset=language_modeling_dataset(), processing_class=tokenizer
    )
    assert trainer.sharing_session.virtual == virtual_module.VirtualTokens(virtual_module.EMBEDS, 8)
    assert _train(trainer)["mean_token_accuracy"] is not None


@pytest.mark.parametrize("peft_type", ["prompt_tuning", "prefix_tuning", "prompt_encoder"])
def test_train_with_peft_config_prompt_tuning(tmp_path, tokenizer, peft_type):
    """TRL's `test_train_with_peft_config_prompt_tuning` (p-tuning doesn't support gradient checkpointing)."""
    model = make_model("qwen2", len(tokenizer))
    trainer = SFTTrainer(
        model=model,
        args=_sft_config(tmp_path, gradient_checkpointing=False),
        train_dataset=language_modeling_dataset(),
        processing_class=tokenizer,
        peft_config=peft_config(peft_type, hidden_size=model.config.hidden_size),
    )
    base_param_names = {f"base_model.{n}" for n, _ in model.named_parameters()}
    previous = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert previous
    for n, param in previous.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # the base model's parameters are the same
            torch.testing.assert_close(param, new_param, msg=f"Parameter {n} has changed.")
        else:  # the PEFT parameters changed
            assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


# ----------------------------------------------------------------------------------------------- SFT against stock
def _capture_log_probs(trainer) -> list:
    """The per-token log-probs of every fused call of the trainer's (PEFT) model, in call order."""
    captured = []
    trainer.model.register_forward_hook(lambda module, args, output: captured.append(output.log_probs.detach()))
    return captured


def make_sft_trainers(tmp_path, tokenizer, kind, dataset=None, ours=None, model=None, **overrides):
    """(stock TRL's `SFTTrainer`, ours) from identical models with the PEFT config of `kind` (prefix tuning without
    gradient checkpointing, as in stock); `model`: a model given as is (a PEFT model, deep-copied)."""
    base = make_model("qwen2", len(tokenizer)) if model is None else model
    common = {
        "output_dir": str(tmp_path / f"run{random.randrange(10**9)}"),
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-3,
        "max_steps": 2,
        "gradient_checkpointing": kind != "prefix_tuning",
        **CPU_RUN,
        **overrides,
    }
    configs = (trl.SFTConfig(**common), SFTConfig(prefix_sharing=True, **(ours or {}), **common))
    return [
        cls(
            model=copy.deepcopy(base),
            args=args,
            train_dataset=dataset if dataset is not None else completions_dataset(),
            processing_class=tokenizer,
            peft_config=peft_config(kind) if model is None else None,
        )
        for cls, args in zip((trl.SFTTrainer, SFTTrainer), configs, strict=True)
    ]


def sft_step(trainer, examples):
    """TRL's loss, metrics, gradients and per-token log-probs of one batch (`num_items_in_batch` as the training
    loop counts it), and the batch."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer.current_gradient_accumulation_steps = 1
    captured = _capture_log_probs(trainer)
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=(batch["labels"][:, 1:] != -100).sum())
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    trainer.model._forward_hooks.clear()
    return loss.detach(), metrics, backward_grads(trainer.model, loss), batch, captured


def compare_sft(stock, shared):
    examples = [stock.train_dataset[i] for i in range(len(stock.train_dataset))]
    expected, got = sft_step(stock, examples), sft_step(shared, examples)
    assert_same_loss_metrics_grads(expected, got, min_metrics=3)
    assert any("prompt_encoder" in name for name in expected[2])  # the prompt encoder's gradients compared
    (stock_log_probs,), (log_probs,) = expected[4], got[4]
    assert stock_log_probs.numel() > 0 and (stock_log_probs != 0).any()
    torch.testing.assert_close(log_probs, stock_log_probs, atol=1e-5, rtol=1e-5)
    return expected, got


@pytest.mark.parametrize(
    "kind,ours",
    [
        ("prompt_tuning", {"prefix_sharing_attn_implementation": "sdpa"}),
        ("prompt_encoder", {"prefix_sharing_attn_implementation": "sdpa"}),
        ("prompt_encoder", {"prefix_sharing_attn_implementation": "varlen"}),
        ("prompt_encoder", {"prefix_sharing_join": "always"}),
        ("prefix_tuning", {"prefix_sharing_attn_implementation": "sdpa"}),
        ("prefix_tuning", {}),
    ],
)
def test_sft_matches_stock(tmp_path, tokenizer, kind, ours):
    stock, shared = make_sft_trainers(tmp_path, tokenizer, kind, ours=ours)
    expected, got = compare_sft(stock, shared)
    layout = got[3]["prefix_sharing"]
    width = expected[3]["input_ids"].shape[1]
    assert got[4][0].shape == (6, (0 if kind == "prefix_tuning" else N_VIRTUAL) + width - 1)  # PEFT's stock shape
    assert layout.virtual is not None and layout.virtual.count == N_VIRTUAL


def test_sft_given_a_peft_model_matches_stock(tmp_path, tokenizer):
    """The model given as `get_peft_model(model, PromptEncoderConfig(...))`: trains as stock does (it used to fail
    at its first step on the `inputs_embeds` PEFT passes)."""
    model = get_peft_model(make_model("qwen2", len(tokenizer)), peft_config("prompt_encoder"))
    compare_sft(*make_sft_trainers(tmp_path, tokenizer, "prompt_encoder", model=model))


def test_sft_training_and_evaluation_match_stock(tmp_path, tokenizer):
    stock, shared = make_sft_trainers(
        tmp_path, tokenizer, "prompt_encoder", dataset=language_modeling_dataset(), per_device_train_batch_size=4
    )
    stock.eval_dataset = shared.eval_dataset = stock.train_dataset
    logs = []
    for trainer in (stock, shared):
        torch.manual_seed(0)
        trainer.train()
        trainer.evaluate()
        trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        logs.append(([log for log in trainer.state.log_history if "loss" in log or "eval_loss" in log], trained))
    (expected, stock_weights), (got, weights) = logs
    assert len(expected) == len(got) >= 3
    for line, shared_line in zip(expected, got, strict=True):
        for key in ("loss", "eval_loss", "entropy", "eval_entropy", "mean_token_accuracy", "num_tokens"):
            if key in line:
                assert shared_line[key] == pytest.approx(line[key], rel=1e-5, abs=1e-6), key
    assert stock_weights and set(weights) == set(stock_weights)
    for name, value in stock_weights.items():
        torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- DPO against stock
@pytest.mark.parametrize("kind,given", [*((kind, "peft_config") for kind in KINDS), ("prompt_encoder", "model")])
def test_dpo_matches_stock(tmp_path, tokenizer, kind, given):
    """DPO with the adapter's reference (the adapter disabled: no virtual tokens, the plain layout); the adapter
    given as `peft_config`, or as a PEFT model given as `model`."""
    model = make_model("qwen2", len(tokenizer))
    stock, shared = make_trainers(
        tmp_path,
        tokenizer=tokenizer,
        family="qwen2",
        dataset=awkward_text_dataset(),
        ref_model=None,
        model=get_peft_model(model, peft_config(kind)) if given == "model" else model,
        peft_config=peft_config(kind) if given == "peft_config" else None,
        gradient_checkpointing=kind != "prefix_tuning",
    )
    examples = [stock.train_dataset[i] for i in range(len(stock.train_dataset))]
    results = []
    for trainer in (stock, shared):
        captured = _capture_log_probs(trainer)
        results.append((step(trainer, examples), captured))
        trainer.model._forward_hooks.clear()
    (expected, stock_calls), (got, calls) = results
    assert_same_step(expected, got)
    assert any("prompt_encoder" in name for name in expected["grads"])
    assert len(stock_calls) == len(calls) == 3  # the policy, then the reference twice
    width = expected["batch"]["input_ids"].shape[1] - 1
    assert stock_calls[0].shape == (16, width + (0 if kind == "prefix_tuning" else N_VIRTUAL))
    for stock_log_probs, log_probs in zip(stock_calls, calls, strict=True):
        assert stock_log_probs.numel() > 0 and (stock_log_probs != 0).any()
        torch.testing.assert_close(log_probs, stock_log_probs, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- computed once
def test_virtual_tokens_are_computed_once_per_micro_batch(tmp_path, tokenizer):
    """Every row starts alike after the virtual tokens here, so the shared rows hold each virtual token once (where
    rows part right after them, the last would start each branch again, as every shared prefix's last token does);
    `num_shared_tokens` counts those rows."""
    rows = [{"prompt": "w1 w2", "completion": f" w{3 + i}" * (1 + i)} for i in range(4)]
    stock, shared = make_sft_trainers(tmp_path, tokenizer, "prompt_tuning", dataset=Dataset.from_list(rows))
    _, got = compare_sft(stock, shared)
    layout, attention_mask = got[3]["prefix_sharing"], got[3]["attention_mask"]
    rooted = layout.virtual.layout
    ids = rooted.input_ids[rooted.document_ids >= 0]
    virtual_ids = virtual_module.VIRTUAL_KEY + torch.arange(N_VIRTUAL)
    assert [int((ids == key).sum()) for key in virtual_ids] == [1] * N_VIRTUAL
    assert rooted.input_ids.shape[0] == 1  # one document: the root on every path
    assert int(rooted.num_positions) == N_VIRTUAL + int(layout.num_positions)
    assert int(attention_mask.sum()) + 4 * N_VIRTUAL > int(rooted.num_positions)  # stock: the virtual tokens per row
    shared.train()  # two steps, each of a micro-batch of these 4 rows
    logged = [log["num_shared_tokens"] for log in shared.state.log_history if "loss" in log]
    assert logged[1] - logged[0] == int(rooted.num_positions)


def test_the_root_joins_every_row_whatever_the_join_rule():
    """Rows that share one leading token: no join rule joins them, a root of that token does (one document)."""
    ids = torch.tensor([[-9, 1, 2, 3, 7], [-9, 4, 5, 6, 0], [-9, 8, 9, 0, 0]])
    mask = (torch.arange(5) < torch.tensor([[5], [4], [3]])).long()
    prompts = torch.tensor([3, 3, 2])
    for join in ("prompts", "always"):
        assert int(plan_layout(StockRows(ids, mask, prompt_lengths=prompts), join).num_documents) == 3
        plan = plan_layout(StockRows(ids, mask, prompt_lengths=prompts, root=1), join)
        assert int(plan.num_documents) == 1


# ----------------------------------------------------------------------------------------------- can fail
def _hidden_from_later_rows(lay_out, session):
    """`VirtualTokens.lay_out` whose virtual tokens the later rows of the shared row do not see (one copy, not
    visible to every row)."""

    def wrong(self, layout, lay_out_rows):
        laid_out = lay_out(self, layout, lay_out_rows)
        rooted = laid_out.layout
        rooted.subtree_end[:, : self.count] = rooted.subtree_end[:, : self.count].clamp(
            max=rooted.input_ids.shape[1] // 2
        )
        rooted.attention = None
        session.with_attention(rooted)
        return laid_out

    return wrong


def _positions_not_offset(lay_out):
    """`VirtualTokens.lay_out` whose rows keep the tokens' stock columns as positions (not offset by the virtual
    tokens)."""

    def wrong(self, layout, lay_out_rows):
        laid_out = lay_out(self, layout, lay_out_rows)
        positions = laid_out.layout.position_ids
        if self.kind == virtual_module.CACHE:
            laid_out.layout.position_ids = layout.position_ids
        else:
            laid_out.layout.position_ids = torch.where(positions >= self.count, positions - self.count, positions)
        return laid_out

    return wrong


@pytest.mark.parametrize(
    "kind,variant",
    [("prompt_encoder", "hidden"), ("prompt_encoder", "positions"), ("prefix_tuning", "positions")],
)
def test_wrong_variants_differ_from_stock(tmp_path, tokenizer, monkeypatch, kind, variant):
    stock, shared = make_sft_trainers(tmp_path, tokenizer, kind, ours={"prefix_sharing_attn_implementation": "sdpa"})
    compare_sft(stock, shared)  # right as built
    lay_out = virtual_module.VirtualTokens.lay_out
    wrong = (
        _hidden_from_later_rows(lay_out, shared.sharing_session)
        if variant == "hidden"
        else _positions_not_offset(lay_out)
    )
    monkeypatch.setattr(virtual_module.VirtualTokens, "lay_out", wrong)
    with pytest.raises(AssertionError):
        compare_sft(stock, shared)


# ----------------------------------------------------------------------------------------------- what is refused
def _kto_dataset():
    return Dataset.from_list([{"prompt": "w1 w2", "completion": " w3", "label": i % 2 == 0} for i in range(4)])


def test_a_peft_model_given_to_a_trainer_that_does_not_lay_it_out_is_refused_before_training(tmp_path, tokenizer):
    model = get_peft_model(make_model("qwen2", len(tokenizer)), peft_config("prompt_encoder"))
    from trl_prefix_sharing import KTOConfig

    args = KTOConfig(output_dir=str(tmp_path), prefix_sharing=True, **CPU_RUN)
    with pytest.raises(ValueError, match=r"KTOTrainer with prefix sharing does not support prompt-learning PEFT"):
        KTOTrainer(model=model, args=args, train_dataset=_kto_dataset(), processing_class=tokenizer)


@pytest.mark.parametrize(
    "config,overrides,match",
    [
        (
            MultitaskPromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=2, num_tasks=2),
            {},
            "task id",
        ),
        (peft_config("prompt_tuning"), {"packing": True}, "Packing does not support prompt-learning PEFT"),
        (peft_config("prefix_tuning"), {"gradient_checkpointing": True}, "gradient_checkpointing=False"),
        (
            peft_config("prefix_tuning"),
            {"gradient_checkpointing": False, "prefix_sharing_attn_implementation": "varlen"},
            "dense mask",
        ),
    ],
)
def test_what_is_refused_is_a_clear_error_before_training(tmp_path, tokenizer, config, overrides, match):
    with pytest.raises(ValueError, match=match):
        DPOTrainer(
            model=make_model("qwen2", len(tokenizer)),
            args=dpo_args(tmp_path, True, **overrides),
            train_dataset=awkward_text_dataset(),
            processing_class=tokenizer,
            peft_config=config,
        )


def test_prefix_tuning_is_refused_with_sliding_windows(tmp_path, tokenizer):
    model = make_model("mistral", len(tokenizer), sliding_window=4)
    with pytest.raises(ValueError, match="sliding-window"):
        DPOTrainer(
            model=model,
            args=dpo_args(tmp_path, True, gradient_checkpointing=False),
            train_dataset=awkward_text_dataset(),
            processing_class=tokenizer,
            peft_config=peft_config("prefix_tuning"),
        )
