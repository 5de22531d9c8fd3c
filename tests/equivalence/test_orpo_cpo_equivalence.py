"""ORPO and CPO (SimPO, CPO-SimPO, AlphaPO) with prefix sharing against TRL's own experimental trainers, in the same
process, fp32 on the CPU: the loss, every logged metric (the NLL term, the `logits/*` means over prompt and padding),
the gradients and the weights after training.

Two paths. `prefix_sharing_score_padding=True` computes each row's padding as stock does: every logged number is
stock's (`make_trainers` builds this path unless told otherwise, so the tests here and in other modules that compare
every metric run it). The default, `False`, skips the padding: the loss, the gradients, the weights and every metric
but `logits/chosen|rejected` are stock's, and those two are the mean logit of the columns that predict a real token,
checked against the stock model's own logits and shown to differ from stock's where rows have padding (the tests
named `..._by_default`)."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from trl.experimental.cpo import CPOConfig as StockCPOConfig
from trl.experimental.cpo import CPOTrainer as StockCPOTrainer
from trl.experimental.orpo import ORPOConfig as StockORPOConfig
from trl.experimental.orpo import ORPOTrainer as StockORPOTrainer

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing import CPOConfig, CPOTrainer, ORPOConfig, ORPOTrainer
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    CPU_RUN,
    assert_same_loss_metrics_grads,
    assert_same_number,
    assert_same_training,
    awkward_text_dataset,
    backward_grads,
    conversational_dataset,
    leaky_dpo_mask,
    tie_free_text_dataset,
    train_and_evaluate,
)


KINDS = {
    "orpo": (StockORPOTrainer, StockORPOConfig, ORPOTrainer, ORPOConfig),
    "cpo": (StockCPOTrainer, StockCPOConfig, CPOTrainer, CPOConfig),
}

#: (trainer, its options): the loss types and weights the trainers offer
SETTINGS = {
    "orpo-beta0.1": ("orpo", {"beta": 0.1}),
    "orpo-beta1": ("orpo", {"beta": 1.0}),
    "orpo-padding-value-1": ("orpo", {"beta": 0.1, "padding_value": 1}),
    "cpo-sigmoid": ("cpo", {"loss_type": "sigmoid"}),
    "cpo-hinge": ("cpo", {"loss_type": "hinge"}),
    "cpo-ipo": ("cpo", {"loss_type": "ipo"}),
    "simpo": ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.0}),
    "cpo-simpo": ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.5}),
    "alphapo": ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.0, "alpha": 0.25}),
}


def make_trainers(
    tmp_path,
    kind,
    tokenizer,
    dataset,
    family="llama",
    peft_config=None,
    config_kwargs=None,
    weights=None,
    ours=None,
    score_padding=True,
    **options,
):
    """(stock TRL trainer, ours with `prefix_sharing=True`, `prefix_sharing_score_padding=score_padding` and `ours`)
    from identical (`weights`-dtype) models and data. `score_padding=True` (every logged number stock's) unless
    told; `None`: the config's default."""
    stock_cls, stock_config, ours_cls, ours_config = KINDS[kind]
    model = make_model(family, len(tokenizer), seed=0, **(config_kwargs or {})).to(weights or torch.float32)
    fields = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_length=512,
        learning_rate=1e-3,
        max_steps=2,
        **CPU_RUN,
    )
    fields.update(options)
    padding = {} if score_padding is None else {"prefix_sharing_score_padding": score_padding}
    trainers = []
    for cls, config, extra in (
        (stock_cls, stock_config, {}),
        (ours_cls, ours_config, {"prefix_sharing": True, **padding, **(ours or {})}),
    ):
        trainers.append(
            cls(
                model=copy.deepcopy(model),
                args=config(output_dir=str(tmp_path / f"run{len(trainers)}"), **extra, **fields),
                train_dataset=dataset,
                eval_dataset=dataset,
                processing_class=tokenizer,
                peft_config=copy.deepcopy(peft_config),
            )
        )
    return trainers


def loss_and_grads(trainer, examples):
    """TRL's loss and metrics of one batch, and the gradients of that loss."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch, train_eval="train")
    return loss.detach(), metrics, backward_grads(trainer.model, loss)


def assert_same_batch(stock, shared, atol=1e-5, rtol=1e-5):
    """`loss_and_grads` of ours equal to stock's: the loss, every metric, every gradient (`score_padding=True`)."""
    assert_same_loss_metrics_grads(stock, shared, atol, rtol, min_metrics=9)


