"""TRL options that change the forward, the batch or the loss's inputs, and that prefix sharing cannot give stock's
numbers with: each refused before anything is built, with the option and the way out in one message. Liger's layer
kernels (the only part of `use_liger_kernel` TRL's DPO, KTO, GRPO and RLOO apply) compose with the shared forward;
a patch that replaces the forward at the start of training is refused there. The full table: docs/options.md."""

from __future__ import annotations

import types

import pytest
import torch
import transformers
from accelerate.parallelism_config import ParallelismConfig

import trl_prefix_sharing as tps
from trl_prefix_sharing.attention import GENERATION_METHODS, AttentionSwitch
from trl_prefix_sharing.forward import _take_stock_inputs
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    assert_same_training,
    awkward_text_dataset,
    make_trainers,
    train_and_evaluate,
)


CONFIGS = {
    "dpo": tps.DPOConfig,
    "reward": tps.RewardConfig,
    "grpo": tps.GRPOConfig,
    "rloo": tps.RLOOConfig,
    "online_dpo": tps.OnlineDPOConfig,
    "kto": tps.KTOConfig,
    "orpo": tps.ORPOConfig,
    "cpo": tps.CPOConfig,
}
#: the trainers whose TRL code keeps Liger's forward-replacing fused loss off
LIGER_LAYER_KERNELS_ONLY = {"dpo", "kto", "grpo", "rloo"}

REFUSED = {
    "context parallel": ({"parallelism_config": ParallelismConfig(cp_size=2)}, r"context or sequence parallelism"),
    "sequence parallel": ({"parallelism_config": ParallelismConfig(sp_size=2)}, r"`cp_size=1` and `sp_size=1`"),
    "tensor parallel": ({"parallelism_config": ParallelismConfig(tp_size=2)}, r"tensor parallelism .* `tp_size=1`"),
    "neftune": ({"neftune_noise_alpha": 5.0}, r"`neftune_noise_alpha`: NEFTune"),
    "torch_compile": ({"torch_compile": True}, r"`torch_compile=True` \(the whole model compiled\)"),
}


def _config(kind, tmp_path, **options):
    return CONFIGS[kind](output_dir=str(tmp_path), use_cpu=True, report_to="none", prefix_sharing=True, **options)


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("option", list(REFUSED))
def test_options_that_cannot_give_stocks_numbers_are_refused(tmp_path, kind, option):
    options, message = REFUSED[option]
    if option in ("context parallel", "sequence parallel") and kind in ("grpo", "rloo"):
        message = r"does not support sequence-dim parallelism"  # TRL's own refusal comes first
    with pytest.raises(ValueError, match=message):
        _config(kind, tmp_path, **options)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_liger_is_refused_where_it_replaces_the_forward(tmp_path, kind):
    if kind in LIGER_LAYER_KERNELS_ONLY:
        assert _config(kind, tmp_path, use_liger_kernel=True).use_liger_kernel
        return
    with pytest.raises(ValueError, match=r"`use_liger_kernel=True` in this trainer: .* replaces the model's forward"):
        _config(kind, tmp_path, use_liger_kernel=True)


def _layer_kernels(model, kernel_config):
    """A stand-in for Liger's layer kernels (what TRL's DPO applies): each RMSNorm module's forward replaced on the
    instance, by a function computing the same."""
    assert not kernel_config.get("fused_linear_cross_entropy", True)  # TRL turned the forward replacement off
    patched = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(type(module).forward, module)
            patched += 1
    assert patched


def _replaced_forward(model, kernel_config):
    """A stand-in for a kernel patch that replaces the model's own forward (Liger's fused cross-entropy)."""
    model.forward = types.MethodType(type(model).forward, model)


def test_liger_layer_kernels_compose_with_sharing(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", _layer_kernels)
    data = awkward_text_dataset()
    stock, shared = make_trainers(
        tmp_path, "llama", data, tokenizer, eval_dataset=data, use_liger_kernel=True, max_steps=2, learning_rate=1e-3
    )
    shared_run = train_and_evaluate(shared)
    assert shared.state.log_history[0]["num_shared_tokens"] < shared.state.log_history[0]["num_tokens"]
    assert_same_training(train_and_evaluate(stock), shared_run, ours_only=("num_shared_tokens",))


def test_a_forward_replaced_at_the_start_of_training_is_refused(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", _replaced_forward)
    _, shared = make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer, use_liger_kernel=True)
    with pytest.raises(RuntimeError, match=r"no longer in place \(`use_liger_kernel=True`: transformers applies"):
        shared.train()
    assert not shared.sharing_session.attached  # the patches taken off on the way out


@pytest.mark.parametrize("name", ["cache", "past_key_values", "inputs_embeds", "position_ids"])
def test_inputs_the_layout_replaces_are_refused_beside_it(name):
    from types import SimpleNamespace

    layout = SimpleNamespace(virtual=None, input_ids=torch.zeros(1, 1, dtype=torch.long))  # no virtual tokens
    replaced = ("inputs_embeds", "position_ids", "past_key_values", "cache")
    with pytest.raises(ValueError, match=f"`{name}` cannot be passed alongside the layout"):
        _take_stock_inputs({name: torch.zeros(1)}, layout, replaced)


def test_active_dropout_is_refused(tmp_path, tokenizer):
    model = make_model("llama", len(tokenizer), attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"dropout active in the model \(`model.layers.0.self_attn.attention_dropout"):
        make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer, model=model)


def test_generation_methods_run_on_the_models_own_attention(tokenizer, monkeypatch):
    """`generate` and `generate_batch` (TRL's `use_transformers_continuous_batching`) sample on the model's own
    attention while the shared passes run on the switched one, as in stock TRL."""
    seen = []
    model = make_model("llama", len(tokenizer), attn_implementation="eager")
    for name in GENERATION_METHODS:

        def record(self, *args, _name=name, **kwargs):
            seen.append((_name, self.config._attn_implementation))

        monkeypatch.setattr(type(model), name, record)
    switch = AttentionSwitch()
    switch.apply(model, "sdpa")
    assert model.config._attn_implementation == "sdpa"
    model.generate()
    model.generate_batch()
    assert seen == [("generate", "eager"), ("generate_batch", "eager")]
    assert model.config._attn_implementation == "sdpa"
    switch.restore()
    assert model.config._attn_implementation == "eager" and not set(GENERATION_METHODS) & set(model.__dict__)
