"""The dataset as TRL prepares it for each trainer. The trainers whose data holds its completions prepare it
themselves, each built on a tiny stand-in model (`prepared.prepared_trainer`): TRL's own preprocessing (DPO and
reward), KTO's `_prepare_dataset`, ORPO/CPO's `tokenize_row`, SFT's preparation. For the trainers that generate their
completions (GRPO, RLOO, online DPO) the prompts are tokenized as TRL's trainers tokenize them."""

from __future__ import annotations

import contextlib

from .defaults import SFT_JOIN, TRAINER_CLASSES
from .errors import StatsError, _cause, _one_line


def _preprocess(trainer: str, prepare, dataset, tokenizer, *limits):
    """`prepare(dataset, tokenizer, *limits)`, the preprocessing of TRL's `trainer`; a dataset it cannot take (a
    column it lacks, a message or text the chat template or tokenizer refuses) is one error line."""
    from ...validation import NoRowsLeft

    try:
        return prepare(dataset, tokenizer, *limits)
    except NoRowsLeft as error:  # the trainer's own check, after TRL's preprocessing
        raise StatsError(_one_line(error)) from None
    except (ValueError, KeyError) as error:  # the checks of the data and the tokenizer's; a column it reads
        cause = f"it reads a column {error} that the dataset lacks" if isinstance(error, KeyError) else _cause(error)
        raise StatsError(f"TRL's {trainer} preprocessing cannot take this dataset ({cause})") from None


@contextlib.contextmanager
def _quiet_preprocessing(dataset):
    """No progress bars while a dataset that takes seconds is prepared."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    if len(dataset) <= 4096:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars:
            datasets.enable_progress_bars()


def _prepared_preferences(dataset, tokenizer, args):
    """The dataset as `--trainer` (dpo or reward) prepares it, and the trainer's collator (`PrefixSharingCollator`,
    under `--prefix_sharing_join`; its `base_collator`, TRL's or the ranked collator, collates the examples before
    prefix sharing): the trainer itself, built on a tiny stand-in model (`prepared.prepared_trainer`)."""
    from ..prepared import prepared_trainer

    options = {"max_length": args.max_length or None, "prefix_sharing_join": args.prefix_sharing_join}
    if args.trainer == "dpo":
        options["truncation_mode"] = args.truncation_mode
    with _quiet_preprocessing(dataset):
        trainer = _preprocess(
            TRAINER_CLASSES[args.trainer],
            lambda data, tokens: prepared_trainer(args.trainer, data, tokens, **options),
            dataset,
            tokenizer,
        )
    return trainer.train_dataset, trainer.data_collator


def kto_trainer(dataset, tokenizer, max_length: int | None, batch_size: int, join: str = SFT_JOIN, merge_kl=None):
    """This package's `KTOTrainer` built on a tiny stand-in model (`prepared.prepared_trainer`), with the config's
    `prefix_sharing_join` `join` and `prefix_sharing_merge_kl` `merge_kl`: its `train_dataset` is `dataset` as TRL's
    `_prepare_dataset` prepares it (`prompt_ids`, `completion_ids` and `KL_completion_ids` per example: pairs are
    unpaired, text completions end with EOS, the examples whose prompt alone fills `max_length` are dropped, and the KL
    completions are rotated within each batch of `batch_size` consecutive examples, as TRL's default loss, `"kto"`,
    computes the KL rows), and its `data_collator` is TRL's."""
    from ..prepared import prepared_trainer

    options = {"max_length": max_length, "per_device_train_batch_size": batch_size, "prefix_sharing_join": join}
    return prepared_trainer("kto", dataset, tokenizer, prefix_sharing_merge_kl=merge_kl, **options)


def kto_dataset(dataset, tokenizer, max_length: int | None, batch_size: int):
    """`dataset` as the KTO trainer prepares it (`kto_trainer`'s `train_dataset`)."""
    return kto_trainer(dataset, tokenizer, max_length, batch_size).train_dataset


def paired_trainer(dataset, tokenizer, trainer: str, max_length: int, score_padding=False, join: str = SFT_JOIN):
    """The ORPO or CPO trainer (`trainer`) built on a tiny stand-in model (`prepared.prepared_trainer`), with the
    config's `prefix_sharing_score_padding` `score_padding` and `prefix_sharing_join` `join`: its `train_dataset` is
    `dataset` as TRL's `maybe_extract_prompt`, `maybe_apply_chat_template` and `tokenize_row` prepare it (BOS heading
    the prompt, EOS ending each completion, a row longer than `max_length` losing the end of its completion, never the
    prompt; `prompt_input_ids`, `chosen_input_ids`, `chosen_labels`, `rejected_input_ids` and `rejected_labels` per
    example; nothing is dropped), and its `data_collator` and `concatenated_inputs` build the stock rows of a step."""
    from ..prepared import prepared_trainer

    # `remove_unused_columns=False`: what TRL's collator for these trainers needs (it sets it itself, with a warning)
    options = {"max_length": max_length, "remove_unused_columns": False, "prefix_sharing_join": join}
    return prepared_trainer(trainer, dataset, tokenizer, prefix_sharing_score_padding=score_padding, **options)


