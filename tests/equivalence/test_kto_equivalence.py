"""KTO with prefix sharing against TRL's own `KTOTrainer`, in the same process, fp32 on the CPU: the policy and
reference log-probs, the `kl` term, the loss, every logged metric, the gradients and the weights after training, with
the policy's KL rows merged into its gradient pass and apart."""

from __future__ import annotations

import copy

import pytest
import torch
import trl
from datasets import Dataset

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing import KTOConfig, KTOTrainer
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    CPU_RUN,
    assert_same_loss_metrics_grads,
    assert_same_training,
    awkward_text_dataset,
    backward_grads,
    conversational_dataset,
    leaky_dpo_mask,
    train_and_evaluate,
)


def unpaired_dataset(conversational: bool = False) -> Dataset:
    """Desirable and undesirable rows mixed within each batch of 4, a prompt twice in one batch (from the paired
    corner cases: one-token prompt, identical and empty completions, a long prompt, a long completion)."""
    paired = (conversational_dataset() if conversational else awkward_text_dataset()).to_list()
    rows = []
    for i, pair in enumerate(paired):
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        if i % 2 == 0:  # the rejected answer right after, in the same batch
            rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return Dataset.from_list(rows)


def make_trainers(
    tmp_path,
    tokenizer,
    dataset,
    family="llama",
    peft_config=None,
    ours=None,
    config_kwargs=None,
    weights=torch.float32,
    **options,
):
    """(stock TRL trainer, ours with `prefix_sharing=True` and `ours`) from identical `weights`-dtype models."""
    model = make_model(family, len(tokenizer), seed=0, **(config_kwargs or {})).to(weights)
    ref = None if peft_config is not None else make_model(family, len(tokenizer), seed=1, **(config_kwargs or {}))
    ref = None if ref is None else ref.to(weights)
    fields = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-3,
        max_steps=2,
        **CPU_RUN,
    )
    fields.update(options)
    trainers = []
    for cls, config, extra in (
        (trl.KTOTrainer, trl.KTOConfig, {}),
        (KTOTrainer, KTOConfig, {"prefix_sharing": True, **(ours or {})}),
    ):
        trainers.append(
            cls(
                model=copy.deepcopy(model),
                ref_model=copy.deepcopy(ref),
                args=config(output_dir=str(tmp_path / f"run{len(trainers)}"), **extra, **fields),
                train_dataset=dataset,
                eval_dataset=dataset,
                processing_class=tokenizer,
                peft_config=copy.deepcopy(peft_config),
            )
        )
    return trainers


def kto_step(trainer, examples):
    """TRL's loss, metrics and gradients of one batch, and the reference log-probs of the same batch."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    loss = trainer.compute_loss(trainer.model, batch)
    grads = backward_grads(trainer.model, loss)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ref = trainer.compute_ref_log_probs(trainer.ref_model or trainer.model, batch)
    return loss.detach(), metrics, grads, ref


def assert_same_step(stock, shared, atol=1e-5, rtol=1e-5):
    """`kto_step` results equal: loss, metrics and gradients, and the reference log-probs."""
    assert_same_loss_metrics_grads(stock, shared, atol, rtol, min_metrics=8)
    ref = stock[3]
    for got, expected in zip(shared[3], ref, strict=True):
        if expected is not None:
            assert expected.numel() > 0
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)


def first_batch(trainer) -> list[dict]:
    """The first training batch as TRL's sequential sampler draws it (its KL completions were rotated within it)."""
    return [trainer.train_dataset[i] for i in range(trainer.args.per_device_train_batch_size)]


SETTINGS = {
    "kto-merged": ({"loss_type": "kto"}, {"prefix_sharing_merge_kl": True}),
    "kto-apart": ({"loss_type": "kto"}, {"prefix_sharing_merge_kl": False}),
    "kto-auto": ({"loss_type": "kto"}, {}),
    "apo-zero-unpaired": ({"loss_type": "apo_zero_unpaired"}, {}),
    "precomputed-reference": ({"precompute_ref_log_probs": True}, {"prefix_sharing_merge_kl": True}),
    "truncated": ({"max_length": 12}, {"prefix_sharing_merge_kl": True}),
    "weights": ({"desirable_weight": 1.5, "undesirable_weight": 0.5, "beta": 0.3}, {}),
    "pad-to-multiple-of-8": ({"pad_to_multiple_of": 8}, {"prefix_sharing_merge_kl": True}),
    "precomputed-reference-batch-size-3": (
        {"precompute_ref_log_probs": True, "precompute_ref_batch_size": 3},
        {"prefix_sharing_merge_kl": True},
    ),
}


