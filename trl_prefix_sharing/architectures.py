"""Which architectures prefix sharing runs, and why the others are refused.

The contract: an architecture gives stock TRL's numbers under the shared layout when

- its attention honours the 4-D mask it is given and the explicit `position_ids` (RoPE, partial RoPE, absolute
  position embeddings read from the ids, NoPE layers),
- no layer carries state along the row (Mamba/SSM, linear or delta-rule attention, short convolutions, RWKV/xLSTM,
  hybrids of those with attention): the second completion would read the state the first one left,
- nothing else in the forward depends on which tokens share a row (ALiBi or positions built from row indices, local
  or chunked attention counted in row positions, a 2-D padding mask assumed).

Whether a family meets it is *measured*, not assumed: `scripts/sweep_architectures.py` runs one DPO step and one
reward step per family (and per window / MoE option) against stock TRL, and writes the results to
`data/architectures.json`. `check_supported_model` reads that file: a family is allowed when every measured
variant gave stock's numbers; a refused family's error names the reason from `REFUSED` (or the measured
difference). What the registry cannot settle (a model type it does not list, custom code under its own type, a family
whose tiny config failed, a window a family was not measured with) goes to the start-up check
(`model_check`), which judges the user's own model on its first batch.
`tests/equivalence/test_architectures.py` re-runs the matrix of the supported families in CI.
"""

from __future__ import annotations

import functools
import json
from importlib import resources


__all__ = [
    "REFUSED",
    "VARIANTS",
    "registry",
    "supported_model_types",
    "check_supported_model",
    "refused_reason",
    "refusal",
    "moves_positions",
    "shift_invariant",
    "window_layout",
    "variant_configs",
    "varlen_unmeasured",
]

# ---------------------------------------------------------------------------------------------------- reasons
#: how every refusal ends
WAY_OUT = "Train it with `prefix_sharing=False`."


def _carries_state(layers: str) -> str:
    return (
        f"its {layers} layers carry a state along the sequence, so in a shared row a completion would start from the "
        "state the one before it left"
    )


#: the reasons a model type can never give stock's numbers under the shared layout, whatever its weights (each one
#: line: the registry and docs/architectures.md show them; an error continues "Prefix sharing can never support
#: '<type>': <reason>.")
ENCODER_DECODER = (
    "it is an encoder-decoder model, and this package lays out decoder-only causal LMs, which read a prompt and its "
    "completions as one causal sequence; here the prompt goes through the encoder, where sharing it would mean one "
    "encoder pass per prompt, which this package does not implement"
)
ENCODER = (
    "it is an encoder model, and prefix sharing is for decoder-only causal LMs, which read a prompt and its "
    "completions as one causal sequence (an encoder attends both ways: each completion would see the others)"
)
MAMBA = _carries_state("Mamba (state-space)")
MAMBA2 = _carries_state("Mamba-2 (state-space)")
RWKV = _carries_state("RWKV (recurrent)")
XLSTM = _carries_state("xLSTM (recurrent)")
RG_LRU = _carries_state("RG-LRU (recurrent)")
GATED_DELTANET = _carries_state("Gated DeltaNet (linear attention)")
KIMI_DELTA = _carries_state("Kimi Delta Attention (linear attention)")
DELTA_ATTENTION = _carries_state("delta-rule linear attention")
LIGHTNING = _carries_state("lightning attention (linear attention)")
SHORT_CONVOLUTION = (
    "its short-convolution layers mix each token with the few before it, so in a shared row a completion's first "
    "tokens would mix in the end of the completion before it"
)
#: the layers of a model type named nowhere here whose `layer_types` entries are not attention (follows "its <kinds>
#: layers are not attention, and ")
RECURRENT = (
    "may carry a state along the sequence (as Mamba/SSM, linear-attention, short-convolution and RWKV layers do), so "
    "in a shared row a completion could start from the state the one before it left"
)
ALIBI = (
    "its ALiBi attention biases are computed from places in the row, not from `position_ids`, so a completion placed "
    "after another one would see other distances than in its own sequence"
)
ROW_POSITIONS = (
    "its position embeddings are computed from places in the row or the 2-D padding mask, not from `position_ids`, "
    "so a completion placed after another one would get other positions than in its own sequence"
)
CHUNKED = (
    "its chunked attention splits the row into chunks counted from the row's start, not from `position_ids`, so a "
    "completion placed after another one would fall into other chunks than in its own sequence"
)
LOCAL = (
    "its local attention works on windows or chunks of places in the row, so a completion placed after another one "
    "would attend to other tokens than in its own sequence"
)
COMPRESSED = (
    "its compressed attention pools keys over blocks of places in the row, so a completion's blocks would mix in the "
    "completion before it"
)
INDEXED = (
    "its sparse attention keeps the top-k keys an indexer scores over the whole row, so in a shared row the other "
    "completions' keys would compete for the k places"
)
ROW_GROUPS = (
    "it groups tokens along the row (byte patches by entropy, n-gram hash embeddings), so a completion's groups would "
    "depend on the completion before it"
)
DRAFTER = (
    "it is a speculative-decoding drafter: it reads the keys and values of a target model and is not trained alone"
)
MASK_2D = "its forward builds its attention mask from the 2-D padding mask and ignores the given 4-D mask"
#: reasons that are not by design (an error continues "Prefix sharing does not support '<type>': <reason>.")
VISION = (
    "it is a vision-language model, and prefix sharing lays out the images of Qwen2-VL, Qwen2.5-VL and Qwen3-VL "
    "only, the families measured equal to stock TRL"
)
UNUSED_WINDOW = (
    "its config sets a sliding window (3000) that its decoder does not apply, while the shared layout's mask would "
    "apply it"
)

