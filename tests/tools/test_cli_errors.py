"""The training commands' checks of their inputs, in this process: which arguments are accelerate's and which are
misspelt, the dataset checks before TRL's preprocessing. `tests/integration/test_cli.py` runs the documented bad inputs
end to
end."""

import json

import pytest
from datasets import Dataset, IterableDataset

from trl_prefix_sharing.cli import check_launch_arguments
from trl_prefix_sharing.cli.train import (
    check_config_file,
    check_split,
    local_dataset,
    make_parser,
    unknown_arguments,
)


@pytest.fixture(scope="module")
def parsers():
    from accelerate.commands.launch import launch_command_parser

    return make_parser("dpo"), launch_command_parser()


def _check(parsers, argv):
    parser, launch_parser = parsers
    argv = ["--bf16", "false", "--use_cpu", "true", *argv]  # TRL's default bf16 needs a GPU
    *_, config_remaining, cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    check_launch_arguments(parser, launch_parser, argv, config_remaining, cli_remaining)


@pytest.mark.parametrize(
    "flags",
    [
        ["--num_processes", "2", "--multi_gpu"],
        ["--num-processes=2", "--main_process_port", "29501", "-q"],
        ["--accelerate_config", "zero3"],
        ["--mixed_precision", "bf16", "--num_machines", "1", "--dynamo_backend", "no"],
        ["--config_file", "accelerate.yaml", "--machine_rank", "0"],
    ],
)
def test_accelerate_options_are_not_unknown(parsers, flags):
    _check(parsers, ["--output_dir", "out", *flags, "--prefix_sharing", "true"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prefix_shraing", "true"], "unrecognized argument --prefix_shraing (did you mean --prefix_sharing?)"),
        (["--num_proceses", "2"], "unrecognized argument --num_proceses (did you mean --num_processes?)"),
        (["--acelerate_config=zero3"], "--acelerate_config (did you mean --accelerate_config?)"),
        (["--zzz", "1", "2", "--multi_gpu", "stray"], "unrecognized arguments --zzz, stray; see"),
    ],
)
def test_misspelt_arguments_are_named(parsers, flags, message):
    with pytest.raises(ValueError, match="see trl-prefix-sharing dpo --help") as error:
        _check(parsers, ["--output_dir", "out", *flags])
    assert message in str(error.value)


def test_recipe_keys_for_accelerate_pass_and_misspelt_ones_are_named(parsers, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("num_processes: 2\nprefix_sharing: true\nlearning_rate: 1.0e-6\n")
    _check(parsers, ["--config", str(recipe)])
    recipe.write_text("num_processes: 2\nlerning_rate: 1.0e-6\n")
    with pytest.raises(ValueError, match=r"unrecognized key lerning_rate \(did you mean learning_rate\?\) in "):
        _check(parsers, ["--config", str(recipe)])


def test_unknown_arguments_takes_values_by_nargs():
    known = {"--multi_gpu": 0, "--num_processes": None}
    tokens = ["--multi_gpu", "stray", "--num_processes", "-2", "--x", "1", "2", "--num_processes=3", "4"]
    assert unknown_arguments(tokens, known) == ["stray", "--x", "4"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "is empty; it needs a YAML mapping"),
        ("- a\n- b\n", "holds a list; it needs a YAML mapping"),
        ("a: [1\n", "is not valid YAML"),
    ],
)
def test_unreadable_recipe(tmp_path, content, message):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(content)
    with pytest.raises(ValueError, match=message):
        check_config_file(["--config", str(recipe)])


def test_missing_recipe(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        check_config_file(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ValueError, match="needs the path"):
        check_config_file(["--output_dir", "out", "--config"])


def test_local_dataset_checks_the_files_of_a_directory(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    (data / "notes.txt").write_text("")  # not a data file
    (data / ".cache").mkdir()
    (data / ".cache" / "old.jsonl").write_text("")  # hidden: not read
    assert local_dataset(str(data)) == data
    (data / "test.jsonl").write_text(" \n")
    with pytest.raises(ValueError, match=r"Dataset file .*data/test.jsonl is empty"):
        local_dataset(str(data))
    assert local_dataset("org/name") is None  # a Hub id
    with pytest.raises(FileNotFoundError, match="not found"):
        local_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "notes.txt").write_text("text")
    with pytest.raises(ValueError, match="unsupported extension"):
        local_dataset(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize(
    "command, columns, accepted",
    [
        ("dpo", ["chosen", "rejected"], True),
        ("dpo", ["prompt_ids", "chosen_ids", "rejected_ids"], True),
        ("dpo", ["prompt", "answer"], False),
        ("reward", ["completions"], True),
        ("kto", ["prompt", "completion", "label"], True),
        ("kto", ["prompt", "chosen", "rejected"], True),
        ("kto", ["completion", "label"], False),
        ("orpo", ["chosen", "rejected"], True),
        ("cpo", ["prompt", "chosen"], False),
        ("grpo", ["prompt", "solution"], True),
        ("rloo", ["text"], False),
        ("online_dpo", ["question"], False),
    ],
)
def test_check_split_columns(command, columns, accepted):
    dataset = Dataset.from_dict({column: ["x"] for column in columns})
    if accepted:
        check_split(command, dataset, "Dataset d.jsonl", "train")
    else:
        with pytest.raises(ValueError, match=r"Dataset d.jsonl \(split 'train'\) has columns"):
            check_split(command, dataset, "Dataset d.jsonl", "train")


def test_check_split_rows():
    """No rows is an error before TRL, whose preprocessing would end in a bare `StopIteration`."""
    with pytest.raises(ValueError, match="has no rows"):
        check_split("dpo", Dataset.from_dict({"chosen": [], "rejected": []}), "Dataset d", "train")
    empty_stream = IterableDataset.from_generator(lambda: iter(()))
    with pytest.raises(ValueError, match="yields no rows"):
        check_split("grpo", empty_stream, "Dataset d", "train")
    check_split("grpo", Dataset.from_dict({"prompt": ["a"]}).to_iterable_dataset(), "Dataset d", "train")
