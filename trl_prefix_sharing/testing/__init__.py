"""Offline test builders (in the spirit of `torch.testing`): a word-level tokenizer with a chat template, small random
models of the supported families, and synthetic preference data; nothing is downloaded. Used by this package's tests,
benchmarks and demo, and usable in yours::

    from trl_prefix_sharing.testing import make_model, make_tokenizer, synthetic_pairs

    tokenizer = make_tokenizer()
    model = make_model("qwen2", len(tokenizer))
    dataset = synthetic_pairs(64, prompt_len=(20, 40), completion_len=(4, 8))  # prompt, chosen, rejected
    prompts = synthetic_prompts(64)  # prompt only (GRPO, RLOO, online DPO)

`trl_prefix_sharing.testing.vision` has the vision-language counterparts (a Qwen-style processor and tiny Qwen-VL
models; needs Pillow). Not imported by `import trl_prefix_sharing`.
"""

from __future__ import annotations

import copy
import json
import random
from importlib import resources

from .configs import FAMILIES, TINY_CONFIGS


__all__ = [
    "FAMILIES",
    "TINY_CONFIGS",
    "make_tokenizer",
    "make_config",
    "make_model",
    "load_demo_dataset",
    "load_demo_chat",
    "synthetic_pairs",
    "synthetic_prompts",
    "PreferredKernelTimer",
]

#: config fields sized like the vocabulary (Gemma 3n/4's per-layer embeddings, Inkling's unpadded head, the parts of
#: a byte-level model): `make_config` sets them to its `vocab_size` where `TINY_CONFIGS` gives them as None
_VOCAB_SIZED = ("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size")
#: multimodal model types of transformers' causal-LM mapping -> the model type of their text part; their tiny config
#: is that type's (plus `TINY_CONFIGS[family]["text_config"]`), with the vision/audio towers of `TINY_CONFIGS[family]`
#: (built, never run on text-only data)
TEXT_PARTS = {
    "dots3_note": "dots3_note_text",
    "emu3": "emu3_text_model",
    "gemma3": "gemma3_text",
    "gemma3n": "gemma3n_text",
    "gemma4": "gemma4_text",
    "gemma4_assistant": "gemma4_text",
    "gemma4_unified": "gemma4_unified_text",
    "gemma4_unified_assistant": "gemma4_unified_text",
    "got_ocr2": "qwen2",
    "mllama": "mllama_text_model",
    "moss_transcribe_diarize": "qwen3",
    "qwen4_exp": "qwen4_exp_text",
}
SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
#: renders plain messages as `<|role|> content <|end|> `; also tools (names), tool calls (`( name arguments )`),
#: tool results and content lists (their text parts), as TRL's tool-calling format gives them
CHAT_TEMPLATE = (
    "{% if tools %}<|system|> {% for tool in tools %}{{ (tool['function'] or tool)['name'] }} {% endfor %}<|end|> "
    "{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|> "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }} {% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}( {{ call['function']['name'] }}"
    "{% for key, value in (call['function']['arguments'] or {}).items() %}{% if value is not none %} {{ key }} "
    "{{ value }}{% endif %}{% endfor %} ) {% endfor %} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WORDS = (
    [f"w{i}" for i in range(200)]
    + [str(i) for i in range(100)]
    + [
        "the",
        "a",
        "of",
        "and",
        "to",
        "is",
        "what",
        "how",
        "why",
        "answer",
        "question",
        "step",
        "so",
        "sum",
        "total",
        "plus",
        "minus",
        "times",
        "equals",
        "yes",
        "no",
        "good",
        "bad",
        "because",
        "therefore",
        "first",
        "then",
    ]
)


def make_tokenizer(words=None):
    """A `PreTrainedTokenizerFast` over whitespace-separated words (plus digits and punctuation), with a chat
    template, `<eos>` as EOS and `<pad>` as padding. Unknown words map to `<unk>`. Saved next to a Llama, Mistral or
    Qwen3 config it reloads as itself with `AutoTokenizer`; next to a Qwen2 config transformers substitutes its
    `Qwen2Tokenizer`, so pass the tokenizer explicitly there."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {}
    for token in SPECIAL_TOKENS + list(words or WORDS) + list(".,?!:;'\"()-+=*/"):
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    backend.add_special_tokens(SPECIAL_TOKENS)  # matched whole, before pre-tokenization splits punctuation
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tiny_text_fields(vocab_size: int, hidden_size: int, num_layers: int) -> dict:
    """The shape of every tiny test model's text part: GQA, 4 query and 2 key/value heads, an MLP twice as wide."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )


def _vocab_sized(kwargs: dict, vocab_size: int) -> dict:
    """`kwargs` with the `_VOCAB_SIZED` fields given as None, at any depth (sub-config dicts), set to `vocab_size`."""
    return {
        key: vocab_size
        if key in _VOCAB_SIZED and value is None
        else _vocab_sized(value, vocab_size)
        if isinstance(value, dict)
        else value
        for key, value in kwargs.items()
    }


