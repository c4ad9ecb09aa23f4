"""The data stage: regeneration by the target (batched, turn by turn, resumable), synthesised prompts, the stage dir."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from draftsmith.backends.batch import pad_id
from draftsmith.backends.stream import StreamDecoder
from draftsmith.data import regenerate as regenerate_module
from draftsmith.data import stage as stage_module
from draftsmith.data import synth as synth_module
from draftsmith.data.regenerate import read_done_ids, recorded_dir, regenerate
from draftsmith.data.sources import Conversation, load_eval_prompts
from draftsmith.data.stage import build_dataset
from draftsmith.data.synth import pre_query, synthesize_prompts
from draftsmith.data.tokenize import render_chat, tokenize_conversation
from draftsmith.errors import ConfigError, DataError
from draftsmith.store import RecordedFeatures, Recording, default_aux_layers
from tests.conftest import tiny_target

GEN = {"temperature": 0.0, "max_new_tokens": 6, "batch_size": 4, "seed": 0, "progress": False}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def prompts(n: int) -> list[Conversation]:
    """Prompts of varied lengths, so batches need left padding."""
    return [
        Conversation(f"p{i}", [user(" ".join(f"t{20 + (i * 7 + j) % 70}" for j in range(2 + i % 5)))]) for i in range(n)
    ]


def greedy(target, messages: list[dict[str, str]], max_new_tokens: int) -> tuple[str, bool]:
    """What plain, unbatched `generate` writes for the next assistant turn: the reference regeneration must match."""
    text = render_chat(target.tokenizer, messages, add_generation_prompt=True)
    ids = torch.tensor([target.tokenizer(text, add_special_tokens=False)["input_ids"]])
    out = target.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=1
    )[0, ids.shape[1] :].tolist()
    ended = 1 in out
    return target.tokenizer.decode(out[: out.index(1)] if ended else out), ended


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerated_turn_is_the_targets_greedy_output(tmp_path):
    target = tiny_target(seed=3)
    conv = Conversation(
        "a", [{"role": "system", "content": "t9"}, user("t5 t6"), {"role": "assistant", "content": "t2"}]
    )
    out = regenerate(target, [conv], tmp_path / "r.jsonl", **GEN)
    [record] = read_jsonl(out)
    text, ended = greedy(target, conv.messages[:2], GEN["max_new_tokens"])
    assert record["id"] == "a"
    assert record["messages"] == [
        {"role": "system", "content": "t9"},
        user("t5 t6"),
        {"role": "assistant", "content": text, "truncated": not ended},
    ]
    assert text != "t2"


def test_turns_are_generated_from_the_regenerated_history_and_batches_match_single_runs(tmp_path):
    target = tiny_target(seed=4)
    convs = [
        Conversation("two", [user("t5"), user("t8 t9")]),  # prompt-only turns: each gets an answer
        Conversation("old", [user("t6 t7 t3"), {"role": "assistant", "content": "t4"}, user("t20")]),
        *prompts(5),
    ]
    batched = read_jsonl(regenerate(target, convs, tmp_path / "batched.jsonl", **GEN))
    single = read_jsonl(regenerate(target, convs, tmp_path / "single.jsonl", **(GEN | {"batch_size": 1})))
    assert sorted(r["id"] for r in batched) == sorted(c.id for c in convs)
    assert {r["id"]: r for r in batched} == {r["id"]: r for r in single}  # left padding changes nothing

    two = next(r for r in batched if r["id"] == "two")["messages"]
    assert [m["role"] for m in two] == ["user", "assistant", "user", "assistant"]
    first, _ = greedy(target, [user("t5")], GEN["max_new_tokens"])
    second, _ = greedy(target, [user("t5"), {"role": "assistant", "content": first}, user("t8 t9")], 6)
    assert (two[1]["content"], two[3]["content"]) == (first, second)
    old = next(r for r in batched if r["id"] == "old")["messages"]
    assert [m["role"] for m in old] == ["user", "assistant", "user", "assistant"] and old[1]["content"] != "t4"


def test_turn_that_ends_with_eos_is_not_truncated(tmp_path):
    target = tiny_target(seed=5)
    text, _ = greedy(target, [user("t5")], 4)
    path_tokens = [int(t[1:]) for t in text.split()]
    assert len(path_tokens) == 4 and path_tokens[2] not in path_tokens[:2]
    target.eos_token_ids = {path_tokens[2]}  # the greedy path now stops at its third token
    [record] = read_jsonl(regenerate(target, [Conversation("a", [user("t5")])], tmp_path / "r.jsonl", **GEN))
    assert record["messages"][-1] == {"role": "assistant", "content": " ".join(text.split()[:2]), "truncated": False}
    [cut] = read_jsonl(regenerate(tiny_target(seed=5), [Conversation("a", [user("t5")])], tmp_path / "c.jsonl", **GEN))
    assert cut["messages"][-1]["truncated"] is True  # no EOS within max_new_tokens on this random model


def multi_turn(n: int) -> list[Conversation]:
    """Conversations of one to three user turns, some with old assistant turns to replace."""
    convs = []
    for i, conv in enumerate(prompts(n)):
        turns = [conv.messages[0]]
        for j in range(i % 3):
            turns += [{"role": "assistant", "content": "t4"}] * (j % 2) + [user(f"t{30 + i + j} t{9 + j}")]
        convs.append(Conversation(conv.id, turns))
    return convs


def by_turn_batches(monkeypatch, *args, **kwargs) -> Path:
    """`regenerate` as an engine without rows that never drain runs it: one batched generate per turn."""
    with monkeypatch.context() as patch:
        patch.setattr(regenerate_module, "streamable", lambda model: False)
        return regenerate(*args, **kwargs)


@pytest.mark.parametrize("batch_size", [3, 8])
@pytest.mark.parametrize("retokenised", [False, True], ids=["extends", "retokenised"])
def test_stream_writes_what_turn_by_turn_batches_write(tmp_path, monkeypatch, retokenised, batch_size):
    """Rows that never drain (prompts fed a token a step beside rows still writing, later turns fed only their new
    tokens, or the whole history again when it does not extend what the row holds; at batch 8, rows left without a
    conversation idle beside the others until a quarter of the rows do) write every turn exactly as one batched
    generate per turn does."""
    target = tiny_target(seed=9)
    if retokenised:  # a later turn's prompt no longer starts with the tokens the row holds: it must restart
        encode = regenerate_module._encode_prompt
        monkeypatch.setattr(
            regenerate_module, "_encode_prompt",
            lambda t, history, *rest: [2 + len(history)] + encode(t, history, *rest),
        )  # fmt: skip
    restarts, idle, step, pad = [], [], StreamDecoder.step, pad_id(target)

    def counted(self, tokens, restart=(), shared=()):
        restarts.extend(i for i in [*restart, *shared] if tokens[i] != pad)
        idle.extend(i for i in restart if tokens[i] == pad)
        return step(self, tokens, restart, shared)

    monkeypatch.setattr(StreamDecoder, "step", counted)
    convs = multi_turn(11)
    options = GEN | {"batch_size": batch_size, "max_new_tokens": 5}
    record = Recording(target.fingerprint(), default_aux_layers(target.num_layers), "transformers")
    stream = read_jsonl(regenerate(target, convs, tmp_path / "stream.jsonl", record=record, **options))
    turns = read_jsonl(by_turn_batches(monkeypatch, target, convs, tmp_path / "turns.jsonl", **options))
    assert len(stream) == len(convs) and {r["id"]: r for r in stream} == {r["id"]: r for r in turns}
    assert sum(len(r["messages"]) for r in stream) > 2 * len(convs)  # later turns were written
    assert bool(idle) == (batch_size == 8)  # a third of 3 rows is compacted away at once
    later_turns = sum(m["role"] == "assistant" for r in stream for m in r["messages"]) - len(convs)
    fresh = len(convs) - batch_size  # each conversation after the first batch restarts a row
    if retokenised:
        assert len(restarts) == fresh + later_turns
    else:  # the tiny tokenizer re-reads some replies differently ("t10" -> "t1" "0"): those turns restart too
        assert fresh <= len(restarts) < fresh + later_turns


def test_smollm2_stream_writes_what_turn_by_turn_batches_write(smollm2, tmp_path, monkeypatch):
    """The real tokenizer and chat template: the text of every turn is the turn-by-turn batches' (which a test above
    holds to `model.generate`), and the recorded tokens and loss mask are `tokenize`'s."""
    _, builtin = load_eval_prompts("builtin")
    convs = [
        Conversation(c.id, c.messages + [user("And in one sentence?")] * (i % 2)) for i, c in enumerate(builtin[:6])
    ]
    options = GEN | {"batch_size": 4, "max_new_tokens": 12}
    record = Recording(smollm2.fingerprint(), default_aux_layers(smollm2.num_layers), "transformers")
    out = regenerate(smollm2, convs, tmp_path / "stream.jsonl", record=record, **options)
    stream = read_jsonl(out)
    turns = read_jsonl(by_turn_batches(monkeypatch, smollm2, convs, tmp_path / "turns.jsonl", **options))
    assert {r["id"]: r for r in stream} == {r["id"]: r for r in turns}
    assert sum(m["role"] == "assistant" for r in stream for m in r["messages"]) == 9
    recorded = RecordedFeatures(recorded_dir(out))  # what the rows fed is what `tokenize` reads, but the last "\n"
    for r in stream:
        ids, mask = recorded.sample(r["id"])
        written, learned = tokenize_conversation(smollm2.tokenizer, r["messages"], 2048)
        assert (ids, mask) == (written[: len(ids)], learned[: len(ids)]) and len(written) - len(ids) == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "turn-batches"])
