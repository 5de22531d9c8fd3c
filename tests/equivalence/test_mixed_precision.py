"""Mixed precision: every pass runs in the dtype stock TRL runs it in, and half-precision models are scored as stock
scores them.

- Under `bf16=True` (accelerate's autocast; on the CPU too), each trainer's policy and reference passes see the
  attention inputs in the dtype stock's do (a hook on the first layer's query projection), and the first training
  step logs stock's numbers to bf16 round-off. A reference model is prepared by TRL's `__init__` before this package
  patches it; its shared calls must still run in that autocast (online DPO's `objective/kl` is exactly 0 on the first
  step, as in stock, only if they do).
- Half-precision weights without autocast: stock online DPO runs `log_softmax` on half-precision logits; the shared
  rows give the same op the same logits.
"""

from collections import defaultdict

import pytest
import torch
import trl
from test_grpo_equivalence import crafted_batch
from test_online_dpo_equivalence import forward_and_grads
from trl.experimental.online_dpo import OnlineDPOConfig as StockOnlineDPOConfig
from trl.experimental.online_dpo import OnlineDPOTrainer as StockOnlineDPOTrainer

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing import DPOTrainer, OnlineDPOConfig, OnlineDPOTrainer, RewardTrainer
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    CPU_RUN,
    assert_same_number,
    awkward_text_dataset,
    dpo_args,
    leaky_dpo_mask,
    make_reward_model,
    reward_args,
)
from trl_prefix_sharing.testing.group_equivalence import (
    UNCOMPARED,
    make_group_trainer,
    prompt_dataset,
    reward_digits,
    reward_length,
    save_model,
)


#: first-step numbers under bf16 autocast, absolute: the bf16 tolerance of the suite's summed log-probs
#: (`BF16_SUM_ATOL` in tests/equivalence/test_hardening.py); relative 1e-3 for larger values (grad norms, rewards of
#: ~15)
BF16_ATOL, BF16_RTOL = 5e-3, 1e-3
FAMILY = "qwen3"


def _online_dpo(
    ours, tmp_path, tokenizer, weights=torch.float32, model_kwargs=None, ref_weights=None, family=FAMILY, **overrides
):
    model_kwargs = model_kwargs or {}
    policy = make_model(family, len(tokenizer), seed=0, **model_kwargs).to(weights)
    ref = make_model(family, len(tokenizer), seed=0, **model_kwargs)  # the policy's weights: stock's first KL is 0
    ref = ref.to(weights if ref_weights is None else ref_weights)
    config, trainer = (OnlineDPOConfig, OnlineDPOTrainer) if ours else (StockOnlineDPOConfig, StockOnlineDPOTrainer)
    kwargs = dict(per_device_train_batch_size=4, max_new_tokens=6, **CPU_RUN, max_steps=1, learning_rate=1e-3)
    kwargs.update(overrides)
    kwargs.update({"output_dir": str(tmp_path / f"online{ours}"), **({"prefix_sharing": True} if ours else {})})
    return trainer(
        model=policy,
        ref_model=ref,
        reward_funcs=[reward_length, reward_digits],
        args=config(**kwargs),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )


def _dpo(ours, tmp_path, tokenizer, weights=torch.float32, model_kwargs=None, **overrides):
    model_kwargs = model_kwargs or {}
    model = make_model(FAMILY, len(tokenizer), seed=0, **model_kwargs).to(weights)
    ref = make_model(FAMILY, len(tokenizer), seed=1, **model_kwargs).to(weights)
    return (DPOTrainer if ours else trl.DPOTrainer)(
        model=model,
        ref_model=ref,
        args=dpo_args(tmp_path, True if ours else None, max_steps=1, learning_rate=1e-3, **overrides),
        train_dataset=awkward_text_dataset(),
        processing_class=tokenizer,
    )


def _reward(ours, tmp_path, tokenizer, weights=torch.float32, model_kwargs=None, **overrides):
    return (RewardTrainer if ours else trl.RewardTrainer)(
        model=make_reward_model(FAMILY, tokenizer, seed=0, **(model_kwargs or {})).to(weights),
        args=reward_args(tmp_path, {"prefix_sharing": True} if ours else None, max_steps=1, **overrides),
        train_dataset=awkward_text_dataset(),
        processing_class=tokenizer,
    )


