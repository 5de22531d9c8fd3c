"""What a user meets around the trainers: half of the swap done (this package's config given to a stock TRL trainer,
or this package's trainer given TRL's config) is never a silent stock run, and `accelerate launch` asked for several
processes on a CPU and starting one says so."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import trl
from test_kto_equivalence import unpaired_dataset
from trl.experimental.cpo import CPOConfig as StockCPOConfig
from trl.experimental.cpo import CPOTrainer as StockCPOTrainer
from trl.experimental.online_dpo import OnlineDPOConfig as StockOnlineDPOConfig
from trl.experimental.online_dpo import OnlineDPOTrainer as StockOnlineDPOTrainer
from trl.experimental.orpo import ORPOConfig as StockORPOConfig
from trl.experimental.orpo import ORPOTrainer as StockORPOTrainer

import trl_prefix_sharing
from trl_prefix_sharing.distributed import processes_asked
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import CPU_RUN, awkward_text_dataset, make_reward_model
from trl_prefix_sharing.testing.group_equivalence import prompt_dataset, reward_length


ROOT = Path(__file__).resolve().parents[2]
FAMILY = "llama"

#: kind -> (TRL's trainer, TRL's config, this package's name, config fields, what the trainer takes besides `args`)
KINDS = {
    "dpo": (trl.DPOTrainer, trl.DPOConfig, "DPO", {}, "ref_model"),
    "reward": (trl.RewardTrainer, trl.RewardConfig, "Reward", {}, "reward_model"),
    "grpo": (trl.GRPOTrainer, trl.GRPOConfig, "GRPO", {"num_generations": 2, "max_completion_length": 4}, "rewards"),
    "rloo": (
        trl.RLOOTrainer,
        trl.RLOOConfig,
        "RLOO",
        {"num_generations": 2, "max_completion_length": 4, "beta": 0.0},
        "rewards",
    ),
    "online_dpo": (StockOnlineDPOTrainer, StockOnlineDPOConfig, "OnlineDPO", {"max_new_tokens": 4}, "online"),
    "kto": (trl.KTOTrainer, trl.KTOConfig, "KTO", {}, "ref_model"),
    "orpo": (StockORPOTrainer, StockORPOConfig, "ORPO", {}, ""),
    "cpo": (StockCPOTrainer, StockCPOConfig, "CPO", {}, ""),
}


def build(kind, trainer_cls, config_cls, tmp_path, tokenizer, **fields):
    """`trainer_cls(args=config_cls(...))` with the models and data `kind` trains on."""
    _, _, _, kind_fields, takes = KINDS[kind]
    args = config_cls(
        output_dir=str(tmp_path / kind), per_device_train_batch_size=4, max_steps=1, **CPU_RUN, **kind_fields, **fields
    )
    model = make_model(FAMILY, len(tokenizer), seed=0)
    extra = {}
    if takes == "reward_model":
        model = make_reward_model(FAMILY, tokenizer, seed=0)
    if takes in ("ref_model", "online"):
        extra["ref_model"] = make_model(FAMILY, len(tokenizer), seed=1)
    if takes in ("rewards", "online"):
        extra["reward_funcs"] = [reward_length]
    dataset = {"rewards": prompt_dataset, "online": prompt_dataset, "": awkward_text_dataset}.get(takes)
    dataset = unpaired_dataset() if kind == "kto" else (dataset or awkward_text_dataset)()
    return trainer_cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, **extra)


@pytest.mark.parametrize("kind", list(KINDS))
def test_our_config_in_a_stock_trainer_is_an_error(kind, tmp_path, tokenizer):
    stock_trainer, _, name, _, _ = KINDS[kind]
    ours = getattr(trl_prefix_sharing, f"{name}Config")
    with pytest.raises(TypeError, match=rf"would ignore them.*from trl_prefix_sharing import {name}Trainer"):
        build(kind, stock_trainer, ours, tmp_path, tokenizer, prefix_sharing=True)
    with warnings.catch_warnings():  # off: exactly stock TRL's config, nothing to say
        warnings.simplefilter("error", UserWarning)
        trainer = build(kind, stock_trainer, ours, tmp_path, tokenizer)
    assert type(trainer) is stock_trainer


@pytest.mark.parametrize("kind", list(KINDS))
def test_our_trainer_with_a_stock_config_warns(kind, tmp_path, tokenizer):
    _, stock_config, name, _, _ = KINDS[kind]
    our_trainer = getattr(trl_prefix_sharing, f"{name}Trainer")
    with pytest.warns(
        UserWarning, match=rf"trains exactly as stock TRL.*{name}Config\(..., prefix_sharing=True\)"
    ) as w:
        trainer = build(kind, our_trainer, stock_config, tmp_path, tokenizer)
    assert not trainer.prefix_sharing and trainer.sharing_session is None
    ours = [r for r in w if "prefix_sharing" in str(r.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # pointing at the user's line (here: `build`)
    with warnings.catch_warnings():  # this package's config: no warning, on or off
        warnings.simplefilter("error", UserWarning)
        for on in (False, True):
            build(
                kind, our_trainer, getattr(trl_prefix_sharing, f"{name}Config"), tmp_path, tokenizer, prefix_sharing=on
            )


def test_packing_alone_in_a_stock_trainer_is_an_error(tmp_path, tokenizer):
    with pytest.raises(TypeError, match="would ignore them"):
        build("dpo", trl.DPOTrainer, trl_prefix_sharing.DPOConfig, tmp_path, tokenizer, packing=True)


def test_every_config_is_checked():
    """Each config of this package carries the check (defined once, installed on every TrainingArguments subclass)."""
    from trl_prefix_sharing.config import _get_process_log_level_for_our_trainers

    for _, _, name, _, _ in KINDS.values():
        assert getattr(trl_prefix_sharing, f"{name}Config").get_process_log_level is (
            _get_process_log_level_for_our_trainers
        )


@pytest.mark.parametrize("kind", list(KINDS))
def test_end_frees_the_distributed_wrapper_before_the_process_group_ends(kind, tmp_path, tokenizer, monkeypatch):
    """`trainer.end()` (TRL's scripts call it last): the wrapper that holds the process group (DDP's reducer) is gone
    before transformers' `end` destroys the group, on every trainer of this package."""
    import transformers

    name = KINDS[kind][2]
    ours = (getattr(trl_prefix_sharing, f"{name}Trainer"), getattr(trl_prefix_sharing, f"{name}Config"))
    trainer = build(kind, *ours, tmp_path, tokenizer, prefix_sharing=True)
    wrapper = torch.nn.Sequential(trainer.model)  # stands for the DDP wrapper `accelerator.prepare` returns
    trainer.model_wrapped = wrapper
    trainer.accelerator._models.append(wrapper)
    seen = []
    monkeypatch.setattr(
        transformers.Trainer,
        "end",
        lambda self: seen.append((self.model_wrapped is self.model, list(self.accelerator._models))),
    )
    trainer.end()
    assert seen == [(True, [])]


