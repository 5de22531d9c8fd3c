"""MultipackSampler properties on random lengths: coverage, capacity, determinism, equal counts, exact len, FFD."""

import random

import pytest
from torch.utils.data import DataLoader

from trl_prefix_sharing import MultipackSampler
from trl_prefix_sharing.sampler import first_fit_decreasing


def _lengths(seed, n, low=1, high=300):
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def _epoch(lengths, max_tokens, replicas, **kwargs):
    samplers = [
        MultipackSampler(lengths, max_tokens, num_replicas=replicas, rank=r, **kwargs) for r in range(replicas)
    ]
    return samplers, [list(s) for s in samplers]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
def test_coverage_capacity_equal_counts_and_len(seed, replicas):
    lengths = _lengths(seed, random.Random(seed).randint(1, 400))
    samplers, batches = _epoch(lengths, 1024, replicas, seed=seed)
    counts = [len(b) for b in batches]
    assert len(set(counts)) == 1, counts  # every rank yields the same number of batches
    assert all(len(s) == c for s, c in zip(samplers, counts, strict=True))  # len() is exact
    for rank_batches in batches:
        for batch in rank_batches:
            assert batch and sum(lengths[i] for i in batch) <= 1024
    seen = sorted(i for rank_batches in batches for batch in rank_batches for i in batch)
    assert set(seen) == set(range(len(lengths)))  # never a missing index
    if len(seen) > len(lengths):  # repeats only when no bin can be split: all single items, fewer than one per rank
        assert all(len(batch) == 1 for rank_batches in batches for batch in rank_batches)
        assert len(seen) - len(lengths) < replicas
    else:
        assert seen == list(range(len(lengths)))  # every index exactly once across ranks


@pytest.mark.parametrize("seed", range(4))
def test_every_index_exactly_once_when_splittable(seed):
    lengths = _lengths(seed, 257, 1, 60)  # small items: bins can always be split to divide among ranks
    _, batches = _epoch(lengths, 1000, 4, seed=seed)
    seen = sorted(i for rank_batches in batches for batch in rank_batches for i in batch)
    assert seen == list(range(257))


def test_drop_last_drops_and_never_repeats():
    lengths = _lengths(3, 101, 200, 300)
    samplers, batches = _epoch(lengths, 600, 4, drop_last=True)
    full = first_fit_decreasing(sorted(range(101), key=lambda i: -lengths[i]), lengths, 600)
    assert len(full) % 4  # something has to be dropped here
    seen = [i for rank_batches in batches for batch in rank_batches for i in batch]
    assert len(seen) == len(set(seen)) and len({len(b) for b in batches}) == 1
    assert [len(s) for s in samplers] == [len(b) for b in batches] == [len(full) // 4] * 4  # fewer than 4 bins dropped


def test_tiny_datasets():
    """Fewer items than ranks: every rank still yields the same number of batches (repeats fill in), or none at all
    with drop_last; one item, one rank: one batch."""
    samplers, batches = _epoch([5, 7], 16, 4)
    assert [len(b) for b in batches] == [1] * 4 and [len(s) for s in samplers] == [1] * 4
    assert {i for b in batches for batch in b for i in batch} == {0, 1}
    _, batches = _epoch([5, 7], 16, 4, drop_last=True)
    assert batches == [[]] * 4
    assert list(MultipackSampler([3], 3)) == [[0]]


def test_deterministic_per_seed_and_epoch():
    lengths = _lengths(0, 200)
    a = MultipackSampler(lengths, 800, seed=1)
    b = MultipackSampler(lengths, 800, seed=1)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != first
    assert len(a) == len(first)  # the number of batches does not change between epochs
    a.set_epoch(0)
    assert list(a) == first
    assert list(MultipackSampler(lengths, 800, seed=2)) != first


def test_load_is_balanced_across_ranks():
    lengths = _lengths(5, 2000, 10, 500)
    samplers, batches = _epoch(lengths, 2048, 4)
    loads = [sum(lengths[i] for b in rank_batches for i in b) for rank_batches in batches]
    assert max(loads) - min(loads) <= 2048


def test_really_first_fit_decreasing():
    lengths = _lengths(9, 300, 1, 500)
    order = sorted(range(300), key=lambda i: -lengths[i])
    naive = []  # the textbook O(n * bins) first fit on the same order
    for i in order:
        for b in naive:
            if sum(lengths[j] for j in b) + lengths[i] <= 1000:
                b.append(i)
                break
        else:
            naive.append([i])
    assert first_fit_decreasing(order, lengths, 1000) == naive


@pytest.mark.parametrize("profile", ["capybara", "hh_rlhf", "metamath", "tldr", "tulu_helpsteer", "ultrafeedback"])
def test_efficiency_on_paper_profiles(profile):
    # median prompt/completion tokens of the paper's datasets; lognormal spread; unit = shared layout length
    medians = {
        "capybara": (712, 448),
        "hh_rlhf": (127, 59),
        "metamath": (694, 178),
        "tldr": (382, 34),
        "tulu_helpsteer": (669, 106),
        "ultrafeedback": (121, 288),
    }
    p, c = medians[profile]
    rng = random.Random(0)
    draw = lambda m: max(1, int(rng.lognormvariate(0, 0.6) * m))  # noqa: E731
    lengths = [min(4096, draw(p) + draw(c) + draw(c) + 1) for _ in range(5000)]
    sampler = MultipackSampler(lengths, 8 * 4096, num_replicas=1)
    assert sampler.efficiency() >= 0.95


def test_too_long_item_is_a_clear_error():
    with pytest.raises(ValueError, match="Item 2 has length 50, more than max_tokens=40"):
        MultipackSampler([10, 20, 50], 40)


def test_tiny_dataset_fewer_items_than_ranks():
    _, batches = _epoch([5], 100, 3)
    assert [len(b) for b in batches] == [1, 1, 1]
    assert all(batch == [0] for rank_batches in batches for batch in rank_batches)


def test_works_as_a_plain_dataloader_batch_sampler():
    data = [{"x": i} for i in range(50)]
    lengths = _lengths(1, 50, 1, 30)
    loader = DataLoader(
        data, batch_sampler=MultipackSampler(lengths, 64), collate_fn=lambda rows: [r["x"] for r in rows]
    )
    seen = sorted(x for batch in loader for x in batch)
    assert seen == list(range(50)) and len(loader) == len(list(loader))
