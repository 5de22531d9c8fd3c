"""Gathers that tolerate ranks holding different numbers of pairs (packing).

TRL's DPO metrics gather per-pair tensors with `accelerator.gather`, which needs the same shape on every rank; with
packing, ranks hold different numbers of pairs, and a plain gather fails with a collective size mismatch (or hangs).
`variable_size_gathers(accelerator)` swaps in gathers that first exchange the sizes, pad to the largest, gather and
drop the padding, for the duration of one loss computation.
"""

from __future__ import annotations

import contextlib

import torch


__all__ = ["variable_size_gathers", "gather_variable"]


def gather_variable(gather, data):
    """Gather ``data`` (tensor, or nested tuple/list/dict of tensors) whose first dimension differs across ranks."""
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
