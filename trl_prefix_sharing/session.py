"""The session: what one trainer holds to run its models on shared layouts.

A `PrefixSharingSession` owns the trainer's models and what every layout of theirs needs: the attention backend
(chosen once, by `attention.choose_backend`), the pad id and the rows the backend lays out, and the model patches
(attention switched, forward wrapped; scoped to these model instances, applied by `attach` and undone by `detach`). It
builds nothing of its own: a layout is the pure `layout.build_layout` of the stock rows, and the session adds what the
backend gives the model for it (`with_attention`: a mask, or the varlen kernel's segments), once per layout, so the
policy and reference passes share it.

Every trainer reaches it in one line per batch:

- preference trainers (DPO, reward): `session.prepare(inputs)` completes the `Layout` the collator put in the batch;
- trainers that build their stock rows in the step (ORPO, CPO, KTO): `session.layout(StockRows(...))`;
- online trainers (GRPO, RLOO, online DPO): `session.generated_layout(input_ids, attention_mask, prompt_length)` on
  the rows TRL generated, kept while those rows live.

The start-up model check is a phase of its own (`model_check.StartupCheck`), which the trainer runs before its first
layout; the session does not call it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping

import torch

from .attention import BACKENDS, AttentionBackend, AttentionSwitch
from .forward import install_prefix_sharing_forward, remove_prefix_sharing_forward
from .layout import Layout, RowPolicy, build_layout
from .patching import is_patched, keep_own, mark_patched, put_back_own
from .trie import StockRows
from .tuning import Tuning
from .virtual import VirtualTokens
from .vision import has_vision_inputs, shared_vision_inputs


__all__ = ["ModelPatches", "PrefixSharingSession", "pad_token_id"]

#: the attribute of a model that keeps its forward from before TRL's fused log-prob head was added here
_UNFUSED = "_prefix_sharing_unfused_forward"


def pad_token_id(processing_class) -> int:
    """The pad id of a tokenizer, or of a processor's tokenizer (the shared rows' padding; any id is exact there)."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else 0


