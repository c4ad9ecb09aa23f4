"""Run directories are ours or refused: draftsmith never writes into, or deletes, a folder it cannot prove it wrote,
and a crash at the windows that matter (a checkpoint renamed before `latest` names it, an export half swapped)
loses nothing. Every case hashes the user's files before and after: not one byte may change."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith import stages
from draftsmith.errors import DraftsmithError
from draftsmith.formats.export import export
from draftsmith.formats.load import load_drafter
from draftsmith.pipeline import run_pipeline
from draftsmith.stages import VocabConfig, _safe_name
from draftsmith.train import TrainConfig
from draftsmith.train.metrics import MetricsWriter, read_metrics
from draftsmith.util import claim_dir, remove_stage_dir, swap_dirs
from tests.formats_helpers import trained_setup
from tests.test_distributed import assert_same_curves
from tests.test_train import curve, run, setup

ROOT = Path(__file__).resolve().parents[1]


def tree_hash(folder: Path) -> str:
    """Every path and byte under `folder`."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def users_folder(path: Path) -> Path:
    (path / "notes").mkdir(parents=True)
    (path / "thesis.tex").write_text("\\section{years of work}\n")
    (path / "notes" / "todo.txt").write_text("back up\n")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_setup(tmp_path_factory.mktemp("ownership"))


def test_a_folder_with_someone_elses_files_is_refused_before_any_work(tmp_path):
    mine = users_folder(tmp_path / "mine")
    before = tree_hash(mine)
    # the source does not even exist: the refusal must come first
    with pytest.raises(DraftsmithError, match="files draftsmith did not write"):
        stages.vocab(VocabConfig(size=8), tmp_path / "no-store", mine)
    with pytest.raises(DraftsmithError, match="files draftsmith did not write"):
        run_pipeline("eagle3", mine, profile="cpu-demo")
    assert tree_hash(mine) == before
    claim_dir(mine, "vocab", overwrite=True)  # --overwrite: replaced, explicitly
    assert [p.name for p in mine.iterdir()] == ["manifest.json"]


def test_another_stages_directory_is_refused(tmp_path):
    store = tmp_path / "extract"
    store.mkdir()
    (store / "manifest.json").write_text(json.dumps({"stage": "extract", "shards": []}))
    (store / "shard-00000.safetensors").write_bytes(b"features")
    before = tree_hash(store)
    with pytest.raises(DraftsmithError, match="output of the extract stage"):
        stages.vocab(VocabConfig(size=8), tmp_path / "no-store", store)
    with pytest.raises(DraftsmithError, match="output of the extract stage"):
        export(tmp_path / "no-checkpoint", store)
    assert tree_hash(store) == before


def test_pipeline_deletes_a_stage_folder_only_when_its_manifest_says_so(tmp_path):
    run_dir = tmp_path / "run"
    data = users_folder(run_dir / "data")
    (run_dir / "status.json").write_text(json.dumps({"stages": {"data": {"state": "completed", "key": "older"}}}))
    before = tree_hash(data)
    with pytest.raises(DraftsmithError, match="does not carry the data stage's manifest"):
        run_pipeline("eagle3", run_dir, profile="cpu-demo", sets=["data.sources=[]", "data.synth=1"])
    assert tree_hash(data) == before
    with pytest.raises(DraftsmithError):
        remove_stage_dir(data, "data")
    (data / "manifest.json").write_text(json.dumps({"stage": "data"}))
    remove_stage_dir(data, "data")
    assert not data.exists()


def test_report_names_from_drafter_strings_stay_inside_out(tmp_path):
    out = tmp_path / "eval"
    for spec in ["..", ".", "../..", "/etc/passwd", "a/../../b", "", "~", "manifest.json", "report.json", ".hidden"]:
        name = _safe_name(spec)
        assert (out / name).resolve().parent == out.resolve() and not name.startswith(".")
        assert name not in ("manifest.json", "report.json", "report.md")


def test_trainer_deletes_only_its_own_checkpoints(tmp_path):
    _, data, weights, config = setup(count=6)
    out = tmp_path / "run"
    users = users_folder(out / "checkpoints" / "step-000001")  # looks like ours, holds no trainer state
    (out / "checkpoints" / "README.txt").write_text("my notes on these runs\n")
    before = tree_hash(users), (out / "checkpoints" / "README.txt").read_bytes()
    cfg = TrainConfig(max_steps=4, batch_size=2, ttt_steps=2, checkpoint_every=1, keep_checkpoints=1, eval_every=10)
    with pytest.raises(DraftsmithError, match="draftsmith did not write"):  # a save would land on it
        run(cfg, data, weights, config, out, resume=False)
    assert (tree_hash(users), (out / "checkpoints" / "README.txt").read_bytes()) == before
    moved = users.rename(tmp_path / "moved")
    run(cfg, data, weights, config, out, resume=False)  # starting over, and rotating down to one checkpoint
    assert (tree_hash(moved), (out / "checkpoints" / "README.txt").read_bytes()) == before
    assert (out / "checkpoints" / "step-000004").is_dir() and not (out / "checkpoints" / "step-000003").exists()