def test_resume_after_a_crash_writes_every_id_exactly_once(tmp_path, monkeypatch, stream):
    target = tiny_target(seed=6)
    convs = prompts(9)
    reference = read_jsonl(regenerate(target, convs, tmp_path / "ref.jsonl", **(GEN | {"batch_size": 1})))
    if not stream:
        monkeypatch.setattr(regenerate_module, "streamable", lambda model: False)

    out = tmp_path / "r.jsonl"
    owner, name = (StreamDecoder, "step") if stream else (regenerate_module, "generate_batch")
    real = getattr(owner, name)
    calls = []

    def crash_on_a_later_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == (20 if stream else 3):
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, crash_on_a_later_call)
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, convs, out, **(GEN | {"batch_size": 2}))
    assert len(read_jsonl(out)) == 4  # two whole batches (groups of two, streaming) reached the disk
    with out.open("a") as f:
        f.write('{"id": "p8", "messages": [{"role": "us')  # a torn last line, as a kill mid-write leaves
    monkeypatch.setattr(owner, name, real)

    assert len(read_done_ids(out)) == 4 and out.read_text().endswith("\n")
    regenerate(target, convs, out, **(GEN | {"batch_size": 1}))
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == sorted(c.id for c in convs)
    assert {r["id"]: r for r in records} == {r["id"]: r for r in reference}

    before = out.read_text()
    monkeypatch.setattr(regenerate_module, "generate_batch", None)  # a finished file needs no generation at all
    monkeypatch.setattr(regenerate_module, "StreamDecoder", None)
    regenerate(target, convs, out, **GEN)
    assert out.read_text() == before