class PrefixSharingSession:
    """The models of one trainer and what their layouts need; see the module docstring.

    Args:
        models: the trainer's models (policy first, then the reference model if it has its own), unwrapped.
        processing_class: the trainer's tokenizer or processor (for the pad id).
        backend: the attention backend its layouts run on (`attention.choose_backend`).
        pad_to_multiple_of: the config's `pad_to_multiple_of`, which the backend's rows may round to (`rows`).
        fuse_lm_head: add TRL's fused log-prob head to the models first (for a trainer that materialises logits in
            stock, such as online DPO): the shared rows are then scored without logits over the prompt. A tuple: the
            per-token fields the head computes (its `outputs`, e.g. `("log_probs", "mean_logits")`).
        checks: `prefix_sharing_checks` (None: where the batch is on the CPU).
        autocast: the trainer's `accelerator.autocast`: the shared calls of a model that accelerate already wrapped
            in mixed precision (a reference model prepared in TRL's `__init__`) run inside it, as stock's calls do.
        join: `prefix_sharing_join` (`trie.JOINS`); `"auto"` chooses by `self.cost`, the policy's under the kernel.
        alternatives, stock_rows: other backends, and whether stock's own rows, `"auto"` chooses from (`tuning.py`).
        virtual: the virtual tokens of the policy's prompt-learning PEFT adapter (`virtual.VirtualTokens`), or None.
        shift: generated rows share a start with prompts of other lengths, moved to the document's positions
            (`StockRows.shift`; shift-invariant models only).
    """

    def __init__(
        self,
        models,
        processing_class,
        backend: AttentionBackend,
        pad_to_multiple_of=None,
        fuse_lm_head: bool | tuple[str, ...] = False,
        checks: bool | None = None,
        autocast=None,
        join: str = "prompts",
        alternatives: tuple[AttentionBackend, ...] = (),
        stock_rows: bool = False,
        virtual: VirtualTokens | None = None,
        shift: bool = False,
    ):
        self.models = list(models)
        self.virtual = virtual
        self.shift = shift
        self.pad_token_id = pad_token_id(processing_class)
        self.backend = backend
        self.pad_to_multiple_of = pad_to_multiple_of
        self.checks = checks
        self.autocast = autocast
        self.join, self.cost = join, self.backend.cost(self.models[0])
        self.tuning = Tuning.of_session(self, alternatives, stock_rows)  # the candidates and their measured costs
        #: a trainer whose TRL code calls its models without a layout sets this: `router(model, kwargs)` gives the
        #: layout of a fused call's rows, a finished output, or None (see `install_prefix_sharing_forward`)
        self.router = None
        self.patches = ModelPatches(self.models, fuse_lm_head, autocast, self._route, self.tuning)
        self._layouts = _LayoutCache()

    @property
    def rows(self) -> RowPolicy:  # the backend's unpacked rows (rounded, or varlen's one unpadded row)
        return self.backend.rows(self.pad_to_multiple_of)

    def attach(self) -> None:
        """Patch the models for this session's kernel (see `ModelPatches.attach`); idempotent."""
        self.patches.attach(self.backend.attn_implementation)

    def detach(self) -> None:
        """Undo the patches (see `ModelPatches.detach`)."""
        self.patches.detach()

    @property
    def attached(self) -> bool:
        return self.patches.attached

    def _route(self, model, kwargs: dict):
        return None if self.router is None else self.router(model, kwargs)

    # ----------------------------------------------------------------------------------------------- layouts
    def with_attention(self, layout: Layout) -> Layout:
        """`layout` with what this session's backend gives the model for it (`Layout.attention`), and whether its
        forward checks it (built once per layout; the layout is returned)."""
        if layout.attention is None and not layout.is_stock:  # stock rows run the model's own call
            layout.check = self._checks_on(layout.input_ids)
            layout.attention = self._backend_of(layout).inputs(layout, self.models[0].config)
        return layout

    def _backend_of(self, layout: Layout) -> AttentionBackend:
        return self.backend if layout.kernel is None else BACKENDS[layout.kernel]

    def layout_like(self, layout: Layout, stock: StockRows) -> Layout:
        """The layout, with its attention inputs, of `stock` rows for the kernel `layout` was laid out for (PEFT's
        virtual tokens before its rows: `virtual.with_virtual`). One host read."""
        built = build_layout(stock, self._backend_of(layout).rows(self.pad_to_multiple_of), self.pad_token_id)
        return self.with_attention(dataclasses.replace(built, kernel=layout.kernel, join=layout.join))

    def prepare(self, inputs: Mapping) -> Layout:
        """Complete the layout a collated batch carries (`inputs["prefix_sharing"]`) for the forward: its attention
        inputs, and for a vision batch its images once per example. Built once per batch, shared by the policy and
        reference passes. Returns the layout."""
        layout = inputs.get("prefix_sharing") if isinstance(inputs, Mapping) else None
        if not isinstance(layout, Layout):
            raise RuntimeError("Prefix sharing is on but the batch has no layout: was the data collator replaced?")
        device = inputs["input_ids"].device
        if layout.input_ids.device != device:  # a batch moved by something other than accelerate's `send_to_device`
            layout = inputs["prefix_sharing"] = layout.to(device)
        self.attach()
        self.with_attention(layout)
        if layout.vision is None and not layout.is_stock and has_vision_inputs(inputs):  # images once per pair
            layout.vision = shared_vision_inputs(self.models[0], inputs, layout)
        return layout

    def layout(self, stock: StockRows, join: str | None = None) -> Layout:
        """The layout, with its attention inputs, of `stock` rows built in the training step (the trie of the rows),
        as `self.tuning` chooses; the session decides whether it checks them (`checks`). On the rows' device; one host
        read. `join`: that join rule's plan on the session's own kernel, whatever `"auto"` would choose (the start-up
        check's layout of rows whose start moves)."""
        self.attach()
        checked = dataclasses.replace(stock, check=self._checks_on(stock.input_ids))
        if join is not None:
            layout = build_layout(checked, self.rows, self.pad_token_id, join=join, cost=self.cost)
        else:
            layout = build_layout(checked, pad_token_id=self.pad_token_id, join=self.join, tuning=self.tuning)
        return self.with_attention(layout)

    def generated_layout(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        score_padding: bool = False,
        source: tuple[torch.Tensor, ...] | None = None,
    ) -> Layout:
        """The layout, with its attention inputs, of generated rows `[left-padded prompt | completion]` (the trie of
        the rows: a prompt's generations, and duplicate prompts', computed once; `score_padding`, and the session's
        `shift`: see `StockRows`).

        Built once per set of rows: it is kept while the tensors the rows were read from live unchanged (`source`,
        default `input_ids` and `attention_mask`; views of one generation batch count as the same rows), so the
        old-policy, reference and training passes over the same rows share one layout and its attention inputs."""
        self.attach()
        source = (input_ids, attention_mask) if source is None else source
        key = (prompt_length, score_padding)
        layout = self._layouts.get(source, key)
        if layout is None:
            checks = self._checks_on(input_ids)
            stock = StockRows.generated(input_ids, attention_mask, prompt_length, score_padding, checks, self.shift)
            layout = build_layout(stock, pad_token_id=self.pad_token_id, join=self.join, tuning=self.tuning)
            self._layouts.put(source, key, self.with_attention(layout))
        return layout

    def _checks_on(self, tensor: torch.Tensor) -> bool:
        return self.checks if self.checks is not None else tensor.device.type == "cpu"


