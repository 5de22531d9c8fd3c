"""Every private TRL (and transformers `Trainer`, accelerate) method, attribute and function this package overrides,
reads or relies on, in one place, checked against the installed versions when a trainer class is created
(`trainers.guard_trainer_class`: each trainer's entry names the groups of `INTERNALS` it depends on).

TRL's trainers have no hooks for a different batch layout, so the trainers here override a few of their methods and
read a few of their attributes. A new TRL release may rename, re-sign or rewrite any of them; this module turns that
into one clear error at import, naming what changed and the versions, instead of a silent wrong number or a traceback
deep in a training step. What is checked, per `Internal`:

- that it exists (an attribute: that its class sets it), and the leading parameters of a method or function;
- `fields`: the field names of a dataclass this package builds (TRL's `FusedCausalLMOutput`);
- `relies_on`: source fragments a TRL method must still contain, where this package depends on how it calls
  something (DPO passing unknown batch keys, such as the layout, to the model; GRPO/RLOO calling
  `shuffle_sequence_dict`; transformers' `Trainer.__init__` asking its `args` for the log level);
- `fingerprint`: a hash of the code of a TRL method whose body this package re-derives or whose order of calls it
  relies on. Those methods, and the tests that pin each against stock TRL:
  - online DPO `_forward` (its truncation and completion columns): `test_forward_scores_every_column_as_stock`;
  - ORPO and CPO `concatenated_forward` (their per-sequence log-probs, logits means and NLL):
    `test_batch_matches_stock` in `tests/equivalence/test_orpo_cpo_equivalence.py`;
  - KTO `_compute_loss` (the KL rows computed before the main rows, which the merged pass fills in):
    `tests/equivalence/test_kto_equivalence.py`;
  - GRPO and RLOO `_get_per_token_logps_and_entropies` (how it calls the model, which the shared-rows proxy answers):
    `test_crafted_batch_log_probs_and_gradients_match_stock`;
  - online DPO `_generate` (its prompts' rendering), whose tokenisation the `stats` command re-derives from TRL's
    public data functions: `test_stats_online_dpo_tokenizes_prompts_as_trl`. For DPO, reward, KTO, ORPO, CPO and SFT
    it builds this package's trainer on a tiny stand-in model (`cli/prepared.py`): TRL's own preparation (and, for
    DPO, reward and SFT, the trainer's own collator), nothing re-derived.

No TRL method body is copied. An override calls TRL's own method (without prefix sharing always, with it wherever
TRL's method has a seam); where it has none (online DPO `_forward`, ORPO and CPO `concatenated_forward`) the override
computes the same outputs from public parts, its fingerprint kept and pinned by the tests above. The GRPO/RLOO shuffle
is replaced by swapping the one function TRL's `_prepare_inputs` calls, for the duration of that call
(`replaced_function`).

Versions: the `trl` requirement moves with each TRL release this package is tested with (`SUPPORTED_TRL`). A TRL
outside it (installed over the requirement, or from source) is checked the same way: refused at import when anything
listed here changed, run with a warning naming the versions when nothing did.
`python -m trl_prefix_sharing.trl_internals` lists every trainer of the table (`trainers.py`) with the internals its
class is checked against, each with its state in the installed TRL and the fingerprints (what a maintainer compares
when moving the requirement).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import re
import textwrap
import warnings
from dataclasses import dataclass

from .trainers import TRAINERS


__all__ = [
    "SUPPORTED_TRL",
    "Internal",
    "INTERNALS",
    "check_trl_internals",
    "fingerprint",
    "import_experimental",
    "resolve",
    "replaced_function",
]

#: the TRL versions this package is measured with (also the `trl` requirement in pyproject.toml)
SUPPORTED_TRL = ">=1.16,<1.17"


@dataclass(frozen=True)
class Internal:
    """One internal we depend on: `owner` (an import path, `module:Class` or `module`), `name`, how we use it
    (`"override"`, `"read"`, `"write"`, `"replace"`: swapped during a call, `"call"`, `"mirror"`: re-derived from
    public parts, its fingerprint kept), for a method or function the
    leading parameters we pass or receive (checked against its signature), and what else is checked (see the module
    docstring)."""

    owner: str
    name: str
    use: str
    parameters: tuple[str, ...] = ()
    attribute: bool = False  # an instance attribute (checked in the source of its class: `self.name = ...`)
    holder: str = "self"  # for an attribute the class sets on another object (e.g. `model.name = ...`): its name there
    fields: tuple[str, ...] = ()  # a dataclass this package builds: field names it must have
    relies_on: tuple[str, ...] = ()  # fragments the method's source must contain (how it calls what we replace)
    fingerprint: str = ""  # the hash of a method body this package re-derives (`fingerprint`)


_DPO, _REWARD, _GRPO, _RLOO, _ONLINE_DPO, _KTO, _ORPO, _CPO, _SFT = (
    TRAINERS[name].trl_trainer for name in ("dpo", "reward", "grpo", "rloo", "online_dpo", "kto", "orpo", "cpo", "sft")
)
_TRAINER = "transformers.trainer:Trainer"
_LOGPS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep")
_PREPARE = ("self", "dataset", "processing_class", "args", "dataset_name")
_CONCATENATED_INIT = ("self", "model", "args", "data_collator", "train_dataset", "eval_dataset", "processing_class")
_GROUP_INIT = ("self", "model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class")
_ONLINE_DPO_INIT = (
    "self",
    "model",
    "ref_model",
    "reward_funcs",
    "args",
    "data_collator",
    "train_dataset",
    "eval_dataset",
    "processing_class",
)
#: how DPO's loss and reference passes call the model: every batch key but these, so the layout reaches it
_DPO_CALL = ("model_kwargs = {k: v for k, v in inputs.items() if k not in _non_model_keys}",)
#: how SFT's loss calls the model: the whole batch, the layout included
_SFT_CALL = ("outputs = model(**inputs, fused_lm_head=True)",)
_FUSED_FIELDS = (
    "loss",
    "aux_loss",
    "log_probs",
    "entropy",
    "log_sum_sq_probs",
    "mean_logits",
    "is_top1",
    "label_mask",
)


def _concatenated_trainer_internals(owner: str, fingerprint_: str) -> tuple[Internal, ...]:
    """What `concatenated.ConcatenatedSharingMixin` uses of TRL's ORPO or CPO trainer class."""
    return (
        Internal(owner, "concatenated_forward", "override", ("self", "model", "batch"), fingerprint=fingerprint_),
        # the constructor's parameters, read by their names (the datasets, `processing_class`, `peft_config`)
        Internal(owner, "__init__", "override", _CONCATENATED_INIT),
        Internal(owner, "log", "override", ("self", "logs", "start_time")),  # `num_shared_tokens`
        Internal(owner, "concatenated_inputs", "call", ("batch", "is_encoder_decoder", "padding_value", "device")),
        Internal(owner, "is_encoder_decoder", "read", attribute=True),
        Internal(owner, "aux_loss_enabled", "read", attribute=True),
    )


