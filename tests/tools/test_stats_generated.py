"""`trl-prefix-sharing stats --trainer grpo` counts what training lays out of the rows it generates: prompts behind one
system prompt, with user turns of different lengths (so TRL's left padding puts the system prompt at other positions
in each prompt's rows), laid out in micro-batches of consecutive prompts as a real GRPO run lays them out. A model
measured shift-invariant (Llama) shares the system prompt across prompts of any length; GPT-2 (learned absolute
positions) only between prompts of one length. Either way the positions `stats` counts are the `num_shared_tokens`
the run logs, with every completion as long as `stats` assumes."""

import json

import pytest


#: the system prompt every prompt starts with (30 words)
SYSTEM = {"role": "system", "content": " ".join(f"w{i}" for i in range(20, 50))}
#: user turns of 1, 1, 2, 3, 4 and 4 words: each micro-batch of two prompts (8 rows: 2 prompts x 4 generations) holds
#: two of one length, then two of other lengths, then two of one length again
USER_WORDS = (1, 1, 2, 3, 4, 4)
GENERATIONS, COMPLETION, ROWS = 4, 5, 8
#: the models the runs train, and the options of their tiny configs (GPT-2 without dropout)
_FAMILIES = {"llama": {}, "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}


def _prompts() -> list[dict]:
    return [
        {"prompt": [SYSTEM, {"role": "user", "content": " ".join(f"w{100 + 10 * i + k}" for k in range(words))}]}
        for i, words in enumerate(USER_WORDS)
    ]


@pytest.fixture(scope="module")
def model_dirs(tokenizer, tmp_path_factory):
    """The tokenizer and the config of each model the runs below train (`make_model(family, ...)`; GPT-2 without
    dropout), so that `stats` reads the same config: its cost model and whether it is shift-invariant."""
    from trl_prefix_sharing.testing import make_config

    root = tmp_path_factory.mktemp("stats_generated")
    dirs = {}
    for family, options in _FAMILIES.items():
        path = root / family
        tokenizer.save_pretrained(path)
        make_config(family, len(tokenizer), **options).save_pretrained(path)
        dirs[family] = str(path)
    return dirs


def _stats(capsys, model_dir: str, data, *flags) -> str:
    from trl_prefix_sharing.cli.stats import main

    argv = ["--dataset_name", str(data), "--model_name_or_path", model_dir, "--trainer", "grpo"]
    argv += ["--num_generations", str(GENERATIONS), "--max_completion_length", str(COMPLETION)]
    assert main([*argv, "--per_device_train_batch_size", str(ROWS), *flags]) == 0
    return capsys.readouterr().out


def _line(out: str, label: str) -> str:
    """What follows `label` on the first line that starts with it (SDPA's block comes first)."""
    line = next(line for line in out.splitlines() if line.strip().startswith(label))
    return line.split(label, 1)[1].strip()


def _counted(tokenizer, model_dir: str, model, join: str):
    """What `stats` lays out, to the position: its `GeneratedLayouts` over the prompts, under `join`, with the cost
    model of `model` (the one the run trains); and whether it moves positions."""
    import datasets

    from trl_prefix_sharing.cli.stats.arguments import parse_args
    from trl_prefix_sharing.cli.stats.groups import _laid_out
    from trl_prefix_sharing.cli.stats.loading import load_model_config
    from trl_prefix_sharing.cli.stats.trained import GeneratedLayouts, generated_shift

    argv = ["--dataset_name", "-", "--model_name_or_path", model_dir, "--trainer", "grpo"]
    argv += ["--num_generations", str(GENERATIONS), "--max_completion_length", str(COMPLETION)]
    args = parse_args([*argv, "--per_device_train_batch_size", str(ROWS), "--prefix_sharing_join", join])
    shift, _ = generated_shift(join, load_model_config(model_dir))
    layouts = GeneratedLayouts(model, tokenizer.pad_token_id, join, COMPLETION, shift, score_padding=False)
    _, _, _, left = _laid_out(datasets.Dataset.from_list(_prompts()), tokenizer, args, layouts)
    assert left == 0
    return layouts.counts["sdpa"], shift


def _run(tokenizer, tmp_path, family: str, join: str):
    """A GRPO run of this package's trainer over the prompts in the dataset's order (`shuffle_dataset=False`), in
    micro-batches of 8 rows, every completion `COMPLETION` tokens (EOS never sampled) and near-uniform sampling (a
    group's completions start with different tokens), SDPA fixed (the plan is the cost model's, as `stats` counts it):
    the trainer and the `num_shared_tokens` it logs last."""
    import datasets

    import trl_prefix_sharing
    from trl_prefix_sharing.testing import make_model

    config = trl_prefix_sharing.GRPOConfig(
        output_dir=str(tmp_path / f"run_{family}_{join}"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        prefix_sharing=True,
        prefix_sharing_join=join,
        prefix_sharing_attn_implementation="sdpa",
        per_device_train_batch_size=ROWS,
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        shuffle_dataset=False,
        temperature=30.0,
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], -100.0]]},
        beta=0.0,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
    )
    trainer = trl_prefix_sharing.GRPOTrainer(
        model=make_model(family, len(tokenizer), **_FAMILIES[family]),
        reward_funcs=[lambda completions, **kwargs: [float(len(c)) for c in completions]],
        args=config,
        train_dataset=datasets.Dataset.from_list(_prompts()),
        processing_class=tokenizer,
    )
    trainer.train()
    logged = [entry["num_shared_tokens"] for entry in trainer.state.log_history if "num_shared_tokens" in entry]
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and len(steps) == len(USER_WORDS) * GENERATIONS // ROWS
    return trainer, logged[-1]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stats_grpo_counts_what_training_lays_out_behind_a_system_prompt(
    family, model_dirs, tokenizer, tmp_path, capsys
):
    """With `prefix_sharing_join="always"`, the positions `stats` counts as training lays out the micro-batches (the
    printed figure, and to the position) are the `num_shared_tokens` of a real GRPO run; the report says whether the
    model moves positions, and the run's session decides as `stats` said. Llama computes the system prompt once per
    micro-batch, fewer positions than each prompt's group on its own; GPT-2 shares it only between the prompts of one
    length, more positions than Llama's."""
    from trl_prefix_sharing.testing import make_model

    data = tmp_path / "system_prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _prompts()))
    out = _stats(capsys, model_dirs[family], data, "--prefix_sharing_join", "always")
    assert "in micro-batches of 8 rows (2 prompts x 4 generations); prefix_sharing_join=always:" in out
    assert _line(out, "with SDPA (dense, the CPU's kernel):") == "3 of 3 micro-batches joined across prompts (always)"
    moved = _line(out, "positions of a shared start:")
    shared = _line(out, "tokens per prompt, shared:").split(" of stock's ")[0]
    per_group = float(_line(out, "shared, P-1+G(C+1):").split()[0])  # each prompt's group on its own
    assert "verdict: prefix sharing pays on the scoring passes on this dataset." in out

    trainer, logged = _run(tokenizer, tmp_path, family, "always")
    counted, shift = _counted(tokenizer, model_dirs[family], make_model(family, len(tokenizer)), "always")
    assert trainer.sharing_session.shift == shift == (family == "llama")  # as training decides (`sharing._shifts`)
    assert counted.tokens == logged and counted.batches == 3 and counted.examples == len(USER_WORDS)
    assert shared == f"{logged / len(USER_WORDS):.1f}"  # printed to one decimal
    if family == "llama":
        assert moved.startswith("moved: a start that prompts of any length share")
        assert "'llama' is measured shift-invariant" in moved
        assert logged / len(USER_WORDS) < per_group - 15  # the system prompt (33 tokens) once per micro-batch of two
    else:
        assert moved.startswith("not moved, a start is shared only between prompts of one length")
        assert "'gpt2' gives other numbers at other positions" in moved
        # the micro-batches of two prompts of one length share the system prompt, the other one does not
        assert logged / len(USER_WORDS) < per_group
        llama, _ = _counted(tokenizer, model_dirs["llama"], make_model("llama", len(tokenizer)), "always")
        assert llama.tokens < logged


