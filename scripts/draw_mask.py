"""Draw the prefix-sharing mask as a PNG, from real layouts and the package's own mask functions.

    python scripts/draw_mask.py docs/images/dpo_mask.png      # needs matplotlib (pip install -e .[bench])

Left: one DPO pair token by token (the example of docs/how_it_works.md: a prompt of 5 tokens, chosen 3, rejected 4).
Right: two documents packed in one row of 1,024 tokens (a DPO pair with long completions and a GRPO group of G = 3)
with FlexAttention's 128 x 128 blocks; the hatched blocks are fully masked, so FlexAttention skips them. Rows are
queries, columns keys; a coloured cell means "may attend" and takes the colour of the key's region.

Everything drawn is computed: the rows are laid out by `trl_prefix_sharing.layout.build_layout`, the cells are
`trl_prefix_sharing.mask.dense_mask(prefix_sharing_mask(...))` (what SDPA receives) and the blocks come from
`trl_prefix_sharing.mask.block_mask` (the FlexAttention `BlockMask` the trainer builds on CUDA; here uncompiled, on
CPU).
"""

from __future__ import annotations

import argparse
import random

import torch

from trl_prefix_sharing.layout import RowPolicy, build_layout
from trl_prefix_sharing.mask import block_mask, dense_mask, prefix_sharing_mask
from trl_prefix_sharing.trie import StockRows


PROMPT = "prompt"
COLOURS = {
    PROMPT: "#7f7f7f",
    "chosen": "#2ca02c",
    "rejected": "#d62728",
    "completion 1": "#1f77b4",
    "completion 2": "#9467bd",
    "completion 3": "#ff7f0e",
}
MASKED = "#ececec"
PADDING = "#c8c8c8"
ROW_LENGTH = 1024


def lay_out(documents, row_length=None):
    """Lay out ``documents`` (each a prompt and its named completions, as token lists) in one shared row.

    Returns the layout, the dense mask ``[S, S]``, each position's region (``(document, region)``, None for padding)
    and each position's token name (``p3``, ``c0``, ``r2``, ...)."""
    rows, prompt_lengths, owner = [], [], []
    for number, (prompt, completions) in enumerate(documents):
        for name, completion in completions.items():
            rows.append(prompt + completion)
            prompt_lengths.append(len(prompt))
            owner.append((number, name))
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    layout = build_layout(
        StockRows(ids, attention_mask, prompt_lengths=torch.tensor(prompt_lengths)),
        rows=RowPolicy(pack=True, one_row=True, length=row_length),
    )
    size = layout.input_ids.shape[1]
    readers = [set() for _ in range(size)]  # the stock rows that read each shared position, and at which column
    for row, columns in enumerate(layout.stock_index.tolist()):
        for column, position in enumerate(columns):
            if position >= 0:
                readers[position].add((row, column))
    regions, names = [], []
    for position in range(size):
        if not readers[position]:
            regions.append(None)
            names.append("")
            continue
        row, column = min(readers[position])
        number, branch = owner[row]
        shared = len({r for r, _ in readers[position]}) > 1
        regions.append((number, PROMPT if shared else branch))
        names.append(f"p{column}" if column < prompt_lengths[row] else f"{branch[0]}{column - prompt_lengths[row]}")
    mask = dense_mask(prefix_sharing_mask(layout.subtree_end), 1, size, size)[0, 0]
    return layout, mask, regions, names


def mask_image(mask, regions):
    """RGB image of the mask: a visible cell in its key's colour, a masked one light grey."""
    from matplotlib.colors import to_rgb

    key_colour = torch.tensor([to_rgb(COLOURS[r[1]] if r else PADDING) for r in regions])
    image = torch.tensor(to_rgb(MASKED)).expand(*mask.shape, 3).clone()
    image[mask] = key_colour.expand(mask.shape[0], -1, -1)[mask]
    return image.numpy()


