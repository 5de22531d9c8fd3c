"""Trainers whose collator builds the layout (DPO, reward, SFT), as mixins placed before TRL's trainer class.

The stock collator's batch gets its `Layout` from `PrefixSharingCollator`; per step, the start-up check runs on the
first batch, then the trainer's session (`session.py`) adds the layout's mask once, shared by the policy and reference
passes, and the models' wrapped forwards run the shared rows and hand back stock-shaped outputs. TRL's own loss code
runs unchanged. For preference trainers packing (`packing.py`) composes with it.
"""

from __future__ import annotations

from datasets import Dataset

from .collator import PrefixSharingCollator
from .examples import example_ids, prompt_lengths
from .packing import PackingMixin, prompt_groups
from .savings import grouping_gain
from .sharing import PrefixSharingMixin
from .virtual import computed_rows, with_virtual
from .vision import is_vision_config


__all__ = ["CollatedSharingMixin", "PreferenceSharingMixin"]

#: the examples of the training set `_grouping_hint` lays out in both orders (once, before training)
GROUPING_SAMPLE = 1024


class CollatedSharingMixin(PrefixSharingMixin):
    """A trainer whose collated batch carries its layout; see the module docstring. `_examples_of` and `_prompts_of`
    say what a batch's examples and prompts are (see `PrefixSharingCollator`); the trainer's `compute_loss` calls
    `_share_batch` first."""

    _resumes_shared_positions = False  # as TRL's DPO, reward and SFT trainers restart `num_tokens`
    _examples_of = staticmethod(example_ids)
    _prompts_of = staticmethod(prompt_lengths)
    _prompt_groups_of = staticmethod(prompt_groups)  # the prompt group of every example (`group_by_prompt`)

    def _setup_collator(self) -> None:
        """The stock collator wrapped to add each batch's layout, its rows as the session rounds them."""
        if isinstance(self.data_collator, PrefixSharingCollator):
            return
        self.data_collator = PrefixSharingCollator(
            self.data_collator,
            self.sharing_session.pad_token_id,
            rows=self.sharing_session.rows,
            share_prefix=self.prefix_sharing,
            join=self.sharing_session.join,
            cost=self.sharing_session.cost,
            tuning=self.sharing_session.tuning
            if self.sharing_session.tuning.measures
            else None,  # packing: rows set below
            examples_of=self._examples_of,
            prompts_of=self._prompts_of,
        )

    def _prepare_layout(self, inputs):
        """The start-up check on the batch's stock rows (first batch only), then its layout completed for the forward
        (see `PrefixSharingSession.prepare`)."""
        self._startup_check(
            inputs["input_ids"],
            inputs["attention_mask"],
            prompt_lengths=lambda: self._prompts_of(inputs),
            examples=lambda: self._examples_of(inputs),
        )
        return self.sharing_session.prepare(inputs)

    def train(self, *args, **kwargs):
        if self.prefix_sharing and self.shared_positions.line is None:
            self.shared_positions.hint = self._grouping_hint()
        return super().train(*args, **kwargs)

    def _grouping_hint(self) -> str:
        """Where keeping each prompt's examples in one micro-batch (`group_by_prompt=True`) would share noticeably
        more than the sampler's micro-batches do, on the training set's first `GROUPING_SAMPLE` examples: the start-up
        line's ending (`savings.grouping_gain`), else nothing."""
        args = self.args
        dataset = self.train_dataset
        if not args.should_log or getattr(args, "group_by_prompt", True) or self.packing:
            return ""  # (the line is logged by the main process only)
        if args.per_device_train_batch_size < 2:
            return ""
        if not isinstance(dataset, Dataset) or is_vision_config(self.sharing_session.models[0].config):
            return ""  # a stream has no prompts to read ahead; examples with images share nothing between them
        dataset = dataset.select(range(min(len(dataset), GROUPING_SAMPLE)))
        try:
            groups = self._prompt_groups_of(dataset)
        except ValueError:  # no prompts to group by (SFT data trained on every token)
            return ""
        if len(set(groups)) == len(groups):
            return ""
        shuffled = getattr(args, "train_sampling_strategy", "random") != "sequential"
        gain = grouping_gain(dataset, self.data_collator, groups, args.per_device_train_batch_size, shuffled)
        return gain.hint()

    def _share_batch(self, inputs) -> None:
        """A step's first act, before TRL's loss (or packing's, which may route a batch past TRL's `compute_loss`):
        the batch's layout prepared (for a policy with prompt-learning PEFT, its rows behind the virtual tokens too),
        and the positions of a training forward counted."""
        if self.sharing_session is not None:
            layout = with_virtual(self.sharing_session, self._prepare_layout(inputs))
            if self.model.training:  # a training forward (evaluation's are not counted)
                self.shared_positions.count(*computed_rows(layout, inputs["attention_mask"]))


class PreferenceSharingMixin(PackingMixin, CollatedSharingMixin):
    """Prefix sharing and packing for a preference trainer (DPO, reward); see the module docstring."""

    def _setup_collator(self) -> None:
        """The stock collator wrapped to add each batch's layout: unpacked rows as the session's backend lays them
        out, or packed rows as packing's row policy says (`_packed_rows`, given the session's backend)."""
        if isinstance(self.data_collator, PrefixSharingCollator):
            return
        super()._setup_collator()
        if self.packing:
            self.data_collator.rows = self._packed_rows(self.sharing_session.backend)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._share_batch(inputs)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
