"""RUN_DIR/status.json of `draftsmith run`, and the fingerprints that tell whether a stage's inputs changed.

Each stage's entry holds its state (pending / in_progress / completed / failed), start and end times, its key
(settings + upstream keys), its inputs and outputs as {name: {"path", "fingerprint"}}, and the error of a failure.
The file is rewritten atomically on every change, so a kill at any moment leaves the last state that was reached.

A fingerprint is a content hash of what a stage wrote, chosen to be cheap even for a terabyte store: the store's
manifest (which lists the sha256 of every shard), the latest training checkpoint (not the older ones), and every
file of the other stages. Content, not modification times, so a run directory copied to another machine (a crashed
rented box) resumes without redoing anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from draftsmith.errors import ConfigError
from draftsmith.util import RUN_STATUS as STATUS_FILE
from draftsmith.util import write_atomic


class Status:
    """RUN_DIR/status.json, rewritten atomically on every change."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / STATUS_FILE
        self.stages: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self.stages = json.loads(self.path.read_text()).get("stages", {})

    def update(self, stage: str, **fields: Any) -> None:
        self.stages.setdefault(stage, {}).update(fields)
        self.save()

    def save(self) -> None:
        write_atomic(self.path, json.dumps({"stages": self.stages}, indent=2) + "\n")


# train.trainer.STATE_FILE, named here because the pipeline layer does not import the trainer (tests/test_layers.py)
TRAINER_STATE = "trainer_state.pt"


def stage_fingerprint(stage: str, directory: Path) -> str | None:
    """A hash of what `stage` wrote into `directory` (None if it holds nothing yet)."""
    if not directory.is_dir():
        return None
    if stage == "extract":
        files = [directory / "manifest.json"]
    elif stage == "train":
        latest = directory / "latest"
        if not latest.is_file():
            return None
        checkpoint = directory / latest.read_text().strip()
        # what the stages after it read: the drafter, not its optimiser state or the wall time it took to train
        files = [latest, *sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != TRAINER_STATE)]
    else:
        files = sorted(p for p in directory.rglob("*") if p.is_file() and not _hidden(p, directory))
    return _hash_files(files, directory)


def file_fingerprint(path: Path) -> str | None:
    """A hash of a source file's content (None for what is not a local file, e.g. a hub dataset id)."""
    return _hash_files([path], path.parent) if path.is_file() else None


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _hash_files(files: list[Path], root: Path) -> str | None:
    files = [f for f in files if f.is_file()]
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        with f.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def status_table(run_dir: Path) -> Table:
    status = Status(run_dir)
    if not status.path.exists():
        raise ConfigError(f"{run_dir} has no {STATUS_FILE}", hint="pass the RUN_DIR of a `draftsmith run`")
    table = Table(title=f"pipeline {run_dir}")
    for column in ("stage", "state", "started", "ended", "seconds", "inputs", "fingerprint"):
        table.add_column(column)
    for stage, entry in status.stages.items():
        seconds = entry.get("seconds")
        inputs = ", ".join(f"{name} {i.get('fingerprint') or '-'}" for name, i in (entry.get("inputs") or {}).items())
        table.add_row(
            stage, entry.get("state", "pending"), entry.get("started") or "", entry.get("ended") or "",
            f"{seconds:.0f}" if seconds is not None else "", inputs,
            entry.get("fingerprint") or entry.get("error") or "",
        )  # fmt: skip
    return table
