"""The `draftsmith data` stage: gather conversations from files, the Hugging Face hub and the target itself.

Writes into `out_dir`:
  conversations.jsonl   every input conversation as {"id", "messages"} (atomic)
  regenerated.jsonl     with `regenerate`: the same conversations with target-written assistant turns (resumable)
  chat.jsonl            with `self_chat`: chats the target wrote both sides of (resumable)
  chat.features/        with `record_features`: their hidden states, recorded as they were written (for extract)
  regenerated.features/ the same for the regenerated conversations (transformers only)
  manifest.json         stage "data": sources, counts, config, target, created time (atomic; "complete" at the end)

Evaluation sets (builtin, mt_bench, humaneval, gsm8k by name) are refused: training on them would inflate every
evaluation. A re-run with the same inputs (source names, config, target) over an unfinished regeneration resumes it
from the conversations gathered the first time, without reading the sources or synthesising again; a re-run with
other inputs over an existing regeneration is refused rather than silently mixing two datasets.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.backends.hf import TransformersBackend
from draftsmith.data.regenerate import check_unique_ids
from draftsmith.data.regenerate import regenerate as regenerate_conversations
from draftsmith.data.selfchat import self_chat as write_self_chat
from draftsmith.data.sources import KNOWN_DATASETS, Conversation, read_records, record_to_conversation
from draftsmith.data.synth import SYNTH_KINDS, check_kinds, synthesize_prompts
from draftsmith.errors import ConfigError, DataError
from draftsmith.store import Recording, default_aux_layers, engine_label
from draftsmith.target import Target, hub_reachable
from draftsmith.util import write_atomic

if TYPE_CHECKING:
    from draftsmith.backends import Backend

_FILE_SUFFIXES = (".jsonl", ".json", ".gz")
CHATS = "chat.jsonl"  # the self-chats; their recorded states beside them (`regenerate.recorded_dir`)
REGENERATED = "regenerated.jsonl"  # the same, for the regenerated conversations


def build_dataset(
    sources: list[str],
    out_dir: Path,
    *,
    target: Target | None = None,
    regenerate: bool = False,
    synth: int = 0,
    self_chat: int = 0,
    self_chat_length: int = 512,
    self_chat_minutes: float | None = None,
    self_chat_user_temperature: float = 1.0,
    self_chat_loop_ngram: int = 0,
    record_features: bool = False,
    synth_kinds: Sequence[str] = SYNTH_KINDS,
    limit: int | None = None,
    skip: int = 0,
    hf_split: str = "train",
    seed: int = 0,
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    backend: Backend | None = None,
) -> Path:
    """Build the data stage directory and return it.

    `sources` are files (ShareGPT / prompt JSONL / JSON, optionally gzipped) or Hugging Face dataset ids
    (`owner/name` or `owner/name:config`, split `hf_split`); `limit` keeps the first N conversations of each source
    after its first `skip` (e.g. the prompts an evaluation uses, held out);
    `synth` adds N prompts the target writes itself, spread evenly over `synth_kinds` (see `draftsmith.data.synth`;
    empty: unsteered pre-query samples); `self_chat` adds N multi-turn chats of `self_chat_length` tokens the target
    writes both sides of (or the whole batches of them that fit in `self_chat_minutes`), over the same kinds, its user
    turns sampled at `self_chat_user_temperature`, its replies cut before they repeat a `self_chat_loop_ngram`-gram
    when that is above 0 (see `draftsmith.data.selfchat`; resumable); `record_features` keeps the self-chats' hidden
    states at the default aux layers as they are written, so that `extract` copies them instead of running the
    target over the chats again. `temperature`, `max_new_tokens` (also the cap on a self-chat reply) and
    `batch_size` drive the regeneration (synthesis samples at its own defaults, since a greedy prompt writer writes
    one prompt).
    `backend` runs the target for synthesis and regeneration (default: transformers; the manifest records it).
    """
    if not sources and synth <= 0 and self_chat <= 0:
        raise ConfigError(
            "no data: no sources, no --synth prompts and no --self-chat chats",
            hint="pass a file, a hub dataset, --synth N or --self-chat N",
        )
    if (regenerate or synth or self_chat) and target is None:
        raise ConfigError("--regenerate, --synth and --self-chat need a target model", hint="pass --target")
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be at least 1, found {limit}", hint="pass a positive --limit or none")
    if skip < 0:
        raise ConfigError(f"skip must be at least 0, found {skip}", hint="pass --skip 0 or more")
    synth_kinds = check_kinds(synth_kinds) if synth_kinds else ()
    out_dir = Path(out_dir)
    config = (
        {
            "regenerate": regenerate,
            "synth": synth,
            "limit": limit,
            "hf_split": hf_split,
            "seed": seed,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
        }
        | ({"synth_kinds": list(synth_kinds)} if synth > 0 or self_chat > 0 else {})
        | ({"self_chat": self_chat, "self_chat_length": self_chat_length} if self_chat > 0 else {})
        # recorded only when not the default, so stores made before the setting existed still resume
        | ({"self_chat_user_temperature": self_chat_user_temperature} if self_chat_user_temperature != 1.0 else {})
        | ({"self_chat_loop_ngram": self_chat_loop_ngram} if self_chat_loop_ngram else {})
        | ({"record_features": True} if record_features and (self_chat > 0 or regenerate) else {})
        | ({"self_chat_minutes": self_chat_minutes} if self_chat_minutes is not None else {})
        | ({"skip": skip} if skip else {})
    )
    inputs = {"sources": list(sources), "config": config, "target": target.name if target else None}
    conversations_path, regenerated_path = out_dir / "conversations.jsonl", out_dir / REGENERATED
    chat_path = out_dir / CHATS
    manifest_path = out_dir / "manifest.json"

    previous = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    same_inputs = previous is not None and all(previous.get(k) == v for k, v in inputs.items())
    if (regenerated_path.exists() or chat_path.exists()) and not same_inputs:
        raise DataError(
            f"{out_dir} already holds target-written data made from other sources, config or target",
            hint="use a new --out directory, or delete the old one to start over",
        )
    if same_inputs and conversations_path.exists():  # resume over the conversations gathered then
        conversations = [
            Conversation(r["id"], r["messages"], r.get("kind")) for _, r in read_records(conversations_path)
        ]
        counts = previous["counts"]
    else:
        conversations, counts = _gather(
            sources, target, synth=synth, synth_kinds=synth_kinds, limit=limit, skip=skip, hf_split=hf_split, seed=seed,
            batch_size=batch_size, backend=backend,
        )  # fmt: skip
        check_unique_ids(conversations)
        if not regenerate:
            _check_answered(sources, conversations)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(conversations_path, "".join(_jsonl(c) for c in conversations))
        write_atomic(manifest_path, _manifest(inputs, counts, complete=False, backend=backend))

    # Self-chat, and regeneration unless an engine of its own runs it, drive the model themselves: the transformers
    # backend's, cast to its dtype if asked; with `record_features` they keep the states they compute.
    engine = backend if isinstance(backend, TransformersBackend) else TransformersBackend(target) if target else None
    record = None
    if record_features and engine is not None:
        layers = default_aux_layers(target.num_layers)
        record = Recording(engine.target.fingerprint(), layers, engine_label(engine.describe()))
    if self_chat > 0:
        write_self_chat(
            engine.target, self_chat, chat_path, seed=seed, length=self_chat_length, batch_size=batch_size,
            max_turn_tokens=max_new_tokens, temperature=temperature, user_temperature=self_chat_user_temperature,
            loop_ngram=self_chat_loop_ngram, kinds=synth_kinds, minutes=self_chat_minutes, record=record,
        )  # fmt: skip
        counts = counts | {"self_chat": sum(1 for _ in read_records(chat_path))}
    if regenerate and conversations:
        regenerate_conversations(
            target, conversations, regenerated_path, temperature=temperature, max_new_tokens=max_new_tokens,
            batch_size=batch_size, seed=seed, backend=backend, record=record if backend in (None, engine) else None,
        )  # fmt: skip
        counts = counts | _regenerated_counts(regenerated_path)
    write_atomic(manifest_path, _manifest(inputs, counts, complete=True, backend=backend))
    return out_dir


def _gather(
    sources: list[str],
    target: Target | None,
    *,
    synth: int,
    limit: int | None,
    hf_split: str,
    skip: int = 0,
    seed: int,
    batch_size: int,
    synth_kinds: Sequence[str] = (),
    backend: Backend | None = None,
) -> tuple[list[Conversation], dict[str, Any]]:
    """All conversations, ids prefixed with their source's name when several inputs are combined."""
    several = len(sources) + (synth > 0) > 1
    conversations: list[Conversation] = []
    per_source: dict[str, int] = {}
    for source in sources:
        loaded = _load_source(source, limit, hf_split, skip)
        prefix = f"{_short_name(source)}/" if several else ""
        conversations += [Conversation(prefix + c.id, c.messages, c.kind) for c in loaded]
        per_source[source] = len(loaded)
    synthesised = (
        synthesize_prompts(target, synth, seed=seed, batch_size=batch_size, kinds=synth_kinds, backend=backend)
        if synth > 0
        else []
    )
    conversations += synthesised
    counts = {"sources": per_source, "synth": len(synthesised), "conversations": len(conversations)}
    per_kind = Counter(c.kind for c in synthesised if c.kind)
    if per_kind:
        counts["synth_kinds"] = dict(per_kind)  # prompts per kind, so a short kind shows in the manifest
    return conversations, counts


