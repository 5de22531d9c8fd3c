"""Every supported architecture family gives stock TRL's numbers (DPO step and reward step, each measured variant);
every refused one is refused with its reason. The families and variants are the registry's
(trl_prefix_sharing/data/architectures.json, written by scripts/sweep_architectures.py)."""

import copy
import json

import pytest
import torch

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing import DPOTrainer, architectures
from trl_prefix_sharing.architectures import (
    _CHECKABLE_OUTCOMES,
    REFUSED,
    check_supported_model,
    registry,
    variant_configs,
    window_layout,
)
from trl_prefix_sharing.testing import make_config, make_model
from trl_prefix_sharing.testing.equivalence import (
    assert_same_reward_step,
    awkward_text_dataset,
    compare_step,
    family_config_kwargs,
    leaky_dpo_mask,
    make_reward_trainers,
    make_trainers,
    reward_step,
)


SUPPORTED = registry()["supported"]


def _covered_by_window(family, variant):
    """The default variant of a family whose window variant mixes full and sliding layers runs inside that variant
    (its full-attention layers take the default mask), so CI runs the window variant only."""
    if variant != "default" or "sliding_window" not in SUPPORTED[family]["variants"]:
        return False
    return window_layout(make_config(family, 8, **family_config_kwargs(family, "sliding_window")))[1]


#: the families TRL's own tests train (and the first four): every variant, DPO and reward
CORE = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "olmo3",
    "cohere2",
    "gpt_neox",
    "gpt_oss",
    "glm4_moe",
    "qwen3_moe",
    "smollm3",
    "deepseek_v3",
    "mixtral",
}
# CI budget: core families get DPO on every measured variant (less defaults covered above); every other supported
# family gets one DPO step on its richest variant (all of them were measured by scripts/sweep_architectures.py); every
# family with a sequence-classification head gets a reward step on its default (the reward forward reads the same
# mask; the window and MoE options are DPO's)
DPO_CASES = [
    (family, variant)
    for family, entry in SUPPORTED.items()
    for variant in entry["variants"]
    if (family in CORE and not _covered_by_window(family, variant))
    or (family not in CORE and variant == entry["variants"][-1])
]
REWARD_CASES = [(family, "default") for family, entry in SUPPORTED.items() if entry["reward"]]


def _dpo(tmp_path, tokenizer, family, variant):
    return make_trainers(
        tmp_path, family, awkward_text_dataset(), tokenizer, config_kwargs=family_config_kwargs(family, variant)
    )


#: gradient tolerances where float32 round-off measured above the default 1e-5: Gemma 4 scales its (tied) embeddings
#: by sqrt(hidden size), which scales the round-off of their gradient too. Measured on one 2-core Xeon (AVX-512):
#: 4 of 11,200 elements of `embed_tokens`' gradient (largest magnitude 1.59) differ by up to 1.5e-5 from stock's,
#: every other gradient within 1e-5 (an earlier CI machine passed at 1e-5: the round-off follows the CPU's kernels);
#: reordering stock's batch moves it by 5e-8. Log-probs, losses and metrics keep 1e-5.
GRAD_TOLERANCES = {"gemma4_unified_text": {"atol": 5e-5, "rtol": 1e-5}}


@pytest.mark.parametrize("family,variant", DPO_CASES)
def test_family_dpo_step_matches_stock(tmp_path, tokenizer, family, variant):
    stock, shared = _dpo(tmp_path, tokenizer, family, variant)
    stock_result, result = compare_step(stock, shared, grad_tolerances=GRAD_TOLERANCES.get(family))
    layout = result["batch"]["prefix_sharing"]
    assert (layout.document_ids >= 0).sum() < result["batch"]["attention_mask"].sum()  # something was shared
    if variant == "router_aux_loss":
        assert stock_result["metrics"]["aux_loss"] > 0  # compared with stock's by compare_step
    if variant == "sliding_window":
        window, _ = window_layout(shared.model.config)
        assert window is not None and int(layout.position_ids.max()) >= window  # the window cuts something


