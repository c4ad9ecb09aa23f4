"""The README.md model card of an export: what it is for, how to serve it, and what it was made from.

The card states the aux-layer convention in both our words and the engine's, the architecture switches, and what a
format cannot express, because the costly failures are the silent ones: a drafter served with the wrong layers or
norms loads fine and just stops being accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.drafters.dflash import DFlashConfig
from draftsmith.drafters.eagle3 import Eagle3Config
from draftsmith.formats.common import CONVENTION, SGLANG_CONVENTION, SGLANG_RULE

# Its build leaves llamafile's sgemm out, so verify batches round as the one-token decode (near-ties included); a
# llama.cpp built with its defaults can write another token than it would without the drafter where the target's
# top two logits all but tie.
LLAMACPP_BUILD = (
    "make llamacpp  # builds llama-server once (-DGGML_LLAMAFILE=OFF: output identical to serving without the "
    "drafter); `draftsmith llamacpp path` prints where"
)


def llama_server_command(target_gguf: str, drafter_gguf: str, k: int, threads: int = 2, algo: str = "eagle3") -> str:
    """The `llama-server` command that serves a drafter GGUF (EAGLE-3, or DFlash with k = block size - 1) beside
    its target (flags of llama.cpp 11434's common/arg.cpp); `--spec-draft-p-min 0` drafts the full chain or block,
    as the drafter was measured."""
    return (
        f"llama-server -m {target_gguf} -md {drafter_gguf} --spec-type draft-{algo} --spec-draft-n-max {k} "
        f"--spec-draft-p-min 0 -t {threads} --host 127.0.0.1 --port 8080"
    )


def serve_commands(fmt: str, verifier: str, out: Path, k: int) -> list[str]:
    if fmt == "gguf":
        return [
            LLAMACPP_BUILD,
            llama_server_command(verifier, str(out / "drafter.gguf"), k),
        ]
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": k})
    vllm = f"vllm serve {verifier} --speculative-config '{spec}'"
    if fmt == "speculators":
        return [f"vllm serve {out}", vllm]
    if fmt == "eagle":
        return [vllm]
    return [
        f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {out} --speculative-num-steps {k} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {k + 1}"
    ]


def render_card(
    fmt: str, config: Eagle3Config, prov: dict[str, Any], engine_config: dict[str, Any], verifier: str, out: Path
) -> str:
    k = prov["speculative_tokens"]
    engine_ids = (
        engine_config.get("eagle_aux_hidden_state_layer_ids")
        or engine_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    ours = list(config.aux_layer_ids)
    engine = {"speculators": "vLLM", "eagle": "vLLM (native EAGLE-3 loader)", "sglang": "SGLang",
              "gguf": "llama.cpp (llama-server)"}[fmt]  # fmt: skip
    checked = out / "speculators" if fmt == "gguf" else out
    lines = [
        f"# EAGLE-3 drafter for {config.target or verifier}",
        "",
        f"Exported by {prov['exported_by']} in the `{fmt}` layout for {engine}, from `{prov['source_checkpoint']}`.",
        "",
        "## Serve it",
        "",
        "```bash",
        *serve_commands(fmt, verifier, out, k),
        "```",
        "",
        f"Check it first: `draftsmith doctor {checked} --target {config.target or verifier}` (add `--store STORE` to "
        "compare the target's hidden states with the ones it was trained on).",
        "",
        "## Target and hidden states",
        "",
        f"- target: `{config.target}` (draftsmith fingerprint `{config.target_fingerprint or 'unknown'}`), "
        f"served as `{verifier}`",
        f"- hidden size {config.hidden_size}, {config.num_attention_heads} heads ({config.num_key_value_heads} KV), "
        f"target vocabulary {config.vocab_size}, draft vocabulary {config.draft_vocab_size} (`d2t`: target id = "
        "draft id + d2t[draft id]; `t2d`: mask of the target ids in the draft vocabulary)",
        f"- aux hidden states: draftsmith layer ids {ours}, meaning the {CONVENTION}",
        f"- in config.json: `eagle_aux_hidden_state_layer_ids` = {engine_ids}, in {engine}'s convention: "
        + (f"the {SGLANG_CONVENTION}" if fmt == "sglang" else f"the {CONVENTION} (the same ids)"),
    ]
    if fmt == "sglang":
        lines.append(
            f"- {SGLANG_RULE}. "
            + (
                "These ids start at 1, so every SGLang version reads them the same way."
                if engine_ids[0] == 1
                else "These ids do not start at 1: SGLang versions disagree on them (`draftsmith doctor` warns). "
                "Prefer the speculators export for vLLM."
            )
        )
        lines.append("- do not serve this directory with vLLM: vLLM reads these ids as inputs of layers (off by one)")
    lines += [
        "",
        "## Architecture",
        "",
        _architecture(config),
        "",
        "Not expressible by these switches, stated here instead: the layer is "
        + ("Qwen3-style (q/k norms" if config.qk_norm else "Llama-style whatever the target's family (no q/k norms")
        + f", no biases, plain RoPE with theta {config.rope_theta:g}"
        + (f", a sliding window of {config.sliding_window} positions" if config.sliding_window else "")
        + "); the token embeddings are the target's own, frozen and not shipped (engines share the target's).",
        "",
        "## Data and training",
        "",
        *_data_lines(prov.get("store")),
        *_training_lines(prov.get("training")),
        "",
        "## Measured acceptance",
        "",
        *_acceptance_lines(prov.get("acceptance"), prov.get("training")),
        "",
        "## Files",
        "",
        *(_gguf_files(prov) if fmt == "gguf" else _files(fmt)),
        "",
    ]
    return "\n".join(lines)


def _files(fmt: str) -> list[str]:
    return [
        "- `config.json`: engine config, plus a `draftsmith` block (provenance; engines ignore it)",
        "- `model.safetensors`: "
        + ("`layers.0.*`" if fmt == "speculators" else "`midlayer.*`")
        + ", `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`",
    ]


def _gguf_files(prov: dict[str, Any]) -> list[str]:
    target = prov.get("gguf_target_type")
    return [
        f"- `drafter.gguf`: the drafter ({prov.get('gguf_drafter_type')}), converted by llama.cpp's "
        "`convert_hf_to_gguf.py speculators --target-model-dir TARGET` (arch `eagle3`; `d2t` as absolute target ids)",
        f"- `target-{target}.gguf`: the target at the precision served"
        if target
        else "- no target GGUF here: `draftsmith export --format gguf --gguf-target f32` writes one (TARGET.gguf)",
        "- `speculators/`: the speculators export the drafter GGUF was converted from (`draftsmith doctor` reads it)",
        "- `*.convert.log`: the converter's output",
    ]


def _data_lines(store: dict[str, Any] | None) -> list[str]:
    if not store:
        return ["- data: not recorded (pass `--store` to `draftsmith export`)"]
    backend = store.get("backend") or {}
    return [
        f"- data: hidden-state store `{store['path']}`: {store['samples']} samples, {store['tokens']} tokens "
        f"({store['masked_tokens']} trained on), stored as {store['dtype']}, extracted with "
        f"{backend.get('name', '?')} {backend.get('transformers', '')} / torch {backend.get('torch', '?')}",
    ]


def _training_lines(training: dict[str, Any] | None) -> list[str]:
    if not training:
        return ["- training budget: not recorded (no trainer_state.pt beside the checkpoint)"]
    if training.get("algo") == "dflash":
        return [
            f"- training budget: {training['steps']} steps x {training['batch_size']} sequences "
            f"({training['sequences']} sequences, up to {training['max_length']} tokens each), DFlash block loss with "
            f"blocks of {training['block_size']}, lr {training['lr']}, seed {training['seed']}"
        ]
    return [
        f"- training budget: {training['steps']} steps x {training['batch_size']} sequences "
        f"({training['sequences']} sequences, up to {training['max_length']} tokens each), training-time test depth "
        f"{training['ttt_steps']}, lr {training['lr']}, seed {training['seed']}"
    ]


def _acceptance_lines(acc: dict[str, Any] | None, training: dict[str, Any] | None) -> list[str]:
    lines = []
    if acc:
        by_pos = ", ".join(f"{p:.2f}" for p in acc["acceptance_by_position"])
        lines.append(
            f"- acceptance length **{acc['acceptance_length']:.2f}** tokens per target forward on "
            f"`{acc['dataset']}` ({acc['prompts']} prompts, T={acc['temperature']}, up to "
            f"{acc['num_draft_tokens']} draft tokens; `draftsmith eval`, {acc['report']})"
        )
        lines.append(f"- P(accepted) by draft position: {by_pos}")
    else:
        lines.append("- not measured: run `draftsmith eval --drafter DIR` and pass its report with `--report`")
    if training and training.get("val_acc"):
        lines.append(
            f"- estimate from validation top-1 agreement at step {training['val_step']}: "
            f"{training['val_acceptance_length_estimate']:.2f} tokens per forward "
            f"(acc_k = {', '.join(f'{a:.2f}' for a in training['val_acc'])})"
        )
    return lines


def _architecture(config: Eagle3Config) -> str:
    """The layer in words, then as speculators' switches."""
    fc = (
        "`input_norm` (one RMSNorm over the 3H features) before `fc`"
        if config.norm_before_fc
        else "one RMSNorm per aux layer (`fc_norm.i`) before `fc`"
        if config.fc_norm
        else "no norm before `fc`"
    )
    residual = "hidden_norm(h)" if config.norm_before_residual else "h itself"
    carried = (
        "the *normed* output (`norm`) is both what `lm_head` reads and"
        if config.norm_output
        else "the final `norm` feeds `lm_head`, and the *pre-norm* output hidden is"
    )
    switches = ", ".join(
        f"`{k}: {str(getattr(config, k)).lower()}`"
        for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    )
    return (
        f"One {'Qwen3' if config.qk_norm else 'Llama'} decoder layer whose attention reads "
        f"cat(input_layernorm(embed(token)), hidden_norm(h)); the residual is {residual}; {fc}; {carried} the next "
        f"draft step's h. As speculators switches: {switches}."
    )


def dflash_serve_commands(fmt: str, verifier: str, out: Path, block_size: int) -> list[str]:
    """SGLang and vLLM commands that serve a DFlash drafter next to its target (speculators' layout: vLLM only; a GGUF
    export: llama-server)."""
    if fmt == "gguf":
        return [
            LLAMACPP_BUILD,
            llama_server_command(verifier, str(out / "drafter.gguf"), block_size - 1, algo="dflash"),
        ]
    spec = json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": block_size - 1})
    if fmt == "speculators":
        return [f"vllm serve {out}", f"vllm serve {verifier} --speculative-config '{spec}'"]
    return [
        f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {block_size}",
        f"vllm serve {verifier} --speculative-config '{spec}'",
    ]


def render_dflash_card(fmt: str, config: DFlashConfig, prov: dict[str, Any], verifier: str, out: Path) -> str:
    """The model card of a DFlash export (z-lab's or speculators' layout)."""
    layout = {
        "zlab": "z-lab's DFlash layout (`DFlashDraftModel`)",
        "speculators": "speculators' DFlash layout",
        "gguf": "GGUF for llama.cpp (`drafter.gguf`, converted by llama.cpp from the z-lab layout in `zlab/`)",
    }[fmt]
    ids = (
        f"`dflash_config.target_layer_ids` = {[i - 1 for i in config.aux_layer_ids]}, z-lab's numbering (output of "
        "decoder layer i)"
        if fmt in ("zlab", "gguf")
        else f"`aux_hidden_state_layer_ids` = {list(config.aux_layer_ids)}, vLLM's numbering (the same as ours)"
    )
    ours = list(config.aux_layer_ids)
    checked = out / "zlab" if fmt == "gguf" else out  # doctor and inspect read the layout llama.cpp converted
    return "\n".join(
        [
            f"# DFlash drafter for {config.target or verifier}",
            "",
            f"Exported by {prov['exported_by']} in {layout}, from `{prov['source_checkpoint']}`.",
            "",
            "## Serve it",
            "",
            "```bash",
            *dflash_serve_commands(fmt, verifier, out, config.block_size),
            "```",
            "",
            f"Check it first: `draftsmith doctor {checked} --target {config.target or verifier}`; "
            f"`draftsmith inspect {checked}` shows this summary.",
            "",
            "## What it is",
            "",
            f"- block size {config.block_size}: each round drafts {config.block_size - 1} tokens in one forward "
            f"(block = [last verified token, mask token {config.mask_token_id} x {config.block_size - 1}])",
            f"- target: `{config.target}` (draftsmith fingerprint `{config.target_fingerprint or 'unknown'}`), "
            f"served as `{verifier}`; the drafter uses the target's embeddings and head (not shipped)",
            f"- target layers: draftsmith ids {ours} ({CONVENTION}); in config.json {ids}",
            f"- {config.num_layers} Qwen3-style decoder layer(s) (q/k norms, no biases, plain RoPE theta "
            f"{config.rope_theta:g}), hidden size {config.hidden_size}, {config.num_attention_heads} heads "
            f"({config.num_key_value_heads} KV), vocabulary {config.vocab_size} (the target's)",
            "",
            "## Data and training",
            "",
            *_data_lines(prov.get("store")),
            *_training_lines(prov.get("training")),
            "",
            "## Measured acceptance",
            "",
            *_acceptance_lines(prov.get("acceptance"), prov.get("training")),
            "",
        ]
    )
