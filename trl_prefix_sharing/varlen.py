"""The padding-free kernel: every query segment of a one-row layout attends to the keys of its path, gathered.

A layout laid out as one unpadded row (`RowPolicy(stream=True)`) describes its attention as query segments
(`layout.Segments`): each row of the trie adds one run of new tokens, and that run's keys are its whole path, the
ancestors' tokens and then its own, gathered from the row by index. One varlen call per layer computes every
segment, bottom-right causal (query `i` of a segment of `q` queries over `k` keys sees keys `0 .. k - q + i`), which
is exactly `mask.on_path`. Nothing is padded or rounded, and no mask is built.

- On CUDA, in bfloat16 or float16, the call is PyTorch's FlashAttention-2 varlen kernel
  (`torch.nn.attention.varlen.varlen_attn`), with grouped-query attention native and a sliding window as
  `window_size=(W - 1, 0)`.
- Elsewhere (the CPU), the same stream, the same gather indices and the same segment bounds run through a reference
  implementation: each segment through `scaled_dot_product_attention` with its bottom-right causal mask. So everything
  but the CUDA kernel is proven in float32 by the CPU tests.

The gathered keys and values are a copy per segment: the gradient of a prefix that several segments read is the sum
of their copies' gradients. `gather_rows` makes that sum in float32, deterministic (the sort-based accumulation of
`index_put_(..., accumulate=True)`), never in bfloat16 atomics.

The function is registered with transformers' `AttentionInterface` as `"prefix_sharing_varlen"` (no "flash" in the
name: transformers would then infer sequences from position ids, which a trie's branches do not restart). A model
runs on it only while a trainer shares prefixes (the session switches it and puts its own back), and a saved config
never names it. A call of such a model without segments (stock rows, such as the start-up check's) runs SDPA with
the model's own mask (the name's mask function is SDPA's).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from .layout import Segments


__all__ = [
    "VARLEN_ATTENTION",
    "SEGMENTS_KWARG",
    "varlen_kernel",
    "kernel_unavailable",
    "gather_rows",
    "segment_attention",
    "varlen_attention_forward",
    "register",
]

#: the attention implementation a model runs while it computes a layout's segments
VARLEN_ATTENTION = "prefix_sharing_varlen"
#: the model keyword that carries a layout's segments to the attention function
SEGMENTS_KWARG = "prefix_sharing_segments"
#: FlashAttention-2's limits on the head size
MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 256, 8
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def varlen_kernel():
    """PyTorch's varlen FlashAttention (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.11: causal as
    `window_size=(-1, 0)`), or None where this torch lacks it. Detected by its signature, not by version."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "window_size" not in inspect.signature(varlen_attn).parameters:
        return None  # torch 2.10: `is_causal` only
    return varlen_attn


