"""`draftsmith export`: a trained EAGLE-3 checkpoint as a directory vLLM or SGLang loads, or a DFlash checkpoint in
z-lab's layout (SGLang, vLLM, the `dflash` package), with a model card.

The directory is built under a temporary name and renamed into place, so a crash never leaves a half export that
looks whole. Every export carries a `draftsmith` block in its config.json (source checkpoint, target fingerprint,
the aux layer ids in our convention and what the engine ids mean, data, training budget, measured acceptance):
engines ignore unknown config keys, and `doctor` and the importer use it to tell a shifted id from a convention.
"""

from __future__ import annotations

import json
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from draftsmith.drafters.eagle3 import read_config, resolve_checkpoint
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.formats import sglang, speculators, zlab
from draftsmith.formats.card import render_card, render_dflash_card
from draftsmith.formats.common import (
    CARD_FILE,
    CONFIG_FILE,
    CONVENTION,
    SGLANG_CONVENTION,
    WEIGHTS_FILE,
    load_weights,
    save_weights,
    verifier_config,
    verifier_name,
    write_json,
)
from draftsmith.train.metrics import read_jsonl
from draftsmith.util import crash_point, dir_owner, fsync_tree, recover_swap, swap_dirs, sweep_temp, temp_path

FORMATS = ("speculators", "sglang", "eagle", "zlab")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export(
    source: str | Path,
    out: str | Path,
    fmt: str = "speculators",
    *,
    verifier: str | None = None,
    store: str | Path | None = None,
    report: str | Path | None = None,
    speculative_tokens: int | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Write `out` in `fmt` from a draftsmith checkpoint or training run; returns `out`.

    `verifier` is what the engine loads as the target (default: the hub id of a built-in target, the absolute
    path of a target directory); `store` and `report` (a `draftsmith eval` report.json) fill in the model card.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}", hint=f"use one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"unknown export dtype {dtype!r}", hint=f"use one of {', '.join(DTYPES)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_swap(out)
    sweep_temp(out.parent, prefix=f".{out.name}.")
    _check_out(out, overwrite)  # before any work
    from draftsmith.formats.load import is_dflash

    tmp = temp_path(out)
    write = _write_dflash if is_dflash(source) or fmt == "zlab" else _write_eagle3
    try:
        write(source, tmp, out, fmt, verifier, store, report, speculative_tokens, dtype)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_tree(tmp)
    crash_point("export-built")
    swap_dirs(tmp, out)  # `out` holds the old export or the new one, whole, at every moment
    crash_point("export-swapped")
    shutil.rmtree(tmp, ignore_errors=True)  # now the old export, if there was one
    return out


def _write_eagle3(
    source: str | Path,
    tmp: Path,
    out: Path,
    fmt: str,
    verifier: str | None,
    store: str | Path | None,
    report: str | Path | None,
    speculative_tokens: int | None,
    dtype: str,
) -> None:
    """An EAGLE-3 checkpoint or run into `tmp` in `fmt`, with its card (which names `out`, where it will live)."""
    ckpt = resolve_checkpoint(source)
    config = read_config(ckpt)
    state = load_weights(ckpt)
    state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    training = training_summary(ckpt)
    k = speculative_tokens or (training or {}).get("ttt_steps") or 3
    target_config = verifier_config(verifier or config.target)
    verifier = verifier or verifier_name(config.target)
    provenance = {
        "format": fmt,
        "exported_by": f"draftsmith {version('draftsmith')}",
        "source_checkpoint": str(ckpt.resolve()),
        "target": config.target,
        "target_fingerprint": config.target_fingerprint,
        "aux_layer_ids": list(config.aux_layer_ids),
        "aux_layer_convention": CONVENTION,
        "aux_layer_ids_mean": "output" if fmt == "sglang" else "input",
        "engine_aux_layer_convention": SGLANG_CONVENTION if fmt == "sglang" else CONVENTION,
        "speculative_tokens": k,
        "store": store_summary(Path(store)) if store else None,
        "training": training,
        "acceptance": acceptance_summary(Path(report)) if report else None,
    }
    if fmt == "speculators":
        cfg = speculators.export_config(config, verifier, target_config, k, dtype, provenance)
        weights = speculators.export_state(state)
    else:
        cfg = sglang.export_config(config, fmt, dtype, provenance)
        weights = sglang.export_state(state)

    tmp.mkdir()
    save_weights(weights, tmp)
    write_json(tmp / CONFIG_FILE, cfg)
    (tmp / CARD_FILE).write_text(render_card(fmt, config, provenance, cfg, verifier, out.resolve()))


