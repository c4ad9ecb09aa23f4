"""The hidden-state store: round trip, sharding, resume after a kill, mismatch errors, disk space, manifest."""

import json
import pickle
import random
import shutil
from collections import namedtuple

import pytest
import torch

import draftsmith.store as store_mod
from draftsmith.data.tokenize import encode_chat
from draftsmith.errors import ConfigError, DataError, DraftsmithError
from draftsmith.store import (
    HiddenStateStore,
    bytes_per_token,
    check_layer_ids,
    default_aux_layers,
    extract,
)
from tests.conftest import tiny_target

LAYERS = (0, 1, 3)


def make_samples(n: int = 10, seed: int = 0, vocab: int = 96) -> list[tuple[str, list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(3, 20)
        ids = [rng.randrange(vocab) for _ in range(length)]
        prompt = rng.randint(1, length - 1)
        out.append((f"s{i}", ids, [0] * prompt + [1] * (length - prompt)))
    return out


def reference(target, ids):
    return target.forward(torch.tensor(ids), target.new_cache(), layer_ids=LAYERS, logits_to_keep=1, last_hidden=True)


def run(target, samples, out, **kw):
    kw = {"layer_ids": LAYERS, "shard_size": 4, "progress": False} | kw
    return extract(target, samples, out, **kw)


def test_default_aux_layers_follow_eagle3_and_bad_ids_fail():
    assert default_aux_layers(30) == (2, 15, 27)
    assert default_aux_layers(32) == (2, 16, 29)
    assert check_layer_ids([0, 3], 4) == (0, 3)
    with pytest.raises(ConfigError, match=r"\[4, -1\] not in 0..3"):
        check_layer_ids([1, 4, -1], 4)
    with pytest.raises(ConfigError, match="empty"):
        check_layer_ids([], 4)
    with pytest.raises(ConfigError, match="at least 3 decoder layers"):
        default_aux_layers(2)


def test_round_trip_fp32_is_exact_and_bf16_within_bf16_tolerance(tmp_path):
    target = tiny_target(0)
    samples = make_samples(7)
    fp32 = HiddenStateStore(run(target, samples, tmp_path / "fp32", dtype="float32"))
    bf16 = HiddenStateStore(run(target, samples, tmp_path / "bf16", dtype="bfloat16"))
    assert len(fp32) == len(bf16) == 7
    for i, (sid, ids, mask) in enumerate(samples):
        ref = reference(target, ids)
        got = fp32[i]
        assert fp32.sample_id(i) == sid
        assert got["input_ids"].dtype == torch.int64 and got["input_ids"].tolist() == ids
        assert got["loss_mask"].dtype == torch.bool and got["loss_mask"].tolist() == [bool(m) for m in mask]
        assert got["aux_hidden"].shape == (len(ids), 3 * target.hidden_size)
        assert torch.equal(got["aux_hidden"], ref.aux_hidden) and torch.equal(got["last_hidden"], ref.last_hidden)
        low = bf16[i]
        assert low["aux_hidden"].dtype == torch.bfloat16
        assert torch.equal(low["aux_hidden"], ref.aux_hidden.bfloat16())
        torch.testing.assert_close(low["aux_hidden"].float(), ref.aux_hidden, rtol=1 / 128, atol=1e-6)
        torch.testing.assert_close(low["last_hidden"].float(), ref.last_hidden, rtol=1 / 128, atol=1e-6)
    assert fp32[-1]["input_ids"].tolist() == samples[-1][1]
    with pytest.raises(IndexError):
        fp32[7]


def test_samples_are_split_into_shards_listed_in_the_manifest(tmp_path):
    target = tiny_target(0)
    samples = make_samples(10)
    out = run(target, samples, tmp_path / "s", shard_size=4)
    m = json.loads((out / "manifest.json").read_text())
    assert [s["file"] for s in m["shards"]] == [f"shard-0000{i}.safetensors" for i in range(3)]
    assert [s["samples"] for s in m["shards"]] == [4, 4, 2]
    assert [s["first_sample"] for s in m["shards"]] == [0, 4, 8]
    for s in m["shards"]:
        assert (out / s["file"]).stat().st_size == s["bytes"]
        assert s["sha256"] == store_mod._file_sha256(out / s["file"])
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"] + [s["file"] for s in m["shards"]]
    store = HiddenStateStore(out)
    assert store.lengths() == [len(s[1]) for s in samples]
    assert store.verify() == []
    counted = sum(int(mask.sum()) for _, mask in store.iter_tokens())
    assert counted == m["masked_tokens"] == sum(sum(s[2]) for s in samples)


def test_manifest_records_target_layers_dtype_backend_and_counts(tmp_path):
    target = tiny_target(0)
    samples = make_samples(5)
    m = HiddenStateStore(run(target, samples, tmp_path / "s", dtype="float16", max_length=12)).manifest
    assert m["stage"] == "extract" and m["complete"] is True
    assert m["target"] == "tiny-0" and m["target_fingerprint"] == target.fingerprint()
    assert (m["hidden_size"], m["num_layers"], m["vocab_size"]) == (32, 4, 96)
    assert m["layer_ids"] == list(LAYERS) and m["layer_convention"] == "input of decoder layer i; 0 = embedding output"
    assert m["dtype"] == "float16"
    assert m["backend"]["name"] == "transformers" and m["backend"]["torch"] == torch.__version__
    lengths = [min(len(s[1]), 12) for s in samples]
    assert m["samples"] == 5 and m["tokens"] == sum(lengths)
    assert m["masked_tokens"] == sum(sum(s[2][:12]) for s in samples)
    assert m["config"]["max_length"] == 12 and m["config"]["shard_size"] == 4
    assert m["bytes_per_token"] == bytes_per_token(32, 3, "float16") == 2 * (3 * 32 + 32) + 5
    assert m["eos_token_ids"] == [1] and 1 in m["special_token_ids"]


class Killed(Exception):
    pass


def killed_after(samples, k):
    for i, s in enumerate(samples):
        if i == k:
            raise Killed
        yield s


@pytest.mark.parametrize("kill_at", [2, 6, 8])
def test_resume_after_a_kill_stores_every_sample_exactly_once(tmp_path, kill_at):
    target = tiny_target(0)
    samples = make_samples(10)
    whole = run(target, samples, tmp_path / "whole")
    out = tmp_path / "resumed"
    with pytest.raises(Killed):
        run(target, killed_after(samples, kill_at), out)
    m = json.loads((out / "manifest.json").read_text())
    assert m["complete"] is False and m["samples"] == (kill_at // 4) * 4
    with pytest.raises(DraftsmithError, match="incomplete"):
        HiddenStateStore(out)
    run(target, iter(samples), out)  # a plain iterator works as well as a list
    a, b = HiddenStateStore(whole), HiddenStateStore(out)
    assert [b.sample_id(i) for i in range(len(b))] == [s[0] for s in samples]
    for i in range(len(samples)):
        assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])
    assert [s["sha256"] for s in a.manifest["shards"]] == [s["sha256"] for s in b.manifest["shards"]]


def test_resume_when_killed_while_writing_a_shard_or_before_the_manifest(tmp_path, monkeypatch):
    target = tiny_target(0)
    samples = make_samples(10)
    out = tmp_path / "s"
    real_save = store_mod.save_file
    calls = []

    def dies_on_second_shard(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            with open(filename, "wb") as f:
                f.write(b"half a shard")
            raise Killed
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(store_mod, "save_file", dies_on_second_shard)
    with pytest.raises(Killed):
        run(target, samples, out)
    monkeypatch.setattr(store_mod, "save_file", real_save)
    assert [p.name for p in out.glob(".shard-*")]  # the half shard is under its temporary name only
    (out / "manifest.json").unlink()  # as if killed after the rename, before the first manifest update
    run(target, samples, out)
    store = HiddenStateStore(out)
    assert not list(out.glob(".shard-*")) and len(store) == 10
    assert [store.sample_id(i) for i in range(10)] == [s[0] for s in samples]
    assert store.verify() == []


def test_rerunning_a_complete_store_does_no_work(tmp_path):
    target = tiny_target(0)
    samples = make_samples(6)
    out = run(target, samples, tmp_path / "s")
    before = HiddenStateStore(out).manifest["shards"]
    run(target, samples, out)
    assert HiddenStateStore(out).manifest["shards"] == before


def test_resume_with_different_inputs_fails(tmp_path):
    target = tiny_target(0)
    out = tmp_path / "s"
    with pytest.raises(Killed):
        run(target, killed_after(make_samples(10), 5), out)
    with pytest.raises(DataError, match="differ from those stored"):
        run(target, make_samples(10, seed=1), out)
    with pytest.raises(DataError, match="has 2 samples but"):
        run(target, make_samples(2), out)


def untouchable():
    raise AssertionError("the samples were read before the store was checked")
    yield


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"target": 1}, r"made with target tiny-0 \(fingerprint [0-9a-f]{16}\), you passed tiny-1"),
        ({"layer_ids": (0, 2, 3)}, r"layer ids \[0, 1, 3\], this run asks for \[0, 2, 3\]"),
        ({"dtype": "float32"}, "dtype bfloat16, this run asks for float32"),
    ],
)
def test_resuming_with_another_target_layers_or_dtype_fails_before_any_work(tmp_path, change, match):
    out = tmp_path / "s"
    with pytest.raises(Killed):
        run(tiny_target(0), killed_after(make_samples(10), 5), out)
    target = tiny_target(change.pop("target", 0))
    with pytest.raises(DraftsmithError, match=match) as err:
        run(target, untouchable(), out, **change)
    assert f"delete {out}" in err.value.hint
    (out / "manifest.json").unlink()  # the shards describe themselves too
    with pytest.raises(DraftsmithError, match=match):
        run(target, untouchable(), out, **change)


