"""Export to speculators / SGLang / EAGLE layouts and import back: same weights, same drafts, same acceptance; and
interop with the real `speculators` 0.9.0 model classes in both directions."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.drafters.eagle3 import Eagle3Drafter, read_config, resolve_checkpoint
from draftsmith.errors import DraftsmithError
from draftsmith.formats.export import export
from draftsmith.formats.load import build_drafter, detect_format, load_drafter, read_drafter
from tests.formats_helpers import LAYERS, trained_setup

FORMATS = ("speculators", "sglang", "eagle")


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    return trained_setup(tmp_path_factory.mktemp("formats"))


@pytest.fixture(scope="session")
def speculators_lib():
    try:
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    except ImportError as exc:  # `make setup` installs it; a missing library must not pass silently
        pytest.fail(f"the speculators library is not installed ({exc}): run `make setup`")
    return Eagle3DraftModel, Eagle3SpeculatorConfig


def convs_file(tmp_path, trained):
    """The first training prompts as a ShareGPT file: a drafter trained for seconds only knows those well."""
    words = torch.randint(2, 96, (4, 4), generator=torch.Generator().manual_seed(1))  # as chat_prompts(seed=1)
    lines = [
        json.dumps({"id": f"p{i}", "conversations": [{"from": "human", "value": " ".join(f"t{int(t)}" for t in row)}]})
        for i, row in enumerate(words)
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_eval(trained, drafter, prompts, out):
    result = CliRunner().invoke(
        app,
        ["eval", "--target", str(trained.model_dir), "--drafter", str(drafter), "--dataset", str(prompts),
         "--max-new-tokens", "40", "--num-draft-tokens", "4", "--draft-length", "fixed", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text())


def test_export_import_eval_is_identical_in_every_format(tmp_path, trained):
    prompts = convs_file(tmp_path, trained)
    original = run_eval(trained, trained.run, prompts, tmp_path / "eval-original")
    assert original["mismatches"] == 0 and original["acceptance_length"] > 1.2  # a drafter that gets accepted
    ckpt = resolve_checkpoint(trained.run)
    state = load_file(ckpt / "model.safetensors")
    for fmt in FORMATS:
        out = export(trained.run, tmp_path / fmt, fmt, verifier=str(trained.model_dir), store=trained.store,
                     report=tmp_path / "eval-original")  # fmt: skip
        assert detect_format(out) == fmt
        assert f"acceptance length **{original['acceptance_length']:.2f}**" in (out / "README.md").read_text()
        converted = read_drafter(out, trained.target.num_layers)
        assert converted.config == read_config(ckpt)  # same shapes, same aux ids in our convention, same target
        assert converted.state.keys() == state.keys()
        assert all(torch.equal(converted.state[k], v) for k, v in state.items()), fmt
        report = run_eval(trained, out, prompts, tmp_path / f"eval-{fmt}")
        assert report["mismatches"] == 0  # identical greedy output (both equal model.generate's)
        for key in ("acceptance_length", "acceptance_by_position", "drafts_by_position", "new_tokens"):
            assert report[key] == original[key], (fmt, key)
        assert [p["acceptance_length"] for p in report["per_prompt"]] == [
            p["acceptance_length"] for p in original["per_prompt"]
        ]
        assert report["drafter_checkpoint"] == str(out)


def test_export_files_and_layer_id_conventions(tmp_path, trained):
    ids = {}
    steps = int(resolve_checkpoint(trained.run).name.removeprefix("step-"))  # the best validation's checkpoint
    for fmt in FORMATS:
        out = export(trained.run, tmp_path / fmt, fmt, verifier=str(trained.model_dir), store=trained.store)
        assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
        cfg = json.loads((out / "config.json").read_text())
        keys = set(load_file(out / "model.safetensors"))
        assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
        assert "embed_tokens.weight" not in keys  # engines share the target's
        prov = cfg["draftsmith"]
        assert prov["aux_layer_ids"] == list(LAYERS) and prov["format"] == fmt
        assert prov["store"]["layer_ids"] == list(LAYERS) and prov["training"]["steps"] == steps
        card = (out / "README.md").read_text()
        assert "## Serve it" in card and "draftsmith layer ids [2, 3, 4], meaning the input of decoder layer i" in card
        if fmt == "speculators":
            assert cfg["speculators_model_type"] == "eagle3" and cfg["speculators_version"] == "0.9.0"
            assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False
            assert cfg["fc_norm"] is False and cfg["norm_output"] is False
            assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(trained.model_dir)
            assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
            assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2  # the TTT depth
            assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
            assert any(k.startswith("layers.0.") for k in keys) and not any(k.startswith("midlayer.") for k in keys)
            assert f"vllm serve {out.resolve()}" in card
            ids[fmt] = cfg["eagle_aux_hidden_state_layer_ids"]
        else:
            assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
            assert cfg["draft_vocab_size"] == 64 and any(k.startswith("midlayer.") for k in keys)
            ids[fmt] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            assert ("sglang.launch_server" in card) == (fmt == "sglang")
        assert f"training budget: {steps} steps" in card and "16 samples" in card
    # vLLM reads ids as inputs of layers (ours); SGLang as outputs of layer j = input of j + 1.
    assert ids == {"speculators": [2, 3, 4], "eagle": [2, 3, 4], "sglang": [1, 2, 3]}


def test_foreign_native_ids_follow_sglang_rule(tmp_path, trained):
    """Without our provenance block, ids starting at 1 are outputs of layers (SpecForge/SGLang), others inputs."""
    for written, expected in (([1, 2, 3], (2, 3, 4)), ([2, 3, 4], (2, 3, 4)), (None, (2, 3, 3))):
        out = export(trained.run, tmp_path / f"n{written}", "sglang", verifier=str(trained.model_dir))
        cfg = json.loads((out / "config.json").read_text())
        del cfg["draftsmith"]
        if written is None:
            del cfg["eagle_config"]  # the engines' default (2, N//2, N-3) for a 6-layer target
        else:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = written
        (out / "config.json").write_text(json.dumps(cfg))
        assert read_drafter(out, trained.target.num_layers).config.aux_layer_ids == expected


def test_unsupported_variants_and_unsafe_outputs_are_clear_errors(tmp_path, trained):
    out = export(trained.run, tmp_path / "s", "speculators", verifier=str(trained.model_dir))
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg["transformer_layer_config"] | {"num_hidden_layers": 2}  # a variant draftsmith cannot run
    (out / "config.json").write_text(json.dumps(cfg | {"transformer_layer_config": layer}))
    with pytest.raises(DraftsmithError, match="num_hidden_layers=2"):
        load_drafter(out, trained.target)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DraftsmithError, match="not an earlier draftsmith export"):
        export(trained.run, tmp_path / "mine", "eagle")
    with pytest.raises(DraftsmithError, match="unknown export format"):
        export(trained.run, tmp_path / "x", "onnx")
    result = CliRunner().invoke(app, ["export", str(trained.run), "--format", "sglang", "--out", str(out)])
    assert result.exit_code == 0, result.output  # an earlier export is replaced
    assert detect_format(out) == "sglang"


def test_speculators_library_loads_our_export(tmp_path, trained, speculators_lib):
    """The real client: speculators' own classes load the export; every tensor and the draft logits match ours."""
    Eagle3DraftModel, Eagle3SpeculatorConfig = speculators_lib
    out = export(trained.run, tmp_path / "spec", "speculators", verifier=str(trained.model_dir))
    config = Eagle3SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "sdpa"  # its default, flex attention, wants a GPU
    theirs = Eagle3DraftModel.from_pretrained(out, config=config).eval()
    # speculators 0.9.0 under transformers 5 leaves a missing embed_tokens uninitialised rather than NaN, so its
    # "fill from the verifier if NaN" never fires; mark it NaN and let its public loader fill it, as intended.
    with torch.no_grad():
        theirs.embed_tokens.weight.fill_(float("nan"))
    theirs.load_verifier_weights()
    ours = load_drafter(trained.run, trained.target).model
    mine = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in ours.state_dict().items()}
    got = {k: v for k, v in theirs.state_dict().items() if not k.startswith("verifier_")}
    assert got.keys() == mine.keys()
    assert all(torch.equal(got[k], mine[k]) for k in mine)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == list(LAYERS)
    # What the library writes for this very model is what we wrote, less its auto_map (it keeps our block too).
    theirs.save_pretrained(tmp_path / "resaved")
    written = json.loads((out / "config.json").read_text())
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert {k: v for k, v in resaved.items() if k != "auto_map"} == written

    # Same inputs: tokens x[t+1] and target features at t, positions t.
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (1, 12), generator=gen)
    feats = torch.randn(1, 12, 3 * 32, generator=gen)
    positions = torch.arange(12)
    captured = []
    theirs.lm_head.register_forward_hook(lambda module, args, output: captured.append(output))
    with torch.no_grad():
        theirs(feats, ids, torch.zeros_like(ids), position_ids=positions[None], ttt_steps=1)
        _, logits = ours(ours.embed_tokens(ids), ours.fuse(feats), positions)
    assert torch.allclose(captured[0], logits, atol=1e-5, rtol=1e-5)


