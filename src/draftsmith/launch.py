"""`python -m draftsmith.launch train RUN_DIR`: the train stage of a `draftsmith run`, as one torchrun process.

The pipeline runs as one process; when `nproc_per_node` > 1 it starts this module under torchrun for the train
stage alone. Each process reads the run's resolved settings (RUN_DIR/pipeline.json, written by `draftsmith run`)
and calls the very function the one-process pipeline calls (`stages.train`), so the two differ only in the world
size. The target is loaded on the CPU: the trainer moves what it needs (the head) to this process's device.
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith.errors import DraftsmithError


def die_with_parent() -> None:
    """torchrun starts its workers in their own session, so killing a crashed pipeline's process group leaves them
    running: a resumed run would then share its run directory with orphans still writing checkpoints. On Linux the
    kernel kills this process as soon as its launcher dies."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "train":
        print("usage: python -m draftsmith.launch train RUN_DIR", file=sys.stderr)
        return 2
    die_with_parent()
    from draftsmith import stages
    from draftsmith.pipeline import PipelineConfig
    from draftsmith.target import load_target

    run_dir = Path(argv[1])
    try:
        cfg = PipelineConfig.model_validate_json((run_dir / "pipeline.json").read_text())
        target = load_target(cfg.target, dtype=cfg.dtype)
        stages.train(cfg.train, run_dir / "extract", run_dir / "vocab", run_dir / "train", target)
    except DraftsmithError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
