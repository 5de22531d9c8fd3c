"""What training lays out: each micro-batch of `--per_device_train_batch_size` consecutive examples collated by the
trainer's own collator and laid out by training's `layout.build_layout`, which under `prefix_sharing_join="auto"`
keeps, per micro-batch, the plan (`prompts` or `always`) of least estimated cost: the cost model of the model given
(`cost.StepCost`, read from the model built from its config on the meta device, no weights) under a kernel's rows and
cost (`KERNELS`). DPO, reward and SFT: the collator is `PrefixSharingCollator` (under `--prefix_sharing_join`), which
lays out the batch. ORPO and CPO build their stock rows in the step (TRL's `concatenated_inputs`), KTO its main and KL
rows (`kto_trainer._SharedKTOBatch`): laid out as training's session lays them out (`LayoutSession`). GRPO, RLOO and
online DPO score the rows they generate, `[left-padded prompt | completion]`: laid out as the trainer's session lays
them out (`GeneratedLayouts`), each completion assumed. The positions counted are those a training run logs as
`num_shared_tokens` (`tests/tools/test_stats_sft.py`, `tests/tools/test_stats_trained.py`,
`tests/tools/test_stats_generated.py`)."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field


#: the kernels the counts lay out for, with what the report says of each: SDPA, which `"auto"` takes on the CPU and
#: whose dense cost (every query-key pair of a row) makes joining rows dearest, and varlen, which `"auto"` tries first
#: on CUDA (one unpadded row, the visible pairs only; FlexAttention too pays for those only)
KERNELS = {
    "sdpa": "with SDPA (dense, the CPU's kernel):",
    "varlen": "with varlen (CUDA's first kernel):",
}


def cost_model(config, tokenizer, head: str, trust_remote_code: bool = False):
    """The model training's cost model is read from (`cost.StepCost.of_model`): the model of `config` built on the
    meta device (no weights, no memory), with the `head` the trainer trains (`TrainerSpec.model_head`). Where there is
    no config (a `str` saying why) or it cannot be built, a one-layer stand-in (`prepared.stand_in_model`) and a note
    saying so; else the note is None."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..prepared import stand_in_model

    why = config if isinstance(config, str) else "no config was read" if config is None else None
    if why is None:
        auto = AutoModelForSequenceClassification if head == "sequence_classification" else AutoModelForCausalLM
        try:
            with torch.device("meta"):
                return auto.from_config(config, trust_remote_code=trust_remote_code), None
        except Exception as error:  # a config transformers reads but cannot build a model of: say so, count on
            why = f"its model could not be built from its config ({type(error).__name__})"
    note = f"the plans are chosen by the cost of a one-layer stand-in model, not the model's: {why}"
    return stand_in_model(tokenizer, head), note


def kernel_collators(collator, model) -> dict:
    """`collator` (the trainer's `PrefixSharingCollator`) as training runs it under each kernel of `KERNELS`: that
    kernel's rows and `model`'s cost model under it, no measured choice (`tuning`)."""
    from ...attention import BACKENDS

    collators = {}
    for name in KERNELS:
        clone = copy.copy(collator)
        clone.rows, clone.cost, clone.tuning = BACKENDS[name].rows(None), BACKENDS[name].cost(model), None
        collators[name] = clone
    return collators


class LayoutSession:
    """What training's `PrefixSharingSession` lays out of the stock rows a trainer builds in its step (ORPO, CPO, KTO:
    `session.layout`) with the kernel `kernel` of `KERNELS` fixed: `build_layout` under `join`, with the candidates
    training's session has then (`tuning.Tuning.of_session`: that kernel's rows and `model`'s cost model under it).
    No models to patch and no attention inputs: only the layout."""

    pad_to_multiple_of = None

    def __init__(self, kernel: str, model, pad_token_id: int, join: str):
        from ...attention import BACKENDS
        from ...tuning import Tuning

        self.backend, self.models, self.pad_token_id, self.join = BACKENDS[kernel], [model], pad_token_id, join
        self.tuning = Tuning.of_session(self)

    def layout(self, stock, plans=None):
        """The layout of `stock` (`plans`: its plans under the session's join, if already made)."""
        from ...layout import build_layout

        return build_layout(stock, pad_token_id=self.pad_token_id, plan=plans, join=self.join, tuning=self.tuning)


