"""The varlen backend: the micro-batch's tokens as one unpadded row whose query segments read their paths' gathered
keys. Its segments are exactly the prefix-sharing mask, its reference attention (the CPU's) equals masked SDPA, the
gather sums repeated keys' gradients in float32 and deterministically, and every trainer computes stock TRL's numbers
on it, seeing no padding."""

import json
import random

import pytest
import torch
import torch.nn.functional as F
from test_layout import _random_rows, _stock, check_layout

from trl_prefix_sharing import layout as layout_module
from trl_prefix_sharing import varlen
from trl_prefix_sharing.layout import RowPolicy, build_layout
from trl_prefix_sharing.mask import dense_mask, prefix_sharing_mask
from trl_prefix_sharing.testing import FAMILIES
from trl_prefix_sharing.testing.equivalence import (
    assert_same_reward_step,
    awkward_text_dataset,
    compare_step,
    conversational_dataset,
    family_config_kwargs,
    make_reward_trainers,
    make_trainers,
    reward_step,
)
from trl_prefix_sharing.trie import StockRows


STREAM = RowPolicy(stream=True)
VARLEN = {"prefix_sharing": True, "prefix_sharing_attn_implementation": "varlen"}


def segment_mask(layout) -> torch.Tensor:
    """`[T, T]`: which keys each query of a one-row layout reads through its segments (bottom-right causal within a
    segment's gathered path, or the whole path for scored padding)."""
    width = layout.input_ids.shape[1]
    allowed = torch.zeros(width, width, dtype=torch.bool)
    seen = torch.zeros(width, dtype=torch.long)
    for call in layout.segments:
        queries = call.query_index if call.query_index is not None else torch.arange(width)
        for q0, q1, k0, k1 in call.bounds():
            keys = call.key_index[k0:k1]
            for i, query in enumerate(queries[q0:q1].tolist()):
                last = (k1 - k0) - (q1 - q0) + i if call.causal else k1 - k0 - 1
                allowed[query, keys[: last + 1]] = True
                seen[query] += 1
    assert torch.equal(seen, torch.ones(width, dtype=torch.long))  # every position is computed, once
    return allowed


def assert_segments_are_the_mask(layout):
    assert layout.input_ids.shape[0] == 1 and (layout.document_ids >= 0).all()  # one row, no padding
    width = layout.input_ids.shape[1]
    expected = dense_mask(
        prefix_sharing_mask(layout.subtree_end, key_visible=layout.key_visible), 1, width, width
    ).view(width, width)
    got = segment_mask(layout)
    assert expected.any() and torch.equal(got, expected), (got.int(), expected.int())


@pytest.mark.parametrize("seed", range(30))
def test_segments_are_exactly_the_prefix_sharing_mask(seed):
    rng = random.Random(seed)
    rows = _random_rows(rng, rng.randrange(1, 9))
    ids, attn, _ = _stock(rows, left=seed % 2 == 1)
    layout = build_layout(StockRows(ids, attn), rows=STREAM)
    check_layout(layout, ids, attn)  # the one-row layout itself is the trie (against the brute-force oracle)
    assert_segments_are_the_mask(layout)
    assert layout.segments[0].query_index is None  # the row's tokens in order are the queries


@pytest.mark.parametrize("seed", range(10))
def test_scored_padding_is_a_second_call_that_sees_the_whole_real_path(seed):
    rng = random.Random(100 + seed)
    rows = _random_rows(rng, rng.randrange(2, 9))
    prompt_length = 2
    ids, attn, _ = _stock(rows)  # right-padded: [prompt | completion | pad], the padding scored (online DPO)
    layout = build_layout(
        StockRows.generated(ids, attn, prompt_length, score_padding=True), pad_token_id=0, rows=STREAM
    )
    check_layout(layout, ids, attn, score_padding=True)
    assert_segments_are_the_mask(layout)
    if (attn == 0).any():
        assert len(layout.segments) == 2 and not layout.segments[1].causal


