"""Fuzzing the data path: random awkward datasets still give stock TRL's numbers; bad rows give errors naming them."""

import random

import pytest
from datasets import Dataset

from trl_prefix_sharing import DPOTrainer, RewardTrainer
from trl_prefix_sharing.testing import WORDS, make_model
from trl_prefix_sharing.testing.equivalence import compare_step, make_reward_model, make_trainers, reward_args


def _random_dataset(seed, n=8):
    rng = random.Random(seed)

    def text(low, high):
        return " ".join(rng.choice(WORDS[:60]) for _ in range(rng.randint(low, high)))

    rows = []
    for _ in range(n):
        prompt = text(0, 40) if rng.random() < 0.8 else text(60, 90)  # some prompts longer than max_length
        chosen = text(0, 12)
        rejected = chosen if rng.random() < 0.15 else (chosen[: len(chosen) // 2] + " " + text(0, 8)).strip()
        rows.append(
            {
                "prompt": prompt,
                "chosen": " " + chosen if chosen else "",
                "rejected": " " + rejected if rejected else "",
            }
        )
    return Dataset.from_list(rows)


@pytest.mark.parametrize("seed", range(6))
def test_random_awkward_data_matches_stock(tmp_path, tokenizer, seed):
    rng = random.Random(seed)
    family = rng.choice(["llama", "mistral", "qwen2", "qwen3"])
    overrides = {"max_length": rng.choice([None, 24, 48]), "truncation_mode": rng.choice(["keep_start", "keep_end"])}
    packing = rng.random() < 0.5
    ours = {"prefix_sharing": rng.random() < 0.8 or not packing, "packing": packing, "packing_length": 1024}
    stock, shared = make_trainers(tmp_path, family, _random_dataset(seed), tokenizer, ours=ours, **overrides)
    if len(stock.train_dataset) == 0:
        pytest.skip("every row dropped by max_length")
    shared._pairs_in_window = len(stock.train_dataset)  # one optimizer step of one micro-batch on one rank
    shared.current_gradient_accumulation_steps = 1
    compare_step(stock, shared)


BAD_DATASETS = [
    (
        [{"prompt": "w1", "chosen": " w2", "rejected": " w3"}, {"prompt": "w1", "chosen": None, "rejected": " w2"}],
        "train row 1, 'chosen' is None",
    ),
    (
        [{"prompt": "w1", "chosen": 4, "rejected": 5}, {"prompt": "w1", "chosen": 6, "rejected": 7}],
        "train row 0, 'chosen' is of type int",
    ),
    (
        [
            {
                "prompt": [{"role": "user", "content": "w1"}],
                "chosen": [{"role": "assistant", "content": "w2"}],
                "rejected": [{"role": "assistant", "content": "w3"}],
            },
            {
                "prompt": [{"role": "user", "content": "w1"}],
                "chosen": [],
                "rejected": [{"role": "assistant", "content": "w3"}],
            },
        ],
        "train row 1, 'chosen' is an empty list of messages",
    ),
]


@pytest.mark.parametrize("rows,message", BAD_DATASETS)
def test_bad_rows_name_the_row(tmp_path, tokenizer, rows, message):
    from trl_prefix_sharing.testing.equivalence import dpo_args

    with pytest.raises(ValueError, match=message):
        DPOTrainer(
            model=make_model("llama", len(tokenizer)),
            args=dpo_args(tmp_path, True),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("margin", [float("nan"), float("inf")])
def test_non_finite_margin_names_the_row(tmp_path, tokenizer, margin):
    dataset = Dataset.from_list(
        [
            {"prompt": "w1", "chosen": " w2", "rejected": " w3", "margin": 0.5},
            {"prompt": "w1", "chosen": " w2", "rejected": " w3", "margin": margin},
        ]
    )
    with pytest.raises(ValueError, match="train row 1: 'margin' is"):
        RewardTrainer(
            model=make_reward_model("llama", tokenizer),
            args=reward_args(tmp_path, {"prefix_sharing": True}),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
