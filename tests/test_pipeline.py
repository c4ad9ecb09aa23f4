"""`draftsmith run`: profiles resolve, stages chain through a status file, re-runs skip or redo exactly what changed."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.errors import ConfigError
from draftsmith.pipeline import load_pipeline, read_pipeline_file, shipped_pipelines
from tests.conftest import saved_tiny_model, tiny_conversations


@pytest.mark.parametrize("name", shipped_pipelines())
def test_every_shipped_profile_parses_and_resolves(name):
    raw, _ = read_pipeline_file(name)
    assert {"cpu-demo", "cpu-full", "gpu-1x", "gpu-8x"} <= set(raw["profiles"])
    for profile in raw["profiles"]:
        cfg = load_pipeline(name, profile)
        assert cfg.stages[0] == "data" and cfg.eval.dataset == "mt_bench"
        assert "mt_bench" not in " ".join(cfg.data.sources + cfg.data.optional_sources)  # never train on the eval set


def test_set_overrides_and_bad_profile():
    cfg = load_pipeline("eagle3", "cpu-demo", ["train.lr=0.005", "vocab.size=1000"])
    assert cfg.train.lr == 0.005 and cfg.vocab.size == 1000 and cfg.train.ttt_steps == 4  # the profile still applies
    with pytest.raises(ConfigError, match="no profile"):
        load_pipeline("eagle3", "tpu-64x")
    with pytest.raises(ConfigError, match="train.nope"):
        load_pipeline("eagle3", None, ["train.nope=1"])
    with pytest.raises(ConfigError, match="bad --set"):
        load_pipeline("eagle3", None, ["train.lr"])


def _tiny_pipeline(tmp_path, steps=4):
    saved_tiny_model(tmp_path / "model")
    convs = tiny_conversations(tmp_path / "convs.jsonl", 6)
    spec = {
        "target": str(tmp_path / "model"),
        "data": {"sources": [str(convs)]},
        "extract": {"layers": [0, 1, 2], "dtype": "float32", "shard_size": 4},
        "vocab": {"size": 16},
        "train": {"max_steps": steps, "batch_size": 2, "ttt_steps": 3, "checkpoint_every": 2, "eval_every": 2,
                  "warmup_steps": 1},
        "eval": {"dataset": str(convs), "limit": 2, "max_new_tokens": 12, "compare": ["ngram"], "compare_limit": 1},
    }  # fmt: skip
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_run_chains_the_stages_and_resumes_only_what_changed(tmp_path):
    pipeline, run_dir = _tiny_pipeline(tmp_path), tmp_path / "run"
    invoke = CliRunner().invoke
    result = invoke(app, ["run", str(pipeline), "--out", str(run_dir)])
    assert result.exit_code == 0, result.output
    status = json.loads((run_dir / "status.json").read_text())["stages"]
    assert [s for s, e in status.items() if e["state"] == "completed"] == ["data", "extract", "vocab", "train", "eval"]
    eagle = json.loads((run_dir / "eval" / "report.json").read_text())
    ngram = json.loads((run_dir / "eval" / "ngram" / "report.json").read_text())
    assert eagle["mismatches"] == 0 and ngram["mismatches"] == 0
    shared = eagle["per_prompt"][0]["baseline_seconds"]
    assert ngram["per_prompt"][0]["baseline_seconds"] == shared  # one shared baseline run
    assert eagle["prompts"] == 2 and ngram["prompts"] == 1  # eval.compare_limit
    report = (run_dir / "report.md").read_text()
    assert "| train |" in report and "acceptance.png" in report and (run_dir / "eval" / "acceptance.png").is_file()
    fixed = f"| its fixed chain of {eagle['num_draft_tokens']} (timed) | {eagle['acceptance_length_fixed']:.2f} |"
    assert fixed in report  # the learned drafter's own quality, under its adaptive policy's row

    again = invoke(app, ["run", str(pipeline), "--out", str(run_dir)])
    assert again.exit_code == 0 and again.output.count("skipped") == 5, again.output

    changed = invoke(app, ["run", str(pipeline), "--out", str(run_dir), "--set", "train.max_steps=6"])
    assert changed.exit_code == 0, changed.output
    assert changed.output.count("skipped") == 3 and "starting it over" in changed.output
    assert (run_dir / "train" / "latest").read_text().strip().endswith("step-000006")
    turns = invoke(app, ["run", str(pipeline), "--out", str(run_dir), "--set", "train.max_steps=6",
                         "--set", "eval.merge_with=[ngram]", "--set", "eval.merge=turns"])  # fmt: skip
    assert turns.exit_code == 0 and turns.output.count("skipped") == 4, turns.output  # only eval re-runs
    merged = json.loads((run_dir / "eval" / "report.json").read_text())
    assert merged["drafter"].endswith("|ngram[1-4]") and merged["mismatches"] == 0
    tree = invoke(app, ["run", str(pipeline), "--out", str(run_dir), "--set", "train.max_steps=6",
                        "--set", "eval.merge_with=[ngram]", "--set", 'eval.tree="depth=2,topk=2,total=3"'])  # fmt: skip
    assert tree.exit_code == 0 and tree.output.count("skipped") == 4, tree.output
    merged = json.loads((run_dir / "eval" / "report.json").read_text())  # the cpu profiles' default policy
    assert merged["drafter"].endswith("+ngram[1-4]") and merged["tree"] == "depth=2,topk=2,total=3"
    assert merged["mismatches"] == merged["mismatches_fixed"] == merged["mismatches_merged"] == 0
    fixed = f"| its fixed chain of {eagle['num_draft_tokens']} (timed) | {merged['acceptance_length_fixed']:.2f} |"
    assert fixed in (run_dir / "report.md").read_text()  # the chain's length, not the tree's total
    table = invoke(app, ["status", str(run_dir)])
    assert table.exit_code == 0 and table.output.count("completed") == 5


def test_a_failed_stage_is_recorded_and_names_the_resume_command(tmp_path):
    pipeline, run_dir = _tiny_pipeline(tmp_path), tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(pipeline), "--out", str(run_dir), "--set", "vocab.size=100000"])
    assert result.exit_code == 2
    assert "stage vocab failed" in result.output and "resume with: draftsmith run" in result.output
    status = json.loads((run_dir / "status.json").read_text())["stages"]
    assert status["extract"]["state"] == "completed" and status["vocab"]["state"] == "failed"


def test_the_train_stage_runs_in_a_process_of_its_own_and_its_error_comes_back(tmp_path, monkeypatch):
    """Training runs as `python -m draftsmith.launch train RUN_DIR`, so the eval stage is timed in a process that
    never trained; a DraftsmithError in that process is the stage's error, message and hint, in the pipeline."""
    from draftsmith import pipeline as pipeline_module

    def in_this_process(*args, **kwargs):
        raise AssertionError("trained in the pipeline's own process")

    monkeypatch.setattr(pipeline_module.run_stage, "train", in_this_process)
    pipeline, run_dir = _tiny_pipeline(tmp_path), tmp_path / "run"
    sets = ["--set", "train.batch_size=3", "--set", "train.micro_batch_size=2"]  # refused when the trainer starts
    result = CliRunner().invoke(app, ["run", str(pipeline), "--out", str(run_dir), *sets])
    assert result.exit_code == 2
    assert "stage train failed: batch_size 3 is not a multiple of micro_batch_size 2" in result.output
    assert "resume with: draftsmith run" in result.output and not (run_dir / "train.error.json").exists()
    status = json.loads((run_dir / "status.json").read_text())["stages"]
    assert status["train"]["state"] == "failed" and "micro_batch_size" in status["train"]["error"]
