"""The one integration path: what every prefix-sharing trainer class puts before TRL's.

`PrefixSharingMixin` runs the checks before TRL's `__init__` (`support.py`), and after it builds the trainer's
`PrefixSharingSession` (`session.py`: the models, their kernel and patches, and the layouts of their rows) and its
`StartupCheck` (`model_check.py`), which each trainer runs on the stock rows of its first batch before it lays out
anything (`_startup_check`). The models are patched only for the length of `train()`, `evaluate()` and `predict()`,
and `remove_prefix_sharing()` leaves the trainer as stock TRL. Packing (`packing.py`) is a separate feature that runs
on the same layout.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from .architectures import moves_positions
from .attention import attention_dtype, auto_backends, choose_backend
from .collator import PrefixSharingCollator
from .config import warn_if_not_our_config
from .distributed import release_distributed_wrappers, warn_if_fewer_processes_than_asked
from .forward import unwrap_model
from .model_check import StartupCheck
from .session import PrefixSharingSession
from .support import (
    check_architecture,
    check_forward_in_place,
    check_model_and_processor,
    check_no_dropout,
    check_prompt_learning,
)
from .trainers import guard_trainer_class, spec_of_class
from .tuning import measure_session
from .validation import (
    check_dataset_columns,
    check_not_empty,
    check_prompt_column,
    check_rows_left,
    dataset_sizes,
    needed_columns,
)
from .virtual import CACHE, VirtualTokens, prompt_learning_config
from .vision import is_vision_config


__all__ = ["PrefixSharingMixin"]

logger = logging.get_logger(__name__)


def _measured_candidates(trainer, models, requested: str, join: str, dtype) -> tuple[tuple, bool]:
    """What `"auto"` measures per micro-batch besides the preferred kernel (`tuning.py`): every kernel that can run,
    and whether stock's own rows are a candidate (the join rule is `"auto"` too). Packed rows keep one kernel
    (packing's sampler fits batches to its rows), as do vision-language models."""
    measured = requested == "auto" and not trainer.packing and not is_vision_config(models[0].config)
    alternatives = tuple(auto_backends(models, trainer.accelerator.device, dtype)) if measured else ()
    return alternatives, measured and join == "auto" and trainer.prefix_sharing


def _measure(trainer, input_ids, attention_mask, prompt_lengths, examples) -> None:
    """The start-up measurement of `"auto"`'s candidates on the first micro-batch's stock rows, logged in one line
    (`prompt_lengths`, `examples`: tensors, or functions that make them)."""
    prompt_lengths, examples = (value() if callable(value) else value for value in (prompt_lengths, examples))
    wrapped = getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False)
    summary = measure_session(
        trainer.sharing_session, input_ids, attention_mask, prompt_lengths, examples, not wrapped
    )
    if trainer.args.should_log:
        logger.warning(f"Prefix sharing ('auto' on {input_ids.device.type}): {summary}.")
        # and, once the close candidates trained their micro-batches, what those steps measured (`Tuning.tick`)
        device = input_ids.device.type
        trainer.sharing_session.tuning.report = lambda text: logger.warning(
            f"Prefix sharing ('auto' on {device}): {text}."
        )


class _ForwardInPlace(TrainerCallback):
    """At the start of training (after transformers applied its kernel options to the model): the shared forward is
    still in place."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer.sharing_session is not None:
            check_forward_in_place(trainer.sharing_session.models, getattr(args, "use_liger_kernel", False))


class _SharedPositionsState(TrainerCallback, ExportableState):
    """`num_shared_tokens` kept in a checkpoint and resumed from it, as stock GRPO's and RLOO's `num_tokens` is (in
    the trainer state)."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def state(self) -> dict:
        trainer = self._trainer()
        total = None if trainer is None else trainer.shared_positions.total
        return {"args": {}, "attributes": {"shared_positions": 0 if total is None else int(total)}}

    def on_train_begin(self, args, state, control, **kwargs):
        saved = state.stateful_callbacks.get(type(self).__name__)
        trainer = self._trainer()
        if state.global_step > 0 and isinstance(saved, dict) and trainer is not None:  # resumed from a checkpoint
            trainer.shared_positions.total = saved["attributes"]["shared_positions"]