class ModelPatches:
    """The patches a session puts on its models, scoped to those instances and reversible.

    Args:
        models: the models to patch.
        fuse_lm_head: add TRL's fused log-prob head first (see `PrefixSharingSession`).
        autocast: accelerate's autocast, for a forward accelerate already wrapped.
        route: the session's router (see `install_prefix_sharing_forward`).
        tuning: the session's `tuning.Tuning`, whose clock times every training forward of the policy (`use`), or
            None.
    """

    def __init__(self, models, fuse_lm_head, autocast, route, tuning=None):
        self.models = models
        self.fuse_lm_head, self.autocast, self.route = fuse_lm_head, autocast, route
        self.tuning = tuning
        self.attached = False
        self._switch = AttentionSwitch()

    def attach(self, attn_implementation: str) -> None:
        """Patch the models: (TRL's fused log-prob head,) `attn_implementation`, the shared forward. The
        trainer attaches for the length of `train()`, `evaluate()` and `predict()`, and on first use by a direct call
        of a step; idempotent."""
        if self.attached:
            return
        if self.fuse_lm_head:
            from trl.trainer.utils import add_fused_lm_head

            outputs = self.fuse_lm_head if isinstance(self.fuse_lm_head, tuple) else ("log_probs",)
            for model in self.models:
                if not is_patched(model, _UNFUSED):
                    keep_own(model, "forward", _UNFUSED)
                    add_fused_lm_head(model, outputs=outputs)
                    mark_patched(model, "forward", _UNFUSED)
        for model in self.models:
            self._switch.apply(model, attn_implementation)
            install_prefix_sharing_forward(model, autocast=self.autocast, route=self.route, switch=self.use)
        self.attached = True

    def use(self, model, layout: Layout) -> None:
        """Before a call of `model` on `layout`: the attention implementation its rows were laid out for (stock
        rows: the model's own), where the session chooses the kernel per micro-batch (`Layout.kernel`); a training
        forward of the policy starts a step `"auto"` times (`tuning.Tuning.tick`)."""
        if layout.kernel is not None:
            self._switch.use(model, None if layout.is_stock else BACKENDS[layout.kernel].attn_implementation)
        if self.tuning is not None and model is self.models[0] and model.training and torch.is_grad_enabled():
            self.tuning.tick(layout, layout.input_ids.device)  # a training step of the policy starts

    def detach(self) -> None:
        """Undo the patches of `attach`: the models run on their own attention implementation and generate as
        stock. A forward that accelerate has since wrapped in its mixed precision (a model prepared for training)
        stays beneath that wrapper, passing every call without a layout through unchanged (taking it out would drop
        accelerate's wrapper too); every other patch is taken out."""
        for model in self.models:
            if remove_prefix_sharing_forward(model):
                put_back_own(model, "forward", _UNFUSED)
        self._switch.restore()
        self.attached = False
        if self.tuning is not None:
            self.tuning.steps.stop()  # what follows is not a training step


class _LayoutCache:
    """Layouts keyed by the tensors they were built from: the same storage, offset, shape and strides, unchanged
    (tensor version counters), while that storage lives (a weak reference to its base tensor; dropped with it)."""

    def __init__(self):
        self._entries: dict = {}

    @staticmethod
    def _key(tensors, extra) -> tuple:
        bases = [t._base if t._base is not None else t for t in tensors]
        return (
            tuple(
                (id(b), t.storage_offset(), tuple(t.shape), t.stride(), t._version)
                for t, b in zip(tensors, bases, strict=True)
            ),
            extra,
        ), bases

    def get(self, tensors, extra):
        key, bases = self._key(tensors, extra)
        entry = self._entries.get(key)
        if entry is None or any(ref() is not base for ref, base in zip(entry[0], bases, strict=True)):
            return None
        return entry[1]

    def put(self, tensors, extra, layout) -> None:
        key, bases = self._key(tensors, extra)
        self._entries[key] = ([weakref.ref(b) for b in bases], layout)
        for base in bases:
            weakref.finalize(base, self._entries.pop, key, None)
