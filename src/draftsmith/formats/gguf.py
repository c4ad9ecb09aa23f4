"""`draftsmith export --format gguf`: an EAGLE-3 or DFlash drafter and its target as GGUF files `llama-server`
serves.

The drafter goes through llama.cpp's own converter, never a GGUF writer of ours: first the speculators export
(EAGLE-3, read as `Eagle3Speculator`/`Eagle3DraftModel`) or z-lab's layout (DFlash, `DFlashDraftModel`), then
`convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET`, which takes the tokenizer and vocabulary size from the
target. llama.cpp reads `eagle_aux_hidden_state_layer_ids` as inputs of layers (it captures the layer inputs), our
convention, and z-lab's `target_layer_ids` as outputs (it adds one), z-lab's.

The target is converted by the same converter at the precision it will be served (`f32`, `bf16`, `q8_0`), or, for
a built-in target, `q4_1` is the GGUF file it ships as. Target GGUFs are cached (they are large and the same for
every drafter) and linked into the export directory.

llama.cpp's EAGLE-3 layer knows `norm_before_residual` and `norm_before_fc`; a drafter with another layer variant
(`fc_norm`, `norm_output`, `qk_norm`, a sliding window) would load and silently draft wrong, so it is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

from draftsmith.drafters.eagle3 import read_config, resolve_checkpoint
from draftsmith.engines.llamacpp import LlamaCpp, installed, run_converter
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.formats.card import render_card, render_dflash_card
from draftsmith.formats.common import CARD_FILE, CONFIG_FILE, PROVENANCE_KEY
from draftsmith.target import BUILTIN_TARGETS, builtin_gguf, cache_dir, hf_dir
from draftsmith.util import claim_dir

DRAFTER_FILE = "drafter.gguf"
SPECULATORS_DIR = "speculators"
ZLAB_DIR = "zlab"
TARGET_TYPES = ("f32", "bf16", "q8_0", "q4_1")  # q4_1: the built-in target's own GGUF file
DRAFTER_TYPES = ("f32", "bf16", "f16", "q8_0")
UNSUPPORTED = ("fc_norm", "norm_output", "qk_norm", "sliding_window")  # variants llama.cpp's EAGLE-3 lacks


def export_gguf(
    source: str | Path,
    out: str | Path,
    *,
    target: str | None = None,
    target_type: str | None = "f32",
    drafter_type: str = "f32",
    store: str | Path | None = None,
    report: str | Path | None = None,
    speculative_tokens: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `out/drafter.gguf` (and `out/target-<type>.gguf` unless `target_type` is None), the layout export they
    came from (speculators' for EAGLE-3, z-lab's for DFlash) and a model card with the `llama-server` command;
    returns `out`."""
    from draftsmith.formats.export import export
    from draftsmith.formats.load import is_dflash, read_dflash

    if drafter_type not in DRAFTER_TYPES:
        raise ConfigError(f"unknown drafter GGUF type {drafter_type!r}", hint=f"use one of {', '.join(DRAFTER_TYPES)}")
    dflash = is_dflash(source)
    if dflash:
        config = read_dflash(source)[0]
    else:
        ckpt = resolve_checkpoint(source)
        config = read_config(ckpt)
        check_supported(config.variant(), ckpt)
    target = target or config.target
    lc = installed()
    target_dir = hf_dir(target)
    out = Path(out)
    claim_dir(out, "gguf", overwrite=overwrite)
    layout, fmt = (ZLAB_DIR, "zlab") if dflash else (SPECULATORS_DIR, "speculators")
    layout_dir = export(source, out / layout, fmt, verifier=str(target_dir), store=store, report=report,
                        speculative_tokens=speculative_tokens)  # fmt: skip
    drafter = out / DRAFTER_FILE
    convert(lc, layout_dir, drafter, drafter_type, target_dir)
    served = None
    if target_type is not None:
        served = _link(target_gguf(target, target_type, lc), out / f"target-{target_type}.gguf")
    cfg = json.loads((layout_dir / CONFIG_FILE).read_text())
    prov = cfg[PROVENANCE_KEY] | {"format": "gguf", "gguf_drafter_type": drafter_type, "gguf_target_type": target_type}
    served_name = str(served.resolve() if served else "TARGET.gguf")
    if dflash:
        card = render_dflash_card("gguf", config, prov, served_name, out.resolve())
    else:
        card = render_card("gguf", config, prov, cfg, served_name, out.resolve())
    (out / CARD_FILE).write_text(card)
    return out


