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

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
#: multi-head latent attention (DeepSeek-V2/V3 style): small ranks and head dims, one key/value head per query head
#: (the latent keys and values are expanded per head), `head_dim` the rotary part as these configs define it
_MLA_ATTENTION = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    qk_head_dim=8,
    v_head_dim=8,
    num_key_value_heads=4,
)
_MLA = dict(**_MLA_ATTENTION, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1)
#: a vision/audio tower's transformer, small (multimodal types build it; the text-only sweep never runs it)
_TINY_VIT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
#: Inkling 2's text model: small heads and experts (its unpadded vocabulary follows `vocab_size`)
_INKLING2 = dict(
    unpadded_vocab_size=None,
    head_dim=8,
    swa_head_dim=8,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    intermediate_size=16,
)
#: DeepSeek sparse attention's indexer (its top-k stays above these sequence lengths: every visible key is kept)
_DSA = dict(index_head_dim=8, index_n_heads=2)
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
    "emu3_text_model": {"attention_dropout": 0.0},
    # MLA families: without `_MLA_ATTENTION` their key/value heads (2) do not match the query heads and stock TRL fails
    "axk1": {**_MOE, **_MLA, "head_dim": 4},
    "axk2": {**_MOE, **_MLA, **_DSA, "head_dim": 4, "n_group": 1, "topk_group": 1},
    "deepseek_v32": {**_MOE, **_MLA, **_DSA, "head_dim": 4},
    "glm4_moe_lite": {**_MOE, **_MLA, "head_dim": 4},
    "glm_moe_dsa": {**_MOE, **_MLA, **_DSA, "head_dim": 4},
    "hy_v4": {**_MOE, **_MLA, **_DSA, "head_dim": 4},
    "longcat_flash": {
        **_MLA_ATTENTION,
        "head_dim": 4,
        "n_routed_experts": 4,
        "moe_topk": 2,
        "zero_expert_num": 2,
        "expert_ffn_hidden_size": 16,
        "ffn_hidden_size": 64,
    },
    "minicpm3": {**_MLA_ATTENTION, "head_dim": 4},
    "sarvam_mla": {**_MOE, **_MLA, "head_dim": 4},
    "youtu": {**_MLA_ATTENTION, "head_dim": 4},
    # MoE families whose defaults are hundreds of experts
    "dots1": {**_MOE, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 16, "moe_num_shared_experts": 1},
    "exaone_moe": {**_MOE, "num_shared_experts": 1},
    "flint": {  # the first two layers are dense by default: a 2-layer model had no experts, TRL's aux loss failed
        **_MOE,
        "head_dim": 8,
        "mlp_only_layers": [0],
        "shared_expert_intermediate_size": 32,
        "layer_types": ["full_attention", "sliding_attention"],
    },
    "granitemoe_swa": _MOE,
    "granitemoeshared": {**_MOE, "shared_intermediate_size": 32},
    "hy_v3": {**_MOE, "head_dim": 8, "num_shared_experts": 1},
    "sarvam_moe": {**_MOE, "head_dim": 8},
    "codegen": {"rotary_dim": 4},
    "cohere_compass_text": {  # RoPE parameters per layer type (its rotary embedding reads them so)
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "dbrx": {  # real DBRX configs carry `rope_theta` in `attn_config`, which DBRX's attention reads
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "d_model": 32,  # its own names: the common sizes' `hidden_size` does not reach the experts
        "n_heads": 4,
        "n_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    # dense Doge keeps MoE fields: TRL turns its router loss on and finds no router logits (and Doge's product-key
    # router does not fit TRL's Mixtral loss either), so stock fails unless the coefficient is 0
    "doge": {"router_aux_loss_coef": 0.0},
    # Gemma 3n / 4: per-layer embeddings as wide as the vocabulary, small
    "gemma3n_text": {
        "head_dim": 8,
        "num_hidden_layers": 4,  # two layers reuse the keys and values of the two before
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": None,
        "laurel_rank": 4,
    },
    "gemma4_text": {"head_dim": 8, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": None},
    # Inkling: hybrid attention + short-convolution layers, small experts and heads
    "inkling_text": {
        "head_dim": 8,
        "swa_head_dim": 8,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 16,
    },
    "inkling2_text": _INKLING2,
    "inkling2_loop_text": {
        **_INKLING2,
        "n_layers_per_attn_res_block": 1,
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 2,
        "loop_num_passes": 2,
        "loop_gate_rank": 4,
    },
    "deepseek_v4": {  # compressed attention every layer (blocks of 4 and 8 positions), hash-routed then top-k experts
        "head_dim": 8,
        "partial_rotary_factor": 0.5,
        "num_key_value_heads": 1,
        "q_lora_rank": 16,
        "o_groups": 2,
        "o_lora_rank": 8,
        "n_routed_experts": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "hc_mult": 2,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe"],
    },
    "dots3_note_text": {  # MLA with DeepSeek sparse attention, and a sliding layer of its own head sizes
        **_MOE,
        **_MLA,
        **_DSA,
        "head_dim": 8,
        "shared_experts_intermediate_size": 16,
        "layer_types": ["indexed_attention", "sliding_attention"],
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 8,
        "swa_qk_nope_head_dim": 4,
        "swa_v_head_dim": 8,
    },
    "reformer": {  # a causal LM only as a decoder; fixed LSH hashes and no dropout, or no two runs agree
        "is_decoder": True,
        "attention_head_size": 8,
        "attn_layers": ["local", "lsh"],
        "axial_pos_embds": False,
        "feed_forward_size": 64,
        "local_attn_chunk_length": 8,
        "lsh_attn_chunk_length": 8,
        "num_buckets": 4,
        "hash_seed": 0,
        "hidden_dropout_prob": 0.0,
        "local_attention_probs_dropout_prob": 0.0,
        "lsh_attention_probs_dropout_prob": 0.0,
    },
    "blt": {  # byte-level: every part reads the (here word-level) vocabulary
        "patcher_config": {
            "vocab_size": None,
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
        },
        "encoder_config": {
            "vocab_size": None,
            "hidden_size": 16,
            "hidden_size_global": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
        },
        "decoder_config": {
            "vocab_size": None,
            "hidden_size": 16,
            "hidden_size_global": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
        },
        "global_config": {
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 64,
        },
        "encoder_hash_byte_group_size": [3, 4],
        "encoder_hash_byte_group_vocab": 64,
    },
    "git": {"vision_config": {**_TINY_VIT, "image_size": 8, "patch_size": 4}},
    "phi4_multimodal": {
        "vision_config": {**_TINY_VIT, "image_size": 28, "patch_size": 14, "crop_size": 28},
        "audio_config": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_blocks": 1,
            "num_attention_heads": 2,
            "ext_pw_out_channel": 16,
            "depthwise_separable_out_channel": 16,
            "nemo_conv_channels": 16,
        },
    },
    # multimodal types (`TEXT_PARTS`): the towers, small
    "dots3_note": {
        "vision_config": {
            **_TINY_VIT,
            "adapter_in_dim": 16,
            "adapter_out_dim": 32,
            "mlp_layer_types": ["dense"],
            "per_layer_config": {},
        },
        "audio_config": {
            **_TINY_VIT,
            "downsample_hidden_size": 8,
            "feature_size": 8,
            "adapter_input_size": 16,
            "adapter_out_dim": 32,
        },
    },
    "gemma3": {"vision_config": {**_TINY_VIT, "image_size": 8, "patch_size": 4}, "mm_tokens_per_image": 4},
    "gemma4_assistant": {  # a drafter: every layer reads the target model's keys and values
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "num_kv_shared_layers": 2},
        "backbone_hidden_size": 32,
        "num_centroids": 4,
        "centroid_intermediate_top_k": 2,
    },
    "gemma4_unified_assistant": {
        "text_config": {"num_kv_shared_layers": 2},
        "backbone_hidden_size": 32,
        "num_centroids": 4,
        "centroid_intermediate_top_k": 2,
    },
    "got_ocr2": {
        "vision_config": {
            **_TINY_VIT,
            "output_channels": 8,
            "image_size": 64,
            "patch_size": 16,
            "window_size": 2,
            "global_attn_indexes": [0],
            "mlp_dim": 32,
        }
    },
    "mllama": {
        "text_config": {"cross_attention_layers": [1]},
        "vision_config": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_global_layers": 1,
            "attention_heads": 2,
            "vision_output_dim": 32,
            "intermediate_layers_indices": [0],
            "image_size": 8,
            "patch_size": 4,
        },
    },
    "moss_transcribe_diarize": {
        "audio_config": {
            **_TINY_VIT,
            "num_mel_bins": 8,
            "max_source_positions": 16,
        }
    },
    "qwen4_exp": {
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 16,
            "patch_size": 4,
        }
    },
    # linear-attention hybrids (refused whatever they measure), small
    "lara_mini": {
        **_MOE,
        "head_dim": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "shared_expert_intermediate_size": 16,
    },
    "qwen4_exp_text": {
        **_MOE,
        "head_dim": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "shared_expert_intermediate_size": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "hc_lowrank": 4,
        # its full-attention layers build the sparse-attention indexer (a budget above these lengths: all kept)
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": 1024,
        "indexer_compress_ratio": 4,
    },
}
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
