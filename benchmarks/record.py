"""What `trl-prefix-sharing stats` quotes, derived from the recorded benchmarks: the package's
`trl_prefix_sharing/data/measured_speedups.json` (package data, since `docs/` is not installed).

    python -m benchmarks.record      # after a benchmark rewrote a JSON of docs/benchmarks

Each entry is one record of `docs/benchmarks` (`SOURCES`), keyed by its file's stem: the device (`mode`: cpu or gpu,
and its name), the model, and per trainer (`dpo`, `reward`, `sft`, `grpo`, `online_dpo`, `kto`, `orpo`, `cpo`) the
profiles it measured, each with the figures `stats` scales by:

- `sharing`: the measured speedup of the default sharing configuration over stock TRL in the same run (its step or
  epoch time); other measured variants beside it (`packing`, `sharing+packing`, a join rule, ...);
- `padded_ideal`: stock's positions / sharing's, padding included (what each computed in that run), and `ideal`, the
  same without padding (tokens), where the record has it;
- `p_over_c`: the profile's prompt / completion tokens (preference, paired and generating trainers), by which `stats`
  finds the profile nearest to a dataset (SFT: by `padded_ideal`).

`tests/tools/test_stats_trained.py` checks that the package's file is what `measured_speedups()` derives from the
records, so it cannot go stale: rerun this after a benchmark is recorded again.
"""

from __future__ import annotations

import json
import os
import sys


__all__ = ["PACKAGE_FILE", "SOURCES", "measured_speedups", "write"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the records `stats` quotes, in `docs/benchmarks`
SOURCES = ("cpu.json", "gpu.json", "join_sft_cpu.json", "grpo_cpu.json", "online_dpo_cpu.json", "paired_cpu.json")
PACKAGE_FILE = os.path.join(ROOT, "trl_prefix_sharing", "data", "measured_speedups.json")


def _round(value: float) -> float:
    return round(value, 3)


def _device(record: dict) -> dict:
    device = record["device"]
    mode = "cpu" if device.upper().startswith("CPU") else "gpu"
    model = record.get("model")
    if model is None:  # `benchmarks.join` names its tiny Llama's size in its arguments
        model = f"llama, hidden {record['args']['hidden_size']}, {record['args']['layers']} layers"
    return {"mode": mode, "device": device, "model": model}


def _preference(results: dict) -> dict:
    """DPO and reward (`benchmarks.dpo`, `scripts/gpu_check.py`): per kind and profile, each variant's pairs per second
    over stock's, and the ideals of the positions and tokens per pair."""
    from .data import PROFILES

    entry = {}
    for kind, profiles in results.items():
        if kind not in ("dpo", "reward"):
            continue
        entry[kind] = {}
        for name, variants in profiles.items():
            stock, sharing = variants["stock"], variants["sharing"]
            ideal = stock["tokens_per_pair"] / sharing["tokens_per_pair"]
            speed = {v: r["pairs_per_s"] / stock["pairs_per_s"] for v, r in variants.items() if v != "stock"}
            entry[kind][name] = {
                "p_over_c": PROFILES[name][0] / PROFILES[name][1],
                "ideal": _round(ideal),
                "padded_ideal": _round(stock["positions_per_pair"] / sharing["positions_per_pair"]),
                "share_of_ideal": _round(speed["sharing"] / ideal),
                **{v: _round(x) for v, x in speed.items()},
            }
    return entry


def _sft(results: dict) -> dict:
    """SFT (`benchmarks.join`): per profile, the default (`"auto"`) run's step time and each fixed join's over stock's,
    and the positions each computed."""
    entry = {}
    for key, variants in results.items():
        trainer, _, name = key.partition("/")
        if trainer != "sft":
            continue
        stock, auto = variants["stock"], variants["auto"]
        entry[name] = {
            "padded_ideal": _round(stock["positions"] / auto["positions"]),
            "sharing": _round(auto["measured_speedup"]),
            **{v: _round(r["measured_speedup"]) for v, r in variants.items() if v not in ("stock", "auto")},
        }
    return {"sft": entry} if entry else {}


def _generating(kind: str, results: list) -> dict:
    """GRPO, online DPO (`benchmarks.online`): per profile and group size, the scoring step's speedup, with
    generation's time too, and the positions' ideals."""
    entry = {}
    for r in results:
        entry[f"{r['profile']}, G={r['G']}"] = {
            "p_over_c": _round(r["p_over_c"]),
            "generations": r["G"],
            "ideal": _round(r["sharing_ideal"]),
            "padded_ideal": _round(r["total_ideal"]),
            "sharing": _round(r["speedup"]),
            "with_generation": _round(r["speedup_with_generation"]),
        }
    return {kind: entry}


def _paired(results: list) -> dict:
    """KTO, ORPO, CPO (`benchmarks.paired`): per profile, the training step's speedup under the defaults (KTO: the
    policy's KL rows merged where the default rule merges most of the run's batches; ORPO/CPO: stock's padding not
    computed) and the other variant's, and the positions' ideals."""
    entry = {}
    for r in results:
        variants = r["variants"]
        if r["trainer"] == "kto":
            merges = 2 * r["auto_merges"] > len(r["batch_prompt_over_kl_completion"])
            default, other = ("merged", "apart") if merges else ("apart", "merged")
            names = {default: "sharing", other: f"KL {other}"}
        else:
            default, names = "unscored padding", {"unscored padding": "sharing", "shared": "scored padding"}
        entry.setdefault(r["trainer"], {})[r["profile"]] = {
            "p_over_c": _round(r["p_over_c"]),
            "ideal": _round(variants[default]["sharing_ideal"]),
            "padded_ideal": _round(variants[default]["ideal"]),
            **({"default": default} if r["trainer"] == "kto" else {}),
            **{label: _round(variants[v]["speedup"]) for v, label in names.items()},
        }
    return entry


def measured_speedups(folder: str | None = None) -> dict:
    """The package's record, derived from the benchmark records in `folder` (default `docs/benchmarks`): one entry
    per record of `SOURCES` that exists there."""
    folder = folder or os.path.join(ROOT, "docs", "benchmarks")
    recorded = {}
    for name in SOURCES:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            record = json.load(f)
        stem, results = name.removesuffix(".json"), record["results"]
        if stem in ("cpu", "gpu") and "dpo" not in results and "reward" not in results:
            (results,) = results.values()  # `scripts/gpu_check.py`: results per model, one model
        derive = {
            "join_sft_cpu": _sft,
            "grpo_cpu": lambda r: _generating("grpo", r),
            "online_dpo_cpu": lambda r: _generating("online_dpo", r),
            "paired_cpu": _paired,
        }.get(stem, _preference)
        recorded[stem] = {**_device(record), "source": f"docs/benchmarks/{name}", **derive(results)}
    return recorded


def write(folder: str | None = None, path: str = PACKAGE_FILE) -> dict:
    """Write `measured_speedups(folder)` to the package's file; returns it."""
    recorded = measured_speedups(folder)
    with open(path, "w") as f:
        json.dump(recorded, f, indent=1, sort_keys=True)
        f.write("\n")
    return recorded


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        raise SystemExit(f"usage: python -m benchmarks.record (takes no arguments; got {' '.join(argv)})")
    recorded = write()
    print(f"wrote {os.path.relpath(PACKAGE_FILE, ROOT)}: " + ", ".join(recorded))


if __name__ == "__main__":
    main()
