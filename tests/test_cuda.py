"""CUDA only (skipped elsewhere): the path CUDA users take, `prefix_sharing_attn_implementation="auto"` = compiled
`create_block_mask` + transformers' compiled `flex_attention`, trains to stock TRL's numbers (FlexAttention has no
backward on CPU, so this is where its gradients are checked), compiles a bounded number of times and never runs
FlexAttention uncompiled. 65 tests; run them with `python scripts/gpu_check.py --part tests --out DIR`, which also
collects the compile counts and the long-row peak memory they record. Commands and results:
docs/benchmarks/gpu_tests.md.

- the matrix: the four families x {sharing, sharing + packing} x {DPO, reward, ranked reward}, fp32 (TF32 off), equal
  to stock at the CPU tests' tolerance (1e-5), gradient checkpointing on (TRL's default, switched on as `train()`
  does);
- the prefix trie, KTO, ORPO and CPO; sharing across examples (`prefix_sharing_join="always"`) and SFT (every join);
- bf16 within the tolerance of the user guide's "Precision" (docs/guide.md); every trainer's policy and reference
  passes under `bf16=True` in stock's dtype; sliding-window models; LoRA; GRPO and online DPO passes;
- compile stability over 39 training and evaluation steps of varying lengths; peak memory of a long-row step.

The tiny models get a head size of 16 (`CUDA_SIZES`): CUDA FlexAttention refuses head sizes under 16 ("NYI: embedding
dimension of the query, key, and value must be at least 16"), and the tiny models' default is 8.
"""

import pytest
import torch
from compile_watch import CompileWatch, compile_schedule, cuda_schedule_data
from equivalence import (
    assert_same_loss_metrics_grads,
    assert_same_reward_step,
    assert_same_step,
    awkward_text_dataset,
    compare_step,
    make_reward_trainers,
    make_trainers,
    positions,
    reward_step,
    step,
)
from test_mixed_precision import TRAINERS as MIXED_PRECISION_TRAINERS
from test_mixed_precision import check_passes_in_stocks_dtype
from test_reward_equivalence import ranked_dataset

from trl_prefix_sharing.ranked import expand_ranked_to_pairs
from trl_prefix_sharing.testing import FAMILIES, make_model, synthetic_pairs


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention backward)")

FP32 = {"atol": 1e-5, "rtol": 1e-5}  # the CPU tests' tolerance
# bf16 per-pair summed log-probs and loss, absolute (a relative 1e-2 let 0.5 nats through on a 240-nat sum): measured
# on CPU only (tests/bf16_spread.py, see BF16_SUM_ATOL in tests/test_hardening.py): FlexAttention's CPU forward at most
# 0.0034 nats from stock, SDPA 0.0010; about 3x that here for the CUDA kernels, not measured on a GPU yet
BF16 = {"atol": 0.01, "rtol": 0}
ON_GPU = {"use_cpu": False, "gradient_checkpointing": True}
#: config overrides of every model built here: hidden 64 over 4 heads, a head size of 16 (CUDA FlexAttention's least)
CUDA_SIZES = {"hidden_size": 64}


@pytest.fixture(autouse=True)
def exact_fp32_and_fresh_compiles():
    """TF32 off (FlexAttention's kernels follow `allow_tf32` too), and each test starts from no compiled variants, as
    one training process would."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.reset()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def head_size(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def is_checkpointing(model) -> bool:
    """transformers' own test (`is_activation_checkpointing`), without its deprecated alias's warning."""
    return any(getattr(module, "gradient_checkpointing", False) for module in model.modules())


def checkpoint_as_train_does(*trainers):
    """Turn on activation checkpointing as `Trainer.train()` does. transformers 5.23 switches it on in `train()`, not
    when the trainer is built, and these tests call the loss directly; TRL's default `gradient_checkpointing=True`
    would otherwise never run here."""
    for trainer in trainers:
        args = trainer.args
        assert args.gradient_checkpointing
        kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
        kwargs = dict(kwargs or {})
        kwargs.pop("every_n_layers", None), kwargs.pop("offload", None)
        if hasattr(trainer.model, "activation_checkpointing_enable"):
            trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
        else:
            trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
        assert is_checkpointing(trainer.model)
    return trainers


def _check_flex_trainer(trainer):
    """Called after a step: FlexAttention chosen, checkpointing still on (TRL's reference pass switches it off and
    back), a head size CUDA FlexAttention accepts."""
    assert trainer.sharing.attn_implementation == "flex_attention"
    assert is_checkpointing(trainer.model)
    assert head_size(trainer.model.config) >= 16


def _check_flex(trainer, batch):
    """`_check_flex_trainer`, and the batch's masks are BlockMasks."""
    _check_flex_trainer(trainer)
    masks = batch["prefix_sharing"].attention_mask
    masks = masks.values() if isinstance(masks, dict) else [masks]
    assert all(type(mask).__name__ == "BlockMask" for mask in masks)


