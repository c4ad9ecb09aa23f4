"""The draft vocabulary: selection, d2t/t2d round trip, coverage, checks, save/load, the vocab stage."""

import json

import pytest
import torch

from draftsmith.errors import ConfigError, DataError, DraftsmithError
from draftsmith.store import extract
from draftsmith.vocab import (
    DraftVocab,
    build_draft_vocab,
    check_vocab,
    draft_to_target,
    target_to_draft,
    vocab_from_store,
)
from tests.conftest import tiny_target


@pytest.mark.parametrize("seed", range(5))
def test_d2t_t2d_round_trip_on_random_vocabularies(seed):
    g = torch.Generator().manual_seed(seed)
    target_vocab = int(torch.randint(50, 300, (1,), generator=g))
    draft_vocab = int(torch.randint(1, target_vocab + 1, (1,), generator=g))
    counts = torch.randint(0, 20, (target_vocab,), generator=g)
    counts[0] += 1
    v = build_draft_vocab(counts, target_vocab, draft_vocab)
    assert v.d2t.dtype == torch.int64 and v.d2t.shape == (draft_vocab,) and bool((v.d2t >= 0).all())
    assert v.t2d.dtype == torch.bool and v.t2d.shape == (target_vocab,) and int(v.t2d.sum()) == draft_vocab
    draft = torch.arange(draft_vocab)
    targets = draft_to_target(draft, v.d2t)
    assert torch.equal(targets, torch.nonzero(v.t2d).flatten()) and torch.equal(targets, v.draft_ids)
    assert bool((targets[1:] > targets[:-1]).all())  # ascending by target id
    assert torch.equal(target_to_draft(targets, v.t2d), draft)
    outside = torch.nonzero(~v.t2d).flatten()
    assert bool((target_to_draft(outside, v.t2d) == -1).all())
    batch = draft[torch.randint(0, draft_vocab, (3, 4), generator=g)]  # any shape
    assert torch.equal(v.target_to_draft(v.draft_to_target(batch)), batch)
    assert check_vocab(v.d2t, v.t2d, target_vocab, draft_vocab) == []


def test_most_frequent_tokens_win_and_ties_go_to_the_lower_id():
    counts = torch.tensor([0, 5, 3, 5, 3, 3, 9, 0])
    v = build_draft_vocab(counts, 8, 4)
    assert v.draft_ids.tolist() == [1, 2, 3, 6]  # 6 (9), 1 and 3 (5 each), then 2 beats 4 and 5 (3 each)
    assert v.d2t.tolist() == [1, 1, 1, 3]
    assert v.t2d.tolist() == [False, True, True, True, False, False, True, False]


def test_coverage_counts_only_tokens_under_the_loss_mask():
    pairs = [
        ([5, 6, 6, 7, 2], [0, 1, 1, 1, 1]),  # 5 is prompt: not counted
        (torch.tensor([5, 5, 8, 6]), torch.tensor([1, 1, 1, 0], dtype=torch.uint8)),
    ]
    # counted: 6 x2, 7, 2, 5 x2, 8 -> 7 tokens; the top 2 are 5 and 6 (2 each), which cover 4 of 7
    v = build_draft_vocab(pairs, 10, 2)
    assert v.draft_ids.tolist() == [5, 6]
    assert v.coverage == pytest.approx(4 / 7)
    assert v.counts.tolist() == [0, 0, 1, 0, 0, 2, 2, 1, 1, 0]
    v3 = build_draft_vocab(v.counts, 10, 3)
    assert v3.draft_ids.tolist() == [2, 5, 6] and v3.coverage == pytest.approx(5 / 7)


def test_always_include_is_in_even_when_never_seen():
    counts = torch.tensor([0, 0, 0, 7, 6, 5, 4, 0])
    v = build_draft_vocab(counts, 8, 4, always_include=[1, 7, 1])
    assert v.draft_ids.tolist() == [1, 3, 4, 7] and v.always_include == [1, 7]
    assert v.coverage == pytest.approx(13 / 22)
    with pytest.raises(ConfigError, match="more than draft_vocab_size"):
        build_draft_vocab(counts, 8, 1, always_include=[1, 2])
    with pytest.raises(ConfigError, match=r"\[9\] are not in the target vocabulary"):
        build_draft_vocab(counts, 8, 4, always_include=[9])


def test_few_distinct_tokens_fill_with_the_lowest_unseen_ids():
    counts = torch.tensor([0, 0, 4, 0, 0, 9, 0, 0])
    v = build_draft_vocab(counts, 8, 5)
    assert v.draft_ids.tolist() == [0, 1, 2, 3, 5] and v.coverage == 1.0
    full = build_draft_vocab(counts, 8, 8)
    assert full.d2t.tolist() == [0] * 8 and check_vocab(full.d2t, full.t2d) == []  # identity: all zeros is right


