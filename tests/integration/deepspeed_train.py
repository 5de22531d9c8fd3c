"""Launched by tests/integration/test_deepspeed.py through `accelerate launch` with a DeepSpeed ZeRO-2 or ZeRO-3 config
on CPU (gloo, `use_cpu: true`, no mixed precision), and by tests/integration/test_distributed.py through
torch.distributed.run (plain DDP, gloo). Trains stock TRL and the prefix-shared trainer one after the other in the same
processes, under the same config, from the same weights on the same data, and writes for each run: the logged losses
and log lines, the trained weights (gathered from the ZeRO-3 partitions) and how the parameters were partitioned
(DeepSpeed only).

`--runs` picks the runs: `dpo` (stock, then ours with sharing), `reward`, `kto` (with its KL term), `orpo`, `cpo`
(`loss_type="sigmoid"`) (the same; ours with `prefix_sharing_score_padding=True`, so that every logged number is
stock's), `dpo-varlen` (as `dpo`, ours with `prefix_sharing_attn_implementation="varlen"`: its reference on the CPU),
`dpo-packing` (ours with sharing and packing; its stock counterpart is `dpo-replay`, stock TRL on one process taking,
step by step, the union of the packed batches of the 2 ranks as one ordinary batch: the plain mean over the same
pairs)."""

import argparse
import copy
import json
import os
import sys
import warnings


warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import datasets  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from distributed_train import ReplayRanks, finish  # noqa: E402

from trl_prefix_sharing import (  # noqa: E402
    CPOConfig,
    CPOTrainer,
    DPOConfig,
    DPOTrainer,
    KTOConfig,
    KTOTrainer,
    ORPOConfig,
    ORPOTrainer,
    RewardConfig,
    RewardTrainer,
)
from trl_prefix_sharing.testing import make_config, make_model, make_tokenizer, synthetic_pairs  # noqa: E402
from trl_prefix_sharing.testing.equivalence import CPU_RUN  # noqa: E402


def make_models(tokenizer) -> dict:
    """Initial weights, made before any trainer exists: once DeepSpeed ZeRO-3 is configured (by the first trainer),
    transformers builds new models under `deepspeed.zero.Init`, which initialises them differently, so each run
    starts from a deep copy of these."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    reward = AutoModelForSequenceClassification.from_config(
        make_config("llama", len(tokenizer), num_labels=1), attn_implementation="sdpa", dtype=torch.float32
    )
    policy_and_reference = (make_model("qwen2", len(tokenizer), seed=0), make_model("qwen2", len(tokenizer), seed=1))
    return {
        "dpo": policy_and_reference,
        "kto": policy_and_reference,
        "orpo": policy_and_reference[:1],
        "cpo": policy_and_reference[:1],
        "reward": (reward,),
    }


def trainer_classes() -> dict:
    """kind: (stock trainer, stock config, ours, our config, options of both) of the trainers built alike (KTO, ORPO,
    CPO): a policy, KTO's reference, `max_length` (the data is never truncated)."""
    from trl.experimental.cpo import CPOConfig as StockCPOConfig
    from trl.experimental.cpo import CPOTrainer as StockCPOTrainer
    from trl.experimental.orpo import ORPOConfig as StockORPOConfig
    from trl.experimental.orpo import ORPOTrainer as StockORPOTrainer

    return {
        "kto": (trl.KTOTrainer, trl.KTOConfig, KTOTrainer, KTOConfig, {"loss_type": "kto"}),  # with the KL term
        "orpo": (StockORPOTrainer, StockORPOConfig, ORPOTrainer, ORPOConfig, {}),
        "cpo": (StockCPOTrainer, StockCPOConfig, CPOTrainer, CPOConfig, {"loss_type": "sigmoid"}),
    }


def unpaired(dataset):
    """KTO's unpaired format from preference pairs: each pair's chosen answer (desirable) or rejected one
    (undesirable), so micro-batches of 2 hold both labels, or one of them only."""
    rows = [
        {"prompt": row["prompt"], "completion": row["chosen" if i % 3 else "rejected"], "label": bool(i % 3)}
        for i, row in enumerate(dataset)
    ]
    return datasets.Dataset.from_list(rows)