def test_damaged_line_in_the_middle_is_an_error(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"id": "a", "messages": []}\nnot json\n{"id": "b", "messages": []}\n')
    with pytest.raises(DataError, match=r"r.jsonl:2: expected a regenerated conversation"):
        read_done_ids(out)


def test_regenerate_errors(tmp_path):
    target = tiny_target()
    with pytest.raises(DataError, match="conversation id 'x' occurs more than once"):
        regenerate(target, [Conversation("x", [user("t5")])] * 2, tmp_path / "r.jsonl", **GEN)
    with pytest.raises(DataError, match="conversation 's' has no user or assistant turn"):
        regenerate(target, [Conversation("s", [{"role": "system", "content": "t5"}])], tmp_path / "r.jsonl", **GEN)
    long = Conversation("long", [user(" ".join(["t5"] * 300))])
    with pytest.raises(DataError, match="first 'long'.* exceeds the context of tiny-0 \\(256 tokens\\)"):
        regenerate(target, [long], tmp_path / "r.jsonl", **GEN)
    assert not (tmp_path / "r.jsonl").exists()


def canned(outputs: list[tuple[str, bool]]):
    """A stand-in for generate_batch that returns these (text, ended) pairs in order, batch after batch."""
    queue = list(outputs)

    def generate(target, prompts, **kwargs):
        batch, queue[:] = queue[: len(prompts)], queue[len(prompts) :]
        return [(target.tokenizer(text, add_special_tokens=False)["input_ids"], ended) for text, ended in batch]

    return generate


