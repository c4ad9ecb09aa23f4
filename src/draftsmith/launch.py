"""`python -m draftsmith.launch train RUN_DIR`: the train stage of a `draftsmith run`, in a process of its own.

The pipeline runs as one process and starts this module for the train stage alone: once, or under torchrun when
`nproc_per_node` > 1. Each process reads the run's resolved settings (RUN_DIR/pipeline.json, written by
`draftsmith run`) and calls `stages.train`, as `draftsmith train` does, so one process and N differ only in the
world size. The target is loaded on the CPU: the trainer moves what it needs (the head) to this process's device.
"""

from __future__ import annotations

import json
import os
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
    import torch

    from draftsmith import stages
    from draftsmith.pipeline import ERROR_FILE_ENV, PipelineConfig
    from draftsmith.target import load_target

    run_dir = Path(argv[1])
    try:
        cfg = PipelineConfig.model_validate_json((run_dir / "pipeline.json").read_text())
        if cfg.threads and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            torch.set_num_threads(cfg.threads)
        target = load_target(cfg.target, dtype=cfg.dtype)
        stages.train(cfg.train, run_dir / "extract", run_dir / "vocab", run_dir / "train", target)
    except DraftsmithError as exc:
        error_file = os.environ.get(ERROR_FILE_ENV)
        if error_file and os.environ.get("RANK", "0") == "0":
            Path(error_file).write_text(json.dumps({"message": exc.message, "hint": exc.hint}))
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
