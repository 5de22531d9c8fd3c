"""Measured costs: how `"auto"` chooses, per micro-batch, between stock's own rows and the shared layouts of every
kernel that can run, by the time each takes on this device.

Counting work is not the same as time: a shared layout computes fewer positions but pays for what stock does not
(a mask, a block mask, a gather, one more kernel per layer), and on a fast device that fixed part can outweigh what
short prompts save. So with `prefix_sharing_attn_implementation="auto"` and `prefix_sharing_join="auto"` the
candidates of a micro-batch are:

- **stock rows**: the trainer's batch exactly as TRL builds it, run by the model's own forward and attention (the same
  numbers, by definition);
- every join plan (`layout.JOINS`) laid out for every kernel that can run here (`attention.auto_backends`: varlen,
  FlexAttention and SDPA on CUDA; SDPA and varlen's reference elsewhere).

All are exact, so the choice changes speed only. Each candidate's step is predicted as

    seconds = fixed + per_mac x multiply-adds

with `multiply-adds` its count under the kernel (`cost.StepCost`: positions, and every or only the visible query-key
pairs) and `fixed` and `per_mac` measured on the device (`Fit`): in the start-up phase, each candidate runs a forward
and a backward of the policy (its gradients dropped: every `.grad` is left as it was) on the first half of the first
micro-batch's rows and on the whole micro-batch, after a warm-up call where code compiles (CUDA, a compiled model),
timed on the same clock (`Timer`: synchronised around the call on an accelerator, the wall clock on the CPU). To keep
the measurement cheap, a candidate whose half already took longer than another's whole micro-batch is not run on the
whole (it cannot win there; its line is drawn through its one point with the fastest candidate's slope), and the
candidates within 15% of the fastest on the whole are timed on it once more, each keeping its faster time. Each later
micro-batch takes the candidate of least predicted time. A fixed choice (a kernel or a join rule other than
`"auto"`) is never overridden: the candidates are then that kernel's layouts only, and stock rows are none of them.

The measurement is per process (each rank chooses for its own micro-batch; every choice is exact) and is repeated
when a run resumes from a checkpoint. Under DeepSpeed or FSDP the forward alone is timed: their hooks reduce every
gradient a backward computes, so a backward outside the training step would be reduced twice.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from .cost import StepCost
from .layout import RowPolicy, build_layout, stock_layout


__all__ = ["STOCK", "Candidate", "Fit", "Timer", "Tuning", "set_timer", "get_timer", "measure_session"]

logger = logging.get_logger(__name__)

#: the name of the candidate that runs stock's own rows (`Layout.kernel` of such a layout)
STOCK = "stock"
#: candidates whose whole micro-batch took at most this much longer than the fastest's are timed on it once more (one
#: call's time on a busy host varies by about as much as close kernels differ)
CLOSE = 0.15


@dataclass(frozen=True)
class Candidate:
    """One way to run a micro-batch.

    Args:
        name: `STOCK`, or the attention backend's name (`attention.BACKENDS`).
        rows: where the shared layout puts its documents (`layout.RowPolicy`), None for stock rows.
        cost: its multiply-adds (`cost.StepCost`; stock rows: dense, over stock's padded rows).
    """

    name: str
    rows: RowPolicy | None
    cost: StepCost

    @property
    def is_stock(self) -> bool:
        return self.rows is None


@dataclass(frozen=True)
class Fit:
    """A candidate's measured cost: `fixed` seconds per forward and backward, plus `per_mac` seconds per multiply-add
    (`cost.StepCost`)."""

    fixed: float
    per_mac: float

    def seconds(self, macs: float) -> float:
        return self.fixed + self.per_mac * macs

    @classmethod
    def through(cls, points: list[tuple[float, float]]) -> Fit:
        """The line through measured `(multiply-adds, seconds)` points: two of different sizes give both constants.
        Where noise bends it, it keeps the larger point (the size of a whole micro-batch, where the choice is made):
        a slope made negative leaves the larger time all fixed, a fixed part made negative (the smaller point slow for
        its size) leaves it all proportional to the work, as one point alone gives."""
        (small_macs, small), (macs, seconds) = sorted(points)[0], sorted(points)[-1]
        if macs > small_macs and seconds > small:
            per_mac = (seconds - small) / (macs - small_macs)
            if small - per_mac * small_macs >= 0:
                return cls(fixed=small - per_mac * small_macs, per_mac=per_mac)
        elif len(points) > 1:
            return cls(fixed=max(seconds, small), per_mac=0.0)
        return cls(fixed=0.0, per_mac=seconds / max(macs, 1.0))


class Timer:
    """The clock of the measurement: `measure(name, run, device)` runs `run()` (candidate `name`'s forward and
    backward on `device`) and returns its seconds. On an accelerator the device is synchronised before and after, so
    the time is the device's; on the CPU, the wall clock. Tests inject another (`set_timer`)."""

    def measure(self, name: str, run, device) -> float:
        synchronize = _synchronizer(device)
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        return time.perf_counter() - start


def _synchronizer(device):
    device = torch.device(device)
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    return getattr(module, "synchronize", None) or (lambda: None)


_TIMER: list[Timer] = [Timer()]


def set_timer(timer: Timer) -> Timer:
    """Replace the clock of every later measurement (tests); returns the one it replaced."""
    old, _TIMER[0] = _TIMER[0], timer
    return old


def get_timer() -> Timer:
    return _TIMER[0]


@dataclass
class Tuning:
    """The candidates of one session and their measured costs (see the module docstring).

    Args:
        candidates: stock rows (if allowed) and the shared layouts of every kernel that can run, the preferred kernel
            first (it wins ties and runs before anything is measured).
    """

    candidates: tuple[Candidate, ...]
    fits: dict[str, Fit] = field(default_factory=dict)
    #: what the start-up measurement found, for the start-up line (None until it ran)
    summary: str | None = None
    #: the candidates that ran out of memory in the measurement (never chosen)
    out_of_memory: set[str] = field(default_factory=set)

    @property
    def measures(self) -> bool:
        """Whether there is a choice to measure (several candidates)."""
        return len(self.candidates) > 1

    @property
    def pending(self) -> bool:
        return self.measures and not self.fits

    @property
    def shared(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if not c.is_stock)

    def estimate(self, candidate: Candidate, num_rows: int, width: int, visible_pairs: int) -> float:
        """The predicted seconds of `candidate` over `num_rows` rows of `width` (a shared layout's mask letting
        `visible_pairs` pairs through); before the measurement, the preferred kernel's multiply-adds, and infinity for
        the others."""
        macs = candidate.cost.estimate(num_rows, width, visible_pairs)
        if not self.fits:  # before the measurement: the preferred kernel runs, its plans compared by their work
            return macs if candidate is self.candidates[0] else float("inf")
        return self.fits[candidate.name].seconds(macs)

    @classmethod
    def of_session(cls, session, alternatives=(), stock_rows: bool = False) -> Tuning:
        """The candidates of `session` (a `PrefixSharingSession`): its backend first, then the `alternatives`
        (backends), then stock's own rows if `stock_rows`; each with the rows and cost model of its kernel."""
        model = session.models[0]
        backends = [session.backend, *(b for b in alternatives if b is not session.backend)]
        candidates = [Candidate(b.name, b.rows(session.pad_to_multiple_of), b.cost(model)) for b in backends]
        if stock_rows:
            candidates.append(Candidate(STOCK, None, StepCost.of_model(model, dense=True)))
        return cls(tuple(candidates))

    # ----------------------------------------------------------------------------------------------- measuring
    def measure(self, run, layout_of, num_rows: int, device, compiles: bool) -> None:
        """Time every candidate on the first micro-batch's first half of rows, then on the whole micro-batch, and keep
        their fits (see the module docstring); `summary` then says what was measured and chosen.

        A candidate whose half already took longer than another's whole micro-batch cannot be chosen for this
        micro-batch and is not run on it (stock's rows, where sharing saves much, cost the most): its fit is the line
        through its one point with the slope of the fastest candidate's. Candidates within `CLOSE` of the fastest on
        the whole micro-batch run it once more, and each keeps the faster of its two times.

        Args:
            run: `run(rows, layout)`: one forward and backward of the policy on the stock rows `rows` (indices)
                laid out as `layout`.
            layout_of: `layout_of(candidate, rows)`: the candidate's layout of the stock rows `rows`.
            num_rows: the micro-batch's stock rows.
            compiles: whether a first call compiles (CUDA, a compiled model): each shape runs once untimed first.
        """
        timer, start, self.out_of_memory = get_timer(), time.perf_counter(), set()

        def timed(candidate, rows):
            layout = layout_of(candidate, rows)
            try:
                if compiles:
                    run(rows, layout)
                return _macs(candidate, layout), timer.measure(candidate.name, lambda: run(rows, layout), device)
            except torch.OutOfMemoryError:  # never chosen; its memory released below, outside the traceback's frames
                self.out_of_memory.add(candidate.name)
            _release(device)
            return _macs(candidate, layout), math.inf

        half = {c.name: timed(c, torch.arange(num_rows // 2)) for c in self.candidates} if num_rows >= 2 else {}
        whole = {}
        for candidate in sorted(self.candidates, key=lambda c: half[c.name][1] if half else 0.0):
            if not half or half[candidate.name][1] < min((w[1] for w in whole.values()), default=math.inf):
                whole[candidate.name] = timed(candidate, torch.arange(num_rows))
        fastest = min((w[1] for w in whole.values()), default=math.inf)
        if math.isinf(fastest):
            raise torch.OutOfMemoryError(
                "Prefix sharing: every candidate of prefix_sharing_attn_implementation='auto' (the kernels that can "
                f"run here{' and stock rows' if STOCK in half or STOCK in whole else ''}) ran out of memory on the "
                "first micro-batch. Lower per_device_train_batch_size or max_length, or enable gradient_checkpointing."
            )
        close = [c for c in self.candidates if c.name in whole and whole[c.name][1] <= fastest * (1 + CLOSE)]
        for candidate in close if len(close) > 1 else ():  # timed again, each keeping its faster time
            whole[candidate.name] = min(whole[candidate.name], timed(candidate, torch.arange(num_rows)), key=_seconds)
        best = min(whole, key=lambda name: whole[name][1])
        for candidate in self.candidates:
            points = [p[candidate.name] for p in (whole, half) if candidate.name in p]
            self.fits[candidate.name] = (
                Fit(math.inf, 0.0) if candidate.name in self.out_of_memory else Fit.through(points)
            )
        for name in set(half) - set(whole) - self.out_of_memory:  # dominated: its one point, the fastest's slope
            macs, seconds = half[name]
            slope = self.fits[best].per_mac
            fixed = seconds - slope * macs
            self.fits[name] = Fit(fixed=fixed, per_mac=slope) if fixed >= 0 else Fit.through([half[name]])
        self.summary = self._summary(whole, half, time.perf_counter() - start)

    def _summary(self, whole: dict, half: dict, spent: float) -> str:
        """The start-up line's text from the measured `(multiply-adds, seconds)` of each candidate's whole micro-batch
        and first half of rows."""

        def timing(c):
            if c.name in self.out_of_memory:
                return f"{_label(c)} out of memory"
            if c.name in whole:
                return f"{_label(c)} {whole[c.name][1] * 1000:.1f} ms"
            return f"{_label(c)} more (its half of the rows took {half[c.name][1] * 1000:.1f} ms)"

        best = next(c for c in self.candidates if c.name == min(whole, key=lambda name: whole[name][1]))
        if best.is_stock and all(c.name in self.out_of_memory for c in self.shared):
            chosen = "stock rows (every shared kernel ran out of memory)"
        elif best.is_stock:
            times = {c.name: (whole if c.name in whole else half)[c.name][1] for c in self.shared}
            shared = min(times, key=times.get)
            bound = "" if shared in whole else "at least "  # its half of the rows took longer than stock's whole
            chosen = (
                f"stock rows: sharing would cost {bound}{times[shared] / whole[STOCK][1]:.2f}x here ({shared}, the "
                "fastest shared kernel)"
            )
        elif STOCK in self.out_of_memory:
            chosen = f"{best.name} (stock's rows ran out of memory)"
        elif STOCK in whole:
            chosen = f"{best.name}, {whole[STOCK][1] / whole[best.name][1]:.2f}x stock's measured step"
        elif STOCK in half:
            chosen = f"{best.name}, at least {half[STOCK][1] / whole[best.name][1]:.2f}x stock's measured step"
        else:
            chosen = best.name
        return (
            f"measured a forward and backward of the first micro-batch: {', '.join(map(timing, self.candidates))}. "
            f"It runs as {chosen}; each micro-batch takes the candidate of least predicted time ({spent:.2f} s spent "
            "measuring)"
        )


def _release(device) -> None:
    """Return the cached memory of `device` to it (after a candidate ran out of memory)."""
    module = getattr(torch, torch.device(device).type, None)
    if hasattr(module, "empty_cache"):
        module.empty_cache()


def _seconds(point: tuple[float, float]) -> float:
    return point[1]


def _label(candidate: Candidate) -> str:
    return "stock rows" if candidate.is_stock else candidate.name


def _macs(candidate: Candidate, layout) -> float:
    """The multiply-adds of `candidate`'s `layout` (`cost.StepCost`)."""
    num_rows, width = layout.input_ids.shape
    pairs = num_rows * width * width if candidate.is_stock else int(layout.visible_pairs)
    return candidate.cost.estimate(num_rows, width, pairs)


def measure_session(
    session, input_ids, attention_mask, prompt_lengths=None, examples=None, backward: bool = True
) -> str:
    """Measure the candidates of `session` (a `PrefixSharingSession`) on a micro-batch's stock rows: each laid out
    as the trainer lays them out, then one forward and backward of the policy (`Tuning.measure`). Returns the start-up
    line's text.

    Args:
        backward: whether the backward is timed too; False where a wrapper's hooks own every backward of the model
            (DeepSpeed, FSDP: they reduce each gradient it computes). Parameters sharded by ZeRO-3 or FSDP are
            detected here as well.
    """
    from .forward import _is_sequence_classifier
    from .model_check import _scores

    model = session.models[0]
    kind = "classifier" if _is_sequence_classifier(model) else "fused"
    trained = [p for p in model.parameters() if p.requires_grad]
    # parameters sharded by ZeRO-3 or FSDP: their backward belongs to the wrapper's hooks, so the forward is timed
    sharded = any(hasattr(p, "ds_id") or type(p).__name__ == "DTensor" for p in trained)
    backward = backward and bool(trained) and not sharded

    def layout_of(candidate, rows):
        take = rows.to(input_ids.device)
        ids, mask = input_ids[take], attention_mask[take]
        if candidate.is_stock:
            return stock_layout(ids, mask, check=False)
        layout = build_layout(
            ids,
            mask,
            prompt_lengths=None if prompt_lengths is None else prompt_lengths[take],
            examples=None if examples is None else examples[take],
            rows=candidate.rows,
            pad_token_id=session.pad_token_id,
            check=False,
            join=session.join,
            cost=candidate.cost,
        )
        layout.kernel = candidate.name
        return session.with_attention(layout)

    def run(rows, layout):
        take = rows.to(input_ids.device)
        autocast = session.autocast() if session.autocast is not None else contextlib.nullcontext()
        with torch.enable_grad() if backward else torch.no_grad(), autocast:
            values, _ = _scores(model, kind, input_ids[take], attention_mask[take], layout)
            if backward:
                _backward_dropped(values.float().sum(), trained)

    compiles = input_ids.device.type != "cpu" or getattr(model, "_compiled_call_impl", None) is not None
    session.attach()
    session.tuning.measure(run, layout_of, input_ids.shape[0], input_ids.device, compiles)
    if backward:
        return session.tuning.summary
    return f"{session.tuning.summary}; the forward only (DeepSpeed's or FSDP's hooks own the backward)"


def _backward_dropped(value: torch.Tensor, parameters: list) -> None:
    """`value.backward()`, its gradients dropped: every parameter's `.grad` left as it was."""
    saved = [p.grad for p in parameters]
    for p in parameters:
        p.grad = None  # else backward adds into the saved tensors in place
    try:
        value.backward()
    finally:
        for p, grad in zip(parameters, saved, strict=True):
            p.grad = grad