def check_supported(variant: dict, where: Path) -> None:
    bad = sorted(k for k in variant if k in UNSUPPORTED)
    if bad:
        raise DraftsmithError(
            f"{where}: llama.cpp's EAGLE-3 layer cannot run the layer variant {', '.join(bad)}",
            hint="llama.cpp supports norm_before_residual and norm_before_fc only; export --format speculators for "
            "vLLM instead, or train without these switches",
        )


def convert(lc: LlamaCpp, model_dir: Path, outfile: Path, outtype: str, target_dir: Path | None = None) -> Path:
    """One run of llama.cpp's converter into `outfile` (atomically: a temp name renamed into place)."""
    outfile = outfile.resolve()
    tmp = outfile.with_name(f".{outfile.name}.tmp{os.getpid()}")
    args = [str(model_dir.resolve()), "--outfile", str(tmp), "--outtype", outtype]
    if target_dir is not None:
        args += ["--target-model-dir", str(target_dir.resolve())]
    try:
        run_converter(lc, args, outfile.with_suffix(".convert.log"))
        os.replace(tmp, outfile)
    finally:
        tmp.unlink(missing_ok=True)
    return outfile


def target_gguf(target: str, target_type: str, lc: LlamaCpp | None = None) -> Path:
    """The target as a GGUF file of `target_type`: the built-in's own Q4_1 file, else converted once and cached
    (keyed by the HF directory's config and weights' sizes and times, so a changed target is converted again)."""
    if target_type not in TARGET_TYPES:
        raise ConfigError(f"unknown target GGUF type {target_type!r}", hint=f"use one of {', '.join(TARGET_TYPES)}")
    if target_type == "q4_1":
        if target not in BUILTIN_TARGETS:
            raise ConfigError(
                f"q4_1 is the built-in targets' own GGUF file; {target!r} is not built in",
                hint="use f32, bf16 or q8_0 (llama.cpp's `llama-quantize` makes the other types)",
            )
        return builtin_gguf(target)
    directory = hf_dir(target)
    out = cache_dir() / "gguf" / f"{_safe(target)}-{_dir_key(directory)}-{target_type}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"converting {target} to GGUF {target_type} into {out} (once; cached)", flush=True)
        convert(lc or installed(), directory, out, target_type)
    return out


def _dir_key(directory: Path) -> str:
    h = hashlib.sha256(str(directory.resolve()).encode())
    for f in sorted(directory.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[-48:]


def _link(src: Path, dst: Path) -> Path:
    """A hard link where the filesystem allows it (target GGUFs are hundreds of MB), else a copy."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def drafter_gguf(spec: str | Path, out: Path, target: str | None = None) -> Path:
    """A drafter as a GGUF file: a `.gguf` as it is, a `--format gguf` export's drafter.gguf, or a draftsmith run or
    checkpoint exported into `out` (drafter only); `dflash:DIR`, as the other commands name a DFlash run, works too
    (the export tells the two algorithms apart by the directory itself)."""
    path = Path(str(spec).removeprefix("dflash:"))
    if path.suffix == ".gguf" and path.is_file():
        return path
    if (path / DRAFTER_FILE).is_file():
        return path / DRAFTER_FILE
    return export_gguf(path, out, target=target, target_type=None) / DRAFTER_FILE


def architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file (`eagle3`, `dflash`, `llama`, ...): the first key llama.cpp's writer
    puts in the header (magic, version, tensor and key counts, then key, value type 8 = string, value)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:4] != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file", hint="pass a .gguf written by llama.cpp's converter")
    (key_len,) = struct.unpack_from("<Q", head, 24)
    key = head[32 : 32 + key_len].decode(errors="replace")
    (kind, value_len) = struct.unpack_from("<IQ", head, 32 + key_len)
    if key != "general.architecture" or kind != 8:
        raise ConfigError(f"{path}: the GGUF header does not start with general.architecture", hint="re-export it")
    start = 32 + key_len + 12
    return head[start : start + value_len].decode(errors="replace")


def served_target(target: str, spec: str) -> Path:
    """The target GGUF for `--gguf-target`: a `.gguf` file as it is, else `target` at that type."""
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"target GGUF {path} does not exist", hint="pass f32, bf16, q8_0, q4_1 or a .gguf file")
        return path
    return target_gguf(target, spec)
