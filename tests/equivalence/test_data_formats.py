"""TRL's data formats train with prefix sharing exactly as stock: tool-calling conversations (assistant turns with only
`tool_calls`, `tool` messages, content lists, a `tools` column) and the reward trainer's older pre-tokenized column
names. Row validation still refuses what stock TRL would crash on."""

import json

import pytest
from datasets import Dataset

from trl_prefix_sharing import DPOTrainer, RewardTrainer
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    assert_same_reward_step,
    compare_step,
    dpo_args,
    make_reward_model,
    make_reward_trainers,
    make_trainers,
    reward_args,
    reward_step,
)


TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "w7",
                "description": "look up a word",
                "parameters": {"type": "object", "properties": {"w8": {"type": "string"}}},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "w9",
                "description": "add two numbers",
                "parameters": {"type": "object", "properties": {"w10": {"type": "integer"}}},
            },
        },
    ]
)


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool_calling_dataset(content_lists: bool = False) -> Dataset:
    """TRL's tool-calling format: assistant turns that only call a tool (no 'content'), tool results, and the `tools`
    the chat template renders (a JSON string, as TRL accepts it). `content_lists`: every content as a list of parts
    (Arrow stores one type per column, so a dataset has either text contents or part lists)."""

    def message(role, text):
        return {"role": role, "content": [{"type": "text", "text": text}] if content_lists else text}

    rows = []
    for i in range(6):
        prompt = [message("system", "w1 w2 w3"), message("user", f"what is w{i} plus w{i + 1} ?")]
        if i % 2:  # an earlier call and its result in the prompt
            prompt += [
                {"role": "assistant", "tool_calls": [_call("w7", w8=f"w{20 + i}")]},
                {**message("tool", " ".join(f"w{j}" for j in range(30, 33 + i))), "name": "w7"},
                message("user", "so ?"),
            ]
        chosen = [{"role": "assistant", "tool_calls": [_call("w9", w10=i)]}]
        rejected = (
            [message("assistant", f"w{40 + i} w41")]
            if i % 3
            else [{"role": "assistant", "tool_calls": [_call("w7", w8="w50"), _call("w9", w10=i + 1)]}]
        )
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "tools": TOOLS})
    return Dataset.from_list(rows)


def _renders_tool_calls(trainer, dataset):
    """The tokenized rows hold the tool names and calls (the chat template rendered them), so the test is not
    vacuous."""
    ids = trainer.train_dataset[0]
    text = trainer.processing_class.decode(ids.get("prompt_ids", []) + ids["chosen_ids"])
    assert "w9 w10 0" in text and "w7" in text, text  # the chosen tool call, and the tools list


@pytest.mark.parametrize("family,content_lists", [("llama", False), ("qwen3", True)])
def test_tool_calling_dpo_matches_stock(tmp_path, tokenizer, family, content_lists):
    dataset = tool_calling_dataset(content_lists)
    stock, shared = make_trainers(tmp_path, family, dataset, tokenizer)
    _renders_tool_calls(stock, dataset)
    _, result = compare_step(stock, shared)
    layout = result["batch"]["prefix_sharing"]
    assert (layout.document_ids >= 0).sum() < result["batch"]["attention_mask"].sum()


def test_tool_calling_dpo_packing_matches_stock(tmp_path, tokenizer):
    stock, packed = make_trainers(
        tmp_path,
        "qwen2",
        tool_calling_dataset(),
        tokenizer,
        ours={"prefix_sharing": True, "packing": True, "packing_length": 1024},
    )
    packed._pairs_in_window = len(stock.train_dataset)  # one optimizer step of one micro-batch on one rank
    packed.current_gradient_accumulation_steps = 1
    compare_step(stock, packed)


def test_tool_calling_reward_matches_stock(tmp_path, tokenizer):
    stock, shared = make_reward_trainers(tmp_path, "mistral", tool_calling_dataset(content_lists=True), tokenizer)
    _renders_tool_calls(stock, None)
    examples = list(stock.train_dataset)
    stock_result, shared_result = reward_step(stock, examples), reward_step(shared, examples)
    assert "prefix_sharing" in shared_result["batch"]
    assert_same_reward_step(stock_result, shared_result)


def test_legacy_pretokenized_reward_columns_match_stock(tmp_path, tokenizer):
    """`chosen_input_ids`/`rejected_input_ids`: TRL 1.16 warns and renames them; our column check runs before that
    rename and must accept them."""
    rows = []
    for i in range(6):
        prompt = tokenizer(f"w1 w2 w{i} w{i + 3} w{i + 5}")["input_ids"]
        rows.append(
            {
                "chosen_input_ids": prompt + tokenizer(f"w{60 + i} w61")["input_ids"] + [3],
                "rejected_input_ids": prompt + tokenizer(f"w{70 + i}")["input_ids"] + [3],
            }
        )
    legacy = Dataset.from_list(rows)
    with pytest.warns(FutureWarning, match="legacy dataset columns"):
        stock, shared = make_reward_trainers(tmp_path, "llama", legacy, tokenizer, eval_dataset=legacy)
    assert set(shared.train_dataset.column_names) >= {"chosen_ids", "rejected_ids"}
    examples = list(stock.train_dataset)
    stock_result, shared_result = reward_step(stock, examples), reward_step(shared, examples)
    assert_same_reward_step(stock_result, shared_result)
    layout = shared_result["batch"]["prefix_sharing"]
    assert (layout.document_ids >= 0).sum() < shared_result["batch"]["attention_mask"].sum()  # prompts shared
    assert stock.evaluate()["eval_loss"] == pytest.approx(shared.evaluate()["eval_loss"], rel=1e-5)


USER = {"role": "user", "content": "w1"}
BAD_MESSAGES = [
    # what stock TRL crashes on (a TypeError or a template error deep inside `datasets.map`), refused by name
    ({"prompt": [USER], "chosen": " w2", "rejected": " w3"}, "train row 0 mixes text and conversational fields"),
    # not a message in any TRL format (no role): stock renders it with an empty role marker, silently
    (
        {"prompt": [USER], "chosen": [{"content": "w2"}], "rejected": [{"role": "assistant", "content": "w3"}]},
        "train row 0, 'chosen': message 0 is .* expected a dict with a 'role'",
    ),
    (
        {"prompt": [USER], "chosen": ["w2"], "rejected": [{"role": "assistant", "content": "w3"}]},
        "train row 0, 'chosen': message 0 is 'w2'",
    ),
    (
        {
            "prompt": [USER],
            "chosen": [{"role": "assistant", "content": 4}],
            "rejected": [{"role": "assistant", "content": "w3"}],
        },
        "train row 0, 'chosen': message 0 has content of type int",
    ),
]


@pytest.mark.parametrize("row,message", BAD_MESSAGES)
@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_bad_messages_name_the_row(tmp_path, tokenizer, kind, row, message):
    dataset = Dataset.from_list([row])
    with pytest.raises(ValueError, match=message):
        if kind == "dpo":
            DPOTrainer(
                model=make_model("llama", len(tokenizer)),
                args=dpo_args(tmp_path, True),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
        else:
            RewardTrainer(
                model=make_reward_model("llama", tokenizer),
                args=reward_args(tmp_path, {"prefix_sharing": True}),
                train_dataset=dataset,
                processing_class=tokenizer,
            )
