"""A trainer built the supported way on a model that costs nothing to build: what `stats` counts with.

`stats` reads a dataset as training reads it. This package's own trainer, built with the options given, prepares the
dataset (TRL's preparation runs in TRL's `__init__`) and holds the collator that lays out each micro-batch in training.
The model is a stand-in on PyTorch's meta device (shapes, no weights) with the tokenizer's vocabulary: preparing and
laying out data reads the tokenizer and the config, never a model's weights, so the user's model is only checked, on
its own (`stats.check_model`). The trainer leaves the model where it is, through transformers' documented override of
`TrainingArguments.place_model_on_device`: a model on the meta device has no weights to move.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import warnings

from ..trainers import TRAINERS


__all__ = ["prepared_trainer", "stand_in_model"]


@functools.cache
def _unplaced(config_class: type) -> type:
    """`config_class`, whose trainer leaves the model where it is."""
    namespace = {"place_model_on_device": property(lambda self: False), "__module__": __name__}
    return dataclasses.dataclass(type(config_class.__name__, (config_class,), namespace))


def stand_in_model(tokenizer):
    """A one-layer Llama with the tokenizer's vocabulary, on the meta device: built in milliseconds, holding no
    memory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def prepared_trainer(name: str, dataset, tokenizer, **options):
    """This package's trainer `name` (an entry of the table of trainers) with `prefix_sharing=True` and `options`
    (config fields), built on `stand_in_model` with `dataset` to train on: its `train_dataset` is the dataset as TRL
    prepares it for training, and its `data_collator` (DPO, reward, SFT) lays out micro-batches as training does."""
    import trl_prefix_sharing

    spec = TRAINERS[name]
    config_class = _unplaced(getattr(trl_prefix_sharing, spec.config_class))
    with tempfile.TemporaryDirectory() as output_dir, warnings.catch_warnings():
        # nothing is written to `output_dir` (no training, no checkpoint); the config's deprecation notices (TRL's
        # defaults set transformers' deprecated `gradient_checkpointing`) concern training, not this count
        warnings.simplefilter("ignore", FutureWarning)
        args = config_class(output_dir=output_dir, report_to=[], use_cpu=True, prefix_sharing=True, **options)
        trainer_class = getattr(trl_prefix_sharing, spec.trainer_class)
        return trainer_class(
            model=stand_in_model(tokenizer), args=args, train_dataset=dataset, processing_class=tokenizer
        )
