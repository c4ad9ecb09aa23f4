"""The hidden-state store: what `draftsmith extract` writes and what EAGLE-3 training reads.

Layout of a store directory::

    manifest.json             what made the store (target fingerprint, layer ids, dtype, backend) and its shards
    shard-00000.safetensors   samples 0 .. k-1
    shard-00001.safetensors   samples k .. 2k-1
    ...

Each shard holds its samples concatenated along the token axis (T = tokens in the shard, S = samples in it):

    input_ids    (T,)         int32
    loss_mask    (T,)         uint8   1 = a token the drafter is trained on (assistant text), 0 = context only
    aux_hidden   (T, n*H)     dtype   the residual stream entering each of the n decoder layers in `layer_ids`
                                      (layer id 0 = the embedding output; see `draftsmith.target`), concatenated
    last_hidden  (T, H)       dtype   the target's final normed hidden state; `lm_head(last_hidden[t])` gives the
                                      target's logits for the token after position t
    target_top   (T,)         int32   optional: the target's argmax over its vocabulary at position t, as recorded
                                      while it wrote the data (-1 where it was not computed); saves training the
                                      full-vocabulary head its accuracy metric needs
    offsets      (S+1,)       int64   sample j is rows offsets[j] : offsets[j+1]

The safetensors metadata of every shard (one key, "draftsmith", holding a JSON object) repeats what it was made
with (format, target, fingerprint, layer ids, dtype, hidden size, max length), its first global sample index, the
sample ids and a sha256 of its inputs, so a shard describes itself even if the manifest was not yet updated when a
run was killed. The same inputs give byte-identical shards.

Writes are resumable: a shard is written under a temporary name and renamed once complete, and the manifest is
rewritten (atomically) after every shard. A re-run with the same inputs skips the samples of the shards on disk
(checking that they are the same samples) and continues with the first missing shard.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from draftsmith.errors import ConfigError, DataError, DraftsmithError
from draftsmith.progress import progress_bar
from draftsmith.target import Target
from draftsmith.util import commit_file, temp_path, write_atomic

if TYPE_CHECKING:
    from draftsmith.backends import Backend

FORMAT = "draftsmith.hidden_states/1"
LAYER_CONVENTION = "input of decoder layer i; 0 = embedding output"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MANIFEST = "manifest.json"
META_KEY = "draftsmith"
DEFAULT_SHARD_SIZE = 64

Sample = tuple[str, list[int], list[int]]
"""(sample id, input token ids, loss mask of the same length: 1 = train on this token)."""


# --------------------------------------------------------------------------------------------- layer ids


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 default used by vLLM, SGLang and EAGLE: the inputs of layers (2, N//2, N-3).

    SmolLM2-135M (N = 30) gives (2, 15, 27). Tiny test models (N < 6) get valid but possibly repeated ids.
    """
    if num_layers < 3:
        raise ConfigError(
            f"the default aux layers (2, N//2, N-3) need a target with at least 3 decoder layers, found {num_layers}",
            hint="pass the layer ids explicitly (--layer-ids)",
        )
    return (2, num_layers // 2, num_layers - 3)


def check_layer_ids(layer_ids: Iterable[int], num_layers: int) -> tuple[int, ...]:
    """The layer ids as a tuple, or a ConfigError naming the ones the target does not have."""
    ids = tuple(layer_ids)
    if not ids:
        raise ConfigError("layer_ids is empty: expected at least one decoder layer id", hint="e.g. --layer-ids 2,15,27")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"layer_ids {list(ids)}: {bad} not in 0..{num_layers - 1} (the target has {num_layers} decoder layers)",
            hint=f"layer id i is the input of decoder layer i (0 = embedding output); the default is "
            f"{list(default_aux_layers(num_layers)) if num_layers >= 3 else 'not defined'}",
        )
    return ids


