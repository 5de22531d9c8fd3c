"""GRPO and RLOO with prefix sharing compute stock TRL's numbers: log-probs and gradients of crafted batches, and whole
training runs (same sampled completions, every logged metric per step, final weights)."""

import re

import pytest
import torch
import trl

import trl_prefix_sharing.attention as attention_module
from trl_prefix_sharing import GRPOConfig, GRPOTrainer
from trl_prefix_sharing.group_sharing import shuffle_keeping_groups
from trl_prefix_sharing.layout import build_layout
from trl_prefix_sharing.testing import FAMILIES
from trl_prefix_sharing.testing.group_equivalence import (
    assert_same_runs,
    ending_early,
    make_group_trainer,
    prompt_dataset,
    save_model,
    spy_generation_attention,
    train,
)
from trl_prefix_sharing.trie import StockRows


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("models")
    return {family: save_model(directory, family, tokenizer) for family in FAMILIES}


# ----------------------------------------------------------------------------------------------- crafted batches
def crafted_batch(tokenizer):
    """Generated rows as GRPO builds them: left-padded prompts, right-padded completions. Two prompts with four and
    three generations (one prompt's rows not adjacent), a one-token prompt, identical completions, a completion whose
    mask is all zero (`mask_truncated_completions`), completions sharing their first tokens, a lone row."""
    pad = tokenizer.pad_token_id

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompts = {"a": ids("w1 w2 w3 w4 w5"), "b": ids("w9"), "c": ids("w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21")}
    rows = [
        ("a", "w30 w31 w32 <eos>"),
        ("a", "w33 <eos>"),
        ("b", "w40 w41 w42 w43 w44 <eos>"),
        ("a", "w30 w31 w32 <eos>"),
        ("c", "w50 w51 w52"),
        ("b", ""),
        ("a", "w30 w31 w35 w36 w37 <eos>"),
        ("c", "w50 w51 w60 <eos>"),
        ("b", "w40 <eos>"),
    ]
    prompt_length = max(len(p) for p in prompts.values())
    completion_length = max(len(ids(c)) for _, c in rows)
    input_ids, attention_mask = [], []
    for prompt, completion in rows:
        p, c = prompts[prompt], ids(completion)
        input_ids.append([pad] * (prompt_length - len(p)) + p + c + [pad] * (completion_length - len(c)))
        attention_mask.append(
            [0] * (prompt_length - len(p)) + [1] * (len(p) + len(c)) + [0] * (completion_length - len(c))
        )
    return torch.tensor(input_ids), torch.tensor(attention_mask), completion_length