def test_a_wrong_segment_fails_the_comparison():
    """The comparison above is not vacuous: keys shifted by one position are another mask."""
    ids, attn, _ = _stock([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 7]])
    layout = build_layout(StockRows(ids, attn), rows=STREAM)
    call = layout.segments[0]
    call.key_index = call.key_index.roll(1)
    with pytest.raises(AssertionError):
        assert_segments_are_the_mask(layout)


def test_the_row_holds_no_padding_and_fewer_positions_than_the_rounded_rows():
    ids, attn, _ = _stock([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 8], [9, 10]])
    stream = build_layout(StockRows(ids, attn), rows=STREAM)
    rows = build_layout(StockRows(ids, attn), rows=RowPolicy(multiple=8))
    assert stream.input_ids.numel() == (stream.document_ids >= 0).sum() == 7 + 2 + 2  # the trie, plus one copy
    assert rows.input_ids.numel() == 2 * 16 > stream.input_ids.numel()  # 9 and 2 tokens, each row rounded to 16
    assert stream.segments[0].max_queries == 7 and stream.segments[0].max_keys == 7


def test_a_layout_for_other_rows_has_no_segments_for_the_varlen_backend():
    from trl_prefix_sharing.attention import BACKENDS

    ids, attn, _ = _stock([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(RuntimeError, match="no query segments"):
        BACKENDS["varlen"].inputs(build_layout(StockRows(ids, attn)), config=None)


# ----------------------------------------------------------------------------------------------- the attention
def _random_layout(seed):
    rng = random.Random(seed)
    rows = [[rng.randrange(1, 4) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
    rows += [row[: rng.randrange(1, len(row) + 1)] + [7, 8] for row in rows[:3]]  # branches off earlier rows
    ids, attn, _ = _stock(rows)
    return build_layout(StockRows(ids, attn), rows=STREAM)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_reference_attention_and_its_gradients_equal_masked_sdpa(window, heads):
    layout = _random_layout(0)
    width = layout.input_ids.shape[1]
    q_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(width, h, 8, generator=generator, dtype=torch.float64) for h in heads + heads[1:])
    mask = dense_mask(prefix_sharing_mask(layout.subtree_end, layout.position_ids, window), 1, width, width)
    outputs, grads = [], []
    for segmented in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if segmented:
            out = varlen.segment_attention(*leaves, layout.segments, scale=0.3, window=window)
        else:
            dense = (t.transpose(0, 1).unsqueeze(0) for t in leaves)
            out = F.scaled_dot_product_attention(*dense, attn_mask=mask, scale=0.3, enable_gqa=q_heads != kv_heads)
            out = out[0].transpose(0, 1)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        outputs.append(out.detach())
        grads.append([t.grad for t in leaves])
    assert outputs[0].shape == (width, q_heads, 8) and outputs[1].abs().sum() > 0
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-12, rtol=1e-10)
    for got, expected in zip(*grads, strict=True):
        assert expected.abs().sum() > 0
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


def test_gather_sums_repeated_rows_in_float32_deterministically():
    """A prefix row read by 4096 segments: its gradient is the float32 sum of the copies' bfloat16 gradients, rounded
    once (a sum in bfloat16, as CUDA's atomics in the tensor's dtype make it, is far off), and the same bits every
    time."""
    source = torch.zeros(3, 2, dtype=torch.bfloat16, requires_grad=True)
    index = torch.tensor([0] * 4096 + [1, 2])
    grad = torch.full((4098, 2), 1.0 + 2**-7, dtype=torch.bfloat16)  # each copy's gradient, exact in bfloat16
    sums = []
    for _ in range(2):
        source.grad = None
        varlen.gather_rows(source, index).backward(grad)
        sums.append(source.grad.clone())
    expected = (4096 * (1.0 + 2**-7)) * torch.ones(2, dtype=torch.float64)
    assert torch.equal(sums[0], sums[1]) and sums[0].dtype == torch.bfloat16
    torch.testing.assert_close(sums[0][0].double(), expected.to(torch.bfloat16).double(), atol=0, rtol=0)
    in_bfloat16 = torch.zeros((), dtype=torch.bfloat16)
    for value in grad[:4096, 0]:  # the same sum, rounded to bfloat16 after every addition
        in_bfloat16 = in_bfloat16 + value
    assert abs(in_bfloat16.double() - expected[0]) > 100


@pytest.mark.parametrize("window", [2, 4, 64])
def test_scored_padding_under_a_sliding_window_equals_masked_sdpa(window):
    """Scored padding's queries see their row's real path within the window (measured in positions: a padding query
    follows its path); a window that bites them goes through the reference on any device."""
    ids = torch.tensor([[1, 2, 3, 4, 0, 0], [1, 2, 3, 5, 6, 0], [1, 2, 7, 0, 0, 0]])
    attn = (ids > 0).long()
    layout = build_layout(StockRows.generated(ids, attn, 2, score_padding=True), pad_token_id=0, rows=STREAM)
    width = layout.input_ids.shape[1]
    q, k, v = (torch.randn(width, 2, 8, dtype=torch.float64) for _ in range(3))
    got = varlen.segment_attention(q, k, v, layout.segments, window=window)
    mask = prefix_sharing_mask(layout.subtree_end, layout.position_ids, window, layout.key_visible)
    dense = dense_mask(mask, 1, width, width)
    visible = dense[0, 0].any(-1)  # a padding query whose window holds no real key attends to nothing
    expected = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), attn_mask=dense)[
        0
    ].transpose(0, 1)
    assert visible.any()
    torch.testing.assert_close(got[visible], expected[visible], atol=1e-12, rtol=1e-10)


