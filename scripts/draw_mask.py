"""Draw the prefix-sharing mask of one example as a PNG (no plotting dependency: the PNG is written with zlib).

    python scripts/draw_mask.py docs/images/dpo_mask.png

Rows are queries, columns keys; a filled cell means "may attend". Colours: prompt (grey), chosen (green),
rejected (red); the mask is evaluated by `trl_prefix_sharing.mask.dense_mask(prefix_sharing_mask(...))`, the same
function the trainer uses for SDPA.
"""

import struct
import sys
import zlib

import torch

from trl_prefix_sharing.layout import build_shared_batch, prompt_lengths_from_completion_mask
from trl_prefix_sharing.mask import dense_mask, prefix_sharing_mask


COLOURS = {0: (120, 120, 120), 1: (46, 160, 67), 2: (207, 34, 46)}
CELL, GAP = 24, 2


def write_png(path, pixels):
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in pixels)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


def main(path):
    # prompt of 5 tokens, chosen of 3, rejected of 4 (stock rows: prompt+chosen, prompt+rejected)
    prompt, chosen, rejected = [10, 11, 12, 13, 14], [20, 21, 22], [30, 31, 32, 33]
    rows = [prompt + chosen, prompt + rejected]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    cm = torch.tensor([[0] * len(prompt) + [1] * (len(r) - len(prompt)) + [0] * (width - len(r)) for r in rows])
    layout = build_shared_batch(ids, attn, prompt_lengths=prompt_lengths_from_completion_mask(attn, cm))
    n = layout["input_ids"].shape[1]
    readers = [set() for _ in range(n)]  # which stock rows read each shared position
    for row in range(2):
        for position in layout["stock_index"][row][attn[row].bool()].tolist():
            readers[position].add(row)
    branch = [0 if len(r) == 2 else 1 + min(r) for r in readers]  # 0: shared by both rows, 1: chosen, 2: rejected
    mask = dense_mask(prefix_sharing_mask(layout["subtree_end"]), 1, n, n)[0, 0]
    size = n * CELL
    pixels = [[(255, 255, 255)] * size for _ in range(size)]
    for q in range(n):
        for kv in range(n):
            if mask[q, kv]:
                colour = COLOURS[branch[kv]]
                for y in range(q * CELL + GAP, (q + 1) * CELL - GAP):
                    for x in range(kv * CELL + GAP, (kv + 1) * CELL - GAP):
                        pixels[y][x] = colour
            else:
                for y in range(q * CELL + GAP, (q + 1) * CELL - GAP):
                    for x in range(kv * CELL + GAP, (kv + 1) * CELL - GAP):
                        pixels[y][x] = (235, 235, 235)
    write_png(path, pixels)
    print(f"wrote {path}: tokens {layout['input_ids'][0].tolist()}, positions {layout['position_ids'][0].tolist()}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/images/dpo_mask.png")
