"""Bad inputs the command line catches, caught from Python too: a dataset without the columns its trainer reads (every
trainer of the table, SFT's `question`/`answer` among them) and a model named by a local path that does not exist.
Each is one error of this package naming what is wrong and the way out, raised before any model is loaded; the
datasets TRL accepts still build a trainer, and the path rule never refuses a Hub id (no network)."""

import socket

import pytest
import transformers
from datasets import Dataset, IterableDataset

import trl_prefix_sharing
from trl_prefix_sharing.cli.train import check_split
from trl_prefix_sharing.support import check_local_model_path, is_local_model_path
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import CPU_RUN
from trl_prefix_sharing.testing.group_equivalence import save_model
from trl_prefix_sharing.testing.trainers import build_trainer
from trl_prefix_sharing.trainers import TRAINERS
from trl_prefix_sharing.validation import check_dataset_columns, needed_columns


SFT_NEEDS = (
    "an SFT dataset needs 'text', 'messages' (or ShareGPT's 'conversations'), or 'prompt' and 'completion', text or "
    "conversational, or pre-tokenized 'input_ids'; 'text' is the config's `dataset_text_field`."
)
QUESTIONS = {"question": ["w1 w2 w3", "w4 w5"], "answer": ["w6", "w7 w8"]}
GOOD_PAIRS = {"prompt": ["w1 w2", "w3"], "chosen": ["w4", "w5 w6"], "rejected": ["w7", "w8"]}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading weights fails the test: the errors here come before TRL loads the model."""

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained{args} called")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


def _build(kind, tmp_path, model, dataset, eval_dataset=None, **config):
    return build_trainer(
        kind,
        stock=False,
        model=model,
        tokenizer=None if isinstance(model, str) else config.pop("tokenizer"),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        output_dir=str(tmp_path / "run"),
        copy_models=False,
        quiet=False,
        prefix_sharing=True,
        **CPU_RUN,
        **config,
    )


# ------------------------------------------------------------------------------------------------ columns
def test_sft_with_other_columns_is_one_clear_error(tmp_path, tokenizer, no_model_loads):
    """The report's case: `question`/`answer` rows, which TRL's SFT trainer ends in `KeyError: 'text'`."""
    path = save_model(tmp_path, "llama", tokenizer)
    with pytest.raises(ValueError) as error:
        _build("sft", tmp_path, path, Dataset.from_dict(QUESTIONS))
    assert str(error.value) == f"The train dataset has columns ['answer', 'question']; {SFT_NEEDS}"


@pytest.mark.parametrize("kind", list(TRAINERS))
def test_every_trainer_names_the_columns_it_reads(tmp_path, tokenizer, no_model_loads, kind):
    """Every trainer of the table, from its entry's columns (the command line's too), before the model loads."""
    path = save_model(tmp_path, "llama", tokenizer)
    with pytest.raises(ValueError) as error:
        _build(kind, tmp_path, path, Dataset.from_dict(QUESTIONS))
    message = str(error.value)
    assert message == f"The train dataset has columns ['answer', 'question']; {TRAINERS[kind].columns.needs}"
    assert "\n" not in message


@pytest.mark.parametrize("kind", ["sft", "kto", "grpo"])
def test_the_eval_dataset_is_checked_too(tmp_path, tokenizer, no_model_loads, kind):
    good = {
        "sft": {"text": ["w1 w2", "w3"]},
        "kto": {"prompt": ["w1", "w2"], "completion": ["w3", "w4"], "label": [True, False]},
        "grpo": {"prompt": ["w1", "w2"]},
    }[kind]
    path = save_model(tmp_path, "llama", tokenizer)
    eval_datasets = {"held_out": Dataset.from_dict(QUESTIONS)}
    with pytest.raises(ValueError, match=r"^The eval\['held_out'\] dataset has columns \['answer', 'question'\]; "):
        _build(kind, tmp_path, path, Dataset.from_dict(good), eval_dataset=eval_datasets, eval_strategy="no")


def _sft_datasets() -> dict:
    """A dataset of every kind TRL 1.16's SFT trainer prepares."""
    conversation = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    return {
        "text": ({"text": ["w1 w2 w3", "w4 w5"]}, {}),
        "messages": ({"messages": [conversation, conversation]}, {}),
        "sharegpt": ({"conversations": [[{"from": m["role"], "value": m["content"]} for m in conversation]] * 2}, {}),
        "prompt_completion": ({"prompt": ["w1 w2", "w3"], "completion": [" w4", " w5 w6"]}, {}),
        "conversational_prompt_completion": (
            {"prompt": [conversation[:1]] * 2, "completion": [conversation[1:]] * 2},
            {},
        ),
        "pre_tokenized": ({"input_ids": [[5, 6, 7], [8, 9]]}, {}),
        "dataset_text_field": ({"content": ["w1 w2 w3", "w4 w5"]}, {"dataset_text_field": "content"}),
    }


