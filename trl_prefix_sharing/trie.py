"""The plan of a layout: the stock rows of a micro-batch sorted into a prefix trie, and what each row adds to it.

A plan (`LayoutPlan`) says, per stock row in depth-first order, which of its tokens are on earlier rows' paths and
which it adds, and how the rows join documents; `layout.build_layout` then chooses between plans and allocates the
shared rows (`layout.assemble_layout`). See `layout.py` for the trie itself.

**Documents.** A trie that is laid out as one piece is a *document*; unpacked, each document is one shared row, and
packing puts several in a row. How sorted rows that share a prefix join one document is the *join* rule (`JOINS`):
`"prompts"` joins them when the prefix holds at least the prompt of one of them (the trainer says what a row's prompt
is: its completion mask, its prompt columns, or what the rows of one example have in common): a prompt's pairs, its
group, its later turns and its duplicates. `"always"` joins any rows that share two tokens or more, so a system prompt
or a document that several examples start with is computed once too. `"auto"` makes both plans from one sort and keeps
the one whose estimated step cost is lower (`cost.StepCost`): a longer row costs a dense kernel more attention than
the positions it saves, a block-sparse kernel only what its visible blocks hold.

**Built with tensor ops where the batch lives**: a sort of the rows (longest common prefixes of all row pairs,
chunked), cumulative sums and scatters; no per-token Python. One device-to-host read per build gives the shared rows'
shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from .layout import RowPolicy


__all__ = [
    "JOINS",
    "StockRows",
    "LayoutPlan",
    "pairwise_common_prefix",
    "plan_layout",
    "plan_layouts",
    "prompt_lengths_from_completion_mask",
]

#: key of a stock column that holds no token (before or after the row's tokens); below every token id, so a row that
#: is a prefix of another sorts first
_NO_TOKEN = -1
#: key of a scored padding column holding pad id 0 (`score_padding`); pad id p is keyed `_SCORED_PAD - p`: never
#: equal to a token, and rows padded with different ids (ORPO pads the narrower side with its `padding_value`) differ
_SCORED_PAD = -2
#: how rows that share a prefix join one document (`prefix_sharing_join`): `"prompts"` when they share at least a
#: prompt, `"always"` whenever they share a prefix (any common start saves positions), `"auto"` whichever of the two
#: the step's estimated cost (`cost.StepCost`) prefers, per micro-batch
JOINS = ("auto", "prompts", "always")
#: elements of the pairwise comparison done at once (rows x rows x columns), bounding its memory
_COMPARE_CHUNK = 1 << 24


@dataclass
class LayoutPlan:
    """Where every stock row's tokens go, before the shared rows are allocated (all tensors on the batch's device).

    Rows are indexed in *sorted* (depth-first) order: `order[i]` is the stock row at sorted place `i`.
    """

    order: torch.Tensor  # [R] stock row of each sorted place
    starts: torch.Tensor  # [R] first column of each sorted row's tokens
    lengths: torch.Tensor  # [R] tokens laid out for each sorted row (with its scored padding)
    real_lengths: torch.Tensor  # [R] real tokens of each sorted row
    first_new: torch.Tensor  # [R] depth of the first token the sorted row adds (the ones before are on earlier paths)
    document: torch.Tensor  # [R] document of each sorted row (0, 1, ... in sorted order)
    offset: torch.Tensor  # [R] where the sorted row's new tokens start in its document
    document_lengths: torch.Tensor  # [R] tokens of each document (zero past the last document)
    num_documents: torch.Tensor  # 0-d
    input_ids: torch.Tensor  # [R, L] stock ids, sorted rows
    score_padding: bool
    join: str = "prompts"  # the join rule that made this plan
    shift: bool = False  # rows share by token index, not column (`StockRows.shift`)

    @property
    def visible_pairs(self) -> torch.Tensor:
        """0-d: query-key pairs the mask lets through (a token at depth d of its row sees the d + 1 tokens of its
        path), what a block-sparse kernel computes at best."""
        n, f = self.lengths, self.first_new
        return ((n * (n + 1) - f * (f + 1)) // 2).sum()

    def tokens_per(self, groups: torch.Tensor, size: int) -> torch.Tensor:
        """`[size]`: tokens the layout adds for each group of stock rows (`groups[r]`, the group of stock row
        r): an example's packing unit when examples do not share with each other."""
        added = self.lengths - self.first_new
        return torch.zeros(size, dtype=torch.long, device=added.device).scatter_add_(0, groups[self.order], added)


