"""Self-chat: the target writes both sides of multi-turn chats in one batch; replies are its greedy output."""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from draftsmith import stages
from draftsmith.backends.batch import generate_batch
from draftsmith.backends.hf import TransformersBackend
from draftsmith.backends.stream import StreamDecoder
from draftsmith.data.regenerate import recorded_dir, regenerate
from draftsmith.data.selfchat import FOLLOW_UPS, Template, self_chat
from draftsmith.data.sources import Conversation
from draftsmith.data.stage import build_dataset, load_stage_conversations
from draftsmith.data.tokenize import tokenize_conversation
from draftsmith.errors import ConfigError, DataError
from draftsmith.stages import ExtractConfig
from draftsmith.store import HiddenStateStore, RecordedFeatures, Recording, default_aux_layers
from draftsmith.target import Target
from tests.conftest import tiny_target


def chat_target(seed: int) -> Target:
    """tiny_target with words of one width (w00 ... w95), so a decoded turn encodes back to the same ids (the
    conftest tokenizer's special "t1" also matches the start of "t13")."""
    tiny = tiny_target(seed=seed)
    tok = Tokenizer(models.WordLevel({f"w{i:02d}": i for i in range(96)}, unk_token="w00"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w01", pad_token="w01")
    return Target(tiny.name, tiny.model, tokenizer)


def chats(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_recorded_top_is_the_targets_argmax(target, recorded, sid, ids, mask):
    """The argmax recorded as the target wrote is there for every position whose next token is trained on, and it
    is the target's own over its whole vocabulary (a fresh forward; near-ties, which batching may flip, skipped)."""
    top = recorded.target_top(sid, len(ids))
    assert top is not None and bool((top[:-1] >= 0)[torch.tensor(mask[1:], dtype=torch.bool)].all())
    logits = target.forward(torch.tensor(ids), target.new_cache()).logits
    best = logits.topk(2, dim=-1).values
    clear = (top >= 0) & (best[:, 0] - best[:, 1] > 1e-3)
    assert clear.sum() > (top >= 0).sum() // 2 and torch.equal(top[clear].long(), logits.argmax(-1)[clear])


def test_replies_are_the_targets_greedy_output_for_the_chat_so_far(tmp_path):
    target = chat_target(seed=3)
    template = Template(target)
    out = self_chat(target, 6, tmp_path / "chat.jsonl", seed=1, length=80, batch_size=4, max_turn_tokens=10,
                    kinds=(), progress=False)  # fmt: skip
    checked = 0
    for record in chats(out):
        messages = record["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        prompt = list(template.start)
        for user, reply in zip(messages[::2], messages[1::2], strict=True):
            prompt += template.encode(user["content"]) + template.to_assistant
            [(tokens, ended)] = generate_batch(
                target, [prompt], temperature=0.0, max_new_tokens=10, stop_ids=template.ends_assistant
            )
            if len(prompt) + len(tokens) + 1 >= 80:  # the chat's length cut this reply short
                break
            assert template.decode(tokens) == reply["content"]
            assert reply.get("truncated", False) == (not ended)
            checked += 1
            prompt += tokens + template.to_user
    assert checked >= 6  # every chat's first reply at least


def test_kinds_take_turns_and_passage_kinds_ask_about_the_passage(tmp_path):
    target = tiny_target(seed=4)
    out = self_chat(target, 4, tmp_path / "chat.jsonl", seed=0, length=90, batch_size=4, max_turn_tokens=8,
                    kinds=("summarisation", "code"), progress=False)  # fmt: skip
    records = chats(out)
    assert [r["id"] for r in records] == [f"chat-{k}-{i:05d}" for i, k in enumerate(["summarisation", "code"] * 2)]
    summary = records[0]["messages"]
    assert summary[0]["content"].startswith("Write a short ") and len(summary) >= 3
    template = Template(target)
    asks = [template.decode(template.encode(f)) for f in FOLLOW_UPS["summarisation"]]  # as the tokenizer reads them
    assert any(summary[2]["content"].startswith(a) for a in asks)  # the follow-up asks about the passage


def test_same_seed_same_chats_and_a_cut_run_resumes_to_the_same_file(tmp_path):
    target = tiny_target(seed=5)
    options = {"seed": 2, "length": 60, "batch_size": 2, "max_turn_tokens": 8, "progress": False}
    whole = self_chat(target, 5, tmp_path / "whole.jsonl", **options).read_text()
    cut = tmp_path / "cut.jsonl"
    lines = whole.splitlines(keepends=True)
    cut.write_text("".join(lines[:2]) + lines[2][:10])  # one whole batch, then a torn line
    assert self_chat(target, 5, cut, **options).read_text() == whole


def test_a_time_budget_writes_the_whole_batches_that_fit_and_a_resume_spends_only_what_is_left(tmp_path, monkeypatch):
    """Each batch "takes" 60 s (a fake clock): 2.5 minutes fit two batches (a third would end at 180 s), a resume
    with 3.5 minutes adds exactly one, and the chats are a prefix of the unbudgeted run's."""
    from draftsmith.data import selfchat as module

    clock = {"now": 0.0}
    real_write = module._write_batch

    def slow_write(*args, **kwargs):
        clock["now"] += 60.0
        return real_write(*args, **kwargs)

    monkeypatch.setattr(module, "_write_batch", slow_write)
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock["now"])
    target = tiny_target(seed=5)
    options = {"seed": 2, "length": 40, "batch_size": 2, "max_turn_tokens": 8, "progress": False}
    whole = chats(self_chat(target, 9, tmp_path / "whole.jsonl", **options))
    out = tmp_path / "chat.jsonl"
    assert chats(self_chat(target, 9, out, minutes=2.5, **options)) == whole[:4]
    assert json.loads(out.with_suffix(".seconds.json").read_text()) == {"seconds": 120.0, "batches": 2}
    assert chats(self_chat(target, 9, out, minutes=3.5, **options)) == whole[:6]
    with pytest.raises(ConfigError, match="budget above 0 minutes"):
        self_chat(target, 2, tmp_path / "c.jsonl", seed=0, minutes=0, progress=False)


def test_bad_settings_are_refused_in_one_line(tmp_path):
    target = tiny_target()
    with pytest.raises(ConfigError, match="exceeds the context"):
        self_chat(target, 2, tmp_path / "c.jsonl", seed=0, length=10_000, progress=False)
    with pytest.raises(ConfigError, match="length >= 16"):
        self_chat(target, 2, tmp_path / "c.jsonl", seed=0, length=4, progress=False)


def test_the_data_stage_keeps_self_chats_beside_the_regenerated_conversations(tmp_path):
    target = tiny_target(seed=6)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "t5 t6 t7"}\n{"prompt": "t8 t9"}\n')
    out = build_dataset([str(prompts)], tmp_path / "data", target=target, regenerate=True, self_chat=3,
                        self_chat_length=40, max_new_tokens=6, batch_size=2)  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["self_chat"] == 3 and manifest["config"]["self_chat_length"] == 40
    conversations = load_stage_conversations(out)
    assert len(conversations) == 5 and sum(c.id.startswith("chat-") for c in conversations) == 3


def test_the_user_temperature_reaches_the_user_turns_and_guards_the_resume(tmp_path):
    """A colder user writer writes other user turns; the manifest records it, so a store is never resumed at another."""
    target = chat_target(seed=4)
    users = {}
    for t in (1.0, 0.05):
        out = build_dataset([], tmp_path / f"data-{t}", target=target, self_chat=4, self_chat_length=60,
                            self_chat_user_temperature=t, max_new_tokens=6, batch_size=4)  # fmt: skip
        users[t] = [m["content"] for r in chats(out / "chat.jsonl") for m in r["messages"] if m["role"] == "user"]
    assert users[1.0] != users[0.05]
    manifest = json.loads((tmp_path / "data-0.05" / "manifest.json").read_text())
    assert manifest["config"]["self_chat_user_temperature"] == 0.05
    with pytest.raises(DataError, match="other sources, config or target"):
        build_dataset([], tmp_path / "data-1.0", target=target, self_chat=4, self_chat_length=60,
                      self_chat_user_temperature=0.05, max_new_tokens=6, batch_size=4)  # fmt: skip


def test_a_looping_reply_ends_before_it_repeats_an_ngram(tmp_path):
    """With loop_ngram 3 every reply is the target's greedy reply cut just before its first repeated trigram."""
    target = chat_target(seed=3)
    template = Template(target)
    out = self_chat(target, 6, tmp_path / "chat.jsonl", seed=1, length=120, batch_size=3, max_turn_tokens=24,
                    loop_ngram=3, kinds=(), progress=False)  # fmt: skip
    cut = 0
    for record in chats(out):
        prompt = list(template.start)
        messages = record["messages"]
        for user, reply in zip(messages[::2], messages[1::2], strict=True):
            prompt += template.encode(user["content"]) + template.to_assistant
            tokens = template.encode(reply["content"])
            grams = [tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)]
            assert len(set(grams)) == len(grams)  # no trigram twice inside a reply
            [(greedy, _)] = generate_batch(
                target, [prompt], temperature=0.0, max_new_tokens=24, stop_ids=template.ends_assistant
            )
            if len(prompt) + len(greedy) + 1 >= 120:  # the chat's length cut this reply short
                break
            assert greedy[: len(tokens)] == tokens
            if len(tokens) < min(len(greedy), 24):  # cut by the loop rule: the next token repeats a trigram
                assert tuple(greedy[len(tokens) - 2 : len(tokens) + 1]) in grams and reply["truncated"]
                cut += 1
            prompt += tokens + template.to_user
    assert cut >= 2  # the random target loops, so the rule fired
    with pytest.raises(ConfigError, match="loop_ngram >= 0"):
        self_chat(target, 2, tmp_path / "c.jsonl", seed=0, loop_ngram=-1, progress=False)


def test_recorded_states_are_the_targets_own_for_exactly_the_tokens_it_wrote(tmp_path):
    """Every token of a chat is fed once (prefill or one decode step): what is recorded equals a fresh forward over
    the chat, and the tokens and loss mask equal what `tokenize` makes of the written messages (this tokenizer
    encodes a decoded turn back to the same ids)."""
    target = chat_target(seed=3)
    layers = default_aux_layers(target.num_layers)
    record = Recording(target.fingerprint(), layers, "transformers")
    out = self_chat(target, 6, tmp_path / "chat.jsonl", seed=1, length=80, batch_size=4, max_turn_tokens=10,
                    kinds=(), record=record, progress=False)  # fmt: skip
    assert recorded_dir(out) == tmp_path / "chat.features"
    assert sorted(p.name for p in recorded_dir(out).iterdir()) == [
        "batch-000000.safetensors", "batch-000004.safetensors"
    ]  # fmt: skip
    recorded = RecordedFeatures(recorded_dir(out))
    assert recorded.keep_only(record) == []
    for chat in chats(out):
        ids, mask = recorded.sample(chat["id"])
        written, learned = tokenize_conversation(target.tokenizer, chat["messages"], 1000)
        shared = min(len(ids), len(written))  # the turn in progress at the end is cut differently
        assert shared > 40 and ids[:shared] == written[:shared] and mask[:shared] == learned[:shared]
        assert sum(mask) > 0
        fresh = target.forward(torch.tensor(ids), target.new_cache(), layers, logits_to_keep=1, last_hidden=True)
        aux, last = recorded.features(chat["id"], torch.tensor(ids, dtype=torch.int32))
        torch.testing.assert_close(aux, fresh.aux_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(last, fresh.last_hidden, atol=1e-4, rtol=1e-4)
        assert_recorded_top_is_the_targets_argmax(target, recorded, chat["id"], ids, mask)
        assert recorded.features(chat["id"], torch.tensor(ids[:-1] + [ids[-1] ^ 1], dtype=torch.int32)) is None
    other = Recording(target.fingerprint(), (0, 1, 2), "transformers")
    [refusal] = recorded.keep_only(other)
    assert not recorded.index and refusal.startswith("2 files of recorded features not used")


TEMPLATE = (
    "{% for m in messages %}w02 {{ m['role'] }} {{ m['content'] }} w01 {% endfor %}"
    "{% if add_generation_prompt %}w02 assistant {% endif %}"
)  # turns that end with the target's stop token, so a written turn reads back as the tokens the row fed


def test_regeneration_records_the_states_of_every_token_the_target_read(tmp_path, monkeypatch):
    """Rows that never drain record as they go: a regenerated conversation's states equal a fresh forward over its
    tokens, which with their loss mask are what `tokenize` makes of the written messages (the stop token a reply
    ended with is the template's turn end, as served); later turns extend the row; files are written a group at a
    time."""
    target = chat_target(seed=4)
    target.tokenizer.chat_template = TEMPLATE
    layers = default_aux_layers(target.num_layers)
    record = Recording(target.fingerprint(), layers, "transformers")
    words = lambda i: " ".join(f"w{10 + (i * 7 + j) % 80}" for j in range(2 + i % 4))  # noqa: E731
    follow_up = [{"role": "user", "content": "w33 w44"}]
    convs = [Conversation(f"c{i}", [{"role": "user", "content": words(i)}] + follow_up * (i % 2)) for i in range(7)]
    target.eos_token_ids = {1} | set(range(40, 60))  # stop tokens besides the template's turn end (w01)
    options = {"temperature": 0.0, "max_new_tokens": 6, "batch_size": 3, "seed": 0, "progress": False}
    restarts, after_prefix, step = [], [], StreamDecoder.step

    def counted(self, tokens, restart=(), shared=()):
        restarts.extend(restart)
        after_prefix.extend(shared)
        return step(self, tokens, restart, shared)

    monkeypatch.setattr(StreamDecoder, "step", counted)
    out = regenerate(target, convs, tmp_path / "regenerated.jsonl", record=record, **options)
    monkeypatch.undo()
    (tmp_path / "plain").mkdir()
    plain = regenerate(target, convs, tmp_path / "plain" / "regenerated.jsonl", **options)
    assert {c["id"]: c for c in chats(out)} == {c["id"]: c for c in chats(plain)}  # a batch per turn, no states
    assert not recorded_dir(plain).exists()
    # new conversations only, each after the prompts' shared opening ("w02 user"): every later turn extended its row
    assert not restarts and len(after_prefix) == len(convs) - 3
    assert sorted(p.name for p in recorded_dir(out).iterdir()) == [
        "part-0000000.safetensors", "part-0000003.safetensors", "part-0000006.safetensors"
    ]  # fmt: skip
    recorded = RecordedFeatures(recorded_dir(out))
    for conv in chats(out):
        ids, mask = recorded.sample(conv["id"])
        written, learned = tokenize_conversation(target.tokenizer, conv["messages"], 1000)
        assert (ids, mask) == (written, learned)
        fresh = target.forward(torch.tensor(ids), target.new_cache(), layers, logits_to_keep=1, last_hidden=True)
        aux, last = recorded.features(conv["id"], torch.tensor(ids, dtype=torch.int32))
        torch.testing.assert_close(aux, fresh.aux_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(last, fresh.last_hidden, atol=1e-4, rtol=1e-4)
        assert_recorded_top_is_the_targets_argmax(target, recorded, conv["id"], ids, mask)
    replies = [m for c in chats(out) for m in c["messages"] if m["role"] == "assistant"]
    assert len(replies) == 10 and 0 < sum(m["truncated"] for m in replies) < 10  # stopped and cut replies


def test_a_crash_while_regenerating_leaves_states_for_every_conversation_on_disk(tmp_path, monkeypatch):
    """Recorded groups reach the disk states first: after a crash every line on disk has its states, and the resumed
    run completes the file as an uninterrupted one writes it."""
    target = chat_target(seed=5)
    target.tokenizer.chat_template = TEMPLATE
    record = Recording(target.fingerprint(), default_aux_layers(target.num_layers), "transformers")
    convs = [Conversation(f"c{i}", [{"role": "user", "content": f"w{20 + i} w{30 + i}"}]) for i in range(7)]
    options = {"temperature": 0.0, "max_new_tokens": 5, "batch_size": 2, "seed": 0, "progress": False}
    (tmp_path / "whole").mkdir()
    whole = chats(regenerate(target, convs, tmp_path / "whole" / "regenerated.jsonl", record=record, **options))
    step, calls = StreamDecoder.step, []

    def crash_on_step_12(self, tokens, restart=(), shared=()):
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return step(self, tokens, restart, shared)

    monkeypatch.setattr(StreamDecoder, "step", crash_on_step_12)
    out = tmp_path / "regenerated.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, convs, out, record=record, **options)
    on_disk = [c["id"] for c in chats(out)]
    assert 0 < len(on_disk) < 7 and all(cid in RecordedFeatures(recorded_dir(out)) for cid in on_disk)
    monkeypatch.undo()
    regenerate(target, convs, out, record=record, **options)
    assert {c["id"]: c for c in chats(out)} == {c["id"]: c for c in whole}
    assert set(RecordedFeatures(recorded_dir(out)).index) == {c.id for c in convs}


def test_extract_copies_recorded_states_and_stores_what_a_second_pass_would(tmp_path, monkeypatch):
    """The data stage records, extract copies: no forward over a recorded self-chat or regenerated conversation,
    and the store equals one extracted the old way. A store asking for other layers computes."""
    target = chat_target(seed=6)
    target.tokenizer.chat_template = TEMPLATE
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w05 w06 w07"}\n{"prompt": "w08 w09"}\n')
    options = {"target": target, "regenerate": True, "self_chat": 3, "self_chat_length": 40, "max_new_tokens": 6,
               "batch_size": 2}  # fmt: skip
    recorded_dir = build_dataset([str(prompts)], tmp_path / "rec", record_features=True, **options)
    plain_dir = build_dataset([str(prompts)], tmp_path / "plain", **options)
    for name in ("chat.jsonl", "regenerated.jsonl"):  # recorded regeneration writes conversations as they end
        assert sorted(chats(recorded_dir / name), key=str) == sorted(chats(plain_dir / name), key=str)
    assert json.loads((recorded_dir / "manifest.json").read_text())["config"]["record_features"] is True

    computed = []
    real = TransformersBackend.features

    def counted(self, samples, layer_ids):
        computed.extend(samples)
        return real(self, samples, layer_ids)

    monkeypatch.setattr(TransformersBackend, "features", counted)
    copied = HiddenStateStore(stages.extract(ExtractConfig(dtype="float32"), recorded_dir, tmp_path / "s1", target))
    recorded = RecordedFeatures(recorded_dir / "chat.features", recorded_dir / "regenerated.features")
    assert not computed and copied.manifest["recorded_samples"] == 5
    again = HiddenStateStore(stages.extract(ExtractConfig(dtype="float32"), plain_dir, tmp_path / "s2", target))
    assert len(computed) == 5
    assert len(copied) == len(again) == 5
    for i in range(5):  # a chat cut by its length was fed up to its last token but one (`tokenize` adds that token
        a, b = copied[i], again[i]  # and the turn end after it)
        n = min(len(a["input_ids"]), len(b["input_ids"]))
        assert copied.sample_id(i) == again.sample_id(i) and n >= len(b["input_ids"]) - 2
        assert torch.equal(a["input_ids"][:n], b["input_ids"][:n])
        assert torch.equal(a["loss_mask"][:n], b["loss_mask"][:n])
        torch.testing.assert_close(a["aux_hidden"][:n], b["aux_hidden"][:n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a["last_hidden"][:n], b["last_hidden"][:n], atol=1e-4, rtol=1e-4)
        assert torch.equal(a["target_top"], recorded.target_top(copied.sample_id(i), len(a["input_ids"])).long())
        assert "target_top" not in b  # computed by a second pass: training computes it
    other = stages.extract(ExtractConfig(dtype="float32", layers=(0, 1)), recorded_dir, tmp_path / "s3", target)
    assert len(computed) == 5 + 5 and "recorded_samples" not in HiddenStateStore(other).manifest


def test_a_batch_recorded_but_not_yet_written_is_recorded_again_identically(tmp_path):
    """A crash between a batch's states (written first) and its chats: the resumed run rewrites that batch's file
    with the same bytes and appends the same chats, so the states always belong to the chats on disk."""
    target = chat_target(seed=5)
    record = Recording(target.fingerprint(), default_aux_layers(target.num_layers), "transformers")
    options = {"seed": 2, "length": 40, "batch_size": 2, "max_turn_tokens": 8, "kinds": (), "record": record,
               "progress": False}  # fmt: skip
    (tmp_path / "whole").mkdir()
    whole = self_chat(target, 4, tmp_path / "whole" / "chat.jsonl", **options)
    states = sorted(recorded_dir(whole).iterdir())
    out = tmp_path / "cut" / "chat.jsonl"
    out.parent.mkdir()
    out.write_text("".join(whole.read_text().splitlines(keepends=True)[:2]))  # the first batch's chats only
    recorded_dir(out).mkdir()
    (recorded_dir(out) / states[1].name).write_bytes(b"torn")  # the second batch's states, half written
    self_chat(target, 4, out, **options)
    assert out.read_text() == whole.read_text()
    assert (recorded_dir(out) / states[1].name).read_bytes() == states[1].read_bytes()
    assert not (recorded_dir(out) / states[0].name).exists()  # its chats were on disk: not redone