def test_segments_travel_with_the_layout():
    ids, attn, _ = _stock([[1, 2, 3], [1, 2, 4]])
    layout = build_layout(StockRows(ids, attn), rows=STREAM)
    moved = layout.to("cpu")
    assert isinstance(moved.segments, tuple) and isinstance(moved.segments[0], layout_module.Segments)
    assert torch.equal(moved.segments[0].key_index, layout.segments[0].key_index)
    assert json.dumps(moved.segments[0].bounds())  # plain ints


def test_a_model_that_drops_the_segments_is_a_clear_error():
    """A model whose attention does not hand the model's keywords on gets the shared call's placeholder mask and no
    segments: a one-line error naming why, never SDPA over the placeholder."""
    module = torch.nn.Module()
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="does not hand the model's keyword arguments on"):
        varlen.varlen_attention_forward(module, q, q, q, torch.zeros(1, 1, 0, 0, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------- trainers
def model_positions(batch) -> int:
    """The positions the model runs on a batch's shared rows, padding included."""
    return batch["prefix_sharing"].input_ids.numel()


def assert_fewer_positions_than_sdpa(trainer, examples, batch) -> None:
    """The model runs no padding: no more positions than the same batch's shared rows under the dense mask (SDPA's
    rows, rounded as configured), and fewer wherever those are several rows (of different lengths)."""
    from trl_prefix_sharing.attention import BACKENDS

    rows = trainer.data_collator.rows
    trainer.data_collator.rows = BACKENDS["sdpa"].rows(trainer.sharing_session.pad_to_multiple_of)
    try:
        dense = trainer.data_collator(examples)["prefix_sharing"].input_ids
    finally:
        trainer.data_collator.rows = rows
    assert model_positions(batch) <= dense.numel()
    if dense.shape[0] > 1:
        assert model_positions(batch) < dense.numel()


DPO_DATA = {
    "awkward_text": lambda: (awkward_text_dataset(), {}),
    "truncated": lambda: (awkward_text_dataset(), {"max_length": 12}),
    "conversational_multiturn": lambda: (conversational_dataset(), {"max_length": 40}),
    "pad_to_multiple_of_8": lambda: (awkward_text_dataset(), {"pad_to_multiple_of": 8}),
}


@pytest.mark.parametrize("data", list(DPO_DATA))
@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_step_matches_stock_without_padding(tmp_path, tokenizer, family, data):
    dataset, overrides = DPO_DATA[data]()
    stock, shared = make_trainers(tmp_path, family, dataset, tokenizer, ours=VARLEN, **overrides)
    assert shared.sharing_session.backend.name == "varlen"
    stock_result, result = compare_step(stock, shared)
    layout = result["batch"]["prefix_sharing"]
    assert layout.input_ids.shape[0] == 1 and (layout.document_ids >= 0).all() and layout.segments
    assert_fewer_positions_than_sdpa(shared, list(shared.train_dataset), result["batch"])


def test_wrong_segments_fail(tmp_path, tokenizer, monkeypatch):
    """Segments that let every token see the whole row before it (plain causal over the stream: the rejected answer
    reads the chosen one) must break the comparison."""
    stock, shared = make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer, ours=VARLEN)
    compare_step(stock, shared)  # the real segments pass

    def causal_row(plan, flat, depth, laid, num_rows):
        width = int((plan.lengths - plan.first_new).sum())  # the row's positions
        whole = torch.tensor([0, width], dtype=torch.int32)
        return (layout_module.Segments(torch.arange(width), whole, whole, width, width),)

    monkeypatch.setattr(layout_module, "_segments", causal_row)
    with pytest.raises(AssertionError):
        compare_step(stock, shared)


@pytest.mark.parametrize(
    "extra, options",
    [
        ({}, {"loss_type": ["ipo", "sigmoid_norm", "sft"], "loss_weights": [1.0, 0.5, 0.2]}),
        ({}, {"loss_type": ["sigmoid"], "use_weighting": True, "ld_alpha": 0.5}),
        ({"prefix_sharing_join": "always"}, {}),
    ],
    ids=["ipo-sigmoid_norm-sft", "weighting-ld_alpha", "join-always"],
)
def test_dpo_loss_types_and_join(tmp_path, tokenizer, extra, options):
    stock, shared = make_trainers(
        tmp_path, "qwen3", conversational_dataset(), tokenizer, ours={**VARLEN, **extra}, **options
    )
    compare_step(stock, shared)


@pytest.mark.parametrize("window", ["mistral", "qwen2-mixed"])
def test_sliding_window_matches_stock(tmp_path, tokenizer, window):
    """A window shorter than the rows (`window_size=(W - 1, 0)` on CUDA, the reference's mask here), on every layer
    (Mistral) or on some (Qwen2's `max_window_layers`)."""
    family, config_kwargs = {
        "mistral": ("mistral", {"sliding_window": 5}),
        "qwen2-mixed": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    }[window]
    data = conversational_dataset()
    stock, shared = make_trainers(tmp_path, family, data, tokenizer, ours=VARLEN, config_kwargs=config_kwargs)
    _, result = compare_step(stock, shared)
    assert max(call.max_keys for call in result["batch"]["prefix_sharing"].segments) > 5  # the window bites


def test_sliding_window_variant_of_the_registry_matches_stock(tmp_path, tokenizer):
    stock, shared = make_trainers(
        tmp_path,
        "qwen3",
        awkward_text_dataset(),
        tokenizer,
        ours=VARLEN,
        config_kwargs=family_config_kwargs("qwen3", "sliding_window"),
    )
    compare_step(stock, shared)


@pytest.mark.parametrize("data", ["awkward_text", "conversational"])
def test_reward_step_matches_stock(tmp_path, tokenizer, data):
    dataset = awkward_text_dataset() if data == "awkward_text" else conversational_dataset()
    stock, shared = make_reward_trainers(tmp_path, "qwen2", dataset, tokenizer, ours=VARLEN)
    examples = list(stock.train_dataset)
    expected, got = reward_step(stock, examples), reward_step(shared, examples)
    assert_same_reward_step(expected, got)
    assert_fewer_positions_than_sdpa(shared, examples, got["batch"])


@pytest.mark.parametrize("data", ["all_pairs", "multi_turn", "duplicates"])
def test_trie_across_pairs_and_turns_matches_stock(tmp_path, tokenizer, data):
    from test_trie_sharing import DATASETS

    stock, shared = make_trainers(tmp_path, "qwen3", DATASETS[data](), tokenizer, ours=VARLEN)
    _, got = compare_step(stock, shared)
    shared.data_collator.across_examples = False  # each pair's prompt alone
    assert got["batch"]["prefix_sharing"].input_ids.numel() < model_positions(
        shared.data_collator(list(shared.train_dataset))
    )


def test_lora_and_gradient_checkpointing_training_match_stock(tmp_path, tokenizer):
    from peft import LoraConfig

    from trl_prefix_sharing.testing import synthetic_pairs
    from trl_prefix_sharing.testing.equivalence import assert_same_training, train_and_evaluate

    stock, shared = make_trainers(
        tmp_path,
        "llama",
        synthetic_pairs(8, (1, 30), (1, 8), seed=3),
        tokenizer,
        eval_dataset=synthetic_pairs(4, (1, 30), (1, 8), seed=4),
        ref_model=None,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        ours=VARLEN,
        max_steps=2,
        learning_rate=1e-3,
        gradient_checkpointing=True,
    )
    assert_same_training(train_and_evaluate(stock), train_and_evaluate(shared))


# ----------------------------------------------------------------------------------------------- generated rows
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    from trl_prefix_sharing.testing.group_equivalence import save_model

    directory = tmp_path_factory.mktemp("models")
    return {family: save_model(directory, family, tokenizer) for family in ("qwen2", "qwen3")}


def test_grpo_crafted_batch_log_probs_and_gradients_match_stock(tmp_path, tokenizer, model_dirs):
    """Left-padded prompts of several lengths, a prompt's generations apart in the batch, identical completions, an
    all-zero completion mask: per-token log-probs, entropies and gradients."""
    from test_grpo_equivalence import crafted_batch, logps_and_grads

    from trl_prefix_sharing.testing.group_equivalence import make_group_trainer, prompt_dataset

    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    stock, shared = (
        make_group_trainer("grpo", ours, model_dirs["qwen3"], prompt_dataset(), tokenizer, tmp_path)
        for ours in (False, VARLEN)
    )
    expected, got = (logps_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared))
    assert shared.sharing_session.backend.name == "varlen" and expected[2]
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(got[0][0], got[0][3])  # identical completions: bitwise equal


