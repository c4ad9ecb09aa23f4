"""llama.cpp as a serving engine: GGUF export through llama.cpp's converter, llama-server loading it, lossless
drafting, and acceptance that matches draftsmith's engine for the same drafter.

The tests that need `llama-server` build it once (`make llamacpp` does it before `make test`); when it cannot be
built they FAIL with the reason, they never skip: a broken llama.cpp path must not pass silently.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from draftsmith.data.tokenize import encode_chat
from draftsmith.decode.engine import SpeculativeDecoder
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Model, save_checkpoint
from draftsmith.engines.llama_server import Draft, LlamaServer, parse_metrics
from draftsmith.engines.llamacpp import CMAKE_FLAGS, LlamaCpp, LlamaCppError, build, installed
from draftsmith.errors import DraftsmithError
from draftsmith.formats.card import llama_server_command
from draftsmith.formats.gguf import check_supported, export_gguf
from draftsmith.formats.load import load_drafter
from draftsmith.target import Target, hf_dir, load_target

DRAFT_VOCAB = 512
LAYERS = (1, 2, 3)


@pytest.fixture(scope="session")
def llamacpp():
    """The built llama.cpp; built here if `make llamacpp` has not run (minutes, once)."""
    try:
        return installed()
    except LlamaCppError:
        pass
    try:
        return build()
    except LlamaCppError as exc:
        pytest.fail(f"llama-server cannot be built, so the llama.cpp tests cannot run: {exc}")


@pytest.fixture
def private_cache(llamacpp, tmp_path, monkeypatch):
    """GGUFs of test targets go to a temporary cache, not the user's; llama.cpp stays where it was built."""
    monkeypatch.setenv("DRAFTSMITH_LLAMACPP_DIR", str(llamacpp.root.parent))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))


def test_a_build_with_other_cmake_flags_is_not_taken_as_built(tmp_path):
    """A cached build made with other flags (e.g. one with AMX kernels that crash) is rebuilt, never reused."""
    lc = LlamaCpp(tmp_path)
    for path in (lc.server, lc.converter):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    lc.stamp.write_text(json.dumps({"cmake_flags": list(CMAKE_FLAGS)}))
    assert lc.is_built()
    lc.stamp.write_text(json.dumps({"cmake_flags": [*CMAKE_FLAGS, "-DGGML_AMX_INT8=ON"]}))
    assert not lc.is_built()
    with pytest.raises(LlamaCppError, match="make llamacpp"):
        lc.require()


