"""Measure which architectures give stock TRL's numbers under prefix sharing; regenerate the registry and its table.

For every model type (default: every causal LM transformers knows), each variant of its tiny config (default, and
where the config has them: a sliding window of 6 positions, the router's auxiliary loss), one DPO step and, where
transformers has a sequence-classification head, one reward step, against stock TRL from identical weights, fp32, on
trl_prefix_sharing/testing/equivalence.py's awkward data. Outcomes: ``equal``, ``differs`` (loss, log-probs, metrics or
gradients), ``error`` (prefix sharing raised), ``stock fails`` (stock TRL itself raised).

    PYTHONPATH=$PWD python scripts/sweep_architectures.py --write            # everything (~10 min on 2 cores)
    PYTHONPATH=$PWD python scripts/sweep_architectures.py gemma2 phi3 --write # re-measure some, keep the rest

    PYTHONPATH=$PWD python scripts/sweep_architectures.py --varlen --write   # the varlen kernel (~15 min on 2 cores)
    PYTHONPATH=$PWD python scripts/sweep_architectures.py --shift --write    # moved positions (~2 min on 2 cores)

``--varlen`` measures the supported families again with `prefix_sharing_attn_implementation="varlen"` (on the CPU
its reference implementation: the same stream, gather and segments as the CUDA kernel), their default and sliding
window variants, and records the variants equal there as each entry's ``varlen`` (what the varlen backend reads: a
type not measured equal on it runs on another kernel); the rest of the registry is kept.

``--shift`` measures whether each supported family gives stock's numbers when a left-padded prompt's tokens move to
other positions (`trl_prefix_sharing/testing/shift.py`: the start-up check's shifted run, prompts of unequal lengths
that start alike, float32), and records it as each entry's ``shift`` (what `architectures.shift_invariant` reads: GRPO,
RLOO and online DPO then share a start across prompts of any length) with the measured difference.

``--write`` updates trl_prefix_sharing/data/architectures.json (what `check_supported_model` reads) and the generated
section of docs/architectures.md; ``--docs-only`` measures nothing, re-applies the reasons of `REFUSED` to the
registry and regenerates that section. ``--timeout S`` bounds each variant (default 600 s); a tiny config over 200M
parameters or one no model can be built from is recorded as ``no tiny config`` (not measured), never run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys
import tempfile
import time


ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
REGISTRY = ROOT / "trl_prefix_sharing" / "data" / "architectures.json"
DOCS = ROOT / "docs" / "architectures.md"
BEGIN, END = "<!-- architectures: begin (scripts/sweep_architectures.py) -->", "<!-- architectures: end -->"
TIMEOUT_S = 600  # per variant (default of `--timeout`): the largest tiny models take minutes on 2 cores
MAX_PARAMETERS = 200_000_000  # a "tiny" config above this missed its family's sizes (and could exhaust the memory)


class _Timeout(Exception):
    pass


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:200]


def _run(stock_fn, shared_fn, compare_fn) -> str:
    results = []
    for failure, fn in (("stock fails", stock_fn), ("error", shared_fn)):
        try:
            results.append(fn())
        except _Timeout:
            raise
        except Exception as error:  # noqa: BLE001 - recorded
            return f"{failure}: {_short(error)}"
    try:
        compare_fn(*results)
    except AssertionError as error:
        return f"differs: {_short(error).splitlines()[0]}"
    return "equal"


def measure(family: str, tokenizer, dataset, timeout_s: int = TIMEOUT_S, ours=None, only=None) -> dict:
    """{variant: {"dpo": outcome, "reward": outcome or None}} for one model type; `timeout_s` per variant. `ours`: our
    config's fields (default prefix sharing on, the default kernel); `only`: the variants to measure (default all)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    from trl_prefix_sharing.architectures import variant_configs, window_layout
    from trl_prefix_sharing.testing import equivalence as eq
    from trl_prefix_sharing.testing import make_config

    has_head = family in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    try:
        config = make_config(family, len(tokenizer))
        variants = variant_configs(config.get_text_config())  # a multimodal config's options are its text part's
    except Exception as error:  # noqa: BLE001 - recorded
        return {"default": {"dpo": f"no tiny config: {_short(error)}", "reward": None}}
    parameters = _count_parameters(config)
    if parameters is not None and parameters > MAX_PARAMETERS:
        return {
            "default": {"dpo": f"no tiny config: {parameters:,} parameters (over {MAX_PARAMETERS:,})", "reward": None}
        }
    tmp = pathlib.Path(tempfile.mkdtemp())
    results = {}
    for name in variants:
        if only is not None and name not in only:
            continue
        overrides = eq.family_config_kwargs(family, name)
        result = {}
        signal.alarm(timeout_s)
        try:
            stock, shared = eq.make_trainers(tmp, family, dataset, tokenizer, config_kwargs=overrides, ours=ours)
            examples = list(stock.train_dataset)
            result["dpo"] = _run(  # each function runs inside this iteration: no late binding
                lambda: eq.step(stock, examples),  # noqa: B023
                lambda: eq.step(shared, examples),  # noqa: B023
                lambda a, b: eq.assert_same_step(a, b),
            )
            if has_head and name != "router_aux_loss":  # the reward trainer has no auxiliary loss
                stock, shared = eq.make_reward_trainers(
                    tmp, family, dataset, tokenizer, config_kwargs=overrides, ours=ours
                )
                examples = list(stock.train_dataset)
                result["reward"] = _run(
                    lambda: eq.reward_step(stock, examples),  # noqa: B023
                    lambda: eq.reward_step(shared, examples),  # noqa: B023
                    lambda a, b: eq.assert_same_reward_step(a, b),
                )
        except _Timeout:
            result.setdefault("dpo", f"error: over {timeout_s} s")
        except Exception as error:  # noqa: BLE001 - building the trainers failed
            result.setdefault("dpo", _build_failure(family, len(tokenizer), overrides, error))
        finally:
            signal.alarm(0)
        config_overrides = {k: v for k, v in overrides.items() if k != "attn_implementation"}
        if (
            name == "sliding_window"
            and result.get("dpo") == "equal"
            and window_layout(make_config(family, len(tokenizer), **config_overrides))[0] is None
        ):
            result = {"dpo": "not applicable: the config's layer types slide nowhere"}
        results[name] = result
    return results


