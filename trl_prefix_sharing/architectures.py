"""Which architectures prefix sharing runs, and why the others are refused.

The contract: an architecture gives stock TRL's numbers under the shared layout when

- its attention honours the 4-D mask it is given and the explicit ``position_ids`` (RoPE, partial RoPE, absolute
  position embeddings read from the ids, NoPE layers),
- no layer carries state along the row (Mamba/SSM, linear or delta-rule attention, short convolutions, RWKV/xLSTM,
  hybrids of those with attention): the second completion would read the state the first one left,
- nothing else in the forward depends on which tokens share a row (ALiBi or positions built from row indices, local
  or chunked attention counted in row positions, a 2-D padding mask assumed).

Whether a family meets it is *measured*, not assumed: ``scripts/sweep_architectures.py`` runs one DPO step and one
reward step per family (and per window / MoE option) against stock TRL, and writes the results to
``data/architectures.json``. :func:`check_supported_model` reads that file: a family is allowed when every measured
variant gave stock's numbers; a refused family's error names the reason from :data:`REFUSED` (or the measured
difference). What the registry cannot settle (a model type it does not list, custom code under its own type, a family
whose tiny config failed, a window a family was not measured with) goes to the start-up check
(:mod:`~trl_prefix_sharing.model_check`), which judges the user's own model on its first batch.
``tests/test_architectures.py`` re-runs the matrix of the supported families in CI.
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
    "window_layout",
    "variant_configs",
]

# ---------------------------------------------------------------------------------------------------- reasons
RECURRENT = (
    "recurrent or convolutional layers (Mamba/SSM, linear or delta-rule attention, short convolutions, RWKV/xLSTM) "
    "carry state across the shared row: the second completion would read the state the first one left"
)
ROW_POSITIONS = (
    "position information is built from row indices or the 2-D padding mask (ALiBi, learned offsets), not from "
    "`position_ids`, so a completion placed after another one gets other positions than in its own row"
)
LOCAL_ROWS = (
    "local or chunked attention is counted in row positions (chunks of the shared row), not in the original positions"
)
NOT_CAUSAL = (
    "not a decoder-only causal LM (encoder or encoder-decoder): tokens attend both ways, a completion sees the other"
)
MASK_2D = "the forward assumes a 2-D padding mask and does not honour a given 4-D mask"
INDEXED = (
    "sparse attention keeps the top-k keys an indexer scores over the whole row (DeepSeek sparse attention): in a "
    "shared row the other completions' keys compete for the k places, and ties are broken by row position"
)
ROW_GROUPS = (
    "tokens are grouped along the row (byte patches by entropy, n-gram hash embeddings): a completion's groups "
    "depend on what precedes it in the shared row"
)
DRAFTER = (
    "a speculative-decoding drafter: its forward reads the keys and values of a target model, it is not trained alone"
)
VISION = (
    "a vision-language model outside the families whose images prefix sharing lays out (Qwen2-VL, Qwen2.5-VL, "
    "Qwen3-VL)"
)
UNUSED_WINDOW = (
    "its config always sets a sliding window (3000) that its decoder does not apply, while the shared layout's mask "
    "would apply it"
)

#: model_type -> why prefix sharing cannot give stock's numbers, known from the model's code (the sweep measured these
#: differing from or failing against stock; `scripts/sweep_architectures.py --measure-refused` measures them again).
#: Families refused by measurement alone carry the measured outcome as their reason in the registry.
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        [
            "bailing_hybrid",
            "inkling2_loop_text",
            "inkling2_text",
            "inkling_text",
            "lara_mini",
            "qwen4_exp",
            "qwen4_exp_text",
            "bamba",
            "falcon_h1",
            "falcon_mamba",
            "granitemoehybrid",
            "jamba",
            "kimi_linear",
            "lfm2",
            "lfm2_moe",
            "mamba",
            "mamba2",
            "minimax",
            "nemotron_h",
            "olmo_hybrid",
            "qwen3_5",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "qwen3_5_text",
            "qwen3_next",
            "recurrent_gemma",
            "rwkv",
            "xlstm",
            "zamba",
            "zamba2",
        ],
        RECURRENT,
    ),
    **dict.fromkeys(["biogpt", "bloom", "cpmant", "mpt", "opt", "xglm"], ROW_POSITIONS),
    **dict.fromkeys(["deepseek_v4", "gpt_neo", "llama4", "llama4_text", "reformer"], LOCAL_ROWS),
    **dict.fromkeys(["axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4"], INDEXED),
    **dict.fromkeys(["gemma3", "gemma3n", "git", "got_ocr2", "mllama", "phi4_multimodal"], VISION),
    **dict.fromkeys(["gemma4_assistant", "gemma4_unified_assistant"], DRAFTER),
    "blt": ROW_GROUPS,
    "openai-gpt": MASK_2D,
    "moshi": UNUSED_WINDOW,
    **dict.fromkeys(
        [
            "bart",
            "bert",
            "bert-generation",
            "big_bird",
            "bigbird_pegasus",
            "blenderbot",
            "blenderbot-small",
            "camembert",
            "data2vec-text",
            "electra",
            "ernie",
            "marian",
            "mbart",
            "megatron-bert",
            "musicgen",
            "musicgen_melody",
            "mvp",
            "pegasus",
            "plbart",
            "prophetnet",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roc_bert",
            "roformer",
            "trocr",
            "whisper",
            "xlm",
            "xlnet",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xmod",
        ],
        NOT_CAUSAL,
    ),
}

#: `layer_types` entries that are not attention: any of them makes a model recurrent in the sense of the contract
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
#: `layer_types` entries refused for a reason of their own (the others that are not attention: `RECURRENT`)
_REFUSED_LAYER_TYPES = {"chunked_attention": LOCAL_ROWS, "indexed_attention": INDEXED}

# ---------------------------------------------------------------------------------------------------- variants
#: The options a family is measured with beyond its default tiny config, under the config names it uses. A variant
#: applies to a family whose config has the attribute named first.
VARIANTS: dict[str, tuple[str, dict]] = {
    "sliding_window": ("sliding_window", {"sliding_window": 6}),
    "router_aux_loss": ("output_router_logits", {"output_router_logits": True, "router_aux_loss_coef": 0.02}),
}


def variant_configs(config) -> dict[str, dict]:
    """The variants that apply to this (default tiny) config: name -> config overrides (``"default"`` first)."""
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
    """The measured registry (``data/architectures.json``): ``{"supported": {model_type: entry}, "refused":
    {...}}``."""
    text = resources.files("trl_prefix_sharing").joinpath("data/architectures.json").read_text()
    return json.loads(text)


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(registry()["supported"]))


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


#: registry outcomes a start-up check on the user's own model can settle (nothing was measured, or only the tiny
#: config failed); every other refused entry stays refused
_CHECKABLE_OUTCOMES = ("not measured", "stock TRL itself fails", "measured: prefix sharing raised")


def check_supported_model(config) -> str | None:
    """Decide how an architecture is judged: raise a clear error for one that cannot give stock's numbers under the
    shared layout (a reason no batch can disprove, or a measured difference); return None for one the registry
    measured equal with this config's options; return why the start-up check must judge it on the model itself
    (:mod:`~trl_prefix_sharing.model_check`): a model type the sweep did not measure (custom code, a newer
    transformers) or measured only without this config's sliding window."""
    text_config = _text_config(config)
    model_type = getattr(text_config, "model_type", None)
    layer_types = set(getattr(text_config, "layer_types", None) or ())
    other_layers = layer_types - _ATTENTION_LAYER_TYPES
    way_out = "Train it with `prefix_sharing=False`."
    if other_layers - set(_REFUSED_LAYER_TYPES):
        raise ValueError(
            f"Prefix sharing is refused for '{model_type}': its layers {sorted(other_layers)} "
            f"are not attention; {RECURRENT}. {way_out}"
        )
    for layer_type, reason in _REFUSED_LAYER_TYPES.items():
        if layer_type in other_layers:
            raise ValueError(
                f"Prefix sharing is refused for '{model_type}' ({layer_type} layers): {reason}. {way_out}"
            )
    if getattr(text_config, "attention_chunk_size", None):
        raise ValueError(f"Prefix sharing is refused for '{model_type}': {LOCAL_ROWS}. {way_out}")
    if model_type in REFUSED:
        raise ValueError(f"Prefix sharing is refused for '{model_type}': {REFUSED[model_type]}. {way_out}")
    refused = registry()["refused"].get(model_type)
    if refused is not None and not refused["reason"].startswith(_CHECKABLE_OUTCOMES):
        raise ValueError(f"Prefix sharing is refused for '{model_type}': {refused['reason']}. {way_out}")
    entry = registry()["supported"].get(model_type)
    if entry is None:
        if getattr(text_config, "output_router_logits", False):
            raise ValueError(
                f"Prefix sharing is not measured for the model type '{model_type}' with the router's auxiliary loss "
                "(`output_router_logits=True`), which the start-up check (log-probs) cannot judge. Set "
                f"`output_router_logits=False`, or {way_out[0].lower() + way_out[1:]}"
            )
        if refused is not None:
            return f"the sweep of model types did not settle '{model_type}' ({refused['reason']})"
        return f"the model type '{model_type}' is not in the measured registry"
    window, _ = window_layout(text_config)
    if window is not None and "sliding_window" not in entry.get("variants", ()):
        failed = entry.get("failed_variants", {}).get("sliding_window")
        if failed and any(outcome and outcome.startswith("differs") for outcome in failed.values()):
            raise ValueError(
                f"Prefix sharing is measured equal for '{model_type}' without a sliding window only "
                f"({_measured(entry, 'sliding_window')}); this config sets `sliding_window={window}`. {way_out}"
            )
        return f"'{model_type}' is measured without a sliding window only; this config sets `sliding_window={window}`"
    if getattr(text_config, "output_router_logits", False) and "router_aux_loss" not in entry.get("variants", ()):
        raise ValueError(
            f"Prefix sharing is measured equal for '{model_type}' without the router's auxiliary loss only "
            f"({_measured(entry, 'router_aux_loss')}); this config sets `output_router_logits=True`. {way_out}"
        )
    return None


def _measured(entry: dict, variant: str) -> str:
    outcomes = entry.get("failed_variants", {}).get(variant)
    if not outcomes:
        return f"{variant}: not measured"
    return f"{variant}: " + "; ".join(f"{kind} {outcome}" for kind, outcome in outcomes.items() if outcome)


# ---------------------------------------------------------------------------------------------------- windows
def window_layout(config) -> tuple[int | None, bool]:
    """(window, mixed): the sliding window the model applies (in positions), and whether only some layers use it.

    A config with ``layer_types`` slides on its ``"sliding_attention"`` layers (Qwen2/3, Gemma 2/3, Cohere 2, GPT-OSS,
    OLMo 3, ...); one without slides everywhere when ``sliding_window`` is set (Mistral, Phi-3, Starcoder2). Whether a
    family's code really does so is what the sweep's ``sliding_window`` variant measures."""
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
