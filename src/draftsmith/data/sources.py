"""Read prompts and conversations from the formats people already have: ShareGPT, JSONL, HF datasets.

Everything is normalised to `Conversation` (role/content messages) at the edge, so later stages see one shape.
Any problem with the user's data is a `DataError` naming the file, the line and what was wrong.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import Any

from draftsmith.errors import DataError

Message = dict[str, str]
"""One chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str}."""


@dataclass(frozen=True)
class Conversation:
    """A chat as role/content messages: the one shape every later stage reads, whatever the source format."""

    id: str
    messages: list[Message]
    kind: str | None = None  # what is asked (MT-bench's category, "math" for GSM8K, ...): evaluation reports by kind


# ShareGPT and its cousins spell roles many ways; map each to the four roles chat templates know.
_ROLES = (
    {"system": "system"}
    | dict.fromkeys(("user", "human"), "user")
    | dict.fromkeys(("assistant", "gpt", "chatgpt", "bard", "model"), "assistant")
    | dict.fromkeys(("tool", "function", "observation"), "tool")
)
MAX_LINE_CHARS = 16 << 20  # one JSONL record; a longer line is a damaged file or not a dataset, never read whole
MAX_TURNS = 1024  # messages in one conversation
_EXPECTED_FIELDS = "'conversations' or 'messages' (a list of turns), 'turns', 'prompt' or 'question'"
_HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"


def first_prompt(conv: Conversation) -> list[Message]:
    """The messages up to and including the first user message: what an evaluation sends to the model."""
    for i, message in enumerate(conv.messages):
        if message["role"] == "user":
            return conv.messages[: i + 1]
    raise DataError(
        f"conversation {conv.id!r}: expected a user message, found roles {[m['role'] for m in conv.messages]}",
        hint="an evaluation prompt needs at least one message with role 'user' (or 'from': 'human')",
    )


def read_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (number, record) from .jsonl, .json (an array, or JSONL content) or either gzipped.

    The number is the 1-based line for JSON Lines and the 1-based position for a JSON array,
    so an error message can point the user at the exact record.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file", hint="check the path; dataset files are .jsonl, .jsonl.gz or .json")
    name = path.name.removesuffix(".gz")
    if not name.endswith((".jsonl", ".json")):
        raise DataError(
            f"{path}: expected a .jsonl, .jsonl.gz or .json file, found {path.suffix!r}",
            hint="convert the data to JSON Lines: one JSON object per line",
        )
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if name.endswith(".json"):  # small by nature: an array must be parsed whole anyway
                text = f.read()
                numbered = (
                    _parse_array(path, text) if text.lstrip().startswith("[") else _parse_lines(path, text.splitlines())
                )
            else:  # JSON Lines may be large training sets: stream them, one bounded line at a time
                numbered = _parse_lines(path, _bounded_lines(path, f))
            for number, record in numbered:
                if not isinstance(record, dict):
                    raise DataError(
                        f"{path}:{number}: expected a JSON object, found {type(record).__name__}",
                        hint='each record must be an object such as {"prompt": "..."}',
                    )
                yield number, record
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {e}", hint="is it a UTF-8 text (or gzip) file?") from e


def _parse_array(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{e.lineno}: expected a JSON array of objects, found invalid JSON ({e.msg})",
            hint="fix the JSON at that line, or write one object per line as JSON Lines",
        ) from e
    yield from enumerate(items, start=1)


def _check_line(path: Path, lineno: int, line: str) -> None:
    if len(line) > MAX_LINE_CHARS:
        raise DataError(
            f"{path}:{lineno}: the line is longer than {MAX_LINE_CHARS:,} characters",
            hint="each line must be one conversation; split or drop that record",
        )


def _bounded_lines(path: Path, f) -> Iterator[str]:
    """The file's lines, refusing one longer than MAX_LINE_CHARS before it is read whole."""
    lineno = 0
    while line := f.readline(MAX_LINE_CHARS + 1):
        lineno += 1
        _check_line(path, lineno, line)
        yield line