def test_stats_grpo_says_what_each_join_shares(model_dirs, tokenizer, tmp_path, capsys):
    """`--prefix_sharing_join prompts` moves no positions and joins a prompt's own rows only: the per-group count;
    `auto` (the default, as in GRPOConfig) keeps per micro-batch the plan of lower estimated cost, here the one that
    computes the system prompt once; a batch size that splits a prompt's generations is refused, as TRL refuses it."""
    from trl_prefix_sharing.cli.stats import main

    data = tmp_path / "system_prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _prompts()))
    prompts = _stats(capsys, model_dirs["llama"], data, "--prefix_sharing_join", "prompts")
    assert _line(prompts, "positions of a shared start:").startswith("not moved: prefix_sharing_join=prompts")
    assert _line(prompts, "with SDPA (dense, the CPU's kernel):").startswith("0 of 3 micro-batches")
    per_group = _line(prompts, "shared, P-1+G(C+1):").split()[0]
    assert _line(prompts, "tokens per prompt, shared:").split(" of ")[0] == per_group
    auto = _stats(capsys, model_dirs["llama"], data)
    assert "prefix_sharing_join=auto keeps, per micro-batch" in auto
    assert _line(auto, "with SDPA (dense, the CPU's kernel):") == "3 of 3 micro-batches joined across prompts (always)"
    assert float(_line(auto, "tokens per prompt, shared:").split(" of ")[0]) < float(per_group) - 15

    argv = ["--dataset_name", str(data), "--model_name_or_path", model_dirs["llama"], "--trainer", "grpo"]
    assert main([*argv, "--num_generations", "4", "--per_device_train_batch_size", "6"]) == 2
    error = capsys.readouterr().err
    assert "--per_device_train_batch_size 6 is not a multiple of --num_generations 4" in error


