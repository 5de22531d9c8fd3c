"""The expected training speedup: the ideal with padding times the share of it that `python -m benchmarks.dpo --record`
measured on the nearest benchmark profile (`trl_prefix_sharing/data/measured_speedups.json`)."""

from __future__ import annotations

import json
import math
from importlib import resources

from .defaults import PREFERENCE_TRAINERS


MEASURED_SPEEDUPS = "measured_speedups.json"


def measured_speedups() -> dict:
    """What `python -m benchmarks.dpo --record` measured: {mode: {"device", "command", kind: {profile: {...}}}}."""
    path = resources.files("trl_prefix_sharing") / "data" / MEASURED_SPEEDUPS
    return json.loads(path.read_text()) if path.is_file() else {}


def expected_speedups(kind: str, ratio: float, ideal: float, padded_ideal: float) -> tuple[list[str], list[float]]:
    """The expected speedup on a dataset of shared prefix/rest ratio `ratio`, from the nearest measured profile: the
    report's lines and the figures.

    `ideal` is the padding-free ideal (stock / shared tokens), `padded_ideal` the one with padding (stock's padded rows
    / the shared rows). A profile that recorded its ideal with padding gives the share of it that training reached;
    an older record only the share of the padding-free ideal, which exceeds 1 where stock computed much padding. An
    expectation is never above `padded_ideal` (capped, and said so), and one above `ideal` says why."""
    lines, values, recorded = [], [], measured_speedups()
    for mode, record in sorted(recorded.items()):
        profiles = record.get(kind) or {}
        if not profiles:
            continue
        name, near = min(profiles.items(), key=lambda item: abs(math.log(item[1]["p_over_c"] / max(ratio, 1e-6))))
        measured = (
            f"measured on the {name} profile, p/c {near['p_over_c']:.2f}: sharing {near['sharing']:.2f}x, "
            f"sharing+packing {near['sharing+packing']:.2f}x over stock"
        )
        if near.get("padded_ideal"):
            share = near["sharing"] / near["padded_ideal"]
            expected, basis = padded_ideal * share, f"the ideal with padding x {share:.2f}, the share of it {measured}"
        else:
            share = near["share_of_ideal"]
            expected, basis = ideal * share, f"the ideal x {share:.2f}, the share of ideal {measured}"
        if expected > padded_ideal:
            expected = padded_ideal
            basis += f"; capped at the ideal with padding, {padded_ideal:.2f}x, the most the positions allow"
        if expected > ideal:
            basis += (
                f"; above the padding-free ideal {ideal:.2f}x because stock also computes its rows' padding "
                "positions, which the shared rows drop"
            )
        if expected < 1.0:  # measured slower than stock: training's `"auto"` (the default) runs stock's own rows
            basis += (
                f"; below stock's ~{expected:.2f}x, so training's prefix_sharing_attn_implementation=auto measures "
                "that and runs stock's own rows (a fixed kernel would not)"
            )
            expected = 1.0
        values.append(expected)
        lines.append(f"    {mode.upper()} ({record['device']}; {record['model']}): ~{expected:.2f}x ({basis})")
    if not lines:
        lines.append(f"    no {kind.upper()} benchmark recorded")
    if kind in PREFERENCE_TRAINERS and "gpu" not in recorded:
        lines.append(
            "    GPU: no benchmark recorded yet (python -m benchmarks.dpo --mode gpu --record on a CUDA machine)"
        )
    return lines, values