def logps_and_grads(trainer, input_ids, attention_mask, logits_to_keep):
    """Per-token log-probs and entropies of the rows, and the gradients of a weighted sum of the log-probs."""
    trainer.model.zero_grad(set_to_none=True)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, logits_to_keep, batch_size=5, compute_entropy=True
    )
    mask = attention_mask[:, -logits_to_keep:].float()
    weights = torch.linspace(-1, 1, mask.numel(), device=mask.device).view_as(mask)
    (logps * mask * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return logps.detach() * mask, entropies.detach() * mask, grads


@pytest.mark.parametrize("family", FAMILIES)
def test_crafted_batch_log_probs_and_gradients_match_stock(tmp_path, tokenizer, model_dirs, family):
    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    stock, shared = (
        make_group_trainer("grpo", ours, model_dirs[family], prompt_dataset(), tokenizer, tmp_path)
        for ours in (False, True)
    )
    expected, got = (logps_and_grads(t, input_ids, attention_mask, keep) for t in (stock, shared))
    assert expected[0].abs().sum() > 0 and expected[2]
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    assert got[2].keys() == expected[2].keys()
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    # identical completions of one prompt: bitwise identical log-probs (they read the same shared positions)
    assert torch.equal(got[0][0], got[0][3])
    # the shared rows are shorter: each prompt once per chunk of 5 rows
    layout = build_layout(
        StockRows.generated(input_ids[:5], attention_mask[:5], input_ids.shape[1] - keep), pad_token_id=0
    )
    assert (layout.document_ids >= 0).sum() < attention_mask[:5].sum()


def test_wrong_mask_fails(tmp_path, tokenizer, model_dirs, monkeypatch):
    from trl_prefix_sharing.testing.equivalence import leaky_dpo_mask

    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    # "prompts": a join that moves no positions, so no start-up check stops the wrong mask before the comparison
    stock, shared = (
        make_group_trainer("grpo", ours, model_dirs["llama"], prompt_dataset(), tokenizer, tmp_path)
        for ours in (False, {"prefix_sharing_join": "prompts"})
    )
    expected = logps_and_grads(stock, input_ids, attention_mask, keep)[0]
    monkeypatch.setattr(attention_module, "prefix_sharing_mask", leaky_dpo_mask)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(logps_and_grads(shared, input_ids, attention_mask, keep)[0], expected)


def test_entropy_quantile_keeps_stocks_ties(tmp_path, tokenizer, model_dirs):
    """`top_entropy_quantile` keeps the tokens whose entropy is at or above a quantile of the batch's. Stock's rows
    that share every token before a column have exactly equal entropies there; the shared rows compute the first
    token of a branch once per branch, equal to round-off, so a quantile that falls on such a tie kept other tokens
    than stock. `tie_like_stock` restores stock's ties: at every quantile the kept tokens are stock's. Left as
    computed (`top_entropy_quantile=1` skips the ties), some quantiles of this batch keep others."""
    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    mask = attention_mask[:, -keep:]
    quantiles = torch.linspace(0.005, 0.995, 199).tolist()

    def kept(ours, quantile):
        trainer = make_group_trainer(
            "grpo", ours, model_dirs["llama"], prompt_dataset(), tokenizer, tmp_path, top_entropy_quantile=quantile
        )
        entropies = logps_and_grads(trainer, input_ids, attention_mask, keep)[1]
        assert (entropies * mask).sum() > 0
        return [trainer.get_high_entropy_mask(entropies, mask, q) for q in quantiles]

    expected, got, untied = kept(False, 0.5), kept(True, 0.5), kept(True, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(expected, untied, strict=True))


def test_shuffle_keeps_groups_and_the_random_stream(tokenizer):
    input_ids, attention_mask, keep = crafted_batch(tokenizer)
    batch = {
        "prompt_ids": input_ids[:, :-keep],
        "prompt_mask": attention_mask[:, :-keep],
        "completion_ids": input_ids[:, -keep:],
        "advantages": torch.arange(9.0),
        "num_items_in_batch": torch.tensor(7),
        "names": list("abcdefghi"),
        "images": None,
    }
    torch.manual_seed(3)
    shuffled = shuffle_keeping_groups(batch)
    after_ours = torch.rand(4)
    torch.manual_seed(3)
    trl.trainer.utils.shuffle_sequence_dict(batch)
    assert torch.equal(after_ours, torch.rand(4))  # same random stream: later generations are stock's
    order = shuffled["advantages"].long().tolist()
    assert sorted(order) == list(range(9)) and shuffled["names"] == [batch["names"][i] for i in order]
    assert shuffled["num_items_in_batch"] == 7 and shuffled["images"] is None
    prompts = [tuple(shuffled["prompt_ids"][i].tolist()) for i in range(9)]
    runs = [p for i, p in enumerate(prompts) if i == 0 or p != prompts[i - 1]]
    assert len(runs) == len(set(runs)) == 3  # each prompt's rows are contiguous


# ----------------------------------------------------------------------------------------------- training runs
def run_pair(kind, tmp_path, model, tokenizer, dataset=None, peft_config=None, **overrides):
    import copy

    dataset = dataset if dataset is not None else prompt_dataset()
    return [
        train(
            make_group_trainer(
                kind, ours, model, dataset, tokenizer, tmp_path, peft_config=copy.deepcopy(peft_config), **overrides
            )
        )
        for ours in (False, True)
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen3 and mistral train in the option tests below
def test_grpo_training_matches_stock(tmp_path, tokenizer, model_dirs, family):
    """Default loss (`dapo`), one micro-batch per generation: every logged number and the final weights."""
    stock, shared = run_pair("grpo", tmp_path, model_dirs[family], tokenizer)
    assert_same_runs(stock, shared)
    assert shared[0][-1]["num_shared_tokens"] < sum(log["num_tokens"] for log in stock[0][-1:])


@pytest.mark.parametrize(
    "setting",
    [
        # a quantile whose threshold falls on one of the exact ties stock has where a prompt's generations part (see
        # `test_entropy_quantile_keeps_stocks_ties`): without `tie_like_stock` the loss differs from step 2 on
        {"top_entropy_quantile": 0.5},
        {"beta": 0.1, "entropy_coef": 0.1},  # the entropy bonus: gradients through the shared rows' entropies
        {"num_iterations": 2, "beta": 0.1, "loss_type": "bnpo"},
        {"conversational": True, "beta": 0.05},
        {"mask_truncated_completions": True, "max_completion_length": 3, "scale_rewards": "batch"},
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_grpo_options_match_stock(tmp_path, tokenizer, model_dirs, setting):
    setting = dict(setting)
    dataset = prompt_dataset(conversational=setting.pop("conversational", False))
    stock, shared = run_pair("grpo", tmp_path, model_dirs["qwen3"], tokenizer, dataset=dataset, **setting)
    assert_same_runs(stock, shared)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_truncated_completions_masked_as_in_stock(tmp_path, tokenizer, model_dirs, kind):
    """`mask_truncated_completions=True`, with completions that end (EOS) and completions cut at
    `max_completion_length` in the same steps: the cut ones get an all-zero completion mask in TRL's rows, and the
    shared rows give every number stock does."""
    stock, shared = run_pair(
        kind,
        tmp_path,
        model_dirs["qwen2"],
        tokenizer,
        mask_truncated_completions=True,
        generation_kwargs=ending_early(tokenizer),
    )
    assert any(0 < log["completions/clipped_ratio"] < 1 for log in stock[0])  # some cut, some ended
    assert_same_runs(stock, shared)


def test_rloo_with_reference_matches_stock(tmp_path, tokenizer, model_dirs):
    stock, shared = run_pair("rloo", tmp_path, model_dirs["mistral"], tokenizer, beta=0.1, num_iterations=2)
    assert_same_runs(stock, shared)


# ----------------------------------------------------------------------------------------------- every loss type
#: every `loss_type` of TRL 1.16's `GRPOConfig` (RLOO has a single loss and no `loss_type`), with the fields it is
#: meant for: `luspo` sequence-level ratios (the paper's setup; TRL warns without); `cispo` clamps the ratio itself at
#: `epsilon_high`, set between the ratios of the second iteration so that some are clamped
GRPO_LOSS_TYPES = {
    "grpo": {},
    "dr_grpo": {},
    "dapo": {},
    "bnpo": {},
    "cispo": {"epsilon_high": 1.0},
    "sapo": {},
    "luspo": {"importance_sampling_level": "sequence"},
    "vespo": {},
}
#: the metric that shows each loss type saw ratios other than 1 (clipped tokens, clamped ratios, gamma weights)
RATIO_METRIC = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean", "sapo": None}


def test_every_grpo_loss_type_is_tested():
    """The loss types TRL's `GRPOConfig` documents as supported are exactly those tested below (a loss type a later
    TRL adds fails here until it is tested)."""
    help_text = trl.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    supported = help_text.split("Supported values are", 1)[1].split(". ", 1)[0]
    assert set(re.findall(r"'(\w+)'", supported)) == set(GRPO_LOSS_TYPES)


@pytest.mark.parametrize("loss_type", [*GRPO_LOSS_TYPES, "grpo-sequence"])
def test_grpo_loss_types_match_stock(tmp_path, tokenizer, model_dirs, loss_type):
    """Every loss type (and GSPO: `grpo` with sequence-level ratios), two iterations over one generation batch: the
    second step's ratios are the updated policy's log-probs over the shared old-policy pass's, far enough from 1 (a
    small `epsilon`) that clipping, clamping and gating act."""
    name, _, level = loss_type.partition("-")
    setting = dict(GRPO_LOSS_TYPES[name], loss_type=name, num_iterations=2, epsilon=0.01)
    setting["generation_kwargs"] = ending_early(tokenizer)  # unequal lengths: the normalisations differ
    if level:
        setting["importance_sampling_level"] = level
    stock, shared = run_pair("grpo", tmp_path, model_dirs["qwen3"], tokenizer, **setting)
    assert_same_runs(stock, shared)
    metric = RATIO_METRIC.get(name, "clip_ratio/region_mean")
    if metric is not None:  # the second iteration's ratios are not all 1
        first, second = (log[metric] for log in stock[0])
        assert second != first, (metric, first, second)


def test_lora_matches_stock(tmp_path, tokenizer, model_dirs):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    stock, shared = run_pair(
        "grpo", tmp_path, model_dirs["llama"], tokenizer, peft_config=lora, beta=0.1, learning_rate=1e-2
    )
    assert_same_runs(stock, shared)


def test_generation_runs_on_the_models_own_attention(tmp_path, tokenizer, model_dirs, monkeypatch):
    """A model loaded with eager attention: the shared passes run on SDPA (the shared mask's implementation on CPU),
    generation on eager as in stock TRL (sampling follows the logits' last bits: on CUDA under bf16, generating through
    FlexAttention drew other completions than stock); the model is as given once sharing is removed.

    Stock scores on eager, the shared rows on SDPA: the trained weights differ by the two kernels' round-off, which
    Adam scales up where GRPO's group-centred gradient nearly cancels (stock on eager vs stock on SDPA: 9.1e-06 on one
    CPU, 1e-05 being the default tolerance). The weights' tolerance is twice that spread, measured here by a third run,
    stock on SDPA; a layout error moves weights by about the learning rate (1e-03)."""
    from transformers import LlamaForCausalLM

    seen = spy_generation_attention(monkeypatch, LlamaForCausalLM)
    runs = []
    for ours, attn in ((False, "eager"), (True, "eager"), (False, "sdpa")):
        trainer = make_group_trainer(
            "grpo",
            ours,
            model_dirs["llama"],
            prompt_dataset(),
            tokenizer,
            tmp_path / attn / str(ours),
            model_init_kwargs={"attn_implementation": attn},
        )
        seen.clear()
        runs.append(train(trainer))
        assert len(seen) == 2 and set(seen) == {attn}, seen  # one generation per step
        if ours:
            assert trainer.sharing_session.backend.name == "sdpa"
            assert trainer.model.config._attn_implementation == "eager"  # as TRL left it, after `train()`
            shared = trainer
    stock, ours, stock_sdpa = runs
    rewards = [[(log["reward"], log["num_tokens"]) for log in run[0]] for run in (stock, stock_sdpa)]
    assert rewards[0] == rewards[1] and rewards[0]  # stock on SDPA generated the same completions
    spread = max((stock_sdpa[1][name] - value).abs().max().item() for name, value in stock[1].items())
    assert spread < 1e-4, spread  # the kernels' round-off
    assert_same_runs(stock, ours, atol=max(1e-5, 2 * spread))
    shared.remove_prefix_sharing()
    assert shared.model.config._attn_implementation == "eager" and "generate" not in shared.model.__dict__


ACCUMULATION = dict(gradient_accumulation_steps=2, steps_per_generation=2, per_device_train_batch_size=4, max_steps=2)


def test_accumulation_matches_stock_with_the_same_micro_batches(tmp_path, tokenizer, model_dirs, monkeypatch):
    """`gradient_accumulation_steps = steps_per_generation = 2`: stock TRL given the group-keeping shuffle logs every
    number ours does, per-micro-batch metrics included."""
    monkeypatch.setattr(trl.trainer.grpo_trainer, "shuffle_sequence_dict", shuffle_keeping_groups)
    stock, shared = run_pair("grpo", tmp_path, model_dirs["llama"], tokenizer, beta=0.1, **ACCUMULATION)
    assert_same_runs(stock, shared)


def test_accumulation_matches_plain_stock_where_micro_batches_cannot_matter(tmp_path, tokenizer, model_dirs):
    """Against TRL's own row shuffle, the token-normalised `dapo` loss (a sum over the whole generation batch), the
    gradient, the samples and rewards, and the final weights are the same; per-micro-batch means (entropy, kl, clip
    ratios) are averaged over other micro-batches, so they are not compared."""
    stock, shared = run_pair("grpo", tmp_path, model_dirs["llama"], tokenizer, **ACCUMULATION)
    keys = {
        "loss",
        "grad_norm",
        "num_tokens",
        "reward",
        "reward_std",
        "completions/mean_length",
        "rewards/reward_length/mean",
        "rewards/reward_digits/mean",
    }
    assert_same_runs(stock, shared, keys=keys)


def test_unsupported_model_is_refused_before_training(tmp_path, tokenizer):
    from transformers import BloomConfig, BloomForCausalLM

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", prefix_sharing=True)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="'bloom'.*ALiBi"):
        GRPOTrainer(
            model=bloom,
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=args,
            train_dataset=prompt_dataset(),
            processing_class=tokenizer,
        )


def test_one_layout_per_set_of_rows(tmp_path, tokenizer, model_dirs, monkeypatch):
    """The old-policy and reference passes over a generation batch share a layout, and the training passes over a
    micro-batch (num_iterations=2) share one; fresh or modified tensors get a new one."""
    import trl_prefix_sharing.group_sharing as group_module
    import trl_prefix_sharing.session as sharing_module

    builds, calls = [], []
    real_layout, real_call = sharing_module.build_layout, group_module._SharedRowsModel.__call__
    monkeypatch.setattr(sharing_module, "build_layout", lambda *a, **k: builds.append(1) or real_layout(*a, **k))
    monkeypatch.setattr(
        group_module._SharedRowsModel, "__call__", lambda self, **k: calls.append(1) or real_call(self, **k)
    )
    ours = {"prefix_sharing_join": "prompts"}  # (a join that moves positions adds the start-up check's layouts)
    shared = make_group_trainer(
        "grpo", ours, model_dirs["qwen3"], prompt_dataset(), tokenizer, tmp_path, beta=0.1, num_iterations=2
    )
    train(shared)
    # two steps, one generation batch: the old-policy and reference passes (one layout), then the training pass of
    # each iteration over the same micro-batch (one layout)
    assert (len(calls), len(builds)) == (4, 2)

    cache = sharing_module._LayoutCache()
    ids = torch.arange(12).view(3, 4)
    cache.put((ids[:2],), "k", {"built": 1})
    assert cache.get((ids[:2],), "k") == {"built": 1}  # another view of the same rows
    assert cache.get((ids[1:],), "k") is None  # other rows
    assert cache.get((ids[:2].clone(),), "k") is None  # fresh tensors
    ids[0, 0] = 5
    assert cache.get((ids[:2],), "k") is None  # modified in place
