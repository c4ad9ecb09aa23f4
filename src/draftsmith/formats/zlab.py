"""z-lab's DFlash layout (`dflash` on PyPI, the published `*-DFlash-*` checkpoints), both ways.

    config.json   a Qwen3 config for the draft layers (`num_hidden_layers` = draft layers), `architectures:
                  ["DFlashDraftModel"]`, `num_target_layers`, `block_size` (top level in older checkpoints) and
                  `dflash_config: {block_size, mask_token_id, target_layer_ids}`
    weights       `layers.*`, `fc`, `hidden_norm`, `norm`: our names already; no embeddings and no head (the
                  target's are used)

Layer ids: z-lab's id i is the *output* of decoder layer i, `hidden_states[i + 1]`; ours is the input of layer i,
`hidden_states[i]`. So ours = theirs + 1, converted here and nowhere else. A config without `target_layer_ids`
means z-lab's default for its draft depth (`default_layer_ids`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftsmith.drafters.dflash import (
    ENGINE_ONLY,
    FROZEN,
    DFlashConfig,
    DFlashModel,
    check_block_size,
    default_layer_ids,
)
from draftsmith.errors import DraftsmithError
from draftsmith.formats.common import PROVENANCE_KEY, save_weights, write_json

ARCHITECTURE = "DFlashDraftModel"
CONVENTION = "output of decoder layer i = transformers hidden_states[i + 1] (draftsmith id i + 1)"
# Switches of the z-lab code that our drafter does not implement, with the value that means "off".
UNSUPPORTED = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "attention_bias": False,
    "is_causal": None,
    "use_sliding_window": False,
}


def is_zlab(raw: dict[str, Any]) -> bool:
    return any(a.startswith("DFlash") for a in raw.get("architectures") or [])


def to_zlab_ids(ids: tuple[int, ...]) -> list[int]:
    return [i - 1 for i in ids]


def from_zlab_ids(ids: list[int]) -> tuple[int, ...]:
    return tuple(int(i) + 1 for i in ids)


def export_config(config: DFlashConfig, dtype: str, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config.json that `dflash.DFlashDraftModel.from_pretrained` (a Qwen3Config) and SGLang/vLLM read."""
    dflash = {
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": to_zlab_ids(config.aux_layer_ids),
    }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": config.target_num_layers,
        "block_size": config.block_size,
        "dflash_config": dflash,
        "torch_dtype": dtype,
        PROVENANCE_KEY: {
            **(provenance or {}),
            "target": config.target,
            "target_fingerprint": config.target_fingerprint,
            "layer_id_convention": CONVENTION,
            "draftsmith_layer_ids": list(config.aux_layer_ids),
        },
    }


def export(model: DFlashModel, out: Path, dtype: str = "bfloat16", provenance: dict[str, Any] | None = None) -> Path:
    """Write `model` into `out` in z-lab's layout (weights in `dtype`)."""
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    state = {k: v.to(torch_dtype) for k, v in model.state_dict().items() if k not in FROZEN + ENGINE_ONLY}
    save_weights(state, out)
    write_json(out / "config.json", export_config(model.config, dtype, provenance))
    return out


def _dflash_value(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    """Newer checkpoints keep the DFlash fields in `dflash_config`, older ones at the top level."""
    return (raw.get("dflash_config") or {}).get(key, raw.get(key, default))


def read(raw: dict[str, Any], weights: dict[str, torch.Tensor], where: str) -> tuple[DFlashConfig, dict, list[str]]:
    """A z-lab directory's config + weights as our config, state dict (our names) and notes on the conversion."""
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise DraftsmithError(
            f"{where}: architecture {raw.get('architectures')} is not supported (only {ARCHITECTURE})",
            hint="DFlash2 drafters (convolutions, candidate selector) are not implemented by draftsmith",
        )
    for key, off in UNSUPPORTED.items():
        value = _dflash_value(raw, key, off)
        if value != off and value is not None:
            raise DraftsmithError(
                f"{where}: {key} = {value!r} is not supported (draftsmith runs the plain DFlash layer)",
                hint="use a DFlash drafter without this option",
            )
    layers = raw.get("num_hidden_layers")
    depth = raw.get("num_target_layers")
    mask = _dflash_value(raw, "mask_token_id")
    if layers is None or depth is None or mask is None:
        raise DraftsmithError(
            f"{where}: a DFlash config needs num_hidden_layers, num_target_layers and dflash_config.mask_token_id",
            hint="the config.json is incomplete; compare with a published DFlash checkpoint",
        )
    zlab_ids = _dflash_value(raw, "target_layer_ids")
    notes = [f"z-lab layer ids are outputs of layer i; draftsmith ids = z-lab ids + 1 ({CONVENTION})"]
    if zlab_ids is None:
        ids = default_layer_ids(depth, layers)
        notes.append(f"no target_layer_ids: z-lab's default for {layers} draft layers over {depth}: {ids}")
    else:
        ids = from_zlab_ids(zlab_ids)
    block_size = check_block_size(int(_dflash_value(raw, "block_size", 16)))
    rope = raw.get("rope_parameters") or {}
    heads = raw["num_attention_heads"]
    provenance = raw.get(PROVENANCE_KEY) or {}
    config = DFlashConfig(
        hidden_size=raw["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        vocab_size=raw["vocab_size"],
        num_layers=layers,
        target_num_layers=depth,
        aux_layer_ids=ids,
        block_size=block_size,
        mask_token_id=int(mask),
        target=provenance.get("target", ""),
        target_fingerprint=provenance.get("target_fingerprint", ""),
    )
    state = {k: v for k, v in weights.items() if k not in FROZEN}
    return config, state, notes
