"""A stand-in for what TRL 1.16 uses of vLLM, so that `use_vllm=True` trains on the CPU in tests (vLLM itself is not
installed, and is not needed: nothing here imports it).

What TRL calls, read from `trl/generation/vllm_generation.py`, `trl/generation/vllm_client.py` and
`trl/experimental/online_dpo/online_dpo_trainer.py`:

- **Server mode** (`vllm_mode="server"`). GRPO and RLOO (through `VLLMGeneration`) build TRL's
  `VLLMClient(base_url, group_port, connection_timeout)` on the main process, call `init_communicator(device)` (an
  NCCL group with the server's workers), and GRPO reads `get_server_info()` (the server's `logprobs_mode`). Each weight
  sync streams every parameter, under vLLM's names, through `update_named_params(metadata, named_tensors)`, then calls
  `reset_prefix_cache()`; generation is `generate(prompts=token ids, n=G, temperature=..., logprobs=0,
  generation_kwargs=...)`, one request per generation batch. Online DPO syncs with `weight_update()` and
  `update_named_param(name, tensor)` per parameter, and sends text prompts (`n=2`). `StandInVLLMClient` is TRL's own
  client with only its transport stood in: its HTTP requests go to a `StandInServer` (the endpoints of `vllm serve`
  TRL calls, answering in vLLM's OpenAI format), and its NCCL broadcasts (`packed_nccl_broadcast_producer`) to an
  in-process queue the server reads. TRL's request building, response parsing (`parse_logprobs`) and weight streaming
  run unchanged; its constructor and `check_server` (which need `requests`, not installed here) and
  `init_communicator` (which refuses a non-CUDA device) are replaced.
- **Colocate mode** (`vllm_mode="colocate"`). `vllm.LLM(model=<checkpoint path>, seed=..., logprobs_mode=..., ...)`
  (GRPO and RLOO send every row of the generation batch as its own prompt, `n=1`; online DPO text prompts, `n=2`),
  `vllm.SamplingParams(**kwargs)` (and `StructuredOutputsParams` for a regex), `llm.generate(prompts,
  sampling_params=..., use_tqdm=False)` returning `RequestOutput`s (`prompt_token_ids`, `outputs[i].token_ids`,
  `outputs[i].logprobs`: per token a dict of `Logprob(logprob, rank)`), weight syncs through
  `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])` then
  `llm.reset_prefix_cache()`, and `sleep`/`wake_up` in sleep mode.

Both hold a `StandInEngine`: the checkpoint loaded from its path, as vLLM loads it, then overwritten by every weight
sync (it refuses names and shapes the model does not have, and records which parameters each sync delivered). It
samples with its own seeded generator, so two trainers given the same weights get the same completions, and it
reports *processed* log-probs (`logprobs_mode="processed_logprobs"`, what TRL asks for): those of the distribution it
sampled from, the model's logits plus a fixed per-token offset (`mismatch`, the numerical mismatch between an
inference engine and the trainer, large here so that importance-sampling correction has something to correct) and
the request's `logit_bias`, over the temperature. Only the sampling options these tests use are supported (no top-k,
top-p, min-p, repetition penalty or structured outputs); others raise.

`install(monkeypatch)` patches TRL's availability checks and vLLM names only for the test that calls it.
"""

from __future__ import annotations

import json
import os
import queue
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch


#: the standard deviation of the per-token logit offset between the engine's distribution and the trained model's
MISMATCH = 0.5
#: environment variables TRL's colocate mode sets for vLLM (`RANK`, ...): a test restores them afterwards
ENVIRONMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: seconds a stand-in server waits for a tensor TRL announced (a hang would otherwise never end)
RECEIVE_TIMEOUT = 60


