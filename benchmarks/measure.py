"""What a benchmark measures around a trainer: epoch wall time (`Timer`), the positions the model runs and the
collator's host time (`CountingCollator`), activation memory (`ActivationMeter`, or `SavedTensors` around any
step), peak memory (`PeakMemory`), and interleaved rounds (`rotations`, `interleave`) so that drift and noise hit
every variant alike."""

from __future__ import annotations

import gc
import time


class Timer:
    """Trainer callback: wall time of each epoch (synchronised on CUDA)."""

    def __init__(self, cuda):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_epoch_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer.start = time.perf_counter()

            def on_epoch_end(self, args, state, control, **kwargs):
                timer._sync()
                timer.epochs.append(time.perf_counter() - timer.start)

        self.cuda = cuda
        self.epochs = []
        self.callback = _Callback()

    def _sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()


class CountingCollator:
    """Counts the positions the model runs (padding included) and the real tokens of each batch, the host seconds the
    collator takes (`seconds`), and the batches laid out per kernel (`kernels`: `Layout.kernel` -> batches; stock's
    rows are not laid out); also the rows, the widest row (`widest`) and the dense attention entries (`attention`:
    rows x width^2, what SDPA with a dense mask scores per head and layer)."""

    def __init__(self, collator):
        self.collator = collator
        self.positions = self.tokens = self.batches = self.rows = self.widest = self.attention = 0
        self.seconds = 0.0
        self.kernels = {}

    def __getattr__(self, name):
        return getattr(self.collator, name)

    def __call__(self, examples):
        start = time.perf_counter()
        batch = self.collator(examples)
        self.seconds += time.perf_counter() - start
        layout = batch.get("prefix_sharing")
        self.batches += 1
        ids = batch["input_ids"] if layout is None else layout.input_ids
        rows, width = ids.shape[0], ids.shape[-1]
        self.positions += ids.numel()
        self.rows += rows
        self.widest = max(self.widest, width)
        self.attention += rows * width**2
        if layout is None:
            self.tokens += int(batch["attention_mask"].sum())
        else:
            self.tokens += int((layout.document_ids >= 0).sum())
            self.kernels[layout.kernel] = self.kernels.get(layout.kernel, 0) + 1
        return batch


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward during one loss computation (the activation memory of a
    step, device-independent and deterministic), max over steps. Wraps `trainer.compute_loss` on the instance. The
    step in which `"auto"` times its candidates (`trl_prefix_sharing.tuning`) is left out: those passes are not the
    step's, and their saved tensors are freed before it runs."""

    def __init__(self, trainer):
        self.peak = 0
        original = trainer.compute_loss
        tuning = getattr(getattr(trainer, "sharing_session", None), "tuning", None)

        def compute_loss(*args, **kwargs):
            if tuning is not None and tuning.pending:
                return original(*args, **kwargs)
            with SavedTensors() as saved:
                result = original(*args, **kwargs)
            self.peak = max(self.peak, saved.bytes)
            return result

        trainer.compute_loss = compute_loss


class SavedTensors:
    """`with SavedTensors() as saved:` counts the bytes of the tensors autograd saves for backward within the block
    (`saved.bytes`, each storage once)."""

    def __enter__(self):
        import torch

        self.storages = {}

        def pack(tensor):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.storages.values())


class PeakMemory:
    """`with PeakMemory(device) as memory:` the peak memory above the level at entry (`memory.peak`, bytes): CUDA's
    allocated bytes, or the CPU's resident set size sampled every millisecond."""

    def __init__(self, device):
        self.cuda, self.peak = device.type == "cuda", 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _sample(self):
        while not self._stop.is_set():
            self._top = max(self._top, self._rss())
            time.sleep(0.001)

    def __enter__(self):
        import threading

        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base, self._top, self._stop = self._rss(), 0, threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._top, self._rss()) - self.base


def clone_batch(batch):
    """A batch with fresh copies of its tensors (a trainer keeps a layout while the tensors it was built from live, so
    repeats over the same tensors would skip building it)."""
    import torch

    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def train_one_epoch(trainer, cuda):
    """One epoch (`trainer.train()` again); the optimizer is dropped afterwards so that the variants' optimizer
    states do not pile up in memory."""
    import torch

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    trainer.train()
    if cuda:
        trainer.peak_memory = max(trainer.peak_memory, torch.cuda.max_memory_allocated() - base)
    trainer.optimizer = trainer.lr_scheduler = None
    gc.collect()


def median_seconds(fn, repeats=7, cuda=False):
    """The median wall time of `repeats` calls of `fn`, after a warm-up call (synchronised on CUDA)."""
    import statistics

    import torch

    fn()
    seconds = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def rotations(variants, rounds):
    """The order of each timed round: every variant once, starting one later each round."""
    variants = list(variants)
    for round_ in range(rounds):
        start = round_ % len(variants)
        yield variants[start:] + variants[:start]


def interleave(step, variants, rounds):
    """`{variant: [step(variant) of each round]}`, the variants in `rotations(variants, rounds)`' order."""
    results = {variant: [] for variant in variants}
    for order in rotations(variants, rounds):
        for variant in order:
            results[variant].append(step(variant))
    return results


def free_memory(cuda):
    """Collect garbage; on CUDA, also hand the allocator's cached blocks back."""
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


class Deadline:
    """A time limit `seconds` from now (none for 0 or None): `left()`, the seconds left (infinite without a limit)."""

    def __init__(self, seconds):
        self.limited = bool(seconds)
        self.end = time.monotonic() + (seconds or 0)

    def left(self) -> float:
        return self.end - time.monotonic() if self.limited else float("inf")