def _token_runs(attention_mask: torch.Tensor, check: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(length, first column) of each row's tokens, which must be one run: right padding, left padding, or both."""
    lengths = attention_mask.sum(dim=1)
    starts = torch.where(lengths > 0, attention_mask.int().argmax(dim=1), torch.zeros_like(lengths))
    if check:
        columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        one_run = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
        if not torch.equal(attention_mask.bool(), one_run):
            raise ValueError(
                "Prefix sharing needs each stock row's tokens in one run (padding only before or after them), "
                "as TRL's collators and generation build them; this attention_mask has holes."
            )
    return lengths, starts


def pairwise_common_prefix(keys: torch.Tensor) -> torch.Tensor:
    """`[R, R]`: for every pair of rows, how many leading columns of `keys` `[R, C]` are equal."""
    rows, columns = keys.shape
    out = torch.empty(rows, rows, dtype=torch.long, device=keys.device)
    step = max(1, _COMPARE_CHUNK // max(rows * columns, 1))
    for first in range(0, rows, step):  # chunks of rows, never tokens
        differ = keys[first : first + step, None, :] != keys[None, :, :]
        out[first : first + step] = torch.where(differ.any(-1), differ.to(torch.uint8).argmax(-1), columns)
    return out


def _sort_rows(keys: torch.Tensor, common: torch.Tensor) -> torch.Tensor:
    """The lexicographic order of the rows of `keys` (ties by row index), from their pairwise common prefixes."""
    rows, columns = keys.shape
    at = common.clamp(max=max(columns - 1, 0))
    mine = keys.gather(1, at)  # [i, j]: row i's key where rows i and j first differ
    theirs = mine.T  # [i, j]: row j's key there (the common prefix is symmetric)
    index = torch.arange(rows, device=keys.device)
    less = torch.where(common < columns, mine < theirs, index[:, None] < index[None, :])  # row i before row j
    rank = less.sum(dim=0)  # rows before each row
    order = torch.empty_like(rank)
    order[rank] = index
    return order


def _previous(values: torch.Tensor) -> torch.Tensor:
    """Each sorted row's value for the row before it (the first row: its own)."""
    return torch.cat([values[:1], values[:-1]])


def prompt_lengths_from_completion_mask(attention_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """The prompt of each row: its tokens before its first completion token."""
    before = completion_mask.cumsum(dim=1) == 0
    return (before & attention_mask.bool()).sum(dim=1)


def _one_join(join: str) -> tuple[str, ...]:
    """The join rules whose plans a build compares: both for `"auto"`, else the one given."""
    if join not in JOINS:
        raise ValueError(f"`prefix_sharing_join` must be one of {JOINS}, got {join!r}.")
    return ("prompts", "always") if join == "auto" else (join,)


@dataclass(frozen=True)
class StockRows:
    """A micro-batch's stock rows, as the trainer's TRL code builds them, and what a layout must know of them.

    Args:
        input_ids, attention_mask: stock `[R, L]` padded tensors (right padding, left padding, or both).
        prompt_lengths: `[R]` prompt tokens of each row: rows join one document when they share at least the prompt
            of one of them (and at least one token). None: the common prefix of the rows of the row's example (with
            `examples`), else any shared token joins.
        examples: `[R]` the example (pair, ranked group) of each stock row.
        across_examples: share between the rows of different examples (the trie); False: within an example only, and
            each example is one document.
        share: False: no sharing, each row its own document, except identical rows of one example (which stay one
            document so that they get bitwise identical results, as in stock).
        score_padding: also lay out the padding after each row's tokens, as stock computes it when a trainer scores
            it (online DPO's statistics do); see `layout.assemble_layout`.
        check: verify that each row's tokens are one run (a comparison on the rows' device, so a host sync there).
        root: the first `root` columns of every row are one block all rows share (PEFT's virtual tokens, the same in
            every row), so every row joins one document, whatever the join rule.
        shift: rows share a common start wherever it sits in their columns (keys by token index, not by column), and
            each document's positions count from its earliest row's first column: a row that starts later in its
            stock columns (more left padding) is moved to the document's start. Only for shift-invariant models
            (`architectures.shift_invariant`: rotary positions, whose attention reads only the distance between two
            positions, which no row's tokens change), and only the `"always"` join uses it: under `"prompts"`, rows
            join only with rows that start at the same column, as without it.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lengths: torch.Tensor | None = None
    examples: torch.Tensor | None = None
    across_examples: bool = True
    share: bool = True
    score_padding: bool = False
    check: bool = True
    root: int = 0
    shift: bool = False

    def __post_init__(self):
        if self.input_ids.dim() != 2 or self.attention_mask.shape != self.input_ids.shape:
            raise ValueError("`input_ids` and `attention_mask` must be [rows, length] tensors of the same shape.")

    @classmethod
    def generated(
        cls, input_ids, attention_mask, prompt_length: int, score_padding=False, check=True, shift=False
    ) -> StockRows:
        """Generated rows `[prompt (prompt_length columns) | completion]` (GRPO, RLOO, online DPO): a row's prompt is
        its tokens in the prompt columns, so a prompt's generations (and duplicate prompts') form one document;
        `shift`: prompts of other lengths (left-padded by other amounts) share their common start too (see `shift`)."""
        prompt_lengths = attention_mask[:, :prompt_length].sum(dim=1)
        return cls(input_ids, attention_mask, prompt_lengths, score_padding=score_padding, check=check, shift=shift)


def plan_layout(rows: StockRows, join: str = "prompts") -> LayoutPlan:
    """Sort the stock `rows` into a trie and find what each row adds (tensor ops on the rows' device), under the join
    rule `join`: `"prompts"` or `"always"` (see `JOINS`; `"auto"` chooses between their plans in `build_layout`)."""
    if join == "auto":
        raise ValueError("`plan_layout` makes one plan: `join='auto'` chooses between plans in `build_layout`.")
    (plan,) = plan_layouts(rows, joins=(join,))
    return plan


@dataclass
class _SortedRows:
    """The stock rows in depth-first order, before any join rule (what every plan of a build shares)."""

    order: torch.Tensor  # [R] stock row of each sorted place
    starts: torch.Tensor  # [R] first column of each sorted row's tokens
    lengths: torch.Tensor  # [R] tokens laid out for each sorted row
    real: torch.Tensor  # [R] real tokens of each sorted row
    same_start: torch.Tensor  # [R] whether the row before starts at the same column
    shared: torch.Tensor  # [R] tokens each sorted row shares with the one before it
    prompts: torch.Tensor  # [R] prompt tokens of each sorted row
    same_example: torch.Tensor | None  # [R] whether the row before is of the same example (within-example sharing)


def _sort_stock_rows(stock: StockRows) -> _SortedRows:
    """The rows sorted into a trie: each row's place, tokens, and what it shares with the row before it."""
    input_ids, prompt_lengths, examples = stock.input_ids, stock.prompt_lengths, stock.examples
    device = input_ids.device
    num_rows, width = input_ids.shape
    real, starts = _token_runs(stock.attention_mask, stock.check)
    columns = torch.arange(width, device=device)
    in_row = (columns >= starts[:, None]) & (columns < (starts + real)[:, None])
    keys = torch.where(in_row, input_ids, _NO_TOKEN)
    if stock.score_padding:  # the padding after a row's tokens is laid out (and scored) with the row
        keys = torch.where(columns >= (starts + real)[:, None], _SCORED_PAD - input_ids, keys)
        lengths = torch.where(real > 0, width - starts, 0)
    else:
        lengths = real
    key_starts = starts
    if stock.shift:  # each row's keys from its first token on: a common start is common wherever its columns are
        at = (starts[:, None] + columns).clamp(max=max(width - 1, 0))
        keys = torch.where(columns < (width - starts)[:, None], keys.gather(1, at), _NO_TOKEN)
        key_starts = torch.zeros_like(starts)
    lead = 0
    examples = examples.to(device) if examples is not None else None
    if examples is not None and (not stock.across_examples or not stock.share):
        keys = torch.cat([examples.view(-1, 1), keys], dim=1)  # rows of different examples never meet
        lead = 1
    common = pairwise_common_prefix(keys)
    order = _sort_rows(keys, common) if num_rows else torch.zeros(0, dtype=torch.long, device=device)
    index = torch.arange(num_rows, device=device)

    if prompt_lengths is None and examples is not None:  # what the rows of each example have in common
        same = examples[:, None] == examples[None, :]
        tokens_common = (common - lead - key_starts[:, None]).clamp(min=0)
        tokens_common = torch.minimum(tokens_common, torch.minimum(lengths[:, None], lengths[None, :]))
        sibling = same & (index[:, None] != index[None, :])
        big = torch.iinfo(torch.long).max
        prompt_lengths = torch.where(sibling, tokens_common, big).amin(dim=1)
        prompt_lengths = torch.where(prompt_lengths == big, lengths, prompt_lengths)  # an example of one row
    if prompt_lengths is None:
        prompt_lengths = torch.ones(num_rows, dtype=torch.long, device=device)

    s_starts, s_lengths = starts[order], lengths[order]
    # tokens each sorted row shares with the one before it (the most any earlier row shares with it)
    shared = (common[order, _previous(order)] - lead - key_starts[order]).clamp(min=0)
    shared = torch.minimum(shared, torch.minimum(s_lengths, _previous(s_lengths)))
    same_example = None
    if lead:
        s_examples = examples[order]
        same_example = s_examples == _previous(s_examples)
    same_start = s_starts == _previous(s_starts)
    prompts = prompt_lengths.to(device)[order]
    return _SortedRows(order, s_starts, s_lengths, real[order], same_start, shared, prompts, same_example)


def _joined_plan(rows: _SortedRows, stock: StockRows, join: str) -> LayoutPlan:
    """The plan of sorted rows under one join rule (`"prompts"` or `"always"`)."""
    device = rows.order.device
    num_rows = rows.order.shape[0]
    index = torch.arange(num_rows, device=device)
    shared, s_lengths = rows.shared, rows.lengths
    prev_lengths = _previous(s_lengths)
    if stock.share:
        joins = shared >= torch.minimum(rows.prompts, _previous(rows.prompts)).clamp(min=1)
        if stock.shift:  # a prompt joins another one only where both start at the same column, as without `shift`
            joins &= rows.same_start
        if join == "always":  # any common start of two tokens saves positions (one is copied to start the branch)
            joins |= shared >= 2
        if stock.root:  # a block every row starts with: one copy, visible to every row
            joins |= shared >= stock.root
        if rows.same_example is not None:  # within examples only (sorted by example first): an example's rows are
            joins |= rows.same_example  # one document, as in stock's pairing, even when they share nothing
    else:
        joins = (shared == s_lengths) & (s_lengths == prev_lengths)  # identical rows (of one example)
    joins &= index > 0
    shared = torch.where(joins, shared, 0)
    # the last common token starts this row's branch again when the path it leaves goes on with another token
    copy = (shared > 0) & (prev_lengths > shared)
    first_new = shared - copy.long()
    added = s_lengths - first_new
    document = (~joins).long().cumsum(0) - 1
    ends = added.cumsum(0)
    document_start = torch.where(joins, 0, ends - added).cummax(0).values  # where each row's document starts
    offset = ends - added - document_start
    document_lengths = torch.zeros(num_rows, dtype=torch.long, device=device).scatter_add_(0, document, added)
    return LayoutPlan(
        order=rows.order,
        starts=rows.starts,
        lengths=s_lengths,
        real_lengths=rows.real,
        first_new=first_new,
        document=document,
        offset=offset,
        document_lengths=document_lengths,
        num_documents=(~joins).sum(),
        input_ids=stock.input_ids[rows.order],
        score_padding=stock.score_padding,
        join=join,
        shift=stock.shift,
    )


def plan_layouts(rows: StockRows, joins: tuple[str, ...] = ("prompts",)) -> list[LayoutPlan]:
    """The plans of the stock `rows` under each join rule of `joins` (`"auto"`: both), from one sort."""
    rules = [rule for join in joins for rule in _one_join(join)]
    sorted_rows = _sort_stock_rows(rows)
    return [_joined_plan(sorted_rows, rows, rule) for rule in rules]


def plan_sizes(plans: list[LayoutPlan]) -> list[list[int]]:
    """Per plan, read on the host in one go: its documents, its visible pairs, and every document's length."""
    sizes = [torch.cat([torch.stack([p.num_documents, p.visible_pairs]), p.document_lengths]) for p in plans]
    return torch.stack(sizes).tolist()


def plan_shape(plan: LayoutPlan, size: list[int], rows: RowPolicy):
    """The number and width of the shared rows `plan` needs under `rows`, where its documents go and the query-key
    pairs its mask lets through, or the `ValueError` saying why its documents do not fit `rows`."""
    num_documents, pairs, *lengths = size
    lengths = lengths[:num_documents]
    try:
        if rows.packs:
            num_rows, needed, placement = _placed(rows, lengths, plan.order.device)
        else:
            num_rows, needed, placement = num_documents, max(lengths, default=0), {}
        return num_rows, max(rows.width(needed), 1), placement, pairs
    except ValueError as error:  # the plan's rows do not fit `rows`
        return error


def _placed(rows: RowPolicy, lengths: list[int], device) -> tuple[int, int, dict]:
    """Packed rows for documents of `lengths`: their number, the widest row's tokens, and each document's row, first
    column and number within the row."""
    placed = rows.place(lengths)
    if sorted(d for row in placed for d in row) != list(range(len(lengths))):
        raise ValueError("A row policy's placement must place every document exactly once.")
    row_of, base, slot = ([0] * len(lengths) for _ in range(3))
    row_lens = []
    for r, row in enumerate(placed):
        cursor = 0
        for number, d in enumerate(row):
            row_of[d], base[d], slot[d] = r, cursor, number
            cursor += lengths[d]
        row_lens.append(cursor)
    placement = {
        "document_row": torch.tensor(row_of, device=device),
        "document_base": torch.tensor(base, device=device),
        "document_slot": torch.tensor(slot, device=device),
    }
    return len(placed), max(row_lens, default=0), placement
