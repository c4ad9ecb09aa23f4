"""Engine backends: transformers is what the stages did before; vLLM fails clearly where it is missing, and its
glue (stop tokens, layer order, final norm, files) is checked against a stand-in for vLLM's documented API."""

import copy
import json
import sys

import pytest
import torch

from draftsmith.backends import get_backend
from draftsmith.backends.batch import BatchDecoder, batched_attention, generate_batch
from draftsmith.backends.hf import TransformersBackend
from draftsmith.errors import ConfigError, DraftsmithError
from draftsmith.store import HiddenStateStore, extract
from draftsmith.target import load_target
from draftsmith.train import TrainConfig
from tests import fake_vllm
from tests.conftest import tiny_target
from tests.test_store import Killed, killed_after, make_samples

LAYERS = (0, 1, 3)


def saved_target(tmp_path, seed: int = 0):
    """A tiny target loaded from disk, as the CLI and pipeline load it (vLLM loads models by path)."""
    source = tiny_target(seed)
    source.model.save_pretrained(tmp_path / "model")
    source.tokenizer.save_pretrained(tmp_path / "model")
    return load_target(str(tmp_path / "model"))


def test_transformers_backend_is_what_the_stages_did_before():
    target = tiny_target(0)
    backend = get_backend("transformers", target)
    prompts = [[5, 6, 7], [8, 9]]
    options = {"temperature": 0.0, "max_new_tokens": 8, "stop_ids": {1}}
    assert backend.generate(prompts, seed=0, **options) == generate_batch(target, prompts, **options)
    ids = torch.tensor([3, 4, 5, 6])
    ((aux, last),) = backend.features([ids], LAYERS)
    ref = target.forward(ids, target.new_cache(), LAYERS, logits_to_keep=1, last_hidden=True)
    assert torch.equal(aux, ref.aux_hidden) and torch.equal(last, ref.last_hidden)
    assert backend.describe()["name"] == "transformers"


def test_vllm_backend_without_vllm_says_how_to_install(monkeypatch):
    target = tiny_target(0)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as where it is not installed
    with pytest.raises(DraftsmithError, match="the vllm backend needs the vllm package") as err:
        get_backend("vllm", target)
    assert "pip install vllm" in err.value.hint and "backend: transformers" in err.value.hint
    with pytest.raises(ConfigError, match="unknown backend 'sglang'"):
        get_backend("sglang", target)
    with pytest.raises(ConfigError, match="takes only the backend_option dtype"):
        get_backend("transformers", target, {"tensor_parallel_size": 2})


def test_a_store_is_resumed_only_by_the_backend_that_started_it(tmp_path):
    class Other(TransformersBackend):
        name = "other"

    target, samples, out = tiny_target(0), make_samples(10), tmp_path / "store"
    kw = {"layer_ids": LAYERS, "shard_size": 4, "progress": False}
    with pytest.raises(Killed):
        extract(target, killed_after(samples, 6), out, backend=Other(target), **kw)
    assert json.loads((out / "manifest.json").read_text())["backend"]["name"] == "other"
    with pytest.raises(DraftsmithError, match="started by the other backend, this run uses transformers") as err:
        extract(target, samples, out, **kw)
    assert "resume with backend other" in err.value.hint
    extract(target, samples, out, backend=Other(target), **kw)
    assert len(HiddenStateStore(out)) == 10


