"""Row-by-row checks of preference data, before TRL's preprocessing: a clear error naming the row and the field,
instead of an exception deep inside `datasets.map` or a silently wrong number."""

from __future__ import annotations

import difflib
import math

from datasets import Dataset, IterableDataset

from .trainers import Columns
from .vision import VISION_MODEL_TYPES


__all__ = [
    "NoRowsLeft",
    "check_dataset_columns",
    "check_not_empty",
    "check_prompt_column",
    "check_rows_left",
    "dataset_columns",
    "dataset_sizes",
    "needed_columns",
    "validate_preference_rows",
]

_TEXT_FIELDS = ("prompt", "chosen", "rejected")
#: columns of pre-tokenized data (TRL's reward trainer renames its older `*_input_ids` names itself)
_PRE_TOKENIZED = {
    "prompt_ids",
    "chosen_ids",
    "rejected_ids",
    "chosen_input_ids",
    "rejected_input_ids",
    "completion_ids",
}


def _check_message(message, where: str) -> None:
    """One message as TRL's chat-template path takes it: a dict with a 'role'; 'content' text, a list of content
    parts, None or absent (an assistant turn with only 'tool_calls'); any other keys ('tool_calls', 'name',
    'tool_call_id', ...) go to the chat template as they are."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} is {message!r}; expected a dict with a 'role' (and 'content' or 'tool_calls').")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise ValueError(
            f"{where} has content of type {type(content).__name__}; expected text, a list of content parts, or None."
        )


def _check_text(value, where: str, allow_empty: bool) -> None:
    if value is None:
        raise ValueError(f"{where} is None. Fill it in or drop the row.")
    if isinstance(value, str):
        return
    if isinstance(value, list):  # conversational: a list of messages
        for k, message in enumerate(value):
            _check_message(message, f"{where}: message {k}")
        if not value and not allow_empty:
            raise ValueError(f"{where} is an empty list of messages.")
        return
    raise ValueError(f"{where} is of type {type(value).__name__}; expected text or a list of messages.")


def _check_same_format(row: dict, fields, where: str) -> None:
    """TRL concatenates prompt and completions: text with messages is a TypeError deep inside `datasets.map`."""
    kinds = {field: "messages" if isinstance(row[field], list) else "text" for field in fields}
    if len(set(kinds.values())) > 1:
        raise ValueError(
            f"{where} mixes text and conversational fields ({kinds}); give them all as text or all as "
            "lists of messages."
        )


def _rows(dataset, batch_size: int = 1024):
    """Rows as dicts, read a batch of columns at a time (much faster than row-by-row access)."""
    for batch in dataset.iter(batch_size=batch_size):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            yield dict(zip(columns, values, strict=True))


def validate_preference_rows(dataset, name: str) -> None:
    """Check every row of a map-style dataset (text fields, ranked completions, margins)."""
    if not isinstance(dataset, Dataset):
        return
    columns = set(dataset.column_names)
    if _PRE_TOKENIZED & columns:
        return  # pre-tokenized: TRL checks the ids
    fields = [f for f in _TEXT_FIELDS if f in columns]
    checked = [*fields, *(c for c in ("completions", "margin") if c in columns)]
    if not checked:
        return
    for index, row in enumerate(_rows(dataset.select_columns(checked))):
        for field in fields:
            _check_text(row[field], f"{name} row {index}, '{field}'", allow_empty=field == "prompt")
        _check_same_format(row, fields, f"{name} row {index}")
        if "completions" in columns:
            completions = row["completions"]
            if not isinstance(completions, list) or len(completions) < 2:
                raise ValueError(
                    f"{name} row {index}: 'completions' must list at least 2 completions (best first), "
                    f"got {completions!r}."
                )
            for k, completion in enumerate(completions):
                _check_text(completion, f"{name} row {index}, completion {k}", allow_empty=False)
        if "margin" in columns:
            margin = row["margin"]
            if margin is None or not isinstance(margin, (int, float)) or math.isnan(margin) or math.isinf(margin):
                raise ValueError(f"{name} row {index}: 'margin' is {margin!r}; it must be a finite number.")


def check_dataset_columns(
    dataset, name: str, needed: Columns | None, allow_images: bool = False, rows: bool = True
) -> None:
    """Clear errors for vision datasets (unless `allow_images`) and missing columns (a trainer's `needed`, from the
    table of trainers, or None: any columns), before TRL's preprocessing; with `rows`, the rows of preference data
    too (`validate_preference_rows`)."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            check_dataset_columns(value, f"{name}[{key!r}]", needed, allow_images, rows)
        return
    columns = dataset_columns(dataset, name)
    if columns is None:
        return  # TRL raises its own error for other types
    if ("image" in columns or "images" in columns) and not allow_images:
        raise ValueError(
            f"The {name} dataset has an image column: prefix sharing lays out images for DPO with a vision-language "
            f"model ({', '.join(VISION_MODEL_TYPES)}) and its processor as `processing_class`; TRL 1.16's "
            "RewardTrainer has no image support. Otherwise train it with `prefix_sharing=False`."
        )
    if needed is not None and not needed.accept(columns):
        raise ValueError(f"The {name} dataset has columns {sorted(columns)}; {needed.needs}")
    if rows:
        validate_preference_rows(dataset, name)