def _ours(packing, **extra):
    return {"prefix_sharing": True, "packing": packing, **({"packing_length": 512} if packing else {}), **extra}


# ------------------------------------------------------------------------------------------------- the fp32 matrix
@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_step_matches_stock(tmp_path, tokenizer, family, packing):
    stock, shared = checkpoint_as_train_does(
        *make_trainers(
            tmp_path,
            family,
            awkward_text_dataset(),
            tokenizer,
            config_kwargs=CUDA_SIZES,
            ours=_ours(packing),
            **ON_GPU,
        )
    )
    _, result = compare_step(stock, shared, **FP32)
    _check_flex(shared, result["batch"])
    if packing:
        assert result["batch"]["prefix_sharing"].input_ids.shape == (1, 512)  # FlexAttention: one packed row
    else:
        assert result["batch"]["prefix_sharing"].input_ids.shape[1] % 128 == 0  # rows rounded to the block size


@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reward_step_matches_stock(tmp_path, tokenizer, family, packing):
    stock, shared = checkpoint_as_train_does(
        *make_reward_trainers(
            tmp_path,
            family,
            awkward_text_dataset(),
            tokenizer,
            config_kwargs=CUDA_SIZES,
            ours=_ours(packing),
            **ON_GPU,
        )
    )
    examples = list(stock.train_dataset)
    stock_result = reward_step(stock, examples)
    shared_result = reward_step(shared, examples, pairs_in_window=len(examples) if packing else None)
    _check_flex(shared, shared_result["batch"])
    assert_same_reward_step(stock_result, shared_result, **FP32)


@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_ranked_reward_step_matches_stock_on_expanded_pairs(tmp_path, tokenizer, family, packing):
    ranked = ranked_dataset()
    pairs = expand_ranked_to_pairs(ranked)
    stock, ours = checkpoint_as_train_does(
        *make_reward_trainers(
            tmp_path,
            family,
            ranked,
            tokenizer,
            stock_dataset=pairs,
            ours=_ours(packing),
            config_kwargs=CUDA_SIZES,
            center_rewards_coefficient=0.1,
            **ON_GPU,
        )
    )
    stock_result = reward_step(stock, list(stock.train_dataset))
    ours_result = reward_step(ours, list(ours.train_dataset), pairs_in_window=len(pairs) if packing else None)
    _check_flex(ours, ours_result["batch"])
    assert_same_reward_step(stock_result, ours_result, compare_rewards=False, **FP32)


# ------------------------------------------------------------------------------------------ the trie, KTO, ORPO, CPO
def _assert_flex_ran(trainer, watch):
    """`_check_flex_trainer`, and FlexAttention ran compiled (at least one variant), never eagerly: for trainers whose
    batch holds no layout."""
    _check_flex_trainer(trainer)
    report = watch.report()
    assert report["flex_attention"] >= 1 and report["create_block_mask"] >= 1, report
    assert report["eager_flex_warnings"] == 0, report


