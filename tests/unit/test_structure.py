"""The package's structure holds: the runtime package loads no test builders, and every TRL (or transformers Trainer)
internal a trainer here overrides is named in `trl_internals.py` and matches the installed versions."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trl
import trl.trainer.utils

import trl_prefix_sharing
from trl_prefix_sharing import trl_internals
from trl_prefix_sharing.trainers import TRAINERS as TRAINER_SPECS
from trl_prefix_sharing.trl_internals import INTERNALS, SUPPORTED_TRL, Internal, check_trl_internals


ROOT = Path(__file__).resolve().parents[2]
#: this package's trainer classes, from the table of trainers
TRAINERS = tuple(spec.trainer_class for spec in TRAINER_SPECS.values())


@pytest.mark.long
def test_import_loads_no_test_builders_demo_or_command_line():
    code = (
        "import sys, trl_prefix_sharing as t\n"
        f"for name in {TRAINERS!r}: getattr(t, name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('trl_prefix_sharing')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stdout.strip()
    assert "trl_prefix_sharing.dpo_trainer" in loaded  # the trainers were really imported
    assert "trl_prefix_sharing.testing" not in loaded and "trl_prefix_sharing.cli" not in loaded


def test_every_internal_matches_the_installed_trl():
    check_trl_internals(*INTERNALS)  # raises on any mismatch


def _listed(owner_class) -> set[str]:
    """Names listed in `INTERNALS` for this class (or one of its bases)."""
    names = set()
    for internal in (i for group in INTERNALS.values() for i in group):
        module, _, qualname = internal.owner.partition(":")
        if qualname and any(
            f"{base.__module__}:{base.__qualname__}" == internal.owner for base in owner_class.__mro__
        ):
            names.add(internal.name)
    return names


@pytest.mark.parametrize("name", TRAINERS)
def test_every_overridden_private_method_is_listed(name):
    """A private method of TRL's trainer or transformers' Trainer that one of our classes defines is an override of a
    TRL internal, and so is any method that TRL's trainer class itself defines: it must be in `trl_internals.INTERNALS`
    (the one place that shows what a TRL release can break)."""
    cls = getattr(trl_prefix_sharing, name)
    ours = [klass for klass in cls.__mro__ if klass.__module__.startswith("trl_prefix_sharing")]
    theirs = [klass for klass in cls.__mro__ if klass.__module__.startswith(("trl.", "transformers."))]
    trl_classes = [base for base in theirs if base.__module__.startswith("trl.")]
    overridden = {
        attr
        for klass in ours
        for attr, value in vars(klass).items()
        if not attr.startswith("__")
        and callable(value)
        # a private method of TRL or transformers, or any method TRL's trainer defines (its own steps)
        and any(attr in vars(base) for base in (theirs if attr.startswith("_") else trl_classes))
    }
    assert overridden, "no private override found: the check looks at nothing"
    assert overridden <= _listed(cls), f"not listed in trl_internals.INTERNALS: {sorted(overridden - _listed(cls))}"


@pytest.mark.parametrize("name", list(TRAINER_SPECS))
def test_every_entry_of_the_table_is_the_trainer_it_names(name):
    """The table's facts about a trainer are the code's: this package's classes over TRL's, the command's script,
    and TRL's defaults that the command line and `stats` read."""
    import dataclasses
    import importlib

    from trl_prefix_sharing.trainers import spec_of_class

    spec = TRAINER_SPECS[name]
    cls, config = getattr(trl_prefix_sharing, spec.trainer_class), getattr(trl_prefix_sharing, spec.config_class)
    assert vars(importlib.import_module(spec.module, "trl_prefix_sharing"))[spec.trainer_class] is cls
    assert vars(importlib.import_module(spec.config_module, "trl_prefix_sharing"))[spec.config_class] is config
    assert issubclass(cls, trl_internals.resolve(spec.trl_trainer)) and spec_of_class(cls) is spec
    assert cls._config_class is config
    assert (ROOT / "trl_prefix_sharing" / "cli" / f"{name}.py").is_file()
    trl_config = next(base for base in config.__mro__[1:] if base.__name__ == spec.config_class)
    assert trl_config.__module__.startswith("trl.")
    defaults = {field.name: field.default for field in dataclasses.fields(trl_config)}
    assert defaults.get("max_length") == spec.max_length
    # online DPO generates a pair per prompt, always: its config has no field for it
    assert defaults.get("num_generations", 2 if name == "online_dpo" else None) == spec.num_generations
    if spec.completion_length_flag:
        assert defaults[spec.completion_length_flag] == spec.max_completion_length