def _public_overrides(owner: str, compute_loss: bool = False) -> tuple[Internal, ...]:
    """TRL's own `evaluate` and `log` (and `compute_loss`) of a trainer, which this package's mixins wrap: the
    patches' scope, the logged token counts, the layout's preparation."""
    return (
        Internal(owner, "evaluate", "override", ("self", "eval_dataset")),
        Internal(owner, "log", "override", ("self", "logs", "start_time")),
        *((Internal(owner, "compute_loss", "override", ("self", "model", "inputs")),) if compute_loss else ()),
    )


def _group_trainer_internals(owner: str) -> tuple[Internal, ...]:
    """What `group_sharing.GroupSharingTrainerMixin` uses of TRL's GRPO or RLOO trainer class (`module:Class`)."""
    module = owner.partition(":")[0]
    return (
        Internal(owner, "_get_per_token_logps_and_entropies", "override", _LOGPS, fingerprint="703df12f7c8c4bc8"),
        Internal(
            owner,
            "_prepare_inputs",
            "override",
            ("self", "generation_batch"),
            relies_on=("generation_batch = shuffle_sequence_dict(generation_batch)",),
        ),
        Internal(owner, "__init__", "override", _GROUP_INIT),  # arguments passed on by position
        Internal(owner, "compute_loss", "override", ("self", "model", "inputs")),
        Internal(owner, "log", "override", ("self", "logs", "start_time")),
        Internal(module, "shuffle_sequence_dict", "replace", ("seq_dict",)),
    )


