"""What a run leaves behind, for every trainer, against stock TRL in the same process: with `bf16=True` (TRL's
default), fp32 weights loaded with eager attention (so the CPU's shared passes switch them to SDPA), after `train()`
and after `evaluate()`: the autocast state and grad mode of the process, the models' train/eval modes, their attention
implementation, and what sits on their `forward` and `generate`."""

from __future__ import annotations

import pytest
import torch
from test_kto_equivalence import make_trainers as make_kto_trainers
from test_kto_equivalence import unpaired_dataset
from test_online_dpo_equivalence import make_trainers as make_online_dpo_trainers
from test_orpo_cpo_equivalence import make_trainers as make_concatenated_trainers

from trl_prefix_sharing.forward import has_prefix_sharing_forward, unwrap_model
from trl_prefix_sharing.sharing import PrefixSharingMixin
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import awkward_text_dataset, make_reward_trainers
from trl_prefix_sharing.testing.equivalence import make_trainers as make_dpo_trainers
from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, prompt_dataset, save_model


EAGER = {"attn_implementation": "eager"}
BF16 = {"bf16": True, "max_steps": 2}


def _pair(kind, tmp_path, tokenizer):
    """(stock trainer, prefix-sharing trainer) of `kind`, bf16 autocast, eager-loaded fp32 models."""
    data = awkward_text_dataset()
    if kind == "dpo":
        model = make_model("llama", len(tokenizer), seed=0, **EAGER)
        ref = make_model("llama", len(tokenizer), seed=1, **EAGER)
        return make_dpo_trainers(
            tmp_path, "llama", data, tokenizer, ref_model=ref, model=model, eval_dataset=data, **BF16
        )
    if kind == "reward":
        return make_reward_trainers(tmp_path, "llama", data, tokenizer, eval_dataset=data, config_kwargs=EAGER, **BF16)
    if kind == "kto":
        return make_kto_trainers(tmp_path, tokenizer, unpaired_dataset(), config_kwargs=EAGER, **BF16)
    if kind in ("orpo", "cpo"):
        return make_concatenated_trainers(tmp_path, kind, tokenizer, data, config_kwargs=EAGER, **BF16)
    if kind == "online_dpo":
        return make_online_dpo_trainers(tmp_path, "llama", tokenizer, config_kwargs=EAGER, **BF16)
    path = save_model(tmp_path, "llama", tokenizer)  # loaded with eager attention, the reference too (RLOO's beta)
    return [
        make_group_trainer(
            kind, ours, path, prompt_dataset(), tokenizer, tmp_path, model_init_kwargs=EAGER, beta=0.1, **BF16
        )
        for ours in (False, True)
    ]


def _state(trainer) -> dict:
    """The process's autocast and grad mode; per model its mode, attention and patched methods."""
    state = {
        "autocast": torch.is_autocast_enabled("cpu"),
        "autocast dtype": torch.get_autocast_dtype("cpu"),
        "grad enabled": torch.is_grad_enabled(),
    }
    models = {"model": trainer.model, "ref_model": getattr(trainer, "ref_model", None)}
    for name, model in models.items():
        if not isinstance(model, torch.nn.Module):
            continue
        base = unwrap_model(model)
        wrapped = "_original_forward" in base.__dict__  # accelerate's mixed-precision wrapper
        state[f"{name} training"] = model.training
        state[f"{name} attention"] = base.config._attn_implementation
        state[f"{name} own generate"] = "generate" in base.__dict__
        state[f"{name} wrapped by accelerate"] = wrapped
        # the shared forward is gone, or (under accelerate's wrapper, which stock has too) passes calls through
        state[f"{name} forward as stock"] = not wrapped and "forward" not in base.__dict__ or wrapped
        if has_prefix_sharing_forward(base):
            assert wrapped, f"{name}: the shared forward is still on top after the run"
    return state


@pytest.mark.parametrize("kind", ["dpo", "reward", "kto", "orpo", "cpo", "online_dpo", "grpo", "rloo"])
def test_nothing_leaks_out_of_train_and_evaluate(tmp_path, tokenizer, kind):
    stock, shared = _pair(kind, tmp_path, tokenizer)
    assert stock.args.bf16 and not isinstance(stock, PrefixSharingMixin)
    assert shared.prefix_sharing and shared.args.bf16
    after = {}
    for trainer in (stock, shared):
        assert not torch.is_autocast_enabled("cpu")
        torch.manual_seed(0)
        trainer.train()
        states = [_state(trainer)]
        if trainer.eval_dataset is not None:
            trainer.evaluate()
            states.append(_state(trainer))
        after[trainer is shared] = states
        torch.set_autocast_enabled("cpu", False)  # a leak must not reach the next trainer of this test
    assert after[True] == after[False]
    assert after[False][0]["model attention"] == "eager" and not after[False][0]["autocast"]
