"""Launched by tests/integration/test_distributed.py through torch.distributed.run on CPU (gloo): the prefix-shared
forward under FSDP2 (`fully_shard` per decoder layer and on the root, optionally with gradient checkpointing) gives the
log-probs (DPO's fused head) or rewards (sequence classification) and the gradients of the unsharded stock forward.
Each rank takes its own examples; FSDP averages the gradients over ranks, as the expected gradient does. The mask
travels as a
forward argument, so the recomputation under checkpointing and FSDP's unshard/reshard hooks see it."""

import argparse
import copy
import dataclasses
import os
import sys
import warnings


warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from trl_prefix_sharing.attention import BACKENDS  # noqa: E402
from trl_prefix_sharing.collator import PrefixSharingCollator  # noqa: E402
from trl_prefix_sharing.forward import install_prefix_sharing_forward  # noqa: E402
from trl_prefix_sharing.testing import make_config, make_tokenizer  # noqa: E402


PAIRS = [
    ("w1 w2 w3 w4 w5", " w6 w7", " w8"),
    ("w9 w10", " w11", " w12 w13 w14"),
    ("w20 w21 w22 w23 w24 w25 w26", " w27 w28 w29", " w27 w30"),
    ("w31", " w32", " w32"),
]


def batch_for(tokenizer, kind, pairs):
    eos = [tokenizer.eos_token_id]
    if kind == "dpo":
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        examples = [
            {
                "prompt_ids": tokenizer(p).input_ids,
                "chosen_ids": tokenizer(c).input_ids + eos,
                "rejected_ids": tokenizer(r).input_ids + eos,
            }
            for p, c, r in pairs
        ]
        base = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    else:
        from trl.trainer.reward_trainer import DataCollatorForPreference

        examples = [
            {"chosen_ids": tokenizer(p + c).input_ids + eos, "rejected_ids": tokenizer(p + r).input_ids + eos}
            for p, c, r in pairs
        ]
        base = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)
    return PrefixSharingCollator(base, pad_token_id=tokenizer.pad_token_id)(examples)


def outputs(model, kind, batch, shared):
    """Per-pair summed completion log-probs (DPO) or rewards (reward model)."""
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if shared:
        layout = batch["prefix_sharing"]
        layout = dataclasses.replace(layout, attention=BACKENDS["sdpa"].inputs(layout, model.config))
        kwargs["prefix_sharing"] = layout
    if kind == "dpo":
        labels = batch["input_ids"].masked_fill(~batch["completion_mask"].bool(), -100)
        return model(**kwargs, labels=labels, fused_lm_head=True).log_probs.sum(-1)
    return model(**kwargs).logits.squeeze(-1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=["dpo", "reward"], default="dpo")
    parser.add_argument("--checkpointing", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = make_tokenizer()
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl.trainer.utils import add_fused_lm_head

    config = make_config("qwen2", len(tokenizer), num_labels=1)
    cls = AutoModelForCausalLM if args.kind == "dpo" else AutoModelForSequenceClassification
    torch.manual_seed(0)
    stock = cls.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32)
    model = copy.deepcopy(stock)
    if args.kind == "dpo":
        add_fused_lm_head(stock)
        add_fused_lm_head(model)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    install_prefix_sharing_forward(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)

    per_rank = [PAIRS[r::world] for r in range(world)]
    expected = [outputs(stock, args.kind, batch_for(tokenizer, args.kind, pairs), False) for pairs in per_rank]
    (sum(e.sum() for e in expected) / world).backward()  # FSDP averages the ranks' gradients
    got = outputs(model, args.kind, batch_for(tokenizer, args.kind, per_rank[rank]), True)
    got.sum().backward()
    assert got.numel() > 0
    torch.testing.assert_close(got, expected[rank], atol=1e-5, rtol=1e-5)
    checked = 0
    for (name, param), (_, reference) in zip(model.named_parameters(), stock.named_parameters(), strict=True):
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        torch.testing.assert_close(grad, reference.grad, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        checked += 1
    assert checked > 10 and type(model).__name__.startswith("FSDP")
    print(f"rank {rank}: {checked} gradients equal under FSDP2", flush=True)
    dist.barrier()  # then exit without interpreter-exit destructors (see distributed_train.finish)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
