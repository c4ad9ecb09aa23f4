"""`draftsmith doctor`: a healthy export passes; each silent failure, built on purpose, is caught."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.formats.doctor import check_hidden_states, diagnose
from draftsmith.formats.export import export
from draftsmith.store import extract
from draftsmith.target import Target
from tests.formats_helpers import LAYERS, greedy_samples, trained_setup


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    return trained_setup(tmp_path_factory.mktemp("formats"))


def statuses(checks) -> dict[str, str]:
    return {c.name: c.status for c in checks}


def detail(checks, name: str) -> str:
    return next(c.detail for c in checks if c.name == name)


def exported(tmp_path, trained, fmt="speculators"):
    return export(trained.run, tmp_path / fmt, fmt, verifier=str(trained.model_dir), store=trained.store)


def run_doctor(trained, path, *extra):
    return CliRunner().invoke(
        app, ["doctor", str(path), "--target", str(trained.model_dir), "--store", str(trained.store), *extra]
    )


def test_healthy_exports_pass(tmp_path, trained):
    for fmt in ("speculators", "sglang", "eagle"):
        checks = diagnose(exported(tmp_path, trained, fmt), trained.target, trained.store)
        assert set(statuses(checks).values()) == {"PASS"}, [c for c in checks if c.status != "PASS"]
    assert "acceptance length" in detail(checks, "acceptance")
    result = run_doctor(trained, tmp_path / "speculators")
    assert result.exit_code == 0, result.output
    assert "hidden states" in result.output and "FAIL" not in result.output


def test_renamed_key_fails(tmp_path, trained):
    out = exported(tmp_path, trained)
    state = load_file(out / "model.safetensors")
    state["layers.0.hidden_layernorm.weight"] = state.pop("layers.0.hidden_norm.weight")
    save_file(state, out / "model.safetensors")
    checks = diagnose(out, trained.target, trained.store)
    assert statuses(checks)["weights"] == "FAIL"
    assert "layers.0.hidden_layernorm.weight" in detail(checks, "weights")
    assert "missing ['layers.0.hidden_norm.weight']" in detail(checks, "weights")
    result = run_doctor(trained, out)
    assert result.exit_code == 1 and "FAIL" in result.output


def test_zeroed_d2t_fails(tmp_path, trained):
    out = exported(tmp_path, trained, "sglang")
    state = load_file(out / "model.safetensors")
    state["d2t"] = torch.zeros_like(state["d2t"])
    save_file(state, out / "model.safetensors")
    checks = diagnose(out, trained.target, trained.store)
    assert statuses(checks)["vocabulary"] == "FAIL" and "all zeros" in detail(checks, "vocabulary")
    assert statuses(checks)["acceptance"] == "SKIP"
    assert run_doctor(trained, out).exit_code == 1


def test_missing_special_tokens_warn(tmp_path, trained):
    out = exported(tmp_path, trained, "eagle")
    state = load_file(out / "model.safetensors")
    eos = 1  # the tiny target's EOS, in the draft vocabulary: swap it for a token outside it
    t2d, d2t = state["t2d"].clone(), state["d2t"]
    outside = int(torch.nonzero(~t2d)[-1])
    t2d[eos], t2d[outside] = False, True
    ids = torch.nonzero(t2d).flatten()
    save_file(state | {"t2d": t2d, "d2t": ids - torch.arange(len(ids))}, out / "model.safetensors")
    assert len(d2t) == len(ids)
    checks = diagnose(out, trained.target)
    assert statuses(checks)["vocabulary"] == "WARN" and "[1]" in detail(checks, "vocabulary")


def test_shifted_layer_ids_fail(tmp_path, trained):
    """The off-by-one of the two conventions: ids shifted after export, with or without our provenance block."""
    out = exported(tmp_path, trained)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in LAYERS]
    (out / "config.json").write_text(json.dumps(cfg))
    checks = diagnose(out, trained.target, trained.store)
    assert statuses(checks)["aux layers"] == "FAIL"
    assert "edited or shifted" in detail(checks, "aux layers") and "store holds layers" in detail(checks, "aux layers")
    del cfg["draftsmith"]
    (out / "config.json").write_text(json.dumps(cfg))
    checks = diagnose(out, trained.target, trained.store)
    assert statuses(checks)["aux layers"] == "FAIL" and "shifted ids?" in detail(checks, "aux layers")
    # Without a store the provenance-free directory cannot be checked against training: a WARN, and the smoke test.
    checks = diagnose(out, trained.target)
    assert statuses(checks)["aux layers"] == "WARN" and "inferred" in detail(checks, "aux layers")
    assert statuses(checks)["acceptance"] in ("FAIL", "WARN")
    assert run_doctor(trained, out).exit_code == 1


def test_sglang_ids_not_starting_at_one_warn(tmp_path, trained):
    out = exported(tmp_path, trained, "sglang")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["draftsmith"]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(LAYERS)  # inputs-of-layers style
    (out / "config.json").write_text(json.dumps(cfg))
    checks = diagnose(out, trained.target, trained.store)
    assert statuses(checks)["aux layers"] == "WARN" and "SGLang versions disagree" in detail(checks, "aux layers")


def other_store(tmp_path, trained, name: str, model) -> object:
    return extract(Target(name, model, trained.target.tokenizer), greedy_samples(trained.target, 4),
                   tmp_path / name, layer_ids=LAYERS, dtype="bfloat16", progress=False)  # fmt: skip


def test_hidden_states_from_another_dtype_or_quantisation(tmp_path, trained):
    """Training states extracted in bf16 (dtype drift: WARN) or from 4-bit weights (another model: FAIL)."""
    bf16 = other_store(tmp_path, trained, "bf16", copy.deepcopy(trained.target.model).to(torch.bfloat16))
    check = check_hidden_states(trained.target, bf16, samples=4, max_tokens=256)
    assert check.status == "WARN" and "different dtype" in check.detail

    quantised = copy.deepcopy(trained.target.model)
    with torch.no_grad():
        for p in quantised.parameters():
            if p.dim() == 2:  # symmetric 4-bit per row, as a Q4 GGUF roughly is
                scale = p.abs().amax(1, keepdim=True).clamp_min(1e-8) / 7
                p.copy_((p / scale).round().clamp(-8, 7) * scale)
    q4 = other_store(tmp_path, trained, "q4", quantised)
    check = check_hidden_states(trained.target, q4, samples=4, max_tokens=256)
    assert check.status == "FAIL" and "quantisation" in check.detail

    checks = diagnose(exported(tmp_path, trained), trained.target, q4)
    assert statuses(checks)["hidden states"] == "FAIL"
    assert statuses(checks)["target"] == "FAIL"  # the drafter's fingerprint is not the store's target
    assert run_doctor(trained, tmp_path / "speculators", "--store", str(q4)).exit_code == 1
    same = other_store(tmp_path, trained, "same", trained.target.model)
    assert check_hidden_states(trained.target, same, samples=4, max_tokens=256).status == "PASS"


def test_useless_drafter_fails_the_smoke_test(tmp_path, trained):
    """Random weights with a valid layout: every structural check passes, acceptance says it is useless."""
    out = exported(tmp_path, trained, "eagle")
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for key in ("fc.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight"):
        state[key] = torch.randn(state[key].shape, generator=gen)
    save_file(state, out / "model.safetensors")
    checks = diagnose(out, trained.target, trained.store)
    assert statuses(checks)["acceptance"] == "FAIL" and "aux layer ids off by one" in detail(checks, "acceptance")
    assert statuses(checks)["weights"] == "PASS"


def test_doctor_without_target_skips_target_checks(tmp_path, trained):
    result = CliRunner().invoke(app, ["doctor", str(exported(tmp_path, trained))])
    assert result.exit_code == 0, result.output  # the recorded target is the tiny model's directory name
    result = CliRunner().invoke(app, ["doctor", str(tmp_path / "nothing")])
    assert result.exit_code == 1 and "FAIL" in result.output
