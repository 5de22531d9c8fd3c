"""`KTOTrainer`: TRL's KTO trainer, computing each example's prompt once for its main and KL rows
(`args.prefix_sharing`).

Stock KTO runs every prompt twice per model: in its main row `[prompt | completion]` and in its KL row `[prompt |
the completion of the example before it]` (TRL rotates the completions within each `per_device_train_batch_size`
chunk of the dataset, which is why KTO trains in sequential order). With prefix sharing:

- the **reference** pass (in the training step, and TRL's `precompute_ref_log_probs`) and every pass without gradients
  (evaluation) run the main and KL rows of a micro-batch as one trie, both completions after one copy of the prompt:
  `(2P + 2C) / (P + 2C)` fewer positions;
- the **policy** pass either does the same inside its gradient pass (the KL rows then go through backward too, without
  contributing a gradient: worth it when prompts are long) or runs the KL rows and the main rows apart, each as its own
  trie (duplicate prompts shared). `prefix_sharing_merge_kl` chooses; by default each batch is merged when its prompt
  tokens exceed twice its KL completion tokens (measured in `docs/benchmarks/paired_cpu.md`).

The layouts are exact only within stock's own micro-batches, which is what they are built on: no regrouping and no
packing (the KL rows and the `kl` batch statistic depend on which examples share a micro-batch).

TRL's `_compute_loss` calls its models without a layout; the trainer routes each fused call by the stock tensor it
holds (`PrefixSharingSession.router`): the main rows' `input_ids` or the KL rows'. A merged pass is run by the first
of the two calls and the other one gets its part of the result: the main call of the training step fills in the KL
log-probs that TRL's `_compute_kl_logps` (overridden here) returned as a placeholder; in TRL's `compute_ref_log_probs`
the main call runs first and the KL call gets its stored result.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import trl

from .config import _SHARING_DOC, PrefixSharingArguments
from .forward import prefix_sharing_forward, unwrap_model
from .layout import Layout
from .sharing import PrefixSharingMixin
from .trie import StockRows, prompt_lengths_from_completion_mask


__all__ = ["KTOConfig", "KTOTrainer"]


#: the auto rule: merge the policy's KL rows into its gradient pass when the batch's prompt tokens exceed this many
#: times its KL completion tokens (merging saves a forward over the prompts and costs a backward over the KL
#: completions, about twice a forward)
MERGE_PROMPT_RATIO = 2.0


@dataclass
class KTOConfig(trl.KTOConfig, PrefixSharingArguments):
    __doc__ = (
        "Configuration class for [`trl_prefix_sharing.KTOTrainer`]: every parameter of [`trl.KTOConfig`], plus the "
        "ones below. With `prefix_sharing=False` training is exactly TRL's.\n"
        + _SHARING_DOC
        + """    prefix_sharing_merge_kl (`bool` or `None`, *optional*, defaults to `None`):
        Whether the policy's gradient pass also computes the KL rows (each example's prompt computed once for both;
        the KL completions then go through backward without contributing a gradient), instead of a separate pass
        without gradients. `None`: per batch, when its prompt tokens exceed twice its KL completion tokens (one host
        read per step). Passes without gradients (the reference, evaluation) always merge. The numbers are the same
        either way.
