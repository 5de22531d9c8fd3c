"""The attention backends: the kernels a shared layout runs on, each one typed object, chosen here and only here.

An `AttentionBackend` says everything that depends on the kernel: its name (`prefix_sharing_attn_implementation`),
the model attention implementation it switches the models to, whether it can run for a device, a compute dtype and
a model (`unavailable`), how it lays out the shared rows (`rows`, `packed_rows`), what it adds to the model call for
one layout (`inputs`, an `AttentionInputs`), and its cost model (`cost`). The rest of the package asks the backend;
nothing else compares kernel names.

- `VarlenBackend` (`"varlen"`): the layout as one unpadded row whose query segments read their gathered paths
  (`varlen.py`): PyTorch's FlashAttention-2 varlen kernel on CUDA in bfloat16/float16, a reference implementation
  (SDPA per segment) elsewhere. No padding, no rounding, no mask.
- `FlexBackend` (`"flex_attention"`): a FlexAttention `BlockMask` of `mask.on_path` (block-sparse: fully masked
  blocks are skipped), rows rounded to its block size. CUDA only for training (no backward on the CPU).
- `SdpaBackend` (`"sdpa"`): the same mask evaluated densely as a boolean `[N, 1, S, S]` tensor for
  `scaled_dot_product_attention`.
- `EagerBackend`: the dense mask as an additive float tensor, for model classes that support neither (attention
  softcapping, sinks). Not a choice of its own: the fallback of the two above.

`choose_backend` decides, from the request, the device, the compute dtype and the models; `"auto"` takes the first
that can run of varlen, FlexAttention and SDPA on CUDA, SDPA elsewhere, and the start-up log says what it took and
why not the others. The switch of a model's attention implementation is recorded and undone by
`AttentionSwitch.restore`; it touches only the models given to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from transformers.utils import logging

from .architectures import supported_model_types, varlen_unmeasured, window_layout
from .cost import StepCost, config_int
from .layout import Layout, RowPolicy, Segments, _moved
from .mask import block_mask, dense_mask, prefix_sharing_mask
from .patching import patch_own, put_back_own
from .varlen import SEGMENTS_KWARG, VARLEN_ATTENTION, kernel_unavailable
from .vision import VISION_MODEL_TYPES, is_vision_config


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ATTN_IMPLEMENTATIONS",
    "AttentionInputs",
    "MaskInputs",
    "SegmentInputs",
    "AttentionBackend",
    "VarlenBackend",
    "FlexBackend",
    "SdpaBackend",
    "EagerBackend",
    "BACKENDS",
    "attention_dtype",
    "choose_backend",
    "auto_backends",
    "AttentionSwitch",
    "GENERATION_METHODS",
]

logger = logging.get_logger(__name__)

#: Architectures measured equal to stock TRL under prefix sharing (the registry in `.architectures`).
SUPPORTED_MODEL_TYPES = supported_model_types()
#: `prefix_sharing_attn_implementation`'s choices
ATTN_IMPLEMENTATIONS = ("auto", "varlen", "flex_attention", "sdpa")
#: FlexAttention's block size (`create_block_mask`'s default): the width shared rows are rounded to under
#: FlexAttention.
FLEX_ROW_MULTIPLE = 128


# ----------------------------------------------------------------------------------------------- what a call gets
class AttentionInputs:
    """What an attention backend adds to the model call for one layout (`Layout.attention`)."""

    def model_kwargs(self) -> dict:
        """The keywords of the model call."""
        raise NotImplementedError

    def to(self, device, non_blocking: bool = False) -> AttentionInputs:
        raise NotImplementedError


@dataclass
class MaskInputs(AttentionInputs):
    """A mask of the shared rows: a FlexAttention `BlockMask`, a dense tensor, or one per layer type (a dict)."""

    mask: Any

    def model_kwargs(self) -> dict:
        return {"attention_mask": self.mask}

    def to(self, device, non_blocking: bool = False) -> MaskInputs:
        return replace(self, mask=_moved(self.mask, device, non_blocking))


@dataclass
class SegmentInputs(AttentionInputs):
    """A one-row layout's query segments (`layout.Segments`), for the varlen attention function. The model's own
    mask is skipped: a 4-D placeholder, which transformers passes through unbuilt and any other attention function
    refuses by its shape."""

    segments: tuple[Segments, ...]

    def model_kwargs(self) -> dict:
        device = self.segments[0].key_index.device if self.segments else None
        placeholder = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=device)
        return {"attention_mask": placeholder, SEGMENTS_KWARG: self.segments}

    def to(self, device, non_blocking: bool = False) -> SegmentInputs:
        return replace(self, segments=_moved(self.segments, device, non_blocking))


# ----------------------------------------------------------------------------------------------- the backends
def _head_dim(config) -> int | None:
    """The model's head size, or None where its config gives no single one (layers of different sizes)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = config_int(config, "head_dim")
    if head_dim is not None:
        return head_dim
    hidden, heads = config_int(config, "hidden_size"), config_int(config, "num_attention_heads")
    return hidden // heads if hidden is not None and heads else None