class SharedPositions:
    """What sharing saves, shown as the run goes: `num_shared_tokens` in the logs (the token positions the policy's
    training forwards computed, a running total kept on the device and read once per logging step) and one start-up
    line, of one form for every trainer, after the first training forward: what its micro-batch really computed
    against what stock TRL computes on the same rows, the join and kernel that ran (and whether `"auto"` chose them),
    and `hint` (set before training: where another grouping of the data would share more), kept as `line`."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)
        self.total = None  # a 0-d device tensor once a training forward counted, or an int resumed from a checkpoint
        self.hint = ""
        self.line = None

    def count(self, layouts, *stock_masks: torch.Tensor, note: str = "") -> None:
        """Add what a training forward of the policy computed on `layouts` (a `Layout`, or the several a pass ran)
        to the total, summed over the processes. With the attention masks of the stock rows that forward stands for,
        the first call also logs the start-up line (one host read, once); `note` says what the rows are."""
        layouts = layouts if isinstance(layouts, (list, tuple)) else (layouts,)
        counts = [sum(layout.num_positions for layout in layouts).reshape(())]
        first = bool(stock_masks) and self.line is None
        if first:
            full = lambda value: torch.full_like(counts[0], value)  # noqa: E731
            counts.append(sum(layout.num_tokens for layout in layouts).to(counts[0]))
            counts.append(full(sum(layout.input_ids.numel() for layout in layouts)))
            counts.append(sum(mask.sum() for mask in stock_masks).to(counts[0]))
            counts.append(full(sum(mask.numel() for mask in stock_masks)))
        trainer = self._trainer()
        counts = trainer.accelerator.gather_for_metrics(torch.stack(counts).unsqueeze(0)).sum(0)
        self.total = counts[0] if self.total is None else self.total + counts[0]
        if first:
            self.line = startup_line(*counts[1:].tolist(), _ran(trainer, layouts[0]), note) + self.hint
            if trainer.args.should_log:
                logger.warning(self.line)


def _ran(trainer, layout) -> str:
    """The join and kernel `layout` ran with, and which of them `"auto"` chose."""
    args = trainer.args
    kernel_chosen = getattr(args, "prefix_sharing_attn_implementation", None) == "auto"
    if layout.is_stock:
        return "stock's own rows" + (', chosen by "auto"' if kernel_chosen else "")
    kernel = layout.kernel or trainer.sharing_session.backend.name
    chosen = [name for name, auto in (("join", args.prefix_sharing_join == "auto"), ("kernel", kernel_chosen)) if auto]
    return f'join "{layout.join}" and kernel "{kernel}"' + (
        f', {" and ".join(chosen)} chosen by "auto"' if chosen else ""
    )


def startup_line(shared: int, shared_padded: int, stock: int, stock_padded: int, ran: str, note: str = "") -> str:
    """The start-up line: the first training micro-batch's tokens and positions (padding included) against stock
    TRL's on the same rows, and what ran (`ran`)."""
    return (
        f"Prefix sharing: the first training micro-batch{note} computes {shared:,} tokens ({shared_padded:,} "
        f"positions with its padding) where stock TRL computes {stock:,} tokens ({stock_padded:,} positions with its "
        f"padding): {stock / max(shared, 1):.2f}x fewer tokens, {stock_padded / max(shared_padded, 1):.2f}x fewer "
        f"positions; {ran}."
    )


