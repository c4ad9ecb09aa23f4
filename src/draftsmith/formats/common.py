"""What every export/import format shares: the converted drafter, weight files, layer-id conventions, provenance.

A foreign directory is converted into a `Converted`: our `Eagle3Config` plus a state dict under *our* parameter
names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, and `embed_tokens.weight` only when the checkpoint
carries its own embeddings). Exports go the other way from the same pair, so one set of names is the pivot.

Layer ids. draftsmith id i is the residual stream *entering* decoder layer i (0 = embedding output), i.e.
transformers' `hidden_states[i]`. vLLM reads `eagle_aux_hidden_state_layer_ids` the same way (it captures
`hidden_states + residual` before running layer i). SGLang, and SpecForge which trains for it, mean *the output of
layer j* and add 1 before capturing; since SGLang PR #25454 it adds 1 only when the first id is 1, and reads other
lists as inputs. `SGLANG_RULE` below is that newer rule; ids whose first entry is 1 read the same under both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.errors import DraftsmithError
from draftsmith.util import commit_file, temp_path, write_atomic

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
PROVENANCE_KEY = "draftsmith"  # our block inside a foreign config.json: origin, convention, fingerprints
CONVENTION = "input of decoder layer i (0 = embedding output) = transformers hidden_states[i]"
SGLANG_CONVENTION = "output of decoder layer j (= input of layer j+1); SGLang adds 1 before capturing"
SGLANG_RULE = "SGLang adds 1 to the ids only when the first id is 1 (PR #25454); older SGLang always adds 1"
BUILTIN_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}

# Our parameter names (the frozen embeddings appear only when a foreign checkpoint ships its own).
MIDLAYER_KEYS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
OUR_KEYS = ("fc.weight", *(f"midlayer.{k}" for k in MIDLAYER_KEYS), "norm.weight", "lm_head.weight", "d2t", "t2d")
EMBED_KEY = "embed_tokens.weight"


def variant_keys(config: Eagle3Config) -> tuple[str, ...]:
    """The weights a layer variant adds (speculators' names, which are ours): none for the original layer."""
    keys: list[str] = []
    if config.norm_before_fc:
        keys.append("input_norm.weight")
    if config.fc_norm:
        keys += [f"fc_norm.{i}.weight" for i in range(3)]
    if config.qk_norm:
        keys += ["midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight"]
    return tuple(keys)


def required_keys(config: Eagle3Config) -> tuple[str, ...]:
    """Every weight a drafter with this config must ship (all but the frozen embeddings)."""
    return (*OUR_KEYS, *variant_keys(config))


@dataclass
class Converted:
    """A drafter directory read into our names, with how its foreign conventions were interpreted."""

    config: Eagle3Config
    state: dict[str, torch.Tensor]
    fmt: str  # draftsmith | speculators | sglang | eagle
    notes: list[str] = field(default_factory=list)
    raw_config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """The shape of every weight of a drafter with this config, under our names."""
    h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    mid = {
        "input_layernorm.weight": (h,),
        "hidden_norm.weight": (h,),
        "self_attn.q_proj.weight": (heads * d, 2 * h),
        "self_attn.k_proj.weight": (kv * d, 2 * h),
        "self_attn.v_proj.weight": (kv * d, 2 * h),
        "self_attn.o_proj.weight": (h, heads * d),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (config.intermediate_size, h),
        "mlp.up_proj.weight": (config.intermediate_size, h),
        "mlp.down_proj.weight": (h, config.intermediate_size),
    }
    variant = {
        "input_norm.weight": (3 * h,),
        **{f"fc_norm.{i}.weight": (h,) for i in range(3)},
        "midlayer.self_attn.q_norm.weight": (d,),
        "midlayer.self_attn.k_norm.weight": (d,),
    }
    return {
        **{k: variant[k] for k in variant_keys(config)},
        "fc.weight": (h, 3 * h),
        **{f"midlayer.{k}": v for k, v in mid.items()},
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
        EMBED_KEY: (config.vocab_size, h),
    }


def check_state(state: dict[str, torch.Tensor], config: Eagle3Config, where: str) -> None:
    """Every weight present with the shape the config implies; nothing unknown (an engine would skip it silently)."""
    shapes = expected_shapes(config)
    missing = [k for k in required_keys(config) if k not in state]
    unknown = sorted(k for k in state if k not in shapes)
    if missing or unknown:
        raise DraftsmithError(
            f"{where}: "
            + "; ".join(
                part
                for part in (
                    f"missing weights {missing}" if missing else "",
                    f"unknown weights {unknown}" if unknown else "",
                )
                if part
            ),
            hint="the checkpoint is incomplete or uses names this format does not have; "
            "`draftsmith doctor DIR` lists every key",
        )
    wrong = [(k, tuple(v.shape), shapes[k]) for k, v in state.items() if tuple(v.shape) != shapes[k]]
    if wrong:
        key, found, want = wrong[0]
        raise DraftsmithError(
            f"{where}: {key} has shape {found}, its config implies {want}"
            + (f" ({len(wrong) - 1} more)" if len(wrong) > 1 else ""),
            hint="the weights do not belong to this config.json",
        )


def build_config(
    tl: dict[str, Any],
    raw: dict[str, Any],
    state: dict[str, torch.Tensor],
    aux: tuple[int, ...],
    provenance: dict[str, Any],
    where: str,
    variant: dict[str, Any] | None = None,
) -> Eagle3Config:
    """Our config from a Llama-layer description (`tl`), used by both foreign layouts; `variant` sets the layer
    variant fields (`drafters.eagle3.VARIANTS`), already checked by the caller."""
    if len(aux) != 3:
        raise DraftsmithError(
            f"{where}: {len(aux)} aux hidden-state layers {list(aux)}; draftsmith's EAGLE-3 fuses exactly 3",
            hint="only 3-layer EAGLE-3 drafters can be imported",
        )
    try:
        hidden, heads = int(tl["hidden_size"]), int(tl["num_attention_heads"])
        rope = tl.get("rope_parameters") or {}
        vocab = tl.get("vocab_size") or raw.get("vocab_size")
        if "t2d" in state:
            vocab = state["t2d"].shape[0]
        return Eagle3Config(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(tl.get("num_key_value_heads") or heads),
            head_dim=int(tl.get("head_dim") or hidden // heads),
            intermediate_size=int(tl["intermediate_size"]),
            rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", tl.get("rope_theta", 10000.0))),
            max_position_embeddings=int(tl.get("max_position_embeddings", 2048)),
            vocab_size=int(vocab),
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            aux_layer_ids=aux,
            target=str(provenance.get("target") or verifier_of(raw) or ""),
            target_fingerprint=str(provenance.get("target_fingerprint") or ""),
            **(variant or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftsmithError(
            f"{where}: config.json lacks or mangles a field draftsmith needs ({exc})",
            hint="compare it with a config.json that `draftsmith export` writes",
        ) from None


def verifier_of(raw: dict[str, Any]) -> str | None:
    return ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def identity_vocab(state: dict[str, torch.Tensor], config: Eagle3Config) -> dict[str, torch.Tensor]:
    """A full-vocabulary drafter may ship without d2t/t2d: the identity mapping."""
    if "d2t" not in state and "t2d" not in state and config.draft_vocab_size == config.vocab_size:
        state = state | {
            "d2t": torch.zeros(config.draft_vocab_size, dtype=torch.long),
            "t2d": torch.ones(config.vocab_size, dtype=torch.bool),
        }
    return state


# ------------------------------------------------------------------------------------------------ layer ids


def to_sglang_ids(ids: tuple[int, ...] | list[int]) -> list[int]:
    """Our ids (input of layer i) as SGLang's explicit ids (output of layer j = input of layer j+1)."""
    return [i - 1 for i in ids]


def from_native_ids(ids: list[int], convention: str | None) -> tuple[tuple[int, ...], str]:
    """`eagle_config` ids of a native (SGLang/EAGLE) directory in our convention, and a note saying how we read them.

    `convention` is what our own export recorded ("output" or "input"); without it we apply SGLang's current rule.
    """
    if convention == "output" or (convention is None and ids and ids[0] == 1):
        return tuple(i + 1 for i in ids), f"eagle_config ids {ids} read as outputs of layers (SGLang): +1"
    how = "as recorded by draftsmith" if convention == "input" else f"by SGLang's rule ({SGLANG_RULE})"
    return tuple(ids), f"eagle_config ids {ids} read as inputs of layers, {how}"


def default_ids(num_layers: int | None, where: str) -> tuple[int, int, int]:
    """The engines' default when a checkpoint names no aux layers: inputs of layers (2, N//2, N-3)."""
    if num_layers is None:
        raise DraftsmithError(
            f"{where} names no aux layer ids; the default (2, N//2, N-3) needs the target's layer count",
            hint="load it with a target (`draftsmith eval --target ...`, `draftsmith doctor --target ...`)",
        )
    return (2, num_layers // 2, num_layers - 3)


# ------------------------------------------------------------------------------------------------ files


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DraftsmithError(f"{path} not found", hint="pass a drafter directory with a config.json") from None
    except json.JSONDecodeError as exc:
        raise DraftsmithError(f"{path} is not valid JSON: {exc}", hint="the file is damaged") from None
    if not isinstance(data, dict):
        raise DraftsmithError(f"{path}: expected a JSON object, found {type(data).__name__}", hint="")
    return data


# The largest drafter a config may describe: far above any real EAGLE-3 head (one layer), far below what would
# exhaust memory when a damaged or hostile config.json is read. Checked before anything is allocated.
SIZE_LIMITS = {
    "hidden_size": 1 << 16,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 11,
    "intermediate_size": 1 << 18,
    "vocab_size": 1 << 22,
    "draft_vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24,
}
MAX_ELEMENTS = 1 << 33  # all weights together


def check_sizes(config: Eagle3Config, where: str) -> None:
    """Refuse a config whose sizes are zero, negative, inconsistent or absurd, before any tensor is built."""
    for name, limit in SIZE_LIMITS.items():
        value = getattr(config, name)
        if not 1 <= value <= limit:
            raise DraftsmithError(
                f"{where}: {name} is {value}; expected 1 to {limit}",
                hint="the config.json is damaged or not a drafter's",
            )
    if config.num_attention_heads % config.num_key_value_heads:
        raise DraftsmithError(
            f"{where}: num_attention_heads {config.num_attention_heads} is not a multiple of num_key_value_heads "
            f"{config.num_key_value_heads}",
            hint="the config.json is damaged or not a drafter's",
        )
    if config.draft_vocab_size > config.vocab_size:
        raise DraftsmithError(
            f"{where}: draft_vocab_size {config.draft_vocab_size} exceeds vocab_size {config.vocab_size}",
            hint="the config.json is damaged or not a drafter's",
        )
    total = sum(math.prod(shape) for shape in expected_shapes(config).values())
    if total > MAX_ELEMENTS:
        raise DraftsmithError(
            f"{where}: the config describes {total:,} weights; the limit is {MAX_ELEMENTS:,}",
            hint="the config.json is damaged or not a drafter's",
        )


def load_weights(directory: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: model.safetensors, a sharded safetensors index, or pytorch_model.bin.
    With `meta`, only the file headers are read: tensors on the meta device (names, shapes, dtypes, no data)."""
    single = directory / WEIGHTS_FILE
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = sorted({directory / f for f in read_json(index).get("weight_map", {}).values()})
    elif (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=meta)
        return {k: v.to("meta") for k, v in state.items()} if meta else state
    else:
        raise DraftsmithError(
            f"{directory} has no weights: expected {WEIGHTS_FILE}, model.safetensors.index.json or pytorch_model.bin",
            hint="pass the directory that holds the drafter's weights",
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if meta:
                    piece = f.get_slice(k)
                    state[k] = torch.empty(piece.get_shape(), dtype=_DTYPES[piece.get_dtype()], device="meta")
                else:
                    state[k] = f.get_tensor(k)
    return state


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # fmt: skip


def save_weights(state: dict[str, torch.Tensor], directory: Path) -> None:
    tmp = temp_path(directory / WEIGHTS_FILE)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    commit_file(tmp, directory / WEIGHTS_FILE)


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def verifier_name(target: str) -> str:
    """What an engine should load as the target: the hub id of a built-in, the absolute path of a directory."""
    if target in BUILTIN_HUB_IDS:
        return BUILTIN_HUB_IDS[target]
    return str(Path(target).resolve()) if target and Path(target).exists() else target


def verifier_config(target: str) -> dict[str, Any]:
    """The target's config.json where it can be read without a download ({} otherwise)."""
    if target in BUILTIN_HUB_IDS:
        return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2}  # SmolLM2's
    path = Path(target) / CONFIG_FILE
    if path.is_file():
        return read_json(path)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(target, local_files_only=True).to_dict()
    except (OSError, ValueError):
        return {}