def test_transformers_backend_computes_in_a_cast_copy_and_a_store_keeps_one_precision(tmp_path):
    target = tiny_target(0)
    backend = get_backend("transformers", target, {"dtype": "bfloat16"})
    assert backend.target.model.dtype == torch.bfloat16 and target.model.dtype == torch.float32  # a copy
    assert backend.target.fingerprint() == target.fingerprint()  # the weights it was cast from
    assert backend.describe()["compute_dtype"] == "bfloat16"
    assert get_backend("transformers", target, {"dtype": "float32"}).target is target  # nothing to cast
    ids = torch.tensor([3, 4, 5, 6])
    ((aux, _),) = backend.features([ids], LAYERS)
    ref = target.forward(ids, target.new_cache(), LAYERS, logits_to_keep=1, last_hidden=True).aux_hidden
    assert aux.dtype == torch.bfloat16 and not torch.equal(aux.float(), ref)
    assert (aux.float() - ref).norm() < 0.1 * ref.norm()  # bf16 rounding through the layers, no more

    samples, out = make_samples(10), tmp_path / "store"
    kw = {"layer_ids": LAYERS, "shard_size": 4, "progress": False}
    with pytest.raises(Killed):
        extract(target, killed_after(samples, 6), out, **kw)
    with pytest.raises(DraftsmithError, match="started by the transformers backend, this run uses transformers in bf"):
        extract(target, samples, out, backend=backend, **kw)
    manifest = json.loads((out / "manifest.json").read_text())
    assert "compute_dtype" not in manifest["backend"] and manifest["target_fingerprint"] == target.fingerprint()


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_casts_to_bf16_only_where_the_hardware_computes_it(monkeypatch, native, capsys):
    """On an AVX2 CPU emulated bf16 ran 8x slower than float32: `auto` must then keep the target's dtype, and
    the manifest and the console must say which precision the features were computed in."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    target = tiny_target(0)
    backend = get_backend("transformers", target, {"dtype": "auto"})
    assert (backend.target is not target) == native
    assert backend.target.model.dtype == (torch.bfloat16 if native else torch.float32)
    assert backend.describe().get("compute_dtype") == ("bfloat16" if native else None)
    assert ("bf16 is not native" in capsys.readouterr().err) == (not native)
    assert TrainConfig(bf16="auto").uses_bf16("cpu") == native
    assert TrainConfig(bf16=True).uses_bf16("cpu") and not TrainConfig(bf16=False).uses_bf16("cpu")
    with pytest.raises(ValueError):
        TrainConfig(bf16="sometimes")


@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]], [[5], [7], [9]]])
def test_decode_steps_over_the_whole_kv_buffer_equal_steps_over_its_used_part(prompts):
    """bf16 decode steps read the whole zeroed KV buffer with the unwritten slots masked; in float32 that must give
    the used part's logits, also after a row leaves the batch and for one-token prompts (whose prefill is not a
    decode step); a missing mask would weigh the empty slots."""
    target = tiny_target(3)

    def run(whole: bool) -> list[torch.Tensor]:
        with torch.inference_mode(), batched_attention(target.model):
            decoder = BatchDecoder(target, prompts, 12, whole=whole)
            logits = [decoder.logits]
            for step in range(10):
                tokens = decoder.logits.argmax(-1)
                if step == 4:
                    tokens = tokens[decoder.keep([0, 2])]
                logits.append(decoder.step(tokens))
        return logits

    whole, used = run(True), run(False)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole, used, strict=True))


def test_vllm_backend_glue_against_the_documented_api(tmp_path, monkeypatch):
    fake_vllm.install(monkeypatch)
    target = saved_target(tmp_path)
    backend = get_backend("vllm", target, {"gpu_memory_utilization": 0.5, "hidden_states_dir": str(tmp_path)})

    prompts = [[5, 6, 7], [20, 21], [40]]
    free = generate_batch(target, prompts, temperature=0.0, max_new_tokens=10, stop_ids={95})
    stop = {free[0][0][3]}  # the 4th greedy token of the first prompt ends it: a stop token, not the length
    want = generate_batch(target, prompts, temperature=0.0, max_new_tokens=10, stop_ids=stop)
    got = backend.generate(prompts, temperature=0.0, max_new_tokens=10, stop_ids=stop, seed=3)
    assert got == want and got[0] == (free[0][0][:3], True)
    assert fake_vllm.created[-1]["model"] == str(tmp_path / "model") and fake_vllm.created[-1]["dtype"] == "float32"
    assert fake_vllm.created[-1]["gpu_memory_utilization"] == 0.5

    samples = make_samples(6)
    kw = {"layer_ids": LAYERS, "dtype": "float32", "shard_size": 4, "progress": False}
    by_hf = HiddenStateStore(extract(target, samples, tmp_path / "hf", **kw))
    by_vllm = HiddenStateStore(extract(target, samples, tmp_path / "vllm", backend=backend, **kw))
    for i in range(len(samples)):
        for key in ("aux_hidden", "last_hidden"):
            assert torch.allclose(by_hf[i][key], by_vllm[i][key], rtol=1e-5, atol=1e-6), (i, key)
    engine = fake_vllm.created[-1]
    assert engine["enable_chunked_prefill"] is False
    assert engine["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        *LAYERS,
        target.num_layers,
    ]
    assert engine["kv_transfer_config"].kv_connector == "ExampleHiddenStatesConnector"
    recorded = by_vllm.manifest["backend"]
    assert recorded["name"] == "vllm" and recorded["options"] == {"gpu_memory_utilization": 0.5}
    feature_dir = engine["kv_transfer_config"].kv_connector_extra_config["shared_storage_path"]
    backend.close()
    assert not list(tmp_path.glob("draftsmith-vllm-hs-*"))  # every per-request file and the directory are gone
    assert feature_dir.startswith(str(tmp_path))


def test_doctor_reads_which_backend_made_the_store(tmp_path):
    """States from another engine differ beyond the store's rounding (here weights off by 1e-3 relative stand in
    for other kernels); doctor passes that when the manifest says another engine made them, warns when it says ours."""
    from draftsmith.formats.doctor import check_hidden_states
    from draftsmith.target import Target

    target = tiny_target(0)
    model = copy.deepcopy(target.model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    # (layers 1..3: layer 0 is the embedding, whose all-zero padding row has no cosine)
    store = extract(Target("other", model, target.tokenizer), make_samples(4), tmp_path / "s", layer_ids=(1, 2, 3),
                    dtype="float32", progress=False)  # fmt: skip
    assert check_hidden_states(target, store, samples=4, max_tokens=256).status == "WARN"
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["backend"] = {"name": "vllm", "vllm": "0.11.0"}
    (store / "manifest.json").write_text(json.dumps(manifest))
    check = check_hidden_states(target, store, samples=4, max_tokens=256)
    assert check.status == "PASS" and "extracted by vllm 0.11.0, recomputed here with transformers" in check.detail
