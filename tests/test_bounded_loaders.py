"""Loaders bounded against damaged or hostile input: a drafter config with absurd sizes, or weights whose headers
do not match it, is refused from the metadata before any tensor is read; a dataset line over the size cap or a
conversation over the turn cap names file:line; chat rendering stops once past max_length. The user's files are
hashed before and after: reading them never changes them."""

import json
import shutil

import pytest

from draftsmith.data import sources, tokenize
from draftsmith.data.sources import load_conversations
from draftsmith.errors import DataError, DraftsmithError
from draftsmith.formats import common
from draftsmith.formats.export import export
from draftsmith.formats.load import checkpoint_dir, load_drafter
from tests.conftest import tiny_tokenizer
from tests.formats_helpers import trained_setup
from tests.test_ownership import tree_hash


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_setup(tmp_path_factory.mktemp("bounded"))


@pytest.fixture
def metadata_only(monkeypatch):
    """Fail the test if any weight data is read: only file headers (meta tensors) may be."""
    real = common.load_weights

    def headers_only(directory, meta=False):
        assert meta, "weights were read before the config and headers were checked"
        return real(directory, meta)

    monkeypatch.setattr("draftsmith.formats.load.load_weights", headers_only)


def _edited_checkpoint(trained, tmp_path, **changes):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(trained.run), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | changes))
    return ckpt


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 10**9}, "hidden_size is 1000000000; expected 1 to 65536"),
        ({"num_attention_heads": 0}, "num_attention_heads is 0"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"hidden_size": 60_000}, "weights; the limit is"),
        ({"intermediate_size": 48}, r"mlp\.\w+\.weight has shape .*, its config implies .*48"),
    ],
)
def test_a_drafter_config_that_does_not_hold_is_refused_from_metadata(
    tmp_path, trained, metadata_only, changes, message
):
    ckpt = _edited_checkpoint(trained, tmp_path, **changes)
    before = tree_hash(ckpt)
    with pytest.raises(DraftsmithError, match=message):
        load_drafter(ckpt, trained.target)
    assert tree_hash(ckpt) == before


def test_a_foreign_config_with_absurd_sizes_is_refused_from_metadata(tmp_path, trained, metadata_only):
    out = export(trained.run, tmp_path / "spec", "speculators", verifier=str(trained.model_dir))
    config = json.loads((out / "config.json").read_text())
    config["transformer_layer_config"]["intermediate_size"] = 1 << 30
    (out / "config.json").write_text(json.dumps(config))
    before = tree_hash(out)
    with pytest.raises(DraftsmithError, match="intermediate_size is 1073741824"):
        load_drafter(out, trained.target)
    assert tree_hash(out) == before


def test_a_dataset_line_over_the_cap_names_file_and_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "MAX_LINE_CHARS", 1000)
    path = tmp_path / "data.jsonl"
    ok = json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    path.write_text(ok + "\n" + json.dumps({"prompt": "x" * 5000}) + "\n")
    before = tree_hash(tmp_path)
    with pytest.raises(DataError, match=rf"{path}:2: the line is longer than 1,000 characters"):
        load_conversations(path)
    assert tree_hash(tmp_path) == before


def test_a_conversation_over_the_turn_cap_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    turns = [{"from": "human" if i % 2 == 0 else "gpt", "value": "t3"} for i in range(sources.MAX_TURNS + 1)]
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"conversations": turns}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: the conversation has {sources.MAX_TURNS + 1} turns"):
        load_conversations(path)


def test_chat_rendering_stops_past_max_length(monkeypatch):
    tokenizer = tiny_tokenizer(32)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "t5 t6 t7"} for i in range(400)]
    calls = []
    real = tokenize.render_chat
    monkeypatch.setattr(tokenize, "render_chat", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, mask = tokenize.tokenize_conversation(tokenizer, messages, max_length=20)
    assert len(ids) == len(mask) == 20 and any(mask)
    assert len(calls) < 12  # the full rendering and the few turns within 20 tokens, not 3 x 200 prefixes
    full_ids, full_mask = tokenize.tokenize_conversation(tokenizer, messages, max_length=100_000)
    assert (full_ids[:20], full_mask[:20]) == (ids, mask)  # the cut changes nothing within the kept tokens