def _parse_lines(path: Path, lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    for lineno, line in enumerate(lines, start=1):
        _check_line(path, lineno, line)
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{lineno}: expected one JSON object per line, found {line.strip()[:60]!r} ({e.msg})",
                hint="fix or remove that line; each line must be one complete JSON object",
            ) from e


def record_to_conversation(record: dict[str, Any], where: str, index: int | None = None) -> Conversation:
    """Normalise one record (ShareGPT, MT-bench, HumanEval, GSM8K or plain prompt) to a Conversation.

    `where` ("file.jsonl:12") goes into error messages; `index` is the id when the record has none.
    """
    conv_id = next((record[k] for k in ("id", "question_id", "task_id") if record.get(k) is not None), None)
    conv_id = str(conv_id if conv_id is not None else index if index is not None else where)

    turns_key = "conversations" if "conversations" in record else "messages" if "messages" in record else None
    turns = record.get(turns_key or "turns")
    if isinstance(turns, list) and len(turns) > MAX_TURNS:
        raise DataError(
            f"{where}: the conversation has {len(turns)} turns; the limit is {MAX_TURNS}",
            hint="split the conversation or drop it",
        )
    if turns_key is not None:
        messages = [_to_message(turn, f"{where}: {turns_key}[{i}]") for i, turn in enumerate(record[turns_key])]
    elif "turns" in record:
        messages = [
            {"role": "user", "content": _text(t, f"{where}: turns[{i}]")} for i, t in enumerate(record["turns"])
        ]
    elif "prompt" in record:
        prompt = _text(record["prompt"], f"{where}: prompt")
        if "entry_point" in record:  # HumanEval: a code prefix, so ask a chat model to complete it
            prompt = _HUMANEVAL_TEMPLATE.format(prompt=prompt)
        messages = [{"role": "user", "content": prompt}]
    elif "question" in record:
        messages = [{"role": "user", "content": _text(record["question"], f"{where}: question")}]
    else:
        raise DataError(
            f"{where}: expected one of the fields {_EXPECTED_FIELDS}; found fields {sorted(record)}",
            hint='use ShareGPT ({"conversations": [{"from": "human", "value": ...}]}) or {"prompt": ...}',
        )
    if not messages:
        raise DataError(f"{where}: expected at least one message, found none", hint="remove empty records")
    kind = record.get("category")
    return Conversation(id=conv_id, messages=messages, kind=kind if isinstance(kind, str) else None)


def _to_message(turn: Any, where: str) -> Message:
    if isinstance(turn, dict) and "from" in turn and "value" in turn:
        role, content = turn["from"], turn["value"]
    elif isinstance(turn, dict) and "role" in turn and "content" in turn:
        role, content = turn["role"], turn["content"]
    else:
        found = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
        raise DataError(
            f"{where}: expected an object with 'from'/'value' or 'role'/'content', found {found}",
            hint='each turn looks like {"from": "human", "value": "..."} or {"role": "user", "content": "..."}',
        )
    if role not in _ROLES:
        raise DataError(
            f"{where}: unknown role {role!r}; expected one of {sorted(_ROLES)}",
            hint="rename the role in the data to one of the known roles",
        )
    # OpenAI-style tool-call messages carry content null; treat it as empty text.
    return {"role": _ROLES[role], "content": "" if content is None else _text(content, f"{where}: content")}


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: expected a string, found {type(value).__name__}", hint="fix that field")
    return value


def load_conversations(path: Path) -> list[Conversation]:
    """All records of a file as Conversations; ids default to the record's position in the file."""
    return list(_iter_conversations(path))


def _iter_conversations(path: Path) -> Iterator[Conversation]:
    # Lazy, so that --limit N never reads (or trips over) records after the first N.
    for i, (number, record) in enumerate(read_records(path)):
        yield record_to_conversation(record, f"{path}:{number}", index=i)


@dataclass(frozen=True)
class _Named:
    file: str
    hub_id: str
    config: str | None
    split: str
    to_record: Callable[[dict[str, Any]], dict[str, Any]]


def _mt_bench_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["prompt_id"], "turns": row["prompt"]}  # the hub copy renamed `turns` to `prompt`


