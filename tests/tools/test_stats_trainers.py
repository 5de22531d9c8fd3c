"""`trl-prefix-sharing stats` for KTO, ORPO, CPO and online DPO: the data it counts (prepared by the trainers
themselves, on a tiny stand-in model; online DPO's prompts re-derived) and the rows it lays out of it equal what TRL's
own trainers produce (columns, and the rows their collators build), on awkward data (a one-token prompt, an empty
completion, one that already ends with EOS, a prompt ending inside a word, implicit prompts, conversations, tools,
truncation); the positions it reports match hand counts; and a deliberately wrong row fails the comparison."""

import copy
import json
import warnings

import pytest
from test_stats_cli import _CHAT, _CHAT_IMPLICIT, _IMPLICIT, _THINKING_TEMPLATE, _assistant, _user
from test_stats_cli import _PLAIN as _PAIRS  # awkward pairs: the same data the DPO and reward comparisons use


_TOOLS = [{"type": "function", "function": {"name": "w50"}}]
_PAIRED = {"plain": _PAIRS, "implicit": _IMPLICIT, "chat": _CHAT, "chat_implicit": _CHAT_IMPLICIT}


def _unpaired(rows):
    """Unpaired KTO rows from pairs: each pair's chosen completion, then its rejected one (TRL's own unpairing puts
    all the chosen ones first)."""
    return [
        {"prompt": row["prompt"], "completion": row[key], "label": key == "chosen"}
        for row in rows
        for key in ("chosen", "rejected")
    ]


_KTO = {
    "unpaired": _unpaired(_PAIRS),
    "paired": _PAIRS,  # TRL unpairs it
    "implicit": _IMPLICIT,
    "chat": _unpaired(_CHAT),
    "chat_implicit": _CHAT_IMPLICIT,
    "chat_tools": [  # tools as JSON text, as a dataset column of mixed tool lists holds them
        {**row, "tools": json.dumps(_TOOLS if i % 3 else [])} for i, row in enumerate(_unpaired(_CHAT))
    ],
    "chat_thinking": _unpaired(_CHAT),
}


def _config(cls, tmp_path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)


def _columns(dataset, names):
    return {name: list(dataset[name]) for name in names}


# ------------------------------------------------------------------------------------------ KTO


def _trl_kto(dataset, tokenizer, config):
    """The train dataset TRL's own `KTOTrainer` prepares (a real trainer on a tiny model, with its reference)."""
    import trl

    from trl_prefix_sharing.testing import make_model

    models = {"model": make_model("llama", len(tokenizer)), "ref_model": make_model("llama", len(tokenizer))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.KTOTrainer(**models, args=config, train_dataset=dataset, processing_class=tokenizer)
    return trainer.train_dataset


def assert_kto_is_trls(ours, expected, tokenizer, max_length, batch_size):
    """The columns, then the rows TRL's collator builds of each micro-batch, equal `stats`' rows."""
    import torch
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from trl_prefix_sharing.cli.stats.counting import kto_rows

    names = ["prompt_ids", "completion_ids", "KL_completion_ids"]
    assert _columns(ours, names) == _columns(expected, names)
    collator = DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_length)
    for start in range(0, len(expected), batch_size):
        batch = [expected[i] for i in range(start, min(start + batch_size, len(expected)))]
        collated = collator(batch)
        main, kl, prompts = kto_rows([ours[i] for i in range(start, start + len(batch))], max_length)
        for rows, key in ((main, ""), (kl, "KL_")):
            mask = collated[f"{key}attention_mask"]
            assert [len(row) for row in rows] == mask.sum(dim=1).tolist()
            assert list(rows) == [
                ids[m.bool()].tolist() for ids, m in zip(collated[f"{key}input_ids"], mask, strict=True)
            ]
            assert len(rows) * max(map(len, rows)) == mask.numel()  # the padded positions stock computes
            prompt = (mask.bool() & (collated[f"{key}completion_mask"] == 0)).sum(dim=1)
            assert prompts == prompt.tolist()
        assert torch.equal(collated["label"], torch.tensor([example["label"] for example in batch]))