def bytes_per_token(hidden_size: int, num_aux_layers: int, dtype: str) -> int:
    """Store bytes per token: the aux and last hidden states, plus 4 (int32 id) + 1 (uint8 mask)."""
    width = 4 if dtype == "float32" else 2
    return width * (num_aux_layers * hidden_size + hidden_size) + 5


def _gb(n: float) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# --------------------------------------------------------------------------------------------- recorded features


@dataclass(frozen=True)
class Recording:
    """What features recorded as the target wrote are made with; `extract` stores them only when its own run would
    compute the same: the same target (fingerprint), layer ids and engine (`engine_label`, compute dtype included)."""

    fingerprint: str
    layer_ids: tuple[int, ...]
    engine: str

    def metadata(self) -> dict[str, str]:
        return {"target_fingerprint": self.fingerprint, "layer_ids": json.dumps(list(self.layer_ids)),
                "engine": self.engine}  # fmt: skip


RecordedSample = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""(sample id, input_ids int32 (T,), loss_mask uint8 (T,), aux_hidden (T, n*H), last_hidden (T, H), target_top
int32 (T,), -1 where the target computed no logits)."""


def write_recorded(path: Path, samples: Sequence[RecordedSample], recording: Recording) -> None:
    """One batch of recorded samples as one file, in a shard's tensor layout (written whole or not at all)."""
    metadata = recording.metadata() | {"format": FORMAT, "sample_ids": json.dumps([s[0] for s in samples])}
    tmp = temp_path(path)
    save_file(_shard_tensors(samples), str(tmp), metadata={META_KEY: json.dumps(metadata, sort_keys=True)})
    commit_file(tmp, path)