def test_synth_dedups_and_filters_by_length(monkeypatch, capsys):
    target = tiny_target()
    outputs = [
        ("t5 t6 t7", True),
        ("t5 t6 t7", True),  # duplicate
        ("t5", True),  # too short
        ("t9 " * 20, True),  # too long
        ("t8 t9 t20", False),  # unfinished at max_new_tokens
        ("t21 t22 t23", True),
        ("t24 t25", True),
    ]
    monkeypatch.setattr(synth_module, "generate_batch", canned(outputs))
    convs = synthesize_prompts(target, 3, seed=0, min_chars=6, max_chars=20, batch_size=4, progress=False)
    assert [c.messages for c in convs] == [[user("t5 t6 t7")], [user("t21 t22 t23")], [user("t24 t25")]]
    assert [c.id for c in convs] == ["synth-00000", "synth-00001", "synth-00002"]

    monkeypatch.setattr(synth_module, "generate_batch", canned(outputs))
    few = synthesize_prompts(target, 5, seed=0, min_chars=6, max_chars=20, batch_size=4, max_attempts=7, progress=False)
    assert len(few) == 3
    assert (
        "synthesised 3 of 5 prompts in 7 samples (1 unfinished at 128 tokens, 2 outside 6-20 characters, "
        "1 duplicates)" in capsys.readouterr().err
    )


def test_synth_needs_sampling():
    with pytest.raises(ConfigError, match="needs sampling"):
        synthesize_prompts(tiny_target(), 3, seed=0, temperature=0.0)