@pytest.mark.parametrize(
    "kind, setting",
    [("grpo", {"beta": 0.1, "num_iterations": 2}), ("rloo", {"beta": 0.1})],
    ids=["grpo-reference-iterations", "rloo-reference"],
)
def test_group_training_matches_stock(tmp_path, tokenizer, model_dirs, kind, setting):
    from trl_prefix_sharing.testing.group_equivalence import (
        assert_same_runs,
        make_group_trainer,
        prompt_dataset,
        train,
    )

    stock, shared = (
        train(make_group_trainer(kind, ours, model_dirs["qwen2"], prompt_dataset(), tokenizer, tmp_path, **setting))
        for ours in (False, VARLEN)
    )
    assert_same_runs(stock, shared)


def test_online_dpo_scores_its_padding_through_a_second_call(tmp_path, tokenizer):
    """Online DPO's statistics sum over the completions' padding: the padding queries are a second varlen call that
    sees each row's whole real path."""
    from test_grpo_equivalence import crafted_batch
    from test_online_dpo_equivalence import forward_and_grads
    from test_online_dpo_equivalence import make_trainers as online_trainers

    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    stock, shared = online_trainers(tmp_path, "qwen3", tokenizer, ours=VARLEN)
    (expected, expected_grads), (got, grads) = (
        forward_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared)
    )
    padding = attention_mask[:, -keep:] == 0
    assert padding.any() and expected_grads and shared.sharing_session.backend.name == "varlen"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # padding columns included
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    layout = next(iter(shared.sharing_session._layouts._entries.values()))[1]
    assert len(layout.segments) == 2 and not layout.segments[1].causal