def _load_source(source: str, limit: int | None, hf_split: str, skip: int = 0) -> list[Conversation]:
    if source in KNOWN_DATASETS:
        raise DataError(
            f"{source!r} is an evaluation set: training on it would inflate every evaluation",
            hint="train on other prompts (a file, a hub dataset or --synth); for the GSM8K train split use "
            "openai/gsm8k:main",
        )
    path = Path(source).expanduser()
    if path.exists():
        records = islice(read_records(path), skip, None if limit is None else skip + limit)
        return [record_to_conversation(r, f"{path}:{n}", index=skip + i) for i, (n, r) in enumerate(records)]
    if source.endswith(_FILE_SUFFIXES) or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise DataError(f"{source}: no such file", hint="check the path; dataset files are .jsonl, .jsonl.gz or .json")
    return _load_hub(source, limit, hf_split, skip)


def _load_hub(source: str, limit: int | None, split: str, skip: int = 0) -> list[Conversation]:
    """Rows of a hub dataset (`name` or `name:config`); fails in seconds when offline, never hangs on retries."""
    hint = "pass a local .jsonl/.json file instead; for a dataset already in the `datasets` cache, set HF_HUB_OFFLINE=1"
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{source!r} is not a file, and reading it as a Hugging Face dataset needs the `datasets` package",
            hint="pip install 'draftsmith[hub]', or " + hint[0].lower() + hint[1:],
        ) from None
    offline = "1" in (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("HF_DATASETS_OFFLINE"))
    if not offline and not hub_reachable():
        raise DataError(f"{source!r} is not a file, and the Hugging Face hub cannot be reached", hint=hint)
    name, _, config = source.partition(":")
    where = f"{source}[{split}]"
    try:
        rows = datasets.load_dataset(name, config or None, split=split, streaming=limit is not None and not offline)
        records = [dict(row) for row in islice(rows, skip, None if limit is None else skip + limit)]
    except Exception as e:  # hub, network, cache or split errors all mean the same to the user: no data from here
        reason = (str(e).splitlines() or [""])[0]
        raise DataError(f"{where} could not be loaded: {type(e).__name__}: {reason}", hint=hint) from e
    return [record_to_conversation(r, f"{where}:{skip + i}", index=skip + i) for i, r in enumerate(records)]


