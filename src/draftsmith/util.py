"""Small file helpers shared by every stage."""

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name, then rename, so a crash never leaves a half file that looks whole."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
