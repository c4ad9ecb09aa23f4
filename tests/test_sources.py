"""Reading prompts and conversations: every accepted format, every user-facing error, the shipped data sets."""

import gzip
import json
import sys
import time
import types
from importlib import resources
from pathlib import Path

import pytest

from draftsmith.data.sources import (
    KNOWN_DATASETS,
    Conversation,
    first_prompt,
    load_conversations,
    load_eval_prompts,
    read_records,
    record_to_conversation,
)
from draftsmith.errors import DataError

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared evaluation data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def no_data_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRAFTSMITH_DATA", raising=False)


# --- read_records: file formats -------------------------------------------------------------------------------


def test_jsonl_skips_blank_lines_and_numbers_records_by_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n   \n{"prompt": "b"}\n')
    assert list(read_records(path)) == [(1, {"prompt": "a"}), (4, {"prompt": "b"})]


def test_gzipped_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [r["prompt"] for _, r in read_records(path)] == ["a", "b"]


def test_json_array_numbers_records_by_position(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
    assert list(read_records(path)) == [(1, {"prompt": "a"}), (2, {"prompt": "b"})]


def test_json_file_with_jsonl_content(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [n for n, _ in read_records(path)] == [1, 2]


# --- read_records: errors ------------------------------------------------------------------------------------


def test_malformed_line_names_file_line_and_shows_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": oops}\n')
    with pytest.raises(DataError) as e:
        list(read_records(path))
    assert f"{path}:3" in e.value.message
    assert '{"prompt": oops}' in e.value.message
    assert e.value.hint


def test_malformed_json_array_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"prompt": "a"},\n  {"prompt": }\n]\n')
    with pytest.raises(DataError, match=r"bad\.json:3"):
        list(read_records(path))


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as e:
        list(read_records(path))
    assert str(path) in e.value.message and e.value.hint


def test_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_text("prompt\nhi\n")
    with pytest.raises(DataError, match=r"expected a \.jsonl"):
        list(read_records(path))


def test_record_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n["not", "an", "object"]\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: expected a JSON object, found list"):
        list(read_records(path))


def test_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl.gz"
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match="cannot read"):
        list(read_records(path))


# --- record_to_conversation ----------------------------------------------------------------------------------


def test_sharegpt_from_value_roles_are_normalised() -> None:
    turns = [
        ("system", "system"),
        ("human", "user"),
        ("gpt", "assistant"),
        ("function", "tool"),
        ("chatgpt", "assistant"),
        ("observation", "tool"),
        ("bard", "assistant"),
        ("tool", "tool"),
        ("model", "assistant"),
    ]
    record = {"id": "c1", "conversations": [{"from": f, "value": f"text {i}"} for i, (f, _) in enumerate(turns)]}
    conv = record_to_conversation(record, "f.json:1")
    assert conv.id == "c1"
    assert [m["role"] for m in conv.messages] == [role for _, role in turns]
    assert conv.messages[1] == {"role": "user", "content": "text 1"}


def test_messages_with_role_content_and_null_tool_call_content() -> None:
    record = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
        ]
    }
    conv = record_to_conversation(record, "f.jsonl:5", index=4)
    assert conv.id == "4"
    assert conv.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]


def test_unknown_role_is_named() -> None:
    record = {"conversations": [{"from": "narrator", "value": "Once upon a time"}]}
    with pytest.raises(DataError, match=r"f\.json:7: conversations\[0\]: unknown role 'narrator'"):
        record_to_conversation(record, "f.json:7")


def test_turn_without_role_fields_lists_what_it_found() -> None:
    with pytest.raises(DataError, match=r"found \['speaker', 'text'\]"):
        record_to_conversation({"conversations": [{"speaker": "a", "text": "b"}]}, "f.json:1")