def layout_sessions(trainer, model) -> dict[str, LayoutSession]:
    """The session of the trainer `trainer` (its pad id, its config's `prefix_sharing_join`) under each kernel of
    `KERNELS`, `model`'s cost model choosing."""
    pad, join = trainer.sharing_session.pad_token_id, trainer.args.prefix_sharing_join
    return {name: LayoutSession(name, model, pad, join) for name in KERNELS}


@dataclass
class TrainedCounts:
    """What training lays out under one kernel: layouts per join rule, micro-batches, and positions, stock and shared.
    SFT also keeps the chosen plans' lengths (`plan`, a `counting._SFTPlanCounts`); KTO the micro-batches whose
    policy's pass merges its main and KL rows (`merged`) and the positions of a training step (`step`)."""

    joins: Counter = field(default_factory=Counter)  # join rule -> layouts built by it (KTO: of the policy's pass)
    batches: int = 0
    examples: int = 0
    stock_tokens: int = 0
    stock_padded: int = 0  # stock's rows: each micro-batch's rows x its width
    tokens: int = 0  # the positions the shared rows hold: what training logs as `num_shared_tokens`
    padded: int = 0  # the shared rows, padding included: rows x width
    plan: object = None
    merged: int | None = None
    step: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # stock tokens, padded; shared tokens, padded

    def add(self, batch, layout, examples: int) -> None:
        """Add one micro-batch of `examples` examples: its stock rows (`batch`) and its `layout`."""
        self.add_pass([layout], [batch["attention_mask"]], examples)

    def add_pass(self, layouts, masks, examples: int) -> None:
        """Add one micro-batch of `examples` examples: the `layouts` its policy's training forward ran and the
        attention `masks` of the stock rows they stand for (what a run counts: `SharedPositions.count`)."""
        self.batches += 1
        self.examples += examples
        for layout in layouts:
            self.joins[layout.join] += 1
            self.tokens += int(layout.num_positions)
            self.padded += layout.input_ids.numel()
        for mask in masks:
            self.stock_tokens += int(mask.sum())
            self.stock_padded += mask.numel()

    def add_step(self, stock: list, shared: list) -> None:
        """Add the passes of one training step: `(attention mask, weight)` of stock's rows, `(layout, weight)` of the
        shared rows (a pass with gradients weighted 3, for its backward)."""
        for mask, weight in stock:
            self.step[0] += weight * int(mask.sum())
            self.step[1] += weight * mask.numel()
        for layout, weight in shared:
            self.step[2] += weight * int(layout.num_positions)
            self.step[3] += weight * layout.input_ids.numel()

    @property
    def figures(self) -> list[float]:
        """The ideals: stock / shared tokens, and with padding (KTO: those of a training step)."""
        if self.step[2]:
            return [self.step[0] / self.step[2], self.step[1] / max(self.step[3], 1)]
        return [self.stock_tokens / max(self.tokens, 1), self.stock_padded / max(self.padded, 1)]


def measure_trained(dataset, collator, model, batch_size: int) -> dict[str, TrainedCounts]:
    """DPO or reward: each micro-batch of `batch_size` consecutive prepared examples collated by the trainer's
    `collator` and laid out as training does, under each kernel of `KERNELS` (`model`: whose cost model chooses)."""
    from .counting import _batches

    collators = kernel_collators(collator, model)
    counts = {name: TrainedCounts() for name in collators}
    for examples in _batches(dataset, batch_size, "Laying out"):
        batch = collator.base_collator(examples)
        plans = collator.plans(batch)
        for name, kernel in collators.items():
            counts[name].add(batch, kernel.layout(batch, plans), len(examples))
    return counts