def test_check_compatible_names_both_targets_and_layer_ids(tmp_path):
    store = HiddenStateStore(run(tiny_target(0), make_samples(3), tmp_path / "s"))
    store.check_compatible(tiny_target(0), LAYERS)
    other = tiny_target(2)
    with pytest.raises(DraftsmithError) as err:
        store.check_compatible(other, LAYERS)
    fp = store.manifest["target_fingerprint"]
    assert f"was made with target tiny-0 (fingerprint {fp}), you passed tiny-2 ({other.fingerprint()})" in str(
        err.value
    )
    with pytest.raises(DraftsmithError, match=r"layer ids \[0, 1, 3\], you asked for \[2, 2, 1\]"):
        store.check_compatible(tiny_target(0), (2, 2, 1))


def test_refuses_to_start_without_the_disk_space_it_needs(tmp_path, monkeypatch):
    target = tiny_target(0)
    samples = make_samples(10)
    need = sum(len(s[1]) for s in samples) * bytes_per_token(32, 3, "bfloat16")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, need - 1))
    out = tmp_path / "new" / "store"
    with pytest.raises(DraftsmithError, match=r"needs about [\d.]+ kB for \d+ tokens but .* has only") as err:
        run(target, samples, out)
    assert "bigger disk" in err.value.hint and not out.exists()
    with pytest.raises(DraftsmithError, match="needs about"):  # an iterator of unknown length: checked per shard
        run(target, iter(samples), out, shard_size=100)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, need))
    assert len(HiddenStateStore(run(target, samples, tmp_path / "fits"))) == 10