#: the two metrics `prefix_sharing_score_padding` changes: stock's means cover its padding columns
LOGITS_METRICS = ("logits/chosen", "logits/rejected")


def _without_logits_metrics(result):
    return (result[0], {k: v for k, v in result[1].items() if k not in LOGITS_METRICS}, *result[2:])


def assert_default_batch(stock, shared, examples, atol=1e-5, rtol=1e-5) -> None:
    """The default path (`prefix_sharing_score_padding=False`) on one batch: the loss, the gradients and every metric
    but `logits/chosen|rejected` are stock's. Those two are the mean logit of the columns that predict a real token,
    computed here from the stock model's own logits; stock's are the mean over every column of its padded rows
    (ORPO: all but the last), padding columns included, so the two differ (every half of these batches has padding)
    by more than the tolerance every other number is held to."""
    assert shared.args.prefix_sharing_score_padding is False
    expected, got = (loss_and_grads(trainer, examples) for trainer in (stock, shared))
    assert set(LOGITS_METRICS) <= set(got[1]) and set(got[1]) == set(expected[1])
    assert_same_loss_metrics_grads(*map(_without_logits_metrics, (expected, got)), atol, rtol, min_metrics=7)

    batch = stock._prepare_inputs(stock.data_collator(examples))
    concatenated = stock.concatenated_inputs(batch, padding_value=shared._padding_value)
    input_ids, attention_mask = concatenated["concatenated_input_ids"], concatenated["concatenated_attention_mask"]
    with torch.no_grad():
        column_means = stock.model(input_ids=input_ids, attention_mask=attention_mask).logits.mean(-1)
    predicts_real = torch.cat([attention_mask[:, 1:], torch.zeros_like(attention_mask[:, :1])], dim=1).bool()
    stock_columns = slice(None, -1) if isinstance(stock, StockORPOTrainer) else slice(None)
    half = len(examples)
    for key, rows in zip(LOGITS_METRICS, (slice(None, half), slice(half, None)), strict=True):
        assert_same_number(got[1][key], column_means[rows][predicts_real[rows]].mean(), key, atol=atol, rtol=rtol)
        assert (attention_mask[rows][:, stock_columns] == 0).any(), key  # padding columns that stock's mean covers
        stocks_mean = column_means[rows][:, stock_columns].mean()
        assert_same_number(expected[1][key], stocks_mean, f"stock's {key}", atol=atol, rtol=rtol)
        with pytest.raises(AssertionError):
            assert_same_number(got[1][key], expected[1][key], key, atol=atol, rtol=rtol)


def longer_rejected(dataset: Dataset) -> Dataset:
    """`dataset` with a 30-token rejected answer after its long prompt: the rejected rows are then the wider ones, and
    stock pads the chosen rows to their width with `padding_value` over many columns (`logits/*` leave out the last
    column, which may otherwise be the only one)."""
    rows = dataset.to_list()
    assert len(rows[5]["prompt"].split()) == 60
    rows[5]["rejected"] = " " + " ".join(f"w{i}" for i in range(200, 230))
    return Dataset.from_list(rows)


def assert_padded_with(trainer, examples, padding_value) -> None:
    """Stock's concatenated rows hold `padding_value` in padding columns whose logits `logits/*` average."""
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    rows = trainer.concatenated_inputs(batch, padding_value=trainer.padding_value)
    ids, mask = rows["concatenated_input_ids"][:, :-1], rows["concatenated_attention_mask"][:, :-1]
    assert (ids[mask == 0] == padding_value).any()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_batch_matches_stock(tmp_path, tokenizer, setting):
    kind, options = SETTINGS[setting]
    padding_value = options.get("padding_value")
    # a non-default pad id on pairs without identical completions (see `test_padding_value_with_identical_completions`)
    dataset = longer_rejected(tie_free_text_dataset()) if padding_value is not None else awkward_text_dataset()
    stock, shared = make_trainers(tmp_path, kind, tokenizer, dataset, **options)
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    assert_same_batch(loss_and_grads(stock, examples), loss_and_grads(shared, examples))
    if padding_value is not None:
        assert padding_value != tokenizer.pad_token_id
        assert_padded_with(stock, examples, padding_value)


