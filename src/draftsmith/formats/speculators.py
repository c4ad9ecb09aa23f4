"""The `speculators` 0.9.0 EAGLE-3 layout, which `vllm serve` loads directly.

config.json is what `Eagle3DraftModel.save_pretrained` writes (field names and defaults from the library's
`Eagle3SpeculatorConfig`, `SpeculatorsConfig`, `VerifierConfig`, `GreedyTokenProposalConfig`), minus `auto_map`,
which points at a config.py that only `trust_remote_code` loaders read. Weights: `layers.0.*` for our `midlayer.*`,
the rest by the same names; no `embed_tokens.weight` (vLLM and speculators take the verifier's embeddings when it is
absent). The speculators library itself also writes the frozen embeddings; `read` accepts them.

The switches are set to what our drafter does: hidden_norm is applied to the attention input only and the residual
is the raw hidden (`norm_before_residual: false` -- vLLM assumes *true* when the field is missing, so it is always
written), no norm before fc (`norm_before_fc`, `fc_norm`: false), and the pre-norm output hidden is fed to the next
draft step (`norm_output: false`). `eagle_aux_hidden_state_layer_ids` is in vLLM's convention, which is ours.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.errors import DraftsmithError
from draftsmith.formats.common import (
    EMBED_KEY,
    PROVENANCE_KEY,
    Converted,
    build_config,
    default_ids,
    identity_vocab,
)

SPECULATORS_VERSION = "0.9.0"
MODEL_TYPE = "eagle3"
# Switch -> the value our drafter needs; any other value is an architecture we cannot run.
SWITCHES = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def to_speculators_key(name: str) -> str:
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def from_speculators_key(name: str) -> str:
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def transformer_layer_config(config: Eagle3Config, target_config: dict[str, Any]) -> dict[str, Any]:
    """A Llama decoder layer shaped like ours: Llama, whatever the target's family, because our layer has no
    q/k norms or biases (Qwen3's layer, speculators' default, has q_norm/k_norm). The token ids are the target's;
    without them the library writes LlamaConfig's defaults (1, 2, null), and so do we."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": target_config.get("bos_token_id", 1),
        "eos_token_id": target_config.get("eos_token_id", 2),
        "pad_token_id": target_config.get("pad_token_id"),
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": config.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": config.vocab_size,
    }


def export_config(
    config: Eagle3Config,
    verifier: str,
    target_config: dict[str, Any],
    speculative_tokens: int,
    dtype: str,
    provenance: dict[str, Any],
) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3DraftModel"],
        "draft_vocab_size": config.draft_vocab_size,
        "dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "embed_requires_grad": False,
        **SWITCHES,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "architectures": list(target_config.get("architectures") or []),
                "name_or_path": verifier or None,
            },
        },
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": transformer_layer_config(config, target_config),
        "transformers_version": transformers.__version__,
        PROVENANCE_KEY: provenance,
    }


def export_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {to_speculators_key(k): v for k, v in state.items() if k != EMBED_KEY}


def read(raw: dict[str, Any], weights: dict[str, torch.Tensor], num_layers: int | None, where: str) -> Converted:
    """A speculators EAGLE-3 directory (config + weights) in our names; fails on switches our drafter lacks."""
    if raw.get("speculators_model_type") != MODEL_TYPE:
        raise DraftsmithError(
            f"{where}: speculators_model_type is {raw.get('speculators_model_type')!r}, draftsmith runs 'eagle3'",
            hint="only EAGLE-3 speculators checkpoints can be imported",
        )
    unsupported = [f"{k}={raw.get(k)}" for k, want in SWITCHES.items() if bool(raw.get(k, want)) != want]
    tl = raw.get("transformer_layer_config") or {}
    if tl.get("model_type", "llama") != "llama":
        unsupported.append(f"transformer_layer_config.model_type={tl.get('model_type')!r} (ours is a Llama layer)")
    if tl.get("num_hidden_layers", 1) != 1:
        unsupported.append(f"num_hidden_layers={tl.get('num_hidden_layers')} (ours has one)")
    for key in ("attention_bias", "mlp_bias"):
        if tl.get(key):
            unsupported.append(f"{key}=true")
    if tl.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={tl.get('hidden_act')!r}")
    rope = tl.get("rope_parameters") or tl.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        unsupported.append(f"rope_type={rope.get('rope_type', rope.get('type'))!r}")
    hidden = tl.get("hidden_size")
    if raw.get("target_hidden_size") not in (None, hidden):
        unsupported.append(f"target_hidden_size={raw['target_hidden_size']} != hidden_size={hidden}")
    if unsupported:
        raise DraftsmithError(
            f"{where}: this EAGLE-3 variant is not one draftsmith's drafter can run: {', '.join(unsupported)}",
            hint="draftsmith imports Llama-layer EAGLE-3 drafters with plain RoPE and the original norms",
        )
    provenance = raw.get(PROVENANCE_KEY) or {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    notes = []
    if ids:
        aux = tuple(int(i) for i in ids)
        notes.append(f"eagle_aux_hidden_state_layer_ids {list(aux)} read as inputs of layers (vLLM's convention)")
    else:
        aux = default_ids(num_layers, where)
        notes.append(f"no eagle_aux_hidden_state_layer_ids: vLLM's default {list(aux)} (inputs of layers)")
    state = {from_speculators_key(k): v for k, v in weights.items()}
    config = build_config(tl, raw, state, aux, provenance, where)
    return Converted(config, identity_vocab(state, config), "speculators", notes, raw, provenance)