#: trainer -> the internals its module depends on ("common": every trainer module)
INTERNALS: dict[str, tuple[Internal, ...]] = {
    "common": (
        Internal("trl.trainer.utils", "add_fused_lm_head", "call", ("model",)),
        Internal("trl.trainer.utils", "FusedCausalLMOutput", "call", fields=_FUSED_FIELDS),
        # the configs replace `get_process_log_level`, which `Trainer.__init__` calls first with its `args`
        Internal(_TRAINER, "__init__", "call", relies_on=("log_level = args.get_process_log_level()",)),
        # accelerate's mark of a model whose forward `prepare_model` wrapped in mixed precision (`forward.py`)
        Internal("accelerate.accelerator:Accelerator", "_original_forward", "read", attribute=True, holder="model"),
        # `PrefixSharingMixin.end` frees the distributed wrapper before transformers destroys the process group
        Internal(_TRAINER, "end", "override", ("self",)),
        Internal(_TRAINER, "model_wrapped", "write", attribute=True),
    ),
    "dpo": (
        Internal(_DPO, "_precompute_ref_logps", "override", ("self", "dataset", "name", "batch_size")),
        Internal(_DPO, "compute_ref_log_probs", "override", ("self", "model", "inputs"), relies_on=_DPO_CALL),
        Internal(_DPO, "_compute_loss", "call", ("self", "model", "inputs"), relies_on=_DPO_CALL),
        Internal(_DPO, "loss_types", "read", attribute=True),
        *_public_overrides(_DPO, compute_loss=True),
        Internal(_DPO, "_metrics", "write", attribute=True),
    ),
    "reward": (
        Internal(_REWARD, "_prepare_dataset", "override", _PREPARE),
        Internal(_REWARD, "_metrics", "write", attribute=True),
        *_public_overrides(_REWARD),
        Internal(_REWARD, "_total_train_tokens", "write", attribute=True),
        Internal(_REWARD, "compute_loss", "call", ("self", "model", "inputs"), relies_on=("model(**inputs)",)),
        Internal(_TRAINER, "_signature_columns", "write", attribute=True),
        Internal(_REWARD, "_tp_size", "read", attribute=True),
        Internal("trl.data_utils", "_tokenize", "call", ("processing_class",)),
        Internal(_TRAINER, "_set_signature_columns_if_needed", "override", ("self",)),
    ),
    "packing": (  # transformers' Trainer, overridden for the multipack sampler and pair-weighted metrics
        Internal(_TRAINER, "_get_train_sampler", "override", ("self", "train_dataset")),
        Internal(_TRAINER, "_get_eval_sampler", "override", ("self", "eval_dataset")),
        Internal(_TRAINER, "get_batch_samples", "override", ("self", "epoch_iterator", "num_batches", "device")),
        Internal(_TRAINER, "evaluation_loop", "override"),
        Internal(_TRAINER, "prediction_step", "override", ("self", "model", "inputs", "prediction_loss_only")),
        Internal(_TRAINER, "gather_function", "write", attribute=True),
        Internal(_TRAINER, "current_gradient_accumulation_steps", "read", attribute=True),
    ),
    "sft": (
        # TRL's loss calls the model with every batch key, so the layout the collator adds reaches it
        Internal(_SFT, "compute_loss", "override", ("self", "model", "inputs"), relies_on=_SFT_CALL),
        *_public_overrides(_SFT),
        # transformers' Trainer: the sampler `group_by_prompt` orders by prompt
        Internal(_TRAINER, "_get_train_sampler", "override", ("self", "train_dataset")),
    ),
    "grpo": _group_trainer_internals(_GRPO),
    "rloo": _group_trainer_internals(_RLOO),
    "online_dpo": (
        Internal(
            _ONLINE_DPO,
            "_forward",
            "override",
            ("self", "model", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "vision_inputs"),
            fingerprint="78000d9a5e87ab8f",
        ),
        Internal(_ONLINE_DPO, "__init__", "override", _ONLINE_DPO_INIT),  # read by name (datasets, processor)
        Internal(_ONLINE_DPO, "log", "override", ("self", "logs", "start_time")),  # `num_shared_tokens`
        Internal(_ONLINE_DPO, "max_length", "read", attribute=True),
    ),
    "kto": (
        Internal(_KTO, "_compute_kl_logps", "override", ("self", "model", "batch")),
        Internal(_KTO, "compute_ref_log_probs", "override", ("self", "model", "inputs")),
        Internal(_KTO, "compute_loss", "override", ("self", "model", "inputs")),
        Internal(_KTO, "_compute_loss", "call", ("self", "model", "inputs"), fingerprint="1473d73edd955b9c"),
        Internal(_KTO, "calculate_KL", "read", attribute=True),
        *_public_overrides(_KTO),
        Internal(_KTO, "_is_vision_dataset", "read", attribute=True),
    ),
    "orpo": (
        *_concatenated_trainer_internals(_ORPO, "9d61d6c4b4974302"),
        Internal(_ORPO, "padding_value", "read", attribute=True),
    ),
    "cpo": (
        *_concatenated_trainer_internals(_CPO, "614b824c96f1c20a"),
        Internal(_CPO, "pad_token_id", "read", attribute=True),
    ),
    # the `trl-prefix-sharing` command line: TRL's argument splitting, and the dataset preparation `stats` re-derives
    # from TRL's public data functions for the trainers it builds no trainer of
    "cli": (Internal("trl.cli.commands.training", "_subtract_subsequence", "call"),),
    "stats": (
        Internal(_ONLINE_DPO, "_generate", "mirror", fingerprint="444dab2a5d9401b8"),  # how it renders prompts
    ),
}


