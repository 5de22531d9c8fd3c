"""What the prefix-sharing GRPO and RLOO trainers have in common: each prompt's generations scored in one sequence.

TRL samples every prompt G times and scores each generation in its own row, `[left-padded prompt | completion]`;
every forward (the training pass, the old-policy and the reference passes) computes the prompt G times. Here the rows
of one prompt (and of a duplicate prompt) become one trie of the shared layout (`trl_prefix_sharing.layout`),
`[prompt | completion 1 | ... | completion G]`, through the trainer's session (`session.py`):
the same mask and the same forward wrapper as DPO. Stock GRPO passes no position ids, so a token's position is its
column, left padding included; the layout keeps exactly those positions. A layout is built once per set of rows and
kept while their tensors live: the old-policy and reference passes over a generation batch share one, the training
passes over a micro-batch (`num_iterations > 1`) another.

Overrides, each calling TRL's own method (TRL's loss, advantage and metric code runs unchanged):

- `_get_per_token_logps_and_entropies` (every pass) hands TRL's chunk loop a model whose call lays out its chunk
  (rows grouped by equal prompt columns) with its mask, and gathers the log-probs back to TRL's rows.
- `compute_loss` tells the chunk loop which micro-batch it runs on (its layout is kept with its rows); the training
  pass counts its positions (`num_shared_tokens`, see `PrefixSharingMixin`).
- `_prepare_inputs` keeps the generations of a prompt in the same micro-batch: TRL shuffles the generation batch row
  by row (`shuffle_sequence_dict`) before splitting it into `steps_per_generation` micro-batches, so siblings would
  rarely meet. For the duration of TRL's `_prepare_inputs` that one function is `shuffle_keeping_groups`,
  which draws the same `torch.randperm` as TRL (the random stream, hence every later sample, is unchanged) and
  orders whole groups by where TRL's permutation puts their first member.
"""

from __future__ import annotations

import torch

from .sharing import PrefixSharingMixin
from .trie import _COMPARE_CHUNK, pairwise_common_prefix
from .trl_internals import replaced_function
from .virtual import GENERATED_ROWS
from .vision import vision_inputs_in


__all__ = ["GroupSharingTrainerMixin", "shuffle_keeping_groups", "tie_like_stock"]


def shuffle_keeping_groups(batch: dict, group_key: str = "prompt_ids", mask_key: str = "prompt_mask") -> dict:
    """TRL's `shuffle_sequence_dict` with the rows of each group (equal `group_key`/`mask_key` rows) kept together.

    Draws the same `torch.randperm` as TRL, so the random stream is unchanged, then orders whole groups by where that
    permutation puts their first member (members in the order it gives them). Tensor ops on the batch's device; list
    values (if any) read the permutation back once."""
    ids, mask = batch[group_key], batch[mask_key]
    size = len(ids)
    stock = torch.randperm(size)
    rank = torch.empty(size, dtype=torch.long)
    rank[stock] = torch.arange(size)  # rank[i]: where TRL's permutation puts row i
    rank = rank.to(ids.device)
    keys = torch.where(mask.bool(), ids, -1)
    same = pairwise_common_prefix(keys) == keys.shape[1]  # rows of one group
    group_rank = torch.where(same, rank[None, :], size).amin(dim=1)  # where the group's first member goes
    permutation = torch.argsort(group_rank * size + rank)
    host_permutation = None

    def permute(value):
        nonlocal host_permutation
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        if host_permutation is None:
            host_permutation = permutation.tolist()
        return [value[i] for i in host_permutation]

    return {key: permute(value) for key, value in batch.items()}