def test_stats_grpo_drops_the_prompts_training_drops(model_dirs, tmp_path, capsys):
    """TRL's sampler draws whole micro-batches of prompts only: the last prompts, fewer than one, are not counted
    (said so); a dataset smaller than one micro-batch is counted as one, and said so."""
    data = tmp_path / "system_prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _prompts()[:5]))
    out = _stats(capsys, model_dirs["llama"], data)
    assert _line(out, "prompts not counted:").startswith("the last 1, fewer than a micro-batch")
    assert "of 2 micro-batches joined across prompts" in _line(out, "with SDPA (dense, the CPU's kernel):")
    out = _stats(capsys, model_dirs["llama"], data, "--max_examples", "1")
    assert _line(out, "prompts counted:").startswith("all 1, as one micro-batch: fewer than a whole one")


def test_stats_online_dpo_counts_what_training_lays_out_behind_a_system_prompt(model_dirs, tokenizer, tmp_path):
    """Online DPO lays out each micro-batch's prompts and their two completions (each row's padding scored): with
    `prefix_sharing_join="always"` on Llama, what `stats` counts is the `num_shared_tokens` of a real run over the
    same consecutive micro-batches of two prompts."""
    import datasets

    import trl_prefix_sharing
    from trl_prefix_sharing.cli.stats.arguments import parse_args
    from trl_prefix_sharing.cli.stats.groups import _laid_out
    from trl_prefix_sharing.cli.stats.trained import GeneratedLayouts
    from trl_prefix_sharing.testing import make_model

    config = trl_prefix_sharing.OnlineDPOConfig(
        output_dir=str(tmp_path / "online"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        prefix_sharing=True,
        prefix_sharing_join="always",
        prefix_sharing_attn_implementation="sdpa",
        per_device_train_batch_size=2,
        train_sampling_strategy="sequential",
        max_new_tokens=COMPLETION,
        temperature=30.0,
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], -100.0]]},
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
    )
    trainer = trl_prefix_sharing.OnlineDPOTrainer(
        model=make_model("llama", len(tokenizer)),
        ref_model=make_model("llama", len(tokenizer)),
        reward_funcs=[lambda completions, **kwargs: [float(len(c)) for c in completions]],
        args=config,
        train_dataset=datasets.Dataset.from_list(_prompts()),
        processing_class=tokenizer,
    )
    trainer.train()
    logged = [entry["num_shared_tokens"] for entry in trainer.state.log_history if "num_shared_tokens" in entry]
    assert trainer.sharing_session.shift and logged

    argv = ["--dataset_name", "-", "--model_name_or_path", model_dirs["llama"], "--trainer", "online_dpo"]
    args = parse_args([*argv, "--max_new_tokens", str(COMPLETION), "--per_device_train_batch_size", "2"])
    model = make_model("llama", len(tokenizer))
    layouts = GeneratedLayouts(model, tokenizer.pad_token_id, "always", COMPLETION, True, score_padding=True)
    _laid_out(datasets.Dataset.from_list(_prompts()), tokenizer, args, layouts)
    assert layouts.counts["sdpa"].batches == 3 and layouts.counts["sdpa"].tokens == logged[-1]
