"""`trl-prefix-sharing stats` end to end as a subprocess (and in-process for the quick error cases), offline, on a
tokenizer saved from `make_tokenizer` and small JSONL datasets."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


ERROR = "trl-prefix-sharing stats: error: "


def _env():
    return {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _stats(args, cwd, timeout=300):
    path = Path(sys.executable).parent / "trl-prefix-sharing"
    command = [str(path)] if path.exists() else [sys.executable, "-m", "trl_prefix_sharing"]
    return subprocess.run(
        command + ["stats", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tokenizer):
    from trl_prefix_sharing.testing import synthetic_pairs

    root = tmp_path_factory.mktemp("stats")
    tokenizer.save_pretrained(root / "tok")
    _write_jsonl(root / "prefs.jsonl", synthetic_pairs(16, (10, 50), (1, 8), seed=40))
    (root / "prefs_dir").mkdir()
    _write_jsonl(root / "prefs_dir" / "train.jsonl", synthetic_pairs(4, (10, 20), (1, 4), seed=1))
    # prompt 4 tokens; the completions start alike ("the the"), then differ; DPO adds EOS to text completions
    _write_jsonl(
        root / "common.jsonl", [{"prompt": "w1 w2 w3 w4", "chosen": " the the w5", "rejected": " the the w6 w7"}]
    )
    _write_jsonl(root / "prompts.jsonl", [{"prompt": "w1 w2 w3"}, {"prompt": "w4 w5 w6 w7 w8"}])  # 3 and 5 tokens
    # `<|user|> w1 w2 <|end|>` + the generation prompt `<|assistant|>`: 5 tokens
    _write_jsonl(root / "chat_prompts.jsonl", [{"prompt": [{"role": "user", "content": "w1 w2"}]}])
    return root


def _one_error_line(proc_or_err, returncode=None):
    stderr = proc_or_err if isinstance(proc_or_err, str) else proc_or_err.stderr
    if returncode is None:
        returncode = proc_or_err.returncode
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR), stderr
    return lines[0][len(ERROR) :]


# ------------------------------------------------------------------------------------------ preference data


@pytest.mark.long
def test_stats_reports_whether_it_pays(workspace):
    proc = _stats(
        ["--dataset_name", str(workspace / "prefs.jsonl"), "--model_name_or_path", str(workspace / "tok")], workspace
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for text in (
        "positions per example",
        "with padding, batches of 8",
        "packed rows: unshared",
        "ideal speedup",
        "expected training speedup from sharing",
        "verdict: prefix sharing pays",
    ):
        assert text in proc.stdout
    from trl_prefix_sharing.cli.stats.speedups import measured_speedups

    quoted = [record for record in measured_speedups().values() if "dpo" in record]
    assert {record["mode"] for record in quoted} == {"cpu", "gpu"}
    for record in quoted:  # the expectation quotes every recorded DPO benchmark, and no line says one is missing
        assert f"{record['mode'].upper()} ({record['device']}; " in proc.stdout
        assert "(the ideal with padding x " in proc.stdout and "the share of it measured on the" in proc.stdout
    assert "no DPO benchmark recorded" not in proc.stdout and "no benchmark recorded" not in proc.stdout


def _line(stdout, label):
    (line,) = [line for line in stdout.splitlines() if line.strip().startswith(label)]
    return line


def test_stats_dpo_labels_the_shared_prefix_truthfully(workspace, capsys):
    """The shared prefix holds the prompt and the completions' common start; both are reported, and nothing calls
    the shared prefix "prompt" or the rest "completion tokens"."""
    from trl_prefix_sharing.cli.stats import main

    argv = ["--dataset_name", str(workspace / "common.jsonl"), "--model_name_or_path", str(workspace / "tok")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prompt tokens:" in _line(out, "prompt tokens:") and "p50 4," in _line(out, "prompt tokens:")
    shared = _line(out, "shared prefix tokens, computed once:")
    assert "p50 6," in shared and "(the prompt + the common start of the completions)" in shared
    assert "p50 2," in _line(out, "common start of the completions:")
    rest = _line(out, "each completion after the shared prefix:")
    assert "p10 2," in rest and "p99 3" in rest and "not shared" in rest  # `w5 <eos>`, `w6 w7 <eos>`
    # rows of 4 + 4 and 4 + 5 tokens; shared: 5 positions, then each branch from a copy of the last common token
    assert "stock 17.0, shared 12.0" in _line(out, "positions per example:")
    assert "median shared prefix / rest of a completion" in out
    assert "shared prefix (prompt)" not in out and "completion tokens:" not in out


def test_stats_reward_labels_do_not_claim_a_prompt(workspace, capsys):
    from trl_prefix_sharing.cli.stats import main

    argv = ["--dataset_name", str(workspace / "common.jsonl"), "--model_name_or_path", str(workspace / "tok")]
    assert main([*argv, "--trainer", "reward"]) == 0
    out = capsys.readouterr().out
    assert "reward, max_length=1024: longer examples dropped" in out and "keep_start" not in out
    assert "(the prompt + the common start of the completions)" in _line(out, "shared prefix tokens, computed once:")
    assert "prompt tokens:" not in out  # the reward trainer tokenizes prompt and completion as one text


# ------------------------------------------------------------------------------------------ GRPO / RLOO


def test_stats_grpo_positions_match_a_hand_count(workspace, capsys):
    """Prompts of 3 and 5 tokens, G = 4 completions of C = 10 tokens:
    stock G(P+C) = 52 and 60 (mean 56); shared P-1+G(C+1) = 46 and 48 (mean 47); ratio 112/94 = 1.19;
    attention: stock 4*13*14/2 + 4*15*16/2 = 844 query-key pairs, shared (3 + 4*(11*2 + 66)) + (10 + 4*(11*4 + 66))
    = 355 + 450 = 805, ratio 1.05."""
    from trl_prefix_sharing.cli.stats import main

    argv = ["--dataset_name", str(workspace / "prompts.jsonl"), "--model_name_or_path", str(workspace / "tok")]
    assert main([*argv, "--trainer", "grpo", "--num_generations", "4", "--completion_length", "10"]) == 0
    out = capsys.readouterr().out
    assert "(2 prompts; grpo, num_generations=4)" in out
    assert "10 tokens each (--completion_length)" in _line(out, "assumed completion length:")
    assert "p10 3, p50 5, p90 5, p99 5 (plain text, no chat template)" in _line(out, "prompt tokens:")
    assert "padding not counted" in out
    assert _line(out, "stock, G(P+C):").split(":")[1].split()[0] == "56.0"
    assert _line(out, "shared, P-1+G(C+1):").split(":")[1].split()[0] == "47.0"
    assert "1.19x" in _line(out, "ideal speedup, linear layers:")
    assert "1.05x" in _line(out, "ideal speedup, attention:")
    assert "generation is not sped up" in out
    assert "verdict: prefix sharing pays on the scoring passes" in out


def test_stats_grpo_defaults_are_trls_and_stated(workspace, capsys):
    """Defaults: GRPOConfig's num_generations (8) and max_completion_length (512) as the assumed length, said so;
    RLOO: RLOOConfig's 2 generations. Conversational prompts go through the chat template with the generation
    prompt: 5 tokens here. One prompt of 5 tokens: stock 8 * 517 = 4136, shared 4 + 8 * 513 = 4108."""
    from trl_prefix_sharing.cli.stats import main

    argv = ["--dataset_name", str(workspace / "chat_prompts.jsonl"), "--model_name_or_path", str(workspace / "tok")]
    assert main([*argv, "--trainer", "grpo"]) == 0
    out = capsys.readouterr().out
    assert "num_generations=8" in out
    assumption = _line(out, "assumed completion length:")
    assert "512 tokens each (--max_completion_length, TRL's GRPOConfig default" in assumption
    assert "--completion_length" in assumption
    assert "p50 5," in _line(out, "prompt tokens:") and "add_generation_prompt=True" in _line(out, "prompt tokens:")
    assert "4,136.0" in _line(out, "stock, G(P+C):") and "4,108.0" in _line(out, "shared, P-1+G(C+1):")
    assert main([*argv, "--trainer", "rloo", "--max_completion_length", "20"]) == 0
    out = capsys.readouterr().out
    assert "rloo, num_generations=2" in out and "20 tokens each (--max_completion_length:" in out
    assert "RLOOConfig" not in out  # not TRL's default: said to come from the flag only


def test_group_defaults_are_trls():
    """The defaults the GRPO/RLOO mode states as TRL's are the installed TRL's config defaults."""
    import dataclasses

    import trl

    from trl_prefix_sharing.cli.stats.defaults import MAX_COMPLETION_LENGTH, NUM_GENERATIONS

    for name, config in (("grpo", trl.GRPOConfig), ("rloo", trl.RLOOConfig)):
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        assert defaults["num_generations"] == NUM_GENERATIONS[name]
        assert defaults["max_completion_length"] == MAX_COMPLETION_LENGTH


def test_group_positions_match_the_shared_layout():
    """The count behind the GRPO figures is what the layout builder lays out for a group."""
    import torch

    from trl_prefix_sharing.layout import build_layout
    from trl_prefix_sharing.savings import group_stats
    from trl_prefix_sharing.trie import StockRows

    for p, c, g in [(5, 7, 4), (1, 3, 2), (9, 1, 8)]:
        prompt = list(range(10, 10 + p))
        rows = [prompt + [100 + k] + [200 + 10 * k + i for i in range(c - 1)] for k in range(g)]
        ids = torch.tensor(rows)
        layout = build_layout(StockRows.generated(ids, torch.ones_like(ids), p), pad_token_id=0)
        stats = group_stats([p], c, g)
        assert stats.stock_tokens == g * (p + c)
        assert stats.shared_tokens == int((layout.document_ids >= 0).sum())


# ------------------------------------------------------------------------------------------ user mistakes


@pytest.mark.long
@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--model_name_or_path", "/nonexistent"],
            "cannot load a tokenizer from '/nonexistent': no such directory; pass --model_name_or_path",
        ),
        (
            ["--model_name_or_path", "not-a-real/model-xyz"],
            "cannot load a tokenizer for 'not-a-real/model-xyz': no such local directory, and the Hub model is not in "
            "the local Hugging Face cache while offline mode is set",
        ),
        (
            ["--model_name_or_path", "tok", "--dataset_name", "someone/no-such-dataset"],
            "the Hub dataset is not in the local Hugging Face cache while offline mode is set",
        ),
        (
            ["--model_name_or_path", "tok", "--max_length", "abc"],
            "argument --max_length: expected an integer, got 'abc'",
        ),
    ],
)
def test_stats_console_script_errors_are_one_clean_line(workspace, args, message):
    """As a user runs it (a subprocess, the Hub offline): exit status 2, one line on stderr, no traceback."""
    if "--dataset_name" not in args:
        args = [*args, "--dataset_name", "prefs.jsonl"]
    assert message in _one_error_line(_stats(args, workspace))


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--dataset_name", "./missing.jsonl"],
            "cannot load the dataset './missing.jsonl': no such file or directory",
        ),
        (["--dataset_name", "empty.jsonl"], "the dataset file 'empty.jsonl' is empty"),
        (["--dataset_name", "broken.jsonl"], "cannot read the dataset 'broken.jsonl' (JSON parse error"),
        (
            ["--dataset_name", "prefs_dir", "--dataset_train_split", "test"],
            "has no split 'test' (its splits: 'train')",
        ),
        (["--dataset_name", "no_rejected.jsonl"], "needs 'chosen' and 'rejected'"),
        (["--dataset_name", "prompts.jsonl"], "needs 'chosen' and 'rejected'"),
        (["--dataset_name", "prompts.jsonl"], "pass --trainer grpo, rloo or online_dpo"),
        (["--dataset_name", "prompts.jsonl", "--trainer", "kto"], "needs 'prompt', 'completion' and 'label'"),
        (["--dataset_name", "prompts.jsonl", "--trainer", "orpo"], "needs 'chosen' and 'rejected'"),
        (["--dataset_name", "unpaired.jsonl"], "for unpaired data (prompt, completion, label) pass --trainer kto"),
        (["--dataset_name", "no_prompt.jsonl", "--trainer", "grpo"], "needs a 'prompt' column"),
        (["--dataset_name", "no_prompt.jsonl", "--trainer", "rloo"], "for preference data pass --trainer dpo"),
        (["--dataset_name", "prefs.jsonl", "--model_name_or_path", "prefs.jsonl"], "it is a file, not a directory"),
        (["--dataset_name", "prefs.jsonl", "--model_name_or_path", "."], "cannot load a tokenizer from the directory"),
        (["--dataset_name", "chat_prompts.jsonl", "--trainer", "grpo", "--model_name_or_path", "no_template"], "chat"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "ppo"], "argument --trainer: invalid choice: 'ppo'"),
        (["--dataset_name", "prefs.jsonl", "--max_examples", "0"], "argument --max_examples: must be at least 1"),
        (["--dataset_name", "prefs.jsonl", "--num_generations", "4"], "--num_generations applies to --trainer grpo"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "grpo", "--num_generations", "1"], "must be at least 2"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "rloo", "--max_length", "64"], "--max_length applies to"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "grpo", "--completion_length", "600"], "is longer than"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "reward", "--truncation_mode", "keep_end"], "dpo or sft only"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "reward", "--max_length", "3"], "preprocessing left none"),
        (["--model_name_or_path", "tok"], "the following arguments are required: --dataset_name"),
        (["--dataset_name", "prompts.jsonl", "--trainer", "online_dpo", "--num_generations", "4"], "generates 2"),
        (["--dataset_name", "prompts.jsonl", "--trainer", "online_dpo", "--max_completion_length", "9"], "--max_new_"),
        (["--dataset_name", "prompts.jsonl", "--trainer", "grpo", "--max_new_tokens", "9"], "--max_completion_length"),
        (
            ["--dataset_name", "prompts.jsonl", "--trainer", "online_dpo", "--completion_length", "65"],
            "is longer than",
        ),
        (["--dataset_name", "prefs.jsonl", "--trainer", "kto", "--truncation_mode", "keep_end"], "keeps the start"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "orpo", "--truncation_mode", "keep_end"], "never the prompt"),
        (["--dataset_name", "prefs.jsonl", "--prefix_sharing_score_padding", "false"], "--trainer orpo or cpo only"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "cpo", "--prefix_sharing_merge_kl", "true"], "kto only"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "kto", "--max_new_tokens", "9"], "pass --trainer online_dpo"),
        (["--dataset_name", "prefs.jsonl", "--trainer", "kto", "--max_length", "3"], "preprocessing left none"),
        (["--dataset_name", "prompts.jsonl", "--trainer", "online_dpo", "--max_length", "0"], "is a number of tokens"),
    ],
)
def test_stats_user_mistakes_are_one_clean_line(workspace, tokenizer, capsys, monkeypatch, args, message):
    """In-process (fast): exit status 2 and one line on stderr naming what, why and the way out."""
    from trl_prefix_sharing.cli.stats import main

    (workspace / "empty.jsonl").write_text("")
    (workspace / "broken.jsonl").write_text('{"prompt": "w1", broken\n')
    _write_jsonl(workspace / "no_prompt.jsonl", [{"chosen": "w1 w2", "rejected": "w1 w3"}])
    _write_jsonl(workspace / "no_rejected.jsonl", [{"prompt": "w1", "chosen": "w2"}])
    _write_jsonl(workspace / "unpaired.jsonl", [{"prompt": "w1", "completion": " w2", "label": True}])
    if not (workspace / "no_template").exists():
        import copy

        plain = copy.deepcopy(tokenizer)
        plain.chat_template = None
        plain.save_pretrained(workspace / "no_template")
        (workspace / "no_template" / "chat_template.jinja").unlink(missing_ok=True)
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no Hub probe for the Hub-id cases
    if "--model_name_or_path" not in args:
        args = [*args, "--model_name_or_path", "tok"]
    code = main(args)
    assert message in _one_error_line(capsys.readouterr().err, code)


# ------------------------------------------------------------------------------------------ TRL's preprocessing
#
# `stats` prepares preference data with TRL's public data functions and its own tokenization; these compare its
# columns with those of TRL's (private) `_prepare_dataset` of the trainers, called on instances built without a model.

#: a chat template that renders a prompt alone with an opening thought block, which the whole conversation lacks
_THINKING_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> w199 {% endif %}"
)


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


#: explicit prompts: a one-token prompt, an empty completion, one that already ends with EOS, a prompt ending inside a
#: word (its last token is not a prefix of the prompt + completion's), a prompt longer than the tests' `max_length` (7)
#: and one exactly as long (both dropped with `keep_start`: no completion token would be left)
_PLAIN = [
    {"prompt": "w1", "chosen": " w2 w3", "rejected": " w4"},
    {"prompt": "w1 w2 w3", "chosen": "", "rejected": " w5 w6 w7 w8"},
    {"prompt": "w9 w10", "chosen": " w11<eos>", "rejected": " w12 w13"},
    {"prompt": "w1 w", "chosen": "2 w3", "rejected": "4 w5 w6"},
    {"prompt": " ".join(f"w{i}" for i in range(20, 32)), "chosen": " w40", "rejected": " w41 w42"},
    {"prompt": "w1 w2 w3 w4 w5 w6 w7", "chosen": " w8 w9", "rejected": " w8 w10"},
]
#: implicit prompts (the start `chosen` and `rejected` share), one with none at all
_IMPLICIT = [
    {"chosen": "w1 w2 w3 w4", "rejected": "w1 w2 w5"},
    {"chosen": "w6", "rejected": "w6 w7"},
    {"chosen": "w1 w2", "rejected": "w3 w4"},
    {"chosen": "w8 w9 w10 w11 w12 w13 w15", "rejected": "w8 w9 w10 w11 w14"},
]
_CHAT = [
    {"prompt": [_user("w1")], "chosen": [_assistant("w2 w3")], "rejected": [_assistant("w4")]},
    {"prompt": [_user("w1 w2")], "chosen": [_assistant("")], "rejected": [_assistant("w5 w6")]},
    {
        "prompt": [_user("w1"), _assistant("w2 w3"), _user(" ".join(f"w{i}" for i in range(20, 30)))],
        "chosen": [_assistant("w7")],
        "rejected": [_assistant("w8 w9")],
    },
]
_CHAT_IMPLICIT = [
    {"chosen": [_user("w1 w2"), _assistant("w3")], "rejected": [_user("w1 w2"), _assistant("w4 w5")]},
    {"chosen": [_user("w6"), _assistant("")], "rejected": [_user("w6"), _assistant("w7")]},
]
_CHAT_TOOLS = [  # tools as JSON text, as a dataset column of mixed tool lists holds them
    {**row, "tools": json.dumps([{"type": "function", "function": {"name": "w50"}}] if i % 2 else [])}
    for i, row in enumerate(_CHAT)
]
_DATASETS = {
    "plain": _PLAIN,
    "implicit": _IMPLICIT,
    "chat": _CHAT,
    "chat_implicit": _CHAT_IMPLICIT,
    "chat_tools": _CHAT_TOOLS,
    "chat_thinking": _CHAT,
}


def _preference_tokenizer(tokenizer, name):
    if name != "chat_thinking":
        return tokenizer
    import copy

    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = _THINKING_TEMPLATE
    return thinking


def _trl_config(cls, tmp_path, **kwargs):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return cls(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **kwargs)


def _columns(dataset, names):
    return {name: list(dataset[name]) for name in names}


def _model(kind, tokenizer):
    """A tiny model of the kind `kind`'s trainer trains (a reward model for `reward`)."""
    from trl_prefix_sharing.testing import make_model
    from trl_prefix_sharing.testing.equivalence import make_reward_model

    return make_reward_model("llama", tokenizer) if kind == "reward" else make_model("llama", len(tokenizer))


