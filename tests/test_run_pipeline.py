"""`draftsmith run` beyond eval: export, doctor and bench stages; inputs and outputs with fingerprints; a changed
input re-runs exactly what read it; `draftsmith demo` is `run eagle3 --profile cpu-demo`; plan errors."""

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from draftsmith import pipeline
from draftsmith.cli import app
from draftsmith.errors import ConfigError
from draftsmith.pipeline import STAGES, load_pipeline
from tests.test_pipeline import _tiny_pipeline

REPO = Path(__file__).resolve().parents[1]


def run(*args: str):
    return CliRunner().invoke(app, ["run", *map(str, args)])


def test_export_doctor_and_bench_stages_record_inputs_outputs_and_report(tmp_path):
    pipeline_file, run_dir = _tiny_pipeline(tmp_path), tmp_path / "run"
    sets = ["--set", f"stages={json.dumps(list(STAGES))}", "--set", "doctor.strict=false",
            "--set", "bench.concurrency=[2]", "--set", "bench.num_prompts=2", "--set", "bench.max_tokens=8",
            "--set", "bench.num_draft_tokens=3", "--set", "threads=1"]  # fmt: skip
    result = run(pipeline_file, "--out", run_dir, *sets)
    assert result.exit_code == 0, result.output
    status = json.loads((run_dir / "status.json").read_text())["stages"]
    assert list(status) == list(STAGES) and {e["state"] for e in status.values()} == {"completed"}

    # every stage records what it read and wrote, with content fingerprints that chain: an input's fingerprint is
    # the fingerprint its producer recorded for its output
    for stage, entry in status.items():
        (name, out), *_ = entry["outputs"].items()
        assert (
            name == stage and out["path"] == str(run_dir / stage) and re.fullmatch(r"[0-9a-f]{16}", out["fingerprint"])
        )
        for source, seen in entry["inputs"].items():
            if stage != "data":
                assert seen["fingerprint"] == status[source]["outputs"][source]["fingerprint"], (stage, source)
    assert set(status["data"]["inputs"]) == {str(tmp_path / "convs.jsonl")}
    assert set(status["doctor"]["inputs"]) == {"export", "extract"} and set(status["bench"]["inputs"]) == {"export"}

    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["draftsmith"]["format"] == "speculators" and config["draftsmith"]["acceptance"] is not None
    checks = json.loads((run_dir / "doctor" / "report.json").read_text())["checks"]
    assert {c["name"] for c in checks} >= {"weights", "vocabulary", "aux layers", "hidden states", "acceptance"}
    assert {c["name"]: c["status"] for c in checks}["hidden states"] == "PASS"
    drafter, baseline = (json.loads((run_dir / "bench" / p / "result.json").read_text()) for p in (".", "baseline"))
    assert drafter["levels"][0]["completed"] == baseline["levels"][0]["completed"] == 2
    assert drafter["levels"][0]["server"]["generation_tokens"] > 0
    rows = json.loads((run_dir / "bench" / "compare.json").read_text())["rows"]
    assert rows[0]["concurrency"] == 2 and rows[0]["output tok/s"] > 0
    report = (run_dir / "report.md").read_text()
    assert "Exported (speculators)" in report and "Doctor:" in report and "| 2 |" in report

    table = CliRunner().invoke(app, ["status", str(run_dir)])
    assert table.exit_code == 0 and table.output.count("completed") == 8


def test_a_changed_input_reruns_the_stages_that_read_it(tmp_path):
    pipeline_file, run_dir = _tiny_pipeline(tmp_path), tmp_path / "run"
    assert run(pipeline_file, "--out", run_dir).exit_code == 0
    (run_dir / "vocab" / "vocab.json").write_text((run_dir / "vocab" / "vocab.json").read_text() + " ")
    again = run(pipeline_file, "--out", run_dir)
    assert again.exit_code == 0, again.output
    assert "train: vocab changed since it ran; starting it over" in again.output
    # data, extract and vocab (whose own input, the store, is unchanged) are skipped; so is eval, because the
    # retrained checkpoint is byte-identical (training is deterministic and the edit changed no token id)
    skipped = re.findall(r"^(\w+): completed earlier", again.output, re.M)
    assert skipped == ["data", "extract", "vocab", "eval"], again.output
    status = json.loads((run_dir / "status.json").read_text())["stages"]
    assert status["train"]["inputs"]["vocab"]["fingerprint"] == pipeline.stage_fingerprint("vocab", run_dir / "vocab")