@pytest.mark.parametrize("limits", [(None, 8), (7, 2), (7, 3)], ids=str)
@pytest.mark.parametrize("name", list(_KTO))
def test_stats_kto_preprocessing_is_trls(tokenizer, tmp_path, name, limits):
    """`stats`' KTO columns and rows equal TRL's `KTOTrainer._prepare_dataset` and its collator's, examples dropped,
    pairs unpaired and KL completions rotated included."""
    import datasets
    import trl

    from trl_prefix_sharing.cli.stats.preprocessing import kto_dataset

    max_length, batch_size = limits
    if name == "chat_thinking":
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = _THINKING_TEMPLATE
    dataset = datasets.Dataset.from_list(_KTO[name])
    config = _config(trl.KTOConfig, tmp_path, max_length=max_length, per_device_train_batch_size=batch_size)
    expected = _trl_kto(dataset, tokenizer, config)
    ours = kto_dataset(dataset, tokenizer, max_length, batch_size)
    assert_kto_is_trls(ours, expected, tokenizer, max_length, batch_size)
    if name == "unpaired":  # the awkward cases are there
        assert 1 in map(len, ours["prompt_ids"])  # a one-token prompt
        assert [tokenizer.eos_token_id] in ours["completion_ids"]  # an empty completion: EOS only
        assert (len(ours) < len(dataset)) == (max_length is not None)  # the 12-token prompt fills max_length
        if max_length:
            assert any(
                len(p) + len(c) > max_length for p, c in zip(ours["prompt_ids"], ours["completion_ids"], strict=True)
            )


def test_a_wrong_kto_count_fails_the_comparison(tokenizer, tmp_path, monkeypatch):
    """The comparison can fail: KL completions rotated the other way, or rows cut one token short of `max_length`,
    are seen."""
    import datasets
    import trl

    from trl_prefix_sharing.cli.stats import counting, preprocessing

    dataset = datasets.Dataset.from_list(_KTO["unpaired"])
    config = _config(trl.KTOConfig, tmp_path, max_length=7, per_device_train_batch_size=3)
    expected = _trl_kto(dataset, tokenizer, config)
    ours = preprocessing.kto_dataset(dataset, tokenizer, 7, 3)
    assert_kto_is_trls(ours, expected, tokenizer, 7, 3)
    other_way = ours.map(
        lambda b: {"KL_completion_ids": b["completion_ids"][1:] + b["completion_ids"][:1]}, batched=True, batch_size=3
    )
    with pytest.raises(AssertionError):
        assert_kto_is_trls(other_way, expected, tokenizer, 7, 3)
    rows = counting.kto_rows
    monkeypatch.setattr(counting, "kto_rows", lambda batch, max_length: rows(batch, max_length - 1))  # one short
    with pytest.raises(AssertionError):
        assert_kto_is_trls(ours, expected, tokenizer, 7, 3)


# ------------------------------------------------------------------------------------------ ORPO, CPO