def _short_name(source: str) -> str:
    path = Path(source)
    if path.suffix in _FILE_SUFFIXES:
        return path.name.removesuffix(".gz").rsplit(".", 1)[0]
    return source.replace("/", "_")


def _check_answered(sources: list[str], conversations: list[Conversation]) -> None:
    """Without regeneration every conversation must already hold an assistant turn to learn from."""
    unanswered = [c.id for c in conversations if not any(m["role"] == "assistant" for m in c.messages)]
    if unanswered:
        raise DataError(
            f"{len(unanswered)} of {len(conversations)} conversations from {', '.join(sources) or 'synth'} have no "
            f"assistant turn (first: {unanswered[0]!r})",
            hint="add --regenerate to have the target write the replies",
        )


def _regenerated_counts(path: Path) -> dict[str, int]:
    records = [record for _, record in read_records(path)]
    turns = [m for r in records for m in r["messages"] if m["role"] == "assistant" and "truncated" in m]
    return {
        "regenerated": len(records),
        "assistant_turns": len(turns),
        "truncated_turns": sum(m["truncated"] for m in turns),
    }


def _jsonl(conv: Conversation) -> str:
    record = {"id": conv.id, "messages": conv.messages} | ({"kind": conv.kind} if conv.kind else {})
    return json.dumps(record, ensure_ascii=False) + "\n"


def _manifest(inputs: dict[str, Any], counts: dict[str, Any], *, complete: bool, backend: Backend | None) -> str:
    manifest = {
        "stage": "data",
        "complete": complete,
        **inputs,
        "counts": counts,
        "backend": backend.describe() if backend else {"name": "transformers"},  # what wrote synth and regenerated
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return json.dumps(manifest, indent=2) + "\n"


def load_stage_conversations(data_dir: Path) -> list[Conversation]:
    """The training conversations of a finished data stage: the regenerated ones when the stage regenerated."""
    manifest_path = Path(data_dir) / "manifest.json"
    if not manifest_path.exists():
        raise DataError(f"{data_dir} is not a data stage directory (no manifest.json)", hint="run `draftsmith data`")
    manifest = json.loads(manifest_path.read_text())
    if not manifest.get("complete"):
        raise DataError(
            f"the data stage in {data_dir} did not finish", hint="re-run the same `draftsmith data` command"
        )
    name = REGENERATED if manifest["config"]["regenerate"] else "conversations.jsonl"
    files = [Path(data_dir) / n for n in (name, CHATS) if (Path(data_dir) / n).exists()]
    return [Conversation(r["id"], r["messages"]) for f in files for _, r in read_records(f)]