_ENCODER_DECODERS = [
    "bart",
    "bigbird_pegasus",
    "blenderbot",
    "blenderbot-small",
    "marian",
    "mbart",
    "musicgen",
    "musicgen_melody",
    "mvp",
    "pegasus",
    "plbart",
    "prophetnet",
    "trocr",
    "whisper",
]
_ENCODERS = [
    "bert",
    "bert-generation",
    "big_bird",
    "camembert",
    "data2vec-text",
    "electra",
    "ernie",
    "megatron-bert",
    "rembert",
    "roberta",
    "roberta-prelayernorm",
    "roc_bert",
    "roformer",
    "xlm",
    "xlm-roberta",
    "xlm-roberta-xl",
    "xlnet",
    "xmod",
]

#: model_type -> why prefix sharing cannot give stock's numbers, known from the model's code (the sweep measured these
#: differing from or failing against stock; `scripts/sweep_architectures.py --measure-refused` measures them again).
#: Families refused by measurement alone carry the measured outcome as their reason in the registry. Any config with
#: `is_encoder_decoder` is refused as `ENCODER_DECODER` too.
REFUSED: dict[str, str] = {
    **dict.fromkeys(_ENCODER_DECODERS, ENCODER_DECODER),
    **dict.fromkeys(_ENCODERS, ENCODER),
    **dict.fromkeys(["mamba", "falcon_mamba", "jamba", "zamba"], MAMBA),
    **dict.fromkeys(["mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2"], MAMBA2),
    "rwkv": RWKV,
    "xlstm": XLSTM,
    "recurrent_gemma": RG_LRU,
    **dict.fromkeys(
        [
            "lara_mini",
            "olmo_hybrid",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "qwen3_5_text",
            "qwen3_next",
            "qwen4_exp",
            "qwen4_exp_text",
        ],
        GATED_DELTANET,
    ),
    "kimi_linear": KIMI_DELTA,
    "bailing_hybrid": DELTA_ATTENTION,
    "minimax": LIGHTNING,
    **dict.fromkeys(["lfm2", "lfm2_moe", "inkling_text", "inkling2_text", "inkling2_loop_text"], SHORT_CONVOLUTION),
    **dict.fromkeys(["bloom", "mpt"], ALIBI),
    **dict.fromkeys(["biogpt", "cpmant", "opt", "xglm"], ROW_POSITIONS),
    **dict.fromkeys(["llama4", "llama4_text"], CHUNKED),
    **dict.fromkeys(["gpt_neo", "reformer"], LOCAL),
    "deepseek_v4": COMPRESSED,
    **dict.fromkeys(["axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4"], INDEXED),
    **dict.fromkeys(["gemma3", "gemma3n", "git", "got_ocr2", "mllama", "phi4_multimodal"], VISION),
    **dict.fromkeys(["gemma4_assistant", "gemma4_unified_assistant"], DRAFTER),
    "blt": ROW_GROUPS,
    "openai-gpt": MASK_2D,
    "moshi": UNUSED_WINDOW,
}