def make_config(family: str, vocab_size: int, hidden_size: int = 32, num_layers: int = 2, **overrides):
    """A small config of one of `FAMILIES` (GQA: 4 query heads, 2 key/value heads), or of any other model type
    transformers knows (with `TINY_CONFIGS[family]` applied; a multimodal one of `TEXT_PARTS` gets its text part's tiny
    config, the overrides applied there)."""
    from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    kwargs = dict(
        **_tiny_text_fields(vocab_size, hidden_size, num_layers),
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        kwargs["head_dim"] = hidden_size // 4
    if family in TEXT_PARTS:  # multimodal: the overrides are the text part's, the towers are `TINY_CONFIGS[family]`
        tiny = dict(TINY_CONFIGS.get(family, {}))
        text_overrides = {**tiny.pop("text_config", {}), **overrides}
        text = make_config(TEXT_PARTS[family], vocab_size, hidden_size, num_layers, **text_overrides)
        heads = {key: overrides[key] for key in ("num_labels",) if key in overrides}  # a classification head's
        return AutoConfig.for_model(family, text_config=text, **_vocab_sized(tiny, vocab_size), **heads)
    if family not in classes:
        kwargs.update(TINY_CONFIGS.get(family, {}))
        kwargs.update(overrides)
        return AutoConfig.for_model(family, **_vocab_sized(kwargs, vocab_size))
    kwargs.update(overrides)
    return classes[family](**kwargs)


def make_model(family: str, vocab_size: int, seed: int = 0, attn_implementation: str = "sdpa", **config_kwargs):
    """A randomly initialised causal LM of `family`, fp32 (the config is copied: nothing is shared between models)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(make_config(family, vocab_size, **config_kwargs))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)


def load_demo_dataset():
    """The preference dataset shipped with the package (`data/demo_preferences.jsonl`): long prompts, short answers."""
    from datasets import Dataset

    text = resources.files("trl_prefix_sharing").joinpath("data/demo_preferences.jsonl").read_text()
    return Dataset.from_list([json.loads(line) for line in text.splitlines() if line.strip()])


def load_demo_chat(pairs: str = "all"):
    """The chat preference dataset shipped with the package (`data/demo_chat.json`), conversational: 24 English
    questions to a library's help desk behind one long system prompt (about 200 tokens), each with three answers
    written for the package and ranked best first (about 15 to 50 tokens each).

    Args:
        pairs (`str`, *optional*, defaults to `"all"`):
            `"all"`: the three pairs of each question (best over middling, best over worst, middling over worst),
            listed question by question; `"best_worst"`: one pair per question.

    Returns:
        `datasets.Dataset`: `prompt` (system and user messages), `chosen` and `rejected` (one assistant message each).
    """
    from datasets import Dataset

    if pairs not in ("all", "best_worst"):
        raise ValueError(f"`pairs` must be 'all' or 'best_worst', got {pairs!r}.")
    data = json.loads(resources.files("trl_prefix_sharing").joinpath("data/demo_chat.json").read_text())
    ranks = [(0, 1), (0, 2), (1, 2)] if pairs == "all" else [(0, 2)]
    rows = []
    for item in data["questions"]:
        prompt = [{"role": "system", "content": data["system"]}, {"role": "user", "content": item["question"]}]
        for better, worse in ranks:
            rows.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": item["answers"][better]}],
                    "rejected": [{"role": "assistant", "content": item["answers"][worse]}],
                }
            )
    return Dataset.from_list(rows)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS[:200]) for _ in range(n))


def synthetic_pairs(
    n: int,
    prompt_len: int | tuple[int, int] = (20, 40),
    completion_len: int | tuple[int, int] = (4, 8),
    seed: int = 0,
    conversational: bool = False,
):
    """`n` random preference examples (`prompt`, `chosen`, `rejected`: TRL's preference format) with prompt and
    completion lengths (in words of `make_tokenizer`'s vocabulary) drawn uniformly from the ranges."""
    from datasets import Dataset

    rng = random.Random(seed)

    def draw(spec):
        return spec if isinstance(spec, int) else rng.randint(*spec)

    rows = []
    for _ in range(n):
        prompt, chosen, rejected = (
            _words(rng, draw(prompt_len)),
            _words(rng, draw(completion_len)),
            _words(rng, draw(completion_len)),
        )
        if conversational:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return Dataset.from_list(rows)


def synthetic_prompts(
    n: int, prompt_len: int | tuple[int, int] = (20, 40), seed: int = 0, conversational: bool = False
):
    """`n` random prompts (a `prompt` column: TRL's prompt-only format, for GRPO, RLOO and online DPO) with lengths (in
    words) drawn uniformly from the range."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = _words(rng, prompt_len if isinstance(prompt_len, int) else rng.randint(*prompt_len))
        rows.append({"prompt": [{"role": "user", "content": prompt}] if conversational else prompt})
    return Dataset.from_list(rows)


class PreferredKernelTimer:
    """A clock for `"auto"`'s start-up measurement (`trl_prefix_sharing.tuning.set_timer`) that makes its choice
    independent of the machine's timing: the kernel `"auto"` prefers on the device is reported fastest, then the others
    in that order, stock's rows slowest, so a run lays out the preferred kernel's rows.

    Args:
        runs: whether each timed call is run (the measurement exercised, e.g. under several processes), or skipped.
    """

    def __init__(self, runs: bool = False):
        self.runs = runs

    def warm_up(self, name, run, device):
        if self.runs:
            run()

    def measure(self, name, run, device):
        from trl_prefix_sharing.attention import _auto_candidates

        if self.runs:
            run()
        order = _auto_candidates(device)
        return 1.0 + order.index(name) if name in order else 10.0
