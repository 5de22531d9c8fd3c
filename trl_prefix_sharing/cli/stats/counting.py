"""The positions `stats` counts: each micro-batch's stock rows laid out as training lays them out, with and without
prefix sharing. DPO and reward data are collated by the trainer's own collator; the rows of a KTO or ORPO/CPO
micro-batch are built here as TRL's collators build them (`kto_rows`, `paired_rows`:
`tests/tools/test_stats_trainers.py` compares them with what TRL's trainers collate) and planned by the layout training
builds (`plan_rows`), each example on its own (what training lays out of them across examples: `trained.py`); SFT's
micro-batches go through the SFT trainer's own collator (TRL's, wrapped in `PrefixSharingCollator` with the SFT
trainer's examples and prompts), so the counts are what training lays out
(`test_stats_sft_counts_what_a_training_run_logs`). Also the packing estimate of DPO and reward data (`_packing`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def kto_rows(batch: list[dict], max_length: int | None) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The stock rows of one KTO micro-batch as TRL's collator builds them (each cut to `max_length`): the main rows
    `prompt + completion`, the KL rows `prompt + KL completion`, and each example's prompt tokens in them."""
    cut = slice(None, max_length)
    main = [(example["prompt_ids"] + example["completion_ids"])[cut] for example in batch]
    kl = [(example["prompt_ids"] + example["KL_completion_ids"])[cut] for example in batch]
    prompts = [len(example["prompt_ids"][cut]) for example in batch]
    return main, kl, prompts


def paired_rows(batch: list[dict]) -> tuple[list[list[int]], list[int]]:
    """The stock rows of one ORPO/CPO micro-batch (`concatenated_inputs`: the chosen rows, then the rejected rows),
    and each example's prompt tokens in them (its chosen row's label mask)."""
    rows = [example["chosen_input_ids"] for example in batch] + [example["rejected_input_ids"] for example in batch]
    prompts = [example["chosen_labels"].count(-100) for example in batch]
    return rows, prompts


@dataclass
class _PreferenceCounts:
    """What the report on data with its completions counts: lengths per example (or per row: `rest_lens`) and
    totals. "Padded": in micro-batches of `per_device_train_batch_size` consecutive examples, padding included."""

    prompt_lens: list[int] = field(default_factory=list)
    common_lens: list[int] = field(default_factory=list)
    shared_lens: list[int] = field(default_factory=list)
    rest_lens: list[int] = field(default_factory=list)
    shared_units: list[int] = field(default_factory=list)
    unshared_units: list[int] = field(default_factory=list)
    stock_tokens: int = 0
    shared_tokens: int = 0
    stock_attention: int = 0
    shared_attention: int = 0
    no_prefix: int = 0
    stock_padded: int = 0  # stock's rows, padded
    shared_padded: int = 0  # the shared rows as trained (ORPO/CPO: with `prefix_sharing_score_padding` as given)
    other_padded: int = 0  # ORPO/CPO: the shared rows with the other `prefix_sharing_score_padding`
    step_stock: int = 0  # KTO: positions of the training steps, a pass with gradients weighted 3 (its backward)
    step_shared: int = 0
    batches: int = 0
    merged: int = 0  # KTO: batches whose policy gradient pass runs the KL rows too


def _dpo_prompt_lengths(batch, lengths: list[int]) -> list[int] | None:
    """DPO: the prompt of each row is what precedes its completion mask (after truncation). None for the reward
    trainer, which tokenizes prompt and completion as one text."""
    if "completion_mask" not in batch:
        return None
    completion = batch["completion_mask"].bool()
    return [int(completion[r].int().argmax()) if completion[r].any() else lengths[r] for r in range(len(lengths))]


