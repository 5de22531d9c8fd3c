"""What a forward over shared rows costs: the estimate `prefix_sharing_join="auto"` chooses a layout by.

Joining rows that share a prefix into one document (`trie.JOINS`) computes the prefix once, but makes the document
longer. Which wins depends on the attention kernel:

- a dense kernel (SDPA or eager with the mask as a tensor, the CPU's) computes every query-key pair of a row whatever
  the mask: `rows x width^2` pairs, so one long row can cost more than the positions it saves;
- a block-sparse kernel (FlexAttention) skips the blocks the mask hides, and the varlen kernel computes each segment's
  path only: they pay for the visible pairs, which joining only lowers.

The linear layers cost the same per position either way, and the model runs every position of its rows, padding
included. So a step costs

    position x rows x width  +  pair x (rows x width^2  or  visible pairs)

in multiply-adds per forward (the backward scales both terms alike), with `position` twice the model's parameters
beyond its input embeddings (the LM head included) and `pair` twice `layers x heads x head_dim` (scores, then weighted
values), both read from the model (`StepCost.of_model`). The visible pairs are a lower bound of what FlexAttention
computes: a block partly visible costs as a full one.
"""

from __future__ import annotations

from dataclasses import dataclass


__all__ = ["StepCost", "config_int"]


@dataclass(frozen=True)
class StepCost:
    """The cost model of one forward over shared rows (see the module docstring).

    Args:
        position: multiply-adds per position the model runs (its linear layers).
        pair: multiply-adds per query-key pair the attention kernel computes.
        dense: whether the kernel computes every pair of a row (SDPA, eager) or the visible ones only (FlexAttention,
            varlen).
    """

    position: float
    pair: float
    dense: bool = True

    def estimate(self, num_rows: int, width: int, visible_pairs: int) -> float:
        """Multiply-adds of a forward over `num_rows` shared rows of `width` positions whose mask lets
        `visible_pairs` query-key pairs through."""
        pairs = num_rows * width * width if self.dense else visible_pairs
        return self.position * num_rows * width + self.pair * pairs

    @classmethod
    def of_model(cls, model, dense: bool = True) -> StepCost:
        """The cost model of `model` (its parameters outside the embeddings, its attention's layers, heads and head
        size) under a kernel that is `dense` (SDPA, eager) or computes the visible pairs only (FlexAttention,
        varlen)."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head_size = head.weight.numel() if head is not None else 0  # the LM head runs per position, tied or not
        lookups = {id(p) for p in model.get_input_embeddings().parameters()}
        lookups |= {id(p) for p in head.parameters()} if head is not None else set()
        parameters = sum(p.numel() for p in model.parameters() if id(p) not in lookups) + head_size
        heads = config_int(config, "num_attention_heads") or 1
        head_dim = config_int(config, "head_dim") or (config_int(config, "hidden_size") or 64 * heads) // heads
        layers = config_int(config, "num_hidden_layers") or 1
        return cls(
            position=2.0 * parameters,
            pair=2.0 * layers * heads * head_dim,
            dense=dense,
        )


def config_int(config, name: str):
    """`config.name`, or None where the config has none or no single value (a config whose layers differ refuses
    to give one: the estimate then takes the default, a model-wide approximation)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # transformers' heterogeneous configs raise for per-layer attributes
        return None
    return value if isinstance(value, int) else None
