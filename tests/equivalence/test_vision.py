"""Vision-language DPO with prefix sharing computes stock TRL's numbers, running the vision tower on each pair's images
once: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (tiny models from config) on TRL's conversational image data."""

import copy

import pytest
import torch
import trl

from trl_prefix_sharing.testing.equivalence import assert_same_step, dpo_args, leaky_dpo_mask, step


pytest.importorskip("PIL", reason="the image processor needs Pillow")

import trl_prefix_sharing.attention as attention_module  # noqa: E402
import trl_prefix_sharing.vision as vision_module  # noqa: E402
from trl_prefix_sharing import DPOTrainer  # noqa: E402
from trl_prefix_sharing.layout import RowPolicy  # noqa: E402
from trl_prefix_sharing.testing.vision import (  # noqa: E402
    VISION_FAMILIES,
    make_vision_config,
    make_vision_model,
    make_vision_processor,
    synthetic_image_pairs,
)


DATA = {
    # one 16x16 image per prompt (4 image tokens)
    "one_image": [[(16, 16)]],
    # several images per prompt, of different sizes, and text-only rows in the same batch
    "mixed": [[(24, 16), (8, 8)], [], [(32, 24)], [(16, 32), (16, 16), (8, 16)]],
    # a batch without any image (the model then counts text positions itself)
    "text_only": [[]],
}


@pytest.fixture(scope="module")
def processors():
    return {family: make_vision_processor(family) for family in VISION_FAMILIES}


def make_vision_trainers(tmp_path, processor, family, dataset, ours=None, eval_dataset=None, **overrides):
    """(stock TRL trainer, prefix-shared trainer) from identical policy and reference weights."""
    model = make_vision_model(family, processor, seed=0)
    ref = make_vision_model(family, processor, seed=1)
    return [
        cls(
            model=copy.deepcopy(model),
            ref_model=copy.deepcopy(ref),
            args=dpo_args(tmp_path, options, **overrides),
            train_dataset=dataset,
            eval_dataset=eval_dataset,
            processing_class=processor,
        )
        for cls, options in ((trl.DPOTrainer, None), (DPOTrainer, ours or {"prefix_sharing": True}))
    ]


def rows(dataset):
    """Fresh example dicts (TRL's vision collator rewrites the examples it is given)."""
    return [dataset[i] for i in range(len(dataset))]


def count_images_through_tower(trainer):
    """Attach a hook counting the images (and patches) the policy's vision tower processes."""
    counts = {"calls": 0, "images": 0, "patches": 0}

    def hook(module, args, kwargs, output):
        counts["calls"] += 1
        counts["images"] += int(kwargs["grid_thw"].shape[0])
        counts["patches"] += int(args[0].shape[0])

    trainer.model.model.visual.register_forward_hook(hook, with_kwargs=True)
    return counts


@pytest.mark.parametrize(
    "family,data",
    [("qwen2_vl", "one_image"), ("qwen3_vl", "text_only"), *((family, "mixed") for family in VISION_FAMILIES)],
)
def test_step_matches_stock_with_images_once_per_pair(tmp_path, processors, family, data):
    dataset = synthetic_image_pairs(4, DATA[data], seed=1)
    stock, shared = make_vision_trainers(tmp_path, processors[family], family, dataset)
    stock_counts, shared_counts = count_images_through_tower(stock), count_images_through_tower(shared)
    stock_result, shared_result = step(stock, rows(dataset)), step(shared, rows(dataset))
    assert_same_step(stock_result, shared_result)

    images = sum(len(example["images"]) for example in rows(dataset))
    # step() runs the policy twice (loss, then log-probs): one tower call each, on every image of the batch once
    assert stock_counts["calls"] == shared_counts["calls"] == (2 if images else 0)
    assert shared_counts["images"] == 2 * images and stock_counts["images"] == 2 * shared_counts["images"]
    assert stock_counts["patches"] == 2 * shared_counts["patches"] >= (1 if images else 0)
    batch = shared_result["batch"]
    layout = batch["prefix_sharing"]
    if data != "text_only":
        assert layout.vision["pixel_values"].shape[0] * 2 == batch["pixel_values"].shape[0]
    assert layout.vision["position_ids"].shape == (3, *layout.input_ids.shape)
    assert (layout.document_ids >= 0).sum() < batch["attention_mask"].sum()