def _count_examples(
    counts: _PreferenceCounts, per_doc: list[int], prefix: list[int], lengths, groups, prompts
) -> None:
    """Add examples laid out each on its own (one document per example, in example order) to `counts`: `per_doc[e]`
    the positions of example e's document, `prefix[e]` those more than one of its rows read (its shared prefix),
    `lengths[r]` the tokens of stock row r, `groups[e]` the stock rows of example e, `prompts[r]` the prompt tokens
    of row r (None: not known apart)."""
    from ...savings import causal_pairs

    for group, doc_len, p in zip(groups, per_doc, prefix, strict=True):
        rows = [lengths[r] for r in group]
        shared_p = p + 1 if p else 0  # the prefix plus the copy of its last token heading each branch
        counts.shared_lens.append(shared_p)
        counts.rest_lens.extend(max(n - shared_p, 0) for n in rows)  # a row that is all prefix: none
        if prompts is not None:
            prompt = prompts[group[0]]
            counts.prompt_lens.append(prompt)
            counts.common_lens.append(max(shared_p - prompt, 0))
        counts.stock_tokens += sum(rows)
        counts.shared_tokens += doc_len
        counts.shared_units.append(doc_len)
        counts.unshared_units.append(sum(rows))
        counts.stock_attention += sum(causal_pairs(0, [n]) for n in rows)
        counts.shared_attention += causal_pairs(p, [n - p for n in rows])
        counts.no_prefix += p == 0


def _count_batch(counts: _PreferenceCounts, batch, batch_size: int) -> None:
    """Add one collated chunk of DPO or reward examples (with its layout) to `counts`."""
    from ...examples import example_groups
    from ...layout import shared_positions

    layout = batch["prefix_sharing"]
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    per_doc = (layout.document_ids >= 0).sum(dim=1).tolist()
    groups = example_groups(batch)
    for first in range(0, len(groups), batch_size):  # consecutive examples stand in for a shuffled batch
        rows = [r for group in groups[first : first + batch_size] for r in group]
        counts.stock_padded += len(rows) * max(lengths[r] for r in rows)
        docs = per_doc[first : first + batch_size]
        counts.shared_padded += len(docs) * max(docs)
    prefix = shared_positions(layout).sum(dim=1).tolist()  # positions every row of the example reads
    _count_examples(counts, per_doc, prefix, lengths, groups, _dpo_prompt_lengths(batch, lengths))


def _measure_preferences(dataset, base, pad_token_id: int, batch_size: int) -> _PreferenceCounts:
    """Collate the prepared examples with prefix sharing, each example on its own (what every micro-batch saves; one
    that holds several pairs of a prompt saves more), and count."""
    from tqdm.auto import tqdm

    from ...collator import PrefixSharingCollator

    collator = PrefixSharingCollator(base, pad_token_id=pad_token_id, across_examples=False)
    counts = _PreferenceCounts()
    chunk = 256 // batch_size * batch_size or batch_size
    for start in tqdm(range(0, len(dataset), chunk), desc="Measuring", disable=len(dataset) <= 4 * chunk):
        examples = [dataset[i] for i in range(start, min(start + chunk, len(dataset)))]
        _count_batch(counts, collator(examples), batch_size)
    return counts


def plan_rows(rows: list[list[int]], examples: list[int], pad_token_id: int, score_padding: bool = False):
    """What the layout training builds makes of one micro-batch's stock rows (right-padded to the longest with
    `pad_token_id`), each example on its own (`examples[r]`: the example of row r, numbered from 0 in order): per
    example, the positions of its shared row and its shared prefix (the positions more than one of its rows read).
    From the layout's plan (`plan_layout`), without assembling the shared rows."""
    import torch

    from ...trie import StockRows, plan_layout

    width = max(map(len, rows))
    input_ids = torch.tensor([row + [pad_token_id] * (width - len(row)) for row in rows])
    attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    plan = plan_layout(
        StockRows(
            input_ids,
            attention_mask,
            examples=torch.tensor(examples),
            across_examples=False,
            score_padding=score_padding,
        )
    )
    documents = int(plan.num_documents)
    # a document's first row reads nothing before it (`first_new` 0); each later row reads `first_new` positions
    prefix = torch.zeros(documents, dtype=torch.long).scatter_reduce(0, plan.document, plan.first_new, "amax")
    return plan.document_lengths[:documents].tolist(), prefix.tolist()