# ----------------------------------------------------------------------------------------------- the engine
@dataclass
class Logprob:
    """vLLM's `Logprob`: what `extract_logprobs` reads."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    text: str = ""
    finish_reason: str = "length"


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    request_id: str = ""
    prompt: str | None = None


@dataclass
class Sample:
    """One completion: its tokens, and per token `(token_id, log-prob, rank)` of the sampled token then of the
    `logprobs` most probable ones (vLLM's order), or `None` when no log-probs were asked."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float, int]]] | None = field(default_factory=list)
    finish_reason: str = "length"


class StandInEngine:
    """The model a vLLM engine (colocate) or server holds; see the module docstring."""

    def __init__(self, model_path: str, seed: int = 0, mismatch: float = MISMATCH):
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        # the saved `tokenizer.json` as it is (`AutoTokenizer` would swap in Qwen2's own tokenizer class)
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
        self.parameters = dict(self.model.named_parameters())
        vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.logit_offset = mismatch * torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed + 1))
        self.generator = torch.Generator().manual_seed(seed)
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.stop_token_ids = set(eos) | {self.tokenizer.eos_token_id}
        self.received: set[str] = set()  # the parameters loaded since the last sync ended
        self.syncs: list[set[str]] = []  # the parameters each weight sync delivered
        self.completions = 0  # completions sampled

    # weights
    def load_weights(self, weights) -> set[str]:
        """vLLM's `model.load_weights`: `(name, tensor)` pairs under the checkpoint's names."""
        loaded = set()
        for name, tensor in weights:
            if name not in self.parameters:
                raise KeyError(f"The vLLM model has no parameter named {name!r}.")
            parameter = self.parameters[name]
            if tensor.shape != parameter.shape:
                raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, the model has {tuple(parameter.shape)}.")
            with torch.no_grad():
                parameter.copy_(tensor.detach().to(parameter.device, parameter.dtype))
            loaded.add(name)
        self.received |= loaded
        return loaded

    def reset_prefix_cache(self) -> None:
        """The end of a weight sync in TRL (and of nothing else): record what it delivered."""
        if self.received:
            self.syncs.append(self.received)
            self.received = set()

    # generation
    def tokenize(self, prompt) -> list[int]:
        """A prompt as `LLM.generate` takes it: token ids (`{"prompt_token_ids": ...}`) or text."""
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:
                raise NotImplementedError("The vLLM stand-in generates from text only.")
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        return list(prompt)

    def _check(self, params: dict) -> None:
        unsupported = {
            "top_k": params.get("top_k") not in (None, 0, -1),
            "top_p": params.get("top_p", 1.0) not in (None, 1.0),
            "min_p": params.get("min_p") not in (None, 0.0),
            "repetition_penalty": params.get("repetition_penalty", 1.0) not in (None, 1.0),
            "structured_outputs": params.get("structured_outputs") is not None,
        }
        if any(unsupported.values()):
            raise NotImplementedError(
                f"The vLLM stand-in does not sample with {[k for k, v in unsupported.items() if v]}."
            )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: dict) -> list[list[Sample]]:
        """`params["n"]` completions of each prompt (token ids), sampled as the module docstring says: the request's
        rows in one left-padded batch (recomputed at every token: the rows are short)."""
        self._check(params)
        n, temperature, top = params.get("n", 1), params.get("temperature", 1.0), params.get("logprobs")
        generator = self.generator
        if params.get("seed") is not None:
            generator = torch.Generator().manual_seed(params["seed"])
        bias = self.logit_offset.clone()
        for token, value in (params.get("logit_bias") or {}).items():
            bias[int(token)] += value
        rows = [ids for ids in prompts for _ in range(n)]
        self.completions += len(rows)
        width = max(len(ids) for ids in rows)
        input_ids = torch.tensor([[0] * (width - len(ids)) + list(ids) for ids in rows])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows])
        samples = [Sample(logprobs=None if top is None else []) for _ in rows]
        active = torch.ones(len(rows), dtype=torch.bool)
        for _ in range(params.get("max_tokens", 16)):
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            logits = outputs.logits[:, -1].float() + bias
            logprobs = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
            if temperature > 0:
                tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
            else:
                tokens = logprobs.argmax(-1)
            self._record(samples, active, tokens, logprobs, top)
            if not active.any():
                break
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(tokens[:, None])], dim=1)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _record(self, samples: list[Sample], active, tokens, logprobs, top: int | None) -> None:
        """Each active row's sampled token (and its log-prob and rank, with the `top` most probable ones); a stop
        token ends its row."""
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        for i in active.nonzero().flatten().tolist():
            token = int(tokens[i])
            samples[i].token_ids.append(token)
            if top is not None:
                entries = [(token, float(chosen[i]), int(ranks[i]))]
                if top > 0:
                    values, indices = logprobs[i].topk(top)
                    entries += [
                        (int(t), float(v), r + 1) for r, (v, t) in enumerate(zip(values, indices, strict=True))
                    ]
                samples[i].logprobs.append(list({e[0]: e for e in entries}.values()))
            if token in self.stop_token_ids:
                samples[i].finish_reason = "stop"
                active[i] = False