class PatchScope:
    """The session's patches attached for the length of a block (nested blocks: the outermost one), and left as TRL
    leaves the models afterwards: what `train()`, `evaluate()` and `predict()` run in."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)
        self._depth = 0

    @contextlib.contextmanager
    def __call__(self):
        session = self._trainer().sharing_session
        depth = self._depth
        self._depth = depth + 1
        try:
            if session is not None:
                session.attach()
            yield
        finally:
            self._depth = depth
            session = self._trainer().sharing_session
            if depth == 0 and session is not None:
                session.detach()


def _check_arguments(trainer, model, args, processing_class, peft_config, datasets: dict) -> dict:
    """Before TRL's `__init__`, with prefix sharing or packing on: this package's config class, the model (a local path
    that does not exist) and the processor, and clear errors for an empty dataset, (with prefix sharing) a misspelt
    prompt column, and a dataset without the columns the trainer reads (its entry's in the table of trainers). Returns
    the datasets' row counts, for checking that TRL's preprocessing left some (`_finish_prefix_sharing_init`)."""
    name = type(trainer).__name__
    if not isinstance(args, trainer._config_class):
        raise TypeError(
            f"`prefix_sharing`/`packing` need `trl_prefix_sharing.{trainer._config_class.__name__}` as `args`."
        )
    trust_remote_code = getattr(args, "trust_remote_code", False)
    check_model_and_processor(name, model, processing_class, peft_config, trust_remote_code, trainer._supports_vision)
    check_prompt_learning(name, prompt_learning_config(model, peft_config), trainer._virtual_tokens_refused, args)
    check = check_prompt_column if trainer.prefix_sharing else check_not_empty  # both refuse an empty dataset
    needed = needed_columns(spec_of_class(type(trainer)).columns, args, getattr(trainer, "_formats_rows", False))
    for split, dataset in datasets.items():
        check(dataset, split)
        # the columns only: DPO's and the reward trainer's own checks read the rows of their preference data too
        check_dataset_columns(dataset, split, needed, allow_images=trainer._supports_vision, rows=False)
    return dataset_sizes(datasets)


def _checked_models(trainer) -> tuple[list, VirtualTokens | None]:
    """The models the layouts run (the policy, and a reference model where the trainer holds one), unwrapped, after
    the checks that need the model as TRL prepared it (dropout, the architecture), and the virtual tokens of the
    policy's prompt-learning adapter, if it has one (read on its PEFT wrapper, `support.check_prompt_learning`)."""
    models = [unwrap_model(trainer.model)]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(unwrap_model(trainer.ref_model))
    config = prompt_learning_config(trainer.model)
    name = type(trainer).__name__
    virtual = check_prompt_learning(name, config, trainer._virtual_tokens_refused, trainer.args, models[0].config)
    check_no_dropout(models[0])
    return models, virtual


#: why the start-up check judges a model whose layouts move a prompt's start (`_shifts`)
SHIFTED = (
    "prompts of other lengths share their start at moved positions (measured shift-invariant for this type; "
    "checked on the model itself)"
)


def _shifts(trainer, models) -> bool:
    """Whether the trainer's layouts share a start between prompts of other lengths (`trie.StockRows.shift`): rows
    TRL generates (left-padded, so a shorter prompt's start sits at later positions), a join that shares what prompts
    start with (`"always"`, `"auto"`), and models measured shift-invariant (`architectures.shift_invariant`)."""
    if not trainer.prefix_sharing or spec_of_class(type(trainer)).data != "prompts":
        return False
    return moves_positions(getattr(trainer.args, "prefix_sharing_join", "prompts"), [m.config for m in models])


def _new_session(trainer, models, virtual: VirtualTokens | None = None, shift: bool = False) -> PrefixSharingSession:
    """The trainer's session: its models on the kernel the config asks for (`"auto"`: chosen here, and measured per
    micro-batch against the other candidates, `tuning.py`); prefix tuning's virtual keys and values (`virtual`) on a
    dense mask only."""
    args = trainer.args
    requested = args.prefix_sharing_attn_implementation
    dense_only = virtual is not None and virtual.kind == CACHE
    dtype = attention_dtype(models[0], trainer.accelerator.mixed_precision)
    backend = choose_backend(models, "sdpa" if dense_only else requested, trainer.accelerator.device, dtype)
    join = getattr(args, "prefix_sharing_join", "prompts")
    alternatives, stock_rows = _measured_candidates(trainer, models, requested, join, dtype)
    alternatives = tuple(b for b in alternatives if b.dense or not dense_only)
    return PrefixSharingSession(
        models,
        trainer.processing_class,
        backend,
        pad_to_multiple_of=getattr(args, "pad_to_multiple_of", None),
        fuse_lm_head=trainer._fuse_lm_head,
        checks=getattr(args, "prefix_sharing_checks", None),
        autocast=trainer.accelerator.autocast,
        join=join,
        alternatives=alternatives,
        stock_rows=stock_rows,
        virtual=virtual,
        shift=shift,
    )


class PrefixSharingMixin:
    """Placed before TRL's trainer class (and after `PackingMixin`). A trainer calls `_init_prefix_sharing(...)` before
    TRL's `__init__` and `_finish_prefix_sharing_init()` after it, and `_startup_check(...)` on the stock rows of a
    batch before it lays them out. It delegates to named objects: `sharing_session` (the models, their kernel and
    patches, the layouts), `model_check` (the start-up check; both None while the trainer runs as stock TRL),
    `shared_positions` (what sharing saves, logged) and `patch_scope` (the patches for the length of `train()`,
    `evaluate()` and `predict()`)."""

    #: the config class with the prefix-sharing fields (set by each trainer)
    _config_class: type
    #: read by the configs: a trainer without it (a stock TRL class) given `prefix_sharing=True` is an error
    _reads_prefix_sharing_config = True
    #: whether `num_shared_tokens` resumes from a checkpoint (True, as GRPO's and RLOO's `num_tokens` does) or restarts
    #: (as the DPO, reward and KTO trainers restart their `num_tokens`)
    _resumes_shared_positions = True
    #: whether the trainer lays out images for prefix sharing (DPO: yes; reward, GRPO, RLOO, online DPO: no)
    _supports_vision = False
    #: whether the models get TRL's fused log-prob head from this package (trainers that score full logits in stock)
    _fuse_lm_head = False
    #: why the trainer does not lay out the virtual tokens of prompt-learning PEFT (`virtual.py`), None where it does
    _virtual_tokens_refused: str | None = (
        "its shared forward does not lay out PEFT's virtual tokens (prefix sharing does for SFTTrainer and DPOTrainer)"
    )

    def __init_subclass__(cls, **kwargs):
        """A class over a TRL trainer is checked, when it is created, against the TRL internals its entry in the table
        of trainers lists (`trainers.guard_trainer_class`): every trainer, by construction."""
        super().__init_subclass__(**kwargs)
        guard_trainer_class(cls)

    def _init_prefix_sharing(self, model, args, processing_class, peft_config=None, datasets=None) -> None:
        """Before TRL's `__init__`: read the options and check what can be checked (the config class, the model, the
        processor and the `datasets`, {"train": ..., "eval": ...})."""
        self.sharing_session = None
        self.model_check = None
        self.shared_positions = SharedPositions(self)
        self.patch_scope = PatchScope(self)
        self._dataset_sizes = {}
        warn_if_not_our_config(args, self._config_class, type(self).__name__)
        warn_if_fewer_processes_than_asked()
        self._prefix_sharing = bool(getattr(args, "prefix_sharing", False))
        self._init_packing(args)
        if self._uses_layout:
            self._dataset_sizes = _check_arguments(self, model, args, processing_class, peft_config, datasets or {})

    def _init_packing(self, args) -> None:
        """Packing's options (see `PackingMixin`); trainers without packing have none."""
        self._packing = False

    @property
    def prefix_sharing(self) -> bool:
        """Whether this trainer shares prefixes (the config's `prefix_sharing`, until `remove_prefix_sharing()`)."""
        return getattr(self, "_prefix_sharing", False)

    @property
    def packing(self) -> bool:
        return getattr(self, "_packing", False)

    @property
    def _uses_layout(self) -> bool:
        """Prefix sharing and packing both run the model on the shared layout."""
        return self.prefix_sharing or self.packing

    def _setup_prefix_sharing(self) -> None:
        """After TRL's `__init__` (or from inside it, on first use): the session, the start-up check, and for
        preference trainers the collator. Idempotent."""
        if self.sharing_session is not None or not self._uses_layout:
            return
        models, virtual = _checked_models(self)
        name = type(self).__name__
        reasons = [check_architecture(model.config, name, self._supports_vision) for model in models]
        shift = _shifts(self, models)
        if shift:  # the start-up check confirms it on the model itself
            reasons = [reason or SHIFTED for reason in reasons]
        mode = getattr(self.args, "prefix_sharing_model_check", "auto")
        self.model_check = StartupCheck(models, reasons, mode, shifted=shift)
        self.sharing_session = _new_session(self, models, virtual, shift)
        self._setup_collator()
        self.add_callback(_ForwardInPlace(self))
        if self.prefix_sharing and self._resumes_shared_positions:
            self.add_callback(_SharedPositionsState(self))

    def _startup_check(self, input_ids, attention_mask, prompt_lengths=None, examples=None) -> None:
        """The start-up check's phase (`StartupCheck`): once, on stock rows of the first batch, before anything of it
        is laid out. `prompt_lengths` or `examples`: what the rows' prompts and examples are, each a tensor or a
        function that makes it, called only while the check is pending (the steps after it pay nothing for them)."""
        if self.model_check is not None and self.model_check.pending:
            prompt_lengths, examples = (value() if callable(value) else value for value in (prompt_lengths, examples))
            self.model_check.run(self.sharing_session, input_ids, attention_mask, prompt_lengths, examples)
        if self.sharing_session is not None and self.sharing_session.tuning.pending:
            _measure(self, input_ids, attention_mask, prompt_lengths, examples)

    def _finish_prefix_sharing_init(self) -> None:
        """The end of the trainer's `__init__`: the session set up, the models left as TRL leaves them (the
        patches are attached by `train()`, `evaluate()` and `predict()` for their length)."""
        self._setup_prefix_sharing()
        if self.sharing_session is not None:
            self.sharing_session.detach()
        datasets = {"train": self.train_dataset, "eval": self.eval_dataset}
        check_rows_left(self._dataset_sizes, datasets, type(self).__name__, getattr(self.args, "max_length", None))

    def _init_prefix_sharing_from(self, args: tuple, kwargs: dict) -> None:
        """`_init_prefix_sharing` with the arguments a trainer's `__init__` got and hands on to TRL's as they are,
        read by the names of TRL's `__init__`."""
        trl_class = next(cls for cls in type(self).__mro__ if cls.__module__.startswith("trl."))
        given = inspect.signature(trl_class.__init__).bind(self, *args, **kwargs).arguments
        datasets = {"train": given.get("train_dataset"), "eval": given.get("eval_dataset")}
        names = ("model", "args", "processing_class", "peft_config")
        self._init_prefix_sharing(*(given.get(name) for name in names), datasets)

    def _setup_collator(self) -> None:
        """Preference trainers wrap their collator (see `PreferenceSharingMixin`); online trainers lay out in the
        forward."""

    def remove_prefix_sharing(self) -> None:
        """Undo the model patches (and the collator wrap): the trainer then trains as stock TRL. The config is left as
        it was given."""
        if self.sharing_session is not None:
            self.sharing_session.detach()
            self.sharing_session = None
        if isinstance(getattr(self, "data_collator", None), PrefixSharingCollator):
            self.data_collator = self.data_collator.base_collator
        self._prefix_sharing = False
        self._packing = False
        self.shared_positions.total = None

    def train(self, *args, **kwargs):
        with self.patch_scope():
            return super().train(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with self.patch_scope():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self.patch_scope():
            return super().predict(*args, **kwargs)

    def log(self, logs, start_time=None):
        total = self.shared_positions.total if self.sharing_session is not None else None
        if total is not None and self.model.training:
            logs = {**logs, "num_shared_tokens": int(total)}
        return super().log(logs, start_time)

    def end(self) -> None:
        """Finish the trackers and destroy the process group, as transformers' `Trainer.end()` (TRL's scripts call it
        last, after training, evaluation and saving). The distributed model wrapper is freed first, while every rank
        still holds the group: freed after the group was gone, its teardown could block forever on CPUs."""
        release_distributed_wrappers(self)
        super().end()
