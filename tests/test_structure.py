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
from trl_prefix_sharing.trl_internals import INTERNALS, SUPPORTED_TRL, Internal, check_trl_internals


ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("DPOTrainer", "RewardTrainer", "GRPOTrainer", "RLOOTrainer", "OnlineDPOTrainer")


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
    TRL internal: it must be in `trl_internals.INTERNALS` (the one place that shows what a TRL release can break)."""
    cls = getattr(trl_prefix_sharing, name)
    ours = [klass for klass in cls.__mro__ if klass.__module__.startswith("trl_prefix_sharing")]
    theirs = [klass for klass in cls.__mro__ if klass.__module__.startswith(("trl.", "transformers."))]
    overridden = {
        attr
        for klass in ours
        for attr, value in vars(klass).items()
        if attr.startswith("_")
        and not attr.startswith("__")
        and callable(value)
        and any(attr in vars(base) for base in theirs)
    }
    assert overridden, "no private override found: the check looks at nothing"
    assert overridden <= _listed(cls), f"not listed in trl_internals.INTERNALS: {sorted(overridden - _listed(cls))}"


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
    guards = sorted((ROOT / "tests").glob("test_*equivalence.py")) + [ROOT / "tests" / "test_architectures.py"]
    assert len(guards) >= 7
    for path in guards:
        assert "mark.long" not in path.read_text(), path.name