def test_bad_samples_fail_with_the_sample_id(tmp_path):
    target = tiny_target(0)
    with pytest.raises(DataError, match="nothing to train on"):
        run(target, [("a", [3, 4, 5], [0, 0, 0])], tmp_path / "a")
    with pytest.raises(DataError, match="sample 'b': input_ids has 3 tokens but loss_mask has 2"):
        run(target, [("b", [3, 4, 5], [0, 1])], tmp_path / "b")
    with pytest.raises(DataError, match=r"sample 'c': token ids must be in 0..95"):
        run(target, [("c", [3, 400], [0, 1])], tmp_path / "c")
    with pytest.raises(DataError, match="no samples"):
        run(target, iter([]), tmp_path / "empty")
    with pytest.raises(ConfigError, match="unknown store dtype"):
        run(target, [], tmp_path / "d", dtype="int8")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("mine")
    with pytest.raises(DraftsmithError, match="not a hidden-state store"):
        run(target, make_samples(2), tmp_path / "e")
    with pytest.raises(DraftsmithError, match="manifest.json not found"):
        HiddenStateStore(tmp_path / "e")


def test_reader_is_lazy_and_picklable_for_dataloader_workers(tmp_path):
    store = HiddenStateStore(run(tiny_target(0), make_samples(10), tmp_path / "s"))
    assert store._open == {}
    first = store[0]
    assert list(store._open) == [0]
    clone = pickle.loads(pickle.dumps(store))
    assert torch.equal(clone[0]["aux_hidden"], first["aux_hidden"])
    loader = torch.utils.data.DataLoader(store, batch_size=None, shuffle=False)
    assert sum(len(item["input_ids"]) for item in loader) == store.num_tokens


@pytest.mark.integration
def test_smollm2_store_uses_the_default_layers_and_size(smollm2, tmp_path):
    ids = encode_chat(smollm2.tokenizer, [{"role": "user", "content": "Hi"}])
    out = extract(smollm2, [("hi", ids, [0] * (len(ids) - 2) + [1, 1])], tmp_path / "s", progress=False)
    store = HiddenStateStore(out)
    assert store.layer_ids == (2, 15, 27) and store.manifest["bytes_per_token"] == 2 * 4 * 576 + 5
    assert store[0]["aux_hidden"].shape == (len(ids), 3 * 576) and store[0]["aux_hidden"].dtype == torch.bfloat16
    store.check_compatible(smollm2, (2, 15, 27))