def _group(kind):
    def build(ours, tmp_path, tokenizer, weights=torch.float32, model_kwargs=None, **overrides):
        # the policy and the reference are loaded from the saved model (beta > 0)
        path = save_model(tmp_path / f"{kind}{ours}", FAMILY, tokenizer, **(model_kwargs or {}))
        model_init_kwargs = {"dtype": weights}
        return make_group_trainer(
            kind,
            ours,
            path,
            prompt_dataset(),
            tokenizer,
            tmp_path,
            max_steps=1,
            beta=0.1,
            model_init_kwargs=model_init_kwargs,
            **overrides,
        )

    return build


def _paired(kind):
    """KTO (with a reference), ORPO and CPO-SimPO (without one), from the trainer modules' own test builders."""

    def build(ours, tmp_path, tokenizer, weights=torch.float32, model_kwargs=None, **overrides):
        import test_kto_equivalence
        import test_orpo_cpo_equivalence

        options = {"max_steps": 1, "learning_rate": 1e-3, "config_kwargs": model_kwargs, "weights": weights}
        if kind == "kto":
            pair = test_kto_equivalence.make_trainers(
                tmp_path, tokenizer, test_kto_equivalence.unpaired_dataset(), **options, **overrides
            )
        else:
            extra = {"loss_type": "simpo", "cpo_alpha": 0.5} if kind == "cpo" else {}
            pair = test_orpo_cpo_equivalence.make_trainers(
                tmp_path, kind, tokenizer, awkward_text_dataset(), family=FAMILY, **options, **extra, **overrides
            )
        return pair[1] if ours else pair[0]

    return build


def _sft(ours, tmp_path, tokenizer, weights=torch.float32, model_kwargs=None, **overrides):
    """SFT on several completions per prompt (joined by the default `"auto"`), from its test module's builder."""
    import test_sft_equivalence

    pair = test_sft_equivalence.make_sft_trainers(
        tmp_path,
        tokenizer,
        test_sft_equivalence.completions_dataset(),
        family=FAMILY,
        config_kwargs=model_kwargs,
        weights=weights,
        max_steps=1,
        **overrides,
    )
    return pair[1] if ours else pair[0]


TRAINERS = {
    "dpo": _dpo,
    "reward": _reward,
    "grpo": _group("grpo"),
    "rloo": _group("rloo"),
    "online_dpo": _online_dpo,
    "kto": _paired("kto"),
    "orpo": _paired("orpo"),
    "cpo": _paired("cpo"),
    "sft": _sft,
}


def _record_query_dtypes(trainer) -> dict:
    """{"policy"|"reference": dtypes of the first layer's query projection output (the attention's input)}, filled as
    the trainer runs; one hook per distinct model."""
    seen = defaultdict(set)
    models = {"policy": trainer.model, "reference": getattr(trainer, "ref_model", None)}
    for role, model in models.items():
        if model is None:
            continue
        (query,) = [m for name, m in model.named_modules() if name.endswith("layers.0.self_attn.q_proj")]
        query.register_forward_hook(lambda module, args, output, role=role: seen[role].add(output.dtype))
    return seen


def _first_step(trainer) -> tuple[dict, dict]:
    seen = _record_query_dtypes(trainer)
    torch.manual_seed(0)
    trainer.train()
    (log,) = [log for log in trainer.state.log_history if "loss" in log]
    return log, dict(seen)


def _assert_same_first_step(stock_log: dict, shared_log: dict, atol=BF16_ATOL, rtol=BF16_RTOL) -> int:
    compared = 0
    for key, value in stock_log.items():
        if key in UNCOMPARED or not isinstance(value, (int, float)):
            continue
        assert_same_number(shared_log[key], value, key, atol, rtol)
        compared += 1
    return compared