# ----------------------------------------------------------------------------------------------- rows built in a step
@pytest.mark.parametrize("setting", ["kto-merged", "kto-apart", "precomputed-reference"])
def test_kto_batch_matches_stock(tmp_path, tokenizer, setting):
    from test_kto_equivalence import SETTINGS, kto_step, unpaired_dataset
    from test_kto_equivalence import assert_same_step as assert_same_kto_step
    from test_kto_equivalence import make_trainers as kto_trainers

    options, ours = SETTINGS[setting]
    stock, shared = kto_trainers(tmp_path, tokenizer, unpaired_dataset(), ours={**VARLEN, **ours}, **options)
    for start in (0, 4):
        examples = [shared.train_dataset[i] for i in range(start, start + 4)]
        assert_same_kto_step(kto_step(stock, examples), kto_step(shared, examples))


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
@pytest.mark.parametrize("score_padding", [True, False], ids=["scored-padding", "default"])
def test_orpo_cpo_batch_matches_stock(tmp_path, tokenizer, kind, score_padding):
    from test_orpo_cpo_equivalence import assert_default_batch, assert_same_batch, loss_and_grads
    from test_orpo_cpo_equivalence import make_trainers as paired_trainers

    options = {"cpo_alpha": 0.5, "loss_type": "simpo"} if kind == "cpo" else {}
    dataset = conversational_dataset()
    stock, shared = paired_trainers(
        tmp_path, kind, tokenizer, dataset, family="qwen3", ours=VARLEN, score_padding=score_padding, **options
    )
    examples = [shared.train_dataset[i] for i in range(len(dataset))]
    if score_padding:  # every number stock's: the padding's queries are a second call
        assert_same_batch(loss_and_grads(stock, examples), loss_and_grads(shared, examples))
    else:
        assert_default_batch(stock, shared, examples)