class AttentionBackend:
    """One kernel for shared layouts; see the module docstring. Subclasses set the class attributes and the methods
    that differ."""

    #: `prefix_sharing_attn_implementation`'s value for it
    name: ClassVar[str]
    #: the model's attention implementation while it runs shared layouts
    attn_implementation: ClassVar[str]
    #: what the model receives, for the start-up line
    form: ClassVar[str]
    #: whether the kernel computes every query-key pair of a row (the cost model's `dense`)
    dense: ClassVar[bool] = True

    def supports(self, model) -> bool:
        """Whether the model's class declares support for this backend's attention implementation."""
        return True

    def unavailable(self, models, device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run these models on `device` computing in `dtype` (None: it can)."""
        return None

    def rows(self, pad_to_multiple_of: int | None) -> RowPolicy:
        """The unpacked shared rows: one document per row, the width rounded up to `pad_to_multiple_of`."""
        return RowPolicy(multiple=pad_to_multiple_of)

    def packed_rows(self, length: int, streams: bool) -> RowPolicy:
        """Packing's rows of `length` tokens (`streams`: a dataset that is streamed, so no sampler fits a batch to
        one row). A dense kernel pays the square of a row's width whatever the mask, so a batch takes several rows as
        long as its longest document (never more attention than stock's padded rows) instead of one long row."""
        return RowPolicy(pack=True)

    def inputs(self, layout: Layout, config) -> AttentionInputs:
        """What the model call gets for `layout` (built once per layout, shared by the policy and reference)."""
        raise NotImplementedError

    def cost(self, model) -> StepCost:
        return StepCost.of_model(model, dense=self.dense)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _MaskBackend(AttentionBackend):
    """A backend that takes the mask of `mask.on_path` in some form (`_mask`), per layer type where the model mixes
    full and sliding-window layers (Qwen2/Qwen3 with `use_sliding_window`, Gemma 2/3, Cohere 2, GPT-OSS, ...)."""

    def _mask(self, mask_mod, n: int, s: int, device):
        raise NotImplementedError

    @torch.no_grad()
    def inputs(self, layout: Layout, config) -> MaskInputs:
        # built without autograd (a mask has no gradient), so the compiled `create_block_mask` sees one grad mode in
        # training and evaluation steps alike (dynamo compiles a variant per grad mode)
        subtree_end, position_ids = layout.subtree_end, layout.position_ids
        n, s = subtree_end.shape
        device = subtree_end.device

        def make(window):
            return self._mask(prefix_sharing_mask(subtree_end, position_ids, window, layout.key_visible), n, s, device)

        window, mixed = window_layout(config)
        full = make(None) if window is None or mixed else None
        if window is None:
            return MaskInputs(full)
        sliding = make(window)
        return MaskInputs({"full_attention": full, "sliding_attention": sliding} if mixed else sliding)


class SdpaBackend(_MaskBackend):
    name = attn_implementation = "sdpa"
    form = "a dense boolean mask"

    def supports(self, model) -> bool:
        return getattr(model, "_supports_sdpa", False)

    def _mask(self, mask_mod, n, s, device):
        return dense_mask(mask_mod, n, s, s, device=device)


class EagerBackend(_MaskBackend):
    name = attn_implementation = "eager"
    form = "a dense additive float mask"

    def _mask(self, mask_mod, n, s, device):  # eager attention adds the mask to the scores
        allowed = dense_mask(mask_mod, n, s, s, device=device)
        return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


class FlexBackend(_MaskBackend):
    name = attn_implementation = "flex_attention"
    form = "a block-sparse BlockMask"
    dense = False

    def supports(self, model) -> bool:
        return getattr(model, "_supports_flex_attn", False)

    def unavailable(self, models, device, dtype):
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError:
            return f"FlexAttention is not available in torch {torch.__version__}"
        if torch.device(device).type != "cuda":
            return f"FlexAttention has no backward pass on {torch.device(device).type} in torch {torch.__version__}"
        if any(is_vision_config(model.config) for model in models):
            return (
                f"the vision-language models prefix sharing supports ({', '.join(VISION_MODEL_TYPES)}) do not accept "
                "`flex_attention` in transformers"
            )
        return None

    def rows(self, pad_to_multiple_of):
        """Rows rounded up to the user's `pad_to_multiple_of`, else to FlexAttention's block size (128). The compiled
        `create_block_mask` and FlexAttention are specialised to shapes; a width per batch can only compile again
        (or, where dynamic shapes fail, past `torch._dynamo.config.recompile_limit` fall back to eager FlexAttention,
        which materialises the full score matrix). Block multiples leave a few widths, add no attention blocks (a
        partial block is computed whole) and at most 127 padding tokens per row to the linear layers.
        `pad_to_multiple_of=1` turns it off."""
        return RowPolicy(multiple=pad_to_multiple_of if pad_to_multiple_of is not None else FLEX_ROW_MULTIPLE)

    def packed_rows(self, length, streams):
        # a stream has no sampler to make a batch fit one row: what arrives goes into as many rows of `length` as it
        # needs (first-fit decreasing); a map-style batch takes one
        return RowPolicy(pack=True, length=length, one_row=not streams)

    def _mask(self, mask_mod, n, s, device):
        return block_mask(mask_mod, n, s, s, device=device)

    @torch.no_grad()
    def inputs(self, layout: Layout, config) -> MaskInputs:
        window, mixed = window_layout(config)
        if window is None:
            return super().inputs(layout, config)
        # One mask_mod structure for every batch and layer type, the window a tensor (full layers: one that never
        # bites): compiled code is specialised to a mask_mod's structure and Python numbers, not to tensor values, so
        # full and sliding layers, short and long batches share compiled variants (else each doubles them).
        subtree_end, position_ids = layout.subtree_end, layout.position_ids
        n, s = subtree_end.shape
        device = subtree_end.device

        def make(window):
            mask_mod = prefix_sharing_mask(subtree_end, position_ids, window, layout.key_visible)
            return block_mask(mask_mod, n, s, s, device=device)

        sliding = make(torch.tensor(window, device=device))
        if not mixed:
            return MaskInputs(sliding)
        full = make(torch.tensor(torch.iinfo(torch.long).max, device=device))
        return MaskInputs({"full_attention": full, "sliding_attention": sliding})


class VarlenBackend(AttentionBackend):
    name = "varlen"
    attn_implementation = VARLEN_ATTENTION
    form = "query segments over gathered paths in one unpadded row"
    dense = False

    def unavailable(self, models, device, dtype):
        for model in models:
            config = model.config
            if is_vision_config(config):
                return "vision-language models are not yet measured on the varlen kernel"
            if not getattr(model, "_supports_sdpa", False):  # softcapping, sinks: eager attention only
                return f"{type(model).__name__}'s attention (softcapping or sinks) has no varlen form"
            unmeasured = varlen_unmeasured(config)
            if unmeasured is not None:
                return unmeasured
            reason = kernel_unavailable(device, dtype, _head_dim(config))
            if reason is not None:
                return reason
        return None

    def rows(self, pad_to_multiple_of):
        return RowPolicy(stream=True)

    def packed_rows(self, length, streams):
        return RowPolicy(stream=True)  # packing's sampler bounds the tokens of a batch; the row has no padding

    def inputs(self, layout: Layout, config) -> SegmentInputs:
        if layout.segments is None:
            raise RuntimeError(
                "This layout has no query segments for the varlen kernel: it was laid out for another attention "
                "backend's rows (build it with `RowPolicy(stream=True)`, the rows of `prefix_sharing_attn_"
                "implementation='varlen'`)."
            )
        return SegmentInputs(layout.segments)


#: the backends by name (`EagerBackend` is a fallback, not a choice)
BACKENDS: dict[str, AttentionBackend] = {
    backend.name: backend for backend in (VarlenBackend(), FlexBackend(), SdpaBackend(), EagerBackend())
}
#: what a mask backend falls back to for a model class that does not declare support for it
_CLASS_FALLBACK = ("flex_attention", "sdpa", "eager")


def attention_dtype(model, mixed_precision: str | None = None) -> torch.dtype:
    """The dtype a model's attention computes in: autocast's under accelerate's mixed precision (`"bf16"`,
    `"fp16"`), else the model's floating-point weights'."""
    if mixed_precision in ("bf16", "fp16"):
        return torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _auto_candidates(device) -> tuple[str, ...]:
    """What `"auto"` tries, in order of preference, on a device (off CUDA varlen is its reference implementation,
    which the measured choice may still find faster than the dense mask)."""
    return ("varlen", "flex_attention", "sdpa") if torch.device(device).type == "cuda" else ("sdpa", "varlen")


def auto_backends(models, device, dtype: torch.dtype) -> list[AttentionBackend]:
    """Every backend `"auto"` may run these models on here, in order of preference: each of `_auto_candidates` that
    can run (`unavailable`), as the model class supports it (`_supported`), once each. A backend that cannot run is
    never a candidate."""
    found = []
    for name in _auto_candidates(device):
        if BACKENDS[name].unavailable(models, torch.device(device), dtype) is not None:
            continue
        choices = {_supported(BACKENDS[name], model).name for model in models}
        if len(choices) == 1 and BACKENDS[choices.pop()] not in found:
            found.append(_supported(BACKENDS[name], models[0]))
    return found


def choose_backend(models, requested: str, device, dtype: torch.dtype):
    """The one backend the shared layouts of these models (policy, reference) run on, logged with why.

    `requested` is `prefix_sharing_attn_implementation`: an explicit backend that cannot run here is an error naming
    why; `"auto"` takes the first of `_auto_candidates` that can run, and a mask backend the model class does not
    declare support for falls back to the next one it supports (FlexAttention -> SDPA -> eager). One layout per step
    serves the policy and reference passes, so they must agree.
    """
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"`prefix_sharing_attn_implementation` must be one of {ATTN_IMPLEMENTATIONS}, got {requested!r}."
        )
    device = torch.device(device)
    skipped = []
    for name in _auto_candidates(device) if requested == "auto" else (requested,):
        reason = BACKENDS[name].unavailable(models, device, dtype)
        if reason is None:
            break
        if requested != "auto":
            others = "'sdpa'" if name == "flex_attention" else "'flex_attention' (CUDA) or 'sdpa'"
            raise ValueError(
                f"`prefix_sharing_attn_implementation='{name}'` cannot run here: {reason}. Use 'auto' (which takes "
                f"the first kernel that can run here) or {others}."
            )
        skipped.append(f"not {name}: {reason}")
    choices = {_supported(BACKENDS[name], model).name for model in models}
    if len(choices) > 1:
        raise ValueError(
            f"The policy and reference models need different attention implementations under prefix sharing "
            f"({sorted(choices)}); use a reference model of the same architecture."
        )
    backend = BACKENDS[choices.pop()]
    how = f"'auto' on {device.type}" if requested == "auto" else "as requested"
    if backend.name != name:
        skipped.append(f"not {name}: {type(models[0]).__name__} does not support it (its class declares so)")
    why = f" ({'; '.join(skipped)})" if skipped else ""
    message = f"Prefix sharing: the shared layouts run on `{backend.name}` ({how}), as {backend.form}{why}."
    (logger.warning if skipped else logger.info)(message)  # a fallback is said at the default verbosity
    return backend