def _write_dflash(
    source: str | Path,
    tmp: Path,
    out: Path,
    fmt: str,
    verifier: str | None,
    store: str | Path | None,
    report: str | Path | None,
    speculative_tokens: int | None,
    dtype: str,
) -> None:
    """A DFlash checkpoint or run into `tmp` in z-lab's layout (what SGLang, vLLM and z-lab's `dflash` read) or
    speculators' DFlash layout (vLLM, the speculators library), with its card. A block drafts B-1 tokens, so
    `speculative_tokens` has no say."""
    from draftsmith.drafters.dflash import ENGINE_ONLY, DFlashModel
    from draftsmith.drafters.dflash import FROZEN as FROZEN_DFLASH
    from draftsmith.formats.load import is_dflash, read_dflash

    if not is_dflash(source):
        raise ConfigError(f"{source} is not a DFlash drafter", hint="--format zlab exports DFlash runs only")
    if fmt not in ("zlab", "speculators"):
        raise ConfigError(
            f"a DFlash drafter exports as zlab or speculators, not {fmt!r}",
            hint="use --format zlab (z-lab's layout: SGLang, vLLM) or --format speculators (vLLM)",
        )
    config, state, _, _ = read_dflash(source)
    ckpt = resolve_checkpoint(source) if (Path(source) / "latest").is_file() else Path(source)
    training = training_summary(ckpt)
    verifier = verifier or verifier_name(config.target)
    provenance = {
        "format": fmt,
        "exported_by": f"draftsmith {version('draftsmith')}",
        "source_checkpoint": str(ckpt.resolve()),
        "store": store_summary(Path(store)) if store else None,
        "training": training,
        "acceptance": acceptance_summary(Path(report)) if report else None,
    }
    model = DFlashModel(config.model_copy(update={"draft_vocab_size": None}))  # engines decode with the full head
    model.load_state_dict({k: v for k, v in state.items() if k not in ENGINE_ONLY}, strict=False)
    if fmt == "zlab":
        zlab.export(model, tmp, dtype, provenance)
    else:
        tmp.mkdir(parents=True)
        state = {k: v.to(DTYPES[dtype]) for k, v in model.state_dict().items() if k not in FROZEN_DFLASH}
        save_weights(state, tmp)
        raw = speculators.dflash_export_config(config, verifier, verifier_config(config.target), dtype, provenance)
        write_json(tmp / CONFIG_FILE, raw)
    (tmp / CARD_FILE).write_text(render_dflash_card(fmt, config, provenance, verifier, out.resolve()))


EXPORT_FILES = {CONFIG_FILE, CARD_FILE, WEIGHTS_FILE}


def _check_out(out: Path, overwrite: bool) -> None:
    """Replace only an empty directory or an earlier export holding nothing but what an export writes."""
    if not out.exists() or overwrite and out.is_dir():
        return
    if not out.is_dir():
        raise DraftsmithError(f"{out} exists and is not a directory", hint="pick a new --out")
    names = {p.name for p in out.iterdir()}
    if not names:
        return
    owner = dir_owner(out)
    foreign = sorted(names - EXPORT_FILES)
    if owner == "export" and not foreign:
        return
    what = (
        f"the output of the {owner} stage"
        if owner not in (None, "export")
        else f"files an export does not write ({', '.join(foreign[:3])})"
        if owner == "export"
        else "files draftsmith did not write"
    )
    raise DraftsmithError(
        f"{out} holds {what}: it is not an earlier draftsmith export, the only directory export replaces",
        hint="pick a new --out, or pass --overwrite to replace that directory",
    )


def training_summary(ckpt: Path) -> dict[str, Any] | None:
    """Steps, batch, TTT depth and the last validation metrics of the run that wrote `ckpt`, where recorded."""
    state_file = ckpt / "trainer_state.pt"
    if not state_file.is_file():
        return None
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    cfg = state.get("config", {})
    summary: dict[str, Any] = {
        "steps": int(state.get("step", 0)),
        "batch_size": cfg.get("batch_size"),
        "sequences": int(state.get("step", 0)) * int(cfg.get("batch_size") or 0),
        "max_length": cfg.get("max_length"),
        "ttt_steps": cfg.get("ttt_steps"),
        "algo": cfg.get("algo", "eagle3"),
        "block_size": cfg.get("block_size") if cfg.get("algo") == "dflash" else None,
        "lr": cfg.get("lr"),
        "seed": cfg.get("seed"),
    }
    metrics = ckpt.parent.parent / "metrics.jsonl"
    if metrics.is_file():
        rows = read_jsonl(metrics)
        val = [r for r in rows if r.get("split") == "val" and r.get("step", 0) <= summary["steps"]]
        if val:
            steps = (k for k in val[-1] if k.removeprefix("acc_").isdigit())  # acc_k, not acc_draft_k
            accs = [val[-1][key] for key in sorted(steps, key=_step_of)]
            summary["val_step"] = val[-1]["step"]
            summary["val_acc"] = accs
            summary["val_acceptance_length_estimate"] = expected_acceptance(accs)
    return summary


def _step_of(key: str) -> int:
    return int(key.split("_")[1])


def expected_acceptance(accs: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: tokens per forward if acc_k is P(draft k right | drafts before it right)."""
    total, chain = 1.0, 1.0
    for acc in accs:
        chain *= acc
        total += chain
    return total


def store_summary(path: Path) -> dict[str, Any]:
    from draftsmith.store import HiddenStateStore

    m = HiddenStateStore(path).manifest
    return {
        "path": str(path.resolve()),
        "samples": m.get("samples"),
        "tokens": m.get("tokens"),
        "masked_tokens": m.get("masked_tokens"),
        "dtype": m.get("dtype"),
        "layer_ids": m.get("layer_ids"),
        "layer_convention": m.get("layer_convention"),
        "backend": m.get("backend"),
        "target": m.get("target"),
        "target_fingerprint": m.get("target_fingerprint"),
    }


def acceptance_summary(path: Path) -> dict[str, Any]:
    report_file = path / "report.json" if path.is_dir() else path
    try:
        r = json.loads(report_file.read_text())
        return {
            "report": str(report_file.resolve()),
            "acceptance_length": r["acceptance_length"],
            "acceptance_by_position": r["acceptance_by_position"],
            "dataset": r.get("dataset"),
            "prompts": r.get("prompts"),
            "temperature": r.get("temperature"),
            "num_draft_tokens": r.get("num_draft_tokens"),
            "speedup": r.get("speedup"),
            "drafter_checkpoint": r.get("drafter_checkpoint"),
        }
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise DraftsmithError(
            f"{report_file} is not a `draftsmith eval` report: {exc}",
            hint="pass the report.json (or its directory) that `draftsmith eval --drafter RUN` wrote",
        ) from None