def test_checkpoint_written_by_speculators_loads_into_eval(tmp_path, trained, speculators_lib):
    """The reverse direction: a drafter built and saved by the speculators library runs in `draftsmith eval`."""
    Eagle3DraftModel, Eagle3SpeculatorConfig = speculators_lib
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    vocab = load_file(trained.root / "vocab" / "vocab.safetensors")
    layer = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=64,
        eagle_aux_hidden_state_layer_ids=list(LAYERS),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(trained.model_dir)),
        ),
    )
    torch.manual_seed(0)
    theirs = Eagle3DraftModel(config)
    theirs.load_vocab_mappings(vocab["t2d"], vocab["d2t"])
    theirs.load_verifier_weights()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    theirs.save_pretrained(tmp_path / "theirs")
    assert detect_format(tmp_path / "theirs") == "speculators"

    drafter = build_drafter(str(tmp_path / "theirs"), trained.target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.aux_layer_ids == LAYERS
    ours = drafter.model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (1, 9), generator=gen)
    feats = torch.randn(1, 9, 96, generator=gen)
    captured = []
    theirs.eval().lm_head.register_forward_hook(lambda module, args, output: captured.append(output))
    with torch.no_grad():
        theirs(feats, ids, torch.zeros_like(ids), position_ids=torch.arange(9)[None], ttt_steps=1)
        _, logits = ours(ours.embed_tokens(ids), ours.fuse(feats), torch.arange(9))
    assert torch.allclose(captured[0], logits, atol=1e-5, rtol=1e-5)
    report = run_eval(trained, tmp_path / "theirs", convs_file(tmp_path, trained), tmp_path / "eval")
    assert report["mismatches"] == 0 and report["prompts"] == 4


def test_renamed_weight_is_refused_on_import(tmp_path, trained):
    out = export(trained.run, tmp_path / "e", "eagle", verifier=str(trained.model_dir))
    state = load_file(out / "model.safetensors")
    state["midlayer.hidden_layernorm.weight"] = state.pop("midlayer.hidden_norm.weight")
    save_file(state, out / "model.safetensors")
    with pytest.raises(DraftsmithError, match=r"missing weights \['midlayer.hidden_norm.weight'\]"):
        load_drafter(out, trained.target)
    shutil.rmtree(out)
