"""`scripts/gpu_check.py` on CPU: its dry run (the GPU run's code with tiny models) writes the files a GPU run keeps,
in their schemas and sizes; its pytest runner counts outcomes, keeps the properties tests record and survives a time
limit; and the two CUDA-only defects it exists to catch stay fixed in tests/cuda/test_cuda.py (head size,
checkpointing)."""

import ast
import copy
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from test_cuda import CUDA_SIZES, checkpoint_as_train_does, head_size, is_checkpointing

from trl_prefix_sharing.testing import FAMILIES, make_config
from trl_prefix_sharing.testing.equivalence import awkward_text_dataset, make_trainers, step


ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the benchmarks package and the GPU runner
import gpu_check  # noqa: E402

from benchmarks.gpu import GRPO_PROFILES, Budget, Deadline  # noqa: E402


MODELS = ("qwen2.5-0.5b", "llama-3b")
#: a dry run's variants: `"sharing"` is `"auto"` (SDPA on the CPU), the varlen reference stands in for FlexAttention
VARIANTS = ("stock", "sharing", "packing", "sharing+packing", "sharing-varlen", "sharing-sdpa")
HOST_KEYS = {
    "step_ms",
    "layout_host_ms_per_step",
    "mask_host_ms_per_step",
    "mask_gpu_ms_per_step",
    "peak_memory_gb",
    "compiled_variants",
    "eager_flex_warnings",
    "recompile_limit_warnings",
    "profile",
}


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    command = [sys.executable, "scripts/gpu_check.py", "--dry-run", "--part", "all", "--jobs", "2", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.long
def test_dry_run_writes_the_files_a_gpu_run_keeps(dry_run):
    names = sorted(os.listdir(dry_run))
    assert names == ["cuda_tests.log", "gpu.json", "gpu.md", "gpu_check.log", "gpu_speedup.svg", "gpu_tests.json"]
    assert len(names) <= gpu_check.MAX_FILES and not gpu_check.check_outputs(dry_run)
    for name in names:
        assert 0 < (dry_run / name).stat().st_size < 2**20, name  # a GPU run's are larger, within 16 MiB
    ET.parse(dry_run / "gpu_speedup.svg")  # well-formed


@pytest.mark.long
def test_dry_run_gpu_tests_json_has_the_schema_and_the_real_counts(dry_run):
    data = json.loads((dry_run / "gpu_tests.json").read_text())
    assert set(gpu_check.GPU_TESTS_KEYS) <= set(data)
    assert data["collected"] == 87  # tests/cuda/test_cuda.py, collected (an import error there fails here)
    assert data["passed"] + data["failed"] + data["skipped"] + data["not_run"] == 87
    if not torch.cuda.is_available():
        assert data["skipped"] == 87 and data["skip_reasons"] == ["Skipped: needs CUDA (FlexAttention backward)"]
    assert isinstance(data["recompiles"], dict) and isinstance(data["peak_memory_gb"], dict)
    assert data["command"].startswith("python scripts/gpu_check.py") and "--dry-run" in data["command"]
    assert data["torch"] == torch.__version__ and data["environment"]["dry_run"] is True
    assert "tests/cuda/test_cuda.py" in (dry_run / "cuda_tests.log").read_text()


@pytest.mark.long
def test_dry_run_gpu_json_has_cpu_json_schema_plus_versions_and_host_times(dry_run):
    data = json.loads((dry_run / "gpu.json").read_text())
    cpu = json.loads((ROOT / "docs/benchmarks/cpu.json").read_text())
    assert set(cpu) | {"torch", "cuda", "transformers", "trl", "triton"} <= set(data)
    cpu_variant_keys = set(cpu["results"]["dpo"]["Capybara"]["stock"])
    # both trainer hooks found: a rename in the package would silently drop the mask and GRPO layout times
    assert data["timed_functions"] == ["AttentionBackend.inputs", "session.build_layout"]
    assert set(data["results"]) == set(MODELS) and not data["not_run"]
    for model in MODELS:
        for kind in ("dpo", "reward"):
            by_variant = data["results"][model][kind]["HH-RLHF"]
            assert set(by_variant) == set(VARIANTS)
            for variant, result in by_variant.items():
                assert cpu_variant_keys | HOST_KEYS <= set(result), (model, kind, variant)
                assert result["pairs_per_s"] > 0 and result["step_ms"] > 0 and result["layout_host_ms_per_step"] > 0
                # a layout's mask is built where a micro-batch ran shared (stock: never; "auto" may run stock's rows)
                laid_out = any(kernel != "stock" for kernel in result["kernels_run"])
                assert laid_out == (variant != "stock") or variant == "sharing", (model, kind, variant)
                assert (sum(result["kernels_run"].values()) > 0) == (variant != "stock"), (model, kind, variant)
                assert (result["mask_host_ms_per_step"] is not None) == laid_out, (model, kind, variant)
                assert (result["masks_per_step"] > 0) == laid_out, (model, kind, variant)
                profile = result["profile"]  # the profiled epoch: per-step CPU time and its top operators
                assert profile["wall_ms_per_step"] > 0 and profile["cpu_ops_ms_per_step"] > 0
                assert profile["top_cpu_ops_ms_per_step"] and profile["gpu_busy_ms_per_step"] is None  # no GPU
            kernels = {variant: result["attn_implementation"] for variant, result in by_variant.items()}
            assert kernels["sharing-sdpa"] == kernels["sharing"] == "sdpa" and kernels["sharing-varlen"] == "varlen"
            summary = data["summary"][model][kind]["HH-RLHF"]
            assert summary["paper"] == [1.19, 1.48] and summary["ideal"] > 1
            assert summary["fastest_sharing_kernel"] in ("sdpa", "varlen")
    calls = data["attention"]["qwen2.5-0.5b"]["HH-RLHF"]["calls"]  # the attention microbenchmark
    assert set(calls) == {"stock", "varlen", "sdpa"} and all(call["host_ms"] > 0 for call in calls.values())
    assert calls["varlen"]["rows"] == 1 and calls["varlen"]["width"] < calls["stock"]["rows"] * calls["stock"]["width"]
    grpo = data["grpo"]["qwen2.5-0.5b"]
    assert set(grpo) == set(GRPO_PROFILES)
    for result in grpo.values():
        assert result["ideal"] > 1 and result["speedup"] > 0 and result["layout_host_ms_per_step"] > 0
        assert result["mask_host_ms_per_step"] > 0
    markdown = (dry_run / "gpu.md").read_text()
    for title in (
        "## qwen2.5-0.5b: DPO",
        "## qwen2.5-0.5b: REWARD",
        "## llama-3b: DPO",
        "## llama-3b: REWARD",
        "## qwen2.5-0.5b: GRPO",
        "## qwen2.5-0.5b: where the step goes",
        "## qwen2.5-0.5b: one attention layer per kernel",
    ):
        assert title in markdown


@pytest.mark.long
def test_merge_combines_parts_from_separate_runs(dry_run, tmp_path):
    full = json.loads((dry_run / "gpu.json").read_text())
    for index, model in enumerate(MODELS):  # as if each model had run in its own call
        part = copy.deepcopy(full)
        for key in ("results", "models", "settings", "grpo"):
            part[key] = {name: value for name, value in part[key].items() if name == model}
        part["command"] = f"python scripts/gpu_check.py --part part{index}"
        (tmp_path / f"part{index}").mkdir()
        (tmp_path / f"part{index}" / "gpu.json").write_text(json.dumps(part))
    (tmp_path / "part0" / "gpu_tests.json").write_text((dry_run / "gpu_tests.json").read_text())
    out = tmp_path / "merged"
    assert gpu_check.main(["--merge", str(tmp_path / "part0"), str(tmp_path / "part1"), "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["gpu.json", "gpu.md", "gpu_speedup.svg", "gpu_tests.json"]
    merged = json.loads((out / "gpu.json").read_text())
    assert set(merged["results"]) == set(MODELS) and set(merged["grpo"]) == {"qwen2.5-0.5b"}
    assert merged["summary"] == full["summary"] and len(merged["commands"]) == 2
    other = json.loads((tmp_path / "part1" / "gpu.json").read_text())
    other["device"] = "another GPU"
    (tmp_path / "part1" / "gpu.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="one machine"):
        gpu_check.main(["--merge", str(tmp_path / "part0"), str(tmp_path / "part1"), "--out", str(out)])


@pytest.mark.long
def test_merge_combines_profiles_of_one_model_from_separate_runs(dry_run, tmp_path):
    """Parts that measured different profiles of the same model and kind (a run cut short, then the rest): the merged
    results hold every profile, and a profile one part had no time for but another measured is not listed as not
    run."""
    full = json.loads((dry_run / "gpu.json").read_text())
    first, second = copy.deepcopy(full), copy.deepcopy(full)
    for kinds in second["results"].values():
        for kind in kinds:
            kinds[kind] = {"TLDR": kinds[kind]["HH-RLHF"]}
    first["not_run"] = ["qwen2.5-0.5b dpo TLDR", "qwen2.5-0.5b dpo Capybara"]
    for index, part in enumerate((first, second)):
        (tmp_path / f"part{index}").mkdir()
        (tmp_path / f"part{index}" / "gpu.json").write_text(json.dumps(part))
    out = tmp_path / "merged"
    assert gpu_check.main(["--merge", str(tmp_path / "part0"), str(tmp_path / "part1"), "--out", str(out)]) == 0
    merged = json.loads((out / "gpu.json").read_text())
    for model in MODELS:
        for kind in ("dpo", "reward"):
            assert set(merged["results"][model][kind]) == {"HH-RLHF", "TLDR"}
            assert set(merged["summary"][model][kind]) == {"HH-RLHF", "TLDR"}
    assert merged["not_run"] == ["qwen2.5-0.5b dpo Capybara"]


@pytest.mark.long
def test_merge_sums_test_runs_over_parts_of_the_file(dry_run, tmp_path):
    tests = json.loads((dry_run / "gpu_tests.json").read_text())
    first, second = copy.deepcopy(tests), copy.deepcopy(tests)
    first.update(passed=30, skipped=0, collected=30, recompiles={"flex_attention": 5}, recompiles_logged={"f": 1})
    second.update(
        passed=9,
        failed=1,
        skipped=0,
        collected=10,
        peak_memory_gb={"long_row": 0.2},
        recompiles_logged={"f": 2},
        failures=[{"test": "t", "message": "m"}],
    )
    merged = gpu_check.merge_tests([first, second])
    assert (merged["passed"], merged["failed"], merged["collected"]) == (39, 1, 40)
    assert merged["recompiles"] == {"flex_attention": 5} and merged["peak_memory_gb"] == {"long_row": 0.2}
    assert merged["recompiles_logged"] == {"f": 3} and len(merged["failures"]) == 1


def test_budget_skips_what_would_overrun_and_keeps_going_after_a_failure():
    data = {"not_run": [], "errors": []}
    budget = Budget(Deadline(0), data, cuda=False)

    def fails():
        raise RuntimeError("out of memory")

    assert budget.run("first", fails) is None and budget.run("second", lambda x: x + 1, 1) == 2
    assert data["errors"] == [{"unit": "first", "error": "RuntimeError: out of memory"}] and not data["not_run"]
    budget = Budget(Deadline(100), data, cuda=False)
    budget.longest = 80  # the next unit would need 120 s
    assert budget.run("third", lambda: 1) is None and data["not_run"] == ["third"]


# ------------------------------------------------------------------------------------------------- the pytest runner
TESTS = """
import time
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "boom"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("broken fixture")

def test_error(broken):
    pass

def test_long_row_step_records(record_property):
    record_property("peak_memory_gb", {"long_row": 0.5})
"""


@pytest.mark.long
def test_pytest_runner_counts_outcomes_runs_measurements_first_and_keeps_properties(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    log = tmp_path / "log.txt"
    summary = gpu_check.run_pytest(["-v", "-p", "no:cacheprovider", str(tmp_path / "test_sample.py")], log, 120)
    assert (summary["passed"], summary["failed"], summary["skipped"], summary["errors"]) == (2, 1, 1, 1)
    assert summary["collected"] == 5 and summary["not_run"] == 0 and not summary["timed_out"]
    assert summary["properties"] == {"peak_memory_gb": {"long_row": 0.5}}
    messages = {failure["test"].split("::")[-1]: failure["message"] for failure in summary["failures"]}
    assert "boom" in messages["test_fails"] and "broken fixture" in messages["test_error"]
    text = log.read_text()
    assert text.index("test_long_row_step_records") < text.index("test_passes")  # measurements first


@pytest.mark.long
def test_pytest_runner_deals_the_tests_out_to_processes_side_by_side(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    log = tmp_path / "log.txt"
    pytest_args = ["-v", "-p", "no:cacheprovider", str(tmp_path / "test_sample.py")]
    summary = gpu_check.run_pytest(pytest_args, log, 120, jobs=2)
    assert (summary["passed"], summary["failed"], summary["skipped"], summary["errors"]) == (2, 1, 1, 1)
    assert summary["collected"] == 5 and summary["not_run"] == 0 and not summary["timed_out"]
    assert summary["properties"] == {"peak_memory_gb": {"long_row": 0.5}}
    parts = log.read_text().split("[gpu_check: part 2 of 2]")
    assert len(parts) == 2 and parts[0].startswith("[gpu_check: part 1 of 2]")
    ran = [set(re.findall(r"::(test_\w+)", part)) for part in parts]  # each test in one part; the measured one first
    assert len(ran[0]) + len(ran[1]) == 5 and not ran[0] & ran[1] and "test_long_row_step_records" in ran[0]
    assert sorted(os.listdir(tmp_path)) == ["log.txt", "test_sample.py"]  # the parts' own logs removed


@pytest.mark.long
def test_pytest_runner_stops_at_its_time_limit_and_keeps_what_finished(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(120)\n"
    )
    log = tmp_path / "log.txt"
    summary = gpu_check.run_pytest(["-p", "no:cacheprovider", str(tmp_path / "test_slow.py")], log, 6)
    assert summary["timed_out"] and summary["duration_s"] < 60
    assert (summary["passed"], summary["not_run"], summary["collected"]) == (1, 1, 2)
    assert "stopped after 6 s" in log.read_text()


@pytest.mark.long
def test_a_test_file_that_does_not_import_fails_the_tests_part(tmp_path):
    """A collection error is not a pass: pytest collected nothing and exited with an error, so the tests part proved
    nothing and its status says so (it used to report 0 of 0 and succeed)."""
    (tmp_path / "test_broken.py").write_text("import not_a_module_anywhere\n\n\ndef test_x():\n    pass\n")
    pytest_args = ["-p", "no:cacheprovider", str(tmp_path / "test_broken.py")]
    summary = gpu_check.run_pytest(pytest_args, tmp_path / "log.txt", 120)
    assert (summary["passed"], summary["failed"], summary["collected"]) == (0, 0, 0)
    tests = {"pytest_returncode": summary["returncode"], "timed_out": False, "collected": summary["collected"]}
    assert "exited with status 2" in gpu_check.not_collected(tests)
    assert "collected no test" in gpu_check.not_collected({**tests, "pytest_returncode": 0})
    assert gpu_check.not_collected({**tests, "pytest_returncode": 1, "collected": 3}) is None  # failures count apart


def test_logged_recompiles_are_counted_per_function(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text(
        "V1123 [0/1] [__recompiles] Recompiling function flex_attention in /x/flex_attention.py:1450\n"
        "    triggered by the following guard failure(s):\n"
        "V1123 [1/1] [__recompiles] Recompiling function create_block_mask in /x/flex_attention.py:900\n"
        "V1123 [0/2] [__recompiles] Recompiling function flex_attention in /x/flex_attention.py:1450\n"
    )
    assert gpu_check.logged_recompiles(log) == {"create_block_mask": 1, "flex_attention": 2}


# -------------------------------------------------------------------------------------------------
# tests/cuda/test_cuda.py
def test_cuda_test_models_have_a_head_size_cuda_flex_attention_accepts():
    """CUDA FlexAttention (torch 2.11) refuses head sizes under 16; every model tests/cuda/test_cuda.py builds gets
    `CUDA_SIZES` (or is built from it and passed in), directly or through `on_cuda`, which adds it."""
    from test_cuda import on_cuda

    for family in FAMILIES:
        assert head_size(make_config(family, 100, **CUDA_SIZES)) >= 16, family
    assert head_size(make_config("qwen3", 100, **CUDA_SIZES, use_sliding_window=True, sliding_window=6)) >= 16
    seen = {}
    on_cuda(lambda *args, **kwargs: seen.update(kwargs) or (), config_kwargs={"sliding_window": 6})
    assert seen["config_kwargs"] == {**CUDA_SIZES, "sliding_window": 6}
    builders = {"make_trainers", "make_reward_trainers", "make_model", "save_model", "make_online_dpo_trainers"}
    direct = through_on_cuda = 0
    for node in ast.walk(ast.parse((ROOT / "tests/cuda/test_cuda.py").read_text())):
        name = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
        if name in builders:
            direct += 1
            text = ast.unparse(node)
            assert "CUDA_SIZES" in text or "model=model" in text, text
        elif name == "on_cuda":
            through_on_cuda += 1
    assert direct >= 8 and through_on_cuda >= 19  # every builder call in the file (8 and 19 today)


def test_checkpointing_is_on_where_the_cuda_tests_assert_it(tmp_path, tokenizer):
    """transformers 5.23 turns checkpointing on in `train()`, not when the trainer is built; the CUDA tests switch it
    on as `train()` does and assert it after a step (TRL's reference pass turns it off and back on)."""
    stock, shared = make_trainers(
        tmp_path, "llama", awkward_text_dataset(), tokenizer, config_kwargs=CUDA_SIZES, gradient_checkpointing=True
    )
    checkpoint_as_train_does(stock, shared)
    examples = list(stock.train_dataset)
    expected, got = step(stock, examples), step(shared, examples)
    assert is_checkpointing(shared.model) and is_checkpointing(stock.model)
    torch.testing.assert_close(got["loss"], expected["loss"], atol=1e-5, rtol=1e-5)
