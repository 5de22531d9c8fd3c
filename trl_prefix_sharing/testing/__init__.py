"""Offline test builders (in the spirit of `torch.testing`): a word-level tokenizer with a chat template, small random
models of the supported families, and synthetic preference data; nothing is downloaded. Used by this package's tests,
benchmarks and demo, and usable in yours::

    from trl_prefix_sharing.testing import make_model, make_tokenizer, synthetic_pairs

    tokenizer = make_tokenizer()
    model = make_model("qwen2", len(tokenizer))
    dataset = synthetic_pairs(64, prompt_len=(20, 40), completion_len=(4, 8))

`trl_prefix_sharing.testing.vision` has the vision-language counterparts (a Qwen-style processor and tiny Qwen-VL
models; needs Pillow). Not imported by `import trl_prefix_sharing`.
"""

from __future__ import annotations

import copy
import json
import random
from importlib import resources


__all__ = [
    "FAMILIES",
    "TINY_CONFIGS",
    "make_tokenizer",
    "make_config",
    "make_model",
    "load_demo_dataset",
    "synthetic_pairs",
]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_MLA = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    qk_head_dim=8,
    v_head_dim=8,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_key_value_heads=4,
)
#: family (model_type) -> what its tiny config needs on top of `make_config`'s common sizes (any model_type
#: transformers knows is accepted; these are the ones whose defaults do not fit a tiny model or that need small
#: experts)
TINY_CONFIGS = {
    "deepseek_v2": {**_MOE, **_MLA},
    "deepseek_v3": {**_MOE, **_MLA},
    "glm4_moe": {**_MOE, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "gpt_oss": {**_MOE, "intermediate_size": 32, "head_dim": 8},
    "mixtral": _MOE,
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {**_MOE, "head_dim": 8},
    "olmoe": _MOE,
    "granitemoe": _MOE,
    "jetmoe": {**_MOE, "kv_channels": 8},
    "gemma": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "query_pre_attn_scalar": 8},
    "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8},
    "cohere2": {"head_dim": 8},
    "gptj": {"rotary_dim": 4},
    "helium": {"head_dim": 8},
    "hunyuan_v1_dense": {"head_dim": 8},
    "hunyuan_v1_moe": {**_MOE, "head_dim": 8},
    "ministral": {"head_dim": 8},
    # training-time randomness TRL's `disable_dropout` does not reach: off, or no two stock runs agree either
    "phimoe": {**_MOE, "router_jitter_noise": 0.0},
    "seed_oss": {"residual_dropout": 0.0, "attention_dropout": 0.0},
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


def make_config(family: str, vocab_size: int, hidden_size: int = 32, num_layers: int = 2, **overrides):
    """A small config of one of `FAMILIES` (GQA: 4 query heads, 2 key/value heads), or of any other model type
    transformers knows (with `TINY_CONFIGS[family]` applied)."""
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
    if family not in classes:
        kwargs.update(TINY_CONFIGS.get(family, {}))
        kwargs.update(overrides)
        return AutoConfig.for_model(family, **kwargs)
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


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS[:200]) for _ in range(n))


def synthetic_pairs(
    n: int,
    prompt_len: int | tuple[int, int],
    completion_len: int | tuple[int, int],
    seed: int = 0,
    conversational: bool = False,
):
    """`n` random preference examples with prompt/completion lengths (in words) drawn uniformly from the ranges."""
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