@pytest.mark.integration
def test_smollm2_synthesises_distinct_prompts(smollm2):
    prefix, stop = pre_query(smollm2)
    assert prefix == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
    )
    assert stop == {smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    convs = synthesize_prompts(smollm2, 3, seed=0, max_new_tokens=40, min_chars=10, max_chars=300, progress=False)
    texts = [c.messages[0]["content"] for c in convs]
    print(texts)
    assert 1 <= len(texts) <= 3
    assert len({" ".join(t.casefold().split()) for t in texts}) == len(texts)
    assert all(10 <= len(t) <= 300 and "<|im" not in t for t in texts)


# ---- the stage ----------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


SHAREGPT = [
    {"id": "s1", "conversations": [{"from": "human", "value": "t5 t6"}, {"from": "gpt", "value": "t7"}]},
    {"id": "s2", "conversations": [{"from": "human", "value": "t8"}, {"from": "gpt", "value": "t9 t20"}]},
]


def test_stage_writes_conversations_and_manifest(tmp_path):
    source = write_jsonl(tmp_path / "chats.jsonl", SHAREGPT)
    out = build_dataset([str(source)], tmp_path / "data", limit=1, seed=7)
    assert read_jsonl(out / "conversations.jsonl") == [
        {"id": "s1", "messages": [user("t5 t6"), {"role": "assistant", "content": "t7"}]}
    ]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "data" and manifest["complete"] is True
    assert manifest["sources"] == [str(source)] and manifest["target"] is None
    assert manifest["counts"] == {"sources": {str(source): 1}, "synth": 0, "conversations": 1}
    assert manifest["config"] == {
        "regenerate": False,
        "synth": 0,
        "limit": 1,
        "hf_split": "train",
        "seed": 7,
        "temperature": 0.0,
        "max_new_tokens": 256,
        "batch_size": 16,
    }
    assert manifest["created"].endswith("+00:00")
    assert not (out / "regenerated.jsonl").exists()


def test_skip_holds_out_the_first_records_of_each_source(tmp_path):
    """`skip` keeps the prompts an evaluation takes from the start of a file out of training."""
    source = write_jsonl(tmp_path / "chats.jsonl", SHAREGPT)
    out = build_dataset([str(source)], tmp_path / "data", skip=1, limit=5)
    assert [r["id"] for r in read_jsonl(out / "conversations.jsonl")] == ["s2"]
    assert json.loads((out / "manifest.json").read_text())["config"]["skip"] == 1
    with pytest.raises(ConfigError, match="skip must be at least 0"):
        build_dataset([str(source)], tmp_path / "bad", skip=-1)


def test_stage_regenerates_prompts_and_synth_and_resumes(tmp_path, monkeypatch):
    target = tiny_target(seed=8)
    prompts_file = write_jsonl(tmp_path / "qs.jsonl", [{"question": "t5 t6"}, {"prompt": "t7"}])
    chats = write_jsonl(tmp_path / "chats.jsonl", SHAREGPT)
    synthesised = [Conversation("synth-00000", [user("t21 t22")])]
    monkeypatch.setattr(stage_module, "synthesize_prompts", lambda target, n, **kw: synthesised[:n])
    kwargs = {"target": target, "regenerate": True, "synth": 1, "max_new_tokens": 4, "batch_size": 2}
    out = build_dataset([str(prompts_file), str(chats)], tmp_path / "data", **kwargs)

    ids = ["qs/0", "qs/1", "chats/s1", "chats/s2", "synth-00000"]
    assert [r["id"] for r in read_jsonl(out / "conversations.jsonl")] == ids
    regenerated = read_jsonl(out / "regenerated.jsonl")
    assert sorted(r["id"] for r in regenerated) == sorted(ids)
    assert all(r["messages"][-1]["role"] == "assistant" for r in regenerated)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "tiny-8" and manifest["complete"] is True
    assert manifest["counts"] | {"truncated_turns": None} == {
        "sources": {str(prompts_file): 2, str(chats): 2},
        "synth": 1,
        "conversations": 5,
        "regenerated": 5,
        "assistant_turns": 5,
        "truncated_turns": None,
    }

    # A re-run with the same inputs resumes: nothing is read, synthesised or generated again.
    before = (out / "regenerated.jsonl").read_text()
    monkeypatch.setattr(stage_module, "synthesize_prompts", None)
    monkeypatch.setattr(regenerate_module, "generate_batch", None)
    monkeypatch.setattr(regenerate_module, "StreamDecoder", None)
    prompts_file.unlink()
    build_dataset([str(prompts_file), str(chats)], tmp_path / "data", **kwargs)
    assert (out / "regenerated.jsonl").read_text() == before

    with pytest.raises(DataError, match="already holds target-written data made from other sources, config or target"):
        build_dataset([str(chats)], tmp_path / "data", **(kwargs | {"max_new_tokens": 5}))


def test_stage_without_regenerate_needs_assistant_turns(tmp_path):
    source = write_jsonl(tmp_path / "qs.jsonl", [{"question": "t5"}, {"question": "t6"}])
    with pytest.raises(DataError, match=r"2 of 2 conversations from .*qs.jsonl have no assistant turn") as err:
        build_dataset([str(source)], tmp_path / "data")
    assert "--regenerate" in err.value.hint
    assert not (tmp_path / "data").exists()


def test_stage_input_errors(tmp_path):
    with pytest.raises(ConfigError, match="no sources, no --synth prompts and no --self-chat"):
        build_dataset([], tmp_path / "data")
    with pytest.raises(ConfigError, match="need a target model"):
        build_dataset(["x.jsonl"], tmp_path / "data", regenerate=True)
    with pytest.raises(DataError, match="'mt_bench' is an evaluation set"):
        build_dataset(["mt_bench"], tmp_path / "data")
    with pytest.raises(DataError, match="missing.jsonl: no such file"):
        build_dataset([str(tmp_path / "missing.jsonl")], tmp_path / "data")
    chats = write_jsonl(tmp_path / "chats.jsonl", SHAREGPT)
    with pytest.raises(DataError, match="conversation id 'chats/s1' occurs more than once"):
        build_dataset([str(chats), str(chats)], tmp_path / "data")


def test_hub_dataset_without_datasets_package_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(DataError, match="'owner/chats' is not a file.*needs the `datasets` package"):
        build_dataset(["owner/chats"], tmp_path / "data")


def test_hub_dataset_offline_fails_fast_and_online_rows_are_read(tmp_path, monkeypatch):
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([SHAREGPT[1], SHAREGPT[0], SHAREGPT[1]])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(stage_module, "hub_reachable", lambda: False)
    with pytest.raises(DataError, match="'owner/chats' is not a file, and the Hugging Face hub cannot be reached"):
        build_dataset(["owner/chats"], tmp_path / "data")
    assert calls == []

    monkeypatch.setattr(stage_module, "hub_reachable", lambda: True)
    out = build_dataset(["owner/chats:main"], tmp_path / "data", limit=2, hf_split="test")
    assert calls == [("owner/chats", "main", "test", True)]
    assert [r["id"] for r in read_jsonl(out / "conversations.jsonl")] == ["s2", "s1"]


def test_hub_load_failure_is_a_data_error(tmp_path, monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("offline mode is enabled\nmore detail")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"owner/chats\[train\] could not be loaded: ConnectionError: offline mode"):
        build_dataset(["owner/chats"], tmp_path / "data")