def measure_paired(trainer, model, batch_size: int) -> dict[str, TrainedCounts]:
    """ORPO/CPO: each micro-batch of `batch_size` consecutive prepared examples (`trainer.train_dataset`) collated by
    the `trainer`'s collator, its chosen and rejected rows concatenated by TRL's `concatenated_inputs` and laid out as
    `concatenated.ConcatenatedSharingMixin.concatenated_forward` lays them out (row i and row B + i are pair i; each
    row's padding scored where the config's `prefix_sharing_score_padding` says), under each kernel of `KERNELS`."""
    import torch

    from ...trie import StockRows
    from .counting import _batches

    sessions = layout_sessions(trainer, model)
    counts = {name: TrainedCounts() for name in sessions}
    score_padding = trainer.args.prefix_sharing_score_padding
    for examples in _batches(trainer.train_dataset, batch_size, "Laying out"):
        concatenated = trainer.concatenated_inputs(
            trainer.data_collator(examples), is_encoder_decoder=False, padding_value=trainer._padding_value
        )
        mask = concatenated["concatenated_attention_mask"]
        pairs = torch.arange(len(examples)).repeat(2)
        stock = StockRows(concatenated["concatenated_input_ids"], mask, examples=pairs, score_padding=score_padding)
        for name, session in sessions.items():
            counts[name].add_pass([session.layout(stock)], [mask], len(examples))
    return counts


def measure_kto(trainer, model, batch_size: int) -> dict[str, TrainedCounts]:
    """KTO: each micro-batch of `batch_size` consecutive prepared examples collated by the `trainer`'s collator, its
    main and KL rows laid out by training's own `kto_trainer._SharedKTOBatch` under each kernel of `KERNELS`: the
    policy's pass (what a run counts), merged where the trainer's `_merge_kl` merges it, else the main rows and the KL
    rows one layout each; and a training step: that pass, weighted 3 where it has gradients (the main rows, or the
    merged ones) for its backward, and the reference's, which always merges."""
    import torch

    from ...kto_trainer import _SharedKTOBatch
    from .counting import _batches

    sessions = layout_sessions(trainer, model)
    counts = {name: TrainedCounts(merged=0) for name in sessions}
    for examples in _batches(trainer.train_dataset, batch_size, "Laying out"):
        batch = trainer.data_collator(examples)
        for name, session in sessions.items():
            shared = _SharedKTOBatch(session, batch, stash_kl=False)
            kl = trainer.calculate_KL and shared.kl is not None
            with torch.enable_grad():  # the rule of the policy's pass, which has gradients
                shared.policy_merged = bool(kl and trainer._merge_kl(shared))
            layouts, *masks = shared.policy_positions(trainer.calculate_KL)
            layouts = layouts if isinstance(layouts, list) else [layouts]
            counts[name].add_pass(layouts, masks, len(examples))
            counts[name].merged += shared.policy_merged
            reference = shared._layout("merged" if kl else "main")
            stock = _weighted(masks) + [(mask, 1) for mask in masks]  # the policy's pass, then the reference's
            counts[name].add_step(stock, _weighted(layouts) + [(reference, 1)])
    return counts


def generated_shift(join: str, config) -> tuple[bool, str]:
    """Whether training's layouts of generated rows move a prompt's tokens to other positions, so that prompts of any
    length share their start (`trie.StockRows.shift`), as the trainer decides it (`architectures.moves_positions`) for
    `join` and the model of `config` (a `str`: why there is none); and the report's words on it."""
    from ...architectures import moves_positions, shift_invariant

    if join == "prompts":
        return (
            False,
            "not moved: prefix_sharing_join=prompts joins a prompt's own rows (and a duplicate prompt's) only",
        )
    one_length = "a start is shared only between prompts of one length (the same left padding)"
    if config is None or isinstance(config, str):
        return False, f"not known: no config of the model was read; counted as not moved, {one_length}"
    if not moves_positions(join, [config]):
        return False, f"not moved, {one_length}: {shift_invariant(config)}"
    return True, (
        "moved: a start that prompts of any length share (a system prompt, tool schemas) is computed once, each "
        f"prompt's tokens moved to its shared row's positions ('{config.model_type}' is measured shift-invariant: its "
        "numbers do not change when a row's tokens all move by the same amount; training confirms it on its first "
        "batch)"
    )