#: `layer_types` entries that mix tokens by attention, or not at all (position-wise MLP / MoE layers)
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "mlp", "moe"}
#: `layer_types` entries named for their reason (any other entry: `RECURRENT`)
_REFUSED_LAYER_TYPES = {
    "linear_attention": _carries_state("linear-attention"),
    "mamba": MAMBA,
    "mamba2": MAMBA2,
    "recurrent": _carries_state("recurrent"),
    "rwkv": RWKV,
    "conv": SHORT_CONVOLUTION,
    "chunked_attention": CHUNKED,
    "compressed_sparse_attention": COMPRESSED,
    "heavily_compressed_attention": COMPRESSED,
    "indexed_attention": INDEXED,
}


#: the reasons of `REFUSED` and `layer_types` that hold by design (the others: not measured equal, not laid out)
_BY_DESIGN = {
    ENCODER,
    MAMBA,
    MAMBA2,
    RWKV,
    XLSTM,
    RG_LRU,
    GATED_DELTANET,
    KIMI_DELTA,
    DELTA_ATTENTION,
    LIGHTNING,
    SHORT_CONVOLUTION,
    ALIBI,
    ROW_POSITIONS,
    CHUNKED,
    LOCAL,
    COMPRESSED,
    INDEXED,
    ROW_GROUPS,
    DRAFTER,
    MASK_2D,
    *_REFUSED_LAYER_TYPES.values(),
}


def refusal(model_type: str, reason: str) -> str:
    """The error for a model type refused for `reason`: one of `REFUSED`'s, or a measured outcome of the
    registry (`"measured: ..."`). Two or three sentences: what, why, and the way out."""
    if reason.startswith("measured: "):
        outcome = reason.removeprefix("measured: ").split(" (")[0]  # a registry of older sweeps kept the error text
        reason = f"measured on a tiny model of this type, {outcome}"
    lead = "can never support" if reason in _BY_DESIGN else "does not support"
    return f"Prefix sharing {lead} '{model_type}': {reason}. {WAY_OUT}"


# ---------------------------------------------------------------------------------------------------- variants
#: The options a family is measured with beyond its default tiny config, under the config names it uses. A variant
#: applies to a family whose config has the attribute named first.
VARIANTS: dict[str, tuple[str, dict]] = {
    "sliding_window": ("sliding_window", {"sliding_window": 6}),
    "router_aux_loss": ("output_router_logits", {"output_router_logits": True, "router_aux_loss_coef": 0.02}),
}


def variant_configs(config) -> dict[str, dict]:
    """The variants that apply to this (default tiny) config: name -> config overrides (`"default"` first)."""
    out = {"default": {}}
    for name, (attribute, overrides) in VARIANTS.items():
        if hasattr(config, attribute):
            overrides = dict(overrides)
            if name == "sliding_window" and hasattr(config, "use_sliding_window"):
                overrides.update(use_sliding_window=True, max_window_layers=1)  # Qwen: full + sliding layers
            out[name] = overrides
    return out


# ---------------------------------------------------------------------------------------------------- registry
@functools.lru_cache(maxsize=1)
def registry() -> dict:
    """The measured registry (`data/architectures.json`): `{"supported": {model_type: entry}, "refused":
    {...}}`."""
    text = resources.files("trl_prefix_sharing").joinpath("data/architectures.json").read_text()
    return json.loads(text)


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(registry()["supported"]))


def _text_config(config):
    """The config of the model's text decoder (the config itself for a text model, or one whose text part is
    ambiguous, such as MusicGen's encoder and decoder)."""
    try:
        return config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError:
        return config


#: registry outcomes a start-up check on the user's own model can settle (nothing was measured, or only the tiny
#: config failed); every other refused entry stays refused
_CHECKABLE_OUTCOMES = ("not measured", "stock TRL itself fails", "measured: prefix sharing raised")