def kernel_unavailable(device, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """Why the CUDA kernel cannot run here (None: it can). Off CUDA the reference implementation runs instead, which
    has no such limits."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if varlen_kernel() is None:
        return f"torch {torch.__version__} has no `torch.nn.attention.varlen.varlen_attn` with `window_size` (2.11+)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"FlashAttention-2 needs an Ampere or newer GPU (sm80+), this one is sm{major}{minor}"
    if dtype not in KERNEL_DTYPES:
        return (
            f"FlashAttention-2 computes in bfloat16 or float16, and this run's attention computes in "
            f"{str(dtype).removeprefix('torch.')} (set `bf16=True` or `fp16=True`, or load half-precision weights)"
        )
    if head_dim is not None and (head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM):
        return f"FlashAttention-2 takes head sizes that are multiples of 8 up to 256, this model's is {head_dim}"
    return None


class _GatherRows(torch.autograd.Function):
    """`source.index_select(0, index)` whose backward sums the gradients of repeated rows in float32 (or wider),
    deterministic (`index_put_` with `accumulate=True`: sort-based on CUDA), and returns them in the source's
    dtype."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.dtype = source.shape[0], source.dtype
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        dtype = torch.promote_types(grad.dtype, torch.float32)
        total = torch.zeros((ctx.rows, *grad.shape[1:]), dtype=dtype, device=grad.device)
        total.index_put_((index,), grad.to(dtype), accumulate=True)
        return total.to(ctx.dtype), None


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows `index` of `source` (`[T, ...]` -> `[len(index), ...]`); gradients of rows read several times add up
    in float32 (see `_GatherRows`)."""
    return _GatherRows.apply(source, index)


def _reference(query, key, value, segments: Segments, scale, window) -> torch.Tensor:
    """Each segment through `scaled_dot_product_attention`: its queries against its gathered keys, bottom-right
    causal (or all of them), within `window` positions. `[Q, Hq, D]` queries, `[K, Hkv, D]` keys and values."""
    outputs = []
    for q0, q1, k0, k1 in segments.bounds():
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)
        k = key[k0:k1].transpose(0, 1).unsqueeze(0)
        v = value[k0:k1].transpose(0, 1).unsqueeze(0)
        num_q, num_k = q1 - q0, k1 - k0
        # the depth of each query and key on the path: the queries end the path (causal) or follow it (padding)
        q_depth = torch.arange(num_q, device=query.device)[:, None] + (num_k - num_q if segments.causal else num_k)
        k_depth = torch.arange(num_k, device=query.device)[None, :]
        allowed = k_depth <= q_depth if segments.causal else torch.ones_like(k_depth, dtype=torch.bool)
        if window is not None:
            allowed = allowed & (q_depth - k_depth < window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        outputs.append(out[0].transpose(0, 1))
    if not outputs:
        return query.new_zeros((0, *query.shape[1:]))
    return torch.cat(outputs)


def _kernel(query, key, value, segments: Segments, scale, window) -> torch.Tensor:
    """The segments through PyTorch's varlen FlashAttention-2 (see the module docstring)."""
    kernel = varlen_kernel()
    if segments.causal:
        window_size = (-1 if window is None else window - 1, 0)
    else:  # scored padding sees its whole path (a window that bites goes through the reference)
        window_size = (-1, -1)
    parameters, extra = _parameters(kernel), {}
    if query.shape[1] != key.shape[1] and "enable_gqa" in parameters:
        extra["enable_gqa"] = True  # torch >= 2.12 asks for it; 2.11 passes unequal heads to the kernel as they are
    if "scale" in parameters:
        extra["scale"] = scale
    elif scale is not None:  # a kernel without `scale` scales by 1/sqrt(head size): fold the model's into the queries
        query = query * (scale * query.shape[-1] ** 0.5)
    return kernel(
        query,
        key,
        value,
        segments.cu_queries,
        segments.cu_keys,
        segments.max_queries,
        segments.max_keys,
        window_size=window_size,
        **extra,
    )


@functools.cache
def _parameters(function) -> frozenset:
    return frozenset(inspect.signature(function).parameters)


def segment_attention(query, key, value, segments: tuple[Segments, ...], scale=None, window=None) -> torch.Tensor:
    """Attention of a one-row layout's tokens, `[T, H, D]` queries, keys and values (heads of keys and values may be
    fewer: grouped-query attention), through its segments: the CUDA kernel in bfloat16/float16 on CUDA, the
    reference implementation elsewhere. `window`: a sliding window in positions (None: none). Returns `[T, Hq, D]`."""
    out = None
    for call in segments:
        # the farthest a query sees: its path's first key (padding queries follow their path)
        farthest = call.max_keys - 1 + (0 if call.causal else call.max_queries)
        bites = window is not None and window <= farthest
        call_window = window if bites else None
        q = query if call.query_index is None else query.index_select(0, call.query_index)
        k, v = gather_rows(key, call.key_index), gather_rows(value, call.key_index)
        if bites and not call.causal:
            # scored padding whose window bites: its bound depends on each row's padding, which one kernel call
            # cannot take, so these few queries go through the reference on any device
            result = _reference(q, k, v, call, scale, call_window)
        elif query.is_cuda:
            if query.dtype not in KERNEL_DTYPES:
                raise ValueError(
                    f"The varlen kernel computes in bfloat16 or float16, not {query.dtype}: train with `bf16=True` or "
                    "`fp16=True`, or set `prefix_sharing_attn_implementation='flex_attention'`."
                )
            result = _kernel(q, k, v, call, scale, call_window)
        else:
            result = _reference(q, k, v, call, scale, call_window)
        if call.query_index is None:
            return result
        if out is None:
            out = query.new_zeros((query.shape[0], query.shape[1], value.shape[-1]), dtype=result.dtype)
        out = out.index_copy(0, call.query_index, result)
    return out


def varlen_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """The attention function registered as `"prefix_sharing_varlen"` (transformers' signature: `[B, H, T, D]` in,
    `([B, T, H, D], None)` out). With a layout's segments (`prefix_sharing_segments`), the row's tokens through
    `segment_attention`; without, the model's own call on SDPA. The layer's sliding window is the `sliding_window`
    its attention passes, else its module's `sliding_window` (Qwen2-MoE sets it on sliding layers only); a model
    that applies its window in the mask alone is measured unequal (`architectures.varlen_unmeasured`)."""
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] == 0:  # a shared call's placeholder
            raise ValueError(
                f"{type(module).__name__} does not hand the model's keyword arguments on to its attention function, "
                "so the varlen kernel's segments never reach it: set `prefix_sharing_attn_implementation='sdpa'` "
                "(or 'flex_attention' on CUDA)."
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout:
        raise ValueError("The varlen kernel runs without attention dropout (prefix sharing needs dropout off).")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"The varlen kernel has no `{name}` (attention softcapping or sinks): set "
                "`prefix_sharing_attn_implementation='sdpa'` or 'auto'."
            )
    if query.shape[0] != 1:
        raise ValueError(f"The varlen kernel computes one row of segments, got {query.shape[0]} rows.")
    window = kwargs.pop("sliding_window") if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")  # rotary embeddings leave fp32 queries and keys under autocast
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = segment_attention(q, k, v, segments, scale=scaling, window=window)
    return out.unsqueeze(0), None


def register() -> None:
    """Register the attention function (and SDPA's mask function for calls without segments) with transformers under
    `VARLEN_ATTENTION`; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


register()
