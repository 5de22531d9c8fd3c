"""CUDA only (skipped elsewhere): the paths CUDA users take. In fp32 `prefix_sharing_attn_implementation="auto"` is
compiled `create_block_mask` + transformers' compiled `flex_attention` (the varlen kernel computes in bf16/fp16 only);
it trains to stock TRL's numbers (FlexAttention has no backward on CPU, so this is where its gradients are checked),
compiles a bounded number of times and never runs FlexAttention uncompiled. In bf16 (TRL's default) `"auto"` is the
varlen kernel, PyTorch's FlashAttention-2 varlen on each trie branch's gathered path. 87 tests; run them with
`python scripts/gpu_check.py --part tests --out DIR`, which also collects the compile counts and the peak memory they
record. Commands and results: docs/benchmarks/gpu_tests.md.

- the FlexAttention matrix: the four families x {sharing, sharing + packing} x {DPO, reward, ranked reward}, fp32
  (TF32 off), equal to stock at the CPU tests' tolerance (1e-5), gradient checkpointing on (TRL's default, switched on
  as `train()` does);
- the prefix trie, KTO, ORPO and CPO; sharing across examples (`prefix_sharing_join="always"`) and SFT (every join);
- bf16 within the tolerance of the user guide's "Precision" (docs/guide.md); every trainer's policy and reference
  passes under `bf16=True` in stock's dtype (on varlen, which `"auto"` takes there); sliding-window models; LoRA;
  GRPO and online DPO passes;
- compile stability over 39 training and evaluation steps of varying lengths; peak memory of a long-row step;
- the varlen matrix, bf16 against stock bf16: DPO (four families x {sharing, packing}), reward (pairs, ranked), the
  trie and joins, sliding windows (`window_size=(W-1, 0)`), LoRA, GRPO and online DPO (scored padding: a second,
  non-causal call); the kernel against the CPU tests' reference (GQA, a window, scored padding), forward and
  backward; the float32, deterministic gather; the peak memory of a 6,000-token prompt with 8 branches.

The tiny models get a head size of 16 (`CUDA_SIZES`): CUDA FlexAttention refuses head sizes under 16 ("NYI: embedding
dimension of the query, key, and value must be at least 16"), and the tiny models' default is 8.
"""

import pytest
import torch
from test_mixed_precision import TRAINERS as MIXED_PRECISION_TRAINERS
from test_mixed_precision import check_passes_in_stocks_dtype
from test_reward_equivalence import ranked_dataset

from trl_prefix_sharing.ranked import expand_ranked_to_pairs
from trl_prefix_sharing.testing import FAMILIES, make_model, synthetic_pairs
from trl_prefix_sharing.testing.compile_watch import CompileWatch, compile_schedule, cuda_schedule_data
from trl_prefix_sharing.testing.equivalence import (
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


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention backward)")

FP32 = {"atol": 1e-5, "rtol": 1e-5}  # the CPU tests' tolerance
# bf16 per-pair summed log-probs and loss, absolute (a relative 1e-2 let 0.5 nats through on a 240-nat sum): measured
# on CPU only (tests/cuda/bf16_spread.py, see BF16_SUM_ATOL in tests/equivalence/test_hardening.py): FlexAttention's
# CPU forward at most 0.0034 nats from stock, SDPA 0.0010; about 3x that here for the CUDA kernels, not measured on a
# GPU yet
BF16 = {"atol": 0.01, "rtol": 0}
ON_GPU = {"use_cpu": False, "gradient_checkpointing": True}
#: config overrides of every model built here: hidden 64 over 4 heads, a head size of 16 (CUDA FlexAttention's least)
CUDA_SIZES = {"hidden_size": 64}


