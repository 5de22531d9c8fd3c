"""Redraw the benchmark plots from their recorded JSON, without running the benchmarks again.

    python -m benchmarks.plot      # docs/benchmarks/cpu_speedup.png and docs/benchmarks/grpo_cpu_speedup.png

Each JSON file given is drawn next to itself as `<name>_speedup.png`:

- `cpu.json` / `gpu.json` (`benchmarks/dpo.py`): DPO and reward throughput over stock TRL against the profile's
  median prompt / completion ratio, with the linear-layer ideal `2(p+c)/(p+2c)`;
- `grpo_cpu.json` (`benchmarks/online.py`): the training step's speedup over stock TRL per profile and group
  size G, beside its ideal (stock padded / shared padded positions).

Needs matplotlib (`pip install -e .[bench]`). `benchmarks/dpo.py` draws its plot with the same function.
"""

from __future__ import annotations

import argparse
import json
import os


VARIANT_COLOURS = {"sharing": "#1f77b4", "sharing+packing": "#ff7f0e", "packing": "#2ca02c"}
KIND_MARKERS = {"dpo": "o", "reward": "D"}
KIND_NAMES = {"dpo": "DPO", "reward": "reward model"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(data: dict, path: str, profiles: dict[str, tuple[int, int]]) -> None:
    """Throughput of each variant over stock TRL (``data``: the JSON `benchmarks/dpo.py` writes), against the
    median prompt / completion ratio of each profile (``profiles``: name -> (prompt, completion) medians)."""
    from matplotlib.lines import Line2D

    plt = _pyplot()
    results = data["results"]
    kinds = list(results)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ratios = [10 ** (x / 50) for x in range(-25, 66)]
    ax.plot(ratios, [2 * (r + 1) / (r + 2) for r in ratios], color="black", ls="--", lw=1)
    # DPO and reward points of a profile sit side by side (a small offset along x), not on top of each other
    dodge = {kind: 1.045 ** (i - (len(kinds) - 1) / 2) for i, kind in enumerate(kinds)}
    ideals = {}
    for kind in kinds:
        for profile, by_variant in results[kind].items():
            p, c = profiles[profile]
            stock = by_variant["stock"]
            ideals.setdefault(profile, stock["tokens_per_pair"] / by_variant["sharing"]["tokens_per_pair"])
            for variant, colour in VARIANT_COLOURS.items():
                speedup = by_variant[variant]["pairs_per_s"] / stock["pairs_per_s"]
                ax.scatter(p / c * dodge[kind], speedup, marker=KIND_MARKERS.get(kind, "s"), s=36, color=colour,
                           edgecolor="white", linewidth=0.6, zorder=3)  # fmt: skip
    xs = [profiles[profile][0] / profiles[profile][1] for profile in ideals]
    ax.scatter(xs, list(ideals.values()), marker="_", s=260, color="black", linewidth=1.5, zorder=2)
    for x in xs:
        ax.axvline(x, color="#e0e0e0", lw=0.8, zorder=0)
    ax.axhline(1.0, color="grey", lw=0.6, zorder=0)

    ax.set_xscale("log")
    ax.set_xlim(0.25, 25)
    ax.set_xticks([0.3, 0.5, 1, 2, 5, 10, 20], ["0.3", "0.5", "1", "2", "5", "10", "20"])
    ax.set_xticks([], minor=True)
    ax.set_ylim(0.9, max(ax.get_ylim()[1], 2.1))
    top = ax.secondary_xaxis("top")
    top.set_xticks(xs, list(ideals), rotation=35, ha="left", fontsize=8)
    top.tick_params(length=0, pad=2)
    ax.set_xlabel("median prompt / completion length of the profile")
    ax.set_ylabel("speedup over stock TRL (pairs/s)")
    names = " and ".join(KIND_NAMES.get(kind, kind) for kind in kinds)
    ax.set_title(f"{names} training on {data['device']}\n{data.get('model', '')}", fontsize=10)

    handles = [Line2D([], [], color="black", ls="--", lw=1, label="ideal 2(p+c)/(p+2c)")]
    handles.append(Line2D([], [], color="black", marker="_", ms=14, mew=1.5, ls="", label="ideal on the data"))
    handles += [Line2D([], [], color=c, marker="s", ls="", ms=7, label=v) for v, c in VARIANT_COLOURS.items()]
    handles += [
        Line2D(
            [], [], color="#555555", marker=KIND_MARKERS.get(kind, "s"), ls="", ms=6, label=KIND_NAMES.get(kind, kind)
        )
        for kind in kinds
    ]
    ax.legend(handles=handles, loc="upper left", fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_online(data: dict, path: str, trainer: str) -> None:
    """The training step's speedup over stock TRL per profile and group size G, beside its ideal (``data``: the JSON
    `benchmarks/online.py` writes)."""
    import matplotlib.transforms as transforms
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt = _pyplot()
    rows = data["results"]
    profiles = list(dict.fromkeys(row["profile"] for row in rows))
    sizes = sorted({row["G"] for row in rows})
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    width = 0.8 / len(sizes)
    shades = ["#9ecae1", "#3182bd", "#08519c"]
    ticks, labels = [], []
    for i, profile in enumerate(profiles):
        for j, g in enumerate(sizes):
            row = next((r for r in rows if r["profile"] == profile and r["G"] == g), None)
            if row is None:
                continue
            x = i + (j - (len(sizes) - 1) / 2) * width
            ax.bar(x, row["speedup"], width * 0.9, color=shades[j % len(shades)], zorder=2)
            ax.plot([x - width * 0.45, x + width * 0.45], [row["total_ideal"]] * 2, color="black", lw=1.8, zorder=3)
            ticks.append(x)
            labels.append(f"G={g}\np/c {row['p_over_c']:.1f}")
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.tick_params(axis="x", length=0)
    below = transforms.blended_transform_factory(ax.transData, ax.transAxes)
    for i, profile in enumerate(profiles):
        ax.text(i, -0.15, profile, transform=below, ha="center", va="top", fontsize=9)
    ax.axhline(1.0, color="grey", lw=0.6, zorder=1)
    ax.set_ylabel("training step speedup over stock TRL")
    ax.set_xlim(-0.6, len(profiles) - 0.4)
    ax.set_title(f"{trainer} training step on {data['device']}\n{data.get('model', '')}", fontsize=10)
    handles = [Patch(color=shades[j % len(shades)], label=f"measured, G = {g}") for j, g in enumerate(sizes)]
    handles.append(Line2D([], [], color="black", lw=1.8, label="ideal: stock / shared padded positions"))
    ax.legend(handles=handles, loc="upper left", fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_file(json_path: str) -> str:
    """Draw ``<name>.json`` as ``<name>_speedup.png`` next to it; returns the image's path."""
    with open(json_path) as f:
        data = json.load(f)
    stem = os.path.splitext(json_path)[0]
    path = f"{stem}_speedup.png"
    if isinstance(data["results"], list):  # benchmarks/online.py: <trainer>_<mode>.json, a row per profile and G
        trainer = os.path.basename(stem).rsplit("_", 1)[0].replace("_", " ")
        plot_online(data, path, "GRPO" if trainer == "grpo" else trainer.replace("dpo", "DPO"))
    else:  # benchmarks/dpo.py: <mode>.json
        from .data import PROFILES

        plot_speedup(data, path, PROFILES)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", default=["docs/benchmarks/cpu.json", "docs/benchmarks/grpo_cpu.json"])
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("matplotlib is not installed (pip install -e .[bench]).") from None
    for json_path in args.files:
        print(f"wrote {plot_file(json_path)}")


if __name__ == "__main__":
    main()
