"""Compile stability of the CUDA path, guarded on CPU: the trainer set up as on CUDA (FlexAttention, compiled
`create_block_mask`, transformers' compiled `flex_attention`, shared rows rounded to FlexAttention's block size) runs
forward passes over 36 batches of varying lengths, policy and reference passes, training and evaluation mode. Every
loss and metric equals stock TRL's (dense SDPA rows); each compiled function needs at most 2 variants; FlexAttention
never runs uncompiled. (CPU has FlexAttention's forward, not its backward: tests/cuda/test_cuda.py trains through
it.)"""

import functools

import torch

from trl_prefix_sharing import attention, mask
from trl_prefix_sharing.testing import synthetic_pairs
from trl_prefix_sharing.testing.compile_watch import CompileWatch, compile_schedule, cuda_schedule_data
from trl_prefix_sharing.testing.equivalence import assert_same_number, make_trainers


#: compiled variants each of `create_block_mask` and `flex_attention` may need: the first shape, and the row count
#: made dynamic by the epoch's shorter last batch. The shared width stays in one bucket: on CPU a dynamic width hits a
#: torch 2.13 bug in the CPU FlexAttention kernel (docs/benchmarks/gpu_tests.md); tests/cuda/test_cuda.py crosses
#: buckets and adds a one-row batch (dynamo specialises sizes 0 and 1). Each compilation costs 10-20 s of CPU here.
MAX_VARIANTS = 2


def as_on_cuda(monkeypatch):
    """The trainer's own CUDA set-up, on CPU: FlexAttention (refused on CPU only because it has no backward there)
    and the compiled `create_block_mask` (compiled by default on CUDA only)."""
    force_flex_attention(monkeypatch)
    monkeypatch.setattr(attention, "block_mask", functools.partial(mask.block_mask, compile=True))


def force_flex_attention(monkeypatch):
    """`"auto"` takes FlexAttention on this device, which then counts as one it can train on."""
    monkeypatch.setattr(attention, "_auto_candidates", lambda device: ("flex_attention",))
    monkeypatch.setattr(attention.FlexBackend, "unavailable", lambda self, *args, **kwargs: None)


def forward(trainer, examples, mode):
    trainer.model.train(mode == "train")
    trainer._metrics[mode].clear()
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    return loss, {key: values[-1] for key, values in trainer._metrics[mode].items()}, batch


def test_flex_attention_compiles_a_bounded_number_of_times_and_equals_stock(tmp_path, tokenizer, monkeypatch):
    as_on_cuda(monkeypatch)
    # documents of 5 to 112 tokens: the raw shared widths vary from batch to batch, all within one 128-token bucket
    train, evaluation = synthetic_pairs(46, (1, 50), (1, 30), seed=5), synthetic_pairs(8, (1, 50), (1, 30), seed=6)
    stock, shared = make_trainers(tmp_path, "llama", train, tokenizer, eval_dataset=evaluation)
    for trainer in (stock, shared):
        trainer.ref_model.eval()  # as `from_pretrained` leaves it: every step switches FlexAttention's training flag
    assert shared.sharing_session.backend.name == "flex_attention" and shared.data_collator.rows.multiple == 128
    # each pair its own document, so that every width stays in one 128-token bucket: pairs that share a prompt start
    # join one longer document (tests/equivalence/test_trie_sharing.py), which can cross buckets and make the width
    # dynamic, and a dynamic width hits the CPU kernel bug above (tests/cuda/test_cuda.py crosses buckets on CUDA)
    shared.data_collator.across_examples = False
    datasets = {
        "train": (stock.train_dataset, shared.train_dataset),
        "eval": (stock.eval_dataset, shared.eval_dataset),
    }
    schedule = compile_schedule(len(train), len(evaluation), batch_size=4, steps=30, eval_every=10)
    widths, rows = set(), set()
    with CompileWatch(monkeypatch) as watch:
        for mode, indices in schedule:
            stock_data, shared_data = datasets[mode]
            stock_loss, stock_metrics, _ = forward(stock, [stock_data[i] for i in indices], mode)
            loss, metrics, batch = forward(shared, [shared_data[i] for i in indices], mode)
            layout = batch["prefix_sharing"]
            assert type(layout.attention.mask).__name__ == "BlockMask"
            widths.add(int((layout.document_ids >= 0).sum(1).max()))
            rows.add(layout.input_ids.shape[0])
            torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
            assert {"logps/chosen", "logps/rejected", "rewards/margins"} <= set(stock_metrics)
            for key, value in stock_metrics.items():
                assert_same_number(metrics[key], value, f"{mode} metric {key}", atol=1e-5, rtol=1e-5)
        report = watch.assert_compiled_and_bounded(MAX_VARIANTS)
    assert report["train_eval_switches"] >= 2 * 30 - 1  # policy (train), then reference (eval), every training step
    assert len(schedule) >= 30 and len(widths) >= 10 and rows == {2, 4}, (len(schedule), widths, rows)
    print(
        f"compile report over {len(schedule)} batches (widths {min(widths)}-{max(widths)}, rows {sorted(rows)}):",
        report,
    )


