"""Small custom models registered under model types of their own (none in the measured registry), for the start-up
check: a plain decoder that honours the shared layout (it must pass), and three that do not (each must be refused).

- `ps_plain_decoder`: Llama under another name.
- `ps_windowed_decoder`: Mistral under another name, with the window it is configured with (honoured: must pass).
- `ps_row_positions`: ignores the given `position_ids` and numbers the tokens by their place in the row.
- `ps_row_causal`: drops a given 4-D mask and attends causally over the whole row.
- `ps_row_window`: applies its sliding window in row positions on top of the given 4-D mask.

Each broken backbone behaves exactly as its base on stock rows (a 2-D padding mask, no position ids), so stock TRL
trains it normally; only the shared layout tells them apart. `write_remote_code_model` saves a plain decoder as
a custom-code checkpoint (`auto_map`, its own `model_type`), loaded with `trust_remote_code=True`.
"""

from __future__ import annotations

import copy
import json
import pathlib

import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralModel,
)

from trl_prefix_sharing.testing import make_config


class _RowPositions(LlamaModel):
    def forward(self, *args, position_ids=None, **kwargs):
        return super().forward(*args, **kwargs)  # positions from the row index


class _RowCausal(LlamaModel):
    def forward(self, *args, attention_mask=None, **kwargs):
        if not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
            attention_mask = None  # causal over the whole row
        return super().forward(*args, attention_mask=attention_mask, **kwargs)


class _RowWindow(MistralModel):
    def forward(self, *args, attention_mask=None, **kwargs):
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            rows = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
            near = (rows[:, None] - rows[None, :]) < self.config.sliding_window  # the window in row positions
            if attention_mask.dtype == torch.bool:
                attention_mask = attention_mask & near
            else:
                attention_mask = attention_mask.masked_fill(~near, torch.finfo(attention_mask.dtype).min)
        return super().forward(*args, attention_mask=attention_mask, **kwargs)


def _register(model_type: str, base_config, base_model, causal_lm, classifier=None, backbone=None):
    config_class = type(f"{model_type}_config", (base_config,), {"model_type": model_type})

    def init(self, config):
        super(type(self), self).__init__(config)
        if backbone is not None:
            getattr(self, self.base_model_prefix).__class__ = backbone  # the same weights, the broken forward

    classes = {}
    for auto, base in ((AutoModelForCausalLM, causal_lm), (AutoModelForSequenceClassification, classifier)):
        if base is not None:
            classes[auto] = type(
                f"{model_type}_{base.__name__}", (base,), {"config_class": config_class, "__init__": init}
            )
    # the backbone a classifier builds with `AutoModel`
    classes[AutoModel] = type(f"{model_type}_{base_model.__name__}", (base_model,), {"config_class": config_class})
    try:
        AutoConfig.register(model_type, config_class)
        for auto, cls in classes.items():
            auto.register(config_class, cls)
    except ValueError:
        pass  # registered already (this module imported twice)
    return config_class


_LLAMA = (LlamaConfig, LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification)
_MISTRAL = (MistralConfig, MistralModel, MistralForCausalLM)
CUSTOM = {
    "ps_plain_decoder": _register("ps_plain_decoder", *_LLAMA),
    "ps_windowed_decoder": _register("ps_windowed_decoder", *_MISTRAL),
    "ps_row_positions": _register("ps_row_positions", *_LLAMA, backbone=_RowPositions),
    "ps_row_causal": _register("ps_row_causal", *_LLAMA, backbone=_RowCausal),
    "ps_row_window": _register("ps_row_window", *_MISTRAL, backbone=_RowWindow),
}
#: the custom types that honour the shared layout, and those that do not
EXACT = ("ps_plain_decoder", "ps_windowed_decoder")
BROKEN = ("ps_row_positions", "ps_row_causal", "ps_row_window")
WINDOW = 4


def custom_config(model_type: str, vocab_size: int, **overrides):
    """The tiny test config (`make_config`'s llama or mistral fields) under a custom model type."""
    base = "mistral" if issubclass(CUSTOM[model_type], MistralConfig) else "llama"
    fields = make_config(base, vocab_size, **overrides).to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        fields.pop(key, None)
    if base == "mistral":
        fields["sliding_window"] = WINDOW
    return CUSTOM[model_type](**fields)


def custom_model(model_type: str, vocab_size: int, seed: int = 0, classifier: bool = False, **overrides):
    """A randomly initialised custom model, fp32, SDPA (a reward model with `classifier`)."""
    config = custom_config(model_type, vocab_size, **({"num_labels": 1} if classifier else {}), **overrides)
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    torch.manual_seed(seed)
    return auto.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32)


_REMOTE_CONFIG = """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
"""
_REMOTE_MODELING = """from torch import nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel, LlamaPreTrainedModel

from .configuration_remote import RemoteConfig


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig


class RemoteForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteConfig

    def __init__(self, config):  # builds its backbone itself (not through AutoModel)
        LlamaPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = RemoteModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
"""


def write_remote_code_model(root: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A custom-code checkpoint like TRL's test model `tiny-RemoteForCausalLM`: its own `model_type` ("remote"), its
    classes in files next to the weights, loadable only with `trust_remote_code=True`; nothing downloaded."""
    torch.manual_seed(0)
    LlamaForCausalLM(make_config("llama", vocab_size)).save_pretrained(root)
    (root / "configuration_remote.py").write_text(_REMOTE_CONFIG)
    (root / "modeling_remote.py").write_text(_REMOTE_MODELING)
    config = json.loads((root / "config.json").read_text())
    config.update(
        model_type="remote",
        architectures=["RemoteForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_remote.RemoteConfig",
            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
            "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
        },
    )
    (root / "config.json").write_text(json.dumps(config))
    return root
