"""Every EAGLE-3 layer variant speculators 0.9.0 trains runs in draftsmith, checked against speculators' own classes:
its training defaults (`norm_before_fc`, `norm_before_residual`, `norm_output` on, a 2048-position sliding window) and
the other switches (`fc_norm`, a Qwen3 layer, a short window), both directions, over several draft steps."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from draftsmith.cli import app
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model, read_config, save_checkpoint
from draftsmith.errors import DraftsmithError
from draftsmith.formats.doctor import diagnose
from draftsmith.formats.export import export
from draftsmith.formats.load import build_model, load_drafter, read_drafter
from draftsmith.target import load_target
from draftsmith.train.losses import ttt_forward
from tests.conftest import tiny_target
from tests.test_engine import reference

LAYERS = (2, 3, 4)
STEPS = 3
# speculators' training defaults for eagle3 (read from its own TrainConfig below), and a variant with every other
# switch: per-layer fc norms, Qwen3's layer (q/k norms) and a window short enough to matter on 16 positions.
VARIANTS = {
    "training-defaults": {},
    "fc_norm-qwen3-window5": {
        "draft_arch": "qwen3",
        "sliding_window": 5,
        "norm_before_fc": False,
        "fc_norm": True,
        "norm_before_residual": False,
        "norm_output": False,
    },
}
EXPECTED = {
    "training-defaults": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True,
                          "sliding_window": 2048},
    "fc_norm-qwen3-window5": {"fc_norm": True, "qk_norm": True, "sliding_window": 5},
}  # fmt: skip


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A tiny Llama target saved as a Hugging Face directory (speculators reads its config from there)."""
    root = tmp_path_factory.mktemp("parity")
    source = tiny_target(5, layers=6)
    source.model.save_pretrained(root / "model")
    source.tokenizer.save_pretrained(root / "model")
    ids = torch.randperm(96, generator=torch.Generator().manual_seed(0))[:64].sort().values
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    return root, load_target(str(root / "model")), ids - torch.arange(64), t2d


def speculators_drafter(verifier, name: str):
    """A drafter built the way `speculators train` builds one (its resolved defaults, then the variant's
    overrides), norms randomised so that a misplaced norm cannot hide, saved by the library, embeddings stripped
    from the weights as vLLM-bound exports ship them."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config.schema import TrainConfig

    root, _, d2t, t2d = verifier
    draft = TrainConfig(speculator_type="eagle3").draft.model_dump() | VARIANTS[name]
    layer = create_transformer_layer_config(
        str(root / "model"),
        num_layers=draft["num_layers"],
        draft_arch=draft["draft_arch"],
        hidden_act=draft["draft_hidden_act"],
        sliding_window=draft["sliding_window"],
        full_attention_indices=draft["full_attention_indices"],
    )
    torch.manual_seed(0)
    theirs = Eagle3DraftModel.from_training_args(
        verifier_config=layer,
        t2d=t2d,
        d2t=d2t,
        **draft
        | {"draft_vocab_size": 64, "target_layer_ids": list(LAYERS), "ttt_steps": STEPS, "draft_attn_impl": "sdpa"}
        | {"verifier_name_or_path": str(root / "model")},
    )
    with torch.no_grad():
        for param_name, p in theirs.named_parameters():
            if "norm" in param_name and not param_name.startswith("verifier"):
                p.uniform_(0.5, 1.5)
    out = root / name
    theirs.save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    del weights["embed_tokens.weight"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return theirs.eval(), out


def their_step_logits(theirs, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """speculators' forward: step k at position t reads token tokens[t + k] and its own step k-1 hidden."""
    captured = []
    hook = theirs.lm_head.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    with torch.no_grad():
        theirs(feats, tokens, torch.zeros_like(tokens), position_ids=torch.arange(tokens.shape[1])[None],
               ttt_steps=steps)  # fmt: skip
    hook.remove()
    return captured