@pytest.mark.parametrize("name", list(TRAINER_SPECS))
def test_every_trainer_of_the_table_is_guarded_by_construction(name, monkeypatch):
    """A class over any TRL trainer of the table (SFT's included) is checked when it is created, a user's subclass
    too: an internal listed for it that the installed TRL lacks refuses the class, naming it. No trainer module has
    to remember a call."""
    spec = TRAINER_SPECS[name]
    cls = getattr(trl_prefix_sharing, spec.trainer_class)
    gone = Internal(spec.trl_trainer, "_gone_in_this_trl", "override", ("self",))
    monkeypatch.setattr(trl_internals, "INTERNALS", {**INTERNALS, spec.guards[0]: (*INTERNALS[spec.guards[0]], gone)})
    check_trl_internals.cache_clear()
    try:
        with pytest.raises(ImportError, match=re.escape(f"{spec.trl_trainer} has no `_gone_in_this_trl`")):
            type("UsersTrainer", (cls,), {})
        monkeypatch.setattr(trl_internals, "INTERNALS", INTERNALS)
        check_trl_internals.cache_clear()
        assert issubclass(type("UsersTrainer", (cls,), {}), cls)  # the installed TRL: created
    finally:
        check_trl_internals.cache_clear()


def test_a_trainer_the_table_does_not_list_is_refused():
    from transformers import Trainer

    from trl_prefix_sharing.sharing import PrefixSharingMixin

    with pytest.raises(TypeError, match=r"puts prefix sharing before Trainer.*does not list"):
        type("Unlisted", (PrefixSharingMixin, Trainer), {})
    assert type("AnotherMixin", (PrefixSharingMixin,), {})  # no trainer class below it: nothing to check yet


def test_the_internals_report_lists_every_trainer_sft_included():
    """`python -m trl_prefix_sharing.trl_internals` lists each trainer of the table with what its class is checked
    against, and the state of each in the installed TRL."""
    report = trl_internals.report()
    for spec in TRAINER_SPECS.values():
        assert f"{spec.name}: {spec.trainer_class} over {spec.trl_trainer}" in report
    assert "override SFTTrainer.compute_loss: matches" in report
    assert "override Trainer._get_train_sampler: matches" in report.split("sft: ")[1]
    assert "CHANGED" not in report


def test_a_changed_internal_is_one_clear_error(monkeypatch):
    broken = {
        **INTERNALS,
        "dpo": (
            *INTERNALS["dpo"],
            Internal("trl.trainer.dpo_trainer:DPOTrainer", "_renamed", "override", ("self",)),
            Internal(
                "trl.trainer.dpo_trainer:DPOTrainer", "_precompute_ref_logps", "override", ("self", "dataset", "split")
            ),
            Internal("accelerate.accelerator:Accelerator", "_gone_forward", "read", attribute=True, holder="model"),
        ),
    }
    monkeypatch.setattr(trl_internals, "INTERNALS", broken)
    check_trl_internals.cache_clear()
    try:
        with pytest.raises(ImportError) as error:
            check_trl_internals("dpo")
    finally:
        check_trl_internals.cache_clear()
    message = str(error.value)
    assert f"trl{SUPPORTED_TRL}" in message and trl.__version__ in message
    assert "has no `_renamed`" in message and "_precompute_ref_logps takes (self, dataset, name" in message
    assert "no longer sets `model._gone_forward`" in message


def _checked(monkeypatch, *trainers):
    """`check_trl_internals(*trainers)` on the (perturbed) installed TRL: the error message, or None."""
    check_trl_internals.cache_clear()
    monkeypatch.setattr(trl_internals, "_warned", [])
    try:
        check_trl_internals(*trainers)
    except ImportError as error:
        return str(error)
    finally:
        check_trl_internals.cache_clear()
    return None


def test_a_rewritten_trl_method_body_is_refused(monkeypatch):
    """A TRL whose method, re-derived here, has new code (same name and signature) is refused, naming the method."""
    from trl.experimental.online_dpo import OnlineDPOTrainer

    assert _checked(monkeypatch, "online_dpo") is None

    def _forward(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision_inputs=None):
        return None  # a different body

    monkeypatch.setattr(OnlineDPOTrainer, "_forward", _forward)
    message = _checked(monkeypatch, "online_dpo")
    assert message is not None and "OnlineDPOTrainer._forward has new code" in message and trl.__version__ in message