@pytest.mark.parametrize("kind", list(_sft_datasets()))
def test_every_kind_of_sft_dataset_still_builds(tmp_path, tokenizer, kind):
    rows, config = _sft_datasets()[kind]
    model = make_model("llama", len(tokenizer))
    trainer = _build("sft", tmp_path, model, Dataset.from_dict(rows), tokenizer=tokenizer, **config)
    assert trainer.prefix_sharing and "input_ids" in trainer.train_dataset.column_names


def test_a_formatting_function_takes_any_columns(tmp_path, tokenizer):
    """TRL makes each row's text with the function: the dataset's own columns are its business."""
    config = trl_prefix_sharing.SFTConfig(output_dir=str(tmp_path), prefix_sharing=True, **CPU_RUN)
    trainer = trl_prefix_sharing.SFTTrainer(
        model=make_model("llama", len(tokenizer)),
        args=config,
        train_dataset=Dataset.from_dict(QUESTIONS),
        processing_class=tokenizer,
        formatting_func=lambda row: f"{row['question']} {row['answer']}",
    )
    assert "input_ids" in trainer.train_dataset.column_names


def test_sft_needs_follow_the_config():
    """`dataset_text_field` renames the text column (in the message too); TRL reads no columns itself with a
    formatting function or `skip_prepare_dataset`; other trainers' columns are their entry's."""
    sft = TRAINERS["sft"].columns
    config = trl_prefix_sharing.SFTConfig(output_dir="x", dataset_text_field="content", **CPU_RUN)
    renamed = needed_columns(sft, config)
    assert renamed.accept({"content"}) and not renamed.accept({"text"}) and renamed.accept({"messages"})
    assert renamed.needs.startswith("an SFT dataset needs 'content', 'messages'")
    assert renamed.needs.endswith("'content' is the config's `dataset_text_field`.")
    skipped = trl_prefix_sharing.SFTConfig(output_dir="x", dataset_kwargs={"skip_prepare_dataset": True}, **CPU_RUN)
    assert needed_columns(sft, skipped) is None
    assert needed_columns(sft, None, formats_rows=True) is None
    assert needed_columns(TRAINERS["dpo"].columns, trl_prefix_sharing.DPOConfig(output_dir="x", **CPU_RUN)) is (
        TRAINERS["dpo"].columns
    )


def test_a_stream_is_checked_from_its_first_row():
    stream = Dataset.from_dict(QUESTIONS).to_iterable_dataset()
    assert isinstance(stream, IterableDataset)
    with pytest.raises(ValueError, match=r"^The train dataset has columns \['answer', 'question'\]; an SFT dataset"):
        check_dataset_columns(stream, "train", TRAINERS["sft"].columns, rows=False)
    check_dataset_columns(Dataset.from_dict({"text": ["w1"]}).to_iterable_dataset(), "train", TRAINERS["sft"].columns)


def test_the_command_line_reads_the_same_table():
    """One definition: the command line takes pre-tokenized SFT data and refuses `question`/`answer` in the same
    words."""
    check_split("sft", Dataset.from_dict({"input_ids": [[1, 2]]}), "Dataset d.jsonl", "train")
    with pytest.raises(ValueError) as error:
        check_split("sft", Dataset.from_dict(QUESTIONS), "Dataset d.jsonl", "train")
    assert str(error.value) == f"Dataset d.jsonl (split 'train') has columns ['answer', 'question']; {SFT_NEEDS}"


# ------------------------------------------------------------------------------------------------ model paths
@pytest.fixture
def no_config_loads(monkeypatch):
    """Reading a model's config fails the test: a missing path is refused before transformers looks for it."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"AutoConfig.from_pretrained{args} called")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)


@pytest.mark.parametrize("kind", list(TRAINERS))
def test_a_missing_local_model_is_one_clear_error(tmp_path, no_config_loads, no_model_loads, kind):
    """`./no/such/model` ends in transformers' `Repo id must use alphanumeric chars ...` after a long traceback;
    every trainer says instead which path is missing and what to pass."""
    with pytest.raises(FileNotFoundError) as error:
        _build(kind, tmp_path, "./no/such/model", Dataset.from_dict(GOOD_PAIRS))
    assert str(error.value) == (
        "Model './no/such/model' not found: no such directory; pass a local model directory or a Hub model id."
    )


@pytest.mark.parametrize("name", ["/no/such/model", "../no-such-model", "~/no-such-model", "no/such/model", "a b"])
def test_the_path_rule_refuses_missing_paths(name, no_config_loads):
    assert is_local_model_path(name)
    with pytest.raises(FileNotFoundError, match=rf"^Model {name!r} not found: no such directory; pass a local"):
        check_local_model_path(name)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the path rule used the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize(
    "name", ["Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "meta-llama/Llama-3.1-8B", "EleutherAI/pythia-14m", "org/name.v1"]
)
def test_the_path_rule_never_refuses_a_hub_id(name, no_network):
    assert not is_local_model_path(name)
    check_local_model_path(name)  # no error, no network


def test_an_existing_directory_passes(tmp_path, monkeypatch, no_network):
    (tmp_path / "model").mkdir()
    check_local_model_path(str(tmp_path / "model"))
    monkeypatch.chdir(tmp_path)
    check_local_model_path("./model")
    check_local_model_path("model")
