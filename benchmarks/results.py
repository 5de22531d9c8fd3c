"""The one result schema of the benchmarks, and how a result is written.

Every benchmark writes `<stem>.json` and `<stem>.md` side by side in its `--out` folder. The JSON holds
`{"command", "device", "model", "results", ...}`: the command that made it (rerun it to regenerate both files), the
device, the model in words, and the measurements (each benchmark's own shape below `results`). The Markdown is the
table a reader reads, made from the same measurements, with its command named in it.
"""

from __future__ import annotations

import json
import os
import shlex
import string
import sys


__all__ = ["CELLS", "command_line", "document", "markdown_table", "times", "versions", "write_result"]


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that reruns this benchmark: `python -m benchmarks.<module> <its arguments>`."""
    return shlex.join(["python", "-m", f"benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def markdown_table(header: list[str] | str, rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines: the header (its cells, or one string of them separated by `|`), its rule, a line per
    row."""
    header = header.split("|") if isinstance(header, str) else header
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]


def document(*blocks) -> list[str]:
    """The lines of a Markdown document: each block (a paragraph, or a list of lines such as a table; `None` is left
    out), a blank line between two blocks."""
    lines = []
    for block in blocks:
        if block is not None:
            lines += ([""] if lines else []) + ([block] if isinstance(block, str) else list(block))
    return lines


def versions() -> dict[str, str]:
    """The versions of torch, transformers and TRL a result was measured with (keys `torch`, `transformers`, `trl`)."""
    import torch
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}


def times(slow: float, fast: float, digits: int = 2) -> str:
    """`slow / fast` as a table cell, `"1.84x"`; `"-"` where `fast` is 0."""
    return f"{slow / fast:.{digits}f}x" if fast else "-"


def write_result(out: str, stem: str, data: dict, lines: list[str], echo: bool = True) -> str:
    """Write `data` (the schema above) to `<out>/<stem>.json` and `lines` to `<out>/<stem>.md`; print the Markdown
    when `echo`. Returns the Markdown's path."""
    missing = {"command", "device", "results"} - set(data)
    if missing:
        raise ValueError(f"a benchmark result needs {sorted(missing)}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    path = os.path.join(out, f"{stem}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))
    return path


class Cells(string.Formatter):
    """`str.format` for table cells: a missing value (None) is `-`, whatever its format (`{x:.2f}` of None: `-`)."""

    def format_field(self, value, spec):
        return "-" if value is None else format(value, spec)


#: `CELLS.format(template, **fields)`: a cell, or a line, with `-` for what is missing
CELLS = Cells()