def test_a_trl_method_that_no_longer_calls_what_we_replace_is_refused(monkeypatch):
    def _prepare_inputs(self, generation_batch):
        return generation_batch  # no `shuffle_sequence_dict`: the swap would change nothing

    monkeypatch.setattr(trl.GRPOTrainer, "_prepare_inputs", _prepare_inputs)
    message = _checked(monkeypatch, "grpo")
    assert message is not None and "GRPOTrainer._prepare_inputs no longer contains `generation_batch" in message


def test_a_fused_output_without_a_field_we_build_is_refused(monkeypatch):
    import dataclasses

    fields = [(f.name, f.type, f) for f in dataclasses.fields(trl.trainer.utils.FusedCausalLMOutput)]
    smaller = dataclasses.make_dataclass("FusedCausalLMOutput", [f for f in fields if f[0] != "label_mask"])
    monkeypatch.setattr(trl.trainer.utils, "FusedCausalLMOutput", smaller)
    message = _checked(monkeypatch, "dpo")
    assert message is not None and "FusedCausalLMOutput has no field `label_mask`" in message


def test_an_untested_trl_with_unchanged_internals_runs_with_a_warning(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.99.0")
    with pytest.warns(UserWarning, match=r"tested with trl>=.*installed: trl 1\.99\.0.*unchanged in this TRL"):
        assert _checked(monkeypatch, *INTERNALS) is None

    def _compute_loss(self, model, inputs, return_outputs):
        return None

    monkeypatch.setattr(trl.KTOTrainer, "_compute_loss", _compute_loss)
    message = _checked(monkeypatch, "kto")
    assert message is not None and "trl 1.99.0" in message and "KTOTrainer._compute_loss has new code" in message


def test_the_fingerprint_ignores_comments_formatting_and_docstrings():
    plain = "def f(x):\n    y = x + 1\n    return y\n"
    same = (
        '    def f(x):\n        """Docstring,\n        two lines."""\n        # a comment\n\n        y = x + 1\n'
        "        return y\n"
    )
    other = "def f(x):\n    y = x + 2\n    return y\n"
    fingerprint = trl_internals.source_fingerprint
    assert fingerprint(plain) == fingerprint(same) != fingerprint(other)


def test_supported_trl_range_is_the_requirement():
    requirement = re.search(r'"trl([<>=!][^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert requirement == SUPPORTED_TRL


def test_the_shuffle_swap_is_scoped():
    """GRPO/RLOO swap TRL's `shuffle_sequence_dict` only during TRL's `_prepare_inputs`, and put it back even when the
    call fails."""
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.shuffle_sequence_dict
    with (
        pytest.raises(RuntimeError),
        trl_internals.replaced_function(grpo_module.__name__, "shuffle_sequence_dict", len),
    ):
        assert grpo_module.shuffle_sequence_dict is len
        raise RuntimeError("a failing step")
    assert grpo_module.shuffle_sequence_dict is original is trl.trainer.utils.shuffle_sequence_dict


def test_no_trl_method_body_is_copied():
    """No function of this package repeats a TRL trainer method's body (the old way of changing one line of it)."""
    from trl_prefix_sharing import group_sharing

    source = inspect.getsource(group_sharing)
    assert "split_tensor_dict" not in source and "_generate_and_score_completions" not in source


def test_ci_runs_every_tier_and_the_fast_tier_keeps_the_equivalence_matrix():
    """`bash scripts/test.sh` leaves out the tests marked `long`; CI runs `--all`, so nothing is left out there; the
    tests that guard the numbers (every `*_equivalence.py` and the architecture matrix) are never marked long."""
    assert "bash scripts/test.sh --all" in (ROOT / ".ci" / "run").read_text()
    assert '-m "not long"' in (ROOT / "scripts" / "test.sh").read_text()
    suite = ROOT / "tests" / "equivalence"
    guards = sorted(suite.glob("test_*equivalence.py")) + [suite / "test_architectures.py"]
    assert len(guards) >= 7
    for path in guards:
        assert "mark.long" not in path.read_text(), path.name


PACKAGE = sorted((ROOT / "trl_prefix_sharing").rglob("*.py"))
#: the most lines a class or function of the package may span
LONGEST = 150


def _definitions(path: Path):
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_no_class_or_function_is_longer_than_150_lines():
    """A long class or function is several ideas: none of the package's (its command line and test builders
    included) spans more than 150 lines."""
    assert len(PACKAGE) > 40
    too_long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
        for path in PACKAGE
        for node, lines in _definitions(path)
        if lines > LONGEST
    ]
    assert not too_long, too_long


#: the most lines a module of the package may hold
MODULE_LINES = 600


def test_no_module_is_longer_than_600_lines():
    over = [
        f"{path.relative_to(ROOT / 'trl_prefix_sharing').as_posix()} ({lines} lines)"
        for path in PACKAGE
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES
    ]
    assert not over, over


#: the benchmark harness (every workload, its data, models, measurements, results and plots)
BENCHMARK_TOOLING = sorted((ROOT / "benchmarks").glob("*.py"))


def test_the_benchmarks_are_one_harness_under_4000_lines():
    """One benchmark harness: every workload a module of `benchmarks/` (none left in `scripts/`), none reaching into
    another script or the tests by `sys.path`, no class or function over 150 lines, all of it under 4,000 lines."""
    assert len(BENCHMARK_TOOLING) > 10
    assert not sorted((ROOT / "scripts").glob("benchmark*.py"))
    lines = sum(len(path.read_text().splitlines()) for path in BENCHMARK_TOOLING)
    assert lines < 4000, lines
    for path in BENCHMARK_TOOLING:
        assert "sys.path" not in path.read_text(), path
    too_long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)"
        for path in [*BENCHMARK_TOOLING, ROOT / "scripts" / "gpu_check.py"]  # the GPU session's runner, on it
        for node, n in _definitions(path)
        if n > LONGEST
    ]
    assert not too_long, too_long