def _batches(dataset, batch_size: int, what: str):
    """The examples of `dataset` in micro-batches of `batch_size` consecutive examples (a list of dicts each)."""
    from tqdm.auto import tqdm

    chunk = max(256 // batch_size, 1) * batch_size
    for start in tqdm(range(0, len(dataset), chunk), desc=what, disable=len(dataset) <= 4 * chunk):
        rows = dataset[start : start + chunk]
        examples = [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)]
        for first in range(0, len(examples), batch_size):
            yield examples[first : first + batch_size]


def _measure_paired(dataset, pad_token_id: int, batch_size: int, score_padding: bool) -> _PreferenceCounts:
    """ORPO/CPO: each micro-batch's chosen and rejected rows laid out as training lays them out (both rows of an
    example after one copy of their common start; with `score_padding`, each row's padding computed too), counted
    with and without the padding scored."""
    counts = _PreferenceCounts()
    columns = ["chosen_input_ids", "rejected_input_ids", "chosen_labels"]
    for batch in _batches(dataset.select_columns(columns), batch_size, "Measuring"):
        rows, prompts = paired_rows(batch)
        n = len(batch)
        examples = list(range(n)) * 2
        lengths = [len(row) for row in rows]
        per_doc, prefix = plan_rows(rows, examples, pad_token_id)
        _count_examples(counts, per_doc, prefix, lengths, [[e, n + e] for e in range(n)], prompts + prompts)
        unscored = n * max(per_doc)  # the shared rows: one per example, as wide as the longest
        scored = n * max(plan_rows(rows, examples, pad_token_id, score_padding=True)[0])
        counts.stock_padded += len(rows) * max(lengths)
        counts.shared_padded += scored if score_padding else unscored
        counts.other_padded += unscored if score_padding else scored
    return counts


def _measure_kto(dataset, pad_token_id: int, args) -> _PreferenceCounts:
    """KTO: each micro-batch's main and KL rows as the reference pass lays them out (an example's two rows after one
    copy of their prompt), and its training step: the policy's gradient pass (weighted 3) merged with the KL rows
    where `--prefix_sharing_merge_kl` says (else the main rows, then the KL rows in a pass without gradients, where
    different prompts share nothing), the reference pass over both."""
    from ...kto_trainer import MERGE_PROMPT_RATIO

    counts = _PreferenceCounts()
    columns = ["prompt_ids", "completion_ids", "KL_completion_ids"]
    max_length = args.max_length or None
    for batch in _batches(dataset.select_columns(columns), args.per_device_train_batch_size, "Measuring"):
        main, kl, prompts = kto_rows(batch, max_length)
        n = len(batch)
        lengths = [len(row) for row in main + kl]
        per_doc, prefix = plan_rows(main + kl, list(range(n)) * 2, pad_token_id)
        _count_examples(counts, per_doc, prefix, lengths, [[e, n + e] for e in range(n)], prompts + prompts)
        main_padded, kl_padded = n * max(lengths[:n]), n * max(lengths[n:])
        shared = n * max(per_doc)  # the merged shared rows: one per example, as wide as the longest
        counts.stock_padded += main_padded + kl_padded
        counts.shared_padded += shared
        merge = args.prefix_sharing_merge_kl
        if merge is None:  # the trainer's rule: the batch's prompt tokens against its KL completion tokens
            merge = sum(prompts) > MERGE_PROMPT_RATIO * (sum(lengths[n:]) - sum(prompts))
        counts.batches += 1
        counts.merged += merge
        counts.step_stock += 3 * main_padded + kl_padded + main_padded + kl_padded
        counts.step_shared += shared + (3 * shared if merge else 3 * main_padded + kl_padded)
    return counts