def spy_precompute_batch_sizes(monkeypatch) -> list[int]:
    """The batch sizes of TRL's reference precomputations (one per dataset and trainer), recorded."""
    sizes = []
    precompute = trl.KTOTrainer._precompute_ref_logps

    def recording(self, dataset, name, batch_size):
        sizes.append(batch_size)
        return precompute(self, dataset, name, batch_size)

    monkeypatch.setattr(trl.KTOTrainer, "_precompute_ref_logps", recording)
    return sizes


def spy_layout_widths(monkeypatch) -> list[int]:
    """The widths of the shared rows of every layout built, recorded."""
    from trl_prefix_sharing.session import PrefixSharingSession as PrefixSharing

    widths = []
    layout = PrefixSharing.layout

    def recording(self, *args, **kwargs):
        result = layout(self, *args, **kwargs)
        widths.append(result.input_ids.shape[1])
        return result

    monkeypatch.setattr(PrefixSharing, "layout", recording)
    return widths


def assert_options_took_effect(options, stock, shared, batches, precompute_batch_sizes, layout_widths):
    """`pad_to_multiple_of`: stock's main and KL rows padded to a multiple wider than their longest row, every shared
    row width a multiple. `precompute_ref_log_probs`: the precomputed columns equal stock's, computed in batches of
    `precompute_ref_batch_size` (train and eval datasets, both trainers)."""
    multiple = options.get("pad_to_multiple_of")
    if multiple:
        for examples in batches:
            batch = stock.data_collator(examples)
            for prefix in ("", "KL_"):
                width = batch[f"{prefix}input_ids"].shape[1]
                assert width % multiple == 0 and batch[f"{prefix}attention_mask"].sum(1).max() < width, width
        assert layout_widths and all(width % multiple == 0 for width in layout_widths), layout_widths
    if options.get("precompute_ref_log_probs"):
        batch_size = options.get("precompute_ref_batch_size") or stock.args.per_device_train_batch_size
        assert precompute_batch_sizes == [batch_size] * 4, precompute_batch_sizes
        for column in ("ref_logps", "ref_KL_logps"):
            expected = torch.tensor(stock.train_dataset[column])
            assert expected.numel() == len(stock.train_dataset)
            torch.testing.assert_close(torch.tensor(shared.train_dataset[column]), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_batch_matches_stock(tmp_path, tokenizer, monkeypatch, setting):
    options, ours = SETTINGS[setting]
    precompute_batch_sizes = spy_precompute_batch_sizes(monkeypatch)
    stock, shared = make_trainers(tmp_path, tokenizer, unpaired_dataset(), ours=ours, **options)
    layout_widths = spy_layout_widths(monkeypatch)
    kls, batches = [], []
    for start in (0, 4):  # the first two batches
        examples = [shared.train_dataset[i] for i in range(start, start + 4)]
        expected = kto_step(stock, examples)
        assert_same_step(expected, kto_step(shared, examples))
        kls.append(expected[1]["kl"])
        batches.append(examples)
    if options.get("loss_type", "kto") == "kto":
        assert max(kls) > 0  # the `kl` term (clamped at 0) is compared where it is not the clamp
    assert_options_took_effect(options, stock, shared, batches, precompute_batch_sizes, layout_widths)


def count_backbone_calls(trainer) -> dict:
    """Calls of the models' backbones and the positions they computed (their `input_ids` elements)."""
    counts = {"calls": 0, "positions": 0}

    def hook(module, args, kwargs):
        counts["calls"] += 1
        counts["positions"] += kwargs["input_ids"].numel()

    for model in (trainer.model, trainer.ref_model):
        model.model.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


@pytest.mark.parametrize("merge", [True, False])
def test_passes_and_positions(tmp_path, tokenizer, merge):
    """Stock: four passes per step (policy KL, policy, reference KL, reference). Shared: the reference's two as one,
    and the policy's two as one when merged; fewer positions either way on long prompts."""
    prompt = " ".join(f"w{i}" for i in range(100, 160))
    rows = [{"prompt": prompt + f" w{i}", "completion": f" w{i} w{i + 1}", "label": i % 2 == 0} for i in range(4)]
    stock, shared = make_trainers(
        tmp_path, tokenizer, Dataset.from_list(rows), ours={"prefix_sharing_merge_kl": merge}
    )
    examples = first_batch(shared)
    counts = [count_backbone_calls(trainer) for trainer in (stock, shared)]
    for trainer in (stock, shared):
        batch = trainer._prepare_inputs(trainer.data_collator(examples))
        trainer.compute_loss(trainer.model, batch).backward()
    assert counts[0]["calls"] == 4 and counts[1]["calls"] == (2 if merge else 3)
    assert counts[1]["positions"] < (0.6 if merge else 0.8) * counts[0]["positions"], counts


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("merge", [True, False])
def test_conversational_matches_stock(tmp_path, tokenizer, family, merge):
    stock, shared = make_trainers(
        tmp_path,
        tokenizer,
        unpaired_dataset(conversational=True),
        family=family,
        ours={"prefix_sharing_merge_kl": merge},
    )
    examples = first_batch(shared)
    assert_same_step(kto_step(stock, examples), kto_step(shared, examples))


@pytest.mark.parametrize("merge", [True, False])
def test_wrong_mask_fails(tmp_path, tokenizer, monkeypatch, merge):
    stock, shared = make_trainers(tmp_path, tokenizer, unpaired_dataset(), ours={"prefix_sharing_merge_kl": merge})
    examples = first_batch(shared)
    expected = kto_step(stock, examples)
    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        assert_same_step(expected, kto_step(shared, examples))


@pytest.mark.parametrize(
    "setting",
    ["default", "gradient-checkpointing", "lora", "precomputed-reference", "sync-ref-model", "eager-attention"],
)
def test_training_matches_stock(tmp_path, tokenizer, setting):
    """Two steps and an evaluation: every logged number and the trained weights. `sync-ref-model`: the reference is
    mixed from the policy after every step (the second step and the evaluation score against new reference weights,
    the same in both runs). `eager-attention`: models loaded with eager attention, which stock runs; the shared passes
    run on SDPA (the shared mask's implementation on the CPU)."""
    options, peft_config = {}, None
    if setting == "gradient-checkpointing":  # the policy's KL rows in its recomputed gradient pass
        options.update(gradient_checkpointing=True, ours={"prefix_sharing_merge_kl": True})
    if setting == "precomputed-reference":
        options["precompute_ref_log_probs"] = True
    if setting == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        options["learning_rate"] = 1e-2
    if setting == "sync-ref-model":
        options.update(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    if setting == "eager-attention":
        options["config_kwargs"] = {"attn_implementation": "eager"}
    trainers = make_trainers(tmp_path, tokenizer, unpaired_dataset(), peft_config=peft_config, **options)
    initial_reference = reference_weights(trainers[0]) if setting == "sync-ref-model" else None
    stock, shared = (train_and_evaluate(trainer) for trainer in trainers)
    assert_same_training(stock, shared)
    if setting == "sync-ref-model":
        assert_reference_synced(*trainers, initial_reference)
    if setting == "eager-attention":
        assert trainers[0].model.config._attn_implementation == "eager"
        assert trainers[0].ref_model.config._attn_implementation == "eager"
        assert trainers[1].sharing_session.backend.name == "sdpa"


def reference_weights(trainer) -> dict:
    return {name: param.detach().clone() for name, param in trainer.ref_model.named_parameters()}


def assert_reference_synced(stock, shared, initial: dict) -> None:
    """The reference's weights moved away from `initial` (synced from the policy), and ours equal stock's."""
    stock_weights, shared_weights = reference_weights(stock), reference_weights(shared)
    assert any(not torch.equal(value, initial[name]) for name, value in stock_weights.items())
    for name, value in stock_weights.items():
        torch.testing.assert_close(shared_weights[name], value, atol=1e-5, rtol=1e-4)


def test_moe_router_loss_matches_stock(tmp_path, tokenizer):
    """A mixture-of-experts policy whose config asks for router logits: TRL adds the load-balancing loss of the main
    rows, so the policy's KL rows stay apart (`prefix_sharing_merge_kl=True` notwithstanding); the reference merges."""
    config_kwargs = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    stock, shared = make_trainers(
        tmp_path,
        tokenizer,
        unpaired_dataset(),
        family="mixtral",
        config_kwargs=config_kwargs,
        ours={"prefix_sharing_merge_kl": True},
    )
    assert shared.aux_loss_enabled
    examples = first_batch(shared)
    expected = kto_step(stock, examples)
    assert "aux_loss" in expected[1]
    assert_same_step(expected, kto_step(shared, examples))