@pytest.mark.parametrize(
    "data,packing",
    [("all_pairs", False), ("multi_turn", True), ("duplicates", False)],
    ids=["all_pairs-sharing", "multi_turn-sharing+packing", "duplicates-sharing"],
)
def test_dpo_trie_matches_stock(tmp_path, tokenizer, data, packing):
    """The prefix trie: several pairs of one prompt, a pair at every turn of a conversation, duplicate prompts, merged
    into one tree per micro-batch (packed into one row with packing), equal to stock with fewer positions."""
    from test_trie_sharing import DATASETS

    stock, shared = checkpoint_as_train_does(
        *make_trainers(
            tmp_path, "llama", DATASETS[data](), tokenizer, config_kwargs=CUDA_SIZES, ours=_ours(packing), **ON_GPU
        )
    )
    examples = list(stock.train_dataset)
    expected, got = step(stock, examples), step(shared, examples)
    assert_same_step(expected, got, **FP32)
    _check_flex(shared, got["batch"])
    assert positions(got["batch"]) < int(expected["batch"]["attention_mask"].sum())


def test_reward_trie_matches_stock(tmp_path, tokenizer):
    from test_trie_sharing import all_pairs_dataset

    stock, shared = checkpoint_as_train_does(
        *make_reward_trainers(
            tmp_path, "qwen3", all_pairs_dataset(), tokenizer, config_kwargs=CUDA_SIZES, ours=_ours(False), **ON_GPU
        )
    )
    examples = list(stock.train_dataset)
    expected, got = reward_step(stock, examples), reward_step(shared, examples)
    _check_flex(shared, got["batch"])
    assert_same_reward_step(expected, got, compare_rewards=True, **FP32)


@pytest.mark.parametrize(
    "family,merge", [("llama", True), ("qwen3", False)], ids=["llama-kl-merged", "qwen3-kl-apart"]
)
def test_kto_step_matches_stock(tmp_path, tokenizer, monkeypatch, family, merge):
    from test_kto_equivalence import assert_same_step as assert_same_kto_step
    from test_kto_equivalence import kto_step, unpaired_dataset
    from test_kto_equivalence import make_trainers as make_kto_trainers

    stock, shared = checkpoint_as_train_does(
        *make_kto_trainers(
            tmp_path,
            tokenizer,
            unpaired_dataset(),
            family=family,
            ours={"prefix_sharing_merge_kl": merge},
            config_kwargs=CUDA_SIZES,
            **ON_GPU,
        )
    )
    for start in (0, 4):  # the first two batches, each with desirable and undesirable rows and their KL rows
        examples = [shared.train_dataset[i] for i in range(start, start + 4)]
        expected = kto_step(stock, examples)
        with CompileWatch(monkeypatch) as watch:
            got = kto_step(shared, examples)
            _assert_flex_ran(shared, watch)
        assert_same_kto_step(expected, got, **FP32)


@pytest.mark.parametrize(
    "family,setting",
    [("llama", "orpo-beta0.1"), ("qwen3", "cpo-sigmoid"), ("mistral", "simpo"), ("qwen2", "cpo-simpo")],
)
def test_orpo_cpo_step_matches_stock(tmp_path, tokenizer, monkeypatch, family, setting):
    from test_orpo_cpo_equivalence import SETTINGS, assert_same_batch, loss_and_grads
    from test_orpo_cpo_equivalence import make_trainers as make_orpo_cpo_trainers

    kind, options = SETTINGS[setting]
    dataset = awkward_text_dataset()
    stock, shared = checkpoint_as_train_does(
        *make_orpo_cpo_trainers(
            tmp_path, kind, tokenizer, dataset, family=family, config_kwargs=CUDA_SIZES, **options, **ON_GPU
        )
    )
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    expected = loss_and_grads(stock, examples)
    with CompileWatch(monkeypatch) as watch:
        got = loss_and_grads(shared, examples)
        _assert_flex_ran(shared, watch)
    assert_same_batch(expected, got, **FP32)


# ----------------------------------------------------------------------------------- across examples (joins), SFT
@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
def test_dpo_join_always_matches_stock(tmp_path, tokenizer, packing):
    """`prefix_sharing_join="always"`: pairs of different prompts after one system prompt, laid out as one tree (one
    row unpacked), the system prompt computed once, equal to stock with fewer positions than `"prompts"` lays out."""
    from test_join import system_prompt_pairs

    ours = _ours(packing, prefix_sharing_join="always")
    stock, shared = checkpoint_as_train_does(
        *make_trainers(
            tmp_path, "qwen3", system_prompt_pairs(), tokenizer, config_kwargs=CUDA_SIZES, ours=ours, **ON_GPU
        )
    )
    examples = list(stock.train_dataset)
    expected, got = step(stock, examples), step(shared, examples)
    assert_same_step(expected, got, **FP32)
    _check_flex(shared, got["batch"])
    assert got["batch"]["prefix_sharing"].join == "always"
    shared.data_collator.join = "prompts"
    assert positions(got["batch"]) < positions(shared.data_collator(examples))


