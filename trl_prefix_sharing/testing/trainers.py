"""Stock TRL's trainer or this package's, for one entry of the table of trainers: the one factory that benchmarks (and
tests that compare the two) build their pairs with.

`build_trainer("dpo", stock=True, ...)` builds TRL's `DPOTrainer` with TRL's `DPOConfig`; `stock=False` builds this
package's, whose config takes the sharing and packing fields too. The classes come from `trainers.TRAINERS`, so a new
entry there is a new trainer here.
"""

from __future__ import annotations

import copy
import importlib
import inspect

from ..trainers import TRAINERS


__all__ = ["ZERO_REWARD", "build_trainer", "shared_tokens_of_run", "trainer_classes"]


def ZERO_REWARD(completions, **kwargs):  # noqa: N802  (a constant function, named as TRL names reward functions)
    """A reward function that scores every completion 0 (timing and counting do not depend on rewards)."""
    return [0.0] * len(completions)


def trainer_classes(name: str, stock: bool) -> tuple[type, type]:
    """(trainer class, config class) of entry `name`: TRL's (`stock=True`) or this package's."""
    spec = TRAINERS[name]
    if stock:
        module_name, class_name = spec.trl_trainer.split(":")
        module = importlib.import_module(module_name)
        return getattr(module, class_name), getattr(module, spec.config_class)
    import trl_prefix_sharing

    return getattr(trl_prefix_sharing, spec.trainer_class), getattr(trl_prefix_sharing, spec.config_class)


def build_trainer(
    name: str,
    *,
    stock: bool,
    model,
    tokenizer,
    train_dataset,
    output_dir: str,
    ref_model=None,
    reward_funcs=None,
    eval_dataset=None,
    peft_config=None,
    copy_models: bool = True,
    quiet: bool = True,
    **config,
):
    """A trainer of entry `name` (TRL's with `stock=True`, else this package's) on `model` and `train_dataset`.

    Args:
        name (`str`):
            A key of `trainers.TRAINERS`.
        stock (`bool`):
            TRL's classes, or this package's (which take `prefix_sharing`, `packing`, ... in `config`).
        model, tokenizer, train_dataset:
            What TRL's trainer takes as `model`, `processing_class` and `train_dataset`.
        output_dir (`str`):
            The config's `output_dir` (nothing is saved there: `save_strategy="no"`).
        ref_model (`PreTrainedModel`, *optional*):
            A reference model, for a trainer whose `__init__` takes one (DPO, KTO, online DPO; others load it).
        reward_funcs (`list`, *optional*):
            For a trainer that generates (GRPO, RLOO, online DPO); default `[ZERO_REWARD]`.
        eval_dataset, peft_config (*optional*):
            Passed on to the trainer where given (the PEFT config as a deep copy, so two trainers never share one).
        copy_models (`bool`, defaults to `True`):
            Train deep copies of `model` and `ref_model` (so that every variant of a comparison starts from the same
            weights).
        quiet (`bool`, defaults to `True`):
            Remove the printing and progress callbacks and log only every 10,000 steps.
        **config:
            Config fields (`per_device_train_batch_size`, `use_cpu`, `prefix_sharing`, ...).
    """
    trainer_class, config_class = trainer_classes(name, stock)
    parameters = inspect.signature(trainer_class.__init__).parameters
    copied = copy.deepcopy if copy_models else (lambda value: value)
    given = {"model": copied(model)}
    if ref_model is not None and "ref_model" in parameters:
        given["ref_model"] = copied(ref_model)
    if "reward_funcs" in parameters:
        given["reward_funcs"] = reward_funcs or [ZERO_REWARD]
    if eval_dataset is not None:
        given["eval_dataset"] = eval_dataset
    if peft_config is not None:
        given["peft_config"] = copy.deepcopy(peft_config)
    defaults = dict(report_to="none", save_strategy="no", seed=0)
    if quiet:
        defaults.update(logging_steps=10_000, disable_tqdm=True)
    args = config_class(output_dir=output_dir, **{**defaults, **config})
    trainer = trainer_class(**given, args=args, train_dataset=train_dataset, processing_class=tokenizer)
    if quiet:
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
    if "reward_funcs" in parameters:
        trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's loop, which a timed step does not run
    return trainer


def shared_tokens_of_run(trainer, lines: list | None = None) -> int:
    """Train `trainer` (this package's, with prefix sharing); the `num_shared_tokens` it logged last (a running total
    of the positions its policy's training forwards computed), its start-up line appended to `lines` if given."""
    trainer.train()
    if lines is not None:
        lines.append(trainer.shared_positions.line)
    logged = [entry["num_shared_tokens"] for entry in trainer.state.log_history if "num_shared_tokens" in entry]
    if not logged:
        raise AssertionError("the run logged no `num_shared_tokens`")
    return logged[-1]
