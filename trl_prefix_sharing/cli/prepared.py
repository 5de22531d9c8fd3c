"""A trainer built the supported way on a model that costs nothing to build: what `stats` counts with.

`stats` reads a dataset as training reads it. This package's own trainer, built with the options given, prepares the
dataset (TRL's preparation runs in TRL's `__init__`) and holds the collator that lays out each micro-batch in training.
The model is a stand-in: one layer eight wide with the tokenizer's vocabulary, built in milliseconds. Preparing and
laying out data read the tokenizer and the config, never a model's weights, so the user's model is only checked, on
its own (`stats.loading.check_model`), and never loaded.
"""

from __future__ import annotations

import inspect
import tempfile
import warnings

from ..trainers import TRAINERS


__all__ = ["prepared_trainer", "stand_in_model"]


def stand_in_model(tokenizer, head: str = "causal_lm"):
    """A one-layer Llama, eight wide, with the tokenizer's vocabulary and the `head` a trainer trains
    (`TrainerSpec.model_head`)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    auto = AutoModelForSequenceClassification if head == "sequence_classification" else AutoModelForCausalLM
    return auto.from_config(config)


def prepared_trainer(name: str, dataset, tokenizer, **options):
    """This package's trainer `name` (an entry of the table of trainers) with `prefix_sharing=True` and `options`
    (config fields), built on `stand_in_model` (a reference model too, for a trainer that takes one) with `dataset` to
    train on: its `train_dataset` is the dataset as TRL prepares it for training, and its `data_collator` (DPO,
    reward, SFT) lays out micro-batches as training does."""
    from trl.import_utils import TRLExperimentalWarning

    import trl_prefix_sharing

    spec = TRAINERS[name]
    with tempfile.TemporaryDirectory() as output_dir, warnings.catch_warnings():
        # nothing is written to `output_dir` (no training, no checkpoint); the config's deprecation notices (TRL's
        # defaults set transformers' deprecated `gradient_checkpointing`) and TRL's notice on the experimental modules
        # its trainers import concern training, not this count
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", TRLExperimentalWarning)
        config_class = getattr(trl_prefix_sharing, spec.config_class)
        trainer_class = getattr(trl_prefix_sharing, spec.trainer_class)
        models = {"model": stand_in_model(tokenizer, spec.model_head)}
        if "ref_model" in inspect.signature(trainer_class.__init__).parameters:  # else TRL loads one from a path
            models["ref_model"] = stand_in_model(tokenizer, spec.model_head)
        args = config_class(output_dir=output_dir, report_to=[], use_cpu=True, prefix_sharing=True, **options)
        return trainer_class(**models, args=args, train_dataset=dataset, processing_class=tokenizer)
