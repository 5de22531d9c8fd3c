"""The benchmarks' models: a tiny random one built from a config (default), a ~0.5B one on a GPU, or
SmolLM2-135M-Instruct's trained weights and tokenizer (`--model smollm2`, offline); the options that choose them, and
the quiet set-up every benchmark starts with."""

from __future__ import annotations

import os
import warnings


MODELS = ("tiny", "smollm2")
#: the tiny model's size options and their defaults; `--model smollm2` refuses them
TINY_OPTIONS = {"family": "llama", "hidden_size": 256, "layers": 4}


def add_model_options(parser):
    """`--model`, and the tiny model's `--family/--hidden-size/--layers` (default None: `check_model_options`
    fills in the defaults, after telling whether they were given)."""
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="tiny: a small random Llama from a config, with a word-level tokenizer (default); smollm2: "
        "SmolLM2-135M-Instruct's trained weights and tokenizer (134.5M parameters, offline: "
        "trl_prefix_sharing.testing.real_model)",
    )
    parser.add_argument("--family", default=None, help="tiny model only (default llama)")
    parser.add_argument("--hidden-size", type=int, default=None, help="tiny model only (default 256)")
    parser.add_argument("--layers", type=int, default=None, help="tiny model only (default 4)")


def check_model_options(args):
    """Refuse the tiny model's size options with `--model smollm2` (one line), then fill in their defaults."""
    given = [f"--{name.replace('_', '-')}" for name in TINY_OPTIONS if getattr(args, name) is not None]
    if args.model != "tiny" and given:
        raise SystemExit(
            f"error: {', '.join(given)} size the tiny model; --model {args.model} has its own size (leave them out)"
        )
    for name, default in TINY_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def smollm2_dir():
    """SmolLM2-135M-Instruct's model directory, or exit with the loader's one-line message when a package is
    missing."""
    from trl_prefix_sharing.testing.real_model import RealModelMissing, smollm2_path

    try:
        return smollm2_path()
    except RealModelMissing as error:
        raise SystemExit(f"error: {error}") from None


def describe_smollm2(model):
    """SmolLM2-135M-Instruct's shape, from the loaded model: `SmolLM2-135M-Instruct (llama, hidden 576, ...)`."""
    config = model.config
    parameters = sum(p.numel() for p in model.parameters()) / 1e6  # the tied embedding counted once
    return (
        f"SmolLM2-135M-Instruct (trained weights, {config.model_type}, hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers, {config.num_attention_heads} query / {config.num_key_value_heads} "
        f"key-value heads, vocab {config.vocab_size}, {parameters:.1f}M parameters)"
    )


def build_model(kind, tokenizer, args):
    """The benchmark's model: a causal LM, or for `kind == "reward"` a sequence classifier with a one-label score
    head; the tiny random model built from a config (on GPU a ~0.5B one), or with `--model smollm2`
    SmolLM2-135M-Instruct's weights (a reward model gets a fresh score head). Seeded; bf16 on CUDA, fp32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from trl_prefix_sharing.testing import make_config

    gpu = args.mode == "gpu"
    cls = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    common = dict(attn_implementation="sdpa", dtype=torch.bfloat16 if gpu else torch.float32)
    torch.manual_seed(0)  # the tiny model's weights, SmolLM2's score head
    if getattr(args, "model", "tiny") == "smollm2":
        model = cls.from_pretrained(smollm2_dir(), **({"num_labels": 1} if kind == "reward" else {}), **common)
    else:
        if gpu:  # ~0.5B parameters, Qwen2.5-0.5B-like shape, built from config (no download)
            sizes = dict(
                hidden_size=896, num_layers=24, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2
            )
            vocab = 32000
        else:
            sizes = dict(hidden_size=args.hidden_size, num_layers=args.layers)
            vocab = len(tokenizer)
        config = make_config(args.family, vocab, **sizes)
        if kind == "reward":
            config.num_labels = 1
        model = cls.from_config(config, **common)
    return model.cuda() if gpu else model


def quiet_setup(gpu: bool, model: str = "tiny"):
    """Silence progress bars and warnings, check CUDA: (device name, the tokenizer: the tiny word-level one, or with
    `model="smollm2"` SmolLM2-135M-Instruct's)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    from trl_prefix_sharing.testing import make_tokenizer

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--mode gpu needs CUDA.")
    if model == "smollm2":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    else:
        tokenizer = make_tokenizer()
    return torch.cuda.get_device_name() if gpu else f"CPU, {torch.get_num_threads()} threads", tokenizer