@pytest.mark.parametrize("checks", [True, False])
def test_padding_value_with_identical_completions(tmp_path, tokenizer, checks):
    """ORPO with `padding_value` other than the tokenizer's pad id, on a pair whose two completions are identical.
    Stock pads each side with the tokenizer's pad id (its collator), then the narrower side with `padding_value`
    (`concatenated_inputs`), so the two identical rows differ in their padding tokens, which stock scores into
    `logits/*`. The layout keys scored padding by its token, so the two rows stay apart where their padding differs
    (keyed alike, they were one document holding one row's padding: the layout check refused the batch, and without
    checks `logits/rejected` was off by 3.6e-4 here)."""
    dataset = longer_rejected(awkward_text_dataset())
    stock, shared = make_trainers(
        tmp_path, "orpo", tokenizer, dataset, padding_value=1, ours={"prefix_sharing_checks": checks}
    )
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    assert_same_batch(loss_and_grads(stock, examples), loss_and_grads(shared, examples))


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
@pytest.mark.parametrize("data", ["conversational", "truncated"])
@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_awkward_data_matches_stock(tmp_path, tokenizer, kind, data, family):
    options = {"cpo_alpha": 0.5, "loss_type": "simpo"} if kind == "cpo" else {}
    if data == "truncated":  # TRL's truncation of long rows (the long prompt, the long rejected answer)
        options.update(max_length=40)
    dataset = conversational_dataset() if data == "conversational" else awkward_text_dataset()
    if data == "truncated":  # without the prompt longer than `max_length` (no completion left: NaN losses in stock)
        dataset = dataset.filter(lambda row: len(row["prompt"].split()) < 30)
    stock, shared = make_trainers(tmp_path, kind, tokenizer, dataset, family=family, **options)
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    assert_same_batch(loss_and_grads(stock, examples), loss_and_grads(shared, examples))


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_wrong_mask_fails(tmp_path, tokenizer, monkeypatch, kind):
    dataset = awkward_text_dataset()
    stock, shared = make_trainers(tmp_path, kind, tokenizer, dataset)
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    expected = loss_and_grads(stock, examples)
    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        assert_same_batch(expected, loss_and_grads(shared, examples))


