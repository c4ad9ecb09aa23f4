"""The `speculators` 0.9.0 EAGLE-3 layout, which `vllm serve` loads directly.

config.json is what `Eagle3DraftModel.save_pretrained` writes (field names and defaults from the library's
`Eagle3SpeculatorConfig`, `SpeculatorsConfig`, `VerifierConfig`, `GreedyTokenProposalConfig`), minus `auto_map`,
which points at a config.py that only `trust_remote_code` loaders read. Weights: `layers.0.*` for our `midlayer.*`,
the rest by the same names; no `embed_tokens.weight` (vLLM and speculators take the verifier's embeddings when it is
absent). The speculators library itself also writes the frozen embeddings; `read` accepts them.

The switches `norm_before_residual`, `norm_before_fc`, `fc_norm` and `norm_output` are our `Eagle3Config` fields of
the same names and meaning, written always (vLLM assumes `norm_before_residual: true` when the field is missing;
speculators, and so draftsmith, false). `transformer_layer_config` says the rest of the layer: `model_type` llama,
or qwen3 for our `qk_norm` (its q_norm/k_norm), and a sliding window as speculators' training writes it
(`layer_types: [sliding_attention]`, `sliding_window`, `use_sliding_window`). Everything else a speculators config can
say that our layer cannot run (several layers, biases, other activations or layer types, RoPE scaling or partial
rotation, a target hidden size of its own) is refused on import. `eagle_aux_hidden_state_layer_ids` is in vLLM's
convention, which is ours.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from draftsmith.drafters.dflash import FROZEN as DFLASH_FROZEN
from draftsmith.drafters.dflash import DFlashConfig, check_block_size
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.errors import DraftsmithError
from draftsmith.formats.common import (
    EMBED_KEY,
    PROVENANCE_KEY,
    Converted,
    build_config,
    default_ids,
    identity_vocab,
    verifier_config,
)

SPECULATORS_VERSION = "0.9.0"
MODEL_TYPE = "eagle3"
# speculators' top-level switches, each an `Eagle3Config` field of the same name (missing: false, as speculators reads)
SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
LAYER_TYPES = {"llama": False, "qwen3": True}  # transformer_layer_config.model_type -> our qk_norm


def to_speculators_key(name: str) -> str:
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def from_speculators_key(name: str) -> str:
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def transformer_layer_config(config: Eagle3Config, target_config: dict[str, Any]) -> dict[str, Any]:
    """A decoder layer shaped like ours: Llama, whatever the target's family, unless ours has q/k norms (`qk_norm`),
    which is Qwen3's layer. The token ids are the target's; without them the library writes LlamaConfig's defaults
    (1, 2, null), and so do we. As speculators writes its own configs, so that it re-saves ours unchanged."""
    if config.qk_norm:
        layer = _common_layer_fields(config, target_config, bos=None, eos=None) | {
            "layer_types": ["full_attention"],
            "max_window_layers": 28,
            "model_type": "qwen3",
            "sliding_window": None,
            "use_sliding_window": False,
        }
    else:
        layer = llama_layer_config(config, target_config)
    if config.sliding_window is not None:  # as speculators' training writes its default sliding-window layer
        layer |= {"layer_types": ["sliding_attention"], "sliding_window": config.sliding_window}
        layer |= {"use_sliding_window": True}
    return layer


def llama_layer_config(config: Eagle3Config, target_config: dict[str, Any]) -> dict[str, Any]:
    return _common_layer_fields(config, target_config, bos=1, eos=2) | {
        "mlp_bias": False,
        "model_type": "llama",
        "pretraining_tp": 1,
    }


def _common_layer_fields(
    config: Eagle3Config, target_config: dict[str, Any], bos: int | None, eos: int | None
) -> dict[str, Any]:
    """The decoder-layer fields Llama's and Qwen3's configs share; `bos`/`eos` where the target names none."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": target_config.get("bos_token_id", bos),
        "eos_token_id": target_config.get("eos_token_id", eos),
        "pad_token_id": target_config.get("pad_token_id"),
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "num_attention_heads": config.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": config.num_key_value_heads,
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
        **{k: getattr(config, k) for k in SWITCHES},
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
    switches = {k: bool(raw.get(k, False)) for k in SWITCHES}
    unsupported = []
    if switches["norm_before_fc"] and switches["fc_norm"]:
        unsupported.append("norm_before_fc and fc_norm both true (speculators refuses that too)")
    tl = raw.get("transformer_layer_config") or {}
    layer_type = tl.get("model_type", "qwen3")  # speculators reads a layer config without model_type as Qwen3's
    if layer_type not in LAYER_TYPES:
        unsupported.append(
            f"transformer_layer_config.model_type={layer_type!r} (draftsmith runs {' and '.join(LAYER_TYPES)} layers)"
        )
    window = sliding_window(tl, layer_type)
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
    if rope.get("partial_rotary_factor", 1.0) != 1.0 or "mrope_section" in rope:
        unsupported.append("partial or multimodal RoPE (partial_rotary_factor / mrope_section)")
    hidden = tl.get("hidden_size")
    if raw.get("target_hidden_size") not in (None, hidden):
        unsupported.append(f"target_hidden_size={raw['target_hidden_size']} != hidden_size={hidden}")
    if unsupported:
        raise DraftsmithError(
            f"{where}: this EAGLE-3 variant is not one draftsmith's drafter can run: {', '.join(unsupported)}",
            hint="draftsmith imports one-layer Llama/Qwen3 EAGLE-3 drafters with plain RoPE, SiLU and no biases",
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
    if layer_type == "qwen3" and not tl.get("head_dim"):
        tl = tl | {"head_dim": 128}  # Qwen3Config's default
    variant = switches | {"qk_norm": LAYER_TYPES[layer_type], "sliding_window": window}
    config = build_config(tl, raw, state, aux, provenance, where, variant)
    return Converted(config, identity_vocab(state, config), "speculators", notes, raw, provenance)


def sliding_window(tl: dict[str, Any], layer_type: str) -> int | None:
    """The window speculators' Eagle3DraftModel applies to its (first and only) layer, read as transformers builds
    the layer config: `layer_types[0] == "sliding_attention"` with a `sliding_window`; Qwen3Config drops the
    window unless `use_sliding_window`, and derives `layer_types` from `max_window_layers` when they are absent."""
    window = tl.get("sliding_window")
    layer_types = tl.get("layer_types")
    if layer_type == "qwen3":
        window = tl.get("sliding_window", 4096) if tl.get("use_sliding_window", False) else None
        if layer_types is None:
            sliding = window is not None and tl.get("max_window_layers", 28) <= 0
            layer_types = ["sliding_attention" if sliding else "full_attention"]
    if not layer_types or layer_types[0] != "sliding_attention" or window is None:
        return None
    return int(window)


# --- DFlash -----------------------------------------------------------------------------------------------------------
#
# speculators 0.9.0's DFlash layout (`DFlashSpeculatorConfig`, what its `DFlashConverter` writes from z-lab's): the
# body's weights under our (= z-lab's) names; `aux_hidden_state_layer_ids` in vLLM's convention, which is ours (z-lab's
# + 1); a Qwen3 `transformer_layer_config` for the draft layers. With the full vocabulary the embeddings and head are
# the verifier's and not saved. A reduced draft vocabulary (its own lm_head, d2t/t2d) is not supported here.

DFLASH_MODEL_TYPE = "dflash"


def is_dflash(raw: dict[str, Any]) -> bool:
    return raw.get("speculators_model_type") == DFLASH_MODEL_TYPE


def dflash_export_config(
    config: DFlashConfig, verifier: str, target_config: dict[str, Any], dtype: str, provenance: dict[str, Any]
) -> dict[str, Any]:
    layer = _common_layer_fields(config, target_config, bos=None, eos=None) | {
        "layer_types": ["full_attention"] * config.num_layers,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_hidden_layers": config.num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
    }
    return {
        "architectures": ["DFlashDraftModel"],
        "aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "block_size": config.block_size,
        "draft_vocab_size": config.vocab_size,
        "dtype": dtype,
        "mask_token_id": config.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": DFLASH_MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": config.draft_tokens,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "architectures": list(target_config.get("architectures") or []),
                "name_or_path": verifier or None,
            },
        },
        "speculators_model_type": DFLASH_MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "transformers_version": transformers.__version__,
        PROVENANCE_KEY: provenance | {"target": config.target, "target_fingerprint": config.target_fingerprint,
                                      "target_num_layers": config.target_num_layers},
    }  # fmt: skip


