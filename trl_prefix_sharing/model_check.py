"""The start-up check: judge a model on the model itself, before it trains with the shared layout.

The registry (`architectures`) decides by model type, measured on tiny configs. A model it has
not measured (custom code under its own `model_type`, a type from a newer transformers, an option the sweep did not
try such as a sliding window) is judged here instead: the first batch the trainer lays out gives a few examples (up to
two prompts with at least two completions each), and the model runs them without gradients, in eval mode, three ways:

- **stock**: the rows `[prompt | completion]` right-padded, as plain rows (the model's own positions and mask);
- **stock, padded otherwise**: the same rows in reverse order with extra padding columns, which changes only the
  shapes the kernels see: the *spread*, the model's own numerical noise between two stock layouts of the same rows;
- **shared**: the rows' prefix-shared layout through the trainer's own shared forward (its mask and position ids).

The compared values are the per-token log-probs of every real token (a causal LM, through TRL's fused log-prob head as
the trainers score them) or the rewards (a sequence classifier). The shared layout passes when its largest
difference from stock is within `max(TOLERANCE[dtype], SPREAD_FACTOR * spread)`: the floor calibrated per compute
dtype on the spread of stock layouts (`scripts/calibrate_model_check.py`, results in
`docs/benchmarks/model_check.md`), widened by the model's own measured spread (a deep model in bfloat16 is noisier
than any tiny one). Under several processes every rank checks its own batch and all ranks take the largest difference
and spread, so they agree on the verdict. A model with a sliding window gets prompts at least one window long (its
prompt tokens repeated), so a window counted in row positions shows; every prompt is at least `MIN_PROMPT` tokens long
(the same way), so the completions after the first read it from other row distances than in their own rows.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers.utils import logging

from .trie import StockRows


__all__ = [
    "MODES",
    "TOLERANCE",
    "check_layout_fn",
    "unequal_prompts",
    "SPREAD_FACTOR",
    "ModelCheckResult",
    "StartupCheck",
    "examples_to_check",
    "distributed",
    "run_model_check",
]

logger = logging.get_logger(__name__)

#: `prefix_sharing_model_check`: for the models the measured registry does not cover, or for every model
MODES = ("auto", "always")

#: the floor of the tolerance on the largest per-token log-prob (or reward) difference, by compute dtype: above the
#: largest shared-vs-stock difference of the calibration models (float32 4e-5; bfloat16 0.2 on the custom models, 0.34
#: on the trained SmolLM2-135M-Instruct, whose bfloat16 spread widens its tolerance to 0.96) and under the smallest
#: difference of their broken layouts (above 1.6 nats in both; 1.8 on the trained model),
#: `docs/benchmarks/model_check.md`; float16 (3 more mantissa bits than bfloat16) a fifth of bfloat16's
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-1, torch.bfloat16: 5e-1}
#: the tolerance grows with the model's own spread between two stock paddings of the same rows
SPREAD_FACTOR = 4.0
#: how many prompts, and completions per prompt, the check runs
MAX_PROMPTS, MAX_COMPLETIONS = 2, 4
#: the shortest prompt the check runs (shorter ones get their tokens repeated in front)
MIN_PROMPT = 8


@dataclass
class ModelCheckResult:
    """What the start-up check measured (the largest values over every rank)."""

    difference: float
    spread: float
    tolerance: float
    dtype: torch.dtype
    compared: str
    rows: int
    values: int
    seconds: float
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.difference <= self.tolerance

    def summary(self) -> str:
        return (
            f"shared vs stock {self.compared}: largest difference {self.difference:.3g} "
            f"(tolerance {self.tolerance:.3g} in {str(self.dtype).removeprefix('torch.')}; "
            f"two stock paddings differ by {self.spread:.3g}), "
            f"{self.values} values of {self.rows} rows, {self.seconds:.2f} s"
        )


def examples_to_check(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor | None = None,
    examples: torch.Tensor | None = None,
) -> list[tuple[list[int], list[list[int]]]]:
    """The check's examples from a batch of stock rows (right or left padded): `[(prompt, [completion, ...])]`, up
    to `MAX_PROMPTS` prompts in the order they first appear, each with 2 to `MAX_COMPLETIONS` distinct, non-empty
    completions, the longest first (a prompt with fewer borrows another prompt's completions, or its own tokens
    reversed).

    Args:
        prompt_lengths: `[R]` the real prompt tokens of each row; None: the common start of the rows of each example
            (`examples`; a reward batch).
        examples: `[R]` the example of each row (used when `prompt_lengths` is None).
    """
    mask = attention_mask.bool().cpu()
    rows = [ids[keep].tolist() for ids, keep in zip(input_ids.cpu(), mask, strict=True)]  # once, before training
    if prompt_lengths is not None:
        lengths = prompt_lengths.cpu().tolist()
    else:
        example_ids = (examples if examples is not None else torch.zeros(len(rows), dtype=torch.long)).cpu().tolist()
        lengths = []
        for row, example in zip(rows, example_ids, strict=True):
            others = [r for r, e in zip(rows, example_ids, strict=True) if e == example]
            lengths.append(min(_common_length(row, other) for other in others) if len(others) > 1 else len(row))
    groups: dict[tuple, list[list[int]]] = {}
    for row, length in zip(rows, lengths, strict=True):
        if length < 1:
            continue  # a row without a prompt token shares nothing
        prompt = tuple(row[:length])
        if prompt in groups or len(groups) < MAX_PROMPTS:
            groups.setdefault(prompt, []).append(row[length:])
    if not groups:
        raise ValueError("The start-up check found no row with a prompt in the first batch.")
    spares = [completion for completions in groups.values() for completion in completions if completion]
    out = []
    for prompt, completions in groups.items():
        # distinct and not empty, so the second completion sits after the first in the shared row, where its
        # positions and its view of the prompt differ from its row's
        chosen = sorted({tuple(c) for c in completions if c}, key=lambda c: (-len(c), c))[:MAX_COMPLETIONS]
        chosen = [list(c) for c in chosen]
        for candidate in (*spares, list(reversed(prompt))):
            if len(chosen) >= 2:
                break
            if candidate not in chosen:
                chosen.append(list(candidate))
        if len(chosen) < 2:
            chosen.append(chosen[0] + chosen[0][:1])  # distinct by its length
        out.append((list(prompt), chosen))
    return out


def _common_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _stretch(examples, window: int | None, max_positions: int | None):
    """Prompts of at least `MIN_PROMPT` tokens and at least one window long (their tokens repeated in front). The
    second completion of a shared row reads the prompt from further away in the row than in its own row; a model
    that counts positions (or a window) in the row sees other distances there. The last prompt token starts each
    branch again (it predicts each completion's first token), so only a longer prompt is read across branches, and
    a position error that shifts a whole branch alike is invisible to relative positions (RoPE)."""
    out = []
    for prompt, completions in examples:
        longest = len(prompt) + max(len(c) for c in completions)
        need = max(MIN_PROMPT, window or 0) - len(prompt)
        if max_positions is not None:
            need = min(need, max_positions - longest)
        if need > 0:
            prompt = (prompt * (need // len(prompt) + 1))[:need] + prompt
        out.append((prompt, completions))
    return out


def unequal_prompts(examples):
    """The check's examples for a shifted layout (`StockRows.shift`): two prompts of unequal lengths that start
    alike, the first prompt alone and followed by the second (or by its own first half), each with its completions.
    Left-padded (`_tensors(left=True)`), the shorter prompt's common start sits at other columns than the longer
    one's, and the shared layout moves it."""
    (first, completions), *rest = examples
    tail, others = rest[0] if rest else (first[: max(1, len(first) // 2)], completions)
    return [(first, completions), (first + tail, others)]


def _tensors(examples, pad_token_id: int, device, left: bool = False):
    """The examples' rows `[prompt | completion]`, right-padded; `left`: as TRL's generated rows, each prompt
    left-padded to the longest prompt, then its completion, right-padded."""
    rows, prompt_lengths, example_ids = [], [], []
    for number, (prompt, completions) in enumerate(examples):
        for completion in completions:
            rows.append(prompt + completion)
            prompt_lengths.append(len(prompt))
            example_ids.append(number)
    lead = [max(prompt_lengths) - length if left else 0 for length in prompt_lengths]
    width = max(len(row) + pad for row, pad in zip(rows, lead, strict=True))
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, pad) in enumerate(zip(rows, lead, strict=True)):
        input_ids[i, pad : pad + len(row)] = torch.tensor(row)
        attention_mask[i, pad : pad + len(row)] = 1
    return (
        input_ids.to(device),
        attention_mask.to(device),
        torch.tensor(prompt_lengths, device=device),
        torch.tensor(example_ids, device=device),
    )


def compute_dtype(model, device) -> torch.dtype:
    """The dtype the model computes in: autocast's where it is on, else its output embedding's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    embeddings = model.get_output_embeddings() or model.get_input_embeddings()
    weight = getattr(embeddings, "weight", None)
    if weight is not None and weight.is_floating_point():
        return weight.dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _scores(model, kind: str, input_ids, attention_mask, layout=None):
    """The compared values of every row: `[R, L - 1]` per-token log-probs through TRL's fused head (`kind`
    "fused") with the mask of the scored ones, or `[R, labels]` rewards ("classifier")."""
    shared = {} if layout is None else {"prefix_sharing": layout}
    if kind == "classifier":
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **shared).logits.float()
        return logits, torch.ones_like(logits, dtype=torch.bool)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    valid = (labels[:, 1:] != -100) & attention_mask[:, :-1].bool()  # a token predicted by a token (not padding)
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True, **shared)
    return out.log_probs.float(), valid


def _largest(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (a - b).abs().masked_fill(~valid, 0).amax() if valid.any() else a.new_zeros(())


def distributed() -> bool:
    """Whether torch.distributed runs (the check's verdict is then agreed by all ranks, and logged by rank 0)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _eval_mode(model) -> set:
    """Dropout off (eval mode), except on bitsandbytes' quantized layers, which have no dropout and which, on a CPU in
    eval mode without gradients, repack their weights in place for an inference kernel. Returns the modules that were
    in training mode (each module's mode is put back as it was)."""
    training = {module for module in model.modules() if module.training}
    model.eval()
    for module in training:
        if type(module).__module__.startswith("bitsandbytes."):
            module.training = True
    return training


def run_model_check(
    model,
    examples,
    layout_fn,
    kind: str,
    pad_token_id: int,
    window: int | None = None,
    autocast=None,
    shifted: bool = False,
) -> ModelCheckResult:
    """Run the start-up check on `model` (the unwrapped model, its shared forward installed).

    Args:
        examples: from `examples_to_check`.
        layout_fn: `layout_fn(input_ids, attention_mask, prompt_lengths, examples)`: the shared layout, with its
            mask, that the trainer builds for such rows.
        kind: `"fused"` (a causal LM with TRL's fused log-prob head) or `"classifier"` (a reward model).
        window: the model's sliding window (prompts are stretched to it).
        autocast: the trainer's `accelerator.autocast` (the check runs in the precision training runs in).
        shifted: the rows are laid out as TRL's generated rows (left-padded, scored without position ids), with two
            prompts of unequal lengths that start alike (`unequal_prompts`), for a layout that moves a shorter prompt's
            start (`StockRows.shift`). The other stock layout still pads after the rows: its spread is the kernels'
            noise, not what moved positions change (on a model with absolute positions stock's own numbers move with
            its left padding, and the check must see that as a difference).
    """
    start = time.perf_counter()
    text_config = model.config.get_text_config()
    examples = _stretch(examples, window, getattr(text_config, "max_position_embeddings", None))
    if shifted:
        examples = unequal_prompts(examples)
    device = next(model.parameters()).device
    input_ids, attention_mask, prompt_lengths, example_ids = _tensors(examples, pad_token_id, device, left=shifted)
    extra = 8  # the other stock layout: rows reversed, 8 more padding columns after them (no position moves)
    other_ids = torch.nn.functional.pad(input_ids.flip(0), (0, extra), value=pad_token_id)
    other_mask = torch.nn.functional.pad(attention_mask.flip(0), (0, extra), value=0)
    error, difference, spread, values = None, None, None, 0
    dtype = torch.float32
    training = _eval_mode(model)
    try:
        with torch.no_grad(), autocast() if autocast is not None else contextlib.nullcontext():
            dtype = compute_dtype(model, device)
            try:
                stock, valid = _scores(model, kind, input_ids, attention_mask)
                other, _ = _scores(model, kind, other_ids, other_mask)
                other = other.flip(0)[:, : stock.shape[1]]
                layout = layout_fn(input_ids, attention_mask, prompt_lengths, example_ids)
                shared, _ = _scores(model, kind, input_ids, attention_mask, layout)
                difference, spread = _largest(shared, stock, valid), _largest(other, stock, valid)
                values = int(valid.sum())
                if not torch.isfinite(stock).all():
                    raise ValueError("the stock rows themselves give non-finite values")
            except Exception as exc:  # noqa: BLE001 - reported as the verdict, on every rank
                error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            measured = torch.tensor(
                [float("inf"), float("inf")] if error else [difference, spread], device=device, dtype=torch.float32
            )
            if distributed() and torch.distributed.get_world_size() > 1:
                torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
    finally:
        for module in model.modules():
            module.training = module in training
    difference, spread = measured.tolist()  # once, before training
    if error is None and difference == float("inf"):
        error = "the check failed on another process (its error is in that process's log)"
    tolerance = max(TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16]), SPREAD_FACTOR * spread)
    compared = "rewards" if kind == "classifier" else "per-token log-probs"
    return ModelCheckResult(
        difference=difference,
        spread=spread,
        tolerance=tolerance,
        dtype=dtype,
        compared=compared,
        rows=int(input_ids.shape[0]),
        values=values,
        seconds=time.perf_counter() - start,
        error=error,
    )


def check_layout_fn(session, shifted: bool = False):
    """The check's `layout_fn` (`run_model_check`): the rows' layout as the trainer's `session` builds it; `shifted`:
    the layout that moves the shorter prompt's start (`StockRows.shift`, joined `"always"`), whatever `"auto"` would
    choose for these few rows."""

    def layout_fn(ids, mask, lengths, example_ids):
        if shifted:
            return session.layout(StockRows(ids, mask, prompt_lengths=lengths, shift=True), join="always")
        return session.layout(StockRows(ids, mask, prompt_lengths=lengths, examples=example_ids))

    return layout_fn


class StartupCheck:
    """The start-up check as a phase of its own: the trainer runs it once, on the stock rows of its first batch,
    before it lays out anything (`run`); no layout call enters it.

    Args:
        models: the trainer's models (policy first), unwrapped.
        reasons: for each model, why the check must judge it (None: the registry measured its type equal).
        mode: `prefix_sharing_model_check`: `"auto"` judges the models with a reason, `"always"` every model.
        shifted: the trainer's layouts move the start a prompt shares with prompts of other lengths
            (`StockRows.shift`): the check runs such prompts, left-padded, against that layout (`run_model_check`).
    """

    def __init__(self, models, reasons, mode: str = "auto", shifted: bool = False):
        from .vision import is_vision_config

        if mode == "always":
            if any(is_vision_config(model.config) for model in models):
                raise ValueError(
                    "`prefix_sharing_model_check='always'` runs text rows; a vision-language model is judged by its "
                    "measured registry entry. Set `prefix_sharing_model_check='auto'`."
                )
            reasons = [reason or "requested (`prefix_sharing_model_check='always'`)" for reason in reasons]
        #: the models still to judge, and why (empty: none, or the check has run)
        self.pending = [(model, reason) for model, reason in zip(models, reasons, strict=True) if reason]
        #: what the check measured (the policy's result when it checked several models)
        self.result: ModelCheckResult | None = None
        self.shifted = shifted

    def run(self, session, input_ids, attention_mask, prompt_lengths=None, examples=None) -> None:
        """Judge the pending models on a few examples of these stock rows, once: each run as stock rows and as the
        rows' shared layout from `session` (without gradients). Logs the measured difference in one line; raises,
        naming it, when the shared layout does not give the model's stock numbers."""
        if not self.pending:
            return
        if prompt_lengths is None and examples is None:
            raise ValueError("The start-up check needs the prompt lengths or the examples of the rows.")
        from .architectures import window_layout
        from .forward import _is_sequence_classifier

        pending, self.pending = self.pending, []
        rows = examples_to_check(input_ids, attention_mask, prompt_lengths=prompt_lengths, examples=examples)

        layout_fn = check_layout_fn(session, self.shifted)
        session.attach()
        router, session.router = session.router, None  # the check's stock rows run as stock
        try:
            for model, reason in pending:
                kind = "classifier" if _is_sequence_classifier(model) else "fused"
                window = window_layout(model.config)[0]
                result = run_model_check(
                    model,
                    rows,
                    layout_fn,
                    kind,
                    session.pad_token_id,
                    window=window,
                    autocast=session.autocast,
                    shifted=self.shifted,
                )
                self._judge(model, reason, result)
        finally:
            session.router = router

    def _judge(self, model, reason: str, result: ModelCheckResult) -> None:
        if self.result is None:
            self.result = result
        name = f"'{model.config.get_text_config().model_type}' ({type(model).__name__})"
        if result.error is not None:
            raise ValueError(
                f"Prefix sharing is refused for {name}: the start-up check could not run a few examples of the first "
                f"batch as prefix-shared rows ({result.error}). Train it with `prefix_sharing=False`."
            )
        if not result.passed:
            raise ValueError(
                f"Prefix sharing is refused for {name}: the start-up check ran a few examples of the first batch as "
                f"stock rows and as prefix-shared rows, and they differ ({result.summary()}). The model does not give "
                "its own numbers under the shared layout's attention mask and position ids. Train it with "
                "`prefix_sharing=False`."
            )
        if not distributed() or torch.distributed.get_rank() == 0:
            logger.warning(f"Prefix sharing: start-up check of {name}, {reason}: equal ({result.summary()}).")