#: sliding-window models: every layer slides (varlen: `window_size=(5, 0)`), or full and sliding layers
SLIDING = [
    ("mistral", {"sliding_window": 6}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
]


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


def on_cuda(make, *args, gpu=ON_GPU, config_kwargs=None, **kwargs):
    """`make(*args, ...)`'s stock and sharing trainers on CUDA (`gpu`: the arguments that put them there), the tiny
    models at `CUDA_SIZES` (plus `config_kwargs`), checkpointing on as `train()` turns it on."""
    config_kwargs = {**CUDA_SIZES, **(config_kwargs or {})}
    return checkpoint_as_train_does(*make(*args, config_kwargs=config_kwargs, **gpu, **kwargs))


def _check_flex_trainer(trainer):
    """Called after a step: FlexAttention chosen, checkpointing still on (TRL's reference pass switches it off and
    back), a head size CUDA FlexAttention accepts."""
    assert trainer.sharing_session.backend.name == "flex_attention"
    assert is_checkpointing(trainer.model)
    assert head_size(trainer.model.config) >= 16


def _check_flex(trainer, batch):
    """`_check_flex_trainer`, and the batch's masks are BlockMasks."""
    _check_flex_trainer(trainer)
    masks = batch["prefix_sharing"].attention.mask
    masks = masks.values() if isinstance(masks, dict) else [masks]
    assert all(type(mask).__name__ == "BlockMask" for mask in masks)


def _ours(packing, **extra):
    return {"prefix_sharing": True, "packing": packing, **({"packing_length": 512} if packing else {}), **extra}


# ------------------------------------------------------------------------------------------------- the fp32 matrix
@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_step_matches_stock(tmp_path, tokenizer, family, packing):
    stock, shared = on_cuda(make_trainers, tmp_path, family, awkward_text_dataset(), tokenizer, ours=_ours(packing))
    _, result = compare_step(stock, shared, **FP32)
    _check_flex(shared, result["batch"])
    if packing:
        assert result["batch"]["prefix_sharing"].input_ids.shape == (1, 512)  # FlexAttention: one packed row
    else:
        assert result["batch"]["prefix_sharing"].input_ids.shape[1] % 128 == 0  # rows rounded to the block size


@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reward_step_matches_stock(tmp_path, tokenizer, family, packing):
    stock, shared = on_cuda(
        make_reward_trainers, tmp_path, family, awkward_text_dataset(), tokenizer, ours=_ours(packing)
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
    stock, ours = on_cuda(
        make_reward_trainers,
        tmp_path,
        family,
        ranked,
        tokenizer,
        stock_dataset=pairs,
        ours=_ours(packing),
        center_rewards_coefficient=0.1,
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

    stock, shared = on_cuda(make_trainers, tmp_path, "llama", DATASETS[data](), tokenizer, ours=_ours(packing))
    examples = list(stock.train_dataset)
    expected, got = step(stock, examples), step(shared, examples)
    assert_same_step(expected, got, **FP32)
    _check_flex(shared, got["batch"])
    assert positions(got["batch"]) < int(expected["batch"]["attention_mask"].sum())


def test_reward_trie_matches_stock(tmp_path, tokenizer):
    from test_trie_sharing import all_pairs_dataset

    stock, shared = on_cuda(make_reward_trainers, tmp_path, "qwen3", all_pairs_dataset(), tokenizer, ours=_ours(False))
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

    stock, shared = on_cuda(
        make_kto_trainers,
        tmp_path,
        tokenizer,
        unpaired_dataset(),
        family=family,
        ours={"prefix_sharing_merge_kl": merge},
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
    stock, shared = on_cuda(make_orpo_cpo_trainers, tmp_path, kind, tokenizer, dataset, family=family, **options)
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
    stock, shared = on_cuda(make_trainers, tmp_path, "qwen3", system_prompt_pairs(), tokenizer, ours=ours)
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

    stock, shared = on_cuda(
        make_sft_trainers, tmp_path, tokenizer, DATASETS[data](), family=family, ours={"prefix_sharing_join": join}
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
    stock, shared = on_cuda(
        make_trainers,
        tmp_path,
        family,
        awkward_text_dataset(),
        tokenizer,
        model=model,
        ref_model=ref,
        bf16=True,
        ours=_ours(False, prefix_sharing_attn_implementation="flex_attention"),  # "auto" takes varlen in bf16
    )
    examples = list(stock.train_dataset)
    stock_result, shared_result = step(stock, examples), step(shared, examples)
    _check_flex(shared, shared_result["batch"])
    assert all(p.dtype == torch.bfloat16 for p in shared.model.parameters())
    for key in ("chosen", "rejected", "loss"):
        assert stock_result[key].numel() > 0
        torch.testing.assert_close(shared_result[key].float(), stock_result[key].float(), **BF16)


@pytest.mark.parametrize("kind", list(MIXED_PRECISION_TRAINERS))
def test_bf16_autocast_passes_run_in_stocks_dtype(tmp_path, tokenizer, monkeypatch, kind):
    """`bf16=True` (TRL's default): every trainer runs its policy and reference passes in stock's dtype through the
    kernel `"auto"` takes in bf16, the varlen kernel (KTO's KL rows, ORPO and CPO, SFT, GRPO's groups, online DPO's
    scored padding as a second, non-causal call), and the first step logs stock's numbers (online DPO's first KL
    exactly 0)."""
    import trl_prefix_sharing.sharing as sharing_module

    chosen, choose = [], sharing_module.choose_backend
    monkeypatch.setattr(sharing_module, "choose_backend", lambda *a, **k: chosen.append(choose(*a, **k)) or chosen[-1])
    check_passes_in_stocks_dtype(
        tmp_path, tokenizer, kind, model_kwargs=CUDA_SIZES, atol=BF16["atol"], rtol=1e-2, **ON_GPU
    )
    assert chosen and {backend.name for backend in chosen} == {"varlen"}


@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
@pytest.mark.parametrize("family,config_kwargs", SLIDING)
def test_sliding_window_matches_stock(tmp_path, tokenizer, family, config_kwargs, packing):
    stock, shared = on_cuda(
        make_trainers,
        tmp_path,
        family,
        awkward_text_dataset(),
        tokenizer,
        config_kwargs=config_kwargs,
        ours=_ours(packing),
    )
    _, result = compare_step(stock, shared, **FP32)
    _check_flex(shared, result["batch"])


@pytest.mark.parametrize("kernel", ["flex_attention", "varlen"])
def test_dpo_lora_matches_stock(tmp_path, tokenizer, kernel):
    """LoRA (the reference: adapters disabled): FlexAttention in fp32 at 1e-5, the varlen kernel in bf16."""
    from peft import LoraConfig

    varlen = kernel == "varlen"
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    stock, shared = on_cuda(
        make_trainers,
        tmp_path,
        "llama",
        awkward_text_dataset(),
        tokenizer,
        ref_model=None,
        peft_config=lora,
        ours=_ours(False, prefix_sharing_attn_implementation=kernel),
        gpu=VARLEN_ON_GPU if varlen else ON_GPU,
    )
    for trainer in (stock, shared):  # adapters away from zero: the policy differs from the reference (adapters off)
        torch.manual_seed(7)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.05)
    examples = list(stock.train_dataset)
    expected, result = step(stock, examples), step(shared, examples)
    if varlen:
        _check_varlen(shared, result["batch"])
        _assert_bf16_close(expected, result)
    else:
        assert_same_step(expected, result, **FP32)
        _check_flex(shared, result["batch"])
    assert result["grads"] and all("lora" in name for name in result["grads"])


def test_reward_lora_matches_stock(tmp_path, tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    stock, shared = on_cuda(
        make_reward_trainers, tmp_path, "qwen2", awkward_text_dataset(), tokenizer, peft_config=lora
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
    stock, shared = on_cuda(make_trainers, tmp_path, "llama", train, tokenizer, eval_dataset=evaluation)
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
    stock, shared = on_cuda(
        make_trainers,
        tmp_path,
        "qwen3",
        dataset,
        tokenizer,
        config_kwargs={"max_position_embeddings": 2 * length},
        ours={"prefix_sharing": True, "packing": True, "packing_length": length},
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
    from test_grpo_equivalence import crafted_batch, logps_and_grads
    from test_online_dpo_equivalence import forward_and_grads
    from test_online_dpo_equivalence import make_trainers as make_online_dpo_trainers

    from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, prompt_dataset, save_model

    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    path = save_model(tmp_path, family, tokenizer, **CUDA_SIZES)
    stock, shared = (
        make_group_trainer("grpo", ours, path, prompt_dataset(), tokenizer, tmp_path, use_cpu=False)
        for ours in (False, True)
    )
    assert shared.sharing_session.backend.name == "flex_attention" and head_size(shared.model.config) >= 16
    expected, got = (logps_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared))
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-4)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-4, rtol=1e-3)
    stock, shared = make_online_dpo_trainers(
        tmp_path / "online", family, tokenizer, config_kwargs=CUDA_SIZES, use_cpu=False
    )
    assert shared.sharing_session.backend.name == "flex_attention" and head_size(shared.model.config) >= 16
    (expected, expected_grads), (got, grads) = (
        forward_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared)
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-4, rtol=1e-3)


# ------------------------------------------------------------------------------------------------- the varlen kernel
#: the varlen kernel computes in bf16 (TRL's default `bf16=True`: autocast over float32 weights)
VARLEN_ON_GPU = {**ON_GPU, "bf16": True}
#: per-token log-probs under bf16 autocast, and each gradient against the largest of its tensor: the CPU reference in
#: bf16 measured up to 1.3e-2 of the largest gradient (tests/equivalence/test_mixed_precision.py); a leaky mask moves
#: log-probs by tenths of a nat
BF16_GRAD_SHARE = 5e-2


def _varlen(packing=False, **extra):
    return {**_ours(packing), "prefix_sharing_attn_implementation": "varlen", **extra}


def _check_varlen(trainer, batch=None):
    """The varlen backend ran: one unpadded row of query segments, checkpointing still on where it was asked."""
    assert trainer.sharing_session.backend.name == "varlen"
    assert trainer.model.config._attn_implementation == "prefix_sharing_varlen"
    if batch is not None:
        layout = batch["prefix_sharing"]
        assert layout.input_ids.shape[0] == 1 and bool((layout.document_ids >= 0).all()) and layout.segments


def _assert_bf16_close(expected: dict, got: dict, keys=("chosen", "rejected", "loss")):
    """bf16 numbers of a step: `keys` within `BF16`, finite; every gradient finite and within `BF16_GRAD_SHARE` of
    the largest of its tensor."""
    for key in keys:
        assert expected[key].numel() > 0 and torch.isfinite(got[key]).all(), key
        torch.testing.assert_close(got[key].float(), expected[key].float(), **BF16)
    assert expected["grads"] and set(got["grads"]) == set(expected["grads"])
    for name, grad in expected["grads"].items():
        scale = grad.float().abs().max().clamp(min=1e-6)
        assert torch.isfinite(got["grads"][name]).all(), name
        assert (got["grads"][name].float() - grad.float()).abs().max() <= BF16_GRAD_SHARE * scale, name


@pytest.mark.parametrize("packing", [False, True], ids=["sharing", "sharing+packing"])
@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_dpo_step_matches_stock_in_bf16(tmp_path, tokenizer, family, packing):
    """`"auto"` in bf16 takes varlen: DPO's log-probs, loss and gradients are stock bf16's to bf16 round-off, with no
    padding in the row (packing: a token budget, not a padded row)."""
    stock, shared = on_cuda(
        make_trainers, tmp_path, family, awkward_text_dataset(), tokenizer, ours=_ours(packing), gpu=VARLEN_ON_GPU
    )
    examples = list(stock.train_dataset)
    expected, got = step(stock, examples), step(shared, examples)
    _check_varlen(shared, got["batch"])
    _assert_bf16_close(expected, got)
    assert positions(got["batch"]) == got["batch"]["prefix_sharing"].input_ids.numel()


@pytest.mark.parametrize("data", ["pairs", "ranked"])
def test_varlen_reward_step_matches_stock_in_bf16(tmp_path, tokenizer, data):
    ranked = data == "ranked"
    dataset = ranked_dataset() if ranked else awkward_text_dataset()
    stock, shared = on_cuda(
        make_reward_trainers,
        tmp_path,
        "qwen2",
        dataset,
        tokenizer,
        stock_dataset=expand_ranked_to_pairs(dataset) if ranked else None,
        ours=_varlen(),
        gpu=VARLEN_ON_GPU,
    )
    expected, got = reward_step(stock, list(stock.train_dataset)), reward_step(shared, list(shared.train_dataset))
    _check_varlen(shared, got["batch"])
    assert torch.isfinite(got["loss"]) and all(torch.isfinite(g).all() for g in got["grads"].values())
    torch.testing.assert_close(got["loss"].float(), expected["loss"].float(), **BF16)  # ranked: over its pairs


@pytest.mark.parametrize("data", ["all_pairs", "multi_turn"])
def test_varlen_trie_and_join_match_stock_in_bf16(tmp_path, tokenizer, data):
    from test_trie_sharing import DATASETS

    stock, shared = on_cuda(
        make_trainers,
        tmp_path,
        "qwen3",
        DATASETS[data](),
        tokenizer,
        ours=_varlen(prefix_sharing_join="always"),
        gpu=VARLEN_ON_GPU,
    )
    examples = list(stock.train_dataset)
    expected, got = step(stock, examples), step(shared, examples)
    _check_varlen(shared, got["batch"])
    _assert_bf16_close(expected, got)
    assert positions(got["batch"]) < int(expected["batch"]["attention_mask"].sum())


@pytest.mark.parametrize("family,config_kwargs", SLIDING)
def test_varlen_sliding_window_matches_stock_in_bf16(tmp_path, tokenizer, family, config_kwargs):
    stock, shared = on_cuda(
        make_trainers,
        tmp_path,
        family,
        awkward_text_dataset(),
        tokenizer,
        config_kwargs=config_kwargs,
        ours=_varlen(),
        gpu=VARLEN_ON_GPU,
    )
    examples = list(stock.train_dataset)
    expected, got = step(stock, examples), step(shared, examples)
    _check_varlen(shared, got["batch"])
    _assert_bf16_close(expected, got)


def _reference_attention(query, key, value, segments, scale, window):
    """`varlen.segment_attention` with every call through the reference implementation (SDPA per segment)."""
    from trl_prefix_sharing import varlen

    out = query.new_zeros(query.shape)
    for call in segments:
        rows = torch.arange(query.shape[0], device=query.device) if call.query_index is None else call.query_index
        k, v = key.index_select(0, call.key_index), value.index_select(0, call.key_index)
        out = out.index_copy(0, rows, varlen._reference(query[rows], k, v, call, scale, window))
    return out


@pytest.mark.parametrize(
    "case", ["gqa", "gqa-window", "mha-scored-padding"], ids=["gqa", "gqa-window-3", "mha-scored-padding"]
)
def test_varlen_kernel_equals_the_reference_forward_and_backward(case):
    """PyTorch's FlashAttention-2 varlen kernel on a trie's segments (bottom-right causal, GQA, `window_size=(W-1,
    0)`, the scored padding's non-causal call) against the CPU tests' reference in float32, outputs and the
    gradients of queries, keys and values (through the float32 gather)."""
    import random

    from test_layout import _stock

    from trl_prefix_sharing import varlen
    from trl_prefix_sharing.layout import RowPolicy, build_layout
    from trl_prefix_sharing.trie import StockRows

    rng = random.Random(0)
    rows = [[rng.randrange(1, 4) for _ in range(rng.randrange(20, 90))] for _ in range(6)]
    rows += [row[: rng.randrange(1, len(row))] + [7, 8, 9] for row in rows[:4]]
    if case == "mha-scored-padding":
        ids, attn, _ = _stock(rows)
        layout = build_layout(
            StockRows.generated(ids, attn, 2, score_padding=True), pad_token_id=0, rows=RowPolicy(stream=True)
        )
        assert len(layout.segments) == 2
    else:
        layout = build_layout(StockRows(*_stock(rows)[:2]), rows=RowPolicy(stream=True))
    layout = layout.to("cuda")
    window = 3 if case == "gqa-window" else None
    heads = (4, 4) if case.startswith("mha") else (8, 2)
    width = layout.input_ids.shape[1]
    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(width, h, 64, device="cuda", generator=generator) for h in (heads[0], heads[1], heads[1])]
    weights = torch.randn(width, heads[0], 64, device="cuda", generator=generator)
    results = []
    for dtype, attend in ((torch.bfloat16, varlen.segment_attention), (torch.float32, _reference_attention)):
        leaves = [t.to(dtype).requires_grad_() for t in tensors]
        out = attend(*leaves, layout.segments, 0.125, window)
        (out.float() * weights).sum().backward()
        results.append([out.detach().float()] + [t.grad.float() for t in leaves])
    for name, got, expected in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert torch.isfinite(got).all() and expected.abs().sum() > 0, name
        scale = expected.abs().max()
        assert (got - expected).abs().max() <= 2e-2 * scale, (name, float((got - expected).abs().max()), float(scale))


def test_varlen_gather_sums_in_float32_and_is_deterministic_on_cuda():
    """The gathered keys' gradient on CUDA: sort-based float32 accumulation, the same bits every run, where
    `index_select`'s own backward adds the bfloat16 gradients with atomics in bfloat16."""
    from trl_prefix_sharing import varlen

    source = torch.zeros(64, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    index = torch.randint(0, 4, (1 << 16,), device="cuda")  # four prefix rows read 16k times each
    grad = torch.rand(index.shape[0], 128, device="cuda").to(torch.bfloat16)
    expected = torch.zeros(64, 128, dtype=torch.float64, device="cuda").index_add_(0, index, grad.double())
    sums = []
    for _ in range(3):
        source.grad = None
        varlen.gather_rows(source, index).backward(grad)
        sums.append(source.grad.clone())
    assert all(torch.equal(sums[0], other) for other in sums[1:])
    ours = (sums[0].double() - expected).abs().max()
    source.grad = None
    source.index_select(0, index).backward(grad)
    atomics = (source.grad.double() - expected).abs().max()
    assert ours <= expected.abs().max() * 2**-8 < atomics, (float(ours), float(atomics))


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_varlen_grpo_and_online_dpo_log_probs_in_bf16(tmp_path, tokenizer, family):
    """GRPO's passes (left-padded prompts, groups) and online DPO's `_forward` (scored padding: the second call) on
    the varlen kernel, bf16 models: stock bf16's log-probs to bf16 round-off, finite gradients."""
    from test_grpo_equivalence import crafted_batch, logps_and_grads
    from test_online_dpo_equivalence import forward_and_grads
    from test_online_dpo_equivalence import make_trainers as make_online_dpo_trainers

    from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, prompt_dataset, save_model

    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    path = save_model(tmp_path, family, tokenizer, **CUDA_SIZES)
    init = {"model_init_kwargs": {"dtype": torch.bfloat16}}
    stock, shared = (
        make_group_trainer("grpo", ours, path, prompt_dataset(), tokenizer, tmp_path, use_cpu=False, **init)
        for ours in (False, {"prefix_sharing_attn_implementation": "varlen"})
    )
    expected, got = (logps_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared))
    assert shared.sharing_session.backend.name == "varlen"
    mask = attention_mask[:, -keep:].bool()
    assert (got[0][mask].float() - expected[0][mask].float()).abs().max() <= 0.05
    assert all(torch.isfinite(grad).all() for grad in got[2].values()) and got[2]
    stock, shared = make_online_dpo_trainers(
        tmp_path / "online",
        family,
        tokenizer,
        models=[make_model(family, len(tokenizer), seed=s, **CUDA_SIZES).to(torch.bfloat16) for s in (0, 1)],
        ours={"prefix_sharing_attn_implementation": "varlen"},
        use_cpu=False,
    )
    assert shared.sharing_session.backend.name == "varlen"
    (expected, _), (got, grads) = (forward_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared))
    assert (got.float() - expected.float()).abs().max() <= 0.05  # padding columns included
    assert all(torch.isfinite(grad).all() for grad in grads.values()) and grads


def test_varlen_memory_of_a_long_shared_prompt_with_8_branches(tmp_path, tokenizer, record_property):
    """One 6,000-token prompt and 8 completions of 200 tokens (a GRPO group in one chunk), forward and backward: the
    varlen row holds the prompt once (6,000 + 8 x 201 = 7,608 positions against stock's 8 x 6,200 = 49,600), the K/V
    of each branch's path gathered per layer; its peak memory is recorded beside stock's and FlexAttention's, and is
    under half of stock's."""
    from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, prompt_dataset, save_model

    prompt_length, completion_length, branches = 6000, 200, 8
    path = save_model(tmp_path, "qwen3", tokenizer, **CUDA_SIZES, max_position_embeddings=8192)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, len(tokenizer), (prompt_length,), generator=generator)
    completions = torch.randint(10, len(tokenizer), (branches, completion_length), generator=generator)
    input_ids = torch.cat([prompt.expand(branches, -1), completions], dim=1).cuda()
    attention_mask = torch.ones_like(input_ids)

    def pass_and_backward(trainer):
        trainer.model.zero_grad(set_to_none=True)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, completion_length, batch_size=branches
        )
        logps.float().sum().backward()
        return logps

    peaks = {}
    for name, ours in (
        ("stock", False),
        ("varlen", {"prefix_sharing_attn_implementation": "varlen"}),
        ("flex_attention", {"prefix_sharing_attn_implementation": "flex_attention"}),
    ):
        init = {"model_init_kwargs": {"dtype": torch.bfloat16}}
        trainer = make_group_trainer("grpo", ours, path, prompt_dataset(), tokenizer, tmp_path, use_cpu=False, **init)
        pass_and_backward(trainer)  # compile, allocate
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        logps = pass_and_backward(trainer)
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**30
        assert torch.isfinite(logps).all()
        del trainer
    record_property("peak_memory_gb", {f"long_prompt_8_branches_{name}": peak for name, peak in peaks.items()})
    print("peak memory (GB) of a 6,000-token prompt with 8 branches:", peaks)
    assert peaks["varlen"] < peaks["stock"] / 2