def check_passes_in_stocks_dtype(
    tmp_path, tokenizer, kind, weights=torch.float32, model_kwargs=None, atol=BF16_ATOL, rtol=BF16_RTOL, **overrides
):
    """`bf16=True`, one training step of `kind` in stock TRL and with prefix sharing, from `weights`-dtype models: the
    policy and reference passes run in bf16 as stock's do, and the first step's numbers are stock's (also run on CUDA
    by tests/cuda/test_cuda.py)."""
    (stock_log, stock_dtypes), (shared_log, shared_dtypes) = (
        _first_step(
            TRAINERS[kind](ours, tmp_path / str(ours), tokenizer, weights, model_kwargs, bf16=True, **overrides)
        )
        for ours in (False, True)
    )
    expected_roles = {"policy"} if kind in ("reward", "orpo", "cpo", "sft") else {"policy", "reference"}
    assert set(stock_dtypes) == expected_roles and all(dtypes == {torch.bfloat16} for dtypes in stock_dtypes.values())
    assert shared_dtypes == stock_dtypes
    assert _assert_same_first_step(stock_log, shared_log, atol=atol, rtol=rtol) >= 4
    if kind == "online_dpo":  # the reference has the policy's weights: stock's KL and margins are exactly 0
        assert stock_log["objective/kl"] == shared_log["objective/kl"] == 0
        assert stock_log["rewards/margins"] == shared_log["rewards/margins"] == 0


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32-weights", "bf16-weights"])
@pytest.mark.parametrize("kind", list(TRAINERS))
def test_every_pass_runs_in_stocks_dtype_under_bf16(tmp_path, tokenizer, kind, weights):
    check_passes_in_stocks_dtype(tmp_path, tokenizer, kind, weights)


def test_half_precision_reference_scored_as_stock(tmp_path, tokenizer):
    """A float32 policy and a bf16 reference without autocast (TRL's own `test_train_with_ref_model` setting): stock
    scores the reference with a bf16 `log_softmax`, which makes its first KL about 0.01 where a float32 log-softmax
    gives 5e-4; the shared rows give the same numbers as stock."""
    stock_log, shared_log = (
        _first_step(_online_dpo(ours, tmp_path, tokenizer, ref_weights=torch.bfloat16, bf16=False))[0]
        for ours in (False, True)
    )
    assert abs(stock_log["objective/kl"]) > 2 * BF16_ATOL  # stock's bf16 log-softmax shows (0.012 measured)
    assert _assert_same_first_step(stock_log, shared_log, atol=1e-5, rtol=1e-4) >= 10


@pytest.mark.parametrize(
    "family, wrong",
    [(FAMILY, None), ("mixtral", None), (FAMILY, "leaky_branches")],
    ids=["qwen3", "mixtral-router-logits", "leaky-mask-fails"],
)
def test_half_precision_log_probs_as_stock(tmp_path, tokenizer, monkeypatch, family, wrong):
    """bf16 weights, no autocast: `_forward` returns stock's bf16 log-probs of every completion column (the same
    `log_softmax` on the same logits, computed over the shared rows), and their gradients, also for an MoE model that
    returns its router logits; a leaky mask fails it."""
    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    model_kwargs = {"output_router_logits": True} if family == "mixtral" else None
    stock, shared = (
        _online_dpo(ours, tmp_path, tokenizer, torch.bfloat16, model_kwargs, family=family, bf16=False)
        for ours in (False, True)
    )
    if wrong == "leaky_branches":
        monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    (expected, expected_grads), (got, grads) = (
        forward_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared)
    )
    assert expected.dtype == got.dtype == torch.bfloat16 and expected.numel() > 0 and expected_grads
    close = torch.isclose(got.float(), expected.float(), rtol=0, atol=BF16_ATOL)
    if wrong is not None:
        assert not close.all()
        return
    assert close.all(), (got.float() - expected.float()).abs().max()
    for name, grad in expected_grads.items():  # bf16 backward through rows of other shapes: measured up to 1.3e-2 of
        # the largest gradient of a tensor (qwen3 `k_norm.weight`); the log-probs themselves are bitwise equal here
        torch.testing.assert_close(grads[name].float(), grad.float(), atol=2e-2, rtol=2e-2, msg=name)


def test_removing_the_patches_gives_back_accelerates_wrapper(tmp_path, tokenizer):
    """The reference model was wrapped in autocast by accelerate (in TRL's `__init__`) before the package patched it;
    `remove_prefix_sharing()` gives back exactly that wrapped forward."""
    trainer = _online_dpo(True, tmp_path, tokenizer, bf16=True)
    ref = trainer.ref_model
    trainer.sharing_session.attach()  # as within `train()`
    assert "_original_forward" in ref.__dict__  # accelerate's mark of its mixed-precision wrapper
    before = ref.__dict__["_prefix_sharing_unfused_forward"]  # the forward as the package found it
    trainer.remove_prefix_sharing()
    assert ref.forward == before and "_prefix_sharing_unfused_forward" not in ref.__dict__