class RecordedFeatures:
    """The samples whose features a data stage recorded (`write_recorded` files in `folders`); `extract` keeps those
    made as it would compute them (`keep_only`) and copies them instead of running the target over them again."""

    def __init__(self, *folders: Path) -> None:
        self.index: dict[str, tuple[Path, int]] = {}
        self.made: dict[Path, Recording] = {}
        self._open: dict[Path, Any] = {}
        for path in (p for folder in folders for p in sorted(Path(folder).glob("*.safetensors"))):
            with safe_open(str(path), framework="pt") as f:
                meta = _shard_metadata(f)
            layers = tuple(json.loads(meta.get("layer_ids", "[]")))
            self.made[path] = Recording(meta.get("target_fingerprint", ""), layers, meta.get("engine", ""))
            for j, sid in enumerate(json.loads(meta["sample_ids"])):
                self.index[sid] = (path, j)

    def keep_only(self, wanted: Recording) -> list[str]:
        """Forget the files not made as `wanted`; one line per kind of mismatch, saying how many files and why."""
        refused = Counter(made for made in self.made.values() if made != wanted)
        self.index = {sid: (path, j) for sid, (path, j) in self.index.items() if self.made[path] == wanted}
        return [
            f"{n} files of recorded features not used (computed again instead): made with layers "
            f"{list(made.layer_ids)} by {made.engine} (target {made.fingerprint}); this extraction computes layers "
            f"{list(wanted.layer_ids)} by {wanted.engine} (target {wanted.fingerprint})"
            for made, n in refused.items()
        ]

    def __contains__(self, sid: str) -> bool:
        return sid in self.index

    def sample(self, sid: str) -> tuple[list[int], list[int]]:
        """The token ids and loss mask the target wrote (its tokens as written, not the text re-tokenised)."""
        f, a, b = self._rows(sid)
        return f.get_slice("input_ids")[a:b].tolist(), f.get_slice("loss_mask")[a:b].tolist()

    def features(self, sid: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(aux, last) of the first len(ids) tokens, or None unless `sid` was recorded with exactly those tokens."""
        if sid not in self.index:
            return None
        f, a, b = self._rows(sid)
        n = len(ids)
        if n > b - a or not torch.equal(f.get_slice("input_ids")[a : a + n], ids):
            return None
        return f.get_slice("aux_hidden")[a : a + n], f.get_slice("last_hidden")[a : a + n]

    def target_top(self, sid: str, n: int) -> torch.Tensor | None:
        """The target's recorded argmax over the first `n` tokens, or None when this file has none (older data)."""
        f, a, _ = self._rows(sid)
        return f.get_slice("target_top")[a : a + n] if _holds(f, "target_top") else None

    def _rows(self, sid: str) -> tuple[Any, int, int]:
        path, j = self.index[sid]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        offsets = self._open[path].get_slice("offsets")[j : j + 2].tolist()
        return self._open[path], offsets[0], offsets[1]


# --------------------------------------------------------------------------------------------- writing


def extract(
    target: Target,
    samples: Iterable[Sample],
    out_dir: Path | str,
    *,
    layer_ids: Sequence[int] | None = None,
    dtype: str = "bfloat16",
    shard_size: int = DEFAULT_SHARD_SIZE,
    max_length: int | None = None,
    progress: bool = True,
    console: Console | None = None,
    backend: Backend | None = None,
    recorded: RecordedFeatures | None = None,
) -> Path:
    """Run `target` over `samples` and store their hidden states in `out_dir`; returns the store directory.

    `recorded`: features the data stage recorded as the target wrote (`RecordedFeatures`); the samples it holds
    with exactly these tokens are copied from it, not computed again.

    `backend` computes the features (default: transformers, on the target as loaded); the manifest records which
    one did, and a store is resumed only by the backend that started it: two engines never agree to the last bit.

    Samples longer than `max_length` (default: the target's context length) are cut to it. If `samples` is a
    Sequence (a list), the totals are known up front: the size estimate and the disk-space check cover the whole
    run, and a dataset with no trainable token fails before any work. Any other iterable is read once, lazily, and
    the disk-space check runs before each shard. Re-running into an existing store resumes it.
    """
    console = console or Console()
    out = Path(out_dir)
    if dtype not in STORE_DTYPES:
        raise ConfigError(f"unknown store dtype {dtype!r}", hint=f"use one of {', '.join(STORE_DTYPES)}")
    if shard_size < 1:
        raise ConfigError(f"shard_size must be at least 1, found {shard_size}", hint="e.g. --shard-size 64")
    ids = check_layer_ids(default_aux_layers(target.num_layers) if layer_ids is None else layer_ids, target.num_layers)
    limit = min(max_length or target.context_length, target.context_length)
    if limit < 1:
        raise ConfigError(f"max_length must be at least 1, found {max_length}", hint="e.g. --max-length 2048")

    fingerprint = target.fingerprint()
    header = {
        "format": FORMAT,
        "target_fingerprint": fingerprint,
        "layer_ids": json.dumps(list(ids)),
        "dtype": dtype,
        "hidden_size": str(target.hidden_size),
        "max_length": str(limit),
    }
    own_backend = backend is None
    if backend is None:
        from draftsmith.backends.hf import TransformersBackend

        backend = TransformersBackend(target)
    done = _existing_shards(out, header, target.name, engine_label(backend.describe()))  # raises on a mismatch
    n_done = sum(s["samples"] for s in done)
    per_token = bytes_per_token(target.hidden_size, len(ids), dtype)

    if isinstance(samples, Sequence):
        total_samples = len(samples)
        lengths = [min(len(s[1]), limit) for s in samples]
        masked = sum(sum(1 for m in s[2][:limit] if m) for s in samples)
        if total_samples and masked == 0:
            raise DataError(
                f"all {sum(lengths)} tokens of the {total_samples} samples have loss_mask 0: nothing to train on",
                hint="the loss mask should cover the assistant turns; check the tokenize stage and the chat template",
            )
        remaining = sum(lengths[n_done:])
        console.print(
            f"extract: {total_samples} samples, {sum(lengths)} tokens, {per_token} bytes/token "
            f"-> about {_gb(sum(lengths) * per_token)} in {out}"
            + (f" ({n_done} samples already stored, {_gb(remaining * per_token)} to go)" if n_done else "")
        )
        _check_disk(out, remaining * per_token, f"{remaining} tokens")
    else:
        total_samples = None
        console.print(f"extract: {per_token} bytes/token (total unknown until the input is read) into {out}")

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".shard-*.tmp*"):  # a shard a killed run was writing: never renamed, so never whole
        stale.unlink()
    config = {"shard_size": shard_size, "max_length": limit, "dtype": dtype, "layer_ids": list(ids)}
    meta = {
        "target": target.name,
        "target_fingerprint": fingerprint,
        "hidden_size": target.hidden_size,
        "num_layers": target.num_layers,
        "vocab_size": target.vocab_size,
        "layer_ids": list(ids),
        "layer_convention": LAYER_CONVENTION,
        "dtype": dtype,
        "eos_token_ids": sorted(target.eos_token_ids),
        "special_token_ids": sorted(set(getattr(target.tokenizer, "all_special_ids", [])) | target.eos_token_ids),
        "bytes_per_token": per_token,
        "backend": backend.describe(),
        "config": config,
    }
    if recorded is not None:  # features the data stage recorded as the target wrote them, where they are ours
        for refusal in recorded.keep_only(Recording(fingerprint, ids, engine_label(backend.describe()))):
            console.print(f"[yellow]warning: {refusal}[/]", highlight=False)
        if recorded.index:
            meta["recorded_samples"] = len(recorded.index)
    _write_manifest(out, meta, done, complete=False)

    store_dtype = STORE_DTYPES[dtype]
    vocab = target.model.get_input_embeddings().num_embeddings
    shard_index = len(done)
    todo: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # the next shard's samples, features not yet computed
    digest = hashlib.sha256()
    check_idx, check_digest, check_left = 0, hashlib.sha256(), done[0]["samples"] if done else 0
    seen = 0
    new_tokens, start = 0, time.perf_counter()
    copied = 0  # samples whose features came from `recorded`
    bar = _progress(progress, console)

    def write_next_shard() -> None:
        """Features for `todo` (the backend sees a whole shard: a batching engine batches it), then the shard."""
        nonlocal shard_index, todo, digest, new_tokens, copied
        pending = []
        known = [recorded.features(sid, ids_t) if recorded else None for sid, ids_t, _ in todo]
        missing = [ids_t for (_, ids_t, _), k in zip(todo, known, strict=True) if k is None]
        computed = iter(backend.features(missing, ids) if missing else ())
        for (sid, ids_t, mask_t), k in zip(todo, known, strict=True):
            aux, last = k if k is not None else next(computed)
            top = recorded.target_top(sid, len(ids_t)) if k is not None else None
            pending.append((sid, ids_t, mask_t, aux.to("cpu", store_dtype).contiguous(),
                            last.to("cpu", store_dtype).contiguous(), top))  # fmt: skip
            copied += k is not None
            new_tokens += len(ids_t)
            bar.advance(task)
            bar.update(task, description=f"extract ({new_tokens / (time.perf_counter() - start):.0f} tok/s)")
        first = seen - len(pending)
        done.append(_write_shard(out, shard_index, first, pending, header, target.name, digest, per_token))
        shard_index, todo, digest = shard_index + 1, [], hashlib.sha256()

    with bar:
        task = bar.add_task("extract", total=total_samples, completed=0)
        for sid, input_ids, loss_mask in samples:
            ids_t, mask_t = _sample_tensors(sid, input_ids, loss_mask, limit, vocab)
            if seen < n_done:  # already stored: make sure it is the very sample the store holds
                _hash_sample(check_digest, sid, ids_t, mask_t)
                check_left -= 1
                if check_left == 0:
                    _check_same_inputs(out, done[check_idx], check_digest.hexdigest())
                    check_idx += 1
                    check_digest = hashlib.sha256()
                    check_left = done[check_idx]["samples"] if check_idx < len(done) else 0
                seen += 1
                bar.advance(task)
                continue
            todo.append((sid, ids_t, mask_t))
            _hash_sample(digest, sid, ids_t, mask_t)
            seen += 1
            if len(todo) == shard_size:
                write_next_shard()
                _write_manifest(out, meta, done, complete=False)
        if todo:
            write_next_shard()
    if own_backend:
        backend.close()
    if seen == 0:
        raise DataError("extract got no samples", hint="check the input data (the tokenize stage's output)")
    if seen < n_done:
        raise DataError(
            f"the input has {seen} samples but {out} already holds {n_done}: these are not the inputs it was made from",
            hint=f"delete {out} or pick a new --out",
        )
    elapsed = time.perf_counter() - start
    manifest = _write_manifest(out, meta, done, complete=True)
    size = sum(s["bytes"] for s in done)
    rate = f", {new_tokens / elapsed:.0f} tokens/s" if new_tokens else " (nothing new: the store was complete)"
    if copied:
        rate += f"; {copied} samples copied from the features recorded as the target wrote them"
    console.print(
        f"extract: stored {manifest['samples']} samples, {manifest['tokens']} tokens in {len(done)} shards, "
        f"{_gb(size)} ({size / max(manifest['tokens'], 1):.1f} bytes/token){rate}"
    )
    return out