def test_the_size_check_sees_a_long_class(tmp_path):
    """The check above can fail: a class of 151 lines is reported."""
    path = tmp_path / "long.py"
    path.write_text("class Long:\n" + "    x = 1\n" * 150)
    assert [(node.name, lines) for node, lines in _definitions(path)] == [("Long", 151)]


#: Sphinx roles and reStructuredText inline literals, which TRL's documentation builder does not render
_RST = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`|``")


def _docstrings(path: Path):
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "name", path.stem), doc


def test_docstrings_use_markdown_backticks():
    """Docstrings in TRL's style: Markdown backticks, no Sphinx roles or double backticks (the command line too)."""
    paths = sorted((ROOT / "trl_prefix_sharing").rglob("*.py"))
    found = [
        f"{path.relative_to(ROOT)}: {name}" for path in paths for name, doc in _docstrings(path) if _RST.search(doc)
    ]
    assert not found, found
    assert _RST.search("see :class:`~trl.DPOTrainer` and ``x``")  # the check can fail


def test_every_trainer_reaches_the_session_through_the_mixin():
    """One seam: the trainers build no session, collator or layout of their own; they call the mixin's set-up, its
    start-up check phase and the session's layout entrances."""
    package = ROOT / "trl_prefix_sharing"
    for path in sorted(package.glob("*.py")):
        source = path.read_text()
        if path.name not in {"session.py", "sharing.py"}:
            assert "PrefixSharingSession(" not in source, path.name
        if path.name not in {"collated.py", "collator.py", "sharing.py"}:
            assert "PrefixSharingCollator(" not in source, path.name
        if path.name not in {"layout.py", "session.py", "collator.py", "tuning.py"}:  # tuning: each candidate's
            assert "build_layout(" not in source, path.name
    session = (package / "session.py").read_text()
    assert "StartupCheck" not in session.split('"""', 2)[2]  # the session never enters the start-up check


def test_packing_stands_apart_from_sharing():
    """Packing has its own config fields and reads nothing of the sharing session: the trainer hands its collator one
    row policy (`_packed_rows`), asked with the kernel's density."""
    from trl_prefix_sharing.config import PackingArguments, PrefixSharingArguments

    assert not issubclass(PackingArguments, PrefixSharingArguments)
    assert not issubclass(PrefixSharingArguments, PackingArguments)
    source = (ROOT / "trl_prefix_sharing" / "packing.py").read_text()
    assert "self.sharing_session" not in source and "attn_implementation" not in source
    collator = (ROOT / "trl_prefix_sharing" / "collator.py").read_text()
    assert "packing_length" not in collator and "pad_to_multiple_of" not in collator