def test_processes_asked():
    assert processes_asked(["accelerate", "launch", "--num_processes", "2", "--cpu", "s.py"]) == 2
    assert processes_asked(["x", "--num-processes=4", "s.py"]) == 4
    assert processes_asked(["x", "--num_processes=1"]) == 1
    assert processes_asked(["accelerate", "launch", "s.py", "--num_generations", "2"]) is None


SCRIPT = textwrap.dedent(
    """
    import json
    from trl_prefix_sharing import DPOConfig, DPOTrainer
    from trl_prefix_sharing.testing import make_model, make_tokenizer, synthetic_pairs

    tokenizer = make_tokenizer()
    args = DPOConfig(output_dir="out", prefix_sharing=True, bf16=False, use_cpu=True, report_to="none")
    trainer = DPOTrainer(
        model=make_model("llama", len(tokenizer)),
        ref_model=make_model("llama", len(tokenizer)),
        args=args,
        train_dataset=synthetic_pairs(8),
        processing_class=tokenizer,
    )
    print("WORLD", trainer.accelerator.num_processes)
    trainer.end()
    """
)


@pytest.mark.long
@pytest.mark.parametrize(
    "launch, processes, warned",
    [(["--num_processes", "2", "--cpu"], 1, True), (["--multi_gpu", "--num_processes", "2"], 2, False)],
    ids=["cpu-flag-one-process", "multi_gpu-two-processes"],
)
def test_accelerate_launch_that_starts_fewer_processes_warns(tmp_path, launch, processes, warned):
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    proc = subprocess.run(
        accelerate + launch + ["script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(f"WORLD {processes}") == processes
    assert ("started one process" in proc.stderr) is warned, proc.stderr[-3000:]


def _cli(args, cwd):
    script = Path(sys.executable).parent / "trl-prefix-sharing"
    command = ([str(script)] if script.exists() else [sys.executable, "-m", "trl_prefix_sharing"]) + args
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TQDM_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, tokenizer):
    import json

    from trl_prefix_sharing.testing import synthetic_pairs

    root = tmp_path_factory.mktemp("usage")
    make_model(FAMILY, len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    with open(root / "pairs.jsonl", "w") as f:
        for row in synthetic_pairs(8, (5, 20), (1, 6)):
            f.write(json.dumps(row) + "\n")
    return root


@pytest.mark.long
def test_the_shipped_recipe_runs_on_a_cpu_with_the_flag_its_first_line_names(tiny_files):
    """Every key of the recipe as shipped (sharing, packing, bf16, gradient checkpointing, ...), with the one flag its
    first line says a CPU needs; the Hub model and dataset replaced by local ones (no download here), the run cut to
    one step."""
    import torch

    recipe = ROOT / "docs" / "recipes" / "dpo_prefix_sharing.yaml"
    first_line = recipe.read_text().splitlines()[0]
    assert "on a CPU, add: --use_cpu true" in first_line
    local = ["--model_name_or_path", "model", "--dataset_name", "pairs.jsonl", "--output_dir", "recipe_out"]
    short = ["--max_steps", "1", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1"]
    command = ["dpo", "--config", str(recipe), *local, *short, "--report_to", "none"]
    proc = _cli([*command, "--use_cpu", "true"], tiny_files)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Prefix sharing: the first training micro-batch computes" in proc.stdout + proc.stderr
    if not torch.cuda.is_available():  # without the flag: transformers' bf16 refusal, in one line
        proc = _cli(command, tiny_files)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines()[-1].startswith("trl-prefix-sharing dpo: error: ")
        assert "use_cpu" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.long
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dataset_name", "./missing.jsonl"], "Dataset './missing.jsonl' not found"),
        (["--model_name_or_path", "./no-model"], "Model './no-model' not found"),
        (["--packing_length", "-5"], "`packing_length` must be positive"),
    ],
    ids=["dataset", "model", "option"],
)
def test_command_line_set_up_errors_end_with_the_message(tiny_files, flags, message):
    """A set-up error ends the output with one line of the package's (or TRL's) message, no traceback from the script
    or from the launcher around it; exit status 2."""
    base = {"--model_name_or_path": "model", "--dataset_name": "pairs.jsonl", "--output_dir": "err_out"}
    base.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    args = [word for pair in base.items() for word in pair]
    proc = _cli(["dpo", *args, "--prefix_sharing", "true", "--use_cpu", "true", "--bf16", "false"], tiny_files)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("trl-prefix-sharing dpo: error: ") and message in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "CalledProcessError" not in proc.stderr