def resolve(owner: str):
    """The object an import path names: `module:Class`, `module:Class.attribute`, or `module`."""
    module_name, _, qualname = owner.partition(":")
    target = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        target = getattr(target, part)
    return target


@functools.cache
def _class_source(owner: type) -> str:
    """A class's source, read once (transformers' `Trainer` is thousands of lines, and several internals name it)."""
    return inspect.getsource(owner)


def fingerprint(function) -> str:
    """A hash of a function's code: its source lines stripped, without blank lines, whole-line comments and the
    docstring (a change of formatting or comments keeps it; a change of code does not). The same on every Python."""
    return source_fingerprint(inspect.getsource(function))


def source_fingerprint(source: str) -> str:
    """`fingerprint` of a function's source text."""
    source = textwrap.dedent(source)
    lines = source.splitlines()
    try:
        body = ast.parse(source).body
    except SyntaxError:  # not a whole statement (a lambda within a line): every line counts
        body = []
    node = body[0] if body else None
    first = node.body[0] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        del lines[first.lineno - 1 : first.end_lineno]
    code = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


def _code_problem(internal: Internal, target) -> str | None:
    """What changed in the code of a method this package relies on (`relies_on`, `fingerprint`)."""
    where = f"{internal.owner}.{internal.name}"
    if internal.relies_on:
        source = inspect.getsource(target)
        missing = [fragment for fragment in internal.relies_on if fragment not in source]
        if missing:
            return f"{where} no longer contains `{missing[0]}`"
    if internal.fingerprint:
        installed = fingerprint(target)
        if installed != internal.fingerprint:
            return f"{where} has new code (fingerprint {installed}, measured {internal.fingerprint})"
    return None


