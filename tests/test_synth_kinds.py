"""Synthesised prompts steered by kind: every requested kind, in turns and even counts, the same for a seed."""

import collections

import pytest

from draftsmith.data.synth import KINDS, SYNTH_KINDS, check_kinds, prompt_kind, synthesize_prompts
from draftsmith.errors import ConfigError
from draftsmith.stages import DataConfig
from tests.conftest import tiny_target


def chatty_target(seed: int = 2):
    """A tiny random target that ends a message often (any of 23 tokens stops it), so short samples finish."""
    target = tiny_target(seed=seed)
    target.eos_token_ids = set(range(1, 24))
    return target


def synth(target, n, kinds=SYNTH_KINDS, seed=0):
    return synthesize_prompts(
        target, n, seed=seed, max_new_tokens=6, min_chars=1, batch_size=8, max_attempts=50 * n, kinds=kinds,
        progress=False,
    )  # fmt: skip


def opener_of(text: str, kind: str) -> str | None:
    """The opener of `kind` that `text` was written from: its fixed words (around a passage) are all in place."""
    for opener in KINDS[kind].openers:
        head, _, tail = opener.partition("{passage}")
        if text.startswith(head.strip()) and tail.strip() in text:
            return opener
    return None


def test_every_kind_in_turns_with_even_counts_and_ids_that_name_it():
    convs = synth(chatty_target(), 2 * len(SYNTH_KINDS))
    kinds = [prompt_kind(c.id) for c in convs]
    assert kinds == list(SYNTH_KINDS) * 2  # round-robin: each kind once, then again
    assert [c.id for c in convs][:2] == ["synth-writing-00000", "synth-roleplay-00001"]
    assert [c.kind for c in convs] == kinds  # the Conversation carries it too
    assert len({c.messages[0]["content"] for c in convs}) == len(convs)
    for conv, kind in zip(convs, kinds, strict=True):
        text = conv.messages[0]["content"]
        opener = opener_of(text, kind)
        assert conv.messages[0]["role"] == "user" and opener is not None, (kind, text)
        written = text
        for fixed in opener.split("{passage}"):
            written = written.replace(fixed.strip(), "")
        assert written.strip(), (kind, text)  # the target wrote a passage, the rest of the prompt, or both


def test_uneven_counts_differ_by_at_most_one_and_follow_the_given_order():
    convs = synth(chatty_target(), 10, kinds=["code", "math", "translation"])
    counts = collections.Counter(prompt_kind(c.id) for c in convs)
    assert counts == {"code": 4, "math": 3, "translation": 3}
    assert [prompt_kind(c.id) for c in convs][:4] == ["code", "math", "translation", "code"]


def test_the_same_seed_gives_the_same_prompts_another_seed_others():
    first = synth(chatty_target(), 9)
    assert synth(chatty_target(), 9) == first
    other = synth(chatty_target(), 9, seed=1)
    assert [c.messages for c in other] != [c.messages for c in first]


def test_unknown_kind_is_a_one_line_config_error_listing_the_valid_kinds():
    with pytest.raises(ConfigError) as err:
        synth(chatty_target(), 3, kinds=["code", "poetry"])
    assert "\n" not in err.value.message
    assert "unknown prompt kind 'poetry'" in err.value.message
    assert ", ".join(SYNTH_KINDS) in err.value.message
    with pytest.raises(ConfigError, match="lists a kind twice"):
        check_kinds(["code", "code"])
    with pytest.raises(ConfigError, match="invalid synth_kinds=.*unknown prompt kind 'poetry'.*writing, roleplay"):
        DataConfig.checked(synth_kinds=["poetry"])
    assert DataConfig().synth_kinds == list(SYNTH_KINDS)  # all ten by default


def test_prompt_kind_reads_ids_and_ignores_others():
    assert prompt_kind("synth-passage_qa-00012") == "passage_qa"
    assert prompt_kind("synth/synth-code-00001") == "code"
    assert prompt_kind("synth-00003") is None and prompt_kind("gsm8k_test/12") is None


def test_data_stage_spreads_synth_over_the_kinds_and_records_them(tmp_path):
    import json

    from draftsmith.data.stage import build_dataset

    out = build_dataset(
        [], tmp_path / "data", target=chatty_target(), regenerate=True, synth=5, synth_kinds=["code", "math"],
        max_new_tokens=3, batch_size=4,
    )  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["synth_kinds"] == ["code", "math"]
    assert manifest["counts"]["synth_kinds"] == {"code": 3, "math": 2}
    gathered = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in gathered] == ["code", "math", "code", "math", "code"]
    ids = [json.loads(line)["id"] for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(ids) == ["synth-code-00000", "synth-code-00002", "synth-code-00004", "synth-math-00001",
                           "synth-math-00003"]  # fmt: skip