def _trl_paired(kind, dataset, tokenizer, tmp_path, max_length, model):
    """The train dataset TRL's experimental ORPO or CPO trainer prepares (a real trainer on a tiny model)."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    trainer_cls, config_cls = {"orpo": (ORPOTrainer, ORPOConfig), "cpo": (CPOTrainer, CPOConfig)}[kind]
    config = _config(config_cls, tmp_path, max_length=max_length, per_device_train_batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    return trainer


def assert_paired_is_trls(ours, trainer, batch_size=2):
    """The columns, then the rows TRL's collator and `concatenated_inputs` build of each micro-batch, equal
    `stats`' rows."""
    from trl_prefix_sharing.cli.stats.counting import paired_rows

    expected = trainer.train_dataset
    names = ["prompt_input_ids", "chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
    assert _columns(ours, names) == _columns(expected, names)
    for start in range(0, len(expected), batch_size):
        batch = [expected[i] for i in range(start, min(start + batch_size, len(expected)))]
        collated = trainer.data_collator(batch)
        concatenated = trainer.concatenated_inputs(
            collated,
            padding_value=trainer.padding_value
            if hasattr(trainer, "padding_value")
            else trainer.pad_token_id,  # CPO: its pad id
        )
        mask = concatenated["concatenated_attention_mask"]
        rows, prompts = paired_rows([ours[i] for i in range(start, start + len(batch))])
        assert rows == [
            ids[m.bool()].tolist() for ids, m in zip(concatenated["concatenated_input_ids"], mask, strict=True)
        ]
        assert len(rows) * max(map(len, rows)) == mask.numel()  # the padded positions stock computes
        labels, n = concatenated["concatenated_labels"], len(batch)
        assert prompts == [int(((row == -100) & m.bool()).sum()) for row, m in zip(labels[:n], mask[:n], strict=True)]


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    from trl_prefix_sharing.testing import make_model

    return make_model("llama", len(tokenizer))


@pytest.mark.parametrize("max_length", [None, 7])
@pytest.mark.parametrize("name", list(_PAIRED))
@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_stats_paired_preprocessing_is_trls(tokenizer, tiny_model, tmp_path, kind, name, max_length):
    """`stats` prepares ORPO/CPO data with this package's trainer itself, on a tiny stand-in model: its columns, and
    the rows `stats` lays out of them, equal those of TRL's experimental trainers (BOS and EOS added, the completions
    cut to fit `max_length`, never the prompt; `max_length=None` is TRL's 512)."""
    import datasets

    from trl_prefix_sharing.cli.stats.defaults import ORPO_DEFAULT_LENGTH
    from trl_prefix_sharing.cli.stats.preprocessing import paired_dataset

    dataset = datasets.Dataset.from_list(_PAIRED[name])
    trainer = _trl_paired(kind, dataset, tokenizer, tmp_path, max_length, copy.deepcopy(tiny_model))
    ours = paired_dataset(dataset, tokenizer, kind, max_length or ORPO_DEFAULT_LENGTH)
    assert_paired_is_trls(ours, trainer)
    if name == "plain":  # the awkward cases are there
        prompts = [labels.count(-100) for labels in ours["chosen_labels"]]
        assert 2 in prompts  # a one-token prompt, after BOS
        assert all(ids[0] == tokenizer.bos_token_id for ids in ours["chosen_input_ids"])
        assert [tokenizer.eos_token_id] in [ids[n:] for ids, n in zip(ours["chosen_input_ids"], prompts, strict=True)]
        long = ours["chosen_input_ids"][4]  # the 12-token prompt: kept whole, its completion cut to nothing
        assert (len(long) > 7 and long[-1] != tokenizer.eos_token_id) == (max_length == 7)


def test_a_wrong_paired_count_fails_the_comparison(tokenizer, tiny_model, tmp_path, monkeypatch):
    """The comparison can fail: with the prompt cut instead of the completion, or a row of each micro-batch lost,
    the rows differ from TRL's."""
    import datasets

    from trl_prefix_sharing.cli.stats import counting, preprocessing

    dataset = datasets.Dataset.from_list(_PAIRS)
    trainer = _trl_paired("orpo", dataset, tokenizer, tmp_path, 7, copy.deepcopy(tiny_model))
    ours = preprocessing.paired_dataset(dataset, tokenizer, "orpo", 7)
    assert_paired_is_trls(ours, trainer)
    cut_prompt = ours.map(
        lambda ex: {
            "chosen_input_ids": ex["chosen_input_ids"][-7:],
            "rejected_input_ids": ex["rejected_input_ids"][-7:],
        }
    )
    with pytest.raises(AssertionError):
        assert_paired_is_trls(cut_prompt, trainer)
    rows = counting.paired_rows
    monkeypatch.setattr(counting, "paired_rows", lambda batch: rows(batch[:-1]))
    with pytest.raises(AssertionError):
        assert_paired_is_trls(ours, trainer)


# ------------------------------------------------------------------------------------------ reports, hand counts


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _line(stdout, label):
    (line,) = [line for line in stdout.splitlines() if line.strip().startswith(label)]
    return line


def _value(stdout, label):
    return _line(stdout, label).split(label)[1].split()[0]


def _trained(stdout, label):
    """What follows `label` on its first line: in the block of what training lays out with SDPA."""
    line = next(line for line in stdout.splitlines() if line.strip().startswith(label))
    return line.split(label)[1].strip()


@pytest.fixture(scope="module")
def tok_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("stats_trainers") / "tok"
    tokenizer.save_pretrained(path)
    return str(path)


def test_stats_orpo_positions_match_a_hand_count(tok_dir, tmp_path, capsys):
    """Prompt `w1 w2 w3 w4`, completions ` the the w5` and ` the the w6 w7`: ORPO's rows, with BOS and EOS, are
    `<bos> w1 w2 w3 w4 the the w5 <eos>` (9) and `<bos> w1 w2 w3 w4 the the w6 w7 <eos>` (10): 19 tokens. Shared:
    the 9 tokens, then a copy of the last common `the` and `w6 w7 <eos>`: 13. Padded to 10 columns: stock 20; the
    shared rows without the padding (the default) 13, with each row's padding scored 10 + 4 = 14."""
    from trl_prefix_sharing.cli.stats import main

    data = _write_jsonl(
        tmp_path / "one.jsonl", [{"prompt": "w1 w2 w3 w4", "chosen": " the the w5", "rejected": " the the w6 w7"}]
    )
    for kind in ("orpo", "cpo"):
        assert main(["--dataset_name", data, "--model_name_or_path", tok_dir, "--trainer", kind]) == 0
        out = capsys.readouterr().out
        assert f"(1 example after TRL's preprocessing; {kind}, max_length=1024: completions cut to fit" in out
        assert "p50 5," in _line(out, "prompt tokens:")  # BOS + 4
        assert "p50 7," in _line(out, "shared prefix tokens, computed once:")
        assert "p50 2," in _line(out, "common start of the completions:")
        assert "stock 19.0, shared 13.0 (tokens, no padding)" in _line(out, "positions per example:")
        assert _line(out, "with padding, batches").endswith("stock 20.0, shared 13.0")
        assert _value(out, "ideal speedup, linear layers:") == f"{19 / 13:.2f}x"
        ideal = _line(out, "ideal with padding, batches of 8:")
        assert _value(out, "ideal with padding, batches of 8:") == f"{20 / 13:.2f}x"
        assert "the shared rows skip stock's padding, prefix_sharing_score_padding=False" in ideal
        other = _line(out, "prefix_sharing_score_padding=True:")
        assert _value(out, "prefix_sharing_score_padding=True:") == f"{20 / 14:.2f}x"
        assert "so that the logits/chosen and logits/rejected metrics are stock's" in other
        assert f"no {kind.upper()} benchmark recorded" in out
        # as training lays it out: one example, the same rows
        assert _trained(out, "with SDPA (dense, the CPU's kernel):").startswith("0 of 1 micro-batches joined")
        assert _trained(out, "tokens per example, shared:").startswith(f"13.0 of stock's 19.0: {19 / 13:.2f}x")
        assert _trained(out, "with padding, shared:").startswith(f"13.0 of stock's 20.0: {20 / 13:.2f}x")
        assert "verdict: prefix sharing pays on this dataset." in out  # min(1.46, 1.54) >= 1.15
    argv = ["--dataset_name", data, "--model_name_or_path", tok_dir, "--trainer", "orpo"]
    assert main([*argv, "--prefix_sharing_score_padding", "true"]) == 0
    out = capsys.readouterr().out
    assert "stock 20.0, shared 14.0 (each stock row's padding computed too" in _line(out, "with padding, batches")
    assert _value(out, "ideal with padding, batches of 8:") == f"{20 / 14:.2f}x"
    assert _value(out, "prefix_sharing_score_padding=False:") == f"{20 / 13:.2f}x"
    assert _trained(out, "with padding, shared:").startswith(f"14.0 of stock's 20.0: {20 / 14:.2f}x")
    assert "verdict: prefix sharing pays on this dataset." in out  # min(1.46, 1.43) >= 1.15


_KTO_HAND = [
    {"prompt": "w1 w2 w3 w4", "completion": " w5", "label": True},
    {"prompt": "w6 w7", "completion": " w8 w9", "label": False},
]


def test_stats_kto_positions_match_a_hand_count(tok_dir, tmp_path, capsys):
    """Two examples in one batch. Main rows `w1 w2 w3 w4 w5 <eos>` (6), `w6 w7 w8 w9 <eos>` (5); KL rows, the
    completions rotated: `w1 w2 w3 w4 w8 w9 <eos>` (7), `w6 w7 w5 <eos>` (4): 22 tokens. Shared: 6 + (a copy of
    `w4` + 3) = 10 and 5 + (a copy of `w7` + 2) = 8: 18. Padded: stock 2 x 6 + 2 x 7 = 26, the shared rows 2 x 10 =
    20. A step (a pass with gradients weighted 3): stock 3 x 12 + 14 (policy) + 12 + 14 (reference) = 76. The batch's
    prompt tokens, 6, do not exceed twice its KL completion tokens, 5: the policy runs main and KL rows apart, 3 x 12
    + 14, the reference merged, 20: 70. Merged (`--prefix_sharing_merge_kl true`): 20 + 3 x 20 = 80. As training lays
    it out, the policy's pass apart shares nothing (the two prompts differ): 22 tokens of 22; a step without padding,
    stock 3 x 11 + 11 + 22 = 66, shared 3 x 11 + 11 + 18 = 62."""
    from trl_prefix_sharing.cli.stats import main

    argv = ["--dataset_name", _write_jsonl(tmp_path / "kto.jsonl", _KTO_HAND), "--model_name_or_path", tok_dir]
    assert main([*argv, "--trainer", "kto"]) == 0
    out = capsys.readouterr().out
    assert "(2 examples after TRL's preprocessing; kto, max_length=1024, truncation keep_start" in out
    assert "p10 2, p50 4," in _line(out, "prompt tokens:")
    # per example: half of each
    assert "stock 11.0, shared 9.0 (tokens, no padding)" in _line(out, "positions per example, main and KL rows:")
    assert "stock 13.0, shared 10.0" in _line(out, "with padding, batches of 8:")
    assert _value(out, "ideal speedup, linear layers:") == f"{22 / 18:.2f}x"
    assert _value(out, "ideal with padding, batches of 8:") == f"{26 / 20:.2f}x"
    assert "0 of 1 batches (when a batch's prompt tokens exceed twice" in _line(out, "policy's gradient pass")
    assert _value(out, "ideal speedup of a training step:") == f"{76 / 70:.2f}x"
    assert "no KTO benchmark recorded" in out
    joins = _trained(out, "with SDPA (dense, the CPU's kernel):")
    assert joins.startswith("0 of 2 layouts joined across examples (always), 2 by prompts")
    assert joins.endswith(
        "the policy's main and KL rows in one layout in 0 of 1 micro-batches, one layout each in the others"
    )
    assert _trained(out, "tokens per example, shared:").startswith("11.0 of stock's 11.0: 1.00x (the policy's pass")
    assert _trained(out, "a training step, shared:").startswith(
        f"31.0 of stock's 33.0: {66 / 62:.2f}x; with padding 35.0 of 38.0: {76 / 70:.2f}x"
    )
    assert "verdict: prefix sharing pays little on this dataset." in out  # the step: 1.06x, 1.09x with padding
    assert main([*argv, "--trainer", "kto", "--prefix_sharing_merge_kl", "true"]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 batches (prefix_sharing_merge_kl=True)" in _line(out, "policy's gradient pass")
    assert _value(out, "ideal speedup of a training step:") == f"{76 / 80:.2f}x"
    assert _trained(out, "a training step, shared:").endswith(
        f"with padding 40.0 of 38.0: {76 / 80:.2f}x (the policy's pass, weighted 3 where it has gradients, and the "
        "reference's)"
    )
    assert "verdict: prefix sharing does not pay on this dataset." in out


def test_stats_online_dpo_positions_match_a_hand_count(tok_dir, tmp_path, capsys):
    """Online DPO: 2 completions per prompt. Prompts of 3 and 5 tokens, completions of C = 10: stock 2(P+C) = 26
    and 30 (mean 28), shared P-1+2(C+1) = 24 and 26 (mean 25). `--max_length 13` leaves 3 prompt tokens beside 10
    completion tokens: the 5-token prompt loses its first 2 (stock 26, shared 24)."""
    from trl_prefix_sharing.cli.stats import main

    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "w1 w2 w3"}, {"prompt": "w4 w5 w6 w7 w8"}])
    argv = ["--dataset_name", prompts, "--model_name_or_path", tok_dir, "--trainer", "online_dpo"]
    assert main([*argv, "--completion_length", "10"]) == 0
    out = capsys.readouterr().out
    assert "(2 prompts; online_dpo, 2 completions per prompt, max_length=512)" in out
    assert "10 tokens each (--completion_length)" in _line(out, "assumed completion length:")
    assert "p10 3, p50 5," in _line(out, "prompt tokens:") and "no special tokens added" in out
    assert _value(out, "stock, G(P+C):") == "28.0" and _value(out, "shared, P-1+G(C+1):") == "25.0"
    assert "prompts cut to fit" not in out and "no online DPO benchmark recorded" in out
    assert "reward model or judge are not sped up" in out
    assert main([*argv, "--max_new_tokens", "10", "--max_length", "13"]) == 0
    out = capsys.readouterr().out
    assert "10 tokens each (--max_new_tokens: completions that stop at EOS are shorter" in out
    assert "1 (their start dropped" in _line(out, "prompts cut to fit --max_length:")
    assert _value(out, "stock, G(P+C):") == "26.0" and _value(out, "shared, P-1+G(C+1):") == "24.0"
    assert main([*argv, "--num_generations", "2"]) == 0  # TRL's own number is accepted
    assert "OnlineDPOConfig default" in capsys.readouterr().out