# ----------------------------------------------------------------------------------------------- colocate mode
class SamplingParams:
    """`vllm.SamplingParams`: the fields TRL passes (an unknown one raises, as a misspelled field would)."""

    def __init__(
        self,
        n=1,
        repetition_penalty=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=16,
        logprobs=None,
        detokenize=True,
        seed=None,
        logit_bias=None,
        structured_outputs=None,
    ):
        self.__dict__.update({k: v for k, v in locals().items() if k != "self"})


class StructuredOutputsParams:
    """`vllm.sampling_params.StructuredOutputsParams` (refused by the engine when used)."""

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _Namespace:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class LLM:
    """`vllm.LLM` in colocate mode: an engine of its own, loaded from the checkpoint path TRL passes."""

    def __init__(self, model: str, seed: int = 0, max_model_len: int | None = None, **kwargs):
        self.kwargs = dict(kwargs, model=model, seed=seed, max_model_len=max_model_len)
        self.engine = StandInEngine(model, seed=seed)
        self.sleeping = False
        runner = _Namespace(model=_Namespace(load_weights=self.engine.load_weights))
        self.llm_engine = _Namespace(
            model_executor=_Namespace(driver_worker=_Namespace(model_runner=runner)),
            model_config=_Namespace(max_model_len=max_model_len or self.engine.model.config.max_position_embeddings),
        )

    def generate(self, prompts, sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        params = vars(sampling_params or SamplingParams())
        prompt_ids = [self.engine.tokenize(prompt) for prompt in (prompts if isinstance(prompts, list) else [prompts])]
        outputs = []
        for ids, samples in zip(prompt_ids, self.engine.generate(prompt_ids, params), strict=True):
            completions = [
                CompletionOutput(
                    index=i,
                    token_ids=sample.token_ids,
                    logprobs=None
                    if sample.logprobs is None
                    else [{t: Logprob(lp, rank) for t, lp, rank in position} for position in sample.logprobs],
                    finish_reason=sample.finish_reason,
                )
                for i, sample in enumerate(samples)
            ]
            outputs.append(RequestOutput(prompt_token_ids=ids, outputs=completions))
        return outputs

    def reset_prefix_cache(self) -> bool:
        self.engine.reset_prefix_cache()
        return True

    def sleep(self, level: int = 1) -> None:
        self.sleeping = True

    def wake_up(self, tags=None) -> None:
        self.sleeping = False


# ----------------------------------------------------------------------------------------------- server mode
class WeightGroup:
    """The weight-transfer group of one server: what TRL broadcasts, in order, for the server to receive."""

    def __init__(self):
        self.tensors = queue.Queue()


def packed_nccl_broadcast_producer(iterator, group: WeightGroup, src: int = 0, post_iter_func=None, **kwargs):
    """vLLM's `packed_nccl_broadcast_producer` (which TRL's `update_named_params` calls): every tensor of `iterator`
    to the group, in order."""
    for item in iterator:
        tensor = post_iter_func(item) if post_iter_func is not None else item
        group.tensors.put(tensor.detach().clone())


class StandInServer:
    """`vllm serve <checkpoint>` (with `--weight-transfer-config`, `--logprobs-mode processed_logprobs`): the
    endpoints TRL's `VLLMClient` calls. `handle` takes a request's method, path and JSON body and returns
    `(status, body)`."""

    def __init__(self, model_path: str, seed: int = 0):
        self.engine = StandInEngine(model_path, seed=seed)
        self.group: WeightGroup | None = None
        self.updating = False
        self.calls: list[str] = []

    def handle(self, method: str, path: str, body: dict | None, params: dict | None):
        self.calls.append(path)
        if method == "GET" and path == "/health":
            return 200, {}
        if method == "GET" and path == "/v1/models":
            return 200, {"data": [{"id": self.engine.model_path}]}
        if method == "GET" and path == "/server_info":
            model_config = {"model": self.engine.model_path, "logprobs_mode": "processed_logprobs"}
            return 200, {"vllm_config": {"model_config": model_config, "weight_transfer_config": {"backend": "nccl"}}}
        if method == "GET" and path == "/get_world_size":
            return 200, {"world_size": 1}
        if method == "POST" and path == "/init_weight_transfer_engine":
            self.group = WeightGroup()
            return 200, {}
        if method == "POST" and path in ("/start_weight_update", "/finish_weight_update"):
            self.updating = path == "/start_weight_update"
            return 200, {}
        if method == "POST" and path == "/update_weights":
            return self._update_weights(body["update_info"])
        if method == "POST" and path == "/reset_prefix_cache":
            self.engine.reset_prefix_cache()
            return 200, {"success": True}
        if method == "POST" and path == "/v1/completions":
            return 200, {"choices": self._completions(body)}
        return 404, {"detail": f"{method} {path} is not an endpoint of the vLLM stand-in"}

    def _update_weights(self, info: dict):
        if self.group is None or not self.updating:
            return 400, {"detail": "update_weights outside init_weight_transfer_engine / start_weight_update"}
        for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
            tensor = self.group.tensors.get(timeout=RECEIVE_TIMEOUT)
            if str(tensor.dtype).removeprefix("torch.") != dtype or list(tensor.shape) != list(shape):
                return 400, {"detail": f"{name}: announced {dtype} {shape}, received {tensor.dtype} {tensor.shape}"}
            self.engine.load_weights([(name, tensor)])
        return 200, {}

    def _completions(self, body: dict) -> list[dict]:
        if not (body.get("return_token_ids") and body.get("return_tokens_as_token_ids")):
            raise ValueError("TRL asks for token ids back (`return_token_ids`, `return_tokens_as_token_ids`).")
        params = {k: v for k, v in body.items() if k not in ("model", "prompt")}
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        prompt_ids = [self.engine.tokenize(prompt) for prompt in prompts]
        choices = []
        for ids, samples in zip(prompt_ids, self.engine.generate(prompt_ids, params), strict=True):
            for sample in samples:  # prompt-major: the n completions of a prompt, then the next prompt's
                logprobs = None
                if sample.logprobs is not None:
                    logprobs = {
                        "tokens": [f"token_id:{t}" for t in sample.token_ids],
                        "token_logprobs": [position[0][1] for position in sample.logprobs],
                        "top_logprobs": [
                            {f"token_id:{t}": lp for t, lp, _ in position} for position in sample.logprobs
                        ],
                    }
                choices.append(
                    {
                        "index": len(choices),
                        "prompt_token_ids": ids,
                        "token_ids": sample.token_ids,
                        "logprobs": logprobs,
                        "finish_reason": sample.finish_reason,
                    }
                )
        return choices


class _Response:
    def __init__(self, status: int, body):
        self.status_code = status
        self.text = json.dumps(body)
        self.headers = {}

    def json(self):
        return json.loads(self.text)


class StandInSession:
    """What TRL's client does with its `requests.Session`: GET and POST, here to the client's own stand-in server
    (bodies go through JSON, as on the wire)."""

    #: address (`host:port`) -> `(checkpoint path, seed)` of the server `vllm serve` would run there
    addresses: dict[str, tuple[str, int]] = {}

    def __init__(self, base_url: str):
        netloc = urlparse(base_url).netloc
        if netloc not in self.addresses:
            raise ConnectionError(f"No vLLM stand-in server at {netloc}.")
        self.server = StandInServer(*self.addresses[netloc])  # a fresh server per client: one per trainer

    def _send(self, method: str, url: str, body=None, params=None):
        body = None if body is None else json.loads(json.dumps(body))
        return _Response(*self.server.handle(method, urlparse(url).path, body, params))

    def get(self, url, params=None, **kwargs):
        return self._send("GET", url, params=params)

    def post(self, url, json=None, **kwargs):
        return self._send("POST", url, body=json)


def _client_class():
    from trl.generation.vllm_client import VLLMClient

    class StandInVLLMClient(VLLMClient):
        """TRL's `VLLMClient` with its transport stood in (see the module docstring)."""

        def __init__(self, base_url=None, host="0.0.0.0", server_port=8000, group_port=51216, connection_timeout=0.0):
            # TRL's constructor, without `requests` (a session to a stand-in server instead)
            if base_url is not None:
                parsed = urlparse(base_url)
                self.host = parsed.hostname
                self.base_url = f"{parsed.scheme or 'http'}://{parsed.netloc}{parsed.path}"
            else:
                self.host, self.server_port = host, server_port
                self.base_url = f"http://{host}:{server_port}"
            self.session = StandInSession(self.base_url)
            self.group_port = group_port
            self.communicator = None
            self._updating_weights = False
            self.check_server(connection_timeout)
            self.model = self._get(f"{self.base_url}/v1/models")["data"][0]["id"]

        def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
            if self.session.get(f"{self.base_url}/health").status_code != 200:
                raise ConnectionError(f"The vLLM server can't be reached at {self.base_url}.")

        def init_communicator(self, device=0):
            """TRL's, without the CUDA device its NCCL group needs: the group is the server's in-process queue."""
            if self.get_server_info()["weight_transfer_config"] is None:
                raise RuntimeError("The vLLM server has no weight-transfer engine.")
            init_info = {
                "master_address": "127.0.0.1",
                "master_port": self.group_port,
                "rank_offset": 1,
                "world_size": self.get_world_size() + 1,
                "packed": True,
            }
            self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info})
            self.communicator = self.session.server.group

    return StandInVLLMClient


