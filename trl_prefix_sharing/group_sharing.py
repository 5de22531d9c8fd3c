"""What the prefix-sharing GRPO and RLOO trainers have in common: each prompt's generations scored in one sequence.

TRL samples every prompt G times and scores each generation in its own row, ``[left-padded prompt | completion]``;
every forward (the training pass, the old-policy and the reference passes) computes the prompt G times. Here the rows
of one prompt become one document of the shared layout (:mod:`trl_prefix_sharing.layout`),
``[prompt | completion 1 | ... | completion G]``, run through the same mask (:mod:`trl_prefix_sharing.mask`) and the
same forward wrapper (:mod:`trl_prefix_sharing.forward`) as DPO. Stock GRPO passes no position ids, so a token's
position is its column, left padding included; the layout keeps exactly those positions.

Two overrides do it, and TRL's loss, advantage and metric code runs unchanged:

- ``_get_per_token_logps_and_entropies`` (every pass) hands TRL's chunk loop a model whose call builds the layout of
  its chunk (rows grouped by equal prompt columns) and the mask, and gathers the log-probs back to TRL's rows.
- ``_prepare_inputs`` keeps the generations of a prompt in the same micro-batch: TRL shuffles the generation batch row
  by row before splitting it into ``steps_per_generation`` micro-batches, so siblings would rarely meet. The
  permutation here draws the same ``torch.randperm`` as TRL (the random stream, hence every later sample, is
  unchanged) and orders whole groups by where TRL's permutation puts their first member.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .attention import build_attention_mask, shared_row_multiple
from .forward import unwrap_model
from .layout import build_shared_batch, groups_by_prefix
from .trainer_setup import SharingSetupMixin

__all__ = ["GroupSharingTrainerMixin", "shuffle_keeping_groups", "shared_group_layout"]

logger = logging.get_logger(__name__)

#: `_get_per_token_logps_and_entropies` arguments that carry images: prefix sharing is text-only for GRPO/RLOO
_MULTIMODAL_ARGUMENTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                         "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def shared_group_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, pad_token_id: int,
                        pad_to_multiple_of: int | None = None, score_padding: bool = False) -> dict[str, torch.Tensor]:
    """The shared layout of generated rows ``[prompt (prompt_length columns) | completion]``: one document per group of
    rows with equal prompt columns, on the rows' device (``score_padding``: see `build_shared_batch`)."""
    groups = groups_by_prefix(input_ids, attention_mask, prompt_length)
    completion_mask = attention_mask.clone()
    completion_mask[:, :prompt_length] = 0  # a shared prefix never mixes prompt and completion tokens
    layout = build_shared_batch(input_ids, attention_mask, groups, completion_mask=completion_mask,
                                pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of,
                                score_padding=score_padding)
    return {name: tensor.to(input_ids.device) for name, tensor in layout.items()}


def shuffle_keeping_groups(batch: dict, group_key: str = "prompt_ids", mask_key: str = "prompt_mask") -> dict:
    """TRL's `shuffle_sequence_dict` with the rows of each group (equal `group_key`/`mask_key` rows) kept together.

    Draws the same `torch.randperm` as TRL, so the random stream is unchanged, then orders whole groups by where that
    permutation puts their first member (members in the order it gives them)."""
    size = len(batch[group_key])
    stock = torch.randperm(size)
    rank = torch.empty(size, dtype=torch.long)
    rank[stock] = torch.arange(size)  # rank[i]: where TRL's permutation puts row i
    rank = rank.tolist()
    groups = groups_by_prefix(batch[group_key], batch[mask_key], batch[group_key].shape[1])
    groups = sorted((sorted(g, key=rank.__getitem__) for g in groups), key=lambda g: rank[g[0]])
    permutation = [row for group in groups for row in group]

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[torch.tensor(permutation, device=value.device)]
        return [value[i] for i in permutation]

    return {key: permute(value) for key, value in batch.items()}