def generated_batch(rows: list[list[int]], completion_length: int, pad_token_id: int):
    """One micro-batch of generated rows as TRL scores them: each of `rows` (a prompt's token ids, once per
    generation) left-padded to the longest, then a completion of `completion_length` tokens of its own (ids that no
    prompt of the batch holds, and no other completion: completions share nothing beyond their prompt). Returns the
    rows' `input_ids`, `attention_mask` and prompt columns."""
    import torch

    width = max(map(len, rows))
    fresh = 1 + max([pad_token_id, *(token for row in rows for token in row)])
    input_ids = torch.full((len(rows), width + completion_length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for number, row in enumerate(rows):
        input_ids[number, width - len(row) : width] = torch.tensor(row, dtype=torch.long)
        attention_mask[number, width - len(row) :] = 1
    completions = torch.arange(len(rows) * completion_length, dtype=torch.long).view(len(rows), completion_length)
    input_ids[:, width:] = fresh + completions
    return input_ids, attention_mask, width


class GeneratedLayouts:
    """What a GRPO, RLOO or online DPO trainer's session lays out of the rows it generates (`session.generated_layout`)
    under each kernel of `KERNELS`, `model`'s cost model choosing under `join`: each micro-batch's rows
    (`generated_batch`) as `StockRows.generated` with the session's `shift` (`generated_shift`) and, for online DPO,
    `score_padding` (its statistics score each row's padding)."""

    def __init__(self, model, pad_token_id: int, join: str, completion_length: int, shift: bool, score_padding: bool):
        self.sessions = {name: LayoutSession(name, model, pad_token_id, join) for name in KERNELS}
        self.counts = {name: TrainedCounts() for name in KERNELS}
        self.pad_token_id, self.join, self.completion_length = pad_token_id, join, completion_length
        self.shift, self.score_padding = shift, score_padding

    def add(self, rows: list[list[int]], prompts: int) -> None:
        """Add one micro-batch of `prompts` prompts: `rows`, each prompt's token ids once per generation."""
        from ...trie import StockRows, plan_layouts

        input_ids, mask, width = generated_batch(rows, self.completion_length, self.pad_token_id)
        stock = StockRows.generated(
            input_ids, mask, width, score_padding=self.score_padding, check=False, shift=self.shift
        )
        plans = plan_layouts(stock, joins=(self.join,))
        for name, session in self.sessions.items():
            self.counts[name].add_pass([session.layout(stock, plans)], [mask], prompts)


def _weighted(passes: list) -> list:
    """The passes of KTO's policy, weighted: the first (the main rows, or the merged ones) has gradients, weighted 3
    for its backward; the KL rows apart have none."""
    return [(item, 3 if number == 0 else 1) for number, item in enumerate(passes)]


def _joins(counts: TrainedCounts, unit: str = "example") -> str:
    """How many micro-batches (KTO: layouts of the policy's pass) each join rule laid out."""
    joined, layouts = counts.joins["always"], sum(counts.joins.values())
    noun = "micro-batches" if layouts == counts.batches else "layouts"
    text = f"{joined:,} of {layouts:,} {noun} joined across {unit}s (always)"
    text += f", {counts.joins['prompts']:,} by prompts" if joined < layouts else ""
    if counts.merged is not None:
        text += (
            f"; the policy's main and KL rows in one layout in {counts.merged:,} of {counts.batches:,} micro-batches"
            + (", one layout each in the others" if counts.merged < counts.batches else "")
        )
    return text


def print_trained(trained: dict[str, TrainedCounts], width: int, what: str = "", unit: str = "example") -> None:
    """The report's lines on what training lays out, one block per kernel (`what`: the pass counted, if not the
    micro-batch's only one; `unit`: what `TrainedCounts.examples` counts)."""
    for name, counts in trained.items():
        n = max(counts.examples, 1)
        ideal, padded = counts.stock_tokens / max(counts.tokens, 1), counts.stock_padded / max(counts.padded, 1)
        print(f"    {KERNELS[name]:<{width - 2}}{_joins(counts, unit)}")
        print(
            f"      {f'tokens per {unit}, shared:':<{width - 4}}{counts.tokens / n:.1f} of stock's "
            f"{counts.stock_tokens / n:.1f}: {ideal:.2f}x ({what}what training logs as num_shared_tokens)"
        )
        print(
            f"      {'with padding, shared:':<{width - 4}}{counts.padded / n:.1f} of stock's "
            f"{counts.stock_padded / n:.1f}: {padded:.2f}x (the positions each computes)"
        )
        if counts.step[2]:
            step_ideal, step_padded = counts.figures
            print(
                f"      {'a training step, shared:':<{width - 4}}{counts.step[2] / n:.1f} of stock's "
                f"{counts.step[0] / n:.1f}: {step_ideal:.2f}x; with padding {counts.step[3] / n:.1f} of "
                f"{counts.step[1] / n:.1f}: {step_padded:.2f}x (the policy's pass, weighted 3 where it has gradients, "
                "and the reference's)"
            )
