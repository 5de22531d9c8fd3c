"""What the recorded benchmarks measured, quoted for a dataset: the expected training speedup is the dataset's ideal
with padding times the share of it that training reached on the nearest benchmark profile; for the trainers that
generate, the nearest profile's measured speedups as they are. The records are
`trl_prefix_sharing/data/measured_speedups.json`, derived from `docs/benchmarks` by `python -m benchmarks.record`: one
entry per record, each with its device (`mode`: cpu or gpu) and, per trainer it measured, its profiles."""

from __future__ import annotations

import json
import math
from importlib import resources


MEASURED_SPEEDUPS = "measured_speedups.json"
#: the trainers' names in the report's lines
NAMES = {"reward": "reward", "online_dpo": "online DPO"}
#: the devices a record is made on, in the order the lines name them
MODES = ("cpu", "gpu")


def measured_speedups() -> dict:
    """The package's record of the benchmarks: {record: {"mode", "device", "model", "source", trainer: {profile:
    {...}}}} (see `benchmarks/record.py`)."""
    path = resources.files("trl_prefix_sharing") / "data" / MEASURED_SPEEDUPS
    return json.loads(path.read_text()) if path.is_file() else {}


def _records(kind: str) -> list[tuple[dict, dict]]:
    """The records that measured `kind`, CPU first: (record, its profiles of `kind`). A record without its `mode` is
    named by its key (`cpu`, `gpu`)."""
    found = [
        ({**record, "mode": record.get("mode") or (key if key in MODES else "cpu")}, record[kind])
        for key, record in sorted(measured_speedups().items())
        if record.get(kind)
    ]
    return sorted(found, key=lambda item: MODES.index(item[0]["mode"]))


def _nearest(profiles: dict, key: str, value: float) -> tuple[str, dict]:
    """The profile whose `key` is nearest to `value` (in ratio)."""
    return min(profiles.items(), key=lambda item: abs(math.log(item[1][key] / max(value, 1e-6))))


def _label(record: dict) -> str:
    return f"{record['mode'].upper()} ({record['device']}; {record['model']})"


def _unrecorded(kind: str, records: list[tuple[dict, dict]]) -> list[str]:
    """The lines for the devices with no record of `kind`: only where that is so."""
    name = NAMES.get(kind, kind.upper())
    if not records:
        return [f"    no {name} benchmark recorded"]
    measured = {record["mode"] for record, _ in records}
    return [f"    {mode.upper()}: no {name} benchmark recorded" for mode in MODES if mode not in measured]


def _slower(expected: float) -> str:
    return (
        f"; below stock's ~{expected:.2f}x, so training's prefix_sharing_attn_implementation=auto measures that and "
        "runs stock's own rows (a fixed kernel would not)"
    )


def expected_speedups(
    kind: str, ratio: float, ideal: float, padded_ideal: float, by: str = "p_over_c"
) -> tuple[list[str], list[float]]:
    """The expected speedup on a dataset, from the nearest measured profile of each record of `kind`: the report's
    lines and the figures.

    `ideal` is the padding-free ideal (stock / shared tokens), `padded_ideal` the one with padding (stock's padded rows
    / the shared rows). The nearest profile is the one of nearest shared prefix/rest ratio `ratio` (`by="p_over_c"`),
    or of nearest ideal with padding (`by="padded_ideal"`: SFT, whose profiles differ in how much rows share). A
    profile that recorded its ideal with padding gives the share of it that training reached; an older record only
    the share of the padding-free ideal, which exceeds 1 where stock computed much padding. An expectation is never
    above `padded_ideal` (capped, and said so), and one above `ideal` says why; nor below 1, where training's `"auto"`
    runs stock's own rows."""
    lines, values, records = [], [], _records(kind)
    for record, profiles in records:
        value = padded_ideal if by == "padded_ideal" else ratio
        name, near = _nearest(profiles, by, value)
        where = f"ideal with padding {near[by]:.2f}x" if by == "padded_ideal" else f"p/c {near[by]:.2f}"
        beside = f", sharing+packing {near['sharing+packing']:.2f}x" if "sharing+packing" in near else ""
        measured = f"measured on the {name} profile, {where}: sharing {near['sharing']:.2f}x{beside} over stock"
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
            basis += _slower(expected)
            expected = 1.0
        values.append(expected)
        lines.append(f"    {_label(record)}: ~{expected:.2f}x ({basis})")
    return lines + _unrecorded(kind, records), values


def measured_group_speedups(kind: str, ratio: float, generations: int) -> list[str]:
    """For a trainer that generates (GRPO, RLOO, online DPO): what each record of `kind` measured on the profile of
    nearest prompt/completion ratio `ratio` among those of `generations` completions per prompt (else among all), as
    measured: the scoring step over stock's, and with generation's time included."""
    lines, records = [], _records(kind)
    for record, profiles in records:
        same = {name: p for name, p in profiles.items() if p.get("generations") == generations}
        name, near = _nearest(same or profiles, "p_over_c", ratio)
        text = (
            f"the scoring step {near['sharing']:.2f}x over stock (its ideal with padding "
            f"{near['padded_ideal']:.2f}x), {near['with_generation']:.2f}x with generation; measured on the {name} "
            f"profile, p/c {near['p_over_c']:.2f}"
        )
        if near["sharing"] < 1.0:
            text += _slower(near["sharing"])
        lines.append(f"    {_label(record)}: {text}")
    return lines + _unrecorded(kind, records)
