"""`draftsmith data | extract | vocab` chained through the CLI on a tiny model saved to disk."""

import json

from safetensors.torch import load_file
from typer.testing import CliRunner

from draftsmith.cli import app
from tests.conftest import saved_tiny_model, tiny_conversations


def test_data_extract_vocab_train_eval_chain(tmp_path):
    model = saved_tiny_model(tmp_path / "model")
    convs = tiny_conversations(tmp_path / "convs.jsonl", 6)
    run = CliRunner().invoke
    result = run(app, ["data", str(convs), "--out", str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    result = run(app, ["extract", str(tmp_path / "data"), "--target", model, "--out", str(tmp_path / "store"),
                       "--layers", "0,1,2", "--dtype", "float32", "--shard-size", "4"])  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["samples"] == 6 and manifest["layer_ids"] == [0, 1, 2] and len(manifest["shards"]) == 2
    result = run(app, ["vocab", str(tmp_path / "store"), "--size", "16", "--out", str(tmp_path / "vocab")])
    assert result.exit_code == 0, result.output
    tensors = load_file(tmp_path / "vocab" / "vocab.safetensors")
    assert tensors["d2t"].shape == (16,) and int(tensors["t2d"].sum()) == 16
    result = run(app, ["train", str(tmp_path / "store"), "--vocab", str(tmp_path / "vocab"), "--target", model,
                       "--out", str(tmp_path / "run"), "--max-steps", "4", "--batch-size", "2", "--ttt-steps", "3",
                       "--checkpoint-every", "2", "--eval-every", "2", "--warmup-steps", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "latest").is_file() and (tmp_path / "run" / "metrics.jsonl").is_file()
    result = run(app, ["train", str(tmp_path / "store"), "--vocab", str(tmp_path / "vocab"), "--target", model,
                       "--out", str(tmp_path / "run3"), "--batch-size", "2", "--micro-batch-size", "3",
                       "--bf16", "auto"])  # fmt: skip
    assert result.exit_code == 2 and "not a multiple of micro_batch_size 3" in result.output
    result = run(app, ["train", str(tmp_path / "store"), "--vocab", str(tmp_path / "vocab"), "--target", model,
                       "--out", str(tmp_path / "run4"), "--bf16", "maybe"])  # fmt: skip
    assert result.exit_code == 2 and "invalid bf16" in result.output  # refused by the config, not by typer
    result = run(app, ["eval", "--target", model, "--drafter", str(tmp_path / "run"), "--dataset", str(convs),
                       "--limit", "2", "--max-new-tokens", "12", "--out", str(tmp_path / "eval")])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["mismatches"] == 0 and report["prompts"] == 2
    result = run(app, ["eval", "--target", model, "--drafter", str(tmp_path / "run"), "--dataset", str(convs),
                       "--drafter-precision", "int4", "--out", str(tmp_path / "eval4")])  # fmt: skip
    assert result.exit_code == 2 and "drafter_precision" in result.output
    best = (tmp_path / "run" / "best").read_text().strip()  # the best validation's checkpoint is what eval loads
    assert report["drafter_checkpoint"] == str(tmp_path / "run" / best)
    assert report["drafter_precision"] == "int8"  # auto: a float32 drafter on a CPU drafts in int8
    assert "drafter weights in int8" in (tmp_path / "eval" / "report.md").read_text()
    costs = report["draft_costs"]  # the adaptive budget's costs, timed at load on this machine
    assert len(costs["forward_costs"]) == 9 and costs["forward_costs"][0] == 1.0 and costs["step_cost"] > 0
    assert "Draft budget's costs timed here" in (tmp_path / "eval" / "report.md").read_text()


def test_extract_refuses_an_unfinished_data_stage(tmp_path):
    (tmp_path / "data").mkdir()
    result = CliRunner().invoke(app, ["extract", str(tmp_path / "data")])
    assert result.exit_code == 2 and "no manifest.json" in result.output