def our_step_logits(model: Eagle3Model, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Our training-time test over the same inputs: our step k at t reads x[t + 1 + k], so x is tokens shifted."""
    x = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], dim=1)
    with torch.no_grad():
        return [model.draft_logits(h)[0] for h in ttt_forward(model, x, feats, steps)]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_speculators_drafter_loads_and_gives_its_logits_at_every_step(verifier, name):
    root, target, _, _ = verifier
    theirs, out = speculators_drafter(verifier, name)
    converted = read_drafter(out, target.num_layers, target)
    assert converted.config.variant() == EXPECTED[name]
    assert "embed_tokens.weight" not in converted.state
    ours = build_model(converted, target)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (1, 16), generator=gen)
    feats = torch.randn(1, 16, 96, generator=gen)
    expected, got = their_step_logits(theirs, tokens, feats, STEPS), our_step_logits(ours, tokens, feats, STEPS)
    for k in range(STEPS):
        n = 15 - k  # step k at the last 1 + k positions reads tokens past the end: each side pads its own way
        assert torch.allclose(got[k][:n], expected[k][:n], atol=1e-5, rtol=1e-5), (name, k)
    if converted.config.sliding_window == 5:  # the window is exercised: without it the logits differ
        windowless = converted.config.model_copy(update={"sliding_window": None})
        plain = build_model(type(converted)(windowless, converted.state, converted.fmt), target)
        assert not torch.allclose(our_step_logits(plain, tokens, feats, 1)[0][:15], expected[0][:15], atol=1e-3)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_inference_drafting_gives_speculators_distributions(verifier, name):
    """The drafter's own loop (KV cache, carried hidden) drafts with the distributions speculators' forward gives
    for the same context and drafts, at temperature 1, for every draft step."""
    _, target, _, _ = verifier
    theirs, out = speculators_drafter(verifier, name)
    drafter = load_drafter(out, target)
    window = drafter.model.config.sliding_window
    n = min(9, window - STEPS)  # context positions; beyond window - k an engine's window and TTT's part ways
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 96, (n + 1,), generator=gen)
    f = torch.randn(n + STEPS - 1, 96, generator=gen)  # features past the context must not matter
    drafter.begin(x[:n], f[:n])
    draft = drafter.propose(x, STEPS, 1.0, gen)
    assert len(draft.tokens) == STEPS
    tokens = torch.cat([x[1:], draft.tokens[:-1]])[None]  # speculators reads the token at its own position
    expected = their_step_logits(theirs, tokens, f[None], STEPS)
    for k in range(STEPS):
        q = torch.softmax(expected[k][n - 1], -1)
        assert torch.allclose(draft.probs[k][drafter.draft_ids], q, atol=1e-5), (name, k)


def test_speculators_default_drafter_runs_in_eval_with_generates_output(tmp_path, verifier):
    root, target, _, _ = verifier
    _, out = speculators_drafter(verifier, "training-defaults")
    drafter = load_drafter(out, target)
    for seed in range(2):
        prompt = [0] + torch.randint(2, 90, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        assert SpeculativeDecoder(target, drafter, 4).generate(prompt, 30).tokens == reference(target, prompt, 30)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "conversations": [{"from": "human", "value": f"t{7 + i} t{40 + i}"}]})
                + "\n" for i in range(3))
    )  # fmt: skip
    result = CliRunner().invoke(
        app,
        ["eval", "--target", str(root / "model"), "--drafter", str(out), "--dataset", str(prompts),
         "--max-new-tokens", "24", "--num-draft-tokens", "3", "--draft-length", "fixed", "--out", str(tmp_path / "e")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    assert report["mismatches"] == 0 and report["prompts"] == 3


def variant_checkpoint(target, directory, **variant) -> Eagle3Model:
    """A random draftsmith drafter with a layer variant, norms randomised, saved as a checkpoint."""
    ids = torch.randperm(96, generator=torch.Generator().manual_seed(3))[:64].sort().values  # as engines want
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    config = Eagle3Config.from_target(target, 64, LAYERS, **variant)
    torch.manual_seed(3)
    model = Eagle3Model.from_weights(
        config, target.model.get_input_embeddings().weight, target.model.lm_head.weight, ids - torch.arange(64), t2d
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    save_checkpoint(model, directory)
    return model


@pytest.mark.parametrize(
    "variant",
    [
        {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True, "sliding_window": 2048},
        {"fc_norm": True, "qk_norm": True, "sliding_window": 4},
    ],
)
def test_export_with_variant_loads_in_speculators(tmp_path, verifier, variant):
    """Export writes our switches; speculators' own loader reads equal tensors and gives equal logits for every
    step; the library re-saves our config.json unchanged; SGLang/EAGLE layouts refuse the variant."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    root, target, _, _ = verifier
    model = variant_checkpoint(target, tmp_path / "ckpt", **variant)
    out = export(tmp_path / "ckpt", tmp_path / "spec", "speculators", verifier=str(root / "model"))
    written = json.loads((out / "config.json").read_text())
    for key in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"):
        assert written[key] is variant.get(key, False)
    assert read_drafter(out, 6).config == read_config(tmp_path / "ckpt")
    checks = {c.name: c.status for c in diagnose(out, None)}
    assert checks["weights"] == checks["config"] == checks["shapes"] == checks["vocabulary"] == "PASS", checks

    config = Eagle3SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "sdpa"
    theirs = Eagle3DraftModel.from_pretrained(out, config=config).eval()
    with torch.no_grad():
        theirs.embed_tokens.weight.fill_(float("nan"))  # see test_formats: let its loader fill it from the verifier
    theirs.load_verifier_weights()
    mine = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in model.state_dict().items()}
    got = {k: v for k, v in theirs.state_dict().items() if not k.startswith("verifier_")}
    assert got.keys() == mine.keys()
    assert all(torch.equal(got[k], mine[k]) for k in mine)
    theirs.save_pretrained(tmp_path / "resaved")
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert {k: v for k, v in resaved.items() if k != "auto_map"} == written

    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 96, (1, 12), generator=gen)
    feats = torch.randn(1, 12, 96, generator=gen)
    expected, got = their_step_logits(theirs, tokens, feats, STEPS), our_step_logits(model, tokens, feats, STEPS)
    for k in range(STEPS):
        assert torch.allclose(got[k][: 11 - k], expected[k][: 11 - k], atol=1e-5, rtol=1e-5), k

    for fmt in ("sglang", "eagle"):
        with pytest.raises(DraftsmithError, match="cannot express this drafter's layer variant .*sliding_window") as e:
            export(tmp_path / "ckpt", tmp_path / fmt, fmt)
        assert "\n" not in e.value.message and not (tmp_path / fmt).exists()


