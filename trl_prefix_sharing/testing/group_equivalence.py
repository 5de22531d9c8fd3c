"""Helpers that run stock TRL's GRPO/RLOO and the prefix-shared trainers side by side from the same saved model."""

from __future__ import annotations

import itertools
import random

import torch
from datasets import Dataset

from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import CPU_RUN, assert_same_number
from trl_prefix_sharing.testing.trainers import build_trainer


_counter = itertools.count()
#: logged values that are not numbers of the training (wall-clock time)
UNCOMPARED = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}


def prompt_dataset(n=8, seed=0, conversational=False) -> Dataset:
    """Prompts of very unequal lengths (one word to forty), so left padding varies a lot within a batch."""
    rng = random.Random(seed)
    lengths = [1, 40, 3, 17, 1, 8, 25, 2] * (n // 8 + 1)
    rows = []
    for length in lengths[:n]:
        text = " ".join(f"w{rng.randrange(200)}" for _ in range(length))
        rows.append({"prompt": [{"role": "user", "content": text}] if conversational else text})
    return Dataset.from_list(rows)


def reward_length(completions, **kwargs):
    return [len(c if isinstance(c, str) else c[0]["content"]) / 10 for c in completions]


def reward_digits(completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in (c if isinstance(c, str) else c[0]["content"]))) for c in completions]


def ending_early(tokenizer, bias=3.0) -> dict:
    """`generation_kwargs` that raise EOS's logit by `bias` while sampling (transformers' `sequence_bias`): a random
    tiny model then ends some completions early and runs others to `max_completion_length`, so completions have
    unequal lengths and some are truncated."""
    return {"sequence_bias": [[[tokenizer.eos_token_id], bias]]}


def save_model(directory, family, tokenizer, seed=0, **config_kwargs) -> str:
    """A tiny model of `family` saved with the tokenizer (GRPO reloads the reference from the path when `beta > 0`)."""
    path = str(directory / family)
    make_model(family, len(tokenizer), seed=seed, **config_kwargs).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def group_fields(tmp_path, ours: bool | dict, **overrides) -> dict:
    """The group trainers' test config fields; `ours`: prefix sharing on (True, or a dict of our config's fields)."""
    kwargs = dict(
        output_dir=str(tmp_path / f"run{next(_counter)}"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        **CPU_RUN,
        max_steps=2,
        learning_rate=1e-3,
    )
    kwargs.update(overrides)
    ours = {"prefix_sharing": True, **(ours if isinstance(ours, dict) else {})} if ours else {}
    return {**kwargs, **ours}


def group_args(config_cls, tmp_path, ours: bool | dict, **overrides):
    """The group trainers' test config (`group_fields`) as `config_cls`."""
    return config_cls(**group_fields(tmp_path, ours, **overrides))


def make_group_trainer(kind, ours, model, dataset, tokenizer, tmp_path, peft_config=None, **overrides):
    return build_trainer(
        kind,
        stock=not ours,
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        reward_funcs=[reward_length, reward_digits],
        peft_config=peft_config,
        copy_models=False,
        quiet=False,
        **group_fields(tmp_path, ours, **overrides),
    )


def train(trainer):
    """Train; the per-step logs and the final trainable parameters."""
    torch.manual_seed(0)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return logs, params


def assert_same_runs(stock, shared, keys=None, atol=1e-5, rtol=1e-4):
    """Every logged number of every step (or only `keys`), and the final trainable parameters, equal."""
    (stock_logs, stock_params), (shared_logs, shared_params) = stock, shared
    assert len(stock_logs) == len(shared_logs) > 0
    compared = 0
    for step, (a, b) in enumerate(zip(stock_logs, shared_logs, strict=True)):
        for key, value in a.items():
            if key in UNCOMPARED or (keys is not None and key not in keys) or not isinstance(value, (int, float)):
                continue
            assert key in b, f"step {step}: {key} not logged with prefix sharing"
            assert_same_number(b[key], value, f"step {step}, {key}", atol, rtol)
            compared += 1
    assert compared >= len(stock_logs) * (len(keys) if keys is not None else 10)
    assert stock_params.keys() == shared_params.keys() and stock_params
    for name, value in stock_params.items():
        assert value.numel() > 0
        torch.testing.assert_close(shared_params[name], value, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def spy_generation_attention(monkeypatch, model_class) -> list[str]:
    """The attention implementation each `generate` call of `model_class` ran on, in call order (filled as it runs)."""
    seen = []
    original = model_class.generate

    def generate(self, *args, **kwargs):
        seen.append(self.config._attn_implementation)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(model_class, "generate", generate)
    return seen