def test_truncated_completions_match_stock(tmp_path, processors):
    # keep_start truncation that cuts completions (never the images) in some rows
    dataset = synthetic_image_pairs(4, DATA["mixed"], completion_len=(4, 9), seed=2)
    stock, shared = make_vision_trainers(tmp_path, processors["qwen2_vl"], "qwen2_vl", dataset, max_length=30)
    stock_result, shared_result = step(stock, rows(dataset)), step(shared, rows(dataset))
    assert (stock_result["batch"]["attention_mask"].sum(1) == 30).any()
    assert_same_step(stock_result, shared_result)


def test_wrong_mask_and_wrong_positions_fail(tmp_path, processors, monkeypatch):
    """A mask letting the rejected completion see the chosen one, or text positions in place of M-RoPE's, must break
    the comparison."""
    dataset = synthetic_image_pairs(4, DATA["mixed"], seed=3)
    stock, shared = make_vision_trainers(tmp_path, processors["qwen2_vl"], "qwen2_vl", dataset)
    stock_result = step(stock, rows(dataset))
    assert_same_step(stock_result, step(shared, rows(dataset)))  # the real layout passes

    with monkeypatch.context() as patch:
        patch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
        with pytest.raises(AssertionError):
            assert_same_step(stock_result, step(shared, rows(dataset)))

    def text_positions(base_model, inputs):
        rows, length = inputs["input_ids"].shape
        return torch.arange(length).view(1, 1, -1).expand(3, rows, -1)

    with monkeypatch.context() as patch:
        patch.setattr(vision_module, "_stock_position_ids", text_positions)
        with pytest.raises(AssertionError):
            assert_same_step(stock_result, step(shared, rows(dataset)))


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_packed_step_matches_stock(tmp_path, processors, prefix_sharing):
    dataset = synthetic_image_pairs(5, DATA["mixed"], seed=4)
    stock, packed = make_vision_trainers(
        tmp_path,
        processors["qwen2_5_vl"],
        "qwen2_5_vl",
        dataset,
        ours={"prefix_sharing": prefix_sharing, "packing": True, "packing_length": 512},
    )
    # the whole batch in one row: images of several pairs in it
    packed.data_collator.rows = RowPolicy(pack=True, length=packed.packed_batches.length, one_row=True)
    stock_result = step(stock, rows(dataset))
    packed_result = step(packed, rows(dataset))
    layout = packed_result["batch"]["prefix_sharing"]
    assert layout.input_ids.shape == (1, 512) and int(layout.document_ids.max()) >= len(dataset) - 1
    assert_same_step(stock_result, packed_result)


def test_training_and_evaluation_match_stock(tmp_path, processors):
    train = synthetic_image_pairs(8, DATA["mixed"], seed=5)
    evaluation = synthetic_image_pairs(4, DATA["mixed"], seed=6)
    stock, shared = make_vision_trainers(
        tmp_path, processors["qwen3_vl"], "qwen3_vl", train, eval_dataset=evaluation, max_steps=2, learning_rate=1e-3
    )
    stock.train()
    shared.train()
    stock_logs = [entry for entry in stock.state.log_history if "loss" in entry]
    shared_logs = [entry for entry in shared.state.log_history if "loss" in entry]
    assert len(stock_logs) == len(shared_logs) == 2
    for expected, got in zip(stock_logs, shared_logs, strict=True):
        for key, value in expected.items():
            if key in ("grad_norm", "loss") or key.startswith(("rewards/", "logps/", "logits/")):
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert shared_logs[-1]["num_shared_tokens"] < shared_logs[-1]["num_tokens"]
    stock_eval, shared_eval = stock.evaluate(), shared.evaluate()
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"):
        assert shared_eval[key] == pytest.approx(stock_eval[key], rel=1e-4, abs=1e-5), key