def test_non_string_content_is_an_error() -> None:
    with pytest.raises(DataError, match=r"content: expected a string, found list"):
        record_to_conversation({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "f.jsonl:1")


def test_empty_conversation_is_an_error() -> None:
    with pytest.raises(DataError, match="at least one message"):
        record_to_conversation({"conversations": []}, "f.json:1")


def test_mt_bench_turns_become_user_messages() -> None:
    conv = record_to_conversation({"question_id": 81, "turns": ["one", "two"]}, "q.jsonl:1")
    assert conv.id == "81"
    assert conv.messages == [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]


def test_plain_prompt_stays_verbatim() -> None:
    conv = record_to_conversation({"prompt": "def f():\n"}, "p.jsonl:1", index=0)
    assert conv.messages == [{"role": "user", "content": "def f():\n"}]


def test_humaneval_prompt_is_wrapped_for_a_chat_model() -> None:
    record = {"task_id": "HumanEval/0", "prompt": "def f(x):\n    ...\n", "entry_point": "f"}
    conv = record_to_conversation(record, "h.jsonl:1")
    assert conv.id == "HumanEval/0"
    content = conv.messages[0]["content"]
    assert content.startswith("Complete the following Python function.")
    assert "```python\ndef f(x):\n    ...\n```" in content


def test_gsm8k_question() -> None:
    conv = record_to_conversation({"question": "2+2?", "answer": "#### 4"}, "g.jsonl:3", index=2)
    assert conv == Conversation(id="2", messages=[{"role": "user", "content": "2+2?"}])


def test_record_without_known_fields_lists_expected_and_found() -> None:
    with pytest.raises(DataError) as e:
        record_to_conversation({"text": "hi", "label": 1}, "x.jsonl:2")
    msg = e.value.message
    assert "x.jsonl:2" in msg and "'conversations'" in msg and "'prompt'" in msg and "['label', 'text']" in msg


def test_first_prompt_keeps_system_and_stops_at_first_user() -> None:
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert first_prompt(Conversation("c", msgs)) == msgs[:2]


def test_first_prompt_without_user_message() -> None:
    with pytest.raises(DataError, match="'c'.*expected a user message"):
        first_prompt(Conversation("c", [{"role": "assistant", "content": "a"}]))


def test_load_conversations_error_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a"}, {"oops": 1}])
    with pytest.raises(DataError, match=r"c\.jsonl:2"):
        load_conversations(path)


# --- load_eval_prompts ---------------------------------------------------------------------------------------


def test_eval_prompts_from_a_file_path_with_limit(tmp_path: Path) -> None:
    convs = [
        {"id": i, "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
        for i in range(5)
    ]
    path = write_jsonl(tmp_path / "mine.jsonl", convs)
    name, prompts = load_eval_prompts(str(path), limit=3)
    assert name == "mine.jsonl"
    assert [p.id for p in prompts] == ["0", "1", "2"]
    assert prompts[0].messages == [{"role": "user", "content": "q0"}]


def test_limit_stops_before_a_later_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\nnot json\n')
    assert len(load_eval_prompts(str(path), limit=1)[1]) == 1


def test_empty_dataset_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="at least one prompt"):
        load_eval_prompts(str(path))


def test_unknown_dataset_name_lists_known_names() -> None:
    with pytest.raises(DataError) as e:
        load_eval_prompts("no_such_benchmark")
    assert all(name in e.value.message for name in KNOWN_DATASETS)


def test_builtin_prompts() -> None:
    name, prompts = load_eval_prompts("builtin")
    assert name == "builtin"
    assert 50 <= len(prompts) <= 70
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)
    with resources.as_file(resources.files("draftsmith.data") / "builtin_prompts.jsonl") as path:
        categories = {r["category"] for _, r in read_records(path)}
    assert categories == {"chat", "coding", "math", "extraction", "summarisation", "rewriting"}
    assert load_eval_prompts()[1] == prompts


def test_named_dataset_found_via_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "gsm8k_test.jsonl", [{"question": "q1", "answer": "1"}, {"question": "q2", "answer": "2"}])
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path))
    name, prompts = load_eval_prompts("gsm8k")
    assert name == "gsm8k"
    assert [p.messages[0]["content"] for p in prompts] == ["q1", "q2"]


