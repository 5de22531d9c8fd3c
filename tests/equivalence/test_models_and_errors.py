"""Sliding-window models, what a saved model keeps, and clear errors for what prefix sharing cannot do."""

import json
import logging
import re
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers.testing_utils import CaptureLogger

from trl_prefix_sharing import DPOConfig, DPOTrainer
from trl_prefix_sharing.attention import BACKENDS, AttentionSwitch, choose_backend
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import awkward_text_dataset, compare_step, dpo_args, make_trainers


@pytest.mark.parametrize(
    "family,config_kwargs",
    [
        ("mistral", {"sliding_window": 6}),  # every layer slides
        ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),  # full + sliding
        ("qwen3", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    ],
)
def test_sliding_window_models_match_stock(tmp_path, tokenizer, family, config_kwargs):
    stock, shared = make_trainers(tmp_path, family, awkward_text_dataset(), tokenizer, config_kwargs=config_kwargs)
    compare_step(stock, shared)


def test_saved_model_has_no_prefix_sharing_trace(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered = set(ALL_ATTENTION_FUNCTIONS.valid_keys())
    _, shared = make_trainers(tmp_path, "qwen3", awkward_text_dataset(), tokenizer, max_steps=1)
    shared.train()
    assert set(ALL_ATTENTION_FUNCTIONS.valid_keys()) == registered  # no attention name of ours, so none to save
    out = tmp_path / "saved"
    shared.save_model(str(out))
    config = json.loads((out / "config.json").read_text())
    assert not any("attn" in key for key in config), config.keys()
    assert "prefix" not in json.dumps(config)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(reloaded(ids).logits, shared.model(input_ids=ids).logits)  # plain forward unchanged


def test_attention_switch_is_scoped_and_reversible(tokenizer):
    model = make_model("llama", len(tokenizer))
    other = make_model("llama", len(tokenizer))
    switch = AttentionSwitch()
    switch.apply(model, "flex_attention")
    assert model.config._attn_implementation == "flex_attention"
    assert other.config._attn_implementation == "sdpa"
    assert make_model("llama", len(tokenizer)).config._attn_implementation == "sdpa"
    switch.restore()
    assert model.config._attn_implementation == "sdpa"


def test_remove_prefix_sharing_restores_forward(tmp_path, tokenizer):
    _, shared = make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer)
    policy = shared.model
    shared.sharing_session.attach()  # as within `train()`
    assert "_prefix_sharing_original_forward" in policy.__dict__
    shared.remove_prefix_sharing()
    assert "_prefix_sharing_original_forward" not in policy.__dict__
    assert not shared.prefix_sharing and shared.args.prefix_sharing  # the config is left as the user gave it
    batch = shared.data_collator([shared.train_dataset[0]])
    assert "prefix_sharing" not in batch


@pytest.mark.parametrize(
    "family,config_kwargs",
    [
        ("llama", {}),
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        ),  # a BlockMask per layer type
    ],
)
def test_flex_attention_through_the_model_matches_stock(tmp_path, tokenizer, family, config_kwargs):
    """CUDA's default path, FlexAttention with the BlockMask through transformers' own `flex_attention`, runs forward
    on CPU too (no backward there): the prefix-shared log-probs through it equal stock TRL's."""
    from torch.nn.attention.flex_attention import BlockMask

    stock, shared = make_trainers(tmp_path, family, awkward_text_dataset(), tokenizer, config_kwargs=config_kwargs)
    shared.sharing_session.backend = BACKENDS["flex_attention"]
    shared.data_collator.tuning = None  # the session's one backend lays out every batch
    shared.model.set_attn_implementation("flex_attention")
    examples = [stock.train_dataset[i] for i in range(len(stock.train_dataset))]
    results = []
    for trainer in (stock, shared):
        batch = trainer._prepare_inputs(trainer.data_collator(examples))
        with torch.no_grad():
            results.append(trainer.compute_ref_log_probs(trainer.model, batch))
    masks = batch["prefix_sharing"].attention.mask
    masks = masks.values() if isinstance(masks, dict) else [masks]
    assert all(isinstance(mask, BlockMask) for mask in masks)
    for expected, got in zip(*results, strict=True):
        assert expected.numel() > 0
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_flex_attention_on_cpu_is_a_clear_error(tokenizer):
    model = make_model("llama", len(tokenizer))
    with pytest.raises(ValueError, match="no backward pass on cpu"):
        choose_backend([model], "flex_attention", torch.device("cpu"), torch.float32)
    assert choose_backend([model], "auto", torch.device("cpu"), torch.float32).name == "sdpa"
    with pytest.raises(ValueError, match="must be one of"):
        choose_backend([model], "eager", torch.device("cpu"), torch.float32)


def test_unsupported_architecture_is_a_clear_error(tmp_path, tokenizer):
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="'bloom'.*ALiBi"):
        DPOTrainer(
            model=model,
            args=dpo_args(tmp_path, True),
            train_dataset=awkward_text_dataset(),
            processing_class=tokenizer,
        )