def tie_like_stock(entropies: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The completion entropies `[R, W]` of TRL's rows (`input_ids`/`attention_mask` `[R, C]`, completions in
    the last `W` columns) made bitwise equal across rows that share every token before a column, as stock's are.

    Stock computes such rows alike, so their entropies there tie exactly. The shared rows compute the first token of a
    branch once per branch (the last common token starts every branch again), equal only to round-off. GRPO's
    `top_entropy_quantile` keeps the tokens whose entropy is at or above a quantile of them: a quantile that falls on
    such a tie keeps all of stock's tied tokens, but only some of the shared rows'. Here each scored entropy becomes
    that of the first row that scores the same column after the same tokens (its own when none does); gradients flow
    through that value. Pairwise over the rows, in chunks of rows."""
    keys = torch.where(attention_mask.bool(), input_ids, -1)
    common = pairwise_common_prefix(keys)  # [R, R]
    rows, width = entropies.shape
    columns = torch.arange(keys.shape[1] - width, keys.shape[1], device=keys.device)  # the column each one scores
    scored = attention_mask[:, -width:].bool()
    first = torch.arange(rows, device=keys.device)[:, None].expand(rows, width).clone()
    step = max(1, _COMPARE_CHUNK // max(rows * width, 1))
    for start in range(0, rows, step):
        # the distribution that scores column c reads columns 0..c-1: rows r and s share it when `common[r, s] >= c`
        shares = (common[start : start + step, :, None] >= columns) & scored[None]  # [r, s, W]
        found = shares.to(torch.uint8).argmax(dim=1)  # the first such s: r itself at the latest, where r scores
        first[start : start + step] = torch.where(scored[start : start + step], found, first[start : start + step])
    return entropies.gather(0, first)


class _SharedRowsModel:
    """What TRL's chunk loop calls as `model(**inputs, labels=..., fused_lm_head=True)`: the model, on the
    prefix-shared layout of the chunk's rows (laid out here, with its mask, once per chunk)."""

    def __init__(self, trainer, model, logits_to_keep: int, source=None):
        self.trainer, self.model, self.logits_to_keep, self.source = trainer, model, logits_to_keep, source

    def __call__(self, **kwargs):
        input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
        whole = self.source is not None and input_ids.shape[0] == self.source[0].shape[0]
        prompt_length = input_ids.shape[1] - self.logits_to_keep
        self.trainer._startup_check(
            input_ids, attention_mask, prompt_lengths=lambda: attention_mask[:, :prompt_length].sum(1)
        )
        layout = self.trainer.sharing_session.generated_layout(
            input_ids, attention_mask, prompt_length, source=self.source if whole else None
        )
        if torch.is_grad_enabled():
            trainer = self.trainer
            note = f" (groups of {trainer.num_generations} generations, {input_ids.shape[0]} rows)"
            trainer.shared_positions.count(layout, attention_mask, note=note)
        return self.model(**kwargs, prefix_sharing=layout)


class GroupSharingTrainerMixin(PrefixSharingMixin):
    """Placed before TRL's `GRPOTrainer` or `RLOOTrainer`; see the module docstring."""

    _virtual_tokens_refused = GENERATED_ROWS

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        *more,
        **kwargs,
    ):
        """Exactly the arguments of TRL's trainer."""
        self._init_prefix_sharing(
            model, args, processing_class, kwargs.get("peft_config"), {"train": train_dataset, "eval": eval_dataset}
        )
        self._loss_inputs = None
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, *more, **kwargs)
        self._finish_prefix_sharing_init()

    @property
    def _trl_module(self) -> str:
        """The module of the TRL trainer class this one extends (whose `shuffle_sequence_dict` is swapped)."""
        return next(cls.__module__ for cls in type(self).__mro__ if cls.__module__.startswith("trl."))

    # ----------------------------------------------------------------------------------------------- every pass
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self.prefix_sharing:
            images = vision_inputs_in(kwargs)
            if images:
                raise ValueError(
                    f"Prefix sharing for {type(self).__name__} is text-only; this batch has {images}. "
                    "Train vision prompts with `prefix_sharing=False`."
                )
            inputs = self._loss_inputs
            source = None
            if inputs is not None:  # the training pass over a micro-batch: its layout is kept with its rows
                source = tuple(
                    inputs[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
                )
            model = _SharedRowsModel(self, model, logits_to_keep, source)
        outputs = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        entropies = outputs[1]
        if self.prefix_sharing and entropies is not None and getattr(self.args, "top_entropy_quantile", 1.0) < 1.0:
            # stock's exact ties, which the quantile's `>=` reads (see `tie_like_stock`)
            outputs = (outputs[0], tie_like_stock(entropies, input_ids, attention_mask), *outputs[2:])
        return outputs

    def compute_loss(self, model, inputs, *args, **kwargs):
        self._loss_inputs = inputs if self.prefix_sharing else None
        try:
            return super().compute_loss(model, inputs, *args, **kwargs)
        finally:
            self._loss_inputs = None

    def _prepare_inputs(self, generation_batch):
        if not (self.prefix_sharing and self.model.training):
            return super()._prepare_inputs(generation_batch)
        # the generation it may run is left out of the training step `"auto"` times (`tuning.TrainingSteps.excluding`)
        with (
            replaced_function(self._trl_module, "shuffle_sequence_dict", shuffle_keeping_groups),
            self.sharing_session.tuning.steps.excluding(),
        ):
            return super()._prepare_inputs(generation_batch)
