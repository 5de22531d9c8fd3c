"""GRPO, RLOO and online DPO generating through vLLM, as most GRPO users run them: TRL's server mode
(`vllm_mode="server"`, TRL's `VLLMClient`) and colocate mode (`vllm.LLM`), with the stand-in of `vllm_standin` (vLLM
is not installed). Prefix sharing's training numbers (every logged metric of every step, the final weights) equal
stock TRL's under the same stand-in, with GRPO's importance-sampling correction in each of its four modes (the
stand-in's log-probs come from a deliberately mismatched distribution, so the correction acts). Each run also checks
the weight syncs: every parameter reaches the engine under a name and shape it has, at every generation, and a last
sync leaves the engine holding the trained weights."""

import copy

import pytest
import torch
from test_online_dpo_equivalence import make_trainers as make_online_dpo_trainers
from test_online_dpo_equivalence import train as train_online_dpo

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing.testing import vllm_standin
from trl_prefix_sharing.testing.equivalence import leaky_dpo_mask
from trl_prefix_sharing.testing.group_equivalence import (
    assert_same_runs,
    make_group_trainer,
    prompt_dataset,
    save_model,
    train,
)


@pytest.fixture
def vllm(monkeypatch):
    """The stand-in, installed for one test (TRL's colocate mode sets `RANK`, ... in the environment: put back)."""
    saved = vllm_standin.saved_environment()
    yield vllm_standin.install(monkeypatch)
    vllm_standin.restore_environment(saved)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tokenizer):
    return save_model(tmp_path_factory.mktemp("models"), "llama", tokenizer)


def eos_logit_bias(tokenizer, bias=5.5) -> dict:
    """`generation_kwargs` for vLLM: raise EOS's logit (`logit_bias`, a `SamplingParams` field) so that completions
    have unequal lengths, some ending and some cut at the length limit. The engine's processed log-probs include the
    bias, the trained model's do not: EOS tokens get importance ratios below 1."""
    return {"logit_bias": {tokenizer.eos_token_id: bias}}


def check_engine(stand_in, trainer, generations: int, completions: int, sync) -> None:
    """The engine sampled `completions` completions in each of `generations` generations, each after a weight sync
    that delivered every parameter; after `sync()` (TRL's own sync call) it holds the trainer's current weights (with
    LoRA: the merged weights, under the base model's names)."""
    engine = stand_in.engine(trainer)
    assert engine.completions == generations * completions
    assert len(engine.syncs) == generations and all(names == set(engine.parameters) for names in engine.syncs)
    sync()
    model = trainer.model
    lora = hasattr(model, "merge_adapter")
    if lora:
        model.merge_adapter()
    try:
        compared = 0
        for name, parameter in model.named_parameters():
            if lora:
                if "lora_" in name:
                    continue
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            assert torch.equal(engine.parameters[name], parameter.detach()), name
            compared += 1
        assert compared == len(engine.parameters)
    finally:
        if lora:
            model.unmerge_adapter()


