"""Small file helpers shared by every stage: durable atomic writes, and run directories that are ours or refused.

Durable: a file counts once its bytes and the directory entry that names it are on disk (fsync of the file, then
of its directory), so a power cut never leaves a `latest` pointing at a checkpoint the disk never got.
Ours: every directory a stage writes carries a marker (its `manifest.json` naming the stage, `status.json` for a
`draftsmith run`, an export's config.json provenance); a non-empty directory without one is someone else's, and
nothing here writes into it or deletes it unless the user said `--overwrite`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
from pathlib import Path

from draftsmith.errors import DraftsmithError

MANIFEST = "manifest.json"
RUN_STATUS = "status.json"
PROVENANCE_KEY = "draftsmith"  # the block an export's config.json carries (see formats/common.py)
_TEMP = re.compile(r"^\..+\.(tmp|old)\d+(\..*)?$")  # `.NAME.tmpPID[.ext]` / `.NAME.oldPID`: ours, from a crash


def temp_path(path: Path, suffix: str = "") -> Path:
    """The name a file or directory is built under before it is renamed to `path`."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}{suffix}")


def fsync_dir(directory: Path) -> None:
    """Make the entries of `directory` (a rename, a new file) durable."""
    with contextlib.suppress(OSError):  # some filesystems cannot open a directory for fsync
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first (a checkpoint before it is renamed)."""
    dirs = []
    for folder, _, files in os.walk(root):
        dirs.append(Path(folder))
        for name in files:
            fsync_file(Path(folder) / name)
    for folder in reversed(dirs):
        fsync_dir(folder)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_file(tmp: Path, final: Path) -> None:
    """A file written under a temporary name becomes `final`: its bytes on disk first, then the rename."""
    fsync_file(tmp)
    replace_durable(tmp, final)


def replace_durable(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` and make the rename itself durable."""
    os.replace(src, dst)
    fsync_dir(dst.parent)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary name, fsync, rename, fsync the directory: a crash never leaves a half file that looks
    whole, and a file that counts is on disk."""
    tmp = temp_path(path)
    with open(tmp, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())
    replace_durable(tmp, path)


def sweep_temp(directory: Path, prefix: str = ".") -> None:
    """Delete the temporary files and folders a killed run left in `directory` (never renamed, so never whole);
    with `prefix`, only those of one name (in a folder that is not ours, e.g. the parent of an export)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith(prefix) and _TEMP.match(entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def crash_point(name: str) -> None:
    """Tests set DRAFTSMITH_CRASH_AT=name to SIGKILL the process at a named window (e.g. a rename before its
    pointer is written), proving the window loses nothing."""
    if os.environ.get("DRAFTSMITH_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------------------- directories we own


def dir_owner(directory: Path) -> str | None:
    """The stage whose marker `directory` carries ("run" for a `draftsmith run` directory), else None."""
    try:
        stage = json.loads((directory / MANIFEST).read_text()).get("stage")
        if isinstance(stage, str):
            return stage
    except (OSError, ValueError, AttributeError):
        pass
    if (directory / RUN_STATUS).is_file():
        return "run"
    if (directory / "latest").is_file() and (directory / "checkpoints").is_dir():
        return "train"  # a run from before training directories carried a manifest
    try:
        if "exported_by" in (json.loads((directory / "config.json").read_text()).get(PROVENANCE_KEY) or {}):
            return "export"
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return None


def _visible(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if not _TEMP.match(p.name)]


def claim_dir(directory: Path, stage: str, *, overwrite: bool = False, mark: bool = True) -> None:
    """Make `directory` the `stage`'s own, or refuse before any work: a missing or empty directory is created (and,
    with `mark`, given a `manifest.json` naming the stage); a directory carrying this stage's marker is resumed;
    anything else (someone's files, another stage's output) is refused unless `overwrite`, which deletes it."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise DraftsmithError(f"{directory} exists and is not a directory", hint="pick another --out")
    if directory.is_dir() and _visible(directory):
        owner = dir_owner(directory)
        if owner == stage and not overwrite:
            sweep_temp(directory)  # what a killed run of this stage was writing
            return
        if not overwrite:
            what = f"the output of the {owner} stage" if owner else "files draftsmith did not write"
            shown = ", ".join(sorted(p.name for p in _visible(directory))[:3])
            raise DraftsmithError(
                f"{directory} holds {what} ({shown}); draftsmith writes only into its own or empty directories",
                hint="pick a new --out, or pass --overwrite to delete that directory and start over",
            )
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if mark and not (directory / MANIFEST).exists():
        write_atomic(directory / MANIFEST, json.dumps({"stage": stage, "complete": False}, indent=2) + "\n")


def remove_stage_dir(directory: Path, stage: str) -> None:
    """Delete a stage's directory to redo it, only when its marker proves it is that stage's."""
    if not directory.exists():
        return
    if dir_owner(directory) != stage:
        raise DraftsmithError(
            f"{directory} must be redone, but it does not carry the {stage} stage's manifest, so it is not deleted",
            hint=f"move {directory} away (it may hold your files), then resume",
        )
    shutil.rmtree(directory)


def swap_dirs(new: Path, old: Path) -> None:
    """Put directory `new` at `old`'s name atomically: after a crash at any moment, `old`'s name holds the old
    directory or the new one, whole. Afterwards `new`'s name holds the old directory (the caller deletes it).
    Linux: one renameat2(RENAME_EXCHANGE); elsewhere two renames, undone by `recover_swap` after a crash."""
    if not old.exists():
        replace_durable(new, old)
        return
    if not _exchange(new, old):
        parked = old.with_name(f".{old.name}.old{os.getpid()}")
        os.replace(old, parked)
        os.replace(new, old)
        os.replace(parked, new)
    fsync_dir(old.parent)


def recover_swap(target: Path) -> None:
    """After a crash inside a two-rename `swap_dirs`, put the parked old directory back at `target`."""
    if target.exists():
        return
    for parked in target.parent.glob(f".{target.name}.old*"):
        os.replace(parked, target)
        return


def _exchange(a: Path, b: Path) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return result == 0