class _SharedRowsModel:
    """What TRL's chunk loop calls as `model(**inputs, labels=..., fused_lm_head=True)`: the model, on the prefix-shared
    layout of the chunk's rows (built here, with its mask, once per chunk)."""

    def __init__(self, trainer, model, logits_to_keep: int):
        self.trainer, self.model, self.logits_to_keep = trainer, model, logits_to_keep

    def __call__(self, **kwargs):
        trainer = self.trainer
        input_ids, attention_mask = kwargs["input_ids"], kwargs["attention_mask"]
        layout = shared_group_layout(input_ids, attention_mask, input_ids.shape[1] - self.logits_to_keep,
                                     trainer._pad_token_id, trainer._row_multiple)
        layout["attention_mask"] = build_attention_mask(layout, trainer._attn_implementation,
                                                        unwrap_model(trainer.model).config)
        if torch.is_grad_enabled():
            trainer._count_positions(attention_mask, layout)
        return self.model(**kwargs, prefix_sharing=layout)


class GroupSharingTrainerMixin(SharingSetupMixin):
    """Placed before TRL's `GRPOTrainer` or `RLOOTrainer`; see the module docstring."""

    #: the config class with the prefix-sharing fields (set by each trainer)
    _config_class: type

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *more, **kwargs):
        """Exactly the arguments of TRL's trainer."""
        self._init_sharing_setup()
        self._shared_positions = 0
        self._sharing_logged = False
        if args is not None and getattr(args, "prefix_sharing", False):
            if not isinstance(args, self._config_class):
                raise TypeError(f"`prefix_sharing` needs `trl_prefix_sharing.{self._config_class.__name__}` as `args`.")
            self._check_model_and_processor(model, args, processing_class, kwargs.get("peft_config"))
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, *more, **kwargs)
        if self.prefix_sharing:
            tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
            self._pad_token_id = tokenizer.pad_token_id
            self._patch_models()
            self._row_multiple = shared_row_multiple(self._attn_implementation, self.args.pad_to_multiple_of)

    def remove_prefix_sharing(self) -> None:
        """Undo the model patches; the trainer then trains as stock TRL."""
        self._unpatch_models()
        self.args.prefix_sharing = False

    # ----------------------------------------------------------------------------------------------- every pass
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if not self.prefix_sharing:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                              **kwargs)
        images = [name for name in _MULTIMODAL_ARGUMENTS if kwargs.get(name) is not None]
        if images:
            raise ValueError(f"Prefix sharing for {type(self).__name__} is text-only; this batch has {images}. Train "
                             "vision prompts with `prefix_sharing=False`.")
        return super()._get_per_token_logps_and_entropies(
            _SharedRowsModel(self, model, logits_to_keep), input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )

    def _prepare_inputs(self, generation_batch):
        if not (self.prefix_sharing and self.model.training):
            return super()._prepare_inputs(generation_batch)
        from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

        # TRL's training branch, with a shuffle that keeps each prompt's generations in one micro-batch
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            generation_batch = self._generate_and_score_completions(generation_batch)
            generation_batch = split_pixel_values_by_grid(generation_batch)
            generation_batch = shuffle_keeping_groups(generation_batch)
            generation_batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in generation_batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    # ----------------------------------------------------------------------------------------------- metrics
    def _count_positions(self, attention_mask, layout) -> None:
        """Token positions the training forward computes (all ranks): `num_shared_tokens`, and a log line comparing
        them with stock's after the first step."""
        counts = torch.stack([attention_mask.sum(), (layout["document_ids"] >= 0).sum()]).to(attention_mask.device)
        stock, shared = self.accelerator.gather_for_metrics(counts.unsqueeze(0)).sum(0).tolist()
        self._shared_positions += shared
        self._metrics["train"]["num_shared_tokens"] = [self._shared_positions]
        if not self._sharing_logged and self.args.should_log:
            logger.warning(
                f"Prefix sharing: the first training batch computes {shared} token positions where stock TRL computes "
                f"{stock} ({stock / max(shared, 1):.2f}x fewer; groups of {self.num_generations} generations, "
                f"{self.args.per_device_train_batch_size} rows per micro-batch)."
            )
            self._sharing_logged = True