@pytest.mark.parametrize("data", ["completions", "messages"])
def test_sft_step_matches_stock(tmp_path, tokenizer, data):
    from test_sft_equivalence import ALWAYS, DATASETS, compare

    _, shared, _, got = compare(tmp_path, tokenizer, DATASETS[data](), family="qwen3", ours={**ALWAYS, **VARLEN})
    layout = got[3]["prefix_sharing"]
    assert layout.input_ids.shape[0] == 1 and layout.segments and shared.sharing_session.backend.name == "varlen"


# ----------------------------------------------------------------------------------------------- precision, checks
@pytest.mark.parametrize("kind", ["dpo", "reward", "grpo", "online_dpo", "kto", "orpo", "sft"])
def test_bf16_autocast_first_step_is_stocks_and_auto_takes_varlen_where_listed(tmp_path, tokenizer, monkeypatch, kind):
    """`bf16=True` on the CPU (autocast), with `"auto"` taking varlen where it is a candidate: every pass runs in
    stock's dtype and the first step logs stock's numbers to bfloat16 round-off."""
    from test_mixed_precision import check_passes_in_stocks_dtype

    import trl_prefix_sharing.attention as attention_module

    monkeypatch.setattr(attention_module, "_auto_candidates", lambda device: ("varlen", "sdpa"))
    chosen = []
    choose = attention_module.choose_backend
    monkeypatch.setattr(
        "trl_prefix_sharing.sharing.choose_backend", lambda *a, **k: chosen.append(choose(*a, **k)) or chosen[-1]
    )
    check_passes_in_stocks_dtype(tmp_path, tokenizer, kind)
    assert chosen and {backend.name for backend in chosen} == {"varlen"}