def group_runs(stand_in, kind, mode, model_path, tokenizer, tmp_path, peft_config=None, shared=True, **overrides):
    """Stock's run, then prefix sharing's (`shared`: True, or our config's fields), each with a fresh stand-in engine
    (its own server in server mode)."""
    stand_in.serve(model_path)
    runs = []
    for ours in (False, shared):
        trainer = make_group_trainer(
            kind,
            ours,
            model_path,
            prompt_dataset(),
            tokenizer,
            tmp_path,
            peft_config=copy.deepcopy(peft_config),
            use_vllm=True,
            vllm_mode=mode,
            **overrides,
        )
        runs.append(train(trainer))
        generations = -(-trainer.state.global_step // trainer.num_iterations)  # one per `num_iterations` steps
        rows = trainer.args.per_device_train_batch_size
        check_engine(stand_in, trainer, generations, rows, sync=trainer.vllm_generation.sync_weights)
    return runs


#: importance-sampling bounds: per token, EOS (raised by `eos_logit_bias` while sampling) falls below the lower one; a
#: sequence's ratio multiplies its tokens', so its bounds are wider (one ending in EOS stays in)
TOKEN_CLIP = {"vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 2.0}
SEQUENCE_CLIP = {"vllm_importance_sampling_clip_min": 1e-3, "vllm_importance_sampling_clip_max": 2.0}
#: GRPO settings, one per importance-sampling mode, spread over the two vLLM modes and over options that read vLLM's
#: log-probs (`off_policy_mask_threshold`) or the ratio (`vespo` weighs it in), the reference pass (`beta`), several
#: iterations over a generation batch and masked truncated completions
GRPO_VLLM = {
    "server-sequence_mask": ("server", {"vllm_importance_sampling_mode": "sequence_mask", **SEQUENCE_CLIP}),
    "server-token_truncate-vespo-beta": (
        "server",
        {"vllm_importance_sampling_mode": "token_truncate", **TOKEN_CLIP, "loss_type": "vespo", "beta": 0.1},
    ),
    "colocate-token_mask-iterations-truncated": (
        "colocate",
        {
            "vllm_importance_sampling_mode": "token_mask",
            **TOKEN_CLIP,
            "num_iterations": 2,
            "mask_truncated_completions": True,
        },
    ),
    "colocate-sequence_truncate-off_policy_mask": (
        "colocate",
        {"vllm_importance_sampling_mode": "sequence_truncate", **SEQUENCE_CLIP, "off_policy_mask_threshold": 0.5},
    ),
}


@pytest.mark.parametrize("setting", list(GRPO_VLLM))
def test_grpo_with_vllm_matches_stock(tmp_path, tokenizer, model_path, vllm, setting):
    """Every number and the final weights equal stock's; and the setting is not vacuous: the model learns, some
    completions end and some are cut, vLLM's log-probs differ from the trained model's, and the correction masks or
    clips some ratios but not all."""
    mode, overrides = GRPO_VLLM[setting]
    stock, shared = group_runs(
        vllm, "grpo", mode, model_path, tokenizer, tmp_path, generation_kwargs=eos_logit_bias(tokenizer), **overrides
    )
    assert_same_runs(stock, shared)
    generated = [log for log in stock[0] if "num_tokens" in log]  # the steps that generated
    assert any(log["grad_norm"] > 0 for log in stock[0])
    assert any(0 < log["completions/clipped_ratio"] < 1 for log in generated)  # some completions end, some are cut
    # vLLM's log-probs differ from the trained model's, and the correction clipped or masked some ratios, not all
    assert all(log["sampling/sampling_logp_difference/mean"] > 0.05 for log in generated)
    ratios = [log[f"sampling/importance_sampling_ratio/{name}"] for log in generated for name in ("min", "max")]
    if overrides["vllm_importance_sampling_mode"].endswith("mask"):
        assert 0.0 in ratios and all(log["sampling/importance_sampling_ratio/mean"] > 0 for log in generated)
    else:
        bounds = {overrides["vllm_importance_sampling_clip_min"], overrides["vllm_importance_sampling_clip_max"]}
        assert bounds & set(ratios), ratios


def test_grpo_lora_with_vllm_matches_stock(tmp_path, tokenizer, model_path, vllm):
    """LoRA, as often with vLLM: TRL merges the adapters into the base weights for each sync and sends them under the
    base model's names (the engine checks them), then unmerges."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    stock, shared = group_runs(
        vllm,
        "grpo",
        "colocate",
        model_path,
        tokenizer,
        tmp_path,
        peft_config=lora,
        learning_rate=1e-2,
        vllm_importance_sampling_mode="token_truncate",
        **TOKEN_CLIP,
    )
    assert_same_runs(stock, shared)


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_rloo_with_vllm_matches_stock(tmp_path, tokenizer, model_path, vllm, mode):
    """RLOO generates through vLLM and ignores its log-probs (TRL 1.16's RLOO has no importance-sampling
    correction)."""
    stock, shared = group_runs(
        vllm, "rloo", mode, model_path, tokenizer, tmp_path, generation_kwargs=eos_logit_bias(tokenizer), beta=0.1
    )
    assert_same_runs(stock, shared)


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_online_dpo_with_vllm_matches_stock(tmp_path, tokenizer, model_path, vllm, monkeypatch, mode):
    """Online DPO (TRL 1.16's experimental trainer supports `use_vllm` in both modes): two completions per prompt from
    the engine, text prompts (the engine tokenizes them), weights synced per parameter (`_move_model_to_vllm`)."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_path)  # colocate mode loads `name_or_path` into vLLM
    reference = AutoModelForCausalLM.from_pretrained(model_path)
    vllm.serve(model_path)
    with monkeypatch.context() as patch:
        # server mode asks torch for the current accelerator's device to join the NCCL group; a CPU-only torch has
        # none (stock TRL 1.16 fails there), so it is the CPU here
        patch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cpu"))
        trainers = make_online_dpo_trainers(
            tmp_path,
            "llama",
            tokenizer,
            models=(policy, reference),
            use_vllm=True,
            vllm_mode=mode,
            generation_kwargs=eos_logit_bias(tokenizer),
        )
    runs = []
    for trainer in trainers:
        runs.append(train_online_dpo(trainer))
        rows = 2 * trainer.args.per_device_train_batch_size  # two completions per prompt
        check_engine(vllm, trainer, trainer.state.global_step, rows, sync=trainer._move_model_to_vllm)
    assert_same_runs(*runs)


def test_wrong_mask_fails_with_vllm(tmp_path, tokenizer, model_path, vllm, monkeypatch):
    """The comparison above can fail: with a mask that lets a prompt's generations see each other, the shared run's
    old-policy log-probs (hence importance ratios, loss and weights) are not stock's."""
    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    # "prompts": a join that moves no positions, so no start-up check stops the wrong mask before the comparison
    prompts = {"prefix_sharing_join": "prompts"}
    stock, shared = group_runs(vllm, "grpo", "server", model_path, tokenizer, tmp_path, shared=prompts, max_steps=1)
    with pytest.raises(AssertionError):
        assert_same_runs(stock, shared)
