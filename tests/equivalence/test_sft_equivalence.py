"""SFT with prefix sharing against stock TRL's `SFTTrainer`, on the same micro-batches: several completions per prompt
(`completion_only_loss` on and off), conversational `messages` (with `assistant_only_loss`), plain text after a shared
preamble; every join rule; the loss, the gradients and every metric SFT logs (`entropy`, `mean_token_accuracy`,
`num_tokens`) equal; a mask that lets one row see another fails; TRL's own packing and padding-free refused."""

import copy
import random

import pytest
import torch
import trl
from datasets import Dataset

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing import SFTConfig, SFTTrainer
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    CPU_RUN,
    assert_grouped_by_prompt,
    assert_same_loss_metrics_grads,
    assert_same_training,
    backward_grads,
    leaky_dpo_mask,
    train_and_evaluate,
)


PREAMBLE = " ".join(f"w{i}" for i in range(120, 140))  # 20 words several examples start with
#: the tiny chat template with TRL's generation markers around the assistant's turns (`assistant_only_loss`)
GENERATION_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> "
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }} <|end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }} <|end|>{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


ALWAYS = {"prefix_sharing_join": "always"}


def _words(rng, n):
    return " ".join(f"w{rng.randrange(80)}" for _ in range(n))


def completions_dataset(prompts=2, per_prompt=4, seed=0) -> Dataset:
    """Several completions of each prompt (rejection sampling, best-of-n): identical completions, a one-word prompt."""
    rng = random.Random(seed)
    rows = []
    for p in range(prompts):
        prompt = "w7" if p == 1 else f"{PREAMBLE} {_words(rng, rng.randrange(3, 9))}"
        completions = [" " + _words(rng, rng.randrange(1, 6)) for _ in range(per_prompt)]
        completions[-1] = completions[0]  # an identical completion
        rows += [{"prompt": prompt, "completion": c} for c in completions]
    return Dataset.from_list(rows)


def messages_dataset(n=8, seed=1) -> Dataset:
    """Conversations after one system prompt, some of two turns."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": PREAMBLE}]
        for _ in range(1 + i % 2):
            messages += [
                {"role": "user", "content": _words(rng, rng.randrange(2, 7))},
                {"role": "assistant", "content": _words(rng, rng.randrange(1, 6))},
            ]
        rows.append({"messages": messages})
    return Dataset.from_list(rows)


def text_dataset(n=8, seed=2) -> Dataset:
    """Plain text, most of it after one preamble (every token trained)."""
    rng = random.Random(seed)
    return Dataset.from_list(
        [{"text": (f"{PREAMBLE} " if i % 4 else "") + _words(rng, rng.randrange(2, 12))} for i in range(n)]
    )


DATASETS = {"completions": completions_dataset, "messages": messages_dataset, "text": text_dataset}


def sft_args(tmp_path, ours: dict | None, **overrides):
    kwargs = {
        "output_dir": str(tmp_path / f"run{random.randrange(10**9)}"),
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "learning_rate": 1e-3,
        "max_steps": 2,
        **CPU_RUN,
        **overrides,  # may override `CPU_RUN` (bf16, use_cpu)
    }
    if ours is None:
        return trl.SFTConfig(**kwargs)
    return SFTConfig(**{"prefix_sharing": True, **ours}, **kwargs)


def make_sft_trainers(
    tmp_path, tokenizer, dataset, family="llama", ours=None, config_kwargs=None, weights=torch.float32, **overrides
):
    """(stock TRL's `SFTTrainer`, ours) from identical models in `weights`' dtype; `ours`: our config's own fields."""
    model = make_model(family, len(tokenizer), seed=0, **(config_kwargs or {})).to(weights)
    return [
        cls(
            model=copy.deepcopy(model),
            args=sft_args(tmp_path, options, **overrides),
            train_dataset=dataset,
            eval_dataset=dataset,
            processing_class=tokenizer,
        )
        for cls, options in ((trl.SFTTrainer, None), (SFTTrainer, ours or {}))
    ]


def sft_step(trainer, examples):
    """TRL's loss, metrics and gradients of one batch (`num_items_in_batch` as the training loop counts it)."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this step does not run
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    items = (batch["labels"][:, 1:] != -100).sum()
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=items)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), metrics, backward_grads(trainer.model, loss), batch


def compare(tmp_path, tokenizer, dataset, ours=None, family="llama", config_kwargs=None, **overrides):
    stock, shared = make_sft_trainers(
        tmp_path, tokenizer, dataset, family=family, ours=ours, config_kwargs=config_kwargs, **overrides
    )
    examples = [stock.train_dataset[i] for i in range(len(stock.train_dataset))]
    expected, got = sft_step(stock, examples), sft_step(shared, examples)
    assert_same_loss_metrics_grads(expected, got, min_metrics=3)
    layout = got[3]["prefix_sharing"]
    stock_positions = expected[3]["attention_mask"].numel()
    assert layout.input_ids.numel() < stock_positions, (layout.input_ids.shape, expected[3]["input_ids"].shape)
    return stock, shared, expected, got


@pytest.mark.parametrize("join", ["auto", "prompts", "always"])
@pytest.mark.parametrize("completion_only_loss", [True, False])
def test_several_completions_per_prompt(tmp_path, tokenizer, join, completion_only_loss):
    _, _, _, got = compare(
        tmp_path,
        tokenizer,
        completions_dataset(),
        ours={"prefix_sharing_join": join},
        completion_only_loss=completion_only_loss,
    )
    layout = got[3]["prefix_sharing"]
    if join == "always":
        assert layout.join == "always" and layout.input_ids.shape[0] < 8


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("data", ["messages", "text"])
def test_conversations_and_text_after_a_shared_preamble(tmp_path, tokenizer, family, data):
    _, _, _, got = compare(tmp_path, tokenizer, DATASETS[data](), family=family, ours=ALWAYS)
    assert got[3]["prefix_sharing"].input_ids.shape[0] < 8  # the preamble's rows joined


def test_assistant_only_loss(tmp_path, tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = GENERATION_TEMPLATE
    _, _, expected, _ = compare(tmp_path, tokenizer, messages_dataset(), assistant_only_loss=True)
    labels = expected[3]["labels"]
    assert ((labels == -100) & (expected[3]["attention_mask"] == 1)).any()  # the system and user turns untrained


OPTIONS = {
    "dft": {"loss_type": "dft"},
    "truncated": {"max_length": 14},
    "truncated-keep-end": {"max_length": 14, "truncation_mode": "keep_end"},
    "pad-to-multiple-of-8": {"pad_to_multiple_of": 8},
    "label-smoothing": {"label_smoothing_factor": 0.1},  # the loss from the full logits, gathered to stock's rows
    "no-gradient-checkpointing": {"gradient_checkpointing": False},
}


@pytest.mark.parametrize("setting", list(OPTIONS))
def test_options(tmp_path, tokenizer, setting):
    compare(tmp_path, tokenizer, completions_dataset(), **OPTIONS[setting])


def test_moe_router_loss(tmp_path, tokenizer):
    """A mixture-of-experts model whose config asks for router logits: SFT adds the load-balancing loss, over the
    stock tokens."""
    config_kwargs = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    stock, _, expected, _ = compare(
        tmp_path, tokenizer, completions_dataset(), family="mixtral", config_kwargs=config_kwargs
    )
    assert stock.aux_loss_enabled and "aux_loss" in expected[1]


def test_a_mask_that_lets_one_row_see_another_fails(tmp_path, tokenizer, monkeypatch):
    stock, shared, expected, _ = compare(tmp_path, tokenizer, completions_dataset(), ours=ALWAYS)
    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    examples = [stock.train_dataset[i] for i in range(len(stock.train_dataset))]
    with pytest.raises(AssertionError):
        assert_same_loss_metrics_grads(expected, sft_step(shared, examples), min_metrics=3)


def test_training_and_evaluation_match_stock(tmp_path, tokenizer):
    stock, shared = make_sft_trainers(tmp_path, tokenizer, completions_dataset(), ours=ALWAYS)
    expected, got = train_and_evaluate(stock), train_and_evaluate(shared)
    assert_same_training(expected, got, min_per_line=1)
    train_logs = [log for log in got[0] if "loss" in log]
    assert {"entropy", "mean_token_accuracy", "num_tokens", "num_shared_tokens"} <= set(train_logs[0])
    assert train_logs[-1]["num_shared_tokens"] < train_logs[-1]["num_tokens"]


@pytest.mark.parametrize("option", ["packing", "padding_free"])
def test_trl_packing_and_padding_free_are_refused(tmp_path, option):
    with pytest.raises(ValueError, match=f"`{option}=True`"):
        SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing=True, **{option: True})
    assert getattr(SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **{option: True}), option)


def test_stock_trainer_given_our_config_is_an_error(tmp_path, tokenizer):
    with pytest.raises(TypeError, match="SFTTrainer"):
        trl.SFTTrainer(
            model=make_model("llama", len(tokenizer)),
            args=sft_args(tmp_path, {}),
            train_dataset=completions_dataset(),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("option", [{"use_liger_kernel": True}, {"neftune_noise_alpha": 5.0}])
def test_options_that_replace_the_forward_or_the_embeddings_are_refused(tmp_path, option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing=True, **option)


def interleaved_completions(prompts=4, per_prompt=3, seed=6) -> Dataset:
    """Several completions per prompt, the prompts interleaved (as a shuffled rejection-sampling dump has them)."""
    rows = completions_dataset(prompts=prompts, per_prompt=per_prompt, seed=seed).to_list()
    return Dataset.from_list([rows[p * per_prompt + c] for c in range(per_prompt) for p in range(prompts)])


def test_group_by_prompt_keeps_a_prompts_completions_together_and_the_random_stream(tmp_path, tokenizer):
    from trl_prefix_sharing.sft_trainer import sft_prompt_groups

    stock, shared = make_sft_trainers(tmp_path, tokenizer, interleaved_completions(), ours={"group_by_prompt": True})
    groups = sft_prompt_groups(shared.train_dataset)
    assert len(set(groups)) == 4
    assert_grouped_by_prompt(stock, shared, groups)


def test_group_by_prompt_needs_prompts(tmp_path, tokenizer):
    _, shared = make_sft_trainers(tmp_path, tokenizer, text_dataset(), ours={"group_by_prompt": True})
    with pytest.raises(ValueError, match="finds no prompts"):
        shared._get_train_sampler()