"""
    )

    prefix_sharing_merge_kl: bool | None = field(
        default=None,
        metadata={
            "help": "Compute the policy's KL rows in its gradient pass, after the same prompts (True), in a separate "
            "pass without gradients (False), or per batch when prompts outweigh twice the KL completions (None)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self._check_prefix_sharing_arguments()


class _Rows:
    """Stock rows of a KTO batch: `input_ids`, `attention_mask` and `completion_mask` (right-padded)."""

    def __init__(self, input_ids, attention_mask, completion_mask):
        self.input_ids, self.attention_mask, self.completion_mask = input_ids, attention_mask, completion_mask

    def holds(self, input_ids) -> bool:
        """Whether a model call's `input_ids` are these rows: the same tensor, or, on the CPU, a copy of it (TRL moves
        the batch to `accelerator.device`, and a CPU tensor moved to `cpu:0` under several processes is a copy; on an
        accelerator the batch is there already and moves as itself, so no comparison reads back from the device)."""
        if input_ids is self.input_ids:
            return True
        return (
            isinstance(input_ids, torch.Tensor)
            and input_ids.device.type == "cpu" == self.input_ids.device.type
            and input_ids.shape == self.input_ids.shape
            and torch.equal(input_ids, self.input_ids)
        )

    @property
    def labels(self) -> torch.Tensor:
        return self.input_ids.masked_fill(self.completion_mask == 0, -100)  # TRL's completion labels

    def padded(self, width: int, pad_token_id: int) -> _Rows:
        extra = width - self.input_ids.shape[1]
        return _Rows(
            F.pad(self.input_ids, (0, extra), value=pad_token_id),
            F.pad(self.attention_mask, (0, extra)),
            F.pad(self.completion_mask, (0, extra)),
        )


class _SharedKTOBatch:
    """One batch's main and KL rows, their layouts (built on first use, shared by the policy and reference passes),
    and the results a merged pass leaves for the other call of the pair (keyed by the model that ran it)."""

    def __init__(self, sharing, batch: dict, stash_kl: bool):
        self.sharing_session = sharing
        self.main = _Rows(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        self.kl = None
        if "KL_input_ids" in batch:
            self.kl = _Rows(batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
        self.stash_kl = stash_kl  # a main call without gradients runs both (TRL's `compute_ref_log_probs`)
        self._layouts: dict = {}
        self.policy_merged = False  # whether the policy's gradient pass ran the KL rows with the main rows
        self.pending: dict = {}  # model -> placeholder KL log-probs the next main call fills in
        self.answers: dict = {}  # model -> KL output of a merged pass, for the next KL call

    def _layout(self, name: str) -> Layout:
        if name not in self._layouts:
            if name == "merged":
                rows, examples = self.merged_rows(), torch.arange(self.main.input_ids.shape[0]).repeat(2)
                examples = examples.to(rows.input_ids.device)
            else:
                rows, examples = getattr(self, name), None
            prompts = prompt_lengths_from_completion_mask(rows.attention_mask, rows.completion_mask)
            stock = StockRows(rows.input_ids, rows.attention_mask, prompt_lengths=prompts, examples=examples)
            self._layouts[name] = self.sharing_session.layout(stock)
        return self._layouts[name]

    def merged_rows(self) -> _Rows:
        """Main rows then KL rows, right-padded to one width: row i and row B + i are example i."""
        if "merged_rows" not in self._layouts:
            width = max(self.main.input_ids.shape[1], self.kl.input_ids.shape[1])
            main, kl = (rows.padded(width, self.sharing_session.pad_token_id) for rows in (self.main, self.kl))
            self._layouts["merged_rows"] = _Rows(
                *(
                    torch.cat(pair)
                    for pair in zip(
                        (main.input_ids, main.attention_mask, main.completion_mask),
                        (kl.input_ids, kl.attention_mask, kl.completion_mask),
                        strict=True,
                    )
                )
            )
        return self._layouts["merged_rows"]

    def policy_positions(self, calculate_kl: bool) -> tuple:
        """What the policy's gradient pass computed (its layouts) and the attention masks of the stock rows it stands
        for (the main rows, and the KL rows when the KL term is computed)."""
        if not (calculate_kl and self.kl is not None):
            return self._layout("main"), self.main.attention_mask
        names = ("merged",) if self.policy_merged else ("main", "kl")
        return [self._layout(name) for name in names], self.main.attention_mask, self.kl.attention_mask

    def route(self, model, kwargs: dict):
        """The layout of a fused call's rows, or its part of a merged pass (see the module docstring)."""
        input_ids = kwargs.get("input_ids")
        if self.main.holds(input_ids):
            if model in self.pending:
                return self._merged(model, kwargs, fill=self.pending.pop(model))
            if self.kl is not None and self.stash_kl and not torch.is_grad_enabled():
                return self._merged(model, kwargs, fill=None)
            return self._layout("main")
        if self.kl is not None and self.kl.holds(input_ids):
            answer = self.answers.pop(model, None)
            return answer if answer is not None else self._layout("kl")
        return None  # rows this batch does not hold: stock

    def defer_kl(self, model) -> torch.Tensor:
        """A placeholder for the KL log-probs of `model`, filled in by its next main call (a merged pass)."""
        placeholder = torch.zeros(self.kl.input_ids.shape[0], device=self.kl.input_ids.device)
        self.pending[model] = placeholder
        return placeholder

    def _merged(self, model, kwargs: dict, fill: torch.Tensor | None):
        """Main and KL rows in one pass (with gradients if the main call has them); the main part returned, the KL
        part's log-prob sums written to `fill` or kept for the next KL call."""
        from trl.trainer.utils import FusedCausalLMOutput

        rows = self.merged_rows()
        kwargs = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "labels")}
        # called from inside the model's own forward: the shared forward beneath accelerate's autocast wrapper (the
        # outer call already runs in it, and re-entering its one autocast object would leave autocast on)
        outputs = prefix_sharing_forward(model)(
            input_ids=rows.input_ids,
            attention_mask=rows.attention_mask,
            labels=rows.labels,
            prefix_sharing=self._layout("merged"),
            **kwargs,
        )
        num = self.main.input_ids.shape[0]
        main_columns, kl_columns = self.main.input_ids.shape[1] - 1, self.kl.input_ids.shape[1] - 1

        def part(value, rows_slice, columns):
            return None if value is None else value[rows_slice, :columns]

        fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
        main = {name: part(getattr(outputs, name), slice(None, num), main_columns) for name in fields}
        kl = {name: part(getattr(outputs, name), slice(num, None), kl_columns) for name in fields}
        if fill is not None:
            fill.copy_(kl["log_probs"].detach().sum(-1))
        else:
            self.answers[model] = FusedCausalLMOutput(**kl)
        count = main["label_mask"].sum().clamp(min=1)
        return FusedCausalLMOutput(loss=-main["log_probs"].sum() / count, aux_loss=outputs.aux_loss, **main)


