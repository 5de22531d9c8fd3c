"""Measured costs: how `"auto"` chooses, per micro-batch, between stock's own rows and the shared layouts of every
kernel that can run, by the time each takes on this device.

Counting work is not the same as time: a shared layout computes fewer positions but pays for what stock does not
(a mask, a block mask, a gather, one more kernel per layer), and on a fast device that fixed part can outweigh what
short prompts save. So with `prefix_sharing_attn_implementation="auto"` and `prefix_sharing_join="auto"` the
candidates of a micro-batch are:

- **stock rows**: the trainer's batch exactly as TRL builds it, run by the model's own forward and attention (the same
  numbers, by definition);
- every join plan (`trie.JOINS`) laid out for every kernel that can run here (`attention.auto_backends`: varlen,
  FlexAttention and SDPA on CUDA; SDPA and varlen's reference elsewhere).

All are exact, so the choice changes speed only. Each candidate's step is predicted as

    seconds = fixed + per_mac x multiply-adds

with `multiply-adds` its count under the kernel (`cost.StepCost`: positions, and every or only the visible query-key
pairs) and `fixed` and `per_mac` measured on the device (`Fit`): in the start-up phase, each candidate runs a forward
and a backward of the policy (its gradients dropped: every `.grad` is left as it was) on the first half of the first
micro-batch's rows and on the whole micro-batch, after an untimed warm-up call (of every candidate where code
compiles: CUDA, a compiled model; else of the first, which pays the process's first backward), timed on the same clock
(`Timer`: synchronised around the call on an accelerator, the wall clock on the CPU). To keep the measurement cheap, a
candidate whose half already took longer than another's whole micro-batch, by more than `EXPLORE`, is not run on the
whole (it cannot win there; its line is drawn through its one point with the fastest candidate's slope).

One timed call is noisy (on a busy host, by tens of percent), so the training steps that follow refine the costs, at
no cost of their own: each micro-batch of the policy's training forward is timed on the same clock, from its forward to
the next one's (CUDA events, read once they completed, without a synchronisation; the wall clock on the CPU), and a
candidate's prediction is corrected by the median of its last observed/predicted ratios, relative to the least such
ratio (`Tuning.tick`, `TrainingSteps.corrections`). The
candidates whose whole micro-batch took within `EXPLORE` of the fastest's (the close ones, which noise could have
ranked wrongly) each train `SAMPLES` micro-batches first, in turn (every candidate is exact: the steps are the run's
own, only their speed differs); a line then says what the steps measured. Each later micro-batch takes the candidate of
least predicted time. A fixed choice (a kernel or a join rule other than `"auto"`) is never overridden: the candidates
are then that kernel's layouts only, and stock rows are none of them.

The measurement is per process (each rank chooses for its own micro-batch; every choice is exact) and is repeated
when a run resumes from a checkpoint. Under DeepSpeed or FSDP the forward alone is timed: their hooks reduce every
gradient a backward computes, so a backward outside the training step would be reduced twice.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from .cost import StepCost
from .layout import RowPolicy, build_layout, stock_layout
from .trie import StockRows


__all__ = [
    "STOCK",
    "Candidate",
    "Fit",
    "Timer",
    "TrainingSteps",
    "Tuning",
    "set_timer",
    "get_timer",
    "measure_session",
]

logger = logging.get_logger(__name__)

#: the name of the candidate that runs stock's own rows (`Layout.kernel` of such a layout)
STOCK = "stock"
#: candidates whose whole micro-batch took at most this much longer than the fastest's train `SAMPLES` micro-batches
#: each before the choice settles (one call's time on a busy host varies by about as much as close kernels differ)
EXPLORE = 0.3
#: the training micro-batches each close candidate runs first
SAMPLES = 3
#: a candidate's prediction is scaled by the median observed/predicted ratio of its last this many micro-batches
WINDOW = 9


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
    the time is the device's; on the CPU, the wall clock. The training steps are timed by marks (`mark`, `elapsed`),
    without a synchronisation. Tests inject another (`set_timer`; one without `mark` leaves the start-up choice
    as it is)."""

    def measure(self, name: str, run, device) -> float:
        synchronize = _synchronizer(device)
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        return time.perf_counter() - start

    def warm_up(self, name: str, run, device) -> None:
        """An untimed call of candidate `name` (`run()`) before its timed ones."""
        run()

    def mark(self, device):
        """A point in time on `device`'s clock: the wall clock on the CPU, a recorded CUDA event; None where neither
        (the steps are then not timed)."""
        device = torch.device(device)
        if device.type == "cpu":
            return time.perf_counter()
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return None

    def elapsed(self, name: str, start, end) -> float | None:
        """Seconds from mark `start` to mark `end` (a step of candidate `name`), or None while the device has not
        reached `end` (asked again later: no synchronisation)."""
        if isinstance(end, float):
            return end - start
        return start.elapsed_time(end) / 1000 if end.query() else None


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
class TrainingSteps:
    """A session's training steps, timed (see the module docstring): each from one training forward of the policy to
    the next, against the seconds its candidate's fit predicted; read once the device passed them, never waiting."""

    #: name: the last `WINDOW` timed steps of that candidate, as (observed seconds, predicted seconds)
    samples: dict = field(default_factory=dict)
    #: the step being timed: (its layout's weak reference, kernel, predicted seconds, start, spans left out, device)
    _open: tuple | None = None
    _unread: list = field(default_factory=list)  # timed steps whose end the device has not reached yet
    _paused: bool = False

    def tick(self, layout, predicted: float | None, device) -> None:
        """A training forward on `layout` starts: the step in progress ends and is observed, and this one is started
        (if `predicted`). A second call on the same layout (the same micro-batch) goes on timing it. Nothing is timed
        while paused, or without a clock for `device`."""
        if self._paused or (self._open is not None and self._open[0]() is layout):
            return
        mark = _mark(device)
        if self._open is not None and mark is not None:
            self._unread.append((*self._open[1:5], mark))  # name, predicted, start, spans left out, end
        self._open = None
        if mark is not None and predicted is not None:
            self._open = (weakref.ref(layout), layout.kernel, predicted, mark, [], device)
        self._read()

    def stop(self) -> None:
        """The training steps stop being timed (the end of `train()`, `evaluate()`): the step in progress is dropped
        (what follows it is not a training step)."""
        self._open = None
        self._read()

    @contextlib.contextmanager
    def excluding(self):
        """What runs inside is left out of the step being timed (a generation between two training forwards: not
        the candidate's work, and as long as many steps)."""
        open_, start = self._open, _mark(self._open[-1]) if self._open is not None else None
        try:
            yield
        finally:
            if open_ is not None and start is not None and self._open is open_:
                open_[4].append((start, _mark(open_[-1])))

    @contextlib.contextmanager
    def paused(self):
        """No step is timed inside (the start-up measurement's own passes)."""
        self._paused, self._open = True, None
        try:
            yield
        finally:
            self._paused = False

    def _read(self) -> None:
        """Observe the timed steps whose end the device has reached."""
        unread, self._unread = self._unread, []
        for name, predicted, start, excluded, end in unread:
            spans = [get_timer().elapsed(name, a, b) for a, b in [(start, end), *excluded]]
            if any(span is None for span in spans):
                self._unread.append((name, predicted, start, excluded, end))
            elif predicted > 0 and math.isfinite(predicted):
                self.samples.setdefault(name, deque(maxlen=WINDOW)).append((spans[0] - sum(spans[1:]), predicted))

    def corrections(self) -> dict[str, float]:
        """The factor each timed candidate's fit is corrected by: the median observed/predicted ratio of its last
        training micro-batches (at least `SAMPLES`), over the least such ratio of any candidate. Relative, because a
        step timed from one forward to the next holds more than the measured forward and backward (the optimizer,
        the data, a reference pass), alike for every candidate; a candidate never timed keeps its fit."""
        ratios = {n: statistics.median(o / p for o, p in s) for n, s in self.samples.items() if len(s) >= SAMPLES}
        least = min(ratios.values(), default=1.0)
        return {name: ratio / least for name, ratio in ratios.items()}


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
    #: the close candidates, which train `SAMPLES` micro-batches each before the choice settles
    contenders: tuple[str, ...] = ()
    #: `report(text)`: where the line saying what the training steps measured goes (the trainer's log), or None
    report: object = None
    #: what the training steps measured, once each contender has run its micro-batches (None until then)
    refined: str | None = None
    #: the training steps, timed
    steps: TrainingSteps = field(default_factory=TrainingSteps)
    _explored: Counter = field(default_factory=Counter)  # name: micro-batches laid out for it while exploring
    #: name: the multiply-adds of its whole first micro-batch, as measured
    first: dict = field(default_factory=dict)

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
        return self.predict(candidate.name, macs)

    def predict(self, name: str, macs: float) -> float:
        """Candidate `name`'s predicted seconds for `macs` multiply-adds: its measured fit, corrected by its timed
        training micro-batches (`TrainingSteps.corrections`)."""
        return self.fits[name].seconds(macs) * self.steps.corrections().get(name, 1.0)

    @property
    def settled(self) -> bool:  # the close candidates took their turns (`exploring`)
        return all(self._explored[name] >= SAMPLES for name in self.contenders)

    def exploring(self) -> str | None:
        """The contender the next micro-batch is laid out for while the close candidates take their turns (the one
        with the fewest so far), else None (the least predicted time chooses). Counts the turn."""
        turns = [name for name in self.contenders if self._explored[name] < SAMPLES]
        if not turns:
            return None
        name = min(turns, key=lambda n: self._explored[n])
        self._explored[name] += 1
        return name

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

    # ----------------------------------------------------------------------------------------------- training steps
    def tick(self, layout, device) -> None:
        """A training forward of the policy on `layout` (its `kernel` and `macs`) starts: the step timed since the
        last one ends here (`TrainingSteps.tick`), against what its fit predicted. Once every contender ran its
        micro-batches, `refined` says what they took (and `report` is given it)."""
        if not self.fits:
            return
        timed = layout.macs is not None and layout.kernel in self.fits
        self.steps.tick(layout, self.fits[layout.kernel].seconds(layout.macs) if timed else None, device)
        if (
            self.refined is None
            and self.contenders
            and all(len(self.steps.samples.get(name, ())) >= SAMPLES for name in self.contenders)
        ):
            self.refined = _steps_line(self)
            if self.report is not None:
                self.report(self.refined)

    # ----------------------------------------------------------------------------------------------- measuring
    def measure(self, run, layout_of, num_rows: int, device, compiles: bool) -> None:
        """Time every candidate on the first micro-batch's first half of rows, then on the whole micro-batch, and keep
        their fits (see the module docstring); `summary` then says what was measured and chosen, and `contenders`
        which candidates the training steps compare.

        A candidate whose half already took longer than another's whole micro-batch (by more than `EXPLORE`) is not
        run on it (stock's rows, where sharing saves much, cost the most): its fit is the line
        through its one point with the slope of the fastest candidate's.

        Args:
            run: `run(rows, layout)`: one forward and backward of the policy on the stock rows `rows` (indices)
                laid out as `layout`.
            layout_of: `layout_of(candidate, rows)`: the candidate's layout of the stock rows `rows`.
            num_rows: the micro-batch's stock rows.
            compiles: whether a first call compiles (CUDA, a compiled model): each shape runs once untimed first.
        """
        timer, start, self.out_of_memory = get_timer(), time.perf_counter(), set()

        def timed(candidate, rows, warm_up):
            layout = layout_of(candidate, rows)
            try:
                if warm_up:
                    _warm_up(timer, candidate.name, lambda: run(rows, layout), device)
                return _macs(candidate, layout), timer.measure(candidate.name, lambda: run(rows, layout), device)
            except torch.OutOfMemoryError:  # never chosen; its memory released below, outside the traceback's frames
                self.out_of_memory.add(candidate.name)
            _release(device)
            return _macs(candidate, layout), math.inf

        halves = torch.arange(num_rows // 2)
        half = (
            {c.name: timed(c, halves, compiles or i == 0) for i, c in enumerate(self.candidates)}
            if num_rows > 1
            else {}
        )
        whole = {}
        for candidate in sorted(self.candidates, key=lambda c: half[c.name][1] if half else 0.0):
            if not half or half[candidate.name][1] < (1 + EXPLORE) * min(
                (w[1] for w in whole.values()), default=math.inf
            ):
                whole[candidate.name] = timed(candidate, torch.arange(num_rows), compiles or not half)
        fastest = min((w[1] for w in whole.values()), default=math.inf)
        if math.isinf(fastest):
            raise torch.OutOfMemoryError(
                "Prefix sharing: every candidate of prefix_sharing_attn_implementation='auto' (the kernels that can "
                f"run here{' and stock rows' if STOCK in half or STOCK in whole else ''}) ran out of memory on the "
                "first micro-batch. Lower per_device_train_batch_size or max_length, or enable gradient_checkpointing."
            )
        self.fits.update(_fits(self.candidates, self.out_of_memory, whole, half))
        close = [c.name for c in self.candidates if c.name in whole and whole[c.name][1] <= fastest * (1 + EXPLORE)]
        self.contenders = tuple(close) if len(close) > 1 and hasattr(timer, "mark") else ()
        self.first = {name: macs for name, (macs, _) in whole.items()}
        self.summary = _start_up_line(self, whole, half, time.perf_counter() - start)


def _fits(candidates, out_of_memory: set, whole: dict, half: dict) -> dict[str, Fit]:
    """Each candidate's `Fit` from its measured `(multiply-adds, seconds)` on the whole micro-batch and on the half
    of its rows (one `out_of_memory`: never chosen); a candidate run on the half only takes the fastest's slope
    through its one point."""
    fits = {}
    for candidate in candidates:
        points = [p[candidate.name] for p in (whole, half) if candidate.name in p]
        fits[candidate.name] = Fit(math.inf, 0.0) if candidate.name in out_of_memory else Fit.through(points)
    slope = fits[min(whole, key=lambda name: whole[name][1])].per_mac
    for name in set(half) - set(whole) - out_of_memory:  # dominated: its one point, the fastest's slope
        macs, seconds = half[name]
        fixed = seconds - slope * macs
        fits[name] = Fit(fixed=fixed, per_mac=slope) if fixed >= 0 else Fit.through([half[name]])
    return fits


def _start_up_line(tuning: Tuning, whole: dict, half: dict, spent: float) -> str:
    """The start-up line's text from the measured `(multiply-adds, seconds)` of each candidate's whole micro-batch
    and first half of rows."""

    def timing(c):
        if c.name in tuning.out_of_memory:
            return f"{_label(c)} out of memory"
        if c.name in whole:
            return f"{_label(c)} {whole[c.name][1] * 1000:.1f} ms"
        return f"{_label(c)} more (its half of the rows took {half[c.name][1] * 1000:.1f} ms)"

    best = next(c for c in tuning.candidates if c.name == min(whole, key=lambda name: whole[name][1]))
    if best.is_stock and all(c.name in tuning.out_of_memory for c in tuning.shared):
        chosen = "stock rows (every shared kernel ran out of memory)"
    elif best.is_stock:
        times = {c.name: (whole if c.name in whole else half)[c.name][1] for c in tuning.shared}
        shared = min(times, key=times.get)
        bound = "" if shared in whole else "at least "  # its half of the rows took longer than stock's whole
        chosen = (
            f"stock rows: sharing would cost {bound}{times[shared] / whole[STOCK][1]:.2f}x here ({shared}, the "
            "fastest shared kernel)"
        )
    elif STOCK in tuning.out_of_memory:
        chosen = f"{best.name} (stock's rows ran out of memory)"
    elif STOCK in whole:
        chosen = f"{best.name}, {whole[STOCK][1] / whole[best.name][1]:.2f}x stock's measured step"
    elif STOCK in half:
        chosen = f"{best.name}, at least {half[STOCK][1] / whole[best.name][1]:.2f}x stock's measured step"
    else:
        chosen = best.name
    return (
        f"measured a forward and backward of the first micro-batch: {', '.join(map(timing, tuning.candidates))}. "
        f"It runs as {chosen}; each micro-batch takes the candidate of least predicted time ({spent:.2f} s spent "
        f"measuring){_contending(tuning)}"
    )


def _contending(tuning: Tuning) -> str:
    """The start-up line's last part: the close candidates, which take turns first (none: empty)."""
    if not tuning.contenders:
        return ""
    names = " and ".join(map(_label, tuning.contenders))
    return (
        f"; {names} within {EXPLORE:.0%} of the fastest: each trains {SAMPLES} micro-batches first, timed, before "
        "the choice settles"
    )


def _steps_line(tuning: Tuning) -> str:
    """The line saying what the contenders' timed training steps took, and how their predictions were corrected."""

    def timing(name):
        return f"{_label(name)} {statistics.median(o for o, _ in tuning.steps.samples[name]) * 1000:.1f} ms"

    corrections = tuning.steps.corrections()
    best = min(tuning.contenders, key=lambda name: tuning.predict(name, tuning.first[name]))
    return (
        f"timed {SAMPLES} training micro-batches of each close candidate, from one forward to the next (median): "
        f"{', '.join(map(timing, tuning.contenders))}; their start-up predictions corrected by "
        f"{', '.join(f'{corrections[name]:.2f}x ({_label(name)})' for name in tuning.contenders)}. Each "
        f"micro-batch takes the candidate of least corrected time: {_label(best)} on one like the first"
    )


def _mark(device):
    """A mark of the clock (`Timer.mark`), or None where it times no steps."""
    return get_timer().mark(device) if hasattr(get_timer(), "mark") else None


def _warm_up(timer, name: str, call, device) -> None:
    """The untimed call of `timer` (`Timer.warm_up`; a clock without one: `call()`)."""
    if hasattr(timer, "warm_up"):
        timer.warm_up(name, call, device)
    else:
        call()


def _release(device) -> None:
    """Return the cached memory of `device` to it (after a candidate ran out of memory)."""
    module = getattr(torch, torch.device(device).type, None)
    if hasattr(module, "empty_cache"):
        module.empty_cache()


def _label(candidate: Candidate | str) -> str:
    name = candidate if isinstance(candidate, str) else candidate.name
    return "stock rows" if name == STOCK else name


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
            StockRows(
                ids,
                mask,
                prompt_lengths=None if prompt_lengths is None else prompt_lengths[take],
                examples=None if examples is None else examples[take],
                check=False,
            ),
            rows=candidate.rows,
            pad_token_id=session.pad_token_id,
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
    with session.tuning.steps.paused():
        session.tuning.measure(run, layout_of, input_ids.shape[0], input_ids.device, compiles)
    if backward:
        return session.tuning.summary
    why = "DeepSpeed's or FSDP's hooks own the backward" if trained else "no parameter of the model itself trains"
    return f"{session.tuning.summary}; the forward only ({why})"


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
