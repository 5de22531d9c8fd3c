"""`RewardTrainer`: TRL's reward trainer, with prefix sharing, packing, and ranked (K-way) data."""

from __future__ import annotations

import torch
import trl
from trl.data_utils import get_dataset_column_names

from .collated import PreferenceSharingMixin
from .config import RewardConfig
from .ranked import RankedCollator, is_ranked_dataset, ranked_loss, ranked_pairs, tokenize_ranked
from .trainers import TRAINERS
from .validation import check_dataset_columns


__all__ = ["RewardTrainer"]


class RewardTrainer(PreferenceSharingMixin, trl.RewardTrainer):
    """TRL's [`trl.RewardTrainer`], computing each prompt once when `args.prefix_sharing=True`.

    Takes exactly the arguments of [`trl.RewardTrainer`]. The shared prefix of a pair is the longest common token
    prefix of its `chosen_ids` and `rejected_ids`; each completion's reward is read where stock transformers reads it
    (the score head at the rightmost non-pad token of its stock row), so rewards, the loss (with `margin` and
    `center_rewards_coefficient`), gradients and metrics equal stock TRL's.

    Beyond TRL: a ranked dataset (`prompt` + `completions`, best first, K >= 2 each; see
    `trl_prefix_sharing.ranked`) trains on all K(K-1)/2 pairs per prompt from one forward over the K completions,
    giving the loss stock TRL gives on the expanded pairs.
    """

    _config_class = RewardConfig

    def __init__(
        self,
        model,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
    ):
        self._init_prefix_sharing(
            model, args, processing_class, peft_config, datasets={"train": train_dataset, "eval": eval_dataset}
        )
        self._ranked = train_dataset is not None and is_ranked_dataset(get_dataset_column_names(train_dataset))
        evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval", eval_dataset)]
        for name, dataset in evals:
            if (
                dataset is not None
                and train_dataset is not None
                and (is_ranked_dataset(get_dataset_column_names(dataset)) != self._ranked)
            ):
                raise ValueError(
                    f"The train dataset is {'ranked' if self._ranked else 'pairwise'} and the {name} dataset is not: "
                    "one collator serves both, so give them the same format (e.g. expand ranked data to pairs with "
                    "`trl_prefix_sharing.ranked.expand_ranked_to_pairs`)."
                )
        if self._uses_layout or self._ranked:
            check_dataset_columns(train_dataset, "train", TRAINERS["reward"].columns)
            check_dataset_columns(eval_dataset, "eval", TRAINERS["reward"].columns)
        if self._ranked and data_collator is None and processing_class is not None:
            pad = processing_class.pad_token or processing_class.eos_token
            data_collator = RankedCollator(
                processing_class.convert_tokens_to_ids(pad), getattr(args, "pad_to_multiple_of", None)
            )
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self._finish_prefix_sharing_init()

    # ----------------------------------------------------------------------------------------------- ranked data
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if not is_ranked_dataset(get_dataset_column_names(dataset)):
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if "completion_ids" not in get_dataset_column_names(dataset):
            dataset = dataset.map(
                tokenize_ranked,
                fn_kwargs={"processing_class": processing_class},
                desc=f"Tokenizing ranked {dataset_name} dataset",
            )
        if args.max_length is not None:  # like TRL: examples with a sequence over max_length are dropped (whole)
            dataset = dataset.filter(lambda ex: all(len(ids) <= args.max_length for ids in ex["completion_ids"]))
        return dataset

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._ranked and "completion_ids" not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, "completion_ids"]

    def _pairs_in(self, batch) -> int:
        if "group_sizes" in batch:
            return int(sum(k * (k - 1) // 2 for k in batch["group_sizes"].tolist()))
        return super()._pairs_in(batch)

    def _base_compute_loss(self, model, inputs, return_outputs, num_items_in_batch):
        if "group_sizes" in inputs:  # ranked batch: all pairs of each example from one forward
            return self._ranked_compute_loss(model, inputs, return_outputs)
        if not (self.packing and self.accelerator.num_processes > 1):
            return super()._base_compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL averages the ranks' accuracy and margin means, which weighs pairs unequally when packed ranks hold
        # different numbers of pairs: replace them by the means over all pairs of the step
        loss, outputs = super()._base_compute_loss(model, inputs, True, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        chosen, rejected = outputs.logits.detach().squeeze(-1).chunk(2)
        accuracy, margin = self._pooled_pair_metrics(chosen, rejected)
        self._metrics[mode]["accuracy"][-1] = accuracy
        self._metrics[mode]["margin"][-1] = margin
        return (loss, outputs) if return_outputs else loss

    def _pooled_pair_metrics(self, chosen, rejected) -> tuple[float, float]:
        """Accuracy and margin over every pair of every rank (stock TRL's values when ranks hold equal numbers)."""
        with torch.no_grad():
            accuracy = self.accelerator.gather((chosen > rejected).float()).mean().item()
            margin = self.accelerator.gather(chosen - rejected).mean().item()
        return accuracy, margin

    def _ranked_compute_loss(self, model, inputs, return_outputs=False):
        mode = "train" if self.model.training else "eval"
        group_sizes = inputs["group_sizes"]
        model_inputs = {k: v for k, v in inputs.items() if k != "group_sizes"}
        outputs = model(**model_inputs, use_cache=False)
        rewards = outputs.logits.squeeze(-1)
        loss, chosen, rejected = ranked_loss(rewards, group_sizes, self.args.center_rewards_coefficient)
        if mode == "train":
            tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            self._total_train_tokens += tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        with torch.no_grad():  # the metrics stock TRL logs on the expanded pairs
            better, worse = ranked_pairs(group_sizes)
            expanded = self.accelerator.gather(torch.cat([rewards[better], rewards[worse]]))
            self._metrics[mode]["min_reward"].append(expanded.min().item())
            self._metrics[mode]["mean_reward"].append(expanded.mean().item())
            self._metrics[mode]["max_reward"].append(expanded.max().item())
            accuracy, margin = self._pooled_pair_metrics(chosen, rejected)
            self._metrics[mode]["accuracy"].append(accuracy)
            self._metrics[mode]["margin"].append(margin)
        return (loss, outputs) if return_outputs else loss
