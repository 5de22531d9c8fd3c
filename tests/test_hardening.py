"""Long-run hardening: resume mid-epoch with packing, bf16 tolerance, QLoRA."""

import json

import pytest
import torch
import trl
from equivalence import awkward_text_dataset, compare_step, dpo_args, leaky_dpo_mask, make_trainers

from trl_prefix_sharing import DPOTrainer
from trl_prefix_sharing.testing import FAMILIES, make_model, synthetic_pairs


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


#: bf16 tolerance on per-pair summed log-probs (nats, absolute: a relative one would grow with the sum, 1e-2 of a
#: 240-nat sum let a 0.5-nat error through). Measured by `PYTHONPATH=. python tests/bf16_spread.py --seeds 0 1 2 3 4`
#: (+ `--autocast`, `--flex`; CPU, bf16 weights, the four families x 5 seeds x {awkward_text_dataset, 8 synthetic
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


def test_qlora_4bit_matches_stock(tmp_path, tokenizer):
    """4-bit QLoRA (bitsandbytes, NF4) with prefix sharing trains like stock TRL with the same adapters: log-probs,
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
    for ours in (None, {"prefix_sharing": True, "prefix_sharing_model_check": "always"}):
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
    assert trainers[1].sharing.model_check_result.passed  # the start-up check runs on the quantized PEFT model too