def test_data_dir_wins_over_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "a" / "gsm8k_test.jsonl", [{"question": "from data_dir"}])
    write_jsonl(tmp_path / "b" / "gsm8k_test.jsonl", [{"question": "from env"}])
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "b"))
    assert load_eval_prompts("gsm8k", data_dir=tmp_path / "a")[1][0].messages[0]["content"] == "from data_dir"


def test_named_dataset_offline_fails_fast_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_data_env: None
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache, should `datasets` be installed
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        load_eval_prompts("mt_bench", data_dir=tmp_path)
    assert time.monotonic() - start < 10
    assert "--data-dir" in e.value.hint and "mt_bench_questions.jsonl" in e.value.hint


def fake_datasets(monkeypatch: pytest.MonkeyPatch, load_dataset) -> list:
    calls: list = []

    def record_call(*args, **kwargs):
        calls.append((args, kwargs))
        return load_dataset()

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=record_call))
    monkeypatch.setattr("draftsmith.target.hub_reachable", lambda: True)  # as if online
    return calls


def test_hub_fallback_maps_mt_bench_rows(monkeypatch: pytest.MonkeyPatch, no_data_env: None) -> None:
    rows = [{"prompt": ["first turn", "second turn"], "prompt_id": 7, "category": "x"}]
    calls = fake_datasets(monkeypatch, lambda: rows)
    name, prompts = load_eval_prompts("mt_bench")
    assert calls == [(("HuggingFaceH4/mt_bench_prompts", None), {"split": "train"})]
    assert prompts == [Conversation("7", [{"role": "user", "content": "first turn"}])]


def test_hub_failure_becomes_a_data_error(monkeypatch: pytest.MonkeyPatch, no_data_env: None) -> None:
    def unreachable():
        raise ConnectionError("Couldn't reach the hub\nmore detail")

    fake_datasets(monkeypatch, unreachable)
    with pytest.raises(DataError) as e:
        load_eval_prompts("gsm8k")
    assert "ConnectionError: Couldn't reach the hub" in e.value.message and "\n" not in e.value.message
    assert "gsm8k_test.jsonl" in e.value.hint


# --- the shared evaluation data ------------------------------------------------------------------------------


def test_shared_mt_bench(shared_data: Path) -> None:
    _, prompts = load_eval_prompts("mt_bench", data_dir=shared_data)
    assert len(prompts) == 80
    assert prompts[0].id == "81"
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)
    first_turn = json.loads((shared_data / "mt_bench_questions.jsonl").read_text().splitlines()[0])["turns"][0]
    assert prompts[0].messages[0]["content"] == first_turn


def test_shared_humaneval(shared_data: Path) -> None:
    _, prompts = load_eval_prompts("humaneval", data_dir=shared_data)
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0"
    assert "def has_close_elements" in prompts[0].messages[0]["content"]


def test_shared_gsm8k(shared_data: Path) -> None:
    _, prompts = load_eval_prompts("gsm8k", data_dir=shared_data, limit=None)
    assert len(prompts) == 1319
    assert prompts[0].id == "0" and prompts[0].messages[0]["content"].startswith("Janet")


def test_shared_fastchat_sharegpt(shared_data: Path) -> None:
    convs = load_conversations(shared_data / "fastchat_dummy_conversation.json")
    assert len(convs) == 500
    assert convs[0].id == "identity_0"
    for conv in convs:
        roles = [m["role"] for m in conv.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles


def test_shared_specforge_tool_use(shared_data: Path) -> None:
    (conv,) = load_conversations(shared_data / "specforge_tool_use_conversation.jsonl")
    assert conv.id == "9"
    assert len(conv.messages) == 13
    assert [m["role"] for m in conv.messages[:4]] == ["system", "user", "assistant", "tool"]