@pytest.mark.parametrize(
    "family,data,join",
    [
        ("llama", "completions", "prompts"),  # several completions of one prompt
        ("qwen3", "messages", "always"),  # conversations after one system prompt
        ("mistral", "text", "always"),  # plain text (every token trained) after a shared preamble
        ("qwen2", "completions", "auto"),  # the join FlexAttention's cost picks
    ],
)
def test_sft_step_matches_stock(tmp_path, tokenizer, monkeypatch, family, data, join):
    """SFT: TRL's loss through its fused log-prob head, `entropy`, `mean_token_accuracy`, `num_tokens` and every
    gradient equal stock's, with fewer positions than stock's padded rows."""
    from test_sft_equivalence import DATASETS, make_sft_trainers, sft_step

    stock, shared = checkpoint_as_train_does(
        *make_sft_trainers(
            tmp_path,
            tokenizer,
            DATASETS[data](),
            family=family,
            ours={"prefix_sharing_join": join},
            config_kwargs=CUDA_SIZES,
            **ON_GPU,
        )
    )
    examples = [stock.train_dataset[i] for i in range(len(stock.train_dataset))]
    expected = sft_step(stock, examples)
    with CompileWatch(monkeypatch) as watch:
        got = sft_step(shared, examples)
        _assert_flex_ran(shared, watch)
    assert_same_loss_metrics_grads(expected, got, min_metrics=3, **FP32)
    _check_flex(shared, got[3])
    layout = got[3]["prefix_sharing"]
    assert positions(got[3]) < int(expected[3]["attention_mask"].sum())
    if join == "always":
        assert layout.join == "always" and layout.input_ids.shape[0] < len(examples)


# ------------------------------------------------------------------------------------------------- bf16, sliding, LoRA
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_log_probs_within_bf16_tolerance(tmp_path, tokenizer, family):
    model = make_model(family, len(tokenizer), **CUDA_SIZES).to(torch.bfloat16)
    ref = make_model(family, len(tokenizer), seed=1, **CUDA_SIZES).to(torch.bfloat16)
    stock, shared = checkpoint_as_train_does(
        *make_trainers(
            tmp_path, family, awkward_text_dataset(), tokenizer, model=model, ref_model=ref, bf16=True, **ON_GPU
        )
    )
    examples = list(stock.train_dataset)
    stock_result, shared_result = step(stock, examples), step(shared, examples)
    _check_flex(shared, shared_result["batch"])
    assert all(p.dtype == torch.bfloat16 for p in shared.model.parameters())
    for key in ("chosen", "rejected", "loss"):
        assert stock_result[key].numel() > 0
        torch.testing.assert_close(shared_result[key].float(), stock_result[key].float(), **BF16)


@pytest.mark.parametrize("kind", list(MIXED_PRECISION_TRAINERS))
def test_bf16_autocast_passes_run_in_stocks_dtype(tmp_path, tokenizer, kind):
    """`bf16=True` (TRL's default): DPO, reward, GRPO, RLOO, online DPO, KTO, ORPO and CPO run their policy and
    reference passes in stock's dtype through FlexAttention, and the first step logs stock's numbers (online DPO's
    first KL exactly 0)."""
    check_passes_in_stocks_dtype(
        tmp_path, tokenizer, kind, model_kwargs=CUDA_SIZES, atol=BF16["atol"], rtol=1e-2, **ON_GPU
    )


@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
@pytest.mark.parametrize(
    "family,config_kwargs",
    [
        ("mistral", {"sliding_window": 6}),  # every layer slides
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
        ),  # full and sliding layers
    ],
)
def test_sliding_window_matches_stock(tmp_path, tokenizer, family, config_kwargs, packing):
    stock, shared = checkpoint_as_train_does(
        *make_trainers(
            tmp_path,
            family,
            awkward_text_dataset(),
            tokenizer,
            config_kwargs={**CUDA_SIZES, **config_kwargs},
            ours=_ours(packing),
            **ON_GPU,
        )
    )
    _, result = compare_step(stock, shared, **FP32)
    _check_flex(shared, result["batch"])