def _build_failure(family: str, vocab_size: int, overrides: dict, error: BaseException) -> str:
    """The outcome of a variant whose trainers could not be built: ``no tiny config`` when the model itself cannot be
    built from the tiny config (a missing dependency, an inconsistent config), else ``error`` (a trainer raised)."""
    from trl_prefix_sharing.testing import make_model

    try:
        make_model(family, vocab_size, **overrides)
    except Exception as model_error:  # noqa: BLE001 - recorded
        return f"no tiny config: {_short(model_error)}"
    return f"error: {_short(error)}"


def _count_parameters(config) -> int | None:
    """The parameters of the causal LM `config` builds, counted on the meta device (nothing allocated); None if it
    cannot be built there."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - the real build reports it
        return None
    return sum(p.numel() for p in model.parameters())


def summarise(family: str, results: dict, tokenizer) -> tuple[str, dict]:
    """("supported" | "refused", registry entry)."""
    from trl_prefix_sharing.architectures import REFUSED
    from trl_prefix_sharing.testing import make_config

    default = results["default"]
    equal = [name for name, r in results.items() if r.get("dpo") == "equal" and r.get("reward") in (None, "equal")]
    if family not in REFUSED and "default" in equal:
        entry = {"variants": equal, "reward": "reward" in default}
        try:
            config = make_config(family, len(tokenizer))
            model_class = _causal_lm_class(config)
            entry["attention"] = ("sdpa" if model_class._supports_sdpa else "eager") + (
                ", flex" if model_class._supports_flex_attn else ""
            )
            entry["moe"] = hasattr(config.get_text_config(), "output_router_logits")
        except Exception:  # noqa: BLE001 - notes only
            pass
        entry["failed_variants"] = {
            name: r for name, r in results.items() if name not in equal and not r["dpo"].startswith("not applicable")
        }
        return "supported", entry
    return "refused", {"reason": REFUSED.get(family) or _measured_reason(results), "measured": results}


def _measured_reason(results: dict) -> str:
    """The reason of a family refused by measurement alone: what its default variant did, in one line (the error text
    stays in the entry's ``measured``)."""
    default = results["default"]
    kind, outcome = next(
        (kind, o) for kind, o in (("DPO", default.get("dpo")), ("reward", default.get("reward"))) if o and o != "equal"
    )
    if outcome.startswith("differs"):
        return f"measured: the prefix-shared {kind} step differs from stock"
    if outcome.startswith("stock fails"):
        return f"stock TRL itself fails on the measured tiny model (the {kind} step)"
    if "over" in outcome and outcome.endswith(" s"):
        return "not measured: the tiny model ran over the sweep's time limit"
    if outcome.startswith("no tiny config"):
        return "not measured: no tiny config could be built"
    return f"measured: prefix sharing raised in the {kind} step"


def _causal_lm_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _varlen_note(entry: dict) -> str:
    """The varlen kernel in the table's attention column: measured equal on every variant, or without a window."""
    measured = set(entry.get("varlen", ()))
    if "default" not in measured:
        return ""
    return (
        ", varlen"
        if "sliding_window" in measured or "sliding_window" not in entry["variants"]
        else (", varlen (no window)")
    )


def _shift_note(entry: dict) -> str:
    """Whether a left-padded prompt's tokens may move (`--shift`): GRPO, RLOO and online DPO then share a start across
    prompts of any length."""
    if "shift" not in entry:
        return "not measured"
    return "equal" if entry["shift"] else "differ (" + entry["shift_measured"].split(" in ")[0] + ")"


def docs_table(registry: dict) -> str:
    """The generated section of docs/architectures.md: the supported model types with their measured options, then
    the refused ones grouped by reason."""
    from trl_prefix_sharing.architectures import variant_configs
    from trl_prefix_sharing.testing import make_config

    def option(entry, config, name):
        if name in entry["variants"]:
            return "yes (" + ", ".join(f"`{key}`" for key in variant_configs(config.get_text_config())[name]) + ")"
        failed = entry.get("failed_variants", {}).get(name)
        if failed is None:
            return "-"
        outcome = next(o for o in failed.values() if o and o != "equal")
        return "refused (measured: " + outcome.split(":")[0] + ")"

    lines = [
        BEGIN,
        "",
        "| Model type | Sliding window | Router aux loss (MoE) | Reward head | Attention | Moved positions |",
        "|---|---|---|---|---|---|",
    ]
    for family, entry in sorted(registry["supported"].items()):
        config = make_config(family, 8)
        attention = entry.get("attention", "") + _varlen_note(entry)
        lines.append(
            f"| `{family}` | {option(entry, config, 'sliding_window')} | "
            f"{option(entry, config, 'router_aux_loss')} | {'yes' if entry['reward'] else 'none in transformers'} "
            f"| {attention} | {_shift_note(entry)} |"
        )
    lines += ["", "Refused (the error names the reason):", "", "| Model types | Reason |", "|---|---|"]
    by_reason = {}
    for family, entry in sorted(registry["refused"].items()):
        by_reason.setdefault(entry["reason"], []).append(f"`{family}`")
    for reason, families in sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[1])):
        lines.append(f"| {', '.join(families)} | {reason.replace('|', '/')} |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="model types (default: every causal LM transformers knows)")
    parser.add_argument(
        "--write", action="store_true", help="update the registry JSON and the table of docs/architectures.md"
    )
    parser.add_argument(
        "--registry", type=pathlib.Path, default=REGISTRY, help="the registry JSON to update (default: the package's)"
    )
    parser.add_argument(
        "--timeout", type=int, default=TIMEOUT_S, help=f"seconds per variant (default {TIMEOUT_S})", metavar="S"
    )
    parser.add_argument(
        "--measure-refused",
        action="store_true",
        help="measure the families `REFUSED` names too (default: record their reason only)",
    )
    parser.add_argument(
        "--varlen",
        action="store_true",
        help="measure the supported families (or those given) on the varlen kernel; record the variants equal there",
    )
    parser.add_argument(
        "--shift",
        action="store_true",
        help="measure the supported families (or those given) with a prompt's tokens at moved positions",
    )
    parser.add_argument(
        "--docs-only",
        action="store_true",
        help="measure nothing: re-apply the reasons of `REFUSED` and regenerate the table of docs/architectures.md",
    )
    args = parser.parse_args()
    if args.docs_only:
        _write_docs(_write_registry(json.loads(args.registry.read_text()), args.registry))
        return

    import conftest  # noqa: F401  - the tests' environment (quiet, 2 threads)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import trl_prefix_sharing.support as sharing_module
    from trl_prefix_sharing.architectures import REFUSED
    from trl_prefix_sharing.testing import make_tokenizer
    from trl_prefix_sharing.testing.equivalence import awkward_text_dataset

    sharing_module.check_supported_model = lambda config: None  # measure every candidate, refused ones included
    tokenizer, dataset = make_tokenizer(), awkward_text_dataset()
    families = args.families or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    registry = json.loads(args.registry.read_text()) if args.registry.exists() else {"supported": {}, "refused": {}}

    def alarm(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, alarm)
    if args.varlen:
        _measure_varlen(args, registry, tokenizer, dataset)
        return
    if args.shift:
        _measure_shift(args, registry, tokenizer)
        return
    for family in families:
        start = time.time()
        if family in REFUSED and not args.measure_refused:
            results = {"default": {"dpo": "not measured: refused for the reason given"}}
        else:
            results = measure(family, tokenizer, dataset, args.timeout)
        status, entry = summarise(family, results, tokenizer)
        previous = registry["supported"].get(family, {})
        if status == "supported":  # the varlen measurement is its own pass (`--varlen`): kept
            kept = ("varlen", "varlen_failed", "shift", "shift_measured")
            entry.update({key: previous[key] for key in kept if key in previous})
        for table in ("supported", "refused"):
            registry[table].pop(family, None)
        registry[status][family] = entry
        if args.write:
            _write_registry(registry, args.registry)
        print(
            json.dumps(
                {
                    "family": family,
                    "status": status,
                    "seconds": round(time.time() - start, 1),
                    **({"variants": entry["variants"]} if status == "supported" else {"reason": entry["reason"]}),
                }
            ),
            flush=True,
        )
    if args.write:
        _write_docs(_write_registry(registry, args.registry))


def _measure_varlen(args, registry: dict, tokenizer, dataset) -> None:
    """`--varlen`: each supported family's default and sliding-window variants on the varlen kernel; the variants equal
    there become the entry's `varlen`, the others its `varlen_failed`."""
    import trl_prefix_sharing.attention as attention_module

    attention_module.varlen_unmeasured = lambda config: None  # measure every supported family, not only the listed
    ours = {"prefix_sharing": True, "prefix_sharing_attn_implementation": "varlen"}
    for family in args.families or list(registry["supported"]):
        entry = registry["supported"].get(family)
        if entry is None:
            print(json.dumps({"family": family, "status": "not supported: not measured on varlen"}), flush=True)
            continue
        start = time.time()
        measured = [name for name in ("default", "sliding_window") if name in entry["variants"]]
        results = measure(family, tokenizer, dataset, args.timeout, ours=ours, only=measured)
        rewards = (None, "equal") if entry["reward"] else (None, "equal", *[r.get("reward") for r in results.values()])
        equal = [n for n, r in results.items() if r.get("dpo") == "equal" and r.get("reward") in rewards]
        entry["varlen"] = equal  # (a reward step the registry does not list for the type does not count)
        entry["varlen_failed"] = {name: r for name, r in results.items() if name not in equal}
        if args.write:
            _write_registry(registry, args.registry)
        print(json.dumps({"family": family, "varlen": equal, "seconds": round(time.time() - start, 1)}), flush=True)
    if args.write:
        _write_docs(_write_registry(registry, args.registry))


def _measure_shift(args, registry: dict, tokenizer) -> None:
    """`--shift`: each supported family's default tiny model with a left-padded prompt's tokens at moved positions;
    `shift` true where the start-up check's tolerance holds, with the measured difference as `shift_measured`."""
    from trl_prefix_sharing.testing import equivalence as eq
    from trl_prefix_sharing.testing import make_model
    from trl_prefix_sharing.testing.shift import shift_check

    for family in args.families or list(registry["supported"]):
        entry = registry["supported"].get(family)
        if entry is None:
            print(json.dumps({"family": family, "status": "not supported: not measured"}), flush=True)
            continue
        start = time.time()
        signal.alarm(args.timeout)
        try:
            result = shift_check(make_model(family, len(tokenizer), **eq.family_config_kwargs(family)), tokenizer)
            error = result.error
        except _Timeout:
            result, error = None, f"over {args.timeout} s"
        except Exception as exc:  # noqa: BLE001 - recorded
            result, error = None, _short(exc)
        finally:
            signal.alarm(0)
        entry["shift"] = error is None and result.passed
        entry["shift_measured"] = (
            f"error: {error}"
            if error
            else f"largest log-prob difference {result.difference:.2g} in float32, tolerance {result.tolerance:.2g}"
        )
        if args.write:
            _write_registry(registry, args.registry)
        print(
            json.dumps(
                {
                    "family": family,
                    "shift": entry["shift"],
                    "measured": entry["shift_measured"],
                    "seconds": round(time.time() - start, 1),
                }
            ),
            flush=True,
        )
    if args.write:
        _write_docs(_write_registry(registry, args.registry))


def _write_registry(registry: dict, path: pathlib.Path = REGISTRY) -> dict:
    from trl_prefix_sharing.architectures import REFUSED

    for family, entry in registry["refused"].items():  # reasons are kept in code; the measurement stays alongside
        entry["reason"] = REFUSED.get(family) or _measured_reason(entry["measured"])
    registry = {key: dict(sorted(registry[key].items())) for key in ("supported", "refused")}
    path.write_text(json.dumps(registry, indent=1) + "\n")
    return registry


def _write_docs(registry: dict) -> None:
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOCS.relative_to(ROOT)} has no generated architectures section ({BEGIN} ... {END}).")
    DOCS.write_text(text[: text.index(BEGIN)] + docs_table(registry) + text[text.index(END) + len(END) :])


if __name__ == "__main__":
    main()