def _progress(enabled: bool, console: Console) -> Progress:
    return progress_bar(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not enabled,
    )


def _sample_tensors(
    sid: str, input_ids: Sequence[int], loss_mask: Sequence[int], limit: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if len(input_ids) != len(loss_mask):
        raise DataError(
            f"sample {sid!r}: input_ids has {len(input_ids)} tokens but loss_mask has {len(loss_mask)}",
            hint="the loss mask needs one 0/1 entry per token",
        )
    if len(input_ids) == 0:
        raise DataError(f"sample {sid!r}: expected at least one token, found none", hint="drop empty samples")
    ids = torch.as_tensor(list(input_ids[:limit]), dtype=torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise DataError(
            f"sample {sid!r}: token ids must be in 0..{vocab - 1}, found {int(ids.min())}..{int(ids.max())}",
            hint="tokenize the data with the target's own tokenizer",
        )
    mask = torch.as_tensor([1 if m else 0 for m in loss_mask[:limit]], dtype=torch.uint8)
    return ids.to(torch.int32), mask


def _hash_sample(h: Any, sid: str, ids: torch.Tensor, mask: torch.Tensor) -> None:
    h.update(str(sid).encode() + b"\0")
    h.update(ids.numpy().tobytes())
    h.update(mask.numpy().tobytes())


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _shard_tensors(pending) -> dict[str, torch.Tensor]:
    """(sample id, ids, mask, aux, last, top or None) per sample -> the tensors of a shard, samples concatenated;
    `target_top` only when some sample has one (the others' are -1: not computed)."""
    lengths = torch.tensor([len(p[1]) for p in pending], dtype=torch.int64)
    tensors = {
        "input_ids": torch.cat([p[1] for p in pending]),
        "loss_mask": torch.cat([p[2] for p in pending]),
        "aux_hidden": torch.cat([p[3] for p in pending]),
        "last_hidden": torch.cat([p[4] for p in pending]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }
    if any(p[5] is not None for p in pending):
        tops = [torch.full((len(p[1]),), -1, dtype=torch.int32) if p[5] is None else p[5] for p in pending]
        tensors["target_top"] = torch.cat(tops).to(torch.int32)
    return tensors


def _write_shard(
    out: Path, index: int, first: int, pending, header: dict, target_name: str, digest, per_token: int
) -> dict[str, Any]:
    tensors = _shard_tensors(pending)
    ids = tensors["input_ids"]
    metadata = header | {
        "target": target_name,
        "first_sample": str(first),
        "sample_ids": json.dumps([p[0] for p in pending]),
        "input_sha256": digest.hexdigest(),
    }
    name = _shard_name(index)
    _check_disk(out, len(ids) * per_token, f"shard {name} ({len(ids)} tokens)")
    tmp = temp_path(out / name)
    # One metadata key: safetensors writes several in a random order, which would make identical shards differ.
    save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(metadata, sort_keys=True)})
    commit_file(tmp, out / name)
    return _shard_entry(out / name, metadata, len(pending), len(ids), int(tensors["loss_mask"].sum()))


def _shard_entry(path: Path, metadata: dict, samples: int, tokens: int, masked: int, sha: str | None = None) -> dict:
    return {
        "file": path.name,
        "first_sample": int(metadata["first_sample"]),
        "samples": samples,
        "tokens": tokens,
        "masked_tokens": masked,
        "bytes": path.stat().st_size,
        "sha256": sha or _file_sha256(path),
        "input_sha256": metadata["input_sha256"],
    }


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(out: Path, meta: dict, shards: list[dict], complete: bool) -> dict:
    manifest = {
        "stage": "extract",
        "format": FORMAT,
        "complete": complete,
        **{k: v for k, v in meta.items() if k != "config"},
        "samples": sum(s["samples"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "masked_tokens": sum(s["masked_tokens"] for s in shards),  # tokens with loss_mask = 1
        "shards": shards,
        "config": meta["config"],
        "updated": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def engine_label(backend: dict) -> str:
    """Which engine computed a store, from its manifest's backend block: the name and any compute dtype it cast the
    target to (a store holds the features of one engine at one precision)."""
    name = backend.get("name", "transformers")
    return f"{name} in {backend['compute_dtype']}" if backend.get("compute_dtype") else name


def _existing_shards(out: Path, header: dict[str, str], target_name: str, backend: str) -> list[dict]:
    """The complete shards already in `out`, checked against what this run would write; [] for a new store."""
    if not out.exists():
        return []
    if not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory", hint="pick a new --out")
    hint = f"delete {out} or pick a new --out"
    manifest_path = out / MANIFEST
    manifest: dict = {}
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise DraftsmithError(f"{manifest_path}: not valid JSON ({exc})", hint=hint) from None
        if manifest.get("stage") != "extract":
            raise DraftsmithError(f"{out} holds a {manifest.get('stage')!r} stage, not a hidden-state store", hint=hint)
        _check_header(out, "manifest.json", _manifest_header(manifest), header, manifest.get("target"), target_name)
        made_by = engine_label(manifest.get("backend") or {})
        if made_by != backend and manifest.get("shards"):
            raise DraftsmithError(
                f"store {out} was started by the {made_by} backend, this run uses {backend}: one store must hold the "
                "features of one engine",
                hint=f"resume with backend {made_by}, or delete {out} (or pick a new --out) to start over",
            )
    shards = sorted(out.glob("shard-*.safetensors"))
    others = [p.name for p in out.iterdir() if p.name != MANIFEST and p not in shards and not p.name.startswith(".")]
    if others and not manifest:
        raise DraftsmithError(
            f"{out} exists and is not a hidden-state store (it holds {', '.join(sorted(others)[:3])})", hint=hint
        )
    known = {s["file"]: s for s in manifest.get("shards", [])}
    done = []
    for index, path in enumerate(shards):
        if path.name != _shard_name(index):
            raise DraftsmithError(
                f"{out}: expected {_shard_name(index)}, found {path.name} (a shard is missing)", hint=hint
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = _shard_metadata(f)
                _check_header(out, path.name, metadata, header, manifest.get("target"), target_name)
                offsets = f.get_tensor("offsets")
                mask = f.get_tensor("loss_mask")
        except DraftsmithError:
            raise
        except Exception as exc:  # a shard that cannot be read was not written by a complete run of ours
            raise DraftsmithError(f"{path}: cannot read this shard ({exc})", hint=hint) from None
        entry = known.get(path.name)
        sha = entry["sha256"] if entry and entry.get("bytes") == path.stat().st_size else None
        done.append(_shard_entry(path, metadata, len(offsets) - 1, int(offsets[-1]), int(mask.sum()), sha))
    return done


def _holds(handle, name: str) -> bool:
    """Does this open safetensors file hold tensor `name`? (`safe_open` has no `in`.)"""
    return name in handle.keys()  # noqa: SIM118


def _shard_metadata(handle) -> dict[str, str]:
    raw = (handle.metadata() or {}).get(META_KEY)
    return json.loads(raw) if raw else {}


def _manifest_header(manifest: dict) -> dict[str, str]:
    cfg = manifest.get("config", {})
    return {
        "format": manifest.get("format", ""),
        "target_fingerprint": manifest.get("target_fingerprint", ""),
        "layer_ids": json.dumps(manifest.get("layer_ids")),
        "dtype": manifest.get("dtype", ""),
        "hidden_size": str(manifest.get("hidden_size")),
        "max_length": str(cfg.get("max_length")),
    }


def _check_header(out: Path, where: str, found: dict, wanted: dict, found_name: str | None, name: str) -> None:
    hint = f"delete {out} or pick a new --out (a store is resumed only with the same target, layer ids, dtype and "
    hint += "max length)"
    if found.get("format") != wanted["format"]:
        raise DraftsmithError(
            f"{out}/{where}: format {found.get('format')!r}, expected {wanted['format']!r}", hint=hint
        )
    if found.get("target_fingerprint") != wanted["target_fingerprint"]:
        raise DraftsmithError(
            f"store {out} was made with target {found_name or found.get('target', '?')} "
            f"(fingerprint {found.get('target_fingerprint')}), "
            f"you passed {name} ({wanted['target_fingerprint']})",
            hint=hint,
        )
    for key, label in (("layer_ids", "layer ids"), ("dtype", "dtype"), ("max_length", "max length")):
        if found.get(key) != wanted[key]:
            raise DraftsmithError(
                f"store {out} was made with {label} {found.get(key)}, this run asks for {wanted[key]}", hint=hint
            )


def _check_same_inputs(out: Path, shard: dict, digest: str) -> None:
    if digest != shard["input_sha256"]:
        raise DataError(
            f"the input samples {shard['first_sample']}..{shard['first_sample'] + shard['samples'] - 1} differ from "
            f"those stored in {out / shard['file']}: a store is resumed only with the same inputs in the same order",
            hint=f"delete {out} or pick a new --out",
        )


def _check_disk(out: Path, needed: int, what: str) -> None:
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise DraftsmithError(
            f"extract needs about {_gb(needed)} for {what} but {probe} has only {_gb(free)} free",
            hint="free some space, pick an --out on a bigger disk, use --dtype bfloat16, lower --max-length or use "
            "fewer samples",
        )


# --------------------------------------------------------------------------------------------- reading


class HiddenStateStore(Dataset):
    """A store written by `extract`, as a Dataset of per-sample dicts; shards are opened lazily (memory-mapped).

    Each item: `input_ids` (L,) int64, `loss_mask` (L,) bool, `aux_hidden` (L, n*H) and `last_hidden` (L, H) in
    the store's dtype, and `target_top` (L,) int64 (-1 where unknown) when the shard recorded it.
    """

    def __init__(self, path: Path | str, require_complete: bool = True) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise DraftsmithError(
                f"{self.path} is not a hidden-state store: {MANIFEST} not found",
                hint="pass the --out directory of `draftsmith extract`",
            )
        try:
            self._manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise DraftsmithError(
                f"{manifest_path}: not valid JSON ({exc})", hint="re-run `draftsmith extract`"
            ) from None
        if self._manifest.get("stage") != "extract" or self._manifest.get("format") != FORMAT:
            raise DraftsmithError(
                f"{manifest_path}: expected stage 'extract' with format {FORMAT!r}, found stage "
                f"{self._manifest.get('stage')!r}, format {self._manifest.get('format')!r}",
                hint="pass the --out directory of `draftsmith extract`",
            )
        if require_complete and not self._manifest.get("complete"):
            raise DraftsmithError(
                f"store {self.path} is incomplete ({self._manifest.get('samples', 0)} samples so far)",
                hint="re-run the same `draftsmith extract` command to finish it",
            )
        self._shards = self._manifest["shards"]
        for s in self._shards:
            p = self.path / s["file"]
            if not p.is_file() or p.stat().st_size != s["bytes"]:
                found = f"{p.stat().st_size} bytes" if p.is_file() else "no file"
                raise DraftsmithError(
                    f"store {self.path}: {s['file']} should have {s['bytes']} bytes, found {found}",
                    hint="the store was changed after extract wrote it; re-run extract into a new --out",
                )
        self._starts = [0]
        for s in self._shards:
            self._starts.append(self._starts[-1] + s["samples"])
        self._open: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    # -- metadata
    @property
    def manifest(self) -> dict:
        return self._manifest

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self._manifest["layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self._manifest["hidden_size"])

    @property
    def dtype(self) -> torch.dtype:
        return STORE_DTYPES[self._manifest["dtype"]]

    @property
    def num_tokens(self) -> int:
        return int(self._manifest["tokens"])

    def check_compatible(self, target: Target, layer_ids: Sequence[int] | None = None) -> None:
        """Raise a DraftsmithError unless this store was made by `target` (same fingerprint) with `layer_ids`."""
        hint = "extract a store with this target and these layer ids, or pass the target the store was made with"
        m = self._manifest
        fp = target.fingerprint()
        if fp != m["target_fingerprint"]:
            raise DraftsmithError(
                f"store {self.path} was made with target {m['target']} (fingerprint {m['target_fingerprint']}), "
                f"you passed {target.name} ({fp})",
                hint=hint,
            )
        if layer_ids is not None and tuple(layer_ids) != self.layer_ids:
            raise DraftsmithError(
                f"store {self.path} holds the states of layer ids {list(self.layer_ids)}, you asked for "
                f"{list(layer_ids)}",
                hint=hint,
            )

    # -- Dataset
    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a store of {len(self)} samples")
        shard = bisect.bisect_right(self._starts, index) - 1
        f = self._handle(shard)
        offsets = self._shard_offsets(shard)
        j = index - self._starts[shard]
        a, b = offsets[j], offsets[j + 1]
        item = {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "aux_hidden": f.get_slice("aux_hidden")[a:b],
            "last_hidden": f.get_slice("last_hidden")[a:b],
        }
        if _holds(f, "target_top"):
            item["target_top"] = f.get_slice("target_top")[a:b].long()
        return item

    def sample_id(self, index: int) -> str:
        shard = bisect.bisect_right(self._starts, index) - 1
        return json.loads(_shard_metadata(self._handle(shard))["sample_ids"])[index - self._starts[shard]]

    def lengths(self) -> list[int]:
        """Tokens per sample, without reading any hidden state (for length-bucketed batching)."""
        out: list[int] = []
        for shard in range(len(self._shards)):
            o = self._shard_offsets(shard)
            out.extend(b - a for a, b in zip(o[:-1], o[1:], strict=True))
        return out

    def iter_tokens(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids int64, loss_mask bool) per shard, reading no hidden state: for token statistics."""
        for shard in range(len(self._shards)):
            f = self._handle(shard)
            yield f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()

    def verify(self) -> list[str]:
        """Problems found by re-hashing every shard against the manifest (reads the whole store)."""
        return [
            f"{s['file']}: sha256 differs from the manifest"
            for s in self._shards
            if _file_sha256(self.path / s["file"]) != s["sha256"]
        ]

    def _handle(self, shard: int):
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.path / self._shards[shard]["file"]), framework="pt")
        return self._open[shard]

    def _shard_offsets(self, shard: int) -> list[int]:
        if shard not in self._offsets:
            self._offsets[shard] = self._handle(shard).get_tensor("offsets").tolist()
        return self._offsets[shard]

    def __getstate__(self) -> dict:  # DataLoader workers re-open the shards themselves
        state = self.__dict__.copy()
        state["_open"] = {}
        return state