def test_dpo_lora_matches_stock(tmp_path, tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    stock, shared = checkpoint_as_train_does(
        *make_trainers(
            tmp_path,
            "llama",
            awkward_text_dataset(),
            tokenizer,
            ref_model=None,
            peft_config=lora,
            config_kwargs=CUDA_SIZES,
            **ON_GPU,
        )
    )
    for trainer in (stock, shared):  # adapters away from zero: the policy differs from the reference (adapters off)
        torch.manual_seed(7)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.05)
    _, result = compare_step(stock, shared, **FP32)
    _check_flex(shared, result["batch"])
    assert result["grads"] and all("lora" in name for name in result["grads"])


def test_reward_lora_matches_stock(tmp_path, tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    stock, shared = checkpoint_as_train_does(
        *make_reward_trainers(
            tmp_path, "qwen2", awkward_text_dataset(), tokenizer, peft_config=lora, config_kwargs=CUDA_SIZES, **ON_GPU
        )
    )
    examples = list(stock.train_dataset)
    stock_result, shared_result = reward_step(stock, examples), reward_step(shared, examples)
    _check_flex(shared, shared_result["batch"])
    assert_same_reward_step(stock_result, shared_result, **FP32)


# ------------------------------------------------------------------------------------------------- compilation
#: compiled variants each function may need over the schedule. Measured on an H200 (torch 2.11, docs/benchmarks/
#: gpu_tests.json, "recompiles"), on a schedule whose batches all took one width: `create_block_mask` (no autograd)
#: 3 = the first shape, the one-row batch (dynamo specialises sizes 0 and 1), the row count made dynamic;
#: `flex_attention` 5 = the same per grad mode (policy passes with gradients; reference and evaluation passes
#: without), the one-row batch in one mode only. The schedule now crosses two 128-token width buckets
#: (`cuda_schedule_data`), which makes the width dynamic too: one more variant of `create_block_mask` and one per grad
#: mode of `flex_attention`, 4 and 7, the bounds, until a GPU run measures that schedule. dynamo's own limit, past
#: which FlexAttention would run eagerly, is 8.
MAX_VARIANTS = {"create_block_mask": 4, "flex_attention": 7}


def test_compiles_a_bounded_number_of_times_over_training_and_evaluation(
    tmp_path, tokenizer, monkeypatch, record_property
):
    train, evaluation = cuda_schedule_data()  # two 128-token width buckets; 4, 2 and 1 rows
    stock, shared = checkpoint_as_train_does(
        *make_trainers(
            tmp_path, "llama", train, tokenizer, eval_dataset=evaluation, config_kwargs=CUDA_SIZES, **ON_GPU
        )
    )
    for trainer in (stock, shared):
        trainer.ref_model.eval()  # as `from_pretrained` leaves it: every step switches FlexAttention's training flag
    datasets = {
        "train": (stock.train_dataset, shared.train_dataset),
        "eval": (stock.eval_dataset, shared.eval_dataset),
    }
    schedule = compile_schedule(len(train), len(evaluation), batch_size=4, steps=30, eval_every=10)
    widths, done = set(), 0
    with CompileWatch(monkeypatch) as watch:
        try:
            for mode, indices in schedule:
                stock_data, shared_data = datasets[mode]
                if mode == "train":  # a training step: policy forward and backward, reference forward
                    expected = step(stock, [stock_data[i] for i in indices])
                    got = step(shared, [shared_data[i] for i in indices])
                    for key in ("chosen", "rejected", "loss"):
                        torch.testing.assert_close(got[key], expected[key], **FP32)
                    batch = got["batch"]
                else:  # an evaluation step
                    losses = []
                    for trainer, data in ((stock, stock_data), (shared, shared_data)):
                        trainer.model.eval()
                        batch = trainer._prepare_inputs(trainer.data_collator([data[i] for i in indices]))
                        with torch.no_grad():
                            losses.append(trainer.compute_loss(trainer.model, batch))
                    torch.testing.assert_close(losses[1], losses[0], **FP32)
                _check_flex(shared, batch)
                widths.add(batch["prefix_sharing"].input_ids.shape[1])
                done += 1
        finally:  # the counts reach gpu_check's report even when an assertion below (or above) fails
            record_property(
                "compile_report",
                {
                    **watch.report(),
                    "batches": done,
                    "of": len(schedule),
                    "widths": sorted(widths),
                    "bounds": MAX_VARIANTS,
                },
            )
        report = watch.assert_compiled_and_bounded(MAX_VARIANTS)
    assert report["train_eval_switches"] >= 2 * 30 - 1
    assert len(schedule) >= 30 and len(widths) >= 2, widths  # more than one 128-token bucket
    print(f"compile report over {len(schedule)} batches (widths {sorted(widths)}):", report)


def test_long_row_step_does_not_materialise_the_score_matrix(tmp_path, tokenizer, monkeypatch, record_property):
    """One packed row of 8192 tokens, forward and backward: compiled FlexAttention needs memory linear in the row;
    eager FlexAttention (or a dense mask) would hold `rows x heads x S x S` scores, 1 GiB per layer here in fp32."""
    length, heads = 8192, 4
    dataset = synthetic_pairs(4, (1800, 1900), (20, 60), seed=9)
    stock, shared = checkpoint_as_train_does(
        *make_trainers(
            tmp_path,
            "qwen3",
            dataset,
            tokenizer,
            **ON_GPU,
            config_kwargs={**CUDA_SIZES, "max_position_embeddings": 2 * length},
            ours={"prefix_sharing": True, "packing": True, "packing_length": length},
        )
    )
    shared.ref_model.eval()
    examples = list(shared.train_dataset)
    with CompileWatch(monkeypatch) as watch:
        step(shared, examples)  # compile first
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = step(shared, examples)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        scores = 1 * heads * length * length * 4
        record_property(
            "peak_memory_gb",
            {
                f"long_row_{length}_step_above_weights": peak / 2**30,
                f"long_row_{length}_total": torch.cuda.max_memory_allocated() / 2**30,
                "one_layer_fp32_scores": scores / 2**30,
            },
        )
        record_property("long_row_compile_report", watch.report())
        watch.assert_compiled_and_bounded(MAX_VARIANTS)
    layout = result["batch"]["prefix_sharing"]
    assert layout.input_ids.shape == (1, length) and int((layout.document_ids >= 0).sum()) > length // 2
    _check_flex(shared, result["batch"])
    print(
        f"peak memory of a {length}-token step: {peak / 2**20:.1f} MiB; one layer's scores: {scores / 2**20:.0f} MiB"
    )
    assert peak < scores / 10


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_and_online_dpo_flex_log_probs_and_gradients_match_stock(tmp_path, tokenizer, family):
    """GRPO's passes and online DPO's `_forward` through FlexAttention (left-padded prompts, groups, scored padding):
    log-probs and gradients equal stock TRL's on a crafted generated batch."""
    from group_equivalence import make_group_trainer, prompt_dataset, save_model
    from test_grpo_equivalence import crafted_batch, logps_and_grads
    from test_online_dpo_equivalence import forward_and_grads
    from test_online_dpo_equivalence import make_trainers as make_online_dpo_trainers

    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    path = save_model(tmp_path, family, tokenizer, **CUDA_SIZES)
    stock, shared = (
        make_group_trainer("grpo", ours, path, prompt_dataset(), tokenizer, tmp_path, use_cpu=False)
        for ours in (False, True)
    )
    assert shared.sharing.attn_implementation == "flex_attention" and head_size(shared.model.config) >= 16
    expected, got = (logps_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared))
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-4)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-4, rtol=1e-3)
    stock, shared = make_online_dpo_trainers(
        tmp_path / "online", family, tokenizer, config_kwargs=CUDA_SIZES, use_cpu=False
    )
    assert shared.sharing.attn_implementation == "flex_attention" and head_size(shared.model.config) >= 16
    (expected, expected_grads), (got, grads) = (
        forward_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared)
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-4, rtol=1e-3)
