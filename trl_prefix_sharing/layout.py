"""The layout of shared rows: the stock rows of a micro-batch as a prefix trie, and how to map back.

Stock TRL scores each completion in its own padded row. Here every token prefix that several rows of the micro-batch
share (the same tokens at the same positions, whichever pairs, groups, turns or duplicate prompts the rows come from)
is computed once. The rows become a trie, laid out depth-first::

    stock    [p0 p1 p2 p3 c0 c1]          shared   [p0 p1 p2 | p3 c0 c1 | p3 r0 r1 r2]
             [p0 p1 p2 p3 r0 r1 r2]       position   0  1  2 |  3  4  5 |  3  4  5  6
                                          subtree    10 10 10|  6  6  6 | 10 10 10 10   (end of each key's subtree)

Equal paths mean equal hidden states, so a row reads its tokens from the path of the trie that spells it, whether or
not it scores them: in a multi-turn conversation, turn t's chosen answer is a completion in one row and part of the
next turn's prompt in another, and both read the same positions. Where rows part, the last common token starts every
branch again (same token, same position, same visible keys, so the same hidden state): each copy scores the first
token of its own branch, as the last common token does in each stock row. A row that ends where another goes on reads
that row's path (its last token scores nothing). Identical rows read the same positions, so they get bitwise identical
results, as in stock.

In depth-first order the tokens under a key form one span, `[k, subtree_end[k])`, so the whole mask is one rule: a
query sees a key when the key is on its path, `k <= q < subtree_end[k]` (`on_path`).
A token's position id is its column in the stock row, which is what the model gives it when no position ids are
passed: right-padded rows (TRL's DPO and reward collators) start at column 0; left-padded prompts (GRPO, RLOO, online
DPO: `[pad pad p0 p1 | c0 c1 pad]`) keep the positions of their pads, exactly as stock computes them.

**Documents**: a trie laid out as one piece. How the rows are sorted, and which of them join one document (the join
rules, `JOINS`), is the plan (`trie.py`); this module chooses between plans and lays them out.

**One row for a varlen kernel.** `RowPolicy(stream=True)` lays every document in one row exactly as long as they are
together (no padding, no rounding) and describes its attention as query segments (`Segments`): each sorted row's new
tokens, reading the keys of its whole path, gathered.

`stock_index` maps every stock position to its place in the shared rows; everything computed on the shared rows
(log-probs, rewards) is gathered back through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from .trie import LayoutPlan, StockRows, plan_layouts, plan_shape, plan_sizes


if TYPE_CHECKING:
    from .attention import AttentionInputs
    from .virtual import VirtualRows


__all__ = [
    "Layout",
    "RowPolicy",
    "assemble_layout",
    "build_layout",
    "stock_layout",
    "shared_labels",
    "gather_to_stock",
    "shared_positions",
]


@dataclass
class Layout:
    """The shared rows of a micro-batch's stock rows, and the way back to stock (see the module docstring).

    Made by `build_layout` (a pure function of the stock rows); the trainer's session adds what its attention backend
    gives the model (`attention`), and for a vision batch the images once per example (`vision`). It travels in the
    batch under the key `"prefix_sharing"` and is moved to the device with it (`to`).

    Args:
        input_ids: `[N, S]` tokens of the shared rows (padding: the pad id).
        position_ids: `[N, S]` each token's column in its stock row.
        document_ids: `[N, S]` the document of each position within its row, -1 for padding.
        subtree_end: `[N, S]` the end of each key's subtree: query `q` sees key `k` when `k <= q < subtree_end[k]`
            (padding: itself only).
        stock_index: `[R, L]` the flat place (into `N * S`) of every stock token, -1 for stock padding.
        key_visible: `[N, S]` False for laid-out stock padding that is scored but never a key (`score_padding`), or
            None.
        attention: what the attention backend adds to the model call for these rows (`attention.AttentionInputs`: the
            mask of `subtree_end` as a FlexAttention `BlockMask` or a dense tensor, or the varlen kernel's segments),
            or None until the session adds it.
        check: whether the forward verifies the shared rows against the stock rows (a host sync on an accelerator).
        vision: the images of a vision batch, once per example, and their M-RoPE positions, or None.
        join: the join rule of the plan that was laid out (`JOINS`; `"auto"` chooses `"prompts"` or `"always"`).
        segments: for one unpadded row (`RowPolicy(stream=True)`), the attention calls that compute it as query
            segments reading their gathered paths (`Segments`), else None.
        kernel: the attention backend these rows were laid out for (`attention.BACKENDS`; `"stock"`: stock's own
            rows, run by the model's own forward and attention), or None where the session's one backend runs every
            layout.
        macs: the multiply-adds of a forward over these rows under `kernel`'s cost model (`cost.StepCost`), where
            `"auto"` chose them by measured costs (their training step is timed against it: `tuning.Tuning.tick`),
            else None.
        virtual: for a policy with prompt-learning PEFT, these rows with its virtual tokens before them, as the
            session lays them out once per layout (`virtual.VirtualRows`), or None.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    subtree_end: torch.Tensor
    stock_index: torch.Tensor
    key_visible: torch.Tensor | None = None
    attention: AttentionInputs | None = None
    check: bool = True
    vision: dict | None = None
    join: str = "prompts"
    segments: tuple[Segments, ...] | None = None
    kernel: str | None = None
    macs: float | None = None
    virtual: VirtualRows | None = None

    @property
    def is_stock(self) -> bool:
        """Whether these are stock's own rows (`stock_layout`), which the model's own forward runs as they are."""
        return self.kernel == "stock"

    @property
    def visible_pairs(self) -> torch.Tensor:
        """0-d: the query-key pairs the mask lets through (each token's keys on its path)."""
        columns = torch.arange(self.subtree_end.shape[1], device=self.subtree_end.device)
        return ((self.subtree_end - columns) * (self.document_ids >= 0)).sum()

    @property
    def num_positions(self) -> torch.Tensor:
        """0-d: the token positions the shared rows hold (what the model computes, padding excluded)."""
        return (self.document_ids >= 0).sum()

    @property
    def num_tokens(self) -> torch.Tensor:
        """0-d: the tokens the rows hold, padding excluded (stock's own rows: their real tokens; shared rows: their
        positions)."""
        return (self.stock_index >= 0).sum() if self.is_stock else self.num_positions

    def to(self, device, non_blocking: bool = False) -> Layout:
        """This layout on `device` (what accelerate calls when it moves a batch)."""
        return replace(self, **{f.name: _moved(getattr(self, f.name), device, non_blocking) for f in fields(self)})

    def pin_memory(self) -> Layout:
        """This layout in pinned memory (what a `DataLoader` with `pin_memory=True` calls)."""
        return replace(self, **{f.name: _moved(getattr(self, f.name), None, False) for f in fields(self)})


def _moved(value, device, non_blocking: bool):
    """`value` on `device` (None: in pinned memory): tensors, dicts and tuples of them and anything with `to` (a
    `BlockMask`, `Segments`)."""
    if isinstance(value, dict):
        return {key: _moved(item, device, non_blocking) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_moved(item, device, non_blocking) for item in value)
    if device is None:
        return value.pin_memory() if isinstance(value, torch.Tensor) else value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    return value.to(device) if hasattr(value, "to") else value


@dataclass
class Segments:
    """One attention call over a layout laid out as one unpadded row (`RowPolicy(stream=True)`), in the form a varlen
    kernel takes: query segments, each reading the keys of its own path.

    In the trie, every sorted row adds one run of new tokens after the path it shares with earlier rows. That run is a
    query segment, and its keys are its whole path, gathered along the trie: the ancestors' tokens, then its own. With
    bottom-right causal alignment (a segment of `q` queries over `k` keys: query `i` sees keys `0 .. k - q + i`), one
    call computes every token exactly as `on_path` allows. Scored padding (`score_padding`) is a second call: each
    row's padding queries see its whole real path and no padding key (`causal=False`).

    Args:
        key_index: `[K]` the flat place (in the row) of every key of every segment, segment after segment, each path
            in order.
        cu_queries: `[S + 1]` int32 cumulative query counts (segment `s` has queries `cu_queries[s]:cu_queries[s + 1]`
            of the queries this call computes).
        cu_keys: `[S + 1]` int32 cumulative key counts, into `key_index`.
        max_queries, max_keys: the longest segment's queries and keys.
        query_index: `[Q]` the flat place of each query of this call, or None where they are the whole row in order.
        causal: bottom-right causal (the tokens) or every key of the path (scored padding).
    """

    key_index: torch.Tensor
    cu_queries: torch.Tensor
    cu_keys: torch.Tensor
    max_queries: int
    max_keys: int
    query_index: torch.Tensor | None = None
    causal: bool = True

    @property
    def num_segments(self) -> int:
        return self.cu_queries.shape[0] - 1

    def bounds(self) -> list[tuple[int, int, int, int]]:
        """`(query_start, query_end, key_start, key_end)` of every segment, read on the host once (a reference
        implementation's loop)."""
        bounds = getattr(self, "_bounds", None)
        if bounds is None:
            q, k = self.cu_queries.tolist(), self.cu_keys.tolist()
            bounds = self._bounds = [(q[s], q[s + 1], k[s], k[s + 1]) for s in range(len(q) - 1)]
        return bounds

    def to(self, device, non_blocking: bool = False) -> Segments:
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


@dataclass(frozen=True)
class RowPolicy:
    """Where a layout puts its documents: one per row (the default), or several per row (packing).

    Args:
        pack: several documents per row, placed by first-fit decreasing (or as `placement` says).
        stream: every document in one row exactly as long as they are together (no padding, no rounding), described
            as query segments for a varlen attention kernel (`Layout.segments`); the other fields are then unused.
        length: the rows' fixed width. None: as wide as needed (unpacked: the longest document, rounded up to
            `multiple`; packed: first-fit decreasing into rows as wide as the longest document, the width dense
            attention pays no more for than stock's padded rows).
        one_row: packed: every document in one row of `length` tokens (a packing sampler made the batch fit).
        multiple: round a width that is not fixed up to a multiple of this (fewer compiled shapes).
        placement: packed: the documents (numbered in the trie's order) of each row, fixed (drawings, tests).
    """

    pack: bool = False
    length: int | None = None
    one_row: bool = False
    multiple: int | None = None
    placement: tuple[tuple[int, ...], ...] | None = None
    stream: bool = False

    @property
    def packs(self) -> bool:
        """Whether several documents share a row (packing, or the one row of a stream)."""
        return self.pack or self.stream

    def place(self, lengths: list[int]) -> list[list[int]]:
        """The documents of each row, given every document's length (policies that pack only)."""
        if self.stream:
            return [list(range(len(lengths)))]
        if self.placement is not None:
            return [list(row) for row in self.placement]
        if self.one_row:
            return [list(range(len(lengths)))]
        from .sampler import first_fit_decreasing

        capacity = self.length if self.length is not None else max(lengths, default=1)
        if max(lengths, default=0) > capacity:
            raise ValueError(f"A packed row needs {max(lengths)} tokens, more than its length of {capacity}.")
        order = sorted(range(len(lengths)), key=lambda d: -lengths[d])
        return first_fit_decreasing(order, lengths, capacity)

    def width(self, needed: int) -> int:
        """The rows' width when the widest row needs `needed` tokens; an error if a fixed width is too narrow."""
        if self.stream:
            return needed
        if self.length is not None:
            if needed > self.length:
                raise ValueError(f"A packed row needs {needed} tokens, more than its length of {self.length}.")
            return self.length
        if self.multiple and not self.pack:
            return -(-needed // self.multiple) * self.multiple
        return needed


def assemble_layout(
    plan: LayoutPlan,
    num_rows: int,
    width: int,
    document_row: torch.Tensor | None = None,
    document_base: torch.Tensor | None = None,
    document_slot: torch.Tensor | None = None,
    pad_token_id: int = 0,
    segments: bool = False,
) -> Layout:
    """Allocate the shared rows `[num_rows, width]` and place the plan's documents in them.

    Args:
        document_row, document_base, document_slot: per document, its shared row, its first column there, and its
            number within the row (`document_ids`); default one document per row.
        segments: also describe the rows as query segments for a varlen kernel (`Layout.segments`; one row only).

    Returns:
        `input_ids`, `position_ids`, `document_ids` (-1 = padding), `subtree_end` (a key's subtree is
        `[k, subtree_end[k])`; padding: itself only) of shape `[N, S]` (and `key_visible` with
        `score_padding`: False for stock's padding, a query that is never a key), and `stock_index` `[R, L]`:
        the flat index (into `N * S`) of every stock token, -1 for padding.
    """
    device = plan.order.device
    num_stock, stock_width = plan.input_ids.shape
    if document_row is None:
        document_row = torch.arange(num_stock, device=device)
        document_base = torch.zeros(num_stock, dtype=torch.long, device=device)
        document_slot = document_base
    in_row_start = document_base[plan.document] + plan.offset
    row_start = document_row[plan.document] * width + in_row_start  # flat
    columns = torch.arange(stock_width, device=device)
    sorted_index = torch.arange(num_stock, device=device)
    # by depth in the row: the sorted row whose new tokens hold (row, depth), the last row so far that adds that depth
    # (rows that share a path share it depth by depth, wherever their tokens start: `StockRows.shift`)
    adds = columns[None, :] >= plan.first_new[:, None]  # [R, depth]
    owner = torch.where(adds, sorted_index[:, None], -1).cummax(dim=0).values.clamp(min=0)
    by_depth = row_start[owner] + columns[None, :] - plan.first_new[owner]  # [R, depth] flat place
    depth = columns[None, :] - plan.starts[:, None]  # [R, L] depth of each stock column in its sorted row
    laid = (depth >= 0) & (depth < plan.lengths[:, None])
    new = laid & (depth >= plan.first_new[:, None])
    flat = torch.where(laid, by_depth.gather(1, depth.clamp(0, max(stock_width - 1, 0))), -1)  # [R, L] per column

    size = num_rows * width
    targets = flat[new]
    out_ids = torch.full((size,), pad_token_id, dtype=torch.long, device=device)
    out_ids[targets] = plan.input_ids[new]
    out_pos = torch.zeros(size, dtype=torch.long, device=device)
    out_pos[targets] = _positions(plan, columns, depth)[new]
    out_doc = torch.full((size,), -1, dtype=torch.long, device=device)
    out_doc[targets] = document_slot[plan.document].unsqueeze(1).expand_as(new)[new]
    in_row = torch.arange(size, device=device) % width
    subtree_end = in_row + 1  # padding sees itself only
    row_end = (in_row_start + plan.lengths - plan.first_new).unsqueeze(1).expand_as(laid)
    subtree_end.scatter_reduce_(0, flat[laid], row_end[laid], reduce="amax")
    stock_index = torch.full((num_stock, stock_width), -1, dtype=torch.long, device=device)
    stock_index[plan.order] = flat
    key_visible = None
    if plan.score_padding:
        key_visible = torch.ones(size, dtype=torch.bool, device=device)
        key_visible[targets] = (depth < plan.real_lengths[:, None])[new]
        key_visible = key_visible.view(num_rows, width)
    return Layout(
        input_ids=out_ids.view(num_rows, width),
        position_ids=out_pos.view(num_rows, width),
        document_ids=out_doc.view(num_rows, width),
        subtree_end=subtree_end.view(num_rows, width),
        stock_index=stock_index,
        key_visible=key_visible,
        segments=_segments(plan, flat, depth, laid, num_rows) if segments else None,
    )


def _positions(plan: LayoutPlan, columns: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """`[R, L]`: the position id of every stock column of every sorted row: its column (what the model gives it in the
    stock row), or with `shift` its depth after the first column of its document's earliest row (the same for a
    row that starts there; moved by the same amount for every token of a row that starts later)."""
    if not plan.shift:
        return columns.expand_as(depth)
    first = torch.full_like(plan.document_lengths, torch.iinfo(torch.long).max)
    first = first.scatter_reduce(0, plan.document, plan.starts, reduce="amin")  # each document's earliest start
    return first[plan.document][:, None] + depth


def _segments(plan: LayoutPlan, flat: torch.Tensor, depth: torch.Tensor, laid: torch.Tensor, num_rows: int):
    """The attention calls of a one-row layout as query segments (`Segments`): each sorted row's new real tokens
    reading its real path, bottom-right causal; with scored padding, a second call in which each row's padding reads
    its whole real path. `flat`, `depth`, `laid`: `[R, L]` per sorted row and stock column, the flat place, the depth
    in the row and whether it is laid out. One host read (the longest segments)."""
    if num_rows != 1:
        raise ValueError("Query segments describe a layout of one row (`RowPolicy(stream=True)`).")
    if flat.shape[0] == 0:
        return ()
    real, first = plan.real_lengths[:, None], plan.first_new[:, None]
    path = laid & (depth < real)  # every sorted row's real path
    calls = [(laid & (depth >= first) & (depth < real), True)]  # its new real tokens
    if plan.score_padding:
        calls.append((laid & (depth >= torch.maximum(first, real)), False))  # its padding
    sizes = []
    for queries, _ in calls:
        query_counts, key_counts = queries.sum(1), path.sum(1)
        key_counts = torch.where(query_counts > 0, key_counts, 0)  # a row that adds no query reads nothing
        sizes.append((query_counts, key_counts))
    longest = torch.stack([torch.stack([q.max(), k.max()]) for q, k in sizes]).tolist() if flat.shape[0] else []
    out = []
    for (queries, causal), (query_counts, key_counts), (max_q, max_k) in zip(calls, sizes, longest, strict=True):
        keep = query_counts > 0
        zero = torch.zeros(1, dtype=torch.int32, device=flat.device)
        out.append(
            Segments(
                key_index=flat[path & keep[:, None]],
                cu_queries=torch.cat([zero, query_counts[keep].cumsum(0).int()]),
                cu_keys=torch.cat([zero, key_counts[keep].cumsum(0).int()]),
                max_queries=max_q,
                max_keys=max_k,
                query_index=flat[queries] if plan.score_padding else None,  # else the row in order
                causal=causal,
            )
        )
    return tuple(out)


def build_layout(
    stock: StockRows,
    rows: RowPolicy | None = None,
    pad_token_id: int = 0,
    plan: LayoutPlan | list[LayoutPlan] | None = None,
    join: str = "prompts",
    cost=None,
    tuning=None,
) -> Layout:
    """The shared layout of `stock` rows (`trie.StockRows`): `plan_layouts`, the cheapest candidate, then
    `assemble_layout`. A pure function of the rows (and of `tuning`'s measured costs).

    Args:
        rows: where the documents go (`RowPolicy`): one per row (the default), or packed. Packing reads the documents'
            lengths on the host.
        pad_token_id: the token that pads the shared rows.
        plan: the plan of these rows, or the plans to choose from, if already made (`stock`'s other fields are then
            unused).
        join: how rows that share a prefix join one document (`JOINS`).
        cost: the step's cost model (`cost.StepCost`), which chooses between plans (`join="auto"`).
        tuning: the candidates to choose from and their measured costs (`tuning.Tuning`): stock rows, and every plan
            laid out for every kernel's rows and cost model (`rows` and `cost` are then unused). The layout says which
            it is (`Layout.kernel`; stock rows: `stock_layout`).

    One device-to-host read (each plan's number of documents and longest, or its documents' lengths when packed).
    """
    if plan is None:
        plan = plan_layouts(stock, joins=(join,))
    plans = plan if isinstance(plan, list) else [plan]
    from .tuning import Candidate, Tuning

    if tuning is None:  # one candidate: `rows`, chosen between plans by `cost`
        if len(plans) > 1 and cost is None:
            raise ValueError("Choosing between layout plans (`join='auto'`) needs the step's cost model (`cost`).")
        tuning = Tuning((Candidate(None, rows or RowPolicy(), cost),))
    sizes = plan_sizes(plans)
    options = []  # (predicted cost, candidate, plan index, shape)
    for candidate in tuning.candidates:
        if candidate.is_stock:
            num, width = stock.input_ids.shape
            options.append((tuning.estimate(candidate, num, width, num * width * width), candidate, None, None))
            continue
        for number, (p, size) in enumerate(zip(plans, sizes, strict=True)):
            shape = plan_shape(p, size, candidate.rows)
            many = len(plans) > 1 or len(tuning.candidates) > 1
            estimate = (
                0.0
                if isinstance(shape, ValueError) or not many
                else tuning.estimate(candidate, shape[0], shape[1], shape[3])
            )
            options.append((float("inf") if isinstance(shape, ValueError) else estimate, candidate, number, shape))
    explore = tuning.exploring() if tuning.fits else None  # a close candidate's turn (`tuning.Tuning.exploring`)
    turn = [option for option in options if option[1].name == explore and math.isfinite(option[0])]
    _, candidate, number, shape = min(turn or options, key=lambda option: option[0])  # the first on a tie
    macs = _chosen_macs(candidate, stock.input_ids, shape) if tuning.fits else None
    if candidate.is_stock:
        layout = stock_layout(stock.input_ids, stock.attention_mask, check=stock.check)
        layout.macs = macs
        return layout
    if isinstance(shape, ValueError):  # no plan fits the rows
        if plans[number].join != "always":
            raise shape
        raise ValueError(
            f"{shape} With `prefix_sharing_join='always'` the rows of several examples that start alike "
            "join one document, which can outgrow a fixed packed row: set `prefix_sharing_join='auto'` (which keeps "
            "to plans that fit) or `'prompts'`, or a larger `packing_length`."
        ) from shape
    num_rows, width, placement, _ = shape
    layout = assemble_layout(
        plans[number], num_rows, width, pad_token_id=pad_token_id, segments=candidate.rows.stream, **placement
    )
    layout.check = stock.check
    layout.join = plans[number].join
    layout.kernel = candidate.name
    layout.macs = macs
    return layout


def _chosen_macs(candidate, input_ids: torch.Tensor, shape) -> float:
    """The multiply-adds of the chosen candidate's rows (`cost.StepCost`): stock's `input_ids`, or a plan's `shape`."""
    if candidate.is_stock:
        num, width = input_ids.shape
        return candidate.cost.estimate(num, width, num * width * width)
    return candidate.cost.estimate(shape[0], shape[1], shape[3])


def stock_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, check: bool = True) -> Layout:
    """Stock's own rows as a layout (`Layout.kernel == "stock"`): the model's own forward runs them as they are, with
    its own attention; every column is a position the model computes (`num_positions`), and `stock_index` is the
    identity on the rows' tokens."""
    num, width = input_ids.shape
    device = input_ids.device
    columns = torch.arange(width, device=device)
    flat = torch.arange(num * width, device=device).view(num, width)
    return Layout(
        input_ids=input_ids,
        position_ids=columns.expand(num, width),
        document_ids=torch.zeros((num, width), dtype=torch.long, device=device),
        subtree_end=(columns + 1).expand(num, width),
        stock_index=torch.where(attention_mask.bool(), flat, -1),
        check=check,
        join="stock",
        kernel="stock",
    )


def shared_positions(layout: Layout) -> torch.Tensor:
    """`[N, S]`: positions of the shared rows that more than one stock position reads (the shared prefixes)."""
    index = layout.stock_index
    counts = torch.bincount(index[index >= 0], minlength=layout.input_ids.numel())
    return (counts > 1).view_as(layout.input_ids)


def shared_labels(
    layout: Layout, stock_labels: torch.Tensor, check: bool = True, shifted: bool = False
) -> torch.Tensor:
    """Next-token labels on the shared rows (`shift_labels` for the fused LM head) from the stock `labels`
    (`shifted`: the stock rows' own `shift_labels`, the label of each column itself, last column included).

    The hidden state at a shared position predicts what its stock position predicts; stock rows that score one shared
    position give it the same label (the next token on the path is unique where two rows score it). `check`
    verifies that (a host sync on the rows' device).
    """
    index = layout.stock_index if shifted else layout.stock_index[:, :-1]
    labels = (stock_labels if shifted else stock_labels[:, 1:]).to(index.device)
    valid = (index >= 0) & (labels != -100)
    flat = torch.full((layout.input_ids.numel(),), -100, dtype=torch.long, device=index.device)
    flat[index[valid]] = labels[valid]
    if check and not torch.equal(flat[index[valid]], labels[valid]):
        raise RuntimeError("Prefix-sharing layout error: a shared position would score two different labels.")
    return flat.view_as(layout.input_ids)


def gather_to_stock(shared: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, fill=0) -> torch.Tensor:
    """Gather a per-position tensor `[N, S, ...]` of the shared rows back to stock positions `index` `[R, T]`.

    Positions where `valid` is False get `fill`. Differentiable: gradients of repeated positions add up, exactly as
    the stock rows' separate copies of the shared prefix would.
    """
    flat = shared.reshape(shared.shape[0] * shared.shape[1], *shared.shape[2:])
    gathered = flat[index.clamp(min=0)]
    mask = valid.view(*valid.shape, *([1] * (gathered.dim() - valid.dim())))
    return torch.where(mask, gathered, torch.as_tensor(fill, dtype=gathered.dtype, device=gathered.device))
