"""The benchmarks' synthetic data: the paper's six dataset profiles (median prompt and completion tokens), lengths
spread around a median, and texts of words that are each one token of the model's tokenizer (so that a length in words
is a length in tokens)."""

from __future__ import annotations

import math
import random
import statistics


# median prompt / completion tokens of the paper's datasets
PROFILES = {
    "Capybara": (712, 448),
    "HH-RLHF": (127, 59),
    "MetaMath-DPO": (694, 178),
    "TLDR": (382, 34),
    "Tulu-Helpsteer": (669, 106),
    "UltraFeedback": (121, 288),
}


def synthetic_dataset(profile, n, scale, seed, sigma=0.5, vocabulary=None):
    """`n` pairs of random words, lengths lognormal around the profile's medians x `scale`. `vocabulary`: the words
    to draw from (default the tiny tokenizer's first 200; `single_token_words` for another tokenizer), each one token,
    so that a length in words is a length in tokens."""
    from datasets import Dataset

    from trl_prefix_sharing.testing import WORDS

    p_med, c_med = PROFILES[profile]
    rng = random.Random(f"{profile}-{seed}")
    vocabulary = vocabulary or WORDS[:200]

    def words(median):
        k = max(1, int(round(median * scale * math.exp(rng.gauss(0, sigma)))))
        return " ".join(rng.choice(vocabulary) for _ in range(k))

    return Dataset.from_list(
        [{"prompt": words(p_med), "chosen": " " + words(c_med), "rejected": " " + words(c_med)} for _ in range(n)]
    )


def lognormal_lengths(rng, median, n, sigma=0.4):
    """`n` lengths spread as a lognormal around `median`: its quantiles at `(i + 0.5) / n`, shuffled, so that a small
    sample is centred on the median; at most 3x the median."""
    normal = statistics.NormalDist()
    quantiles = (math.exp(sigma * normal.inv_cdf((i + 0.5) / n)) for i in range(n))
    lengths = [max(1, min(3 * median, round(median * q))) for q in quantiles]
    rng.shuffle(lengths)
    return lengths


def lognormal(rng, median, sigma=0.4):
    """One length drawn as a lognormal around `median`, at most 3x the median."""
    return max(1, min(3 * median, round(median * rng.lognormvariate(0, sigma))))


def single_token_words(tokenizer, n=200):
    """The first `n` lowercase words (by token id, so frequent ones first) that `tokenizer` encodes as one token both
    alone and after a space: text of them joined by spaces has one token per word, so a synthetic length in words is
    a length in tokens. Checked on the joined words."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        word = text[1:]
        if not (text.startswith(" ") and len(word) >= 3 and word.isascii() and word.isalpha() and word.islower()):
            continue
        if all(len(tokenizer(x, add_special_tokens=False)["input_ids"]) == 1 for x in (word, " " + word)):
            words.append(word)
            if len(words) == n:
                break
    joined = " ".join(words + words[::-1])
    if len(words) < n or len(tokenizer(joined, add_special_tokens=False)["input_ids"]) != 2 * n:
        raise SystemExit(f"error: the tokenizer has no {n} words of one token each")
    return words


def count_tokens(tokenizer, text):
    """Tokens of `text` alone (BOS and EOS aside)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_one_token_per_word(tokenizer, texts):
    """Every text has as many tokens as words: the profiles' lengths, in words, are real tokens."""
    for text in texts:
        if count_tokens(tokenizer, text) != len(text.split()):
            raise SystemExit(f"error: {text[:60]!r}... is not one token per word with this tokenizer")
