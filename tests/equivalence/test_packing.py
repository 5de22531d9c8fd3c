"""Packing: per-pair log-probs and gradients equal stock TRL's on the same pairs, across accumulation; evaluation
metrics equal stock's per-pair means; the Trainer uses the multipack sampler."""

import pytest
import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler

from trl_prefix_sharing.layout import RowPolicy
from trl_prefix_sharing.testing import synthetic_pairs
from trl_prefix_sharing.testing.equivalence import (
    assert_same_eval_metrics,
    assert_same_step,
    awkward_text_dataset,
    make_trainers,
    step,
)


def _packed_step(trainer, micro_batches):
    """Gradient of one optimizer step made of packed micro-batches, as the Trainer runs it."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    batches = [trainer._prepare_inputs(trainer.data_collator(examples)) for examples in micro_batches]
    trainer._pairs_in_window = sum(b["input_ids"].shape[0] // 2 for b in batches)
    trainer.current_gradient_accumulation_steps = len(batches)
    total = 0.0
    for batch in batches:
        loss = trainer.compute_loss(trainer.model, batch) / len(batches)  # Trainer's division by accumulation
        loss.backward()
        total += loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return total, grads


@pytest.mark.parametrize("rows", ["one_row", "dense_rows"])
@pytest.mark.parametrize("prefix_sharing", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_logps_and_gradient_equal_stock(tmp_path, tokenizer, family, prefix_sharing, rows):
    dataset = awkward_text_dataset()
    stock, packed = make_trainers(
        tmp_path,
        family,
        dataset,
        tokenizer,
        ours={"packing": True, "packing_length": 512, "prefix_sharing": prefix_sharing},
    )
    assert packed.data_collator.rows == RowPolicy(pack=True)  # dense (SDPA) backend: several rows per batch
    if rows == "one_row":  # FlexAttention's layout: the whole batch in one row of packing_length
        packed.data_collator.rows = RowPolicy(pack=True, length=packed.packed_batches.length, one_row=True)
    examples = list(stock.train_dataset)
    stock_result = step(stock, examples)
    # one optimizer step of one micro-batch on one rank, as `get_batch_samples` counts it before the step (scale 1)
    packed._pairs_in_window, packed.current_gradient_accumulation_steps = len(examples), 1
    packed_result = step(packed, examples)
    layout = packed_result["batch"]["prefix_sharing"]
    if rows == "one_row":
        assert layout.input_ids.shape == (1, 512) and int(layout.document_ids.max()) >= len(examples) - 1
    else:
        longest = int(packed.data_collator.unpacked()(examples)["prefix_sharing"].document_ids.ge(0).sum(1).max())
        assert layout.input_ids.shape[0] > 1 and layout.input_ids.shape[1] == longest
        assert int(layout.document_ids.max()) >= 1  # several documents share a row
    assert_same_step(stock_result, packed_result)
    # the same pairs as two packed micro-batches of 3 and 5 pairs in one window: the loss rescale (scale 0.75 and 1.25)
    # makes them stock's one batch; without it each micro-batch's mean would weigh its pairs unequally
    loss, grads = _packed_step(packed, [examples[:3], examples[3:]])
    torch.testing.assert_close(loss, stock_result["loss"], atol=1e-5, rtol=1e-5)
    assert grads and set(grads) == set(stock_result["grads"])
    for name, grad in stock_result["grads"].items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5)


def test_gradient_accumulation_weighs_every_pair_equally(tmp_path, tokenizer):
    dataset = synthetic_pairs(10, (1, 30), (1, 6), seed=11)
    stock, packed = make_trainers(
        tmp_path, "mistral", dataset, tokenizer, ours={"prefix_sharing": True, "packing": True, "packing_length": 512}
    )
    examples = list(stock.train_dataset)
    stock_result = step(stock, examples)  # one stock batch of all 10 pairs
    # the same pairs in two packed micro-batches of 3 and 7 pairs: plain per-micro-batch means would weigh them
    # unequally
    loss, grads = _packed_step(packed, [examples[:3], examples[3:]])
    torch.testing.assert_close(loss, stock_result["loss"], atol=1e-5, rtol=1e-5)
    assert grads
    for name, grad in stock_result["grads"].items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5)


def test_evaluate_with_packing_equals_stock_per_pair_means(tmp_path, tokenizer):
    train = synthetic_pairs(8, (1, 30), (1, 6), seed=12)
    evaluation = synthetic_pairs(11, (1, 40), (1, 8), seed=13)
    # stock evaluates all 11 pairs in one batch: its metrics are the per-pair (and per-token) means of the dataset
    stock, packed = make_trainers(
        tmp_path,
        "qwen2",
        train,
        tokenizer,
        eval_dataset=evaluation,
        per_device_eval_batch_size=16,
        ours={"prefix_sharing": True, "packing": True, "packing_length": 128},
    )
    stock_metrics = stock.evaluate()
    eval_loader = packed.get_eval_dataloader()
    assert len(eval_loader) > 2  # the packed evaluation really runs several rows with different numbers of pairs
    assert_same_eval_metrics(stock_metrics, packed.evaluate())


def test_training_uses_the_multipack_sampler(tmp_path, tokenizer):
    from trl_prefix_sharing.sampler import MultipackSampler

    dataset = synthetic_pairs(24, (5, 60), (1, 10), seed=14)
    _, packed = make_trainers(
        tmp_path,
        "llama",
        dataset,
        tokenizer,
        num_train_epochs=2,
        per_device_train_batch_size=4,
        ours={"prefix_sharing": True, "packing": True},
    )
    loader = packed.get_train_dataloader()
    sampler = (
        loader.batch_sampler.batch_sampler if hasattr(loader.batch_sampler, "batch_sampler") else loader.batch_sampler
    )
    assert isinstance(sampler, MultipackSampler)
    assert packed.packed_batches.length % 128 == 0
    assert sampler.efficiency() > 0.5
    seen = sorted(i for batch in sampler for i in batch)
    assert seen == list(range(len(packed.train_dataset)))
    packed.train()
    logs = [log for log in packed.state.log_history if "loss" in log]
    assert len(logs) == 2 * len(sampler) and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    assert logs[-1]["num_shared_tokens"] < logs[-1]["num_tokens"]


def test_over_long_example_for_packing_length_is_a_clear_error(tmp_path, tokenizer):
    _, packed = make_trainers(
        tmp_path,
        "llama",
        awkward_text_dataset(),
        tokenizer,
        ours={"prefix_sharing": True, "packing": True, "packing_length": 32},
    )
    with pytest.raises(ValueError, match=r"Item \d+ has length \d+, more than max_tokens=32"):
        packed.get_train_dataloader()


class _FixedBatches(BatchRebalanceSampler):
    """A batch sampler the Trainer passes through unchanged: exactly these batches, in this order."""

    def __init__(self, batches):
        self.batches = [list(b) for b in batches]

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self):
        return len(self.batches)

    def set_epoch(self, epoch):
        pass


def test_training_loop_with_accumulation_equals_stock_on_the_same_pairs(tmp_path, tokenizer):
    """`trainer.train()` with packing and gradient accumulation (the Trainer's own `get_batch_samples` counts the pairs
    of each window) logs the losses and reaches the weights of stock TRL trained on ordinary batches of the same pairs:
    every pair weighs the same although the packed micro-batches hold different numbers of pairs."""
    dataset = synthetic_pairs(20, (5, 60), (1, 10), seed=15)
    stock, packed = make_trainers(
        tmp_path,
        "llama",
        dataset,
        tokenizer,
        learning_rate=1e-3,
        num_train_epochs=1,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=2,
        ours={"prefix_sharing": True, "packing": True},
    )
    micro = [list(b) for b in packed._get_train_sampler()]
    assert len({len(b) for b in micro}) > 1 and len(micro) >= 4  # unequal numbers of pairs per micro-batch
    windows = [micro[i] + micro[i + 1] if i + 1 < len(micro) else micro[i] for i in range(0, len(micro), 2)]
    packed._get_train_sampler = lambda train_dataset=None: _FixedBatches(micro)
    stock._get_train_sampler = lambda train_dataset=None: _FixedBatches(windows)
    stock.args.gradient_accumulation_steps = 1
    stock.train()
    packed.train()
    stock_losses = [log["loss"] for log in stock.state.log_history if "loss" in log]
    packed_losses = [log["loss"] for log in packed.state.log_history if "loss" in log]
    assert len(stock_losses) == len(windows) > 1
    assert packed_losses == pytest.approx(stock_losses, rel=1e-4, abs=1e-6)
    for (name, expected), got in zip(stock.model.named_parameters(), packed.model.parameters(), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_batch_level_loss_types_with_packing_warn(tmp_path, tokenizer):
    from transformers.testing_utils import CaptureLogger

    import trl_prefix_sharing.dpo_trainer as dpo_module

    with CaptureLogger(dpo_module.logger) as captured:
        make_trainers(
            tmp_path,
            "llama",
            awkward_text_dataset(),
            tokenizer,
            loss_type=["sigmoid", "sft"],
            ours={"prefix_sharing": True, "packing": True},
        )
    assert "Loss types ['sft'] look at the whole batch" in captured.out


def test_mask_that_forgets_documents_fails(tmp_path, tokenizer, monkeypatch):
    """A packed row whose mask lets a token see another example must break the comparison."""
    import trl_prefix_sharing.attention as attention_module
    from trl_prefix_sharing.mask import on_path

    stock, packed = make_trainers(
        tmp_path,
        "llama",
        awkward_text_dataset(),
        tokenizer,
        ours={"prefix_sharing": True, "packing": True, "packing_length": 512},
    )
    packed.data_collator.rows = RowPolicy(
        pack=True, length=packed.packed_batches.length, one_row=True
    )  # all examples in one row
    examples = list(stock.train_dataset)
    stock_result = step(stock, examples)
    assert_same_step(stock_result, step(packed, examples))  # the real mask passes

    def leaky(subtree_end, position_ids=None, window=None, key_visible=None):
        """on_path, and every earlier key of another tree of the row (another example) as well"""
        reach = subtree_end.cummax(dim=1).values
        starts = torch.arange(1, subtree_end.shape[1], device=subtree_end.device) >= reach[:, :-1]
        tree = torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1).long().cumsum(dim=1)
        path = on_path(subtree_end)
        return lambda b, h, q, kv: path(b, h, q, kv) | ((kv < q) & (tree[b, kv] < tree[b, q]))

    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky)
    with pytest.raises(AssertionError):
        assert_same_step(stock_result, step(packed, examples))
