"""`draftsmith inspect DIR`: what a drafter directory is, on one screen, without loading its target.

For any directory draftsmith reads (EAGLE-3: ours, speculators, SGLang/EAGLE; DFlash: ours, z-lab's): the algorithm,
the target it was made for, its layer ids in draftsmith's numbering and in the engine's, block size or draft length,
draft vocabulary or mask token, parameter count and dtype, what the serving engine must provide, and the commands
that serve it. `--json` prints the same as one object for scripts.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from draftsmith.formats.card import dflash_serve_commands, serve_commands
from draftsmith.formats.common import CONVENTION, SGLANG_CONVENTION, verifier_name
from draftsmith.formats.load import is_dflash, read_dflash, read_drafter, trained_depth
from draftsmith.formats.zlab import CONVENTION as ZLAB_CONVENTION
from draftsmith.formats.zlab import to_zlab_ids

EXPORT_PLACEHOLDER = "EXPORT_DIR"


def _weights_summary(state: dict[str, torch.Tensor]) -> tuple[int, str]:
    """Trainable parameter count (buffers such as d2t/t2d excluded) and the dominant floating dtype."""
    floats = {k: v for k, v in state.items() if v.is_floating_point()}
    dtypes = Counter(str(v.dtype).removeprefix("torch.") for v in floats.values())
    return sum(v.numel() for v in floats.values()), dtypes.most_common(1)[0][0] if dtypes else "unknown"


def describe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    return _describe_dflash(path) if is_dflash(path) else _describe_eagle3(path)


def _describe_dflash(path: Path) -> dict[str, Any]:
    config, state, fmt, notes = read_dflash(path)
    params, dtype = _weights_summary(state)
    verifier = verifier_name(config.target) or "TARGET"
    served = Path(EXPORT_PLACEHOLDER) if fmt == "draftsmith" else path.resolve()
    commands = dflash_serve_commands("zlab" if fmt == "draftsmith" else fmt, verifier, served, config.block_size)
    if fmt == "draftsmith":
        commands.insert(0, f"draftsmith export {path} --format zlab --out {EXPORT_PLACEHOLDER}")
    return {
        "path": str(path),
        "algorithm": "dflash",
        "format": fmt,
        "target": config.target or None,
        "target_fingerprint": config.target_fingerprint or None,
        "target_layers": config.target_num_layers,
        "layer_ids": {
            "draftsmith": list(config.aux_layer_ids),
            "draftsmith_means": CONVENTION,
            "engine": list(config.aux_layer_ids) if fmt == "speculators" else to_zlab_ids(config.aux_layer_ids),
            "engine_means": CONVENTION if fmt == "speculators" else ZLAB_CONVENTION,
        },
        "block_size": config.block_size,
        "draft_tokens": config.draft_tokens,
        "mask_token_id": config.mask_token_id,
        "draft_vocab_size": config.draft_vocab_size,  # draftsmith's engine only; exports use the full head
        "vocab_size": config.vocab_size,
        "draft_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "parameters": params,
        "dtype": dtype,
        "needs": [
            f"the target's hidden states at {len(config.aux_layer_ids)} layers (ids above), for every accepted token",
            "the target's token embeddings and lm_head (not shipped; the drafter has none)",
            f"non-causal attention over a block of {config.block_size} (engine support: SGLang/vLLM DFLASH)",
        ],
        "serve": commands,
        "notes": notes,
    }


def _describe_eagle3(path: Path) -> dict[str, Any]:
    converted = read_drafter(path)
    config, fmt = converted.config, converted.fmt
    params, dtype = _weights_summary(converted.state)
    depth = trained_depth(path)
    k = depth or 3
    verifier = verifier_name(config.target) or "TARGET"
    engine_fmt = "speculators" if fmt == "draftsmith" else fmt
    served = Path(EXPORT_PLACEHOLDER) if fmt == "draftsmith" else path.resolve()
    commands = serve_commands(engine_fmt, verifier, served, k)
    if fmt == "draftsmith":
        commands.insert(0, f"draftsmith export {path} --format speculators --out {EXPORT_PLACEHOLDER}")
    sglang = fmt == "sglang"
    return {
        "path": str(path),
        "algorithm": "eagle3",
        "format": fmt,
        "target": config.target or None,
        "target_fingerprint": config.target_fingerprint or None,
        "target_layers": None,
        "layer_ids": {
            "draftsmith": list(config.aux_layer_ids),
            "draftsmith_means": CONVENTION,
            "engine": [i - 1 for i in config.aux_layer_ids] if sglang else list(config.aux_layer_ids),
            "engine_means": SGLANG_CONVENTION if sglang else CONVENTION,
        },
        "block_size": None,
        "draft_tokens": depth,
        "mask_token_id": None,
        "draft_vocab_size": config.draft_vocab_size,
        "vocab_size": config.vocab_size,
        "draft_layers": 1,
        "hidden_size": config.hidden_size,
        "parameters": params,
        "dtype": dtype,
        "needs": [
            f"the target's hidden states entering layers {list(config.aux_layer_ids)}, for every accepted token",
            "the target's token embeddings (not shipped unless the checkpoint has its own)",
            f"d2t/t2d: a draft vocabulary of {config.draft_vocab_size} of the target's {config.vocab_size} tokens",
        ],
        "serve": commands,
        "notes": converted.notes,
    }


def render(info: dict[str, Any]) -> str:
    """The one-screen text form of `describe`."""
    ids = info["layer_ids"]
    length = (
        f"block size {info['block_size']} ({info['draft_tokens']} draft tokens per round), mask token "
        f"{info['mask_token_id']}"
        if info["algorithm"] == "dflash"
        else f"draft length {info['draft_tokens'] or 'not recorded'} (trained chain depth), draft vocabulary "
        f"{info['draft_vocab_size']} of {info['vocab_size']}"
    )
    lines = [
        f"{info['path']}: {info['algorithm'].upper()} drafter, {info['format']} layout",
        f"  target        {info['target'] or 'not recorded'} (fingerprint {info['target_fingerprint'] or '-'})",
        f"  layer ids     draftsmith {ids['draftsmith']} ({ids['draftsmith_means']})",
        f"                engine     {ids['engine']} ({ids['engine_means']})",
        f"  drafting      {length}",
        f"  model         {info['draft_layers']} layer(s), hidden {info['hidden_size']}, "
        f"{info['parameters']:,} parameters, {info['dtype']}",
        "  needs         " + "\n                ".join(info["needs"]),
        "  serve",
        *(f"    {c}" for c in info["serve"]),
    ]
    lines += [f"  note: {n}" for n in info["notes"]]
    return "\n".join(lines)