def test_a_doctor_failure_stops_the_run_before_bench(tmp_path, monkeypatch):
    from draftsmith.formats import doctor

    pipeline_file, run_dir = _tiny_pipeline(tmp_path), tmp_path / "run"
    real = doctor.check_acceptance
    monkeypatch.setattr(doctor, "check_acceptance", lambda *a, **k: doctor.Check("acceptance", "FAIL", "useless"))
    result = run(pipeline_file, "--out", run_dir, "--set", f"stages={json.dumps(list(STAGES))}")
    assert result.exit_code == 2
    assert "stage doctor failed: 1 doctor check(s) failed, first acceptance: useless" in result.output
    assert "doctor.strict=false" in result.output and "resume with: draftsmith run" in result.output
    status = json.loads((run_dir / "status.json").read_text())["stages"]
    assert status["doctor"]["state"] == "failed" and "bench" not in status
    monkeypatch.setattr(doctor, "check_acceptance", real)


def test_demo_is_run_eagle3_with_the_cpu_demo_profile(tmp_path, monkeypatch):
    """`make demo` runs `draftsmith demo`, which must resolve to exactly `draftsmith run eagle3 --profile cpu-demo`
    (same PipelineConfig, hence the same stages, numbers and report)."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe and recipe.group(1).strip().endswith("draftsmith demo")
    seen = []

    def record(self):  # the plan each command resolved to, without running it
        seen.append(self.cfg)
        (self.run_dir / "status.json").write_text('{"stages": {}}')
        return {}

    monkeypatch.setattr(pipeline.Runner, "run", record)
    invoke = CliRunner().invoke
    assert invoke(app, ["demo", "--out", str(tmp_path / "demo")]).exit_code == 0
    assert invoke(app, ["run", "eagle3", "--profile", "cpu-demo", "--out", str(tmp_path / "run")]).exit_code == 0
    assert seen[0] == seen[1] == load_pipeline("eagle3", "cpu-demo")
    assert (tmp_path / "demo" / "pipeline.json").read_text() == (tmp_path / "run" / "pipeline.json").read_text()
    assert seen[0].stages == ["data", "extract", "vocab", "train", "eval"]  # make demo does not export or bench


def test_plan_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="list each stage once, in the order data, extract"):
        load_pipeline("eagle3", "cpu-demo", ["stages=[train, data]"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = run("eagle3", "--out", tmp_path / "r")
    assert result.exit_code == 2 and "started by torchrun" in result.output and "nproc_per_node" in result.output
    monkeypatch.delenv("WORLD_SIZE")
    pipeline_file = _tiny_pipeline(tmp_path)
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    result = run(pipeline_file, "--out", tmp_path / "v", "--set", "extract.backend=vllm")
    assert result.exit_code == 2 and "stage extract failed: the vllm backend needs the vllm package" in result.output
    assert "pip install vllm" in result.output


def test_extract_prints_its_size_and_refuses_to_start_without_the_disk_space(tmp_path, monkeypatch):
    """Before extraction: the estimate (bytes per token x tokens); after: what was written. With too little free
    space the extract stage fails before writing anything and says how much it needs."""
    import shutil
    from collections import namedtuple

    pipeline_file, run_dir = _tiny_pipeline(tmp_path), tmp_path / "run"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("usage", "total used free")(10**12, 0, 2000))
    result = run(pipeline_file, "--out", run_dir)
    assert result.exit_code == 2
    need = re.search(
        r"stage extract failed: extract needs about ([\d.]+) kB for (\d+) tokens but .* has only 2.0 kB", result.output
    )
    assert need and "bigger disk" in result.output, result.output
    assert (
        not list((run_dir / "extract").glob("shard-*"))
        and json.loads((run_dir / "status.json").read_text())["stages"]["extract"]["state"] == "failed"
    )

    monkeypatch.setattr(shutil, "disk_usage", real)
    result = run(pipeline_file, "--out", run_dir)
    assert result.exit_code == 0, result.output
    per_token = (3 * 32 + 32) * 4 + 5  # float32 aux (3 layers) + last hidden state, int32 id, uint8 mask
    tokens = int(need.group(2))
    assert f"extract: 6 samples, {tokens} tokens, {per_token} bytes/token -> about" in result.output
    assert float(need.group(1)) == pytest.approx(tokens * per_token / 1e3, abs=0.05)
    actual = re.search(
        rf"extract: stored 6 samples, {tokens} tokens in 2 shards, .* \(([\d.]+) bytes/token\)", result.output
    )
    assert actual and per_token <= float(actual.group(1)) < 1.5 * per_token  # + safetensors headers and offsets
