"""A stand-in for the parts of vLLM's offline API that the vllm backend uses, computed with transformers.

It implements the documented behaviour our glue depends on, and nothing else: `LLM(model=...)`,
`LLM.generate(prompts, sampling_params, use_tqdm=...)` with `TokensPrompt`s and one `SamplingParams` per prompt
(the stop token stays in `token_ids`, `finish_reason` is "stop" or "length"), and the `extract_hidden_states`
method with `ExampleHiddenStatesConnector` (one safetensors file per request with `hidden_states`
[tokens, layers, hidden] and `token_ids`; layer id i = the input of decoder layer i, id num_hidden_layers = the
last layer's output before the final norm; the path in `kv_transfer_params["hidden_states_path"]`).

It tests our side of the contract (argument names, stop tokens, layer order, the final norm, file clean-up); it
proves nothing about vLLM itself, which cannot run on this machine.
"""

from __future__ import annotations

import os
import sys
import types
import uuid
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

created: list[dict] = []  # the keyword arguments of every LLM(...), for assertions


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, stop_token_ids=None, seed=None) -> None:
        self.temperature, self.max_tokens, self.seed = temperature, max_tokens, seed
        self.stop_token_ids = list(stop_token_ids or [])


def TokensPrompt(prompt_token_ids):  # noqa: N802 - a TypedDict in vLLM
    return {"prompt_token_ids": prompt_token_ids}


@dataclass
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_connector_extra_config: dict = field(default_factory=dict)


@dataclass
class CompletionOutput:
    token_ids: list[int]
    finish_reason: str


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]
    kv_transfer_params: dict | None = None


class LLM:
    def __init__(self, model: str, tokenizer=None, dtype="auto", seed=0, **kwargs) -> None:
        created.append({"model": model, "tokenizer": tokenizer, "dtype": dtype, "seed": seed, **kwargs})
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.spec = kwargs.get("speculative_config")
        self.kv = kwargs.get("kv_transfer_config")

    def generate(self, prompts, sampling_params, use_tqdm=True) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if self.spec and self.spec["method"] == "extract_hidden_states":
            return [self._extract(p["prompt_token_ids"]) for p in prompts]
        return [self._generate(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params, strict=True)]

    @torch.no_grad()
    def _generate(self, ids: list[int], sp: SamplingParams) -> RequestOutput:
        if sp.seed is not None:
            torch.manual_seed(sp.seed)
        x = torch.tensor([ids])
        out = self.model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=sp.max_tokens, do_sample=sp.temperature > 0,
            temperature=sp.temperature or None, top_k=None, eos_token_id=sp.stop_token_ids, pad_token_id=0,
        )[0, len(ids):].tolist()  # fmt: skip
        stopped = bool(out) and out[-1] in sp.stop_token_ids
        return RequestOutput([CompletionOutput(out, "stop" if stopped else "length")])

    @torch.no_grad()
    def _extract(self, ids: list[int]) -> RequestOutput:
        layer_ids = self.spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        base = self.model.model
        captured: dict[int, torch.Tensor] = {}
        hooks = [
            layer.register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(i, a[0][0]))
            for i, layer in enumerate(base.layers)
        ]
        hooks.append(base.norm.register_forward_pre_hook(lambda m, a: captured.__setitem__(len(base.layers), a[0][0])))
        try:
            self.model(torch.tensor([ids]))
        finally:
            for h in hooks:
                h.remove()
        path = os.path.join(self.kv.kv_connector_extra_config["shared_storage_path"], f"{uuid.uuid4().hex}.safetensors")
        states = torch.stack([captured[i] for i in layer_ids], dim=1)
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)}, path)
        open(path + ".lock", "w").close()
        return RequestOutput([CompletionOutput([0], "length")], {"hidden_states_path": path})


def load_hidden_states(path: str) -> dict[str, torch.Tensor]:
    return load_file(path, device="cpu")


def install(monkeypatch) -> None:
    """Make `import vllm` (and the submodules the backend imports) resolve to this stand-in."""
    names = {
        "vllm": {"LLM": LLM, "SamplingParams": SamplingParams, "__version__": "0.0-test"},
        "vllm.inputs": {"TokensPrompt": TokensPrompt},
        "vllm.config": {"KVTransferConfig": KVTransferConfig},
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector": {
            "load_hidden_states": load_hidden_states
        },
    }
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    created.clear()
