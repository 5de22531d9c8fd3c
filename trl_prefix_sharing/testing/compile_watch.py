"""Watching torch.compile on the FlexAttention path: how many compiled variants the compiled `create_block_mask` and
transformers' compiled `flex_attention` needed, whether FlexAttention ever ran uncompiled, and a realistic schedule of
training and evaluation batches to run under it. Used by tests/unit/test_compile.py (CPU, forward) and
tests/cuda/test_cuda.py.

Why it matters: both functions are compiled for the shapes they see. A new variant per batch costs a compilation each
step, and past `torch._dynamo.config.recompile_limit` (8) dynamo stops compiling and FlexAttention runs its eager
form, which materialises the full `rows x heads x S x S` score matrix.
"""

from __future__ import annotations

import functools
import logging
import random
import warnings

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch.nn.attention import flex_attention as flex_module


#: torch's warning when FlexAttention runs uncompiled
EAGER_FLEX_WARNING = "flex_attention called without torch.compile()"


class CompileWatch:
    """Within the block: compiled variants (dynamo cache entries) of `create_block_mask` and `flex_attention`, graph
    breaks, dynamo's recompile-limit warnings, eager FlexAttention warnings, and the `training` flags transformers'
    compiled FlexAttention was called with (policy passes in train mode, reference and evaluation passes in eval mode).
    Resets dynamo on entry and exit, so that no other test's compilations count here or leak out."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.training_flags: set[bool] = set()
        self.switches = 0  # how often consecutive FlexAttention calls switched between training and eval mode
        self._last_flag = None
        self.limit_warnings: list[str] = []

    def __enter__(self):
        from transformers.integrations import flex_attention as hf_flex

        torch._dynamo.reset()
        getattr(flex_module, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")  # warn again if eager
        self._graphs = counters["stats"]["unique_graphs"]
        self._breaks = sum(counters["graph_break"].values())
        original = hf_flex.compile_friendly_flex_attention

        @functools.wraps(original)
        def spy(*args, training=False, **kwargs):
            self.training_flags.add(bool(training))
            self.switches += self._last_flag is not None and self._last_flag != bool(training)
            self._last_flag = bool(training)
            return original(*args, training=training, **kwargs)

        self.monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", spy)
        watch = self

        class LimitHandler(logging.Handler):
            def emit(self, record):
                if "recompile_limit" in record.getMessage() or "cache_size_limit" in record.getMessage():
                    watch.limit_warnings.append(record.getMessage())

        self._handler = LimitHandler(level=logging.WARNING)
        logging.getLogger("torch._dynamo").addHandler(self._handler)
        self._warnings = warnings.catch_warnings(record=True)
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._warnings.__exit__(*exc)
        logging.getLogger("torch._dynamo").removeHandler(self._handler)
        torch._dynamo.reset()  # later tests start from nothing compiled (no shapes already made dynamic)
        return False

    def variants(self) -> dict[str, int]:
        """Compiled variants of each function so far (each one compilation; a new shape or guard adds one)."""
        return {
            "create_block_mask": len(_debug_get_cache_entry_list(flex_module.create_block_mask)),
            "flex_attention": len(_debug_get_cache_entry_list(flex_module.flex_attention)),
        }

    def report(self) -> dict:
        return {
            **self.variants(),
            "unique_graphs": counters["stats"]["unique_graphs"] - self._graphs,
            "graph_breaks": sum(counters["graph_break"].values()) - self._breaks,
            "training_flags": sorted(self.training_flags),
            "train_eval_switches": self.switches,
            "eager_flex_warnings": self.eager_flex_warnings(),
            "recompile_limit_warnings": len(self.limit_warnings),
        }

    def eager_flex_warnings(self) -> int:
        return sum(EAGER_FLEX_WARNING in str(w.message) for w in self.caught)

    def assert_compiled_and_bounded(self, max_variants: int | dict[str, int]) -> dict:
        """Both functions compiled (at least one variant each), at most `max_variants` each (or per function name),
        FlexAttention never eager, no graph break, no recompile limit hit, and both train- and eval-mode passes went
        through it."""
        report = self.report()
        assert report["eager_flex_warnings"] == 0, report
        assert report["recompile_limit_warnings"] == 0, (report, self.limit_warnings)
        assert report["graph_breaks"] == 0, (report, dict(counters["graph_break"]))
        for name in ("create_block_mask", "flex_attention"):
            bound = max_variants[name] if isinstance(max_variants, dict) else max_variants
            assert 1 <= report[name] <= bound, (name, bound, report)
        assert report["training_flags"] == [False, True], report  # policy (train) and reference/eval passes
        return report


def compile_schedule(train_size: int, eval_size: int, batch_size: int, steps: int, eval_every: int, seed: int = 0):
    """(mode, example indices) batches as the Trainer runs them: shuffled training batches of `batch_size` (a shorter
    last batch of each epoch), with a full evaluation (shorter last batch too) every `eval_every` steps."""
    rng = random.Random(seed)
    schedule, order = [], []
    for step in range(steps):
        if not order:
            order = list(range(train_size))
            rng.shuffle(order)
        schedule.append(("train", order[:batch_size]))
        order = order[batch_size:]
        if (step + 1) % eval_every == 0:
            schedule.extend(
                ("eval", list(range(i, min(i + batch_size, eval_size)))) for i in range(0, eval_size, batch_size)
            )
    return schedule


def cuda_schedule_data():
    """(train, evaluation) pairs of tests/cuda/test_cuda.py's compile test: documents of 3 to about 160 tokens, so that
    with rows rounded to FlexAttention's 128-token blocks the batches take two widths (128 and 256) and 4, 2 and 1 rows
    (tests/unit/test_compile.py checks this on CPU). Longer documents put every batch in the 256 bucket: the first GPU
    run then compiled one width only."""
    from trl_prefix_sharing.testing import synthetic_pairs

    return synthetic_pairs(46, (1, 100), (1, 30), seed=5), synthetic_pairs(9, (1, 100), (1, 30), seed=6)