def test_bad_inputs_fail_clearly():
    with pytest.raises(DataError, match="no token has loss_mask 1"):
        build_draft_vocab([([1, 2], [0, 0])], 8, 2)
    with pytest.raises(ConfigError, match=r"draft_vocab_size must be in 1..8"):
        build_draft_vocab(torch.ones(8), 8, 9)
    with pytest.raises(DataError, match="token ids must be in 0..7"):
        build_draft_vocab([([1, 12], [1, 1])], 8, 2)
    with pytest.raises(DataError, match="token counts have 5 entries, expected 8"):
        build_draft_vocab(torch.ones(5), 8, 2)


def test_check_vocab_catches_a_zeroed_d2t_a_mismatch_and_wrong_lengths():
    v = build_draft_vocab(torch.tensor([0, 5, 3, 5, 3, 3, 9, 0]), 8, 4)
    zeroed = torch.zeros_like(v.d2t)
    problems = check_vocab(zeroed, v.t2d)
    assert any("all zeros" in p for p in problems) and any("disagree" in p for p in problems)
    shifted = v.d2t.clone()
    shifted[2] += 1  # draft id 2 -> target 4, but t2d holds 3
    [problem] = check_vocab(shifted, v.t2d)
    assert "draft id 2: d2t gives target id 4, t2d's 2-th token is 3" in problem
    assert any("t2d marks 4 target tokens but d2t has 3" in p for p in check_vocab(v.d2t[:3], v.t2d))
    assert any("expected the target vocab size 9" in p for p in check_vocab(v.d2t, v.t2d, target_vocab_size=9))
    assert any("expected the draft vocab size 5" in p for p in check_vocab(v.d2t, v.t2d, draft_vocab_size=5))
    out_of_range = v.d2t.clone()
    out_of_range[-1] = 50
    assert any("outside the target vocab" in p for p in check_vocab(out_of_range, v.t2d))
    assert any("bool" in p for p in check_vocab(v.d2t, v.t2d.long()))


def test_save_and_load_round_trip(tmp_path):
    v = build_draft_vocab(torch.tensor([0, 5, 3, 5, 3, 3, 9, 0]), 8, 4, always_include=[7])
    v.save(tmp_path / "v", source={"store": "somewhere"})
    info = json.loads((tmp_path / "v" / "vocab.json").read_text())
    assert info["draft_vocab_size"] == 4 and info["target_vocab_size"] == 8 and info["source"]["store"] == "somewhere"
    assert [t["id"] for t in info["top_tokens"]] == [6, 1, 3, 2, 4, 5] and info["tokens_counted"] == 28
    back = DraftVocab.load(tmp_path / "v")
    assert torch.equal(back.d2t, v.d2t) and torch.equal(back.t2d, v.t2d)
    assert back.coverage == pytest.approx(v.coverage) and back.always_include == [7]
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["vocab.json", "vocab.safetensors"]
    from safetensors.torch import save_file

    save_file({"d2t": torch.zeros(4, dtype=torch.int64), "t2d": v.t2d}, str(tmp_path / "v" / "vocab.safetensors"))
    with pytest.raises(DraftsmithError, match="all zeros"):
        DraftVocab.load(tmp_path / "v")
    with pytest.raises(DraftsmithError, match="not found"):
        DraftVocab.load(tmp_path / "missing")


def test_vocab_stage_counts_the_stores_masked_tokens(tmp_path):
    target = tiny_target(0)
    samples = [("a", [3, 4, 4, 5, 1], [0, 1, 1, 1, 1]), ("b", [3, 3, 6, 6, 6], [1, 0, 1, 1, 0])]
    store = extract(target, samples, tmp_path / "store", layer_ids=(1,), progress=False)
    v = vocab_from_store(store, 3, tmp_path / "vocab")
    # masked counts: 4 x2, 6 x2, 5, 1, 3; always_include defaults to the special/EOS ids (t1 = eos/pad)
    assert v.always_include == [1]
    assert v.draft_ids.tolist() == [1, 4, 6] and v.coverage == pytest.approx(5 / 7)
    manifest = json.loads((tmp_path / "vocab" / "manifest.json").read_text())
    assert manifest["stage"] == "vocab" and manifest["inputs"]["target_fingerprint"] == target.fingerprint()
    assert manifest["coverage"] == pytest.approx(5 / 7)
    assert torch.equal(DraftVocab.load(tmp_path / "vocab").d2t, v.d2t)
    v5 = vocab_from_store(store, 5, tmp_path / "vocab5", always_include=[])
    assert v5.draft_ids.tolist() == [1, 3, 4, 5, 6] and v5.coverage == 1.0