def refused_reason(config) -> str | None:
    """Why this model is refused whatever its weights, known without running it (its type in `REFUSED`, an
    encoder-decoder config, layers that are not attention, chunked attention), or None."""
    text_config = _text_config(config)
    model_type = getattr(text_config, "model_type", None)
    reason = REFUSED.get(getattr(config, "model_type", None)) or REFUSED.get(model_type)
    if reason is None and getattr(config, "is_encoder_decoder", False):
        reason = ENCODER_DECODER
    if reason is None:
        layer_types = set(getattr(text_config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES
        unknown = sorted(layer_types - set(_REFUSED_LAYER_TYPES))
        if unknown:
            reason = f"its {', '.join(repr(kind) for kind in unknown)} layers are not attention, and {RECURRENT}"
        else:
            reason = next((r for kind, r in _REFUSED_LAYER_TYPES.items() if kind in layer_types), None)
    if reason is None and getattr(text_config, "attention_chunk_size", None):
        reason = CHUNKED
    return reason


def check_supported_model(config) -> str | None:
    """Decide how an architecture is judged: raise a clear error for one that cannot give stock's numbers under the
    shared layout (a reason no batch can disprove, or a measured difference); return None for one the registry
    measured equal with this config's options; return why the start-up check must judge it on the model itself
    (`model_check`): a model type the sweep did not measure (custom code, a newer
    transformers) or measured only without this config's sliding window."""
    text_config = _text_config(config)
    model_type = getattr(text_config, "model_type", None)
    name = getattr(config, "model_type", None) or model_type  # the type the user knows (a multimodal model's own)
    reason = refused_reason(config)
    if reason is None:
        refused = registry()["refused"].get(model_type)
        if refused is not None and not refused["reason"].startswith(_CHECKABLE_OUTCOMES):
            reason = refused["reason"]
    if reason is not None:
        raise ValueError(refusal(name, reason))
    entry = registry()["supported"].get(model_type)
    if entry is None:
        if getattr(text_config, "output_router_logits", False):
            raise ValueError(
                f"Prefix sharing cannot judge '{name}' with the router's auxiliary loss "
                "(`output_router_logits=True`): the type is not in the measured registry, and the start-up check "
                "compares log-probs only. Set `output_router_logits=False`, or train it with `prefix_sharing=False`."
            )
        refused = registry()["refused"].get(model_type)
        if refused is not None:
            return f"the measured registry did not settle '{model_type}' ({refused['reason']})"
        return f"the model type '{model_type}' is not in the measured registry"
    window, _ = window_layout(text_config)
    if window is not None and "sliding_window" not in entry.get("variants", ()):
        failed = entry.get("failed_variants", {}).get("sliding_window")
        if failed and any(outcome and outcome.startswith("differs") for outcome in failed.values()):
            raise ValueError(
                f"Prefix sharing does not support '{name}' with a sliding window (`sliding_window={window}`): "
                f"measured on a tiny model of this type, {_measured(entry, 'sliding_window')}. Train it without "
                "the window, or with `prefix_sharing=False`."
            )
        return f"'{model_type}' is measured without a sliding window only; this config sets `sliding_window={window}`"
    if getattr(text_config, "output_router_logits", False) and "router_aux_loss" not in entry.get("variants", ()):
        raise ValueError(
            f"Prefix sharing does not support '{name}' with the router's auxiliary loss "
            f"(`output_router_logits=True`): measured on a tiny model of this type, "
            f"{_measured(entry, 'router_aux_loss')}. Set `output_router_logits=False`, or train it with "
            "`prefix_sharing=False`."
        )
    return None


def varlen_unmeasured(config) -> str | None:
    """Why the varlen kernel is not known to give this model stock's numbers (None: the registry measured its type
    equal there, with this config's sliding window where it has one). The sweep's `--varlen` pass measures each
    supported type: a model whose attention does not hand the model's keyword arguments on to the attention
    function, or that builds its own mask, cannot run the kernel's segments."""
    text_config = _text_config(config)
    model_type = getattr(text_config, "model_type", None)
    entry = registry()["supported"].get(model_type)
    if entry is None:
        return f"the model type '{model_type}' is not measured on the varlen kernel"
    windowed = window_layout(text_config)[0] is not None
    if ("sliding_window" if windowed else "default") not in entry.get("varlen", ()):
        how = " with a sliding window" if windowed else ""
        return f"'{model_type}'{how} is not measured equal to stock on the varlen kernel (docs/architectures.md)"
    return None


#: rotary scalings whose frequencies depend on the longest position of the call (dynamic NTK, LongRoPE): a row moved
#: to other positions can get other frequencies than stock's row
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_types(config) -> set[str]:
    """The rotary scaling types of a (text) config, over its layer types where it has one set per type."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = parameters and all(isinstance(value, dict) for value in parameters.values())
    groups = parameters.values() if per_type else [parameters]
    return {group.get("rope_type", group.get("type", "default")) for group in groups if isinstance(group, dict)}


def shift_invariant(config) -> str | None:
    """Why this model's numbers could change when a row's tokens all move to other positions by the same amount, or
    None where they cannot (`trie.StockRows.shift`: a prompt's start shared with prompts of other lengths, which stock
    TRL's left padding puts at other positions).

    Measured per model type, like the rest of the registry (`scripts/sweep_architectures.py --shift`: left-padded
    prompts of unequal lengths that start alike, stock rows against the shifted layout; equal within the start-up
    check's float32 tolerance): rotary positions, whose attention reads only the distance between two positions,
    pass; learned or sinusoidal absolute positions differ. Per config: a rotary scaling whose frequencies depend on
    the longest position (`dynamic`, `longrope`) is not shift-invariant whatever its type measured."""
    text_config = _text_config(config)
    model_type = getattr(text_config, "model_type", None)
    entry = registry()["supported"].get(model_type)
    if entry is None or "shift" not in entry:
        return f"the model type '{model_type}' is not measured under moved positions"
    if not entry["shift"]:
        return f"'{model_type}' gives other numbers at other positions ({entry.get('shift_measured', 'measured')})"
    scaled = sorted(_rope_types(text_config) & set(_POSITION_DEPENDENT_ROPE))
    if scaled:
        return f"its rotary scaling ('{scaled[0]}') depends on the longest position of each call"
    if getattr(text_config, "alibi", False):
        return "its ALiBi biases are computed from places in the row"
    return None


def moves_positions(join: str, configs) -> bool:
    """Whether the layouts of generated rows (GRPO, RLOO, online DPO) share a start between prompts of other lengths,
    moving a prompt's tokens to other positions (`trie.StockRows.shift`): under a join that shares what prompts start
    with (`"always"`, `"auto"`), with every model's config (`configs`) shift-invariant (`shift_invariant`)."""
    return join != "prompts" and all(shift_invariant(config) is None for config in configs)


def _measured(entry: dict, variant: str) -> str:
    """What the sweep measured for a variant that is not equal to stock, in words (the errors' text left out)."""
    outcomes = entry.get("failed_variants", {}).get(variant) or {}
    phrases = []
    for kind, outcome in outcomes.items():
        step = {"dpo": "DPO", "reward": "reward"}.get(kind, kind)
        if not outcome or outcome == "equal":
            continue
        if outcome.startswith("differs"):
            phrases.append(f"the prefix-shared {step} step differs from stock")
        elif outcome.startswith("stock fails"):
            phrases.append(f"stock TRL itself fails in the {step} step")
        elif outcome.startswith("error") and outcome.endswith(" s"):
            phrases.append(f"the {step} step ran over the sweep's time limit")
        elif outcome.startswith("error"):
            phrases.append(f"prefix sharing raised in the {step} step")
        else:
            phrases.append(f"the {step} step was not measured")
    return "; ".join(phrases) or "this option was not measured"


# ---------------------------------------------------------------------------------------------------- windows
def window_layout(config) -> tuple[int | None, bool]:
    """(window, mixed): the sliding window the model applies (in positions), and whether only some layers use it.

    A config with `layer_types` slides on its `"sliding_attention"` layers (Qwen2/3, Gemma 2/3, Cohere 2, GPT-OSS,
    OLMo 3, ...); one without slides everywhere when `sliding_window` is set (Mistral, Phi-3, Starcoder2). Whether a
    family's code really does so is what the sweep's `sliding_window` variant measures."""
    text_config = _text_config(config)
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if window is None:
        return None, False
    if layer_types is None:
        return window, False
    if "sliding_attention" not in layer_types:
        return None, False
    return window, "full_attention" in layer_types