def _packing(units: list[int], batch_size: int, n: int) -> tuple[int, float, float]:
    """Row length (the trainer's default `packing_length`), efficiency, positions per example."""
    from ...sampler import MultipackSampler

    length = -(-batch_size * max(units) // 128) * 128
    sampler = MultipackSampler(units, length)
    return length, sampler.efficiency(), len(sampler) * length / n


@dataclass
class _SFTPlanCounts:
    """What one join rule lays out over the whole dataset: per row, the start it shares with another row of its
    shared row and the rest; totals."""

    shared_lens: list[int] = field(default_factory=list)
    rest_lens: list[int] = field(default_factory=list)
    joined: int = 0  # rows laid out in one shared row with another
    tokens: int = 0
    padded: int = 0  # the shared rows, each batch's as wide as its widest
    pairs: int = 0  # query-key pairs the mask lets through


@dataclass
class _SFTCounts:
    rows: int = 0
    batches: int = 0
    prompt_lens: list[int] = field(default_factory=list)  # the rows that have a prompt (a start not trained on)
    row_lens: list[int] = field(default_factory=list)
    stock_tokens: int = 0
    stock_padded: int = 0
    stock_pairs: int = 0
    plans: dict = field(default_factory=dict)  # join rule -> _SFTPlanCounts
    trained: dict = field(default_factory=dict)  # kernel -> `trained.TrainedCounts`: what training lays out


def _common_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens `ids` and `other` have in common."""
    return len(os.path.commonprefix([ids, other]))


def _count_sft_plan(counts: _SFTPlanCounts, plan, rows: list[list[int]]) -> None:
    """Add one micro-batch's plan (`trie.LayoutPlan`) of the stock `rows` to `counts`."""
    from collections import Counter

    order, document = plan.order.tolist(), plan.document.tolist()
    documents = int(plan.num_documents)
    lengths = plan.document_lengths[:documents].tolist()
    counts.tokens += sum(lengths)
    counts.padded += documents * max(lengths)
    counts.pairs += int(plan.visible_pairs)
    # in depth-first order a row shares the most with its neighbours; only those of its own shared row count
    common = [0] * (len(order) + 1)
    for i in range(1, len(order)):
        if document[i] == document[i - 1]:
            common[i] = _common_length(rows[order[i - 1]], rows[order[i]])
    sizes = Counter(document)
    for i, r in enumerate(order):
        shared = max(common[i], common[i + 1])
        counts.shared_lens.append(shared)
        counts.rest_lens.append(len(rows[r]) - shared)
        counts.joined += sizes[document[i]] > 1


def _measure_sft(dataset, collator, batch_size: int, kernels: dict | None = None) -> _SFTCounts:
    """Each micro-batch of `batch_size` consecutive examples collated and planned by the SFT trainer's own collator
    (`PrefixSharingCollator.plans`): per join rule (`auto`: both plans it chooses from), the positions of the shared
    rows; and with `kernels` (kernel -> the collator as training runs it there: `trained.kernel_collators`), the plan
    training lays out per micro-batch under each (`PrefixSharingCollator.layout`)."""
    from ...sft_trainer import prompt_end
    from .trained import TrainedCounts

    base = collator.base_collator
    counts = _SFTCounts()
    counts.trained = {name: TrainedCounts(plan=_SFTPlanCounts()) for name in kernels or {}}
    for examples in _batches(dataset.select_columns(["input_ids", "labels"]), batch_size, "Measuring"):
        batch = base(examples)
        rows = [example["input_ids"] for example in examples]
        lengths = [len(row) for row in rows]
        ends = [prompt_end(example["labels"]) for example in examples]
        counts.prompt_lens.extend(end for end, n in zip(ends, lengths, strict=True) if 0 < end < n)
        counts.rows += len(rows)
        counts.batches += 1
        counts.row_lens.extend(lengths)
        counts.stock_tokens += sum(lengths)
        counts.stock_padded += len(rows) * max(lengths)
        counts.stock_pairs += sum(n * (n + 1) // 2 for n in lengths)
        plans = collator.plans(batch)
        for plan in plans:
            _count_sft_plan(counts.plans.setdefault(plan.join, _SFTPlanCounts()), plan, rows)
        for name, kernel in (kernels or {}).items():
            layout = kernel.layout(batch, plans)
            counts.trained[name].add(batch, layout, len(rows))
            _count_sft_plan(counts.trained[name].plan, next(p for p in plans if p.join == layout.join), rows)
    return counts