@pytest.mark.parametrize(
    "setting", ["orpo", "cpo-simpo-gradient-checkpointing", "orpo-lora", "orpo-eager-attention", "cpo-eager-attention"]
)
def test_training_matches_stock(tmp_path, tokenizer, setting):
    """Two steps and an evaluation: every logged number and the trained weights. `eager-attention`: the model loaded
    with eager attention, which stock runs; the shared passes run on SDPA (the shared mask's implementation on the
    CPU)."""
    kind = setting.split("-")[0]
    options = {"loss_type": "simpo", "cpo_alpha": 0.5} if "simpo" in setting else {}
    if "checkpointing" in setting:
        options["gradient_checkpointing"] = True
    if "eager" in setting:
        options["config_kwargs"] = {"attn_implementation": "eager"}
    peft_config = None
    if "lora" in setting:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        options["learning_rate"] = 1e-2
    trainers = make_trainers(tmp_path, kind, tokenizer, conversational_dataset(), peft_config=peft_config, **options)
    stock, shared = (train_and_evaluate(t) for t in trainers)
    assert_same_training(stock, shared)
    if "eager" in setting:
        assert trainers[0].model.config._attn_implementation == "eager"
        assert trainers[1].sharing_session.backend.name == "sdpa"


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_half_precision_weights_without_autocast_differ_by_rounding(tmp_path, tokenizer, caplog, kind):
    """The documented difference: bf16 weights with `bf16=False`. Stock rounds its logits to bf16 before the
    log-softmax; the fused head computes in float32 from the same bf16 hidden states. A warning says so at start-up;
    the numbers agree to bf16 resolution only."""
    dataset = awkward_text_dataset()
    with caplog.at_level("WARNING"):
        stock, shared = make_trainers(tmp_path, kind, tokenizer, dataset, family="qwen3", weights=torch.bfloat16)
    assert "half-precision weights without autocast" in caplog.text
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    (loss, metrics, _), (got_loss, got_metrics, _) = (loss_and_grads(t, examples) for t in (stock, shared))
    assert_same_number(got_loss, loss, "loss", atol=0, rtol=2e-2)
    assert_same_number(got_metrics["logps/chosen"], metrics["logps/chosen"], "logps/chosen", atol=0, rtol=2e-2)
    with pytest.raises(AssertionError):  # not stock's to float precision: a documented difference
        assert_same_number(got_metrics["logps/chosen"], metrics["logps/chosen"], "logps/chosen", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_moe_router_loss_matches_stock(tmp_path, tokenizer, kind):
    """A mixture-of-experts model whose config asks for router logits: TRL adds the load-balancing loss of the stock
    rows, which the shared forward computes over the stock positions."""
    dataset = awkward_text_dataset()
    config_kwargs = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    stock, shared = make_trainers(tmp_path, kind, tokenizer, dataset, family="mixtral", config_kwargs=config_kwargs)
    assert shared.aux_loss_enabled
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    assert_same_batch(loss_and_grads(stock, examples), loss_and_grads(shared, examples))


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_fewer_positions_and_no_logits(tmp_path, tokenizer, kind):
    """On long prompts the backbone computes clearly fewer positions than stock's, and the LM head module is never
    called on them (TRL's fused head scores them in chunks: no `[2B, L, vocab]` logits), where stock calls it once."""
    prompt = " ".join(f"w{i}" for i in range(100, 160))
    rows = [{"prompt": prompt + f" w{i}", "chosen": f" w{i} w{i + 1}", "rejected": f" w{i + 2}"} for i in range(4)]
    dataset = Dataset.from_list(rows)
    stock, shared = make_trainers(tmp_path, kind, tokenizer, dataset)
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    counts = []
    for trainer in (stock, shared):
        seen = {"positions": 0, "head": 0}
        trainer.model.model.register_forward_pre_hook(
            lambda module, args, kwargs, seen=seen: seen.__setitem__(
                "positions",
                seen["positions"] + (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).numel(),
            ),
            with_kwargs=True,
        )
        trainer.model.lm_head.register_forward_hook(lambda *_, seen=seen: seen.__setitem__("head", seen["head"] + 1))
        loss_and_grads(trainer, examples)
        counts.append(seen)
    assert counts[0]["head"] == 1 and counts[1]["head"] == 0
    assert counts[1]["positions"] < 0.6 * counts[0]["positions"], counts


def test_score_padding_defaults_to_false(tmp_path):
    """`prefix_sharing_score_padding` is off unless asked for, in both configs."""
    for config in (ORPOConfig, CPOConfig):
        assert config(output_dir=str(tmp_path), **CPU_RUN).prefix_sharing_score_padding is False


#: the default path on the batches of `test_batch_matches_stock` and `test_awkward_data_matches_stock`
DEFAULT_CASES = {
    **{setting: (*SETTINGS[setting], "awkward") for setting in SETTINGS},
    "orpo-conversational": ("orpo", {}, "conversational"),
    "cpo-simpo-truncated": ("cpo", {"loss_type": "simpo", "cpo_alpha": 0.5, "max_length": 40}, "truncated"),
}


@pytest.mark.parametrize("case", list(DEFAULT_CASES))
def test_batch_matches_stock_but_logits_metrics_by_default(tmp_path, tokenizer, case):
    """`prefix_sharing_score_padding=False` (the default): the loss, the gradients and every metric but
    `logits/chosen|rejected` are stock's; those two average the columns that predict a real token and differ from
    stock's (`assert_default_batch`)."""
    kind, options, data = DEFAULT_CASES[case]
    if options.get("padding_value") is not None:
        dataset = longer_rejected(tie_free_text_dataset())
    elif data == "conversational":
        dataset = conversational_dataset()
    else:
        dataset = awkward_text_dataset()
    if data == "truncated":
        dataset = dataset.filter(lambda row: len(row["prompt"].split()) < 30)
    stock, shared = make_trainers(tmp_path, kind, tokenizer, dataset, score_padding=None, **options)
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    assert_default_batch(stock, shared, examples)


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_training_matches_stock_but_logits_metrics_by_default(tmp_path, tokenizer, kind):
    """Two steps and an evaluation on the default path: every logged number but `logits/chosen|rejected` (training
    and evaluation lines) and the trained weights are stock's; those two differ."""
    options = {"loss_type": "simpo", "cpo_alpha": 0.5} if kind == "cpo" else {}
    trainers = make_trainers(tmp_path, kind, tokenizer, conversational_dataset(), score_padding=None, **options)
    assert trainers[1].args.prefix_sharing_score_padding is False
    stock, shared = (train_and_evaluate(t) for t in trainers)

    def is_logits_metric(key: str) -> bool:
        return key.removeprefix("eval_") in LOGITS_METRICS

    differ = [
        abs(got[key] - line[key]) > 1e-5
        for line, got in zip(stock[0], shared[0], strict=True)
        for key in line
        if is_logits_metric(key)
    ]
    assert len(differ) == 2 * len(stock[0]) and any(differ)
    stock, shared = (
        ([{k: v for k, v in line.items() if not is_logits_metric(k)} for line in logs], weights)
        for logs, weights in (stock, shared)
    )
    assert_same_training(stock, shared)