# ------------------------------------------------------------------------------------------------------ errors
def test_unproven_vision_families_are_refused(tmp_path, processors):
    from transformers import LlavaConfig

    config = LlavaConfig()
    config.save_pretrained(tmp_path / "llava")
    dataset = synthetic_image_pairs(2, DATA["one_image"])
    with pytest.raises(ValueError, match=r"qwen2_vl, qwen2_5_vl, qwen3_vl; this model is 'llava'"):
        DPOTrainer(
            model=str(tmp_path / "llava"),
            args=dpo_args(tmp_path, True),
            train_dataset=dataset,
            processing_class=processors["qwen2_vl"],
        )
    # transformers' Qwen VL models refuse flex_attention, and the varlen kernel is not measured on them: "auto" on
    # CUDA means SDPA for them, an explicit Flex or varlen fails naming why
    vision_model = type(
        "VisionModel",
        (),
        {
            "config": make_vision_config("qwen2_vl", processors["qwen2_vl"].tokenizer),
            "_supports_sdpa": True,
            "_supports_flex_attn": True,
        },
    )()
    cuda = torch.device("cuda")
    assert attention_module.choose_backend([vision_model], "auto", cuda, torch.bfloat16).name == "sdpa"
    assert attention_module.choose_backend([vision_model], "sdpa", cuda, torch.bfloat16).name == "sdpa"
    with pytest.raises(ValueError, match="do not accept `flex_attention`.*Use 'auto'"):
        attention_module.choose_backend([vision_model], "flex_attention", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="vision-language models are not yet measured on the varlen kernel"):
        attention_module.choose_backend([vision_model], "varlen", cuda, torch.bfloat16)
    # a window slides where the text config has sliding layers (as transformers builds `layer_types` from
    # `use_sliding_window`, `sliding_window` and `max_window_layers`): the one window rule of `window_layout`
    sliding = make_vision_config("qwen2_vl", processors["qwen2_vl"].tokenizer)
    sliding.text_config.use_sliding_window, sliding.text_config.sliding_window = True, 8
    sliding.text_config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="sliding-window"):
        vision_module.check_supported_vision_model(sliding)


def test_reward_trainer_refuses_images(tmp_path, processors):
    from trl_prefix_sharing import RewardTrainer
    from trl_prefix_sharing.testing import make_tokenizer
    from trl_prefix_sharing.testing.equivalence import make_reward_model, reward_args

    tokenizer = make_tokenizer()
    dataset = synthetic_image_pairs(2, DATA["one_image"])
    with pytest.raises(ValueError, match="RewardTrainer has no image support"):
        RewardTrainer(
            model=make_reward_model("llama", tokenizer),
            args=reward_args(tmp_path, {"prefix_sharing": True}),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match="RewardTrainer with prefix sharing does not lay out images"):
        RewardTrainer(
            model=make_reward_model("llama", tokenizer),
            args=reward_args(tmp_path, {"prefix_sharing": True}),
            train_dataset=dataset,
            processing_class=processors["qwen2_vl"],
        )


def test_image_tokens_cut_by_max_length_and_videos_are_refused(tmp_path, processors):
    dataset = synthetic_image_pairs(2, [[(32, 32)]])  # 16 image tokens from position 3 on
    stock, shared = make_vision_trainers(tmp_path, processors["qwen2_vl"], "qwen2_vl", dataset, max_length=10)
    with pytest.raises(ValueError, match="max_length"):
        step(stock, rows(dataset))
    with pytest.raises(ValueError, match="max_length"):
        step(shared, rows(dataset))

    batch = shared._prepare_inputs(shared.data_collator(rows(dataset)[:1]))
    batch["pixel_values_videos"] = torch.zeros(4, 96)
    with pytest.raises(ValueError, match="pixel_values_videos"):
        shared.compute_loss(shared.model, batch)