def _prepared_and_real(kind, dataset, tokenizer, tmp_path, **options):
    """The trainer `stats` builds on a tiny stand-in model, and the same trainer built on a real tiny
    model: what each prepares must be the same."""
    import warnings

    import trl_prefix_sharing
    from trl_prefix_sharing.cli.prepared import prepared_trainer
    from trl_prefix_sharing.testing import make_model

    spec = trl_prefix_sharing.trainers.TRAINERS[kind]
    prepared = prepared_trainer(kind, dataset, tokenizer, **options)
    model = _model(kind, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        config = getattr(trl_prefix_sharing, spec.config_class)(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", prefix_sharing=True, **options
        )
    refs = {"ref_model": make_model("llama", len(tokenizer))} if kind == "dpo" else {}
    trainer_class = getattr(trl_prefix_sharing, spec.trainer_class)
    real = trainer_class(model=model, **refs, args=config, train_dataset=dataset, processing_class=tokenizer)
    return prepared, real


@pytest.mark.parametrize("limits", [(None, "keep_start"), (7, "keep_start"), (7, "keep_end")], ids=str)
@pytest.mark.parametrize("name", ["plain", "implicit", "chat_tools", "chat_thinking"])
def test_stats_dpo_prepares_as_the_trainer(tokenizer, tmp_path, name, limits):
    """`stats` prepares DPO data with the DPO trainer itself, on a tiny stand-in model: the columns equal
    those of the trainer built on a real model (examples dropped included), on awkward data."""
    import datasets

    max_length, truncation_mode = limits
    tokenizer = _preference_tokenizer(tokenizer, name)
    dataset = datasets.Dataset.from_list(_DATASETS[name])
    prepared, real = _prepared_and_real(
        "dpo", dataset, tokenizer, tmp_path, max_length=max_length, truncation_mode=truncation_mode
    )
    names = ["prompt_ids", "chosen_ids", "rejected_ids"]
    assert _columns(prepared.train_dataset, names) == _columns(real.train_dataset, names)
    assert len(prepared.train_dataset) > 0
    if name == "plain":  # the awkward cases are there
        rows = _columns(prepared.train_dataset, names)
        assert 1 in map(len, rows["prompt_ids"])  # a one-token prompt
        assert [tokenizer.eos_token_id] in rows["chosen_ids"]  # an empty completion: EOS only
        dropped = max_length is not None and truncation_mode == "keep_start"
        assert (len(prepared.train_dataset) < len(dataset)) == dropped


_REWARD_DATASETS = {
    "plain": _PLAIN,
    "implicit": _IMPLICIT,
    "chat": _CHAT,
    "chat_implicit": _CHAT_IMPLICIT,
    "chat_tools": _CHAT_TOOLS,
    "margin": [{**row, "margin": float(i)} for i, row in enumerate(_PLAIN)],
    "legacy_ids": [
        {"chosen_input_ids": [1, 2, 3], "rejected_input_ids": [1, 4]},
        {"chosen_input_ids": list(range(9)), "rejected_input_ids": [5]},
    ],
}


@pytest.mark.parametrize("max_length", [None, 7])
@pytest.mark.parametrize("name", ["plain", "chat_implicit", "margin", "legacy_ids", "ranked"])
def test_stats_reward_prepares_as_the_trainer(tokenizer, tmp_path, name, max_length):
    """`stats` prepares reward data (pairs, TRL's older column names, ranked lists) with the reward trainer itself:
    the columns equal those of the trainer built on a real model, examples dropped included."""
    import warnings

    import datasets

    rows = _REWARD_DATASETS.get(name) or [
        {"prompt": "w1", "completions": [" w2", "", " w3 w4 w5"]},
        {"prompt": "w1 w2 w3 w4", "completions": [" w5 w6 w7 w8 w9", " w10"]},
        {"prompt": "w6 w7", "completions": [" w8", " w9<eos>"]},
    ]
    dataset = datasets.Dataset.from_list(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL's deprecation of the legacy column names
        prepared, real = _prepared_and_real("reward", dataset, tokenizer, tmp_path, max_length=max_length)
    names = ["completion_ids"] if name == "ranked" else ["chosen_ids", "rejected_ids"]
    assert 0 < len(prepared.train_dataset) and _columns(prepared.train_dataset, names) == _columns(
        real.train_dataset, names
    )
    assert ("margin" in prepared.train_dataset.column_names) == (name == "margin")
    if max_length:
        assert len(prepared.train_dataset) < len(dataset)  # the limit dropped some examples, not all


@pytest.mark.parametrize("kind", ["dpo", "reward", "kto", "orpo", "cpo"])
def test_stats_counts_what_a_training_run_logs(workspace, tokenizer, tmp_path, capsys, kind):
    """The positions per example `stats` prints for DPO, reward, KTO, ORPO and CPO data are the `num_shared_tokens` a
    run of this package's trainer logs over the same examples (one epoch, every prompt distinct, so that micro-batches
    share nothing across examples; KTO's policy pass merged with its KL rows, as its reference pass is), divided by the
    examples (KTO's: the pairs unpaired)."""
    import datasets

    import trl_prefix_sharing
    from trl_prefix_sharing.cli.stats import main
    from trl_prefix_sharing.testing import make_model

    rows = [json.loads(line) for line in (workspace / "prefs.jsonl").read_text().splitlines()][:12]
    assert len({row["prompt"] for row in rows}) == len(rows)
    data = workspace / f"distinct_{kind}.jsonl"
    _write_jsonl(data, rows)
    argv = ["--dataset_name", str(data), "--model_name_or_path", str(workspace / "tok"), "--trainer", kind]
    assert main([*argv, "--per_device_train_batch_size", "4"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("positions per")]
    printed = float(line.split("shared ")[1].split(" ")[0])

    spec = trl_prefix_sharing.trainers.TRAINERS[kind]
    model = _model(kind, tokenizer)
    config = getattr(trl_prefix_sharing, spec.config_class)(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        prefix_sharing=True,
        prefix_sharing_join="prompts",
        prefix_sharing_attn_implementation="sdpa",  # no measured choice of stock's rows
        per_device_train_batch_size=4,
        num_train_epochs=1,
        logging_steps=1,  # `num_shared_tokens` is a running total: the last one logged counts the epoch
        save_strategy="no",
        **({"prefix_sharing_merge_kl": True} if kind == "kto" else {}),
    )
    refs = {"ref_model": make_model("llama", len(tokenizer))} if kind in ("dpo", "kto") else {}
    trainer = getattr(trl_prefix_sharing, spec.trainer_class)(
        model=model, **refs, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    trainer.train()
    logged = [entry["num_shared_tokens"] for entry in trainer.state.log_history if "num_shared_tokens" in entry]
    assert logged and logged[-1] > 0
    examples = len(trainer.train_dataset)
    assert examples == len(rows) * (2 if kind == "kto" else 1)
    assert printed == pytest.approx(logged[-1] / examples, abs=0.05)  # printed to one decimal
    stock_per_example = float(line.split("stock ")[1].split(",")[0])
    assert abs(stock_per_example - logged[-1] / examples) > 0.05  # the comparison can fail: stock's count differs


# ------------------------------------------------------------------------------------------ the model check

_DATASET_OF = {"grpo": "prompts.jsonl", "rloo": "prompts.jsonl", "online_dpo": "prompts.jsonl"}


@pytest.fixture(scope="module")
def model_dirs(workspace, tokenizer):
    """Tiny model directories (a config and the tokenizer, no weights): Mamba, which training refuses, and Llama."""
    from trl_prefix_sharing.testing import make_config

    for family in ("mamba", "llama"):
        make_config(family, len(tokenizer)).save_pretrained(workspace / family)
        tokenizer.save_pretrained(workspace / family)
    return workspace


@pytest.mark.parametrize("trainer", ["dpo", "reward", "kto", "orpo", "cpo", "grpo", "rloo", "online_dpo"])
def test_stats_refuses_a_model_training_refuses(model_dirs, tokenizer, capsys, monkeypatch, trainer):
    """A Mamba model: one error line with training's own refusal (what `check_model_and_processor` raises when a
    trainer is built with prefix sharing), exit status 2, and no report or verdict."""
    from trl_prefix_sharing.cli.stats import main
    from trl_prefix_sharing.cli.stats.defaults import TRAINER_CLASSES
    from trl_prefix_sharing.support import check_model_and_processor

    path = str(model_dirs / "mamba")
    with pytest.raises(ValueError) as training:
        check_model_and_processor(TRAINER_CLASSES[trainer], path, tokenizer, None, False, trainer == "dpo")
    monkeypatch.chdir(model_dirs)
    dataset = _DATASET_OF.get(trainer, "prefs.jsonl")
    code = main(["--dataset_name", dataset, "--model_name_or_path", path, "--trainer", trainer])
    captured = capsys.readouterr()
    message = _one_error_line(captured.err, code)
    assert message == f"--model_name_or_path {path!r}: {' '.join(str(training.value).split())}"
    assert "can never support 'mamba'" in message and "prefix_sharing=False" in message
    assert "verdict" not in captured.out and "pays" not in captured.out


def test_stats_reports_the_model_check(model_dirs, capsys):
    """A supported model says so; a directory holding a tokenizer only says the architecture was not checked."""
    from trl_prefix_sharing.cli.stats import main

    data = str(model_dirs / "prefs.jsonl")
    assert main(["--dataset_name", data, "--model_name_or_path", str(model_dirs / "llama")]) == 0
    assert "'llama', measured equal to stock TRL with prefix sharing" in _line(capsys.readouterr().out, "model:")
    assert main(["--dataset_name", data, "--model_name_or_path", str(model_dirs / "tok"), "--trainer", "kto"]) == 0
    line = _line(capsys.readouterr().out, "model:")
    assert "not checked:" in line and "holds no config.json" in line and "--model_name_or_path" in line


# ------------------------------------------------------------------------------------------ a misspelt prompt column


@pytest.mark.parametrize("trainer", ["dpo", "reward", "kto", "orpo", "cpo", "grpo", "rloo", "online_dpo"])
def test_stats_a_misspelt_prompt_column_is_an_error(workspace, capsys, monkeypatch, trainer):
    """`promt` instead of `prompt`: no prompt would be shared, so every trainer stops with the dataset check's one
    line (`check_prompt_column`), before any preprocessing."""
    from trl_prefix_sharing.cli.stats import main

    _write_jsonl(workspace / "promt.jsonl", [{"promt": "w1 w2 w3", "chosen": " w4", "rejected": " w5"}])
    monkeypatch.chdir(workspace)
    code = main(["--dataset_name", "promt.jsonl", "--model_name_or_path", "tok", "--trainer", trainer])
    message = _one_error_line(capsys.readouterr().err, code)
    assert "'promt.jsonl' dataset has no 'prompt' column but has 'promt'" in message
    assert "rename_column('promt', 'prompt')" in message


# ------------------------------------------------------------------------------------------ ideal and expected


def _speedup(line: str) -> float:
    return float(line.split("x (")[0].split()[-1].lstrip("~"))


def _expected_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("    ") and ": ~" in line]


@pytest.mark.parametrize("trainer", ["dpo", "reward"])
@pytest.mark.parametrize("data", ["readme", "nothing_shared"])
def test_stats_expected_speedup_is_never_above_its_ideal_unexplained(workspace, capsys, trainer, data):
    """On the README's data (where the old report printed an expected 1.74x under a 1.64x ideal) and on pairs that
    share nothing (1.00x ideal): every expected figure is at most the ideal with padding it scales (what stock and the
    shared rows really compute, as training lays out its micro-batches with SDPA), and one above the padding-free
    ideal says why on its line."""
    from trl_prefix_sharing.cli.stats import main
    from trl_prefix_sharing.testing import synthetic_pairs

    rows = (
        synthetic_pairs(32)
        if data == "readme"
        else [{"chosen": f"w{i} w{i + 1} w{i + 2}", "rejected": f"w{i + 50} w{i + 3}"} for i in range(16)]
    )
    path = _write_jsonl(workspace / f"{data}.jsonl", rows)
    assert (
        main(["--dataset_name", str(path), "--model_name_or_path", str(workspace / "tok"), "--trainer", trainer]) == 0
    )
    out = capsys.readouterr().out
    if data == "nothing_shared":
        assert _speedup(_line(out, "ideal speedup, linear layers:")) == 1.0 and "does not pay" in out
    # as training lays it out with SDPA (the first block): the ideals the expectation scales
    ideal, padded = (
        float(next(line for line in out.splitlines() if line.strip().startswith(label)).split(": ")[-1].split("x")[0])
        for label in ("tokens per example, shared:", "with padding, shared:")
    )
    lines = _expected_lines(out)
    assert lines, out  # the CPU benchmark is recorded for dpo and reward
    for line in lines:
        expected = _speedup(line)
        assert expected <= (padded or ideal) or "padding" in line, f"{expected} above the ideal {ideal}: {line}"
        if expected > ideal:
            assert f"above the padding-free ideal {ideal:.2f}x because stock also computes its rows' padding" in line
        assert padded is not None and expected <= padded, line  # the bound is printed, and holds


def test_expected_speedup_is_capped_at_the_ideal_with_padding(monkeypatch):
    """A record without the ideal with padding gives the share of the padding-free ideal, which can exceed 1: the
    expectation is then capped at the ideal with padding, and each line says where it stands."""
    from trl_prefix_sharing.cli.stats import speedups

    profile = {"p_over_c": 2.0, "share_of_ideal": 1.09, "sharing": 1.5, "sharing+packing": 1.9}
    record = {"device": "CPU", "model": "tiny", "dpo": {"old": profile}}
    monkeypatch.setattr(speedups, "measured_speedups", lambda: {"cpu": record})
    lines, values = speedups.expected_speedups("dpo", 2.0, 1.0, 1.05)
    assert values == [1.05] and "~1.05x (the ideal x 1.09" in lines[0]
    assert "capped at the ideal with padding, 1.05x" in lines[0] and "above the padding-free ideal 1.00x" in lines[0]
    record["dpo"]["old"] = {**profile, "padded_ideal": 1.6}  # the share of the ideal with padding: 1.5 / 1.6
    lines, values = speedups.expected_speedups("dpo", 2.0, 1.3, 1.2)
    assert values == [pytest.approx(1.2 * 1.5 / 1.6)] and "the ideal with padding x 0.94" in lines[0]
    assert "capped" not in lines[0] and "above the padding-free ideal" not in lines[0]
    lines, values = speedups.expected_speedups("kto", 2.0, 1.3, 1.2)
    assert lines == ["    no KTO benchmark recorded"] and values == []


def test_expected_speedup_is_never_below_stock(monkeypatch):
    """A profile measured slower than stock (short prompts on a fast device): training's `"auto"` runs stock's own
    rows there, so the expectation is 1.00x, and the line gives what a fixed kernel would run."""
    from trl_prefix_sharing.cli.stats import speedups

    profile = {"p_over_c": 2.0, "sharing": 0.7, "sharing+packing": 0.8, "padded_ideal": 1.4}
    monkeypatch.setattr(
        speedups, "measured_speedups", lambda: {"gpu": {"device": "H200", "model": "0.5B", "dpo": {"p": profile}}}
    )
    lines, values = speedups.expected_speedups("dpo", 2.0, 1.3, 1.4)
    assert values == [1.0] and "~1.00x" in lines[0]
    assert "below stock's ~0.70x" in lines[0] and "runs stock's own rows" in lines[0]
    profile["sharing"] = 1.2  # a faster one is as measured
    lines, values = speedups.expected_speedups("dpo", 2.0, 1.3, 1.4)
    assert values == [pytest.approx(1.2)] and "stock's own rows" not in lines[0]


def test_recorded_speedups_hold_the_ideal_with_padding():
    """Every recorded profile has its ideal with padding (stock / shared positions per pair of the same benchmark
    run, `docs/benchmarks/cpu.json`), and training reached at most that ideal: no expectation needs capping."""
    from trl_prefix_sharing.cli.stats.speedups import measured_speedups

    run = json.loads((Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "cpu.json").read_text())
    recorded = measured_speedups()["cpu"]
    for kind in ("dpo", "reward"):
        for name, profile in recorded[kind].items():
            variants = run["results"][kind][name]
            positions = variants["stock"]["positions_per_pair"] / variants["sharing"]["positions_per_pair"]
            assert profile["padded_ideal"] == pytest.approx(positions, abs=1e-3), name
            assert profile["sharing"] <= profile["padded_ideal"], name


@pytest.mark.parametrize("kind", ["grpo", "rloo", "online_dpo"])
def test_stats_group_counts_what_a_training_run_logs(workspace, tokenizer, tmp_path, capsys, kind):
    """GRPO, RLOO and online DPO: with every completion as long as `stats` assumes (EOS never sampled, so each runs
    to the longest generation) and every prompt distinct, the shared positions per group it prints are the
    `num_shared_tokens` a training run logs, divided by the groups. (Completions that start alike share more in
    training, which `stats` cannot know before generation; the fixed seed's completions do not.)"""
    import datasets

    import trl_prefix_sharing
    from trl_prefix_sharing.cli.stats import main
    from trl_prefix_sharing.testing import make_model

    prompts = [{"prompt": " ".join(f"w{10 * i + k}" for k in range(i % 5 + 1))} for i in range(1, 9)]
    data = workspace / f"distinct_prompts_{kind}.jsonl"
    _write_jsonl(data, prompts)
    online = kind == "online_dpo"
    generations, length = (2, 5) if online else (4, 5)  # online DPO generates a pair per prompt
    # the longest generation, as each config names it, and the group size where it is an option
    sizes = {"max_new_tokens": length} if online else {"max_completion_length": length, "num_generations": generations}
    argv = ["--dataset_name", str(data), "--model_name_or_path", str(workspace / "tok"), "--trainer", kind]
    assert main([*argv, *(f"--{key}={value}" for key, value in sizes.items())]) == 0
    out = capsys.readouterr().out.splitlines()
    shared, stock = (
        float(next(line for line in out if line.strip().startswith(label)).split(":")[1].split()[0])
        for label in ("shared, P-1+G(C+1)", "stock, G(P+C)")
    )

    spec = trl_prefix_sharing.trainers.TRAINERS[kind]
    config = getattr(trl_prefix_sharing, spec.config_class)(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        prefix_sharing=True,
        prefix_sharing_join="prompts",
        prefix_sharing_attn_implementation="sdpa",  # no measured choice of stock's rows
        per_device_train_batch_size=2 if online else 2 * generations,  # online DPO: prompts, each generating 2
        **sizes,
        temperature=30.0,  # near-uniform sampling: a group's completions start with different tokens
        generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], -100.0]]},  # EOS never sampled
        **({} if online else {"beta": 0.0}),  # no reference model (RLOO's default loads one from the model's path)
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
    )
    refs = {"ref_model": make_model("llama", len(tokenizer))} if online else {}
    trainer = getattr(trl_prefix_sharing, spec.trainer_class)(
        model=make_model("llama", len(tokenizer)),
        **refs,
        reward_funcs=[lambda completions, **kwargs: [float(len(c)) for c in completions]],
        args=config,
        train_dataset=datasets.Dataset.from_list(prompts),
        processing_class=tokenizer,
    )
    trainer.train()
    logged = [entry["num_shared_tokens"] for entry in trainer.state.log_history if "num_shared_tokens" in entry]
    assert logged and logged[-1] > 0
    assert shared == pytest.approx(logged[-1] / len(prompts), abs=0.05)  # printed to one decimal
    assert abs(stock - logged[-1] / len(prompts)) > 0.05  # the comparison can fail: stock's count differs