@pytest.mark.parametrize("family,variant", REWARD_CASES)
def test_family_reward_step_matches_stock(tmp_path, tokenizer, family, variant):
    stock, shared = make_reward_trainers(
        tmp_path, family, awkward_text_dataset(), tokenizer, config_kwargs=family_config_kwargs(family, variant)
    )
    examples = list(stock.train_dataset)
    stock_result, result = reward_step(stock, examples), reward_step(shared, examples)
    assert "prefix_sharing" in result["batch"]
    assert_same_reward_step(stock_result, result)


@pytest.mark.parametrize("family,variant", [("gemma2", "sliding_window"), ("gpt_oss", "default")])
def test_family_wrong_mask_fails(tmp_path, tokenizer, monkeypatch, family, variant):
    """Eager attention (softcapping, sinks) with the additive float mask: a leaky mask breaks the comparison."""
    stock, shared = _dpo(tmp_path, tokenizer, family, variant)
    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        compare_step(stock, shared)


def test_router_aux_loss_needs_the_stock_positions(tmp_path, tokenizer, monkeypatch):
    """The load-balancing loss over the shared rows (each prompt token once) is not stock's: gathering matters."""
    import trl_prefix_sharing.forward as forward_module

    stock, shared = _dpo(tmp_path, tokenizer, "mixtral", "router_aux_loss")

    def shared_rows_aux_loss(router_logits, layout, stock_attention_mask, text_config):
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        return load_balancing_loss_func(
            router_logits,
            text_config.num_experts,
            text_config.num_experts_per_tok,
            (layout.document_ids >= 0).long(),
        )

    monkeypatch.setattr(forward_module, "_stock_aux_loss", shared_rows_aux_loss)
    with pytest.raises(AssertionError, match="aux_loss|Tensor-likes"):
        compare_step(stock, shared)


@pytest.mark.parametrize("family", sorted(registry()["refused"]))
def test_refused_family_names_its_reason(family):
    """A family refused by a reason no batch can disprove, or by a measured difference, is refused with it, in a short
    error that ends with the way out; one the sweep could not settle (nothing measured, or only its tiny config failed)
    goes to the start-up check."""
    reason = REFUSED.get(family) or registry()["refused"][family]["reason"]
    config = type("Config", (), {"model_type": family})()  # the check reads the model type (and layer types)
    if family not in REFUSED and reason.startswith(_CHECKABLE_OUTCOMES):
        assert f"did not settle '{family}' ({reason})" in check_supported_model(config)
        return
    with pytest.raises(ValueError, match=f"support '{family}': ") as error:
        check_supported_model(config)
    message = str(error.value)
    if family in REFUSED:
        assert reason in message
    else:  # measured: the outcome, without the assertion's text
        assert f"measured on a tiny model of this type, {reason.removeprefix('measured: ')}." in message
    assert message.endswith("Train it with `prefix_sharing=False`.")
    assert len(message) < 400 and "scripts/" not in message and "not measured" not in message
    assert "measured" in registry()["refused"][family]  # the registry keeps what the sweep measured


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            {"layer_types": ["full_attention", "linear_attention"]},
            "never support 'llama': its linear-attention layers",
        ),
        ({"layer_types": ["conv", "full_attention"]}, "its short-convolution layers mix each token"),
        (
            {"layer_types": ["full_attention", "hybrid"]},
            r"its 'hybrid' layers are not attention, and may carry a state",
        ),
        ({"attention_chunk_size": 4}, "its chunked attention splits the row"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "its chunked attention splits the row"),
        ({"layer_types": ["indexed_attention", "full_attention"]}, "its sparse attention keeps the top-k keys"),
        ({"is_encoder_decoder": True}, "does not support 'llama': it is an encoder-decoder model"),
        (
            {"model_type": "not_a_model", "output_router_logits": True},
            r"cannot judge 'not_a_model' with the router's auxiliary loss \(`output_router_logits=True`\)",
        ),
    ],
)
def test_contract_refusals_without_a_registry_entry(overrides, match):
    config = make_config("llama", 32)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match) as error:
        check_supported_model(config)
    assert str(error.value).endswith("`prefix_sharing=False`.")