def _problem(internal: Internal) -> str | None:
    """What no longer matches for one internal (None: it matches)."""
    try:
        owner = resolve(internal.owner)
    except (ImportError, AttributeError) as error:
        return f"{internal.owner} cannot be imported ({error})"
    if internal.attribute:
        source = _class_source(owner) if inspect.isclass(owner) else ""
        assignment = rf"\b{internal.holder}\.{internal.name}\s*(\[[^]]*\]\s*)?[+]?="
        if hasattr(owner, internal.name) or re.search(assignment, source):
            return None
        return f"{internal.owner} no longer sets `{internal.holder}.{internal.name}`"
    target = getattr(owner, internal.name, None)
    if target is None:
        return f"{internal.owner} has no `{internal.name}`"
    if internal.fields:
        names = {field.name for field in dataclasses.fields(target)}
        missing = [name for name in internal.fields if name not in names]
        if missing:
            return f"{internal.owner}.{internal.name} has no field `{missing[0]}`"
    if internal.parameters:
        try:
            names = tuple(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            return None  # not introspectable (a C function): nothing to compare
        if names[: len(internal.parameters)] != internal.parameters:
            return (
                f"{internal.owner}.{internal.name} takes ({', '.join(names)}), not "
                f"({', '.join(internal.parameters)}, ...)"
            )
    return _code_problem(internal, target)


@functools.cache
def check_trl_internals(*trainers: str) -> None:
    """Check the internals of these trainers (keys of `INTERNALS`, "common" always) against the installed TRL and
    transformers; one error listing every mismatch. A TRL outside `SUPPORTED_TRL` whose internals all match runs, with
    a warning naming the versions."""
    import transformers
    import trl
    from packaging.specifiers import SpecifierSet

    problems = [
        problem
        for key in ("common", *trainers)
        for internal in INTERNALS[key]
        if (problem := _problem(internal)) is not None
    ]
    versions = f"installed: trl {trl.__version__}, transformers {transformers.__version__}"
    if problems:
        raise ImportError(
            f"trl_prefix_sharing is tested with trl{SUPPORTED_TRL} ({versions}); the TRL internals it builds on have "
            "changed:\n- "
            + "\n- ".join(problems)
            + f"\nInstall a supported TRL (`pip install 'trl{SUPPORTED_TRL}'`), or a release of trl-prefix-sharing "
            "that supports this one, or use TRL's trainers without prefix sharing."
        )
    if not SpecifierSet(SUPPORTED_TRL).contains(trl.__version__, prereleases=True) and not _warned:
        _warned.append(True)
        warnings.warn(
            f"trl_prefix_sharing is tested with trl{SUPPORTED_TRL} ({versions}). Every TRL internal it builds on, and "
            "the code of every TRL method whose steps it re-derives, is unchanged in this TRL, so it runs; numbers "
            "have not been compared with stock TRL at this version.",
            UserWarning,
            stacklevel=2,
        )


_warned: list[bool] = []


def import_experimental(name: str, trainer: str):
    """`trl.experimental.<name>`, or an error that says what is missing and the way out: TRL removes experimental
    trainers without a deprecation cycle, and only the module of that trainer fails to import, not this package."""
    try:
        return importlib.import_module(f"trl.experimental.{name}")
    except ImportError as error:
        import trl

        raise ImportError(
            f"trl_prefix_sharing.{trainer} builds on TRL's experimental `trl.experimental.{name}`, which the "
            f"installed trl {trl.__version__} does not provide ({error}). It is supported with trl{SUPPORTED_TRL}: "
            f"install it (`pip install 'trl{SUPPORTED_TRL}'`), or train with a TRL trainer without prefix sharing. "
            "The other trainers of this package are unaffected."
        ) from error


@contextlib.contextmanager
def replaced_function(module_name: str, name: str, replacement):
    """Within the block, `module_name.name` is `replacement` (for the code of that module that calls it by name);
    restored on exit, whatever happens. Scoped to one call of a TRL method: nothing else sees it afterwards."""
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield original
    finally:
        setattr(module, name, original)


def _described(internal: Internal) -> str:
    """One internal on one line: how it is used, where, and whether the installed TRL still matches it."""
    owner = internal.owner.rpartition(":")[2] or internal.owner
    where = f"{internal.holder}.{internal.name}" if internal.attribute and internal.holder != "self" else internal.name
    problem = _problem(internal)
    state = "matches" if problem is None else f"CHANGED: {problem}"
    if internal.fingerprint and problem is None:
        state += f" (fingerprint {internal.fingerprint})"
    return f"  {internal.use:<8} {owner}.{where}: {state}"


def report() -> str:
    """What `python -m trl_prefix_sharing.trl_internals` prints: every trainer of the table with the internals its
    class is checked against at creation (the common ones once, first), then the command line's, each with its state
    in the installed TRL."""
    import transformers
    import trl

    lines = [f"trl {trl.__version__}, transformers {transformers.__version__} (supported: trl{SUPPORTED_TRL})"]
    lines += ["every trainer:", *map(_described, INTERNALS["common"])]
    for spec in TRAINERS.values():
        lines.append(f"{spec.name}: {spec.trainer_class} over {spec.trl_trainer} (checks {', '.join(spec.guards)}):")
        lines += [_described(internal) for key in spec.guards for internal in INTERNALS[key]]
    for key in ("cli", "stats"):
        lines += [f"the command line ({key}):", *map(_described, INTERNALS[key])]
    return "\n".join(lines)


if __name__ == "__main__":  # every trainer's guarded internals, checked against the installed TRL
    print(report())  # noqa: T201
