"""`"auto"` chooses per micro-batch between stock's own rows and every kernel's shared layouts, by costs measured at
start-up (`trl_prefix_sharing.tuning`); the clock is injected here, so the choice is known, and whichever wins the
run equals stock TRL's."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from trl_prefix_sharing import tuning
from trl_prefix_sharing.attention import auto_backends
from trl_prefix_sharing.cost import StepCost
from trl_prefix_sharing.layout import RowPolicy, build_layout
from trl_prefix_sharing.session import PrefixSharingSession
from trl_prefix_sharing.testing import make_model
from trl_prefix_sharing.testing.equivalence import (
    assert_same_training,
    awkward_text_dataset,
    make_reward_trainers,
    make_trainers,
    train_and_evaluate,
)
from trl_prefix_sharing.testing.group_equivalence import (
    assert_same_runs,
    make_group_trainer,
    prompt_dataset,
    save_model,
)
from trl_prefix_sharing.testing.group_equivalence import train as train_group
from trl_prefix_sharing.trie import StockRows
from trl_prefix_sharing.tuning import STOCK, Candidate, Fit, Tuning


class ScriptedTimer:
    """A clock that runs each timed call (so the measurement's calls are exercised) and says it took `seconds[name]`
    (default 5 s; a tuple: its calls' times in turn, the half of the rows first; an exception: raised); it records what
    it timed."""

    def __init__(self, seconds: dict):
        self.seconds, self.timed = seconds, []

    def measure(self, name, run, device):
        run()
        seconds = self.seconds.get(name, 5.0)
        if isinstance(seconds, tuple):
            seconds = seconds[self.timed.count(name)]
        self.timed.append(name)
        if isinstance(seconds, Exception):
            raise seconds
        return seconds


@pytest.fixture
def clock():
    """Install a scripted clock for the test: `clock({"stock": 1.0})`."""
    old = tuning.get_timer()

    def install(seconds):
        timer = ScriptedTimer(seconds)
        tuning.set_timer(timer)
        return timer

    yield install
    tuning.set_timer(old)


@pytest.fixture
def kernels_run(monkeypatch):
    """The kernel of every layout a preference trainer's step prepared (`Layout.kernel`), in order."""
    seen = []
    prepare = PrefixSharingSession.prepare

    def spy(self, inputs):
        layout = prepare(self, inputs)
        seen.append(layout.kernel)
        return layout

    monkeypatch.setattr(PrefixSharingSession, "prepare", spy)
    return seen


# ----------------------------------------------------------------------------------------------- the model
def test_a_fit_through_two_sizes_gives_the_fixed_and_the_per_multiply_add_cost():
    fit = Fit.through([(100.0, 0.3), (300.0, 0.7)])
    assert fit.fixed == pytest.approx(0.1) and fit.per_mac == pytest.approx(0.002)
    assert fit.seconds(200.0) == pytest.approx(0.5)
    assert Fit.through([(100.0, 0.5)]) == Fit(fixed=0.0, per_mac=0.005)  # one size: proportional
    noisy = Fit.through([(100.0, 0.5), (300.0, 0.4)])  # the larger was faster: all of it is fixed
    assert noisy == Fit(fixed=0.5, per_mac=0.0)
    # the half slow for its size (a line with a negative fixed part): proportional through the whole, its time kept
    steep = Fit.through([(70.0, 1.7), (100.0, 3.2)])
    assert steep == Fit(fixed=0.0, per_mac=0.032) and steep.seconds(100.0) == pytest.approx(3.2)


def _rows():
    """Two prompts of 6 tokens with two completions each, right-padded."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 0], [5, 6, 7, 8, 9, 10, 13, 14, 15], [20] * 9, [20] * 7 + [21, 0]])
    mask = (ids != 0).long()
    return ids, mask, torch.tensor([0, 0, 1, 1])


def _tuning(fits: dict[str, Fit]) -> Tuning:
    cost = StepCost(position=1.0, pair=0.1)
    candidates = (
        Candidate("sdpa", RowPolicy(), cost),
        Candidate("varlen", RowPolicy(stream=True), StepCost(position=1.0, pair=0.1, dense=False)),
        Candidate(STOCK, None, cost),
    )
    return Tuning(candidates, fits=fits)


@pytest.mark.parametrize("cheapest", ["sdpa", "varlen", STOCK])
def test_the_cheapest_candidate_is_laid_out(cheapest):
    ids, mask, examples = _rows()
    fits = {name: Fit(fixed=1.0 if name == cheapest else 2.0, per_mac=0.0) for name in ("sdpa", "varlen", STOCK)}
    layout = build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=_tuning(fits))
    assert layout.kernel == cheapest
    assert (layout.segments is not None) == (cheapest == "varlen")
    if cheapest == STOCK:  # stock's own rows, every column a position the model computes
        assert layout.is_stock and torch.equal(layout.input_ids, ids)
        assert int(layout.num_positions) == ids.numel()
        assert torch.equal(layout.stock_index[mask.bool()], torch.arange(ids.numel()).view_as(ids)[mask.bool()])
    else:
        assert int(layout.num_positions) < int(mask.sum())  # the two prompts computed once each


def test_the_per_multiply_add_cost_decides_between_sizes():
    """A candidate with a large fixed cost and a small one per multiply-add wins the large micro-batches only."""
    ids, mask, examples = _rows()
    fits = {"sdpa": Fit(fixed=100.0, per_mac=0.0), "varlen": Fit(fixed=200.0, per_mac=0.0)}
    fits[STOCK] = Fit(fixed=0.0, per_mac=2.0)  # this batch: 36 positions and 324 pairs, 137 s; one short row: 8 s
    assert build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=_tuning(fits)).kernel == "sdpa"
    assert build_layout(StockRows(ids[:1, :3], mask[:1, :3]), join="auto", tuning=_tuning(fits)).kernel == STOCK


def test_before_the_measurement_the_preferred_kernel_runs():
    ids, mask, examples = _rows()
    layout = build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=_tuning({}))
    assert layout.kernel == "sdpa"


def test_a_kernel_that_cannot_run_is_never_a_candidate(tokenizer):
    model = make_model("llama", len(tokenizer))
    names = [b.name for b in auto_backends([model], "cpu", torch.float32)]
    assert names == ["sdpa", "varlen"]  # FlexAttention has no CPU backward
    eager_only = make_model("gemma2", len(tokenizer), attn_implementation="eager")  # softcapping: no SDPA, no varlen
    assert [b.name for b in auto_backends([eager_only], "cpu", torch.float32)] == ["eager"]


# ----------------------------------------------------------------------------------------------- a trainer
@pytest.mark.parametrize(
    ("ours", "candidates"),
    [
        ({}, ["sdpa", "varlen", STOCK]),
        ({"prefix_sharing_join": "prompts"}, ["sdpa", "varlen"]),  # a fixed join: stock rows are no candidate
        ({"prefix_sharing_attn_implementation": "sdpa"}, ["sdpa"]),  # a fixed kernel: nothing to measure
        ({"prefix_sharing_attn_implementation": "varlen"}, ["varlen"]),
        ({"packing": True, "packing_length": 256}, ["sdpa"]),  # packed rows keep one kernel
    ],
)
def test_the_candidates_follow_the_options(tmp_path, tokenizer, ours, candidates):
    _, trainer = make_trainers(
        tmp_path, "llama", awkward_text_dataset(), tokenizer, ours={"prefix_sharing": True, **ours}, max_steps=1
    )
    assert [c.name for c in trainer.sharing_session.tuning.candidates] == candidates
    assert trainer.sharing_session.tuning.measures == (len(candidates) > 1)


@pytest.mark.parametrize("winner", [STOCK, "varlen", "sdpa"])
def test_dpo_equals_stock_whichever_candidate_wins(tmp_path, tokenizer, clock, kernels_run, caplog, winner):
    timer = clock({winner: 1.0})
    data = awkward_text_dataset()
    stock, ours = make_trainers(tmp_path, "llama", data, tokenizer, eval_dataset=data, max_steps=3)
    with caplog.at_level(logging.WARNING):
        results = train_and_evaluate(stock), train_and_evaluate(ours)
    assert_same_training(*results)
    # each candidate's half of the rows; then the whole batch for the one whose half beat every whole (the winner)
    assert timer.timed == ["sdpa", "varlen", STOCK, winner]
    # the first batches were laid out before the measurement (the preferred kernel); the rest by it
    trained = kernels_run[: 3 * 2]  # a training step prepares a batch for its loss and its reference pass
    assert trained[0] == "sdpa" and trained[-1] == winner, kernels_run
    assert set(kernels_run[4:]) == {winner}, kernels_run
    line = next(r.getMessage() for r in caplog.records if "measured a forward and backward" in r.getMessage())
    assert ("It runs as stock rows: sharing would cost" in line) == (winner == STOCK), line
    assert "stock rows more (its half of the rows took 5000.0 ms)" in line or winner == STOCK


def test_a_candidate_is_run_on_the_whole_batch_unless_its_half_was_slower_than_a_whole(tmp_path, tokenizer, clock):
    """The halves first, fastest first on the whole: varlen's half (1.5 s) beat sdpa's whole (2 s), so it runs the
    whole too; stock's half (5 s) did not, so its constants come from its one point and the winner's slope."""
    timer = clock({"sdpa": (1.0, 2.0), "varlen": (1.5, 2.5), STOCK: (5.0,)})
    data = awkward_text_dataset()
    stock, ours = make_trainers(tmp_path, "llama", data, tokenizer, eval_dataset=data, max_steps=2)
    assert_same_training(train_and_evaluate(stock), train_and_evaluate(ours))
    assert timer.timed == ["sdpa", "varlen", STOCK, "sdpa", "varlen"]
    fits = ours.sharing_session.tuning.fits
    assert fits["sdpa"].per_mac > 0 and fits[STOCK].per_mac == fits["sdpa"].per_mac
    assert "sdpa 2000.0 ms, varlen 2500.0 ms, stock rows more (its half of the rows took 5000.0 ms)" in (
        ours.sharing_session.tuning.summary
    )
    assert "It runs as sdpa, at least 2.50x stock's measured step" in ours.sharing_session.tuning.summary


class StepTimer(ScriptedTimer):
    """A `ScriptedTimer` that also times the training steps: a step of candidate `name` took `steps[name]` seconds
    (a list: its steps' times in turn), read once `lag` later marks were made (a device that had not reached the end
    of a step yet says None)."""

    def __init__(self, seconds: dict, steps: dict, lag: int = 0):
        super().__init__(seconds)
        self.steps, self.lag, self.marks, self.read = steps, lag, 0, []

    def mark(self, device):
        self.marks += 1
        return self.marks

    def elapsed(self, name, start, end):
        if self.marks - end < self.lag:
            return None
        seconds = self.steps[name]
        if isinstance(seconds, list):
            seconds = seconds[[n for n, _ in self.read].count(name) % len(seconds)]
        self.read.append((name, seconds))
        return seconds


def _train_steps(tuning_, timer, layouts: int) -> list:
    """Lay out `layouts` micro-batches of `_rows()` as `tuning_` chooses, each timed as a training step; returns
    their kernels."""
    ids, mask, examples = _rows()
    tuning.set_timer(timer)
    kernels = []
    for _ in range(layouts):
        layout = build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=tuning_)
        tuning_.tick(layout, "cpu")
        kernels.append(layout.kernel)
    return kernels


def test_close_candidates_take_turns_then_the_least_corrected_time_wins(clock):
    """sdpa and varlen measured close (sdpa ahead), stock far behind: the training micro-batches go to sdpa and varlen
    in turn, SAMPLES each; varlen's steps took less than sdpa's for what was predicted, so it wins from then on."""
    fits = {"sdpa": Fit(fixed=1.0, per_mac=0.0), "varlen": Fit(fixed=1.1, per_mac=0.0), STOCK: Fit(9.0, 0.0)}
    tuning_ = _tuning(fits)
    tuning_.contenders, tuning_.first = ("sdpa", "varlen"), {"sdpa": 1.0, "varlen": 1.0}
    reports = []
    tuning_.report = reports.append
    clock({})  # the fixture puts the suite's clock back after
    timer = StepTimer({}, steps={"sdpa": 3.0, "varlen": 2.2})
    assert not tuning_.settled
    kernels = _train_steps(tuning_, timer, 2 * tuning.SAMPLES + 4)
    assert tuning_.settled
    assert kernels[: 2 * tuning.SAMPLES] == ["sdpa", "varlen"] * tuning.SAMPLES
    assert set(kernels[2 * tuning.SAMPLES + 1 :]) == {"varlen"}, kernels  # one step more: the last turn read
    corrections = tuning_.steps.corrections()  # observed/predicted: sdpa 3.0, varlen 2.0
    assert corrections["sdpa"] == pytest.approx(1.5) and corrections["varlen"] == pytest.approx(1.0)
    assert STOCK not in corrections and tuning_.predict(STOCK, 1.0) == 9.0  # never timed: its fit
    assert reports == [tuning_.refined] and "sdpa 3000.0 ms, varlen 2200.0 ms" in reports[0]
    assert "corrected by 1.50x (sdpa), 1.00x (varlen)" in reports[0] and "varlen on one like the first" in reports[0]
    # a wrong attribution (each step's time given to the kernel of the step after it) would have flipped the choice
    assert [name for name, _ in timer.read][:2] == ["sdpa", "varlen"]


def test_a_step_is_timed_once_read_without_waiting_and_never_across_a_pause_or_a_stop(clock):
    fits = {"sdpa": Fit(fixed=1.0, per_mac=0.0), "varlen": Fit(fixed=1.1, per_mac=0.0), STOCK: Fit(9.0, 0.0)}
    tuning_ = _tuning(fits)
    clock({})
    timer = StepTimer({}, steps={"sdpa": 1.0, "varlen": 1.0}, lag=2)  # a device two marks behind
    _train_steps(tuning_, timer, 3)
    assert len(timer.read) == 0 and len(tuning_.steps._unread) == 2  # not read yet: nothing waits for the device
    ids, mask, examples = _rows()
    layout = build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=tuning_)
    tuning_.tick(layout, "cpu")
    tuning_.tick(layout, "cpu")  # the same micro-batch again (one step): no mark
    assert timer.marks == 4 and len(timer.read) == 1
    tuning_.steps.stop()  # the end of train(): the step in progress is not one
    assert tuning_.steps._open is None
    with tuning_.steps.paused():
        tuning_.tick(build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=tuning_), "cpu")
    assert timer.marks == 4 and tuning_.steps._open is None
    unmeasured = build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=_tuning({}))
    assert unmeasured.macs is None  # laid out before the measurement: nothing to time it against
    tuning_.tick(unmeasured, "cpu")
    assert tuning_.steps._open is None


def test_a_generation_inside_a_step_is_left_out_of_its_time(clock):
    class Clock(ScriptedTimer):  # marks are the times set by the test
        now = 0.0

        def mark(self, device):
            return self.now

        def elapsed(self, name, start, end):
            return end - start

    tuning_ = _tuning({name: Fit(fixed=1.0, per_mac=0.0) for name in ("sdpa", "varlen", STOCK)})
    clock({})
    timer = Clock({})
    tuning.set_timer(timer)
    ids, mask, examples = _rows()
    tuning_.tick(build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=tuning_), "cpu")
    timer.now = 5.0
    with tuning_.steps.excluding():  # 4 s of generation
        timer.now = 9.0
    timer.now = 10.0
    tuning_.tick(build_layout(StockRows(ids, mask, examples=examples), join="auto", tuning=tuning_), "cpu")
    assert [seconds for seconds, _ in tuning_.steps.samples["sdpa"]] == [6.0]


def test_dpo_equals_stock_while_close_candidates_take_turns(tmp_path, tokenizer, clock, kernels_run, caplog):
    """The real training steps, timed: sdpa and varlen measured close, each trains its micro-batches in turn; the run
    equals stock TRL's, and the line says what the steps measured (eval passes are not timed)."""
    timer = StepTimer({"sdpa": 1.0, "varlen": 1.2}, steps={"sdpa": 2.0, "varlen": 1.0})
    tuning.set_timer(timer)
    data = awkward_text_dataset()
    stock, ours = make_trainers(tmp_path, "llama", data, tokenizer, eval_dataset=data, max_steps=10)
    with caplog.at_level(logging.WARNING):
        assert_same_training(train_and_evaluate(stock), train_and_evaluate(ours))
    assert ours.sharing_session.tuning.contenders == ("sdpa", "varlen")
    assert "sdpa and varlen within 30% of the fastest" in ours.sharing_session.tuning.summary
    read = [name for name, _ in timer.read]
    assert read.count("sdpa") >= tuning.SAMPLES and read.count("varlen") >= tuning.SAMPLES, read
    assert len(read) <= 10 - 2  # training steps only (the first two laid out before the measurement)
    assert {"sdpa", "varlen"} <= set(kernels_run)
    line = next(r.getMessage() for r in caplog.records if "training micro-batches" in r.getMessage())
    assert "sdpa 2000.0 ms, varlen 1000.0 ms" in line and "varlen on one like the first" in line, line


def test_num_shared_tokens_counts_stock_rows_as_stock_computes_them(tmp_path, tokenizer, clock, monkeypatch):
    clock({STOCK: 1.0})
    dataset = awkward_text_dataset()
    _, ours = make_trainers(tmp_path, "llama", dataset, tokenizer, eval_dataset=dataset, max_steps=3)
    trained = []
    prepare = PrefixSharingSession.prepare

    def spy(self, inputs):
        layout = prepare(self, inputs)
        if ours.model.training and all(layout is not seen for seen in trained):
            trained.append(layout)
        return layout

    monkeypatch.setattr(PrefixSharingSession, "prepare", spy)
    train_and_evaluate(ours)
    logged = [log["num_shared_tokens"] for log in ours.state.log_history if "num_shared_tokens" in log]
    # the first two batches were collated before the measurement (the data loader reads one ahead)
    assert len(trained) == 3 and not trained[0].is_stock and trained[-1].is_stock
    assert logged[-1] == sum(int(layout.num_positions) for layout in trained)
    assert int(trained[-1].num_positions) == trained[-1].input_ids.numel()  # every stock column, padding included


def test_reward_equals_stock_on_stock_rows_and_on_varlen(tmp_path, tokenizer, clock):
    for winner in (STOCK, "varlen"):
        clock({winner: 1.0})
        data = awkward_text_dataset()
        stock, ours = make_reward_trainers(tmp_path, "llama", data, tokenizer, eval_dataset=data, max_steps=3)
        assert_same_training(train_and_evaluate(stock), train_and_evaluate(ours), min_per_line=4)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_group_trainers_equal_stock_on_stock_rows(tmp_path, tokenizer, clock, kind):
    timer = clock({STOCK: 1.0})
    path = save_model(tmp_path / "model", "llama", tokenizer)
    dataset = prompt_dataset()
    stock = train_group(make_group_trainer(kind, False, path, dataset, tokenizer, tmp_path, max_steps=3))
    ours_trainer = make_group_trainer(kind, True, path, dataset, tokenizer, tmp_path, max_steps=3)
    ours = train_group(ours_trainer)
    assert_same_runs(stock, ours)
    assert STOCK in timer.timed and ours_trainer.sharing_session.tuning.fits[STOCK].fixed == 1.0


def test_the_real_clock_measures_every_candidate_and_the_run_equals_stock(tmp_path, tokenizer, caplog):
    tuning.set_timer(tuning.Timer())  # this machine's wall clock (the suite's fixture puts its own back after)
    data = awkward_text_dataset()
    stock, ours = make_trainers(tmp_path, "llama", data, tokenizer, eval_dataset=data, max_steps=3)
    with caplog.at_level(logging.WARNING):
        assert_same_training(train_and_evaluate(stock), train_and_evaluate(ours))
    fits = ours.sharing_session.tuning.fits
    assert set(fits) == {"sdpa", "varlen", STOCK}
    assert all(fit.fixed >= 0 and fit.per_mac >= 0 and fit.seconds(1e6) > 0 for fit in fits.values())
    assert any("measured a forward and backward of the first micro-batch" in r.getMessage() for r in caplog.records)


def test_the_measurement_leaves_gradients_and_modes_as_they_were(tmp_path, tokenizer, clock):
    clock({"varlen": 1.0})
    _, ours = make_trainers(tmp_path, "llama", awkward_text_dataset(), tokenizer, max_steps=1)
    model = ours.model
    model.train()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    batch = ours.data_collator([ours.train_dataset[i] for i in range(4)])
    ours.sharing_session.attach()
    try:
        ours._startup_check(batch["input_ids"], batch["attention_mask"], examples=torch.tensor([0, 1, 2, 3] * 2))
    finally:
        ours.sharing_session.detach()
    assert ours.sharing_session.tuning.fits and model.training
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"  # the switch put back with the patches


def test_a_candidate_out_of_memory_is_never_chosen_and_all_out_of_memory_is_an_error(tmp_path, tokenizer, clock):
    """Stock's rows hold more activations than the shared ones: where they run out of memory in the measurement, the
    run goes on with the kernels that fit, as stock TRL's numbers; where every candidate does, a clear error."""
    clock({STOCK: torch.OutOfMemoryError("out of memory"), "varlen": 1.0})
    data = awkward_text_dataset()
    stock, ours = make_trainers(tmp_path, "llama", data, tokenizer, eval_dataset=data, max_steps=2)
    assert_same_training(train_and_evaluate(stock), train_and_evaluate(ours))
    assert (
        ours.sharing_session.tuning.out_of_memory == {STOCK}
        and ours.sharing_session.tuning.fits[STOCK].seconds(1.0) == math.inf
    )
    assert "stock rows out of memory" in ours.sharing_session.tuning.summary
    assert "It runs as varlen (stock's rows ran out of memory)" in ours.sharing_session.tuning.summary
    clock({name: torch.OutOfMemoryError("out of memory") for name in ("sdpa", "varlen", STOCK)})
    _, ours = make_trainers(tmp_path / "all", "llama", data, tokenizer, max_steps=1)
    with pytest.raises(torch.OutOfMemoryError, match="every candidate .* ran out of memory on the first micro-batch"):
        ours.train()