def test_a_torn_last_metrics_line_is_skipped_on_resume(tmp_path):
    lines = [json.dumps({"step": s, "split": "train", "loss": 1.0}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "spl')
    MetricsWriter(tmp_path, 2).file.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


_TRAIN_SCRIPT = """
import sys
from pathlib import Path
from draftsmith.train import TrainConfig
from tests.test_train import run, setup
_, data, weights, config = setup(count=6)
cfg = TrainConfig(max_steps=6, batch_size=2, ttt_steps=2, checkpoint_every=3, eval_every=100, warmup_steps=1)
run(cfg, data, weights, config, Path(sys.argv[1]))
"""


def _python(script: str, *args: str, crash_at: str) -> int:
    env = os.environ | {"DRAFTSMITH_CRASH_AT": crash_at, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
                        "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT, timeout=300).returncode


def test_sigkill_between_checkpoint_rename_and_latest_loses_nothing(tmp_path):
    crashed, whole = tmp_path / "crashed", tmp_path / "whole"
    assert _python(_TRAIN_SCRIPT, str(crashed), crash_at="checkpoint-renamed") == -signal.SIGKILL
    assert (crashed / "checkpoints" / "step-000003").is_dir() and not (crashed / "latest").exists()
    (crashed / ".latest.tmp99999").write_text("half")  # a temp file another crash left: swept at start
    _, data, weights, config = setup(count=6)
    cfg = TrainConfig(max_steps=6, batch_size=2, ttt_steps=2, checkpoint_every=3, eval_every=100, warmup_steps=1)
    result = run(cfg, data, weights, config, crashed)  # resumes from step 3, though `latest` never named it
    run(cfg, data, weights, config, whole)
    assert result.steps == 6
    assert_same_curves(curve(crashed), curve(whole))  # the subprocess ran on 1 thread: fp32 sums reorder
    assert not list(crashed.glob(".*.tmp*"))


def test_export_refuses_foreign_files_and_a_crash_leaves_the_old_or_the_new_export(tmp_path, trained):
    out = export(trained.run, tmp_path / "exp", "speculators", verifier=str(trained.model_dir))
    old = tree_hash(out)
    (out / "my-notes.md").write_text("mine\n")  # an export with a file export did not write: not replaced
    with pytest.raises(DraftsmithError, match="files an export does not write"):
        export(trained.run, out, "speculators", verifier=str(trained.model_dir))
    (out / "my-notes.md").unlink()
    script = ("import sys\nfrom draftsmith.formats.export import export\n"
              "export(sys.argv[1], sys.argv[2], 'speculators', verifier=sys.argv[3], dtype='bfloat16')")  # fmt: skip
    args = (str(trained.run), str(out), str(trained.model_dir))
    assert _python(script, *args, crash_at="export-built") == -signal.SIGKILL
    assert tree_hash(out) == old  # killed before the swap: the old export, whole
    assert _python(script, *args, crash_at="export-swapped") == -signal.SIGKILL
    assert json.loads((out / "config.json").read_text())["draftsmith"]["format"] == "speculators"
    assert tree_hash(out) != old and load_drafter(out, trained.target)  # killed after: the new one, whole
    export(trained.run, out, "speculators", verifier=str(trained.model_dir))  # and the leftovers are swept
    assert tree_hash(out) == old and not list(tmp_path.glob(".exp.*"))


def test_swap_dirs_without_renameat2_is_recovered(tmp_path, monkeypatch):
    from draftsmith import util

    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir()
    old.mkdir()
    (new / "f").write_text("new")
    (old / "f").write_text("old")
    monkeypatch.setattr(util, "_exchange", lambda a, b: False)
    swap_dirs(new, old)
    assert (old / "f").read_text() == "new" and (new / "f").read_text() == "old"
    parked = tmp_path / ".old.old123"  # as a crash between the two renames leaves it
    os.replace(old, parked)
    util.recover_swap(old)
    assert (old / "f").read_text() == "new"


def test_the_cli_refuses_before_loading_anything_and_overwrite_replaces(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from draftsmith.cli import app

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before --out was checked")

    monkeypatch.setattr("draftsmith.target.load_target", no_target)
    mine = users_folder(tmp_path / "mine")
    before = tree_hash(mine)
    for args in (["train", str(tmp_path / "store"), "--out", str(mine)], ["extract", str(tmp_path), "--out", str(mine)],
                 ["eval", "--out", str(mine)], ["export", str(tmp_path / "run"), "--out", str(mine)]):  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "did not write" in result.output, (args, result.output)
    assert tree_hash(mine) == before
    result = CliRunner().invoke(app, ["vocab", str(tmp_path / "no-store"), "--out", str(mine), "--overwrite"])
    assert result.exit_code != 0 and not (mine / "thesis.tex").exists()  # replaced as asked, then no store