def test_startup_check_judges_the_varlen_layout(tmp_path, tokenizer):
    """The start-up check runs the stock rows through the switched model (its SDPA fallback without segments) and the
    shared rows through the segments: equal."""
    stock, shared = make_trainers(
        tmp_path,
        "qwen2",
        awkward_text_dataset(),
        tokenizer,
        ours={**VARLEN, "prefix_sharing_model_check": "always"},
    )
    compare_step(stock, shared)
    result = shared.model_check.result
    assert result is not None and result.passed and result.values > 0 and result.difference <= 1e-5


def test_the_models_are_left_as_stock_and_no_saved_config_names_the_kernel(tmp_path, tokenizer, monkeypatch):
    stock, shared = make_trainers(
        tmp_path,
        "llama",
        awkward_text_dataset(),
        tokenizer,
        ours=VARLEN,
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
    )
    calls = []
    attention = varlen.segment_attention
    monkeypatch.setattr(varlen, "segment_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    shared.train()
    assert calls  # the segments ran
    for model, stock_model in ((shared.model, stock.model), (shared.ref_model, stock.ref_model)):
        assert model.config._attn_implementation == stock_model.config._attn_implementation == "sdpa"
    configs = list(tmp_path.rglob("config.json"))  # the checkpoints saved during training
    assert configs and all(varlen.VARLEN_ATTENTION not in path.read_text() for path in configs)
    shared.model.save_pretrained(tmp_path / "saved")
    assert varlen.VARLEN_ATTENTION not in (tmp_path / "saved" / "config.json").read_text()


# ----------------------------------------------------------------------------------------------- where it cannot run
def _fake_cuda(monkeypatch, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return torch.device("cuda")


@pytest.mark.parametrize(
    "case, match",
    [
        ("float32", "computes in bfloat16 or float16, and this run's attention computes in float32"),
        ("turing", "needs an Ampere or newer GPU \\(sm80\\+\\), this one is sm75"),
        ("old_torch", "has no `torch.nn.attention.varlen.varlen_attn` with `window_size`"),
        ("head_dim_12", "head sizes that are multiples of 8 up to 256, this model's is 12"),
        ("softcapping", "attention \\(softcapping or sinks\\) has no varlen form"),
        ("unmeasured_type", "'ps_plain_decoder' is not measured on the varlen kernel"),
    ],
)
def test_an_explicit_varlen_that_cannot_run_is_a_one_line_error(tokenizer, monkeypatch, case, match):
    from trl_prefix_sharing.attention import choose_backend
    from trl_prefix_sharing.testing import make_model

    device = _fake_cuda(monkeypatch, (7, 5) if case == "turing" else (9, 0))
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    if case == "old_torch":
        monkeypatch.setattr(varlen, "varlen_kernel", lambda: None)
    kwargs = {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2} if case == "head_dim_12" else {}
    if case == "softcapping":
        model = make_model("gemma2", len(tokenizer), attn_implementation="eager")
    elif case == "unmeasured_type":
        from trl_prefix_sharing.testing.custom_models import custom_model

        model = custom_model("ps_plain_decoder", len(tokenizer))
    else:
        model = make_model("llama", len(tokenizer), **kwargs)
    with pytest.raises(ValueError, match=f"'varlen'` cannot run here: .*{match}.*Use 'auto'") as error:
        choose_backend([model], "varlen", device, dtype)
    assert "\n" not in str(error.value)


def test_auto_falls_back_and_says_why(tokenizer, monkeypatch):
    from transformers.testing_utils import CaptureLogger

    import trl_prefix_sharing.attention as attention_module
    from trl_prefix_sharing.testing import make_model

    device = _fake_cuda(monkeypatch)
    model = make_model("llama", len(tokenizer))
    with CaptureLogger(attention_module.logger) as captured:
        chosen = attention_module.choose_backend([model], "auto", device, torch.float32)
    assert chosen.name == "flex_attention"
    assert "not varlen: FlashAttention-2 computes in bfloat16 or float16" in captured.out
    assert attention_module.choose_backend([model], "auto", device, torch.bfloat16).name == "varlen"