def test_stats_online_dpo_tokenizes_prompts_as_trl(tokenizer, tok_dir, tmp_path, capsys):
    """Online DPO renders a conversational prompt with TRL's `maybe_apply_chat_template` and tokenizes it without
    special tokens: `<|user|> w1 w2 <|end|> <|assistant|>`, 5 tokens."""
    import datasets
    from trl.data_utils import maybe_apply_chat_template

    from trl_prefix_sharing.cli.stats.preprocessing import prompt_lengths

    rows = [{"prompt": [_user("w1 w2")]}, {"prompt": "w1 w2 w3"}, {"prompt": [_user("w1"), _assistant("w2")]}]
    lengths, conversational = prompt_lengths(datasets.Dataset.from_list(rows[:1] + rows[2:]), tokenizer, online=True)
    expected = [
        len(tokenizer(maybe_apply_chat_template(row, tokenizer)["prompt"], add_special_tokens=False)["input_ids"])
        for row in rows[:1] + rows[2:]
    ]
    assert lengths == expected and lengths[0] == 5 and conversational
    assert prompt_lengths(datasets.Dataset.from_list(rows[1:2]), tokenizer, online=True) == ([3], False)


def test_stats_defaults_are_trls():
    """The defaults `stats` states as TRL's are the installed TRL's config defaults."""
    import dataclasses

    import trl
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.online_dpo import OnlineDPOConfig
    from trl.experimental.orpo import ORPOConfig

    from trl_prefix_sharing.cli.stats.defaults import (
        BATCH_SIZE,
        MAX_LENGTHS,
        MAX_NEW_TOKENS,
        NUM_GENERATIONS,
        TRUNCATION_MODE,
    )

    configs = {
        "dpo": trl.DPOConfig,
        "reward": trl.RewardConfig,
        "kto": trl.KTOConfig,
        "orpo": ORPOConfig,
        "cpo": CPOConfig,
        "online_dpo": OnlineDPOConfig,
    }
    for name, config in configs.items():
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        assert defaults["max_length"] == MAX_LENGTHS[name], name
        assert defaults["per_device_train_batch_size"] == BATCH_SIZE, name
    assert {f.name: f.default for f in dataclasses.fields(trl.DPOConfig)}["truncation_mode"] == TRUNCATION_MODE
    assert {f.name: f.default for f in dataclasses.fields(trl.KTOConfig)}["loss_type"] == "kto"  # KL rows computed
    assert {f.name: f.default for f in dataclasses.fields(OnlineDPOConfig)}["max_new_tokens"] == MAX_NEW_TOKENS
    assert NUM_GENERATIONS["online_dpo"] == 2
    assert {f.name for f in dataclasses.fields(ORPOConfig)} >= {"max_length", "padding_value"}
    assert "max_prompt_length" not in {f.name for f in dataclasses.fields(ORPOConfig)}  # TRL 1.16 cuts no prompt


