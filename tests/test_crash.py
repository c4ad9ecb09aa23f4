"""Crash safety: `draftsmith run` killed with SIGKILL during extract, and again during training (2 torchrun
processes), then finished on 1 process, ends with the store and the checkpoint of an uninterrupted run.

The runs are real processes (`python -m draftsmith.cli run ...`, started in their own process group so the kill
takes torchrun's workers too), watched through RUN_DIR/status.json and the stage directories, and killed at a
point where work is half done: some extract shards written but not all, a training checkpoint written and later
steps logged after it. Expected: the same samples in byte-identical shards, and the same loss curve and final
weights as one uninterrupted process (within the tolerance of a different number of training processes: 1e-5
relative on the curve, 1e-6 absolute on weights of size 0.1 to 1; see tests/test_distributed.py).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.store import HiddenStateStore
from draftsmith.train.metrics import read_metrics
from tests.conftest import tiny_target
from tests.test_distributed import assert_same_curves
from tests.test_train import NONDETERMINISTIC

STEPS, CHECKPOINT_EVERY = 40, 5


def pipeline_file(tmp_path: Path) -> Path:
    """A tiny target and 300 conversations: enough that extract and train each take a few seconds to kill in."""
    target = tiny_target(0, vocab_size=96)
    target.model.save_pretrained(tmp_path / "model")
    target.tokenizer.save_pretrained(tmp_path / "model")
    rng = random.Random(0)
    words = lambda n: " ".join(f"t{rng.randrange(2, 96)}" for _ in range(n))  # noqa: E731
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(
        json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": words(rng.randint(4, 12))},
                                                     {"from": "gpt", "value": words(rng.randint(8, 24))}]}) + "\n"
        for i in range(300)
    ))  # fmt: skip
    spec = {
        "target": str(tmp_path / "model"),
        "threads": 1,
        "data": {"sources": [str(convs)]},
        "extract": {"layers": [0, 1, 2], "dtype": "float32", "shard_size": 4},
        "vocab": {"size": 32},
        "train": {"max_steps": STEPS, "batch_size": 2, "ttt_steps": 3, "checkpoint_every": CHECKPOINT_EVERY,
                  "eval_every": 10, "warmup_steps": 2, "lr": 3e-3},
        "eval": {"dataset": str(convs), "limit": 2, "max_new_tokens": 8, "compare": []},
    }  # fmt: skip
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start(pipeline: Path, run_dir: Path, *sets: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "draftsmith.cli", "run", str(pipeline), "--out", str(run_dir), *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip


def kill_when(proc: subprocess.Popen, ready, timeout: float = 240.0) -> None:
    """SIGKILL the run's whole process group as soon as `ready()` holds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (code {proc.returncode}) before the kill point:\n{proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the kill point was never reached")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.2)  # torchrun's workers die with the group; let the kernel reap them


def stage_state(run_dir: Path, stage: str) -> str | None:
    try:
        return json.loads((run_dir / "status.json").read_text())["stages"].get(stage, {}).get("state")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def curve(train_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in NONDETERMINISTIC} for r in read_metrics(train_dir)]


def test_sigkill_during_extract_and_train_then_rerun_equals_an_uninterrupted_run(tmp_path):
    pipeline = pipeline_file(tmp_path)
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    result = CliRunner().invoke(app, ["run", str(pipeline), "--out", str(whole)])
    assert result.exit_code == 0, result.output

    # 1. Killed during extract: some shards on disk, the manifest not complete.
    proc = start(pipeline, crashed, "--set", "nproc_per_node=2")
    shards = lambda: len(list((crashed / "extract").glob("shard-*.safetensors")))  # noqa: E731
    kill_when(proc, lambda: stage_state(crashed, "extract") == "in_progress" and shards() >= 3)
    manifest = json.loads((crashed / "extract" / "manifest.json").read_text())
    assert not manifest["complete"] and 0 < manifest["samples"] < 300
    assert stage_state(crashed, "extract") == "in_progress"

    # 2. Re-run; killed during training (2 torchrun processes) after a checkpoint, with later steps logged.
    proc = start(pipeline, crashed, "--set", "nproc_per_node=2")
    latest = crashed / "train" / "latest"

    def mid_training() -> bool:
        if stage_state(crashed, "train") != "in_progress" or not latest.is_file():
            return False
        saved = int(latest.read_text().strip().rsplit("-", 1)[1])
        logged = max((r["step"] for r in read_metrics(crashed / "train")), default=0)
        return saved < logged < STEPS

    kill_when(proc, mid_training)
    assert stage_state(crashed, "extract") == "completed" and stage_state(crashed, "train") == "in_progress"

    # 3. Finish on one process: the train stage's key ignores the process count, so it resumes.
    result = CliRunner().invoke(app, ["run", str(pipeline), "--out", str(crashed), "--set", "nproc_per_node=1"])
    assert result.exit_code == 0, result.output
    assert "data: completed earlier" in result.output and "extract: completed earlier" in result.output

    a, b = HiddenStateStore(whole / "extract"), HiddenStateStore(crashed / "extract")
    assert [b.sample_id(i) for i in range(len(b))] == [a.sample_id(i) for i in range(len(a))] and len(a) == 300
    assert [s["sha256"] for s in b.manifest["shards"]] == [s["sha256"] for s in a.manifest["shards"]]
    assert_same_curves(curve(whole / "train"), curve(crashed / "train"))
    final = f"checkpoints/step-{STEPS:06d}/model.safetensors"
    wa, wb = load_file(whole / "train" / final), load_file(crashed / "train" / final)
    assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)
