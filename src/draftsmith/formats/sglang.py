"""The native EAGLE-3 layout (SGLang's `LlamaForCausalLMEagle3`, also what SpecForge and the EAGLE authors publish).

config.json is a one-layer Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`; the weights keep our names (`midlayer.*`, `fc`, `norm`,
`lm_head`, `d2t`, `t2d`), without the frozen embeddings, which the engines share from the target.

The same layout is read by two engines that disagree on what the ids mean (see `formats.common`), so there are two
flavours:

    sglang   ids in SGLang's convention: output of layer j, i.e. our id - 1. `python -m sglang.launch_server`.
             Unambiguous across SGLang versions when the first id is 1 (our first id is 2, the default).
    eagle    ids in vLLM's convention: input of layer i, i.e. our ids. vLLM's native EAGLE-3 loader
             (`vllm serve --speculative-config '{"method": "eagle3", "model": DIR}'`).

Our provenance block records which flavour wrote the ids, so `read` converts our own exports exactly; a foreign
directory is read with SGLang's current rule.

The layout describes the original EAGLE-3 layer only: a drafter with a layer variant (speculators' norm switches,
q/k norms, a sliding window; see `drafters.eagle3`) is refused on export, with `--format speculators` as the way
out, and a native config that declares one is refused on import.
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.errors import DraftsmithError
from draftsmith.formats.common import (
    EMBED_KEY,
    PROVENANCE_KEY,
    Converted,
    build_config,
    default_ids,
    from_native_ids,
    identity_vocab,
    to_sglang_ids,
)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
FLAVOURS = ("sglang", "eagle")


def engine_ids(config: Eagle3Config, flavour: str) -> list[int]:
    """The ids to write into `eagle_config` for this flavour."""
    if flavour == "sglang":
        if 0 in config.aux_layer_ids:
            raise DraftsmithError(
                f"aux layer ids {list(config.aux_layer_ids)} include 0 (the embedding output), which SGLang's "
                "explicit ids cannot name (it would need id -1)",
                hint="export with --format speculators (vLLM), or train with layer ids >= 1",
            )
        return to_sglang_ids(config.aux_layer_ids)
    return list(config.aux_layer_ids)


def export_config(config: Eagle3Config, flavour: str, dtype: str, provenance: dict[str, Any]) -> dict[str, Any]:
    variant = config.variant()
    if variant:
        raise DraftsmithError(
            f"the {flavour} layout cannot express this drafter's layer variant "
            f"{', '.join(f'{k}={v}' for k, v in variant.items())}: its engines run the original EAGLE-3 layer only",
            hint="export with --format speculators (vLLM), or train without the variant",
        )
    return {
        "architectures": [ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.hidden_size,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": engine_ids(config, flavour),
            "use_aux_hidden_state": True,
        },
        PROVENANCE_KEY: provenance,
    }


def export_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != EMBED_KEY}


def is_native(raw: dict[str, Any]) -> bool:
    return bool(set(raw.get("architectures") or []) & set(ARCHITECTURES)) or (
        "draft_vocab_size" in raw and "speculators_model_type" not in raw and "aux_layer_ids" not in raw
    )


def read(raw: dict[str, Any], weights: dict[str, torch.Tensor], num_layers: int | None, where: str) -> Converted:
    """A native EAGLE-3 directory in our names, its aux ids converted to our convention."""
    provenance = raw.get(PROVENANCE_KEY) or {}
    fmt = provenance.get("format") if provenance.get("format") in FLAVOURS else "sglang"
    eagle = raw.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        aux, note = from_native_ids([int(i) for i in ids], provenance.get("aux_layer_ids_mean"))
    else:
        aux = default_ids(num_layers, where)
        note = f"no eagle_aux_hidden_state_layer_ids: the engines' default {list(aux)} (inputs of layers)"
    unsupported = []
    if raw.get("num_hidden_layers", 1) != 1:
        unsupported.append(f"num_hidden_layers={raw.get('num_hidden_layers')}")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            unsupported.append(f"{key}=true")
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if raw.get(key):
            unsupported.append(f"{key}=true")
    if (raw.get("layer_types") or [None])[0] == "sliding_attention" and raw.get("sliding_window"):
        unsupported.append(f"sliding_window={raw['sliding_window']}")
    scaling = raw.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        unsupported.append(f"rope_scaling={scaling}")
    if raw.get("target_hidden_size") not in (None, raw.get("hidden_size")):
        unsupported.append(f"target_hidden_size={raw['target_hidden_size']} != hidden_size={raw.get('hidden_size')}")
    if unsupported:
        raise DraftsmithError(
            f"{where}: this EAGLE-3 variant is not one draftsmith's drafter can run: {', '.join(unsupported)}",
            hint="draftsmith imports Llama-layer EAGLE-3 drafters with plain RoPE and the original norms",
        )
    state = dict(weights)
    config = build_config(raw, raw, state, aux, provenance, where)
    return Converted(config, identity_vocab(state, config), fmt, [note], raw, provenance)