@pytest.mark.parametrize("score_padding", [False, True])
def test_stats_plan_counts_are_the_layouts(score_padding):
    """The positions and shared prefix `stats` reads from the layout's plan are those of the layout training builds
    (its shared rows, and the positions more than one stock position reads), on random pairs and awkward ones: rows
    equal, one row a prefix of the other, rows sharing nothing, a one-token row."""
    import random

    import torch

    from trl_prefix_sharing.cli.stats.counting import plan_rows
    from trl_prefix_sharing.layout import build_layout, shared_positions
    from trl_prefix_sharing.trie import StockRows

    rng = random.Random(0)
    pairs = [([5, 6, 7], [5, 6, 7]), ([5, 6], [5, 6, 7, 8]), ([9, 6], [5, 6, 7]), ([5], [5, 8]), ([4], [7])]
    for _ in range(20):
        prompt = [rng.randrange(4, 40) for _ in range(rng.randrange(0, 12))]
        pairs.append(tuple(prompt + [rng.randrange(4, 40) for _ in range(rng.randrange(1, 6))] for _ in range(2)))
    for first in range(0, len(pairs), 4):
        batch = pairs[first : first + 4]
        rows, n = [a for a, _ in batch] + [b for _, b in batch], len(batch)
        per_doc, prefix = plan_rows(rows, list(range(n)) * 2, pad_token_id=1, score_padding=score_padding)
        width = max(map(len, rows))
        ids = torch.tensor([row + [1] * (width - len(row)) for row in rows])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        layout = build_layout(
            StockRows(
                ids, mask, examples=torch.arange(n).repeat(2), across_examples=False, score_padding=score_padding
            ),
            pad_token_id=1,
        )
        assert per_doc == (layout.document_ids >= 0).sum(dim=1).tolist()
        assert prefix == shared_positions(layout).sum(dim=1).tolist()
        assert n * max(per_doc) == layout.input_ids.numel()