def logit_lens_drafter(
    target: Target, directory: Path, must_have: list[int] = (), intermediate_size: int | None = None
) -> Path:
    """An untrained EAGLE-3 drafter that starts as the target's logit lens on its deepest aux layer, i.e. it drafts
    the token the target just produced again; its draft vocabulary holds `must_have` and the lowest other ids."""
    ids = sorted(set(must_have))[:DRAFT_VOCAB]
    ids = sorted(ids + [i for i in range(DRAFT_VOCAB + len(ids)) if i not in set(ids)][: DRAFT_VOCAB - len(ids)])
    d2t = torch.tensor(ids) - torch.arange(DRAFT_VOCAB)  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    config = Eagle3Config.from_target(
        target, DRAFT_VOCAB, LAYERS, fingerprint="test", intermediate_size=intermediate_size
    )
    torch.manual_seed(0)
    model = Eagle3Model.from_weights(
        config,
        target.model.get_input_embeddings().weight.detach(),
        target.model.get_output_embeddings().weight.detach(),
        d2t,
        t2d,
    )
    model.start_from_logit_lens(target.model.model.norm.weight.detach())
    return save_checkpoint(model, directory)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A 4-layer random Llama with SmolLM2's tokenizer (llama.cpp's converter needs a real BPE tokenizer), saved as an
    HF directory, and a logit-lens drafter for it (with an MLP of its own width). Its layers barely change the
    residual and its head is its embeddings, so its greedy text repeats tokens in runs, which the drafter (drafting a
    repeat) gets accepted; the tokens of those runs are in its draft vocabulary, with a non-trivial d2t."""
    root = tmp_path_factory.mktemp("llamacpp")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir("smollm2-135m"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.generation_config.eos_token_id = 2
    model_dir = root / "target"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    target = load_target(str(model_dir), packed=False)
    seen = []
    for ids in prompts(target):
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
        seen += out[0].tolist()
    # an MLP narrower than the target's (96 against 128): llama.cpp must take the drafter's own width
    return target, model_dir, logit_lens_drafter(target, root / "drafter", seen, intermediate_size=96)


NEW_TOKENS = 24


def prompts(target: Target) -> list[list[int]]:
    return [
        encode_chat(target.tokenizer, [{"role": "user", "content": text}]) for text in ("Name three colours.", "Hi!")
    ]


def test_metrics_are_parsed_per_position():
    text = (
        "# TYPE llamacpp:spec_decode_num_drafts_total counter\nllamacpp:spec_decode_num_drafts_total 7\n"
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5\n'
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 1\n'
    )
    parsed = parse_metrics(text)
    assert parsed["spec_decode_num_drafts_total"] == 7
    assert parsed["accepted_per_pos"] == [5, 0, 1]


def test_unsupported_layer_variants_are_refused():
    with pytest.raises(DraftsmithError, match="qk_norm"):
        check_supported({"qk_norm": True, "norm_before_fc": True}, Path("x"))
    check_supported({"norm_before_fc": True, "norm_before_residual": True}, Path("x"))


def test_card_command_uses_llama_cpp_flags():
    command = llama_server_command("t.gguf", "d.gguf", 3)
    for flag in ("-m t.gguf", "-md d.gguf", "--spec-type draft-eagle3", "--spec-draft-n-max 3"):
        assert flag in command


def test_gguf_export_serves_losslessly_with_draftsmith_acceptance(llamacpp, tiny, tmp_path, private_cache):
    target, model_dir, drafter = tiny
    out = export_gguf(drafter, tmp_path / "gguf", target=str(model_dir), target_type="f32", speculative_tokens=3)
    card = (out / "README.md").read_text()
    assert "--spec-type draft-eagle3" in card and str(out / "target-f32.gguf") in card
    ids = prompts(target)
    with LlamaServer(llamacpp, out / "target-f32.gguf", ctx_size=512) as plain:
        base = [plain.complete(p, NEW_TOKENS) for p in ids]
    draft = Draft(out / "drafter.gguf", 3, n_min=3, p_min=0.0, threads=1)  # llama-server takes the drafter's threads
    with LlamaServer(llamacpp, out / "target-f32.gguf", draft, ctx_size=512) as spec:
        runs = [spec.complete(p, NEW_TOKENS) for p in ids]
        metrics = spec.metrics()
    assert all(len(b.tokens) > 0 for b in base)
    assert [r.tokens for r in runs] == [b.tokens for b in base]  # lossless at T=0
    assert all(r.timings.get("draft_n", 0) > 0 for r in runs)  # the drafter was loaded and drafted
    assert metrics["spec_decode_num_drafts_total"] > 0
    # llama.cpp's τ vs draftsmith's engine on the same drafter, prompts and chain (both float32)
    tau_cpp = sum(len(r.tokens) for r in runs) / sum(len(r.tokens) - r.timings["draft_n_accepted"] for r in runs)
    decoder = SpeculativeDecoder(target, load_drafter(str(drafter), target), 3)
    ours = [decoder.generate(p, NEW_TOKENS) for p in ids]
    assert [g.tokens for g in ours] == [b.tokens for b in base]  # llama.cpp's f32 target agrees with ours
    tau_ours = sum(len(g.tokens) for g in ours) / sum(g.target_forwards for g in ours)
    assert tau_ours > 1.2, "the logit-lens drafter should get the target's repeats accepted"
    assert abs(tau_cpp - tau_ours) <= 0.1 * tau_ours, (tau_cpp, tau_ours)


def test_builds_fail_with_a_reason_without_cmake(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_LLAMACPP_DIR", str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(LlamaCppError, match="needs cmake"):
        build()
    with pytest.raises(LlamaCppError, match="make llamacpp"):
        installed()


@pytest.mark.integration
def test_smollm2_with_a_drafter_is_lossless_in_llama_server(llamacpp, smollm2, tmp_path):
    drafter = logit_lens_drafter(smollm2, tmp_path / "drafter")
    out = export_gguf(drafter, tmp_path / "gguf", target="smollm2-135m", target_type="q4_1", speculative_tokens=3)
    ids = prompts(smollm2)
    with LlamaServer(llamacpp, out / "target-q4_1.gguf") as plain:
        base = [plain.complete(p, 32) for p in ids]
    with LlamaServer(llamacpp, out / "target-q4_1.gguf", Draft(out / "drafter.gguf", 3)) as spec:
        runs = [spec.complete(p, 32) for p in ids]
    assert [r.tokens for r in runs] == [b.tokens for b in base]
    assert all(r.timings.get("draft_n", 0) > 0 for r in runs)


def test_a_near_tie_comes_out_as_without_a_drafter(llamacpp, smollm2, shared_data, tmp_path):
    """MT-bench prompt 90's 29th new token is a near-tie of SmolLM2 (top-2 logit gap 0.0005): a verify batch that
    rounded otherwise than the one-token decode (llamafile's sgemm, built in by default) wrote another token there.
    Our build leaves it out, so every output is one `ggml_vec_dot` over its row whatever the batch."""
    question = next(
        json.loads(line) for line in (shared_data / "mt_bench_questions.jsonl").open() if '"question_id": 90' in line
    )
    ids = encode_chat(smollm2.tokenizer, [{"role": "user", "content": question["turns"][0]}])
    drafter = logit_lens_drafter(smollm2, tmp_path / "drafter")
    out = export_gguf(drafter, tmp_path / "gguf", target="smollm2-135m", target_type="f32", speculative_tokens=3)
    with LlamaServer(llamacpp, out / "target-f32.gguf") as plain:
        base = plain.complete(ids, 40)
    with LlamaServer(llamacpp, out / "target-f32.gguf", Draft(out / "drafter.gguf", 3, n_min=3, p_min=0.0)) as spec:
        run = spec.complete(ids, 40)
    assert run.tokens == base.tokens
    assert run.timings.get("draft_n", 0) >= 30  # it drafted: the tokens were verified in batches of four


def test_doctor_reports_acceptance_per_served_precision(llamacpp, tiny, tmp_path, private_cache):
    from draftsmith.engines.llamacpp_eval import precision_checks

    target, _, drafter = tiny
    checks = precision_checks(drafter, target, prompts(target), ["q8_0"], "f32", 16, 3, tmp_path)
    assert [c.name for c in checks] == ["llama.cpp f32", "llama.cpp q8_0"]
    assert all(c.status in ("PASS", "WARN") and "τ" in c.detail for c in checks)


def test_report_counts_tau_acceptance_and_first_difference():
    from draftsmith.config import EvalConfig
    from draftsmith.data.sources import Conversation
    from draftsmith.engines.llama_server import Completion
    from draftsmith.engines.llamacpp_eval import Served, summarise
    from tests.conftest import tiny_target

    target = tiny_target(0)
    convs = [Conversation(f"p{i}", [{"role": "user", "content": "t5 t6"}], kind="k") for i in range(2)]
    encoded = [[3, 4, 5], [6, 7]]
    base = [Completion([10, 11, 12, 13], 1.0), Completion([20, 21, 22], 1.0)]
    spec = [
        Completion([10, 11, 12, 13], 0.5, {"draft_n": 6, "draft_n_accepted": 2}),
        Completion([20, 29, 22], 0.5, {"draft_n": 3, "draft_n_accepted": 0}),
    ]
    counters = {"spec_decode_num_drafts_total": 3, "accepted_per_pos": [2, 0]}
    cfg = EvalConfig(num_draft_tokens=2, max_new_tokens=4)
    report = summarise(target, "d", convs, encoded, cfg, Served(base, {}), Served(spec, counters))
    assert report["acceptance_length"] == 7 / (2 + 3)  # 7 tokens, 5 forwards (4 - 2 accepted, 3 - 0)
    assert report["acceptance_by_position"] == [2 / 3, 0.0]
    assert report["draft_acceptance_rate"] == 2 / 9
    assert report["engine_mean_length"] == 1 + 2 / 3
    assert report["speedup"] == 2.0 and report["mismatches"] == 1
    differing = report["per_prompt"][1]
    assert differing["first_difference"] == 1 and differing["spec_token"] == 29 and differing["top2_logit_gap"] >= 0
    assert "first_difference" not in report["per_prompt"][0]


def test_target_ggufs_are_named_or_refused(tmp_path):
    from draftsmith.errors import ConfigError
    from draftsmith.formats.gguf import served_target, target_gguf

    with pytest.raises(ConfigError, match="not built in"):
        target_gguf(str(tmp_path), "q4_1")
    with pytest.raises(ConfigError, match="unknown target GGUF type"):
        target_gguf("smollm2-135m", "q2_k")
    with pytest.raises(ConfigError, match="does not exist"):
        served_target("smollm2-135m", str(tmp_path / "missing.gguf"))
    assert served_target("smollm2-135m", "q4_1").name.endswith("Q4_1.gguf")


def test_dflash_gguf_export_serves_losslessly(llamacpp, tiny, tmp_path, private_cache):
    """A DFlash drafter goes through z-lab's layout and llama.cpp's converter, and llama-server drafts with it
    (`--spec-type draft-dflash`, taken from the GGUF's architecture) without changing the output."""
    from draftsmith.drafters.dflash import DFlashConfig, DFlashModel
    from draftsmith.drafters.dflash import save_checkpoint as save_dflash
    from draftsmith.engines.llamacpp_eval import draft_for
    from draftsmith.formats.gguf import architecture, drafter_gguf

    target, model_dir, _ = tiny
    torch.manual_seed(0)
    model = DFlashModel(DFlashConfig.from_target(target, 1, (1, 2, 3), block_size=4, fingerprint="test"))
    drafter = save_dflash(model.attach_target(target), tmp_path / "dflash")
    out = export_gguf(drafter, tmp_path / "gguf", target=str(model_dir), target_type="f32")
    assert architecture(out / "drafter.gguf") == "dflash"
    by_name = drafter_gguf(f"dflash:{drafter}", tmp_path / "by-name", target=str(model_dir))  # as `eval` names it
    assert by_name.read_bytes() == (out / "drafter.gguf").read_bytes()
    card = (out / "README.md").read_text()
    assert "--spec-type draft-dflash --spec-draft-n-max 3" in card and "target_layer_ids` = [0, 1, 2]" in card
    from draftsmith.config import EvalConfig

    draft = draft_for(out / "drafter.gguf", EvalConfig(num_draft_tokens=3, draft_length="fixed", draft_threads=1))
    assert draft.spec_type == "draft-dflash" and draft.args()[-2:] == ["--spec-draft-threads-batch", "1"]
    ids = prompts(target)
    with LlamaServer(llamacpp, out / "target-f32.gguf", ctx_size=512) as plain:
        base = [plain.complete(p, NEW_TOKENS) for p in ids]
    with LlamaServer(llamacpp, out / "target-f32.gguf", draft, ctx_size=512) as spec:
        runs = [spec.complete(p, NEW_TOKENS) for p in ids]
    assert [r.tokens for r in runs] == [b.tokens for b in base]
    assert all(r.timings.get("draft_n", 0) > 0 for r in runs)
