"""Keep third-party start-up lines out of commands that do not use those libraries.

Importing TRL imports `transformers.trainer_utils`, which imports PEFT, which imports bitsandbytes, which logs "Failed
to load CPU gemm_4bit_forward from kernels-community" on CPUs with AVX512-BF16 when the optional `kernels` package is
missing; where DeepSpeed is installed, accelerate's checks import it and it logs "Setting accelerator to CPU" on a
machine without a GPU. Neither matters to a command that quantizes nothing and runs no DeepSpeed (`stats`, and the demo
in `scripts/demo.py`).
"""

from __future__ import annotations

import contextlib
import logging


__all__ = ["lines_dropped", "quiet_unused_backends"]

#: library -> (its logger, the start of the line it logs at start-up)
STARTUP_LINES = {
    "bitsandbytes": ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    "deepspeed": ("DeepSpeed", "Setting accelerator to CPU"),
}


class _DropLine(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_unused_backends(*libraries: str) -> None:
    """Drop the start-up line of each of `libraries` (default: all of `STARTUP_LINES`). Call it before importing TRL:
    a filter on the library's logger, which `logging.getLogger` creates now and the library reuses; nothing else
    that logger says is dropped. Idempotent."""
    for library in libraries or STARTUP_LINES:
        name, prefix = STARTUP_LINES[library]
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLine) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropLine(prefix))


@contextlib.contextmanager
def lines_dropped(lines: dict[str, str]):
    """Drop the lines of `lines` ({logger name: the start of the line}) while the block runs: for a line whose
    content an error raised in the block reports (see `train._load_local`)."""
    filters = {name: _DropLine(prefix) for name, prefix in lines.items()}
    for name, line_filter in filters.items():
        logging.getLogger(name).addFilter(line_filter)
    try:
        yield
    finally:
        for name, line_filter in filters.items():
            logging.getLogger(name).removeFilter(line_filter)