def read_dflash(
    raw: dict[str, Any], weights: dict[str, torch.Tensor], where: str
) -> tuple[DFlashConfig, dict[str, torch.Tensor], list[str]]:
    """A speculators DFlash directory as our config, state dict and notes."""
    tl = raw.get("transformer_layer_config") or {}
    vocab = tl.get("vocab_size")
    unsupported = {
        "a reduced draft vocabulary": raw.get("draft_vocab_size") not in (None, vocab) or "lm_head.weight" in weights,
        "sample_from_anchor": bool(raw.get("sample_from_anchor")),
        "sliding-window layers": "sliding_attention" in (tl.get("layer_types") or []),
        "a target hidden size of its own": raw.get("target_hidden_size") not in (None, tl.get("hidden_size")),
        "attention biases": bool(tl.get("attention_bias")),
    }
    for what, present in unsupported.items():
        if present:
            raise DraftsmithError(
                f"{where}: a speculators DFlash drafter with {what} is not supported",
                hint="draftsmith runs the plain full-vocabulary DFlash drafter",
            )
    ids, mask = raw.get("aux_hidden_state_layer_ids"), raw.get("mask_token_id")
    if not ids or mask is None or not tl:
        raise DraftsmithError(
            f"{where}: a speculators DFlash config needs aux_hidden_state_layer_ids, mask_token_id and "
            "transformer_layer_config",
            hint="the config.json is incomplete",
        )
    provenance = raw.get(PROVENANCE_KEY) or {}
    rope = tl.get("rope_parameters") or {}
    heads = tl["num_attention_heads"]
    config = DFlashConfig(
        hidden_size=tl["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=tl.get("num_key_value_heads") or heads,
        head_dim=tl.get("head_dim") or tl["hidden_size"] // heads,
        intermediate_size=tl["intermediate_size"],
        rms_norm_eps=tl.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", tl.get("rope_theta", 10000.0)),
        max_position_embeddings=tl.get("max_position_embeddings", 2048),
        vocab_size=vocab,
        num_layers=tl.get("num_hidden_layers", 1),
        target_num_layers=provenance.get("target_num_layers") or _verifier_depth(raw) or max(ids) + 1,
        aux_layer_ids=tuple(ids),
        block_size=check_block_size(int(raw.get("block_size", 8))),
        mask_token_id=int(mask),
        target=provenance.get("target", ""),
        target_fingerprint=provenance.get("target_fingerprint", ""),
    )
    state = {k: v for k, v in weights.items() if k not in DFLASH_FROZEN and k not in ("d2t", "t2d")}
    note = "speculators aux_hidden_state_layer_ids are vLLM's (inputs of layers): the same as draftsmith's"
    return config, state, [note]


def _verifier_depth(raw: dict[str, Any]) -> int | None:
    """The verifier's layer count where its config can be read without a download."""
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return verifier_config(verifier).get("num_hidden_layers") if verifier else None