def test_unrunnable_speculators_configs_are_one_line_errors(tmp_path, verifier):
    root, target, _, _ = verifier
    variant_checkpoint(target, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", tmp_path / "spec", "speculators", verifier=str(root / "model"))
    good = json.loads((out / "config.json").read_text())
    layer = good["transformer_layer_config"]
    cases = [
        (good | {"norm_before_fc": True, "fc_norm": True}, "norm_before_fc and fc_norm both true"),
        (good | {"transformer_layer_config": layer | {"model_type": "mistral"}}, "model_type='mistral'"),
        (good | {"transformer_layer_config": layer | {"num_hidden_layers": 2}}, "num_hidden_layers=2"),
        (good | {"transformer_layer_config": layer | {"hidden_act": "gelu"}}, "hidden_act='gelu'"),
        (good | {"transformer_layer_config": layer | {"attention_bias": True}}, "attention_bias=true"),
        (good | {"transformer_layer_config": layer | {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}},
         "rope_type='llama3'"),
        (good | {"transformer_layer_config": layer | {"rope_parameters": {"rope_type": "default",
                                                                          "partial_rotary_factor": 0.5}}},
         "partial or multimodal RoPE"),
    ]  # fmt: skip
    for cfg, message in cases:
        (out / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(DraftsmithError, match="variant is not one draftsmith's drafter can run") as e:
            load_drafter(out, target)
        assert message in e.value.message and "\n" not in e.value.message, message
    # A switch on in the config without its weights: named, before any work.
    (out / "config.json").write_text(json.dumps(good | {"norm_before_fc": True}))
    with pytest.raises(DraftsmithError, match=r"missing weights \['input_norm.weight'\]"):
        load_drafter(out, target)


def test_old_config_without_switches_reads_as_the_original_layer(tmp_path, verifier):
    _, target, _, _ = verifier
    variant_checkpoint(target, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "qk_norm", "sliding_window"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config(tmp_path).variant() == {}
    assert load_drafter(tmp_path, target).model.config.variant() == {}


def test_train_any_variant_then_draft_losslessly(tmp_path, verifier):
    """`draftsmith train` with speculators' default switches (a window shorter than the samples, a wider MLP) writes
    a checkpoint with them, which exports to speculators' layout and drafts with the target's own greedy output."""
    from draftsmith.store import extract
    from draftsmith.train.trainer import TrainConfig
    from draftsmith.vocab import vocab_from_store
    from tests.formats_helpers import greedy_samples

    root, target, _, _ = verifier
    store = extract(target, greedy_samples(target, 4, new_tokens=24), tmp_path / "store", layer_ids=LAYERS,
                    dtype="float32", progress=False)  # fmt: skip
    vocab_from_store(store, 64, tmp_path / "vocab")
    result = CliRunner().invoke(
        app,
        ["train", str(store), "--vocab", str(tmp_path / "vocab"), "--target", str(root / "model"),
         "--out", str(tmp_path / "run"), "--max-steps", "4", "--batch-size", "2", "--ttt-steps", "2",
         "--warmup-steps", "1", "--norm-before-fc", "--norm-before-residual", "--norm-output",
         "--sliding-window", "8", "--intermediate-size", "200"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    drafter = load_drafter(tmp_path / "run", target)
    assert drafter.model.config.variant() == {
        "norm_before_fc": True, "norm_before_residual": True, "norm_output": True, "sliding_window": 8
    }  # fmt: skip
    assert drafter.model.config.intermediate_size == 200 != target.config.intermediate_size
    out = export(tmp_path / "run", tmp_path / "spec", "speculators", verifier=str(root / "model"))
    assert load_drafter(out, target).model.config == drafter.model.config  # the width survives the export
    with pytest.raises(ValueError, match="intermediate_size sets the EAGLE-3 drafter's MLP width"):
        TrainConfig(algo="dflash", intermediate_size=200)  # refused when the profile loads, not ignored
    with pytest.raises(ValueError, match="label_temperature applies to EAGLE-3's TTT loss"):
        TrainConfig(algo="dflash", label_temperature=0.5)
    with pytest.raises(ValueError, match="reached_only applies to EAGLE-3's TTT loss"):
        TrainConfig(algo="dflash", reached_only=True)
    assert isinstance(drafter, Eagle3Drafter)
    prompt = [0, 11, 12, 13]
    assert SpeculativeDecoder(target, drafter, 3).generate(prompt, 30).tokens == reference(target, prompt, 30)


def test_sliding_window_caches():
    """Training (StepCache): step k at t sees step-0 keys t - W < s <= t and its own earlier steps at t, as
    speculators' mask does. Inference (KVCache): each query sees the last W cache entries, as an engine's window."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from draftsmith.drafters.eagle3 import KVCache
    from draftsmith.train.losses import StepCache

    torch.manual_seed(0)
    b, heads, kv_heads, length, dim, window = 2, 4, 2, 9, 8, 3
    cache, keys, values = StepCache(), [], []
    t, s = torch.arange(length)[:, None], torch.arange(length)[None, :]
    for k in range(3):
        q = torch.randn(b, heads, length, dim, dtype=torch.float64)
        keys.append(torch.randn(b, kv_heads, length, dim, dtype=torch.float64))
        values.append(torch.randn(b, kv_heads, length, dim, dtype=torch.float64))
        out = cache.attend(q, keys[-1], values[-1], window=window)
        mask = torch.cat([(s <= t) & (s > t - window)] + [s == t] * k, dim=1)
        expected = sdpa(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True)
        assert torch.allclose(out, expected, atol=1e-12), k

    kv = KVCache()
    q, key, value = (torch.randn(1, n, length + 2, dim, dtype=torch.float64) for n in (heads, kv_heads, kv_heads))
    first = kv.attend(q[:, :, :length], key[:, :, :length], value[:, :, :length], window=window)
    steps = [kv.attend(q[:, :, i : i + 1], key[:, :, i : i + 1], value[:, :, i : i + 1], window=window)
             for i in (length, length + 1)]  # fmt: skip
    t, s = torch.arange(length + 2)[:, None], torch.arange(length + 2)[None, :]
    expected = sdpa(q, key, value, attn_mask=(s <= t) & (s > t - window), enable_gqa=True)
    assert torch.allclose(torch.cat([first, *steps], 2), expected, atol=1e-12)
