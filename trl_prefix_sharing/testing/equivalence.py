"""Helpers that run stock TRL and the prefix-shared trainer side by side, from identical weights, on identical data."""

from __future__ import annotations

import copy
import itertools

import torch
import trl
from datasets import Dataset

from trl_prefix_sharing import DPOConfig
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.trainers import build_trainer


_counter = itertools.count()
#: how every side-by-side run trains, whatever the trainer: on the CPU, in fp32 (TRL's default `bf16=True` off), a log
#: line per step, no checkpoints, one seed
CPU_RUN = {"bf16": False, "use_cpu": True, "report_to": "none", "logging_steps": 1, "save_strategy": "no", "seed": 0}


def _common_args(tmp_path, overrides) -> dict:
    """The fields stock and ours share in these tests (`CPU_RUN`, batches of 4, no truncation), then `overrides`."""
    return {
        "output_dir": str(tmp_path / f"run{next(_counter)}"),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_length": None,
        **CPU_RUN,
        **overrides,
    }


def assert_same_number(got, expected, what: str, atol: float, rtol: float) -> None:
    """One logged number (a metric, a loss) equal to stock's within `atol`/`rtol`; `what` names it in the error."""
    torch.testing.assert_close(
        torch.tensor(float(got)), torch.tensor(float(expected)), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def train_and_evaluate(trainer):
    """Train (the config's steps), then evaluate: the log lines and the trained weights."""
    torch.manual_seed(0)
    trainer.train()
    trainer.evaluate()
    logs = [log for log in trainer.state.log_history if "loss" in log or "eval_loss" in log]
    return logs, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


#: words of log entries that are timings or schedule counters, not numbers of the model
UNTIMED = ("runtime", "per_second", "epoch", "step", "learning_rate", "grad_norm")


def assert_same_training(stock, shared, atol=1e-5, rtol=1e-4, min_per_line=8, ours_only=("num_shared_tokens",)):
    """`train_and_evaluate` results equal: every logged number of every line (timings aside), and the weights.
    `ours_only`: keys only the prefix-sharing run logs (every trainer's `num_shared_tokens`)."""
    assert len(stock[0]) == len(shared[0]) >= 2
    for expected, got in zip(stock[0], shared[0], strict=True):
        assert set(expected) == set(got) - set(ours_only)
        numbers = [key for key in expected if not any(word in key for word in UNTIMED)]
        assert len(numbers) >= min_per_line, numbers
        for key in numbers:
            assert_same_number(got[key], expected[key], key, atol, rtol)
    assert stock[1]
    for name, value in stock[1].items():
        torch.testing.assert_close(shared[1][name], value, atol=atol, rtol=rtol)


def dpo_args(tmp_path, ours: bool | dict | None, **overrides):
    """`ours=None` -> TRL's own `DPOConfig` (stock); a bool -> ours with that `prefix_sharing`; a dict -> ours with
    those fields (`prefix_sharing`, `packing`, ...)."""
    kwargs = _common_args(tmp_path, overrides)
    if ours is None:
        return trl.DPOConfig(**kwargs)
    if isinstance(ours, bool):
        ours = {"prefix_sharing": ours}
    return DPOConfig(**ours, **kwargs)


def make_trainers(
    tmp_path,
    family,
    dataset,
    tokenizer,
    ref_model="copy",
    eval_dataset=None,
    model=None,
    peft_config=None,
    config_kwargs=None,
    ours=None,
    **overrides,
):
    """(stock TRL trainer, prefix-shared trainer) with deep-copied identical policy (and reference) models.
    `ours`: fields only our config has (default `{"prefix_sharing": True}`); `overrides`: fields of both."""
    config_kwargs = config_kwargs or {}
    if model is None:
        model = make_model(family, len(tokenizer), seed=0, **config_kwargs)
    ref = make_model(family, len(tokenizer), seed=1, **config_kwargs) if ref_model == "copy" else ref_model
    return [
        build_trainer(
            "dpo",
            stock=options is None,
            model=model if isinstance(model, str) else copy.deepcopy(model),
            ref_model=copy.deepcopy(ref) if ref is not None else None,
            tokenizer=tokenizer,
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            copy_models=False,
            quiet=False,
            **_common_args(tmp_path, overrides),
            **(options or {}),
        )
        for options in (None, ours or {"prefix_sharing": True})
    ]


def backward_grads(model, loss) -> dict:
    """`loss.backward()`: the gradients by name (copies), then the model's gradients cleared."""
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_loss_metrics_grads(stock, shared, atol=1e-5, rtol=1e-5, min_metrics=1) -> None:
    """`(loss, metrics, grads)` of a batch equal to stock's: the loss, every metric stock logged (at least
    `min_metrics`, the same keys), every gradient (non-empty, the same parameters)."""
    (loss, metrics, grads), (got_loss, got_metrics, got_grads) = stock[:3], shared[:3]
    torch.testing.assert_close(got_loss, loss, atol=atol, rtol=rtol)
    assert len(metrics) >= min_metrics and set(got_metrics) == set(metrics), (metrics, got_metrics)
    for key, value in metrics.items():
        assert_same_number(got_metrics[key], value, f"metric {key}", atol, rtol)
    assert grads and set(got_grads) == set(grads)
    for name, grad in grads.items():
        assert grad.numel() > 0
        torch.testing.assert_close(got_grads[name], grad, atol=atol, rtol=rtol, msg=lambda m, n=name: f"grad {n}: {m}")


def positions(batch) -> int:
    """The positions a batch's layout computes (its documents' tokens, padding left out)."""
    return int((batch["prefix_sharing"].document_ids >= 0).sum())


def step(trainer, examples):
    """One training loss + backward on `examples`: loss, gradients by name, per-pair policy log-probs, metrics."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    loss = trainer.compute_loss(trainer.model, batch)
    grads = backward_grads(trainer.model, loss)
    chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {
        "loss": loss.detach(),
        "grads": grads,
        "chosen": chosen,
        "rejected": rejected,
        "metrics": metrics,
        "batch": batch,
    }


def assert_same_step(stock, shared, atol=1e-5, rtol=1e-5, grad_tolerances=None):
    """Loss, per-pair log-probs, every stock metric and every gradient equal; compared tensors non-empty.
    `grad_tolerances`: {"atol", "rtol"} for the gradients alone (default: the same as the rest)."""
    grad_tolerances = grad_tolerances or {"atol": atol, "rtol": rtol}
    assert stock["chosen"].numel() > 0 and stock["rejected"].numel() > 0
    torch.testing.assert_close(shared["chosen"], stock["chosen"], atol=atol, rtol=rtol)
    torch.testing.assert_close(shared["rejected"], stock["rejected"], atol=atol, rtol=rtol)
    torch.testing.assert_close(shared["loss"], stock["loss"], atol=atol, rtol=rtol)
    assert stock["metrics"], "no metrics were logged"
    for key, value in stock["metrics"].items():
        assert_same_number(shared["metrics"][key], value, f"metric {key}", atol, rtol)
    assert stock["grads"] and set(shared["grads"]) == set(stock["grads"])
    for name, grad in stock["grads"].items():
        assert grad.numel() > 0
        torch.testing.assert_close(
            shared["grads"][name], grad, **grad_tolerances, msg=lambda m, name=name: f"grad {name}: {m}"
        )


def compare_step(stock_trainer, shared_trainer, n=None, **tolerances):
    dataset = stock_trainer.train_dataset
    examples = [dataset[i] for i in range(len(dataset) if n is None else min(n, len(dataset)))]
    stock = step(stock_trainer, examples)
    shared = step(shared_trainer, examples)
    assert "prefix_sharing" in shared["batch"] and "prefix_sharing" not in stock["batch"]
    assert_same_step(stock, shared, **tolerances)
    return stock, shared


def awkward_text_dataset() -> Dataset:
    """Real-data corner cases, in plain text (TRL appends EOS to each completion)."""
    rows = [
        {"prompt": "w1", "chosen": " w2 w3", "rejected": " w4"},  # one-token prompt
        {"prompt": "w5 w6 w7 w8 w9", "chosen": " w10", "rejected": " " + " ".join(f"w{i}" for i in range(40, 80))},
        {"prompt": "what is the sum of 3 and 4 ?", "chosen": " 7", "rejected": " 7"},  # identical completions
        {"prompt": "w11 w12 w13", "chosen": " w14 w15 w16 w17", "rejected": " w14 w15 w18"},  # shared first tokens
        {"prompt": "w20 w21 w22 w23", "chosen": "", "rejected": " w24 w25"},  # empty completion (EOS only)
        {"prompt": " ".join(f"w{i}" for i in range(100, 160)), "chosen": " w1 w2", "rejected": " w3"},  # long prompt
        {"prompt": "w30 w31", "chosen": " w32 w33 w34 w35 w36 w37 w38 w39", "rejected": " w32"},
        {"prompt": "the answer", "chosen": " is yes", "rejected": " is no because"},
    ]
    return Dataset.from_list(rows)


def tie_free_text_dataset() -> Dataset:
    """`awkward_text_dataset` with different completions in its tie row (identical completions tie exactly in the
    shared row and by round-off in stock's rows, see `expected_shared_accuracy`): stock's reward accuracy is then
    compared exactly."""
    rows = awkward_text_dataset().to_list()
    assert rows[2]["chosen"] == rows[2]["rejected"]
    rows[2]["rejected"] = " 8"
    return Dataset.from_list(rows)


def conversational_dataset() -> Dataset:
    """Multi-turn conversational prompts (system + several user/assistant turns)."""
    rows = []
    for i in range(6):
        prompt = [
            {"role": "system", "content": "w1 w2 w3"},
            {"role": "user", "content": f"what is w{i} plus w{i + 1} ?"},
            {"role": "assistant", "content": f"w{i + 2} w{i + 3} so the sum"},
            {"role": "user", "content": " ".join(f"w{j}" for j in range(i, i + 3 + 4 * i))},
        ]
        rows.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": " ".join(f"w{j}" for j in range(50, 52 + i))}],
                "rejected": [{"role": "assistant", "content": "no" if i % 2 else f"w50 w51 w{90 + i}"}],
            }
        )
    return Dataset.from_list(rows)


# ------------------------------------------------------------------------------------------------- reward models
def make_reward_model(family, tokenizer, seed=0, **config_kwargs):
    from transformers import AutoModelForSequenceClassification

    from trl_prefix_sharing.testing import make_config

    attn_implementation = config_kwargs.pop("attn_implementation", "sdpa")
    config = copy.deepcopy(make_config(family, len(tokenizer), num_labels=1, **config_kwargs))
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )


def reward_args(tmp_path, ours: dict | None, **overrides):
    from trl_prefix_sharing import RewardConfig

    kwargs = _common_args(tmp_path, overrides)
    return trl.RewardConfig(**kwargs) if ours is None else RewardConfig(**ours, **kwargs)


def make_reward_trainers(
    tmp_path,
    family,
    dataset,
    tokenizer,
    eval_dataset=None,
    peft_config=None,
    ours=None,
    stock_dataset=None,
    config_kwargs=None,
    **overrides,
):
    """(stock TRL RewardTrainer, ours) from identical weights. `stock_dataset`: what stock trains on (e.g. the
    expanded pairs of a ranked dataset)."""
    model = make_reward_model(family, tokenizer, **(config_kwargs or {}))
    return [
        build_trainer(
            "reward",
            stock=options is None,
            model=model,
            tokenizer=tokenizer,
            train_dataset=data,
            eval_dataset=eval_dataset,
            peft_config=peft_config,
            quiet=False,
            **_common_args(tmp_path, overrides),
            **(options or {}),
        )
        for options, data in (
            (None, stock_dataset if stock_dataset is not None else dataset),
            (ours or {"prefix_sharing": True}, dataset),
        )
    ]


def reward_step(trainer, examples, pairs_in_window=None):
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    if pairs_in_window is not None:
        trainer._pairs_in_window = pairs_in_window
        trainer.current_gradient_accumulation_steps = 1
    loss, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {
        "loss": loss.detach(),
        "rewards": outputs.logits.detach(),
        "grads": grads,
        "metrics": metrics,
        "batch": batch,
    }


def assert_same_reward_step(stock, shared, compare_rewards=True, atol=1e-5, rtol=1e-5):
    if compare_rewards:
        assert stock["rewards"].numel() > 0
        torch.testing.assert_close(shared["rewards"], stock["rewards"], atol=atol, rtol=rtol)
    torch.testing.assert_close(shared["loss"], stock["loss"], atol=atol, rtol=rtol)
    assert stock["metrics"]
    for key, value in stock["metrics"].items():
        if key == "num_tokens" and not compare_rewards:
            continue  # ranked rows are counted once, the expanded pairs repeat them
        if key == "accuracy" and compare_rewards:
            assert float(shared["metrics"][key]) == expected_shared_accuracy(stock, shared), (key, value)
            continue
        assert_same_number(shared["metrics"][key], value, f"metric {key}", atol, rtol)
    assert stock["grads"] and set(stock["grads"]) == set(shared["grads"])
    for name, grad in stock["grads"].items():
        torch.testing.assert_close(
            shared["grads"][name], grad, atol=atol, rtol=rtol, msg=lambda m, name=name: f"grad {name}: {m}"
        )


def tied_pairs(batch) -> torch.Tensor:
    """[B] bool: pairs whose chosen and rejected rows are the same tokens (identical completions), in a stock reward
    batch (chosen rows first, then rejected)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    half = ids.shape[0] // 2
    return (ids[:half] == ids[half:]).all(1) & (mask[:half] == mask[half:]).all(1)


def expected_shared_accuracy(stock, shared) -> float:
    """The reward `accuracy` prefix sharing must log, exactly (no tolerance): stock's, except at exact ties (identical
    completions). There stock's two rows can differ by round-off (about 1e-8) and count either way, while the shared
    row gives both completions the same positions, so bitwise equal rewards: a tie, not won. Without ties this is
    stock's own metric."""
    half = stock["rewards"].shape[0] // 2
    assert half > 0
    wins = (stock["rewards"][:half] > stock["rewards"][half:]).reshape(half)
    assert float(stock["metrics"]["accuracy"]) == wins.float().mean().item()  # stock's metric is read from its rewards
    ties = tied_pairs(stock["batch"]).to(wins.device)
    tied_rewards = shared["rewards"][:half][ties], shared["rewards"][half:][ties]
    assert torch.equal(*tied_rewards), tied_rewards
    return (wins & ~ties).float().mean().item()


def leaky_dpo_mask(subtree_end, position_ids=None, window=None, key_visible=None):
    """A deliberately wrong `prefix_sharing_mask`: plain causal attention, forgetting `on_path`, so a completion sees
    its siblings (the rejected one sees the chosen one). Patched in to show the equivalence tests fail with a wrong
    mask."""
    from torch.nn.attention.flex_attention import and_masks

    from trl_prefix_sharing.mask import causal, visible_key

    if key_visible is None:
        return causal
    return and_masks(causal, visible_key(key_visible))  # only the path rule is wrong


#: evaluation metrics that are not per-pair means: timings, and batch extremes averaged over batches (they depend on
#: how the pairs are batched, in stock TRL too)
NOT_PER_PAIR_METRICS = ("runtime", "per_second", "preparation_time", "min_reward", "max_reward")


def assert_same_eval_metrics(expected: dict, got: dict, rel=1e-4, abs=1e-5) -> None:
    """Every per-pair-mean evaluation metric of `expected` equals `got`'s; at least four of them compared."""
    import pytest

    compared = 0
    for key, value in expected.items():
        if any(skip in key for skip in NOT_PER_PAIR_METRICS):
            continue
        assert got[key] == pytest.approx(value, rel=rel, abs=abs), key
        compared += 1
    assert compared >= 4


# ------------------------------------------------------------------------------------------- architecture matrix
def family_config_kwargs(family, variant="default"):
    """Config overrides of one measured variant of `family` (trl_prefix_sharing.architectures), with the attention
    stock runs it with: SDPA where the model class supports it, else eager. A multimodal config's variants are its text
    part's (`make_config` applies the overrides there)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from trl_prefix_sharing.architectures import variant_configs
    from trl_prefix_sharing.testing import make_config

    config = make_config(family, 8)
    attn_implementation = "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else "eager"
    return {"attn_implementation": attn_implementation, **variant_configs(config.get_text_config())[variant]}


def assert_grouped_by_prompt(stock, shared, groups) -> None:
    """`group_by_prompt`: the shared trainer's training sampler draws what stock's draws (the same random stream, the
    same examples) and puts each prompt's examples (`groups`: the prompt of every dataset index) in one run, the runs
    in the order their first example was drawn."""
    from trl_prefix_sharing.packing import PromptGroupSampler

    torch.manual_seed(0)
    stock_order = list(stock._get_train_sampler())
    after_stock = torch.randint(1 << 30, ())
    torch.manual_seed(0)
    sampler = shared._get_train_sampler()
    assert isinstance(sampler, PromptGroupSampler)
    order = list(sampler)
    assert torch.randint(1 << 30, ()) == after_stock  # the same random draws
    assert sorted(order) == sorted(stock_order) and order != stock_order
    runs = [g for g, _ in itertools.groupby(groups[i] for i in order)]
    assert len(runs) == len(set(runs))  # each prompt's examples in one run
    firsts = {}
    for place, index in enumerate(stock_order):
        firsts.setdefault(groups[index], place)
    assert runs == sorted(set(runs), key=firsts.get)  # groups in the order their first example was drawn
