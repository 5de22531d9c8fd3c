"""The layout of a shared row: how stock rows that start alike become one sequence, and how to map back.

Stock TRL scores each completion in its own padded row, ``[prompt | chosen]`` and ``[prompt | rejected]``. Here the
rows of one example (two for DPO and pairwise reward models, K for ranked data) become one *document*::

    stock    [p0 p1 p2 p3 c0 c1]          shared   [p0 p1 p2 | p3 c0 c1 | p3 r0 r1 r2]
             [p0 p1 p2 p3 r0 r1 r2]       position   0  1  2 |  3  4  5 |  3  4  5  6
                                          branch     0  0  0 |  1  1  1 |  2  2  2  2

The shared prefix is the longest common prefix of the rows, compared on (token, completion-mask) pairs, so it is
exact whatever the truncation did. A row identical to an earlier row of its group is not repeated: it reads the same
positions, so identical completions get bitwise identical results, as in the stock rows. Its last token starts every
branch (same token, same position, same visible keys, so the same hidden state): that copy scores the first token of
each completion, as the last prompt token does in the stock rows. Rows with nothing in common still work (an empty
prefix: K separate sequences in one document).

The layout is built from the *stock collator's own tensors*, so the tokens scored are exactly the ones stock TRL
scores. ``stock_index`` maps every stock position to its place in the shared rows; everything computed on the shared
rows (log-probs, rewards) is gathered back through it.

A token's position id is its column in the stock row, which is what the model gives it when no position ids are
passed. Right-padded rows (TRL's DPO and reward collators) start at column 0; left-padded prompts (GRPO, RLOO, online
DPO: ``[pad pad p0 p1 | c0 c1 pad]``) keep the positions of their pads, exactly as stock computes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


__all__ = [
    "build_shared_batch",
    "common_prefix_length",
    "shared_labels",
    "gather_to_stock",
    "groups_by_prefix",
    "shared_group_layout",
]


def common_prefix_length(rows: Sequence[Sequence]) -> int:
    """Length of the longest common prefix of several sequences."""
    if not rows:
        return 0
    n = min(len(r) for r in rows)
    first = rows[0]
    for i in range(n):
        item = first[i]
        if any(r[i] != item for r in rows[1:]):
            return i
    return n


def build_shared_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    groups: Sequence[Sequence[int]],
    completion_mask: torch.Tensor | None = None,
    rows: Sequence[Sequence[int]] | None = None,
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
    row_length: int | None = None,
    score_padding: bool = False,
) -> dict[str, torch.Tensor]:
    """Lay out stock rows as prefix-shared documents.

    Args:
        input_ids, attention_mask: stock ``[R, L]`` padded tensors (right-padded as TRL's collators build them, or
            left-padded prompts as generation builds them).
        groups: for each document, the stock row indices that share a prompt (e.g. ``[i, B + i]`` for DPO).
        completion_mask: stock ``[R, L]`` completion mask; the shared prefix never mixes prompt and completion.
        rows: which documents go in which shared row (packing); default one document per row.
        pad_token_id: token used for padding the shared rows.
        pad_to_multiple_of: round the shared row length up to a multiple of this.
        row_length: fixed shared row length (packing); an error if a row does not fit.
        score_padding: also lay out the padding after each row's tokens, as stock computes it when a trainer scores
            it (online DPO's statistics do): a padding query sees its row's tokens and no key sees padding. Those
            positions join the row's branch, and ``key_visible`` (False for them) is returned for the mask.

    Returns:
        ``input_ids``, ``position_ids``, ``document_ids`` (-1 = padding), ``branch_ids`` (0 = prefix) of shape
        ``[N, S]`` (and ``key_visible`` with ``score_padding``), and ``stock_index`` ``[R, L]``: the flat index (into
        ``N * S``) of every stock token, -1 for padding.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError("`input_ids` and `attention_mask` must be [rows, length] tensors of the same shape.")
    num_stock_rows, stock_len = input_ids.shape
    lengths, starts = _token_runs(attention_mask)
    ids_list = input_ids.tolist()
    cm_list = completion_mask.tolist() if completion_mask is not None else None

    seen = [False] * num_stock_rows
    docs = []  # per document: (tokens, positions, branches, {stock_row: [offsets]})
    for group in groups:
        for r in group:
            if not 0 <= r < num_stock_rows or seen[r]:
                raise ValueError(f"Stock row {r} is out of range or in two groups.")
            seen[r] = True
        keyed = []  # (token, position[, completion mask]) of each row's tokens: equal keys mean equal hidden states
        for r in group:
            columns = range(starts[r], starts[r] + lengths[r])
            keyed.append(
                [(ids_list[r][c], c, cm_list[r][c]) if cm_list is not None else (ids_list[r][c], c) for c in columns]
            )
        m = common_prefix_length(keyed)
        s = max(m - 1, 0)  # the last common token heads every branch
        first, start0 = ids_list[group[0]], starts[group[0]]
        tokens = list(first[start0 : start0 + s])
        positions = list(range(start0, start0 + s))
        branches = [0] * s
        visible = [True] * s
        offsets = {}
        branch = 0
        for key, r in zip(keyed, group, strict=True):
            twin = next((group[j] for j in range(len(offsets)) if keyed[j] == key), None)
            if twin is not None:  # identical to an earlier row: the same positions (bitwise equal, as in stock)
                offsets[r] = offsets[twin]
                continue
            n, first_column = lengths[r], starts[r]
            end = stock_len if score_padding else first_column + n  # the row's tokens (and its trailing padding)
            start = len(tokens)
            branch += 1
            tokens.extend(ids_list[r][first_column + s : end])
            positions.extend(range(first_column + s, end))
            branches.extend([branch] * (end - first_column - s))
            visible.extend([True] * (n - s) + [False] * (end - first_column - n))
            offsets[r] = list(range(min(s, n))) + list(range(start, start + max(end - first_column - s, 0)))
        docs.append((tokens, positions, branches, visible, offsets))

    if rows is None:
        rows = [[d] for d in range(len(docs))]
    used = sorted(d for row in rows for d in row)
    if used != list(range(len(docs))):
        raise ValueError("`rows` must place every document exactly once.")
    row_lens = [sum(len(docs[d][0]) for d in row) for row in rows]
    if row_length is None:
        width = max(row_lens, default=0)
        if pad_to_multiple_of:
            width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    else:
        width = row_length
        if max(row_lens, default=0) > width:
            raise ValueError(f"A packed row needs {max(row_lens)} tokens, more than row_length={width}.")
    width = max(width, 1)

    n_rows = len(rows)
    out_ids = torch.full((n_rows, width), pad_token_id, dtype=torch.long)
    out_pos = torch.zeros((n_rows, width), dtype=torch.long)
    out_doc = torch.full((n_rows, width), -1, dtype=torch.long)
    out_branch = torch.zeros((n_rows, width), dtype=torch.long)
    out_visible = torch.ones((n_rows, width), dtype=torch.bool)
    stock_index = torch.full((num_stock_rows, stock_len), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        cursor = 0
        for doc_number, d in enumerate(row):
            tokens, positions, branches, visible, offsets = docs[d]
            n = len(tokens)
            sl = slice(cursor, cursor + n)
            out_ids[i, sl] = torch.tensor(tokens, dtype=torch.long)
            out_pos[i, sl] = torch.tensor(positions, dtype=torch.long)
            out_doc[i, sl] = doc_number
            out_branch[i, sl] = torch.tensor(branches, dtype=torch.long)
            out_visible[i, sl] = torch.tensor(visible, dtype=torch.bool)
            base = i * width + cursor
            for r, offs in offsets.items():
                if offs:
                    stock_index[r, starts[r] : starts[r] + len(offs)] = base + torch.tensor(offs, dtype=torch.long)
            cursor += n
    # Padding queries see earlier padding only: never a real token, and never an empty row (no NaN in softmax).
    layout = {
        "input_ids": out_ids,
        "position_ids": out_pos,
        "document_ids": out_doc,
        "branch_ids": out_branch,
        "stock_index": stock_index,
    }
    if score_padding:
        layout["key_visible"] = out_visible
    return layout


def _token_runs(attention_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """(length, first column) of each row's tokens, which must be one run: right padding, left padding, or both."""
    lengths = attention_mask.sum(dim=1)
    starts = torch.where(lengths > 0, attention_mask.int().argmax(dim=1), torch.zeros_like(lengths))
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    one_run = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
    if not torch.equal(attention_mask.bool(), one_run):
        raise ValueError(
            "Prefix sharing needs each stock row's tokens in one run (padding only before or after them), "
            "as TRL's collators and generation build them; this attention_mask has holes."
        )
    return lengths.tolist(), starts.tolist()


def groups_by_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix_length: int) -> list[list[int]]:
    """Rows whose first ``prefix_length`` columns (tokens and mask) are equal, in order of first appearance.

    For generated batches (``[left-padded prompt | completion]``): the generations of one prompt. Rows with equal
    prompt columns compute equal prompt hidden states, so sharing them is exact even when two groups came from
    duplicate prompts.
    """
    keys = torch.cat([input_ids[:, :prefix_length], attention_mask[:, :prefix_length]], dim=1).tolist()
    groups: dict[tuple, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(tuple(key), []).append(row)
    return list(groups.values())


def shared_group_layout(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
    score_padding: bool = False,
) -> dict[str, torch.Tensor]:
    """The shared layout of generated rows ``[prompt (prompt_length columns) | completion]`` (GRPO, RLOO, online DPO):
    one document per group of rows with equal prompt columns, on the rows' device (``score_padding``: see
    `build_shared_batch`)."""
    groups = groups_by_prefix(input_ids, attention_mask, prompt_length)
    completion_mask = attention_mask.clone()
    completion_mask[:, :prompt_length] = 0  # a shared prefix never mixes prompt and completion tokens
    layout = build_shared_batch(
        input_ids,
        attention_mask,
        groups,
        completion_mask=completion_mask,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
        score_padding=score_padding,
    )
    return {name: tensor.to(input_ids.device) for name, tensor in layout.items()}


def shared_labels(layout: dict[str, torch.Tensor], stock_labels: torch.Tensor) -> torch.Tensor:
    """Next-token labels on the shared rows (``shift_labels`` for the fused LM head) from the stock ``labels``.

    The hidden state at a shared position predicts what its stock position predicts; positions shared by several
    stock rows get the same label from each of them (the layout guarantees it, and it is checked here).
    """
    index = layout["stock_index"][:, :-1]
    labels = stock_labels[:, 1:].to(index.device)
    valid = (index >= 0) & (labels != -100)
    flat = torch.full((layout["input_ids"].numel(),), -100, dtype=torch.long, device=index.device)
    flat[index[valid]] = labels[valid]
    if not torch.equal(flat[index[valid]], labels[valid]):
        raise RuntimeError("Prefix-sharing layout error: a shared position would score two different labels.")
    return flat.view_as(layout["input_ids"])


def gather_to_stock(shared: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, fill=0) -> torch.Tensor:
    """Gather a per-position tensor ``[N, S, ...]`` of the shared rows back to stock positions ``index`` ``[R, T]``.

    Positions where ``valid`` is False get ``fill``. Differentiable: gradients of repeated positions add up, exactly as
    the stock rows' separate copies of the shared prefix would.
    """
    flat = shared.reshape(shared.shape[0] * shared.shape[1], *shared.shape[2:])
    gathered = flat[index.clamp(min=0)]
    mask = valid.view(*valid.shape, *([1] * (gathered.dim() - valid.dim())))
    return torch.where(mask, gathered, torch.as_tensor(fill, dtype=gathered.dtype, device=gathered.device))
