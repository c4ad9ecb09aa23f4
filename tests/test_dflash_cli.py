"""DFlash through the CLI on a tiny model: one store trains both algorithms; eval, export (z-lab), inspect, doctor."""

import json

import pytest
import torch
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.formats.doctor import diagnose
from draftsmith.target import load_target
from tests.conftest import saved_tiny_model, tiny_conversations


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target, one extract store, and an EAGLE-3 and a DFlash run trained from it."""
    tmp = tmp_path_factory.mktemp("dflash_cli")
    model = saved_tiny_model(tmp / "model")
    convs = tiny_conversations(tmp / "convs.jsonl", 6)
    run = CliRunner().invoke
    for args in (
        ["data", str(convs), "--out", str(tmp / "data")],
        ["extract", str(tmp / "data"), "--target", model, "--out", str(tmp / "store"), "--layers", "1,2,3",
         "--dtype", "float32"],
        ["vocab", str(tmp / "store"), "--size", "16", "--out", str(tmp / "vocab")],
        ["train", str(tmp / "store"), "--vocab", str(tmp / "vocab"), "--target", model, "--out", str(tmp / "eagle3"),
         "--max-steps", "2", "--batch-size", "2", "--ttt-steps", "2"],
        ["train", str(tmp / "store"), "--target", model, "--out", str(tmp / "dflash"), "--algo", "dflash",
         "--block-size", "8", "--draft-layers", "2", "--max-steps", "3", "--batch-size", "2", "--anchors", "4",
         "--eval-every", "2"],
    ):  # fmt: skip
        result = run(app, args)
        assert result.exit_code == 0, (args[0], result.output)
    return tmp, model, convs


def test_one_store_trains_both_and_dflash_evaluates_losslessly(trained):
    tmp, model, convs = trained
    config = json.loads((tmp / "dflash" / "checkpoints" / "step-000003" / "config.json").read_text())
    assert config["algorithm"] == "dflash" and config["aux_layer_ids"] == [1, 2, 3] and config["block_size"] == 8
    result = CliRunner().invoke(app, ["eval", "--target", model, "--drafter", str(tmp / "dflash"), "--dataset",
                                      str(convs), "--limit", "2", "--max-new-tokens", "12", "--num-draft-tokens", "7",
                                      "--out", str(tmp / "eval")])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp / "eval" / "report.json").read_text())
    assert report["mismatches"] == 0 and report["drafter"].startswith("dflash:")
    # the adaptive budget cuts blocks by costs timed here; the full block is measured beside it (the drafter's quality)
    assert report["mismatches_fixed"] == 0 and report["draft_costs"]["forward_costs"][0] == 1.0


def test_export_zlab_inspect_and_doctor(trained):
    tmp, model, convs = trained
    run = CliRunner().invoke
    result = run(app, ["export", str(tmp / "dflash"), "--format", "zlab", "--out", str(tmp / "zlab"),
                       "--store", str(tmp / "store")])  # fmt: skip
    assert result.exit_code == 0, result.output
    raw = json.loads((tmp / "zlab" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    card = (tmp / "zlab" / "README.md").read_text()
    assert "--speculative-algorithm DFLASH" in card and '"num_speculative_tokens": 7' in card
    assert "--speculative-num-draft-tokens 8" in card

    result = run(app, ["inspect", str(tmp / "zlab"), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["algorithm"] == "dflash" and info["block_size"] == 8 and info["format"] == "zlab"
    assert info["layer_ids"]["draftsmith"] == [1, 2, 3] and info["layer_ids"]["engine"] == [0, 1, 2]
    assert info["parameters"] > 0 and info["dtype"] == "float32" and len(info["serve"]) == 2
    result = run(app, ["eval", "--target", model, "--drafter", str(tmp / "zlab"), "--dataset", str(convs),
                       "--limit", "1", "--max-new-tokens", "8", "--num-draft-tokens", "7",
                       "--out", str(tmp / "eval-zlab")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads((tmp / "eval-zlab" / "report.json").read_text())["mismatches"] == 0
    result = run(app, ["inspect", str(tmp / "dflash")])
    assert result.exit_code == 0 and "DFLASH drafter, draftsmith layout" in result.output
    assert "draftsmith export" in result.output and "--speculative-algorithm DFLASH" in result.output
    result = run(app, ["inspect", str(tmp / "eagle3")])
    assert result.exit_code == 0 and "EAGLE3 drafter" in result.output and "draft vocabulary 16" in result.output
    assert "draftsmith export" in result.output  # a training run is served through its export

    checks = {c.name: c for c in diagnose(tmp / "zlab", load_target(model), tmp / "store", max_new_tokens=8)}
    assert all(checks[n].status == "PASS" for n in ("weights", "target layers", "hidden sizes", "hidden states"))
    assert checks["mask token"].status in ("PASS", "WARN") and checks["acceptance"].status != "SKIP"


@pytest.mark.parametrize(
    ("edit", "check", "message"),
    [
        ({"dflash_config": {"block_size": 8, "mask_token_id": 95, "target_layer_ids": [0, 1, 3]}}, "target layers",
         "outside 0..3"),
        ({"num_target_layers": 6}, "hidden sizes", "target depth 6"),
    ],
)  # fmt: skip
def test_doctor_flags_bad_dflash_dirs(trained, tmp_path, edit, check, message):
    tmp, model, _ = trained
    CliRunner().invoke(app, ["export", str(tmp / "dflash"), "--format", "zlab", "--out", str(tmp_path / "x")])
    raw = json.loads((tmp_path / "x" / "config.json").read_text())
    (tmp_path / "x" / "config.json").write_text(json.dumps(raw | edit))
    checks = {c.name: c for c in diagnose(tmp_path / "x", load_target(model))}
    assert checks[check].status == "FAIL" and message in checks[check].detail


def test_dflash_export_refuses_eagle_formats(trained):
    tmp, _, _ = trained
    result = CliRunner().invoke(app, ["export", str(tmp / "dflash"), "--format", "sglang", "--out", str(tmp / "y")])
    assert result.exit_code == 2 and "exports as zlab or speculators" in result.output


def test_draft_vocabulary_is_kept_for_our_engine_and_left_out_of_exports(trained):
    from safetensors.torch import load_file

    tmp, model, convs = trained
    run = CliRunner().invoke
    result = run(app, ["train", str(tmp / "store"), "--vocab", str(tmp / "vocab"), "--target", model, "--out",
                       str(tmp / "dflash-vocab"), "--algo", "dflash", "--block-size", "4", "--draft-vocab",
                       "--max-steps", "1", "--batch-size", "2", "--anchors", "2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    ckpt = tmp / "dflash-vocab" / "checkpoints" / "step-000001"
    vocab = load_file(tmp / "vocab" / "vocab.safetensors")
    assert torch.equal(load_file(ckpt / "model.safetensors")["draft_ids"], torch.arange(16) + vocab["d2t"])
    result = run(app, ["eval", "--target", model, "--drafter", str(tmp / "dflash-vocab"), "--dataset", str(convs),
                       "--limit", "1", "--max-new-tokens", "8", "--num-draft-tokens", "3",
                       "--out", str(tmp / "eval-vocab")])  # fmt: skip
    assert result.exit_code == 0 and json.loads((tmp / "eval-vocab" / "report.json").read_text())["mismatches"] == 0
    assert run(app, ["export", str(tmp / "dflash-vocab"), "--format", "zlab", "--out", str(tmp / "z2")]).exit_code == 0
    assert "draft_ids" not in load_file(tmp / "z2" / "model.safetensors")
    assert json.loads(run(app, ["inspect", str(tmp / "dflash-vocab"), "--json"]).output)["draft_vocab_size"] == 16