def test_shared_rows_are_rounded_to_the_flex_block_size_unless_set():
    flex, sdpa, varlen = (attention.BACKENDS[name] for name in ("flex_attention", "sdpa", "varlen"))
    assert flex.rows(None).multiple == 128
    assert flex.rows(1).multiple == 1  # rounding off
    assert flex.rows(64).multiple == 64
    assert sdpa.rows(None).multiple is None  # dense attention: no extra padding
    assert varlen.rows(64).stream and varlen.rows(64).width(100) == 100  # one row, never rounded


def test_full_and_sliding_layers_share_one_compiled_variant(tmp_path, tokenizer, monkeypatch):
    """A model mixing full and sliding-window layers gets two BlockMasks per step, and batches shorter than the window
    need none: one mask structure (the window a tensor) keeps all of them to one compiled variant (two before)."""
    as_on_cuda(monkeypatch)
    short, long = synthetic_pairs(4, (1, 4), (1, 4), seed=7), synthetic_pairs(8, (20, 40), (5, 20), seed=8)
    config_kwargs = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}
    trainers = [
        make_trainers(tmp_path, "qwen3", data, tokenizer, config_kwargs=config_kwargs) for data in (short, long)
    ]
    with CompileWatch(monkeypatch) as watch:
        for (stock, shared), batches in zip(trainers, ([range(4)], [range(4), range(4, 8)]), strict=True):
            for trainer in (stock, shared):
                trainer.ref_model.eval()
            for indices in batches:
                stock_loss, _, _ = forward(stock, [stock.train_dataset[i] for i in indices], "train")
                loss, _, batch = forward(shared, [shared.train_dataset[i] for i in indices], "train")
                torch.testing.assert_close(loss, stock_loss, atol=1e-5, rtol=1e-5)
                assert batch["prefix_sharing"].input_ids.shape == (4, 128)
                masks = batch["prefix_sharing"].attention.mask
                assert isinstance(masks, dict) and set(masks) == {"full_attention", "sliding_attention"}
        report = watch.assert_compiled_and_bounded(1)
    print("full and sliding layers:", report)


def test_the_cuda_compile_schedule_crosses_two_width_buckets(tmp_path, tokenizer, monkeypatch):
    """tests/cuda/test_cuda.py's compile test measures the variants a dynamic width needs only if its batches, rounded
    to FlexAttention's blocks as on CUDA, take more than one width (its first GPU run had one): checked here on the
    collator alone, without a forward."""
    as_on_cuda(monkeypatch)
    train, evaluation = cuda_schedule_data()
    _, shared = make_trainers(tmp_path, "llama", train, tokenizer, eval_dataset=evaluation)
    assert shared.data_collator.rows.multiple == 128
    data = {"train": shared.train_dataset, "eval": shared.eval_dataset}
    shapes = set()
    for mode, indices in compile_schedule(len(train), len(evaluation), batch_size=4, steps=30, eval_every=10):
        shapes.add(tuple(shared.data_collator([data[mode][i] for i in indices])["prefix_sharing"].input_ids.shape))
    assert {width for _, width in shapes} == {128, 256} and {rows for rows, _ in shapes} == {1, 2, 4}, shapes