def spans(values):
    """``(value, start, end)`` for each run of equal values."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((values[start], start, i))
            start = i
    return out


def bracket(ax, start, end, text, colour, side, offset, fontsize=9, align="center"):
    """Label the span ``[start, end)`` of positions with a line and text outside the top or left edge of ``ax``
    (``align``: the text at the span's centre, or from its start)."""
    import matplotlib.transforms as transforms

    lo, hi = start - 0.5, end - 0.5
    pad = (hi - lo) * 0.03
    if side == "top":
        t = transforms.blended_transform_factory(ax.transData, ax.transAxes)
        ax.plot([lo + pad, hi - pad], [1 + offset] * 2, color=colour, lw=2.5, transform=t, clip_on=False)
        x, ha = ((lo + hi) / 2, "center") if align == "center" else (lo + pad, "left")
        ax.text(x, 1 + offset + 0.015, text, color=colour, transform=t, ha=ha, va="bottom", fontsize=fontsize)
    else:
        t = transforms.blended_transform_factory(ax.transAxes, ax.transData)
        ax.plot([-offset] * 2, [lo + pad, hi - pad], color=colour, lw=2.5, transform=t, clip_on=False)
        ax.text(
            -offset - 0.015,
            (lo + hi) / 2,
            text,
            color=colour,
            transform=t,
            ha="right",
            va="center",
            rotation=90,
            fontsize=fontsize,
        )


def draw_pair(ax):
    """One pair, token by token: the example of docs/how_it_works.md."""
    prompt, chosen, rejected = [10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33]
    layout, mask, regions, names = lay_out([(prompt, {"chosen": chosen, "rejected": rejected})])
    n = len(names)
    ax.imshow(mask_image(mask, regions), interpolation="nearest")
    ax.set_xticks(range(n), names, fontsize=8)
    ax.set_yticks(range(n), names, fontsize=8)
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        for label, region in zip(labels, regions, strict=True):
            label.set_color(COLOURS[region[1]])
    ax.tick_params(length=0, pad=2)
    ax.set_xticks([i + 0.5 for i in range(n - 1)], minor=True)
    ax.set_yticks([i + 0.5 for i in range(n - 1)], minor=True)
    ax.tick_params(which="minor", length=0)
    ax.grid(which="minor", color="white", lw=1.5)
    for spine in ax.spines.values():
        spine.set_visible(False)
    for (_, region), start, end in spans(regions):
        bracket(ax, start, end, region, COLOURS[region], "top", 0.02)
        bracket(ax, start, end, region, COLOURS[region], "left", 0.1)
    ax.yaxis.set_label_coords(-0.2, 0.5)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title("one pair, token by token", fontsize=10, pad=24)
    return layout


def draw_packed(ax):
    """Two documents in one row of ROW_LENGTH tokens, with FlexAttention's 128 x 128 blocks."""
    from matplotlib.patches import Rectangle

    rng = random.Random(0)

    def tokens(first, count):  # a distinct first token per sequence, so that the layout shares only the prompts
        return [first] + [rng.randrange(1000, 2000) for _ in range(count - 1)]

    pair = (tokens(1, 200), {"chosen": tokens(3, 260), "rejected": tokens(4, 250)})
    group = (tokens(2, 100), {f"completion {g + 1}": tokens(5 + g, length) for g, length in enumerate((60, 70, 50))})
    layout, mask, regions, _ = lay_out([pair, group], row_length=ROW_LENGTH)
    ax.imshow(mask_image(mask, regions), interpolation="antialiased")

    blocks = block_mask(prefix_sharing_mask(layout.subtree_end), 1, ROW_LENGTH, ROW_LENGTH, "cpu", compile=False)
    size = blocks.BLOCK_SIZE[0]
    count = ROW_LENGTH // size
    computed = set()
    for num, indices in (
        (blocks.kv_num_blocks, blocks.kv_indices),
        (blocks.full_kv_num_blocks, blocks.full_kv_indices),
    ):
        for q in range(count):
            computed.update((q, int(kv)) for kv in indices[0, 0, q, : int(num[0, 0, q])])
    for q in range(count):
        for kv in range(count):
            if (q, kv) not in computed:
                corner = (kv * size - 0.5, q * size - 0.5)
                ax.add_patch(Rectangle(corner, size, size, fill=False, hatch="////", edgecolor="#a0a0a0", lw=0))
    edges = [i * size - 0.5 for i in range(count + 1)]
    for edge in edges:
        ax.axhline(edge, color="#404040", lw=0.8)
        ax.axvline(edge, color="#404040", lw=0.8)
    ax.set_xticks(edges, [str(i * size) for i in range(count + 1)], fontsize=8)
    ax.set_yticks(edges, [str(i * size) for i in range(count + 1)], fontsize=8)
    ax.set_xlim(-0.5, ROW_LENGTH - 0.5)
    ax.set_ylim(ROW_LENGTH - 0.5, -0.5)

    documents = [(None if r is None else r[0]) for r in regions]
    titles = {0: "document 1: DPO pair", 1: "document 2: GRPO group"}
    for number, start, end in spans(documents):
        if number is not None:
            bracket(ax, start, end, titles[number], "#404040", "top", 0.02, align="start" if number == 0 else "center")
            bracket(ax, start, end, f"document {number + 1}", "#404040", "left", 0.12)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.yaxis.set_label_coords(-0.2, 0.5)
    skipped = count * count - len(computed)
    ax.set_title(
        f"two documents packed in a row of {ROW_LENGTH:,} tokens;\n"
        f"{size}\u00d7{size} blocks: {skipped} of {count * count} skipped (hatched)",
        fontsize=10,
        pad=24,
    )
    return layout, skipped, count * count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", default="docs/images/dpo_mask.png")
    parser.add_argument("--dpi", type=int, default=150)
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise SystemExit("matplotlib is not installed (pip install -e .[bench]).") from None

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 5.2), gridspec_kw={"wspace": 0.38})
    pair = draw_pair(left)
    packed, skipped, total = draw_packed(right)
    handles = [Patch(color=colour, label=name) for name, colour in COLOURS.items()]
    handles += [
        Patch(facecolor=MASKED, edgecolor="#c0c0c0", label="masked"),
        Patch(facecolor="white", edgecolor="#a0a0a0", hatch="////", label="skipped block"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.subplots_adjust(left=0.1, right=0.96, top=0.85, bottom=0.2)
    fig.savefig(args.path, dpi=args.dpi)
    print(f"wrote {args.path}")
    print(f"pair: tokens {pair['input_ids'][0].tolist()}, positions {pair['position_ids'][0].tolist()}")
    print(f"packed row: document ids {spans(packed['document_ids'][0].tolist())}, {skipped} of {total} blocks skipped")


if __name__ == "__main__":
    main()