def _supported(backend: AttentionBackend, model) -> AttentionBackend:
    """`backend`, or for a mask backend the model class does not declare support for, the next one it supports."""
    if backend.name not in _CLASS_FALLBACK:
        return backend
    order = _CLASS_FALLBACK[_CLASS_FALLBACK.index(backend.name) :]
    return next(BACKENDS[name] for name in order if BACKENDS[name].supports(model))


#: the generation methods `AttentionSwitch` runs on the model's own attention (`generate_batch`: transformers'
#: continuous batching, TRL's `use_transformers_continuous_batching`)
GENERATION_METHODS = ("generate", "generate_batch")


def _own_key(name: str) -> str:
    """Where a model's own generation method (an instance attribute, or None for the class's) is kept while its
    wrapper is installed."""
    return f"_prefix_sharing_own_{name}"


class AttentionSwitch:
    """Set the attention implementation of given models, remembering the old one so it can be put back.

    Generation runs on the model's own implementation, as in stock TRL: `generate` and `generate_batch` (GRPO, RLOO
    and online DPO sample with them) switch back for the call. Sampling follows the logits' last bits, so generating
    through the shared mask's implementation (FlexAttention under bf16 on CUDA) would draw other completions than
    stock TRL from the same seed; it would also compile FlexAttention for every decoding length.
    """

    def __init__(self):
        self._saved: list[tuple[object, object]] = []

    def apply(self, model, attn_implementation: str) -> None:
        if any(m is model for m, _ in self._saved):
            return
        current = model.config._attn_implementation
        self._saved.append((model, current))
        if current != attn_implementation:
            model.set_attn_implementation(attn_implementation)
            if current is not None:
                for name in GENERATION_METHODS:
                    if callable(getattr(model, name, None)):
                        _generate_with(model, name, current)

    def use(self, model, attn_implementation: str | None) -> None:
        """Switch a model this switch applied to `attn_implementation` (None: the model's own) for the calls that
        follow; it stays until the next switch (a backward's recomputation under gradient checkpointing reads it)."""
        for saved, own in self._saved:
            if saved is model:
                wanted = own if attn_implementation is None else attn_implementation
                if wanted is not None and model.config._attn_implementation != wanted:
                    model.set_attn_implementation(wanted)
                return

    def restore(self) -> None:
        for model, old in reversed(self._saved):
            for name in GENERATION_METHODS:
                put_back_own(model, name, _own_key(name))
            if old is not None and model.config._attn_implementation != old:
                model.set_attn_implementation(old)
        self._saved.clear()


def _generate_with(model, name: str, attn_implementation: str) -> None:
    """Wrap this model instance's generation method `name` to run on `attn_implementation`, switching back
    afterwards."""
    generate = getattr(model, name)

    @functools.wraps(generate)
    def generate_as_stock(*args, **kwargs):
        shared = model.config._attn_implementation
        model.set_attn_implementation(attn_implementation)
        try:
            return generate(*args, **kwargs)
        finally:
            model.set_attn_implementation(shared)

    patch_own(model, name, _own_key(name), generate_as_stock)
