"""Gathers that tolerate ranks holding different numbers of pairs (packing); a warning when `accelerate launch` was
asked for several processes and started one; the release of the distributed model wrapper before the process group
ends.

TRL's DPO metrics gather per-pair tensors with `accelerator.gather`, which needs the same shape on every rank; with
packing, ranks hold different numbers of pairs, and a plain gather fails with a collective size mismatch (or hangs).
`variable_size_gathers(accelerator)` swaps in gathers that first exchange the sizes, pad to the largest, gather and
drop the padding, for the duration of one loss computation.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings

import torch


__all__ = [
    "variable_size_gathers",
    "gather_variable",
    "warn_if_fewer_processes_than_asked",
    "processes_asked",
    "release_distributed_wrappers",
]


def gather_variable(gather, data):
    """Gather `data` (tensor, or nested tuple/list/dict of tensors) whose first dimension differs across ranks."""
    if isinstance(data, (tuple, list)):
        return type(data)(gather_variable(gather, d) for d in data)
    if isinstance(data, dict):
        return {k: gather_variable(gather, v) for k, v in data.items()}
    if not isinstance(data, torch.Tensor) or data.dim() == 0:
        return gather(data)
    sizes = gather(torch.tensor([data.shape[0]], device=data.device))
    largest = int(sizes.max())
    padded = data.new_zeros((largest, *data.shape[1:]))
    padded[: data.shape[0]] = data
    gathered = gather(padded)
    return torch.cat([gathered[r * largest : r * largest + int(n)] for r, n in enumerate(sizes.tolist())])


@contextlib.contextmanager
def variable_size_gathers(accelerator):
    """Within the block, `accelerator.gather` and `accelerator.gather_for_metrics` accept per-rank sizes."""
    if accelerator.num_processes == 1:
        yield
        return
    original = accelerator.gather
    accelerator.gather = lambda data: gather_variable(original, data)
    accelerator.gather_for_metrics = lambda data, use_gather_object=False: gather_variable(original, data)
    try:
        yield
    finally:
        del accelerator.gather, accelerator.gather_for_metrics  # back to the class methods


def processes_asked(command_line: list[str]) -> int | None:
    """The `--num_processes` (or `--num-processes`) of a launcher's command line, if any."""
    for i, arg in enumerate(command_line):
        match = re.fullmatch(r"--num[_-]processes(?:=(\d+))?", arg)
        if match:
            value = match.group(1) or (command_line[i + 1] if i + 1 < len(command_line) else "")
            return int(value) if value.isdigit() else None
    return None


def warn_if_fewer_processes_than_asked() -> None:
    """`accelerate launch --num_processes 2 --cpu script.py` (or without `--multi_gpu` on a machine without GPUs)
    starts ONE process: accelerate's simple launcher ignores `--num_processes`. It leaves `ACCELERATE_USE_CPU` in the
    environment and no `WORLD_SIZE`; the launcher's own command line (the parent process, read from /proc on Linux)
    says how many were asked for. Elsewhere nothing can be read, and nothing is said."""
    if "ACCELERATE_USE_CPU" not in os.environ or "WORLD_SIZE" in os.environ:
        return
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            command_line = [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]
    except OSError:
        return
    asked = processes_asked(command_line)
    if asked is not None and asked > 1:
        from .config import stacklevel_outside_package

        warnings.warn(
            f"The launcher was asked for --num_processes {asked} but started one process: accelerate runs several "
            "only with a distributed launcher. On CPUs: `accelerate launch --multi_gpu --num_processes "
            f"{asked} script.py` (without `--cpu`) with `use_cpu=True` in the config; the command line takes "
            f"`--multi_gpu --num_processes {asked} --use_cpu true`.",
            UserWarning,
            stacklevel=stacklevel_outside_package(),
        )


def release_distributed_wrappers(trainer) -> None:
    """Free the trainer's distributed model wrapper (DDP's gradient reducer holds the process group) while every rank
    still holds the group, before `trainer.end()` destroys it.

    Otherwise the wrapper is freed only when the script returns, after the group is gone; on CPUs (gloo) that teardown
    sometimes blocked forever (about 1 run in 6 of two-process `trl dpo`, stock TRL alike), after training and saving
    were done."""
    import gc

    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.free_memory()  # drops accelerate's references to the prepared (wrapped) models
    trainer.model_wrapped = trainer.model
    gc.collect()