def paired_dataset(dataset, tokenizer, trainer: str, max_length: int):
    """`dataset` as the ORPO or CPO trainer (`trainer`) prepares it (`paired_trainer`'s `train_dataset`)."""
    return paired_trainer(dataset, tokenizer, trainer, max_length).train_dataset


def sft_trainer(dataset, tokenizer, max_length: int | None, truncation_mode: str, join: str = SFT_JOIN):
    """This package's `SFTTrainer` built on a tiny stand-in model (`prepared.prepared_trainer`): its
    `train_dataset` is `dataset` as TRL prepares it (`input_ids` and `labels` per example, -100 on the tokens it does
    not train on: `text` tokenized as it is, `messages` through the chat template, `prompt` + `completion` with the
    prompt masked by TRL's default `completion_only_loss`; EOS added to text; truncated to `max_length` by
    `truncation_mode`, the examples left with no trained token dropped), and its `data_collator` lays out each
    micro-batch as training does, under the join rule `join`. No packing, no shuffling, no `assistant_only_loss`."""
    from ..prepared import prepared_trainer

    return prepared_trainer(
        "sft", dataset, tokenizer, max_length=max_length, truncation_mode=truncation_mode, prefix_sharing_join=join
    )


def _check_prompts(prompts: list, start: int) -> None:
    for offset, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, list)) or (
            isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m for m in prompt)
        ):
            raise StatsError(
                f"row {start + offset}: 'prompt' is {_one_line(repr(prompt))[:80]}; expected text or a list of "
                "messages (dicts with 'role' and 'content'); fix or drop the row"
            )


def _encode_prompts(prompts: list, chat: list[bool], tokenizer, online: bool) -> list[list[int]]:
    """The token ids of `prompts` as the trainer tokenizes them: GRPO/RLOO (`_tokenize_prompts`) conversational ones
    through the chat template with the generation prompt, text as it is; online DPO (`_generate`) each rendered by
    `maybe_apply_chat_template` and tokenized without special tokens."""
    if online:
        from trl.data_utils import maybe_apply_chat_template

        texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
        return tokenizer(text=texts, add_special_tokens=False)["input_ids"]
    encoded = plain = iter(())
    if any(chat):
        messages = [p for p, c in zip(prompts, chat, strict=True) if c]
        encoded = iter(
            tokenizer.apply_chat_template(
                conversation=messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
    if not all(chat):
        plain = iter(tokenizer(text=[p for p, c in zip(prompts, chat, strict=True) if not c])["input_ids"])
    return [next(encoded) if c else next(plain) for c in chat]


def tokenized_prompts(dataset, tokenizer, chunk: int = 256, online: bool = False):
    """The token ids of each prompt as TRL's GRPO/RLOO trainers tokenize them (`_tokenize_prompts`): conversational
    ones through the chat template with `add_generation_prompt=True`, text as it is; with `online`, as its online DPO
    trainer does (the chat template applied as text, no special tokens added). Yields `(ids, conversational)` per
    prompt, in the dataset's order, tokenized `chunk` prompts at a time."""
    from tqdm.auto import tqdm
    from trl.data_utils import is_conversational

    for start in tqdm(range(0, len(dataset), chunk), desc="Tokenizing prompts", disable=len(dataset) <= 16 * chunk):
        prompts = dataset[start : start + chunk]["prompt"]
        _check_prompts(prompts, start)
        chat = [is_conversational({"prompt": p}) for p in prompts]
        try:
            encoded = _encode_prompts(prompts, chat, tokenizer, online)
        except Exception as error:  # the tokenizer on the user's prompts: a template or a text it cannot take
            what, way_out = (
                ("the chat template", "conversational prompts need a tokenizer whose chat template takes them")
                if any(chat)
                else ("the tokenizer", "check the prompts' text")
            )
            raise StatsError(
                f"{what} of --model_name_or_path cannot take the prompts of rows {start}-{start + len(prompts) - 1} "
                f"({_cause(error)}); {way_out}"
            ) from None
        yield from zip(encoded, chat, strict=True)


def prompt_lengths(dataset, tokenizer, chunk: int = 256, online: bool = False) -> tuple[list[int], bool]:
    """Token counts of the prompts as the trainer tokenizes them (`tokenized_prompts`), and whether any was
    conversational."""
    lengths, conversational = [], False
    for ids, chat in tokenized_prompts(dataset, tokenizer, chunk, online):
        lengths.append(len(ids))
        conversational |= chat
    return lengths, conversational