def make_trainer(kind, ours, out, tokenizer, dataset, models, **fields):
    common = dict(
        output_dir=os.path.join(out, "run"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        **CPU_RUN,
        learning_rate=0.1,
        optim="sgd",
        max_length=None,
        train_sampling_strategy="sequential",
    )  # the same batches for both runs (packing: its own sampler)
    common.update(fields)
    ours_fields = ours or {}
    if kind in ("orpo", "cpo") and ours is not None:  # each row's padding computed: `logits/*` stock's too
        ours_fields = {"prefix_sharing_score_padding": True, **ours_fields}
    if kind in ("kto", "orpo", "cpo"):
        stock_cls, stock_config, cls, config, options = trainer_classes()[kind]
        common.update(max_length=512, **options)
        args = config(**common, **ours_fields) if ours is not None else stock_config(**common)
        extra = {"ref_model": copy.deepcopy(models[kind][1])} if kind == "kto" else {}
        return (cls if ours is not None else stock_cls)(
            model=copy.deepcopy(models[kind][0]),
            args=args,
            train_dataset=unpaired(dataset) if kind == "kto" else dataset,
            processing_class=tokenizer,
            **extra,
        )
    if kind == "dpo":
        model, ref = (copy.deepcopy(m) for m in models["dpo"])
        args = DPOConfig(**common, **ours_fields) if ours is not None else trl.DPOConfig(**common)
        cls = DPOTrainer if ours is not None else trl.DPOTrainer
        return cls(model=model, ref_model=ref, args=args, train_dataset=dataset, processing_class=tokenizer)
    common["center_rewards_coefficient"] = 0.01
    args = RewardConfig(**common, **ours_fields) if ours is not None else trl.RewardConfig(**common)
    cls = RewardTrainer if ours is not None else trl.RewardTrainer
    return cls(model=copy.deepcopy(models["reward"][0]), args=args, train_dataset=dataset, processing_class=tokenizer)


def partitioning(trainer) -> dict | None:
    """How the trained model's parameters and optimizer state are held on this rank (DeepSpeed only)."""
    if not trainer.is_deepspeed_enabled:
        return None
    engine = trainer.model_wrapped
    params = list(engine.module.parameters())
    optimizer = engine.optimizer
    master = getattr(optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3
    if master is None:
        master = getattr(optimizer, "single_partition_of_fp32_groups", [])  # ZeRO-1/2
    return {
        "stage": engine.zero_optimization_stage(),
        "local": sum(p.numel() for p in params),  # ZeRO-3: empty placeholders
        "partition": sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor")),
        "full": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "optimizer_partition": sum(t.numel() for t in master),
    }


def full_weights(trainer) -> dict:
    params = dict(trainer.accelerator.unwrap_model(trainer.model_wrapped).named_parameters())
    if not trainer.is_deepspeed_enabled:
        return {name: p.detach().clone() for name, p in params.items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().clone() for name, p in params.items()}


def without_shm_allreduce() -> None:
    """DeepSpeed JIT-compiles a shared-memory allreduce for CPU (C++ through ninja: minutes on 2 cores) when it first
    initialises; mark it unavailable so that DeepSpeed uses torch.distributed's gloo collectives, as it does where the
    op cannot build. (`__compatible_ops__` is one dict cached in the module, read when DeepSpeed initialises.)"""
    try:
        import deepspeed.ops
    except ImportError:  # a DDP launch without DeepSpeed installed
        return
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main():
    without_shm_allreduce()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", required=True)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    dataset = synthetic_pairs(16, (1, 60), (1, 12), seed=21)
    models = make_models(tokenizer)
    results = {}
    for run in args.runs.split(","):
        kind = run.split("-")[0]
        if run in ("dpo", "reward", "kto", "orpo", "cpo", "dpo-varlen"):
            # the start-up check too: the policy under ZeRO's hooks (stage 3: partitioned parameters), ranks agreeing
            kernel = {"prefix_sharing_attn_implementation": "varlen"} if run.endswith("-varlen") else {}
            todo = [
                ("stock", None, {}),
                ("ours", {"prefix_sharing": True, "prefix_sharing_model_check": "always", **kernel}, {}),
            ]
        elif run == "dpo-packing":
            todo = [
                (
                    "ours",
                    {"prefix_sharing": True, "packing": True},
                    {"gradient_accumulation_steps": 1, "per_device_train_batch_size": 3},
                )
            ]
        else:  # dpo-replay: one process, the packed batches of 2 ranks as ordinary stock batches
            todo = [("stock", None, {"gradient_accumulation_steps": 1, "per_device_train_batch_size": 3})]
        for label, ours, fields in todo:
            trainer = make_trainer(kind, ours, args.out, tokenizer, dataset, models, **fields)
            if run == "dpo-replay":
                planner = make_trainer(
                    kind, {"prefix_sharing": True, "packing": True}, args.out, tokenizer, dataset, models, **fields
                )
                replay = ReplayRanks(
                    planner.packed_batches.unit_lengths(planner.train_dataset),
                    planner.packed_batches.resolve_length(),
                    num_replicas=2,
                    rank=0,
                    seed=0,
                    shuffle=True,
                )
                trainer._get_train_sampler = lambda train_dataset=None, replay=replay: replay
            loader = trainer.get_train_dataloader()
            sampler = getattr(loader.batch_sampler, "batch_sampler", loader.batch_sampler)
            pairs_per_batch = [len(b) for b in sampler] if "packing" in run else []
            trainer.train()
            logs = [log for log in trainer.state.log_history if "loss" in log]
            losses = [log["loss"] for log in logs]
            weights = full_weights(trainer)
            results[f"{run}/{label}"] = {
                "losses": losses,
                "logs": logs,
                "partitioning": partitioning(trainer),
                "world": trainer.args.world_size,
                "pairs_per_batch": pairs_per_batch,
                "check": None
                if getattr(trainer, "sharing_session", None) is None or trainer.model_check.result is None
                else trainer.model_check.result.summary(),
            }
            if trainer.args.process_index == 0:
                torch.save(weights, os.path.join(args.out, f"{run}-{label}.pt"))
    with open(os.path.join(args.out, f"rank{int(os.environ.get('RANK', 0))}.json"), "w") as f:
        json.dump(results, f)
    finish()


if __name__ == "__main__":
    main()