def needed_columns(columns: Columns, args, formats_rows: bool = False) -> Columns | None:
    """The columns a trainer's datasets need under its config `args` (`columns`: its entry's in the table of
    trainers): SFT reads plain text from the config's `dataset_text_field`, and takes any columns where TRL does not
    read them itself (None): with a formatting function (`formats_rows`), which makes each row's text, or with
    `dataset_kwargs={"skip_prepare_dataset": True}`, which hands the rows to the collator as they are."""
    dataset_kwargs = getattr(args, "dataset_kwargs", None)
    if formats_rows or (isinstance(dataset_kwargs, dict) and dataset_kwargs.get("skip_prepare_dataset", False)):
        return None
    text_field = getattr(args, "dataset_text_field", None)
    return columns if text_field is None else columns.with_text_field(text_field)


#: how alike a column's name must be to "prompt" to be taken for a misspelling of it (difflib's ratio: "promt" 0.91,
#: "prompts" 0.92, "Prompt" 1.0; "prompt_text" 0.71 and "question" 0.29 are other columns)
NEAR_MATCH = 0.8
#: columns TRL itself reads that look like "prompt" (pre-tokenized ids)
_PROMPT_LIKE = {"prompt_ids", "prompt_input_ids"}


def check_not_empty(dataset, name: str) -> None:
    """A clear error for a dataset with no rows (TRL's preprocessing would end in a bare `StopIteration`)."""
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            check_not_empty(value, f"{name}[{key!r}]")
        return
    dataset_columns(dataset, name)


def dataset_columns(dataset, name: str) -> set[str] | None:
    """The columns of a map-style or streamed dataset (None for other types); an error naming the dataset if it has
    no rows."""
    if isinstance(dataset, Dataset):
        if len(dataset) == 0:
            raise ValueError(f"The {name} dataset is empty (0 rows); give it at least one example.")
        return set(dataset.column_names)
    if isinstance(dataset, IterableDataset):
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"The streamed {name} dataset yields no rows; give it at least one example.")
        return set(first)
    return None


def check_prompt_column(dataset, name: str, prompt: str = "prompt") -> None:
    """An error when the dataset has no `prompt` column but one whose name is a near match of it (`promt`, `prompts`,
    `Prompt`): prefix sharing and TRL read the prompt from that column only, so a misspelt one would be ignored and
    nothing shared. Renaming it, or removing it, is the way out."""
    if isinstance(dataset, dict):
        for key, value in dataset.items():
            check_prompt_column(value, f"{name}[{key!r}]", prompt)
        return
    columns = dataset_columns(dataset, name)
    if columns is None or prompt in columns:
        return
    near = sorted(
        (column for column in columns - _PROMPT_LIKE if _likeness(column, prompt) >= NEAR_MATCH),
        key=lambda column: -_likeness(column, prompt),
    )
    if near:
        column = near[0]
        raise ValueError(
            f"The {name} dataset has no {prompt!r} column but has {column!r}: TRL and prefix sharing read the prompt "
            f"from {prompt!r} only, so {column!r} would be ignored and no prompt shared. Rename it "
            f"(`dataset.rename_column({column!r}, {prompt!r})`), or remove it (`dataset.remove_columns({column!r})`) "
            "if it is not the prompt."
        )


def _likeness(column: str, prompt: str) -> float:
    return difflib.SequenceMatcher(None, column.lower(), prompt).ratio()


def dataset_sizes(datasets: dict) -> dict[str, int]:
    """The row count of each map-style dataset of `datasets` ({name: dataset}; others are left out)."""
    return {name: len(dataset) for name, dataset in datasets.items() if isinstance(dataset, Dataset)}


class NoRowsLeft(ValueError):
    """TRL's preprocessing dropped every row of a dataset (`check_rows_left`)."""


def check_rows_left(sizes: dict[str, int], datasets: dict, trainer_name: str, max_length) -> None:
    """An error when TRL's preprocessing dropped every row of a dataset that had some (`sizes`: the counts before,
    `datasets`: the prepared ones): TRL's DPO, reward and KTO trainers drop the examples that do not fit
    `max_length`."""
    for name, before in sizes.items():
        dataset = datasets.get(name)
        if before and isinstance(dataset, Dataset) and len(dataset) == 0:
            raise NoRowsLeft(
                f"{trainer_name}'s preprocessing left none of the {before:,} examples of the {name} dataset: it drops "
                f"the examples that do not fit `max_length` ({max_length}). Raise `max_length`, or shorten the "
                "prompts."
            )
