"""`train --online`: the target computes, on the fly, exactly the features `extract` would have stored."""

import torch
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.online import OnlineFeatures
from draftsmith.store import HiddenStateStore
from draftsmith.target import load_target
from tests.conftest import saved_tiny_model, tiny_conversations


def test_online_features_equal_the_store_and_train(tmp_path):
    model = saved_tiny_model(tmp_path / "model")
    convs = tiny_conversations(tmp_path / "convs.jsonl", 4)
    run = CliRunner().invoke
    assert run(app, ["data", str(convs), "--out", str(tmp_path / "data")]).exit_code == 0
    result = run(app, ["extract", str(tmp_path / "data"), "--target", model, "--out", str(tmp_path / "store"),
                       "--layers", "0,1,2", "--dtype", "float32"])  # fmt: skip
    assert result.exit_code == 0, result.output

    online = OnlineFeatures(load_target(model), tmp_path / "data", layer_ids=(0, 1, 2))
    store = HiddenStateStore(tmp_path / "store")
    assert len(online) == len(store) == 4
    for i in range(4):
        a, b = online[i], store[i]
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert torch.allclose(a[key].float(), b[key].float(), atol=1e-5), key

    result = run(app, ["vocab", str(tmp_path / "data"), "--target", model, "--size", "16", "--out",
                       str(tmp_path / "vocab")])  # fmt: skip
    assert result.exit_code == 0, result.output
    train = [
        "train",
        str(tmp_path / "data"),
        "--vocab",
        str(tmp_path / "vocab"),
        "--target",
        model,
        "--out",
        str(tmp_path / "run"),
        "--max-steps",
        "2",
        "--batch-size",
        "2",
        "--ttt-steps",
        "2",
        "--warmup-steps",
        "1",
    ]
    result = run(app, [*train, "--online", "--layers", "0,1,2"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "latest").is_file()
    result = run(app, train)  # a data directory without --online is a mistake, said before any work
    assert result.exit_code == 2 and "--online" in result.output
