"""Long-run hardening: resume from a mid-run checkpoint (packing; and DPO, reward, KTO, ORPO, CPO, GRPO as stock
resumes), bf16 tolerance, QLoRA."""

import json

import pytest
import torch
import trl

from trl_prefix_sharing import DPOTrainer
from trl_prefix_sharing.testing import FAMILIES, make_model, synthetic_pairs
from trl_prefix_sharing.testing.equivalence import (
    assert_same_number,
    assert_same_training,
    awkward_text_dataset,
    compare_step,
    dpo_args,
    leaky_dpo_mask,
    make_reward_trainers,
    make_trainers,
    tie_free_text_dataset,
    train_and_evaluate,
)


def _losses(trainer):
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}


def test_resume_mid_epoch_sees_the_same_batches(tmp_path, tokenizer):
    """A run resumed from a mid-epoch checkpoint (packing sampler included) continues exactly as an uninterrupted
    one."""
    dataset = synthetic_pairs(20, (5, 60), (1, 10), seed=50)
    model, ref = make_model("llama", len(tokenizer), seed=0), make_model("llama", len(tokenizer), seed=1)
    ours = {"prefix_sharing": True, "packing": True}
    common = dict(
        per_device_train_batch_size=2, num_train_epochs=2, save_strategy="steps", save_steps=3, learning_rate=1e-3
    )
    full = DPOTrainer(
        model=model,
        ref_model=ref,
        args=dpo_args(tmp_path, ours, **common),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    steps_per_epoch = len(full.get_train_dataloader())
    assert steps_per_epoch > 3  # the checkpoint at step 3 is mid-epoch
    full.train()
    expected = _losses(full)
    checkpoint = f"{full.args.output_dir}/checkpoint-3"
    resumed = DPOTrainer(
        model=make_model("llama", len(tokenizer), seed=0),
        ref_model=make_model("llama", len(tokenizer), seed=1),
        args=dpo_args(tmp_path, ours, **common),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    got = _losses(resumed)
    later = [step for step in expected if step > 3]
    assert later and all(step in got for step in later)
    for step in later:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    config = json.loads(open(f"{checkpoint}/config.json").read())
    assert not any("attn" in key for key in config)


#: the runs of `test_resume_from_checkpoint_as_stock_resumes`: this many steps, a checkpoint after `RESUME_FROM`
RESUME_STEPS, RESUME_FROM = 4, 2
#: logged values that are wall-clock timings, not numbers of the training
TIMINGS = ("runtime", "per_second", "step_time", "total_flos")
#: a running total only prefix sharing logs -> stock's running total it continues (or restarts) like on resume
RUNNING_TOTALS = {"num_shared_tokens": "num_tokens"}


def _stock_and_ours(kind: str, directory, tokenizer) -> list:
    """(stock TRL's trainer, ours with `prefix_sharing=True`) of `kind` from identical weights and data, in batches of
    2 (the checkpoint is mid-epoch), saving a checkpoint every `RESUME_FROM` steps. SGD with momentum: an optimizer
    state to restore, at a fraction of the cost of the default fused AdamW here (about 0.2 s a step on 2 busy CPUs)."""
    fields = dict(max_steps=RESUME_STEPS, save_strategy="steps", save_steps=RESUME_FROM)
    fields.update(optim="sgd", optim_args="momentum=0.9", learning_rate=0.05, gradient_checkpointing=False)
    if kind == "grpo":  # two prompts of 4 generations per step
        from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, prompt_dataset, save_model

        path = save_model(directory, "llama", tokenizer)
        return [
            make_group_trainer("grpo", ours, path, prompt_dataset(), tokenizer, directory, **fields)
            for ours in (False, True)
        ]
    fields["per_device_train_batch_size"] = 2
    if kind == "kto":  # the KL term on (sequential batches)
        from test_kto_equivalence import make_trainers as make_kto_trainers
        from test_kto_equivalence import unpaired_dataset

        return make_kto_trainers(directory, tokenizer, unpaired_dataset(), **fields)
    if kind in ("orpo", "cpo"):
        from test_orpo_cpo_equivalence import make_trainers as make_paired_trainers

        options = {"loss_type": "sigmoid"} if kind == "cpo" else {}
        return make_paired_trainers(directory, kind, tokenizer, tie_free_text_dataset(), **fields, **options)
    make = make_trainers if kind == "dpo" else make_reward_trainers
    return make(directory, "llama", tie_free_text_dataset(), tokenizer, **fields)


def _lines_after_checkpoint(trainer) -> dict:
    """Step -> every number of its training log line (timings aside: the loss, each metric, `grad_norm`), for the
    steps after the checkpoint (a resumed trainer's history starts with the checkpoint's lines)."""
    return {
        log["step"]: {key: value for key, value in log.items() if not any(word in key for word in TIMINGS)}
        for log in trainer.state.log_history
        if "loss" in log and log["step"] > RESUME_FROM
    }


def _close(got, expected, atol=1e-5, rtol=1e-4) -> bool:
    return abs(got - expected) <= atol + rtol * abs(expected)


def _assert_same_lines(expected: dict, got: dict, keys, what: str, atol=1e-5, rtol=1e-4) -> None:
    """`got` logged, on the steps of `expected`, each of `keys` (all of `expected`'s when None) as `expected` did."""
    assert sorted(expected) == list(range(RESUME_FROM + 1, RESUME_STEPS + 1)) and sorted(got) == sorted(expected)
    for step, line in expected.items():
        compared = [key for key in line if keys is None or key in keys]
        assert "loss" in compared and len(compared) >= 5 and set(compared) <= set(got[step]), (what, step, compared)
        for key in compared:
            assert_same_number(got[step][key], line[key], f"{what}, step {step}, {key}", atol, rtol)


def _assert_same_weights(expected, got, what: str, atol=1e-5, rtol=1e-4) -> None:
    weights = {name: p.detach() for name, p in expected.model.named_parameters() if p.requires_grad}
    got_weights = {name: p.detach() for name, p in got.model.named_parameters() if p.requires_grad}
    assert weights and set(got_weights) == set(weights)
    for name, weight in weights.items():
        assert weight.numel() > 0
        torch.testing.assert_close(
            got_weights[name], weight, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{what}, {name}: {m}"
        )


@pytest.mark.parametrize("kind", ["dpo", "reward", "kto", "orpo", "cpo", "grpo"])
def test_resume_from_checkpoint_as_stock_resumes(tmp_path, tokenizer, kind):
    """Stock TRL and prefix sharing each train `RESUME_STEPS` steps with a mid-epoch checkpoint after `RESUME_FROM`;
    fresh trainers resume from those checkpoints (the same global seed before each `train()`, as a script sets it:
    the random sampler's order is drawn from it). The resumed shared run logs the same numbers on the later steps and
    ends on the same weights as (b) stock TRL resumed the same way, and as (a) the uninterrupted shared run: every
    number but those stock's own resume does not reproduce (a cumulative counter TRL restarts, such as KTO's and the
    reward trainer's `num_tokens`). Its checkpoint's model config is stock's."""
    full = _stock_and_ours(kind, tmp_path / "full", tokenizer)
    for trainer in full:
        torch.manual_seed(0)
        trainer.train()
    assert "prefix_sharing" not in type(full[0]).__module__ and "prefix_sharing" in type(full[1]).__module__
    checkpoints = [f"{trainer.args.output_dir}/checkpoint-{RESUME_FROM}" for trainer in full]
    configs = [json.loads(open(f"{checkpoint}/config.json").read()) for checkpoint in checkpoints]
    assert configs[0] and configs[1] == configs[0]
    resumed = _stock_and_ours(kind, tmp_path / "resumed", tokenizer)
    for trainer, checkpoint in zip(resumed, checkpoints, strict=True):
        torch.manual_seed(0)
        trainer.train(resume_from_checkpoint=checkpoint)
    (stock_full, ours_full), (stock_resumed, ours_resumed) = (
        [_lines_after_checkpoint(trainer) for trainer in runs] for runs in (full, resumed)
    )
    # (b): every number stock logs; ours may log more (e.g. GRPO's `num_shared_tokens`)
    _assert_same_lines(stock_resumed, ours_resumed, None, "ours resumed vs stock resumed")
    _assert_same_weights(resumed[0], resumed[1], "ours resumed vs stock resumed")
    # (a): stock's numbers that its own resume reproduces (the loss among them), and every number only ours logs;
    # ours' running total of computed positions resumes as stock's `num_tokens` does
    not_reproduced = {
        key
        for step, line in stock_full.items()
        for key, value in line.items()
        if not _close(stock_resumed[step][key], value)
    }
    not_reproduced |= {ours for ours, stock in RUNNING_TOTALS.items() if stock in not_reproduced}
    keys = {key for line in ours_full.values() for key in line} - not_reproduced
    _assert_same_lines(ours_full, ours_resumed, keys, "ours resumed vs ours uninterrupted")
    _assert_same_weights(full[1], resumed[1], "ours resumed vs ours uninterrupted")


#: bf16 tolerance on per-pair summed log-probs (nats, absolute: a relative one would grow with the sum, 1e-2 of a
#: 240-nat sum let a 0.5-nat error through). Measured by `PYTHONPATH=. python tests/cuda/bf16_spread.py --seeds 0 1 2 3
#: 4` (+ `--autocast`, `--flex`; CPU, bf16 weights, the four families x 5 seeds x {awkward_text_dataset, 8 synthetic
#: pairs}, sums up to 241 nats): shared vs stock (SDPA) at most 0.0010 on sums, 0.0020 per token (the same with
#: autocast); shared through FlexAttention (CPU forward) 0.0034; stock against itself in another layout (16 more
#: pad columns 0.0012, one pair per batch 0.0025, reversed order 0). 2x the largest of those layout spreads.
BF16_SUM_ATOL = 5e-3
BF16_DATA = {"awkward_text": awkward_text_dataset, "synthetic": lambda: synthetic_pairs(8, (1, 40), (1, 12), seed=5)}


def _half_a_nat_on_one_token(shared_forward):
    """A deliberately wrong shared forward: 0.5 nats more on the last token of the longest completion (a sum of about
    240 nats, where a relative tolerance of 1e-2 would let it through)."""

    def forward(*args, **kwargs):
        outputs = shared_forward(*args, **kwargs)
        row = int(outputs.label_mask.sum(1).argmax())
        outputs.log_probs[row, int(outputs.label_mask[row].nonzero()[-1])] += 0.5
        return outputs

    return forward


def _bf16_log_probs(tmp_path, tokenizer, family, dataset):
    model = make_model(family, len(tokenizer)).to(torch.bfloat16)
    ref = make_model(family, len(tokenizer), seed=1).to(torch.bfloat16)
    stock, shared = make_trainers(tmp_path, family, dataset, tokenizer, model=model, ref_model=ref)
    examples = list(stock.train_dataset)
    results = []
    for trainer in (stock, shared):
        batch = trainer._prepare_inputs(trainer.data_collator(examples))
        results.append(trainer.compute_ref_log_probs(trainer.model, batch))
    assert all(p.dtype == torch.bfloat16 for t in (stock, shared) for p in t.model.parameters())
    return results


def _assert_bf16_close(stock_logps, shared_logps):
    for expected, got in zip(stock_logps, shared_logps, strict=True):
        assert expected.numel() > 0  # TRL's fused head sums the per-token log-probs in fp32
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=BF16_SUM_ATOL)


@pytest.mark.parametrize("data", list(BF16_DATA))
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_log_probs_within_bf16_tolerance(tmp_path, tokenizer, family, data):
    """In bf16, prefix sharing changes the order of some reductions (other row shapes), not the math: per-pair
    log-probs stay within bf16 round-off of stock TRL's, as close as stock is to itself in another layout."""
    _assert_bf16_close(*_bf16_log_probs(tmp_path, tokenizer, family, BF16_DATA[data]()))


@pytest.mark.parametrize("wrong", ["half_a_nat_on_one_token", "leaky_mask"])
def test_bf16_tolerance_catches_a_wrong_shared_forward(tmp_path, tokenizer, monkeypatch, wrong):
    """The bf16 tolerance fails 0.5 nats on one token and a mask that lets rejected see chosen (the former rtol 1e-2,
    atol 0.05 let both through)."""
    import trl_prefix_sharing.attention as attention_module
    import trl_prefix_sharing.forward as forward_module

    if wrong == "leaky_mask":
        monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    else:
        wrong_forward = _half_a_nat_on_one_token(forward_module._shared_forward)
        monkeypatch.setattr(forward_module, "_shared_forward", wrong_forward)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        _assert_bf16_close(*_bf16_log_probs(tmp_path, tokenizer, "qwen3", awkward_text_dataset()))


@pytest.mark.parametrize("kernel", ["sdpa", "varlen"])
def test_qlora_4bit_matches_stock(tmp_path, tokenizer, kernel):
    """4-bit QLoRA (bitsandbytes, NF4) with prefix sharing, on the dense mask and on the varlen kernel (its CPU
    reference), trains like stock TRL with the same adapters: log-probs,
    loss and metrics to 1e-5. The adapters' gradients agree to bf16 round-off (relative 1e-2, about 4e-3 in norm
    here, 2**-8): bitsandbytes' CPU 4-bit backward is not fp32-exact, so rows of other shapes round differently
    (stock TRL against itself is bitwise equal; unquantized LoRA agrees to 1e-5, test_dpo_equivalence). The start-up
    check runs on the quantized PEFT model (`prefix_sharing_model_check="always"`) and passes."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = tmp_path / "base"
    make_model("qwen2", len(tokenizer), seed=3).save_pretrained(path)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], lora_dropout=0.0
    )
    trainers = []
    ours_fields = {"prefix_sharing": True, "prefix_sharing_model_check": "always"}
    for ours in (None, {**ours_fields, "prefix_sharing_attn_implementation": kernel}):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.float32)
        cls = trl.DPOTrainer if ours is None else DPOTrainer
        trainers.append(
            cls(
                model=model,
                args=dpo_args(tmp_path, ours, gradient_checkpointing=False),
                train_dataset=awkward_text_dataset(),
                processing_class=tokenizer,
                peft_config=lora,
            )
        )
    assert any("4bit" in type(m).__name__ for m in trainers[1].model.modules())
    for trainer in trainers:  # adapters away from zero, identically, so the policy differs from the reference
        torch.manual_seed(7)
        for name, param in trainer.model.named_parameters():
            if "lora_" in name:
                param.data.normal_(0, 0.05)
    _, shared = compare_step(*trainers, grad_tolerances={"atol": 1e-4, "rtol": 1e-2})
    assert shared["grads"] and all("lora" in name for name in shared["grads"])
    assert trainers[1].model_check.result.passed  # the start-up check runs on the quantized PEFT model too


def test_kto_batch_moved_as_a_copy_still_shares_its_prompts(tmp_path, tokenizer, monkeypatch):
    """Under several CPU processes `accelerator.device` is `cpu:0`, and TRL's KTO moves the batch there as a copy: the
    merged KL pass must still find its rows (before the fix its KL log-probs stayed at the placeholder's zeros)."""
    import accelerate
    from test_kto_equivalence import make_trainers as make_kto_trainers
    from test_kto_equivalence import unpaired_dataset

    from trl_prefix_sharing import KTOTrainer

    monkeypatch.setattr(accelerate.Accelerator, "device", property(lambda self: torch.device("cpu", 0)))
    stock, shared = make_kto_trainers(tmp_path, tokenizer, unpaired_dataset(), ours={"prefix_sharing_merge_kl": True})
    assert isinstance(shared, KTOTrainer) and stock.accelerator.device == torch.device("cpu", 0)
    runs = [train_and_evaluate(trainer) for trainer in (stock, shared)]
    assert any(log.get("kl", 0) > 0 for log in runs[0][0])
    assert_same_training(*runs, ours_only=("num_shared_tokens",))