class KTOTrainer(PrefixSharingMixin, trl.KTOTrainer):
    """TRL's [`trl.KTOTrainer`], computing each prompt once for its main and KL rows when `args.prefix_sharing=True`
    (see the module docstring). Takes exactly the arguments of [`trl.KTOTrainer`]; the policy and reference log-probs,
    the `kl` term, the loss (`loss_type` `"kto"` and `"apo_zero_unpaired"`), the gradients and every logged metric
    equal stock TRL's to float precision. Text data (plain or conversational)."""

    _config_class = KTOConfig
    _resumes_shared_positions = False  # as TRL's KTO trainer restarts `num_tokens`

    def __init__(
        self,
        model,
        ref_model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
    ):
        self._init_prefix_sharing(
            model, args, processing_class, peft_config, datasets={"train": train_dataset, "eval": eval_dataset}
        )
        self._shared_batch = None
        super().__init__(
            model=model,
            ref_model=ref_model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self._finish_prefix_sharing_init()

    @contextlib.contextmanager
    def _routing(self, inputs, stash_kl: bool = False):
        """Within the block, the models' fused calls on this batch's rows run on its layouts."""
        if self.sharing_session is None:
            yield
            return
        if self._is_vision_dataset:
            raise ValueError("Prefix sharing for KTO is text-only; train vision data with `prefix_sharing=False`.")
        attention_mask = inputs["attention_mask"]
        self._startup_check(
            inputs["input_ids"],
            attention_mask,
            prompt_lengths=lambda: prompt_lengths_from_completion_mask(attention_mask, inputs["completion_mask"]),
        )
        self.sharing_session.attach()  # the routed calls reach the models through the shared forward
        self._shared_batch = shared = _SharedKTOBatch(self.sharing_session, inputs, stash_kl)
        self.sharing_session.router = self._route
        try:
            yield
        finally:
            self.sharing_session.router = None
            self._shared_batch = None
        if shared.pending:  # a deferred KL pass that no main call ran: never train on its placeholder
            raise RuntimeError(
                "Prefix sharing for KTO deferred the KL rows' log-probs to the main rows' pass, but no model call of "
                "this step held the batch's main rows, so they were never computed. Train with "
                "`prefix_sharing=False`, and report this with your TRL and transformers versions."
            )

    def _route(self, model, kwargs):
        return None if self._shared_batch is None else self._shared_batch.route(unwrap_model(model), kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self._routing(inputs):
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if self._shared_batch is not None and self.model.training:
                self.shared_positions.count(*self._shared_batch.policy_positions(self.calculate_KL))
        return result

    def compute_ref_log_probs(self, model, inputs):
        self._setup_prefix_sharing()  # TRL precomputes from inside `__init__`
        with self._routing(inputs, stash_kl=True):
            return super().compute_ref_log_probs(model, inputs)

    def _compute_kl_logps(self, model, batch):
        shared = self._shared_batch
        if shared is None or not self.calculate_KL:
            return super()._compute_kl_logps(model, batch)
        merge = self._merge_kl(shared)
        if torch.is_grad_enabled():
            shared.policy_merged = merge
        if not merge:
            return super()._compute_kl_logps(model, batch)  # routed to the KL rows' own layout
        return shared.defer_kl(unwrap_model(model))

    def _merge_kl(self, shared: _SharedKTOBatch) -> bool:
        """Whether this KL pass rides along the next main call: always without gradients (the reference, evaluation);
        for the policy's gradient pass, `prefix_sharing_merge_kl` (None: prompts outweigh twice the KL completions;
        never when the main call returns a router loss, which covers its own rows only)."""
        if not torch.is_grad_enabled():
            return True
        if self.aux_loss_enabled:
            return False
        choice = self.args.prefix_sharing_merge_kl
        if choice is not None:
            return choice
        prompt = (shared.main.attention_mask.bool() & (shared.main.completion_mask == 0)).sum()
        completion = shared.kl.completion_mask.sum()
        prompt, completion = torch.stack([prompt, completion]).tolist()
        return prompt > MERGE_PROMPT_RATIO * completion
