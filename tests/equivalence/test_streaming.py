"""Streamed (`datasets.IterableDataset`) train and eval sets with packing: no lengths to read ahead, so no multipack
sampler; the Trainer batches the stream as it does for stock TRL and the collator packs each batch as it arrives.
The default row budget comes from `max_length`, the bound every example obeys. Every pair still weighs the same."""

import pytest
import torch

from trl_prefix_sharing import DPOTrainer
from trl_prefix_sharing.layout import RowPolicy
from trl_prefix_sharing.testing import make_model, synthetic_pairs
from trl_prefix_sharing.testing.equivalence import (
    assert_same_eval_metrics,
    assert_same_step,
    dpo_args,
    make_reward_trainers,
    make_trainers,
    step,
)


MAX_LENGTH = 64


def _stream(n, seed):
    return synthetic_pairs(n, (5, 60), (1, 10), seed=seed).to_iterable_dataset()


def _make(kind, tmp_path, tokenizer, dataset, **overrides):
    if kind == "dpo":
        return make_trainers(tmp_path, "llama", dataset, tokenizer, **overrides)
    return make_reward_trainers(tmp_path, "llama", dataset, tokenizer, **overrides)


def _losses(trainer):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_streamed_packing_with_defaults_trains_like_stock_per_pair(tmp_path, tokenizer, kind):
    """A stream of 6 pairs, batches of 4 and 2 accumulated into one step: the packed step is the plain mean over its 6
    pairs, i.e. stock TRL with one batch of all 6 (not stock's mean of the two micro-batch means)."""
    common = dict(max_length=MAX_LENGTH, max_steps=1, optim="sgd", learning_rate=0.5)
    stock, packed = _make(
        kind,
        tmp_path,
        tokenizer,
        _stream(6, seed=40),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        ours={"prefix_sharing": True, "packing": True},
        **common,
    )
    one_batch, _ = _make(kind, tmp_path, tokenizer, _stream(6, seed=40), per_device_train_batch_size=6, **common)
    # the default row budget: per_device_train_batch_size x 2 rows of max_length, rounded up to 128
    assert packed.packed_batches.length == 512
    for trainer in (stock, packed, one_batch):
        trainer.train()
    assert len(_losses(packed)) == len(_losses(one_batch)) == 1
    assert _losses(packed) == pytest.approx(_losses(one_batch), rel=1e-5, abs=1e-6)
    assert _losses(stock) != pytest.approx(_losses(packed), rel=1e-3)  # the mean of means differs: not vacuous
    for (name, expected), got in zip(one_batch.model.named_parameters(), packed.model.parameters(), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert packed.state.log_history[0]["num_shared_tokens"] < packed.state.log_history[0]["num_tokens"]


@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_streamed_packing_evaluation_equals_stock(tmp_path, tokenizer, kind):
    """A streamed eval set, packed in batches of 4 as they arrive (the last one short): every metric that is a
    per-pair (or per-token) mean equals stock's over the whole set, which stock gets from one batch of all 11 pairs."""
    stock, packed = _make(
        kind,
        tmp_path,
        tokenizer,
        synthetic_pairs(4, (5, 60), (1, 10), seed=41),
        eval_dataset=_stream(11, seed=42),
        max_length=MAX_LENGTH,
        per_device_eval_batch_size=16,
        ours={"prefix_sharing": True, "packing": True},
    )
    packed.args.per_device_eval_batch_size = 4
    assert packed.packed_batches.streams() and len(list(packed.get_eval_dataloader())) == 3
    assert_same_eval_metrics(stock.evaluate(), packed.evaluate())


def test_stream_batch_larger_than_packing_length_takes_several_rows(tmp_path, tokenizer):
    """With FlexAttention's fixed rows, a stream batch that does not fit one row of `packing_length` is packed into
    several (first-fit decreasing), as `_setup_prefix_sharing` sets it up for streams; the numbers stay stock's."""
    stream = _stream(8, seed=43)
    stock, packed = make_trainers(
        tmp_path,
        "qwen2",
        stream,
        tokenizer,
        max_length=MAX_LENGTH,
        max_steps=1,
        ours={"prefix_sharing": True, "packing": True, "packing_length": 128},
    )
    # the FlexAttention stream layout
    packed.data_collator.rows = RowPolicy(pack=True, length=packed.packed_batches.length)
    examples = list(stock.train_dataset)
    assert len(examples) == 8
    packed._pairs_in_window = len(examples)  # one optimizer step of one micro-batch on one rank
    packed.current_gradient_accumulation_steps = 1
    stock_result, packed_result = step(stock, examples), step(packed, examples)
    layout = packed_result["batch"]["prefix_sharing"]
    assert layout.input_ids.shape[0] > 1 and layout.input_ids.shape[1] == 128
    assert int(layout.document_ids.max()) >= 1  # several pairs in a row
    assert_same_step(stock_result, packed_result)


def _stream_trainer(tmp_path, tokenizer, **overrides):
    return DPOTrainer(
        model=make_model("llama", len(tokenizer)),
        ref_model=make_model("llama", len(tokenizer)),
        args=dpo_args(tmp_path, {"prefix_sharing": True, "packing": True}, **overrides),
        train_dataset=_stream(4, seed=44),
        processing_class=tokenizer,
    )


def test_stream_without_a_length_bound_is_a_clear_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="packing=True` on a streamed dataset needs a bound"):
        _stream_trainer(tmp_path, tokenizer, max_length=None, max_steps=1)
    _stream_trainer(tmp_path, tokenizer, max_length=None, max_steps=1, packing_length=256)  # an explicit budget


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({}, "max_steps has to be specified"),
        (
            {"max_steps": 1, "precompute_ref_log_probs": True},
            "`precompute_ref_log_probs=True` is not supported with IterableDataset",
        ),
    ],
)
def test_trl_refusals_of_streams_come_first(tmp_path, tokenizer, overrides, message):
    """What stock refuses for a stream, it refuses first (here even with no length bound for packing)."""
    with pytest.raises(ValueError, match=message):
        _stream_trainer(tmp_path, tokenizer, max_length=None, **overrides)