# ----------------------------------------------------------------------------------------------- installing
class StandIn:
    """What `install` returns: where servers run, and the engine each trainer used."""

    @staticmethod
    def serve(model_path: str, host: str = "0.0.0.0", port: int = 8000, seed: int = 0) -> None:
        """A `vllm serve model_path` at `host:port` (TRL's default address): every client that connects there gets
        a fresh server of its own (so stock's and prefix sharing's trainers sample alike)."""
        StandInSession.addresses[f"{host}:{port}"] = (model_path, seed)

    @staticmethod
    def engine(trainer) -> StandInEngine:
        """The engine a trainer generates with: its colocated `LLM`'s, or its client's server's."""
        owner = getattr(trainer, "vllm_generation", trainer)
        llm = getattr(owner, "llm", None)
        return llm.engine if llm is not None else owner.vllm_client.session.server.engine


def install(monkeypatch) -> StandIn:
    """Make TRL 1.16 believe vLLM is installed, for the calling test only: its availability checks answer yes, the
    vLLM names its modules import (when vLLM is present) are the stand-ins, its client talks to stand-in servers.
    Restore `ENVIRONMENT` after the test (TRL's colocate mode sets those variables)."""
    import trl.experimental.online_dpo.online_dpo_trainer as online_dpo
    import trl.generation.vllm_client as vllm_client
    import trl.generation.vllm_generation as vllm_generation

    client = _client_class()
    for module in (vllm_generation, online_dpo):
        monkeypatch.setattr(module, "is_vllm_available", lambda *args, **kwargs: True)
        monkeypatch.setattr(module, "LLM", LLM, raising=False)
        monkeypatch.setattr(module, "SamplingParams", SamplingParams, raising=False)
        monkeypatch.setattr(module, "StructuredOutputsParams", StructuredOutputsParams, raising=False)
        monkeypatch.setattr(module, "VLLMClient", client)
    monkeypatch.setattr(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", True)
    monkeypatch.setattr(vllm_client, "packed_nccl_broadcast_producer", packed_nccl_broadcast_producer, raising=False)
    monkeypatch.setattr(StandInSession, "addresses", {})
    return StandIn()


def saved_environment() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in ENVIRONMENT}


def restore_environment(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
