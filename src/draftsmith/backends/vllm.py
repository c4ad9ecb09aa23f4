"""The vLLM backend: regeneration through `vllm.LLM.generate`, features through vLLM's hidden-state extraction.

Both use vLLM's documented offline API only:

- generation: `LLM(model=...)` and `LLM.generate([TokensPrompt(prompt_token_ids=...)], [SamplingParams(...)])`,
  one seeded `SamplingParams` per prompt, so a row samples the same way whichever batch it lands in;
- features: the `extract_hidden_states` speculative method with the `ExampleHiddenStatesConnector`, which writes
  one safetensors file per request holding `hidden_states` [tokens, layers, hidden] and `token_ids`, and returns
  its path in `output.kv_transfer_params["hidden_states_path"]`. The layer ids are vLLM's
  `eagle_aux_hidden_state_layer_ids`, which mean what ours mean (the input of decoder layer i); the id
  `num_hidden_layers` gives the last layer's output *before* the final norm, so we apply the target's own norm to
  get `last_hidden` as the transformers backend stores it.

vLLM is imported only when this backend is used; where it is missing the error says how to install it. The
target loaded by transformers is still needed (tokenizer, final norm, fingerprint), on the CPU if need be.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from draftsmith.errors import DraftsmithError, TargetError
from draftsmith.target import Target

INSTALL_HINT = (
    "pip install vllm (Linux with a CUDA GPU; see https://docs.vllm.ai/en/latest/getting_started/installation/), "
    "or use backend: transformers"
)


def import_vllm():
    """The vllm module, or a DraftsmithError with an install hint."""
    try:
        import vllm
    except ImportError as exc:
        raise DraftsmithError(f"the vllm backend needs the vllm package, which cannot be imported ({exc})",
                              hint=INSTALL_HINT) from None  # fmt: skip
    return vllm


class VllmBackend:
    name = "vllm"

    def __init__(self, target: Target, options: dict[str, Any]) -> None:
        """`options` are extra `vllm.LLM(...)` keyword arguments (e.g. tensor_parallel_size,
        gpu_memory_utilization); `hidden_states_dir` (default: a temporary directory) is where vLLM writes the
        per-request feature files, each deleted once read."""
        self.vllm = import_vllm()
        self.target = target
        self.options = dict(options)
        self.hidden_states_dir = self.options.pop("hidden_states_dir", None)
        self.model_path = getattr(target.model.config, "_name_or_path", "") or target.name
        self.dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
        self._llm = None
        self._extractor = None
        self._extractor_layers: tuple[int, ...] = ()
        self._tmp: str | None = None

    def _engine(self, **extra: Any):
        kwargs = {"model": self.model_path, "tokenizer": self.model_path, "dtype": self.dtype, "seed": 0}
        return self.vllm.LLM(**(kwargs | extra | self.options))

    def generate(
        self,
        prompts: Sequence[list[int]],
        *,
        temperature: float,
        max_new_tokens: int,
        stop_ids: set[int],
        seed: int,
    ) -> list[tuple[list[int], bool]]:
        from vllm.inputs import TokensPrompt

        if self._llm is None:
            self._free_extractor()
            self._llm = self._engine()
        params = [
            self.vllm.SamplingParams(
                temperature=temperature, max_tokens=max_new_tokens, stop_token_ids=sorted(stop_ids),
                seed=(seed + i) % 2**63,
            )
            for i in range(len(prompts))
        ]  # fmt: skip
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        results = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            ended = completion.finish_reason == "stop"
            if tokens and tokens[-1] in stop_ids:  # vLLM keeps the stop token in token_ids; we never do
                tokens, ended = tokens[:-1], True
            results.append((tokens, ended))
        return results

    def features(
        self, samples: Sequence[torch.Tensor], layer_ids: tuple[int, ...]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from vllm.inputs import TokensPrompt

        extractor = self._features_engine(tuple(layer_ids))
        prompts = [TokensPrompt(prompt_token_ids=ids.tolist()) for ids in samples]
        outputs = extractor.generate(prompts, self.vllm.SamplingParams(max_tokens=1), use_tqdm=False)
        norm = _final_norm(self.target)
        for ids, out in zip(samples, outputs, strict=True):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise DraftsmithError(
                    "vLLM returned no hidden_states_path: this vLLM version does not support the "
                    "extract_hidden_states method with ExampleHiddenStatesConnector",
                    hint="use a vLLM version with hidden-state extraction (docs: features/speculative_decoding/"
                    "extract_hidden_states), or backend: transformers",
                )
            data = _load_hidden_states(path)
            states, token_ids = data["hidden_states"], data["token_ids"]
            n = len(ids)
            if states.shape[0] < n or not torch.equal(token_ids[:n].long().cpu(), ids.long().cpu()):
                raise DraftsmithError(
                    f"vLLM stored the hidden states of other tokens than it was given ({path}: {states.shape[0]} "
                    f"tokens, expected the {n} of the sample)",
                    hint="use backend: transformers, and report the vLLM version",
                )
            states = states[:n].cpu()
            aux = states[:, :-1].reshape(n, -1)
            with torch.no_grad():
                last = norm(states[:, -1].to(norm.weight.device, norm.weight.dtype))
            yield aux, last

    def _features_engine(self, layer_ids: tuple[int, ...]):
        if self._extractor is not None and self._extractor_layers == layer_ids:
            return self._extractor
        self._free_generator()
        self._free_extractor()
        from vllm.config import KVTransferConfig

        self._tmp = tempfile.mkdtemp(prefix="draftsmith-vllm-hs-", dir=self.hidden_states_dir)
        capture = [*layer_ids, self.target.num_layers]  # + the last layer's output, normed by us
        self._extractor = self._engine(
            enable_chunked_prefill=False,  # required by hidden-state extraction
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture}},
            },
            kv_transfer_config=KVTransferConfig(
                kv_connector="ExampleHiddenStatesConnector",
                kv_role="kv_producer",
                kv_connector_extra_config={"shared_storage_path": self._tmp},
            ),
        )
        self._extractor_layers = layer_ids
        return self._extractor

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "vllm": getattr(self.vllm, "__version__", "unknown"),
            "torch": torch.__version__,
            "model": self.model_path,
            "dtype": self.options.get("dtype", self.dtype),
            "options": {k: v for k, v in self.options.items() if isinstance(v, str | int | float | bool)},
        }

    def close(self) -> None:
        self._free_generator()
        self._free_extractor()

    def _free_generator(self) -> None:
        if self._llm is not None:
            self._llm = None
            _release_gpu()

    def _free_extractor(self) -> None:
        if self._extractor is not None:
            self._extractor = None
            _release_gpu()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _load_hidden_states(path: str) -> dict[str, torch.Tensor]:
    """Read one request's file (waiting for vLLM's asynchronous write where the version has one), then delete it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
    except ImportError:  # versions that wrote the file before returning the output
        from safetensors.torch import load_file

        data = load_file(path, device="cpu")
    else:
        data = load_hidden_states(path)
    for leftover in (path, path + ".lock"):
        if os.path.exists(leftover):
            os.remove(leftover)
    return data


def _final_norm(target: Target) -> torch.nn.Module:
    base = getattr(target.model, target.model.base_model_prefix, target.model)
    norm = getattr(base, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise TargetError(
            f"cannot find the final norm of {type(target.model).__name__} (`{target.model.base_model_prefix}.norm`)",
            hint="the vllm backend supports Llama-style targets; use backend: transformers for this one",
        )
    return norm


def _release_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