def test_position_wise_layer_types_are_not_refused():
    """`layer_types` entries that mix no tokens (MLP, MoE layers) are no reason to refuse a model."""
    config = make_config("llama", 32)
    config.layer_types = ["full_attention", "mlp", "moe"]
    assert check_supported_model(config) is None


def test_failed_router_variant_is_refused_with_its_outcome():
    """A measured type whose router's auxiliary loss was not equal to stock (Beam: stock TRL itself fails with it)
    refuses `output_router_logits=True` in words, without the error's text."""
    assert "router_aux_loss" in registry()["supported"]["beam"]["failed_variants"]
    with pytest.raises(
        ValueError,
        match=r"does not support 'beam' with the router's auxiliary loss \(`output_router_logits=True`\): measured on "
        r"a tiny model of this type, stock TRL itself fails in the DPO step\. Set `output_router_logits=False`",
    ):
        check_supported_model(make_config("beam", 32, output_router_logits=True))


def test_docs_table_is_the_registry(load_script):
    """docs/architectures.md's generated section is what `scripts/sweep_architectures.py --docs-only` writes from the
    registry, and the registry's reasons are those of `REFUSED` (regenerated after a reason changes)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    sweep = load_script("sweep_architectures")
    for family, entry in registry()["refused"].items():
        assert entry["reason"] == (REFUSED.get(family) or sweep._measured_reason(entry["measured"])), family
    text = (root / "docs" / "architectures.md").read_text()
    assert text.count(sweep.BEGIN) == 1 and text.count(sweep.END) == 1
    generated = text[text.index(sweep.BEGIN) : text.index(sweep.END) + len(sweep.END)]
    assert generated == sweep.docs_table(registry()), "run scripts/sweep_architectures.py --docs-only"


def _sliding_layers(family):
    """`family`'s tiny config with a window of 6 on its first layer (full attention on the others)."""
    layer_types = ["sliding_attention"] + ["full_attention"] * (make_config(family, 8).num_hidden_layers - 1)
    return make_config(family, 8, sliding_window=6, layer_types=layer_types)


def test_unmeasured_window_goes_to_the_start_up_check():
    """A family measured without a window sends a config whose layers slide to the start-up check (the registry as it
    is): the supported families whose config has a window option but no measured window variant (the sweep found
    their tiny config's layer types slide nowhere)."""
    unmeasured = [
        f
        for f, e in SUPPORTED.items()
        if "sliding_window" not in e["variants"]
        and "sliding_window" not in e.get("failed_variants", {})
        and "sliding_window" in variant_configs(make_config(f, 8))
    ]
    assert unmeasured  # the loop below must run (if the registry measures every window, construct the case instead)
    for family in unmeasured:
        assert check_supported_model(make_config(family, 8)) is None  # measured without a window: allowed
        config = _sliding_layers(family)
        assert window_layout(config) == (6, True)
        assert check_supported_model(config) == (
            f"'{family}' is measured without a sliding window only; this config sets `sliding_window=6`"
        )


def test_failed_window_variant_is_refused_with_its_outcome(monkeypatch):
    """A family whose window variant was measured and differed (a registry copy with Mistral's window variant moved to
    `failed_variants`) refuses a config with a window and names the measured outcome; the real entry allows it."""
    config = make_config("mistral", 8, sliding_window=6)
    assert window_layout(config) == (6, False)
    check_supported_model(config)  # measured with a window: allowed
    patched = copy.deepcopy(registry())
    entry = patched["supported"]["mistral"]
    entry["variants"].remove("sliding_window")
    entry["failed_variants"] = {"sliding_window": {"dpo": "differs: chosen logps 0.1", "reward": None}}
    monkeypatch.setattr(architectures, "registry", lambda: patched)
    with pytest.raises(
        ValueError,
        match=r"does not support 'mistral' with a sliding window \(`sliding_window=6`\): measured on a tiny model of "
        r"this type, the prefix-shared DPO step differs from stock\. Train it without the window",
    ):
        check_supported_model(config)