#: what each family's refusal must say (checked on configs built offline), and what it must not
FAMILY_ERRORS = {
    "t5": r"does not support 't5': it is an encoder-decoder model, .* one encoder pass per prompt, which this package",
    "bart": r"does not support 'bart': it is an encoder-decoder model",
    "bert": r"can never support 'bert': it is an encoder model, .* \(an encoder attends both ways",
    "mamba": r"can never support 'mamba': its Mamba \(state-space\) layers carry a state along the sequence",
    "mamba2": r"can never support 'mamba2': its Mamba-2 \(state-space\) layers carry a state",
    "rwkv": r"can never support 'rwkv': its RWKV \(recurrent\) layers carry a state",
    "jamba": r"can never support 'jamba': its Mamba \(state-space\) layers carry a state",
    "qwen3_next": r"can never support 'qwen3_next': its Gated DeltaNet \(linear attention\) layers carry a state",
    "lfm2": r"can never support 'lfm2': its short-convolution layers mix each token with the few before it",
    "bloom": r"can never support 'bloom': its ALiBi attention biases are computed from places in the row",
    "llama4": r"can never support 'llama4': its chunked attention splits the row into chunks",
    "llava": r"supports the vision-language model types qwen2_vl, qwen2_5_vl, qwen3_vl; this model is 'llava'",
    "gpt_bigcode": r"does not support 'gpt_bigcode': measured on a tiny model of this type, the prefix-shared DPO "
    r"step differs from stock\.",
}


@pytest.mark.parametrize("model_type", sorted(FAMILY_ERRORS))
def test_refusals_say_why_for_the_family(model_type):
    """Each family is refused with its own reason, in two or three sentences that end with the way out, and without
    lists of model types or the repository's scripts (a pip user has neither)."""
    from transformers import AutoConfig

    from trl_prefix_sharing.support import check_architecture

    with pytest.raises(ValueError, match=FAMILY_ERRORS[model_type]) as error:
        check_architecture(AutoConfig.for_model(model_type), "DPOTrainer", supports_vision=True)
    message = str(error.value)
    assert message.endswith("Train it with `prefix_sharing=False`.")
    assert len(re.findall(r"[.!?](?: |$)", message)) <= 3, message
    assert len(message) < 400 and "scripts/" not in message and "#" not in message and "not measured" not in message


def test_unknown_decoder_goes_to_the_start_up_check():
    """A decoder of a model type the registry does not know (custom code) is not refused: the start-up check judges it
    at the first batch, which is said at construction, with the way out. Custom code that declares a measured type is
    trusted as that type, and told how to have it checked."""
    from trl_prefix_sharing import support as sharing
    from trl_prefix_sharing.testing.custom_models import custom_config

    model = SimpleNamespace(config=custom_config("ps_plain_decoder", 32))
    assert sharing.check_architecture(model.config, "DPOTrainer", True) == (
        "the model type 'ps_plain_decoder' is not in the measured registry"
    )
    remote_llama = SimpleNamespace(config=make_model("llama", 32).config)
    remote_llama.config.auto_map = {"AutoModelForCausalLM": "modeling_custom_llama.CustomLlamaForCausalLM"}
    level = sharing.logger.level
    sharing.logger.setLevel(logging.INFO)
    try:
        with CaptureLogger(sharing.logger) as captured:
            sharing.check_model_and_processor("DPOTrainer", model, None, None, False, True)
        with CaptureLogger(sharing.logger) as remote:
            sharing.check_model_and_processor("DPOTrainer", remote_llama, None, None, False, True)
    finally:
        sharing.logger.setLevel(level)
    assert (
        "'ps_plain_decoder' is not in the measured registry, so the start-up check will judge the model at its "
        "first batch" in captured.out
    )
    assert "`prefix_sharing=False`" in captured.out
    assert 'trusted as that type. Set `prefix_sharing_model_check="always"`' in remote.out


def test_padding_free_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="padding_free"):
        DPOConfig(output_dir=str(tmp_path), prefix_sharing=True, padding_free=True, bf16=False, use_cpu=True)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"prompt": "w1", "chosen": " w2"}], "needs 'chosen' and 'rejected'"),
        ([{"prompt": "w1", "chosen": " w2", "rejected": " w3", "image": None}], "vision"),
    ],
)
def test_bad_datasets_are_clear_errors(tmp_path, tokenizer, rows, match):
    model = make_model("llama", len(tokenizer))
    with pytest.raises(ValueError, match=match):
        DPOTrainer(
            model=model,
            args=dpo_args(tmp_path, True),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )


def test_empty_prompt_is_exact_and_documented(tmp_path, tokenizer):
    """An empty prompt gives no shared prefix: the pair runs as two sequences in one row, with stock's numbers."""
    rows = [
        {"prompt": "", "chosen": " w1 w2", "rejected": " w3"},
        {"prompt": "", "chosen": " w4", "rejected": " w4 w5"},
    ]
    stock, shared = make_trainers(tmp_path, "llama", Dataset.from_list(rows), tokenizer)
    compare_step(stock, shared)


def test_prompt_learning_peft_is_a_clear_error_where_it_is_not_laid_out(tmp_path, tokenizer):
    """Prompt tuning, P-tuning and prefix tuning are laid out for SFT and DPO (`test_prompt_learning.py`); the
    reward trainer refuses them before anything is built, naming the cause and the way out."""
    from peft import PromptTuningConfig

    from trl_prefix_sharing import RewardTrainer
    from trl_prefix_sharing.testing.equivalence import make_reward_model, reward_args

    with pytest.raises(ValueError, match="RewardTrainer with prefix sharing does not support prompt-learning PEFT"):
        RewardTrainer(
            model=make_reward_model("llama", tokenizer),
            args=reward_args(tmp_path, {"prefix_sharing": True}),
            train_dataset=awkward_text_dataset(),
            processing_class=tokenizer,
            peft_config=PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=2),
        )


def test_custom_collator_that_changes_the_batch_is_refused(tmp_path, tokenizer):
    from trl_prefix_sharing.forward import check_layout_matches

    _, shared = make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer)
    batch = shared.data_collator([shared.train_dataset[i] for i in range(2)])
    tampered = batch["input_ids"].clone()
    tampered[0, 0] += 1
    with pytest.raises(RuntimeError, match="does not hold the stock batch"):
        check_layout_matches(batch["prefix_sharing"], tampered, batch["attention_mask"])