# Named evaluation sets: the local file first (offline, reproducible), the Hugging Face hub as a fallback.
_NAMED = {
    "mt_bench": _Named("mt_bench_questions.jsonl", "HuggingFaceH4/mt_bench_prompts", None, "train", _mt_bench_row),
    "humaneval": _Named("humaneval.jsonl.gz", "openai/openai_humaneval", None, "test", dict),
    "gsm8k": _Named("gsm8k_test.jsonl", "openai/gsm8k", "main", "test", dict),
}
KNOWN_DATASETS = ("builtin", *_NAMED)
_DATASET_KINDS = {"gsm8k": "math", "humaneval": "code"}  # sets of one kind; MT-bench's records name theirs


def load_eval_prompts(
    dataset: str = "builtin", data_dir: Path | None = None, limit: int | None = None
) -> tuple[str, list[Conversation]]:
    """(display name, conversations cut to their first prompt) for a named dataset or a file path."""
    path = Path(dataset).expanduser()
    if dataset == "builtin":
        with resources.as_file(resources.files("draftsmith.data") / "builtin_prompts.jsonl") as builtin:
            convs = list(islice(_iter_conversations(builtin), limit))
    elif dataset in _NAMED:
        convs = _load_named(dataset, data_dir, limit)
    elif path.is_file():
        convs = list(islice(_iter_conversations(path), limit))
    else:
        raise DataError(
            f"unknown dataset {dataset!r}: expected one of {', '.join(KNOWN_DATASETS)} or a path to an existing file",
            hint="pass a known name, or the path of a .jsonl, .jsonl.gz or .json file",
        )
    if not convs:
        raise DataError(
            f"dataset {dataset!r}: expected at least one prompt, found none", hint="check the file and limit"
        )
    name = dataset if dataset in KNOWN_DATASETS else path.name
    kind = _DATASET_KINDS.get(dataset)
    return name, [Conversation(c.id, first_prompt(c), c.kind or kind) for c in convs]


def _load_named(name: str, data_dir: Path | None, limit: int | None) -> list[Conversation]:
    spec = _NAMED[name]
    dirs = [Path(d).expanduser() for d in (data_dir, os.environ.get("DRAFTSMITH_DATA")) if d]
    for d in dirs:
        if (d / spec.file).is_file():
            return list(islice(_iter_conversations(d / spec.file), limit))

    # Not local: try the hub. Offline mode is left to `datasets`, which then reads its cache or fails at once.
    searched = ", ".join(dict.fromkeys(map(str, dirs)))  # data_dir and $DRAFTSMITH_DATA are often the same
    missing = f"{name}: {spec.file} not found in {searched or 'any data directory (none given)'}"
    hint = f"pass --data-dir DIR or set DRAFTSMITH_DATA to a folder that holds {spec.file}"
    if not _hub_dataset_available(spec.hub_id):  # decided in milliseconds, before importing `datasets` (seconds)
        raise DataError(f"{missing}, and {spec.hub_id} is neither reachable on the hub nor cached", hint=hint)
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"{missing}, and `datasets` is not installed to fetch {spec.hub_id}", hint=hint) from e
    try:
        rows = datasets.load_dataset(spec.hub_id, spec.config, split=spec.split)
    except Exception as e:  # any hub, network or offline-cache failure means the same to the user: no data here
        reason = (str(e).splitlines() or [""])[0]
        raise DataError(
            f"{missing}, and {spec.hub_id} could not be loaded: {type(e).__name__}: {reason}", hint=hint
        ) from e
    return [
        record_to_conversation(spec.to_record(row), f"{spec.hub_id}[{i}]", index=i)
        for i, row in enumerate(islice(rows, limit))
    ]


def _hub_dataset_available(hub_id: str) -> bool:
    """Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): only if `datasets` has it cached; online: if the hub answers."""
    from draftsmith.target import hub_reachable

    if "1" in (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("HF_DATASETS_OFFLINE")):
        home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
        cache = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()
        return any(cache.glob(hub_id.replace("/", "___") + "*"))
    return hub_reachable()