def test_trust_remote_code_subclass_of_a_supported_type(tmp_path, tokenizer):
    """A remote-code Llama subclass (local module saved next to its config, nothing downloaded) whose config declares
    `model_type: llama` trains with prefix sharing and gives stock's numbers."""
    root = tmp_path / "remote_llama"
    make_model("llama", len(tokenizer)).save_pretrained(root)
    (root / "configuration_custom_llama.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass CustomLlamaConfig(LlamaConfig):\n    model_type = 'llama'\n"
    )
    (root / "modeling_custom_llama.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom_llama import CustomLlamaConfig\n\n\n"
        "class CustomLlamaForCausalLM(LlamaForCausalLM):\n    config_class = CustomLlamaConfig\n"
    )
    config = json.loads((root / "config.json").read_text())
    config["architectures"] = ["CustomLlamaForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "configuration_custom_llama.CustomLlamaConfig",
        "AutoModelForCausalLM": "modeling_custom_llama.CustomLlamaForCausalLM",
    }
    (root / "config.json").write_text(json.dumps(config))
    stock, shared = make_trainers(
        tmp_path, "llama", awkward_text_dataset(), tokenizer, model=str(root), ref_model=None, trust_remote_code=True
    )
    assert type(shared.model).__name__ == "CustomLlamaForCausalLM"
    assert type(shared.model).__module__ != "transformers.models.llama.modeling_llama"
    compare_step(stock, shared)


@pytest.mark.parametrize(
    "family,variant",
    [("gemma2", "sliding_window"), ("phi3", "sliding_window"), ("gpt_neox", "default"), ("qwen3_moe", "default")],
)
def test_flex_attention_forward_matches_stock(tmp_path, tokenizer, family, variant):
    """FlexAttention (CUDA's default) with the BlockMask through transformers' flex path, forward on CPU."""
    if family not in SUPPORTED or variant not in SUPPORTED[family]["variants"]:
        pytest.skip(f"{family} {variant} is not in the registry")
    stock, shared = _dpo(tmp_path, tokenizer, family, variant)
    shared.sharing_session.backend = attention_module.BACKENDS["flex_attention"]
    shared.model.set_attn_implementation("flex_attention")
    examples = list(stock.train_dataset)
    results = []
    for trainer in (stock, shared):
        batch = trainer._prepare_inputs(trainer.data_collator(examples))
        with torch.no_grad():
            results.append(trainer.compute_ref_log_probs(trainer.model, batch))
    for expected, got in zip(*results, strict=True):
        assert expected.numel() > 0
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_unsupported_architecture_error_names_the_reason(tmp_path, tokenizer):
    from transformers import MambaConfig, MambaForCausalLM

    from trl_prefix_sharing.testing.equivalence import dpo_args

    model = MambaForCausalLM(MambaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"never support 'mamba': its Mamba \(state-space\) layers carry a state"):
        DPOTrainer(
            model=model,
            args=dpo_args(tmp_path, True),
            train_dataset=awkward_text_dataset(),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize(
    "supports,requested,expected",
    [
        ({"_supports_flex_attn": True, "_supports_sdpa": True}, "flex_attention", "flex_attention"),
        ({"_supports_flex_attn": False, "_supports_sdpa": True}, "flex_attention", "sdpa"),
        ({"_supports_flex_attn": False, "_supports_sdpa": False}, "flex_attention", "eager"),
        ({"_supports_flex_attn": True, "_supports_sdpa": False}, "sdpa", "eager"),  # softcapping, sinks
    ],
)
def test_attention_implementation_per_model_class_is_logged(supports, requested, expected):
    """The one place that decides the kernel: a class that does not support the request falls back, with a warning."""
    from types import SimpleNamespace

    from transformers.testing_utils import CaptureLogger

    model = type("SomeModel", (), {**supports, "config": SimpleNamespace()})()
    assert attention_module._supported(attention_module.BACKENDS[requested], model).name == expected
    with CaptureLogger(attention_module.logger) as captured:
        chosen = attention_module.choose_backend([model], requested, torch.device("cuda"), torch.bfloat16)
    assert chosen.name == expected
    assert (f"run on `{expected}`" in captured.out and f"not {requested}: SomeModel" in captured.out) == (
        expected != requested
    )
